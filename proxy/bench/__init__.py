"""shmproxy-bench: shmproxy and its Python peers measured side by side, in one run (nccl-tests style).

    mpiexec -n 2 shmproxy-bench pingpong -b 8 -e 64M -f 4 --peers mpi4py
    mpiexec -n 2 python -m proxy.bench sendrecv --json sendrecv.json --plot sendrecv.png
    mpiexec -n 4 shmproxy-bench allreduce -b 8 -e 64M -f 8 --op sum --dtype float32
    mpiexec -n 4 shmproxy-bench allgather --in-place --no-alloc
    mpiexec -n 2 shmproxy-bench overlap -b 64K -e 16M -f 4
    mpiexec -n 2 shmproxy-bench post --peers mpi4py
    mpiexec -n 2 shmproxy-bench idle --idle-seconds 10

Every rank runs this program under a launcher. Each calls ``proxy.init()`` and, for the peers asked
for (``--peers``, default per operation), opens them in the same process: mpi4py's COMM_WORLD, and
torch.distributed's gloo backend (its TCPStore is hosted by rank 0 on 127.0.0.1 at a free port that
rank 0 sends to the others through shmproxy; under torchrun, MASTER_ADDR/MASTER_PORT are used). A peer
that cannot be opened on every rank is skipped with a printed note; shmproxy itself never is.

The operation table
-------------------
``OPERATIONS`` maps a name to an :class:`Operation`: one builder per library (the call to time), the
bus-bandwidth factor, a correctness check, and how it is measured (a timed loop, posting cost, overlap
or idle CPU). The sweep, timing, gathering, checking, table, JSON and plot are shared.

- point to point: pingpong, sendrecv, post, idle.
- collectives (``measure_coll``): allreduce, reduce (root 0), bcast (root 0), allgather, reduce_scatter
  (``Reduce_scatter_block``), alltoall, barrier. shmproxy: ``comm.Allreduce`` ...; mpi4py: the
  upper-case buffer calls of ``MPI.COMM_WORLD``; gloo: ``dist.all_reduce``, ``dist.reduce``,
  ``dist.broadcast``, ``dist.all_gather_single`` (or ``all_gather_into_tensor``),
  ``dist.reduce_scatter_single`` (or ``reduce_scatter_tensor``), ``dist.all_to_all_single``,
  ``dist.barrier`` on tensors made by ``torch.from_numpy`` over the same numpy buffers.
  ``dist.all_reduce`` and ``dist.reduce`` work in place on their one tensor: gloo is timed on the
  receive buffer with no copy (its natural use), for out-of-place runs too.
- overlap (``measure_overlap``, the OSU osu_iallreduce method): see below.

A peer that cannot do an operation as asked (mpi4py has no AVG; torch has no in-place
reduce_scatter; a dtype or call its build does not support) is skipped for the run with a note that
says why: first from what is known statically, then by one probing call at the smallest size on
every rank (an error there, e.g. gloo's "Invalid scalar type" for int16, skips the peer everywhere).

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

In place (``--in-place``, allreduce / allgather / reduce_scatter) follows MPI: allreduce reduces the
receive buffer; allgather finds each rank's block already at its place in the receive buffer;
reduce_scatter takes its input (n blocks) from the receive buffer and leaves the result in the first
block (MPI_IN_PLACE; nccl puts it at block ``rank``).

Inputs and checks of collectives: rank r's input is ``pattern(r, ...)`` (small integers 0..100, exact
in every dtype); for ``--op prod`` it is ``1 + (pattern // 7) % 2`` (products are powers of two).
After the timed loop, the receive buffer is reset (the sentinel, or the input where the call works
in place) and ONE more call is made and checked against the expected result: exactly for
integers (wrapping like the libraries), within ``4 n eps`` for floats (reduction order differs
between libraries). The checks compare against one period (101 elements) of the expected values, so
they cost a pass over the buffer and no more memory.

Overlap (OSU method)
--------------------
As OSU's osu_iallreduce (``osu_util.c``: ``do_compute_cpu``, ``calculate_and_print_stats``), for each
size and library:

1. ``t_comm``: (Iallreduce; Wait) alone, each iteration followed by the library's own barrier
   (untimed), as OSU does; this rank's mean over ``-n`` iterations.
2. The work: pure-Python integer arithmetic (it holds the GIL, as an application's Python does) in
   chunks of ~2 us, repeated until this rank's ``t_comm`` of wall time has passed (OSU computes for
   a time, not an amount: ``do_compute_cpu`` loops until ``latency_in_secs`` have elapsed).
3. ``t_total``: (post Iallreduce; the work; Wait), each iteration followed by the barrier (untimed);
   ``t_compute`` = the work's time inside those iterations (OSU's "Compute" column). Means over the
   iterations.

Each figure is then averaged over the ranks (OSU reduces with MPI_SUM and divides by the number of
processes), and ``overlap % = 100 * max(0, 1 - (t_total - t_compute) / t_comm)`` (clipped to 100): the
fraction of the communication hidden behind the work. 100 means communicating cost nothing; 0 that it
was all added. mpi4py: ``Iallreduce`` + ``Wait`` and ``Barrier``; gloo: ``dist.all_reduce(async_op=True)``
+ ``work.wait()`` and ``dist.barrier``.

``work_slowdown`` (in the JSON) says what OSU's method does not: how much less work a rank got done
per second while the collective was in flight than alone (the same chunks, timed alone ``-n`` times).
Above 1, communicating slowed the rank's own computation (shared cores, memory bandwidth, or a host
whose vCPUs share physical cores: ``tools/host_probe interference``).

How a figure is made
--------------------
- Sizes go from ``-b`` to ``-e``, multiplying by ``-f``, and always end at ``-e`` (nccl-tests stops
  at the last power below it: ``-b 8 -e 64M -f 8`` would never measure 64 MiB). A size becomes
  ``max(1, size // itemsize)`` elements; the table shows the bytes actually moved.
- For each size, shmproxy runs first and then each peer, so that slow drift of the machine (another
  job, thermal, page cache) hits every library alike. On a noisy virtual machine the drift is faster
  than one library's measurement: ``--rounds R`` (timed sweeps: pingpong, sendrecv, the collectives)
  splits each library's ``-n`` iterations into R slices run in turn (shmproxy, peers, shmproxy, ...;
  each slice after its own warm-up and barrier) and pools their times before the median is taken.
- Where /proc/stat reports it, the steal time during each library's measurement (the share of CPU time
  the hypervisor gave to other guests while our vCPUs were ready to run) is kept in the JSON
  (``steal_pct``, per size and library) and summarized under the table: figures taken under steal
  are about the neighbours as much as about the libraries.
- Each library gets its buffers once, at the largest size (shmproxy: ``comm.alloc``, the zero-copy
  path, unless ``--no-alloc``; the peers: numpy arrays), and each size uses a prefix of them.
- A measurement is: a barrier, ``-w`` warm-up iterations, the receive buffer filled with a sentinel, a
  barrier, then ``-n`` iterations each timed alone with ``time.perf_counter``. A rank's figure is the
  median over its iterations (and the 99th percentile: with few iterations that is nearly the maximum);
  the reported figure is the maximum over the ranks of these medians. The ranks' figures travel to rank
  0 through shmproxy itself (Send/Recv of a float64 array), as does every barrier.
- Defaults adapt to the size (``default_iters``): many iterations for small messages, few for large
  ones, so that a sweep to 64 MiB takes well under a minute on 2 cores.
- pingpong: one iteration is a round trip between ranks 0 and 1 (other ranks idle); time = half of it
  (one-way latency); bandwidth = bytes / one-way time. sendrecv: each rank Isends to its right and
  Irecvs from its left, then Waitall; algbw = bytes / time, busbw = algbw.
- ratio = peer time / shmproxy time, which is also shmproxy bandwidth / peer bandwidth: above 1,
  shmproxy is faster.
- After the timed loop, every received buffer is compared with the pattern its sender wrote (unless
  ``--no-check``); the exit status is 1 on every rank if any check failed anywhere, 2 for a usage
  error.

``--inject-error`` (hidden) is a test hook: it corrupts shmproxy's first received buffer on every rank
before the check, so that the failure path (FAIL in the table, exit status 1) can be tested.
"""
from __future__ import annotations

import argparse
import contextlib
import dataclasses
import datetime
import functools
import json
import math
import os
import platform
import socket
import sys
import time
from typing import Any, Callable, Mapping, Sequence

import numpy as np

SCHEMA = "shmproxy-bench/1"
PEERS = ("mpi4py", "gloo")
SENTINEL = 113
"""Written into receive buffers before the timed loop; never a value of ``pattern`` (0..100)."""
PATTERN_MOD = 101
GROUP_SIZE = 64
IDLE_SETTLE_S = 0.5
"""Before the idle window, let the receivers post and the progress process finish its spin phase."""
RENDEZVOUS_TIMEOUT_S = 60.0

# Tags of our own traffic; the measured operations use TAG_OP. Distinct tags keep a barrier or a
# gather from ever matching a measured message.
TAG_OP, TAG_BARRIER, TAG_GATHER, TAG_BCAST = 17, 0x5B0001, 0x5B0002, 0x5B0003

_perf = time.perf_counter


# =================================================================================================
# Pure helpers: sizes, iterations, patterns, statistics (unit-tested without processes)

def parse_size(text: str) -> int:
    """Bytes with an optional K/M/G suffix (binary units), as the SHMPROXY_* sizes: '8', '4K', '64M'."""
    from proxy.params import _parse_size
    try:
        return _parse_size(text)
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


def pattern(rank: int, count: int, dtype: Any) -> np.ndarray:
    """What ``rank`` sends: small integers (0..100), exact in every supported dtype."""
    return _pattern(rank, count, np.dtype(dtype).str)


@functools.lru_cache(maxsize=4)
def _pattern(rank: int, count: int, dtype_str: str) -> np.ndarray:
    a = tiled(input_period(rank), 0, count, dtype_str)
    a.flags.writeable = False
    return a


# ---- collectives: inputs, expected results, sizes, bus factors (every value has period PATTERN_MOD)

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


def row_size(op: "Operation", nbytes: int, nranks: int, in_place: bool,
             itemsize: int) -> tuple[int, int, int, int]:
    """(send elements, receive elements, count argument, size in bytes) of one rank for a requested
    size of ``nbytes``: size = max(send, receive) bytes (nccl-tests), 0 for an operation without data."""
    n_send, n_recv, count = op.shape(element_count(nbytes, itemsize), nranks, in_place)
    return n_send, n_recv, count, (max(n_send, n_recv) * itemsize if op.sized else 0)


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


