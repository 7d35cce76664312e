"""Rank bodies for tests/test_interrupt.py."""
from __future__ import annotations

import os
import signal
import threading

import numpy as np

import shmproxy


def ctrl_c_in_a_loop() -> None:
    """A Ctrl-C as mpiexec delivers it, in the middle of a stream of Allreduces: the progress process's
    group hears it first (here: the progress process alone), every rank's a moment later. Rank 0's
    timer thread sends both, so that the main threads are inside their waits.

    The rank takes Python's own SIGINT handler first: a test run started in the background of a
    non-interactive shell inherits SIGINT ignored (POSIX, for asynchronous commands), and Python then
    leaves it ignored, so the ranks would run their loop to its end instead of being interrupted."""
    signal.signal(signal.SIGINT, signal.default_int_handler)
    with shmproxy.init() as comm:
        pids = np.zeros(comm.size, np.int64)
        comm.Allgather(np.array([os.getpid()], np.int64), pids)
        x, y = np.ones(1000), np.zeros(1000)

        def interrupt() -> None:
            os.kill(comm._proxy.pid, signal.SIGINT)
            threading.Event().wait(0.2)   # the lag between two groups' signals
            for pid in pids:
                os.killpg(int(pid), signal.SIGINT)   # each rank leads its own session (the harness)

        for i in range(10 ** 7):
            if i == 50 and comm.rank == 0:
                threading.Thread(target=interrupt, daemon=True).start()
            comm.Allreduce(x, y)
