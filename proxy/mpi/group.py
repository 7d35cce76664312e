"""MPI.Group in pure Python: an ordered tuple of processes, named by their rank in COMM_WORLD.

Every communicator of the MPI layer knows the world ranks of its members (comm.py), so a group is
just that tuple plus this process's world rank; the set operations follow MPI's ordering rules
(Union: the first group's order, then the second's new members; Intersection and Difference: the
first group's order). Nothing here communicates.
"""
from __future__ import annotations

from typing import Any, Iterable, Sequence

from shmproxy.core.ops import UNDEFINED
from shmproxy.mpi.exceptions import ERR_ARG, ERR_GROUP, ERR_RANK, as_int, error
from shmproxy.mpi.handles import HandleNumber, Numbers
from shmproxy.mpi.status import PROC_NULL

IDENT, CONGRUENT, SIMILAR, UNEQUAL = 0, 1, 2, 3


class Group(HandleNumber):
    """A group of processes: ``size``, ``rank`` (UNDEFINED if this process is not a member)."""

    __slots__ = ("_members", "_me", "_index", "_null", "_h", "__weakref__")
    _members: tuple[int, ...]   # world ranks, in group order
    _me: int                    # this process's world rank
    _index: dict[int, int]      # world rank -> rank in the group
    _null: bool
    _h: Group

    def __init__(self, members: "Iterable[int] | Group | None" = None, me: int = -1):
        """``Group()`` is a null handle and ``Group(group)`` a second handle to ``group``, as in mpi4py;
        the layer makes groups from their members."""
        # _h: the group whose handle this object is (a second handle, Group(g), shares g's number)
        self._h = self
        if isinstance(members, Group):
            me, null, self._h, members = members._me, members._null, members._h, members._members
        elif members is None or isinstance(members, (tuple, list, range)):
            null = members is None
        else:   # as mpi4py's: a handle of another class, a number or a string is no group
            raise TypeError(f"MPI.Group() takes an MPI.Group, not {type(members).__name__}")
        self._null = null
        self._members = tuple(int(m) for m in (members or ()))
        if len(set(self._members)) != len(self._members):
            raise error(ERR_GROUP, f"a group lists a process twice: {self._members}")
        self._me = me
        self._index = {m: i for i, m in enumerate(self._members)}

    # ---- queries
    def Get_size(self) -> int:
        self._valid("Get_size")
        return len(self._members)

    def Get_rank(self) -> int:
        self._valid("Get_rank")
        return self._index.get(self._me, UNDEFINED)

    def _valid(self, what: str) -> None:
        if self._null:
            raise error(ERR_GROUP, f"Group.{what}: invalid group (MPI.GROUP_NULL, or freed)")

    @property
    def size(self) -> int:
        return len(self._members)

    @property
    def rank(self) -> int:
        return self.Get_rank()

    @property
    def members(self) -> tuple[int, ...]:
        """The members' ranks in COMM_WORLD, in group order."""
        return self._members

    def Translate_ranks(self, ranks: Sequence[int] | None = None, group: "Group | None" = None) -> list[int]:
        """The ranks in ``group`` of the processes with ``ranks`` in this group (UNDEFINED where absent;
        PROC_NULL stays PROC_NULL). ``ranks`` None: every rank; ``group`` None: the ranks in COMM_WORLD."""
        ranks = range(self.size) if ranks is None else ranks
        out = []
        for r in ranks:
            r = self._check_rank(r)
            if r == PROC_NULL:
                out.append(PROC_NULL)
                continue
            p = self._members[r]
            out.append(p if group is None else group._index.get(p, UNDEFINED))
        return out

    def Compare(self, other: "Group") -> int:
        """IDENT (same members, same order), SIMILAR (same members), else UNEQUAL."""
        _check_group(other)
        self._valid("Compare")
        other._valid("Compare")
        if self._members == other._members:
            return IDENT
        if set(self._members) == set(other._members):
            return SIMILAR
        return UNEQUAL

    # ---- constructors
    def Incl(self, ranks: Sequence[int]) -> "Group":
        return self._make([self._members[self._check_rank(r, null=False)] for r in ranks])

    def Excl(self, ranks: Sequence[int]) -> "Group":
        drop = {self._check_rank(r, null=False) for r in ranks}
        if len(drop) != len(list(ranks)):
            raise error(ERR_RANK, f"Group.Excl: a rank is listed twice in {list(ranks)}")
        return self._make([m for i, m in enumerate(self._members) if i not in drop])

    def Range_incl(self, ranges: Sequence[Sequence[int]]) -> "Group":
        return self.Incl(self._expand(ranges, "Range_incl"))

    def Range_excl(self, ranges: Sequence[Sequence[int]]) -> "Group":
        return self.Excl(self._expand(ranges, "Range_excl"))

    def Union(self, other: "Group") -> "Group":
        _check_group(other)
        return self._make(list(self._members) + [m for m in other._members if m not in self._index])

    def Intersection(self, other: "Group") -> "Group":
        _check_group(other)
        return self._make([m for m in self._members if m in other._index])

    def Difference(self, other: "Group") -> "Group":
        _check_group(other)
        return self._make([m for m in self._members if m not in other._index])

    def Dup(self) -> "Group":
        return self._make(self._members)

    def Free(self) -> None:
        """The handle becomes the null group (groups hold no other resources)."""
        if self is GROUP_NULL or self is GROUP_EMPTY:
            raise error(ERR_GROUP, f"MPI.{'GROUP_NULL' if self is GROUP_NULL else 'GROUP_EMPTY'} is "
                        "predefined and cannot be freed")
        self._members, self._index, self._null = (), {}, True

    def free(self) -> None:
        """mpi4py's safe free: GROUP_EMPTY and GROUP_NULL stay themselves; any other handle (a
        second handle of GROUP_EMPTY too) becomes null."""
        if self is not GROUP_NULL and self is not GROUP_EMPTY:
            self._members, self._index, self._null = (), {}, True

    def __bool__(self) -> bool:
        return not self._null

    def __reduce__(self) -> Any:
        """As mpi4py: the predefined groups unpickle as themselves, a null handle as a null handle, an
        empty group as a handle to GROUP_EMPTY; any other cannot be pickled (it names processes)."""
        if self is GROUP_NULL:
            return "GROUP_NULL"
        if self is GROUP_EMPTY:
            return "GROUP_EMPTY"
        if self._null:
            return (type(self), ())     # type(self): a subclass of the program's unpickles as itself
        if not self._members:
            return (type(self), (GROUP_EMPTY,))
        raise ValueError(f"cannot pickle {self!r}: a group of processes is no value to send")

    # handles, as mpi4py gives them: a group is a value (its members), so the number names this
    # object while it lives (0 names GROUP_NULL); fromhandle gives an equal group
    @property
    def handle(self) -> int:
        return _NUMBERS.number(None if self._null else self._h)

    @classmethod
    def fromhandle(cls, handle: Any) -> "Group":
        g = _NUMBERS.lookup(handle)
        return cls() if g is None else cls(g)

    # ---- helpers
    def _make(self, members: Sequence[int]) -> "Group":
        return Group(members, self._me)

    def _check_rank(self, r: Any, null: bool = True) -> int:
        if type(r) is not int:
            r = as_int(r, "a group rank")
        if null and r == PROC_NULL:
            return r
        if not 0 <= r < len(self._members):
            raise error(ERR_RANK, f"rank {r} is not in a group of {len(self._members)}")
        return r

    def _expand(self, ranges: Sequence[Sequence[int]], what: str) -> list[int]:
        out: list[int] = []
        for rng in ranges:
            try:
                first, last, stride = rng
            except (TypeError, ValueError):
                raise error(ERR_ARG, f"Group.{what}: each range is (first, last, stride), "
                            f"got {rng!r}") from None
            first, last, stride = (as_int(x, f"Group.{what}: a range's item") for x in (first, last, stride))
            if stride == 0:
                raise error(ERR_ARG, f"Group.{what}: stride 0 in {rng!r}")
            out.extend(range(first, last + (1 if stride > 0 else -1), stride))
        return out

    def __eq__(self, other: object) -> bool:
        """Null handles equal each other only; groups, by their members in order."""
        if not isinstance(other, Group):
            return NotImplemented
        if self._null or other._null:
            return self._null and other._null
        return self._members == other._members

    __hash__ = None  # type: ignore[assignment]

    def __repr__(self) -> str:
        return "<MPI.GROUP_NULL>" if self._null else f"<MPI.Group {list(self._members)}>"


def _check_group(g: Any) -> None:
    if not isinstance(g, Group):
        raise error(ERR_GROUP, f"expected an MPI.Group, got {type(g).__name__}")


_NUMBERS = Numbers("group", ERR_GROUP)
GROUP_EMPTY = Group(())
GROUP_NULL = Group()