def overlap_percent(t_comm: float, t_compute: float, t_total: float) -> float:
    """OSU: 100 * max(0, 1 - (t_total - t_compute) / t_comm), at most 100; NaN without a t_comm."""
    if not (t_comm > 0) or math.isnan(t_compute) or math.isnan(t_total):
        return math.nan
    return 100.0 * min(1.0, max(0.0, 1.0 - (t_total - t_compute) / t_comm))


def spin(units: int) -> int:
    """The overlap benchmark's work: pure-Python integer arithmetic (holds the GIL throughout)."""
    x = 1
    for i in range(units):
        x = (x * 1103515245 + i) & 0xFFFFFFFF
    return x


def rescale_units(units: int, measured_s: float, target_s: float) -> int:
    """Work units that should take ``target_s``, given that ``units`` took ``measured_s``."""
    if not measured_s > 0:
        return max(1, units * 2)
    return max(1, int(round(units * target_s / measured_s)))


def calibrate(target_s: float, work: Callable[[int], Any] = spin, rounds: int = 3) -> int:
    """Units of ``work`` taking about ``target_s`` on this core: a first rate from a ~2 ms run, then
    ``rounds`` corrections from the fastest of three runs at the current guess (the fastest: a run
    that was preempted says nothing about the work's cost)."""
    units, took = 256, 0.0
    while True:
        t0 = _perf()
        work(units)
        took = _perf() - t0
        if took >= 2e-3 or units >= 1 << 26:
            break
        units *= 4
    units = rescale_units(units, took, target_s)
    for _ in range(rounds):
        runs = []
        for _ in range(3):
            t0 = _perf()
            work(units)
            runs.append(_perf() - t0)
        units = rescale_units(units, min(runs), target_s)
    return units


def summarize(times_s: Sequence[float], divisor: float = 1.0) -> tuple[float, float]:
    """(median, p99) in microseconds of per-iteration times in seconds, each divided by ``divisor``."""
    t = np.asarray(times_s, dtype=np.float64) * (1e6 / divisor)
    if t.size == 0:
        return math.nan, math.nan
    return float(np.median(t)), float(np.percentile(t, 99))


def cpu_ticks() -> tuple[int, int] | None:
    """(steal, all) clock ticks of this host's CPUs since boot, from /proc/stat; None where unknown.
    Steal is the time a virtual CPU was ready to run but the hypervisor ran something else."""
    try:
        with open("/proc/stat", encoding="ascii") as f:
            fields = f.readline().split()
    except OSError:
        return None
    if len(fields) < 9 or fields[0] != "cpu":
        return None
    ticks = [int(x) for x in fields[1:9]]  # user nice system idle iowait irq softirq steal (guest is in user)
    return ticks[7], sum(ticks)


class StealMeter:
    """Steal time during the spans it wraps (``with meter:``), as a percentage of all CPU time in
    them: on a virtual machine, how much of the host the other guests took while we measured."""

    def __init__(self) -> None:
        self.steal = self.total = 0
        self.known = True
        self._start: tuple[int, int] | None = None

    def __enter__(self) -> "StealMeter":
        self._start = cpu_ticks()
        return self

    def __exit__(self, *exc: object) -> None:
        end = cpu_ticks()
        if self._start is None or end is None:
            self.known = False
            return
        self.steal += end[0] - self._start[0]
        self.total += end[1] - self._start[1]

    @property
    def pct(self) -> float | None:
        return 100.0 * self.steal / self.total if self.known and self.total > 0 else None


def steal_note(rows: Sequence[Mapping[str, Any]], names: Sequence[str]) -> str:
    """The '#' line on steal time during each library's measurements ('' when the host reports none)."""
    parts = []
    for name in names:
        pcts = [r["results"][name].get("steal_pct") for r in rows]
        pcts = [p for p in pcts if p is not None]
        if pcts:
            parts.append(f"{name} {min(pcts):.1f}-{max(pcts):.1f} %")
    if not parts:
        return ""
    return ("# steal (the hypervisor ran other guests on our CPUs) while each library was measured, over the sizes: "
            + ", ".join(parts))


def gbps(nbytes: int, time_us: float) -> float:
    """GB/s (10**9 bytes per second) for ``nbytes`` in ``time_us`` microseconds."""
    if not time_us > 0:
        return math.nan
    return nbytes / time_us / 1e3


def max_over_ranks(values: Sequence[float]) -> float:
    """The largest non-NaN value (NaN marks a rank that did not take part); NaN if none took part."""
    v = [x for x in values if not math.isnan(x)]
    return max(v) if v else math.nan


def check_word(results: Mapping[str, Mapping[str, Any]]) -> str:
    """'ok', '-' (nothing checked), or 'FAIL:<libraries>' for one row."""
    failed = [lib for lib, r in results.items() if r.get("check") == "FAIL"]
    if failed:
        return "FAIL:" + ",".join(failed)
    if all(r.get("check") == "skipped" for r in results.values()):
        return "-"
    return "ok"


# =================================================================================================
# Libraries: what each one offers the operations (buffers and point-to-point calls)

class Library:
    """One library under test. Subclasses bind send/recv/isend/irecv (positional arguments: buffer,
    peer, tag), waitall and group to the library's own calls, so that the timed loop calls the library
    directly, with no layer of ours in between."""

    name = ""
    version = ""
    send: Callable[[Any, int, int], Any]
    recv: Callable[[Any, int, int], Any]
    isend: Callable[[Any, int, int], Any]
    irecv: Callable[[Any, int, int], Any]
    waitall: Callable[[list[Any]], Any]
    group: Callable[[], contextlib.AbstractContextManager[Any]]
    """Posts inside are batched (shmproxy's comm.group); a no-op context for the peers."""

    def __init__(self) -> None:
        self.waitall = self._wait_each
        self.group = contextlib.nullcontext

    def array(self, shape: int | tuple[int, ...], dtype: Any) -> np.ndarray:
        return np.zeros(shape, dtype)

    def wrap(self, a: np.ndarray) -> Any:
        """What this library's calls take for the numpy array ``a`` (sharing its memory)."""
        return a

    def redop(self, name: str) -> Any:
        """This library's reduction op for ``name`` (one of REDOPS); None if it has none."""
        return None

    @staticmethod
    def wait(req: Any) -> None:
        req.Wait()

    def _wait_each(self, reqs: list[Any]) -> None:
        for r in reqs:
            self.wait(r)

    def close(self) -> None:
        pass


class ShmproxyLib(Library):
    name = "shmproxy"

    def __init__(self, comm: Any, zero_copy: bool):
        import proxy
        super().__init__()
        self.comm, self.zero_copy = comm, zero_copy
        self.version = proxy.__version__
        self.send, self.recv, self.isend, self.irecv = comm.Send, comm.Recv, comm.Isend, comm.Irecv
        self.waitall, self.group = proxy.Request.Waitall, comm.group

    def redop(self, name: str) -> Any:
        import proxy
        return getattr(proxy, name.upper())

    def array(self, shape: int | tuple[int, ...], dtype: Any) -> np.ndarray:
        return self.comm.alloc(shape, dtype) if self.zero_copy else np.zeros(shape, dtype)


class MpiLib(Library):
    name = "mpi4py"

    def __init__(self, MPI: Any):
        import mpi4py
        super().__init__()
        world = MPI.COMM_WORLD
        self.world = world
        lib = MPI.Get_library_version().replace("\x00", "").strip().splitlines()   # Open MPI ends in NUL
        self.version = f"{mpi4py.__version__} ({' '.join(lib[0].split()) if lib else 'unknown MPI'})"
        self.send, self.recv, self.isend, self.irecv = world.Send, world.Recv, world.Isend, world.Irecv
        self.waitall = MPI.Request.Waitall
        self.MPI = MPI

    def redop(self, name: str) -> Any:
        MPI = self.MPI
        return {"sum": MPI.SUM, "prod": MPI.PROD, "min": MPI.MIN, "max": MPI.MAX}.get(name)  # no AVG


class GlooLib(Library):
    name = "gloo"

    def __init__(self, torch: Any, dist: Any):
        super().__init__()
        self.torch, self.dist = torch, dist
        self.version = torch.__version__
        self.send = lambda t, peer, tag: dist.send(t, peer, tag=tag)
        self.recv = lambda t, peer, tag: dist.recv(t, peer, tag=tag)
        self.isend = lambda t, peer, tag: dist.isend(t, peer, tag=tag)
        self.irecv = lambda t, peer, tag: dist.irecv(t, peer, tag=tag)

    def wrap(self, a: np.ndarray) -> Any:
        return self.torch.from_numpy(a)

    def redop(self, name: str) -> Any:
        R = self.dist.ReduceOp
        return {"sum": R.SUM, "prod": R.PRODUCT, "min": R.MIN, "max": R.MAX,
                "avg": getattr(R, "AVG", None)}.get(name)

    def fn(self, *names: str) -> Any:
        """The first of ``names`` that this torch.distributed has (newer names first), or None."""
        for name in names:
            f = getattr(self.dist, name, None)
            if f is not None:
                return f
        return None

    @staticmethod
    def wait(req: Any) -> None:
        req.wait()

    def close(self) -> None:
        self.dist.destroy_process_group()


# =================================================================================================
# Our own traffic through shmproxy: barrier, gather to rank 0, broadcast from rank 0

def barrier(comm: Any) -> None:
    """Dissemination barrier over shmproxy point-to-point (log2(n) rounds)."""
    n, r = comm.size, comm.rank
    token, got = np.zeros(1, np.uint8), np.zeros(1, np.uint8)
    k = 1
    while k < n:
        req = comm.Isend(token, (r + k) % n, TAG_BARRIER)
        comm.Recv(got, (r - k) % n, TAG_BARRIER)
        req.Wait()
        k *= 2


def gather(comm: Any, values: Sequence[float]) -> np.ndarray | None:
    """Every rank's ``values`` (same length everywhere) as rows of a float64 matrix on rank 0."""
    row = np.asarray(values, dtype=np.float64).reshape(-1)
    if comm.rank != 0:
        comm.Send(row, 0, TAG_GATHER)
        return None
    out = np.empty((comm.size, row.size), np.float64)
    out[0] = row
    for src in range(1, comm.size):
        comm.Recv(out[src], src, TAG_GATHER)
    return out


