"""Rank bodies for tests/test_dump_pending.py: hangs made on purpose, read with the outside dump."""
from __future__ import annotations

import subprocess
import sys
import time

import numpy as np

import shmproxy


def _dump_until(comm, needle: str, bound_s: float = 20.0) -> str:
    """The outside dump of our progress process (nothing prepared), read until it shows ``needle``."""
    deadline = time.monotonic() + bound_s
    text = ""
    while needle not in text and time.monotonic() < deadline:
        text = subprocess.run([sys.executable, "-m", "shmproxy.tools.dump_cli", "--pid", str(comm._proxy.pid),
                               "--outside"], capture_output=True, text=True, timeout=60).stdout
    return text


def near_match() -> dict:
    """Rank 0 sends tag 42 while rank 1 waits for tag 41: the dump names both and calls it a near-match.
    Then each side posts what the other sent, and both complete."""
    with shmproxy.init() as comm:
        big = 1 << 20
        if comm.rank == 0:
            s = comm.Isend(np.full(big, 1, np.uint8), 1, tag=42)
            text = _dump_until(comm, "near-match")
            comm.Send(np.zeros(4, np.uint8), 1, tag=41)
            s.Wait()
            return {"dump": text}
        comm.Recv(np.zeros(4, np.uint8), 0, tag=41)   # rank 0 sends it once it has read the dump
        comm.Recv(np.zeros(big, np.uint8), 0, tag=42)
        return {}


def unjoined_collective() -> dict:
    """Rank 0 enters a Barrier that rank 1 has not: the dump says so; then rank 0 lets rank 1 in."""
    with shmproxy.init() as comm:
        if comm.rank == 0:
            b = comm.Ibarrier()
            text = _dump_until(comm, "have not")
            comm.Send(np.zeros(1), 1, tag=5)
            b.Wait()
            return {"dump": text}
        comm.Recv(np.zeros(1), 0, tag=5)
        comm.Ibarrier().Wait()   # as rank 0's (a blocking Barrier does not match an Ibarrier)
        return {}
