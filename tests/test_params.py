"""shmproxy.core.params: defaults, environment and overrides, and the values it refuses."""
from __future__ import annotations

import pytest

from shmproxy.core import errors, params as params_mod


def test_params_defaults_env_and_overrides():
    p = params_mod.Params(env={})
    assert p.PROGRESS_APPENDOP_FREQ == 8 and p.APPEND_BATCH_SIZE == 16 and p.STEPS == 8
    assert p.TIMEOUT == 600.0 and p.DUMP_SIGNAL == 0
    assert p.KEEP_AWAKE_US == -1.0   # automatic: on only when the ranks and the progress process share cores
    assert p.LOOP_COPIES == -1       # automatic likewise
    assert p.LOOP_POLL_US == -1.0    # automatic: polls only where the loop runs copy jobs itself
    assert p.COPY_STREAMING is True and p.STREAMING_MIN_BYTES == -1   # automatic: by the cache
    assert params_mod.Params(env={"SHMPROXY_STREAMING_MIN_BYTES": "auto"}).STREAMING_MIN_BYTES == -1
    assert params_mod.Params(env={"SHMPROXY_STREAMING_MIN_BYTES": "8M"}).STREAMING_MIN_BYTES == 8 << 20
    p = params_mod.Params(env={"SHMPROXY_CHUNK_SIZE": "1M", "SHMPROXY_DUMP_SIGNAL": "USR1"},
                          overrides={"steps": 4})
    assert p.CHUNK_SIZE == 1 << 20 and p.DUMP_SIGNAL == 10 and p.STEPS == 4
    origins = {x.name: x.origin for x in p.items()}
    assert origins["CHUNK_SIZE"] == "environment" and origins["STEPS"] == "override"
    assert params_mod.Params(env=p.to_env()).CHUNK_SIZE == 1 << 20
    assert "SHMPROXY_STEPS" in p.dump()
    # the eager limit is EAGER_BYTES capped at one chunk, for the loop and Wait's spin alike
    assert p.eager_limit == 512 << 10
    assert params_mod.Params(env={"SHMPROXY_CHUNK_SIZE": "64K"}).eager_limit == 64 << 10


@pytest.mark.parametrize("env", [{"SHMPROXY_STEPS": "eight"}, {"SHMPROXY_STEPS": "0"},
                                 {"SHMPROXY_DEBUG": "LOUD"}, {"SHMPROXY_PROXY_CPUS": "3-1"},
                                 {"SHMPROXY_NO_SUCH_THING": "1"}, {"SHMPROXY_DUMP_SIGNAL": "SIGNOPE"},
                                 {"SHMPROXY_DEBUG_SUBSYS": "INIT,BOGUS"}, {"SHMPROXY_APPEND_BATCH_SIZE": "1025"},
                                 {"SHMPROXY_LOOP_COPIES": "2"}, {"SHMPROXY_LOOP_POLL_US": "-2"},
                                 {"SHMPROXY_STREAMING_MIN_BYTES": "-2"}, {"SHMPROXY_STREAMING_MIN_BYTES": "big"},
                                 {"SHMPROXY_COLL_CHUNK_SIZE": "-3"}])
def test_bad_param_values_raise(env):
    with pytest.raises(errors.InvalidArgument, match="SHMPROXY_"):
        params_mod.Params(env=env)


def test_unknown_override_raises():
    with pytest.raises(errors.InvalidArgument):
        params_mod.Params(env={}, overrides={"stepz": 3})


def test_fast_path_size_by_ranks_crowding_and_settings():
    """The fast path's automatic size: the largest power of two whose cells fit FAST_AUTO_POOL_BYTES,
    capped at FAST_AUTO_MAX_BYTES, or at FAST_AUTO_CROWDED_MAX_BYTES where the ranks and the progress
    process share cores; off across nodes and above FAST_MAX_RANKS; FAST_BYTES set wins."""
    p = params_mod.Params(env={})
    sizes = {n: (p.fast_bytes(n, n), p.fast_bytes(n, n, crowded=True)) for n in (2, 3, 4, 8, 16, 64)}
    # no memory known: the pool's floor, 4 MiB
    assert sizes == {2: (64 << 10, 256 << 10), 3: (64 << 10, 64 << 10), 4: (64 << 10, 64 << 10),
                     8: (16 << 10, 16 << 10), 16: (4 << 10, 4 << 10), 64: (512, 512)}
    # the pool scales with the node's memory (1/4096), up to 64 MiB: 24 GiB keeps 16 KiB at 8 ranks,
    # 256 GiB gives 8 and 16 ranks the whole 64 KiB
    gib = 1 << 30
    assert [p.fast_bytes(n, n, mem_bytes=24 * gib) for n in (2, 8, 16)] == [64 << 10, 16 << 10, 4 << 10]
    big = [p.fast_bytes(n, n, mem_bytes=256 * gib) for n in (2, 8, 16, 32)]
    assert big == [64 << 10, 64 << 10, 64 << 10, 16 << 10]
    assert p.fast_bytes(16, 16, mem_bytes=1 << 50) == 64 << 10
    assert params_mod.Params(env={"SHMPROXY_FAST_AUTO_POOL_BYTES": "4M"}).fast_bytes(
        16, 16, mem_bytes=256 * gib) == 4 << 10
    assert p.fast_bytes(2, 4) == 0 and p.fast_bytes(65, 65) == 0   # across nodes; too many ranks
    fixed = params_mod.Params(env={"SHMPROXY_FAST_BYTES": "1K"})
    assert fixed.fast_bytes(2, 2, crowded=True) == 1024 and fixed.fast_bytes(16, 16) == 1024
    assert params_mod.Params(env={"SHMPROXY_FAST_BYTES": "0"}).fast_bytes(2, 2) == 0
    small = params_mod.Params(env={"SHMPROXY_FAST_AUTO_MAX_BYTES": "8K",
                                   "SHMPROXY_FAST_AUTO_CROWDED_MAX_BYTES": "8K"})
    assert small.fast_bytes(2, 2) == 8 << 10 and small.fast_bytes(2, 2, crowded=True) == 8 << 10
