"""Derived datatypes, flattened: every constructor yields a block list the progress process copies by.

A derived type is kept as its *block list*: (byte displacement, byte length) pairs in type-map order
(the order the bytes travel), adjacent pairs merged, zero-length ones dropped, with MPI's bounds (lb,
ub: the extent that successive instances are apart) and true bounds (where the bytes really are).
Constructors compute the list from their old types' lists with numpy (no per-element Python loop);
``Commit`` only marks the type usable. Nothing here moves message bytes: a buffer spec with a derived
type becomes a ``TypedBuffer`` (the region of the user's memory the type's instances touch, from the
true lower bound), and the rank registers the block list with each communicator's progress process
once (shmproxy.rank.typed), which gathers and scatters the bytes (shmproxy.shm.typed).

A type whose list is one block at 0 of its whole extent (a contiguous type of a predefined one, a
struct without gaps) is *dense*: its buffers become plain numpy views and take the ordinary path.

Type signatures are checked as the native layer checks dtypes: a type built from one predefined type
travels with that type's dtype code, one mixing types as bytes (uint8); sender and receiver must agree
on that code and the receive must hold the message's bytes. Negative extents are refused (ERR_TYPE),
and so is a region that reaches outside the buffer object (this layer never addresses memory
outside the object it was given: MPI.BOTTOM with absolute addresses is not supported).
"""
from __future__ import annotations

import itertools
from typing import Any, Sequence

import numpy as np

from shmproxy.core.ops import DTYPE_CODE
from shmproxy.mpi import attributes
from shmproxy.mpi.datatypes import _STATE, DATATYPE_NULL, Datatype
from shmproxy.mpi.exceptions import ERR_ARG, ERR_BUFFER, ERR_COUNT, ERR_TYPE, as_int, error
from shmproxy.rank.typed import TypedBuffer

COMBINER_CONTIGUOUS, COMBINER_VECTOR, COMBINER_HVECTOR = 2, 3, 4
COMBINER_INDEXED, COMBINER_HINDEXED, COMBINER_INDEXED_BLOCK = 5, 6, 7
COMBINER_HINDEXED_BLOCK, COMBINER_STRUCT, COMBINER_SUBARRAY = 8, 9, 10
COMBINER_DARRAY, COMBINER_RESIZED, COMBINER_DUP = 11, 12, 13
ORDER_C, ORDER_FORTRAN = 0, 1

_EMPTY = np.zeros((0, 2), np.int64)
_serial = itertools.count(1)


