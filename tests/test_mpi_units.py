"""shmproxy.MPI's pure parts, in this process, with no rank started: buffer specs, datatypes, Status,
groups, Compute_dims, ops, error classes, the import hook."""
from __future__ import annotations

import array
import mmap
import subprocess
import sys

from typing import Any

import numpy as np
import pytest

from shmproxy import MPI
from shmproxy.mpi import buffers
from shmproxy.mpi.status import Status


def _shares(view: np.ndarray, owner: object) -> bool:
    return np.shares_memory(view, np.asarray(memoryview(owner)).view(np.uint8))


# ------------------------------------------------------------------ buffer specs
def test_plain_buffers_become_views_without_copies():
    a = np.arange(6, dtype=np.float64).reshape(2, 3)
    assert buffers.parse(a, "b", True) is a            # the short path: the array itself
    for obj, dt in ((bytearray(8), np.uint8), (array.array("d", [1.0, 2.0]), np.float64),
                    (array.array("i", [1, 2, 3]), np.int32)):
        v = buffers.parse(obj, "b", True)
        assert type(v) is np.ndarray and v.dtype == dt and _shares(v, obj)
        v[0] = 7
        assert obj[0] == 7                               # written through: no copy
    mm = mmap.mmap(-1, 16)
    v = buffers.parse(mm, "b", True)
    v[:] = 3
    assert mm[5] == 3
    ro = buffers.parse(b"abcd", "b", False)
    assert ro.dtype == np.uint8 and not ro.flags.writeable and bytes(ro) == b"abcd"
    f = np.asfortranarray(np.arange(6.0).reshape(2, 3))
    assert np.shares_memory(buffers.parse(f, "b", True), f)


def test_list_specs_with_datatype_count_and_displacement():
    a = np.arange(10, dtype=np.int32)
    v = buffers.parse([a, MPI.INT], "b", True)
    assert v.size == 10 and np.shares_memory(v, a)
    assert buffers.parse([a, 4, MPI.INT], "b", True).tolist() == [0, 1, 2, 3]
    assert buffers.parse([a, (3, 2), MPI.INT], "b", True).tolist() == [2, 3, 4]
    assert buffers.parse([a, 3, 2, MPI.INT], "b", True).tolist() == [2, 3, 4]
    assert buffers.parse((a, MPI.INT), "b", True).size == 10
    assert buffers.parse([a, "i"], "b", True).size == 10
    assert buffers.parse([a, 2], "b", True).tolist() == [0, 1]
    # another datatype reinterprets the bytes (a view, as MPI sees memory)
    b = buffers.parse([bytearray(16), MPI.DOUBLE], "b", True)
    assert b.dtype == np.float64 and b.size == 2
    # a count in a collective is per block
    assert buffers.parse([a, 2, MPI.INT], "b", True, blocks=3).size == 6
    for special in (None, MPI.IN_PLACE, MPI.BOTTOM):
        assert buffers.parse(special, "b", True) is special


def test_vector_specs():
    a = np.arange(10, dtype=np.float64)
    v = buffers.parse_v([a, ([1, 2, 3], [0, 2, 6]), MPI.DOUBLE], "b", True, 3)
    assert v.counts == (1, 2, 3) and v.displs == (0, 2, 6) and v.datatype is MPI.DOUBLE
    assert np.shares_memory(v.array, a)
    packed = buffers.parse_v([a, [2, 3], MPI.DOUBLE], "b", True, 2)
    assert packed.displs == (0, 2)
    with pytest.raises(MPI.Exception) as e:
        buffers.parse_v([a, ([5, 6], [0, 5]), MPI.DOUBLE], "b", True, 2)
    assert e.value.Get_error_class() == MPI.ERR_COUNT


