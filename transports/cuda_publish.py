"""Completions published by the GPU: a request's completion word stored by a kernel behind its copy.

A rank waiting on a device message spins on its completion slot's ``done_seq`` (shm/_poster_request.c).
Published by the progress loop, that word changes only once the loop has polled the copy's event and
run its completion code: microseconds after the copy ended, more while the loop is busy elsewhere.
Here the GPU stores it instead, in the same graph launch as the copy (transports/cuda_gpu.py, ``Gpu.copy``):

- the ranks' completion slots are pinned and mapped for the devices once (cuMemHostRegister:
  ``cuda_order.HostSlots``, which the streams' waits for the ranks' words use too), so a kernel can
  store into them;
- a *cell* is a small pinned descriptor: a count, a token, (device address, value) pairs, an ack. A
  repeated copy's graph is captured as the copy, then one launch of ``shmproxy_publish`` reading its
  own cell, then its end event. Each launch of the graph (``Publisher.launch``, one C call:
  shm/_native_device.c ``publish_launch``) first writes its requests' slots but their done_seq,
  and fills the cell with where each done_seq lies, its value and a new token; a graph is never
  launched again while in flight (``Graph.busy``), so a cell is never rewritten before the kernel
  read it. An empty cell (count 0) publishes nothing, and the loop completes those requests.
- the kernel stores the token into the ack word last, so the loop learns that the graph's work is
  done by reading pinned memory (``acked``) instead of querying the event, a driver call the loop
  would make on every pass while the copy runs.

Why a kernel and not cuStreamWriteValue64: those are driver calls of their own, two per message,
outside any graph (the values change with every op), and each cost the loop more than the graph
launch it follows; the kernel rides in the graph launch the copy makes anyway (docs/decisions.md,
"who publishes a device op's completion"; the figures in BENCHMARKS.md).

Ordering: the kernel runs after the copy (stream order within the graph), so a rank that sees its
word has its bytes in place; the loop's stores into the cell and the slot's other fields come before
its launch call, which the GPU follows.
"""
from __future__ import annotations

import ctypes
import mmap
from typing import Any

from shmproxy.shm import _native
from shmproxy.transports.cuda_driver import Driver
from shmproxy.transports.cuda_order import HostSlots

CELL_PAIRS = 16                          # requests one cell can publish (a message needs two)
_TOKEN, _ACK = 1, 2 + 2 * CELL_PAIRS     # a cell's words: count, token, pairs, ack
CELL_BYTES = 8 * (_ACK + 2)              # and one word of padding: a multiple of 16 bytes
assert _native.PUBLISH_CELL == (0, _TOKEN, 2)   # the cell's layout as publish_launch writes it
NCELLS = 256                             # graphs that can publish at once (cuda.GRAPHS_MAX and retirees)

_SRC = r"""
extern "C" __global__ void shmproxy_publish(unsigned long long* cell) {
    volatile unsigned long long* c = cell;
    unsigned long long n = c[0];
    for (unsigned long long i = 0; i < n; i++)
        *(volatile unsigned long long*)c[2 + 2 * i] = c[3 + 2 * i];
    __threadfence_system();   /* the completions are visible before the ack */
    c[%(ack)d] = c[1];
}
"""


_kernel: Any = None


def publish_kernel(cp: Any) -> Any:
    """The publish kernel (compiled once per process, by nvrtc or from cupy's disk cache)."""
    global _kernel
    if _kernel is None:
        _kernel = cp.RawKernel(_SRC % {"ack": _ACK}, "shmproxy_publish")
    return _kernel


def load(cp: Any, device: int) -> None:
    """Compile and load the kernel for ``device`` ahead of its first use: done when a rank first
    registers memory there (REGISTER, which the loop runs before it answers), so that a compile (tens
    of ms on a cold cache) is paid at set-up and never in the middle of a job's messages."""
    with cp.cuda.Device(device):
        _ = publish_kernel(cp).kernel   # compiled (or read from the cache), then loaded


