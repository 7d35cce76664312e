"""What the parts of a Comm share, declared in one place.

A Comm is its public calls (comm.py) over two parts, its lifecycle (lifecycle.py: it starts or
finds the progress process, attaches to the ops pool and sets everything below) and its posting
(posting.py: checks, buffers, the record a post fills), and a component, its waiter (waiting.py:
the futex sleep, the free records and slots and the pending requests, state it owns). The two
parts share one object, the communicator, so that a post is one attribute read away from the pool.
What they share is declared here with its type, and the calls one part makes into another are
abstract methods here, so that mypy checks each part against the other and a reader sees, in one
page, what a part may touch.
"""
from __future__ import annotations

import abc
import subprocess
from typing import Any

from shmproxy.control.client import ServiceClient
from shmproxy.control.protocol import MsgType
from shmproxy.core import errors, params as params_mod
from shmproxy.rank.buffers import Registry, StagingCache
from shmproxy.rank.request import Request
from shmproxy.rank.waiting import Waiter
from shmproxy.shm import pool as P
from shmproxy.shm.segment import Segment


class CommState(abc.ABC):
    """The communicator's state (set by Lifecycle._create and _attach_pool) and its parts' calls."""

    # who this rank is, and what the communicator was made with
    rank: int
    size: int
    local_rank: int
    local_size: int
    params: params_mod.Params
    node_layout: dict | None        # the nodes' layout, when the communicator spans nodes
    parent_ranks: list[int]         # a Split child's ranks in its parent
    _timeout: float
    _job_key: str
    _comm_id: int
    _nchildren: int                 # Splits made so far: a child's id depends on it
    _split_layout: Any              # where a Split child across nodes gets its layout (rank/splitting.py)
    _path: str                      # the service socket
    _closed: bool
    _failure: errors.ProxyError | None

    # the progress process and the service
    _proc: subprocess.Popen | None  # local rank 0 started it
    _proxy_pid: int
    _pidfd: int
    _fault_fd: int                  # where its fatal-signal stacks go
    _client: ServiceClient | None

    # the ops pool, mapped (_attach_pool)
    _seg: Segment | None
    _view: P.PoolView | None
    _layout: P.Layout
    _q: memoryview                  # the pool as uint64 words
    _i32: memoryview
    _u32: memoryview
    _abort_q: int                   # word indices of the control block's abort and error words,
    _err_q: int
    _posted_q: int                  # and of this rank's posted word
    _waiter: Waiter                 # waiting, and the records, slots and pending requests (waiting.py)
    _pp: Any                        # the C poster (shm/_poster.c)
    _registry: Registry
    _arena_held: bool   # registered the numpy arena (shmproxy.rank.arena) and holds its handler
    _staging: StagingCache

    # lifecycle.py
    @abc.abstractmethod
    def _check_usable(self) -> None: ...

    @abc.abstractmethod
    def _record_failure(self) -> errors.ProxyError: ...

    @abc.abstractmethod
    def _set_failure(self, exc: errors.ProxyError) -> None: ...

    @abc.abstractmethod
    def _failed_now(self) -> bool: ...

    @abc.abstractmethod
    def _proxy_dead(self, wait_s: float = 0.0) -> bool: ...

    @abc.abstractmethod
    def _deadline(self, timeout: float | None) -> float: ...

    @abc.abstractmethod
    def _control(self, msg: MsgType, payload: dict, fds: tuple = ()) -> dict: ...

    # posting.py
    @abc.abstractmethod
    def _cancel(self, req: Request) -> bool: ...

    # comm.py
    @abc.abstractmethod
    def _bind_entries(self, seg_addr: int, layout: P.Layout) -> None: ...

    @abc.abstractmethod
    def _bind_arena(self) -> None: ...

    @abc.abstractmethod
    def Barrier(self) -> None: ...
