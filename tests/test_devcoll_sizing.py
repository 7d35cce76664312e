"""The ranks' device kernels' scratch sizing (shmproxy.rank.devcoll.Sizing), without a GPU: whatever
the parameters, every kernel a call is cut into keeps its slots inside a scratch half.

The kernels round each block's slice up (shmproxy.rank.devkernels): a two-shot kernel's slice of a
window to NR 16-byte packs, so that each of its NR parts is whole packs; a share kernel's part to one
pack. The sizes below are those roundings, written out as the kernels compute them; a window or
share that overflowed would write past the half into the other (memory a peer may be reading).
"""
from __future__ import annotations

import random

import pytest

from shmproxy.rank.devcoll import Sizing
from shmproxy.rank.devkernels import MAX_BLOCKS

ITEMSIZES = (1, 2, 4, 8)


def _twoshot_slot_bytes(n: int, itemsize: int, grid: int, nranks: int) -> int:
    vec = 16 // itemsize
    per = -(-n // grid)
    per = -(-per // (nranks * vec)) * nranks * vec
    return per // nranks * grid * itemsize


def _share_slot_bytes(n: int, itemsize: int, grid: int) -> int:
    vec = 16 // itemsize
    sub = -(-n // grid)
    return -(-sub // vec) * vec * grid * itemsize


def _sizings(seed: int, count: int) -> list[Sizing]:
    rnd = random.Random(seed)
    out = [Sizing(2, 8 << 20, 1 << 40, 64 << 20, 128, 128, 128 << 10),    # the defaults, 2 ranks
           Sizing(8, 8 << 20, 1 << 40, 64 << 20, 128, 128, 128 << 10),    # ... and 8
           Sizing(2, 64 << 10, 1 << 40, 1 << 20, 128, 128, 1 << 10)]      # the GPU tests' small limits
    for _ in range(count):
        out.append(Sizing(rnd.randint(2, 8), rnd.choice([0, 4 << 10, 1 << 20, 8 << 20]), 1 << 40,
                          rnd.choice([1 << 20, 3 << 20, 64 << 20, 100 << 20]), rnd.randint(1, MAX_BLOCKS),
                          rnd.randint(1, MAX_BLOCKS), rnd.choice([16, 1 << 10, 128 << 10])))
    return out


@pytest.mark.parametrize("itemsize", ITEMSIZES)
def test_every_twoshot_window_fits_a_half(itemsize: int) -> None:
    rnd = random.Random(itemsize)
    for z in _sizings(itemsize, 40):
        step = z.window_count(itemsize)
        assert step >= 16 // itemsize, (vars(z), step)
        assert step * itemsize <= z.window
        for n in {1, 7, step - 1, step, rnd.randint(1, step), *(rnd.randint(1, 1 << 16) for _ in range(5))}:
            if not 0 < n <= step:
                continue
            grid = Sizing.grid(n, itemsize, z.blocks2)
            need = 2 * (z.nranks - 1) * _twoshot_slot_bytes(n, itemsize, grid, z.nranks)
            assert need <= z.cap, (vars(z), n, grid, need)


@pytest.mark.parametrize("itemsize", ITEMSIZES)
def test_every_share_window_fits_a_half(itemsize: int) -> None:
    rnd = random.Random(100 + itemsize)
    for z in _sizings(100 + itemsize, 40):
        if not z.window:
            continue
        step = z.share_window(itemsize)
        assert step >= 16 // itemsize, (vars(z), step)
        for n in {1, 7, step - 1, step, rnd.randint(1, step), *(rnd.randint(1, 1 << 16) for _ in range(5))}:
            if not 0 < n <= step:
                continue
            grid = Sizing.grid(n, itemsize, z.blocks2)
            need = (z.nranks - 1) * _share_slot_bytes(n, itemsize, grid)
            assert need <= z.cap, (vars(z), n, grid, need)


def test_a_oneshot_call_fits_a_half_and_halves_stay_aligned() -> None:
    for z in _sizings(7, 60):
        assert z.cap % 256 == 0 and z.cap >= z.oneshot_bytes
        assert 1 <= z.blocks <= MAX_BLOCKS and 1 <= z.blocks2 <= MAX_BLOCKS and z.chunk % 16 == 0


def test_two_shot_off_leaves_no_window() -> None:
    assert Sizing(2, 8 << 20, 0, 64 << 20, 128, 128, 128 << 10).window == 0
    assert Sizing(2, 8 << 20, 4 << 20, 64 << 20, 128, 128, 128 << 10).window == 0   # below the one-shot's
    assert Sizing(2, 8 << 20, 32 << 20, 64 << 20, 128, 128, 128 << 10).window == 32 << 20
