"""The transport contract: what moves the bytes of one connection, and what it may ask of the engine.

The progress engine fetches ops, matches a send with a receive, and hands the matched pair to the
*connector* of that (sender, receiver, memory kind): the engine never moves a byte of a message
itself, and a transport never reaches into the engine. They meet in two small types defined here:

- ``Connector``: one direction of one connection (``send`` rank -> ``recv`` rank, memory ``kind``),
  made once when the pair first talks and cached by the engine. It carries each side's private state
  (``send_state`` / ``recv_state``, whatever its transport's setup put there) and the connect-info
  blobs the two sides exchanged. Within a node both sides are set up in one progress process and
  the blobs are handed over directly; across nodes they travel between progress processes, which is
  why they are bytes and not objects.
- ``TransportContext``: the narrow view of the engine a transport gets (policy values, the copy
  engine, the registered buffers, the args pool, the hooks that settle finished work). The engine's
  implementation is shmproxy.engine.context.EngineContext.

A transport (``Transport``) fills these methods; names say which side and which process runs them:

=======================================  ======================================================
``can_connect(me, peer, kind)``          may it carry ``kind`` memory between the two ranks?
``send_setup(ctx, conn) -> bytes``       prepare the sending side; returns its connect-info
``recv_setup(ctx, conn) -> bytes``       prepare the receiving side; returns its connect-info
``send_connect(ctx, conn, recv_info)``   the sending side reads the receiver's connect-info
``recv_connect(ctx, conn, send_info)``   the receiving side reads the sender's connect-info
``proxy_start(ctx, conn, transfer)``     start a matched message: resolve both buffers, apply
                                         the eager/chunking policy; True when it finished now
``proxy_progress(ctx, args)``            advance an args' subs without blocking; True when done
``proxy_free(ctx)``                      release everything at progress-process exit
=======================================  ======================================================

Optional hooks are ``None`` on the base class, never silent no-ops: ``proxy_progress_coll(ctx, args)``
(run a collective's chunk schedules between the ranks the transport connects),
``proxy_coll_entry(ctx, conn, schedule, entry)`` (start a SEND or RECV entry of a collective's schedule
on this connector; returns the (schedule, entry) pairs it completed now: within a node, a SEND and
the RECV of the same key meet and become one copy; across nodes the chunk travels), and
``proxy_start_coll(ctx, ops)`` (a collective on memory of the transport's kind, every local rank's
op arrived and checked against the others: run it whole, ``ctx.coll_sub`` giving the sub its progress
then settles, or ``ctx.refuse_coll`` failing its requests; the cuda transport's device collectives),
``proxy_register(ctx, reg)`` / ``proxy_deregister(ctx, reg)`` (a buffer a rank registered or dropped,
a ``Registration``, for transports that map or pin memory ahead of use; they run on the loop thread
before the rank's REGISTER is answered, so that no op can name the buffer first), and
``proxy_watch(ctx)`` (memory words, ``((address, value), ...)``, of which one takes its value when
the transport's work in flight has moved, so that a loop with nothing else in flight waits on them in
C instead of passing through Python; None while some of that work can only be polled), and
``proxy_repeat(ctx, transfer)`` / ``proxy_fired(ctx, conn, transfer, repeat, token, rc)`` (a launch
the engine may arm to make again from C when the same message comes back, and its bookkeeping once
C made it: proxy/engine/armed.py; ``repeat.words()`` gives the C fire its launch). Host
memory is offered to every allowed transport with a register hook after the engine mapped it;
memory of another kind goes to the first allowed transport that moves that kind and has one, and a
REGISTER that none takes is refused, naming the kind.

A transport between nodes has the per-process hooks too (NCCL's proxySharedInit): the first allowed
transport with ``proxy_shared_init(ctx) -> bytes`` listens when the communicator spans nodes and
returns this node's connect-info, which the ranks publish at the rendezvous; ``proxy_shared_connect(
ctx, infos)`` gets every node's, in node order, and links the nodes. Then ``proxy_send_envelope(ctx,
conn, op) -> bool`` ships the envelope of a send whose receiver is on another node (True: the send is
complete already, eager), ``proxy_start`` lands a message from another node once it matched here,
``proxy_rank_closed(ctx, rank)`` and ``proxy_abort(ctx, code, message, rank)`` tell every other node
what happened here, ``proxy_note(ctx, node, kind, value, payload)`` carries the engine's own news to
one node (``ctx.note`` there), and ``proxy_describe(ctx) -> dict`` feeds the dump.

A sub moves ``nbytes`` in ``nsteps`` chunks of at most ``chunk`` bytes through ``ctx.steps`` slots,
with the counters posted (handed to the copy engine or the wire), transmitted (left the source),
received (landed in the destination) and done (retired), and ``posted < done + steps``.

``transports.REGISTRY`` orders the transports; ``transports.select`` takes the first that can
connect a pair for a memory kind and raises naming both ranks when none can. ``check_transport``
runs at registration, so that a transport missing part of the contract fails at import.
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, ClassVar, Protocol

from shmproxy.core.memory import MemKind
from shmproxy.core.ops import CODE_DTYPE
from shmproxy.shm import _reduce

if TYPE_CHECKING:  # pragma: no cover
    from shmproxy.engine.args import Args, Sub, Transfer
    from shmproxy.shm.segment import MemfdBuffer


@dataclass(frozen=True)
class PeerInfo:
    """What the progress process knows about a rank when it picks a transport."""

    rank: int
    local_rank: int
    host: str
    pid: int
    node: int = 0


@dataclass(frozen=True)
class Registration:
    """A buffer a rank registered (the REGISTER message), as a transport's register hook sees it.

    Host memory is mapped by the engine first (``buffer``: its MemfdBuffer, the one ``ctx.buffers``
    holds), so a transport that must pin it (RDMA) registers that mapping; memory of another kind
    is the business of the transport that moves that kind alone (``fds`` and ``info``: whatever the
    rank sent for it, e.g. an IPC handle), and ``buffer`` is None."""

    rank: int
    local_rank: int
    buf_id: int
    kind: MemKind
    device: int
    nbytes: int
    buffer: "MemfdBuffer | None" = None
    fds: tuple[int, ...] = ()
    info: Any = None


# Connector states, in order. A connector lives as long as its progress process.
CONN_NEW, CONN_SETUP, CONN_CONNECTED = range(3)
CONN_STATE_NAMES = {CONN_NEW: "new", CONN_SETUP: "setup", CONN_CONNECTED: "connected"}


class Connector:
    """One direction of one connection: ``send`` -> ``recv`` for memory of ``kind``, over ``transport``."""

    __slots__ = ("transport", "send", "recv", "kind", "state", "send_state", "recv_state",
                 "send_info", "recv_info", "nmsgs")

    def __init__(self, transport: "Transport", send: PeerInfo, recv: PeerInfo, kind: MemKind):
        self.transport, self.send, self.recv, self.kind = transport, send, recv, kind
        self.state = CONN_NEW
        self.send_state: Any = None   # the sending side's private state (its transport's to set)
        self.recv_state: Any = None
        self.send_info = self.recv_info = b""
        self.nmsgs = 0  # messages started on it, for the dump

    @property
    def key(self) -> tuple[int, int]:
        return (self.send.rank, self.recv.rank)

    def describe(self) -> dict:
        return {"transport": self.transport.name, "kind": self.kind.name.lower(),
                "state": CONN_STATE_NAMES[self.state], "messages": self.nmsgs}


class HostBuffer(Protocol):
    """Host memory mapped in the progress process, as ``ctx.buffers`` holds it: a rank's registered
    buffer (shm.segment.MemfdBuffer), or a send the progress process buffered (engine/p2p.py)."""

    addr: int    # where it is mapped here
    size: int    # its bytes
    mm: Any      # an object that exports those bytes (the mmap, the buffered array)

    def close(self) -> None: ...


def land_folded(e: Any, src: int) -> None:
    """A collective's folding RECV entry (shmproxy.coll.sched.recv's ``fold`` = (op, dtype code, a)),
    its bytes arrived at ``src``: ``e.dst = a op src``, in the C kernel, a before src (the schedule's
    order of operands, so every node computes the same bits)."""
    op, code, a = e.fold
    _reduce.reduce(op, code, e.nbytes // CODE_DTYPE[code].itemsize, [a, src], [e.dst], False)


class TransportContext(Protocol):
    """The engine as a transport sees it. Nothing else of the engine is a transport's business."""

    steps: int               # STEPS: chunks a sub may have in flight
    chunk: int               # CHUNK_SIZE: bytes per step of a message
    eager: int               # messages up to this size are copied at match time
    parallel_threshold: int  # messages from this size are split over the copy workers
    buffers: dict[tuple[int, int], HostBuffer]   # (local rank, buffer id) -> mapped host buffer

    @property
    def nworkers(self) -> int:
        """Copy workers of the progress process (0: the loop copies inline)."""

    def copy(self, sub: "Sub", dst: int, src: int, nbytes: int) -> bool:
        """Copy one chunk of ``sub``, inline or on a worker; True when it is done already."""

    def memcopy(self, dst: int, src: int, nbytes: int) -> None:
        """Copy now, in this thread (the GIL released)."""

    def args_for(self, conn: Connector, opcount: int) -> "Args":
        """The args that collects this connection's subs of one opCount (created and made active on
        first use within a fetch)."""

    def add_sub(self, args: "Args", work: Any, src: int, dst: int, nbytes: int, chunk: int) -> "Sub":
        """A new sub of ``args`` for ``work`` (a Transfer or a collective), mirrored in the sub table."""

    def settle(self, sub: "Sub", before: tuple[int, int]) -> bool:
        """After a sub was advanced: note progress, publish its counters, retire it when done;
        True when it is done."""

    def post_event(self, fn: Callable[[], None]) -> None:
        """From any thread of the progress process (a transport's helper thread watching sockets or
        device events): have the loop run ``fn`` soon, on its own thread, waking it if it sleeps."""

    wake_pool: int   # the ops pool's address: C helper threads wake the loop through its EVENTS word

    def on_events(self, fn: Callable[[], None]) -> None:
        """Have the loop run ``fn`` every time news came (the EVENTS word moved), after what was
        posted: for helper threads in C, which cannot post a callable and bump EVENTS themselves
        (shm/_wire.c)."""

    def completion_items(self, transfer: Any) -> tuple | None:
        """For a transport whose device writes a message's completion itself: (op, source, tag) of
        both requests, the results to write into their completion slots (every field but the word
        that publishes each, which the device stores after the copy). A transport that has them
        published sets ``transfer.published``; the transfer then finishes without writing its slots.
        None: complete it the usual way."""

    def disarm_routes(self) -> None:
        """Loop thread: forget every armed route (proxy/engine/armed.py) before a launch one of them
        holds is destroyed."""

    def completion_slots(self) -> tuple[int, int, int]:
        """(address, bytes, slots per rank) of the ranks' completion slots in this process: what such
        a device must be able to write (pinned and mapped for it once)."""

    start_entry: Callable[..., bool]     # collectives: start one schedule entry (True: done inline)
    start_schedule: Callable[..., bool]  # collectives: hand a whole chunk schedule to one worker

    # A collective the transport runs whole (proxy_start_coll).
    def coll_sub(self, t: "Transport", ops: list, nbytes: int, keep: list, published: bool = False) -> "Sub":
        """The one sub of the collective of ``ops`` (``nbytes`` moved), in an args of ``t`` made active:
        ``t``'s proxy_progress_coll finishes it; ``keep`` stays alive until then (scratch memory);
        ``published``: the transport's device wrote the requests' completions itself."""

    def coll_items(self, ops: list) -> list:
        """completion_items for every op of a collective whose completion the device writes."""

    def complete_coll(self, ops: list, nbytes: int) -> None:
        """Complete every op of a collective now (nothing to move)."""

    def refuse_coll(self, ops: list, code: int) -> None:
        """Fail every request of a collective with ``code`` (a wrong buffer: nothing was moved)."""

    # What a transport between nodes needs besides (engine/nodes.py); the loop runs every one of these
    # callables, so a helper thread reaches them through post_event.
    params: Any                          # the resolved shmproxy.core.params.Params (read-only)
    transport_state: dict[str, Any]      # a transport's own per-process state, under its name
    timeout: float                       # TIMEOUT: the bound of every wait
    comm_id: int
    net_ip: str                          # the address this node listens on for the others

    @property
    def node(self) -> int:
        """This progress process's node."""

    @property
    def nnodes(self) -> int: ...

    @property
    def secret(self) -> bytes:
        """The job's 16-byte secret, which every connection between nodes must present."""

    @property
    def coll_chunk_max(self) -> int:
        """The largest chunk a collective's SEND or RECV entry may move."""

    def rank_node(self, rank: int) -> int: ...
    def node_ranks(self, node: int) -> list[int]: ...
    def node_host(self, node: int) -> str: ...
    def arrive(self, env: Any) -> None: ...
    def finish(self, transfer: Any) -> None: ...
    def complete_send(self, op: Any, code: int, nbytes: int, peer_dtype: int = 0) -> None: ...
    def entry_done(self, sch: Any, e: Any) -> None: ...
    def remote_closed(self, rank: int) -> None: ...
    def fail(self, code: int, message: str, rank: int | None = None) -> None: ...
    def note(self, node: int, kind: int, value: int, payload: bytes) -> None: ...


