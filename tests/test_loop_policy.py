"""What the progress loop decides from its params and the node: the fetch mode, the idle spin, the
collective chunk, and when a collective streams (with the bytes a schedule writes, which that
decision counts)."""
from __future__ import annotations

import os
import time

import numpy as np
import pytest

from shmproxy.core import params as params_mod
from shmproxy.coll import sched as sched_mod
from shmproxy.engine.policy import FetchMode, fetch_mode
from shmproxy.shm import pool as P


def test_streaming_threshold_follows_the_params_and_the_cache(monkeypatch):
    """A collective streams once it writes more than the threshold: never with COPY_STREAMING=0, an
    explicit STREAMING_MIN_BYTES as given; automatically always where the progress process has cores
    of its own, and on a crowded node (the loop runs copy jobs) above half the last-level cache, at
    most 16 MiB (16 MiB when the cache is unknown)."""
    from shmproxy.engine import affinity, policy

    def threshold(env, llc, crowded=True):
        monkeypatch.setattr(affinity, "last_level_cache_bytes", lambda cpu: llc)
        return policy.streaming_threshold(params_mod.Params(env=env), [0, 1], crowded)
    assert threshold({}, 8 << 20) == 4 << 20
    assert threshold({}, 300 << 20) == 16 << 20 == policy.AUTO_STREAMING_MIN_BYTES
    assert threshold({}, 0) == 16 << 20
    assert threshold({}, 8 << 20, crowded=False) == 0
    assert threshold({"SHMPROXY_STREAMING_MIN_BYTES": "0"}, 300 << 20) == 0
    assert threshold({"SHMPROXY_STREAMING_MIN_BYTES": "1M"}, 8 << 20, crowded=False) == 1 << 20
    assert threshold({"SHMPROXY_COPY_STREAMING": "0", "SHMPROXY_STREAMING_MIN_BYTES": "0"}, 8 << 20) >= 1 << 62


def test_coll_chunk_limit_is_one_chunk_per_cpu_where_the_loop_runs_jobs():
    from shmproxy.engine import policy
    p = params_mod.Params(env={})
    assert policy.coll_chunk_limit(p, loop_copies=False) == p.CHUNK_SIZE == 512 << 10
    assert policy.coll_chunk_limit(p, loop_copies=True) == policy.AUTO_CROWDED_COLL_CHUNK == 4 << 20
    p = params_mod.Params(env={"SHMPROXY_COLL_CHUNK_SIZE": "64K"})
    assert policy.coll_chunk_limit(p, True) == policy.coll_chunk_limit(p, False) == 64 << 10


def test_written_bytes_counts_every_output_and_streaming_schedules_mark_theirs():
    C, wb = sched_mod.Coll, sched_mod.written_bytes
    assert wb(C.ALLREDUCE, 1000, 4, 3) == 12_000            # every rank's recvbuf
    assert wb(C.REDUCE, 1000, 4, 3) == 4_000                 # the root's alone
    assert wb(C.BCAST, 1000, 8, 4) == 24_000                 # all but the root
    assert wb(C.ALLGATHER, 10, 2, 3) == 180                  # count per rank's block, size blocks each
    assert wb(C.ALLTOALL, 10, 2, 3) == 180
    assert wb(C.REDUCE_SCATTER_BLOCK, 10, 4, 3) == 120       # count per rank's result
    assert wb(C.BARRIER, 0, 1, 5) == 0
    make = sched_mod.streaming_schedules(lambda k: sched_mod.Schedule([sched_mod.Entry(sched_mod.NOP)]))
    assert make(0).streaming is True
    assert sched_mod.Schedule([]).streaming is False


def test_fetch_policy():
    # Nothing active: block (spin, then a bounded condvar sleep).
    assert fetch_mode(idle=True, nactive=0, passes=3, appendop_freq=8) == FetchMode.BLOCK
    assert fetch_mode(idle=False, nactive=0, passes=3, appendop_freq=8) == FetchMode.BLOCK
    # Work in hand: only trylock, and only when idle or every FREQ passes.
    assert fetch_mode(idle=True, nactive=2, passes=3, appendop_freq=8) == FetchMode.TRY
    assert fetch_mode(idle=False, nactive=2, passes=3, appendop_freq=8) == FetchMode.NONE
    assert fetch_mode(idle=False, nactive=2, passes=16, appendop_freq=8) == FetchMode.TRY
    modes = [fetch_mode(False, 1, p, 8) for p in range(1, 65)]
    assert modes.count(FetchMode.TRY) == 8


@pytest.mark.parametrize("crowded", [False, True])
def test_idle_spin_is_skipped_once_after_large_work_on_a_crowded_node(crowded):
    """After completing what the copy workers moved, a crowded node's loop sleeps at once (leaves
    the CPUs to the ranks it woke); otherwise, and the time after, it polls its spin window."""
    import types
    from shmproxy.engine.completion import Completion
    from shmproxy.engine.fetching import Fetcher
    i32 = np.full(P.NEXT_OPS_OFF // 4 + 1, -1, np.int32)           # an empty posted chain
    from shmproxy.shm import _workers
    awake = _workers.KeepAwake(sorted(os.sched_getaffinity(0))[:1], 1.0) if crowded else None
    q = np.zeros(P.CTRL_OFF // 8 + P.CTRL_COUNT, np.uint64)        # nothing handed off, no event
    st = types.SimpleNamespace(awake=awake, spin_skip=False, should_exit=lambda: False)   # the loop's state
    fetcher = types.SimpleNamespace(spin_ns=30_000_000, view=types.SimpleNamespace(i32=i32), q=q, st=st,
                                    events=types.SimpleNamespace(seen=0))

    def spin() -> float:
        t0 = time.monotonic()
        Fetcher.spin_for_work(fetcher)   # type: ignore[arg-type]
        return time.monotonic() - t0
    Completion.complete_large(types.SimpleNamespace(crowded=crowded, st=st))
    assert st.spin_skip is crowded
    if awake is not None:           # and the keep-awake guards spin through the hand-off
        assert awake.spinning
        awake.stop()
    first, second = spin(), spin()
    assert (first < 0.015) is crowded and second >= 0.03 and not st.spin_skip
    q[P.PENDING_MASK_OFF // 8] = 1 << 1           # a chain handed off ends the spin
    assert spin() < 0.015
    q[P.PENDING_MASK_OFF // 8] = 0
    q[P.CTRL_OFF // 8 + P.CTRL_EVENTS] = 1         # and so does news from another thread (post_event)
    assert spin() < 0.015
