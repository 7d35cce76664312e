"""The progress engine's dispatch, in-process: a ProgressEngine with two fake local ranks (registered
memfds, no service, no workers) is handed forged records, and must turn each problem into a
request's error or the communicator's failure, never an exception out of its loop."""
from __future__ import annotations

import os
import time
from typing import Iterator

import pytest

from shmproxy.core import errors, ops as opsmod, params as PM
from shmproxy.core.memory import MemKind, mem_word
from shmproxy.engine.progress import ProgressEngine
from shmproxy.engine.ranks import RankInfo
from shmproxy.shm import pool as P
from shmproxy.shm.segment import MemfdBuffer
from shmproxy.transports.base import PeerInfo
from shmproxy.transports.shm import ShmTransport
from shmproxy import transports

SLOT_WORDS = P.SLOT_BYTES // 8


@pytest.fixture
def engine(tmp_path) -> Iterator[ProgressEngine]:
    params = PM.Params(env={"SHMPROXY_RUN_DIR": str(tmp_path)})
    eng = ProgressEngine(params, str(tmp_path / "c.sock"), 2, 2, "0123456789abcdef", 0, os.getpid())
    try:
        for lr in range(2):
            eng.st.ranks[lr] = RankInfo(lr, lr, os.getpid(), "h", [0])
            eng.st.local_of[lr] = lr
            fd = os.memfd_create("dispatch")
            os.ftruncate(fd, 4096)
            eng.st.buffers[(lr, 1)] = MemfdBuffer.from_fd(fd, 4096)
        yield eng
    finally:
        eng.failures.failed = False   # nobody to tell: shutdown() must not linger for ranks that never joined
        eng.shutdown()       # releases the pool, the buffers and their fds now, not at a later GC


def op(eng: ProgressEngine, kind: int, owner: int, peer: int, slot: int, tag: int = 7, mem: int = 0) -> opsmod.Op:
    lay = eng.layout
    scratch = bytearray(lay.total_bytes)
    opsmod.pack(scratch, lay, 0, kind, opsmod.DTYPE_CODE["B"], owner, peer, tag, 1, 1, slot, 1, 0, 8, 8, 0, mem=mem)
    return opsmod.Op(0, P.RECORD.unpack_from(scratch, lay.record_off(0)), owner, 0)


def status(eng: ProgressEngine, slot: int) -> int:
    return int(eng.q[eng.completion.slots_q + SLOT_WORDS * slot + P.SLOT_STATUS]) & 0xFFFF


def pair(eng: ProgressEngine, mem_send: int = 0, mem_recv: int = 0) -> tuple[int, int]:
    rslot, sslot = eng.layout.max_ops, 0        # local rank 1's first slot, local rank 0's first
    eng.p2p.append(op(eng, opsmod.KIND_RECV, 1, 0, rslot, mem=mem_recv))
    eng.p2p.append(op(eng, opsmod.KIND_SEND, 0, 1, sslot, mem=mem_send))
    return sslot, rslot


def test_a_matched_message_moves_through_its_connector(engine):
    s, r = pair(engine)
    assert status(engine, s) == status(engine, r) == 0 and not engine.failures.failed
    conn = engine.connections.conns[(0, 1, MemKind.HOST)]
    assert conn.transport.name == "shm" and conn.nmsgs == 1 and conn.describe()["state"] == "connected"


def test_no_transport_for_a_pair_fails_the_communicator_naming_both_ranks_and_the_kind(engine):
    class Refuses(ShmTransport):
        name = "refuses"

        def can_connect(self, me: PeerInfo, peer: PeerInfo, kind: MemKind) -> bool:
            return False
    engine.st.transports = (Refuses(),)
    pair(engine)
    error = engine.failures.error
    assert engine.failures.failed and isinstance(error, errors.InvalidUsage)
    assert "rank 0" in str(error) and "rank 1" in str(error) and "host memory" in str(error)


def test_device_memory_with_no_device_transport_fails_the_communicator_naming_the_kind(engine):
    engine.st.transports = transports.allowed("shm")
    pair(engine, mem_send=mem_word(MemKind.CUDA, 0))
    error = engine.failures.error
    assert engine.failures.failed and "cuda memory" in str(error) and "tried: shm" in str(error)


def test_an_unknown_memory_kind_fails_both_requests_not_the_loop(engine):
    s, r = pair(engine, mem_recv=0x7F)
    assert status(engine, s) == status(engine, r) == errors.InvalidArgument.code and not engine.failures.failed


def test_a_forged_wildcard_send_is_refused(engine):
    engine.p2p.append(op(engine, opsmod.KIND_SEND, 0, 1, 0, tag=opsmod.ANY_TAG))
    assert status(engine, 0) == errors.InvalidArgument.code and not engine.failures.failed
    assert len(engine.p2p.matcher) == 0