class Transport(ABC):
    name: ClassVar[str] = "?"
    kinds: ClassVar[frozenset[MemKind]] = frozenset({MemKind.HOST})   # memory kinds it can move

    @abstractmethod
    def can_connect(self, me: PeerInfo, peer: PeerInfo, kind: MemKind) -> bool:
        """True when this transport can carry ``kind`` memory between ``me`` and ``peer``."""

    @abstractmethod
    def send_setup(self, ctx: TransportContext, conn: Connector) -> bytes:
        """Prepare the sending side of ``conn`` (its ``send_state``); returns its connect-info."""

    @abstractmethod
    def recv_setup(self, ctx: TransportContext, conn: Connector) -> bytes:
        """Prepare the receiving side of ``conn`` (its ``recv_state``); returns its connect-info."""

    @abstractmethod
    def send_connect(self, ctx: TransportContext, conn: Connector, recv_info: bytes) -> None:
        """The sending side reads the receiver's connect-info; ``conn`` can then carry messages."""

    @abstractmethod
    def recv_connect(self, ctx: TransportContext, conn: Connector, send_info: bytes) -> None:
        """The receiving side reads the sender's connect-info."""

    @abstractmethod
    def proxy_start(self, ctx: TransportContext, conn: Connector, transfer: "Transfer") -> bool:
        """Start moving a matched message; True when every byte has landed already (the engine then
        completes both requests). Raises InvalidArgument, before moving anything, when a buffer is
        not what the op says (unknown, or too small)."""

    @abstractmethod
    def proxy_progress(self, ctx: TransportContext, args: "Args") -> bool:
        """Advance the subs of ``args`` without blocking; True once every sub is done."""

    @abstractmethod
    def proxy_free(self, ctx: TransportContext) -> None:
        """Release what the transport holds, at progress-process exit."""

    # Optional hooks: None where a transport has no such thing to do.
    proxy_progress_coll: Callable[[TransportContext, "Args"], bool] | None = None
    proxy_start_coll: Callable[[TransportContext, list], None] | None = None
    proxy_coll_entry: Callable[[TransportContext, Connector, Any, Any], list] | None = None
    proxy_register: Callable[[TransportContext, Registration], None] | None = None
    proxy_deregister: Callable[[TransportContext, Registration], None] | None = None
    proxy_watch: Callable[[TransportContext], Any] | None = None
    proxy_repeat: Callable[[TransportContext, Any], Any] | None = None
    proxy_fired: Callable[[TransportContext, Connector, Any, Any, int, int], None] | None = None
    # Between nodes (see the module header).
    proxy_shared_init: Callable[[TransportContext], bytes] | None = None
    proxy_shared_connect: Callable[[TransportContext, list], None] | None = None
    proxy_send_envelope: Callable[[TransportContext, Connector, Any], bool] | None = None
    proxy_rank_closed: Callable[[TransportContext, int], None] | None = None
    proxy_abort: Callable[[TransportContext, int, str, Any], None] | None = None
    proxy_note: Callable[[TransportContext, int, int, int, bytes], None] | None = None
    proxy_describe: Callable[[TransportContext], dict] | None = None


