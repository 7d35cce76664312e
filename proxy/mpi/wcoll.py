"""The "w" collectives' buffers (Alltoallw, Ialltoallw, Neighbor_alltoallw, Ineighbor_alltoallw):
per block a count, a displacement in *bytes* and a datatype of its own (MPI 4.0 sections 6.8, 8.6).

The engine moves one element type per collective, so a w collective travels as bytes: block i of
a side is ``counts[i]`` instances of ``types[i]`` at byte ``displs[i]`` of the buffer, i.e. a list
of byte runs (the type's block list repeated every extent, typemap.py), and its message is those
runs' bytes in type-map order, ``counts[i] * types[i].size`` of them. MPI requires the sender's and
the receiver's type signatures to match, so the packed bytes of one are the packed bytes of the
other and a byte Alltoallv (Neighbor_alltoallv) carries the collective. Where every block of a
side is one run (predefined types and dense derived ones, the common case) the byte view of the
caller's buffer goes to the native call as it is, with byte counts and displacements: no copy in
the rank. Otherwise the side is packed into (sends) or received into (receives) a contiguous
temporary, gathered or scattered here with numpy fancy indexing; receive blocks are scattered when
the collective completes (``Unpacking``, the request), and only the blocks that received something
(a neighbour collective's PROC_NULL edges leave theirs as they were).

MPI.BOTTOM as the buffer makes displacements (and derived types' displacements) absolute addresses,
as MPI defines: the runs are then read and written with ctypes.memmove at those addresses. This is
the one place where shmproxy.MPI addresses memory it was not handed as an object: the program gave
the addresses (from MPI.Get_address) and vouches for them, as it does with a C MPI.

Spec forms, as mpi4py's ``message_vector_w`` reads them: ``[buf, counts, displs, types]``,
``[buf, (counts, displs), types]``, ``[buf, types]`` (one instance of each type at byte 0);
counts and displs both None mean the same; BOTTOM needs both. Every check happens here, before the
collective is posted.
"""
from __future__ import annotations

import ctypes
from typing import Any, Callable, NamedTuple, Sequence

import numpy as np

from shmproxy.core import errors
from shmproxy.core.ops import IN_PLACE, AddressConstant
from shmproxy.mpi import buffers, foreign
from shmproxy.mpi.buffers import BOTTOM
from shmproxy.mpi.datatypes import Datatype
from shmproxy.mpi.exceptions import (ERR_ARG, ERR_BUFFER, ERR_TYPE, as_int, buffer_error, error, type_error,
                                     unsupported)
from shmproxy.mpi.membuf import dlpack_region
from shmproxy.mpi.typemap import Derived

_U8 = np.dtype(np.uint8)


class WSide(NamedTuple):
    """One side of a w collective: ``raw`` the uint8 view of the buffer (None with MPI.BOTTOM), and
    per block the byte ``runs`` (an (n, 2) array of start, length; starts are addresses with
    BOTTOM) and ``nbytes`` (the block's message bytes)."""
    raw: np.ndarray | None
    runs: tuple[np.ndarray, ...]
    nbytes: tuple[int, ...]

    @property
    def direct(self) -> bool:
        """Every block one run of the buffer: the native call can take the buffer itself."""
        return self.raw is not None and all(len(r) <= 1 for r in self.runs)

    def displs(self) -> list[int]:
        return [int(r[0, 0]) if len(r) else 0 for r in self.runs]


def _items(v: Any, n: int, what: str, name: str) -> list[Any]:
    if isinstance(v, (str, bytes)) or not hasattr(v, "__len__"):
        raise type_error(ERR_ARG, f"{what}: {name} must be a sequence of {n}, got {type(v).__name__}")
    items = list(v)
    if len(items) != n:
        raise error(ERR_ARG, f"{what}: expected {n} {name}, got {len(items)}")
    return items


def _datatype(t: Any, what: str) -> Datatype:
    if isinstance(t, str):
        return buffers._as_datatype(t, what)
    if not isinstance(t, Datatype):
        raise type_error(ERR_TYPE, f"{what}: expected an MPI.Datatype, got {type(t).__name__}")
    if type(t) is Derived:
        return t.usable(what)
    return t


def _runs(count: int, displ: int, d: Datatype, what: str) -> np.ndarray:
    """The byte runs of ``count`` instances of ``d`` from byte ``displ``."""
    if count == 0:
        return np.zeros((0, 2), np.int64)
    if type(d) is not Derived:
        if not d or d.dtype is None:
            raise error(ERR_TYPE, f"{what}: {d.name or 'DATATYPE_NULL'} cannot carry data")
        return np.array([[displ, count * d.size]], np.int64)
    if d.dense:
        return np.array([[displ, count * d.size]], np.int64) if d.size else np.zeros((0, 2), np.int64)
    b = d.blocks
    if not len(b):
        return np.zeros((0, 2), np.int64)
    starts = (displ + np.arange(count, dtype=np.int64)[:, None] * d.extent + b[:, 0][None, :]).reshape(-1)
    return np.stack([starts, np.tile(b[:, 1], count)], axis=1)


