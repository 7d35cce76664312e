"""MPI.Comm and MPI.Intracomm: mpi4py's communicator calls over a native shmproxy Comm.

A wrapper holds the native communicator (``_c``; absent for COMM_NULL), the ranks of its members in
COMM_WORLD (``_wranks``, for groups) and its name. Each call parses its buffer specs (buffers.py:
numpy views, no copies, errors before anything is posted), handles PROC_NULL itself (MPI defines it
as an immediate no-op whose receive status says source PROC_NULL), and calls the native method;
native errors come back as MPI.Exception subclasses that are still the native classes
(exceptions.convert).

Point-to-point (buffers, probes, and the object layer's send/recv/isend/irecv/sendrecv/probe) is the
mixin in p2p.py, whose header says which modes exist.

Communicators the native layer builds from a list of members without a collective over the parent
(COMM_SELF, Create_group) use the same call that Split makes once it knows the members
(``_member_comm``): each has a progress process of its own, so COMM_SELF is created on first use only.

Collectives are in coll.py, topologies in topology.py; the object (lower-case) layer is here.
"""
from __future__ import annotations

import hashlib
import os
import sys
import weakref
from typing import Any

from shmproxy.core import errors
from shmproxy.core.ops import UNDEFINED
from shmproxy.mpi import attributes
from shmproxy.mpi.attributes import COMM, Cached
# the predefined attribute keys, still importable from here (attributes.py owns attribute caching)
from shmproxy.mpi.attributes import (APPNUM, HOST, IO, KEYVAL_INVALID, LASTUSEDCODE, TAG_UB,  # noqa: F401
                                     UNIVERSE_SIZE, WTIME_IS_GLOBAL)
from shmproxy.mpi.coll import Collectives
from shmproxy.mpi.exceptions import (ERR_ARG, ERR_COMM, ERR_ROOT, ERR_TAG, as_int, attr_error, convert, error,
                                     unsupported)
from shmproxy.mpi.group import CONGRUENT, IDENT, SIMILAR, UNEQUAL, Group
from shmproxy.mpi.ops import SUM, as_op
from shmproxy.mpi.p2p import PointToPoint
from shmproxy.mpi.partitioned import PartitionedP2P
from shmproxy.mpi.persistent import PersistentCollectives
from shmproxy.mpi.handles import HandleNumber
from shmproxy.rank import objcoll
from shmproxy.rank.comm import Comm as NativeComm