class Derived(Datatype):
    """A derived MPI datatype (see the module header). ``dtype`` is None: it never passes for a
    predefined type; ``base`` is the one predefined numpy dtype it is made of, or None (mixed)."""

    __slots__ = ("blocks", "lb", "ub", "true_lb", "true_ub", "base", "align", "comb", "_contents",
                 "committed", "freed", "key")
    # slots here, read-only properties in Datatype (a predefined type's bounds follow from its size)
    lb: int
    ub: int
    true_lb: int
    true_ub: int

    def _setup(self, blocks: np.ndarray, lb: int, ub: int, true_lb: int, true_ub: int, base: Any,
               align: int, combiner: int, contents: tuple) -> None:
        self._sym, self._label, self.dtype, self._pair, self._h = "DERIVED", "", None, None, self
        self.blocks = _merge(blocks)
        self.size = int(self.blocks[:, 1].sum())
        self.lb, self.ub, self.true_lb, self.true_ub = int(lb), int(ub), int(true_lb), int(true_ub)
        if not self.size:
            self.true_lb = self.true_ub = 0 if not len(self.blocks) else self.true_lb
        self.base, self.align, self.comb, self._contents = base, align, combiner, contents
        self.committed = self.freed = False
        self.key = next(_serial)

    # ---- queries
    def Get_extent(self) -> tuple[int, int]:
        return self.lb, self.ub - self.lb

    def Get_true_extent(self) -> tuple[int, int]:
        return self.true_lb, self.true_ub - self.true_lb

    @property
    def extent(self) -> int:
        return self.ub - self.lb

    @property
    def is_predefined(self) -> bool:
        return False

    @property
    def is_named(self) -> bool:
        return False

    @property
    def combiner(self) -> int:   # type: ignore[override]
        return self.comb

    def Get_envelope(self) -> tuple[int, int, int, int, int]:
        ints, addrs, types = self._contents
        return len(ints), len(addrs), 0, len(types), self.comb

    def Get_contents(self) -> tuple[list[int], list[int], list[int], list[Datatype]]:
        """As MPI_Type_get_contents: a derived type among the old types comes back as a new handle
        (the caller frees it), a named one as itself."""
        ints, addrs, types = self._contents
        # predefined handles (named ones, and F90 types, which MPI never frees) come back as themselves
        olds = [t if t.is_named or t.is_predefined else t._newhandle() for t in types]
        return list(ints), list(addrs), [], olds

    def decode(self) -> tuple[Datatype, str, dict]:
        from shmproxy.mpi.dtintro import decode
        return decode(self)

    def tocode(self) -> str:
        if self.comb == COMBINER_DUP:
            return self._contents[2][0].tocode()
        raise error(ERR_TYPE, "a derived datatype has no type code")

    @property
    def typechar(self) -> str:   # type: ignore[override]
        if self.comb == COMBINER_DUP:
            return self._contents[2][0].typechar
        return "V"

    @property
    def typestr(self) -> str:   # type: ignore[override]
        if self.comb == COMBINER_DUP:
            return self._contents[2][0].typestr
        return f"V{self.extent}"

    def _copy(self, cls: type | None = None) -> "Derived":
        """A second Python object of this handle (MPI.Datatype(d)): equal to it."""
        new: Derived = object.__new__(Derived if cls is None else cls)
        for slot in _STATE + Derived.__slots__:
            setattr(new, slot, getattr(self, slot))
        return new

    def _newhandle(self) -> "Derived":
        """A new handle of the same type (Get_contents' old types): freeing one leaves the other."""
        d = _new(self.blocks, self.lb, self.ub, self.true_lb, self.true_ub, self.base, self.align, self.comb,
                 self._contents)
        d.committed, d._label = self.committed, self._label
        return d

    @property
    def dense(self) -> bool:
        """True when instances are plain bytes back to back: the ordinary (contiguous) path applies."""
        b = self.blocks
        return self.lb == 0 and self.ub == self.size and (len(b) == 0 or (len(b) == 1 and b[0, 0] == 0))

    def table(self) -> np.ndarray:
        """The block list relative to the true lower bound (what the progress process registers)."""
        t = self.blocks.copy()
        t[:, 0] -= self.true_lb
        return t

    @property
    def code(self) -> int:
        return DTYPE_CODE[(self.base if self.base is not None else np.dtype(np.uint8)).char]

    def Commit(self) -> "Derived":
        # a negative extent commits, as in MPI (mpi4py's tests commit one); a message refuses it (usable)
        self._check_live("Commit")
        self.committed = True
        return self

    def Free(self) -> None:
        self._check_live("Free")
        attributes.free_all(self._h, self, "Datatype.Free")
        self.freed = True
        self._h = DATATYPE_NULL     # as mpi4py's Free: this handle is the null handle now

    def Dup(self) -> "Derived":
        self._check_live("Dup")
        return dup(self)

    Create_dup = Dup

    def _check_live(self, what: str) -> None:
        if self.freed:
            raise error(ERR_TYPE, f"Datatype.{what}: the datatype was freed")

    def usable(self, what: str) -> "Derived":
        self._check_live(what)
        if not self.committed:
            raise error(ERR_TYPE, f"{what}: the derived datatype is not committed (call Commit first)")
        if self.extent < 0:
            raise error(ERR_TYPE, f"{what}: a datatype of negative extent {self.extent} cannot be used here")
        return self

    def __repr__(self) -> str:
        return (f"<shmproxy.MPI derived datatype: {len(self.blocks)} blocks, size {self.size}, "
                f"extent {self.extent}>")

    def __reduce__(self) -> Any:   # type: ignore[override]
        """Pickles as its constructor call (decode), so that the copy is built the same way."""
        from shmproxy.mpi.dtintro import rebuild
        old, comb, kwargs = self.decode()
        return rebuild, (old, comb, kwargs, self.committed)


def _new(blocks: np.ndarray, lb: int, ub: int, tlb: int, tub: int, base: Any, align: int, comb: int,
         contents: tuple) -> Derived:
    d = object.__new__(Derived)
    d._setup(blocks, lb, ub, tlb, tub, base, align, comb, contents)
    return d


