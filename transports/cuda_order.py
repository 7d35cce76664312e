"""Stream order across processes: a device op waits for the work its rank queued before posting it
(NCCL's stream semantics; the rank's half is shmproxy.rank.device).

Every completion slot has a word for this, SLOT_STREAM_SEQ (shm/pool.py). A rank that posts a device op
while its stream has work queued has that stream store the low 32 bits of the request's sequence
number into the word once the work is done (cuStreamWriteValue32), and flags the op FLAG_STREAM_WORD.
Before queueing the op's copy or kernel, this process reads the word: if the value is there, there is
nothing to wait for; otherwise its stream waits for it on the GPU (cuStreamWaitValue32, equal).

Why a word of host memory and not an interprocess event, which this used before (docs/decisions.md,
"Stream order through a word"):
- where ranks share a GPU, a stream waiting for another process's event costs a switch of the
  time-sliced GPU between the contexts. A wait for a word is the waiting GPU reading memory, an
  order of magnitude cheaper (the figures and the probe that took them: docs/decisions.md), and the
  order held in every case tried: the wait queued before the store and after it, on the rank's GPU
  and on another;
- the driver backs a process's interprocess events with a file in /dev/shm that it never removes;
- a wait on another GPU's interprocess event crashed the driver; host memory every GPU reads alike.

Both processes pin and map the ranks' slots for every device, once (``HostSlots``: cuMemHostRegister,
portable and device-mapped): the rank its own, for its streams' stores, and this process all of
them, for its streams' waits and for the GPU-published completions (cuda_publish.py).

A slot is its request's alone until the request completes, so the word a wait reads was stored for
that request; an equal compare of 32 bits would be fooled only by a store left from 2^32 requests
earlier. A dead rank's store never comes: a stream of ours waiting for it would hold every later copy
on that stream, and the synchronize at exit. So each wait's word and value are kept (``awaited``, the
latest per slot), and ``release`` stores those not there yet, at exit.
"""
from __future__ import annotations

import ctypes
import mmap
from typing import Any, Callable

from shmproxy.core.errors import InvalidArgument
from shmproxy.core.memory import mem_kind
from shmproxy.core.ops import FLAG_STREAM_WORD
from shmproxy.shm import pool as P
from shmproxy.transports.base import MemKind
from shmproxy.transports.cuda_driver import Driver

_PAGE = mmap.PAGESIZE
_WORD = 8 * P.SLOT_STREAM_SEQ   # the word's offset in a slot (its low 32 bits: little-endian)


def word_address(slot0: int, slot: int) -> int:
    """Where completion slot ``slot``'s stream word lies, slot 0 lying at ``slot0``."""
    return slot0 + P.SLOT_BYTES * slot + _WORD


class HostSlots:
    """Completion slots pinned and mapped for every device of this process, once: all the ranks' in the
    progress process, a rank's own in the rank (shmproxy.rank.device)."""

    def __init__(self, drv: Driver, slots: tuple[int, int, int]):
        self.drv = drv
        self.addr, nbytes, self.per_rank = slots
        start, end = self.addr & ~(_PAGE - 1), (self.addr + nbytes + _PAGE - 1) & ~(_PAGE - 1)
        drv.host_register(start, end - start)
        self.start = start
        self.deltas: dict[int, int] = {}   # device -> its address of the slots minus ours

    def delta(self, device: int) -> int:
        """Add to a slot's address here for ``device``'s (whose context must be current)."""
        d = self.deltas.get(device)
        if d is None:
            d = self.deltas[device] = self.drv.host_device_pointer(self.start) - self.start
        return d

    def close(self) -> None:
        """At exit, once no work in flight can read or write a slot."""
        self.drv.host_unregister(self.start)


class StreamOrder:
    """The waits of this process's streams for the ranks' stream words. ``slots``: (address, bytes,
    slots per rank) of the completion slots here; ``mapped``: those slots pinned for the devices
    (HostSlots), made on the first wait a stream needs: a job whose words are all there in time, or
    whose streams are idle, never pins them for this."""

    def __init__(self, drv: Driver, slots: tuple[int, int, int], mapped: Callable[[], HostSlots]):
        self.drv, self.mapped = drv, mapped
        self.addr, nbytes, self.per_rank = slots
        self.nslots = nbytes // P.SLOT_BYTES
        self.awaited: dict[int, int] = {}   # word address -> the value a wait of ours expects (release)

    def wait_for_rank(self, op: Any, stream: Any, device: int) -> None:
        """Order ``stream`` (of ``device``, current on this thread) after the work the op's rank queued
        before posting it: nothing when the rank's stream was idle (no FLAG_STREAM_WORD), the memory is
        the host's (ready at post), or the word already holds the value."""
        if not op.flags & FLAG_STREAM_WORD or mem_kind(op.mem) != MemKind.CUDA:
            return
        slot = op.req_slot
        if not 0 <= slot < self.nslots or slot // self.per_rank != op.owner:
            raise InvalidArgument(f"{op.describe()}: completion slot {slot} is not its rank's")
        addr = word_address(self.addr, slot)
        want = op.req_seq & 0xFFFFFFFF
        if ctypes.c_uint32.from_address(addr).value == want:
            return
        self.awaited[addr] = want
        self.drv.wait_value(stream.ptr, addr + self.mapped().delta(device), want)

    def waited_on(self) -> list[int]:
        """For the dump: the local ranks whose stream stores a stream of ours still waits for."""
        return sorted({(addr - self.addr - _WORD) // P.SLOT_BYTES // self.per_rank
                       for addr, want in self.awaited.items()
                       if ctypes.c_uint32.from_address(addr).value != want})

    def release(self) -> None:
        """At exit: store every awaited value not stored yet (its rank died, or closed with the store
        still queued), so that no stream of ours waits for it any longer."""
        for addr, want in self.awaited.items():
            word = ctypes.c_uint32.from_address(addr)
            if word.value != want:
                word.value = want
        self.awaited.clear()
