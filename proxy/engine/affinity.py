"""CPU affinity of the progress process (docs/architecture.md, "CPU placement").

The progress process exists so that communication advances while the ranks compute; that only works
if it does not share a core with a busy rank. So it pins itself to cores the ranks do not use.

Policy (``choose_proxy_cpus``), from SHMPROXY_PROXY_CPUS:

- ``none``: no pinning.
- a CPU list (``4-7,12``): exactly those CPUs that we may use; none usable is InvalidArgument.
- ``''``/``auto``: if the ranks are pinned (each rank's affinity, within ``allowed``, is a strict
  subset of ``allowed``), the spare CPUs are those no rank is pinned to. If any rank is unpinned, the
  ranks float over everything and only their count matters: the lowest-numbered ``nlocal`` CPUs are
  left as the ranks' share and the rest is spare (the highest-numbered CPUs, away from CPU 0 where
  the OS and many interrupts live). From the spare CPUs take SHMPROXY_PROXY_NCORES of them (0 = all,
  at most 16), all from one NUMA node when one has enough: the node named by ``prefer_node`` (the
  GPU's or NIC's, when the caller knows it), else the node holding most of the pinned ranks' CPUs,
  else the node with most spare CPUs; within a node the highest-numbered CPUs first.
- nothing spare: no cores of its own, and the reason says so. It then floats over every CPU a local
  rank may use (``float_cpus``), not over the affinity it inherited (below); under ``none`` its
  affinity is left alone.

Where the CPUs come from. ``allowed`` defaults to ``allowed_cpus()``: what the kernel lets this
process use (its cpuset), *not* its current affinity. The progress process is started by local
rank 0, and inherits its affinity: under ``mpirun --bind-to core`` that is rank 0's single core, and
choosing within it would put the progress process on the very core it must stay off. A process may
widen its own affinity up to its cpuset, so the probe asks the kernel in a throwaway thread.

Linux affinity is per thread: ``sched_setaffinity(0, ...)`` pins the calling thread only, and new
threads inherit their creator's mask. ``pin_self`` therefore pins every thread that exists, and
``pin_thread`` the calling one (a copy worker pinning itself).

"CPU" here means a logical CPU as the kernel numbers them; SMT siblings are not treated specially.
"""
from __future__ import annotations

import glob
import os
import re
import threading
from typing import Any, Iterable, Mapping

from shmproxy.core.errors import InvalidArgument, from_oserror
from shmproxy.core.params import parse_cpu_list, parse_size

MAX_AUTO_CORES = 16
"""PROXY_NCORES=0 takes all spare CPUs, but at most this many: the largest count shown to pay for
large collectives, whose GIL-free copy workers scale with cores (docs/bench/HISTORY.md)."""


def format_cpu_list(cpus: Iterable[int]) -> str:
    """The compact form of a CPU set, as the kernel writes it: {0,1,2,3,8} -> '0-3,8'."""
    out: list[str] = []
    run: list[int] = []
    for c in sorted(set(cpus)):
        if run and c == run[-1] + 1:
            run.append(c)
            continue
        if run:
            out.append(f"{run[0]}-{run[-1]}" if len(run) > 1 else str(run[0]))
        run = [c]
    if run:
        out.append(f"{run[0]}-{run[-1]}" if len(run) > 1 else str(run[0]))
    return ",".join(out)


def _read_cpu_list(path: str) -> set[int]:
    with open(path) as f:
        text = f.read().strip()
    return set(parse_cpu_list(text)) if text else set()


def current_affinity(pid: int = 0) -> set[int]:
    """The CPUs ``pid`` (a pid or a tid; 0 = the calling thread) may run on. Raises SystemError_."""
    try:
        return set(os.sched_getaffinity(pid))
    except OSError as exc:
        raise from_oserror(f"cannot read the CPU affinity of {pid or 'this thread'}", exc) from exc


def allowed_cpus() -> set[int]:
    """The CPUs this process may pin itself to (its cpuset), whatever its current affinity.

    Asked of the kernel in a short-lived thread: setting a thread's affinity to every CPU leaves it
    with exactly the CPUs its cpuset allows. The caller's threads are not touched. Falls back to the
    current affinity if the probe fails.
    """
    try:
        possible = _read_cpu_list("/sys/devices/system/cpu/possible")
    except (OSError, ValueError):
        possible = set()
    candidates = set(range(max([os.cpu_count() or 1, *(c + 1 for c in possible)])))
    result: dict[str, Any] = {}

    def probe() -> None:
        try:
            os.sched_setaffinity(0, candidates)
            result["cpus"] = set(os.sched_getaffinity(0))
        except OSError as exc:
            result["error"] = exc

    t = threading.Thread(target=probe, name="shmproxy-cpuset-probe", daemon=True)
    t.start()
    t.join()
    cpus = result.get("cpus")
    return cpus if cpus else current_affinity(os.getpid())


