"""``shmproxy.MPI``: the mpi4py-style namespace (implemented in the subpackage shmproxy.mpi).

``from shmproxy import MPI`` and ``import shmproxy.MPI as MPI`` both land here. This module only
re-exports shmproxy.mpi's names, so the objects are the same whichever name a program imports, and
nothing of the MPI layer is loaded by a plain ``import shmproxy`` (see the hook in __init__.py).
"""
from shmproxy.mpi import *  # noqa: F401,F403
from shmproxy.mpi import __getattr__  # noqa: F401
import shmproxy.mpi as _impl

globals().update({k: v for k, v in vars(_impl).items() if not k.startswith("__")})
del _impl
