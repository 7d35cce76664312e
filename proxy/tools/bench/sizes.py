"""Sizes: the sweep from ``-b`` to ``-e``, the iteration defaults, and the nccl-tests size convention
of the collectives (``shape_*``: send, receive and count elements of one rank) with their bus-bandwidth
factors. ``operation.row_size`` applies them to one operation.

Sizes of collectives (nccl-tests' convention)
---------------------------------------------
``size`` (the table's first column, ``bytes`` in the JSON) is the larger of one rank's send and
receive buffers, as nccl-tests prints ``max(sendBytes, expectedBytes)``; ``count`` is the count
argument of the call, as nccl-tests prints it:

==============  ========================  ======================  ===================  ==============
operation       send buffer (per rank)    receive buffer          size                 busbw/algbw
==============  ========================  ======================  ===================  ==============
allreduce       count                     count                   count                2(n-1)/n
reduce, bcast   count                     count                   count                1
allgather       count (one block)         n x count               n x count            (n-1)/n
reduce_scatter  n x count                 count (in place: n x)   n x count            (n-1)/n
alltoall        n x count (n blocks)      n x count               n x count            (n-1)/n
==============  ========================  ======================  ===================  ==============

(in elements; a requested size of S bytes gives ``count = max(1, S // itemsize)`` for the first
three and ``count = max(1, S // itemsize // n)`` for the last three, so the size shown is what was
really moved.) algbw = size / time and busbw = algbw x the factor above, as in nccl-tests'
PERFORMANCE.md. barrier has no size: one row, time only.
"""
from __future__ import annotations

import argparse


def parse_size(text: str) -> int:
    """Bytes with an optional K/M/G suffix (binary units), as the SHMPROXY_* sizes: '8', '4K', '64M'."""
    from shmproxy.core.params import parse_size as parse_param_size
    try:
        return parse_param_size(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"bad size {text!r}: {exc}") from None


def size_sweep(lo: int, hi: int, factor: int) -> list[int]:
    """lo, lo*factor, lo*factor**2, ... while below hi, then hi: the sweep always ends at hi."""
    if lo < 1:
        raise ValueError(f"minimum size must be at least 1 byte, got {lo}")
    if hi < lo:
        raise ValueError(f"maximum size {hi} is below the minimum {lo}")
    if factor < 2:
        raise ValueError(f"step factor must be at least 2, got {factor}")
    out, s = [], lo
    while s < hi:
        out.append(s)
        s *= factor
    return out + [hi]


def element_count(nbytes: int, itemsize: int) -> int:
    """Elements for a size: at least one, never more bytes than asked."""
    return max(1, nbytes // itemsize)


def default_iters(nbytes: int) -> int:
    """Timed iterations for a message: 1000 up to 64 KiB, then ~64 MiB of traffic, at least 10."""
    return int(min(1000, max(10, (64 << 20) // max(nbytes, 1))))


def default_warmup(iters: int) -> int:
    return int(min(100, max(2, iters // 10)))


def bus_factor_allreduce(n: int) -> float:
    """nccl-tests PERFORMANCE.md: allreduce busbw = algbw * 2(n-1)/n."""
    return 2.0 * (n - 1) / n


def bus_factor_one(n: int) -> float:
    """reduce, broadcast (and point to point): busbw = algbw."""
    return 1.0


def bus_factor_gather(n: int) -> float:
    """allgather, reduce_scatter, alltoall: busbw = algbw * (n-1)/n."""
    return (n - 1) / n


def block_count(count: int, nranks: int) -> int:
    """Elements per rank block of allgather / reduce_scatter / alltoall for a size of ``count``."""
    return max(1, count // nranks)


def shape_same(count: int, n: int, in_place: bool) -> tuple[int, int, int]:
    """(send elements, receive elements, count argument): point to point, allreduce, reduce, bcast."""
    return count, count, count


def shape_allgather(count: int, n: int, in_place: bool) -> tuple[int, int, int]:
    b = block_count(count, n)
    return b, b * n, b


def shape_reduce_scatter(count: int, n: int, in_place: bool) -> tuple[int, int, int]:
    b = block_count(count, n)
    return b * n, (b * n if in_place else b), b


def shape_alltoall(count: int, n: int, in_place: bool) -> tuple[int, int, int]:
    b = block_count(count, n)
    return b * n, b * n, b


def shape_none(count: int, n: int, in_place: bool) -> tuple[int, int, int]:
    """barrier: no data (one-element buffers keep the machinery uniform)."""
    return 1, 1, 0
