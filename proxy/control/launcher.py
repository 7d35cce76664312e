"""Launcher detection: which rank of how many this process is, and which local rank on this host.

``detect()`` is re-exported by shmproxy.control.bootstrap, step 1 of the rendezvous story told there.

Which launcher wins
-------------------
Launchers nest, and the variables of the outer one leak into everything started inside it: ``srun``
sets SLURM_* for whatever it starts, including an ``mpirun`` or a ``torchrun`` that then starts the
real ranks, and ``mpirun -npernode 1 torchrun ...`` / ``srun torchrun ...`` are the usual multi-node
torchrun recipes. The innermost launcher is the one that started *this* process, so the order is,
innermost first::

    explicit (rank=/size= given to detect)  >  torchrun  >  Open MPI  >  MPICH/Hydra, Intel MPI (PMI_*)
      >  Slurm srun  >  singleton (no launcher: rank 0 of 1)

torchrun comes first because it is an agent that forks the workers itself: when its variables are
present it is always the innermost (the reverse nesting, torchrun starting mpirun, is not a recipe
anyone uses; if it happens, pass rank=/size= explicitly). Open MPI precedes PMI_* because PMI_RANK is
also what Slurm's PMI-2 plugin sets, while OMPI_* is unambiguous. Slurm is last: it is the resource
manager, outermost by nature. When two launchers are present and disagree on rank or size, a WARNING
on the BOOTSTRAP logger names both and says which one was used.

Slurm counts only for srun tasks (SLURM_STEP_ID set, and not a batch/extern/interactive step): a
batch script or an ``salloc`` shell has SLURM_PROCID=0 and SLURM_NTASKS=N too, and a plain ``python``
started there is a singleton, not rank 0 of N.

Partial information
-------------------
- A launcher with only one of rank/size (``RANK`` without ``WORLD_SIZE``), or only one of its local
  pair (``LOCAL_RANK`` without ``LOCAL_WORLD_SIZE``), is a configuration error: ``InvalidArgument``
  naming the missing variable. Any variable that we read and cannot parse is ``InvalidArgument`` too.
  The chosen launcher's errors raise; a lower-precedence launcher's errors only log a WARNING (its
  variables may be stale leftovers that we are not going to use).
- A launcher with neither local variable (e.g. ``RANK``/``WORLD_SIZE`` set by a custom script for
  torch's ``env://``, or ``srun --mpi=pmi2`` which sets PMI_RANK but not MPI_LOCALRANKID) takes the
  local pair from another present launcher that agrees on rank and size (here SLURM_LOCALID). If none
  does, all ranks are assumed to be on this host (local_rank = rank, local_size = size) and, when
  size > 1, a WARNING says so: a wrong assumption is caught by the host-identity check at the
  service Init (or by the bounded connect wait), never a silent hang.
- Explicit ``rank=``/``size=`` go together, and so do ``local_rank=``/``local_size=``. The local pair
  alone overrides just the local fields of whatever launcher was detected.

Environment
-----------
Nothing here reads ``SHMPROXY_*`` (that is params' job). The launcher's variables are not ours; every
function that reads them takes ``env`` (default ``os.environ``) so that tests pass plain dicts.
"""
from __future__ import annotations

import dataclasses
import os
import re
from dataclasses import dataclass
from typing import Any, Callable, Mapping

from shmproxy.core import log
from shmproxy.core.errors import InvalidArgument

_LOG = log.get("BOOTSTRAP")

LAUNCHERS = ("explicit", "torchrun", "openmpi", "mpich", "slurm", "singleton")
"""Every value of ``LaunchInfo.launcher``, in precedence order."""

# Slurm's special step ids (slurm.h): SLURM_PENDING_STEP .. SLURM_BATCH_SCRIPT, INTERACTIVE, EXTERN.
_SLURM_SPECIAL_STEP_MIN = 0xFFFFFFF0


@dataclass(frozen=True)
class LaunchInfo:
    """Where this process stands in the job, as the launcher (or the caller) said."""

    rank: int
    size: int
    local_rank: int
    local_size: int
    launcher: str
    """'explicit', 'torchrun', 'openmpi', 'mpich', 'slurm' or 'singleton'."""
    master_addr: str | None = None
    """MASTER_ADDR if set (whatever the launcher): where the future TCP store lives."""
    master_port: int | None = None

    def __str__(self) -> str:
        return (f"rank {self.rank}/{self.size} local {self.local_rank}/{self.local_size}"
                f" via {self.launcher}")


