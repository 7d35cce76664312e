"""The progress loop's policies, as pure functions of the parameters and the node (testable alone)."""
from __future__ import annotations

import enum

from shmproxy.core import params as params_mod
from shmproxy.engine import affinity

AUTO_CROWDED_COLL_CHUNK = 4 << 20  # COLL_CHUNK_SIZE=-1 where the loop runs copy jobs: ~0.3 ms of work
AUTO_STREAMING_MIN_BYTES = 16 << 20  # STREAMING_MIN_BYTES=-1: at most this (a shared L3 did not hold more)


class FetchMode(enum.IntEnum):
    NONE = 0    # keep progressing, do not look at the posted chain this pass
    TRY = 1     # look, with trylock: never block the loop while it has work in hand
    BLOCK = 2   # nothing active: spin briefly, then a bounded sleep on the pool condvar


_F_NONE, _F_TRY, _F_BLOCK = FetchMode.NONE, FetchMode.TRY, FetchMode.BLOCK  # globals: no enum lookup per pass


def fetch_mode(idle: bool, nactive: int, passes: int, appendop_freq: int) -> FetchMode:
    """The fetch policy: fetch only when idle, when nothing is active, or every FREQ passes."""
    if nactive == 0:
        return _F_BLOCK
    if idle or passes % appendop_freq == 0:
        return _F_TRY
    return _F_NONE


def coll_chunk_limit(params: params_mod.Params, loop_copies: bool) -> int:
    """The largest chunk of a collective (per rank's buffer): COLL_CHUNK_SIZE, automatically CHUNK_SIZE.

    Where the loop runs copy jobs beside one worker per CPU (``loop_copies``), every job it hands over
    costs cross-CPU wake-ups and a pass of its Python, so a collective is cut in one chunk per CPU
    (fewer hand-overs gained more than finer chunks' pipelining: docs/decisions.md), up to
    AUTO_CROWDED_COLL_CHUNK, so that the loop, running one itself, still looks for new work every
    few hundred us."""
    if params.COLL_CHUNK_SIZE >= 0:
        return params.COLL_CHUNK_SIZE
    return AUTO_CROWDED_COLL_CHUNK if loop_copies else params.CHUNK_SIZE


def streaming_threshold(params: params_mod.Params, cpus: list[int], loop_copies: bool) -> int:
    """How many bytes a collective must write (every output together, sched.written_bytes) for its
    copies and reductions to use non-temporal stores, on a progress process running on ``cpus``.

    Streaming stores skip the read-for-ownership of every output line but leave the data in DRAM.
    Where the progress process has cores of its own they paid at every size measured, so there
    they are always used. On a crowded node (``loop_copies``: the loop and one worker per CPU) they
    lost while the data fit in the cache and won beyond: there the threshold is half the last-level
    cache (a collective reads about as much as it writes), at most AUTO_STREAMING_MIN_BYTES. The
    measurements: docs/decisions.md."""
    if not params.COPY_STREAMING:
        return 1 << 62
    if params.STREAMING_MIN_BYTES >= 0:
        return params.STREAMING_MIN_BYTES
    if not loop_copies:
        return 0
    llc = affinity.last_level_cache_bytes(cpus[0] if cpus else 0)
    return min(llc // 2, AUTO_STREAMING_MIN_BYTES) if llc else AUTO_STREAMING_MIN_BYTES
