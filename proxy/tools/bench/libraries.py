"""Libraries: what each one offers the operations (buffers and point-to-point calls). ``ShmproxyLib``,
``MpiLib`` (mpi4py's COMM_WORLD), ``GlooLib`` (torch.distributed's gloo) and ``NcclLib`` (torch's NCCL,
device buffers only) bind the calls that the timed loops make; ``peers.py`` opens the peers.
"""
from __future__ import annotations

import contextlib
import types
from typing import Any, Callable

import numpy as np

PEERS = ("mpi4py", "gloo", "nccl", "shmproxy.MPI", "tcp", "tcp-streams")
RAW_PEERS = ("tcp", "tcp-streams")   # plain sockets: the link's own limit (rawsock.py)


class Library:
    """One library under test. Subclasses bind send/recv/isend/irecv (positional arguments: buffer,
    peer, tag), waitall and group to the library's own calls, so that the timed loop calls the library
    directly, with no layer of ours in between."""

    name = ""
    version = ""
    kind = ""
    """Which calls measure it (the operations' tables are by kind); its name is its row. Two shmproxy
    rows share the kind: plain arrays ("shmproxy") and comm.alloc memory ("shmproxy:alloc")."""
    send: Callable[[Any, int, int], Any]
    recv: Callable[[Any, int, int], Any]
    isend: Callable[[Any, int, int], Any]
    irecv: Callable[[Any, int, int], Any]
    waitall: Callable[[list[Any]], Any]
    group: Callable[[], contextlib.AbstractContextManager[Any]]
    """Posts inside are batched (shmproxy's comm.group); a no-op context for the peers."""

    def __init__(self) -> None:
        self.kind = self.kind or self.name
        self.waitall = self._wait_each
        self.group = contextlib.nullcontext

    def array(self, shape: int | tuple[int, ...], dtype: Any) -> np.ndarray:
        return np.zeros(shape, dtype)

    def wrap(self, a: np.ndarray) -> Any:
        """What this library's calls take for the numpy array ``a`` (sharing its memory)."""
        return a

    def redop(self, name: str) -> Any:
        """This library's reduction op for ``name`` (one of REDOPS); None if it has none."""
        return None

    def refresh(self, a: np.ndarray) -> None:
        """``a`` (host) was written: bring what ``wrap`` gave up to date (device buffers, device.py)."""

    def fetch(self, a: np.ndarray) -> None:
        """Before ``a`` (host) is read: bring in what the calls wrote into ``wrap(a)`` (device.py)."""

    @staticmethod
    def wait(req: Any) -> None:
        req.Wait()

    def _wait_each(self, reqs: list[Any]) -> None:
        for r in reqs:
            self.wait(r)

    def close(self) -> None:
        pass


class ShmproxyLib(Library):
    """shmproxy with the buffers users have (plain numpy arrays: the row "shmproxy"), or with memory
    from ``comm.alloc``, which no post copies (``zero_copy``; the row "shmproxy:alloc" when both run,
    else "shmproxy")."""

    name = kind = "shmproxy"
    ALLOC_ROW = "shmproxy:alloc"

    def __init__(self, comm: Any, zero_copy: bool, row: str = "shmproxy"):
        import shmproxy
        super().__init__()
        self.name = row
        self.comm, self.zero_copy = comm, zero_copy
        self.version = shmproxy.__version__
        self.send, self.recv, self.isend, self.irecv = comm.Send, comm.Recv, comm.Isend, comm.Irecv
        self.waitall, self.group = shmproxy.Request.Waitall, comm.group

    def redop(self, name: str) -> Any:
        import shmproxy
        return getattr(shmproxy, name.upper())

    def array(self, shape: int | tuple[int, ...], dtype: Any) -> np.ndarray:
        return self.comm.alloc(shape, dtype) if self.zero_copy else np.zeros(shape, dtype)


class MpiLib(Library):
    name = "mpi4py"

    def __init__(self, MPI: Any):
        import mpi4py
        super().__init__()
        world = MPI.COMM_WORLD
        self.world = world
        lib = MPI.Get_library_version().replace("\x00", "").strip().splitlines()   # Open MPI ends in NUL
        self.version = f"{mpi4py.__version__} ({' '.join(lib[0].split()) if lib else 'unknown MPI'})"
        self.send, self.recv, self.isend, self.irecv = world.Send, world.Recv, world.Isend, world.Irecv
        self.waitall = MPI.Request.Waitall
        self.MPI = MPI

    def redop(self, name: str) -> Any:
        MPI = self.MPI
        return {"sum": MPI.SUM, "prod": MPI.PROD, "min": MPI.MIN, "max": MPI.MAX}.get(name)  # no AVG