def _merge(blocks: np.ndarray) -> np.ndarray:
    """Drop empty blocks and merge each block with the next when the next starts where it ends."""
    b = np.asarray(blocks, np.int64).reshape(-1, 2)
    b = b[b[:, 1] > 0]
    if len(b) < 2:
        return np.ascontiguousarray(b)
    ends = b[:, 0] + b[:, 1]
    starts = np.flatnonzero(np.concatenate(([True], b[1:, 0] != ends[:-1])))
    lengths = np.add.reduceat(b[:, 1], starts)
    return np.ascontiguousarray(np.stack([b[starts, 0], lengths], axis=1))


def _parts(t: Any) -> tuple[np.ndarray, int, int, int, int, Any, int]:
    """(blocks, lb, ub, true_lb, true_ub, base dtype, alignment) of a predefined or derived type."""
    if isinstance(t, Derived):
        t._check_live("a constructor")
        return t.blocks, t.lb, t.ub, t.true_lb, t.true_ub, t.base, t.align
    if not isinstance(t, Datatype):
        raise error(ERR_TYPE, f"expected an MPI.Datatype, got {type(t).__name__}")
    dt = t.dtype
    if dt is None or t._pair is not None or dt.char not in DTYPE_CODE:
        if dt is None:
            raise error(ERR_TYPE, f"{t.name} cannot be part of a derived datatype")
        # a pair type or long double: its bytes, as a type of mixed elements
        n = dt.itemsize
        return np.array([[0, n]], np.int64), 0, n, 0, n, None, dt.alignment
    n = dt.itemsize
    return np.array([[0, n]], np.int64), 0, n, 0, n, dt, (n // 2 if dt.kind == "c" else n)


def _replicate(t: Any, offsets: np.ndarray) -> tuple[np.ndarray, int, int, int, int, Any, int]:
    """``t`` placed at each byte offset in turn: its blocks and the bounds of the whole."""
    tb, lb, ub, tlb, tub, base, align = _parts(t)
    offsets = np.asarray(offsets, np.int64).reshape(-1)
    if not len(offsets):
        return _EMPTY, 0, 0, 0, 0, base, align
    d = (offsets[:, None] + tb[None, :, 0]).reshape(-1)
    ln = np.broadcast_to(tb[:, 1], (len(offsets), len(tb))).reshape(-1)
    lo, hi = int(offsets.min()), int(offsets.max())
    return np.stack([d, ln], axis=1), lo + lb, hi + ub, lo + tlb, hi + tub, base, align


def _ints(v: Sequence[Any] | np.ndarray, what: str, nonneg: bool = True) -> np.ndarray:
    if isinstance(v, np.ndarray) and v.dtype.kind in "iu":
        a = v.astype(np.int64).reshape(-1)
    else:      # each item read as mpi4py reads an integer (no floats, no strings)
        a = np.array([as_int(x, what, ERR_COUNT if nonneg else ERR_ARG) for x in v], np.int64)
    if nonneg and (a < 0).any():
        raise error(ERR_COUNT if nonneg else ERR_ARG, f"{what}: negative value in {list(v)!r}")
    return a


def _count(v: Any, what: str) -> int:
    n = as_int(v, what, ERR_COUNT)
    if n < 0:
        raise error(ERR_COUNT, f"{what}: expected a non-negative int, got {v!r}")
    return n


def _from(parts: tuple[np.ndarray, int, int, int, int, Any, int], comb: int, contents: tuple) -> Derived:
    return _new(*parts, comb, contents)


def _extent(t: Any) -> int:
    p = _parts(t)
    return p[2] - p[1]


def hvector(t: Any, count: int, bl: int, stride: int, comb: int = COMBINER_HVECTOR,
            contents: tuple | None = None) -> Derived:
    count, bl = _count(count, "count"), _count(bl, "blocklength")
    stride = as_int(stride, "stride")
    ext = _extent(t)
    tb, lb, ub, tlb, tub, base, align = _parts(t)
    if (len(tb) == 1 and tb[0, 0] == 0 and tb[0, 1] == ext and lb == 0 and stride == bl * ext
            and count * bl):   # dense pieces back to back: one block, whatever the count
        n = count * bl * ext
        return _new(np.array([[0, n]], np.int64), 0, n, 0, n, base, align, comb,
                    contents or ((count, bl), (stride,), (t,)))
    offs = (np.arange(count, dtype=np.int64)[:, None] * stride
            + np.arange(bl, dtype=np.int64)[None, :] * ext)
    return _from(_replicate(t, offs), comb, contents or ((count, bl), (stride,), (t,)))


def contiguous(t: Any, count: int) -> Derived:
    count = _count(count, "count")
    return hvector(t, count, 1, _extent(t), COMBINER_CONTIGUOUS, ((count,), (), (t,)))


def vector(t: Any, count: int, bl: int, stride: int) -> Derived:
    stride = as_int(stride, "stride")
    return hvector(t, count, bl, stride * _extent(t), COMBINER_VECTOR,
                   ((_count(count, "count"), _count(bl, "blocklength"), stride), (), (t,)))


def hindexed(t: Any, bls: Sequence[int] | np.ndarray, displs: Sequence[int] | np.ndarray,
             comb: int = COMBINER_HINDEXED,
             contents: tuple | None = None) -> Derived:
    b, d = _ints(bls, "blocklengths"), _ints(displs, "displacements", nonneg=False)
    if len(b) != len(d):
        raise error(ERR_ARG, f"{len(b)} blocklengths for {len(d)} displacements")
    ext = _extent(t)
    offs = (np.concatenate([x + np.arange(n, dtype=np.int64) * ext for x, n in zip(d, b)])
            if len(b) else np.zeros(0, np.int64))
    return _from(_replicate(t, offs), comb, contents or ((len(b), *b.tolist()), tuple(d.tolist()), (t,)))


def indexed(t: Any, bls: Sequence[int], displs: Sequence[int]) -> Derived:
    d = _ints(displs, "displacements", nonneg=False)
    b = _ints(bls, "blocklengths")
    return hindexed(t, b, d * _extent(t), COMBINER_INDEXED, ((len(b), *b.tolist(), *d.tolist()), (), (t,)))


def indexed_block(t: Any, bl: int, displs: Sequence[int], hbytes: bool = False) -> Derived:
    d = _ints(displs, "displacements", nonneg=False)
    bl = _count(bl, "blocklength")
    scale = 1 if hbytes else _extent(t)
    comb = COMBINER_HINDEXED_BLOCK if hbytes else COMBINER_INDEXED_BLOCK
    contents = ((len(d), bl), tuple(d.tolist()), (t,)) if hbytes else ((len(d), bl, *d.tolist()), (), (t,))
    return hindexed(t, [bl] * len(d), d * scale, comb, contents)


def struct(bls: Sequence[int], displs: Sequence[int], types: Sequence[Any]) -> Derived:
    b, d = _ints(bls, "blocklengths"), _ints(displs, "displacements", nonneg=False)
    types = list(types)
    if not len(b) == len(d) == len(types):
        raise error(ERR_ARG, f"Create_struct: {len(b)} blocklengths, {len(d)} displacements, "
                    f"{len(types)} types")
    pieces, lbs, ubs, tlbs, tubs, bases, align = [], [], [], [], [], set(), 1
    for n, x, t in zip(b, d, types):
        p = _parts(t)
        offs = x + np.arange(n, dtype=np.int64) * (p[2] - p[1])
        blocks, lb, ub, tlb, tub, base, al = _replicate(t, offs)
        bases.add(base)
        align = max(align, al)
        if n:
            pieces.append(blocks)
            lbs.append(lb)
            ubs.append(ub)
            tlbs.append(tlb)
            tubs.append(tub)
    blocks = np.concatenate(pieces) if pieces else _EMPTY
    lb, ub = (min(lbs), max(ubs)) if lbs else (0, 0)
    ub = lb + -(-(ub - lb) // align) * align   # MPI pads a struct's extent to its strictest alignment
    base = bases.pop() if len(bases) == 1 else None
    return _new(blocks, lb, ub, min(tlbs) if tlbs else 0, max(tubs) if tubs else 0, base, align,
                COMBINER_STRUCT, ((len(b), *b.tolist()), tuple(d.tolist()), tuple(types)))


def subarray(t: Any, sizes: Sequence[int], subsizes: Sequence[int], starts: Sequence[int],
             order: int = ORDER_C) -> Derived:
    sz, sub, st = _ints(sizes, "sizes"), _ints(subsizes, "subsizes"), _ints(starts, "starts")
    if not len(sz) == len(sub) == len(st) or not len(sz):
        raise error(ERR_ARG, "Create_subarray: sizes, subsizes and starts need one entry per dimension")
    if (st + sub > sz).any():
        raise error(ERR_ARG, f"Create_subarray: subarray {sub.tolist()} at {st.tolist()} does not fit "
                    f"the array {sz.tolist()}")
    if order not in (ORDER_C, ORDER_FORTRAN):
        raise error(ERR_ARG, f"Create_subarray: order must be ORDER_C or ORDER_FORTRAN, got {order!r}")
    ext = _extent(t)
    shape = tuple(sz.tolist()) if order == ORDER_C else tuple(sz.tolist())[::-1]
    lo = st if order == ORDER_C else st[::-1]
    hi = (st + sub) if order == ORDER_C else (st + sub)[::-1]
    index = np.arange(int(np.prod(sz)), dtype=np.int64).reshape(shape)
    elems = index[tuple(slice(int(a), int(b)) for a, b in zip(lo, hi))].reshape(-1)
    blocks, _lb, _ub, tlb, tub, base, align = _replicate(t, elems * ext)
    p = _parts(t)
    return _new(blocks, p[1], p[1] + int(np.prod(sz)) * ext, tlb, tub, base, align, COMBINER_SUBARRAY,
                ((len(sz), *sz.tolist(), *sub.tolist(), *st.tolist(), order), (), (t,)))


def dup(t: Any) -> Derived:
    blocks, lb, ub, tlb, tub, base, align = _parts(t)
    d = _new(blocks, lb, ub, tlb, tub, base, align, COMBINER_DUP, ((), (), (t,)))
    d.committed = True if t.is_predefined else t.committed
    return d


def darray(t: Any, size: int, rank: int, gsizes: Sequence[int], distribs: Sequence[int],
           dargs: Sequence[int], psizes: Sequence[int], order: int = ORDER_C) -> Derived:
    """This rank's part of a block/cyclic distributed array (MPI_Type_create_darray)."""
    from shmproxy.mpi.dtintro import darray_elements
    g = _ints(gsizes, "gsizes")
    size, rank, order = _count(size, "size"), _count(rank, "rank"), as_int(order, "order")
    distribs, dargs = _ints(distribs, "distribs", False).tolist(), _ints(dargs, "dargs", False).tolist()
    psizes = _ints(psizes, "psizes").tolist()
    elems = darray_elements(size, rank, g.tolist(), distribs, dargs, psizes, order)
    ext = _extent(t)
    blocks, _lb, _ub, tlb, tub, base, align = _replicate(t, elems * ext)
    p = _parts(t)
    nd = len(g)
    return _new(blocks, p[1], p[1] + int(np.prod(g)) * ext, tlb, tub, base, align, COMBINER_DARRAY,
                ((size, rank, nd, *g.tolist(), *distribs, *dargs, *psizes, order), (), (t,)))


def resized(t: Any, lb: int, extent: int) -> Derived:
    lb, extent = as_int(lb, "Create_resized: lb"), as_int(extent, "Create_resized: extent")
    blocks, _lb, _ub, tlb, tub, base, align = _parts(t)
    return _new(blocks, lb, lb + extent, tlb, tub, base, align, COMBINER_RESIZED,
                ((), (lb, extent), (t,)))


def typed_buffer(arr: np.ndarray, d: Derived, count: Any, displ: Any, what: str, out: bool = False) -> Any:
    """The buffer ``[arr, (count, displ), d]`` (arr: 1-D contiguous): a plain numpy view when ``d`` is
    dense, else a TypedBuffer over the region its instances touch, checked to lie inside ``arr``."""
    d.usable(what)
    raw = arr.view(np.uint8) if arr.dtype != np.uint8 else arr
    ext = d.extent
    start = 0 if displ is None else _count(displ, "displacement") * ext
    if count is None:
        count = (raw.nbytes - start) // ext if ext > 0 else 1
    count = _count(count, "count")
    if d.dense:
        n = count * d.size
        if start + n > raw.nbytes:
            raise error(ERR_COUNT, f"{what}: {count} x {d.size} B from byte {start} do not fit the "
                        f"buffer's {raw.nbytes} B")
        view = raw[start:start + n]
        return view.view(d.base) if d.base is not None and n % d.base.itemsize == 0 else view
    tb = TypedBuffer(raw[:0], d, count, out)
    span = tb.span()
    lo = start + (d.true_lb if span else 0)
    if lo < 0 or lo + span > raw.nbytes:
        raise error(ERR_BUFFER, f"{what}: {count} instances of the datatype reach bytes [{lo}, {lo + span}) "
                    f"of a buffer of {raw.nbytes} B")
    tb.region = raw[lo:lo + span]
    return tb
