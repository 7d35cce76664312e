"""The buffer collectives of MPI.Comm under mpi4py's names and signatures (a mixin of comm.Comm).

Each one the engine runs natively (Barrier, Bcast, Reduce, Allreduce, Allgather, Alltoall,
Reduce_scatter_block, Reduce_scatter with counts, Gather, Scatter, Gatherv, Scatterv, Allgatherv,
Alltoallv, Scan, Exscan and their nonblocking forms) parses its buffer specs (a count in a spec is per
rank, as MPI's recvcount; a vector spec [buf, (counts, displs), datatype] gives each rank's block) and
calls the native collective. Arguments only the root reads are parsed on the root only. None where a
call takes MPI.IN_PLACE means IN_PLACE (mpi4py's rule); Alltoall(v) in place sends a copy of the
recvbuf, which is what MPI defines it to send. A reduction with an op or type the progress process
does not reduce is done by the ranks (localred.py), the nonblocking forms included. Alltoallw and
Ialltoallw travel as one byte Alltoallv (wcoll.py: each rank's datatype becomes byte runs). The
neighbour collectives need a topology (topology.py); on a plain communicator they raise
NotImplementedError naming themselves.

Barrier, Bcast, Reduce and Allreduce try a fast path first: plain arrays the buffer parser would hand
over as they are (buffers.FAST_DTYPES, C-contiguous, the receive side writable), IN_PLACE or None as
sendbuf, and a predefined op the progress process reduces go straight to the native call; anything
else takes the general path below, which gives the same result for those arguments.
"""
from __future__ import annotations

from typing import Any, NoReturn

import numpy as np

from shmproxy.core import errors
from shmproxy.core.ops import IN_PLACE
from shmproxy.mpi import buffers
from shmproxy.mpi.exceptions import ERR_COUNT, ERR_ROOT, as_int, convert, error, is_integral, unsupported
from shmproxy.mpi.ops import SUM, Op, as_op
from shmproxy.mpi import localred, typedcoll, wcoll
from shmproxy.mpi.request import Request
from shmproxy.rank.typed import TypedBuffer

_parse = buffers.parse
_ndarray = np.ndarray
_FAST = buffers.FAST_DTYPES
_MISSING = "neighbour collectives need a topology communicator (Create_cart, Create_graph, Create_dist_graph)"


def _send(spec: Any) -> Any:
    """mpi4py's rule: None where a collective takes IN_PLACE means IN_PLACE."""
    return IN_PLACE if spec is None else spec


def _copy_of(rb: Any, name: str) -> Any:
    if type(rb) is not np.ndarray:
        unsupported(f"{name} with IN_PLACE on a derived datatype")
    return rb.copy()


def _dtype_of(*specs: Any) -> Any:
    """The MPI datatype of the first buffer spec that is one, for a user op's third argument (the type
    it names, or its buffer's own; None where neither is known)."""
    for spec in specs:
        if spec is not None and spec is not IN_PLACE:
            return buffers.datatype_named(spec)
    return None


def _root(root: Any) -> int:
    """A root as the native layer takes it: an int (numpy integers, bools, ``__index__`` objects read
    as mpi4py reads them; the native layer checks the range)."""
    return root if type(root) is int else as_int(root, "root", ERR_ROOT)


def _fast_send(spec: Any) -> bool:
    """A sendbuf for the fast paths: IN_PLACE, None (IN_PLACE), or a plain array passed as it is."""
    if type(spec) is _ndarray:
        return spec.dtype in _FAST and spec.flags.c_contiguous
    return spec is IN_PLACE or spec is None


def _fast_recv(spec: Any) -> bool:
    """A recvbuf for the fast paths: a plain array passed as it is, writable."""
    if type(spec) is _ndarray and spec.dtype in _FAST:
        flags = spec.flags
        return flags.c_contiguous and flags.writeable
    return False


def _dtypes(bufs: tuple) -> str:
    return "/".join(sorted({str(b.dtype) for b in bufs if isinstance(b, np.ndarray)})) or "these buffers"