class OneProcessSides:
    """Setup of a transport whose both sides live in one progress process (shm, cuda): the peer's
    memory is mapped here already, so there is nothing to exchange and nothing to connect. A mixin
    placed before Transport in the bases, so that it fills the four abstract setup methods."""

    def send_setup(self, ctx: TransportContext, conn: Connector) -> bytes:
        return b""

    def recv_setup(self, ctx: TransportContext, conn: Connector) -> bytes:
        return b""

    def send_connect(self, ctx: TransportContext, conn: Connector, recv_info: bytes) -> None:
        return None

    def recv_connect(self, ctx: TransportContext, conn: Connector, send_info: bytes) -> None:
        return None


_REQUIRED = ("can_connect", "send_setup", "recv_setup", "send_connect", "recv_connect", "proxy_start",
             "proxy_progress", "proxy_free")
_OPTIONAL = ("proxy_progress_coll", "proxy_start_coll", "proxy_coll_entry", "proxy_register", "proxy_deregister",
             "proxy_watch", "proxy_repeat", "proxy_fired", "proxy_shared_init",
             "proxy_shared_connect", "proxy_send_envelope", "proxy_rank_closed", "proxy_abort", "proxy_note",
             "proxy_describe")
_BETWEEN_NODES = ("proxy_shared_init", "proxy_shared_connect", "proxy_send_envelope", "proxy_rank_closed",
                  "proxy_abort", "proxy_note")