class Comm(HandleNumber, Cached, PointToPoint, Collectives, PersistentCollectives):
    """A communicator (mpi4py's MPI.Comm)."""

    __slots__ = ("_c", "_wranks", "_name", "_info", "__weakref__")
    _c: Any                         # the native communicator (unset: COMM_NULL, or freed)
    _wranks: tuple[int, ...]        # the members' ranks in COMM_WORLD
    _name: str

    def __new__(cls, *_a: Any, **_k: Any) -> "Comm":
        return object.__new__(cls)     # (mpi4py's subclasses call it with the communicator to wrap)

    def __init__(self, native: Any = None, world_ranks: tuple[int, ...] = (), name: str = ""):
        if isinstance(native, Comm):    # mpi4py's MPI.Intracomm(comm): a second handle to comm
            if isinstance(self, Intracomm) and native.is_inter:
                raise TypeError(f"MPI.{type(self).__name__}() takes an intracommunicator, not an "
                                "intercommunicator")
            c = native._c if native else None     # first: COMM_WORLD's first use joins the job and
            world_ranks, name = native._wranks, native._name   # only then knows its ranks
            native = c
        elif native is not None and not isinstance(native, NativeComm):
            raise TypeError(f"MPI.{type(self).__name__}() takes a communicator, not {type(native).__name__}")
        if native is not None:
            self._c = native
        self._wranks = world_ranks
        self._name = name
        self._info: dict[str, str] = {}

    def __getattr__(self, name: str) -> Any:
        # Only reached for ``_c`` when it was never set: COMM_NULL or a freed communicator.
        # (COMM_WORLD and COMM_SELF override this to initialise themselves on first use.)
        if name == "_c":
            raise error(ERR_COMM, "invalid communicator (MPI.COMM_NULL, or freed)")
        if name.startswith("_") and not name.startswith("__"):
            try:
                object.__getattribute__(self, "_c")
            except AttributeError:
                # a null handle of a subclass (MPI.Intercomm(), MPI.Cartcomm()) lacks its layout's
                # slots too: the call is on an invalid communicator (also an AttributeError, so
                # that hasattr stays False)
                raise attr_error(ERR_COMM, f"invalid communicator (MPI.{type(self).__name__}() null "
                                 "handle, or freed)") from None
        raise AttributeError(f"'{type(self).__name__}' object has no attribute {name!r}")

    # ------------------------------------------------------------------ queries
    def Get_rank(self) -> int:
        return self._c.rank

    def Get_size(self) -> int:
        return self._c.size

    @property
    def rank(self) -> int:
        return self._c.rank

    @property
    def size(self) -> int:
        return self._c.size

    def Get_name(self) -> str:
        if not self._name and cached_native(self) is None and not self:
            return "MPI_COMM_NULL"
        return self._name

    def Set_name(self, name: str) -> None:
        if not isinstance(name, str):
            raise TypeError(f"Comm.Set_name: a name is a str, not {type(name).__name__}")
        self._name = name

    @property
    def name(self) -> str:
        return self.Get_name()

    @name.setter
    def name(self, name: str) -> None:
        self.Set_name(name)

    def Get_info(self) -> Any:
        """A new Info with the hints set on this communicator (shmproxy takes none of them)."""
        from shmproxy.mpi.info import Info
        self._c   # COMM_NULL raises
        return Info.Create(self._info)

    def Set_info(self, info: Any) -> None:
        from shmproxy.mpi.info import Info
        if info is not None and not isinstance(info, Info):
            raise TypeError(f"Comm.Set_info: expected an MPI.Info, got {type(info).__name__}")
        self._c
        self._info = dict(info.items()) if info else {}

    @property
    def info(self) -> Any:
        return self.Get_info()

    @info.setter
    def info(self, info: Any) -> None:
        self.Set_info(info)

    def Get_group(self) -> Group:
        c = self._c
        return Group(self._wranks, self._wranks[c.rank])

    @property
    def group(self) -> Group:
        return self.Get_group()

    def Get_topology(self) -> int:
        self._c   # COMM_NULL raises ERR_COMM
        return UNDEFINED

    @property
    def topology(self) -> int:
        return self.Get_topology()

    @property
    def is_topo(self) -> bool:
        return self.Get_topology() != UNDEFINED

    @property
    def is_inter(self) -> bool:
        return False

    @property
    def is_intra(self) -> bool:
        return True

    def Is_inter(self) -> bool:
        self._c   # COMM_NULL raises ERR_COMM
        return False

    def Is_intra(self) -> bool:
        self._c
        return True

    # attributes (Get_attr, Set_attr, Delete_attr, Create_keyval, ...): attributes.Cached
    _attr_kind = COMM

    def _attr_owner(self) -> Any:
        return self._c     # every handle of one communicator shares it; COMM_NULL raises ERR_COMM

    def Compare(self, comm: "Comm") -> int:
        """IDENT (the same communicator), CONGRUENT (same members, same order), SIMILAR, UNEQUAL;
        ``comm1.Compare(comm2)`` or mpi4py's ``MPI.Comm.Compare(comm1, comm2)``."""
        if not isinstance(comm, Comm):
            raise TypeError(f"Comm.Compare: expected an MPI.Comm, got {type(comm).__name__}")
        self._c, comm._c   # COMM_NULL raises ERR_COMM
        if self == comm:
            return IDENT
        if self.is_inter or comm.is_inter:
            from shmproxy.mpi.intercomm import compare
            return compare(self, comm)
        a, b = self._wranks, comm._wranks
        if a == b:
            return CONGRUENT
        return SIMILAR if set(a) == set(b) else UNEQUAL

    def _eh_key(self) -> object:
        """What the held error handler is filed under: the native communicator (COMM_NULL raises).
        errhandler.py files it by the id of what this returns, so it must be the object itself: the id
        of a fresh ``id(...)`` int is no stable key."""
        return self._c

    def Get_errhandler(self) -> Any:
        """A new handle to the error handler this communicator holds (ERRORS_RETURN unless set);
        the caller Frees it. Errors are raised as MPI.Exception whatever the handler."""
        from shmproxy.mpi import errhandler
        return errhandler.get(self._eh_key())

    def Set_errhandler(self, errhandler: Any) -> None:
        from shmproxy.mpi import errhandler as eh
        key = self._eh_key()
        eh.set_(key, errhandler)

    def Call_errhandler(self, errorcode: int) -> None:
        """Run the held handler for ``errorcode`` (a handler of the program's own is called with this
        communicator; ERRORS_ARE_FATAL/ERRORS_ABORT abort on an error code; ERRORS_RETURN does nothing)."""
        from shmproxy.mpi import errhandler
        errhandler.call(self, self._eh_key(), errorcode)

    @classmethod
    def Create_errhandler(cls, errhandler_fn: Any) -> Any:
        from shmproxy.mpi import errhandler
        return errhandler.create(errhandler_fn)

    def __bool__(self) -> bool:
        try:
            self._c
        except errors.ProxyError:
            return False
        return True

    def __eq__(self, other: object) -> bool:
        """Handles compare equal when they refer to one communicator (``MPI.Comm(comm) == comm``),
        every null handle (COMM_NULL, a freed one) to every other."""
        if not isinstance(other, Comm):
            return NotImplemented
        if self is other:
            return True
        if not self or not other:
            return not self and not other
        return self._c is other._c

    __hash__ = None  # type: ignore[assignment]  # as mpi4py: free() turns a handle into COMM_NULL in place

    # handles, as mpi4py gives them: an int naming the communicator while some handle of it lives
    # (0 names COMM_NULL); fromhandle gives a handle of the same class (Intracomm, Intercomm, ...)
    @property
    def handle(self) -> int:
        if not self:
            return 0
        _HANDLES[id(self._c)] = self
        return id(self._c)

    @classmethod
    def fromhandle(cls, handle: int) -> "Comm":
        if int(handle) == 0:
            return COMM_NULL
        comm = _HANDLES.get(int(handle))
        if comm is None or not comm:
            raise error(ERR_COMM, f"no communicator has the handle {handle}")
        return type(comm)(comm)

    def __reduce__(self) -> Any:
        """As mpi4py: the predefined communicators unpickle as themselves, a second handle to one of
        them as a handle to it, a null handle as a null handle; any other cannot be pickled."""
        from shmproxy.mpi import env
        for name in ("COMM_NULL", "COMM_WORLD", "COMM_SELF"):
            predefined = COMM_NULL if name == "COMM_NULL" else getattr(env, name)
            if self is predefined:
                return name
        if not self:
            return (type(self), ())
        for predefined in (env.COMM_WORLD, env.COMM_SELF):
            if cached_native(predefined) is not None and self == predefined:
                return (type(self), (predefined,))
        raise ValueError(f"cannot pickle {self!r}: a communicator is no value to send (only the "
                         "predefined ones pickle, by name)")

    def __repr__(self) -> str:
        c = cached_native(self)
        if c is None:
            return f"<MPI.{self._name or 'COMM_NULL'}>"
        return f"<MPI.{type(self).__name__.lstrip('_')} {self._name or 'comm'} rank {c.rank}/{c.size}>"

    # ------------------------------------------------------------------ management
    def _wrap(self, native: Any, cls: type | None = None) -> "Comm":
        """A wrapper for a native child whose ``parent_ranks`` are ranks of this communicator."""
        if native is None:
            return COMM_NULL
        mine = self._wranks
        return (cls or Intracomm)(native, tuple(mine[r] for r in native.parent_ranks))

    def Dup(self, info: Any = None) -> "Comm":
        """A new communicator of the same members; it keeps this one's hints, or ``info``'s."""
        try:
            native = self._c.Dup()
        except errors.ProxyError as exc:
            raise convert(exc) from None
        cls = type(self)
        if cls in (Comm, Intracomm) or not cls.__module__.startswith("shmproxy"):
            # as mpi4py's Dup/Clone: a handle of this class, a subclass of the program's included, made
            # by its __new__ without arguments (no __init__), as mpi4py's New(type(self)) makes it
            dup = cls.__new__(cls)
            Comm.__init__(dup, native, tuple(self._wranks[r] for r in native.parent_ranks))
        else:
            dup = self._wrap(native, Intracomm)     # COMM_WORLD's and COMM_SELF's own classes
        dup._info = dict(info.items()) if info else dict(self._info)
        return dup

    def Dup_with_info(self, info: Any) -> "Comm":
        """A Dup whose hints are ``info``'s only (none for INFO_NULL)."""
        dup = self.Dup()
        dup._info = dict(info.items()) if info else {}
        return dup

    def Idup(self, info: Any = None) -> tuple["Comm", Any]:
        """The Dup, made now (the native Dup is a short collective), and a request that completes at
        once (an active request with nothing to wait for, as a PROC_NULL operation's)."""
        from shmproxy.mpi.request import Request
        return self.Dup(info), Request(proc_null=True)

    def Idup_with_info(self, info: Any) -> tuple["Comm", Any]:
        from shmproxy.mpi.request import Request
        return self.Dup_with_info(info), Request(proc_null=True)

    @classmethod
    def Get_parent(cls) -> Any:
        """No process here was spawned (shmproxy has no Spawn): the null intercommunicator."""
        from shmproxy.mpi.intercomm import Intercomm
        return Intercomm()

    def Clone(self) -> "Comm":
        return self.Dup()

    def Split(self, color: int = 0, key: int = 0) -> "Comm":
        """Collective: communicators of the ranks with the same color, ordered by (key, rank);
        UNDEFINED gives COMM_NULL."""
        color, key = as_int(color, "Split: color"), as_int(key, "Split: key")   # a bool color too, as mpi4py
        try:
            return self._wrap(self._c.Split(color, key))
        except errors.ProxyError as exc:
            raise convert(exc) from None

    def Split_type(self, split_type: int, key: int = 0, info: Any = None) -> "Comm":
        """COMM_TYPE_SHARED: the ranks of this node, which on one node is everyone."""
        from shmproxy.mpi.env import COMM_TYPE_SHARED
        split_type = as_int(split_type, "Split_type: split_type")
        if split_type == UNDEFINED:
            return self.Split(UNDEFINED, key)
        if split_type != COMM_TYPE_SHARED:
            unsupported(f"Comm.Split_type({split_type})", "only COMM_TYPE_SHARED exists")
        return self.Split(0, key)

    def Create(self, group: Group) -> "Comm":
        """Collective over this communicator: a communicator of ``group`` (a subset of it, in group
        order) on its members, COMM_NULL elsewhere; built with Split."""
        self._check_group(group, "Create")
        key = group._index.get(self._wranks[self._c.rank])
        return self.Split(UNDEFINED if key is None else 0, key or 0)

    def _check_group(self, group: Group, what: str) -> None:
        if not isinstance(group, Group):
            raise error(ERR_ARG, f"Comm.{what}: expected an MPI.Group, got {type(group).__name__}")
        mine = set(self._wranks)
        if any(w not in mine for w in group.members):
            raise error(ERR_ARG, f"Comm.{what}: the group has processes outside this communicator")

    def Create_group(self, group: Group, tag: int = 0) -> "Comm":
        """Collective over the members of ``group`` only (not the whole communicator): the members
        derive the same new communicator id from this communicator, the group and ``tag``, and join
        it without a collective over this communicator."""
        self._check_group(group, "Create_group")
        tag = as_int(tag, "Create_group: tag", ERR_TAG)   # in the new id: True and 1 must agree
        me = self._wranks[self._c.rank]
        if me not in group._index:
            return COMM_NULL
        index = {w: i for i, w in enumerate(self._wranks)}
        ranks = [index[w] for w in group.members]
        try:
            native = _member_comm(self._c, ranks, f"group/{tag}")
        except errors.ProxyError as exc:
            raise convert(exc) from None
        return Intracomm(native, tuple(group.members))

    # MPI 4.1's buffers attached to one communicator: the process's buffer (MPI.Attach_buffer) serves
    # every communicator here
    def Attach_buffer(self, buf: Any) -> None:
        _per_comm_buffer("Attach_buffer")

    def Detach_buffer(self) -> Any:
        _per_comm_buffer("Detach_buffer")

    def Flush_buffer(self) -> None:
        _per_comm_buffer("Flush_buffer")

    def Iflush_buffer(self) -> Any:
        _per_comm_buffer("Iflush_buffer")

    def Free(self) -> None:
        """Run the attributes' delete callbacks, then close this rank's part of the communicator
        (pending sends complete first)."""
        attributes.free_all(self._attr_owner(), self, f"{type(self).__name__}.Free")
        c = self._c
        from shmproxy.mpi import errhandler
        errhandler.forget(c)
        try:
            c.close()
        except errors.ProxyError as exc:
            raise convert(exc) from None
        finally:
            object.__delattr__(self, "_c")

    def free(self) -> None:
        """mpi4py's safe free: COMM_NULL, COMM_WORLD and COMM_SELF stay themselves; a second handle of
        one of them becomes null (the communicator stays); any other communicator is freed."""
        from shmproxy.mpi import env
        native = cached_native(self)
        if native is None or self is env.COMM_WORLD or self is env.COMM_SELF:
            return
        if any(cached_native(p) is native for p in (env.COMM_WORLD, env.COMM_SELF)):
            object.__delattr__(self, "_c")
            return
        self.Free()

    def Disconnect(self) -> None:
        self.Free()

    def Abort(self, errorcode: int = 0) -> None:
        """Fail the communicator on every rank, then end this process with exit status ``errorcode``
        (1 for 0, so that an abort never reads as success), as MPI_Abort ends the job; the other
        ranks get Aborted errors naming this call."""
        errorcode = as_int(errorcode, "Abort: errorcode")
        sys.stdout.flush()
        sys.stderr.flush()
        try:
            self._c.Abort(f"MPI.Abort({errorcode}) called by rank {self._c.rank}")
        finally:
            os._exit(errorcode & 0xFF or 1)

    # ------------------------------------------------------------------ objects (lower case)
    def bcast(self, obj: Any = None, root: int = 0) -> Any:
        from shmproxy.mpi.commlock import _comm_lock
        with _comm_lock(self, "bcast"):    # as mpi4py: threads' bcasts on one communicator take turns
            return self._obj(objcoll.bcast, obj, self._root(root))

    def gather(self, sendobj: Any, root: int = 0) -> list | None:
        return self._obj(objcoll.gather, sendobj, self._root(root))

    def allgather(self, sendobj: Any) -> list:
        return self._obj(objcoll.allgather, sendobj)

    def allreduce(self, sendobj: Any, op: Any = SUM) -> Any:
        return self._obj(objcoll.allreduce, sendobj, as_op(op, "allreduce"))

    def reduce(self, sendobj: Any, op: Any = SUM, root: int = 0) -> Any:
        """The native object layer has allreduce only: every rank computes the same reduction (in rank
        order), the root returns it, the others None."""
        root = self._root(root)
        value = self._obj(objcoll.allreduce, sendobj, as_op(op, "reduce"))
        return value if self._c.rank == root else None

    def barrier(self) -> None:
        self._obj(objcoll.barrier)

    def _obj(self, fn: Any, *args: Any) -> Any:
        try:
            return fn(self._c, *args)
        except errors.ProxyError as exc:
            raise convert(exc) from None

    # The object collectives the native object layer lacks, built on its allgather and bcast: every
    # object is pickled once and the results are computed in rank order, as mpi4py defines them.
    def scatter(self, sendobj: Any = None, root: int = 0) -> Any:
        """The root's ``sendobj`` (a sequence of one object per rank): this rank's item."""
        root = self._root(root)
        c = self._c
        if c.rank == root:   # None stands for one None per rank, as in mpi4py
            items = [None] * c.size if sendobj is None else list(sendobj)
            if len(items) != c.size:
                raise error(ERR_ARG, f"scatter: the root needs a sequence of {c.size} objects, got "
                            f"{len(items)}")
        else:
            items = None
        return self._obj(objcoll.bcast, items, root)[c.rank]

    def alltoall(self, sendobj: Any) -> list:
        """Item j of this rank's ``sendobj`` goes to rank j; the result holds one item per rank."""
        c = self._c
        items = [None] * c.size if sendobj is None else list(sendobj)   # None: one None per rank
        if len(items) != c.size:
            raise error(ERR_ARG, f"alltoall: expected a sequence of {c.size} objects, got {len(items)}")
        return [row[c.rank] for row in self._obj(objcoll.allgather, items)]

    def scan(self, sendobj: Any, op: Any = SUM) -> Any:
        """The reduction of ranks 0..rank's objects (inclusive), in rank order."""
        o = as_op(op, "scan")
        values = self._obj(objcoll.allgather, sendobj)[:self._c.rank + 1]
        acc = values[0]
        for v in values[1:]:
            acc = o(acc, v)
        return acc

    def exscan(self, sendobj: Any, op: Any = SUM) -> Any:
        """The reduction of ranks 0..rank-1's objects; None on rank 0."""
        o = as_op(op, "exscan")
        values = self._obj(objcoll.allgather, sendobj)[:self._c.rank]
        if not values:
            return None
        acc = values[0]
        for v in values[1:]:
            acc = o(acc, v)
        return acc

    def _root(self, root: Any) -> int:
        root = as_int(root, "root", ERR_ROOT)
        if not 0 <= root < self._c.size:
            raise error(ERR_ROOT, f"root {root!r} is not a rank of this communicator of {self._c.size}")
        return root


