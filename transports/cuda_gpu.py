"""The cuda transport's state in the progress process (``Gpu``): cupy and the driver, the streams per
device, the ranks' allocations opened by IPC handle (and their peer mappings), the events and graphs
in flight, the routes and graphs kept for repeated messages, and the completions the GPU publishes.

How they are used, and why (stream order, peer mappings, graphs, published completions), is the
transport's header (transports/cuda.py); ``CudaTransport`` there is the contract's side, which makes
one ``Gpu`` at the first device registration of the process.
"""
from __future__ import annotations

import collections
import threading
from typing import Any

from shmproxy.core import log
from shmproxy.core.errors import InvalidArgument, InvalidUsage, SystemError_
from shmproxy.core.memory import mem_device, mem_kind
from shmproxy.transports.base import MemKind, Registration, TransportContext
from shmproxy.transports.cuda_driver import Driver
from shmproxy.transports.cuda_order import HostSlots, StreamOrder
from shmproxy.transports import cuda_publish
from shmproxy.transports.cuda_publish import Publisher

_log = log.get("CUDA")
HANDLE_BYTES = 64       # cudaIpcMemHandle_t
GRAPHS_MAX = 64         # repeated copies kept as graphs (see Gpu.copy)
ROUTES_MAX = 1024       # messages' resolved buffers kept (see Gpu.route)
ACK_CHECKS_EVENT = 256  # every so many polls of unacked graphs, one query of an event for a GPU fault (poll)
_LAZY_PEER_ACCESS = 1   # cudaIpcMemLazyEnablePeerAccess


def _handle(reg: Registration, text: Any) -> bytes:
    try:
        raw = bytes.fromhex(text) if isinstance(text, str) else b""
    except ValueError:
        raw = b""
    if len(raw) != HANDLE_BYTES:
        raise InvalidArgument(f"REGISTER of cuda memory (device {reg.device}) by rank {reg.rank}: an IPC "
                              f"handle is {HANDLE_BYTES} bytes in hex, got {text!r:.80}")
    return raw