class Publisher:
    """The cells and the publish kernel of each device, over the pinned completion slots."""

    def __init__(self, cp: Any, drv: Driver, slots: HostSlots):
        self.cp, self.drv, self.host_slots = cp, drv, slots
        self.slots, self.slots_per_rank = slots.addr, slots.per_rank
        self.mm = mmap.mmap(-1, NCELLS * CELL_BYTES)
        self.words = (ctypes.c_uint64 * (NCELLS * CELL_BYTES // 8)).from_buffer(self.mm)
        self.cells_base = ctypes.addressof(self.words)
        drv.host_register(self.cells_base, NCELLS * CELL_BYTES)
        self.free = list(range(NCELLS - 1, -1, -1))
        # Tokens of cell runs, never reused: a word of its own, since armed routes (shm/_native_armed.c)
        # take tokens from it too
        self.run_word = ctypes.c_uint64(0)
        self.runs_addr = ctypes.addressof(self.run_word)
        self.launches: dict[int, Any] = {}      # device -> (Launch, slots' delta, cells' device address)

    def devices(self) -> list[int]:
        return sorted(self.launches)

    def prepare(self, device: int) -> None:
        """Load the kernel into ``device``'s context (current) before a capture queues it: loading
        a module is no stream work, and a capturing thread should make no such call."""
        self._device(device)

    def _device(self, device: int) -> tuple[Any, int, int]:
        """The device's launch of the kernel and addresses; its context must be current."""
        got = self.launches.get(device)
        if got is None:
            launch = self.drv.launcher(publish_kernel(self.cp).kernel.ptr, 1)   # the current context's
            delta = self.host_slots.delta(device)
            got = self.launches[device] = (launch, delta, self.drv.host_device_pointer(self.cells_base))
        return got

    def take(self) -> int | None:
        return self.free.pop() if self.free else None

    def put(self, cell: int) -> None:
        self.free.append(cell)

    def queue(self, cell: int, device: int, stream: int) -> None:
        """Queue the kernel that publishes ``cell`` (under a capture: a node of the graph)."""
        launch, _delta, cells = self._device(device)
        launch.set((cells + cell * CELL_BYTES,))
        launch(1, 1, stream)

    def launch(self, g: Any, device: int, stream: int, items: Any, nbytes: int) -> bool:
        """Launch graph ``g`` (its cell's kernel last) so that it publishes ``items`` ((op, source,
        tag) of each request it completes, ``nbytes`` each): True when it does. Not when an op is
        not a local rank's with its slot in its region, or there are more than CELL_PAIRS of them (a
        caller's bug): the cell then publishes nothing and the loop completes them. ``g.token``
        becomes the run's token, which the kernel stores last in the cell's ack word (``acked``)."""
        token = g.token = self.run_word.value = self.run_word.value + 1
        rc, published = _native.publish_launch(
            self.slots, self.slots_per_rank, items, nbytes, self.cell_addr(g.cell), CELL_PAIRS,
            token, self._device(device)[1], self.drv.graph_launch_addr, g.exe, stream)
        if rc:
            self.drv.fail("cuGraphLaunch", rc)
        return published

    def cell_addr(self, cell: int) -> int:
        return self.cells_base + cell * CELL_BYTES

    def delta(self, device: int) -> int:
        """A device address minus this process's address of the pinned slots (``device`` current)."""
        return self._device(device)[1]

    def ack_word(self, cell: int) -> int:
        """The address of ``cell``'s ack word (the loop waits on it in shm._native.watch_words)."""
        return self.cells_base + cell * CELL_BYTES + 8 * _ACK

    def acked(self, cell: int, token: int) -> bool:
        """Whether the run of ``cell`` that ``launch`` gave ``token`` has finished: its copy (earlier in
        the same graph) and its stores, or a later run's (a graph runs one launch at a time, and tokens
        only grow). A read of pinned memory, where an event query is a driver call that the loop would
        make on every pass."""
        return self.words[cell * CELL_BYTES // 8 + _ACK] >= token

    def close(self) -> None:
        """At exit, once nothing in flight can run a kernel that reads a cell (the slots are
        HostSlots', unpinned after this)."""
        self.drv.host_unregister(self.cells_base)
        del self.words
        self.mm.close()


class Repeat:
    """A publishing graph's launch as an armed route makes it again (proxy/engine/armed.py), over the
    transport's ``Gpu`` (transports/cuda_gpu.py): valid while no registration was dropped and the graph is
    not retired."""

    __slots__ = ("gpu", "graph", "device", "stream", "gen")

    def __init__(self, gpu: Any, graph: Any, device: int, stream: int, gen: int):
        self.gpu, self.graph, self.device, self.stream, self.gen = gpu, graph, device, stream, gen

    def words(self) -> tuple | None:
        """(device, ack word, last token, cell, slots' delta, exe, stream, tokens' word, cuGraphLaunch)
        for the C fire (shm/_native_armed.c), or None where the graph may not be launched again."""
        gpu, g = self.gpu, self.graph
        pub = gpu.publisher
        if self.gen != gpu.gen or g.cell is None or pub is None or g not in gpu.live_graphs:
            return None
        return (self.device, pub.ack_word(g.cell), g.token, pub.cell_addr(g.cell), pub.delta(self.device),
                g.exe, self.stream, pub.runs_addr, gpu.drv.graph_launch_addr)

    def current_device(self) -> int:
        """The device whose context is current on the loop thread (a fire launches there)."""
        return self.gpu.device