def bcast(comm: Any, values: Sequence[float] | None, length: int) -> np.ndarray:
    """Rank 0's ``values`` (``length`` float64) on every rank."""
    if comm.rank == 0:
        buf = np.asarray(values, dtype=np.float64).reshape(length)
        for dst in range(1, comm.size):
            comm.Send(buf, dst, TAG_BCAST)
        return buf
    buf = np.empty(length, np.float64)
    comm.Recv(buf, 0, TAG_BCAST)
    return buf


def agree(comm: Any, ok: bool) -> bool:
    """True on every rank when ``ok`` is true on every rank."""
    rows = gather(comm, [1.0 if ok else 0.0])
    return bool(bcast(comm, None if rows is None else [float(rows.min())], 1)[0])


# =================================================================================================
# The operation table

@dataclasses.dataclass
class Ctx:
    """What the operations see: this rank, its communicator, the options."""

    comm: Any
    rank: int
    size: int
    args: argparse.Namespace
    inject_pending: bool = False
    pids: list[int] = dataclasses.field(default_factory=list)


Builder = Callable[[Ctx, Any, Any, Any], Any]
"""(ctx, library, send, recv) -> one iteration of the operation (None: this rank takes no part); for
``overlap``, a (post, wait) pair. ``send``/``recv`` are the library's own view of the buffers (a torch
tensor for gloo). The library is typed Any here: each builder takes its own Library subclass."""


@dataclasses.dataclass(frozen=True)
class Column:
    title: str
    unit: str
    key: str


@dataclasses.dataclass(frozen=True)
class CheckSpec:
    """What a collective's check needs besides the buffer: the reduction, in place, the count."""

    redop: str = "sum"
    in_place: bool = False
    count: int = 0


def _no_source(rank: int, size: int) -> int | None:
    return None


@dataclasses.dataclass(frozen=True)
class Operation:
    name: str
    summary: str
    measure: Callable[..., list[float]]
    """measure(ctx, op, lib, send, recv, iters, warmup) -> this rank's figures (``fields``)."""
    fields: tuple[str, ...]
    """The per-rank figures ``measure`` returns (reduced with max over the ranks that took part)."""
    columns: tuple[Column, ...]
    source: Callable[[int, int], int | None]
    """(rank, size) -> the rank whose data this rank receives, None if it receives nothing."""
    calls: Mapping[str, Builder] = dataclasses.field(default_factory=dict)
    bus_factor: Callable[[int], float] = bus_factor_one
    time_divisor: float = 1.0
    ratio_key: str | None = "time_us"
    """Result key whose peer/shmproxy quotient is the ratio column (None: no ratio)."""
    default_dtype: str = "float32"
    default_sizes: tuple[str, str, int] = ("8", "64M", 4)
    default_peers: tuple[str, ...] = PEERS
    group_recv: bool = False
    """The receiver gets --group-size messages at once, each into its own row of the receive buffer."""
    check: Callable[[int, int, np.ndarray], bool] | None = None
    """(rank, size, received) -> data correct; default: equals ``pattern(source(rank, size))``."""
    # ---- collectives
    shape: Callable[[int, int, bool], tuple[int, int, int]] = shape_same
    """(elements of the requested size, ranks, in place) -> (send elements, receive elements, count
    argument); the row's size is max(send, receive) bytes (nccl-tests)."""
    verify: Callable[[int, int, np.ndarray, CheckSpec], bool] | None = None
    """(rank, size, receive buffer, spec) -> correct; replaces ``check``/``source`` when set."""
    receives: Callable[[int, int], bool] | None = None
    """(rank, size) -> this rank's receive buffer is checked (with ``verify``)."""
    reduces: bool = False
    """Takes --op; the inputs are ``reduction_input`` (else ``pattern``)."""
    in_place_ok: bool = False
    """--in-place applies."""
    native_in_place: frozenset[str] = frozenset()
    """Libraries whose call works in place on the receive buffer whatever --in-place says (gloo's
    all_reduce/reduce): their checked call gets the input copied into the receive buffer first."""
    place_input: Callable[[int, int, np.ndarray, np.ndarray], None] | None = None
    """(rank, size, send, recv): put the input where the in-place call reads it (default: recv = send)."""
    sized: bool = True
    """False: no data (barrier): one row of size 0, no bandwidth."""
    probe: bool = False
    """Try each peer once at the smallest size before the sweep; skip it (with the error) if it fails."""
    root: int | None = None
    bus_note: str = "1"
    derive: Callable[[dict[str, Any], np.ndarray], None] | None = None
    """(result, per-rank matrix) -> adds derived keys to a library's result (overlap's percentage)."""
    derived: tuple[str, ...] = ()

    def check_received(self, rank: int, size: int, recv: np.ndarray) -> bool:
        if self.check is not None:
            return self.check(rank, size, recv)
        src = self.source(rank, size)
        if src is None:
            return True
        return bool((recv == pattern(src, recv.shape[-1], recv.dtype)).all())

    def takes_data(self, rank: int, size: int) -> bool:
        """This rank's receive buffer is checked."""
        if self.receives is not None:
            return self.receives(rank, size)
        return self.source(rank, size) is not None

    def fill(self, rank: int, count: int, dtype: np.dtype, redop: str) -> np.ndarray:
        """This rank's input (send buffer) of ``count`` elements."""
        if self.reduces:
            return reduction_input(rank, count, dtype, redop)
        return pattern(rank, count, dtype)


def _pingpong(ctx: Ctx, lib: Library, send: Any, recv: Any) -> Callable[[], None] | None:
    s, r = lib.send, lib.recv
    if ctx.rank == 0:
        def it() -> None:
            s(send, 1, TAG_OP)
            r(recv, 1, TAG_OP)
    elif ctx.rank == 1:
        def it() -> None:
            r(recv, 0, TAG_OP)
            s(send, 0, TAG_OP)
    else:
        return None
    return it


def _sendrecv(ctx: Ctx, lib: Library, send: Any, recv: Any) -> Callable[[], None]:
    right, left = (ctx.rank + 1) % ctx.size, (ctx.rank - 1) % ctx.size
    isend, irecv, waitall = lib.isend, lib.irecv, lib.waitall

    def it() -> None:
        waitall([isend(send, right, TAG_OP), irecv(recv, left, TAG_OP)])
    return it


# ---- collectives: one builder per library. ``send``/``recv`` are the library's views (torch tensors
# for gloo); the reduction and in place come from ctx.args; the root of reduce/bcast is 0.

def _in_place(ctx: Ctx) -> bool:
    return bool(getattr(ctx.args, "in_place", False))


def _allreduce_shm(ctx: Ctx, lib: ShmproxyLib, send: Any, recv: Any) -> Callable[[], Any]:
    import proxy
    f, op, s = lib.comm.Allreduce, lib.redop(ctx.args.redop), proxy.IN_PLACE if _in_place(ctx) else send
    return lambda: f(s, recv, op)


def _allreduce_mpi(ctx: Ctx, lib: MpiLib, send: Any, recv: Any) -> Callable[[], Any]:
    f, op, s = lib.world.Allreduce, lib.redop(ctx.args.redop), lib.MPI.IN_PLACE if _in_place(ctx) else send
    return lambda: f(s, recv, op)


def _allreduce_gloo(ctx: Ctx, lib: GlooLib, send: Any, recv: Any) -> Callable[[], Any]:
    f, op = lib.dist.all_reduce, lib.redop(ctx.args.redop)     # in place on recv (native_in_place)
    return lambda: f(recv, op=op)


def _reduce_shm(ctx: Ctx, lib: ShmproxyLib, send: Any, recv: Any) -> Callable[[], Any]:
    f, op = lib.comm.Reduce, lib.redop(ctx.args.redop)
    return lambda: f(send, recv, op, 0)


def _reduce_mpi(ctx: Ctx, lib: MpiLib, send: Any, recv: Any) -> Callable[[], Any]:
    f, op = lib.world.Reduce, lib.redop(ctx.args.redop)
    return lambda: f(send, recv, op, root=0)


def _reduce_gloo(ctx: Ctx, lib: GlooLib, send: Any, recv: Any) -> Callable[[], Any]:
    f, op = lib.dist.reduce, lib.redop(ctx.args.redop)         # in place on recv (native_in_place)
    return lambda: f(recv, 0, op=op)


def _bcast_shm(ctx: Ctx, lib: ShmproxyLib, send: Any, recv: Any) -> Callable[[], Any]:
    f, buf = lib.comm.Bcast, send if ctx.rank == 0 else recv
    return lambda: f(buf, 0)


def _bcast_mpi(ctx: Ctx, lib: MpiLib, send: Any, recv: Any) -> Callable[[], Any]:
    f, buf = lib.world.Bcast, send if ctx.rank == 0 else recv
    return lambda: f(buf, root=0)


def _bcast_gloo(ctx: Ctx, lib: GlooLib, send: Any, recv: Any) -> Callable[[], Any]:
    f, buf = lib.dist.broadcast, send if ctx.rank == 0 else recv
    return lambda: f(buf, 0)


def _my_block(ctx: Ctx, recv: Any) -> Any:
    b = recv.shape[0] // ctx.size
    return recv[ctx.rank * b:(ctx.rank + 1) * b]


def _allgather_shm(ctx: Ctx, lib: ShmproxyLib, send: Any, recv: Any) -> Callable[[], Any]:
    import proxy
    f, s = lib.comm.Allgather, proxy.IN_PLACE if _in_place(ctx) else send
    return lambda: f(s, recv)


def _allgather_mpi(ctx: Ctx, lib: MpiLib, send: Any, recv: Any) -> Callable[[], Any]:
    f, s = lib.world.Allgather, lib.MPI.IN_PLACE if _in_place(ctx) else send
    return lambda: f(s, recv)


def _allgather_gloo(ctx: Ctx, lib: GlooLib, send: Any, recv: Any) -> Callable[[], Any]:
    f = lib.fn("all_gather_single", "all_gather_into_tensor", "_all_gather_base")
    s = _my_block(ctx, recv) if _in_place(ctx) else send       # in place: our block of the output
    return lambda: f(recv, s)


def _reduce_scatter_shm(ctx: Ctx, lib: ShmproxyLib, send: Any, recv: Any) -> Callable[[], Any]:
    import proxy
    f, op = lib.comm.Reduce_scatter_block, lib.redop(ctx.args.redop)
    s = proxy.IN_PLACE if _in_place(ctx) else send
    return lambda: f(s, recv, op)


