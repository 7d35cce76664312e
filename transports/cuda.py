"""cuda transport: device memory of ranks on one node, moved by the progress process's GPU streams.

Like NCCL's copy-engine mode: the progress process maps each rank's device allocations (CUDA IPC
memory handles, opened once and cached by handle) and copies between them with cudaMemcpyAsync on
a stream of its own per device; ranks that share a GPU get a same-device copy, ranks on different GPUs
a peer copy. A host buffer on one side (a numpy array sent to a device array) is the host mapping the
engine holds, copied with the same call.

Ranks on different GPUs (``address``, ``on=``). An IPC handle is mapped into the context of the
device current when it is opened, and a pointer is usable by the work of that context only. So an
allocation is opened first in its own device's context (at registration: a bad handle fails there),
and again, on first use, in the context of each other device whose stream copies from it or whose
kernel reads it, with cudaIpcMemLazyEnablePeerAccess, which enables that device's peer access to
the allocation's (NCCL opens its peers' buffers the same way). Where two GPUs have no peer access, a
copy between them uses the allocation's own mapping and the driver stages it; a reduction across
them is refused (InvalidUsage), since no kernel can read both.

Nothing of CUDA exists in a progress process until a rank registers device memory: cupy is imported
and a context created then (``Gpu``, transports/cuda_gpu.py), so host-only jobs pay nothing.

Order and completion (NCCL's stream semantics): a device op whose rank's stream had work queued at
post time carries FLAG_STREAM_WORD, and that stream stores the request's sequence number into a word
of its completion slot once the work is done (shmproxy.rank.device); the copy stream waits for the
words of both ops before it copies, unless they hold their values already (transports/cuda_order.py).
After the copies the transport records an event of its own and the message's one sub is done when
that event is (polled by ``proxy_progress``, never a device-wide
synchronize), so a request completes with its bytes in place. A repeated copy runs as a graph that
also publishes the requests itself, a kernel storing each one's completion word behind the copy
(transports/cuda_publish.py), so a rank spinning in Wait returns as the copy ends, not when the loop
next polls the event; the event still tells the loop when the sub is done (it then only counts the
requests and wakes any rank asleep). These per-op calls go to the CUDA driver directly
(transports/cuda_driver.py); the loop thread keeps the device's context current.

Registrations (``proxy_register``, on the loop thread, before the REGISTER is answered) are of
the rank's allocations, ``info`` ``{"handle": hex}`` (the op names offsets from the start). A dropped
registration is closed by the loop once no copy is in flight; everything left is closed at
exit (``proxy_free``). Collectives on device memory (``proxy_start_coll``) are transports/cuda_coll.py's,
on the same streams.
"""
from __future__ import annotations

from typing import Any

from shmproxy.core.errors import InternalError, InvalidArgument
from shmproxy.transports.base import (Connector, MemKind, OneProcessSides, PeerInfo, Registration, Transport,
                                      TransportContext)
from shmproxy.transports import cuda_coll
from shmproxy.transports.cuda_gpu import Gpu
from shmproxy.transports.cuda_publish import Repeat


