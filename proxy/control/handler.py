"""The progress process's side of the control protocol (runs on the service thread).

    INIT        a rank introduces itself: rank, local rank, host identity, affinity. The pid comes
                from SO_PEERCRED, never from the payload. When every local rank is in, the progress
                process chooses its cores.
    SHARED_INIT the pool's fd (SCM_RIGHTS) and size, so the rank can map it. The pool has no name in
                /dev/shm (shm/segment.py): nothing of ours is visible there, whatever happens to any process.
    SETUP       the rank has mapped the pool (a failure is recorded there from then on: engine/failure.py).
    CONNECT     transports for the rank's peers (first in the registry that can connect).
    REGISTER    a memfd (SCM_RIGHTS) the rank will use as a buffer; the progress process maps it.
    DEREGISTER  buffers the rank no longer uses; unmapped by the loop once nothing is in flight.
    GETFD       a registered buffer's fd (for transports that map peers' memory themselves).
    QUERYFD     whether a buffer is registered and its size.
    TYPE_REGISTER  a derived datatype's block list (shmproxy.shm.typed), under the rank's type id;
                in parts ("more": true until the last), so that one message stays under MAX_PAYLOAD.
                Registered types live as long as the communicator: ops in the pool name them by id,
                and a free sent over this socket could overtake an op still waiting to be fetched.
    CLOSE       the rank is done; when every local rank is, the loop drains and exits.
    ABORT       fail the communicator now; STOP stops it as if every rank had closed.

Threads. Requests arrive on the service thread, but what they change (the rank table, buffers,
registrations, connections, datatypes, the stop flag) is the loop's: every message but ABORT is run on
the loop thread (``engine.calls``, engine/loopcall.py), and its answer leaves once it ran, so a rank's
next op always finds what its request set up. ABORT and a rank's death (``on_process_exit``) go to
the failures component straight from this thread: a failure must end the job even while the loop is
busy (engine/failure.py). Only the join bookkeeping (``failures.told``, ``joins``) is this thread's.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any

from shmproxy.core import errors, log
from shmproxy.control.protocol import TYPE_MAX_BLOCKS, TYPE_PART_BLOCKS, MsgType, next_state
from shmproxy.shm.typed import TypeMap
from shmproxy.shm import pool as P
from shmproxy.engine.ranks import RankInfo
from shmproxy.core.memory import MAX_DEVICE, MemKind, parse_kind
from shmproxy.transports.base import Registration
from shmproxy.shm.segment import MemfdBuffer

if TYPE_CHECKING:  # pragma: no cover
    from shmproxy.engine.progress import ProgressEngine

_log = log.get("SERVICE")


def _int(payload: dict, key: str, lo: int, hi: int) -> int:
    v = payload.get(key)
    if not isinstance(v, int) or isinstance(v, bool) or not lo <= v < hi:
        raise errors.InvalidArgument(f"field {key!r} must be an int in [{lo}, {hi}), got {v!r}")
    return v


# Messages of a rank joining the communicator: refused with the failure once it failed.
_JOINING = frozenset({MsgType.INIT, MsgType.SHARED_INIT, MsgType.SETUP, MsgType.CONNECT})


class ControlHandler:
    def __init__(self, engine: "ProgressEngine"):
        self.engine = engine
        self.dispatch = {
            MsgType.INIT: self.on_init, MsgType.SHARED_INIT: self.on_shared_init,
            MsgType.SETUP: self.on_setup, MsgType.CONNECT: self.on_connect,
            MsgType.REGISTER: self.on_register, MsgType.DEREGISTER: self.on_deregister,
            MsgType.GETFD: self.on_getfd, MsgType.QUERYFD: self.on_queryfd,
            MsgType.TYPE_REGISTER: self.on_type_register,
            MsgType.CLOSE: self.on_close, MsgType.ABORT: self.on_abort, MsgType.STOP: self.on_stop,
        }

    # ServiceHandler protocol -------------------------------------------------------------------
    def handle(self, conn: Any, msg: MsgType, payload: dict, fds: list[int]) -> tuple[dict, list[int]]:
        try:
            if msg in _JOINING and self.engine.failures.error is not None:
                self._refuse_join(conn, payload)
            if msg is MsgType.ABORT:
                return self._answer(conn, msg, payload, fds)
            return self.engine.calls.run(lambda: self._answer(conn, msg, payload, fds))
        except BaseException:
            for fd in fds:
                _close_quietly(fd)
            raise
        finally:
            self._joined()

    def _answer(self, conn: Any, msg: MsgType, payload: dict, fds: list[int]) -> tuple[dict, list[int]]:
        """The loop thread (but for ABORT): serve one message, and publish the connection's new state."""
        resp, out_fds = self.dispatch[msg](conn, payload, fds)
        info = conn.data.get("info")
        if info is not None:
            e = self.engine
            e.q[e.layout.rank_q(info.local_rank, P.RANK_CONN_STATE)] = int(next_state(conn.state, msg))
        return resp, out_fds

    def on_disconnect(self, conn: Any, clean: bool) -> None:
        info = conn.data.get("info")
        if info is not None and not clean and not info.closed:
            _log.info("rank %d dropped its service connection without CLOSE", info.rank)
        self._joined()

    def on_process_exit(self, conn: Any) -> None:
        info = conn.data.get("info")
        if info is not None:
            self.engine.failures.rank_died(info)
        self._joined()

    def _refuse_join(self, conn: Any, payload: dict) -> None:
        """The communicator failed: a rank still joining gets the failure itself (ProgressEngine.
        wait_until_told keeps the service up for it), which names who died."""
        e = self.engine
        info = conn.data.get("info")
        lr = info.local_rank if info is not None else payload.get("local_rank")
        if isinstance(lr, int) and 0 <= lr < e.nlocal:
            e.failures.told.add(lr)
        error = e.failures.error
        assert error is not None
        raise errors.while_joining(error)

    def _joined(self) -> None:
        """Wake ProgressEngine.wait_until_told: what it waits for may have changed."""
        with self.engine.failures.joins:
            self.engine.failures.joins.notify_all()

    # messages ----------------------------------------------------------------------------------
    def on_init(self, conn: Any, payload: dict, fds: list[int]):
        e = self.engine
        rank = _int(payload, "rank", 0, e.size)
        local_rank = _int(payload, "local_rank", 0, e.nlocal)
        host = payload.get("host")
        affinity = payload.get("affinity") or []
        if not isinstance(host, str) or not isinstance(affinity, list):
            raise errors.InvalidArgument("INIT needs 'host' (str) and 'affinity' (list)")
        if payload.get("size") != e.size or payload.get("local_size") != e.nlocal:
            raise errors.InvalidUsage(
                f"rank {rank} thinks the job has {payload.get('size')} ranks, {payload.get('local_size')} "
                f"on this node; the progress process was started for {e.size} and {e.nlocal}")
        if local_rank in e.st.ranks:
            old = e.st.ranks[local_rank]
            raise errors.InvalidUsage(f"local rank {local_rank} is already rank {old.rank} (pid {old.pid})")
        if rank in e.st.local_of:
            raise errors.InvalidUsage(f"rank {rank} already connected as local rank {e.st.local_of[rank]}")
        for other in e.st.ranks.values():
            if other.host != host:
                raise errors.InvalidUsage(
                    f"rank {rank} runs on host {host!r} but rank {other.rank} on {other.host!r}: "
                    f"ranks of different hosts cannot share a progress process")
        info = RankInfo(rank, local_rank, conn.pid, host, [int(c) for c in affinity])
        conn.data["info"] = info
        e.st.ranks[local_rank] = info
        e.st.local_of[rank] = local_rank
        e.q[e.layout.rank_q(local_rank, P.RANK_PID)] = conn.pid
        _log.info("rank %d (local %d, pid %d) connected", rank, local_rank, conn.pid)
        if len(e.st.ranks) == e.nlocal:
            e.decide_affinity()
        e.intro.post_write_info()   # the loop is the blob's one writer
        return {"proxy_pid": e.view.ctrl(P.CTRL_PROXY_PID), "nlocal": e.nlocal, "net": e.nodes.info.hex()}, (
            [e.fault_fd] if e.fault_fd >= 0 else [])

    def on_shared_init(self, conn: Any, payload: dict, fds: list[int]):
        e = self.engine
        return {"pool": e.seg.name, "bytes": e.layout.total_bytes}, [e.seg.fd]

    def on_setup(self, conn: Any, payload: dict, fds: list[int]):
        conn.data["info"].mapped = True
        return {}, []

    def on_connect(self, conn: Any, payload: dict, fds: list[int]):
        e = self.engine
        me = conn.data["info"]
        peers = payload.get("peers")
        if not isinstance(peers, list):
            raise errors.InvalidArgument("CONNECT needs 'peers' (list of ranks)")
        net = payload.get("net")
        if net is not None:   # the communicator spans nodes: the layout the rendezvous found
            if not isinstance(net, dict):
                raise errors.InvalidArgument("CONNECT: 'net' must be an object")
            e.nodes.setup(net, me.rank)
        out = {}
        for p in peers:
            if not isinstance(p, int) or not 0 <= p < e.size:
                raise errors.InvalidArgument(f"CONNECT: peer {p!r} out of range [0, {e.size})")
            if p in e.st.local_of:
                link = e.connections.get(me.rank, p, MemKind.HOST)   # both ways, made now if new
                e.connections.get(p, me.rank, MemKind.HOST)
                out[str(p)] = link.transport.name
            else:
                out[str(p)] = "pending"  # selected when the peer connects and the first message flows
        return {"transports": out}, []

    def on_register(self, conn: Any, payload: dict, fds: list[int]):
        e = self.engine
        me = conn.data["info"]
        buf_id = _int(payload, "buf_id", 0, 2**31)
        size = _int(payload, "bytes", 0, 2**62)
        kind = parse_kind(payload.get("kind", "host"))
        device = _int(payload, "device", 0, MAX_DEVICE + 1) if "device" in payload else 0
        hooked = [t for t in e.st.transports if kind in t.kinds and t.proxy_register is not None]
        if kind != MemKind.HOST:
            if not hooked:
                raise errors.InvalidArgument(f"REGISTER of {kind.name.lower()} memory (device {device}) by "
                                             f"rank {me.rank}: no allowed transport moves that memory kind")
            reg = Registration(me.rank, me.local_rank, buf_id, kind, device, size, None, tuple(fds),
                               payload.get("info"))
            hooked[0].proxy_register(e.ctx, reg)   # type: ignore[misc]  # it owns the fds from here
            e.st.registrations[(me.local_rank, buf_id)] = ([hooked[0]], reg)
            return {}, []
        if len(fds) != 1:
            raise errors.InvalidArgument(f"REGISTER needs exactly one fd, got {len(fds)}")
        if (me.local_rank, buf_id) in e.st.buffers:
            raise errors.InvalidUsage(f"buffer {buf_id} of rank {me.rank} is already registered")
        buf = MemfdBuffer.from_fd(fds[0], size)
        e.st.buffers[(me.local_rank, buf_id)] = buf
        if hooked:
            reg = Registration(me.rank, me.local_rank, buf_id, kind, device, size, buf)
            for t in hooked:
                t.proxy_register(e.ctx, reg)   # type: ignore[misc]
            e.st.registrations[(me.local_rank, buf_id)] = (hooked, reg)
        return {}, []

    def on_deregister(self, conn: Any, payload: dict, fds: list[int]):
        e = self.engine
        me = conn.data["info"]
        ids = payload.get("buf_ids")
        if not isinstance(ids, list):
            raise errors.InvalidArgument("DEREGISTER needs 'buf_ids' (list)")
        for bid in ids:
            hooked = e.st.registrations.pop((me.local_rank, bid), None)
            if hooked is not None:
                e.deregister(*hooked)
            buf = e.st.buffers.pop((me.local_rank, bid), None)
            if buf is not None:
                e.retired.append(buf)
        return {}, []

    def on_type_register(self, conn: Any, payload: dict, fds: list[int]):
        e = self.engine
        me = conn.data["info"]
        key = (me.local_rank, _int(payload, "type_id", 1, 2**31))
        extent = _int(payload, "extent", 0, 2**62)
        blocks = payload.get("blocks")
        if not isinstance(blocks, list) or len(blocks) % 2 or len(blocks) > 2 * TYPE_PART_BLOCKS or \
                not all(isinstance(v, int) and not isinstance(v, bool) for v in blocks):
            raise errors.InvalidArgument(f"TYPE_REGISTER needs 'blocks' (a list of at most "
                                         f"{TYPE_PART_BLOCKS} "
                                         "(displacement, length) int pairs)")
        if key in e.p2p.types:
            raise errors.InvalidUsage(f"datatype {key[1]} of rank {me.rank} is already registered")
        parts = e.p2p.types_pending.setdefault(key, [])
        parts.extend(blocks)
        if len(parts) > 2 * TYPE_MAX_BLOCKS:
            del e.p2p.types_pending[key]
            raise errors.InvalidArgument(f"datatype {key[1]} of rank {me.rank}: more than {TYPE_MAX_BLOCKS} "
                                         "blocks")
        if not payload.get("more"):
            del e.p2p.types_pending[key]
            e.p2p.types[key] = TypeMap(parts, extent)   # raises InvalidArgument naming a bad table
        return {}, []

    def on_getfd(self, conn: Any, payload: dict, fds: list[int]):
        e = self.engine
        key = (_int(payload, "local_rank", 0, e.nlocal), _int(payload, "buf_id", 0, 2**31))
        buf = e.st.buffers.get(key)
        if not isinstance(buf, MemfdBuffer):   # (the registry's other entries, buffered sends, have no fd)
            raise errors.InvalidArgument(f"no buffer {key[1]} registered by local rank {key[0]}")
        return {"bytes": buf.size}, [buf.fd]

    def on_queryfd(self, conn: Any, payload: dict, fds: list[int]):
        e = self.engine
        key = (_int(payload, "local_rank", 0, e.nlocal), _int(payload, "buf_id", 0, 2**31))
        buf = e.st.buffers.get(key)
        return {"registered": buf is not None, "bytes": buf.size if buf else 0}, []

    def on_close(self, conn: Any, payload: dict, fds: list[int]):
        self.engine.rank_closed(conn.data["info"])
        return {}, []

    def on_abort(self, conn: Any, payload: dict, fds: list[int]):
        me = conn.data["info"]
        code = payload.get("code")
        if type(code) is int and code in (errors.Timeout.code, errors.InvalidUsage.code):
            # a failure a rank found itself (a small collective that timed out or mismatched: rank/fastpath.py)
            self.engine.failures.fail(code, str(payload.get("message", ""))[:400], rank=me.rank, pid=me.pid)
            return {}, []
        reason = str(payload.get("reason", ""))[:200]
        self.engine.failures.fail(errors.Aborted.code,
                                  f"rank {me.rank} called Abort()" + (f": {reason}" if reason else ""),
                                  rank=me.rank, pid=me.pid)
        return {}, []

    def on_stop(self, conn: Any, payload: dict, fds: list[int]):
        e = self.engine
        e.st.stopping = True
        e.view.set_ctrl(P.CTRL_STOP, 1)
        return {}, []


def _close_quietly(fd: int) -> None:
    import os
    try:
        os.close(fd)
    except OSError as exc:
        _log.debug("closing fd %d: %s", fd, exc)
