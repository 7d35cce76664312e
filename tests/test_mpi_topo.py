"""shmproxy.MPI topologies, neighbour collectives and intercommunicators, end to end in real rank
processes (bodies in tests/bodies_mpi_topo.py), at 2 to 4 ranks: a periodic and a bounded ring, a 2-D
periodic grid (2x2 at four ranks, where both neighbours of a dimension are one rank), graphs, an
irregular weighted multigraph with self-loops, and an intercommunicator of two halves."""
from __future__ import annotations

import pytest

from tests.harness import run_ranks

BODY = "tests.bodies_mpi_topo:"


@pytest.mark.parametrize("nranks", [2, 3, 4])
def test_cartesian_neighbour_collectives(nranks):
    run_ranks(BODY + "cartesian", nranks, timeout=300)


@pytest.mark.parametrize("nranks", [2, 3])
def test_graph_and_dist_graph_topologies(nranks):
    run_ranks(BODY + "graphs", nranks, timeout=300)


@pytest.mark.parametrize("nranks", [2, 4])
def test_intercommunicator_of_two_halves(nranks):
    run_ranks(BODY + "intercomm", nranks, timeout=300)