def test_a_transport_thread_hands_the_loop_work_through_the_context(engine):
    """What a transport's helper thread (sockets, device events) does: ctx.post_event from its own
    thread; the loop runs the callable on its next pass, on the loop's thread."""
    import threading
    ran = []
    t = threading.Thread(target=lambda: engine.ctx.post_event(lambda: ran.append(threading.get_ident())))
    t.start()
    t.join(10)
    assert not ran   # queued, not run by the posting thread
    engine.progress_once()
    assert ran == [threading.get_ident()] and engine.events.seen == 1


def test_a_closed_ranks_abandoned_receive_does_not_take_a_later_message(engine):
    """Rank 1 posted a receive and closed without it (close abandons unmatched receives): the progress
    process drops it, and a message sent to rank 1 afterwards fails (the peer closed first) instead
    of landing in a receive nobody waits for."""
    rslot = engine.layout.max_ops
    engine.p2p.append(op(engine, opsmod.KIND_RECV, 1, 0, rslot))
    engine.p2p.close_half(engine.st.ranks[1])
    assert len(engine.p2p.matcher) == 0 and status(engine, rslot) == 0   # dropped, not completed
    engine.p2p.append(op(engine, opsmod.KIND_SEND, 0, 1, 0))
    assert status(engine, 0) == errors.InvalidUsage.code and len(engine.p2p.matcher) == 0


def test_a_service_request_changes_engine_state_on_the_loop_thread_before_its_answer(engine):
    """REGISTER handled on the service thread: the buffer table and the transports' register hooks
    change on the loop's thread (engine/loopcall.py), and the answer leaves only once they did."""
    import threading
    from shmproxy.control.handler import ControlHandler
    from shmproxy.control.protocol import ConnState, MsgType
    from shmproxy.control.service_requests import ConnInfo

    hooked: list = []

    class Hooks(ShmTransport):
        name = "hooks"

        def proxy_register(self, ctx, reg):
            hooked.append((threading.get_ident(), reg.buf_id))

        def proxy_deregister(self, ctx, reg):
            hooked.append((threading.get_ident(), -reg.buf_id))

    engine.st.transports = (Hooks(),)
    engine.calls.started()   # this thread is the loop
    conn = ConnInfo(1, -1, os.getpid(), 0, 0, 0, 0, ConnState.CONNECTED, {"info": engine.st.ranks[0]})
    handler = ControlHandler(engine)
    fd = os.memfd_create("registered")
    os.ftruncate(fd, 4096)
    answers: list = []
    service = threading.Thread(target=lambda: answers.append(
        handler.handle(conn, MsgType.REGISTER, {"buf_id": 9, "bytes": 4096}, [fd])))
    service.start()
    deadline = time.monotonic() + 10
    while not engine.events.queue and time.monotonic() < deadline:
        time.sleep(0.001)
    assert engine.events.queue and not answers and (0, 9) not in engine.st.buffers   # waiting for the loop
    while not answers and time.monotonic() < deadline:
        engine.progress_once()
    service.join(10)
    assert answers == [({}, [])] and (0, 9) in engine.st.buffers
    assert hooked == [(threading.get_ident(), 9)]


def test_a_device_collective_goes_to_the_transport_of_its_memory_through_the_contract(engine):
    """The engine hands a collective on device memory to the first allowed transport that moves that
    kind and has proxy_start_coll, with the context (never itself); without one, every request fails
    with InvalidUsage and the communicator goes on."""
    dev = mem_word(MemKind.CUDA, 0)
    r1 = engine.layout.max_ops   # local rank 1's first slot
    ops = [op(engine, opsmod.KIND_SEND, 0, 1, 0, mem=dev), op(engine, opsmod.KIND_SEND, 1, 0, r1, mem=dev)]
    engine.coll.start_on_device(ops)
    assert [status(engine, s) for s in (0, r1)] == [errors.InvalidUsage.code] * 2
    assert not engine.failures.failed

    started: list = []

    class DeviceColl(ShmTransport):
        name = "devcoll"
        kinds = frozenset({MemKind.HOST, MemKind.CUDA})

        def proxy_start_coll(self, ctx, got):
            started.append((ctx, got))
            ctx.refuse_coll(got, errors.InvalidArgument.code)

        def proxy_progress_coll(self, ctx, args):
            return True

    transports.check_transport(DeviceColl())
    engine.st.transports = (ShmTransport(), DeviceColl())
    ops = [op(engine, opsmod.KIND_SEND, 0, 1, 1, mem=dev), op(engine, opsmod.KIND_SEND, 1, 0, r1 + 1, mem=dev)]
    engine.coll.start_on_device(ops)
    assert started == [(engine.ctx, ops)]
    assert [status(engine, s) for s in (1, r1 + 1)] == [errors.InvalidArgument.code] * 2
