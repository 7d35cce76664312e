"""Checks shared by the MPI layer's rank bodies (tests/bodies_mpi_*.py)."""
from __future__ import annotations

from typing import Any, Callable

from shmproxy import MPI


def raises_class(error_class: int, fn: Callable[..., Any], *args: Any) -> None:
    """``fn(*args)`` raises an MPI.Exception of ``error_class``."""
    try:
        fn(*args)
    except MPI.Exception as exc:
        assert exc.Get_error_class() == error_class, (fn, exc.Get_error_class(), error_class, exc)
    else:
        raise AssertionError(f"{fn} raised nothing")
