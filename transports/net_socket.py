"""socket transport: host memory between progress processes of different nodes, over TCP.

A communicator that spans nodes has one progress process per node; each listens on one TCP port
(``proxy_shared_init``, its address published through the job's rendezvous) and, once every node's
address is known (``proxy_shared_connect``), node i connects ``SOCKET_NTHREADS * NSOCKS_PERTHREAD``
sockets to every node j > i: one *link* per pair of nodes (transports/net_wire.py: frames, the
handshake with the job's secret, the threads). Every connector between a rank here and a rank there
rides on the link of their two nodes, in both directions.

A message across nodes is MPI's rendezvous, split between the two halves of the engine:

1. the sender's node ships the envelope (RTS: source, destination, tag, size, dtype). A message of
   at most ``NET_EAGER_BYTES`` travels inside it, and its send completes once the bytes are queued
   (MPI's eager protocol: a standard send is complete when its buffer may be reused);
2. the receiver's node matches it like a local message (the engine's receive half, MPI's order),
   and decides what only it can: truncation and dtype agreement. A verdict that moves nothing goes
   back as a CTS without a landing, and the sender completes with it;
3. otherwise the CTS names a *landing* (the receive buffer, pinned), and the sender's node streams
   the bytes in chunks of ``NET_CHUNK_SIZE`` over every socket of the link, at most STEPS chunks
   queued at a time (each chunk that leaves queues the next: ``_Outgoing``), straight from the
   sender's registered memory into the receiver's (``sendmsg`` / ``recv_into`` on views of the
   mappings: no staging copy). When the last chunk has landed the receiver's node says DONE, and
   only then does the send complete: as within a node, a completed send is a delivered message, so a
   sender that dies right after its Send returned never takes that message with it (its chunks on
   other sockets could otherwise arrive after the failure its death causes). The receive completes
   when its last chunk has landed.

Control frames all travel on socket 0 in queue order, so two messages of one pair and tag arrive in
the order they were sent (non-overtaking); bulk frames say where they land and may take any socket.

Collectives across nodes are schedules (shmproxy.coll.hierarchy) whose SEND and RECV entries meet
by key in transports/net_coll.py (``_Net.colls``): on the link's collective wire (shm/_wire.c, C
threads), or without one on the link's last Python-threaded socket (COLL frames).

Failures: a link that breaks without a goodbye (the peer's progress process died, the cable was
cut: keepalive and TCP_USER_TIMEOUT bound that) fails the communicator naming the node and its
ranks; a failure anywhere is sent to every node (ABORT) so that every survivor raises it; a rank that
closes is announced to every node (CLOSED), which fails what waits on it there. The engine's own
news between nodes (a collective's fingerprint, for the mismatch check) travels as NOTE frames.

Threads: the link's reader and writer threads never touch the engine. What they learn they hand
to the loop with ``ctx.post_event``, a reader one event for all the frames one ``recv`` brought
(net_wire.Inbox); the loop owns matching, completion and every table here except the landing table
(and net_coll.py's receives and stash), which readers use under ``_Net.lock``. The loop writes its
own control frames when socket 0 is idle (net_wire._Writer.put), so a small message crosses with no
hand-off on the sender.
"""
from __future__ import annotations

import functools
import itertools
import json
import socket
import threading
import time
from typing import Any, Callable

import numpy as np

from shmproxy.core import errors, log
from shmproxy.core.ops import FLAG_SYNC, KIND_SEND
from shmproxy.shm import _wire, typed
from shmproxy.transports import net_wire as W
from shmproxy.transports.base import Connector, MemKind, PeerInfo, Transport, TransportContext
from shmproxy.transports.net_coll import CollFrames

_log = log.get("NET")


