"""The ``Operation`` record (one entry of the operation table, ``operations.OPERATIONS``) and ``Ctx``,
what its calls see; ``row_size``: the sizes of one row of an operation.
"""
from __future__ import annotations

import argparse
import dataclasses
from typing import Any, Callable, Mapping

import numpy as np

from shmproxy.tools.bench.patterns import CheckSpec, pattern, reduction_input
from shmproxy.tools.bench.sizes import bus_factor_one, element_count, shape_same


@dataclasses.dataclass
class Ctx:
    """What the operations see: this rank, its communicator, the options."""

    comm: Any
    rank: int
    size: int
    args: argparse.Namespace
    inject_pending: bool = False
    pids: list[int] = dataclasses.field(default_factory=list)


Builder = Callable[[Ctx, Any, Any, Any], Any]
"""(ctx, library, send, recv) -> one iteration of the operation (None: this rank takes no part); for
``overlap``, a (post, wait) pair. ``send``/``recv`` are the library's own view of the buffers (a torch
tensor for gloo). The library is typed Any here: each builder takes its own Library subclass."""


@dataclasses.dataclass(frozen=True)
class Column:
    title: str
    unit: str
    key: str


def _no_source(rank: int, size: int) -> int | None:
    return None


@dataclasses.dataclass(frozen=True)
class Operation:
    name: str
    summary: str
    measure: Callable[..., list[float]]
    """measure(ctx, op, lib, send, recv, iters, warmup) -> this rank's figures (``fields``)."""
    fields: tuple[str, ...]
    """The per-rank figures ``measure`` returns (reduced with max over the ranks that took part)."""
    columns: tuple[Column, ...]
    source: Callable[[int, int], int | None]
    """(rank, size) -> the rank whose data this rank receives, None if it receives nothing."""
    calls: Mapping[str, Builder] = dataclasses.field(default_factory=dict)
    bus_factor: Callable[[int], float] = bus_factor_one
    time_divisor: float = 1.0
    ratio_key: str | None = "time_us"
    """Result key whose peer/shmproxy quotient is the ratio column (None: no ratio)."""
    default_dtype: str = "float32"
    default_sizes: tuple[str, str, int] = ("8", "64M", 4)
    default_peers: tuple[str, ...] = ("mpi4py", "gloo")   # shmproxy.MPI when asked for
    group_recv: bool = False
    """The receiver gets --group-size messages at once, each into its own row of the receive buffer."""
    check: Callable[[int, int, np.ndarray], bool] | None = None
    """(rank, size, received) -> data correct; default: equals ``pattern(source(rank, size))``."""
    # ---- collectives
    shape: Callable[[int, int, bool], tuple[int, int, int]] = shape_same
    """(elements of the requested size, ranks, in place) -> (send elements, receive elements, count
    argument); the row's size is max(send, receive) bytes (nccl-tests)."""
    verify: Callable[[int, int, np.ndarray, CheckSpec], bool] | None = None
    """(rank, size, receive buffer, spec) -> correct; replaces ``check``/``source`` when set."""
    receives: Callable[[int, int], bool] | None = None
    """(rank, size) -> this rank's receive buffer is checked (with ``verify``)."""
    reduces: bool = False
    """Takes --op; the inputs are ``reduction_input`` (else ``pattern``)."""
    in_place_ok: bool = False
    """--in-place applies."""
    native_in_place: frozenset[str] = frozenset()
    """Libraries whose call works in place on the receive buffer whatever --in-place says (gloo's
    all_reduce/reduce): their checked call gets the input copied into the receive buffer first."""
    place_input: Callable[[int, int, np.ndarray, np.ndarray], None] | None = None
    """(rank, size, send, recv): put the input where the in-place call reads it (default: recv = send)."""
    sized: bool = True
    """False: no data (barrier): one row of size 0, no bandwidth."""
    probe: bool = False
    """Try each peer once at the smallest size before the sweep; skip it (with the error) if it fails."""
    root: int | None = None
    bus_note: str = "1"
    derive: Callable[[dict[str, Any], np.ndarray], None] | None = None
    """(result, per-rank matrix) -> adds derived keys to a library's result (overlap's percentage)."""
    derived: tuple[str, ...] = ()

    def check_received(self, rank: int, size: int, recv: np.ndarray) -> bool:
        if self.check is not None:
            return self.check(rank, size, recv)
        src = self.source(rank, size)
        if src is None:
            return True
        return bool((recv == pattern(src, recv.shape[-1], recv.dtype)).all())

    def takes_data(self, rank: int, size: int) -> bool:
        """This rank's receive buffer is checked."""
        if self.receives is not None:
            return self.receives(rank, size)
        return self.source(rank, size) is not None

    def fill(self, rank: int, count: int, dtype: np.dtype, redop: str) -> np.ndarray:
        """This rank's input (send buffer) of ``count`` elements."""
        if self.reduces:
            return reduction_input(rank, count, dtype, redop)
        return pattern(rank, count, dtype)


def row_size(op: "Operation", nbytes: int, nranks: int, in_place: bool,
             itemsize: int) -> tuple[int, int, int, int]:
    """(send elements, receive elements, count argument, size in bytes) of one rank for a requested
    size of ``nbytes``: size = max(send, receive) bytes (nccl-tests), 0 for an operation without data."""
    n_send, n_recv, count = op.shape(element_count(nbytes, itemsize), nranks, in_place)
    return n_send, n_recv, count, (max(n_send, n_recv) * itemsize if op.sized else 0)