class CudaTransport(OneProcessSides, Transport):   # allocations are opened here at registration
    name = "cuda"
    kinds = frozenset({MemKind.CUDA})

    def __init__(self) -> None:
        self.gpu: Gpu | None = None

    def _gpu(self, ctx: TransportContext) -> Gpu:
        if self.gpu is None:
            p = ctx.params
            self.gpu = Gpu(ctx.completion_slots(), bool(p.CUDA_GRAPHS), bool(p.CUDA_DEVICE_COMPLETES),
                           int(p.CUDA_DEVICE_COMPLETES_MIN), bool(p.CUDA_FUSED_REDUCE))
            self.gpu.on_retire = ctx.disarm_routes
        return self.gpu

    def can_connect(self, me: PeerInfo, peer: PeerInfo, kind: MemKind) -> bool:
        return kind == MemKind.CUDA and me.host == peer.host

    def proxy_describe(self, ctx: TransportContext) -> dict:  # type: ignore[override]
        """For the dump: the GPUs this process holds something on (empty before the first GPU buffer)."""
        return self.gpu.describe() if self.gpu is not None else {}

    def proxy_register(self, ctx: TransportContext, reg: Registration) -> None:  # type: ignore[override]
        if not isinstance(reg.info, dict) or "handle" not in reg.info:
            raise InvalidArgument(f"REGISTER of cuda memory (device {reg.device}) by rank {reg.rank}: needs "
                                  f"an IPC handle ('info': {{'handle': hex}})")
        self._gpu(ctx).register(reg)

    def proxy_deregister(self, ctx: TransportContext, reg: Registration) -> None:  # type: ignore[override]
        if self.gpu is not None:
            self.gpu.deregister(reg)
            ctx.post_event(self.gpu.close_retired)

    def proxy_start(self, ctx: TransportContext, conn: Connector, transfer: Any) -> bool:
        n = transfer.nbytes
        send, recv = transfer.send, transfer.recv
        if not n:
            return True   # nothing to move, nothing to order
        gpu = self.gpu
        if gpu is None:
            raise InvalidArgument(f"{send.describe()} -> {recv.describe()}: device memory that was never "
                                  f"registered")
        key = (send.owner, send.buf_id, send.offset, send.mem, recv.owner, recv.buf_id, recv.offset, recv.mem, n)
        route = gpu.routes.get(key)
        if route is None or route[0] != gpu.gen:
            route = gpu.route(ctx, key, send, recv, n)
        gen, src, dst, device, on_device = route
        stream = gpu.ordered_stream(device, (send, recv))
        pub = gpu.publishing() if on_device and gpu.publishes(n) else None
        ev, owner, transfer.published = gpu.copy(dst, src, n, device, stream, on_device,
                                                 (ctx.completion_items(transfer) or ()) if pub is not None else None)
        if transfer.published:   # what an armed route would launch next time (proxy_repeat)
            gpu.last_launch = (owner, device, stream.ptr, gen)
        args = ctx.args_for(conn, send.opcount)
        sub = ctx.add_sub(args, transfer, src, dst, n, n)   # one step: the copy
        sub.posted = 1
        gpu.watch(sub.slot, device, ev, owner)
        return False

    def proxy_progress(self, ctx: TransportContext, args: Any) -> bool:
        gpu = self.gpu
        if gpu is None:
            raise InternalError("cuda transport progressed before any device memory was registered")
        all_done = True
        for s in args.subs:
            if s.done == s.nsteps:
                continue
            before = (s.posted, s.done)
            if gpu.poll(s.slot):
                s.transmitted = s.received = s.done = s.nsteps
            all_done &= ctx.settle(s, before)
        if gpu.retired and not gpu.pending:
            gpu.close_retired()
        return all_done

    def proxy_start_coll(self, ctx: TransportContext, ops: list) -> None:
        """A collective on device memory, every local rank's op in: queued whole (cuda_coll.py)."""
        cuda_coll.start(ctx, self, self.gpu, ops)

    # A device collective is one sub whose copies and kernels end with one event (cuda_coll.py).
    proxy_progress_coll = proxy_progress

    def proxy_repeat(self, ctx: TransportContext, transfer: Any) -> Any:
        """The launch of ``transfer`` (just started, published by its graph), for arming its route
        (proxy/engine/armed.py): a Repeat, or None."""
        gpu = self.gpu
        got = gpu.last_launch if gpu is not None else None
        if gpu is None or got is None or not transfer.published:
            return None
        gpu.last_launch = None
        return Repeat(gpu, *got)

    def proxy_fired(self, ctx: TransportContext, conn: Connector, transfer: Any, rep: Repeat, token: int,
                    rc: int) -> None:
        """An armed route fired: C launched ``rep``'s graph for ``transfer`` with ``token`` (CUresult
        ``rc``). What proxy_start does after its launch: the graph is busy with that run, and the
        message's one sub ends with it."""
        gpu, g = self._gpu(ctx), rep.graph   # made by the launch that armed the route
        if rc:
            gpu.drv.fail("cuGraphLaunch", rc)
        g.busy = True
        g.token = token
        n = transfer.nbytes
        sub = ctx.add_sub(ctx.args_for(conn, transfer.send.opcount), transfer, 0, 0, n, n)
        sub.posted = 1
        gpu.watch(sub.slot, rep.device, g.event, g)

    def proxy_watch(self, ctx: TransportContext) -> list | None:  # type: ignore[override]
        """The ack words of the publishing graphs in flight (transports/cuda_publish.py), with the token
        each will hold; None while other work is, whose end only an event query shows."""
        gpu = self.gpu
        pub = gpu.publisher if gpu is not None else None
        if gpu is None or pub is None:
            return None
        words = []
        for _device, _ev, owner, token in gpu.pending.values():
            if owner is None or owner is True or owner.cell is None:
                return None
            words.append((pub.ack_word(owner.cell), token))
        return words

    def proxy_free(self, ctx: TransportContext) -> None:
        if self.gpu is not None:
            self.gpu.free()
