"""Derived datatypes (shmproxy.mpi.typemap, shmproxy.shm.typed): each constructor's block list
against numpy's view of the same layout, the C gather/scatter, and messages between ranks (one node
and two simulated nodes) whose two sides use different types of the same signature."""
from __future__ import annotations

import numpy as np
import pytest

from shmproxy import MPI
from shmproxy.shm.typed import TypeMap
from shmproxy.shm import _native
from tests.harness import run_ranks

BODY = "tests.bodies_mpi_datatypes:"


def gather(arr: np.ndarray, t, count: int = 1) -> bytes:
    """The bytes ``count`` instances of ``t`` select from ``arr`` (whose start is the type's origin),
    gathered by the progress process's C copy."""
    raw = arr.view(np.uint8).reshape(-1)
    tm = TypeMap(t.table().reshape(-1).tolist(), t.extent)
    out = np.zeros(count * t.size, np.uint8)
    dst = np.array([[0, max(out.nbytes, 1)]], np.int64)
    if out.nbytes:
        assert t.true_lb >= 0 and t.true_lb + tm.span(count) <= raw.nbytes
        info = _native.buffer_info
        _native.copy_blocks(info(out, True)[0], info(dst, False)[0], 1, out.nbytes,
                            info(raw, False)[0] + t.true_lb, tm.addr, tm.nblocks, tm.extent, out.nbytes)
    return out.tobytes()


def test_vector_hvector_contiguous_match_numpy_strides():
    a = np.arange(60, dtype="d")
    v = MPI.DOUBLE.Create_vector(5, 2, 6).Commit()
    assert gather(a, v) == a.reshape(10, 6)[:5, :2].tobytes()
    assert v.Get_size() == 80 and v.Get_extent() == (0, (4 * 6 + 2) * 8)
    hv = MPI.DOUBLE.Create_hvector(3, 1, 24).Commit()
    assert gather(a, hv) == a[:9:3].tobytes()
    c = MPI.INT.Create_contiguous(7).Commit()
    assert c.dense and c.Get_extent() == (0, 28) and len(c.blocks) == 1
    col = MPI.DOUBLE.Create_vector(4, 1, 6)
    cols = col.Create_resized(0, 8).Commit()      # count > 1: successive columns
    assert gather(a, cols, 3) == a.reshape(10, 6)[:4, :3].T.tobytes()


def test_indexed_hindexed_indexed_block_follow_type_map_order():
    a = np.arange(30, dtype="i")
    t = MPI.INT.Create_indexed([2, 1, 3], [10, 0, 4]).Commit()
    assert gather(a, t) == np.concatenate([a[10:12], a[0:1], a[4:7]]).tobytes()
    assert t.Get_extent() == (0, 48) and t.Get_true_extent() == (0, 48)
    h = MPI.INT.Create_hindexed([1, 2], [8, 20]).Commit()
    assert gather(a, h) == np.concatenate([a[2:3], a[5:7]]).tobytes()
    b = MPI.INT.Create_indexed_block(2, [6, 1, 20]).Commit()
    assert gather(a, b) == np.concatenate([a[6:8], a[1:3], a[20:22]]).tobytes()
    adjacent = MPI.INT.Create_indexed([2, 3], [0, 2]).Commit()
    assert len(adjacent.blocks) == 1 and adjacent.dense


def test_subarray_matches_numpy_slices_in_both_orders():
    a = np.arange(7 * 9 * 4, dtype="f").reshape(7, 9, 4)
    s = MPI.FLOAT.Create_subarray([7, 9, 4], [3, 2, 4], [2, 5, 0]).Commit()
    assert gather(a, s) == a[2:5, 5:7, :].tobytes()
    assert s.Get_extent() == (0, a.nbytes) and s.Get_size() == 3 * 2 * 4 * 4
    f = np.asfortranarray(np.arange(6 * 5, dtype="d").reshape(6, 5))
    sf = MPI.DOUBLE.Create_subarray([6, 5], [2, 3], [1, 2], order=MPI.ORDER_FORTRAN).Commit()
    assert gather(f.reshape(-1, order="F"), sf) == f[1:3, 2:5].tobytes(order="F")