# --------------------------------------------------------------------------------------------------
# Reading the launchers' variables


@dataclass(frozen=True)
class _Reading:
    """What one launcher's variables say; ``where`` names the variable behind each field."""

    launcher: str
    rank: int
    size: int
    local_rank: int | None
    local_size: int | None
    where: Mapping[str, str]


def _int(env: Mapping[str, str], var: str) -> int | None:
    raw = env.get(var)
    if raw is None:
        return None
    try:
        return int(raw.strip())
    except ValueError:
        raise InvalidArgument(f"{var}={raw!r} is not an integer") from None


def _first(env: Mapping[str, str], names: tuple[str, ...]) -> str | None:
    return next((n for n in names if n in env), None)


def _global(env: Mapping[str, str], launcher: str, rank_var: str,
            size_vars: tuple[str, ...]) -> tuple[int, int, dict[str, str]] | None:
    """(rank, size, where) of one launcher; None if its variables are absent."""
    size_var = _first(env, size_vars)
    if rank_var not in env and size_var is None:
        return None
    if size_var is None:
        raise InvalidArgument(f"{rank_var} is set but {' / '.join(size_vars)} is not ({launcher})")
    if rank_var not in env:
        raise InvalidArgument(f"{size_var} is set but {rank_var} is not ({launcher})")
    rank, size = _int(env, rank_var), _int(env, size_var)
    assert rank is not None and size is not None
    return rank, size, {"rank": f"{rank_var}={env[rank_var]}", "size": f"{size_var}={env[size_var]}"}


def _reading(launcher: str, found: tuple[int, int, dict[str, str]],
             local_rank: tuple[int | None, str], local_size: tuple[int | None, str]) -> _Reading:
    """Combine the global pair with the local pair; each local item is (value or None, its name or
    "VAR=value"). One local item without the other is an error naming the missing one."""
    rank, size, where = found
    (lrank, lrank_name), (lsize, lsize_name) = local_rank, local_size
    if (lrank is None) != (lsize is None):
        have, missing = (lrank_name, lsize_name) if lrank is not None else (lsize_name, lrank_name)
        raise InvalidArgument(f"{have} is set but {missing} is not ({launcher}); set both or neither")
    if lrank is not None:
        where = {**where, "local_rank": lrank_name, "local_size": lsize_name}
    return _Reading(launcher, rank, size, lrank, lsize, where)


def _named(env: Mapping[str, str], var: str) -> tuple[int | None, str]:
    return _int(env, var), (f"{var}={env[var]}" if var in env else var)


def _simple(env: Mapping[str, str], launcher: str, rank_var: str, size_var: str,
            local_rank_var: str, local_size_var: str) -> _Reading | None:
    found = _global(env, launcher, rank_var, (size_var,))
    if found is None:
        return None
    return _reading(launcher, found, _named(env, local_rank_var), _named(env, local_size_var))


def _read_torchrun(env: Mapping[str, str]) -> _Reading | None:
    return _simple(env, "torchrun", "RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE")


def _read_openmpi(env: Mapping[str, str]) -> _Reading | None:
    return _simple(env, "openmpi", "OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE",
                   "OMPI_COMM_WORLD_LOCAL_RANK", "OMPI_COMM_WORLD_LOCAL_SIZE")


def _read_mpich(env: Mapping[str, str]) -> _Reading | None:
    return _simple(env, "mpich", "PMI_RANK", "PMI_SIZE", "MPI_LOCALRANKID", "MPI_LOCALNRANKS")


_SLURM_TPN_HINT = ("a usable SLURM_STEP_TASKS_PER_NODE / SLURM_TASKS_PER_NODE / SLURM_NTASKS_PER_NODE"
                   " (matching the step's task count)")
_TASKS_ITEM = re.compile(r"(\d+)(?:\(x(\d+)\))?")


def parse_tasks_per_node(text: str, var: str = "SLURM_TASKS_PER_NODE") -> list[int]:
    """Expand Slurm's compressed tasks-per-node list: '4(x2),3' -> [4, 4, 3].

    Raises InvalidArgument naming ``var`` when the text is malformed.
    """
    counts: list[int] = []
    for item in text.strip().split(","):
        m = _TASKS_ITEM.fullmatch(item.strip())
        if m is None or int(m.group(1)) < 1 or (m.group(2) is not None and int(m.group(2)) < 1):
            raise InvalidArgument(f"{var}={text!r} is not a tasks-per-node list like '4(x2),3'")
        counts.extend([int(m.group(1))] * int(m.group(2) or 1))
    return counts