def check_transport(t: Transport) -> Transport:
    """The contract check run at registration: a broken plug-in fails at import."""
    if not isinstance(t, Transport):
        raise TypeError(f"{t!r} is not a shmproxy.transports.base.Transport")
    if not t.name or t.name == "?":
        raise TypeError(f"transport {type(t).__name__} has no name")
    missing = [m for m in _REQUIRED if getattr(type(t), m, None) is getattr(Transport, m)
               or getattr(getattr(type(t), m, None), "__isabstractmethod__", False)]
    if missing:
        raise TypeError(f"transport {t.name} does not implement {', '.join(missing)}")
    for m in _OPTIONAL:
        hook = getattr(t, m)
        if hook is not None and not callable(hook):
            raise TypeError(f"transport {t.name}: {m} must be a method or None")
    if (t.proxy_register is None) != (t.proxy_deregister is None):
        raise TypeError(f"transport {t.name}: proxy_register and proxy_deregister come together")
    if t.proxy_start_coll is not None and t.proxy_progress_coll is None:
        raise TypeError(f"transport {t.name}: proxy_start_coll needs proxy_progress_coll, which finishes its subs")
    between = [m for m in _BETWEEN_NODES if getattr(t, m) is not None]
    if between and len(between) != len(_BETWEEN_NODES):
        raise TypeError(f"transport {t.name}: a transport between nodes needs all of {', '.join(_BETWEEN_NODES)}")
    if not t.kinds or not all(isinstance(k, MemKind) for k in t.kinds):
        raise TypeError(f"transport {t.name}: kinds must name at least one MemKind")
    return t