def _reduce_scatter_mpi(ctx: Ctx, lib: MpiLib, send: Any, recv: Any) -> Callable[[], Any]:
    f, op = lib.world.Reduce_scatter_block, lib.redop(ctx.args.redop)
    s = lib.MPI.IN_PLACE if _in_place(ctx) else send
    return lambda: f(s, recv, op)


def _reduce_scatter_gloo(ctx: Ctx, lib: GlooLib, send: Any, recv: Any) -> Callable[[], Any]:
    f = lib.fn("reduce_scatter_single", "reduce_scatter_tensor", "_reduce_scatter_base")
    op = lib.redop(ctx.args.redop)
    return lambda: f(recv, send, op=op)


def _alltoall_shm(ctx: Ctx, lib: ShmproxyLib, send: Any, recv: Any) -> Callable[[], Any]:
    f = lib.comm.Alltoall
    return lambda: f(send, recv)


def _alltoall_mpi(ctx: Ctx, lib: MpiLib, send: Any, recv: Any) -> Callable[[], Any]:
    f = lib.world.Alltoall
    return lambda: f(send, recv)


def _alltoall_gloo(ctx: Ctx, lib: GlooLib, send: Any, recv: Any) -> Callable[[], Any]:
    f = lib.dist.all_to_all_single
    return lambda: f(recv, send)


def _barrier_shm(ctx: Ctx, lib: ShmproxyLib, send: Any, recv: Any) -> Callable[[], Any]:
    return lib.comm.Barrier


def _barrier_mpi(ctx: Ctx, lib: MpiLib, send: Any, recv: Any) -> Callable[[], Any]:
    return lib.world.Barrier


def _barrier_gloo(ctx: Ctx, lib: GlooLib, send: Any, recv: Any) -> Callable[[], Any]:
    return lib.dist.barrier


# overlap: (post, wait) pairs of the nonblocking allreduce


PostWait = tuple[Callable[[], Any], Callable[[Any], Any]]


def _iallreduce_shm(ctx: Ctx, lib: ShmproxyLib, send: Any, recv: Any) -> PostWait:
    f, op = lib.comm.Iallreduce, lib.redop(ctx.args.redop)
    return (lambda: f(send, recv, op)), (lambda req: req.Wait())


def _iallreduce_mpi(ctx: Ctx, lib: MpiLib, send: Any, recv: Any) -> PostWait:
    f, op = lib.world.Iallreduce, lib.redop(ctx.args.redop)
    return (lambda: f(send, recv, op)), (lambda req: req.Wait())


def _iallreduce_gloo(ctx: Ctx, lib: GlooLib, send: Any, recv: Any) -> PostWait:
    f, op = lib.dist.all_reduce, lib.redop(ctx.args.redop)     # in place on recv (native_in_place)
    return (lambda: f(recv, op=op, async_op=True)), (lambda work: work.wait())


def _place_block(rank: int, size: int, send: np.ndarray, recv: np.ndarray) -> None:
    """In-place allgather: our block of the receive buffer holds our input, the rest the sentinel."""
    recv.fill(SENTINEL)
    b = send.shape[0]
    recv[rank * b:(rank + 1) * b] = send


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


def _timed_loop(it: Callable[[], Any], iters: int) -> list[float]:
    times = [0.0] * iters
    for i in range(iters):
        t0 = _perf()
        it()
        times[i] = _perf() - t0
    return times


def _finish_check(ctx: Ctx, op: Operation, lib: Library, recv: np.ndarray, count: int = 0) -> float:
    """1.0 when the received data is right (or unchecked), 0.0 when wrong; applies --inject-error."""
    if ctx.inject_pending and lib.name == "shmproxy" and op.takes_data(ctx.rank, ctx.size):
        ctx.inject_pending = False
        recv[(0,) * recv.ndim] = SENTINEL
    if not ctx.args.check:
        return 1.0
    if op.verify is not None:
        spec = CheckSpec(getattr(ctx.args, "redop", None) or "sum", _in_place(ctx), count)
        return 1.0 if op.verify(ctx.rank, ctx.size, recv, spec) else 0.0
    return 1.0 if op.check_received(ctx.rank, ctx.size, recv) else 0.0


def _prepare(ctx: Ctx, op: Operation, lib: Library, send: np.ndarray, recv: np.ndarray) -> None:
    """Before a checked collective call: the receive buffer holds the sentinel, or, where the call
    works in place (--in-place, or a library whose call is in place by nature), the input."""
    if _in_place(ctx) or lib.name in op.native_in_place:
        (op.place_input or _copy_input)(ctx.rank, ctx.size, send, recv)
    else:
        recv.fill(SENTINEL)


def _copy_input(rank: int, size: int, send: np.ndarray, recv: np.ndarray) -> None:
    np.copyto(recv, send)


def loop_times(ctx: Ctx, op: Operation, lib: Library, send: np.ndarray, recv: np.ndarray, iters: int,
               warmup: int) -> list[float]:
    """Per-iteration seconds of one library at one size: warm up, reset the receive buffer, time."""
    it = op.calls[lib.name](ctx, lib, lib.wrap(send), lib.wrap(recv))
    barrier(ctx.comm)
    if it is not None:
        for _ in range(warmup):
            it()
    recv.fill(SENTINEL)
    barrier(ctx.comm)
    if it is None:
        return []
    return _timed_loop(it, iters)


def measure_loop(ctx: Ctx, op: Operation, lib: Library, send: np.ndarray, recv: np.ndarray, iters: int,
                 warmup: int) -> list[float]:
    """[time_us, p99_us] of one library at one size (``loop_times``)."""
    return list(summarize(loop_times(ctx, op, lib, send, recv, iters, warmup), op.time_divisor))


