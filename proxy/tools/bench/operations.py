"""The operation table: what each operation calls in each library, how it is checked and measured.

``OPERATIONS`` maps a name to an :class:`Operation`: one builder per library (the call to time), the
bus-bandwidth factor, a correctness check, and how it is measured (a timed loop, posting cost, overlap
or idle CPU). The sweep, timing, gathering, checking, table, JSON and plot are shared.

- point to point: pingpong, sendrecv, post, idle.
- collectives (``measure_coll``): allreduce, reduce (root 0), bcast (root 0), allgather, reduce_scatter
  (``Reduce_scatter_block``), alltoall, barrier. shmproxy: ``comm.Allreduce`` ...; mpi4py: the
  upper-case buffer calls of ``MPI.COMM_WORLD``; gloo: ``dist.all_reduce``, ``dist.reduce``,
  ``dist.broadcast``, ``dist.all_gather_single`` (or ``all_gather_into_tensor``),
  ``dist.reduce_scatter_single`` (or ``reduce_scatter_tensor``), ``dist.all_to_all_single``,
  ``dist.barrier`` on tensors made by ``torch.from_numpy`` over the same numpy buffers; nccl: the same
  torch calls on CUDA tensors, on a group of its own (``NcclLib``, ``--device cuda`` only).
  ``dist.all_reduce`` and ``dist.reduce`` work in place on their one tensor: gloo is timed on the
  receive buffer with no copy (its natural use), for out-of-place runs too.
- overlap (``measure_overlap``, the OSU osu_iallreduce method): see ``overlap.py``.

A peer that cannot run an operation as asked is skipped (``peers.py``).
"""
from __future__ import annotations

from typing import Any, Callable

import numpy as np

from shmproxy.tools.bench.calls import (
    BARRIERS, _allgather_gloo, _allgather_mpi, _allgather_shm, _allreduce_gloo, _allreduce_mpi,
    _allreduce_shm, _alltoall_gloo, _alltoall_mpi, _alltoall_shm, _bcast_gloo, _bcast_mpi, _bcast_shm,
    _iallreduce_gloo, _iallreduce_mpi, _iallreduce_shm, _pingpong, _place_block, _reduce_gloo, _reduce_mpi,
    _reduce_scatter_gloo, _reduce_scatter_mpi, _reduce_scatter_shm, _reduce_shm, _sendrecv)
from shmproxy.tools.bench.libraries import PEERS
from shmproxy.tools.bench.measure import measure_coll, measure_idle, measure_loop, measure_post
from shmproxy.tools.bench.operation import Builder, Column, Operation, _no_source
from shmproxy.tools.bench.overlap import _derive_overlap, measure_overlap
from shmproxy.tools.bench.patterns import (CheckSpec, verify_allgather, verify_allreduce, verify_alltoall,
                                           verify_bcast, verify_nothing, verify_reduce, verify_reduce_scatter)
from shmproxy.tools.bench.sizes import (bus_factor_allreduce, bus_factor_gather, bus_factor_one, shape_allgather,
                                        shape_alltoall, shape_none, shape_reduce_scatter)

SWEEP_COLUMNS = (Column("time", "us", "time_us"), Column("p99", "us", "p99_us"),
                 Column("algbw", "GB/s", "algbw_GBps"), Column("busbw", "GB/s", "busbw_GBps"))


def _collective(name: str, summary: str, calls: tuple[Builder, Builder, Builder],
                bus_factor: Callable[[int], float], bus_note: str,
                verify: Callable[[int, int, np.ndarray, CheckSpec], bool], **extra: Any) -> Operation:
    """A collective entry: timed by measure_coll, probed, checked by ``verify`` on every rank unless
    ``receives`` says otherwise."""
    extra.setdefault("receives", lambda r, n: True)
    columns = extra.pop("columns", SWEEP_COLUMNS)
    made = dict(zip(("shmproxy", "mpi4py", "gloo"), calls))
    made["shmproxy.MPI"] = made["mpi4py"]   # the same MPI calls, through shmproxy's own MPI layer
    made["nccl"] = made["gloo"]             # the same torch calls, on NcclLib's group (libraries.py)
    return Operation(name, summary, measure_coll, ("time_us", "p99_us"), columns, source=_no_source,
                     calls=made, bus_factor=bus_factor, bus_note=bus_note,
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
                verify_allreduce, reduces=True, in_place_ok=True,
                native_in_place=frozenset({"gloo", "nccl"})),
    _collective("reduce", "Reduce to root 0",
                (_reduce_shm, _reduce_mpi, _reduce_gloo), bus_factor_one, "1",
                verify_reduce, receives=lambda r, n: r == 0, reduces=True,
                native_in_place=frozenset({"gloo", "nccl"}), root=0),
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
                (BARRIERS["shmproxy"], BARRIERS["mpi4py"], BARRIERS["gloo"]), bus_factor_one, "-",
                verify_nothing, receives=lambda r, n: False, shape=shape_none, sized=False,
                columns=SWEEP_COLUMNS[:2], default_sizes=("8", "8", 2)),
    Operation(
        "overlap", "Iallreduce overlapped with pure-Python work (OSU method); overlap % per library",
        measure_overlap, ("t_comm_us", "t_compute_us", "t_total_us", "work_slowdown", "post_us", "wait_us"),
        (Column("t_comm", "us", "t_comm_us"), Column("t_comp", "us", "t_compute_us"),
         Column("t_total", "us", "t_total_us"), Column("slowdown", "x", "work_slowdown"),
         Column("post", "us", "post_us"), Column("wait", "us", "wait_us"), Column("overlap", "%", "overlap_pct")),
        source=_no_source, calls={"shmproxy": _iallreduce_shm, "mpi4py": _iallreduce_mpi,
                                  "gloo": _iallreduce_gloo, "shmproxy.MPI": _iallreduce_mpi},
        ratio_key=None, default_sizes=("64K", "16M", 4), bus_note="2(n-1)/n", verify=verify_allreduce,
        receives=lambda r, n: True, reduces=True, native_in_place=frozenset({"gloo"}), probe=True,
        derive=_derive_overlap, derived=("overlap_pct",)),
)}