def numa_nodes() -> dict[int, set[int]]:
    """NUMA node -> its CPUs, from /sys/devices/system/node; {} if unreadable. CPU-less nodes omitted."""
    nodes: dict[int, set[int]] = {}
    for path in glob.glob("/sys/devices/system/node/node*/cpulist"):
        m = re.search(r"/node(\d+)/cpulist$", path)
        if m is None:
            continue
        try:
            cpus = _read_cpu_list(path)
        except (OSError, ValueError):
            return {}
        if cpus:
            nodes[int(m.group(1))] = cpus
    return nodes


def last_level_cache_bytes(cpu: int, base: str = "/sys/devices/system/cpu") -> int:
    """Size of the outermost data or unified cache of ``cpu``, from /sys; 0 if unknown."""
    best_level, size = 0, 0
    for path in glob.glob(f"{base}/cpu{cpu}/cache/index*"):
        try:
            with open(f"{path}/level") as f:
                level = int(f.read())
            with open(f"{path}/type") as f:
                kind = f.read().strip()
            with open(f"{path}/size") as f:
                nbytes = parse_size(f.read())   # '32768K'
        except (OSError, ValueError):
            continue
        if kind != "Instruction" and level > best_level:
            best_level, size = level, nbytes
    return size


def _check_cpus(cpus: Iterable[int]) -> list[int]:
    out = sorted(set(cpus))
    if not out or any(not isinstance(c, int) or isinstance(c, bool) or c < 0 for c in out):
        raise InvalidArgument(f"a CPU set must be non-empty ints >= 0, got {cpus!r}")
    return out


def pin_self(cpus: Iterable[int]) -> None:
    """Pin every thread of this process to ``cpus`` (threads started later inherit it).

    Raises InvalidArgument for an empty set, SystemError_ if the kernel refuses (e.g. none of the
    CPUs is in our cpuset). Idempotent.
    """
    mask = _check_cpus(cpus)
    me = threading.get_native_id()
    try:
        os.sched_setaffinity(me, mask)
    except OSError as exc:
        raise from_oserror(f"cannot pin to CPUs {format_cpu_list(mask)}", exc) from exc
    try:
        tids = [int(t) for t in os.listdir("/proc/self/task")]
    except OSError as exc:
        raise from_oserror("cannot list this process's threads", exc) from exc
    for tid in tids:
        if tid == me:
            continue
        try:
            os.sched_setaffinity(tid, mask)
        except ProcessLookupError:
            pass  # the thread exited since we listed it
        except OSError as exc:
            raise from_oserror(f"cannot pin thread {tid} to CPUs {format_cpu_list(mask)}", exc) from exc


def pin_thread(cpus: Iterable[int]) -> None:
    """Pin the calling thread only (by its native tid). Raises like pin_self. Idempotent."""
    mask = _check_cpus(cpus)
    try:
        os.sched_setaffinity(threading.get_native_id(), mask)
    except OSError as exc:
        raise from_oserror(f"cannot pin this thread to CPUs {format_cpu_list(mask)}", exc) from exc


def _take(spare: set[int], n: int, nodes: Mapping[int, set[int]], order: list[int]) -> list[int]:
    """``n`` CPUs of ``spare``: all from one node if one has enough (first in ``order``), else node by
    node in ``order``, then CPUs of no known node; the highest-numbered first within each."""
    def highest(cpus: set[int], k: int) -> list[int]:
        return sorted(cpus, reverse=True)[:k]

    groups = [spare & nodes[k] for k in order]
    groups.append(spare - set().union(set(), *groups))
    for g in groups[:-1]:
        if len(g) >= n:
            return sorted(highest(g, n))
    taken: list[int] = []
    for g in groups:
        taken += highest(g, n - len(taken))
    return sorted(taken)


def _cpus_spec(params: Any) -> str:
    return str(params.PROXY_CPUS).strip().lower()


def float_cpus(params: Any, rank_affinities: list[set[int]], allowed: set[int] | None = None) -> list[int] | None:
    """Where the progress process runs when ``choose_proxy_cpus`` gave it no CPUs of its own: every CPU
    a local rank may use (within ``allowed``), or None under SHMPROXY_PROXY_CPUS=none (left as it is).

    Not the affinity it inherited: under ``mpirun --bind-to core`` (Open MPI's default for 2 ranks)
    that is local rank 0's one core, where the loop and every copy worker would queue behind each
    other while rank 1's core idles between its calls."""
    if _cpus_spec(params) == "none":
        return None
    allowed = set(allowed_cpus() if allowed is None else allowed)
    cpus = set().union(*rank_affinities) & allowed if rank_affinities else set()
    return sorted(cpus or allowed) or None