@pytest.mark.parametrize("spec, cls", [
    (object(), MPI.ERR_BUFFER),
    ([np.zeros(4), 5, MPI.DOUBLE], MPI.ERR_COUNT),
    ([np.zeros(4), -1, MPI.DOUBLE], MPI.ERR_COUNT),
    ([np.zeros(4), (2, 3), MPI.DOUBLE], MPI.ERR_COUNT),
    ([np.zeros(3, np.uint8), MPI.DOUBLE], MPI.ERR_BUFFER),
    ([np.zeros(4), 42], MPI.ERR_COUNT),
    ([np.zeros(4), 1, "zz"], MPI.ERR_TYPE),
    ([np.zeros(4), 1, 2, 3, 4], MPI.ERR_BUFFER),
    ([np.zeros(3), MPI.DOUBLE_INT], MPI.ERR_BUFFER),    # 24 bytes: not whole (value, index) pairs
    ([np.zeros(4), MPI.DATATYPE_NULL], MPI.ERR_TYPE),
    (np.zeros((4, 4))[:, 1], MPI.ERR_BUFFER),
    (np.zeros(3, dtype="U2"), MPI.ERR_TYPE),
])
def test_bad_specs_raise_mpi_exceptions(spec, cls):
    with pytest.raises(MPI.Exception) as e:
        buffers.parse(spec, "b", True)
    assert e.value.Get_error_class() == cls, e.value
    assert isinstance(e.value, ValueError)              # also the native InvalidArgument


def test_vector_specs_in_every_mpi4py_form():
    a = np.arange(8, dtype="i")
    v = buffers.parse_v([a, (2, 3), MPI.INT], "b", False, 2)     # one count each, displacement stride 3
    assert (v.counts, v.displs) == ((2, 2), (0, 3))
    v = buffers.parse_v([a, ([1, 3], None), "i"], "b", False, 2)  # counts, packed
    assert (v.counts, v.displs) == ((1, 3), (0, 1))
    v = buffers.parse_v([a, (2, [4, 1])], "b", False, 2)
    assert (v.counts, v.displs) == ((2, 2), (4, 1))
    v = buffers.parse_v([a, np.array([3, 5]), MPI.INT], "b", False, 2)
    assert (v.counts, v.displs) == ((3, 5), (0, 3))
    with pytest.raises(MPI.Exception):
        buffers.parse_v([a, (5, 4), MPI.INT], "b", False, 2)        # rank 1's block ends past the buffer


def test_foreign_byte_order_needs_a_named_datatype():
    swapped = np.arange(3, dtype=np.dtype("i4").newbyteorder())
    with pytest.raises(BufferError) as e:
        buffers.parse(swapped, "send buffer", False)
    assert isinstance(e.value, MPI.Exception) and e.value.Get_error_class() == MPI.ERR_BUFFER
    assert buffers.parse([swapped, MPI.INT], "send buffer", False).dtype == np.dtype("i4")   # its bytes


def test_read_only_buffers_cannot_receive():
    with pytest.raises(MPI.Exception) as e:
        buffers.parse(b"abcd", "receive buffer", True)
    assert e.value.Get_error_class() == MPI.ERR_BUFFER and "read-only" in str(e.value)


# ------------------------------------------------------------------ datatypes
def test_datatypes():
    for name, size in (("BYTE", 1), ("CHAR", 1), ("SHORT", 2), ("INT", 4), ("LONG_LONG", 8), ("FLOAT", 4),
                       ("DOUBLE", 8), ("C_BOOL", 1), ("BOOL", 1), ("INT8_T", 1), ("UINT64_T", 8),
                       ("UNSIGNED", 4), ("UNSIGNED_LONG_LONG", 8), ("C_FLOAT_COMPLEX", 8),
                       ("C_DOUBLE_COMPLEX", 16), ("C_COMPLEX", 8)):
        d = getattr(MPI, name)
        assert isinstance(d, MPI.Datatype) and d.Get_size() == size and d.size == size
        assert d.name == "MPI_" + name
        assert d.Get_extent() == (0, size) and d.dtype.itemsize == size
    assert MPI.DOUBLE.dtype == np.float64 and MPI.INT.dtype == np.int32
    assert MPI._typedict["d"] is MPI.DOUBLE and MPI._typedict["i"] is MPI.INT
    # derived datatypes: tests/test_mpi_datatypes.py
    assert MPI.Datatype(MPI.INT) == MPI.INT and MPI.Datatype(MPI.INT) is not MPI.INT
    assert not MPI.DATATYPE_NULL and MPI.Datatype() == MPI.DATATYPE_NULL
    assert MPI.INT.decode() == (MPI.INT, "NAMED", {})
    assert MPI.INT.Get_envelope() == (0, 0, 0, 0, MPI.COMBINER_NAMED)
    assert MPI.Datatype.Get_value_index(MPI.DOUBLE, MPI.INT) is MPI.DOUBLE_INT
    assert MPI.Datatype.Create_f90_real(15, 300).size == 8 and MPI.Datatype.Create_f90_integer(3).size == 2


