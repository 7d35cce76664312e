"""Memory kinds: where a buffer's bytes live, from the rank's call to the progress process's copy.

Every layer carries the kind of the memory it names: the rank locates a buffer (host memory it
registered, or staged; or a device array's allocation), the REGISTER message says the
kind of what it registers, the op record carries the kind and device of its buffers (the ``mem``
word: kind in the low 8 bits, device index above), and the progress process picks a connection per
(pair of ranks, memory kind), so that each transport resolves only the memory it knows.

Host memory moves by the shm transport, device memory by the cuda transport (transports/cuda.py);
the rank side of device arrays is shmproxy.rank.device.
"""
from __future__ import annotations

import enum
from typing import Any

from shmproxy.core import errors


class MemKind(enum.IntEnum):
    HOST = 0   # host memory the progress process has mapped (a rank's memfd, passed at registration)
    CUDA = 1   # device memory of a GPU


KIND_NAMES = {k.name.lower(): k for k in MemKind}
MAX_DEVICE = (1 << 23) - 1   # the device index in the record's mem word (int32, 8 bits of kind)


def mem_word(kind: MemKind, device: int = 0) -> int:
    """The record's ``mem`` field for memory of ``kind`` on ``device``."""
    return int(kind) | (device << 8)


def mem_kind(word: int) -> int:
    """The kind in a record's ``mem`` field (an int: a forged record may hold any)."""
    return word & 0xFF


def mem_device(word: int) -> int:
    return (word >> 8) & MAX_DEVICE


def parse_kind(name: Any) -> MemKind:
    """A kind as the REGISTER message names it ('host', 'cuda'); InvalidArgument otherwise."""
    kind = KIND_NAMES.get(name) if isinstance(name, str) else None
    if kind is None:
        raise errors.InvalidArgument(f"unknown memory kind {name!r}; one of {', '.join(KIND_NAMES)}")
    return kind


def device_array_kind(obj: Any) -> str | None:
    """'cuda' when ``obj`` is a device array (CUDA array interface, or DLPack on a CUDA device), else
    None: what the rank checks before it refuses or routes a buffer that is not host memory."""
    if hasattr(obj, "__cuda_array_interface__"):
        return "cuda"
    dev = getattr(obj, "__dlpack_device__", None)
    if dev is not None:
        try:
            device_type = dev()[0]
        except (TypeError, ValueError, RuntimeError, IndexError):
            return None
        if device_type in (2, 3, 13):   # kDLCUDA, kDLCUDAHost (pinned host) excluded below, kDLCUDAManaged
            return None if device_type == 3 else "cuda"
    return None