def smt_siblings() -> dict[int, set[int]]:
    """CPU -> the hardware threads of its physical core (itself included), from /sys; {} if unknown."""
    out: dict[int, set[int]] = {}
    base = "/sys/devices/system/cpu"
    try:
        names = os.listdir(base)
    except OSError:
        return out
    for name in names:
        if not (name.startswith("cpu") and name[3:].isdigit()):
            continue
        try:
            with open(f"{base}/{name}/topology/thread_siblings_list") as f:
                out[int(name[3:])] = set(parse_cpu_list(f.read().strip()))
        except (OSError, ValueError):
            continue
    return out


def choose_proxy_cpus(params: Any, rank_affinities: list[set[int]], allowed: set[int] | None = None, *,
                      numa: Mapping[int, set[int]] | None = None,
                      prefer_node: int | None = None,
                      siblings: Mapping[int, set[int]] | None = None) -> tuple[list[int] | None, str]:
    """The CPUs the progress process should pin to (None: do not pin) and a one-line reason.

    ``rank_affinities``: the current affinity of each local rank. ``allowed``: the CPUs the progress
    process may use (default ``allowed_cpus()``). ``numa``: node -> CPUs (default ``numa_nodes()``;
    {} ignores NUMA). ``prefer_node``: a NUMA node to favour (the GPU's or NIC's). Pure apart from
    the defaults' reads of /sys. Raises InvalidArgument for an explicit SHMPROXY_PROXY_CPUS list with
    no allowed CPU in it, no local ranks, or an empty ``allowed``.
    """
    spec = _cpus_spec(params)
    if spec == "none":
        return None, "pinning disabled by SHMPROXY_PROXY_CPUS=none"
    allowed = set(allowed_cpus() if allowed is None else allowed)
    if not allowed:
        raise InvalidArgument("no CPU is allowed for the progress process (empty allowed set)")
    if spec not in ("", "auto"):
        try:
            wanted = set(parse_cpu_list(spec))
        except ValueError as exc:
            raise InvalidArgument(f"SHMPROXY_PROXY_CPUS={spec!r} is invalid: {exc}") from exc
        usable = wanted & allowed
        if not usable:
            raise InvalidArgument(f"SHMPROXY_PROXY_CPUS={spec} names no CPU this process may use"
                                  f" (allowed: {format_cpu_list(allowed)})")
        dropped = wanted - allowed
        note = f" ({format_cpu_list(dropped)} not allowed, dropped)" if dropped else ""
        return sorted(usable), f"CPUs {format_cpu_list(usable)} from SHMPROXY_PROXY_CPUS={spec}{note}"

    nlocal = len(rank_affinities)
    if nlocal == 0:
        raise InvalidArgument("choose_proxy_cpus needs the affinity of at least one local rank")
    ranks = [set(a) & allowed for a in rank_affinities]
    pinned = all(r < allowed for r in ranks)  # a rank pinned outside `allowed` is no competitor
    if pinned:
        used = set().union(*ranks)
        spare = allowed - used
        how = f"ranks pinned to {format_cpu_list(used)}" if used else "ranks pinned outside the allowed CPUs"
    else:
        used = set(sorted(allowed)[:nlocal])
        spare = allowed - used
        how = f"ranks unpinned, {format_cpu_list(used) or 'none'} left to them"
    if not spare:
        return None, (f"no spare cores: {len(allowed)} cores, {nlocal} local ranks; not pinned, shares the"
                      f" ranks' CPUs")
    # A CPU whose SMT sibling runs a rank shares that rank's core: work there slows the rank's own
    # computation, which is what the progress process exists to overlap with. Avoid such CPUs when
    # there are others (``siblings``: CPU -> its hardware threads, default from /sys).
    sib = smt_siblings() if siblings is None else siblings
    clean = {c for c in spare if not (set(sib.get(c, {c})) - {c}) & used}
    if clean and clean != spare:
        how += f"; {format_cpu_list(spare - clean)} avoided (SMT siblings of rank CPUs)"
        spare = clean

    ncores = int(params.PROXY_NCORES)
    n = min(len(spare), MAX_AUTO_CORES) if ncores <= 0 else min(ncores, len(spare))
    nodes = numa_nodes() if numa is None else numa
    nodes = {k: set(v) for k, v in nodes.items() if set(v) & allowed}
    if len(nodes) > 1:
        def score(node: int) -> tuple[int, int, int, int]:
            cpus = nodes[node]
            return (node == prefer_node, len(used & cpus) if pinned else 0, len(spare & cpus), -node)
        order = sorted(nodes, key=score, reverse=True)
    else:
        order = list(nodes)
    chosen = _take(spare, n, nodes, order)
    in_nodes = sorted(k for k in order if set(chosen) & nodes[k])
    where = ""
    if in_nodes:
        where = f" on NUMA node{'s' if len(in_nodes) > 1 else ''} {','.join(map(str, in_nodes))}"
    short = f" (asked {ncores}, {len(spare)} spare)" if ncores > len(spare) else ""
    return chosen, (f"CPUs {format_cpu_list(chosen)}{where}: {len(chosen)} of {len(spare)} spare of"
                    f" {len(allowed)} allowed, {how}{short}")