class Gpu:
    """The CUDA side of the progress process: cupy, streams, opened handles, events in flight."""

    def __init__(self, slots: tuple[int, int, int], graphs: bool = True, completes: bool = True,
                 completes_min: int = 0, fused: bool = True) -> None:
        import cupy   # here and only here: the first device registration of this process
        self.cp = cupy
        self.rt = cupy.cuda.runtime
        self.drv = Driver()                 # the per-op calls (transports/cuda_driver.py)
        self.device = -1                    # the device whose context is current on the loop thread (use)
        self.gen = 0                        # bumped when a registration is dropped (cached launches re-resolve)
        self.plans: dict = {}               # small reductions' launches by their buffers (cuda_coll.py)
        self.routes: dict = {}              # messages' resolved buffers (route)
        # Repeated work as CUDA graphs (one launch call, started sooner: see copy): copies by their
        # addresses, seen-once copies, and every live graph (destroyed once retired and idle, or at exit).
        self.graphs: dict[tuple[int, int, int, int], Any] = {}
        self.copies_seen: dict[tuple[int, int, int, int], int] = {}
        self.live_graphs: set = set()
        self.graphs_ok = graphs             # CUDA_GRAPHS, and False after a capture failed
        self.completes = completes          # CUDA_DEVICE_COMPLETES, and False where the driver cannot
        self.completes_min = completes_min  # CUDA_DEVICE_COMPLETES_MIN: smaller work is published by the loop
        self.fused = fused                  # CUDA_FUSED_REDUCE: reductions as one kernel of ours (cuda_coll.py)
        self.publisher: Publisher | None = None   # GPU-published completions (publishing)
        self.loaded: set[int] = set()       # devices the publish kernel was loaded for (register)
        # REGISTER/DEREGISTER open and drop, copies resolve: the loop's, but for the requests a lingering
        # service answers after the loop ended (proxy/control/handler.py)
        self.lock = threading.Lock()
        # IPC handle -> [base pointer, references, device, {other device: base there, or 0: no peer access}]
        self.opened: dict[bytes, list] = {}
        self.peer_access: dict[tuple[int, int], bool] = {}   # (device, owner's device) -> may it map it
        self.bus_ids: dict[int, str] = {}    # device -> its PCI bus id in this process (check_device)
        self.mem: dict[tuple[int, int], tuple[bytes, int, int]] = {}   # (local rank, buf_id) -> (handle, size, device)
        self.slots_at = slots               # the ranks' completion slots here (address, bytes, per rank)
        self.host_slots: HostSlots | None = None   # those slots pinned for the devices (slots)
        self.order = StreamOrder(self.drv, slots, self.slots)   # waits for the ranks' stream words
        self.streams: dict[int, Any] = {}
        self.free_events: dict[int, list[Any]] = {}
        self.pending: dict[int, Any] = {}                # sub slot -> the event its copies end with
        self.retired: collections.deque = collections.deque()   # handles to close once nothing is in flight
        self.nbusy = 0
        self.unacked = 0   # polls of a publishing graph not acked yet (poll)
        self.last_launch: tuple | None = None   # the last publishing launch of a message (proxy_repeat)
        self.on_retire: Any = None   # the engine's disarm of every armed route (close_retired)
        _log.info("CUDA up: cupy %s, %d device(s)", cupy.__version__, self.rt.getDeviceCount())

    # ------------------------------------------------------------------ registrations (REGISTER)
    def check_device(self, reg: Registration, info: dict) -> None:
        """A rank names its GPUs by its own device numbers, which depend on its CUDA_VISIBLE_DEVICES;
        this process uses them as its own. Where the two disagree (a launcher that gives each rank a
        list of its own: srun --gpus-per-task, say), say so at the first registration instead of
        mapping memory on, or waiting on events of, the wrong GPU. A rank that sends no bus id
        (``info`` without "bus") is taken at its word."""
        bus = info.get("bus")
        if bus is None:
            return
        mine = self.bus_ids.get(reg.device)
        if mine is None:
            n = self.rt.getDeviceCount()
            mine = self.rt.deviceGetPCIBusId(reg.device) if 0 <= reg.device < n else f"none (it sees {n})"
            self.bus_ids[reg.device] = mine
        if str(bus).lower() != str(mine).lower():
            raise InvalidUsage(f"rank {reg.rank}'s CUDA device {reg.device} is the GPU at {bus}, but the "
                               f"progress process's device {reg.device} is {mine}: every rank of a node must "
                               f"see the same GPUs under the same numbers (the same CUDA_VISIBLE_DEVICES, or "
                               f"none); choose a rank's GPU with cupy.cuda.Device(n).use() or "
                               f"torch.cuda.set_device(n)")

    def register(self, reg: Registration) -> None:
        info = reg.info if isinstance(reg.info, dict) else {}
        self.check_device(reg, info)
        key = (reg.local_rank, reg.buf_id)
        raw = _handle(reg, info.get("handle"))
        with self.lock:
            if key in self.mem:
                raise InvalidArgument(f"buffer {reg.buf_id} of rank {reg.rank} is already registered")
            entry = self.opened.get(raw)
            if entry is None:
                with self.cp.cuda.Device(reg.device):
                    base = self.rt.ipcOpenMemHandle(raw, _LAZY_PEER_ACCESS)
                entry = self.opened[raw] = [base, 0, reg.device, {}]
            entry[1] += 1
            self.mem[key] = (raw, reg.nbytes, reg.device)
        if self.completes and self.graphs_ok and reg.device not in self.loaded:
            self.loaded.add(reg.device)
            try:
                cuda_publish.load(self.cp, reg.device)   # here, not on the loop (cuda_publish.load)
            except Exception as exc:   # nvrtc's or cupy's own errors: device memory works without it
                self.completes = False
                _log.warning("the publish kernel cannot be built; the loop publishes every completion: %s",
                             exc)

    def deregister(self, reg: Registration) -> None:
        key = (reg.local_rank, reg.buf_id)
        with self.lock:
            found = self.mem.pop(key, None)
            if found is None:
                return
            self.gen += 1   # addresses may go: every cached launch, route and graph with them
            self.plans.clear()
            self.routes.clear()
            self.graphs.clear()
            self.copies_seen.clear()
            self.retired.extend(("graph", g) for g in self.live_graphs)
            self.live_graphs.clear()
            entry = self.opened[found[0]]
            entry[1] -= 1
            if entry[1] == 0:
                del self.opened[found[0]]
                self.retired.append(("mem", entry))

    def close_retired(self) -> None:
        """Loop thread (or exit): close dropped handles, once no copy that might use them is in flight."""
        if self.retired and self.on_retire is not None:
            self.on_retire()   # no armed route may launch a graph destroyed below (it may start work)
        if self.pending:
            return
        while self.retired:
            what, x = self.retired.popleft()
            if what == "graph":   # before the mappings it copies between are closed
                if x.event is not None and not self.drv.done(x.event.ptr):
                    # a graph seen done by its ack may still have its end event's record to run
                    self.retired.appendleft((what, x))
                    return
                if x.cell is not None and self.publisher is not None:
                    self.publisher.put(x.cell)
                    x.cell = None
                x.destroy()
            else:   # "mem": its own device's mapping, then those in other devices' contexts
                for device, base in [(x[2], x[0]), *x[3].items()]:
                    if base:
                        with self.cp.cuda.Device(device):
                            self.rt.ipcCloseMemHandle(base)

    # ------------------------------------------------------------------ resolving ops (loop thread)
    def address(self, ctx: TransportContext, op: Any, second: bool, nbytes: int, on: int = -1,
                kernel: bool = False) -> int:
        """The address in this process of ``nbytes`` of an op's buffer (second: its receive buffer),
        device or host, bounds-checked. ``on``: the device whose stream the work using it goes on
        (-1: the buffer's own); ``kernel``: a kernel reads or writes it there, not only a copy (see
        the module header, "Ranks on different GPUs")."""
        bid, off = (op.buf2_id, op.offset2) if second else (op.buf_id, op.offset)
        if mem_kind(op.mem) == MemKind.HOST:
            buf = ctx.buffers.get((op.owner, bid))
            if buf is None or off + nbytes > buf.size:
                raise InvalidArgument(f"{op.describe()}: host buffer {bid} offset {off} + {nbytes} B is outside "
                                      f"the registered buffer")
            return buf.addr + off
        found = self.mem.get((op.owner, bid))
        if found is None or off + nbytes > found[1]:
            raise InvalidArgument(f"{op.describe()}: device buffer {bid} offset {off} + {nbytes} B is outside "
                                  f"the registered allocation ({'unknown' if found is None else found[1]} B)")
        entry = self.opened[found[0]]
        if on < 0 or on == entry[2]:
            return entry[0] + off
        base = entry[3].get(on)
        if base is None:
            base = self._open_on(found[0], entry, on)
        if base:
            return base + off
        if kernel:
            raise InvalidUsage(f"{op.describe()}: GPU {on} has no peer access to GPU {entry[2]}, where this "
                               f"buffer lives; a reduction across the two is not supported")
        return entry[0] + off   # a copy: the driver moves it between the two contexts itself

    def _open_on(self, raw: bytes, entry: list, device: int) -> int:
        """``raw`` opened in ``device``'s context with peer access (0 where the two GPUs have none)."""
        owner = entry[2]
        ok = self.peer_access.get((device, owner))
        if ok is None:
            ok = self.peer_access[(device, owner)] = bool(self.rt.deviceCanAccessPeer(device, owner))
            _log.info("GPU %d %s peer access to GPU %d", device, "has" if ok else "has no", owner)
        base = 0
        if ok:
            try:
                with self.cp.cuda.Device(device):
                    base = self.rt.ipcOpenMemHandle(raw, _LAZY_PEER_ACCESS)
            except self.rt.CUDARuntimeError as exc:
                raise SystemError_(f"mapping GPU {owner}'s memory for GPU {device}: {exc}") from exc
        with self.lock:   # deregister retires entries
            entry[3][device] = base
        return base

    def route(self, ctx: TransportContext, key: tuple, send: Any, recv: Any, nbytes: int) -> tuple:
        """How a message between these buffers goes: (gen, source and destination address, device,
        both sides device memory). Remembered under ``key`` (the ops' buffers, offsets, memory and the
        size) for device memory on both sides, as a training loop or a ping-pong repeats it, until a
        registration is dropped (``gen``)."""
        gen = self.gen   # read first: a drop while resolving leaves the route stale, never wrong
        on_device = mem_kind(send.mem) == MemKind.CUDA and mem_kind(recv.mem) == MemKind.CUDA
        device = mem_device(recv.mem if mem_kind(recv.mem) == MemKind.CUDA else send.mem)
        src = self.address(ctx, send, False, nbytes, device)   # mapped where the copy runs
        dst = self.address(ctx, recv, False, nbytes, device)
        route = (gen, src, dst, device, on_device)
        if on_device:   # a host side's mapping may change without a drop of device memory
            if len(self.routes) >= ROUTES_MAX:
                self.routes.clear()
            self.routes[key] = route
        return route

    def publishes(self, nbytes: int) -> bool:
        """Whether repeated device work of ``nbytes`` has its requests published by its graph
        (CUDA_DEVICE_COMPLETES and _MIN; graphs on)."""
        return self.completes and self.graphs_ok and nbytes >= self.completes_min

    def use(self, device: int) -> None:
        """Make ``device``'s primary context current on the loop thread, where the driver calls act
        (cupy's ``with Device`` elsewhere in this thread restores it on leaving)."""
        if device != self.device:
            self.rt.setDevice(device)
            self.device = device

    def stream(self, device: int) -> Any:
        s = self.streams.get(device)
        if s is None:
            with self.cp.cuda.Device(device):
                s = self.streams[device] = self.cp.cuda.Stream(non_blocking=True)
        return s

    def ordered_stream(self, device: int, ops: Any) -> Any:
        """This process's stream of ``device``, made current and ordered after the work each op's rank
        queued before posting it: where every copy and kernel of those ops is queued."""
        stream = self.stream(device)
        self.use(device)
        order = self.order
        for op in ops:
            order.wait_for_rank(op, stream, device)
        return stream

    def slots(self) -> HostSlots:
        """The ranks' completion slots, pinned and mapped for the devices on first need (loop thread,
        a device current): the streams wait on their words, the GPU publishes into them."""
        if self.host_slots is None:
            self.host_slots = HostSlots(self.drv, self.slots_at)
        return self.host_slots

    def end_event(self, device: int, stream: Any) -> Any:
        """An event recorded on ``stream`` after the copies queued so far (recycled once polled done)."""
        free = self.free_events.setdefault(device, [])
        if free:
            ev = free.pop()
        else:
            with self.cp.cuda.Device(device):
                ev = self.cp.cuda.Event(block=False, disable_timing=True)
        self.drv.record(ev.ptr, stream.ptr)
        return ev

    def publishing(self) -> Publisher | None:
        """The publisher of GPU completions (transports/cuda_publish.py), made on first use; None where
        they are off or the driver refused (then the loop publishes every completion)."""
        if self.publisher is None and self.completes:
            try:
                self.publisher = Publisher(self.cp, self.drv, self.slots())
            except SystemError_ as exc:
                self.completes = False
                _log.warning("the GPU cannot publish completions on this host, the loop does: %s", exc)
        return self.publisher

    def watch(self, slot: int, device: int, ev: Any, owner: Any = None) -> None:
        """Complete the sub in ``slot`` with ``ev``. ``owner``: None for an event of ours (recycled once
        done), else the graph whose own event it is (True where nothing else of it needs to know)."""
        token = owner.token if owner is not None and owner is not True else 0   # the run just launched
        self.pending[slot] = (device, ev, owner, token)

    def poll(self, slot: int) -> bool:
        """True once the copies of the sub in ``slot`` finished on the GPU."""
        device, ev, owner, token = self.pending[slot]
        pub = self.publisher
        if pub is not None and owner is not None and owner is not True and owner.cell is not None:
            if not pub.acked(owner.cell, token):   # its kernel ran last in the graph
                self.unacked += 1
                if not self.unacked % ACK_CHECKS_EVENT:
                    self.drv.done(ev.ptr)   # raises where the GPU failed the graph: no ack would ever come
                return False
        elif not self.drv.done(ev.ptr):
            return False
        del self.pending[slot]
        if owner is None:
            self.free_events[device].append(ev)
        elif owner is not True and token == owner.token:   # not relaunched since (an armed route's fire)
            owner.busy = False   # its cell may be filled again (cuda_publish.py)
        return True

    def copy(self, dst: int, src: int, nbytes: int, device: int, stream: Any, on_device: bool,
             items: Any = None) -> tuple[Any, Any, bool]:
        """Queue one copy and the event it ends with: (event, its owner for ``watch``, whether its graph
        publishes ``items``). A copy between
        the same device addresses a second time is captured as a graph, launched from then on: one
        call instead of two, and the GPU starts it sooner (BENCHMARKS.md); a ping-pong or a training
        loop repeats its copies. The first time it goes directly: capturing costs more than a copy's
        calls. A copy with a host side (``on_device`` False) never does: the engine's mapping of a
        rank's host buffer is pageable memory, which a graph's copy cannot take.

        ``items`` (a message's completion_items, or () to publish none; given only once the publisher
        is made): its graph also publishes them (``launch_graph``); not on the first, direct, copy,
        nor while the graph is still in flight from an earlier launch (the copy then goes directly,
        and the loop publishes)."""
        key = (dst, src, nbytes, device)
        g = self.graphs.get(key)
        if g is None and self.graphs_ok and on_device:
            seen = self.copies_seen
            if key in seen:
                g = self._copy_graph(key, stream, self.publisher if items is not None else None)
            else:
                if len(seen) >= GRAPHS_MAX:
                    seen.clear()
                seen[key] = 1
        if g is not None and not g.busy:
            return g.event, g, self.launch_graph(g, device, stream, items, nbytes)
        self.drv.memcpy(dst, src, nbytes, stream.ptr)
        return self.end_event(device, stream), None, False

    def _copy_graph(self, key: tuple, stream: Any, pub: Publisher | None) -> Any:
        """Capture the copy of ``key`` (and, with ``pub``, the kernel publishing its cell) as a graph."""
        dst, src, nbytes, device = key
        g = self.publishing_graph(stream, device, lambda: self.drv.memcpy(dst, src, nbytes, stream.ptr), pub)
        if g is None:
            return None
        if len(self.graphs) >= GRAPHS_MAX:   # destroyed once none is in flight (close_retired)
            with self.lock:
                self.retired.extend(("graph", old) for old in self.graphs.values())
                self.live_graphs.difference_update(self.graphs.values())
                self.graphs.clear()
        self.graphs[key] = g
        return g

    def launch_graph(self, g: Any, device: int, stream: Any, items: Any, nbytes: int) -> bool:
        """Launch ``g`` (not in flight: ``busy``). A graph with a cell publishes ``items`` ((op, source,
        tag) of the requests it completes, ``nbytes`` each; None or (): none, the loop publishes them):
        True when it does (Publisher.launch)."""
        g.busy = True
        pub = self.publisher
        if g.cell is None or pub is None:     # a graph has a cell only where there is a publisher
            g.launch(stream.ptr)
            return False
        return pub.launch(g, device, stream.ptr, items or (), nbytes)

    def publishing_graph(self, stream: Any, device: int, queue: Any, pub: Publisher | None) -> Any:
        """``graph`` of ``queue``'s work followed, with ``pub`` and a free cell, by the kernel that
        publishes the cell (transports/cuda_publish.py; the graph's ``cell``, filled before each launch)."""
        cell = pub.take() if pub is not None else None
        if cell is None or pub is None:
            return self.graph(stream, device, queue)
        pub.prepare(device)

        def queue_and_publish() -> None:
            queue()
            pub.queue(cell, device, stream.ptr)

        g = self.graph(stream, device, queue_and_publish)
        if g is None:
            pub.put(cell)
        else:
            g.cell = cell
        return g

    def graph(self, stream: Any, device: int, queue: Any) -> Any:
        """``queue``'s work on ``stream`` and an event of its own as a graph (transports/cuda_driver.py),
        or None where capturing fails (then never again in this process: direct calls work)."""
        with self.cp.cuda.Device(device):
            ev = self.cp.cuda.Event(block=False, disable_timing=True)
        try:
            g = self.drv.capture(stream.ptr, queue, ev)
        except SystemError_ as exc:
            self.graphs_ok = False
            _log.warning("CUDA graphs unavailable, launching directly from now on: %s", exc)
            return None
        with self.lock:   # deregister retires them
            self.live_graphs.add(g)
        return g

    def free(self) -> None:
        self.on_retire = None   # at exit: nothing armed is started any more
        self.order.release()   # no stream of ours waits any longer for a store that will not come
        for s in self.streams.values():
            s.synchronize()   # at exit only: nothing may still read a handle closed below, or write a slot
        self.pending.clear()
        with self.lock:
            for raw, entry in self.opened.items():
                self.retired.append(("mem", entry))
            self.opened.clear()
            self.mem.clear()
            self.retired.extendleft(("graph", g) for g in self.live_graphs)
            self.live_graphs.clear()
            self.plans.clear()
            self.graphs.clear()
        self.close_retired()
        if self.publisher is not None:   # after the graphs whose kernels read its cells
            self.publisher.close()
            self.publisher = None
        if self.host_slots is not None:
            self.host_slots.close()
            self.host_slots = None

    def describe(self) -> dict:
        """For the dump: the GPUs this process holds a context, mappings or streams on."""
        with self.lock:
            opened = self.opened.values()
            devices = ({e[2] for e in opened} | {d for e in opened for d, b in e[3].items() if b}
                       | set(self.streams))
            return {"devices": sorted(devices), "opened_allocations": len(self.opened),
                    "peer_mappings": sum(1 for e in opened for b in e[3].values() if b),
                    "opened_bytes": sum(size for _h, size, _d in self.mem.values()),
                    "ranks_waited_on": self.order.waited_on(),
                    "copies_in_flight": len(self.pending), "handles_to_close": len(self.retired),
                    "graphs": len(self.live_graphs), "planned_reductions": len(self.plans),
                    "gpu_publishes_completions": self.publisher.devices() if self.publisher else []}