class RemoteSend:
    """The envelope of a send posted on another node, standing in for its op in this node's matcher.

    It has the attributes of shmproxy.core.ops.Op that matching and the receive half read. ``owner``
    is -1: it has no completion slot here. Completing it (``reply``) sends the sender's node the
    verdict, unless its bytes already moved (eager, or landed)."""

    __slots__ = ("kind", "rank", "peer", "tag", "nbytes", "dtype", "mem", "owner", "req_slot", "opcount",
                 "t_post", "t_fetch", "sid", "link", "eager", "replied", "node")

    def __init__(self, link: W.Link, sid: int, src: int, dst: int, tag: int, nbytes: int, dtype: int,
                 mem: int, eager: bytes | None):
        self.kind, self.rank, self.peer, self.tag = KIND_SEND, src, dst, tag
        self.nbytes, self.dtype, self.mem = nbytes, dtype, mem
        self.owner, self.req_slot, self.opcount = -1, -1, 0
        self.t_post = self.t_fetch = time.monotonic_ns()
        self.sid, self.link, self.eager, self.node = sid, link, eager, link.peer
        self.replied = eager is not None   # an eager send completed on its node already

    def reply(self, code: int, nbytes: int, peer_dtype: int = 0) -> None:
        """The receive half's verdict when no byte is to move: the sender completes with ``code``."""
        if self.replied:
            return
        self.replied = True
        self.link.control(W.CTS, self.sid, -1, (code & 0xFFFF) | (peer_dtype << 16))

    def describe(self) -> str:
        return (f"send rank {self.rank} (node {self.node}) peer {self.peer} tag {self.tag} {self.nbytes} B"
                f"{' eager' if self.eager is not None else ''}")


class _Landing:
    """Where a matched message from another node lands: a view of the receive buffer (which pins its
    mapping until the view is released), and how much of it arrived."""

    __slots__ = ("transfer", "view", "nbytes", "got", "after")

    def __init__(self, transfer: Any, view: memoryview, nbytes: int, after: Any = None):
        self.transfer, self.view, self.nbytes, self.got = transfer, view, nbytes, 0
        self.after = after   # run by the loop once every byte landed (a derived datatype's unpack)

    def landed(self, ctx: TransportContext) -> None:
        if self.after is not None:
            self.after()
        ctx.finish(self.transfer)


