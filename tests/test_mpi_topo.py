"""shmproxy.MPI topologies, neighbour collectives and intercommunicators, end to end in real rank
processes (bodies in tests/bodies_mpi_topo.py), at 2 to 4 ranks: a periodic and a bounded ring, a 2-D
periodic grid (2x2 at four ranks, where both neighbours of a dimension are one rank), graphs, an
irregular weighted multigraph with self-loops, and an intercommunicator of two halves; at 1 to 4 ranks,
grids and graphs of fewer processes than ranks in mpi4py's argument forms, Cart_map/Graph_map, and
the w collectives (Alltoallw with mixed and derived datatypes, IN_PLACE and MPI.BOTTOM;
Neighbor_alltoallw on grids with PROC_NULL edges and on a graph of fewer nodes)."""
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


@pytest.mark.parametrize("nranks", [1, 2, 3, 4])
def test_topologies_in_mpi4py_forms(nranks):
    run_ranks(BODY + "topo_forms", nranks, timeout=300)


@pytest.mark.parametrize("nranks", [1, 2, 3, 4])
def test_alltoallw_mixed_datatypes(nranks):
    run_ranks(BODY + "alltoallw", nranks, timeout=300)


@pytest.mark.parametrize("nranks", [1, 2, 3, 4])
def test_neighbor_alltoallw(nranks):
    run_ranks(BODY + "neighbor_alltoallw", nranks, timeout=300)
