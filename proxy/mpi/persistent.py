"""Persistent collectives (MPI 4.0, section 6.13; mpi4py's ``Comm.Xxx_init``): a collective's
arguments bound once, started many times.

``Xxx_init`` checks that the communicator has the collective and returns an inactive
:class:`~shmproxy.mpi.request.Prequest`; each ``Start`` posts the matching nonblocking collective
(``Ixxx``) with the arguments bound at init, and ``Wait``/``Test`` complete that round, as for the
persistent point-to-point requests. MPI requires every rank to start its persistent collectives in the
same order, which is the nonblocking collectives' own rule, so no state is shared between rounds.
A bad argument is refused when the round is posted, before anything of it is sent. ``info`` is taken
for its hints, none of which change what runs.
"""
from __future__ import annotations

import functools
from typing import Any

from shmproxy.mpi.exceptions import unsupported
from shmproxy.mpi.ops import SUM
from shmproxy.mpi.request import Prequest


class PersistentCollectives:
    """The ``Xxx_init`` calls of a communicator; each starts the communicator's own ``Ixxx``."""

    def _persistent(self, name: str, *args: Any, **kwargs: Any) -> Prequest:
        post: Any = getattr(self, "I" + name.lower(), None)
        if post is None:
            unsupported(f"{type(self).__name__}.{name}_init", f"this communicator has no I{name.lower()}")
        return Prequest(functools.partial(post, *args, **kwargs))

    def Barrier_init(self, info: Any = None) -> Prequest:
        return self._persistent("Barrier")

    def Bcast_init(self, buf: Any, root: int = 0, info: Any = None) -> Prequest:
        return self._persistent("Bcast", buf, root=root)

    def Gather_init(self, sendbuf: Any, recvbuf: Any, root: int = 0, info: Any = None) -> Prequest:
        return self._persistent("Gather", sendbuf, recvbuf, root=root)

    def Gatherv_init(self, sendbuf: Any, recvbuf: Any, root: int = 0, info: Any = None) -> Prequest:
        return self._persistent("Gatherv", sendbuf, recvbuf, root=root)

    def Scatter_init(self, sendbuf: Any, recvbuf: Any, root: int = 0, info: Any = None) -> Prequest:
        return self._persistent("Scatter", sendbuf, recvbuf, root=root)

    def Scatterv_init(self, sendbuf: Any, recvbuf: Any, root: int = 0, info: Any = None) -> Prequest:
        return self._persistent("Scatterv", sendbuf, recvbuf, root=root)

    def Allgather_init(self, sendbuf: Any, recvbuf: Any, info: Any = None) -> Prequest:
        return self._persistent("Allgather", sendbuf, recvbuf)

    def Allgatherv_init(self, sendbuf: Any, recvbuf: Any, info: Any = None) -> Prequest:
        return self._persistent("Allgatherv", sendbuf, recvbuf)

    def Alltoall_init(self, sendbuf: Any, recvbuf: Any, info: Any = None) -> Prequest:
        return self._persistent("Alltoall", sendbuf, recvbuf)

    def Alltoallv_init(self, sendbuf: Any, recvbuf: Any, info: Any = None) -> Prequest:
        return self._persistent("Alltoallv", sendbuf, recvbuf)

    def Alltoallw_init(self, sendbuf: Any, recvbuf: Any, info: Any = None) -> Prequest:
        return self._persistent("Alltoallw", sendbuf, recvbuf)

    def Reduce_init(self, sendbuf: Any, recvbuf: Any, op: Any = SUM, root: int = 0,
                    info: Any = None) -> Prequest:
        return self._persistent("Reduce", sendbuf, recvbuf, op, root)

    def Allreduce_init(self, sendbuf: Any, recvbuf: Any, op: Any = SUM, info: Any = None) -> Prequest:
        return self._persistent("Allreduce", sendbuf, recvbuf, op)

    def Reduce_scatter_block_init(self, sendbuf: Any, recvbuf: Any, op: Any = SUM,
                                  info: Any = None) -> Prequest:
        return self._persistent("Reduce_scatter_block", sendbuf, recvbuf, op)

    def Reduce_scatter_init(self, sendbuf: Any, recvbuf: Any, recvcounts: Any = None, op: Any = SUM,
                            info: Any = None) -> Prequest:
        return self._persistent("Reduce_scatter", sendbuf, recvbuf, recvcounts, op)

    def Scan_init(self, sendbuf: Any, recvbuf: Any, op: Any = SUM, info: Any = None) -> Prequest:
        return self._persistent("Scan", sendbuf, recvbuf, op)

    def Exscan_init(self, sendbuf: Any, recvbuf: Any, op: Any = SUM, info: Any = None) -> Prequest:
        return self._persistent("Exscan", sendbuf, recvbuf, op)

    def Neighbor_allgather_init(self, sendbuf: Any, recvbuf: Any, info: Any = None) -> Prequest:
        return self._persistent("Neighbor_allgather", sendbuf, recvbuf)

    def Neighbor_allgatherv_init(self, sendbuf: Any, recvbuf: Any, info: Any = None) -> Prequest:
        return self._persistent("Neighbor_allgatherv", sendbuf, recvbuf)

    def Neighbor_alltoall_init(self, sendbuf: Any, recvbuf: Any, info: Any = None) -> Prequest:
        return self._persistent("Neighbor_alltoall", sendbuf, recvbuf)

    def Neighbor_alltoallv_init(self, sendbuf: Any, recvbuf: Any, info: Any = None) -> Prequest:
        return self._persistent("Neighbor_alltoallv", sendbuf, recvbuf)

    def Neighbor_alltoallw_init(self, sendbuf: Any, recvbuf: Any, info: Any = None) -> Prequest:
        return self._persistent("Neighbor_alltoallw", sendbuf, recvbuf)
