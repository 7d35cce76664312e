"""shmproxy.MPI's error and handle model in real rank processes (bodies in tests/bodies_mpi_handles.py):
null handles raise their error class, predefined ones refuse Free, error handlers per communicator,
MPI.Exception as mpi4py's, user error classes and codes."""
from __future__ import annotations

import pytest

from tests.harness import run_ranks

BODY = "tests.bodies_mpi_handles:"


@pytest.mark.parametrize("body", ["null_handles", "errhandlers", "exceptions", "pickler", "objmodel", "subclasses",
                                  "topo_subclass"])
def test_error_and_handle_model(body):
    run_ranks(BODY + body, 2, timeout=120)