class Intracomm(Comm, PartitionedP2P):
    """An intracommunicator (every communicator here is one)."""

    __slots__ = ()

    def Create_cart(self, dims: Any, periods: Any = None, reorder: bool = False) -> Any:
        from shmproxy.mpi.topology import create_cart
        return create_cart(self, dims, periods, reorder)

    def Create_graph(self, index: Any, edges: Any, reorder: bool = False) -> Any:
        from shmproxy.mpi.graph import create_graph
        return create_graph(self, index, edges, reorder)

    def Create_dist_graph_adjacent(self, *a: Any, **k: Any) -> Any:
        from shmproxy.mpi.graph import create_dist_graph_adjacent
        return create_dist_graph_adjacent(self, *a, **k)

    def Create_dist_graph(self, *a: Any, **k: Any) -> Any:
        from shmproxy.mpi.graph import create_dist_graph
        return create_dist_graph(self, *a, **k)

    def Cart_map(self, dims: Any, periods: Any = None) -> int:
        from shmproxy.mpi.topology import cart_map
        return cart_map(self, dims, periods)

    def Graph_map(self, index: Any, edges: Any) -> int:
        from shmproxy.mpi.graph import graph_map
        return graph_map(self, index, edges)

    def Create_intercomm(self, local_leader: int, peer_comm: Any, remote_leader: int, tag: int = 0) -> Any:
        from shmproxy.mpi.intercomm import create_intercomm
        return create_intercomm(self, local_leader, peer_comm, remote_leader, tag)

    @classmethod
    def Create_from_group(cls, group: Group, stringtag: str = "org.mpi4py", info: Any = None,
                          errhandler: Any = None) -> "Intracomm":
        """MPI 4's communicator from a group alone, joined by the group's members only (the members
        derive one id from the group and ``stringtag``, as Create_group does from its parent)."""
        from shmproxy.mpi.env import _native_world
        if not isinstance(group, Group):
            raise error(ERR_ARG, f"Create_from_group: expected an MPI.Group, got {type(group).__name__}")
        if not isinstance(stringtag, str):
            raise TypeError(f"Create_from_group: stringtag is a str, not {type(stringtag).__name__}")
        world = _native_world()
        if world.rank not in group._index:
            raise error(ERR_ARG, f"Create_from_group: rank {world.rank} of COMM_WORLD is not in the group")
        try:
            native = _member_comm(world, list(group.members), f"from_group/{stringtag}")
        except errors.ProxyError as exc:
            raise convert(exc) from None
        comm = cls(native, tuple(group.members))
        comm._info = dict(info.items()) if info else {}
        return comm

    def Spawn(self, *a: Any, **k: Any) -> Any:
        unsupported("Intracomm.Spawn", "dynamic processes are not part of shmproxy")

    Spawn_multiple = Accept = Connect = Spawn


