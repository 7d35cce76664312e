"""The object layer (proxy/rank/objects.py) end to end: real rank processes at 1, 2 and 3 ranks.

Bodies live in tests/bodies_objects.py and check every value themselves; what they return says what
was exercised, and is checked here too. The wire format and the pickling are also unit-tested here,
without processes.
"""
from __future__ import annotations

import pickle
import threading

import numpy as np
import pytest

from shmproxy.core import errors
from shmproxy.rank import objects, objstate
from tests.harness import run_ranks

BODY = "tests.bodies_objects:"


# ------------------------------------------------------------------------------ no processes
def test_out_of_band_buffers_are_views_not_copies():
    a = np.arange(1 << 16, dtype=np.float64)
    f = np.asfortranarray(np.ones((300, 100)))
    out = objects._dumps({"a": a, "f": f, "small": np.ones(3), "strided": a[::2]}, "t")
    assert len(out.bufs) == 2                        # small and non-contiguous stay in-band
    assert np.shares_memory(np.frombuffer(out.bufs[0], np.uint8), a)
    strided = a[::2].nbytes
    assert strided < len(out.data) < strided + 2000   # only the strided copy is in the pickle
    back = out.copy("t")
    assert np.array_equal(back["a"], a) and not np.shares_memory(back["a"], a)
    assert back["f"].flags.f_contiguous and np.array_equal(back["f"], f)


def test_at_most_oob_max_buffers_go_out_of_band(monkeypatch):
    monkeypatch.setattr(objects, "OOB_MAX_BUFFERS", 5)
    obj = [np.full(objects.OOB_MIN_BYTES + (i % 4) * 8, i, np.uint8) for i in range(12)]
    out = objects._dumps(obj, "t")
    assert sorted(m.nbytes for m in out.bufs) == [objects.OOB_MIN_BYTES + d for d in (16, 16, 24, 24, 24)]
    back = out.copy("t")
    assert len(back) == 12 and all(np.array_equal(a, b) for a, b in zip(obj, back))


@pytest.mark.parametrize("bad", [threading.Lock(), lambda x: x, {"deep": [1, threading.Lock()]}])
def test_unpicklable_is_invalid_argument_with_cause(bad):
    with pytest.raises(errors.InvalidArgument, match="cannot pickle") as info:
        objects._dumps(bad, "send")
    assert isinstance(info.value, ValueError) and info.value.__cause__ is not None


def test_reducers():
    assert objstate._reducer("SUM")(2, 3) == 5 and objstate._reducer("prod")(2, 3) == 6
    assert np.array_equal(objstate._reducer("MIN")(np.array([1, 5]), np.array([3, 2])), [1, 2])
    assert np.array_equal(objstate._reducer("MAX")(np.array([1, 5]), np.array([3, 2])), [3, 5])
    fn = lambda a, b: a  # noqa: E731
    assert objstate._reducer(fn) is fn
    for bad in ("AVG", 3, None):
        with pytest.raises(errors.InvalidArgument):
            objstate._reducer(bad)


class _FakeComm:
    """Records posted messages; Irecv delivers them in order (one pair, one tag: FIFO)."""

    rank, size = 0, 1

    def __init__(self):
        self.queue: list[np.ndarray] = []
        self._posting = self   # the pickle layer's buffered sends: comm._posting.post (below)

    def Isend(self, buf, dest, tag):
        self.queue.append(np.array(buf, copy=True))
        return _Done(buf.nbytes)

    def post(self, kind, buf, dest, tag, buffered=False):   # the pickle layer's buffered sends
        return self.Isend(buf, dest, tag)

    def Irecv(self, buf, source, tag):
        msg = self.queue.pop(0)
        assert msg.dtype == buf.dtype and msg.nbytes <= buf.nbytes, (msg.dtype, buf.dtype, msg.nbytes)
        buf.reshape(-1)[:msg.size] = msg.reshape(-1)
        return _Done(msg.nbytes)

    def Recv(self, buf, source, tag):
        return self.Irecv(buf, source, tag).Wait()


class _Done:
    _stage = None

    def __init__(self, nbytes):
        self.nbytes = nbytes

    def Wait(self, timeout=None):
        return self

    def Test(self):
        return True