def _slurm_local_size(env: Mapping[str, str], size: int) -> tuple[int | None, str | None]:
    """This node's task count, from the most specific variable that describes this step.

    SLURM_STEP_TASKS_PER_NODE describes the step; SLURM_TASKS_PER_NODE may describe the whole
    allocation, so a list whose total is not the step's size is skipped rather than trusted.
    """
    node = _int(env, "SLURM_NODEID")
    for var in ("SLURM_STEP_TASKS_PER_NODE", "SLURM_TASKS_PER_NODE", "SLURM_NTASKS_PER_NODE"):
        if var not in env:
            continue
        counts = parse_tasks_per_node(env[var], var)
        if var != "SLURM_NTASKS_PER_NODE" and sum(counts) != size:
            _LOG.debug("%s=%s totals %d, not the step's %d tasks; not used", var, env[var], sum(counts), size)
            continue
        if node is None:
            if len(set(counts)) != 1:
                raise InvalidArgument(f"{var}={env[var]} differs per node but SLURM_NODEID is not set")
            return counts[0], f"{var}={env[var]}"
        if len(counts) == 1:
            return counts[0], f"{var}={env[var]}"
        if not 0 <= node < len(counts):
            raise InvalidArgument(f"SLURM_NODEID={node} is out of range for {var}={env[var]}")
        return counts[node], f"{var}={env[var]} at SLURM_NODEID={node}"
    return None, None


def _read_slurm(env: Mapping[str, str]) -> _Reading | None:
    if "SLURM_PROCID" not in env:
        return None
    step_var = _first(env, ("SLURM_STEP_ID", "SLURM_STEPID"))
    step = env.get(step_var, "") if step_var else ""
    if not step.strip().isdigit() or int(step) >= _SLURM_SPECIAL_STEP_MIN:
        _LOG.info("SLURM_PROCID is set but this is not an srun task (%s); Slurm's variables ignored",
                  f"{step_var}={step}" if step_var else "no SLURM_STEP_ID")
        return None
    found = _global(env, "slurm", "SLURM_PROCID", ("SLURM_STEP_NUM_TASKS", "SLURM_NTASKS", "SLURM_NPROCS"))
    assert found is not None
    local_rank = _named(env, "SLURM_LOCALID")
    local_size: tuple[int | None, str] = (None, _SLURM_TPN_HINT)
    if local_rank[0] is not None:
        n, where = _slurm_local_size(env, found[1])
        if n is not None and where is not None:
            local_size = (n, where)
    return _reading("slurm", found, local_rank, local_size)


_READERS: tuple[tuple[str, Callable[[Mapping[str, str]], _Reading | None]], ...] = (
    ("torchrun", _read_torchrun),
    ("openmpi", _read_openmpi),
    ("mpich", _read_mpich),
    ("slurm", _read_slurm),
)


def _check_int(name: str, value: Any) -> int:
    if not isinstance(value, int) or isinstance(value, bool):
        raise InvalidArgument(f"{name}= must be an int, got {value!r}")
    return value


def _validate(r: _Reading) -> None:
    w = r.where
    assert r.local_rank is not None and r.local_size is not None
    if r.size < 1:
        raise InvalidArgument(f"size must be at least 1 ({w['size']})")
    if not 0 <= r.rank < r.size:
        raise InvalidArgument(f"rank {r.rank} is out of range [0, {r.size}) ({w['rank']}, {w['size']})")
    if not 1 <= r.local_size <= r.size:
        raise InvalidArgument(f"local size {r.local_size} is out of range [1, {r.size}]"
                              f" ({w['local_size']}, {w['size']})")
    if not 0 <= r.local_rank < r.local_size:
        raise InvalidArgument(f"local rank {r.local_rank} is out of range [0, {r.local_size})"
                              f" ({w['local_rank']}, {w['local_size']})")


def _master(env: Mapping[str, str]) -> tuple[str | None, int | None]:
    addr = env.get("MASTER_ADDR", "").strip() or None
    port = _int(env, "MASTER_PORT")
    if port is not None and not 1 <= port <= 65535:
        raise InvalidArgument(f"MASTER_PORT={env['MASTER_PORT']!r} is not a TCP port (1-65535)")
    return addr, port