def measure_post(ctx: Ctx, op: Operation, lib: Library, send: np.ndarray, recv: np.ndarray, iters: int,
                 warmup: int) -> list[float]:
    """[single_us, single_p99_us, group_us_per_op] on rank 0, posting to rank 1.

    single: each Isend post timed alone (the wait for its completion is outside the timed region).
    group: ``--group-size`` Isends posted back to back inside ``lib.group()`` (shmproxy: one splice
    for all of them; the peers have no such call, so the posts simply follow each other), the time
    from before the first post to after the group is closed, divided by the number of posts.
    Rank 1 receives every message (the group ones into distinct rows, posted as a group of Irecvs)."""
    gsize = recv.shape[0]
    reps = max(10, iters // gsize)
    wreps = max(1, warmup // gsize)
    isend, irecv, wait, waitall, group = lib.isend, lib.irecv, lib.wait, lib.waitall, lib.group
    barrier(ctx.comm)
    out = [math.nan, math.nan, math.nan]
    if ctx.rank == 0:
        s = lib.wrap(send)
        single = []
        for i in range(warmup + iters):
            t0 = _perf()
            req = isend(s, 1, TAG_OP)
            t1 = _perf()
            wait(req)
            if i >= warmup:
                single.append(t1 - t0)
        grouped = []
        for i in range(wreps + reps):
            t0 = _perf()
            with group():
                reqs = [isend(s, 1, TAG_OP) for _ in range(gsize)]
            t1 = _perf()
            waitall(reqs)
            if i >= wreps:
                grouped.append((t1 - t0) / gsize)
        out = [*summarize(single), summarize(grouped)[0]]
    elif ctx.rank == 1:
        rows = [lib.wrap(recv[j]) for j in range(gsize)]
        recv_one = lib.recv
        for _ in range(warmup + iters):
            recv_one(rows[0], 0, TAG_OP)
        for i in range(wreps + reps):
            if i == wreps:
                recv.fill(SENTINEL)
            with group():
                reqs = [irecv(rows[j], 0, TAG_OP) for j in range(gsize)]
            waitall(reqs)
    return out


def _cpu_seconds(pid: int) -> float:
    import psutil
    t = psutil.Process(pid).cpu_times()
    return float(t.user + t.system)


def _voluntary_switches(pid: int) -> int:
    """Voluntary context switches of every thread of ``pid`` (each is a sleep, i.e. a wake-up)."""
    total = 0
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            with open(f"/proc/{pid}/task/{tid}/status") as f:
                for line in f:
                    if line.startswith("voluntary_ctxt_switches:"):
                        total += int(line.split()[1])
        except FileNotFoundError:
            pass                                      # a thread that ended meanwhile
    return total


def measure_idle(ctx: Ctx, op: Operation, lib: Library, send: np.ndarray, recv: np.ndarray, iters: int,
                 warmup: int) -> list[float]:
    """[proxy %core, proxy wake-ups/s, waiting ranks' %core (max)] over --idle-seconds.

    Every rank but 0 blocks in a receive (as an application waiting for work does); rank 0 samples
    the CPU time of the progress process and of the waiting ranks, then sends them their message."""
    barrier(ctx.comm)
    if ctx.rank != 0:
        recv.fill(SENTINEL)
        lib.recv(lib.wrap(recv), 0, TAG_OP)
        return [math.nan, math.nan, math.nan]
    proxy_pid = ctx.comm._proxy_pid
    waiting = ctx.pids[1:]
    time.sleep(IDLE_SETTLE_S)
    c0 = [_cpu_seconds(p) for p in [proxy_pid, *waiting]]
    v0 = _voluntary_switches(proxy_pid)
    t0 = _perf()
    time.sleep(ctx.args.idle_seconds)
    wall = _perf() - t0
    c1 = [_cpu_seconds(p) for p in [proxy_pid, *waiting]]
    v1 = _voluntary_switches(proxy_pid)
    s = lib.wrap(send)
    for dst in range(1, ctx.size):
        lib.send(s, dst, TAG_OP)
    pct = [100.0 * (b - a) / wall for a, b in zip(c0, c1)]
    return [pct[0], (v1 - v0) / wall, max(pct[1:], default=math.nan)]


def coll_times(ctx: Ctx, op: Operation, lib: Library, send: np.ndarray, recv: np.ndarray, iters: int,
               warmup: int) -> list[float]:
    """Per-call seconds of one collective at one size; then one more call, the checked one.

    Warm up, barrier, ``iters`` calls each timed alone; then the receive buffer is reset (``_prepare``:
    the sentinel, or the input for a call that works in place, whose timed calls overwrote it),
    a barrier, and one call whose result ``_finish_check`` compares with the expected one."""
    it = op.calls[lib.name](ctx, lib, lib.wrap(send), lib.wrap(recv))
    _prepare(ctx, op, lib, send, recv)
    barrier(ctx.comm)
    for _ in range(warmup):
        it()
    barrier(ctx.comm)
    times = _timed_loop(it, iters)
    _prepare(ctx, op, lib, send, recv)
    barrier(ctx.comm)
    it()
    return times


def measure_coll(ctx: Ctx, op: Operation, lib: Library, send: np.ndarray, recv: np.ndarray, iters: int,
                 warmup: int) -> list[float]:
    """[time_us, p99_us] of one collective at one size (``coll_times``)."""
    return list(summarize(coll_times(ctx, op, lib, send, recv, iters, warmup), op.time_divisor))


# The measures whose figures are the median and p99 of per-iteration times: with --rounds, the times
# of every round are pooled before they are summarized.
RAW_TIMES = {measure_loop: loop_times, measure_coll: coll_times}


WORK_CHUNK_S = 2e-6     # one chunk of the overlap benchmark's work (OSU's compute_on_host: ~1 us)


def work_for(seconds: float, chunk: int) -> int:
    """The overlap benchmark's work: ``spin(chunk)`` until ``seconds`` of wall time have passed (at
    least once), as OSU's do_compute_cpu. Returns the chunks done."""
    t0, n = _perf(), 0
    while True:
        spin(chunk)
        n += 1
        if _perf() - t0 >= seconds:
            return n


def measure_overlap(ctx: Ctx, op: Operation, lib: Library, send: np.ndarray, recv: np.ndarray, iters: int,
                    warmup: int) -> list[float]:
    """[t_comm_us, t_compute_us, t_total_us, work_slowdown] at one size, as OSU's osu_iallreduce
    (see the module's "Overlap" section): means over ``iters`` iterations, each followed by the
    library's barrier; the work runs for this rank's t_comm of wall time."""
    post, wait = op.calls[lib.name](ctx, lib, lib.wrap(send), lib.wrap(recv))
    lib_barrier = OPERATIONS["barrier"].calls[lib.name](ctx, lib, None, None)   # OSU's MPI_Barrier, untimed
    _prepare(ctx, op, lib, send, recv)
    barrier(ctx.comm)
    for _ in range(warmup):
        wait(post())
        lib_barrier()
    t_comm = [0.0] * iters
    for i in range(iters):
        t0 = _perf()
        wait(post())
        t_comm[i] = _perf() - t0
        lib_barrier()
    target = float(np.mean(t_comm))
    chunk = calibrate(WORK_CHUNK_S)
    rate_alone = []
    for _ in range(iters):
        t0 = _perf()
        n = work_for(target, chunk)
        rate_alone.append(n / (_perf() - t0))
    barrier(ctx.comm)
    for _ in range(min(warmup, 3)):
        req = post()
        work_for(target, chunk)
        wait(req)
        lib_barrier()
    total, during, rate = [0.0] * iters, [0.0] * iters, [0.0] * iters
    for i in range(iters):
        t0 = _perf()
        req = post()
        t1 = _perf()
        n = work_for(target, chunk)
        t2 = _perf()
        wait(req)
        t3 = _perf()
        total[i], during[i], rate[i] = t3 - t0, t2 - t1, n / (t2 - t1)
        lib_barrier()
    _prepare(ctx, op, lib, send, recv)
    barrier(ctx.comm)
    wait(post())
    slowdown = float(np.median(rate_alone) / np.median(rate)) if min(rate) > 0 else math.nan
    return [float(np.mean(x)) * 1e6 for x in (t_comm, during, total)] + [slowdown]


def _derive_overlap(res: dict[str, Any], per_rank: np.ndarray) -> None:
    """OSU: each figure averaged over the ranks, then the overlap of those means; per rank from each
    rank's own figures."""
    means = [float(np.nanmean(per_rank[:, i])) for i in range(per_rank.shape[1])]
    res["t_comm_us"], res["t_compute_us"], res["t_total_us"], res["work_slowdown"] = means
    res["overlap_pct"] = overlap_percent(*means[:3])
    res["ranks"]["overlap_pct"] = [
        None if math.isnan(v := overlap_percent(row[0], row[1], row[2])) else v for row in per_rank.tolist()]


SWEEP_COLUMNS = (Column("time", "us", "time_us"), Column("p99", "us", "p99_us"),
                 Column("algbw", "GB/s", "algbw_GBps"), Column("busbw", "GB/s", "busbw_GBps"))


def _collective(name: str, summary: str, calls: tuple[Builder, Builder, Builder],
                bus_factor: Callable[[int], float], bus_note: str,
                verify: Callable[[int, int, np.ndarray, CheckSpec], bool], **extra: Any) -> Operation:
    """A collective entry: timed by measure_coll, probed, checked by ``verify`` on every rank unless
    ``receives`` says otherwise."""
    extra.setdefault("receives", lambda r, n: True)
    columns = extra.pop("columns", SWEEP_COLUMNS)
    return Operation(name, summary, measure_coll, ("time_us", "p99_us"), columns, source=_no_source,
                     calls=dict(zip(("shmproxy", *PEERS), calls)), bus_factor=bus_factor, bus_note=bus_note,
                     verify=verify, probe=True, **extra)


OPERATIONS: dict[str, Operation] = {op.name: op for op in (
    Operation(
        "pingpong", "rank 0 <-> rank 1 round trips; time = one way (half a round trip)",
        measure_loop, ("time_us", "p99_us"), SWEEP_COLUMNS,
        source=lambda r, n: {0: 1, 1: 0}.get(r),
        calls=dict.fromkeys(("shmproxy", *PEERS), _pingpong),
        time_divisor=2.0, default_dtype="uint8"),
    Operation(
        "sendrecv", "ring exchange: Isend to the right, Irecv from the left, Waitall",
        measure_loop, ("time_us", "p99_us"), SWEEP_COLUMNS,
        source=lambda r, n: (r - 1) % n,
        calls=dict.fromkeys(("shmproxy", *PEERS), _sendrecv)),
    Operation(
        "post", "cost of posting an Isend on rank 0 (rank 1 receives): alone, and amortised in a group",
        measure_post, ("single_us", "single_p99_us", "group_us_per_op"),
        (Column("post", "us", "single_us"), Column("p99", "us", "single_p99_us"),
         Column("group", "us/op", "group_us_per_op")),
        source=lambda r, n: 0 if r == 1 else None,
        ratio_key="single_us", default_dtype="uint8", default_sizes=("8", "8", 2), group_recv=True),
    Operation(
        "idle", "CPU use while the job is idle: ranks 1.. block in a receive, rank 0 watches",
        measure_idle, ("proxy_cpu_percent", "proxy_wakeups_per_s", "waiting_cpu_percent"),
        (Column("proxy", "%core", "proxy_cpu_percent"), Column("wakeups", "1/s", "proxy_wakeups_per_s"),
         Column("waiting", "%core", "waiting_cpu_percent")),
        source=lambda r, n: 0 if r != 0 else None,
        ratio_key=None, default_dtype="uint8", default_sizes=("8", "8", 2), default_peers=()),
    _collective("allreduce", "Allreduce: every rank gets the reduction of every rank's buffer",
                (_allreduce_shm, _allreduce_mpi, _allreduce_gloo), bus_factor_allreduce, "2(n-1)/n",
                verify_allreduce, reduces=True, in_place_ok=True, native_in_place=frozenset({"gloo"})),
    _collective("reduce", "Reduce to root 0",
                (_reduce_shm, _reduce_mpi, _reduce_gloo), bus_factor_one, "1",
                verify_reduce, receives=lambda r, n: r == 0, reduces=True,
                native_in_place=frozenset({"gloo"}), root=0),
    _collective("bcast", "Bcast from root 0",
                (_bcast_shm, _bcast_mpi, _bcast_gloo), bus_factor_one, "1",
                verify_bcast, receives=lambda r, n: r != 0, root=0),
    _collective("allgather", "Allgather: every rank gets every rank's block (size = n blocks)",
                (_allgather_shm, _allgather_mpi, _allgather_gloo), bus_factor_gather, "(n-1)/n",
                verify_allgather, shape=shape_allgather, in_place_ok=True, place_input=_place_block),
    _collective("reduce_scatter",
                "Reduce_scatter_block: rank r gets block r of the reduction (size = n blocks)",
                (_reduce_scatter_shm, _reduce_scatter_mpi, _reduce_scatter_gloo), bus_factor_gather,
                "(n-1)/n",
                verify_reduce_scatter, shape=shape_reduce_scatter, reduces=True, in_place_ok=True),
    _collective("alltoall", "Alltoall: block r of rank q goes to block q of rank r (size = n blocks)",
                (_alltoall_shm, _alltoall_mpi, _alltoall_gloo), bus_factor_gather, "(n-1)/n",
                verify_alltoall, shape=shape_alltoall),
    _collective("barrier", "Barrier (no data: one row, time only)",
                (_barrier_shm, _barrier_mpi, _barrier_gloo), bus_factor_one, "-",
                verify_nothing, receives=lambda r, n: False, shape=shape_none, sized=False,
                columns=SWEEP_COLUMNS[:2], default_sizes=("8", "8", 2)),
    Operation(
        "overlap", "Iallreduce overlapped with pure-Python work (OSU method); overlap % per library",
        measure_overlap, ("t_comm_us", "t_compute_us", "t_total_us", "work_slowdown"),
        (Column("t_comm", "us", "t_comm_us"), Column("t_comp", "us", "t_compute_us"),
         Column("t_total", "us", "t_total_us"), Column("slowdown", "x", "work_slowdown"),
         Column("overlap", "%", "overlap_pct")),
        source=_no_source, calls={"shmproxy": _iallreduce_shm, "mpi4py": _iallreduce_mpi,
                                  "gloo": _iallreduce_gloo},
        ratio_key=None, default_sizes=("64K", "16M", 4), bus_note="2(n-1)/n", verify=verify_allreduce,
        receives=lambda r, n: True, reduces=True, native_in_place=frozenset({"gloo"}), probe=True,
        derive=_derive_overlap, derived=("overlap_pct",)),
)}


# =================================================================================================
# Reduction on rank 0, rows, table

def reduce_result(op: Operation, per_rank: np.ndarray, nbytes: int, nranks: int,
                  checked: bool) -> dict[str, Any]:
    """One library's figures at one size from the gathered per-rank matrix.

    ``per_rank`` has one row per rank: ``op.fields`` then check (1/0)."""
    nf = len(op.fields)
    res: dict[str, Any] = {k: max_over_ranks(per_rank[:, i].tolist()) for i, k in enumerate(op.fields)}
    res["ranks"] = {k: [None if math.isnan(v) else v for v in per_rank[:, i].tolist()]
                    for i, k in enumerate(op.fields)}
    if "time_us" in res and op.sized:
        res["algbw_GBps"] = gbps(nbytes, res["time_us"])
        res["busbw_GBps"] = res["algbw_GBps"] * op.bus_factor(nranks)
    if op.derive is not None:
        op.derive(res, per_rank[:, :nf])
    res["check"] = ("ok" if per_rank[:, nf].min() == 1.0 else "FAIL") if checked else "skipped"
    return res


def ratios(op: Operation, results: Mapping[str, Mapping[str, Any]]) -> dict[str, float | None]:
    """peer figure / shmproxy figure of ``op.ratio_key`` for each peer (time: > 1 = shmproxy faster)."""
    if op.ratio_key is None:
        return {}
    base = results["shmproxy"].get(op.ratio_key, math.nan)
    out: dict[str, float | None] = {}
    for lib, r in results.items():
        if lib == "shmproxy":
            continue
        v = r.get(op.ratio_key, math.nan)
        out[lib] = v / base if base > 0 and v > 0 else None
    return out


LEAD = (("size", "(B)", 12), ("count", "(elems)", 11), ("type", "", 8))
COL_W = 9
RATIO_W = 11


def format_value(v: Any) -> str:
    """Numbers for the table: '-' for missing, fewer decimals as they grow."""
    if v is None or (isinstance(v, float) and math.isnan(v)):
        return "-"
    if isinstance(v, (str, int, np.integer)):
        return str(v)
    a = abs(v)
    if a >= 1e5:
        return f"{v:.0f}"
    if a >= 1e3:
        return f"{v:.1f}"
    return f"{v:.2f}"


def format_header(op: Operation, libs: Sequence[str]) -> list[str]:
    """The table's header (three '#' lines, nccl-tests style)."""
    lead_w = sum(w for _, _, w in LEAD)
    group_w = COL_W * len(op.columns)
    peers = [lib for lib in libs if lib != "shmproxy"] if op.ratio_key else []
    l1 = "#" + " " * (lead_w - 1) + "".join(f"{lib:>{group_w}}" for lib in libs)
    l2 = "".join(f"{t:>{w}}" for t, _, w in LEAD)
    l3 = "".join(f"{u:>{w}}" for _, u, w in LEAD)
    for _ in libs:
        l2 += "".join(f"{c.title:>{COL_W}}" for c in op.columns)
        l3 += "".join(f"{'(' + c.unit + ')':>{COL_W}}" for c in op.columns)
    for p in peers:
        l2 += f"{'vs ' + p:>{RATIO_W}}"
        l3 += f"{'(ratio)':>{RATIO_W}}"
    l2 += "  check"
    return [l1, "#" + l2[1:], "#" + l3[1:]]


def format_row(op: Operation, row: Mapping[str, Any], libs: Sequence[str]) -> str:
    cells = [row["bytes"], row["count"], row["dtype"]]
    line = "".join(f"{format_value(v):>{w}}" for v, (_, _, w) in zip(cells, LEAD))
    for lib in libs:
        r = row["results"][lib]
        line += "".join(f"{format_value(r.get(c.key)):>{COL_W}}" for c in op.columns)
    if op.ratio_key:
        for lib in libs:
            if lib != "shmproxy":
                line += f"{format_value(row['ratio'].get(lib)):>{RATIO_W}}"
    return line + "  " + check_word(row["results"])


def ratio_note(op: Operation) -> str:
    if op.ratio_key is None:
        return ""
    if op.ratio_key == "time_us":
        return ("# ratio = peer time / shmproxy time (= shmproxy bandwidth / peer bandwidth);"
                " > 1: shmproxy is faster")
    title = next(c.title for c in op.columns if c.key == op.ratio_key)
    return f"# ratio = peer {title} time / shmproxy {title} time; > 1: shmproxy is cheaper"


# =================================================================================================
# Report (JSON) and plot

REPORT_KEYS: dict[str, type | tuple[type, ...]] = {
    "schema": str, "op": str, "summary": str, "ok": bool, "libraries": list, "skipped": dict,
    "config": dict, "environment": dict, "columns": list, "results": list,
}
ROW_KEYS: dict[str, type | tuple[type, ...]] = {
    "bytes": int, "count": int, "dtype": str, "iters": int, "warmup": int, "results": dict, "ratio": dict,
}
ENV_KEYS = ("host", "nproc", "ranks", "python", "numpy", "shmproxy", "mpi4py", "torch", "params", "date",
            "command")


def build_report(op: Operation, rows: list[dict[str, Any]], libs: Sequence[str], skipped: Mapping[str, str],
                 config: Mapping[str, Any], environment: Mapping[str, Any],
                 complete: bool = True) -> dict[str, Any]:
    """``complete`` is False in the copies written after each row (a run that was cut short)."""
    return {
        "schema": SCHEMA, "op": op.name, "summary": op.summary, "complete": complete,
        "ok": all(r.get("check") != "FAIL" for row in rows for r in row["results"].values()),
        "libraries": list(libs), "skipped": dict(skipped), "config": dict(config),
        "environment": dict(environment),
        "columns": [dataclasses.asdict(c) for c in op.columns],
        "ratio": ratio_note(op).lstrip("# "),
        "bus_factor": op.bus_note,
        "size": ("max(send, recv) bytes of one rank; count = the call's count argument (nccl-tests)"
                 if op.probe and op.sized else "bytes of one message" if op.sized else "none"),
        "results": rows,
    }


def validate_report(report: Mapping[str, Any]) -> list[str]:
    """What is wrong with a report (empty when it follows the schema)."""
    problems = []
    for key, typ in REPORT_KEYS.items():
        if not isinstance(report.get(key), typ):
            problems.append(f"{key}: expected {typ}, got {type(report.get(key)).__name__}")
    if problems:
        return problems
    if report["schema"] != SCHEMA:
        problems.append(f"schema {report['schema']!r} is not {SCHEMA!r}")
    if "shmproxy" not in report["libraries"]:
        problems.append("libraries lacks shmproxy")
    for key in ENV_KEYS:
        if key not in report["environment"]:
            problems.append(f"environment lacks {key}")
    fields = [c["key"] for c in report["columns"]]
    for i, row in enumerate(report["results"]):
        for key, typ in ROW_KEYS.items():
            if not isinstance(row.get(key), typ):
                problems.append(f"results[{i}].{key}: expected {typ}, got {type(row.get(key)).__name__}")
        for lib in report["libraries"]:
            r = row.get("results", {}).get(lib)
            if not isinstance(r, dict):
                problems.append(f"results[{i}] lacks {lib}")
                continue
            if r.get("check") not in ("ok", "FAIL", "skipped"):
                problems.append(f"results[{i}].{lib}.check is {r.get('check')!r}")
            for f in fields:
                if f not in r:
                    problems.append(f"results[{i}].{lib} lacks {f}")
    return problems


def _json_safe(obj: Any) -> Any:
    """NaN/inf -> None (strict JSON), numpy scalars -> Python numbers."""
    if isinstance(obj, dict):
        return {str(k): _json_safe(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_json_safe(v) for v in obj]
    if isinstance(obj, np.generic):
        obj = obj.item()
    if isinstance(obj, float) and not math.isfinite(obj):
        return None
    if obj is None or isinstance(obj, (bool, int, float, str)):
        return obj
    return str(obj)


def dumps_report(report: Mapping[str, Any]) -> str:
    return json.dumps(_json_safe(report), indent=2, allow_nan=False) + "\n"


def plot_report(report: Mapping[str, Any], path: str) -> str:
    """Latency and bandwidth against size, one line per library; returns a line saying what happened."""
    sized = any(row["bytes"] for row in report["results"])
    if "time_us" not in [c["key"] for c in report["columns"]] or not sized:
        return (f"--plot: nothing to plot for {report['op']} (only size sweeps such as pingpong, sendrecv, "
                f"allreduce)")
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "--plot: matplotlib is not installed (pip install 'shmproxy[bench]'); no plot written"
    fig, (ax_t, ax_b) = plt.subplots(1, 2, figsize=(12, 4.5))
    sizes = [row["bytes"] for row in report["results"]]
    for lib in report["libraries"]:
        t = [row["results"][lib].get("time_us") for row in report["results"]]
        b = [row["results"][lib].get("busbw_GBps") for row in report["results"]]
        ax_t.plot(sizes, [math.nan if v is None else v for v in t], marker="o", label=lib)
        ax_b.plot(sizes, [math.nan if v is None else v for v in b], marker="o", label=lib)
    for ax, what in ((ax_t, "time (us)"), (ax_b, "bus bandwidth (GB/s)")):
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("message size (B)")
        ax.set_ylabel(what)
        ax.grid(True, which="both", alpha=0.3)
        ax.legend()
    env = report["environment"]
    fig.suptitle(f"shmproxy-bench {report['op']}: {env.get('ranks')} ranks on {env.get('host')} "
                 f"({env.get('nproc')} CPUs), {env.get('date', '')[:19]}")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return f"# plot written to {path}"


# =================================================================================================
# Opening the peers, the environment, the run

def open_mpi(ctx: Ctx) -> tuple[Library | None, str]:
    try:
        from mpi4py import MPI
    except ImportError as exc:
        return None, f"mpi4py cannot be imported ({exc})"
    world = MPI.COMM_WORLD
    if (world.Get_rank(), world.Get_size()) != (ctx.rank, ctx.size):
        return None, (f"MPI.COMM_WORLD is rank {world.Get_rank()} of {world.Get_size()} but shmproxy is "
                      f"rank {ctx.rank} of {ctx.size} (not started by an MPI launcher?)")
    return MpiLib(MPI), ""


def open_gloo(ctx: Ctx) -> tuple[Library | None, str]:
    try:
        import torch
        import torch.distributed as dist
        have = dist.is_available() and dist.is_gloo_available()
        why = "" if have else "this torch has no gloo backend"
    except ImportError as exc:
        have, why = False, f"torch cannot be imported ({exc})"
    if not agree(ctx.comm, have):
        return None, why or "torch.distributed gloo is missing on another rank"
    timeout = datetime.timedelta(seconds=RENDEZVOUS_TIMEOUT_S)
    if os.environ.get("MASTER_ADDR") and os.environ.get("MASTER_PORT"):    # torchrun and friends
        dist.init_process_group("gloo", init_method="env://", rank=ctx.rank, world_size=ctx.size,
                                timeout=timeout)
        return GlooLib(torch, dist), ""
    # No rendezvous given: rank 0 hosts a TCPStore on a free port and tells the others through shmproxy.
    store = None
    if ctx.rank == 0:
        try:
            store = dist.TCPStore("127.0.0.1", 0, ctx.size, True, timeout=timeout, wait_for_workers=False)
            port = store.port
        except (RuntimeError, OSError) as exc:
            port, why = 0, f"rank 0 could not open a TCPStore on 127.0.0.1 ({exc})"
    port = int(bcast(ctx.comm, [port] if ctx.rank == 0 else None, 1)[0])
    if port == 0:
        return None, why or "rank 0 could not open a TCPStore on 127.0.0.1"
    if store is None:
        store = dist.TCPStore("127.0.0.1", port, ctx.size, False, timeout=timeout)
    dist.init_process_group("gloo", store=store, rank=ctx.rank, world_size=ctx.size, timeout=timeout)
    return GlooLib(torch, dist), ""


def _module_version(name: str) -> str | None:
    mod = sys.modules.get(name)
    if mod is None:
        try:
            from importlib.metadata import version
            return version(name)
        except Exception:                              # not installed: say so in the report
            return None
    return getattr(mod, "__version__", None)


def collect_environment(ctx: Ctx, libs: Sequence[Library]) -> dict[str, Any]:
    """Where and how the figures were taken (rank 0; reads the other ranks' affinity by pid)."""
    import proxy
    from proxy.affinity import format_cpu_list
    from proxy.bootstrap import detect

    def affinity(pid: int) -> str | None:
        try:
            return format_cpu_list(os.sched_getaffinity(pid))
        except OSError:
            return None
    return {
        "host": socket.gethostname(), "nproc": os.cpu_count(), "ranks": ctx.size,
        "launcher": detect().launcher,
        "rank_pids": ctx.pids, "rank_affinity": [affinity(p) for p in ctx.pids],
        "proxy_pid": ctx.comm._proxy_pid, "proxy_affinity": affinity(ctx.comm._proxy_pid),
        "python": sys.version, "platform": platform.platform(), "numpy": np.__version__,
        "shmproxy": proxy.__version__, "mpi4py": _module_version("mpi4py"), "torch": _module_version("torch"),
        "libraries": {lib.name: lib.version for lib in libs},
        "params": ctx.comm.params.as_dict(),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "command": list(getattr(sys, "orig_argv", sys.argv)),
    }


def _peers_arg(text: str) -> tuple[str, ...]:
    names = tuple(p.strip() for p in text.split(",") if p.strip())
    if names in ((), ("none",)):
        return ()
    bad = [p for p in names if p not in PEERS]
    if bad:
        raise argparse.ArgumentTypeError(f"unknown peer(s) {', '.join(bad)}; known: {', '.join(PEERS)}, none")
    return tuple(dict.fromkeys(names))


def make_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="shmproxy-bench",
        description="Benchmark shmproxy against mpi4py and torch gloo in the same run. Run it under a "
                    "launcher, e.g. `mpiexec -n 2 shmproxy-bench pingpong -b 8 -e 64M -f 4`.",
        epilog="Operations: " + "; ".join(f"{o.name}: {o.summary}" for o in OPERATIONS.values()))
    p.add_argument("op", choices=list(OPERATIONS), help="what to measure")
    p.add_argument("-b", "--minbytes", type=parse_size, help="smallest message (default per operation)")
    p.add_argument("-e", "--maxbytes", type=parse_size, help="largest message (K/M/G suffixes)")
    p.add_argument("-f", "--stepfactor", type=int, help="size multiplier between steps")
    p.add_argument("-n", "--iters", type=int, help="timed iterations (default: adapts to the size)")
    p.add_argument("-w", "--warmup-iters", type=int, help="warm-up iterations (default: adapts)")
    p.add_argument("-r", "--rounds", type=int, default=1,
                   help="split the iterations into this many slices, alternating between the libraries, "
                        "so that drift of a noisy host hits every library alike (timed sweeps only)")
    p.add_argument("--dtype", help="element type (default: uint8 for pingpong/post/idle, float32 otherwise)")
    p.add_argument("--op", dest="redop", choices=REDOPS,
                   help="reduction of allreduce, reduce, reduce_scatter, overlap (default: sum; avg needs a "
                        "float dtype)")
    p.add_argument("--in-place", action="store_true",
                   help="allreduce, allgather, reduce_scatter: in place (MPI_IN_PLACE semantics)")
    p.add_argument("--peers", type=_peers_arg,
                   help="comma-separated peers to compare with: mpi4py, gloo, or none "
                        "(default: both for pingpong/sendrecv/post, none for idle)")
    p.add_argument("--alloc", action=argparse.BooleanOptionalAction, default=True,
                   help="shmproxy buffers from comm.alloc (zero-copy) or plain numpy arrays (--no-alloc: "
                        "the staged path)")
    p.add_argument("--check", action=argparse.BooleanOptionalAction, default=True,
                   help="compare every received buffer with what was sent")
    p.add_argument("--group-size", type=int, default=GROUP_SIZE, help="posts per group for `post`")
    p.add_argument("--idle-seconds", type=float, default=10.0, help="measurement window for `idle`")
    p.add_argument("--json", metavar="FILE", help="write every figure and the environment here")
    p.add_argument("--plot", metavar="FILE.png", help="plot time and bandwidth against size (matplotlib)")
    p.add_argument("--progress", action=argparse.BooleanOptionalAction, default=None,
                   help="progress bar on rank 0's stderr (tqdm if installed; default: when stderr is a terminal)")
    p.add_argument("--inject-error", action="store_true", help=argparse.SUPPRESS)  # test hook, see top
    return p


def resolve(args: argparse.Namespace,
            parser: argparse.ArgumentParser) -> tuple[Operation, list[int], np.dtype]:
    """Fill the per-operation defaults in; parser.error (exit 2) on a bad combination."""
    op = OPERATIONS[args.op]
    lo_d, hi_d, f_d = op.default_sizes
    lo = args.minbytes if args.minbytes is not None else parse_size(lo_d)
    hi = args.maxbytes if args.maxbytes is not None else max(parse_size(hi_d), lo)
    try:
        sizes = size_sweep(lo, hi, args.stepfactor if args.stepfactor is not None else f_d)
        dtype = np.dtype(args.dtype or op.default_dtype)
    except (ValueError, TypeError) as exc:
        parser.error(str(exc))
    from proxy.ops import DTYPE_CODE, SUPPORTED_DTYPES
    if dtype.char not in DTYPE_CODE or dtype.kind == "b":
        parser.error(f"--dtype {dtype} is not supported; use one of {SUPPORTED_DTYPES} (bool excepted)")
    if args.iters is not None and args.iters < 1 or args.warmup_iters is not None and args.warmup_iters < 0:
        parser.error("-n must be at least 1 and -w at least 0")
    if args.rounds < 1:
        parser.error("--rounds must be at least 1")
    if args.rounds > 1 and op.measure not in RAW_TIMES:
        parser.error(f"--rounds applies to the timed sweeps ({', '.join(o.name for o in OPERATIONS.values() if o.measure in RAW_TIMES)}), not to {op.name}")
    if args.group_size < 1 or not args.idle_seconds > 0:
        parser.error("--group-size must be at least 1 and --idle-seconds positive")
    reductions = ", ".join(o.name for o in OPERATIONS.values() if o.reduces)
    if args.redop is not None and not op.reduces:
        parser.error(f"--op is the reduction of {reductions}; {op.name} has none")
    args.redop = args.redop or "sum"
    if args.redop == "avg" and dtype.kind not in "fc":
        parser.error(f"--op avg needs a floating or complex --dtype, not {dtype}")
    if args.in_place and not op.in_place_ok:
        parser.error("--in-place applies to "
                     + ", ".join(o.name for o in OPERATIONS.values() if o.in_place_ok))
    if not op.sized:
        sizes = [0]                                   # barrier: one row, no data
    if args.peers is None:
        args.peers = op.default_peers
    return op, sizes, dtype


def peer_unsupported(op: Operation, lib: Library, args: argparse.Namespace) -> str:
    """Why ``lib`` cannot run ``op`` as asked, known without trying ('' when it may)."""
    if op.reduces and lib.redop(args.redop) is None:
        what = "MPI defines no such op" if lib.name == "mpi4py" else "this torch.distributed has none"
        return f"{lib.name} has no {args.redop.upper()} reduction ({what})"
    if isinstance(lib, GlooLib) and op.name == "reduce_scatter":
        if args.in_place:
            return "torch.distributed has no in-place reduce_scatter (MPI_IN_PLACE: input in the output)"
        if lib.fn("reduce_scatter_single", "reduce_scatter_tensor", "_reduce_scatter_base") is None:
            return "this torch.distributed has no reduce_scatter_single / reduce_scatter_tensor"
    if isinstance(lib, GlooLib) and op.name == "allgather":
        if lib.fn("all_gather_single", "all_gather_into_tensor", "_all_gather_base") is None:
            return "this torch.distributed has no all_gather_single / all_gather_into_tensor"
    return ""


def probe(ctx: Ctx, op: Operation, lib: Library, dtype: np.dtype) -> str:
    """One call of ``op`` with ``lib`` at the smallest size (one element per block), on every rank;
    '' when it worked, else the error. Libraries refuse what they do not support (a dtype, an op)
    before they communicate, on every rank alike, so a refusal cannot leave a peer waiting."""
    n_send, n_recv, _count = op.shape(ctx.size, ctx.size, bool(ctx.args.in_place))
    send = np.array(op.fill(ctx.rank, n_send, dtype, ctx.args.redop))
    recv = np.zeros(n_recv, dtype)
    _prepare(ctx, op, lib, send, recv)
    try:
        made = op.calls[lib.name](ctx, lib, lib.wrap(send), lib.wrap(recv))
        if op.measure is measure_overlap:
            post, wait = made
            wait(post())
        else:
            made()
    except Exception as exc:                          # whatever the library raises: report it
        first = (str(exc).strip().splitlines() or [""])[0][:200]
        return f"{type(exc).__name__}: {first}"
    return ""


def op_notes(op: Operation, args: argparse.Namespace, names: Sequence[str]) -> list[str]:
    """The '#' lines that say how a collective or the overlap is measured."""
    if not op.probe:
        return []
    out = []
    what = [f"reduction {args.redop}"] if op.reduces else []
    what += [f"root {op.root}"] if op.root is not None else []
    what += ["in place" if args.in_place else "out of place"] if op.in_place_ok else []
    if op.sized:
        out.append(f"# {op.name}: {', '.join(what + [''])}size = max(send, recv) bytes of one rank, "
                   f"count = the call's count argument (nccl-tests); busbw = algbw x {op.bus_note}")
    else:
        out.append(f"# {op.name}: no data; time only")
    native = [lib for lib in names if lib in op.native_in_place]
    if native:
        out.append(f"# {', '.join(native)}: the call works in place on the receive tensor (no copy timed);"
                   f" its checked call gets the input copied in first")
    if op.measure is measure_overlap:
        out.append("# overlap (OSU osu_iallreduce): t_comm = Iallreduce+Wait alone; t_total = post, pure-Python"
                   " work for t_comm of wall time, Wait; t_comp = that work's time; a barrier after every"
                   " iteration; means over iterations and ranks; overlap = 100*max(0, 1-(t_total-t_comp)/t_comm)")
    out.append("# checked: one more call after the timed ones, against the expected result"
               + (" (off: --no-check)" if not args.check else ""))
    return out


def run_config(ctx: Ctx, op: Operation, sizes: list[int], dtype: np.dtype) -> dict[str, Any]:
    args = ctx.args
    return {"sizes": sizes, "dtype": dtype.name, "iters": args.iters, "warmup": args.warmup_iters,
            "rounds": args.rounds,
            "zero_copy": args.alloc, "check": args.check, "peers": list(args.peers),
            "group_size": args.group_size, "idle_seconds": args.idle_seconds,
            "redop": args.redop if op.reduces else None, "in_place": bool(args.in_place), "root": op.root,
            "inject_error": args.inject_error}


def _write_json(path: str, report: Mapping[str, Any]) -> None:
    """Write whole or not at all: a reader (or a kill) never sees half a file."""
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "w", encoding="utf-8") as f:
        f.write(dumps_report(report))
    os.replace(tmp, path)


def run(ctx: Ctx, op: Operation, sizes: list[int], dtype: np.dtype) -> int:
    """The whole benchmark on one rank; returns the exit status (the same on every rank)."""
    comm, args, is_root = ctx.comm, ctx.args, ctx.rank == 0
    say = (lambda *a: print(*a, flush=True)) if is_root else (lambda *a: None)
    pids = gather(comm, [os.getpid()])
    ctx.pids = [] if pids is None else [int(p) for p in pids[:, 0]]

    libs: list[Library] = [ShmproxyLib(comm, args.alloc)]
    skipped: dict[str, str] = {}
    for name in args.peers:
        lib, why = (open_mpi if name == "mpi4py" else open_gloo)(ctx)
        if not agree(comm, lib is not None):
            if lib is not None:
                lib.close()
            lib, why = None, why or "not available on every rank"
        if lib is not None and op.probe:             # can it do this operation as asked?
            why = peer_unsupported(op, lib, args)
            if not agree(comm, not why):
                why = why or "unsupported on another rank"
            elif not agree(comm, not (why := probe(ctx, op, lib, dtype))):
                why = f"a first {op.name} call failed: {why or 'on another rank'}"
            if why:
                lib.close()
                lib = None
        if lib is None:
            skipped[name] = why
            say(f"# {name} skipped: {why}")
        else:
            libs.append(lib)
    names = [lib.name for lib in libs]

    env = collect_environment(ctx, libs) if is_root else {}
    say(f"# shmproxy-bench {op.name}: {op.summary}")
    say(f"# {ctx.size} ranks on {env.get('host')} ({env.get('nproc')} CPUs; rank CPUs "
        f"{' | '.join(map(str, env.get('rank_affinity', [])))}, progress process CPUs "
        f"{env.get('proxy_affinity')}); "
        + ", ".join(f"{lib.name} {lib.version}" for lib in libs))
    if op.measure is measure_idle:
        say(f"# window {args.idle_seconds:g} s after {IDLE_SETTLE_S:g} s to settle; proxy = the progress"
            f" process (% of one core, voluntary wake-ups/s), waiting = the busiest rank blocked in recv")
    else:
        say(f"# shmproxy buffers: {'comm.alloc (zero-copy)' if args.alloc else 'numpy arrays (staged)'};"
            f" time = median over iterations, max over ranks; p99 likewise"
            + (f"; group = {args.group_size} posts" if op.measure is measure_post else ""))
    for line in op_notes(op, args, names):
        say(line)
    if args.rounds > 1:
        say(f"# rounds: each library's iterations ran as {args.rounds} interleaved slices ({' -> '.join(names)},"
            f" then again), each after its warm-up; the times of all slices are pooled")
    if ratio_note(op):
        say(ratio_note(op))
    for line in format_header(op, names):
        say(line)

    in_place = bool(args.in_place)
    shapes = [row_size(op, nbytes, ctx.size, in_place, dtype.itemsize) for nbytes in sizes]
    max_send, max_recv = max(sh[0] for sh in shapes), max(sh[1] for sh in shapes)
    recv_shape = (args.group_size, max_recv) if op.group_recv else max_recv
    bufs = {lib.name: (lib.array(max_send, dtype), lib.array(recv_shape, dtype)) for lib in libs}
    rows: list[dict[str, Any]] = []
    nf = len(op.fields)
    show = args.progress if args.progress is not None else sys.stderr.isatty()
    bar = Progress(len(shapes), op.name, enabled=bool(is_root and show))
    raw = RAW_TIMES.get(op.measure)
    for n_send, n_recv, count, nbytes in shapes:
        bar.step(f"{nbytes} B")
        iters = args.iters if args.iters is not None else default_iters(nbytes)
        warmup = args.warmup_iters if args.warmup_iters is not None else default_warmup(iters)
        if raw is not None:
            per_round = -(-iters // args.rounds)
            iters = per_round * args.rounds
        figures: dict[str, list[float]] = {}
        times: dict[str, list[float]] = {name: [] for name in names}
        checks = dict.fromkeys(names, 1.0)
        steal = {name: StealMeter() for name in names}
        for _ in range(args.rounds):
            for lib in libs:
                send_full, recv_full = bufs[lib.name]
                send, recv = send_full[:n_send], recv_full[..., :n_recv]
                np.copyto(send, op.fill(ctx.rank, n_send, dtype, args.redop))
                with steal[lib.name]:
                    if raw is None:
                        figures[lib.name] = op.measure(ctx, op, lib, send, recv, iters, warmup)
                    else:
                        times[lib.name] += raw(ctx, op, lib, send, recv, per_round, warmup)
                checks[lib.name] = min(checks[lib.name], _finish_check(ctx, op, lib, recv, count))
        mine: list[float] = []
        for name in names:
            mine += [*(figures[name] if raw is None else summarize(times[name], op.time_divisor)), checks[name]]
        table = gather(comm, mine)
        if table is None:
            continue
        results = {lib: reduce_result(op, table[:, i * (nf + 1):(i + 1) * (nf + 1)], nbytes, ctx.size,
                                      args.check)
                   for i, lib in enumerate(names)}
        for name in names:
            results[name]["steal_pct"] = steal[name].pct
        row = {"bytes": nbytes, "count": count, "dtype": dtype.name, "iters": iters,
               "warmup": warmup, "results": results, "ratio": ratios(op, results)}
        rows.append(row)
        say(format_row(op, row, names))
        if args.json:                                 # after every row: a run cut short keeps its rows
            _write_json(args.json, build_report(op, rows, names, skipped, run_config(ctx, op, sizes, dtype),
                                                env, complete=False))

    bar.close()
    status = 0.0
    if is_root:
        note = steal_note(rows, names)
        if note:
            say(note)
        report = build_report(op, rows, names, skipped, run_config(ctx, op, sizes, dtype), env)
        failed = sum(1 for row in rows for r in row["results"].values() if r["check"] == "FAIL")
        say("# checks: " + ("not run (--no-check)" if not args.check else
                            f"{failed} FAILED" if failed else "all passed"))
        if args.json:
            _write_json(args.json, report)
            say(f"# JSON written to {args.json}")
        if args.plot:
            say(plot_report(report, args.plot))
        status = 1.0 if failed else 0.0
    status = bcast(comm, [status] if is_root else None, 1)[0]
    for lib in libs[1:]:
        lib.close()
    return int(status)


class Progress:
    """A progress bar for long sweeps on rank 0's stderr: tqdm when installed (an optional extra),
    else one rewritten text line. Disabled, it does nothing."""

    def __init__(self, total: int, label: str, enabled: bool, stream: Any = None):
        self.total, self.label, self.enabled = total, label, enabled
        self.stream = stream or sys.stderr
        self.done = 0
        self._tqdm = None
        if enabled:
            try:
                from tqdm import tqdm
            except ImportError:
                tqdm = None
            if tqdm is not None:
                self._tqdm = tqdm(total=total, desc=label, file=self.stream, leave=False, unit="size")

    def step(self, what: str) -> None:
        """Called before each size: shows the size about to run and how many are done."""
        if not self.enabled:
            return
        if self._tqdm is not None:
            if self.done:
                self._tqdm.update(1)
            self._tqdm.set_postfix_str(what)
        else:
            # Cursor back to column 0 afterwards: the next table row overwrites the line.
            self.stream.write(f"\r# {self.label}: {self.done}/{self.total} sizes done, now {what}   \r")
            self.stream.flush()
        self.done += 1

    def close(self) -> None:
        if not self.enabled:
            return
        if self._tqdm is not None:
            self._tqdm.update(1)
            self._tqdm.close()
        else:
            self.stream.write(f"\r# {self.label}: {self.total}/{self.total} sizes done{' ' * 30}\n")
            self.stream.flush()


def main(argv: list[str] | None = None) -> int:
    parser = make_parser()
    args = parser.parse_args(argv)
    op, sizes, dtype = resolve(args, parser)

    import proxy
    from proxy.bootstrap import detect
    info = detect()
    if info.size < 2:
        print(f"shmproxy-bench: {op.name} needs at least 2 ranks (found {info.size}, launcher "
              f"{info.launcher}); run it under a launcher, e.g.\n"
              f"    mpiexec -n 2 shmproxy-bench {op.name}", file=sys.stderr)
        return 2
    with proxy.init() as comm:
        ctx = Ctx(comm, comm.rank, comm.size, args, inject_pending=args.inject_error)
        return run(ctx, op, sizes, dtype)


if __name__ == "__main__":
    sys.exit(main())