def parse_w(spec: Any, what: str, writable: bool, n: int) -> WSide:
    """A w collective's buffer spec of ``n`` blocks (see the module header)."""
    if not isinstance(spec, (list, tuple)):
        raise error(ERR_BUFFER, f"{what}: expected [buf, counts, displs, datatypes], [buf, (counts, displs), "
                    f"datatypes] or [buf, datatypes], got {type(spec).__name__}")
    if len(spec) == 2:
        buf, counts, displs, types = spec[0], None, None, spec[1]
    elif len(spec) == 3:
        pair = spec[1]
        if not isinstance(pair, (list, tuple)) or len(pair) != 2:
            raise error(ERR_BUFFER, f"{what}: the second item of [buf, (counts, displs), datatypes] must be "
                        "a (counts, displs) pair")
        buf, (counts, displs), types = spec[0], pair, spec[2]
    elif len(spec) == 4:
        buf, counts, displs, types = spec
    else:
        raise error(ERR_BUFFER, f"{what}: a w-collective buffer spec has 2 to 4 items, got {len(spec)}")
    bottom = buf is BOTTOM
    if bottom and (counts is None or displs is None):
        raise error(ERR_BUFFER, f"{what}: MPI.BOTTOM needs counts and displacements (addresses)")
    if (counts is None) != (displs is None):
        raise error(ERR_ARG, f"{what}: give both counts and displacements, or neither")
    if counts is None:
        cs, ds = [1] * n, [0] * n
    else:
        cs = [buffers.as_count(c, "count", what) for c in _items(counts, n, what, "counts")]
        ds = [as_int(x, f"{what}: displacement", ERR_ARG) for x in _items(displs, n, what, "displacements")]
    ts = [_datatype(t, what) for t in _items(types, n, what, "datatypes")]
    raw: np.ndarray | None = None
    if not bottom:
        if buf is None:
            raw = np.empty(0, _U8)
        else:
            arr = buffers._as_array(buf, writable, what)
            raw = arr.view(_U8) if arr.dtype != _U8 else arr
    runs = tuple(_runs(c, x, t, what) for c, x, t in zip(cs, ds, ts))
    if raw is not None:
        for i, r in enumerate(runs):
            if len(r) and (int(r[:, 0].min()) < 0 or int((r[:, 0] + r[:, 1]).max()) > raw.nbytes):
                raise error(ERR_BUFFER, f"{what}: block {i} ({cs[i]} x {ts[i].name} at byte {ds[i]}) reaches "
                            f"outside the buffer's {raw.nbytes} bytes")
    return WSide(raw, runs, tuple(c * t.size for c, t in zip(cs, ts)))


def _index(runs: Sequence[np.ndarray]) -> np.ndarray:
    """The byte offsets of ``runs``, in order (concatenated aranges)."""
    if not runs:
        return np.zeros(0, np.int64)
    r = np.concatenate(runs)
    if not len(r):
        return np.zeros(0, np.int64)
    lengths = r[:, 1]
    before = np.concatenate(([0], np.cumsum(lengths)[:-1]))
    return np.repeat(r[:, 0] - before, lengths) + np.arange(int(lengths.sum()), dtype=np.int64)


def _gather(side: WSide) -> np.ndarray:
    """The side's blocks packed, one after another (a copy)."""
    out = np.empty(sum(side.nbytes), _U8)
    if side.raw is not None:
        out[:] = side.raw[_index(side.runs)]
        return out
    at = out.ctypes.data
    for r in side.runs:
        for start, length in r.tolist():
            ctypes.memmove(at, start, length)
            at += length
    return out


def _scatter(side: WSide, packed: np.ndarray, blocks: Sequence[int]) -> None:
    """Write ``packed`` (every block of the side, one after another) into the blocks listed."""
    offs = np.concatenate(([0], np.cumsum(side.nbytes))).tolist()
    if side.raw is not None:
        chosen = [side.runs[i] for i in blocks]
        src = [np.arange(offs[i], offs[i + 1], dtype=np.int64) for i in blocks]
        side.raw[_index(chosen)] = packed[np.concatenate(src) if src else np.zeros(0, np.int64)]
        return
    base = packed.ctypes.data
    for i in blocks:
        at = base + offs[i]
        for start, length in side.runs[i].tolist():
            ctypes.memmove(start, at, length)
            at += length


