"""Bootstrap: who am I in the job, which job is it, and where do the ranks of one host meet.

The rendezvous story
--------------------
1. ``detect()`` reads the launcher's variables (DESIGN.md section 9) and says which rank of how many
   this process is, and which local rank of how many on this host.
2. ``job_key()`` derives a 16-hex-digit key that every rank of the job on this host computes alike and
   that differs between two jobs of the same user. ``run_dir()`` is a private 0700 directory of ours.
3. On one node, every local rank connects to the service socket of the progress process at the
   deterministic path ``service_path(run_dir, job_key, comm_id)`` = ``<run_dir>/<job_key>-c<id>.sock``.
   Local rank 0 starts that process (``python -m shmproxy.engine.progress ...``); the others wait for the socket,
   bounded by ``SHMPROXY_TIMEOUT``. No store and no broadcast is needed for this: the path is a
   function of values every local rank already has.
4. The service's Init collects each rank's ``host_identity()`` (and size) and checks that they agree,
   so that a wrong guess (ranks of two hosts, or two "hosts" made with network namespaces, that
   believe they are one node) fails with a message instead of corrupting anything.
5. Multi-node (``requires_store(info)``: fewer local ranks than ranks) will add a TCP store, hosted by
   rank 0 at MASTER_ADDR:MASTER_PORT, through which the nodes exchange their progress processes' net
   addresses and group ranks by host identity. Until it exists the caller raises ``InvalidUsage``
   with ``store_required_message(info)``; this seam is deliberately the only place that knows.

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
import hashlib
import os
import re
import socket
import stat
import struct
from dataclasses import dataclass
from typing import Any, Callable, Mapping

from shmproxy.core import log
from shmproxy.core.errors import InvalidArgument, InvalidUsage, from_oserror

_LOG = log.get("BOOTSTRAP")

LAUNCHERS = ("explicit", "torchrun", "openmpi", "mpich", "slurm", "singleton")
"""Every value of ``LaunchInfo.launcher``, in precedence order."""

SUN_PATH_MAX = 107
"""Longest Unix socket path in bytes (sun_path is 108 bytes, NUL included)."""

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


# --------------------------------------------------------------------------------------------------
# Job identity


def _proc_stat(pid: int) -> list[str]:
    """Fields of /proc/<pid>/stat after the command name (index 0 is field 3, the state)."""
    with open(f"/proc/{pid}/stat", "rb") as f:
        data = f.read()
    return data[data.rindex(b")") + 2:].decode("ascii").split()


def _start_ticks(pid: int) -> int:
    """Start time of ``pid`` in clock ticks since boot (field 22 of /proc/<pid>/stat).

    This is what psutil's create_time() is made of, before psutil adds the wall-clock boot time,
    which moves when the clock is stepped: two ranks computing the key a few ms apart across an NTP
    step would disagree. The tick count is an exact integer that never changes.
    """
    return int(_proc_stat(pid)[19])


def _ancestors(pid: int) -> list[int]:
    out: list[int] = []
    for _ in range(64):
        try:
            pid = int(_proc_stat(pid)[1])
        except (OSError, ValueError, IndexError):
            break
        if pid <= 0:
            break
        out.append(pid)
    return out


def _peer_pid(fd: int) -> int | None:
    """The pid that created the other end of Unix socket ``fd`` (SO_PEERCRED), or None."""
    try:
        sock = socket.fromfd(fd, socket.AF_UNIX, socket.SOCK_STREAM)  # a dup: fd itself stays open
    except OSError:
        return None
    try:
        cred = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
        return struct.unpack("3i", cred)[0] or None
    except OSError:
        return None
    finally:
        sock.close()


def _launcher_process(env: Mapping[str, str]) -> tuple[int, str]:
    """The local launcher process that all local ranks descend from (hydra_pmi_proxy, orted, ...).

    Hydra passes each rank one end of a socketpair in PMI_FD; the pid that created it is the proxy,
    whatever wrappers (``mpiexec -n 2 sh -c 'python ...'``) sit between. It is accepted only if it is
    one of our ancestors (PMI_FD may be a stale variable inherited by a grandchild). Otherwise the
    parent process.
    """
    raw = env.get("PMI_FD", "").strip()
    if raw.isdigit():
        pid = _peer_pid(int(raw))
        if pid is not None and pid in _ancestors(os.getpid()):
            return pid, f"PMI_FD={raw} peer"
    return os.getppid(), "parent process"


def _process_parts(pid: int, what: str) -> list[str]:
    try:
        ticks = _start_ticks(pid)
    except (OSError, ValueError, IndexError) as exc:
        raise InvalidUsage(f"cannot read the start time of {what} (pid {pid}) to derive the job key:"
                           f" {exc}; set SHMPROXY_JOB_ID to the same value on every rank") from exc
    return [f"{what}={pid}", f"start={ticks}"]


_JOB_ID_VARS = {
    "torchrun": ("TORCHELASTIC_RUN_ID", "MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RESTART_COUNT"),
    "openmpi": ("PMIX_NAMESPACE", "OMPI_MCA_ess_base_jobid", "OMPI_MCA_orte_ess_jobid"),
    "slurm": ("SLURM_JOB_ID", "SLURM_JOBID", "SLURM_STEP_ID", "SLURM_STEPID"),
    "mpich": ("PMI_JOBID",),
}


def _job_parts(info: LaunchInfo, env: Mapping[str, str]) -> list[str]:
    if info.launcher == "explicit":
        if info.size > 1:
            raise InvalidUsage(
                f"rank/size were given explicitly ({info}) and SHMPROXY_JOB_ID is not set: the ranks"
                " cannot derive a common job key; set SHMPROXY_JOB_ID to the same value on every rank")
        return _process_parts(os.getpid(), "pid")
    if info.launcher == "singleton":
        return _process_parts(os.getpid(), "pid")
    names = _JOB_ID_VARS.get(info.launcher, ())
    parts = [f"{n}={env[n]}" for n in names if env.get(n, "").strip()]
    if parts:
        return parts
    pid, how = _launcher_process(env)
    _LOG.info("no job id from %s (%s unset): the job key uses the launcher process %d (%s)",
              info.launcher, "/".join(names) or "it has none", pid, how)
    return _process_parts(pid, "launcher")


def job_key(info: LaunchInfo, params: Any, env: Mapping[str, str] | None = None) -> str:
    """16 hex chars naming this job on this host: equal on its ranks here, different between jobs.

    From SHMPROXY_JOB_ID (``params.JOB_ID``) if set; else from the launcher: torchrun
    TORCHELASTIC_RUN_ID + MASTER_ADDR + MASTER_PORT (+ TORCHELASTIC_RESTART_COUNT, so that a restarted
    worker group never meets its predecessor's progress process); Open MPI PMIX_NAMESPACE (>= 5) or
    OMPI_MCA_ess_base_jobid; Slurm SLURM_JOB_ID + SLURM_STEP_ID; MPICH/Hydra, which exports no job id,
    the local launcher process (pid + start time); singleton our own pid + start time. The uid is
    always mixed in. It is not a secret (anyone can recompute it) and must not serve as the TCP token.

    Two ranks of one job on different hosts may get different keys under MPICH (one proxy per host);
    the key only has to agree per host. Raises InvalidUsage when no key can be derived (explicit
    rank/size with size > 1 and no JOB_ID). Deterministic: calling it twice gives the same key.
    """
    env = os.environ if env is None else env
    parts = [f"uid={os.getuid()}"]
    if params.JOB_ID:
        parts.append(f"SHMPROXY_JOB_ID={params.JOB_ID}")
    else:
        parts.append(f"launcher={info.launcher}")
        parts.extend(_job_parts(info, env))
    key = hashlib.blake2b("\0".join(parts).encode(), digest_size=8, person=b"shmproxy-job").hexdigest()
    _LOG.info("job key %s from %s", key, ", ".join(parts))
    return key


# --------------------------------------------------------------------------------------------------
# Host identity, run directory, service socket


def host_identity(shm_dir: str | None = "/dev/shm") -> str:
    """A string equal for processes of one host and different across hosts.

    hostname + kernel boot_id + the inode of our network namespace, so that "hosts" made with
    ``ip netns`` on one machine differ. With ``shm_dir`` (pass params.SHM_DIR) also the device of that
    tmpfs, so that containers sharing the network but not /dev/shm (which could not use the shm
    transport between them) are different hosts too. Raises SystemError_ if /proc is unreadable.
    """
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot_id = f.read().strip()
        netns = os.stat("/proc/self/ns/net").st_ino
        ident = f"{socket.gethostname()}/boot={boot_id}/netns={netns}"
        if shm_dir is not None:
            dev = os.stat(shm_dir).st_dev
            ident += f"/shm={os.major(dev)}:{os.minor(dev)}"
    except OSError as exc:
        raise from_oserror("cannot read the host identity", exc) from exc
    return ident


def run_dir(params: Any, env: Mapping[str, str] | None = None) -> str:
    """Our private directory for service sockets and dumps: ``<base>/shmproxy-<uid>``, mode 0700.

    ``base`` is SHMPROXY_RUN_DIR (absolute; created if missing) if set, else $XDG_RUNTIME_DIR if it
    is set and exists, else /tmp. An existing directory must be a real directory (not a symlink)
    owned by us, else InvalidUsage: in /tmp another user could have planted it. A mode other than
    0700 is fixed (through an O_NOFOLLOW fd, so the checked directory is the one changed).
    Idempotent; safe when ranks race to create it. Raises SystemError_ when the OS refuses.
    """
    env = os.environ if env is None else env
    uid = os.getuid()
    if params.RUN_DIR:
        base = params.RUN_DIR
        if not os.path.isabs(base):
            raise InvalidArgument(f"SHMPROXY_RUN_DIR={base!r} must be an absolute path (every rank"
                                  " must compute the same socket path)")
        try:
            os.makedirs(base, exist_ok=True)
        except OSError as exc:
            raise from_oserror(f"cannot create SHMPROXY_RUN_DIR={base}", exc) from exc
    else:
        xdg = env.get("XDG_RUNTIME_DIR", "")
        base = xdg if xdg and os.path.isabs(xdg) and os.path.isdir(xdg) else "/tmp"
    path = os.path.join(base, f"shmproxy-{uid}")
    try:
        os.mkdir(path, 0o700)
    except FileExistsError:
        pass
    except OSError as exc:
        raise from_oserror(f"cannot create the run directory {path}", exc) from exc
    try:
        st = os.lstat(path)
    except OSError as exc:
        raise from_oserror(f"cannot stat the run directory {path}", exc) from exc
    fix = "remove it, or set SHMPROXY_RUN_DIR to a directory of ours"
    if stat.S_ISLNK(st.st_mode):
        raise InvalidUsage(f"run directory {path} is a symbolic link; refusing to use it ({fix})")
    if not stat.S_ISDIR(st.st_mode):
        raise InvalidUsage(f"run directory {path} is not a directory ({fix})")
    if st.st_uid != uid:
        raise InvalidUsage(f"run directory {path} is owned by uid {st.st_uid}, not by us (uid {uid}) ({fix})")
    if stat.S_IMODE(st.st_mode) != 0o700:
        try:
            fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
            try:
                fst = os.fstat(fd)
                if (fst.st_dev, fst.st_ino, fst.st_uid) != (st.st_dev, st.st_ino, uid):
                    raise InvalidUsage(f"run directory {path} was replaced while being checked ({fix})")
                os.fchmod(fd, 0o700)
            finally:
                os.close(fd)
        except OSError as exc:
            raise from_oserror(f"cannot set mode 0700 on the run directory {path}", exc) from exc
        _LOG.info("run directory %s had mode %o; set to 0700", path, stat.S_IMODE(st.st_mode))
    return path


_JOB_KEY = re.compile(r"[0-9a-f]{16}")


def service_path(rundir: str, job_key: str, comm_id: int) -> str:
    """The service socket of communicator ``comm_id`` of job ``job_key``: ``<rundir>/<key>-c<id>.sock``.

    Pure. Raises InvalidArgument for a malformed key or id, or when the path exceeds the 107 bytes
    a Unix socket path may have (the fix is a shorter SHMPROXY_RUN_DIR).
    """
    if not isinstance(job_key, str) or not _JOB_KEY.fullmatch(job_key):
        raise InvalidArgument(f"job key {job_key!r} is not 16 lowercase hex digits (see job_key())")
    if not isinstance(comm_id, int) or isinstance(comm_id, bool) or comm_id < 0:
        raise InvalidArgument(f"comm_id must be an int >= 0, got {comm_id!r}")
    path = os.path.join(rundir, f"{job_key}-c{comm_id}.sock")
    n = len(os.fsencode(path))
    if n > SUN_PATH_MAX:
        raise InvalidArgument(f"service socket path {path!r} is {n} bytes, more than the {SUN_PATH_MAX}"
                              " a Unix socket allows; set SHMPROXY_RUN_DIR to a shorter directory"
                              " (e.g. /tmp)")
    return path


# --------------------------------------------------------------------------------------------------
# The multi-node seam


def requires_store(info: LaunchInfo) -> bool:
    """True when the job spans several hosts (fewer local ranks than ranks): the TCP store is needed."""
    return info.local_size < info.size


def store_required_message(info: LaunchInfo) -> str:
    """The text of the InvalidUsage a caller raises while the multi-node TCP store does not exist."""
    where = (f" at {info.master_addr}:{info.master_port}" if info.master_addr and info.master_port
             else "")
    return (f"multi-node needs the TCP store (not implemented yet): {info.local_size} of the"
            f" {info.size} ranks run on this host ({info}); the store would be hosted by rank 0{where}."
            " Run all ranks on one host for now")
