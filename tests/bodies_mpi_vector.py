"""Rank bodies of the vector-collective tests (tests/test_mpi_vector.py): Gatherv, Scatterv, Allgatherv,
Alltoallv and their nonblocking forms under every vector-spec form mpi4py reads, checked against numpy.

A case (drawn by hypothesis in the pytest process) names the collective, the datatype, the root, and
for each vector side its spec form, per-rank counts and displacements (consistent with the form: a
form with one count needs equal counts, one with a stride equally spaced blocks, ...). Every rank
builds the same deterministic inputs from the case, so each one knows what every block must hold.
Receive buffers start filled with a sentinel, and the whole buffer is compared: a block MPI should
have written but did not, or an element outside every block that was written, both show.
"""
from __future__ import annotations

from typing import Any

import numpy as np

from shmproxy import MPI

SENTINEL = -1
# spec forms of a vector side (tests/test_mpi_vector.py draws counts and displs to fit each)
GENERAL = ("four", "pair", "arrays")                  # any counts and displs
PACKED = ("counts", "pair_none", "four_none")         # any counts, blocks one after another
UNIFORM = ("count_type", "count_only", "scalar_pair", "np_scalar_pair")  # one count for every rank
SPLIT = ("plain", "typed")                            # counts from the buffer's size, split evenly
FORMS = GENERAL + PACKED + UNIFORM + SPLIT


def vspec(form: str, buf: np.ndarray, counts: list[int], displs: list[int], mtype: Any) -> Any:
    """The spec of ``buf`` in ``form`` that means these counts and displacements."""
    c = counts[0] if counts else 0
    stride = displs[1] - displs[0] if len(displs) > 1 else c
    return {
        "four": lambda: [buf, counts, displs, mtype],
        "four_none": lambda: [buf, tuple(counts), None, mtype],
        "pair": lambda: [buf, (counts, displs), mtype],
        "arrays": lambda: [buf, (np.array(counts, np.int32), np.array(displs, np.int64)), mtype],
        "counts": lambda: [buf, counts, mtype],
        "pair_none": lambda: [buf, (counts, None), mtype],
        "count_type": lambda: [buf, c, mtype],
        "count_only": lambda: [buf, c],
        "scalar_pair": lambda: [buf, (c, stride), mtype],
        "np_scalar_pair": lambda: [buf, (np.int64(c), np.intc(stride)), mtype],
        "plain": lambda: buf,
        "typed": lambda: [buf, mtype],
    }[form]()


def _values(i: int, src: int, dst: int, n: int, dtype: str) -> np.ndarray:
    """What rank ``src`` sends to rank ``dst`` in case ``i``: small distinct non-negative numbers."""
    return ((np.arange(n) + 7 * src + 3 * dst + i) % 90 + 1).astype(dtype)


def _side(side: dict, dtype: str) -> np.ndarray:
    """A buffer of the side's size, every element the sentinel."""
    return np.full(side["size"], SENTINEL, dtype)


def _check(case: dict, got: np.ndarray, want: np.ndarray, what: str, failures: list[str]) -> None:
    if not np.array_equal(got, want):
        failures.append(f"case {case['i']} {case['coll']} {what}: got {got.tolist()} want {want.tolist()} "
                        f"({case})")


def run_case(comm: Any, case: dict, failures: list[str]) -> None:
    rank, size = comm.Get_rank(), comm.Get_size()
    coll, dtype, root, i = case["coll"], case["dtype"], case["root"] % size, case["i"]
    mtype = getattr(MPI, case["mpitype"])
    name = coll[1:].capitalize() if coll.startswith("I") else coll     # Iallgatherv: Allgatherv
    start = getattr(comm, coll)

    def call(*args: Any) -> None:
        out = start(*args)
        if coll.startswith("I"):
            out.Wait()

    if name == "Gatherv" or name == "Allgatherv":
        v = case["v"]                       # the receiving side: one block per source rank
        counts, displs = v["counts"], v["displs"]
        mine = counts[rank]
        sendbuf = _values(i, rank, 0, mine, dtype)
        if case["send_form"] == "typed":
            sendbuf = [sendbuf, mtype]
        rooted = name == "Gatherv"
        rb = _side(v, dtype)
        recvbuf = vspec(v["form"], rb, counts, displs, mtype) if not rooted or rank == root else None
        if rooted:
            call(sendbuf, recvbuf, root)
        else:
            call(sendbuf, recvbuf)
        if not rooted or rank == root:
            want = _side(v, dtype)
            for r in range(size):
                want[displs[r]:displs[r] + counts[r]] = _values(i, r, 0, counts[r], dtype)
            _check(case, rb, want, "recvbuf", failures)
    elif name == "Scatterv":
        v = case["v"]                       # the sending side, on the root
        counts, displs = v["counts"], v["displs"]
        sb = _side(v, dtype)
        for r in range(size):
            sb[displs[r]:displs[r] + counts[r]] = _values(i, root, r, counts[r], dtype)
        sendbuf = vspec(v["form"], sb, counts, displs, mtype) if rank == root else None
        extra = case["recv_pad"]
        rb = np.full(counts[rank] + extra, SENTINEL, dtype)
        recvbuf = [rb, counts[rank], mtype] if extra else rb
        call(sendbuf, recvbuf, root)
        want = np.full(counts[rank] + extra, SENTINEL, dtype)
        want[:counts[rank]] = _values(i, root, rank, counts[rank], dtype)
        _check(case, rb, want, "recvbuf", failures)
    else:                                   # Alltoallv: rank r's row is what it sends
        s, r_ = case["send"][rank], case["recv"][rank]
        sb = _side(s, dtype)
        for d in range(size):
            n, x = s["counts"][d], s["displs"][d]
            sb[x:x + n] = _values(i, rank, d, n, dtype)
        rb = _side(r_, dtype)
        call(vspec(s["form"], sb, s["counts"], s["displs"], mtype),
             vspec(r_["form"], rb, r_["counts"], r_["displs"], mtype))
        want = _side(r_, dtype)
        for src in range(size):
            n, x = r_["counts"][src], r_["displs"][src]
            want[x:x + n] = _values(i, src, rank, n, dtype)
        _check(case, rb, want, "recvbuf", failures)


def run_cases(cases: list[dict]) -> dict:
    """Every case in turn (all ranks in the same order). Wrong values are collected and the cases go
    on; an exception ends the loop at once (the other ranks may be inside the collective, which then
    fails them by the runtime's timeout), reported with its case."""
    comm = MPI.COMM_WORLD
    failures: list[str] = []
    done = 0
    for case in cases:
        try:
            run_case(comm, case, failures)
        except (MPI.Exception, ValueError, TypeError) as exc:
            raise AssertionError(f"case {case['i']} {case['coll']}: {type(exc).__name__}: {exc} "
                                 f"({case}); {len(failures)} wrong results before it: {failures[:3]}"
                                 ) from exc
        done += 1
    comm.Barrier()
    MPI.Finalize()
    return {"failures": failures, "ncases": done}