class Unpacking:
    """A native-like request (a native one, or neighbor.py's rounds) whose completion runs ``after``
    once: the scatter of a packed receive side."""

    __slots__ = ("_req", "_after", "_keep")

    def __init__(self, req: Any, after: Callable[[], None], keep: tuple):
        self._req, self._keep = req, keep     # keep: the temporaries the operation reads and writes
        self._after: Callable[[], None] | None = after

    def _finish(self) -> None:
        after, self._after = self._after, None
        if after is not None:
            after()
            self._keep = ()

    def Wait(self) -> Any:
        self._req.Wait()
        self._finish()
        return self.status

    def Test(self) -> bool:
        if not self._req.Test():
            return False
        self._finish()
        return True

    @property
    def status(self) -> Any:
        return self._req.status

    @property
    def _comm(self) -> Any:     # for Waitany/Waitsome, which sleep on a request's communicator
        return self._req._comm

    def Cancel(self) -> None:
        raise errors.InvalidArgument("a collective cannot be cancelled")

    def describe(self) -> str:
        return f"{self._req.describe()}, then scattering datatypes"


class Prepared(NamedTuple):
    """Both sides as byte arrays with byte counts and displacements, and what to do once complete."""
    sbuf: np.ndarray
    scounts: list[int]
    sdispls: list[int]
    rbuf: np.ndarray
    rcounts: list[int]
    rdispls: list[int]
    finish: Callable[[list[int]], Callable[[], None] | None]


def prepare(sendspec: Any, recvspec: Any, what: str, nsend: int, nrecv: int, in_place: bool) -> Prepared:
    """Parse both sides (every error here, before anything is posted) and lay them out as bytes.
    ``finish(live)``, given the receive blocks that will be written, is the scatter to run at
    completion (None when the receive side is the caller's buffer itself)."""
    rside = parse_w(recvspec, f"{what} recvbuf", True, nrecv)
    if sendspec is IN_PLACE or sendspec is None:
        if not in_place:
            raise error(ERR_BUFFER, f"{what}: MPI.IN_PLACE is not allowed here")
        sb, sc = _gather(rside), list(rside.nbytes)     # what the receive blocks hold goes out
        sd = np.concatenate(([0], np.cumsum(sc)[:-1])).astype(np.int64).tolist() if sc else []
    else:
        sside = parse_w(sendspec, f"{what} sendbuf", False, nsend)
        sc = list(sside.nbytes)
        if sside.direct:
            sb, sd = sside.raw, sside.displs()     # type: ignore[assignment]
        else:
            sb = _gather(sside)
            sd = np.concatenate(([0], np.cumsum(sc)[:-1])).astype(np.int64).tolist() if sc else []
    rc = list(rside.nbytes)
    if rside.direct:
        assert rside.raw is not None
        return Prepared(sb, sc, sd, rside.raw, rc, rside.displs(), lambda live: None)
    temp = np.empty(sum(rc), _U8)
    rd = np.concatenate(([0], np.cumsum(rc)[:-1])).astype(np.int64).tolist() if rc else []

    def finish(live: list[int]) -> Callable[[], None]:
        return lambda: _scatter(rside, temp, live)
    return Prepared(sb, sc, sd, temp, rc, rd, finish)


def wrap(req: Any, prepared: Prepared, live: list[int]) -> Any:
    """The request of a posted w collective: ``req`` itself, or one that scatters at completion."""
    after = prepared.finish(live)
    if after is None:
        return req
    return Unpacking(req, after, (prepared.sbuf, prepared.rbuf))


def address_of(location: Any) -> int:
    """MPI.Get_address: the address of a buffer (the buffer protocol; DLPack and CUDA-array-interface
    objects over host memory), as the w collectives take them with MPI.BOTTOM. An address constant
    (BOTTOM, IN_PLACE) is its own address, as in C."""
    if isinstance(location, AddressConstant):
        return int(location)
    try:
        mv = memoryview(location)
    except TypeError:
        if not (hasattr(location, "__dlpack__") or hasattr(location, "__cuda_array_interface__")):
            raise
        return _foreign_address(location)
    return int(np.asarray(mv).__array_interface__["data"][0])


def _foreign_address(location: Any) -> int:
    if not hasattr(location, "__dlpack__"):        # the CUDA array interface (host memory)
        return int(foreign.as_array(location, "Get_address").__array_interface__["data"][0])
    # mpi4py's checks of the device pair, the capsule and the tensor, with its errors; the capsule
    # stays in dlpack_region's frame (an exception raised with it alive would keep the exporter's
    # tensor in a traceback: mpi4py's tests count references to it)
    address, _nbytes, _readonly, devtype, problem = dlpack_region(location)
    if problem is not None:
        raise buffer_error(f"Get_address: {problem}")
    host = (foreign._KDL_CPU, foreign._KDL_CUDA_HOST)
    if devtype not in host and not (devtype == foreign._KDL_CUDA and not foreign.on_device(location)):
        unsupported(f"Get_address of a buffer on DLPack device type {devtype}", "host memory only")
    return address