def test_struct_matches_a_numpy_structured_dtype_extent_and_fields():
    rec = np.dtype([("a", "i1"), ("b", "f8"), ("c", "i4")], align=True)
    t = MPI.Datatype.Create_struct([1, 1, 1], [rec.fields[k][1] for k in "abc"],
                                   [MPI.SIGNED_CHAR, MPI.DOUBLE, MPI.INT]).Commit()
    assert t.Get_extent() == (0, rec.itemsize) and t.Get_size() == 13 and t.base is None
    x = np.zeros(4, rec)
    x["a"], x["b"], x["c"] = [1, 2, 3, 4], [0.5, 1.5, 2.5, 3.5], [9, 8, 7, 6]
    packed = np.frombuffer(gather(x, t, 4), np.dtype([("a", "i1"), ("b", "f8"), ("c", "i4")]))
    assert packed["a"].tolist() == [1, 2, 3, 4] and packed["c"].tolist() == [9, 8, 7, 6]
    assert packed["b"].tolist() == [0.5, 1.5, 2.5, 3.5]


def test_resized_dup_envelope_and_true_extent():
    t = MPI.INT.Create_vector(2, 1, 3)
    r = t.Create_resized(-4, 40)
    assert r.Get_extent() == (-4, 40) and r.Get_true_extent() == (0, 16) and r.Get_size() == 8
    d = r.Dup()
    assert d.Get_extent() == r.Get_extent() and d.combiner == MPI.COMBINER_DUP
    assert t.Get_envelope() == (3, 0, 0, 1, MPI.COMBINER_VECTOR) and t.Get_contents()[0] == [2, 1, 3]
    assert t.decode() == (MPI.INT, "VECTOR", {"count": 2, "blocklength": 1, "stride": 3})
    import pickle
    p = pickle.loads(pickle.dumps(r))
    assert p.decode()[1:] == ("RESIZED", {"lb": -4, "extent": 40}) and p.Get_extent() == (-4, 40)
    old = d.Get_contents()[3][0]      # a new handle of r (MPI_Type_get_contents): freeing it leaves r
    assert MPI.Datatype(d) == d and old != r and old.Get_extent() == r.Get_extent()
    old.Free()
    assert r.Dup().Get_extent() == (-4, 40)
    z = MPI.DOUBLE.Create_contiguous(0).Commit()
    assert z.Get_size() == 0 and z.Get_extent() == (0, 0)
    t.Free()
    with pytest.raises(MPI.Exception):
        t.Commit()


def test_buffer_specs_with_derived_types():
    from shmproxy.mpi.buffers import parse
    from shmproxy.rank.typed import TypedBuffer
    a = np.arange(40, dtype="d")
    v = MPI.DOUBLE.Create_vector(3, 1, 4)
    with pytest.raises(MPI.Exception, match="not committed"):
        parse([a, 1, v], "send buffer", False)
    v.Commit()
    tb = parse([a, 2, v], "send buffer", False)
    assert type(tb) is TypedBuffer and tb.nbytes == 48 and tb.region.nbytes == (9 + 9) * 8
    with pytest.raises(MPI.Exception):
        parse([a, 5, v], "send buffer", False)    # reaches past the array
    dense = parse([a, 3, MPI.DOUBLE.Create_contiguous(4).Commit()], "send buffer", False)
    assert type(dense) is np.ndarray and dense.dtype == np.float64 and dense.size == 12
    from shmproxy.mpi.datatypes import check_native
    with pytest.raises(MPI.Exception, match="point-to-point"):
        check_native(v, "Bcast buffer")      # what the collectives' buffers go through


def test_point_to_point_with_different_types_on_each_side():
    run_ranks(BODY + "exchange", 2, timeout=180)


def test_point_to_point_with_derived_types_across_two_nodes():
    run_ranks(BODY + "exchange", 2, timeout=240, nodes=2)


def test_buffer_collectives_with_derived_types():
    run_ranks(BODY + "collectives", 3, timeout=240)


def test_buffer_collectives_with_derived_types_across_two_nodes():
    run_ranks(BODY + "collectives", 3, timeout=240, nodes=2)


def test_typealign_and_f90_types_inside_derived_ones():
    """MPI._typealign is a predefined type's C alignment (pair types: their struct's), None for a
    struct; an F90 type inside a derived type comes back from Get_contents as itself (mpi4py's dtlib
    walks such types)."""
    for code in "bhilqfdFDG":
        assert MPI._typealign(MPI.Datatype.fromcode(code)) == np.dtype(code).alignment
    assert MPI._typealign(MPI.DOUBLE_INT) == 8 and MPI._typealign(MPI.DOUBLE.Dup()) == 8
    st = MPI.Datatype.Create_struct([1, 1], [0, 8], [MPI.INT, MPI.DOUBLE])
    assert MPI._typealign(st) is None
    f90 = MPI.Datatype.Create_f90_integer(5)
    pair = MPI.Datatype.Create_struct([1, 1], [0, 8], [MPI.INT, f90])
    assert pair.Get_contents()[3][1] == f90
    from shmproxy.util import dtlib
    assert dtlib.to_numpy_dtype(pair).fields["f1"][0] == np.dtype("i4")