# ------------------------------------------------------------------ Status
def test_status():
    class Native:
        source, tag, nbytes = 3, 7, 24
    st = Status()
    st._fill(Native())
    assert (st.Get_source(), st.Get_tag(), st.source, st.tag) == (3, 7, 3, 7)
    assert st.Get_count(MPI.DOUBLE) == 3 and st.Get_count(MPI.INT) == 6 and st.Get_count() == 24
    assert st.Get_elements(MPI.DOUBLE) == 3 and st.Get_error() == MPI.SUCCESS
    assert st.Get_count(MPI.C_DOUBLE_COMPLEX) == MPI.UNDEFINED      # 24 B is not whole 16-byte elements
    st._fill_null()
    assert st.source == MPI.PROC_NULL and st.tag == MPI.ANY_TAG and st.Get_count(MPI.INT) == 0
    assert Status(st) == st


# ------------------------------------------------------------------ groups, Compute_dims
def test_groups():
    g = MPI.Group(range(6), me=2)
    assert g.size == 6 and g.rank == 2
    a = g.Incl([4, 2, 0])
    assert a.members == (4, 2, 0) and a.rank == 1
    assert g.Excl([0, 1]).members == (2, 3, 4, 5)
    assert g.Range_incl([(0, 4, 2)]).members == (0, 2, 4)
    assert g.Range_incl([(5, 3, -1)]).members == (5, 4, 3)
    assert g.Range_excl([(1, 5, 2)]).members == (0, 2, 4)
    b = g.Incl([0, 1, 3])
    assert a.Union(b).members == (4, 2, 0, 1, 3)
    assert a.Intersection(b).members == (0,)
    assert a.Difference(b).members == (4, 2)
    assert b.rank == MPI.UNDEFINED
    assert a.Translate_ranks([0, 1, 2], g) == [4, 2, 0]
    assert a.Translate_ranks([0, 2], b) == [MPI.UNDEFINED, 0]
    assert a.Translate_ranks([MPI.PROC_NULL], b) == [MPI.PROC_NULL]
    assert a.Compare(a.Dup()) == MPI.IDENT
    assert a.Compare(g.Incl([0, 2, 4])) == MPI.SIMILAR and a.Compare(b) == MPI.UNEQUAL
    with pytest.raises(MPI.Exception) as e:
        g.Incl([6])
    assert e.value.Get_error_class() == MPI.ERR_RANK
    assert MPI.GROUP_EMPTY.size == 0


@pytest.mark.parametrize("n, dims, expect", [
    (12, 2, [4, 3]), (16, 3, [4, 2, 2]), (6, [0, 3], [2, 3]), (7, 2, [7, 1]), (1, 3, [1, 1, 1]),
    (24, [0, 0, 2], [4, 3, 2]), (8, [2, 2, 2], [2, 2, 2]), (30, 3, [5, 3, 2]),
])
def test_compute_dims(n, dims, expect):
    assert MPI.Compute_dims(n, dims) == expect


def test_compute_dims_errors():
    with pytest.raises(MPI.Exception) as e:
        MPI.Compute_dims(7, [2, 0])
    assert e.value.Get_error_class() == MPI.ERR_DIMS


# ------------------------------------------------------------------ ops, errors, environment
def test_ops():
    assert MPI.SUM(2, 3) == 5 and MPI.PROD(2, 3) == 6 and MPI.MIN(2, 3) == 2 and MPI.MAX(2, 3) == 3
    assert MPI.MAXLOC((3, 1), (3, 0)) == (3, 0) and MPI.MINLOC((1, 5), (2, 0)) == (1, 5)
    assert MPI.LAND(1, 0) is False and MPI.LOR(1, 0) is True and MPI.LXOR(1, 1) is False
    assert MPI.BAND(6, 3) == 2 and MPI.BOR(6, 3) == 7 and MPI.BXOR(6, 3) == 5
    assert MPI.SUM.native == 1 and MPI.LAND.native is None
    user = MPI.Op.Create(lambda a, b: a * 10 + b)
    assert user(1, 2) == 12 and not user.is_commutative


