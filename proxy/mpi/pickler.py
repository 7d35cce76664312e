"""MPI.pickle: the pickler of the object layer (send, recv, bcast, ...), as mpi4py's MPI.pickle.

The object layer (shmproxy.rank.objects) pickles with the standard library's pickle, protocol 5,
buffers of at least OOB_MIN_BYTES out of band (sent as messages of their own, no copy into the pickle).
``dumps``/``loads`` give and take one bytes object, in-band, as mpi4py's do; ``dumps_oob`` and
``loads_oob`` the out-of-band form the object layer sends. A pickler of the program's own
(mpi4py's ``MPI.pickle.__init__(dumps, loads)``) is not provided: the object layer has no hook for it.
"""
from __future__ import annotations

import pickle as _pickle
from typing import Any, Callable

from shmproxy.mpi.exceptions import unsupported
from shmproxy.rank import objects


class Pickle:
    """How objects are pickled for the object layer (see the module doc)."""

    PROTOCOL = 5

    def __init__(self, dumps: Callable[..., bytes] | None = None, loads: Callable[..., Any] | None = None,
                 protocol: int | None = None, threshold: int | None = None) -> None:
        if dumps is not None or loads is not None or protocol not in (None, 5) or threshold is not None:
            unsupported("MPI.pickle with a pickler of the program's own",
                        "the object layer pickles with pickle, protocol 5")

    @property
    def THRESHOLD(self) -> int:
        return objects.OOB_MIN_BYTES

    def dumps(self, obj: Any) -> bytes:
        return _pickle.dumps(obj, protocol=self.PROTOCOL)

    def loads(self, data: Any) -> Any:
        return _pickle.loads(data)

    def dumps_oob(self, obj: Any) -> tuple[bytes, list[memoryview]]:
        out = objects._dumps(obj, "MPI.pickle.dumps_oob")
        return out.data, list(out.bufs)

    def loads_oob(self, data: Any, buffers: Any) -> Any:
        return _pickle.loads(data, buffers=buffers)


pickle = Pickle()