class MpiLayerLib(MpiLib):
    """shmproxy's own MPI layer (``from shmproxy import MPI``) over the same communicator's ranks: the
    peer that shows what the layer adds to the native calls, measured in the same job."""
    name = "shmproxy.MPI"

    def __init__(self, MPI: Any):
        Library.__init__(self)
        world = MPI.COMM_WORLD
        self.world = world
        self.version = MPI.Get_library_version().strip().splitlines()[0]
        self.send, self.recv, self.isend, self.irecv = world.Send, world.Recv, world.Isend, world.Irecv
        self.waitall = MPI.Request.Waitall
        self.MPI = MPI


class GlooLib(Library):
    name = "gloo"
    opened = 0   # torch peers of this run over torch.distributed's default group; the last to close ends it

    def __init__(self, torch: Any, dist: Any):
        super().__init__()
        self.torch, self.dist = torch, dist
        self.version = torch.__version__
        GlooLib.opened += 1
        self.send = lambda t, peer, tag: dist.send(t, peer, tag=tag)
        self.recv = lambda t, peer, tag: dist.recv(t, peer, tag=tag)
        self.isend = lambda t, peer, tag: dist.isend(t, peer, tag=tag)
        self.irecv = lambda t, peer, tag: dist.irecv(t, peer, tag=tag)

    def wrap(self, a: np.ndarray) -> Any:
        return self.torch.from_numpy(a)

    def redop(self, name: str) -> Any:
        R = self.dist.ReduceOp
        return {"sum": R.SUM, "prod": R.PRODUCT, "min": R.MIN, "max": R.MAX,
                "avg": getattr(R, "AVG", None)}.get(name)

    def fn(self, *names: str) -> Any:
        """The first of ``names`` that this torch.distributed has (newer names first), or None."""
        for name in names:
            f = getattr(self.dist, name, None)
            if f is not None:
                return f
        return None

    @staticmethod
    def wait(req: Any) -> None:
        req.wait()

    def close(self) -> None:
        """The last torch peer to close destroys the default group (and every group with it)."""
        GlooLib.opened -= 1
        dist = self.torch.distributed
        if not GlooLib.opened and dist.is_initialized():
            dist.destroy_process_group()


# What the gloo builders of calls.py call on ``lib.dist``; NcclLib binds each to its group.
_NCCL_COLLECTIVES = ("all_reduce", "reduce", "broadcast", "all_gather_into_tensor", "reduce_scatter_tensor",
                     "all_to_all_single", "barrier")


class NcclLib(GlooLib):
    """torch.distributed's NCCL on a group of every rank, each rank on a GPU of its own. NCCL queues its
    work on a stream and returns: each blocking call here ends with the current stream synchronized,
    so that a timed call ends with its result on the device, as shmproxy's blocking calls do. The gloo
    builders of calls.py drive it through ``dist``, a namespace of the same calls bound to the group.
    NCCL has no tags (the bench's loops never need them), and an Isend/Irecv pair is posted as one
    ``batch_isend_irecv``, torch's way of handing NCCL both directions at once: posted one by one,
    two ranks that both send first can wait for each other."""
    name = "nccl"

    def __init__(self, torch: Any, dist: Any, group: Any):
        super().__init__(torch, dist)
        self.group = group
        self.version = f"{torch.__version__} (NCCL {'.'.join(map(str, torch.cuda.nccl.version()))})"

        def blocking(f: Callable[..., Any]) -> Callable[..., None]:
            def call(*a: Any, **kw: Any) -> None:
                f(*a, group=group, **kw)
                self._sync()
            return call

        self.dist = types.SimpleNamespace(ReduceOp=dist.ReduceOp, **{
            n: blocking(getattr(dist, n)) for n in _NCCL_COLLECTIVES if hasattr(dist, n)})
        send, recv, p2p = blocking(dist.send), blocking(dist.recv), dist.P2POp
        self.send = lambda t, peer, tag: send(t, peer)
        self.recv = lambda t, peer, tag: recv(t, peer)
        self.isend = lambda t, peer, tag: p2p(dist.isend, t, peer, group=group)
        self.irecv = lambda t, peer, tag: p2p(dist.irecv, t, peer, group=group)
        self.waitall = self._batch

    def _sync(self) -> None:
        self.torch.cuda.current_stream().synchronize()

    def _batch(self, ops: list[Any]) -> None:
        for work in self.torch.distributed.batch_isend_irecv(ops):
            work.wait()
        self._sync()

    def close(self) -> None:
        dist = self.torch.distributed
        if dist.is_initialized():
            dist.destroy_process_group(self.group)
        super().close()
