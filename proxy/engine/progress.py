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
What the loop is made of: this module (lifecycle, the driver) and its components, each owning its
own state and taking, in its constructor, the loop's shared state (``st``: engine/state.py, the pool,
the args pool and active list, the rank and buffer tables, the counters) and the siblings it calls:

    events       engine/events.py       news from the other threads (post, on_events)
    calls        engine/loopcall.py     the service thread's requests, run on the loop
    failures     engine/failure.py      the first error, and who learned it
    completion   engine/completion.py   publishing results, waking ranks
    ctx          engine/context.py      what transports see of the engine
    nodes        engine/nodes.py        the other nodes, the link to them
    connections  engine/connections.py  the connectors, made on first use
    coll         coll/runner.py         collectives (coll/multinode.py: across nodes)
    fastpath     engine/fastpath.py     the fast path's cells, drained in order
    p2p          engine/p2p.py          the two halves of a message: matching, buffering, probes
    armed        engine/armed.py        repeated device messages launched from C at fetch
    fetcher      engine/fetching.py     taking the ranks' posts; the loop's waits for them
    intro        engine/introspect.py   the info blob and the dump (it reads the whole engine)

They are made in that order, each finding made those it takes. The calls that go back up the order
are listeners the later component registers (Failures.on_first_error and on_abort, Completion's
coll_finished, the poll hooks) or a ``bind`` made once both exist (the fast path and point-to-point
call each other; point-to-point and the armed routes; the context offers what came after it).

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
from typing import Any

