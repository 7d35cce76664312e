"""ProcessGroupShmproxy: a torch.distributed process group (torch's Python trampoline,
``dist.ProcessGroup`` subclassed in Python) over one shmproxy communicator.

Every torch call validates its tensors, posts the communicator's nonblocking requests and returns a
Work at once (ops.py builds the requests, work.py completes them); ``async_op=False`` is torch
calling ``wait()`` on that Work. So the progress process moves a DDP bucket while backward computes.
Small CPU calls on one node take the ranks' fast path instead: blocking collectives run directly
("Blocking calls"), sends go through a cell, receives wait for their message themselves
("Point-to-point").
CUDA tensors take the same path with torch's stream order (cuda.py); one call's tensors are all CPU
or all on one CUDA device.

Thread safety: torch may call a process group from several threads (DDP's reducer posts allreduces
from autograd threads, the completer tests requests). A shmproxy Comm is used by one thread at a
time, so each group has one lock (``self.lock``, reentrant): posting (including a whole
``comm.group()`` of coalesced requests) and testing requests take it; nobody holds it while waiting.
The completer sleeps without it (work.py), so posting is never delayed by a wait.

Which torch calls reach this class: torch.distributed's Python functions call the group's methods
by name, so every method below serves them (reduce, gather, scatter, alltoall, recv_anysource
included); C++ callers (DDP's reducer, ``_broadcast_coalesced``, ``_verify_params_across_processes``)
reach allreduce, broadcast, allgather, barrier and the rest that torch's trampoline forwards.
"""
from __future__ import annotations

import atexit
import functools
import threading
import weakref
from datetime import timedelta
from typing import Any, Callable, Sequence

import torch
import torch.distributed as dist

import shmproxy
from shmproxy.core import errors
from shmproxy.torch import cuda, ops
from shmproxy.torch.tensors import Adopter, Staged, StagePool, alloc_tensor, check_tensor
from shmproxy.torch.work import SMALL_WAIT_BYTES, Completed, Completer, Work

BACKEND_NAME = "shmproxy"
# A failed communicator: the call's Work fails (as gloo's and NCCL's report it) instead of the call
# raising; DDP's reducer posts from an autograd hook and is not made to survive a throw there.
GROUP_FAILED = (errors.PeerDiedError, errors.Aborted, errors.Closed, errors.Timeout)


def _stop_at_exit(ref: "weakref.ref[ProcessGroupShmproxy]") -> None:
    pg = ref()
    if pg is not None:
        pg.completer.stop()
        pg.completer.thread.join(pg.timeout_s)


