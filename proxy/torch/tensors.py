"""CPU tensors as the numpy arrays shmproxy's communicator takes, without copies where the tensor allows.

A contiguous CPU tensor's storage is viewed with ``tensor.numpy()`` (no copy; the progress process then
reads or writes the tensor's memory through staging, or directly when the tensor lies in registered
memory: ``alloc_tensor`` gives such tensors). The rules, each the reason for a copy or an error:

- **CUDA (and every other non-CPU) tensor**: an error saying that this backend does not support them
  yet. Never a silent copy to host memory: the caller would lose the stream ordering and the speed
  they expect from a device backend.
- **Non-contiguous tensors** are copied into a contiguous temporary, and outputs are copied back
  once the operation completed (as gloo does), so that every layout works; the copy is the cost.
- **bfloat16** has no numpy dtype. Where bytes only move (broadcast, allgather, alltoall, send and
  receive, gather, scatter) the tensor is reinterpreted as int16, which moves the same bits.
  Reductions run in float32: the input is upcast into a float32 temporary, reduced there, and the
  result is rounded back to bfloat16 (round to nearest even) into the tensor. This is exactly
  gloo's result for two ranks; for more ranks it is at least as accurate, since gloo rounds to
  bfloat16 after every pairwise step.
- **Complex tensors** reach the backend as real views already (torch.distributed calls
  ``view_as_real`` before it calls a process group), so they move as float pairs.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import numpy as np
import torch

from shmproxy.core import errors

# torch dtype -> numpy dtype that holds the same bits. bfloat16 is handled apart (see the header).
_NUMPY: dict[torch.dtype, np.dtype] = {
    torch.bool: np.dtype(np.bool_), torch.uint8: np.dtype(np.uint8), torch.int8: np.dtype(np.int8),
    torch.int16: np.dtype(np.int16), torch.int32: np.dtype(np.int32), torch.int64: np.dtype(np.int64),
    torch.float16: np.dtype(np.float16), torch.float32: np.dtype(np.float32),
    torch.float64: np.dtype(np.float64), torch.complex64: np.dtype(np.complex64),
    torch.complex128: np.dtype(np.complex128),
}
SUPPORTED = ", ".join(str(d).replace("torch.", "") for d in [*_NUMPY, torch.bfloat16])


def check_tensor(t: torch.Tensor, what: str) -> None:
    """Raise before anything is posted when ``t`` cannot travel through this backend."""
    if not isinstance(t, torch.Tensor):
        raise errors.InvalidArgument(
            f"shmproxy backend: {what} must be a torch.Tensor, got {type(t).__name__}")
    if t.device.type != "cpu":
        raise errors.InvalidArgument(
            f"shmproxy backend: {what} is on {t.device}; CUDA (and other device) tensors are not supported "
            "by this backend yet (no host copy is made): keep them on a device backend such as nccl, or "
            "move them to the CPU yourself")
    if t.dtype not in _NUMPY and t.dtype != torch.bfloat16:
        raise errors.InvalidArgument(
            f"shmproxy backend: {what} has dtype {t.dtype}, which this backend does not support; "
            f"supported: {SUPPORTED}")
    if t.is_sparse or t.layout != torch.strided:
        raise errors.InvalidArgument(f"shmproxy backend: {what} has layout {t.layout}; only dense tensors")


def bits_view(t: torch.Tensor) -> np.ndarray:
    """A numpy view of a contiguous CPU tensor's bytes, of a dtype with the same bits (bfloat16 -> int16)."""
    if t.dtype == torch.bfloat16:
        t = t.view(torch.int16)
    return t.detach().reshape(-1).numpy()


@dataclass
class Staged:
    """The arrays an operation posts, and what to do once it completed (copies back, casts).

    ``after`` runs in the process group's completion thread, after every request of the operation
    completed and before its Work and Future are marked completed."""

    keep: list = field(default_factory=list)        # temporaries that must live until completion
    after: list[Callable[[], None]] = field(default_factory=list)

    def done(self) -> None:
        for fn in self.after:
            fn()
        self.after.clear()
        self.keep.clear()


def for_move(t: torch.Tensor, stage: Staged, output: bool) -> np.ndarray:
    """An array over ``t`` (or over a contiguous copy of it) for an operation that only moves bytes.
    ``output``: the operation writes it, so a copy is copied back into ``t`` at completion."""
    if t.is_contiguous():
        return bits_view(t)
    tmp = t.contiguous()
    stage.keep.append(tmp)
    if output:
        stage.after.append(lambda: t.copy_(tmp))
    return bits_view(tmp)


def for_reduce(t: torch.Tensor, stage: Staged, output: bool) -> np.ndarray:
    """An array over ``t`` for a reduction: bfloat16 goes through a float32 temporary (cast back into
    ``t`` at completion when ``output``); other dtypes as ``for_move``."""
    if t.dtype != torch.bfloat16:
        return for_move(t, stage, output)
    tmp = t.to(torch.float32).contiguous()
    stage.keep.append(tmp)
    if output:
        stage.after.append(lambda: t.copy_(tmp))
    return tmp.reshape(-1).numpy()


def scratch(numel: int, like: torch.Tensor, stage: Staged,
            reduce: bool = False) -> tuple[torch.Tensor, np.ndarray]:
    """A contiguous temporary of ``numel`` elements of ``like``'s dtype (float32 for a bfloat16
    reduction), kept alive until completion: (tensor, numpy view)."""
    dtype = torch.float32 if (reduce and like.dtype == torch.bfloat16) else like.dtype
    tmp = torch.empty(numel, dtype=dtype)
    stage.keep.append(tmp)
    return tmp, (tmp.numpy() if dtype != torch.bfloat16 else bits_view(tmp))


def alloc_tensor(comm: object, shape: int | tuple[int, ...],
                 dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """A zeroed CPU tensor in ``comm``'s registered shared memory: operations on it need no staging
    copy. The tensor keeps the memory alive (it is returned to the communicator when the tensor and
    every view of it are gone)."""
    shp = (shape,) if isinstance(shape, int) else tuple(shape)
    if dtype == torch.bfloat16:
        arr = comm.alloc(shp, np.int16)  # type: ignore[attr-defined]
        return torch.from_numpy(arr).view(torch.bfloat16)
    if dtype not in _NUMPY:
        raise errors.InvalidArgument(
            f"shmproxy backend: alloc_tensor of dtype {dtype}; supported: {SUPPORTED}")
    return torch.from_numpy(comm.alloc(shp, _NUMPY[dtype]))  # type: ignore[attr-defined]
