"""shmproxy.MPI intercommunicators end to end in real rank processes (bodies in
tests/bodies_mpi_intercomm.py), at 2, 3 and 4 ranks: world rank 1 alone against the others, so the
groups are of unequal size from 3 ranks on. Every collective (buffer, vector, reduction, object;
blocking and nonblocking; from every root of both groups), Dup, Split, Split_type, Create,
Create_from_groups, Compare and handles, each result checked against numpy."""
from __future__ import annotations

import pytest

from tests.harness import run_ranks

BODY = "tests.bodies_mpi_intercomm:"


@pytest.mark.parametrize("nranks", [2, 3, 4])
def test_rooted_collectives_from_every_root(nranks: int) -> None:
    run_ranks(BODY + "rooted", nranks, timeout=120)


@pytest.mark.parametrize("nranks", [2, 3, 4])
def test_all_to_all_collectives_and_reductions(nranks: int) -> None:
    run_ranks(BODY + "allcoll", nranks, timeout=120)


@pytest.mark.parametrize("nranks", [2, 3])
def test_sendrecv_between_the_groups(nranks: int) -> None:
    run_ranks(BODY + "p2p", nranks, timeout=120)


@pytest.mark.parametrize("nranks", [2, 3, 4])
def test_object_collectives(nranks: int) -> None:
    run_ranks(BODY + "objects", nranks, timeout=120)


@pytest.mark.parametrize("nranks", [2, 3, 4])
def test_new_intercommunicators(nranks: int) -> None:
    run_ranks(BODY + "communicators", nranks, timeout=120)