class Collectives:
    """Buffer collectives; ``self._c`` is the native communicator."""

    __slots__ = ()
    _c: Any

    def _call(self, fn: Any, *args: Any) -> Any:
        args = tuple(buffers.wire(a) for a in args)
        try:
            return fn(*args)
        except errors.ProxyError as exc:
            if any(type(a) is TypedBuffer for a in args):   # derived datatypes: nothing was posted
                return typedcoll.call(self._c, fn, args)
            raise convert(exc) from None

    # ---- barrier, broadcast
    def Barrier(self) -> None:
        try:
            self._c.Barrier()
        except errors.ProxyError as exc:
            raise convert(exc) from None

    def Ibarrier(self) -> Request:
        return Request(self._call(self._c.Ibarrier))

    def Bcast(self, buf: Any, root: int = 0) -> None:
        root = _root(root)
        if type(buf) is _ndarray and buf.dtype in _FAST:
            flags = buf.flags
            if flags.c_contiguous and flags.writeable:
                try:
                    self._c.Bcast(buf, root)
                    return
                except errors.ProxyError as exc:
                    raise convert(exc) from None
        self._call(self._c.Bcast, _parse(buf, "Bcast buffer", True), root)

    def Ibcast(self, buf: Any, root: int = 0) -> Request:
        return Request(self._call(self._c.Ibcast, _parse(buf, "Ibcast buffer", True), _root(root)))

    # ---- reductions
    def _reduce_args(self, name: str, sendbuf: Any, recvbuf: Any, op: Any) -> tuple:
        o = as_op(op, name)
        sb = _parse(_send(sendbuf), f"{name} sendbuf", False)
        rb = None if recvbuf is None else _parse(recvbuf, f"{name} recvbuf", True)
        return sb, rb, o

    def _native_op(self, o: Any, *bufs: Any) -> Any:
        """The native op, or None where the ranks reduce (localred.py)."""
        return o.native if not localred.needs_ranks(o, *bufs) else None

    def _local(self, fn: Any, *args: Any) -> Any:
        """Start a reduction the ranks fold (localred.py): the native-like request of it."""
        for a in args[:2]:
            if type(a) is TypedBuffer:
                unsupported("a reduction the ranks do (see localred.py) on a derived datatype")
        # 1-D views (a 0-d array of one element included): the reductions fold rows of elements
        args = tuple(a.reshape(-1) if type(a) is np.ndarray else a for a in args)
        try:
            return fn(self._c, *args)
        except errors.ProxyError as exc:
            raise convert(exc) from None

    def _finish(self, out: Any) -> None:
        """A blocking reduction's end: the ranks' fold, where they do it (the native call is done)."""
        if isinstance(out, localred.Folding):
            Request(out).Wait()

    def _reduce_call(self, name: str, sendbuf: Any, recvbuf: Any, op: Any, root: int) -> Any:
        root = _root(root)
        sb, rb, o = self._reduce_args(name, sendbuf, recvbuf, op)
        native = self._native_op(o, sb, rb if self._rooted(root) else None)
        if native is None:
            return self._local(localred.reduce, sb, rb, o, self._c._posting.check_root(root),
                               _dtype_of(recvbuf, sendbuf))
        return self._call(getattr(self._c, name), sb, rb, native, root)

    def Reduce(self, sendbuf: Any, recvbuf: Any, op: Any = SUM, root: int = 0) -> None:
        root = _root(root)
        if type(op) is Op and op.native is not None and _fast_send(sendbuf) and (
                recvbuf is None or _fast_recv(recvbuf)):
            try:
                self._c.Reduce(IN_PLACE if sendbuf is None else sendbuf, recvbuf, op.native, root)
                return
            except errors.ProxyError as exc:
                raise convert(exc) from None
        self._finish(self._reduce_call("Reduce", sendbuf, recvbuf, op, root))

    def Ireduce(self, sendbuf: Any, recvbuf: Any, op: Any = SUM, root: int = 0) -> Request:
        return Request(self._reduce_call("Ireduce", sendbuf, recvbuf, op, root))

    def _allreduce_call(self, name: str, sendbuf: Any, recvbuf: Any, op: Any) -> Any:
        sb, rb, o = self._reduce_args(name, sendbuf, recvbuf, op)
        native = self._native_op(o, sb, rb)
        if native is None:
            return self._local(localred.allreduce, sb, rb, o, _dtype_of(recvbuf, sendbuf))
        return self._call(getattr(self._c, name), sb, rb, native)

    def Allreduce(self, sendbuf: Any, recvbuf: Any, op: Any = SUM) -> None:
        # Small arrays between the ranks of one node: the C path's own checks first, which cost less
        # than the ones below (and accept exactly what they would pass: exact host ndarrays of a
        # native dtype, contiguous, recvbuf writable, same dtype and count)
        if type(op) is Op and op.native is not None:
            try:
                if self._c._pp.try_allreduce(sendbuf, recvbuf, op.native) is not NotImplemented:
                    return
            except errors.ProxyError as exc:
                raise convert(exc) from None
        # _fast_send and _fast_recv written out: the most frequent collective, spared two frames
        if type(op) is Op and type(recvbuf) is _ndarray and recvbuf.dtype in _FAST and (
                sendbuf is IN_PLACE or sendbuf is None
                or (type(sendbuf) is _ndarray and sendbuf.dtype in _FAST and sendbuf.flags.c_contiguous)):
            flags, native = recvbuf.flags, op.native
            if native is not None and flags.c_contiguous and flags.writeable:
                try:
                    self._c.Allreduce(IN_PLACE if sendbuf is None else sendbuf, recvbuf, native)
                    return
                except errors.ProxyError as exc:
                    raise convert(exc) from None
        self._finish(self._allreduce_call("Allreduce", sendbuf, recvbuf, op))

    def Iallreduce(self, sendbuf: Any, recvbuf: Any, op: Any = SUM) -> Request:
        return Request(self._allreduce_call("Iallreduce", sendbuf, recvbuf, op))

    def _rsb_args(self, name: str, sendbuf: Any, recvbuf: Any, op: Any) -> tuple:
        o = as_op(op, name)
        size = self._c.size
        sb = _parse(_send(sendbuf), f"{name} sendbuf", False, blocks=size)
        rb = _parse(recvbuf, f"{name} recvbuf", True, blocks=size if sb is IN_PLACE else 1)
        return sb, rb, o

    def _rsb_call(self, name: str, sendbuf: Any, recvbuf: Any, op: Any) -> Any:
        sb, rb, o = self._rsb_args(name, sendbuf, recvbuf, op)
        native = self._native_op(o, sb, rb)
        if native is None:
            size = self._c.size
            k = rb.size // size if sb is IN_PLACE else rb.size
            return self._local(localred.reduce_scatter, sb, rb, [k] * size, o, _dtype_of(recvbuf, sendbuf))
        return self._call(getattr(self._c, name), sb, rb, native)

    def Reduce_scatter_block(self, sendbuf: Any, recvbuf: Any, op: Any = SUM) -> None:
        self._finish(self._rsb_call("Reduce_scatter_block", sendbuf, recvbuf, op))

    def Ireduce_scatter_block(self, sendbuf: Any, recvbuf: Any, op: Any = SUM) -> Request:
        return Request(self._rsb_call("Ireduce_scatter_block", sendbuf, recvbuf, op))

    def _rs_args(self, name: str, sendbuf: Any, recvbuf: Any, recvcounts: Any, op: Any) -> tuple:
        o = as_op(op, name)
        size = self._c.size
        sb = _parse(_send(sendbuf), f"{name} sendbuf", False)
        rb = _parse(recvbuf, f"{name} recvbuf", True)
        if recvcounts is None:
            if sb is IN_PLACE:      # equal blocks of the recvbuf (the native rule)
                return sb, rb, None, o
            # mpi4py's rule: each rank's count is its recvbuf's size, which every rank learns (a
            # blocking exchange, also under Ireduce_scatter: every rank is in this call)
            mine = np.array([getattr(rb, "size", 0)], np.int64)
            every = np.empty(size, np.int64)
            self._call(self._c.Allgather, mine, every)
            return sb, rb, [int(c) for c in every], o
        try:
            counts = None if is_integral(recvcounts) else list(recvcounts)
        except TypeError:       # not a sequence: the error below
            counts = None
        if counts is None or len(counts) != size:
            raise error(ERR_COUNT, f"{name}: recvcounts must be a sequence of {size} counts, got "
                        f"{recvcounts!r}")
        counts = [buffers.as_count(c, "recvcount", name) for c in counts]
        if type(sb) is np.ndarray and sb.size != sum(counts):    # mpi4py's check: the spec's count is all
            raise error(ERR_COUNT, f"{name}: sendbuf has {sb.size} elements, the recvcounts add up to "
                        f"{sum(counts)}")
        return sb, rb, counts, o

    def _rs_call(self, name: str, sendbuf: Any, recvbuf: Any, recvcounts: Any, op: Any) -> Any:
        sb, rb, counts, o = self._rs_args(name, sendbuf, recvbuf, recvcounts, op)
        native = self._native_op(o, sb, rb)
        if native is None:
            if counts is None:
                counts = [rb.size // self._c.size] * self._c.size
            return self._local(localred.reduce_scatter, sb, rb, counts, o, _dtype_of(recvbuf, sendbuf))
        return self._call(getattr(self._c, name), sb, rb, counts, native)

    def Reduce_scatter(self, sendbuf: Any, recvbuf: Any, recvcounts: Any = None, op: Any = SUM) -> None:
        """recvcounts, when given, are every rank's block of the vector (packed in rank order)."""
        self._finish(self._rs_call("Reduce_scatter", sendbuf, recvbuf, recvcounts, op))

    def Ireduce_scatter(self, sendbuf: Any, recvbuf: Any, recvcounts: Any = None, op: Any = SUM) -> Request:
        return Request(self._rs_call("Ireduce_scatter", sendbuf, recvbuf, recvcounts, op))

    def _scan_args(self, name: str, sendbuf: Any, recvbuf: Any, op: Any) -> tuple:
        o = as_op(op, name)
        sb = _parse(_send(sendbuf), f"{name} sendbuf", False)
        rb = _parse(recvbuf, f"{name} recvbuf", True)
        return sb, rb, o

    def _scan(self, name: str, sendbuf: Any, recvbuf: Any, op: Any) -> Any:
        sb, rb, o = self._scan_args(name, sendbuf, recvbuf, op)
        native = self._native_op(o, sb, rb)
        if native is None:
            exclusive = name in ("Exscan", "Iexscan")
            return self._local(localred.scan, sb, rb, o, exclusive, _dtype_of(recvbuf, sendbuf))
        return self._call(getattr(self._c, name), sb, rb, native)

    def Scan(self, sendbuf: Any, recvbuf: Any, op: Any = SUM) -> None:
        self._finish(self._scan("Scan", sendbuf, recvbuf, op))

    def Iscan(self, sendbuf: Any, recvbuf: Any, op: Any = SUM) -> Request:
        return Request(self._scan("Iscan", sendbuf, recvbuf, op))

    def Exscan(self, sendbuf: Any, recvbuf: Any, op: Any = SUM) -> None:
        self._finish(self._scan("Exscan", sendbuf, recvbuf, op))

    def Iexscan(self, sendbuf: Any, recvbuf: Any, op: Any = SUM) -> Request:
        return Request(self._scan("Iexscan", sendbuf, recvbuf, op))

    # ---- data movement
    def _ag_args(self, name: str, sendbuf: Any, recvbuf: Any) -> tuple:
        return (_parse(_send(sendbuf), f"{name} sendbuf", False),
                _parse(recvbuf, f"{name} recvbuf", True, blocks=self._c.size))

    def Allgather(self, sendbuf: Any, recvbuf: Any) -> None:
        self._call(self._c.Allgather, *self._ag_args("Allgather", sendbuf, recvbuf))

    def Iallgather(self, sendbuf: Any, recvbuf: Any) -> Request:
        return Request(self._call(self._c.Iallgather, *self._ag_args("Iallgather", sendbuf, recvbuf)))

    def _a2a_args(self, name: str, sendbuf: Any, recvbuf: Any) -> tuple:
        size = self._c.size
        rb = _parse(recvbuf, f"{name} recvbuf", True, blocks=size)
        if _send(sendbuf) is IN_PLACE:   # MPI sends what the recvbuf holds: a copy, then in place
            return _copy_of(rb, name), rb
        return _parse(sendbuf, f"{name} sendbuf", False, blocks=size), rb

    def Alltoall(self, sendbuf: Any, recvbuf: Any) -> None:
        self._call(self._c.Alltoall, *self._a2a_args("Alltoall", sendbuf, recvbuf))

    def Ialltoall(self, sendbuf: Any, recvbuf: Any) -> Request:
        return Request(self._call(self._c.Ialltoall, *self._a2a_args("Ialltoall", sendbuf, recvbuf)))

    # ---- rooted and vector collectives
    def _rooted(self, root: int) -> bool:
        return self._c.rank == root

    def _gather_args(self, name: str, sendbuf: Any, recvbuf: Any, root: int) -> tuple:
        root = _root(root)
        sb = _parse(_send(sendbuf) if self._rooted(root) else sendbuf, f"{name} sendbuf", False)
        rb = _parse(recvbuf, f"{name} recvbuf", True, blocks=self._c.size) if self._rooted(root) else None
        return sb, rb, root

    def Gather(self, sendbuf: Any, recvbuf: Any, root: int = 0) -> None:
        self._call(self._c.Gather, *self._gather_args("Gather", sendbuf, recvbuf, root))

    def Igather(self, sendbuf: Any, recvbuf: Any, root: int = 0) -> Request:
        return Request(self._call(self._c.Igather, *self._gather_args("Igather", sendbuf, recvbuf, root)))

    def _scatter_args(self, name: str, sendbuf: Any, recvbuf: Any, root: int) -> tuple:
        root = _root(root)
        sb = _parse(sendbuf, f"{name} sendbuf", False, blocks=self._c.size) if self._rooted(root) else None
        rb = _send(recvbuf) if self._rooted(root) else recvbuf
        return sb, _parse(rb, f"{name} recvbuf", True), root

    def Scatter(self, sendbuf: Any, recvbuf: Any, root: int = 0) -> None:
        self._call(self._c.Scatter, *self._scatter_args("Scatter", sendbuf, recvbuf, root))

    def Iscatter(self, sendbuf: Any, recvbuf: Any, root: int = 0) -> Request:
        return Request(self._call(self._c.Iscatter, *self._scatter_args("Iscatter", sendbuf, recvbuf, root)))

    def _vector(self, spec: Any, what: str, writable: bool) -> tuple:
        """(array, counts, displs) of a vector spec in any of mpi4py's forms (buffers.parse_v), as the
        native layer takes them (a type it has no code for travels as bytes, counts and displacements
        scaled to them)."""
        v = buffers.parse_v(spec, what, writable, self._c.size)
        arr, counts, displs = v.array, list(v.counts), list(v.displs)
        if type(arr) is np.ndarray and buffers.wire(arr) is not arr:   # counted in bytes on the wire
            k = arr.dtype.itemsize
            arr, counts, displs = buffers.wire(arr), [c * k for c in counts], [x * k for x in displs]
        return arr, counts, displs

    def _gatherv_args(self, name: str, sendbuf: Any, recvbuf: Any, root: int) -> tuple:
        root = _root(root)
        sb = _parse(_send(sendbuf) if self._rooted(root) else sendbuf, f"{name} sendbuf", False)
        if self._rooted(root):
            rb, counts, displs = self._vector(recvbuf, f"{name} recvbuf", True)
            return sb, rb, counts, displs, root
        return sb, None, None, None, root

    def Gatherv(self, sendbuf: Any, recvbuf: Any, root: int = 0) -> None:
        self._call(self._c.Gatherv, *self._gatherv_args("Gatherv", sendbuf, recvbuf, root))

    def Igatherv(self, sendbuf: Any, recvbuf: Any, root: int = 0) -> Request:
        return Request(self._call(self._c.Igatherv, *self._gatherv_args("Igatherv", sendbuf, recvbuf, root)))

    def _scatterv_args(self, name: str, sendbuf: Any, recvbuf: Any, root: int) -> tuple:
        root = _root(root)
        rb = _parse(_send(recvbuf) if self._rooted(root) else recvbuf, f"{name} recvbuf", True)
        if self._rooted(root):
            sb, counts, displs = self._vector(sendbuf, f"{name} sendbuf", False)
            return sb, rb, counts, displs, root
        return None, rb, None, None, root

    def Scatterv(self, sendbuf: Any, recvbuf: Any, root: int = 0) -> None:
        self._call(self._c.Scatterv, *self._scatterv_args("Scatterv", sendbuf, recvbuf, root))

    def Iscatterv(self, sendbuf: Any, recvbuf: Any, root: int = 0) -> Request:
        args = self._scatterv_args("Iscatterv", sendbuf, recvbuf, root)
        return Request(self._call(self._c.Iscatterv, *args))

    def _allgatherv_args(self, name: str, sendbuf: Any, recvbuf: Any) -> tuple:
        sb = _parse(_send(sendbuf), f"{name} sendbuf", False)
        rb, counts, displs = self._vector(recvbuf, f"{name} recvbuf", True)
        return sb, rb, counts, displs

    def Allgatherv(self, sendbuf: Any, recvbuf: Any) -> None:
        self._call(self._c.Allgatherv, *self._allgatherv_args("Allgatherv", sendbuf, recvbuf))

    def Iallgatherv(self, sendbuf: Any, recvbuf: Any) -> Request:
        args = self._allgatherv_args("Iallgatherv", sendbuf, recvbuf)
        return Request(self._call(self._c.Iallgatherv, *args))

    def _alltoallv_args(self, name: str, sendbuf: Any, recvbuf: Any) -> tuple:
        rb, rc, rd = self._vector(recvbuf, f"{name} recvbuf", True)
        if _send(sendbuf) is IN_PLACE:   # what each block of the recvbuf holds goes out: a copy of it
            return _copy_of(rb, name), rc, rd, rb, rc, rd
        sb, sc, sd = self._vector(sendbuf, f"{name} sendbuf", False)
        return sb, sc, sd, rb, rc, rd

    def Alltoallv(self, sendbuf: Any, recvbuf: Any) -> None:
        self._call(self._c.Alltoallv, *self._alltoallv_args("Alltoallv", sendbuf, recvbuf))

    def Ialltoallv(self, sendbuf: Any, recvbuf: Any) -> Request:
        return Request(self._call(self._c.Ialltoallv, *self._alltoallv_args("Ialltoallv", sendbuf, recvbuf)))

    # ---- the w collective: per-rank counts, byte displacements and datatypes (wcoll.py), as bytes
    def _alltoallw(self, name: str, sendbuf: Any, recvbuf: Any) -> Any:
        if self.Is_inter():    # type: ignore[attr-defined]
            unsupported(f"Intercomm.{name}", "the w collectives run on intracommunicators")
        size = self._c.size
        p = wcoll.prepare(sendbuf, recvbuf, name, size, size, in_place=True)
        req = self._call(self._c.Ialltoallv, p.sbuf, p.scounts, p.sdispls, p.rbuf, p.rcounts, p.rdispls)
        return wcoll.wrap(req, p, list(range(size)))

    def Alltoallw(self, sendbuf: Any, recvbuf: Any) -> None:
        """Block j of sendbuf (sendcounts[j] x sendtypes[j] at byte sdispls[j]) to rank j; block i of
        recvbuf from rank i. IN_PLACE (or None) as sendbuf sends what the receive blocks hold."""
        Request(self._alltoallw("Alltoallw", sendbuf, recvbuf)).Wait()

    def Ialltoallw(self, sendbuf: Any, recvbuf: Any) -> Request:
        return Request(self._alltoallw("Ialltoallw", sendbuf, recvbuf))

    # ---- what the engine lacks
    def _missing(self, name: str) -> NoReturn:
        unsupported(f"Comm.{name}", _MISSING)

    def Neighbor_allgather(self, *a: Any, **k: Any) -> None:
        self._missing("Neighbor_allgather")

    def Neighbor_alltoall(self, *a: Any, **k: Any) -> None:
        self._missing("Neighbor_alltoall")

    def Neighbor_allgatherv(self, *a: Any, **k: Any) -> None:
        self._missing("Neighbor_allgatherv")

    def Neighbor_alltoallv(self, *a: Any, **k: Any) -> None:
        self._missing("Neighbor_alltoallv")

    def neighbor_allgather(self, *a: Any, **k: Any) -> list:
        self._missing("neighbor_allgather")

    def neighbor_alltoall(self, *a: Any, **k: Any) -> list:
        self._missing("neighbor_alltoall")