def detect(env: Mapping[str, str] | None = None, *, rank: int | None = None, size: int | None = None,
           local_rank: int | None = None, local_size: int | None = None) -> LaunchInfo:
    """Rank, size, local rank and local size of this process, from the launcher or the arguments.

    ``rank``/``size`` (together) and ``local_rank``/``local_size`` (together) override whatever the
    environment says; see the module docstring for the launcher precedence and the fallbacks.
    Reads only the launcher variables named there, never SHMPROXY_*. Pure apart from logging.

    Raises InvalidArgument for an unparsable variable, a launcher with half its variables, an
    argument that is not an int, or values out of range (0 <= rank < size,
    0 <= local_rank < local_size <= size); the message names the variable or argument.
    """
    env = os.environ if env is None else env
    given = {"rank": rank, "size": size, "local_rank": local_rank, "local_size": local_size}
    for name, value in given.items():
        if value is not None:
            _check_int(name, value)
    if (rank is None) != (size is None):
        raise InvalidArgument("rank= and size= go together: pass both or neither")
    if (local_rank is None) != (local_size is None):
        raise InvalidArgument("local_rank= and local_size= go together: pass both or neither")

    readings: list[_Reading] = []
    for name, reader in _READERS:
        try:
            r = reader(env)
        except InvalidArgument as exc:
            if rank is None and not readings:
                raise  # this launcher would be the one we use
            _LOG.warning("ignoring %s's variables (%s is used): %s", name,
                         "explicit rank/size" if rank is not None else readings[0].launcher, exc)
            continue
        if r is not None:
            readings.append(r)

    chosen: _Reading
    if rank is not None:
        assert size is not None
        chosen = _Reading("explicit", rank, size, None, None,
                          {"rank": f"rank={rank}", "size": f"size={size}"})
        others = readings
        if readings:
            _LOG.info("explicit rank=%d size=%d; launcher variables of %s not used", rank, size,
                      ", ".join(r.launcher for r in readings))
    elif readings:
        chosen, others = readings[0], readings[1:]
        for o in others:
            if (o.rank, o.size) != (chosen.rank, chosen.size):
                _LOG.warning("launchers disagree: %s says rank %d of %d (%s, %s) but %s says rank %d of %d"
                             " (%s, %s); using %s (precedence %s)",
                             chosen.launcher, chosen.rank, chosen.size, chosen.where["rank"],
                             chosen.where["size"], o.launcher, o.rank, o.size, o.where["rank"],
                             o.where["size"], chosen.launcher, " > ".join(LAUNCHERS[1:-1]))
    else:
        chosen = _Reading("singleton", 0, 1, 0, 1, {"rank": "no launcher", "size": "no launcher",
                                                    "local_rank": "no launcher", "local_size": "no launcher"})
        others = []

    if local_rank is not None:
        chosen = dataclasses.replace(chosen, local_rank=local_rank, local_size=local_size, where={
            **chosen.where, "local_rank": f"local_rank={local_rank}",
            "local_size": f"local_size={local_size}"})
    elif chosen.local_rank is None:
        donor = next((o for o in others if o.local_rank is not None
                      and (o.rank, o.size) == (chosen.rank, chosen.size)), None)
        if donor is not None:
            _LOG.info("local rank/size of %s from %s (%s, %s)", chosen.launcher, donor.launcher,
                      donor.where["local_rank"], donor.where["local_size"])
            chosen = dataclasses.replace(chosen, local_rank=donor.local_rank, local_size=donor.local_size,
                                         where={**chosen.where, "local_rank": donor.where["local_rank"],
                                                "local_size": donor.where["local_size"]})
        else:
            if chosen.size > 1:
                _LOG.warning("%s gives no local rank/size: assuming all %d ranks run on this host"
                             " (for several hosts, set the launcher's local variables or pass"
                             " local_rank=/local_size=)", chosen.launcher, chosen.size)
            chosen = dataclasses.replace(chosen, local_rank=chosen.rank, local_size=chosen.size, where={
                **chosen.where, "local_rank": f"assumed from {chosen.where['rank']}",
                "local_size": f"assumed from {chosen.where['size']}"})

    _validate(chosen)
    addr, port = _master(env)
    assert chosen.local_rank is not None and chosen.local_size is not None
    info = LaunchInfo(chosen.rank, chosen.size, chosen.local_rank, chosen.local_size, chosen.launcher,
                      addr, port)
    _LOG.info("%s (%s)", info, ", ".join(dict.fromkeys(chosen.where.values())))
    return info
