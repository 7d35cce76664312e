"""The info blob's publication (shmproxy.core.infoblob): a reader in another process never takes a
rewrite half done, a writer stopped mid-write is reported instead of waited for, and the progress
loop rewrites the blob only when its content changed."""
from __future__ import annotations

import json
import multiprocessing
import time
import types

import pytest

from shmproxy.core import infoblob
from shmproxy.engine.introspect import Introspector
from shmproxy.shm import pool as P
from shmproxy.shm.segment import Segment
from shmproxy.tools import dump

from tests.dump_helpers import TAG

LAYOUT = P.Layout(2, 16, 64)
# Two documents whose lengths and bytes differ everywhere: any mix of them is not either one.
DOCS = [{"pid": 1, "fill": "a" * 9000}, {"pid": 2, "fill": "b" * 3000, "more": list(range(200))}]
HAMMER_S = 1.5


@pytest.fixture
def view():
    seg = Segment.create(TAG, LAYOUT.total_bytes)
    v = None
    try:
        v = P.PoolView.initialize(seg.mm, seg.addr, LAYOUT)
        yield v
    finally:
        if v is not None:
            v.release()
        seg.close()


def _hammer(v: P.PoolView, stop: float) -> None:
    blobs = [infoblob.encode(d) for d in DOCS]
    i = 0
    while time.monotonic() < stop:
        infoblob.publish(v, blobs[i & 1])
        i += 1


def test_a_reader_never_sees_a_torn_blob_while_another_process_rewrites_it(view):
    infoblob.publish(view, infoblob.encode(DOCS[0]))
    writer = multiprocessing.get_context("fork").Process(target=_hammer,
                                                         args=(view, time.monotonic() + HAMMER_S))
    writer.start()
    reads = 0
    seen = set()
    try:
        while writer.is_alive() or reads == 0:
            info = infoblob.read(view)
            assert info in DOCS, json.dumps(info)[:200]   # never an error, never a mix
            seen.add(info["pid"])
            reads += 1
            state = dump.read_pool(view)   # and the dump's reader takes the same path
            assert state["info"] in DOCS and not any("info blob" in p for p in state["problems"])
    finally:
        writer.join(30)
    assert writer.exitcode == 0 and reads > 0
    assert infoblob.read(view) in DOCS and seen


def test_a_writer_stopped_mid_write_is_reported_not_waited_for(view):
    infoblob.publish(view, infoblob.encode({"pid": 7}))
    seq_i = (LAYOUT.info_off + P.INFO_BYTES - 8) // 8
    view.q[seq_i] += 1   # odd: a rewrite began and never ended
    assert "being rewritten" in infoblob.read(view)["error"]
    infoblob.publish(view, infoblob.encode({"pid": 8}))   # the next writer takes over
    assert infoblob.read(view) == {"pid": 8}


def test_an_oversized_blob_becomes_a_valid_stand_in(view):
    infoblob.publish(view, infoblob.encode({"pid": 9, "cpus": [1], "fill": "x" * P.INFO_BYTES}))
    assert infoblob.read(view) == {"truncated": True, "pid": 9, "cpus": [1]}


class _Engine:
    """Just what the blob's writer reads of the progress engine."""

    def __init__(self, v: P.PoolView):
        self.view, self.posted = v, []
        self.job_key, self.comm_id, self.nlocal, self.size, self.path = "k", 1, 1, 1, "/x.sock"
        self.seg = types.SimpleNamespace(name="pool")
        self.cpus, self.affinity_reason = [0], "test"
        self.st = types.SimpleNamespace(copy=types.SimpleNamespace(nworkers=0), ranks={})   # the loop's state
        self.params = types.SimpleNamespace(items=lambda: [])
        self.events = types.SimpleNamespace(post=self.posted.append)   # news for the loop (engine/events.py)


class _Intro(Introspector):
    """What waits is set by the test, not looked up in a matcher."""
    waits: dict | None = None

    def describe_pending(self, now: int) -> dict | None:
        return self.waits

    def describe_nodes(self) -> dict | None:
        return None


def test_the_loop_rewrites_the_blob_only_when_it_changed_and_other_threads_post_it(view, monkeypatch):
    published: list = []
    real = infoblob.publish
    monkeypatch.setattr(infoblob, "publish", lambda v, data: (published.append(data), real(v, data)))
    e = _Intro(_Engine(view))  # type: ignore[arg-type]  # a stand-in for the engine
    e.write_info()
    for _ in range(3):
        e.refresh()
    assert len(published) == 1
    e.waits = {"recvs": [{"rank": 0}], "sends": [], "colls": []}
    e.refresh()
    e.refresh()
    assert len(published) == 2 and infoblob.read(view)["pending"] == e.waits
    e.post_write_info()   # a rank joined (service thread): the loop rewrites it, and nothing changed
    assert len(published) == 2 and len(e.engine.posted) == 1
    e.engine.posted.pop()()
    assert len(published) == 2
