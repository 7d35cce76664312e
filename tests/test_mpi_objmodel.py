"""shmproxy.MPI's handle objects as mpi4py's, in real rank processes (bodies in
tests/bodies_mpi_objmodel.py): no hashing, weak references, handle numbers, safe free() of second
handles, subclasses that pickle as themselves, and Win/File/Session as real classes of null handles
whose operations say what shmproxy does not provide (mpi4py's test_objmodel and test_msgspec), and
mpi4py's per-communicator lock table (test_p2p_obj's testCommLock)."""
from __future__ import annotations

import pytest

from tests.harness import run_ranks

BODY = "tests.bodies_mpi_objmodel:"


@pytest.mark.parametrize("body", ["handle_model", "unprovided", "comm_lock_table", "dlpack_bytes"])
def test_objmodel(body: str) -> None:
    run_ranks(BODY + body, 3, timeout=120)
