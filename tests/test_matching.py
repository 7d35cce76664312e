"""Message matching (shmproxy.engine.matching): each MPI ordering rule on its own, a property test
against a linear-scan reference model, and a check that the wildcard-free path does no scan."""
from __future__ import annotations

from typing import Any

import pytest
from hypothesis import given, settings, strategies as st

from shmproxy.core import errors
from shmproxy.engine.matching import ANY_SOURCE, ANY_TAG, Matcher


class Item:
    """An opaque op: compared by identity, named for readable failures."""

    def __init__(self, name: str):
        self.name = name

    def __repr__(self) -> str:
        return self.name


def items(prefix: str, n: int) -> list[Item]:
    return [Item(f"{prefix}{i}") for i in range(n)]


# ------------------------------------------------------------------------------------ rules
def test_specific_match_either_order():
    m = Matcher()
    s, r = Item("s"), Item("r")
    assert m.arrive(0, 1, 5, s) is None and m.counts(0) == (0, 1)
    assert m.post(0, 1, 5, r) is s and len(m) == 0
    assert m.post(0, 1, 5, r) is None and m.counts(0) == (1, 0)
    assert m.arrive(0, 1, 5, s) is r and len(m) == 0 and m.dests() == []


def test_envelope_must_match_exactly_without_wildcards():
    m = Matcher()
    r = Item("r")
    m.post(0, 1, 5, r)
    assert m.arrive(0, 2, 5, Item("other source")) is None
    assert m.arrive(0, 1, 6, Item("other tag")) is None
    assert m.arrive(1, 1, 5, Item("other destination")) is None
    assert m.counts(0) == (1, 2) and m.counts(1) == (0, 1)
    s = Item("s")
    assert m.arrive(0, 1, 5, s) is r


def test_receives_posted_before_the_sends_match_in_posting_order():
    m = Matcher()
    rs, ss = items("r", 3), items("s", 3)
    for r in rs:
        assert m.post(0, 1, 7, r) is None
    assert [m.arrive(0, 1, 7, s) for s in ss] == rs


def test_sends_arrived_before_the_receives_match_in_arrival_order():
    m = Matcher()
    rs, ss = items("r", 3), items("s", 3)
    for s in ss:
        assert m.arrive(0, 1, 7, s) is None
    assert [m.post(0, 1, 7, r) for r in rs] == ss


def test_receives_pending_before_and_after_the_sends():
    m = Matcher()
    r0, r1, r2, r3 = items("r", 4)
    s0, s1, s2 = items("s", 3)
    m.post(0, 1, 7, r0)
    assert m.arrive(0, 1, 7, s0) is r0
    assert m.arrive(0, 1, 7, s1) is None
    assert m.arrive(0, 1, 7, s2) is None
    assert m.post(0, 1, 7, r1) is s1
    assert m.post(0, 1, 7, r2) is s2
    assert m.post(0, 1, 7, r3) is None
    assert list(m.posted(0)) == [(1, 7, r3)]


def test_any_source_takes_the_earliest_arrived_of_any_source():
    m = Matcher()
    a, b, c = Item("from2"), Item("from1"), Item("from1-tag9")
    m.arrive(0, 2, 7, a)
    m.arrive(0, 1, 7, b)
    m.arrive(0, 1, 9, c)
    assert m.post(0, ANY_SOURCE, 7, Item("r0")) is a
    assert m.post(0, ANY_SOURCE, 7, Item("r1")) is b
    assert m.post(0, ANY_SOURCE, 7, Item("r2")) is None   # c has another tag
    assert m.arrive(0, 3, 7, Item("from3")) is not None


def test_any_tag_takes_the_earliest_arrived_of_any_tag_from_that_source():
    m = Matcher()
    a, b, c = Item("tag9"), Item("src2"), Item("tag3")
    m.arrive(0, 1, 9, a)
    m.arrive(0, 2, 3, b)
    m.arrive(0, 1, 3, c)
    assert m.post(0, 1, ANY_TAG, Item("r0")) is a
    assert m.post(0, 1, ANY_TAG, Item("r1")) is c
    r2 = Item("r2")
    assert m.post(0, 1, ANY_TAG, r2) is None
    assert m.arrive(0, 1, -5, Item("negative tag")) is r2


