"""numpy arrays born in registered memory (shmproxy.rank.arena, shm/_arena.c): arrays made after init
are zero-copy to every operation, arrays made before are staged as before, the allocator's reuse,
zeroing, growth and threads, arrays alive across close, the parameter that turns it off, and fork."""
from __future__ import annotations

import pytest

from tests.harness import run_ranks

B = "tests.bodies_arena:"


def _clean(res) -> None:
    for r in res.results:
        assert not r["bad"], r["bad"]


@pytest.mark.parametrize("nranks", [2, 3])
def test_arrays_made_after_init_are_zero_copy_and_exact(nranks):
    res = run_ranks(B + "operations", nranks, timeout=120)
    _clean(res)
    assert all(r["stats"]["live_blocks"] > 0 and r["stats"]["fallbacks"] == 0 for r in res.results)


def test_an_array_outlives_its_communicator():
    _clean(run_ranks(B + "lifetime", 2, timeout=120))


def test_the_parameter_turns_it_off():
    _clean(run_ranks(B + "turned_off", 2, timeout=120, env={"SHMPROXY_NUMPY_ARENA": "0"}))


def test_the_allocator_reuses_zeroes_grows_and_takes_threads():
    _clean(run_ranks(B + "allocator", 1, timeout=120, env={"SHMPROXY_NUMPY_ARENA_KEEP_BYTES": str(2 << 20)}))


def test_a_forked_child_has_arena_arrays_of_its_own():
    _clean(run_ranks(B + "fork_child", 2, timeout=120))


@pytest.mark.parametrize("nranks", [2, 3])
def test_middle_collectives_through_the_arenas_are_bit_exact(nranks):
    res = run_ranks(B + "middle", nranks, timeout=240)
    _clean(res)
    assert all(r["cases"] > 100 for r in res.results)


def test_middle_collectives_a_rank_cannot_map_are_declined_by_every_rank():
    _clean(run_ranks(B + "middle_declined", 3, timeout=120))


def test_middle_collectives_declined_by_a_device_rank_are_posted_by_every_rank():
    _clean(run_ranks(B + "middle_declined_by_a_device_rank", 3, timeout=120))


def test_a_progress_process_that_cannot_map_an_arena_leaves_it_staged():
    res = run_ranks(B + "arena_unmappable", 2, timeout=120,
                    env={"SHMPROXY_NUMPY_ARENA_BYTES": "8G", "SHMPROXY_DEBUG": "WARN", "SHMPROXY_DEBUG_SUBSYS": "SHM"})
    _clean(res)
    # whichever rank registers second finds no room left (the two register in either order)
    held = [r["held"] for r in res.results]
    assert sorted(held) == [False, True], res.results
    assert "cannot map the arena" in res.stderr[held.index(False)], res.stderr
