"""The ranks' stream events, as the progress process holds them: how a device op is ordered after
the work its rank queued before posting it (NCCL's stream semantics; the rank's half is
shmproxy.rank.device).

A rank registers, once per device it posts from, a ring of NEVENTS interprocess events; an op posted
while the rank's stream had work queued carries FLAG_STREAM_EVENT and has event ``req_slot %
NEVENTS`` recorded after that work. The progress process opens each ring at registration, in the
context of the ring's device, and before queueing an op's copy or kernel makes its stream wait for
the op's event, unless that event has finished (a wait on a finished event of another process still
costs a context switch where ranks share a GPU).

Ranks on different GPUs: the stream that does the work may be on another GPU than the event (a
message runs on the receiver's device, a collective on rank 0's). A direct wait there crashed the
driver (SIGSEGV in cuStreamWaitEvent, 2x H200, driver 580), so the wait goes through a relay: a
stream of ours on the event's GPU waits for it and records an ordinary event, which the working
stream waits for. cuStreamWaitEvent takes an event's latest record at the time of the call, so one
relay event per device serves every op in turn.

The driver keeps a process's interprocess events in a file of /dev/shm that it never removes
(transports/cuda_driver.py): a rank removes its own at exit, and this process, at its exit, those
of the ranks that died (and their marks in the run directory), by the pid the service knows for
the rank that registered each ring.
"""
from __future__ import annotations

import threading
from typing import Any, Callable

from shmproxy.core.errors import InvalidArgument
from shmproxy.core.memory import mem_device, mem_kind
from shmproxy.core.ops import FLAG_STREAM_EVENT
from shmproxy.core.process import alive as process_alive
from shmproxy.transports.base import MemKind, Registration
from shmproxy.transports.cuda_driver import Driver, remove_event_files

NEVENTS = 16   # the ranks' event ring (shmproxy.rank.device.NEVENTS): an op uses req_slot % NEVENTS


class RankEvents:
    """Every rank's opened ring, by (local rank, device); the relays between GPUs."""

    def __init__(self, cp: Any, drv: Driver, lock: threading.Lock, run_dir: str) -> None:
        self.cp, self.rt, self.drv, self.run_dir = cp, cp.cuda.runtime, drv, run_dir
        self.lock = lock   # the transport's: the service thread opens and drops, the loop waits
        self.rings: dict[tuple[int, int], list[int]] = {}   # (local rank, device) -> its opened ring
        self.regs: set[tuple[int, int]] = set()        # (local rank, buf_id) of each ring's registration
        self.pids: set[int] = set()                      # the processes whose rings were opened
        self.relays: dict[int, tuple[Any, Any]] = {}     # device -> (stream, event)

    # ---------------------------------------------------------------- registrations (service thread)
    def register(self, reg: Registration, raws: list[bytes]) -> list[int] | None:
        """Open the ring of NEVENTS event handles ``raws`` that ``reg``'s rank registered for its device;
        returns the ring it replaces (to be destroyed once nothing is in flight), if any."""
        if len(raws) != NEVENTS:
            raise InvalidArgument(f"REGISTER of cuda memory (device {reg.device}) by rank {reg.rank}: "
                                  f"'events' must list {NEVENTS} event handles")
        with self.cp.cuda.Device(reg.device):
            ring = [self.rt.ipcOpenEventHandle(r) for r in raws]
        with self.lock:
            if reg.pid > 0:
                self.pids.add(reg.pid)
            old = self.rings.pop((reg.local_rank, reg.device), None)
            self.rings[(reg.local_rank, reg.device)] = ring
            self.regs.add((reg.local_rank, reg.buf_id))
        return old

    def forget(self, key: tuple[int, int]) -> bool:
        """Whether registration ``key`` (local rank, buf_id) was a ring (the caller holds the lock). A
        ring lives as long as its rank's registrations, and is destroyed at exit (take_all)."""
        if key not in self.regs:
            return False
        self.regs.discard(key)
        return True

    # ---------------------------------------------------------------- ordering (loop thread)
    def wait_for_rank(self, op: Any, stream: Any, device: int, use: Callable[[int], None]) -> None:
        """Order ``stream`` (of ``device``, current on this thread) after the work the op's rank queued
        before posting it: nothing when the rank's stream was idle (no FLAG_STREAM_EVENT) or the memory
        is the host's (ready at post). ``use(d)`` makes device d's context current."""
        if not op.flags & FLAG_STREAM_EVENT or mem_kind(op.mem) != MemKind.CUDA:
            return
        owner = mem_device(op.mem)
        ring = self.rings.get((op.owner, owner))
        if ring is None:
            raise InvalidArgument(f"{op.describe()}: rank {op.rank} registered no stream events for device "
                                  f"{owner}")
        ev = ring[op.req_slot % NEVENTS]
        if self.drv.done(ev):
            return
        if owner == device:
            self.drv.wait(stream.ptr, ev)
            return
        relay, mark = self._relay(owner)
        use(owner)
        self.drv.wait(relay.ptr, ev)
        self.drv.record(mark.ptr, relay.ptr)
        use(device)
        self.drv.wait(stream.ptr, mark.ptr)

    def _relay(self, device: int) -> tuple[Any, Any]:
        """The relay stream and event of ``device``: a stream apart from the device's copy stream, so
        that a relayed wait holds back no copy of ours there."""
        r = self.relays.get(device)
        if r is None:
            with self.cp.cuda.Device(device):
                r = self.relays[device] = (self.cp.cuda.Stream(non_blocking=True),
                                           self.cp.cuda.Event(block=False, disable_timing=True))
        return r

    # ---------------------------------------------------------------- exit and the dump
    def relay_streams(self) -> list[Any]:
        return [s for s, _e in self.relays.values()]

    def take_all(self) -> list[list[int]]:
        """Every opened ring, to destroy (the caller holds the lock); none is held any more."""
        rings = list(self.rings.values())
        self.rings.clear()
        return rings

    def remove_files_of_the_dead(self) -> None:
        """At exit: the driver's event files, and the marks, of the ranks that died (a zombie counts as
        dead)."""
        for pid in self.pids:
            if not process_alive(pid):
                remove_event_files(pid, self.run_dir)

    def devices(self) -> set[int]:
        return {d for _lr, d in self.rings}

    def ranks(self) -> list[int]:
        return sorted({lr for lr, _d in self.rings})