def test_both_wildcards_take_the_earliest_arrival():
    m = Matcher()
    ss = [Item("a"), Item("b"), Item("c")]
    for (src, tag), s in zip([(3, 1), (1, 4), (2, 0)], ss):
        m.arrive(0, src, tag, s)
    assert [m.post(0, ANY_SOURCE, ANY_TAG, Item(f"r{i}")) for i in range(3)] == ss
    r = Item("r")
    m.post(0, ANY_SOURCE, ANY_TAG, r)
    assert m.arrive(0, 5, 123, Item("any")) is r


def test_earlier_posted_wildcard_beats_later_specific():
    m = Matcher()
    w, sp = Item("wild"), Item("specific")
    m.post(0, ANY_SOURCE, 7, w)
    m.post(0, 1, 7, sp)
    assert m.arrive(0, 1, 7, Item("s0")) is w
    assert m.arrive(0, 1, 7, Item("s1")) is sp


def test_earlier_posted_specific_beats_later_wildcard():
    m = Matcher()
    sp, w = Item("specific"), Item("wild")
    m.post(0, 1, 7, sp)
    m.post(0, 1, ANY_TAG, w)
    assert m.arrive(0, 1, 7, Item("s0")) is sp
    assert m.arrive(0, 1, 7, Item("s1")) is w


def test_interleaved_receives_are_satisfied_in_posting_order():
    m = Matcher()
    order = [(1, 7), (ANY_SOURCE, 7), (1, ANY_TAG), (1, 7), (ANY_SOURCE, ANY_TAG), (1, 7)]
    rs = items("r", len(order))
    for (src, tag), r in zip(order, rs):
        m.post(0, src, tag, r)
    assert [m.arrive(0, 1, 7, Item(f"s{i}")) for i in range(len(rs))] == rs


def test_non_accepting_earlier_wildcard_does_not_block():
    m = Matcher()
    w, sp = Item("wild tag 8"), Item("specific")
    m.post(0, ANY_SOURCE, 8, w)
    m.post(0, 1, 7, sp)
    assert m.arrive(0, 1, 7, Item("s")) is sp
    assert list(m.posted(0)) == [(ANY_SOURCE, 8, w)]


def test_non_overtaking_through_a_wildcard_receive():
    m = Matcher()
    first, second = Item("first"), Item("second")
    m.arrive(0, 1, 7, first)
    m.arrive(0, 2, 7, Item("other source"))
    m.arrive(0, 1, 7, second)
    assert m.post(0, 1, ANY_TAG, Item("r0")) is first
    assert m.post(0, 1, ANY_TAG, Item("r1")) is second


def test_probe_leaves_the_message_and_take_removes_it():
    m = Matcher()
    a, b = Item("a"), Item("b")
    m.arrive(0, 2, 4, a)
    m.arrive(0, 1, 4, b)
    assert m.probe(0, 1, 4) is b
    assert m.probe(0, ANY_SOURCE, 4) is a
    assert m.probe(0, ANY_SOURCE, ANY_TAG) is a and m.counts(0) == (0, 2)
    assert m.probe(0, 3, 4) is None and m.probe(1, ANY_SOURCE, ANY_TAG) is None
    assert m.take(0, a) and not m.take(0, a) and not m.take(1, b)
    assert m.probe(0, ANY_SOURCE, ANY_TAG) is b
    assert m.post(0, ANY_SOURCE, ANY_TAG, Item("r")) is b and len(m) == 0


def test_take_from_the_middle_of_a_queue_keeps_the_others_in_order():
    m = Matcher()
    ss = items("s", 3)
    for s in ss:
        m.arrive(0, 1, 4, s)
    assert m.take(0, ss[1])
    assert [m.post(0, 1, 4, Item("r")) for _ in range(2)] == [ss[0], ss[2]]