from shmproxy import transports
from shmproxy.coll import sched
from shmproxy.coll.runner import CollRunner
from shmproxy.control.handler import ControlHandler
from shmproxy.control.service import ServiceServer
from shmproxy.core import errors, host, log, params as params_mod
from shmproxy.engine import affinity
from shmproxy.engine.args import PROGRESS, READY, Args
from shmproxy.engine.armed import ArmedRoutes
from shmproxy.engine.completion import Completion
from shmproxy.engine.connections import Connections
from shmproxy.engine.context import EngineContext
from shmproxy.engine.copyengine import CopyEngine
from shmproxy.engine.events import EVENTS_Q as _EVENTS_Q, LoopEvents
from shmproxy.engine.failure import OWNER_DEAD_GRACE_S, Failures
from shmproxy.engine.fastpath import FastPath
from shmproxy.engine.fetching import Fetcher
from shmproxy.engine.introspect import Introspector
from shmproxy.engine.loopcall import LoopCalls
from shmproxy.engine.matching import Matcher
from shmproxy.engine.nodes import Nodes
from shmproxy.engine.p2p import PointToPoint
from shmproxy.engine.policy import FetchMode, fetch_mode, streaming_threshold
from shmproxy.engine.ranks import RankInfo
from shmproxy.engine.state import LoopState
from shmproxy.shm import _workers, pool as P, sync
from shmproxy.shm.segment import Segment
from shmproxy.transports.base import Registration, Transport

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
        self.path, self.nlocal, self.size = path, nlocal, size
        self.job_key, self.comm_id, self.parent = job_key, comm_id, parent
        # On a crowded node the ranks and this process share cores (core/host.py): the automatic
        # settings differ there, the fast path's size among them.
        crowded = host.crowded(nlocal)
        # The fast path (engine/fastpath.py) needs every rank of the communicator on this node.
        fast = params.fast_bytes(nlocal, size, crowded, host.memory_bytes())
        layout = P.Layout(nlocal, params.MAX_OPS_PER_RANK, params.MAX_SUBS, fast)
        self.seg = Segment.create(f"{job_key[:8]}-c{comm_id}", layout.total_bytes, params.SHM_DIR)
        self.view = view = P.PoolView.initialize(self.seg.mm, self.seg.addr, layout)
        self.layout = layout
        view.set_ctrl(P.CTRL_PROXY_PID, os.getpid())
        view.set_ctrl(P.CTRL_STATE, P.PROXY_STARTING)
        self.q = view.q
        loop_copies = bool(params.LOOP_COPIES) if params.LOOP_COPIES >= 0 else crowded
        poll_us = params.LOOP_POLL_US if params.LOOP_POLL_US >= 0 else (AUTO_LOOP_POLL_US if loop_copies else 0.0)
        self.loop_poll_s = poll_us / 1e6

        # The loop's components (the module header), each taking the state and the siblings it calls,
        # made in an order where each finds those it takes; the few calls back up the order are
        # listeners (Failures.on_first_error, on_abort; Completion.coll_finished) or one ``bind``.
        self.st = st = LoopState(params, view, self.seg.addr, layout, size, crowded, loop_copies,
                                 transports.allowed(params.TRANSPORTS))
        st.streaming_min = streaming_threshold(params, sorted(os.sched_getaffinity(0)), loop_copies)
        self.events = LoopEvents(st.q, st.seg_addr, st.timeout)   # news from the other threads
        # The service thread's requests change engine state on this thread, answered after (engine/loopcall.py).
        self.calls = LoopCalls(self.events.post, st.timeout)
        matcher = Matcher()   # the receive half of point-to-point; the fast path and armed routes watch it
        self.failures = Failures(st, self.calls, matcher)   # the first error, and who learned it
        view.mutex.on_owner_dead = self.failures.mutex_owner_died
        self.completion = Completion(st, self.failures)    # publishing results, waking ranks
        self.ctx = EngineContext(st, self.events, self.completion, self.failures, comm_id, net_ip)
        self.nodes = Nodes(st, self.failures, self.completion, self.ctx)   # the other nodes, the link to them
        self.connections = Connections(st, self.nodes, self.ctx)
        self.coll = CollRunner(st, self.failures, self.completion, self.nodes, self.connections, self.ctx)
        self.fastpath = FastPath(st, matcher, self.failures)   # small blocking calls the ranks complete themselves
        self.p2p = PointToPoint(st, matcher, self.failures, self.completion, self.nodes, self.connections,
                                self.coll, self.fastpath, self.ctx)   # matching, buffered sends, probes
        # repeated device messages launched from C at fetch (engine/armed.py)
        slots, _nbytes, per_rank = self.completion.completion_slots()
        armed_on = bool(params.CUDA_ARMED_ROUTES and params.CUDA_GRAPHS and params.CUDA_DEVICE_COMPLETES)
        self.armed = ArmedRoutes(armed_on, matcher, self.ctx, self.fastpath, st.seg_addr, (slots, per_rank),
                                 self.p2p.probes, st.local_of, st.profiler, self.p2p.append)
        self.fastpath.bind(self.p2p)
        self.p2p.bind(self.armed)
        self.ctx.bind(self.coll, self.nodes, self.p2p, self.armed)
        self.fetcher = Fetcher(st, self.events, self.failures, self.completion, self.armed, self.p2p, self.ctx)

        self.fault_fd = -1   # the memfd a fatal signal's stacks go to (main), given to every rank at INIT
        self.retired: collections.deque = collections.deque()
        self.cpus: list[int] | None = None
        self.affinity_reason = "not decided yet (waiting for every local rank to connect)"
        self.pending_affinity: tuple[list[int] | None, str, list[int] | None] | None = None
        self.dump_requested = False
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

    def rank_closed(self, info: RankInfo) -> None:
        """The loop (CLOSE): ``info``'s rank closed; what waits on it fails (PointToPoint.close_half), what
        transports hold for its buffers goes, and once every local rank closed or died the loop stops."""
        st = self.st
        info.closed = True
        self.p2p.close_half(info)
        self.release_registrations(info.local_rank)
        if len(st.ranks) == st.nlocal and all(r.closed or r.dead for r in list(st.ranks.values())):
            st.stopping = True
            self.view.set_ctrl(P.CTRL_STOP, 1)

    def release_registrations(self, local_rank: int) -> None:
        """Loop thread, once a rank closed (it waited for its sends and collectives): what transports
        hold for its buffers (a device mapping opened by CUDA IPC keeps the rank's GPU memory alive)
        goes now, not when the progress process exits. A transport defers what a copy still uses."""
        regs = self.st.registrations
        for key in [k for k in list(regs) if k[0] == local_rank]:
            owners, reg = regs.pop(key)
            self.deregister(owners, reg)

    def _service_failed(self, exc: BaseException) -> None:
        code = exc.code if isinstance(exc, errors.ProxyError) else errors.InternalError.code
        self.failures.fail(code, f"the service failed handling a rank: {exc!r}")

    def start(self) -> None:
        sync.set_lock_spin(self.params.LOCK_SPIN_US)   # contended pool locks retry briefly first
        if self.size > self.nlocal:
            self.nodes.start(self.st.transports)
        self.calls.started()   # main() runs the loop on this thread next: requests wait for it
        self.server.start()
        self.view.set_ctrl(P.CTRL_STATE, P.PROXY_RUNNING)
        _log.info("progress process up: pool %s (%d bytes), %d local ranks, socket %s",
                  self.seg.name, self.layout.total_bytes, self.nlocal, self.path)

    def shutdown(self) -> None:
        """Tear everything down; safe after any failure, and nothing of ours is left behind."""
        st = self.st
        self.view.set_ctrl(P.CTRL_STATE, P.PROXY_STOPPING)
        self.calls.ended()   # the service thread's requests run on its own thread from here
        if self.failures.failed:
            self.failures.wait_until_told(self.params.FAIL_LINGER_S)
        self.server.stop(timeout=5.0)
        st.copy.stop()
        if st.awake is not None:
            st.awake.stop()
        self.view.set_ctrl(P.CTRL_STATE, P.PROXY_EXITED)
        if st.profiler.enabled and self.params.PROFILE_FILE:
            st.profiler.write(self.params.PROFILE_FILE)
        for owners, reg in list(st.registrations.values()):
            self.deregister(owners, reg)
        st.registrations.clear()
        for t in st.transports:
            t.proxy_free(self.ctx)
        st.active.clear()  # schedules hold numpy views of the buffers closed below
        self.coll.colls.clear()
        self.retired.extend(st.buffers.values())
        st.buffers.clear()
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

    def decide_affinity(self) -> None:
        rank_sets = [set(r.affinity) for r in list(self.st.ranks.values())]
        try:
            allowed = affinity.allowed_cpus()
            cpus, reason = affinity.choose_proxy_cpus(self.params, rank_sets, allowed)
            floating = None if cpus else affinity.float_cpus(self.params, rank_sets, allowed)
            self.pending_affinity = (cpus, reason, floating)
        except errors.ProxyError as exc:
            self.failures.fail(exc.code, f"cannot choose progress cores: {exc}")

    # ------------------------------------------------------------------ progress and completion
    def progress_once(self) -> bool:
        """Advance every active args once. Returns True when nothing moved (idle)."""
        st, events = self.st, self.events
        st.progressed = False
        if st.q[_EVENTS_Q] != events.seen:   # news came since the last run: every pass, so no call
            events.run()
            st.progressed = True
            if st.fast:
                self.fastpath.check_bells()
        if st.hooks.armed:
            st.hooks.run()
        copy = st.copy
        if copy.nworkers:
            done = copy.drain()
            if done:
                st.q[_COPY_JOBS_Q] = copy.jobs
            for tok in done:
                if type(tok) is tuple:   # (schedule, entry) of a collective
                    tok[0].entry_done(tok[1])
                elif type(tok) is sched.Schedule:  # a whole chunk schedule
                    tok.all_done()
                else:
                    tok.chunk_done()
                st.progressed = True
        active = st.active
        if active:
            if st.ready:
                st.ready.clear()
            still: list[Args] = []
            ctx, argspool = self.ctx, st.argspool
            for a in active:
                if a.state == READY:
                    argspool.set_state(a, PROGRESS)
                done = (a.transport.proxy_progress_coll(ctx, a) if a.coll is not None
                        else a.transport.proxy_progress(ctx, a))
                if done:
                    argspool.release(a)
                    st.progressed = True
                else:
                    still.append(a)
            st.active = still   # args added by this pass's progress calls were iterated too
        return not st.progressed

    # ------------------------------------------------------------------ driver
    def run(self) -> None:
        st, events, fetcher = self.st, self.events, self.fetcher
        freq = self.params.PROGRESS_APPENDOP_FREQ
        hb_ns = int(self.params.HEARTBEAT_MS * 1e6)
        next_tick = 0
        while not st.should_exit():
            idle = self.progress_once()
            st.passes += 1
            mode = fetch_mode(idle, len(st.active), st.passes, freq)
            if st.hooks.no_sleep:   # e.g. sends waiting out their grace (engine/p2p.py): look, never sleep
                mode = _F_TRY if mode == _F_BLOCK else mode
            added = fetcher.fetch(mode) if mode else 0
            copy = st.copy
            if copy.in_flight and st.awake is not None:
                st.awake.touch()
            if idle and not added and mode != _F_BLOCK:
                if copy.in_flight:
                    # With no core of its own the loop runs queued jobs itself rather than leave its
                    # CPU to workers that would take turns on the other one (shm/_workers.c help()).
                    if not (st.loop_copies and copy.help()):
                        if events.polls and not st.crowded:
                            # C threads' news (the collective wire's tokens) ends the wait too: poll
                            # for it all along, on a core that is spare (shm/_workers_pool.c)
                            copy.wait(WORKER_WAIT_S, WORKER_WAIT_S, (events.addr, events.seen))
                        else:
                            copy.wait(WORKER_WAIT_S, self.loop_poll_s)  # GIL released: copyengine.py
                elif not fetcher.wait_watched():
                    os.sched_yield()
            now = time.monotonic_ns()
            # An affinity decided (the last rank connected) is applied at once, not a heartbeat later:
            # until then there are no copy workers, and the job's first work would run on the loop alone.
            if now >= next_tick or self.pending_affinity is not None:
                next_tick = now + hb_ns
                self.tick(now)

    def tick(self, now: int) -> None:
        """Housekeeping every HEARTBEAT_MS: heartbeat, affinity, retired buffers, dumps, orphaning."""
        base, st = P.CTRL_OFF // 8, self.st
        self.q[base + P.CTRL_HEARTBEAT] = now
        self.q[base + P.CTRL_N_PASSES] = st.passes
        self.q[base + P.CTRL_ACTIVE_SUBS] = sum(len(a.subs) for a in st.active)
        self.coll.across.flush_notes()   # the fingerprints for node 0's mismatch check (coll/multinode.py)
        if self.pending_affinity is not None:
            self.apply_affinity(*self.pending_affinity)
            self.pending_affinity = None
        else:
            self.intro.refresh()   # what waits, and on whom, for the outside dump
        if self.retired and not st.active:
            self._close_retired()
        if self.dump_requested:
            self.dump_requested = False
            self.intro.write_dump()
        f = self.failures
        if f.owner_died_at and not f.failed and time.monotonic() - f.owner_died_at > OWNER_DEAD_GRACE_S:
            f.fail(errors.PeerDiedError.code, "a process died holding the ops pool mutex")
        if not st.ranks and time.monotonic() - self.t_start > self.params.TIMEOUT:
            self.failures.fail(errors.Timeout.code, f"no rank connected within {self.params.TIMEOUT} s")
        if not st.ranks and os.getppid() != self.parent:
            self.failures.fail(errors.PeerDiedError.code, f"local rank 0 (pid {self.parent}) exited before connecting",
                               rank=None, pid=self.parent)

    def apply_affinity(self, cpus: list[int] | None, reason: str, floating: list[int] | None = None) -> None:
        """Pin every thread to ``cpus`` (CPUs of its own), or let them float over ``floating`` (the
        ranks' CPUs, when none are spare), or leave the affinity as it is (both None)."""
        st = self.st
        self.cpus, self.affinity_reason = cpus, reason
        mask = cpus or floating
        if mask:
            affinity.pin_self(mask)
        running_on = sorted(mask or os.sched_getaffinity(0))
        n = self.params.COPY_THREADS or (len(cpus) if cpus else min(len(running_on), 8))
        if n > st.copy.nworkers:
            st.copy.stop()
            if st.loop_copies and not cpus:   # crowded: one worker per CPU, the loop beside them
                st.copy = CopyEngine(n, running_on, spread=True)
            else:
                st.copy = CopyEngine(n, cpus)
        st.streaming_min = streaming_threshold(self.params, running_on, st.loop_copies)
        self.start_keep_awake(running_on)
        where = cpus if cpus else f"unpinned, on CPUs {affinity.format_cpu_list(running_on)}"
        _log.info("progress affinity: %s (%s); %d copy threads", where, reason, n)
        self.intro.write_info()

    def start_keep_awake(self, cpus: list[int]) -> None:
        """One idle-priority guard per CPU we run on (shm/_workers.c, KeepAwake), when KEEP_AWAKE_US
        asks for them: on a crowded node by default."""
        us = self.params.KEEP_AWAKE_US
        st = self.st
        if us < 0:
            us = AUTO_KEEP_AWAKE_US if st.crowded else 0.0
        if st.awake is not None:
            st.awake.stop()
            st.awake = None
        if us > 0:
            # Guards wake spread workers on their own CPUs: no IPI (shm/_workers.c, "Relayed wake-ups").
            relay = st.copy.pool if st.copy.spread else None
            st.awake = _workers.KeepAwake(cpus, us / 1e6, relay, self.seg.addr + self.layout.rank_area_off,
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
