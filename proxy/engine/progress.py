"""The progress process: one per communicator per node, started by local rank 0.

    python -m shmproxy.engine.progress --path SOCK --nlocal N --size S --job-key K --comm-id C --parent PID

It creates the ops pool, serves the control socket (shmproxy.control.handler, on a thread), and runs the loop
that moves every byte (docs/architecture.md, "The progress loop"):

    while not abort and not (stop and nothing active):
        idle = progress_once()            # news, armed poll hooks (engine/hooks.py), every active args
        mode = fetch_mode(idle, len(active), passes, PROGRESS_APPENDOP_FREQ)
        fetcher.fetch(mode)               # NONE | TRY (trylock) | BLOCK (spin, then condvar sleep)
        sched_yield() when idle and nothing was added

The fetch copies posted records out of the pool under the mutex (at most APPEND_BATCH_SIZE opCount
groups), returns each record to its owner's free list in the same critical section, then matches
sends with receives per (source, destination, tag) in FIFO order, which is what keeps messages of
one pair and tag from overtaking each other. A matched message goes to the connector of its pair and
memory kind (engine/p2p.py), whose transport moves it: at once, or as subs of an args keyed by
(connection, opCount) whose step counters it advances; a finished message writes both requests'
completion slots and wakes their ranks (engine/completion.py). Collectives are run by coll/runner.py.
What the loop is made of: this module (lifecycle, the driver), the components it owns, each with its
own state and typed (``fetcher``: engine/fetching.py, taking the ranks' posts and the loop's waits
for them; ``completion``: engine/completion.py, publishing results and waking ranks;
``failures``: engine/failure.py, the first error and who learned it; ``fastpath``:
engine/fastpath.py, the cells drained in order; ``intro``: engine/introspect.py, the info blob and
the dump; ``nodes``: engine/nodes.py, the other nodes and the link to them; ``coll``:
coll/runner.py, the collectives, with coll/multinode.py for those across nodes; ``armed``:
engine/armed.py, repeated device messages launched from C at fetch; ``p2p``: engine/p2p.py, the
two halves of a message, matching, buffered sends and probes).

The loop never raises into a void: the first error is stored with its context in the pool's
asyncResult fields and the communicator is aborted, so every rank raises it at its next call.
"""
from __future__ import annotations

import argparse
import collections
import faulthandler
import os
import signal
import sys
import time
import traceback
from typing import Any, Callable


from shmproxy.engine import affinity
from shmproxy.core import errors, host, log, params as params_mod
from shmproxy.coll import sched
from shmproxy.engine.args import PROGRESS, READY, Args, ArgsPool
from shmproxy.engine.armed import ArmedRoutes
from shmproxy.engine.copyengine import CopyEngine
from shmproxy.engine.profiler import Profiler
from shmproxy.shm import _native, _workers, pool as P, sync
from shmproxy.shm.segment import Segment
from shmproxy import transports
from shmproxy.coll.runner import CollRunner
from shmproxy.control.handler import ControlHandler
from shmproxy.control.service import ServiceServer
from shmproxy.engine.completion import Completion
from shmproxy.engine.context import EngineContext
from shmproxy.engine.failure import OWNER_DEAD_GRACE_S, Failures
from shmproxy.engine.hooks import PollHooks
from shmproxy.engine.introspect import Introspector
from shmproxy.engine.loopcall import LoopCalls
from shmproxy.engine.nodes import Nodes
from shmproxy.engine.fastpath import FastPath
from shmproxy.engine.fetching import _EVENTS_Q, Fetcher
from shmproxy.engine.p2p import PointToPoint
from shmproxy.engine.policy import FetchMode, fetch_mode, streaming_threshold
from shmproxy.engine.ranks import RankInfo
from shmproxy.transports.base import Connector, HostBuffer, Registration, Transport

_log = log.get("PROXY")
AUTO_KEEP_AWAKE_US = 2000.0  # KEEP_AWAKE_US=-1 on a crowded node: covers a message's hand-offs
AUTO_LOOP_POLL_US = 100.0    # LOOP_POLL_US=-1 where the loop runs copy jobs itself: a few 512 KiB jobs
WORKER_WAIT_S = 200e-6       # how long the idle loop blocks on copy workers before it looks for ops
SWITCH_INTERVAL_S = 100e-6   # GIL switch interval of the progress process (default 5 ms)

