"""Collectives on device memory: the GPU executor, and how the cuda transport starts one.

The simplest honest path, beside the host's chunk schedules: once every local rank's op of a
collective has arrived and one of them names device memory, the engine hands the collective to the
transport of that memory (``proxy_start_coll``, transports/base.py), which queues it whole on its
stream of that device (``start``, through the TransportContext only): the stream waits on each
rank's post-time event, then the executor queues the copies (cudaMemcpyAsync) and reductions (cupy
ufuncs writing with ``out=`` into the destination, no temporaries) in the same order as the host
algorithms, and records one event. The collective is one sub of one args of the cuda transport,
done when that event is (its ``proxy_progress_coll`` polls it), so the GPU runs the whole collective
back to back while the loop goes on with other work. Not chunked: a device collective is one
stream of work, and the copy engines and SMs pipeline it themselves.

An Allreduce or Reduce is one fused kernel of our own instead, at every size (CUDA_FUSED_REDUCE;
not for float16, complex, bool or bfloat16, nor more than FUSED_MAX_RANKS ranks): it reads every
input and writes every output once, where ufuncs and copies move the result a second time, and
from 16 MiB on it ran at 1.3-1.4x their bandwidth (BENCHMARKS.md). Its launch is remembered as a
``_Plan`` under the ops' buffers and shape: the next collective on the same buffers (a training
loop's) skips resolving them, and from its second run the plan is a CUDA graph, one launch call with
its end event (transports/cuda.py has why; a dropped registration forgets every plan).

Reductions go in rank order (the root's input first for Reduce), into one output that is then copied
to the other ranks' outputs (the fused kernel stores the one result into each), so every rank gets
the same bits, as on the host. bfloat16 (which cupy
lacks; the record's DTYPE_BFLOAT16) is reduced as 16-bit words by kernels of our own that widen each
pair to float32, combine, and round back to nearest even, step by step as torch's bfloat16 ops do.
Every rank's buffers must be device memory: a collective whose ranks mix host and device buffers is
refused (InvalidArgument on every rank). A small blocking Bcast never comes here: its ranks run it
between themselves through host copies (shmproxy.rank.fastpath), where host and device ranks mix.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable

import numpy as np

from shmproxy.coll import sched
from shmproxy.core import errors, log
from shmproxy.core.kernels import AVG_FINISH, C_TYPES, REDUCE_EXPR
from shmproxy.core.memory import MemKind, mem_device, mem_kind
from shmproxy.core.ops import CODE_DTYPE, DTYPE_BFLOAT16, FLAG_IN_PLACE, FLAG_NO_RECV, Coll, Op, ReduceOp
from shmproxy.transports import cuda_coll_vector
from shmproxy.transports.cuda_bf16 import BF16_PREAMBLE
from shmproxy.transports.cuda_publish import CELL_PAIRS

if TYPE_CHECKING:
    from shmproxy.transports.base import Transport, TransportContext

_log = log.get("COLL")
_UFUNC_NAMES: dict[int, str] = {ReduceOp.SUM: "add", ReduceOp.PROD: "multiply", ReduceOp.MIN: "minimum",
                                ReduceOp.MAX: "maximum", ReduceOp.AVG: "add"}
# x, y: the two float32 operands (NaN propagates through MIN and MAX, as in torch)
_BF16_EXPR: dict[int, str] = {ReduceOp.SUM: "x + y", ReduceOp.AVG: "x + y", ReduceOp.PROD: "x * y",
                              ReduceOp.MIN: "(x != x || x < y) ? x : y", ReduceOp.MAX: "(x != x || x > y) ? x : y"}
_bf16_kernels: dict = {}


def bf16_kernel(cp: Any, redop: int) -> Any:
    """The cached elementwise kernel of one bfloat16 reduction (redop -1: divide by a float32)."""
    k = _bf16_kernels.get(redop)
    if k is None:
        if redop == -1:
            k = cp.ElementwiseKernel("uint16 a, float32 d", "uint16 o", "o = bf16_out(bf16_in(a) / d)",
                                     "shmproxy_bf16_div", preamble=BF16_PREAMBLE)
        else:
            body = f"float x = bf16_in(a), y = bf16_in(b); o = bf16_out({_BF16_EXPR[redop]})"
            k = cp.ElementwiseKernel("uint16 a, uint16 b", "uint16 o", body,
                                     f"shmproxy_bf16_{ReduceOp(redop).name.lower()}", preamble=BF16_PREAMBLE)
        _bf16_kernels[redop] = k
    return k


# Small reductions (Allreduce, Reduce): one kernel launch of our own, every input read and every output
# written by it, instead of cupy ufuncs over fresh views and a copy per further rank. For a small
# message the progress process's Python per launch is most of the cost, not the GPU.
FUSED_MAX_RANKS = 16           # kernels are written out per count of buffers: bounded
_FUSED_SRC = r"""
extern "C" __global__ void shmproxy_fused(%(params)s, long long n) {
    for (long long k = (long long)blockIdx.x * blockDim.x + threadIdx.x; k < n;
         k += (long long)blockDim.x * gridDim.x) {
        T a = ((const T*)i0)[k], b;
%(steps)s
%(finish)s
%(stores)s
    }
}
"""
_fused_kernels: dict = {}
_fused_launches: dict = {}   # (redop, dtype char, inputs, outputs, device) -> its driver Launch
_FUSED_BLOCK = 256
PLANS_MAX = 256                # fused launches remembered per progress process (see _Plan)
_PLANNED_FLAGS = FLAG_IN_PLACE | FLAG_NO_RECV


def fused_kernel(cp: Any, redop: int, dtype: Any, nin: int, nout: int) -> Any:
    """The cached fused reduction kernel of (redop, dtype, inputs, outputs), or None where it has none
    (see above). Written out per count of buffers, so that a launch passes only their pointers; in
    place, an output aliases an input at the same index only, which its thread has read already."""
    key = (redop, dtype.name, nin, nout)
    k = _fused_kernels.get(key)
    if k is None and dtype.name in C_TYPES:
        params = ", ".join([f"unsigned long long i{r}" for r in range(nin)] +
                           [f"unsigned long long o{r}" for r in range(nout)])
        expr = REDUCE_EXPR[redop]
        steps = "\n".join(f"        b = ((const T*)i{r})[k]; a = {expr};" for r in range(1, nin))
        stores = "\n".join(f"        ((T*)o{r})[k] = a;" for r in range(nout))
        finish = "        " + AVG_FINISH % nin if redop == ReduceOp.AVG else ""
        src = f"typedef {C_TYPES[dtype.name]} T;\n" + _FUSED_SRC % {
            "params": params, "steps": steps, "finish": finish, "stores": stores}
        k = _fused_kernels[key] = cp.RawKernel(src, "shmproxy_fused")
    return k


class GpuExecutor:
    """Copies and reductions on device memory, queued on one stream; views over raw addresses."""

    name = "cuda"

    def __init__(self, gpu: Any, stream: Any, device: int, bf16: bool = False):
        self.cp, self.drv, self.stream, self.device, self.bf16 = gpu.cp, gpu.drv, stream, device, bf16

    def view(self, addr: int, count: int, dtype: Any) -> Any:
        """A cupy array over ``count`` elements at ``addr`` (an opened allocation): no copy, no owner."""
        cp = self.cp
        mem = cp.cuda.UnownedMemory(addr, count * dtype.itemsize, None, self.device)
        return cp.ndarray((count,), dtype, cp.cuda.MemoryPointer(mem, 0))

    def copy(self, dst: int, src: int, nbytes: int) -> None:
        if nbytes and dst != src:
            self.drv.memcpy(dst, src, nbytes, self.stream.ptr)

    def reduce(self, redop: int, dtype: Any, count: int, ins: list[int], out: int, nranks: int) -> None:
        """out = ins[0] op ins[1] op ... (in that order); AVG divides by ``nranks`` after."""
        cp = self.cp
        ufunc = bf16_kernel(cp, redop) if self.bf16 else getattr(cp, _UFUNC_NAMES[redop])
        o = self.view(out, count, dtype)
        with self.stream:
            if len(ins) == 1:
                self.copy(out, ins[0], count * dtype.itemsize)
            elif self.bf16:
                ufunc(self.view(ins[0], count, dtype), self.view(ins[1], count, dtype), o)
                for x in ins[2:]:
                    ufunc(o, self.view(x, count, dtype), o)
            else:
                ufunc(self.view(ins[0], count, dtype), self.view(ins[1], count, dtype), out=o)
                for x in ins[2:]:
                    ufunc(o, self.view(x, count, dtype), out=o)
            if redop == ReduceOp.AVG and self.bf16:
                bf16_kernel(cp, -1)(o, np.float32(nranks), o)
            elif redop == ReduceOp.AVG:
                cp.true_divide(o, nranks, out=o, casting="unsafe")


class _Plan:
    """A small reduction's kernel launch, remembered by its ops' buffers and shape (``plan_key``): the
    next collective on the same buffers, the common case of a training loop, skips resolving and
    checking them again. Valid while no registration was dropped (``gen``)."""

    __slots__ = ("gen", "launch", "values", "grid", "device", "nbytes", "graph", "runs")

    def __init__(self, gen: int, launch: Any, values: tuple, grid: int, device: int, nbytes: int):
        self.gen, self.launch, self.values, self.grid, self.device, self.nbytes = (gen, launch, values, grid,
                                                                                   device, nbytes)
        self.graph: Any = None   # from its second run: the launch and its end event as one CUDA graph
        self.runs = 0

    def queue(self, stream: int) -> None:
        self.launch.set(self.values)
        self.launch(self.grid, _FUSED_BLOCK, stream)


def plan_key(ops: list[Op]) -> tuple:
    """What a fused launch depends on, per op: everything but the stream-event flag."""
    return tuple((op.coll, op.dtype, op.count, op.redop, op.peer, op.mem, op.flags & _PLANNED_FLAGS, op.buf_id,
                  op.offset, op.buf2_id, op.offset2) for op in ops)


def _fused_plan(gpu: Any, redop: int, dtype: Any, count: int, ins: list[int], outs: list[int], device: int,
                nbytes: int) -> _Plan | None:
    """outs[*] = ins[0] op ins[1] op ... in one kernel (AVG: divided by len(ins)); None where the fused
    path does not apply (dtype, ranks)."""
    if len(ins) > FUSED_MAX_RANKS or len(outs) > FUSED_MAX_RANKS:
        return None
    key = (redop, dtype.char, len(ins), len(outs), device)
    launch = _fused_launches.get(key)
    if launch is None:
        k = fused_kernel(gpu.cp, redop, dtype, len(ins), len(outs))
        if k is None:
            return None
        gpu.use(device)   # the kernel is loaded into the current context
        launch = _fused_launches[key] = gpu.drv.launcher(k.kernel.ptr, len(ins) + len(outs) + 1)
    return _Plan(gpu.gen, launch, (*ins, *outs, count), min((count + _FUSED_BLOCK - 1) // _FUSED_BLOCK, 1024),
                 device, nbytes)


def _run_plan(ctx: "TransportContext", t: "Transport", gpu: Any, ops: list[Op], plan: _Plan) -> None:
    device = plan.device
    stream = gpu.ordered_stream(device, ops)
    if plan.graph is None and plan.runs and gpu.graphs_ok:   # repeated: worth a capture (cuda.py copy)
        pub = gpu.publishing() if gpu.publishes(plan.nbytes) and len(ops) <= CELL_PAIRS else None
        plan.graph = gpu.publishing_graph(stream, device, lambda: plan.queue(stream.ptr), pub)
    plan.runs += 1
    g = plan.graph
    if g is not None and not g.busy:   # in flight still (nonblocking calls): queued directly, below
        # a graph with a cell publishes the ranks' requests (transports/cuda_publish.py)
        published = gpu.launch_graph(g, device, stream, ctx.coll_items(ops), plan.nbytes)
        _watch(ctx, t, gpu, ops, plan.nbytes, [], device, g.event, g, published)
    else:
        plan.queue(stream.ptr)
        _watch(ctx, t, gpu, ops, plan.nbytes, [], device, gpu.end_event(device, stream))


def start(ctx: "TransportContext", t: "Transport", gpu: Any, ops: list[Op]) -> None:
    """Queue a collective on device memory (see the module header) with ``gpu``, the state of ``t``,
    the cuda transport (None: no device memory was registered); its requests fail, nothing moved,
    when a buffer is wrong."""
    try:
        plan = gpu.plans.get(plan_key(ops)) if gpu is not None and gpu.plans else None
        if plan is not None and plan.gen == gpu.gen:
            _run_plan(ctx, t, gpu, ops, plan)
        else:
            _start(ctx, t, gpu, ops)
    except errors.ProxyError as exc:
        ctx.refuse_coll(ops, exc.code)
        _log.warning("device collective #%d refused: %s", ops[0].coll_seq, exc)


def _check_registered(gpu: Any) -> None:
    if gpu is None:
        raise errors.InvalidUsage("a collective on device memory, but no rank registered device memory with "
                                  "this progress process")


def _start(ctx: "TransportContext", t: "Transport", gpu: Any, ops: list[Op]) -> None:
    op0 = ops[0]
    c, n, size = op0.coll, op0.count, len(ops)
    bf16 = op0.dtype == DTYPE_BFLOAT16
    dt = np.dtype(np.uint16) if bf16 else CODE_DTYPE.get(op0.dtype)
    if dt is None:
        raise errors.InvalidArgument(f"{op0.describe()}: unknown dtype code {op0.dtype}")
    hosts = [op.rank for op in ops if mem_kind(op.mem) != MemKind.CUDA]
    if hosts:
        raise errors.InvalidArgument(f"{op0.describe()}: ranks {hosts} passed host buffers where other ranks "
                                     f"passed device memory; a collective takes one kind on every rank")
    if c in cuda_coll_vector.COLLS:
        _start_vector(ctx, t, gpu, ops, dt, bf16)
        return
    blk = n * dt.itemsize
    if not blk and c != Coll.BARRIER:   # nothing to move, nothing to order
        ctx.complete_coll(ops, 0)
        return
    _check_registered(gpu)
    in_place = [bool(op.flags & FLAG_IN_PLACE) for op in ops]
    device = mem_device(op0.mem)   # where the whole collective runs (_queue): every buffer mapped there
    kernel = c in (Coll.ALLREDUCE, Coll.REDUCE, Coll.REDUCE_SCATTER_BLOCK)

    def addr(op: Op, second: bool, nbytes: int) -> int:   # second: the receive buffer
        return gpu.address(ctx, op, second, nbytes, device, kernel)

    # Every address resolved and bounds-checked before anything is queued.
    if c == Coll.ALLREDUCE:
        outs = [addr(op, True, blk) for op in ops]
        ins = [o if ip else addr(op, False, blk) for op, o, ip in zip(ops, outs, in_place)]
        total = blk
    elif c == Coll.REDUCE:
        root = op0.peer
        out = addr(ops[root], True, blk)
        ins = [out if ip else addr(op, False, blk) for op, ip in zip(ops, in_place)]
        total = blk
    elif c == Coll.BCAST:
        bufs = [addr(op, True, blk) for op in ops]
        total = blk
    elif c in (Coll.ALLGATHER, Coll.ALLTOALL, Coll.REDUCE_SCATTER_BLOCK):
        full = blk * size
        total = full
        if c == Coll.ALLGATHER:
            outs = [addr(op, True, full) for op in ops]
            ins = [o + r * blk if ip else addr(op, False, blk)
                   for r, (op, o, ip) in enumerate(zip(ops, outs, in_place))]
        elif c == Coll.ALLTOALL:
            ins = [addr(op, False, full) for op in ops]
            outs = [addr(op, True, full) for op in ops]
        else:
            if any(in_place) and not all(in_place):
                raise errors.InvalidUsage("Reduce_scatter_block: IN_PLACE must be used by every rank or none")
            if in_place[0]:
                ins = [addr(op, True, full) for op in ops]
                outs = list(ins)
            else:
                ins = [addr(op, False, full) for op in ops]
                outs = [addr(op, True, blk) for op in ops]
    else:
        raise errors.InvalidArgument(f"{op0.describe()}: collective {c} has no device path")
    if c in (Coll.REDUCE, Coll.ALLREDUCE, Coll.REDUCE_SCATTER_BLOCK):
        sched.check_op(op0.redop, np.dtype(np.float32) if bf16 else dt)
    if c in (Coll.REDUCE, Coll.ALLREDUCE):
        if c == Coll.REDUCE:   # in rank order from the root
            ins = [ins[op0.peer]] + [x for r, x in enumerate(ins) if r != op0.peer]
            outs = [out]
        plan = None if bf16 or not gpu.fused else _fused_plan(gpu, op0.redop, dt, n, ins, outs, device, total)
        if plan is not None:
            if len(gpu.plans) >= PLANS_MAX:
                gpu.plans.clear()
            gpu.plans[plan_key(ops)] = plan
            _run_plan(ctx, t, gpu, ops, plan)
            return

    def body(x: GpuExecutor, keep: list) -> None:
        if c == Coll.ALLREDUCE:
            x.reduce(op0.redop, dt, n, ins, outs[0], size)
            for o in outs[1:]:
                x.copy(o, outs[0], blk)
        elif c == Coll.REDUCE:
            x.reduce(op0.redop, dt, n, ins, out, size)
        elif c == Coll.BCAST:
            for r, b in enumerate(bufs):
                if r != op0.peer:
                    x.copy(b, bufs[op0.peer], blk)
        elif c == Coll.ALLGATHER:
            for r, src in enumerate(ins):
                for o in outs:
                    x.copy(o + r * blk, src, blk)
        elif c == Coll.ALLTOALL:
            for q, o in enumerate(outs):
                for r, src in enumerate(ins):
                    x.copy(o + r * blk, src + q * blk, blk)
        else:   # Reduce_scatter_block; in place, rank d's result goes to block 0 of its buffer, which
            # only rank 0's result reads: rank 0's is computed first
            for d, o in enumerate(outs):
                x.reduce(op0.redop, dt, n, [src + d * blk for src in ins], o, size)
    _queue(ctx, t, gpu, ops, bf16, total, body)


def _start_vector(ctx: "TransportContext", t: "Transport", gpu: Any, ops: list[Op], dt: Any, bf16: bool) -> None:
    """The rooted, vector and prefix collectives (transports/cuda_coll_vector.py), their counts checked
    between the ranks by the engine already, as on the host: planned and queued."""
    op0 = ops[0]
    if op0.coll in (Coll.REDUCE_SCATTER, Coll.SCAN, Coll.EXSCAN):
        sched.check_op(op0.redop, np.dtype(np.float32) if bf16 else dt)
        if op0.redop == ReduceOp.AVG and op0.coll != Coll.REDUCE_SCATTER:
            raise errors.InvalidArgument(f"{op0.describe()}: AVG is not defined for a prefix reduction")
    _check_registered(gpu)
    planned = cuda_coll_vector.plan(ctx, ops, gpu, dt)
    if planned is None:   # nothing to move, nothing to order
        ctx.complete_coll(ops, 0)
        return
    _queue(ctx, t, gpu, ops, bf16, planned[0], planned[1])


def _queue(ctx: "TransportContext", t: "Transport", gpu: Any, ops: list[Op], bf16: bool, total: int,
           body: Callable[[GpuExecutor, list], None]) -> None:
    """Queue ``body`` on the stream of the ops' device after every rank's post-time event, then the
    collective's end event, and watch it."""
    op0 = ops[0]
    device = mem_device(op0.mem)
    stream = gpu.ordered_stream(device, ops)
    x = GpuExecutor(gpu, stream, device, bf16)
    keep: list = []   # device scratch, alive until the collective is done
    body(x, keep)
    _watch(ctx, t, gpu, ops, total, keep, device, gpu.end_event(device, stream))


def _watch(ctx: "TransportContext", t: "Transport", gpu: Any, ops: list[Op], total: int, keep: list, device: int,
           ev: Any, owner: Any = None, published: bool = False) -> None:
    """The queued collective as one sub of one args of the cuda transport, done with ``ev`` (``owner``:
    the graph whose own event it is, transports/cuda.py ``watch``; ``published``: by that graph)."""
    sub = ctx.coll_sub(t, ops, total, keep, published)
    gpu.watch(sub.slot, device, ev, owner)
