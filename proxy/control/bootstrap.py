"""Bootstrap: who am I in the job, which job is it, and where do the ranks of one host meet.

The rendezvous story
--------------------
1. ``detect()`` reads the launcher's variables (docs/architecture.md, "Joining a communicator") and says
   which rank of how many this process is, and which local rank of how many on this host.
2. ``job_key()`` derives a 16-hex-digit key that every rank of the job on this host computes alike and
   that differs between two jobs of the same user. ``run_dir()`` is a private 0700 directory of ours.
3. On one node, every local rank connects to the service socket of the progress process at the
   deterministic path ``service_path(run_dir, job_key, comm_id)`` = ``<run_dir>/<job_key>-c<id>.sock``.
   Local rank 0 starts that process (``python -m shmproxy.engine.progress ...``); the others wait for
   the socket, bounded by ``SHMPROXY_TIMEOUT``. No store and no broadcast is needed for this: the path
   is a function of values every local rank already has.
4. The service's Init collects each rank's ``host_identity()`` (and size) and checks that they agree,
   so that a wrong guess (ranks of two hosts, or two "hosts" made with network namespaces, that
   believe they are one node) fails with a message instead of corrupting anything.
5. Across nodes (``spans_nodes(info)``: fewer local ranks than ranks) the ranks also meet once through
   the job's rendezvous (shmproxy.control.rendezvous: SHMPROXY_BOOTSTRAP, torchrun's store or mpi4py),
   which groups them into nodes by host identity and tells every progress process where the others
   listen. The job key then mixes in the host identity, so that "nodes" sharing a file system (network
   namespaces of one machine) never share a socket path.

The launcher detection (``detect``, ``LaunchInfo``: which launcher wins, what partial information
means) lives in shmproxy.control.launcher and is re-exported here, so that ``bootstrap`` stays the
one name callers import.

Environment
-----------
Nothing here reads ``SHMPROXY_*`` (that is params' job). The launcher's variables are not ours; every
function that reads them takes ``env`` (default ``os.environ``) so that tests pass plain dicts.
"""
from __future__ import annotations

import hashlib
import os
import re
import socket
import stat
import struct
import time
from typing import Any, Callable, Iterator, Mapping

from shmproxy.control.launcher import LAUNCHERS, LaunchInfo, detect, parse_tasks_per_node
from shmproxy.core import log
from shmproxy.core.errors import InvalidArgument, InvalidUsage, from_oserror
from shmproxy.shm import pool

__all__ = ["LAUNCHERS", "SUN_PATH_MAX", "LaunchInfo", "detect", "host_identity", "job_key",
           "parse_tasks_per_node", "run_dir", "service_path", "spans_nodes"]

_LOG = log.get("BOOTSTRAP")

SUN_PATH_MAX = 107
"""Longest Unix socket path in bytes (sun_path is 108 bytes, NUL included)."""

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
    if info.local_size < info.size:
        # Across nodes, two "nodes" may share a file system (network namespaces of one machine, as the
        # tests make): the host identity keeps their sockets apart.
        parts.append(f"host={params.HOSTNAME or host_identity()}")
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


STALE_SOCKET_AGE_S = 60.0   # a service socket this old that refuses connections has no server left
_SOCKET_NAME = re.compile(r"[0-9a-f]{16}-c\d+\.sock")


def _old_files_of_ours(directory: str, name: re.Pattern, is_kind: Callable[[int], bool], min_age_s: float,
                       what: str) -> Iterator[str]:
    """The paths in ``directory`` whose name is ``name``'s, of the kind ``is_kind`` tells from the mode,
    owned by us and at least ``min_age_s`` old: what the sweeps below then judge one by one. A file
    gone or unreadable meanwhile is skipped, never a reason to fail a start."""
    try:
        names = os.listdir(directory)
    except OSError as exc:
        _LOG.info("cannot list %s for stale %s: %s", directory, what, exc)
        return
    now, uid = time.time(), os.getuid()
    for n in names:
        if not name.fullmatch(n):
            continue
        path = os.path.join(directory, n)
        try:
            st = os.lstat(path)
        except OSError:
            continue
        if is_kind(st.st_mode) and st.st_uid == uid and now - st.st_mtime >= min_age_s:
            yield path


def sweep_stale_sockets(rundir: str, min_age_s: float = STALE_SOCKET_AGE_S) -> list[str]:
    """Remove the service sockets that jobs killed outright left in ``rundir`` (a kill -9 of every
    process of a job leaves its socket file: nobody was left to unlink it); returns their paths.

    A socket is stale when its name is a service socket's, it is ours, at least ``min_age_s`` old, and a
    connection to it is refused (nobody listens). The age keeps a server that has bound its socket but
    not yet listened (a matter of microseconds) from ever being taken for dead; a live server answers
    the probe, accepts it and drops it as a client that never said INIT. Anything unexpected (a file
    gone meanwhile, a connection that times out) leaves the file alone: this is a tidy-up, never a
    reason to fail a start. Dumps (``*.dump.json``) are output a person asked for, and are kept."""
    removed: list[str] = []
    for path in _old_files_of_ours(rundir, _SOCKET_NAME, stat.S_ISSOCK, min_age_s, "sockets"):
        probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        probe.settimeout(1.0)
        try:
            probe.connect(path)
        except ConnectionRefusedError:
            try:
                os.unlink(path)
                removed.append(path)
            except FileNotFoundError:
                continue
        except OSError as exc:
            _LOG.info("left %s alone: %s", path, exc)
        finally:
            probe.close()
    return removed


_POOL_NAME = re.compile(r"shmproxy-[0-9a-f]{8}-c\d+-[0-9a-f]{8}")


def sweep_stale_pools(shm_dir: str, min_age_s: float = STALE_SOCKET_AGE_S) -> list[str]:
    """Remove the names of ops pools that jobs killed outright left in ``shm_dir``; returns their paths.
    A pool's name is removed the moment it is created (shm/segment.py), so only a kill that lands in
    those microseconds leaves one (or a job of a version that kept the name until every rank mapped
    it), and nobody of that job is left to remove it.

    A pool is stale when its name is a pool's, it is ours, at least ``min_age_s`` old, and the progress
    process its header names is gone: no such process, or one that is not a progress process (its pid
    was reused). As for sockets, anything unexpected leaves the file alone."""
    removed: list[str] = []
    pid_at = pool.CTRL_OFF + 8 * pool.CTRL_PROXY_PID
    for path in _old_files_of_ours(shm_dir, _POOL_NAME, stat.S_ISREG, min_age_s, "pools"):
        try:
            with open(path, "rb") as f:
                head = f.read(pid_at + 8)
            if len(head) < pid_at + 8 or struct.unpack_from("<Q", head, 0)[0] != pool.MAGIC:
                continue
            pid = struct.unpack_from("<Q", head, pid_at)[0]
            if pid and _progress_process_alive(pid):
                continue
            os.unlink(path)
            removed.append(path)
        except OSError as exc:   # gone meanwhile, unreadable: not ours to judge
            _LOG.info("left %s alone: %s", path, exc)
    return removed


def _progress_process_alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return b"shmproxy.engine.progress" in f.read()
    except FileNotFoundError:
        return False
    except OSError:
        return True   # it exists and cannot be read: not ours to remove


# --------------------------------------------------------------------------------------------------
# Across nodes


def spans_nodes(info: LaunchInfo) -> bool:
    """True when the job spans several hosts (fewer local ranks than ranks): its ranks meet through
    the rendezvous of shmproxy.control.rendezvous, and its nodes' progress processes over TCP."""
    return info.local_size < info.size
