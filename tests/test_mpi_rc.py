"""shmproxy.rc (mpi4py's runtime configuration) and the thread model of shmproxy.MPI, in real rank
processes (bodies in tests/bodies_mpi_rc.py)."""
from __future__ import annotations

import pytest

from tests.harness import run_ranks

BODY = "tests.bodies_mpi_rc:"


@pytest.mark.parametrize("body", ["options_before_first_use", "init_from_a_thread", "no_threads_and_bad_values"])
def test_runtime_configuration_and_threads(body):
    run_ranks(BODY + body, 2, timeout=120)
