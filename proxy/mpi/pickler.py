"""MPI.pickle: the pickler of the object layer (send, recv, bcast, ...), as mpi4py's MPI.pickle.

The object layer (shmproxy.rank.objects) pickles with the standard library's pickle, protocol 5,
buffers of at least OOB_MIN_BYTES out of band (sent as messages of their own, no copy into the pickle).
``dumps``/``loads`` give and take one bytes object, in-band, as mpi4py's do; ``dumps_oob`` and
``loads_oob`` the out-of-band form the object layer sends. As mpi4py's, ``MPI.pickle.__init__(dumps,
loads, protocol)`` sets a serializer of the program's own (marshal, json, pickle at another protocol)
for every object call; every rank must set the same one. ``MPI.pickle.__init__()`` restores the
default (protocol 5 with out-of-band buffers).
"""
from __future__ import annotations

import pickle as _pickle
from typing import Any, Callable

from shmproxy.rank import objects


class Pickle:
    """How objects are pickled for the object layer (see the module doc)."""

    def __init__(self, dumps: Callable[..., Any] | None = None, loads: Callable[..., Any] | None = None,
                 protocol: int | None = None, threshold: int | None = None) -> None:
        if (dumps is None) != (loads is None):
            raise TypeError("MPI.pickle: give both dumps and loads, or neither")
        if dumps is None and protocol is None:
            protocol = _pickle.HIGHEST_PROTOCOL
        if protocol is not None and not isinstance(protocol, int):
            raise TypeError(f"MPI.pickle: protocol is an int, not {type(protocol).__name__}")
        self.PROTOCOL = protocol
        self._threshold = threshold
        if dumps is None and protocol in (-1, 5):
            # the object layer's own form: protocol 5 with out-of-band buffers
            self._dumps: Callable[[Any], Any] = lambda obj: _pickle.dumps(obj, protocol=5)
            self._loads: Callable[[Any], Any] = _pickle.loads
            objects.CUSTOM[0] = None
            return
        base_dumps = _pickle.dumps if dumps is None else dumps
        base_loads = _pickle.loads if loads is None else loads
        # mpi4py calls dumps(obj, protocol) when a protocol is given, dumps(obj) otherwise
        self._dumps = (lambda obj: base_dumps(obj)) if protocol is None else \
            (lambda obj: base_dumps(obj, protocol))
        self._loads = base_loads
        objects.CUSTOM[0] = (self._dumps, self._loads)

    @property
    def THRESHOLD(self) -> int:
        return objects.OOB_MIN_BYTES if self._threshold is None else self._threshold

    def dumps(self, obj: Any) -> bytes:
        return bytes(self._dumps(obj))

    def loads(self, data: Any) -> Any:
        return self._loads(data)

    def dumps_oob(self, obj: Any) -> tuple[bytes, list[memoryview]]:
        out = objects._dumps(obj, "MPI.pickle.dumps_oob")
        return out.data, list(out.bufs)

    def loads_oob(self, data: Any, buffers: Any) -> Any:
        return objects._loads(data, list(buffers), "MPI.pickle.loads_oob")


pickle = Pickle()
