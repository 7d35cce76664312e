"""Datatype introspection and the datatypes MPI names by properties: decode (a type's constructor
call back from its envelope and contents), pickling by that call, the Fortran 90 parameterised types
(Create_f90_integer/real/complex), Match_size, Get_value_index, and the element list of
Create_darray.

A Fortran 90 parameterised type is a predefined type of its own (is_predefined but not is_named, as
MPI says), of the smallest C representation that holds the asked range and precision; asking twice
gives the same handle. Get_value_index gives the predefined (value, index) pair type, or
DATATYPE_NULL where MPI has none.
"""
from __future__ import annotations

from typing import Any, Sequence

import numpy as np

from shmproxy.mpi import datatypes as D
from shmproxy.mpi import typemap as TM
from shmproxy.mpi.exceptions import ERR_ARG, ERR_TYPE, as_int, error

COMBINER_F90_REAL, COMBINER_F90_COMPLEX, COMBINER_F90_INTEGER = 14, 15, 16
COMBINER_VALUE_INDEX = 17
TYPECLASS_INTEGER, TYPECLASS_REAL, TYPECLASS_COMPLEX, TYPECLASS_LOGICAL = 1, 2, 3, 4
DISTRIBUTE_NONE, DISTRIBUTE_BLOCK, DISTRIBUTE_CYCLIC = 0, 1, 2
DISTRIBUTE_DFLT_DARG = -1
ORDER_F = TM.ORDER_FORTRAN

_NAMES = {v: k[len("COMBINER_"):] for k, v in {**vars(TM), **globals()}.items()
          if k.startswith("COMBINER_") and isinstance(v, int)}
_NAMES[D.COMBINER_NAMED] = "NAMED"


class F90Type(D.Datatype):
    """A Fortran 90 parameterised type: a predefined C type under an F90 combiner and parameters."""

    __slots__ = ("comb", "params")
    comb: int                   # COMBINER_F90_INTEGER, _REAL or _COMPLEX
    params: dict[str, int]      # {"r": range} or {"p": precision, "r": range}

    @property
    def is_named(self) -> bool:
        return False

    def Get_envelope(self) -> tuple[int, int, int, int, int]:
        return len(self.params), 0, 0, 0, self.comb

    def Get_contents(self) -> tuple[list[int], list[int], list[int], list[D.Datatype]]:
        return list(self.params.values()), [], [], []

    def decode(self) -> tuple[D.Datatype, str, dict]:
        return D.DATATYPE_NULL, _NAMES[self.comb], dict(self.params)

    def Dup(self) -> D.Datatype:
        return TM.dup(self)

    def __reduce__(self) -> Any:
        return f90, (_NAMES[self.comb], self.params.get("p"), self.params["r"])

    def __repr__(self) -> str:
        return f"<shmproxy.MPI {_NAMES[self.comb]} {self.params}>"


_F90: dict[tuple, F90Type] = {}


def _f90_dtype(kind: str, p: int, r: int) -> Any:
    if kind == "F90_INTEGER":
        for dt, digits in ((np.int8, 2), (np.int16, 4), (np.int32, 9), (np.int64, 18)):
            if r <= digits:
                return dt
        return None
    for real, cplx, prec, rng in ((np.float32, np.complex64, 6, 37), (np.float64, np.complex128, 15, 307)):
        if p <= prec and r <= rng:
            return real if kind == "F90_REAL" else cplx
    return None


def f90(kind: str, p: int | None = None, r: int | None = None) -> D.Datatype:
    """The F90 type ``kind`` ("F90_INTEGER", "F90_REAL", "F90_COMPLEX") of precision ``p`` and range
    ``r`` (MPI_UNDEFINED, -1 here too, where a real or complex leaves one open)."""
    pv = -1 if p is None else as_int(p, f"Create_{kind.lower()}: p")
    rv = -1 if r is None else as_int(r, f"Create_{kind.lower()}: r")
    params = {"r": rv} if kind == "F90_INTEGER" else {"p": pv, "r": rv}
    key = (kind, *params.values())
    if key in _F90:
        return _F90[key]
    dt = _f90_dtype(kind, pv if pv >= 0 else 0, rv if rv >= 0 else 0)
    if dt is None:
        raise error(ERR_ARG, f"Create_{kind.lower()}{tuple(params.values())}: no C type holds that "
                    "precision and range")
    t = F90Type._make(D.of_dtype(np.dtype(dt))._sym, dt)
    t._label = f"MPI_{kind}({', '.join(str(v) for v in params.values())})"
    t.comb = {"F90_INTEGER": COMBINER_F90_INTEGER, "F90_REAL": COMBINER_F90_REAL,
              "F90_COMPLEX": COMBINER_F90_COMPLEX}[kind]
    t.params = params
    _F90[key] = t
    return t


