"""Exceptions raised by the program's callbacks, reported as mpi4py reports them.

MPI calls some functions of the program from inside a call of its own: attribute copy and delete
callbacks (attributes.py), a generalized request's query, free and cancel functions (grequest.py).
In mpi4py such a callback runs under the MPI library, which only understands an error code, so an
exception cannot travel through it: mpi4py prints the exception's traceback on stderr and hands MPI
the error class (the exception's own for an MPI.Exception, ERR_OTHER for any other), which MPI then
returns from the call that ran the callback and mpi4py raises as ``MPI.Exception(code)``. Programs
(and mpi4py's tests) look for both: the traceback on stderr, the class on the raised exception. The
same happens here, with the original exception chained as the cause, which mpi4py cannot do.
"""
from __future__ import annotations

import sys
import traceback

from shmproxy.mpi.exceptions import ERR_OTHER, Exception as MPIException


def error_class_of(exc: BaseException) -> int:
    """The error class MPI would have got back from the callback."""
    return exc.error_code if isinstance(exc, MPIException) else ERR_OTHER


def report(exc: BaseException) -> int:
    """Print the callback's traceback where mpi4py prints it (sys.stderr as it is now: a program may
    have redirected it) and return its error class."""
    traceback.print_exception(exc, file=sys.stderr)
    return error_class_of(exc)


def failed(what: str, exc: BaseException) -> MPIException:
    """The MPI.Exception a call raises when a callback it ran raised ``exc`` (printed by now)."""
    code = error_class_of(exc)
    return MPIException(f"{what}: the program's callback raised {type(exc).__name__}: {exc}", code)