_F_NONE, _F_TRY, _F_BLOCK = FetchMode.NONE, FetchMode.TRY, FetchMode.BLOCK  # globals: no enum lookup per pass
_COPY_JOBS_Q = P.CTRL_OFF // 8 + P.CTRL_N_COPY_JOBS


class ProgressEngine:
    def __init__(self, params: params_mod.Params, path: str, nlocal: int, size: int, job_key: str,
                 comm_id: int, parent: int, net_ip: str = ""):
        self.params = params
        self.net_ip = net_ip
        self.path, self.nlocal, self.size = path, nlocal, size
        self.job_key, self.comm_id, self.parent = job_key, comm_id, parent
        # On a crowded node the ranks and this process share cores (core/host.py): the automatic
        # settings differ there, the fast path's size among them.
        self.crowded = host.crowded(nlocal)
        # The fast path (engine/fastpath.py) needs every rank of the communicator on this node.
        fast = params.fast_bytes(nlocal, size, self.crowded, host.memory_bytes())
        layout = P.Layout(nlocal, params.MAX_OPS_PER_RANK, params.MAX_SUBS, fast)
        self.seg = Segment.create(f"{job_key[:8]}-c{comm_id}", layout.total_bytes, params.SHM_DIR)
        self.view = P.PoolView.initialize(self.seg.mm, self.seg.addr, layout)
        self.layout = layout
        self.failures = Failures(self)   # the first error, and who learned it (engine/failure.py)
        self.view.mutex.on_owner_dead = self.failures.mutex_owner_died
        self.view.set_ctrl(P.CTRL_PROXY_PID, os.getpid())
        self.view.set_ctrl(P.CTRL_STATE, P.PROXY_STARTING)
        self.q = self.view.q
        self.steps = params.STEPS
        self.chunk = params.CHUNK_SIZE
        self.eager = params.eager_limit
        self.loop_copies: bool = bool(params.LOOP_COPIES) if params.LOOP_COPIES >= 0 else self.crowded
        poll_us = params.LOOP_POLL_US if params.LOOP_POLL_US >= 0 else (AUTO_LOOP_POLL_US if self.loop_copies else 0.0)
        self.loop_poll_s = poll_us / 1e6
        self.timeout = params.TIMEOUT
        # work components defer to the next passes, polled while they have some (engine/hooks.py)
        self.hooks = PollHooks()
        self.fetcher = Fetcher(self, params, self.crowded)   # taking the ranks' posts (engine/fetching.py)
        self.transports = transports.allowed(params.TRANSPORTS)
        self.streaming_min = streaming_threshold(params, sorted(os.sched_getaffinity(0)), self.loop_copies)
        self.argspool = ArgsPool(self.view)
        self.copy: CopyEngine = CopyEngine(0, None)
        self.nodes = Nodes(self, size)   # the other nodes: layout, the link transport (engine/nodes.py)
        self.awake: Any = None  # shm._workers.KeepAwake on a crowded node (start_keep_awake)
        self.profiler = Profiler(params.PROFILE)
        self.active: list[Args] = []
        self.ready: dict[tuple, Args] = {}
        self.p2p = PointToPoint(self, params)   # matching, buffered sends, probes (engine/p2p.py)
        self.completion = Completion(self)   # publishing results, waking ranks (engine/completion.py)
        self.coll = CollRunner(self)   # collectives: this node's ranks, and across nodes (coll/runner.py)
        self.fastpath = FastPath(self, layout)  # small blocking calls the ranks complete themselves
        self.fast = self.fastpath.on
        self.gone: set[int] = set()   # ranks whose close the loop has handled (close_half)
        # News from the other threads of this process (the service thread, transports' helper threads):
        # callables run by the loop (post_event), and the CTRL_EVENTS count the loop has seen.
        self.events: collections.deque = collections.deque()
        self.events_seen = 0
        self.event_polls: list[Callable[[], None]] = []   # run after the events (on_events)
        self.events_addr = self.seg.addr + P.CTRL_OFF + 8 * P.CTRL_EVENTS   # the EVENTS word
        # The service thread's requests change engine state on this thread, answered after (engine/loopcall.py).
        self.calls = LoopCalls(self.post_event, self.timeout)
        self.ranks: dict[int, RankInfo] = {}          # by local rank
        self.local_of: dict[int, int] = {}            # global rank -> local rank
        # (src, dst global ranks, memory kind): a MemKind, or the int a record carries (equal keys)
        self.conns: dict[tuple[int, int, int], Connector] = {}
        self.buffers: dict[tuple[int, int], HostBuffer] = {}   # registered memfds and buffered sends
        # Buffers a transport's register hook took: (local rank, buffer id) -> (its transport(s), Registration)
        self.registrations: dict[tuple[int, int], tuple[list[Transport], Registration]] = {}
        self.ctx = EngineContext(self)   # all that transports see of this engine
        # repeated device messages launched from C at fetch (engine/armed.py)
        slots, _nbytes, per_rank = self.completion.completion_slots()
        armed_on = bool(params.CUDA_ARMED_ROUTES and params.CUDA_GRAPHS and params.CUDA_DEVICE_COMPLETES)
        p2p = self.p2p
        self.armed = ArmedRoutes(armed_on, p2p.matcher, self.ctx, self.fastpath, self.seg.addr, (slots, per_rank),
                                 p2p.probes, self.local_of, self.profiler, p2p.append)
        self.fault_fd = -1   # the memfd a fatal signal's stacks go to (main), given to every rank at INIT
        self.retired: collections.deque = collections.deque()
        self.cpus: list[int] | None = None
        self.affinity_reason = "not decided yet (waiting for every local rank to connect)"
        self.pending_affinity: tuple[list[int] | None, str, list[int] | None] | None = None
        self.stopping = False
        self.dump_requested = False
        self.progressed = False
        self.passes = 0
        self.t_start = time.monotonic()
        self.intro = Introspector(self)   # the info blob and the dump (engine/introspect.py)
        self.intro.write_info()
        # A handler that raises (on_process_exit is how a rank's death reaches us) fails the communicator:
        # swallowed, the death would be a hang until TIMEOUT on every survivor.
        self.server = ServiceServer(path, ControlHandler(self), token=job_key, on_handler_error=self._service_failed)

    # ------------------------------------------------------------------ lifecycle
    def deregister(self, owners: list[Transport], reg: Registration) -> None:
        """A buffer a transport's register hook took is gone (DEREGISTER, or the process exits)."""
        for t in owners:
            t.proxy_deregister(self.ctx, reg)   # type: ignore[misc]  # paired with proxy_register

    def _service_failed(self, exc: BaseException) -> None:
        code = exc.code if isinstance(exc, errors.ProxyError) else errors.InternalError.code
        self.failures.fail(code, f"the service failed handling a rank: {exc!r}")

    def start(self) -> None:
        sync.set_lock_spin(self.params.LOCK_SPIN_US)   # contended pool locks retry briefly first
        if self.size > self.nlocal:
            self.nodes.start(self.transports)
        self.calls.started()   # main() runs the loop on this thread next: requests wait for it
        self.server.start()
        self.view.set_ctrl(P.CTRL_STATE, P.PROXY_RUNNING)
        _log.info("progress process up: pool %s (%d bytes), %d local ranks, socket %s",
                  self.seg.name, self.layout.total_bytes, self.nlocal, self.path)

    def shutdown(self) -> None:
        """Tear everything down; safe after any failure, and nothing of ours is left behind."""
        self.view.set_ctrl(P.CTRL_STATE, P.PROXY_STOPPING)
        self.calls.ended()   # the service thread's requests run on its own thread from here
        if self.failures.failed:
            self.failures.wait_until_told(self.params.FAIL_LINGER_S)
        self.server.stop(timeout=5.0)
        self.copy.stop()
        if self.awake is not None:
            self.awake.stop()
        self.view.set_ctrl(P.CTRL_STATE, P.PROXY_EXITED)
        if self.profiler.enabled and self.params.PROFILE_FILE:
            self.profiler.write(self.params.PROFILE_FILE)
        for owners, reg in list(self.registrations.values()):
            self.deregister(owners, reg)
        self.registrations.clear()
        for t in self.transports:
            t.proxy_free(self.ctx)
        self.active.clear()  # schedules hold numpy views of the buffers closed below
        self.coll.colls.clear()
        self.retired.extend(self.buffers.values())
        self.buffers.clear()
        self._close_retired()
        self.view.release()
        self.seg.close()
        _log.info("progress process exiting")

    def _close_retired(self) -> None:
        """Unmap deregistered buffers; one still viewed by a numpy array is retried later."""
        keep = []
        while self.retired:
            buf = self.retired.popleft()
            try:
                buf.close()
            except BufferError:
                keep.append(buf)
        if keep:
            _log.info("%d deregistered buffer(s) still referenced; unmapping later", len(keep))
            self.retired.extend(keep)

    # ------------------------------------------------------------------ news from the other threads
    def post_event(self, fn: Callable[[], None]) -> None:
        """Any thread of this process: have the loop run ``fn`` soon, on its own thread (which owns the
        matching, the args and the transports' progress), waking it if it sleeps. The wake-up cannot
        be lost (_native.post_event against sleep_unless_posted), and ranks never pay for it."""
        self.events.append(fn)
        rc = _native.post_event(self.seg.addr, self.timeout)
        if rc == sync.TIMEDOUT:
            _log.warning("pool mutex not acquired within %.1f s to wake the loop; it wakes at its bound",
                         self.timeout)

    def on_events(self, fn: Callable[[], None]) -> None:
        """Have the loop run ``fn`` after the posted events, every time news came: C threads of a
        transport queue their news in C and bump EVENTS (shm/_wire.c); ``fn`` collects it."""
        self.event_polls.append(fn)

    def run_events(self) -> None:
        """Loop thread: run what other threads posted (post_event), oldest first, then the polls of
        on_events."""
        self.events_seen = self.q[_EVENTS_Q]   # read before draining: a later post is seen next time
        events = self.events
        while events:
            events.popleft()()
        for poll in self.event_polls:
            poll()
        self.progressed = True

    def decide_affinity(self) -> None:
        rank_sets = [set(r.affinity) for r in list(self.ranks.values())]
        try:
            allowed = affinity.allowed_cpus()
            cpus, reason = affinity.choose_proxy_cpus(self.params, rank_sets, allowed)
            floating = None if cpus else affinity.float_cpus(self.params, rank_sets, allowed)
            self.pending_affinity = (cpus, reason, floating)
        except errors.ProxyError as exc:
            self.failures.fail(exc.code, f"cannot choose progress cores: {exc}")

    # ------------------------------------------------------------------ collectives

    # ------------------------------------------------------------------ progress and completion
    def progress_once(self) -> bool:
        """Advance every active args once. Returns True when nothing moved (idle)."""
        self.progressed = False
        if self.q[_EVENTS_Q] != self.events_seen:
            self.run_events()
            if self.fast:
                self.fastpath.check_bells()
        if self.hooks.armed:
            self.hooks.run()
        if self.copy.nworkers:
            done = self.copy.drain()
            if done:
                self.q[_COPY_JOBS_Q] = self.copy.jobs
            for tok in done:
                if type(tok) is tuple:   # (schedule, entry) of a collective
                    tok[0].entry_done(tok[1])
                elif type(tok) is sched.Schedule:  # a whole chunk schedule
                    tok.all_done()
                else:
                    tok.chunk_done()
                self.progressed = True
        if self.active:
            if self.ready:
                self.ready.clear()
            still: list[Args] = []
            ctx = self.ctx
            for a in self.active:
                if a.state == READY:
                    self.argspool.set_state(a, PROGRESS)
                done = (a.transport.proxy_progress_coll(ctx, a) if a.coll is not None
                        else a.transport.proxy_progress(ctx, a))
                if done:
                    self.argspool.release(a)
                    self.progressed = True
                else:
                    still.append(a)
            self.active = still
        return not self.progressed

    # ------------------------------------------------------------------ driver
    def _should_exit(self) -> bool:
        return bool(self.q[P.CTRL_OFF // 8 + P.CTRL_ABORT]) or (self.stopping and not self.active)

    def run(self) -> None:
        freq = self.params.PROGRESS_APPENDOP_FREQ
        hb_ns = int(self.params.HEARTBEAT_MS * 1e6)
        next_tick = 0
        while not self._should_exit():
            idle = self.progress_once()
            self.passes += 1
            mode = fetch_mode(idle, len(self.active), self.passes, freq)
            if self.hooks.no_sleep:   # e.g. sends waiting out their grace (engine/p2p.py): look, never sleep
                mode = _F_TRY if mode == _F_BLOCK else mode
            added = self.fetcher.fetch(mode) if mode else 0
            if self.copy.in_flight and self.awake is not None:
                self.awake.touch()
            if idle and not added and mode != _F_BLOCK:
                if self.copy.in_flight:
                    # With no core of its own the loop runs queued jobs itself rather than leave its
                    # CPU to workers that would take turns on the other one (shm/_workers.c help()).
                    if not (self.loop_copies and self.copy.help()):
                        if self.event_polls and not self.crowded:
                            # C threads' news (the collective wire's tokens) ends the wait too: poll
                            # for it all along, on a core that is spare (shm/_workers_pool.c)
                            self.copy.wait(WORKER_WAIT_S, WORKER_WAIT_S, (self.events_addr, self.events_seen))
                        else:
                            self.copy.wait(WORKER_WAIT_S, self.loop_poll_s)  # GIL released: copyengine.py
                elif not self.fetcher.wait_watched():
                    os.sched_yield()
            now = time.monotonic_ns()
            # An affinity decided (the last rank connected) is applied at once, not a heartbeat later:
            # until then there are no copy workers, and the job's first work would run on the loop alone.
            if now >= next_tick or self.pending_affinity is not None:
                next_tick = now + hb_ns
                self.tick(now)

    def tick(self, now: int) -> None:
        """Housekeeping every HEARTBEAT_MS: heartbeat, affinity, retired buffers, dumps, orphaning."""
        base = P.CTRL_OFF // 8
        self.q[base + P.CTRL_HEARTBEAT] = now
        self.q[base + P.CTRL_N_PASSES] = self.passes
        self.q[base + P.CTRL_ACTIVE_SUBS] = sum(len(a.subs) for a in self.active)
        self.coll.across.flush_notes()   # the fingerprints for node 0's mismatch check (coll/multinode.py)
        if self.pending_affinity is not None:
            self.apply_affinity(*self.pending_affinity)
            self.pending_affinity = None
        else:
            self.intro.refresh()   # what waits, and on whom, for the outside dump
        if self.retired and not self.active:
            self._close_retired()
        if self.dump_requested:
            self.dump_requested = False
            self.intro.write_dump()
        f = self.failures
        if f.owner_died_at and not f.failed and time.monotonic() - f.owner_died_at > OWNER_DEAD_GRACE_S:
            f.fail(errors.PeerDiedError.code, "a process died holding the ops pool mutex")
        if not self.ranks and time.monotonic() - self.t_start > self.params.TIMEOUT:
            self.failures.fail(errors.Timeout.code, f"no rank connected within {self.params.TIMEOUT} s")
        if not self.ranks and os.getppid() != self.parent:
            self.failures.fail(errors.PeerDiedError.code, f"local rank 0 (pid {self.parent}) exited before connecting",
                               rank=None, pid=self.parent)

    def apply_affinity(self, cpus: list[int] | None, reason: str, floating: list[int] | None = None) -> None:
        """Pin every thread to ``cpus`` (CPUs of its own), or let them float over ``floating`` (the
        ranks' CPUs, when none are spare), or leave the affinity as it is (both None)."""
        self.cpus, self.affinity_reason = cpus, reason
        mask = cpus or floating
        if mask:
            affinity.pin_self(mask)
        running_on = sorted(mask or os.sched_getaffinity(0))
        n = self.params.COPY_THREADS or (len(cpus) if cpus else min(len(running_on), 8))
        if n > self.copy.nworkers:
            self.copy.stop()
            if self.loop_copies and not cpus:   # crowded: one worker per CPU, the loop beside them
                self.copy = CopyEngine(n, running_on, spread=True)
            else:
                self.copy = CopyEngine(n, cpus)
        self.streaming_min = streaming_threshold(self.params, running_on, self.loop_copies)
        self.start_keep_awake(running_on)
        where = cpus if cpus else f"unpinned, on CPUs {affinity.format_cpu_list(running_on)}"
        _log.info("progress affinity: %s (%s); %d copy threads", where, reason, n)
        self.intro.write_info()

    def start_keep_awake(self, cpus: list[int]) -> None:
        """One idle-priority guard per CPU we run on (shm/_workers.c, KeepAwake), when KEEP_AWAKE_US
        asks for them: on a crowded node by default."""
        us = self.params.KEEP_AWAKE_US
        if us < 0:
            us = AUTO_KEEP_AWAKE_US if self.crowded else 0.0
        if self.awake is not None:
            self.awake.stop()
            self.awake = None
        if us > 0:
            # Guards wake spread workers on their own CPUs: no IPI (shm/_workers.c, "Relayed wake-ups").
            relay = self.copy.pool if self.copy.spread else None
            self.awake = _workers.KeepAwake(cpus, us / 1e6, relay, self.seg.addr + self.layout.rank_area_off,
                                            self.nlocal)
            _log.info("keep-awake: %d idle-priority guard(s) on cpus %s, %g us after the last work%s",
                      len(cpus), affinity.format_cpu_list(cpus), us,
                      ", waking the copy workers there" if relay is not None else "")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m shmproxy.engine.progress", description=__doc__.split("\n")[0])
    ap.add_argument("--path", required=True)
    ap.add_argument("--nlocal", type=int, required=True)
    ap.add_argument("--size", type=int, required=True)
    ap.add_argument("--job-key", required=True)
    ap.add_argument("--comm-id", type=int, default=0)
    ap.add_argument("--parent", type=int, default=0)
    ap.add_argument("--net-ip", default="", help="address to listen on for other nodes (multi-node jobs)")
    ap.add_argument("--cwd", default="", help="the starting rank's working directory (we start in "
                    "the package root, so that `-m` imports the rank's own code; proxy/rank/lifecycle.py)")
    ns = ap.parse_args(argv)
    cwd_error = None
    if ns.cwd:      # before logging opens DEBUG_FILE, which may be relative
        try:
            os.chdir(ns.cwd)
        except OSError as exc:   # removed since: stay where we are, relative paths resolve there
            cwd_error = exc
    params = params_mod.get()
    log.set_rank("proxy")
    log.configure(params)
    if cwd_error is not None:
        _log.warning("cannot return to the rank's directory %s (%s)", ns.cwd, cwd_error)
    sys.setswitchinterval(SWITCH_INTERVAL_S)
    # A fatal signal (a crash in C, an abort) leaves no Python exception to record: faulthandler writes
    # every thread's stack into a memfd that each rank holds a copy of (INIT passes it), so that the
    # ranks can quote it after this process is gone, and no file is ever left behind.
    fault_fd = os.memfd_create("shmproxy-fault", os.MFD_CLOEXEC)
    faulthandler.enable(file=fault_fd, all_threads=True)
    engine = ProgressEngine(params, ns.path, ns.nlocal, ns.size, ns.job_key, ns.comm_id, ns.parent, ns.net_ip)
    engine.fault_fd = fault_fd

    def on_term(signum: int, frame: Any) -> None:  # only sets flags; the loop acts
        engine.q[P.CTRL_OFF // 8 + P.CTRL_ABORT] = 1

    def on_dump(signum: int, frame: Any) -> None:
        engine.dump_requested = True

    signal.signal(signal.SIGTERM, on_term)
    # Ctrl-C reaches the ranks too (a terminal signals the foreground group; mpiexec and torchrun
    # forward it): each raises KeyboardInterrupt, and this process follows their abort or death. Were it
    # to abort on its own SIGINT, its abort would race ahead of the ranks' interrupts, and the job
    # would end as a communicator abort (exit status 1 everywhere) instead of an interrupt.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    if params.DUMP_SIGNAL:
        signal.signal(params.DUMP_SIGNAL, on_dump)
    rc = 0
    try:
        engine.start()
        engine.run()
    except BaseException as exc:  # the loop never raises into a void: record, abort, exit non-zero
        rc = 1
        engine.failures.fail(getattr(exc, "code", errors.InternalError.code),
                             f"progress loop crashed: {type(exc).__name__}: {exc}")
        traceback.print_exc()
    finally:
        engine.shutdown()
        faulthandler.disable()
        os.close(fault_fd)
    return rc


if __name__ == "__main__":
    sys.exit(main())