_PAIRS = {"SHORT": "SHORT_INT", "INT": "2INT", "LONG": "LONG_INT", "FLOAT": "FLOAT_INT",
          "DOUBLE": "DOUBLE_INT", "LONG_DOUBLE": "LONG_DOUBLE_INT"}


def value_index(value: D.Datatype, index: D.Datatype) -> D.Datatype:
    for t, what in ((value, "value"), (index, "index")):
        if not isinstance(t, D.Datatype) or not t:
            raise error(ERR_TYPE, f"Get_value_index: the {what} type is DATATYPE_NULL or not a datatype")
    if index == D.PREDEFINED["INT"] and value.is_named and value._sym in _PAIRS:
        return D.PREDEFINED[_PAIRS[value._sym]]
    return D.DATATYPE_NULL


_MATCH = {TYPECLASS_INTEGER: "INTEGER", TYPECLASS_REAL: "REAL", TYPECLASS_COMPLEX: "COMPLEX"}


def match_size(typeclass: int, size: int) -> D.Datatype:
    prefix = _MATCH.get(as_int(typeclass, "Match_size: typeclass"))
    t = D.PREDEFINED.get(f"{prefix}{as_int(size, 'Match_size: size')}") if prefix else None
    if t is None:
        raise error(ERR_ARG, f"Match_size: no Fortran type of class {typeclass} and size {size}")
    return t


def _split(vals: list[int], *sizes: int) -> list[list[int]]:
    out, i = [], 0
    for n in sizes:
        out.append(list(vals[i:i + n]))
        i += n
    return out


def decode(t: Any) -> tuple[D.Datatype, str, dict]:
    """mpi4py's decode of a derived type: (old type, combiner name, the constructor's keywords)."""
    ints, addrs, _counts, types = t.Get_contents()
    c = t.comb
    name = _NAMES[c]
    old = types[0] if types else D.DATATYPE_NULL
    if c == TM.COMBINER_DUP:
        return old, name, {}
    if c == TM.COMBINER_CONTIGUOUS:
        return old, name, {"count": ints[0]}
    if c == TM.COMBINER_VECTOR:
        return old, name, {"count": ints[0], "blocklength": ints[1], "stride": ints[2]}
    if c == TM.COMBINER_HVECTOR:
        return old, name, {"count": ints[0], "blocklength": ints[1], "stride": addrs[0]}
    if c == TM.COMBINER_INDEXED:
        n = ints[0]
        bls, dsp = _split(ints[1:], n, n)
        return old, name, {"blocklengths": bls, "displacements": dsp}
    if c == TM.COMBINER_HINDEXED:
        return old, name, {"blocklengths": ints[1:], "displacements": addrs}
    if c == TM.COMBINER_INDEXED_BLOCK:
        return old, name, {"blocklength": ints[1], "displacements": ints[2:]}
    if c == TM.COMBINER_HINDEXED_BLOCK:
        return old, name, {"blocklength": ints[1], "displacements": addrs}
    if c == TM.COMBINER_STRUCT:
        return D.DATATYPE_NULL, name, {"blocklengths": ints[1:], "displacements": addrs, "datatypes": types}
    if c == TM.COMBINER_SUBARRAY:
        nd = ints[0]
        sizes, subsizes, starts = _split(ints[1:], nd, nd, nd)
        return old, name, {"sizes": sizes, "subsizes": subsizes, "starts": starts, "order": ints[-1]}
    if c == TM.COMBINER_DARRAY:
        size, rank, nd = ints[:3]
        g, dist, darg, ps = _split(ints[3:], nd, nd, nd, nd)
        return old, name, {"size": size, "rank": rank, "gsizes": g, "distribs": dist, "dargs": darg,
                           "psizes": ps, "order": ints[-1]}
    if c == TM.COMBINER_RESIZED:
        return old, name, {"lb": addrs[0], "extent": addrs[1]}
    raise error(ERR_TYPE, f"decode: unknown combiner {c}")