def test_cancel_removes_only_a_pending_receive():
    m = Matcher()
    r0, r1, w = Item("r0"), Item("r1"), Item("w")
    m.post(0, 1, 4, r0)
    m.post(0, ANY_SOURCE, ANY_TAG, w)
    m.post(0, 1, 4, r1)
    assert m.cancel(0, r0) and not m.cancel(0, r0) and not m.cancel(1, r1)
    assert m.cancel(0, w) and not m.cancel(0, w)
    assert m.arrive(0, 1, 4, Item("s")) is r1
    assert not m.cancel(0, r1)   # already matched
    assert not m.cancel(0, Item("never posted")) and len(m) == 0 and m.dests() == []


def test_drop_removes_what_pred_picks_in_order():
    m = Matcher()
    r_from2, w, r_from1 = Item("r_from2"), Item("w"), Item("r_from1")
    s_from2, s_from1 = Item("s_from2"), Item("s_from1")
    m.post(0, 2, 4, r_from2)
    m.arrive(1, 2, 4, s_from2)
    m.post(0, ANY_SOURCE, 5, w)
    m.post(0, 1, 4, r_from1)
    m.arrive(1, 1, 4, s_from1)
    # rank 2 died: drop receives naming it and messages from it (not the wildcard)
    assert m.drop(lambda dst, src, tag, item: src == 2) == [r_from2, s_from2]
    assert m.counts(0) == (2, 0) and m.counts(1) == (0, 1) and len(m) == 3
    assert m.drop(lambda dst, src, tag, item: True, posted=False) == [s_from1]
    assert m.drop(lambda dst, src, tag, item: dst == 0) == [w, r_from1]
    assert len(m) == 0 and m.dests() == []


@pytest.mark.parametrize("src,tag", [(ANY_SOURCE, 1), (1, ANY_TAG), (-3, 1)])
def test_an_arrival_cannot_carry_a_wildcard(src, tag):
    with pytest.raises(errors.InvalidArgument):
        Matcher().arrive(0, src, tag, Item("s"))


def test_a_receive_source_is_a_rank_or_any_source():
    with pytest.raises(errors.InvalidArgument):
        Matcher().post(0, -2, 1, Item("r"))


def test_extreme_tags():
    m = Matcher()
    big, small = (1 << 63) - 1, ANY_TAG + 1
    r = Item("r")
    m.post(0, 1, big, r)
    assert m.arrive(0, 1, small, Item("small")) is None
    assert m.arrive(0, 1, big, Item("big")) is r
    assert m.post(0, 1, ANY_TAG, Item("r2")).name == "small"


# ------------------------------------------------------------------------------------ property test
def _accepts(want_src: int, want_tag: int, src: int, tag: int) -> bool:
    return want_src in (src, ANY_SOURCE) and want_tag in (tag, ANY_TAG)


class Reference:
    """MPI matching as plainly as it can be said: per destination, lists scanned front to back."""

    def __init__(self) -> None:
        self.posted: dict[int, list[tuple[int, int, int, Any]]] = {}   # (seq, src, tag, item)
        self.unexp: dict[int, list[tuple[int, int, int, Any]]] = {}
        self.seq = 0

    def _find(self, lst: list, src: int, tag: int, recv_side: bool) -> int | None:
        for i, (_, s, t, _) in enumerate(lst):
            if (_accepts(s, t, src, tag) if recv_side else _accepts(src, tag, s, t)):
                return i
        return None

    def arrive(self, dst, src, tag, item):
        lst = self.posted.setdefault(dst, [])
        i = self._find(lst, src, tag, True)
        if i is not None:
            return lst.pop(i)[3]
        self.seq += 1
        self.unexp.setdefault(dst, []).append((self.seq, src, tag, item))
        return None

    def post(self, dst, src, tag, item):
        lst = self.unexp.setdefault(dst, [])
        i = self._find(lst, src, tag, False)
        if i is not None:
            return lst.pop(i)[3]
        self.seq += 1
        self.posted.setdefault(dst, []).append((self.seq, src, tag, item))
        return None

    def probe(self, dst, src, tag):
        lst = self.unexp.get(dst, [])
        i = self._find(lst, src, tag, False)
        return None if i is None else lst[i][3]

    @staticmethod
    def _remove(lst: list, item) -> bool:
        for i, e in enumerate(lst):
            if e[3] is item:
                del lst[i]
                return True
        return False

    def take(self, dst, item):
        return self._remove(self.unexp.get(dst, []), item)

    def cancel(self, dst, item):
        return self._remove(self.posted.get(dst, []), item)

    def drop(self, pred):
        out = []
        for table in (self.posted, self.unexp):
            for dst, lst in table.items():
                out.extend(e for e in lst if pred(dst, e[1], e[2], e[3]))
                lst[:] = [e for e in lst if not pred(dst, e[1], e[2], e[3])]
        return [e[3] for e in sorted(out, key=lambda e: e[0])]