def test_reduce_local_in_the_rank():
    a, b = np.array([1, 5, 3], np.int32), np.array([4, 2, 3], np.int32)
    MPI.MAX.Reduce_local(a, b)
    assert b.tolist() == [4, 5, 3]
    MPI.BXOR.Reduce_local(a, b)
    assert b.tolist() == [5, 0, 0]
    MPI.LOR.Reduce_local([np.array([0.0, 2.0]), MPI.DOUBLE], c := np.array([0.0, 0.0]))
    assert c.tolist() == [0.0, 1.0]
    pair = np.dtype([("v", np.float64), ("i", np.int32)], align=True)
    x, y = np.array([(1.0, 3), (5.0, 1)], pair), np.array([(1.0, 2), (6.0, 0)], pair)
    MPI.MINLOC.Reduce_local([x, MPI.DOUBLE_INT], [y, MPI.DOUBLE_INT])
    assert y.tolist() == [(1.0, 2), (5.0, 1)]

    def cat(inbuf: Any, inout: Any, datatype: Any) -> None:   # non-commutative: inout = in * 10 + inout
        i, o = np.frombuffer(inbuf, np.int64), np.frombuffer(inout, np.int64)
        o[:] = i * 10 + o
    op = MPI.Op.Create(cat, commute=False)
    z = np.array([2], np.int64)
    op.Reduce_local(np.array([1], np.int64), z)
    assert z.tolist() == [12]
    with pytest.raises(MPI.Exception):
        MPI.SUM.Reduce_local(np.zeros(2), np.zeros(3))
    with pytest.raises(MPI.Exception):
        MPI.MAX.Reduce_local(np.zeros(2, complex), np.zeros(2, complex))


def test_native_errors_are_mpi_exceptions_and_still_native():
    import shmproxy
    from shmproxy.mpi.exceptions import convert
    for native, cls in ((shmproxy.TruncationError("t"), MPI.ERR_TRUNCATE),
                        (shmproxy.Timeout("x"), MPI.ERR_PENDING),
                        (shmproxy.InvalidArgument("a"), MPI.ERR_ARG),
                        (shmproxy.Closed("c"), MPI.ERR_COMM),
                        (shmproxy.PeerDiedError("d", rank=2, pid=9), MPI.ERR_PROC_FAILED)):
        e = convert(native)
        assert isinstance(e, MPI.Exception) and isinstance(e, type(native)) and str(e) == str(native)
        assert e.Get_error_class() == cls and e.error_class == cls and e.Get_error_code() == cls
    assert convert(shmproxy.PeerDiedError("d", rank=2, pid=9)).rank == 2
    assert isinstance(convert(shmproxy.Timeout("x")), TimeoutError)
    assert MPI.Exception(MPI.ERR_ARG).Get_error_class() == MPI.ERR_ARG
    assert MPI.Get_error_string(MPI.ERR_TRUNCATE) == "ERR_TRUNCATE"


def test_environment_without_starting_anything():
    assert MPI.Query_thread() in (MPI.THREAD_SINGLE, MPI.THREAD_FUNNELED, MPI.THREAD_SERIALIZED)
    assert MPI.Get_version() == (3, 1) and MPI.Wtick() > 0 and MPI.Wtime() > 0
    assert isinstance(MPI.Get_processor_name(), str)
    assert repr(MPI.COMM_WORLD) and MPI.COMM_SELF.Get_size() == 1 and MPI.COMM_SELF.Get_rank() == 0
    assert not MPI.COMM_NULL
    assert MPI.Alloc_mem(8).nbytes == 8
    for call in (lambda: MPI.Win.Create(None),
                 lambda: MPI.Intracomm().Spawn("x"), lambda: MPI.Open_port()):
        with pytest.raises(NotImplementedError):
            call()
    with pytest.raises(AttributeError, match="not provided"):
        MPI.Some_mpi4py_name   # noqa: B018


def test_import_forms_and_no_eager_import():
    code = ("import sys, shmproxy; assert 'shmproxy.mpi' not in sys.modules; "
            "import shmproxy.MPI as A; from shmproxy import MPI as B; assert A is B is shmproxy.MPI; "
            "assert B.COMM_WORLD is shmproxy.mpi.COMM_WORLD; assert not B.Is_initialized()")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)


