"""The loop's state: what the progress process's components share, typed and declared in one place.

Every component of the engine (engine/progress.py lists them) takes this object and the siblings it
calls, in its constructor; nothing reaches a sibling through the engine. What lives here is what more
than one component reads or writes and no one of them owns:

- the pool: its view (``view``, ``q``), where it is mapped (``seg_addr``) and its layout;
- the work in flight: the args pool, the ``active`` args the loop advances every pass, those still
  taking subs (``ready``, by (connection, opCount)), the poll hooks, the profiler, the copy engine,
  the keep-awake guards and the streaming threshold (the last three replaced once the CPU affinity is
  decided: read them here, never keep them);
- the tables the control plane fills on the loop thread (proxy/control/handler.py): the local ranks,
  global to local rank, the closed ranks (``gone``), registered buffers and the transports'
  registrations;
- the loop's counters and flags: ``passes``, ``progressed`` (this pass moved something: no sleep),
  ``stopping`` (every local rank closed), ``spin_skip`` (the next fetch does not spin first).

One writer: the loop thread. The service thread's requests run on it (engine/loopcall.py); other
threads reach it through events (engine/events.py).
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any

from shmproxy.core.params import Params
from shmproxy.engine.args import Args, ArgsPool
from shmproxy.engine.copyengine import CopyEngine
from shmproxy.engine.hooks import PollHooks
from shmproxy.engine.profiler import Profiler
from shmproxy.engine.ranks import RankInfo
from shmproxy.shm import pool as P

if TYPE_CHECKING:  # pragma: no cover
    from shmproxy.transports.base import HostBuffer, Registration, Transport

_ABORT_Q = P.CTRL_OFF // 8 + P.CTRL_ABORT


class LoopState:
    __slots__ = ("params", "timeout", "nlocal", "size", "crowded", "loop_copies", "fast", "eager", "view", "q",
                 "seg_addr", "layout", "argspool", "active", "ready", "hooks", "profiler", "copy", "awake",
                 "streaming_min", "transports", "ranks", "local_of", "gone", "buffers", "registrations", "passes",
                 "progressed", "stopping", "spin_skip")

    def __init__(self, params: Params, view: P.PoolView, seg_addr: int, layout: P.Layout, size: int,
                 crowded: bool, loop_copies: bool, transports: "tuple[Transport, ...]"):
        self.params = params
        self.timeout: float = params.TIMEOUT
        self.nlocal, self.size, self.crowded = layout.nlocal, size, crowded
        self.loop_copies = loop_copies   # the loop runs copy jobs itself (LOOP_COPIES; engine/progress.py)
        self.fast = bool(layout.fast_bytes)   # the pool has the fast path's region (engine/fastpath.py)
        self.eager: int = params.eager_limit
        self.view, self.q, self.seg_addr, self.layout = view, view.q, seg_addr, layout
        self.argspool = ArgsPool(view)
        self.active: list[Args] = []
        self.ready: dict[tuple, Args] = {}
        self.hooks = PollHooks()
        self.profiler = Profiler(params.PROFILE)
        self.copy = CopyEngine(0, None)
        self.awake: Any = None   # shm._workers.KeepAwake, where the affinity asks for guards
        self.streaming_min = 0   # collectives writing more than this stream their stores (engine/policy.py)
        self.transports = transports
        self.ranks: dict[int, RankInfo] = {}     # by local rank
        self.local_of: dict[int, int] = {}       # global rank -> local rank
        self.gone: set[int] = set()   # ranks whose close the loop has handled (PointToPoint.close_half)
        self.buffers: dict[tuple[int, int], HostBuffer] = {}   # registered memfds and buffered sends
        # Buffers a transport's register hook took: (local rank, buffer id) -> (its transport(s), Registration)
        self.registrations: dict[tuple[int, int], tuple[list[Transport], Registration]] = {}
        self.passes = 0
        self.progressed = False
        self.stopping = False
        self.spin_skip = False

    def should_exit(self) -> bool:
        """The loop ends: the communicator aborted, or every local rank closed and nothing is in flight."""
        return bool(self.q[_ABORT_Q]) or (self.stopping and not self.active)
