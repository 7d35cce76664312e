"""Fixtures shared by every test.

The autouse fixture ``leak_guard`` asserts that a test leaves nothing of shmproxy's behind (docs/architecture.md,
"Testing"): no new ``/dev/shm/shmproxy-*`` segment (nor ``cuda.shm.*``, the CUDA driver's files of
interprocess events, which shmproxy never makes), no new progress process (or other process of a shmproxy
job) started by this test session, no new ``*.sock`` or dump file in the run directories. Processes get
a short bounded grace period to exit (polled, never a bare sleep). What is left is then killed or
unlinked, so that one failing test does not cascade into the next, and the test fails (as an error at
teardown) with the list. The logic is
tests.harness.LeakGuard.

Nothing here changes os.environ: each harness run builds its ranks' environment itself.
"""
from __future__ import annotations

import sys
from pathlib import Path
from typing import Iterator

import pytest

# `tests.harness` must import under a bare `pytest` too (python -m pytest adds the cwd, pytest does not).
_REPO = str(Path(__file__).resolve().parents[1])
if _REPO not in sys.path:
    sys.path.insert(0, _REPO)

from tests.harness import LeakGuard  # noqa: E402
from tests.unit_helpers import pool  # noqa: E402,F401  (a fixture: test_pool.py, test_poster.py)


@pytest.fixture(autouse=True)
def leak_guard() -> Iterator[LeakGuard]:
    """Snapshot before the test; after it, fail if segments, sockets or processes were left behind."""
    guard = LeakGuard()
    guard.snapshot()
    yield guard
    leaks = guard.check()
    if leaks:
        pytest.fail("the test left shmproxy resources behind (now removed):\n  " + "\n  ".join(leaks),
                    pytrace=False)