@pytest.mark.parametrize("hdr_words", [objects.HDR_WORDS, 128])
@pytest.mark.parametrize("nbufs,plen", [(0, 10), (3, 10), (3, 10000), (125, 10), (125, 10000)])
def test_wire_format(nbufs, plen, hdr_words, monkeypatch):
    """Header layout, inline pickle, lengths message when they do not fit, buffers in order."""
    monkeypatch.setattr(objects, "HDR_WORDS", hdr_words)
    comm = _FakeComm()
    obj = {"s": "x" * plen,
           "bufs": [np.full(objects.OOB_MIN_BYTES + i, i % 251, np.uint8) for i in range(nbufs)]}
    out = objects._dumps(obj, "t")
    assert len(out.bufs) == nbufs <= objects.OOB_MAX_BUFFERS
    objects._post_send(comm, out, 0, 5, objects.OP_P2P, 0)
    hdr = comm.queue[0]
    assert hdr.dtype == np.int64 and hdr.size <= objects.HDR_WORDS
    assert hdr[objects.H_MAGIC] == objects.MAGIC and hdr[objects.H_NBUFS] == nbufs
    assert hdr[objects.H_PLEN] == len(out.data)
    inline = bool((int(hdr[objects.H_OPFLAGS]) >> 8) & objects.FLAG_INLINE)
    lengths_inline = nbufs + objects._FIXED <= objects.HDR_WORDS
    room = 8 * (objects.HDR_WORDS - objects._FIXED - (nbufs if lengths_inline else 0))
    assert inline == (len(out.data) <= room)
    expect_msgs = 1 + (0 if lengths_inline or not nbufs else 1) + (0 if inline else 1) + nbufs
    assert len(comm.queue) == expect_msgs
    tail = comm.queue[len(comm.queue) - nbufs:]
    assert [m.nbytes for m in tail] == [objects.OOB_MIN_BYTES + i for i in range(nbufs)]
    inc = objects._In(comm, 0, 5)
    inc.post_body(comm, 5, objects.OP_P2P, 0, "t")
    inc.wait("t")
    got = inc.load("t")
    assert not comm.queue
    assert got["s"] == obj["s"] and all(np.array_equal(a, b) for a, b in zip(got["bufs"], obj["bufs"]))
    assert len(got["bufs"]) == nbufs


def test_error_marker_and_op_mismatch():
    comm = _FakeComm()
    objects._post_send(comm, objects._Out.error("rank 2 cannot pickle its object"), 0, 1, objects.OP_BCAST, 4)
    inc = objects._In(comm, 0, 1)
    inc.post_body(comm, 1, objects.OP_BCAST, 4, "bcast")
    inc.wait("bcast")
    with pytest.raises(errors.RemoteError, match="rank 2 cannot pickle"):
        inc.load("bcast")
    objects._post_send(comm, objects._dumps(1, "t"), 0, 1, objects.OP_GATHER, 4)
    inc = objects._In(comm, 0, 1)
    with pytest.raises(errors.InvalidUsage, match=r"bcast #4.*gather #4"):
        inc.post_body(comm, 1, objects.OP_BCAST, 4, "bcast")


def test_reserved_tag_space():
    assert objects.OBJ_COLL_TAG < objects.OBJ_TAG_BASE == -(2**62)
    assert pickle.loads(pickle.dumps(objects.OBJ_TAG_BASE)) == objects.OBJ_TAG_BASE


# ------------------------------------------------------------------------------ real ranks
@pytest.mark.parametrize("n", [1, 2, 3])
def test_send_recv_every_kind_of_object(n):
    res = run_ranks(BODY + "p2p_objects", n, timeout=90)
    assert all(r["checked"] == 20 for r in res.results), res.results


def test_many_out_of_band_buffers():
    res = run_ranks(BODY + "many_buffers", 2, timeout=90, args=(300,))
    assert all(r == {"oob": objects.OOB_MAX_BUFFERS, "oob_small": 23} for r in res.results), res.results
    assert objects._FIXED + objects.OOB_MAX_BUFFERS > 128  # the body's HDR_WORDS: lengths in a message


def test_tags_select_and_objects_do_not_overtake():
    res = run_ranks(BODY + "tags_and_order", 2, timeout=60)
    assert [r["rank"] for r in res.results] == [0, 1]


def test_bad_arguments_raise_before_sending():
    res = run_ranks(BODY + "bad_args", 3, timeout=60)
    assert all(r["raised"] == 9 for r in res.results)


@pytest.mark.parametrize("n", [1, 2, 3])
def test_collectives(n):
    res = run_ranks(BODY + "collectives", n, timeout=90)
    assert [r["rank"] for r in res.results] == list(range(n)) and all(r["ok"] for r in res.results)


def test_barrier_waits_for_every_rank():
    res = run_ranks(BODY + "barrier_orders", 3, timeout=60)
    assert all(r["rounds"] == 3 for r in res.results)


def test_unpicklable_raises_everywhere_and_comm_stays_usable():
    n = 3
    res = run_ranks(BODY + "unpicklable", n, timeout=90)
    victim = n - 1
    for r, out in enumerate(res.results):
        seen = out["seen"]
        assert seen[:3] == ["send"] * 3, seen
        expect_bcast = n  # one per root
        assert seen.count("bcast-root") == 1 and seen.count("bcast-peer") == expect_bcast - 1, seen
        assert seen.count("gather-victim") == (n if r == victim else 0), seen
        assert seen.count("gather-root") == (1 if r != victim else 0), seen
        assert seen.count("all-victim" if r == victim else "all-peer") == 2, seen
        if n > 1:
            assert ("reduce-root" if r == 0 else "reduce-peer") in seen, seen


def test_mismatched_collectives_buffer_messages_and_failed_buffered_sends():
    # SEND_BUFFER_BYTES=0: the failed send is one the progress process did not buffer (a buffered
    # one completes before its receive is matched, so its sender never hears of the mismatch)
    res = run_ranks(BODY + "misuse", 2, timeout=60, env={"SHMPROXY_SEND_BUFFER_BYTES": "0"})
    assert res.results == [{"deferred": True}, {"mismatch": True, "raw": True, "dtype": True}], res.results


def test_size_one_self_sends_pickling_errors_and_closed_comm():
    res = run_ranks(BODY + "size_one_and_closed", 1, timeout=60)
    assert res.results[0]["closed"] == 7
