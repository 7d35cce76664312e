"""Attribute caching of shmproxy.MPI in real rank processes (bodies in tests/bodies_mpi_attributes.py):
keyvals, copy callbacks on every Dup, delete callbacks on Delete_attr, overwrite, Free and Finalize,
callback errors as mpi4py reports them, the predefined keys."""
from __future__ import annotations

import pytest

from tests.harness import run_ranks

BODY = "tests.bodies_mpi_attributes:"


@pytest.mark.parametrize("body", ["comm_attributes", "datatype_attributes", "self_attributes_at_finalize"])
def test_attribute_caching(body):
    run_ranks(BODY + body, 2, timeout=120)