# ------------------------------------------------------------------ vector specs as mpi4py reads them
class _Index:
    """An integer only through __index__ (as operator.index reads it)."""

    def __init__(self, v: int):
        self.v = v

    def __index__(self) -> int:
        return self.v


@pytest.mark.parametrize("second, counts, displs", [
    ((2, 3), (2, 2, 2), (0, 3, 6)),                          # one count, a displacement stride
    ((np.int64(2), np.intc(3)), (2, 2, 2), (0, 3, 6)),
    ((np.array(2), _Index(3)), (2, 2, 2), (0, 3, 6)),
    ((0, 0), (0, 0, 0), (0, 0, 0)),
    ((2, None), (2, 2, 2), (0, 2, 4)),
    ((True, 4), (1, 1, 1), (0, 4, 8)),
    (([1, 0, 2], 3), (1, 0, 2), (0, 3, 6)),                  # counts, a stride
    ((2, [6, 0, 3]), (2, 2, 2), (6, 0, 3)),                  # one count, displacements
    (([3, 0, 1], None), (3, 0, 1), (0, 3, 3)),
    ([[3, 0, 1], [5, 0, 1]], (3, 0, 1), (5, 0, 1)),          # a list pair of sequences
    ((np.array([1, 2, 3]), np.array([0, 1, 3])), (1, 2, 3), (0, 1, 3)),
    ([1, 2, 3], (1, 2, 3), (0, 1, 3)),                       # counts, packed
    ((1, 2, 3), (1, 2, 3), (0, 1, 3)),                       # a tuple of three is counts, not a pair
    (np.array([0, 4, 1]), (0, 4, 1), (0, 0, 4)),
    (3, (3, 3, 3), (0, 3, 6)),                               # one count, packed
    (np.int8(1), (1, 1, 1), (0, 1, 2)),
])
def test_vector_spec_forms_with_a_datatype(second: Any, counts: tuple, displs: tuple):
    a = np.zeros(10, "i")
    v = buffers.parse_v([a, second, MPI.INT], "b", True, 3)
    assert (v.counts, v.displs) == (counts, displs)
    assert v.array.base is a or v.array is a
    if not isinstance(second, np.ndarray):      # [buf, counts] with the buffer's own type reads alike
        v = buffers.parse_v([a, second], "b", True, 3)
        assert (v.counts, v.displs) == (counts, displs) and v.datatype == MPI.INT


def test_vector_spec_four_items_and_buffers_alone():
    a = np.zeros(10, "d")
    v = buffers.parse_v([a, [1, 2, 3], [7, 0, 2], MPI.DOUBLE], "b", True, 3)
    assert (v.counts, v.displs) == ((1, 2, 3), (7, 0, 2))
    v = buffers.parse_v([a, (1, 2, 3), None, "d"], "b", True, 3)           # None displs: packed
    assert (v.counts, v.displs) == ((1, 2, 3), (0, 1, 3))
    v = buffers.parse_v([a, 2, 3, MPI.DOUBLE], "b", True, 3)                # integer count and stride
    assert (v.counts, v.displs) == ((2, 2, 2), (0, 3, 6))
    # no counts: the buffer split as evenly as it goes, the first ranks one more (mpi4py's rule)
    for spec in (a, [a], [a, MPI.DOUBLE], [a, None, None, MPI.DOUBLE]):
        v = buffers.parse_v(spec, "b", True, 3)
        assert (v.counts, v.displs) == ((4, 3, 3), (0, 4, 7)), spec
    v = buffers.parse_v(np.zeros(0), "b", True, 3)
    assert (v.counts, v.displs) == ((0, 0, 0), (0, 0, 0))
    v = buffers.parse_v([None, 0, MPI.INT], "b", True, 3)                   # zero counts need no memory
    assert v.array.size == 0 and v.counts == (0, 0, 0)
    # zero-count blocks may start anywhere: nothing is read or written there
    v = buffers.parse_v([a, [0, 10, 0], [99, 0, 50], MPI.DOUBLE], "b", True, 3)
    assert v.counts == (0, 10, 0)