class ProcessGroupShmproxy(dist.ProcessGroup):
    """A process group whose collectives and messages run on shmproxy's progress process."""

    def __init__(self, comm: shmproxy.Comm, rank: int, size: int, timeout: timedelta, label: str = ""):
        super().__init__(rank, size)  # type: ignore[call-arg]  # the (rank, size) form torch keeps for Python backends
        self.comm = comm
        self.timeout_s = timeout.total_seconds() if isinstance(timeout, timedelta) else float(timeout)
        self.group_label = label or f"r{rank}"
        self.lock = threading.RLock()
        self.adopter = Adopter(comm, comm.params.TORCH_ADOPT)
        self.stage_pool = StagePool(comm, comm.params.STAGING_CACHE)
        self.side_streams = cuda.SideStreams()    # the completion thread's copies back
        self.kernel_streams = cuda.SideStreams()  # async calls' kernels of the ranks' own (ops.allreduce_on_gpus)
        self.order_streams = cuda.SideStreams()   # where CUDA Futures complete (Work._stream_future)
        self.completer = Completer(self)
        self.direct = bool(comm.params.TORCH_BLOCKING_DIRECT)
        # Small CPU messages (send, recv): the ranks' fast path, up to its cell size, and receives
        # deferred only where a send of that size completes without its receive (buffered).
        self.eager_bytes = comm._fast_bytes if self.direct else 0
        self.defer_bytes = min(self.eager_bytes, comm.params.SEND_BUFFER_BYTES)
        self.deferred_recv: Work | None = None   # the one receive not posted yet (recv, "Deferred")
        # Registered after the Comm's own exit hook, so it runs first (atexit is last-in, first-out):
        # the completion thread stops touching the communicator before the Comm is closed.
        atexit.register(_stop_at_exit, weakref.ref(self))

    # ---- identity ---------------------------------------------------------------------------------
    def getBackendName(self) -> str:
        return BACKEND_NAME

    def name(self) -> str:  # type: ignore[override]
        return BACKEND_NAME

    # What torch reads of a device's backend: this group has no per-device backends (a Python
    # process group is used as it is: torch registers none for it), so it answers for itself.
    supports_coalescing = False   # batch_isend_irecv then posts each op alone (NCCL's coalescing is not ours)
    supports_splitting = False
    supports_time_estimate = False

    # The group's name and description, which torch sets at creation and reads back (DeviceMesh, and
    # so FSDP2's fully_shard, finds a group by its name). A C++ ProcessGroup keeps them on its
    # per-device backends, of which a Python group has none: there ``group_name`` raised "ProcessGroup
    # name not set" however often torch set it. Kept here instead.
    _shm_group_name = ""
    _shm_group_desc = ""

    def _set_group_name(self, name: str) -> None:  # type: ignore[override]
        self._shm_group_name = name

    def _set_group_desc(self, desc: str) -> None:  # type: ignore[override]
        self._shm_group_desc = desc

    @property
    def group_name(self) -> str:  # type: ignore[override]
        if not self._shm_group_name:
            raise RuntimeError("ProcessGroup name not set")
        return self._shm_group_name

    @property
    def group_desc(self) -> str:  # type: ignore[override]
        return self._shm_group_desc or "undefined"

    def _get_backend(self, device: Any) -> "ProcessGroupShmproxy":  # type: ignore[override]
        """This group, for every device (CPU and CUDA). torch 2.14's batch_isend_irecv asks any
        ProcessGroup for the backend of the tensors' device, where 2.13 asked plain ProcessGroups
        only; for a Python group the C++ lookup raises ("No backend type associated with device type
        cpu"), so every batch_isend_irecv on a shmproxy group failed there."""
        return self

    def alloc_tensor(self, shape: int | tuple[int, ...], dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """A zeroed CPU tensor in this group's registered shared memory (no staging copy when it is
        sent, received or reduced through this group)."""
        with self.lock:
            return alloc_tensor(self.comm, shape, dtype)

    # ---- posting ----------------------------------------------------------------------------------
    def _post(self, name: str, build: Callable[[Staged], list], result: list[torch.Tensor],
              on_done: Callable[[Work], None] | None = None, inputs: Sequence[Any] = (),
              receive: bool = False) -> Work:
        """Post one torch call (``result``: its outputs, ``inputs``: its other tensors; all on one device)."""
        device = cuda.common_device([*result, *inputs], name)
        stage = (Staged(adopt=self.adopter, pool=self.stage_pool) if device is None else Staged())
        if device is not None:
            cuda.begin(stage, device, self.side_streams)
        finished: list[Work] = []
        try:
            with self.lock:
                finished = self.completer.reap()
                try:
                    reqs = build(stage)
                    if device is not None:
                        cuda.seal(stage)
                except GROUP_FAILED as exc:   # a failed Work, not an exception; bad arguments still raise
                    work = Work(self, name, [], stage, result, on_done, receive)
                    work._fail(exc)
                    return work
                work = Work(self, name, reqs, stage, result, on_done, receive)
                self.completer.add(work)
            return work
        finally:
            for w in finished:   # outside the lock, as the completer completes
                w._complete()

    def _coalesced(self, name: str, builds: Sequence[Callable[[Staged], list]],
                   result: list[torch.Tensor], inputs: Sequence[Any] = ()) -> Work:
        def build(st: Staged) -> list:
            with self.comm.group():
                return [r for b in builds for r in b(st)]
        return self._post(name, build, result, inputs=inputs)

    # ---- blocking calls ---------------------------------------------------------------------------
    # torch says when it will wait on a Work at once: ``opts.asyncOp`` is False for a blocking call
    # made through torch.distributed's Python functions (True by default, so C++ callers such as DDP's
    # reducer, and torch releases without the field, keep the posted path). Such a call of small CPU
    # tensors (not bfloat16, which reduces through float32 temporaries) runs the communicator's
    # *blocking* call here, under the group's lock (for these sizes microseconds, as
    # Work._finish_here's wait), and returns a Completed Work: on one node that is the ranks' fast
    # path (a few µs), where posting it meant a trip through the progress process and a Work and an
    # Event per call. The cost of the choice: a blocking
    # collective never matches a nonblocking one (MPI's rule), so ranks must agree on async_op for
    # these calls; where they do not, the group fails on every rank with InvalidUsage instead of
    # hanging (TORCH_BLOCKING_DIRECT=0 posts every call).
    def _direct(self, opts: Any, tensors: Sequence[torch.Tensor]) -> bool:
        if not self.direct or getattr(opts, "asyncOp", True):
            return False
        nbytes = 0
        for t in tensors:   # decided by what every rank passes alike (a strided tensor goes through a copy)
            if t.is_cuda or t.dtype == torch.bfloat16:
                return False
            nbytes += t.numel() * t.element_size()
        return nbytes <= SMALL_WAIT_BYTES

    def _run_now(self, name: str, run: Callable[[], object], result: list[torch.Tensor]) -> Completed:
        with self.lock:
            try:
                run()
            except GROUP_FAILED as exc:
                return Completed(name, result, exc)
            except errors.InvalidUsage as exc:
                raise errors.InvalidUsage(
                    f"{exc} (torch: a blocking {name} of small CPU tensors runs as a blocking collective; "
                    "if ranks passed different async_op, make them agree or set "
                    "SHMPROXY_TORCH_BLOCKING_DIRECT=0 on every rank)") from exc
        return Completed(name, result)

    def _on_gpus(self, name: str, run: Callable[[torch.cuda.Stream | None], bool], t: torch.Tensor,
                 opts: Any) -> Completed | None:
        """A call on CUDA tensors (``t`` its result) queued as the ranks' own kernels (``run(side)``;
        False: it is not one), as a completed Work whose Future is the device's; None where the call
        is posted. An async call's kernel runs on a stream of the group's, ``side``, which the
        caller's later kernels overlap (NCCL's); a blocking one's on the current stream (None), which
        waits for it at once anyway."""
        if not t.is_cuda:
            return None
        side = self.kernel_streams.get(t.device) if getattr(opts, "asyncOp", True) else None
        finished: list[Work] = []
        try:
            with self.lock:
                finished = self.completer.reap()
                try:
                    if not run(side):
                        return None
                except GROUP_FAILED as exc:
                    return Completed(name, [t], exc)
        finally:
            for w in finished:   # outside the lock, as the completer completes
                w._complete()
        return Completed(name, [t], device=t.device, stream=side)

    # ---- collectives ------------------------------------------------------------------------------
    # torch's stubs give these overloads of the C++ ProcessGroup (opts or op/timeout forms); its Python
    # trampoline calls a backend with the (tensors, opts) form only, the one written here: hence an
    # ignored [override] on each.
    def allreduce(self, tensors: list[torch.Tensor], opts: Any = None) -> Work | Completed:  # type: ignore[override]
        t = ops.one(tensors, "allreduce")
        op = opts.reduceOp if opts is not None else dist.ReduceOp.SUM
        if self._direct(opts, tensors):
            return self._run_now("allreduce", lambda: ops.allreduce_now(self, t, op), [t])
        done = self._on_gpus("allreduce", lambda side: ops.allreduce_on_gpus(self, t, op, side), t, opts)
        if done is not None:
            return done
        return self._post("allreduce", lambda st: ops.allreduce(self, t, op, st), [t])

    def allreduce_coalesced(self, tensors: list[torch.Tensor], opts: Any = None) -> Work:
        op = opts.reduceOp if opts is not None else dist.ReduceOp.SUM
        for i, t in enumerate(tensors):
            check_tensor(t, f"allreduce_coalesced tensor {i}")
        builds = [functools.partial(ops.allreduce, self, t, op) for t in tensors]
        return self._coalesced("allreduce_coalesced", builds, list(tensors))

    def broadcast(self, tensors: list[torch.Tensor], opts: Any = None) -> Work | Completed:  # type: ignore[override]
        t = ops.one(tensors, "broadcast")
        root = opts.rootRank if opts is not None else 0
        if self._direct(opts, tensors):
            return self._run_now("broadcast", lambda: ops.broadcast_now(self, t, root), [t])
        return self._post("broadcast", lambda st: ops.broadcast(self, t, root, st), [t])

    def reduce(self, tensors: list[torch.Tensor], opts: Any = None) -> Work | Completed:  # type: ignore[override]
        t = ops.one(tensors, "reduce")
        op = opts.reduceOp if opts is not None else dist.ReduceOp.SUM
        root = opts.rootRank if opts is not None else 0
        if self._direct(opts, tensors):
            return self._run_now("reduce", lambda: ops.reduce_now(self, t, op, root), [t])
        return self._post("reduce", lambda st: ops.reduce(self, t, op, root, st), [t])

    def barrier(self, opts: Any = None) -> Work | Completed:
        if self._direct(opts, ()):
            return self._run_now("barrier", self.comm.Barrier, [])
        return self._post("barrier", lambda st: ops.barrier(self, st), [])

    def allgather(self, output_lists: list[list[torch.Tensor]], inputs: list[torch.Tensor],  # type: ignore[override]
                  opts: Any = None) -> Work:
        inp = ops.one(inputs, "allgather")
        if len(output_lists) != 1:
            raise errors.InvalidArgument("shmproxy backend: allgather takes one list of outputs")
        outs = output_lists[0]
        return self._post("allgather", lambda st: ops.allgather_list(self, outs, inp, st), list(outs),
                          inputs=[inp])

    def allgather_coalesced(self, output_lists: list[list[torch.Tensor]], inputs: list[torch.Tensor],
                            opts: Any = None) -> Work:
        if len(output_lists) != len(inputs):
            raise errors.InvalidArgument("shmproxy backend: allgather_coalesced: one output list per input")
        builds = [functools.partial(ops.allgather_list, self, o, i) for o, i in zip(output_lists, inputs)]
        return self._coalesced("allgather_coalesced", builds, [t for o in output_lists for t in o], inputs)

    def all_gather_single(self, out: torch.Tensor, inp: torch.Tensor, opts: Any = None) -> Work | Completed:
        done = self._on_gpus("all_gather_into_tensor", lambda side: ops.all_gather_on_gpus(self, out, inp, side),
                             out, opts)
        if done is not None:
            return done
        return self._post("all_gather_into_tensor", lambda st: ops.all_gather_single(self, out, inp, st),
                          [out], inputs=[inp])

    _allgather_base = all_gather_single  # type: ignore[assignment]

    def all_gather_single_coalesced(self, outs: list[torch.Tensor], ins: list[torch.Tensor],
                                    opts: Any = None) -> Work:
        builds = [functools.partial(ops.all_gather_single, self, o, i) for o, i in zip(outs, ins)]
        return self._coalesced("all_gather_into_tensor_coalesced", builds, list(outs), ins)

    allgather_into_tensor_coalesced = all_gather_single_coalesced  # type: ignore[assignment]

    def reduce_scatter(  # type: ignore[override]
            self, outputs: list[torch.Tensor], input_lists: list[list[torch.Tensor]], opts: Any = None) -> Work:
        out = ops.one(outputs, "reduce_scatter")
        if len(input_lists) != 1:
            raise errors.InvalidArgument("shmproxy backend: reduce_scatter takes one list of inputs")
        ins = input_lists[0]
        op = opts.reduceOp if opts is not None else dist.ReduceOp.SUM
        return self._post("reduce_scatter", lambda st: ops.reduce_scatter_list(self, out, ins, op, st), [out],
                          inputs=ins)

    def reduce_scatter_single(self, out: torch.Tensor, inp: torch.Tensor,
                              opts: Any = None) -> Work | Completed:
        op = opts.reduceOp if opts is not None else dist.ReduceOp.SUM
        done = self._on_gpus("reduce_scatter_tensor",
                             lambda side: ops.reduce_scatter_on_gpus(self, out, inp, op, side), out, opts)
        if done is not None:
            return done
        return self._post("reduce_scatter_tensor",
                          lambda st: ops.reduce_scatter_single(self, out, inp, op, st), [out], inputs=[inp])

    _reduce_scatter_base = reduce_scatter_single  # type: ignore[assignment]

    def reduce_scatter_single_coalesced(self, outs: list[torch.Tensor], ins: list[torch.Tensor],
                                        opts: Any = None) -> Work:
        op = opts.reduceOp if opts is not None else dist.ReduceOp.SUM
        builds = [functools.partial(ops.reduce_scatter_single, self, o, i, op) for o, i in zip(outs, ins)]
        return self._coalesced("reduce_scatter_tensor_coalesced", builds, list(outs), ins)

    reduce_scatter_tensor_coalesced = reduce_scatter_single_coalesced  # type: ignore[assignment]

    def all_to_all_single(self, out: torch.Tensor, inp: torch.Tensor, out_splits: Sequence[int],
                          in_splits: Sequence[int], opts: Any = None) -> Work:
        return self._post("all_to_all_single",
                          lambda st: ops.all_to_all_single(self, out, inp, out_splits, in_splits, st), [out],
                          inputs=[inp])

    alltoall_base = all_to_all_single  # type: ignore[assignment]

    def alltoall(self, outs: list[torch.Tensor], ins: list[torch.Tensor], opts: Any = None) -> Work:
        return self._post("all_to_all", lambda st: ops.alltoall_list(self, outs, ins, st), list(outs),
                          inputs=ins)

    def gather(self, output_lists: list[list[torch.Tensor]], inputs: list[torch.Tensor],  # type: ignore[override]
               opts: Any = None) -> Work:
        inp = ops.one(inputs, "gather")
        root = opts.rootRank if opts is not None else 0
        outs = output_lists[0] if output_lists else []
        return self._post("gather", lambda st: ops.gather(self, outs, inp, root, st), list(outs),
                          inputs=[inp])

    def scatter(self, outputs: list[torch.Tensor], input_lists: list[list[torch.Tensor]],  # type: ignore[override]
                opts: Any = None) -> Work:
        out = ops.one(outputs, "scatter")
        root = opts.rootRank if opts is not None else 0
        ins = input_lists[0] if input_lists else []
        return self._post("scatter", lambda st: ops.scatter(self, out, ins, root, st), [out], inputs=ins)

    # ---- point-to-point ---------------------------------------------------------------------------
    # Point-to-point. torch's send and recv call these and then ``wait()`` (isend and irecv return the
    # Work), and the group cannot tell which. Small CPU messages on one node use the ranks' fast path
    # either way:
    # - **send**: through a cell of the pair at once when one is free (a completed Work: the bytes
    #   are copied, as a buffered send's), else the posted Isend, never waited for here.
    # - **recv, deferred**: the receive is not posted at the call. ``wait()`` takes the message from
    #   its cell itself if it comes within the fast path's spin (else posts it and waits without the
    #   group's lock, as every receive does: another thread's send on the group may be what the peer
    #   waits for). Anything else that needs the receive posted posts it first as an Irecv: another
    #   receive on the group (so receives keep their order: at most one is deferred, the latest),
    #   ``get_future``, ``is_completed``, the completion thread. Deferring never holds a sender up:
    #   it is done only for sizes a send completes without its receive (SEND_BUFFER_BYTES), and a
    #   blocking wait elsewhere in the program meanwhile finds those sends complete, as they would be.
    # Both only where the fast path is on and TORCH_BLOCKING_DIRECT is (its switch).
    def _eager(self, t: torch.Tensor, limit: int) -> bool:
        return not t.is_cuda and 0 < t.numel() * t.element_size() <= limit

    def flush_deferred(self) -> None:
        """Post the deferred receive, if any (the group's lock held)."""
        w = self.deferred_recv
        if w is not None:
            w.post_deferred()

    def send(self, tensors: list[torch.Tensor], dst: int, tag: int = 0) -> Work | Completed:
        t = ops.one(tensors, "send")
        name = f"send to rank {dst} tag {tag}"
        if self._eager(t, self.eager_bytes):
            with self.lock:
                try:
                    req = ops.send_or_isend(self, t, dst, tag)
                except GROUP_FAILED as exc:
                    return Completed(name, [t], exc)
                if req is None:
                    return Completed(name, [t])
                work = Work(self, name, [req], Staged(), [t])
                self.completer.add(work)
            return work
        return self._post(name, lambda st: ops.send(self, t, dst, tag, st), [t])

    def recv(self, tensors: list[torch.Tensor], src: int, tag: int = 0) -> Work:
        t = ops.one(tensors, "recv")
        name = f"recv from rank {src} tag {tag}"

        def source(w: Work) -> None:
            if w._recv_req is not None:
                w.source = w._recv_req.status.source

        if self._eager(t, self.defer_bytes):
            if src != shmproxy.ANY_SOURCE and not 0 <= src < self.size():
                raise errors.InvalidArgument(f"shmproxy backend: recv: source {src} is not a rank of this group"
                                             f" (size {self.size()})")
            with self.lock:
                self.flush_deferred()   # an earlier deferred receive is posted first: receives keep order
                work = Work(self, name, [], Staged(), [t], source, receive=True)
                work._deferred = (src, tag)
                self.deferred_recv = work
                self.completer.add(work)
            return work

        def build(st: Staged) -> list:
            self.flush_deferred()
            reqs = ops.recv(self, t, src, tag, st)
            work_req.extend(reqs)
            return reqs

        work_req: list = []

        def done(w: Work) -> None:
            w.source = work_req[0].status.source
        return self._post(name, build, [t], done, receive=True)

    def recv_anysource(self, tensors: list[torch.Tensor], tag: int = 0) -> Work:
        return self.recv(tensors, shmproxy.ANY_SOURCE, tag)

    # ---- lifecycle --------------------------------------------------------------------------------
    def abort(self, cause: BaseException | None = None) -> None:
        """Fail the communicator on every rank now (pending Works raise shmproxy.Aborted; ``cause``: the
        error that made this rank abort, which the other ranks see as the reason)."""
        reason = "torch.distributed abort" if cause is None else f"{type(cause).__name__}: {cause}"
        with self.lock:
            self.comm.Abort(reason)
        self.completer.fail_all(errors.Aborted(f"rank {self.rank()}: the process group was aborted"
                                               + ("" if cause is None else f" ({reason})")))

    def shutdown(self) -> None:
        """Close the communicator after its pending operations completed (or failed); idempotent."""
        self.completer.stop()
        self.completer.thread.join(self.timeout_s)
        with self.lock:
            self.comm.close()

    def __repr__(self) -> str:
        return f"<ProcessGroupShmproxy rank {self.rank()}/{self.size()} {self.comm!r}>"
