"""shmproxy.MPI's partitioned point-to-point communication (MPI 4.0: Psend_init, Precv_init, Pready,
Parrived) in real rank processes: parts marked ready in any order arrive whole and in place, never
match a plain message of the same tag, and misuse is an error before anything is posted."""
from __future__ import annotations

import pytest

from tests.harness import run_ranks

BODY = "tests.bodies_mpi_partitioned:"


@pytest.mark.timeout(240)
@pytest.mark.parametrize("nranks,parts", [(1, 4), (3, 1), (3, 5)])
def test_parts_marked_ready_in_any_order_arrive_in_place(nranks: int, parts: int) -> None:
    run_ranks(BODY + "ring_out_of_order", nranks, timeout=180, args=(parts, 6))


@pytest.mark.timeout(240)
def test_misuse_is_an_error() -> None:
    run_ranks(BODY + "errors_before_anything_is_posted", 1, timeout=180)
