"""``--device cuda``: every library's buffers live on the rank's GPU.

The sweep keeps building, filling and checking numpy arrays; in device mode each library's ``wrap``
hands its calls a device copy instead (a cupy array for shmproxy, a torch CUDA tensor for gloo), kept
per host array and refreshed whenever the host side was written (``refresh``: the input filled, the
receive buffer reset to the sentinel) and read back before a check (``fetch``). The copies happen
outside the timed loops. mpi4py is not offered device buffers (a CUDA-aware MPI is not assumed, and
a plain one would read device pointers as host memory), nor gloo beyond the collectives torch
documents for CUDA tensors. NCCL through torch (``--peers nccl``) takes device buffers only, and
needs a GPU of its own per rank (torch's NCCL refuses two ranks on one GPU): where ranks share a GPU
it is skipped, saying so.
"""
from __future__ import annotations

from typing import Any

import numpy as np

from shmproxy.tools.bench.libraries import Library

DEVICE_OPS = ("pingpong", "sendrecv", "allreduce", "reduce", "bcast", "allgather", "alltoall",
              "reduce_scatter", "barrier")
"""The operations whose buffers can be device memory (post, idle and overlap time host-side things)."""


class Mirror:
    """Device copies of host arrays, keyed by (address, shape, dtype) of the host array."""

    def __init__(self, kind: str, device: int):
        self.kind, self.device = kind, device
        self.copies: dict[tuple, Any] = {}
        if kind == "torch":
            import torch
            self.torch = torch
            self.dev = torch.device("cuda", device)
        else:
            import cupy
            self.cp = cupy
            cupy.cuda.Device(device).use()

    @staticmethod
    def _key(a: np.ndarray) -> tuple:
        return (a.__array_interface__["data"][0], a.shape, a.dtype.str)

    def put(self, a: np.ndarray) -> Any:
        """The device copy of ``a`` with ``a``'s current contents."""
        key = self._key(a)
        d = self.copies.get(key)
        if d is None:
            if self.kind == "torch":
                d = self.torch.empty(a.shape, dtype=self.torch.from_numpy(a[..., :0].copy()).dtype,
                                     device=self.dev)
            else:
                d = self.cp.empty(a.shape, a.dtype)
            self.copies[key] = d
        self._upload(d, a)
        return d

    def refresh(self, a: np.ndarray) -> None:
        d = self.copies.get(self._key(a))
        if d is not None:
            self._upload(d, a)

    def fetch(self, a: np.ndarray) -> None:
        d = self.copies.get(self._key(a))
        if d is None:
            return
        if self.kind == "torch":
            np.copyto(a, d.cpu().numpy())
        else:
            d.get(out=a)
            self.cp.cuda.get_current_stream().synchronize()

    def _upload(self, d: Any, a: np.ndarray) -> None:
        if self.kind == "torch":
            d.copy_(self.torch.from_numpy(np.ascontiguousarray(a)))
            self.torch.cuda.synchronize(self.dev)
        else:
            d.set(np.ascontiguousarray(a))
            self.cp.cuda.get_current_stream().synchronize()


GLOO_GPU_OPS = ("allreduce", "bcast")
"""What torch documents gloo to do with CUDA tensors (all_reduce, broadcast); anything else would hand
gloo a device pointer it reads as host memory."""


def host_unsupported(name: str) -> str:
    """Why peer ``name`` cannot run on host buffers ('' when it can)."""
    return "nccl takes device buffers only (run with --device cuda)" if name == "nccl" else ""


def peer_unsupported(name: str, op: str) -> str:
    """Why peer ``name`` cannot run ``op`` on device buffers ('' when it can)."""
    if name == "mpi4py":
        return "no device buffers for mpi4py (a CUDA-aware MPI is not assumed)"
    if name in ("tcp", "tcp-streams"):
        return "raw sockets move host memory only"
    if name == "shmproxy.MPI":
        return "the MPI layer's device buffers are the native calls' (measured as shmproxy)"
    if name == "gloo" and op not in GLOO_GPU_OPS:
        return f"gloo takes CUDA tensors for {' and '.join(GLOO_GPU_OPS)} only"
    return ""


def local_gpu(ctx: Any) -> int:
    """The GPU of this rank: its local rank modulo the GPUs visible."""
    import cupy
    return ctx.comm.local_rank % max(cupy.cuda.runtime.getDeviceCount(), 1)


def placement(ctx: Any) -> str:
    """Where the ranks' device buffers are, for the table's header."""
    import cupy
    n, ngpu = ctx.comm.local_size, cupy.cuda.runtime.getDeviceCount()
    if n == 1:
        return "GPU 0"
    if ngpu <= 1:
        return "GPU 0, shared by this host's ranks"
    if ngpu >= n:
        return f"each rank's own GPU (local rank r on GPU r of {ngpu})"
    return f"GPU (local rank modulo {ngpu}) of each rank: {n} ranks on {ngpu} GPUs"


def own_gpu_note(ctx: Any) -> str:
    """Why the ranks of this host cannot each have a GPU of their own ('' when they can)."""
    import cupy
    ngpu = cupy.cuda.runtime.getDeviceCount()
    if ngpu < ctx.comm.local_size:
        return (f"{ctx.comm.local_size} ranks on this host share {ngpu} GPU(s), and NCCL needs a GPU of "
                f"its own per rank")
    return ""


def enable(lib: Library, device: int) -> None:
    """Give ``lib`` device buffers (see the module header)."""
    m = Mirror("torch" if lib.kind in ("gloo", "nccl") else "cupy", device)
    lib.wrap = m.put            # type: ignore[method-assign]
    lib.refresh = m.refresh     # type: ignore[method-assign]
    lib.fetch = m.fetch         # type: ignore[method-assign]


def nccl_note(ctx: Any, peers: Any) -> str:
    """Why NCCL is not among the peers of this run ('' when asked for: its own line says how it went)."""
    if "nccl" in peers:
        return ""
    why = own_gpu_note(ctx)
    return f"# nccl not run: {why}" if why else "# nccl not run: not asked for (--peers nccl)"