def rebuild(old: D.Datatype, comb: str, kwargs: dict, committed: bool) -> D.Datatype:
    """Unpickling a derived type: its constructor called again."""
    ctor = "Dup" if comb == "DUP" else "Create_" + comb.lower()
    t = getattr(old, ctor)(**kwargs)
    if committed:
        t.Commit()
    return t


def _owned(g: int, dist: int, darg: int, p: int, coord: int) -> np.ndarray:
    """The indices of one dimension of ``g`` elements that process coordinate ``coord`` of ``p`` owns."""
    if dist == DISTRIBUTE_NONE:
        if p != 1:
            raise error(ERR_ARG, "Create_darray: DISTRIBUTE_NONE needs a process dimension of 1")
        return np.arange(g, dtype=np.int64)
    if dist == DISTRIBUTE_BLOCK:
        b = -(-g // p) if darg == DISTRIBUTE_DFLT_DARG else int(darg)
        if b * p < g:
            raise error(ERR_ARG, f"Create_darray: block size {b} x {p} processes does not cover {g}")
        return np.arange(min(coord * b, g), min((coord + 1) * b, g), dtype=np.int64)
    if dist == DISTRIBUTE_CYCLIC:
        b = 1 if darg == DISTRIBUTE_DFLT_DARG else int(darg)
        if b <= 0:
            raise error(ERR_ARG, f"Create_darray: cyclic block size {b}")
        i = np.arange(g, dtype=np.int64)
        return i[(i // b) % p == coord]
    raise error(ERR_ARG, f"Create_darray: unknown distribution {dist}")


def darray_elements(size: int, rank: int, gsizes: Sequence[int], distribs: Sequence[int],
                    dargs: Sequence[int], psizes: Sequence[int], order: int) -> np.ndarray:
    """Element offsets (in array order) of the global array that ``rank`` owns."""
    nd = len(gsizes)
    if not (len(distribs) == len(dargs) == len(psizes) == nd) or not nd:
        raise error(ERR_ARG, "Create_darray: gsizes, distribs, dargs and psizes need one entry per dimension")
    if int(np.prod(psizes)) != size or not 0 <= rank < size:
        raise error(ERR_ARG, f"Create_darray: a grid of {psizes} for {size} processes, rank {rank}")
    if order not in (TM.ORDER_C, TM.ORDER_FORTRAN):
        raise error(ERR_ARG, f"Create_darray: order must be ORDER_C or ORDER_FORTRAN, got {order!r}")
    coords, rest = [], rank
    for p in reversed(psizes):          # the process grid is row-major, whatever the array order
        coords.append(rest % p)
        rest //= p
    coords.reverse()
    owned = [_owned(g, int(d), int(a), p, c)
             for g, d, a, p, c in zip(gsizes, distribs, dargs, psizes, coords)]
    dims = range(nd) if order == TM.ORDER_C else range(nd - 1, -1, -1)   # slowest dimension first
    strides = [0] * nd
    acc = 1
    for k in reversed(list(dims)):
        strides[k] = acc
        acc *= gsizes[k]
    offs = np.zeros(1, np.int64)
    for k in dims:
        offs = (offs[:, None] + owned[k][None, :] * strides[k]).reshape(-1)
    return offs


def _typealign(datatype: D.Datatype) -> int | None:
    """mpi4py's MPI._typealign: a predefined type's C alignment (a pair type's: its struct's; an F90
    type's: its C type's; a dup's: the original's); None for any other derived type (its layout is
    the program's, not a C type's)."""
    if not isinstance(datatype, D.Datatype):
        raise TypeError(f"_typealign: expected an MPI.Datatype, got {type(datatype).__name__}")
    while isinstance(datatype, TM.Derived) and datatype.comb == TM.COMBINER_DUP:
        datatype = datatype._contents[2][0]
    if datatype.is_predefined and datatype.dtype is not None:
        return int(datatype.dtype.alignment)
    return None