class _Outgoing:
    """A matched message's chunks on their way out. At most STEPS of them are queued on the link's
    sockets at once (a step is *posted* when its chunk is queued, *transmitted* when the kernel took
    its last byte); each chunk that leaves queues the next, so a large message pipelines over the
    sockets without filling every queue, and the dump can say how far it got. The send completes
    when the receiver's node says DONE (``_Net.on_done``). Writer threads call ``sent``; ``lock``
    keeps the counters."""

    __slots__ = ("net", "op", "view", "link", "rid", "nchunks", "posted", "transmitted", "lock")

    def __init__(self, net: "_Net", op: Any, view: memoryview, link: W.Link, rid: int):
        self.net, self.op, self.view, self.link, self.rid = net, op, view, link, rid
        self.nchunks = -(-op.nbytes // net.chunk)
        self.posted = self.transmitted = 0
        self.lock = threading.Lock()

    def pump(self) -> None:
        chunk, steps = self.net.chunk, self.net.ctx.steps
        todo = []
        with self.lock:
            while self.posted < self.nchunks and self.posted - self.transmitted < steps:
                todo.append(self.posted * chunk)
                self.posted += 1
        for off in todo:
            self.link.bulk(W.DATA, self.rid, off, [self.view[off:off + chunk]], self.sent)

    def sent(self) -> None:
        with self.lock:
            self.transmitted += 1
            last = self.transmitted == self.nchunks
        if last:
            self.view.release()   # every byte left; the send completes at the receiver's DONE (on_done)
        else:
            self.pump()

    def describe(self) -> str:
        return (f"{self.op.describe()}: steps posted {self.posted}, transmitted {self.transmitted} of "
                f"{self.nchunks} chunks")


class _Net:
    """The transport's state in one progress process (ctx.transport_state['socket'])."""

    def __init__(self, ctx: TransportContext):
        p = ctx.params
        self.ctx = ctx
        self.nsocks = p.SOCKET_NTHREADS * p.NSOCKS_PERTHREAD
        self.wire_socks, self.part_min = p.NET_COLL_SOCKETS, p.NET_COLL_PART_BYTES
        self.total = self.nsocks + self.wire_socks   # a link's sockets, as its HELLOs count them
        self.chunk, self.eager_max = p.NET_CHUNK_SIZE, p.NET_EAGER_BYTES
        self.keepalive = p.NET_KEEPALIVE_S
        self.listener: socket.socket | None = None
        self.addr: tuple = ()
        self.family = socket.AF_INET
        self.links: dict[int, W.Link] = {}
        self.ids = itertools.count(1)
        # sid -> (op, view, link): waiting for CTS
        self.sends: dict[int, tuple[Any, memoryview, W.Link]] = {}
        self.outgoing: dict[int, _Outgoing] = {}       # sid -> a matched message's chunks, until DONE
        self.landings: dict[int, _Landing] = {}       # rid -> landing (readers use it: under lock)
        self.lock = threading.Lock()
        self.colls = CollFrames(ctx, self.lock, self.ids, self.chunk)   # collectives' frames (net_coll.py)
        self.stopping = False
        self.threads: list[threading.Thread] = []
        self.dropped = 0   # connections refused at the handshake
        self.ready = threading.Event()   # set once the node layout is known (proxy_shared_connect)

    # ---------------------------------------------------------------- accepting
    def accept_loop(self) -> None:
        assert self.listener is not None
        while not self.stopping:
            try:
                sock, peer = self.listener.accept()
            except socket.timeout:
                continue
            except OSError as exc:
                if not self.stopping:
                    _log.warning("accepting connections failed: %s", exc)
                return
            t = threading.Thread(target=self.handshake, args=(sock, peer), name="shmproxy-net-hello",
                                 daemon=True)
            t.start()

    def handshake(self, sock: socket.socket, peer: Any) -> None:
        """Read a HELLO with a deadline; attach the socket to its link, or drop it (logged)."""
        ctx = self.ctx
        try:
            sock.settimeout(W.HELLO_TIMEOUT_S)
            data = bytearray(W.HELLO.size)
            if not W.recv_exact(sock, memoryview(data)):
                raise W.ProtocolError("closed before its hello")
            # A lower node may connect before our ranks told us the layout (and the secret): wait for it.
            if not self.ready.wait(ctx.timeout):
                raise W.ProtocolError("the node layout never came")
            node, index, nsocks = W.check_hello(bytes(data), ctx.secret, ctx.comm_id, ctx.nnodes, ctx.node)
            if nsocks != self.total:
                raise W.ProtocolError(f"{nsocks} sockets per link, we use {self.total} (SOCKET_NTHREADS, "
                                      f"NSOCKS_PERTHREAD, NET_COLL_SOCKETS must agree on every node)")
            link = self.links.get(node)
            if link is None:
                raise W.ProtocolError(f"no link to node {node}")
            link.attach(index, sock)
        except (W.ProtocolError, OSError) as exc:
            self.dropped += 1
            _log.warning("dropped a connection from %s: %s", peer, exc)
            sock.close()

    def connect_to(self, link: W.Link, addr: tuple, family: int, deadline: float) -> None:
        """Open every socket of ``link`` (we are the lower node), each with its HELLO."""
        ctx = self.ctx
        try:
            for i in range(self.total):
                while True:
                    try:
                        sock = W.connect(addr, family, max(0.1, deadline - time.monotonic()))
                        break
                    except (ConnectionRefusedError, socket.timeout) as exc:
                        if time.monotonic() >= deadline:
                            raise OSError(f"cannot connect to node {link.peer} at {addr}: {exc}") from exc
                        time.sleep(0.05)  # bounded retry of a refused connect, not a synchronisation
                W.send_all(sock, [W.make_hello(ctx.secret, ctx.comm_id, ctx.node, i, self.total)])
                link.attach(i, sock)
        except (OSError, W.ProtocolError) as exc:
            link.broken(f"connecting: {exc}")

    # ---------------------------------------------------------------- frames (reader threads)
    def on_frame(self, link: W.Link, index: int, h: tuple, rd: W.Inbox) -> None:
        ftype, flags, n, a, b, c = h
        ctx = self.ctx
        if ftype == W.DATA:
            with self.lock:
                landing = self.landings.get(a)
            if landing is None or b < 0 or b + n > landing.nbytes:
                raise W.ProtocolError(f"DATA for landing {a} at {b} + {n} B: no such landing or out of "
                                      f"bounds")
            if not rd.read_into(landing.view[b:b + n]) and n:
                raise W.ProtocolError("connection closed inside a frame")
            with self.lock:
                landing.got += n
                done = landing.got == landing.nbytes
                if done:
                    del self.landings[a]
            if done:
                landing.view.release()
                # the sender's Send completes (module header)
                link.control(W.DONE, landing.transfer.send.sid)
                rd.later(lambda: landing.landed(ctx))
        elif ftype == W.COLL:
            self.colls.on_frame(a, n, rd)
        elif ftype == W.RTS:
            eager = bool(flags & W.F_EAGER)
            if (n < W.ENVELOPE.size or n != W.ENVELOPE.size + (c if eager else 0)
                    or (eager and c > self.eager_max) or c < 0):
                raise W.ProtocolError(f"RTS of {n} B for a {c} B message")
            src, dst, dtype, mem = W.ENVELOPE.unpack(rd.payload(W.ENVELOPE.size))
            if ctx.rank_node(src) != link.peer or ctx.rank_node(dst) != ctx.node:
                raise W.ProtocolError(f"RTS from rank {src} to rank {dst} on the link to node {link.peer}")
            env = RemoteSend(link, a, src, dst, b, c, dtype, mem, rd.payload(c) if eager else None)
            rd.later(lambda: ctx.arrive(env))
        elif ftype == W.CTS:
            if n:
                raise W.ProtocolError(f"CTS with {n} B of payload")
            rd.later(lambda: self.on_cts(a, b, c))
        elif ftype == W.DONE:
            if n:
                raise W.ProtocolError(f"DONE with {n} B of payload")
            rd.later(lambda: self.on_done(a))
        elif ftype == W.CLOSED:
            if n or ctx.rank_node(a) != link.peer:
                raise W.ProtocolError(f"CLOSED for rank {a} on the link to node {link.peer}")
            rd.later(lambda: ctx.remote_closed(a))
        elif ftype == W.NOTE:
            if n > W.MAX_CONTROL:
                raise W.ProtocolError(f"NOTE of {n} B")
            payload = rd.payload(n)
            rd.later(lambda: ctx.note(link.peer, a, b, payload))
        elif ftype == W.ABORT:
            if n > W.MAX_CONTROL:
                raise W.ProtocolError(f"ABORT of {n} B")
            text = rd.payload(n).decode("utf-8", "replace")
            rd.later(lambda: ctx.fail(a or errors.Aborted.code, f"{text} (reported by node {link.peer})",
                                      None if b < 0 else b))
        else:
            raise W.ProtocolError(f"unknown frame type {ftype}")

    def on_lost(self, link: W.Link, reason: str) -> None:
        ctx = self.ctx
        ranks = ctx.node_ranks(link.peer)
        shown = ", ".join(map(str, ranks[:8])) + (" ..." if len(ranks) > 8 else "")
        msg = f"lost node {link.peer} ({ctx.node_host(link.peer)}, ranks {shown}): {reason}"
        ctx.post_event(lambda: ctx.fail(errors.PeerDiedError.code, msg, ranks[0] if ranks else None))

    # ---------------------------------------------------------------- the loop's side
    def on_cts(self, sid: int, rid: int, verdict: int) -> None:
        """Loop: the receiver's node matched our send ``sid``: move its bytes to landing ``rid``, or
        complete it with the verdict when nothing is to move."""
        ctx = self.ctx
        entry = self.sends.pop(sid, None)
        if entry is None:
            ctx.fail(errors.InternalError.code, f"clear-to-send for unknown send {sid}")
            return
        op, view, link = entry
        if rid < 0:
            view.release()
            ctx.complete_send(op, verdict & 0xFFFF, op.nbytes, verdict >> 16)
            return
        out = _Outgoing(self, op, view, link, rid)
        self.outgoing[sid] = out
        out.pump()

    def on_done(self, sid: int) -> None:
        """Loop: every byte of our send ``sid`` landed on the receiver's node: the send completes."""
        out = self.outgoing.pop(sid, None)
        if out is None:   # (the writer may not have counted its last chunk yet: the bytes are there)
            self.ctx.fail(errors.InternalError.code,
                          f"a delivery notice for send {sid}, which is not in flight")
            return
        out.view.release()   # released already unless the message was empty
        self.ctx.complete_send(out.op, 0, out.op.nbytes, 0)


class SocketTransport(Transport):
    name = "socket"
    kinds = frozenset({MemKind.HOST})

    @staticmethod
    def _net(ctx: TransportContext) -> _Net:
        net = ctx.transport_state.get("socket")
        if net is None:
            net = ctx.transport_state["socket"] = _Net(ctx)
        return net

    def can_connect(self, me: PeerInfo, peer: PeerInfo, kind: MemKind) -> bool:
        return kind == MemKind.HOST and me.node != peer.node

    def send_setup(self, ctx: TransportContext, conn: Connector) -> bytes:
        conn.send_state = self._link(ctx, conn)
        return b""   # the link was set up for the whole node pair (proxy_shared_connect)

    def recv_setup(self, ctx: TransportContext, conn: Connector) -> bytes:
        conn.recv_state = self._link(ctx, conn)
        return b""

    def send_connect(self, ctx: TransportContext, conn: Connector, recv_info: bytes) -> None:
        return None

    def recv_connect(self, ctx: TransportContext, conn: Connector, send_info: bytes) -> None:
        return None

    def _link(self, ctx: TransportContext, conn: Connector) -> W.Link:
        other = conn.recv.node if conn.send.node == ctx.node else conn.send.node
        link = self._net(ctx).links.get(other)
        if link is None:
            raise errors.InvalidUsage(f"no link to node {other} (ranks {conn.send.rank} -> {conn.recv.rank})")
        return link

    # ---------------------------------------------------------------- per process
    def proxy_shared_init(self, ctx: TransportContext) -> bytes:  # type: ignore[override]
        """Listen on this node's address (ctx.net_ip); returns the connect-info other nodes use."""
        net = self._net(ctx)
        ip = ctx.net_ip
        fam = socket.AF_INET6 if ":" in ip else socket.AF_INET
        sock = socket.socket(fam, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((ip, 0))
            sock.listen(128)
        except OSError as exc:
            sock.close()
            raise errors.from_oserror(f"cannot listen on {ip} for other nodes", exc) from exc
        sock.settimeout(0.5)   # the accept loop looks at ``stopping`` between waits
        net.listener, net.family = sock, fam
        net.addr = sock.getsockname()[:2]
        t = threading.Thread(target=net.accept_loop, name="shmproxy-net-accept", daemon=True)
        t.start()
        net.threads.append(t)
        _log.info("node %d listening on %s port %d", ctx.node, net.addr[0], net.addr[1])
        return json.dumps({"ip": net.addr[0], "port": net.addr[1]}).encode()

    def proxy_shared_connect(self, ctx: TransportContext,  # type: ignore[override]
                             infos: list[bytes]) -> None:
        """Every node's connect-info, in node order: make the link to each other node (we connect to
        the higher nodes; the lower ones connect to us)."""
        net = self._net(ctx)
        deadline = time.monotonic() + ctx.timeout
        # The connect threads below and the dump read the table: built aside, published whole.
        links = {j: W.Link(j, net.nsocks, net.on_frame, net.on_lost, net.keepalive, ctx.post_event,
                           ctx.params.NET_DIRECT_WRITE_BYTES,
                           _wire.Wire(j, net.wire_socks, ctx.wake_pool, net.part_min,
                                      max(net.chunk, ctx.coll_chunk_max), ctx.params.NET_DIRECT_WRITE_BYTES)
                           if net.wire_socks else None,
                           net.wire_socks)
                 for j in range(len(infos)) if j != ctx.node}
        net.links = net.colls.links = links
        if net.wire_socks:
            ctx.on_events(net.colls.drain)
        for j, raw in enumerate(infos):
            if j > ctx.node:
                link = links[j]
                info = json.loads(raw)
                fam = socket.AF_INET6 if ":" in info["ip"] else socket.AF_INET
                t = threading.Thread(target=net.connect_to, args=(link, (info["ip"], int(info["port"])), fam,
                                                                  deadline),
                                     name=f"shmproxy-net-connect{j}", daemon=True)
                t.start()
                net.threads.append(t)
        net.ready.set()

    # ---------------------------------------------------------------- messages
    def proxy_send_envelope(self, ctx: TransportContext, conn: Connector,  # type: ignore[override]
                            op: Any) -> bool:
        """The send half of a message to another node: ship its envelope (with its bytes when eager).
        True when the send is complete already (eager)."""
        net = self._net(ctx)
        link: W.Link = conn.send_state
        n = op.nbytes
        # a derived datatype is packed here, on the sender's node (shmproxy.shm.typed)
        view = _view(ctx, op, n) if op.tmap is None else typed.pack(ctx.buffers, op).data
        head = W.ENVELOPE.pack(op.rank, op.peer, op.dtype, op.mem)
        if n <= net.eager_max and not op.flags & FLAG_SYNC:   # an Ssend waits for its match
            payload = head + bytes(view)
            view.release()
            link.control(W.RTS, 0, op.tag, n, payload, flags=W.F_EAGER)
            return True
        sid = next(net.ids)
        net.sends[sid] = (op, view, link)
        link.control(W.RTS, sid, op.tag, n, head)
        return False

    def proxy_start(self, ctx: TransportContext, conn: Connector, transfer: Any) -> bool:
        """A message from another node met its receive here: land its bytes (now, when they came
        with the envelope; else ask for them with a clear-to-send naming the landing)."""
        net = self._net(ctx)
        env, recv, n = transfer.send, transfer.recv, transfer.nbytes
        after: Callable[[], None] | None = None
        if recv.tmap is None:
            view = _view(ctx, recv, n)
        else:   # a derived datatype: land contiguously, then scatter on this node (shmproxy.shm.typed)
            typed.check(ctx.buffers, recv, n)
            tmp = np.empty(n, np.uint8)
            view = tmp.data
            after = functools.partial(typed.unpack, ctx.buffers, recv, tmp, n)
        if env.eager is not None:
            view[:n] = env.eager
            view.release()
            if after is not None:
                after()
            return True
        rid = next(net.ids)
        with net.lock:
            net.landings[rid] = _Landing(transfer, view, n, after)
        env.replied = True
        env.link.control(W.CTS, env.sid, rid, 0)
        if n == 0:   # an empty synchronous send: nothing will arrive, it is delivered now
            with net.lock:
                del net.landings[rid]
            view.release()
            env.link.control(W.DONE, env.sid)
            return True
        return False

    def proxy_progress(self, ctx: TransportContext, args: Any) -> bool:
        return True   # messages across nodes make no args: their helper threads move them

    def proxy_coll_entry(self, ctx: TransportContext, conn: Connector, sch: Any,  # type: ignore[override]
                         e: Any) -> list:
        """A collective's SEND (one frame from its region) or RECV (land the frame of its key)."""
        return self._net(ctx).colls.entry(conn.send_state, sch, e)

    # ---------------------------------------------------------------- news for every node
    def proxy_rank_closed(self, ctx: TransportContext, rank: int) -> None:  # type: ignore[override]
        for link in self._net(ctx).links.values():
            link.control(W.CLOSED, rank)

    def proxy_abort(self, ctx: TransportContext, code: int, message: str,  # type: ignore[override]
                    rank: int | None) -> None:
        data = message.encode("utf-8", "replace")[:W.MAX_CONTROL]
        for link in self._net(ctx).links.values():
            link.control(W.ABORT, code, -1 if rank is None else rank, 0, data)
            if link.wire is not None:   # no frame lands in a failed collective's buffers from now on
                link.wire.cancel()

    def proxy_note(self, ctx: TransportContext, node: int, kind: int, value: int,  # type: ignore[override]
                   payload: bytes) -> None:
        if len(payload) > W.MAX_CONTROL:
            raise errors.InternalError(f"a note of {len(payload)} B for node {node}")
        self._net(ctx).links[node].control(W.NOTE, kind, value, 0, payload)

    def proxy_describe(self, ctx: TransportContext) -> dict:  # type: ignore[override]
        """Loop thread: the links and everything that waits on another node, for the dump."""
        net = self._net(ctx)
        waits = []
        for op, _view, link in list(net.sends.values()):
            waits.append({"node": link.peer,
                          "what": f"{op.describe()}: waits for its receiver's clear-to-send"})
        with net.lock:
            landings = list(net.landings.values())
        for ld in landings:
            t = ld.transfer
            waits.append({"node": t.send.node, "what": f"{t.recv.describe()}: {ld.got} of {ld.nbytes} B of "
                                                       f"rank {t.send.rank}'s message arrived"})
        for out in list(net.outgoing.values()):
            waits.append({"node": out.link.peer, "what": out.describe()})
        colls_e, stashed = net.colls.waiting()
        for e in colls_e:
            seq = e.key[0] if isinstance(e.key, tuple) and e.key else e.key
            waits.append({"node": e.peer, "what": f"collective #{seq} waits for {e.nbytes} B {e.key!r}"})
        return {"listening": list(net.addr), "links": [lk.describe() for lk in net.links.values()],
                "waiting": waits, "coll_stashed": stashed, "dropped_connections": net.dropped}

    def proxy_free(self, ctx: TransportContext) -> None:
        net = ctx.transport_state.get("socket")
        if net is None:
            return
        net.stopping = True
        for link in net.links.values():
            link.close()
        if net.listener is not None:
            net.listener.close()
        for t in net.threads:
            t.join(1.0)


def _view(ctx: TransportContext, op: Any, nbytes: int) -> memoryview:
    """A view of an op's ``nbytes`` in its registered buffer, bounds-checked; it pins the mapping
    (a DEREGISTER's unmap waits until it is released)."""
    if op.mem & 0xFF != MemKind.HOST:
        raise errors.InvalidArgument(f"{op.describe()}: not host memory (memory word {op.mem:#x})")
    buf = ctx.buffers.get((op.owner, op.buf_id))
    if buf is None or op.offset + nbytes > buf.size or nbytes > op.nbytes:
        raise errors.InvalidArgument(
            f"{op.describe()}: buffer {op.buf_id} offset {op.offset} + {nbytes} B is outside the registered "
            f"buffer ({'unknown' if buf is None else buf.size} B)")
    return memoryview(buf.mm)[op.offset:op.offset + nbytes]