def _steps(n: int) -> st.SearchStrategy:
    rank = st.integers(0, n - 1)
    tag = st.sampled_from([0, 1, 2])
    want_src = st.sampled_from([ANY_SOURCE] + list(range(n)))   # the wildcard at least 1 time in 5
    want_tag = st.sampled_from([ANY_TAG, ANY_TAG, 0, 1, 2])
    by_kind = {
        "arrive": st.tuples(st.just("arrive"), rank, rank, tag),
        "post": st.tuples(st.just("post"), rank, want_src, want_tag),
        "probe": st.tuples(st.just("probe"), rank, want_src, want_tag),
        "take": st.tuples(st.just("take"), rank, st.integers(0, 4)),
        "cancel": st.tuples(st.just("cancel"), rank, st.integers(0, 4)),
        "drop": st.tuples(st.just("drop"), st.sampled_from(["src", "dst"]), rank),
    }
    # arrivals and posts 4 times as often as the rest, and drops rarer, so that queues build up
    kinds = ["arrive"] * 4 + ["post"] * 4 + ["probe", "take", "cancel"] * 2 + ["drop"]
    return st.lists(st.sampled_from(kinds).flatmap(by_kind.__getitem__), min_size=20, max_size=120)


@settings(max_examples=300, deadline=None)
@given(st.data())
def test_matches_the_reference_model(data):
    n = data.draw(st.integers(1, 4), label="ranks")
    steps = data.draw(_steps(n), label="steps")
    m, ref = Matcher(), Reference()
    gone = Item("never queued")   # take/cancel of an item not pending must say False
    for k, step in enumerate(steps):
        op = step[0]
        if op in ("arrive", "post"):
            _, dst, src, tag = step
            item = Item(f"{op[0]}{k}")
            got, want = getattr(m, op)(dst, src, tag, item), getattr(ref, op)(dst, src, tag, item)
        elif op == "probe":
            got, want = m.probe(*step[1:]), ref.probe(*step[1:])
        elif op in ("take", "cancel"):
            _, dst, i = step
            lst = (ref.unexp if op == "take" else ref.posted).get(dst, [])
            item = lst[i][3] if i < len(lst) else gone
            got, want = getattr(m, op)(dst, item), getattr(ref, op)(dst, item)
        else:
            _, field, r = step
            pick = (lambda d, s, t, it: s == r) if field == "src" else (lambda d, s, t, it: d == r)
            got, want = m.drop(pick), ref.drop(pick)
        assert got == want, (k, step)   # Items compare by identity
        for dst in range(n):
            assert list(m.posted(dst)) == [e[1:] for e in ref.posted.get(dst, [])], (k, step, dst)
            assert list(m.unexpected(dst)) == [e[1:] for e in ref.unexp.get(dst, [])], (k, step, dst)
            assert m.counts(dst) == (len(ref.posted.get(dst, [])), len(ref.unexp.get(dst, [])))
        assert len(m) == sum(map(len, ref.posted.values())) + sum(map(len, ref.unexp.values()))
        assert m.dests() == sorted(d for d in range(n) if ref.posted.get(d) or ref.unexp.get(d))