@pytest.mark.parametrize("spec, cls, typeerror", [
    ([np.zeros(9, "i"), (2.0, 3), MPI.INT], MPI.ERR_COUNT, True),
    ([np.zeros(9, "i"), (2, 3.0), MPI.INT], MPI.ERR_COUNT, True),
    ([np.zeros(9, "i"), ("2", 3), MPI.INT], MPI.ERR_COUNT, True),
    ([np.zeros(9, "i"), ([1, 2, 3.5], None), MPI.INT], MPI.ERR_COUNT, True),
    ([np.zeros(9, "i"), (np.array([1.0, 2.0, 3.0]), None), MPI.INT], MPI.ERR_COUNT, True),
    ([np.zeros(9, "i"), [1, 2], MPI.INT], MPI.ERR_COUNT, False),          # two counts for three ranks
    ([np.zeros(9, "i"), ([1, 1, 1], [0, 1]), MPI.INT], MPI.ERR_COUNT, False),
    ([np.zeros(9, "i"), (2, 4), MPI.INT], MPI.ERR_COUNT, False),          # rank 2's block: 8..9
    ([np.zeros(9, "i"), (-1, 0), MPI.INT], MPI.ERR_COUNT, False),
    ([np.zeros(9, "i"), 1, 2, 3, 4], MPI.ERR_BUFFER, False),
])
def test_bad_vector_specs(spec: Any, cls: int, typeerror: bool):
    with pytest.raises(MPI.Exception) as e:
        buffers.parse_v(spec, "b", True, 3)
    assert e.value.Get_error_class() == cls, e.value
    assert isinstance(e.value, TypeError) == typeerror, e.value


# ------------------------------------------------------------------ integers through __index__
@pytest.mark.parametrize("value, expect", [
    (3, 3), (True, 1), (False, 0), (np.int64(3), 3), (np.uint8(3), 3), (np.intc(-2), -2),
    (np.True_, 1), (np.False_, 0), (np.array(3), 3), (np.array(True), 1), (_Index(4), 4),
])
def test_integers_read_through_index(value: Any, expect: int):
    from shmproxy.mpi.exceptions import as_int
    got = as_int(value, "x")
    assert got == expect and type(got) is int
    if expect >= 0:
        assert buffers.parse([np.zeros(8), value, MPI.DOUBLE], "b", True).size == expect


@pytest.mark.parametrize("value", [2.0, np.float64(2), "2", None, [2], np.array([2]), np.array(2.0), 1j])
def test_non_integers_are_type_errors_and_mpi_exceptions(value: Any):
    from shmproxy.mpi.exceptions import as_int
    with pytest.raises(TypeError) as e:
        as_int(value, "the thing", MPI.ERR_RANK)
    assert isinstance(e.value, MPI.Exception) and e.value.Get_error_class() == MPI.ERR_RANK
    assert "the thing must be an integer" in str(e.value)


def test_integer_arguments_of_the_local_calls():
    assert MPI.Compute_dims(np.int64(6), np.int32(2)) == [3, 2]
    assert MPI.Compute_dims(_Index(8), [np.int64(0), True]) == [8, 1]
    with pytest.raises(TypeError):
        MPI.Compute_dims(6.0, 2)
    st = Status()
    st.Set_source(np.int64(3))
    st.Set_tag(_Index(7))
    st.Set_error(np.intc(MPI.ERR_TAG))
    st.Set_elements(MPI.DOUBLE, np.uint16(2))
    assert (st.Get_source(), st.Get_tag(), st.Get_error(), st.Get_count(MPI.DOUBLE)) == (3, 7, MPI.ERR_TAG, 2)
    with pytest.raises(TypeError):
        st.Set_tag(1.5)
    assert MPI.Alloc_mem(np.int64(8)).nbytes == 8
    g = MPI.Group(range(6), me=2)
    assert g.Incl([np.int64(4), True, _Index(0)]).members == (4, 1, 0)
    assert g.Range_incl([(np.int64(0), np.int32(4), _Index(2))]).members == (0, 2, 4)
    assert g.Translate_ranks([np.int8(5)], g) == [5]
    with pytest.raises(TypeError):
        g.Incl([1.0])
    t = MPI.DOUBLE.Create_vector(np.int64(2), np.int32(1), _Index(3))
    assert t.Get_extent() == (0, 32)
    assert MPI.INT.Create_indexed([np.int64(1), True], np.array([0, 2])).Get_size() == 8
    with pytest.raises(TypeError):
        MPI.INT.Create_indexed([1.5], [0])
    assert MPI.DOUBLE.Create_resized(np.int64(0), np.int64(16)).Get_extent() == (0, 16)
