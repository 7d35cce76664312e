"""Rank-side buffers: registered memory (comm.alloc) and staging for every other array.

The progress process can only touch memory it has mapped, i.e. memfds the rank registered through the
service (REGISTER passes the fd with SCM_RIGHTS). Two kinds:

- ``alloc``: the zero-copy path. A memfd of exactly the array's size, registered once; the user gets a
  numpy array over it. When the user drops every view, a weakref finalizer queues a DEREGISTER (sent
  with the next control message: a finalizer may run anywhere, so it never talks to the socket).
- staging: for arrays that are not in registered memory. Buffers of power-of-two size classes are
  registered on first use and cached (up to SHMPROXY_STAGING_CACHE bytes); a send copies into one
  before posting, a receive copies out of one when it completes.

Lookup of "is this address registered?" is a bisect over the sorted registered ranges; the ranges are
also pushed to the rank's C post path (shm/_poster.c) on every change, which does the same lookup.
"""
from __future__ import annotations

import bisect
import os
import weakref
from typing import Callable

import numpy as np

from shmproxy.core import log
from shmproxy.shm.segment import MemfdBuffer

_log = log.get("SHM")
MIN_STAGING = 64 << 10


class Registry:
    """Registered address ranges of this rank: start -> (end, buf_id)."""

    def __init__(self, register: Callable[[int, int, int], None],
                 on_change: Callable[[list[tuple[int, int, int]]], None]):
        self._register = register      # (buf_id, fd, nbytes) -> service REGISTER
        self._on_change = on_change    # [(start, end, buf_id)] sorted by start, after every change
        self._starts: list[int] = []
        self._ranges: dict[int, tuple[int, int]] = {}
        self.dead_ids: list[int] = []  # filled by finalizers, flushed as DEREGISTER
        self._next_id = 1

    def new_id(self) -> int:
        bid = self._next_id
        self._next_id += 1
        return bid

    def register_new(self, nbytes: int, label: str) -> tuple[int, MemfdBuffer]:
        """A fresh memfd of ``nbytes``, registered with the progress process: (buf_id, buffer)."""
        buf = MemfdBuffer.create(nbytes, label)
        bid = self.new_id()
        try:
            self._register(bid, buf.fd, nbytes)
        except BaseException:
            buf.close()
            raise
        return bid, buf

    def adopt(self, fd: int, start: int, nbytes: int) -> int:
        """Register memory this rank mapped already (the numpy arena: shmproxy.rank.arena) at
        ``start``; ``fd`` stays the caller's. Returns its buf_id."""
        bid = self.new_id()
        self._register(bid, fd, nbytes)
        self.add(start, nbytes, bid)
        return bid

    def add(self, start: int, nbytes: int, buf_id: int) -> None:
        bisect.insort(self._starts, start)
        self._ranges[start] = (start + nbytes, buf_id)
        self._changed()

    def remove(self, start: int) -> None:
        if start in self._ranges:
            _end, bid = self._ranges.pop(start)
            self._starts.remove(start)
            self.dead_ids.append(bid)
            self._changed()

    def _changed(self) -> None:
        self._on_change([(s, *self._ranges[s]) for s in self._starts])

    def find(self, addr: int, nbytes: int) -> tuple[int, int] | None:
        """(buf_id, offset) when [addr, addr+nbytes) lies inside one registered buffer."""
        i = bisect.bisect_right(self._starts, addr) - 1
        if i < 0:
            return None
        start = self._starts[i]
        end, bid = self._ranges[start]
        if addr + nbytes <= end:
            return bid, addr - start
        return None

    def alloc(self, shape, dtype: np.dtype) -> np.ndarray:
        count = int(np.prod(shape, dtype=np.int64)) if shape != () else 1
        nbytes = count * dtype.itemsize
        bid, buf = self.register_new(nbytes, "shmproxy-alloc")
        # The progress process has its own reference to the memory now; the mapping lives as long
        # as the array does, so our fd is no longer needed.
        os.close(buf.fd)
        buf.fd = -1
        mm = buf.mm
        self.add(buf.addr, nbytes, bid)
        weakref.finalize(mm, self.remove, buf.addr)
        return np.frombuffer(mm, dtype=dtype, count=count).reshape(shape)


class StagingCache:
    """Registered staging buffers by power-of-two size class, reused across operations."""

    def __init__(self, registry: Registry, limit: int):
        self.registry = registry
        self.limit = limit
        self.free: dict[int, list[tuple[int, MemfdBuffer]]] = {}
        self.cached_bytes = 0
        self.owned: dict[int, MemfdBuffer] = {}

    @staticmethod
    def size_class(nbytes: int) -> int:
        return max(MIN_STAGING, 1 << max(nbytes - 1, 0).bit_length())

    def get(self, nbytes: int) -> tuple[int, MemfdBuffer]:
        cls = self.size_class(nbytes)
        lst = self.free.get(cls)
        if lst:
            item = lst.pop()
            self.cached_bytes -= cls
            return item
        bid, buf = self.registry.register_new(cls, "shmproxy-staging")
        self.owned[bid] = buf
        return bid, buf

    def put(self, bid: int, buf: MemfdBuffer) -> None:
        cls = buf.size
        if self.cached_bytes + cls > self.limit:
            self.owned.pop(bid, None)
            self.registry.dead_ids.append(bid)
            buf.close()
            return
        self.free.setdefault(cls, []).append((bid, buf))
        self.cached_bytes += cls

    def close(self) -> None:
        for buf in self.owned.values():
            buf.close()
        self.owned.clear()
        self.free.clear()
        self.cached_bytes = 0
