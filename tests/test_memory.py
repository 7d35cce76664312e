"""The memory-kind vocabulary (shmproxy.core.memory): the record's mem word, kind names, and how the
rank recognises a device array (CUDA array interface or DLPack) without importing any GPU library."""
from __future__ import annotations

import numpy as np
import pytest

import shmproxy
from shmproxy.core import memory, ops
from shmproxy.core.memory import MemKind
from shmproxy.shm import pool as P
from shmproxy.transports.base import MemKind as TransportsMemKind


def test_mem_word_round_trips_kind_and_device():
    for kind in MemKind:
        for device in (0, 1, 7, memory.MAX_DEVICE):
            w = memory.mem_word(kind, device)
            assert memory.mem_kind(w) == kind and memory.mem_device(w) == device
            assert 0 <= w < 2**31   # fits the record's int32 field
    assert memory.mem_word(MemKind.HOST) == 0   # a record nobody set a kind in is host memory
    assert TransportsMemKind is MemKind


def test_the_record_carries_the_mem_word_to_the_progress_side_op():
    lay = P.Layout(2, 4, 64)
    buf = bytearray(lay.total_bytes)
    w = memory.mem_word(MemKind.CUDA, 3)
    ops.pack(buf, lay, 5, ops.KIND_SEND, ops.DTYPE_CODE["f"], 1, 0, 7, 1, 1, 5, 2, 0, 16, 4, 123, mem=w)
    op = ops.Op(5, P.RECORD.unpack_from(buf, lay.record_off(5)), 1, 0)
    assert op.mem == w and memory.mem_kind(op.mem) == MemKind.CUDA and memory.mem_device(op.mem) == 3
    ops.pack(buf, lay, 6, ops.KIND_RECV, ops.DTYPE_CODE["f"], 1, 0, 7, 1, 1, 6, 2, 0, 16, 4, 123)
    assert ops.Op(6, P.RECORD.unpack_from(buf, lay.record_off(6)), 1, 0).mem == 0


def test_kind_names_of_the_register_message():
    assert memory.parse_kind("host") is MemKind.HOST and memory.parse_kind("cuda") is MemKind.CUDA
    for bad in ("HOST", "gpu", 1, None):
        with pytest.raises(shmproxy.InvalidArgument, match="unknown memory kind"):
            memory.parse_kind(bad)


class _Cai:
    __cuda_array_interface__ = {"shape": (1,), "typestr": "<f4", "data": (0, False), "version": 3}


class _DLPack:
    def __init__(self, device_type: int):
        self.device_type = device_type

    def __dlpack_device__(self):
        return (self.device_type, 0)


def test_device_arrays_are_recognised_without_a_gpu_library():
    assert memory.device_array_kind(_Cai()) == "cuda"
    assert memory.device_array_kind(_DLPack(2)) == "cuda"      # kDLCUDA
    assert memory.device_array_kind(_DLPack(13)) == "cuda"     # kDLCUDAManaged
    assert memory.device_array_kind(_DLPack(3)) is None        # kDLCUDAHost: pinned host memory
    assert memory.device_array_kind(_DLPack(1)) is None        # kDLCPU
    assert memory.device_array_kind(np.zeros(3)) is None       # numpy's __dlpack_device__ says CPU
    assert memory.device_array_kind(object()) is None
