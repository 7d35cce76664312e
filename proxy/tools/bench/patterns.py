"""What the ranks send and what they must receive: the input pattern, the expected results of the
reductions (one period of them), and the checks of the collectives' receive buffers.

Inputs and checks of collectives: rank r's input is ``pattern(r, ...)`` (small integers 0..100, exact
in every dtype); for ``--op prod`` it is ``1 + (pattern // 7) % 2`` (products are powers of two).
After the timed loop, the receive buffer is reset (the sentinel, or the input where the call works
in place) and ONE more call is made and checked against the expected result: exactly for
integers (wrapping like the libraries), within ``4 n eps`` for floats (reduction order differs
between libraries). The checks compare against one period (101 elements) of the expected values, so
they cost a pass over the buffer and no more memory.
"""
from __future__ import annotations

import dataclasses
import functools
from typing import Any

import numpy as np

SENTINEL = 113
"""Written into receive buffers before the timed loop; never a value of ``pattern`` (0..100)."""
PATTERN_MOD = 101


def pattern(rank: int, count: int, dtype: Any) -> np.ndarray:
    """What ``rank`` sends: small integers (0..100), exact in every supported dtype."""
    return _pattern(rank, count, np.dtype(dtype).str)


@functools.lru_cache(maxsize=4)
def _pattern(rank: int, count: int, dtype_str: str) -> np.ndarray:
    a = tiled(input_period(rank), 0, count, dtype_str)
    a.flags.writeable = False
    return a


# ---- collectives: inputs and expected results (every value has period PATTERN_MOD)

REDOPS = ("sum", "prod", "min", "max", "avg")
_UFUNCS = {"sum": np.add, "prod": np.multiply, "min": np.minimum, "max": np.maximum, "avg": np.add}


def input_period(rank: int, redop: str = "sum") -> np.ndarray:
    """One period (PATTERN_MOD elements, int64) of rank ``rank``'s input: element i of any buffer is
    element ``i % PATTERN_MOD`` of this (7 and 101 are coprime). For ``prod`` the values are
    ``1 + (pattern // 7) % 2`` (1 or 2): products are powers of two, exact in every dtype whatever
    the order, no zero hides the other ranks' values, and over 16 ranks they stay below 2**11."""
    a = (np.arange(PATTERN_MOD, dtype=np.int64) * 7 + rank * 13 + 1) % PATTERN_MOD
    return 1 + (a // 7) % 2 if redop == "prod" else a


def tiled(period: np.ndarray, start: int, count: int, dtype: Any) -> np.ndarray:
    """Elements ``start .. start+count-1`` of the infinite repetition of ``period``, as ``dtype``."""
    p = period.size
    base = np.roll(np.asarray(period), -(start % p)).astype(dtype)
    return np.tile(base, -(-count // p))[:count] if count else base[:0]


def reduction_input(rank: int, count: int, dtype: Any, redop: str) -> np.ndarray:
    """Rank ``rank``'s input of a reduction (``pattern`` itself except for ``prod``)."""
    if redop != "prod":
        return pattern(rank, count, dtype)
    return tiled(input_period(rank, redop), 0, count, dtype)


def reduction_period(nranks: int, dtype: Any, redop: str) -> np.ndarray:
    """One period of the reduction over ranks 0..n-1 of their inputs, in ``dtype``. Integers are
    reduced in their own type (wrapping, as the libraries do); floats in float64/complex128, then
    rounded once to ``dtype``."""
    dt = np.dtype(dtype)
    ins = np.stack([input_period(r, redop) for r in range(nranks)])
    ufunc = _UFUNCS[redop]
    if dt.kind in "fc":
        wide = ins.astype(np.complex128 if dt.kind == "c" else np.float64)
        out = ufunc.reduce(wide, axis=0)
        if redop == "avg":
            out = out / nranks
        with np.errstate(over="ignore"):               # float16 products may overflow to inf
            return out.astype(dt)
    return ufunc.reduce(ins.astype(dt), axis=0, dtype=dt)


def tolerance(dtype: Any, nranks: int) -> float:
    """Relative tolerance of a reduced float (each library adds in its own order); 0 for integers."""
    dt = np.dtype(dtype)
    return 4.0 * max(nranks, 2) * float(np.finfo(dt).eps) if dt.kind in "fc" else 0.0


_CHECK_CHUNK = PATTERN_MOD * 8192


def matches_periodic(got: np.ndarray, period: np.ndarray, start: int = 0, rtol: float = 0.0) -> bool:
    """``got[i] == period[(start + i) % len(period)]`` for every i (within ``rtol`` when non-zero),
    compared chunk by chunk against one period (no full-size expected array)."""
    flat = got.reshape(-1)
    p = period.size
    exp = np.roll(np.asarray(period), -(start % p)).astype(flat.dtype)
    whole = flat.size // p * p
    for lo in range(0, whole, _CHECK_CHUNK):
        if not _close(flat[lo:min(lo + _CHECK_CHUNK, whole)].reshape(-1, p), exp, rtol):
            return False
    tail = flat[whole:]
    return _close(tail, exp[:tail.size], rtol)


def _close(got: np.ndarray, exp: np.ndarray, rtol: float) -> bool:
    with np.errstate(invalid="ignore", over="ignore"):
        if bool((got == exp).all()):
            return True
        return rtol > 0 and bool(np.isclose(got, exp, rtol=rtol, atol=0.0, equal_nan=True).all())


@dataclasses.dataclass(frozen=True)
class CheckSpec:
    """What a collective's check needs besides the buffer: the reduction, in place, the count."""

    redop: str = "sum"
    in_place: bool = False
    count: int = 0


# ---- checks of collectives (pure: every expected value comes from one period)

def verify_allreduce(rank: int, size: int, recv: np.ndarray, spec: CheckSpec) -> bool:
    return matches_periodic(recv[:spec.count], reduction_period(size, recv.dtype, spec.redop), 0,
                            tolerance(recv.dtype, size))


def verify_reduce(rank: int, size: int, recv: np.ndarray, spec: CheckSpec) -> bool:
    return rank != 0 or verify_allreduce(rank, size, recv, spec)


def verify_bcast(rank: int, size: int, recv: np.ndarray, spec: CheckSpec) -> bool:
    return rank == 0 or matches_periodic(recv[:spec.count], input_period(0))


def verify_allgather(rank: int, size: int, recv: np.ndarray, spec: CheckSpec) -> bool:
    c = spec.count
    return all(matches_periodic(recv[r * c:(r + 1) * c], input_period(r)) for r in range(size))


def verify_reduce_scatter(rank: int, size: int, recv: np.ndarray, spec: CheckSpec) -> bool:
    """Our block ``rank`` of the reduction, at the start of recv (in place too: MPI's convention)."""
    c = spec.count
    return matches_periodic(recv[:c], reduction_period(size, recv.dtype, spec.redop), rank * c,
                            tolerance(recv.dtype, size))


def verify_alltoall(rank: int, size: int, recv: np.ndarray, spec: CheckSpec) -> bool:
    """Block r of ours = block ``rank`` of rank r's input."""
    c = spec.count
    return all(matches_periodic(recv[r * c:(r + 1) * c], input_period(r), rank * c) for r in range(size))


def verify_nothing(rank: int, size: int, recv: np.ndarray, spec: CheckSpec) -> bool:
    return True
