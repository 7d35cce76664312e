"""Rank bodies for tests/test_faults.py: what a live job leaves in /dev/shm, a job killed whole, and
how fast each failure reaches the ranks. Each function runs in every rank of a real job
(tests/rankmain.py); return values travel back to the test as JSON.

Times are time.monotonic(): CLOCK_MONOTONIC is one clock for every process of the host, so a time
taken in one rank can be compared with one taken in another.
"""
from __future__ import annotations

import json
import os
import signal
import socket
import time

import numpy as np

import shmproxy


def _pool_prefix(comm: shmproxy.Comm) -> str:
    """The name every ops pool of this job starts with in /dev/shm (shm/segment.py, Segment.create, with
    the tag proxy/engine/progress.py gives it: the job key's first 8 digits)."""
    from shmproxy.shm.segment import NAME_PREFIX
    return f"{NAME_PREFIX}{comm._job_key[:8]}-"


def shm_while_live() -> dict:
    """After every rank returned from init and passed a Barrier, list what /dev/shm holds of this job's
    pools: none, the pool's name is gone the moment it is created."""
    with shmproxy.init() as comm:
        comm.Barrier()
        prefix = _pool_prefix(comm)
        names = sorted(n for n in os.listdir("/dev/shm") if n.startswith(prefix))
        pool = comm._seg.name.lstrip("/")
        comm.Barrier()      # nobody closes (and so unlinks anything) before every rank has looked
        return {"prefix": prefix, "pool": pool, "names": names}


def report_then_allreduce(addr: str, limit_s: float) -> None:
    """Tell the test (a datagram to ``addr``) this rank's pid, the progress process's and where the job's
    names live, then run Allreduce until the test SIGKILLs every process of the job (``limit_s``:
    a bound in case it never does)."""
    with shmproxy.init() as comm:
        comm.Barrier()
        msg = {"rank": comm.rank, "pid": os.getpid(), "proxy_pid": comm._proxy.pid,
               "prefix": _pool_prefix(comm), "socket": comm._path}
        with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as s:
            s.sendto(json.dumps(msg).encode(), addr)
        x = np.ones(1 << 12, np.float32)
        out = np.empty_like(x)
        deadline = time.monotonic() + limit_s
        while time.monotonic() < deadline:
            comm.Allreduce(x, out)
        raise AssertionError(f"not killed within {limit_s} s")


def join_while_the_last_rank_stays_away(limit_s: float) -> None:
    """Every rank but the last joins (init waits for the last one, whose pool is made by then); the
    last never does. The test SIGKILLs every process of the job meanwhile (``limit_s``: a bound in
    case it never does)."""
    rank, size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    if rank == size - 1:
        time.sleep(limit_s)
    else:
        with shmproxy.init(timeout=limit_s) as comm:
            comm.Barrier()
    raise AssertionError(f"not killed within {limit_s} s")


def join_and_report_socket() -> dict:
    """A plain start and close; returns the service socket's path (the test checks a stale one was
    replaced and is gone afterwards)."""
    with shmproxy.init() as comm:
        comm.Barrier()
        return {"socket": comm._path}


def peer_death_is_prompt(victim: int) -> dict:
    """The victim sends one message, then SIGKILLs itself; the others, waiting in Recv on it, measure
    how long PeerDiedError took from just before their Recv."""
    with shmproxy.init() as comm:
        comm.Barrier()
        if comm.rank == victim:
            for r in range(comm.size):
                if r != victim:
                    comm.Ssend(np.zeros(1), r, tag=7)   # received (a buffered Send could complete first)
            os.kill(os.getpid(), signal.SIGKILL)
        comm.Recv(np.zeros(1), victim, tag=7)      # the victim is in and about to die
        t0 = time.monotonic()
        try:
            comm.Recv(np.zeros(8), victim, tag=8)
        except shmproxy.PeerDiedError as e:
            return {"seconds": time.monotonic() - t0, "message": str(e)}
        raise AssertionError("Recv from a dead rank returned")


def readonly_recv_is_refused_at_once() -> dict:
    """Receiving into a read-only buffer from a peer that never sends raises InvalidArgument before
    anything is posted, so at once; posted, it would wait for the whole TIMEOUT."""
    with shmproxy.init() as comm:
        ro = np.frombuffer(b"x" * 32, np.float32)
        t0 = time.monotonic()
        try:
            comm.Recv(ro, (comm.rank + 1) % comm.size, tag=31)
        except shmproxy.InvalidArgument as e:
            seconds = time.monotonic() - t0
            assert "read-only" in str(e), str(e)
        else:
            raise AssertionError("Recv into a read-only buffer returned")
        comm.Barrier()      # and the communicator is still usable
        return {"seconds": seconds}


def timeout_then_abort_are_prompt(wait_s: float) -> dict:
    """Rank 0 waits ``wait_s`` on a message nobody sends (Timeout), then aborts; every other rank,
    waiting in Recv on rank 0, raises Aborted. Rank 0 returns how long its Wait took and when it
    aborted; the others when they raised."""
    with shmproxy.init() as comm:
        comm.Barrier()      # every rank has joined before rank 0 aborts
        if comm.rank == 0:
            t0 = time.monotonic()
            try:
                comm.Irecv(np.zeros(1), 1, tag=9).Wait(timeout=wait_s)
            except shmproxy.Timeout:
                waited = time.monotonic() - t0
            else:
                raise AssertionError("no Timeout")
            t_abort = time.monotonic()
            comm.Abort("faults test over")
            return {"waited": waited, "t_abort": t_abort}
        try:
            comm.Recv(np.zeros(1), 0, tag=1)
        except shmproxy.Aborted as e:
            return {"t_raised": time.monotonic(), "message": str(e)}
        raise AssertionError("no Aborted")


def progress_process_crashes() -> dict:
    """Rank 0 sends the progress process SIGSEGV (what a crash in its C code raises) while every rank
    waits: each rank's error quotes its fault handler's report, and local rank 0, its parent, names
    the signal that killed it."""
    with shmproxy.init() as comm:
        comm.Barrier()
        if comm.rank == 0:
            os.kill(comm._proxy.pid, signal.SIGSEGV)
        t0 = time.monotonic()
        try:
            comm.Recv(np.zeros(8), (comm.rank + 1) % comm.size, tag=1)
        except shmproxy.PeerDiedError as exc:
            return {"message": str(exc), "seconds": time.monotonic() - t0}
        raise AssertionError("Recv after the progress process crashed returned")