# ------------------------------------------------------------------------------------ cost
@pytest.mark.parametrize("nkeys", [1, 1000])
def test_specific_only_path_scans_nothing(nkeys):
    """100k arrivals and posts with 2 items queued on each of nkeys (src, tag) keys of 4 destinations:
    no entry is ever examined by a walk, however many keys there are."""
    m = Matcher()
    keys = [(dst, src, tag) for dst in range(4) for src in range(4) for tag in range(nkeys // 16 + 1)][:nkeys]
    for key in keys:
        for _ in range(2):
            m.post(*key, Item("r"))
    for i in range(50_000):   # each arrival matches the head; the post refills the queue
        key = keys[i % len(keys)]
        assert m.arrive(*key, Item("s")) is not None
        assert m.post(*key, Item("r")) is None
    assert m.nposted == 2 * len(keys)
    for key in keys:   # now the other side: 2 unexpected messages each
        for _ in range(4):
            m.arrive(*key, Item("s"))
    for i in range(50_000):
        key = keys[i % len(keys)]
        assert m.post(*key, Item("r")) is not None
        assert m.arrive(*key, Item("s")) is None
    assert m.nunexpected == 2 * len(keys) and m.scanned == 0


def test_wildcards_of_one_destination_cost_nothing_to_another():
    m = Matcher()
    for i in range(100):
        m.post(1, ANY_SOURCE, ANY_TAG, Item(f"w{i}"))
    m.post(0, 2, 3, Item("r"))
    assert m.arrive(0, 2, 3, Item("s")) is not None
    m.arrive(0, 2, 3, Item("s"))
    assert m.post(0, 2, 3, Item("r")) is not None
    assert m.scanned == 0


def test_walks_stop_early():
    m = Matcher()
    # a specific receive posted before 100 wildcards: an arrival it takes walks none of them
    sp = Item("specific")
    m.post(0, 1, 7, sp)
    for i in range(100):
        m.post(0, ANY_SOURCE, 9, Item(f"w{i}"))
    assert m.arrive(0, 1, 7, Item("s")) is sp and m.scanned == 0
    # a wildcard post looks at the head of each unexpected queue, not at what is behind it
    m2 = Matcher()
    for src in range(10):
        for _ in range(5):
            m2.arrive(0, src, 1, Item("s"))
    assert m2.post(0, ANY_SOURCE, 1, Item("r")) is not None
    assert m2.scanned == 10


def test_a_buffered_copy_keeps_the_place_of_the_send_it_replaces():
    m = Matcher()
    assert m.arrive(0, 1, 5, "a") is None and m.arrive(0, 1, 5, "b") is None and m.arrive(0, 1, 5, "c") is None
    assert m.is_unexpected(0, 1, 5, "b") and not m.is_unexpected(0, 1, 6, "b")
    assert m.replace_unexpected(0, 1, 5, "b", "B")          # not the newest: buffered after its grace
    assert not m.replace_unexpected(0, 1, 5, "x", "X") and not m.replace_unexpected(0, 2, 5, "a", "A")
    assert not m.is_unexpected(0, 1, 5, "b") and m.is_unexpected(0, 1, 5, "B")
    assert m.post(0, 1, 5, "r1") == "a" and m.post(0, ANY_SOURCE, ANY_TAG, "r2") == "B"
    assert not m.is_unexpected(0, 1, 5, "a") and m.post(0, 1, 5, "r3") == "c"


def test_any_tag_leaves_the_reserved_tags_alone():
    from shmproxy.core.ops import RESERVED_TAG_HI, RESERVED_TAG_LO
    from shmproxy.rank.objstate import OBJ_COLL_TAG, OBJ_TAG_BASE
    assert OBJ_TAG_BASE == RESERVED_TAG_HI and RESERVED_TAG_LO <= OBJ_COLL_TAG < RESERVED_TAG_HI
    m = Matcher()
    assert m.arrive(0, 1, OBJ_COLL_TAG, "coll") is None
    assert m.probe(0, ANY_SOURCE, ANY_TAG) is None and m.post(0, 1, ANY_TAG, "r") is None
    assert m.arrive(0, 1, 3, "user") == "r"
    assert m.post(0, 1, OBJ_COLL_TAG, "internal") == "coll"