def _per_comm_buffer(call: str) -> None:
    unsupported(f"Comm.{call}", "MPI 4.1's buffers of one communicator; the process's buffer "
                "(MPI.Attach_buffer) serves every communicator")


def cached_native(comm: Comm) -> Any:
    """The native communicator of a wrapper, or None, without initialising COMM_WORLD or COMM_SELF
    (reads the slot directly: ``comm._c`` would fall back to their __getattr__)."""
    slot = Comm.__dict__["_c"]
    try:
        return slot.__get__(comm, type(comm))
    except AttributeError:
        return None


def _member_comm(parent: Any, ranks: list[int], salt: str) -> Any:
    """A native communicator of ``ranks`` (ranks of ``parent``), joined by those ranks only: the
    second half of the native Split, given the members instead of an Allgather of colors. Each
    call on the same members and salt gets a new id (a per-communicator counter, advanced alike on
    every member since they call in the same order)."""
    from shmproxy.control import bootstrap
    from shmproxy.rank.comm import Comm as NativeComm
    counters = parent.__dict__.setdefault("_mpi_member_counts", {})
    n = counters[(tuple(ranks), salt)] = counters.get((tuple(ranks), salt), 0) + 1
    text = f"{parent._comm_id}/{salt}/{n}/{','.join(map(str, ranks))}"
    digest = hashlib.blake2b(text.encode(), digest_size=4).digest()
    comm_id = int.from_bytes(digest, "little") & 0x7FFFFFFF or 1
    me = ranks.index(parent.rank)
    info = bootstrap.LaunchInfo(rank=me, size=len(ranks), local_rank=me, local_size=len(ranks),
                                launcher="split")
    child = NativeComm._create(info, parent.params, comm_id, key=parent._job_key)
    child.parent_ranks = list(ranks)
    return child


COMM_NULL = Comm()
_HANDLES: "weakref.WeakValueDictionary[int, Comm]" = weakref.WeakValueDictionary()
