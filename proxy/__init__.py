"""shmproxy's rank-side API.

    import proxy
    with proxy.init() as comm:              # under mpiexec, torchrun or srun
        buf = comm.alloc(1 << 20, "float32")  # registered shared memory: the zero-copy path
        if comm.rank == 0:
            comm.Send(buf, dest=1, tag=7)
        elif comm.rank == 1:
            comm.Recv(buf, source=0, tag=7)
"""
from proxy.errors import (Aborted, Closed, InternalError, InvalidArgument, InvalidUsage, PeerDiedError,
                          ProxyError, RemoteError, Timeout, TruncationError)
from proxy.ops import IN_PLACE, UNDEFINED
from proxy.request import Request, Status
from proxy.sched import ReduceOp

SUM, PROD, MIN, MAX, AVG = ReduceOp.SUM, ReduceOp.PROD, ReduceOp.MIN, ReduceOp.MAX, ReduceOp.AVG

__all__ = ["init", "Comm", "Request", "Status", "ProxyError", "InvalidArgument", "InvalidUsage",
           "RemoteError", "PeerDiedError", "Timeout", "Closed", "Aborted", "InternalError",
           "TruncationError", "ReduceOp", "SUM", "PROD", "MIN", "MAX", "AVG", "IN_PLACE", "UNDEFINED"]
__version__ = "0.1.0"


def __getattr__(name: str):
    # Lazy: shm/ imports proxy.errors and proxy.log, and proxy.comm imports shm/; importing comm
    # eagerly here would make `import shm.segment` circular.
    if name in ("init", "Comm"):
        from proxy import comm
        return getattr(comm, name)
    raise AttributeError(f"module 'proxy' has no attribute {name!r}")
