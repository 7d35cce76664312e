"""Every tunable of shmproxy, declared once.

Each parameter has a name, a type, a default, a description and, once read, the place its value came
from (default, environment, or an explicit override). Values are read from ``SHMPROXY_<NAME>``
environment variables; nothing else in the code base reads ``os.environ`` for configuration (the
launcher variables that bootstrap interprets are the one documented exception: they are not ours).

A malformed value is an error (:class:`shmproxy.core.errors.InvalidArgument`), never a silent default.
An unknown ``SHMPROXY_*`` variable is reported as an error too: a typo would otherwise be a silent
no-op. ``python -m shmproxy.core.params`` (or ``shmproxy-params``) prints the table.

The progress process receives the resolved values from the rank that starts it (``to_env``), so both
sides of a communicator always agree.
"""
from __future__ import annotations

import dataclasses
import json
import os
import signal
import sys
from typing import Any, Callable, Mapping

from shmproxy.core.errors import InvalidArgument

PREFIX = "SHMPROXY_"
FAST_AUTO_POOL_MIN, FAST_AUTO_POOL_MAX = 4 << 20, 64 << 20   # FAST_AUTO_POOL_BYTES=-1's bounds


def _parse_bool(text: str) -> bool:
    low = text.strip().lower()
    if low in ("1", "true", "yes", "on"):
        return True
    if low in ("0", "false", "no", "off"):
        return False
    raise ValueError(f"expected 0/1/true/false, got {text!r}")


def parse_size(text: str) -> int:
    """Bytes with an optional K/M/G suffix (binary units): '512K', '4M', '1G'."""
    t = text.strip().upper().removesuffix("B").removesuffix("I")
    mult = 1
    for suffix, m in (("K", 1 << 10), ("M", 1 << 20), ("G", 1 << 30)):
        if t.endswith(suffix):
            t, mult = t[:-1], m
            break
    value = int(t) * mult
    if value < 0:
        raise ValueError("must be >= 0")
    return value


def _parse_size_or_auto(text: str) -> int:
    """A size as parse_size, or 'auto' / '-1' for -1 (the value is then derived at run time)."""
    return -1 if text.strip().lower() in ("auto", "-1") else parse_size(text)


def _parse_signal(text: str) -> int:
    """A signal by name ('SIGUSR1', 'USR1') or number; '' / 'none' / '0' disables."""
    t = text.strip().upper()
    if t in ("", "0", "NONE", "OFF"):
        return 0
    if t.isdigit():
        return int(signal.Signals(int(t)))
    name = t if t.startswith("SIG") else "SIG" + t
    return int(signal.Signals[name])


def _parse_level(text: str) -> str:
    t = text.strip().upper()
    if t not in ("NONE", "WARN", "INFO", "TRACE"):
        raise ValueError("expected one of NONE, WARN, INFO, TRACE")
    return t


SUBSYSTEMS = ("INIT", "PROXY", "SHM", "NET", "SERVICE", "BOOTSTRAP", "COLL", "ALL")


def _parse_adopt(text: str) -> str:
    t = text.strip().lower()
    if t not in ("auto", "swap", "share", "off"):
        raise ValueError("expected one of auto, swap, share, off")
    return t


def _parse_subsys(text: str) -> str:
    parts = [p.strip().upper() for p in text.split(",") if p.strip()]
    bad = [p.lstrip("^") for p in parts if p.lstrip("^") not in SUBSYSTEMS]
    if bad:
        raise ValueError(f"unknown subsystem(s) {bad}; known: {', '.join(SUBSYSTEMS)}")
    return ",".join(parts)


def _parse_cpus(text: str) -> str:
    """'' (automatic), 'none' (do not pin), or a CPU list like '4-7,12'."""
    t = text.strip().lower()
    if t in ("", "auto", "none"):
        return t
    parse_cpu_list(t)
    return t


def _parse_names(text: str) -> str:
    """A comma-separated list of names ('' = all), normalised to lower case without blanks; which
    names exist is checked where they are used (the transport registry)."""
    names = [n.strip().lower() for n in text.split(",") if n.strip()]
    bad = [n for n in names if not n.replace("_", "").isalnum()]
    if bad:
        raise ValueError(f"bad name(s) {', '.join(map(repr, bad))}")
    return ",".join(names)


def _parse_hostport(text: str) -> str:
    """'' or host:port (an IPv6 host in brackets: [::1]:9000), port in 1..65535."""
    t = text.strip()
    if not t:
        return ""
    host, sep, port = t.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError("expected host:port, e.g. 10.0.0.1:29400 or [fe80::1]:29400")
    return t


def _parse_ifname(text: str) -> str:
    """NCCL_SOCKET_IFNAME's syntax: comma-separated prefixes, a leading '^' excludes, '=' exact."""
    t = text.strip()
    body = t.lstrip("^").lstrip("=")
    if any(not n.strip() or any(c.isspace() for c in n.strip()) for n in body.split(",")) and t:
        raise ValueError("expected interface names or prefixes, comma-separated (e.g. eth,ib or ^docker,lo)")
    return t


def parse_cpu_list(text: str) -> list[int]:
    cpus: set[int] = set()
    for part in text.split(","):
        part = part.strip()
        if not part:
            continue
        if "-" in part:
            lo, hi = part.split("-", 1)
            a, b = int(lo), int(hi)
            if a > b or a < 0:
                raise ValueError(f"bad CPU range {part!r}")
            cpus.update(range(a, b + 1))
        else:
            c = int(part)
            if c < 0:
                raise ValueError(f"bad CPU {part!r}")
            cpus.add(c)
    if not cpus:
        raise ValueError("empty CPU list")
    return sorted(cpus)


@dataclasses.dataclass
class Param:
    name: str
    parse: Callable[[str], Any]
    default: Any
    description: str
    minimum: float | None = None
    maximum: float | None = None
    value: Any = None
    origin: str = "default"

    def env_name(self) -> str:
        return PREFIX + self.name


def _p(name: str, parse: Callable[[str], Any], default: Any, description: str,
       minimum: float | None = None, maximum: float | None = None) -> Param:
    return Param(name, parse, default, description, minimum, maximum)


_DECLARED: tuple[Param, ...] = (
    # --- progress engine (docs/architecture.md, "The progress loop") ---
    _p("PROGRESS_APPENDOP_FREQ", int, 8,
       "With ops in flight, fetch newly posted ops every this many progress passes.", 1),
    _p("APPEND_BATCH_SIZE", int, 16, "At most this many opCount groups are taken per fetch.", 1, 1024),
    _p("STEPS", int, 8, "Buffer slots per connection: a sub may have this many chunks in flight.", 1),
    _p("CHUNK_SIZE", parse_size, 512 << 10, "Bytes moved per step by the shm transport.", 4096),
    _p("COLL_CHUNK_SIZE", _parse_size_or_auto, -1,
       "Largest chunk of a collective (per rank's buffer). -1 = automatic: CHUNK_SIZE, or 4 MiB where the "
       "progress loop runs copy jobs itself (LOOP_COPIES), so that a collective is cut in one chunk per "
       "CPU there.", -1),
    _p("COLL_MIN_CHUNK", parse_size, 64 << 10,
       "A collective's chunks shrink below COLL_CHUNK_SIZE to give every copy worker one, but not below "
       "this.", 4096),
    _p("MAX_OPS_PER_RANK", int, 1024, "Op records (and request slots) each local rank owns in the pool.", 16),
    _p("MAX_SUBS", int, 4096, "Sub slots in the pool's progress table (visible to the dump tool).", 64),
    _p("PARALLEL_THRESHOLD", parse_size, 1 << 20,
       "Messages at least this large are split into one sub per copy worker.", 0),
    _p("EAGER_BYTES", parse_size, 512 << 10,
       "Messages up to this size are copied by the progress loop itself as soon as they match, without "
       "an args or a copy worker (handing a copy to a worker thread costs cross-CPU wake-ups).", 0),
    _p("SEND_BUFFER_BYTES", parse_size, 64 << 10,
       "A send of at most this many bytes to a rank of this node that finds no posted receive is copied "
       "into the progress process's memory and completes at once (MPI's buffered standard mode); a larger "
       "one, an Ssend, or one beyond SEND_BUFFER_PER_PEER completes when its receive takes it. 0 = never.", 0),
    _p("SEND_BUFFER_GRACE_US_PER_KIB", float, 0.1,
       "How long a send that SEND_BUFFER_BYTES lets the progress process buffer waits for its receive first, "
       "in microseconds per KiB of message (about what its copy into the buffer would cost): a receive "
       "posted meanwhile takes it with one copy instead of two. 0: buffered once the batch of ops it "
       "arrived with is matched.", 0.0),
    _p("SEND_BUFFER_PER_PEER", parse_size, 4 << 20,
       "Bytes of buffered sends (SEND_BUFFER_BYTES) that may wait for one destination rank; beyond it a "
       "send waits for its receive (flow control).", 0),
    _p("FAST_BYTES", _parse_size_or_auto, -1,
       "The fast path: on a communicator whose ranks all share this node (at most FAST_MAX_RANKS), a "
       "blocking Send of at most this many bytes is written into a shared cell of the pair and a blocking "
       "Recv takes it itself, and a blocking Barrier, Allreduce, Bcast or Reduce of at most this many bytes "
       "per rank runs between the ranks; the progress process keeps everything else (docs/architecture.md, "
       "'The fast path'). Every rank must use the same value. auto (-1): as large as keeps the cells of "
       "every pair within FAST_AUTO_POOL_BYTES, between 512 B and FAST_AUTO_MAX_BYTES "
       "(FAST_AUTO_CROWDED_MAX_BYTES on a crowded node). 0 = off.", -1, 1 << 20),
    _p("DEVICE_ONESHOT_BYTES", parse_size, 8 << 20,
       "An Allreduce of device arrays up to this size, on a communicator of one node whose ranks each have "
       "a GPU of their own, runs as one kernel per rank on the caller's stream, reading the peers' GPUs "
       "(shmproxy.rank.devcoll); larger ones take the two-shot kernels (DEVICE_TWOSHOT_BYTES), and every one "
       "where ranks share a GPU goes through the progress process. Each rank keeps twice this much device "
       "memory for it (or the two-shot window's, if more). 0 = off. Every rank must use the same value.", 0),
    _p("DEVICE_TWOSHOT_BYTES", parse_size, 1 << 40,
       "An Allreduce of device arrays above DEVICE_ONESHOT_BYTES and up to this size, where the one-shot "
       "kernel would run, runs as two-shot kernels instead: each rank reduces a 1/N share, written into it "
       "by its peers, and writes the result into theirs (shmproxy.rank.devcoll). 0 = off (such calls go "
       "through the progress process). Every rank must use the same value.", 0),
    _p("DEVICE_TWOSHOT_WINDOW", parse_size, 64 << 20,
       "The most bytes of one two-shot kernel; a larger Allreduce is several, one after another. Each rank "
       "keeps 4 (N - 1) / N times this much device memory for them (N ranks).", 1 << 20),
    _p("DEVICE_TWOSHOT_BLOCKS", int, 128,
       "Most thread blocks of one two-shot kernel (at most 512): more than the GPU's SMs lets blocks that wait "
       "for a peer's flag leave the SM to blocks that copy.", 1),
    _p("DEVICE_TWOSHOT_CHUNK", parse_size, 128 << 10,
       "The bytes a two-shot kernel's block moves in one step of its pipeline (a multiple of 16): smaller "
       "overlaps more of the steps, larger waits for fewer flags.", 16),
    _p("DEVICE_CE_BYTES", parse_size, 0,
       "A two-shot device Allreduce of at least this size moves its two exchanges with the GPUs' copy "
       "engines (peer copies, flags stored by the streams) instead of the kernels' stores, leaving the SMs "
       "to local reductions and copies (shmproxy.rank.devcoll). 0 = never: the default until its speed "
       "against the kernels' is measured between GPUs (docs/decisions.md). Every rank must use the same "
       "value.", 0),
    _p("DEVICE_CE_CHUNK", parse_size, 4 << 20,
       "The bytes of one copy-engine step of such an Allreduce (rounded to 16): smaller overlaps the steps "
       "more, larger queues fewer copies.", 16),
    _p("DEVICE_CE_BLOCKS", int, 32,
       "Thread blocks of the local reduce and copy kernels between a copy-engine Allreduce's exchanges.", 1),
    _p("DEVICE_KERNELS_SHARED_GPU", _parse_bool, False,
       "The ranks' own device kernels (DEVICE_ONESHOT_BYTES and above) also where ranks share a GPU: for a "
       "GPU run under MPS, whose clients' kernels run side by side. Without MPS the GPU runs one process's "
       "work at a time and the kernels, which wait for each other, take turns: right, and slow. Every rank "
       "must use the same value."),
    _p("DEVICE_ONESHOT_BLOCKS", int, 128,
       "Most thread blocks of one DEVICE_ONESHOT_BYTES kernel (at most 512): the reads of the peers' memory "
       "in flight at once, against the SMs the kernel takes from the work it overlaps.", 1),
    _p("FAST_DEVICE_REDUCTIONS", _parse_bool, False,
       "Small blocking Allreduce and Reduce of device arrays run between the ranks through host copies, as "
       "a small device Bcast does. Off by default: on a GPU shared by ranks without MPS the two copies per "
       "call cost more than the progress process's path (BENCHMARKS.md). Every rank must use the same value."),
    _p("FAST_AUTO_POOL_BYTES", _parse_size_or_auto, -1,
       "With FAST_BYTES=auto: the shared memory the fast path's cells of a communicator may take. "
       "-1 = automatic: the node's memory / 4096, between 4 MiB and 64 MiB (so 64 KiB cells at 16 ranks "
       "on a node of 256 GiB, 16 KiB at 8 ranks on one of 24 GiB; measured: BENCHMARKS.md)."),
    _p("FAST_AUTO_MAX_BYTES", parse_size, 64 << 10,
       "With FAST_BYTES=auto: the largest message the fast path takes, where FAST_AUTO_POOL_BYTES allows "
       "it (2 to 4 ranks per node; 16 KiB at 8, 4 KiB at 16). Up to 64 KiB, two copies between the ranks "
       "beat a trip through the progress process (BENCHMARKS.md, 'The fast path's size').", 512, 1 << 20),
    _p("FAST_AUTO_CROWDED_MAX_BYTES", parse_size, 256 << 10,
       "FAST_AUTO_MAX_BYTES where the node is crowded (fewer cores than local ranks + 2: the progress "
       "process has no core of its own), still within FAST_AUTO_POOL_BYTES (256 KiB at 2 ranks, 64 KiB "
       "at 4): there a trip through the progress process also waits for a CPU.", 512, 1 << 20),
    _p("FAST_REF_MIN_BYTES", parse_size, 64 << 10,
       "A blocking Send to a rank of this node of at least this many bytes (and at most FAST_REF_MAX_BYTES), "
       "from a numpy array in the arena (NUMPY_ARENA_MIN_BYTES), writes a fast-path cell by reference: the "
       "receiver's blocking Recv copies straight from the sender's array, once, where a cell would take two "
       "copies and the progress process a post and a match (shm/_fast.h). The Send returns once the message "
       "was taken, by the receiver or into the progress process. Every rank must use the same value.", 0),
    _p("FAST_REF_MAX_BYTES", parse_size, 1 << 20,
       "The largest Send by reference (FAST_REF_MIN_BYTES); a blocking Recv up to this size waits for a cell "
       "before it posts. 0 = off. Every rank must use the same value.", 0),
    _p("FAST_MAPPED_BYTES", parse_size, 2 << 20,
       "The middle collectives: a blocking Allreduce, Bcast or Reduce of host arrays above "
       "FAST_MAPPED_MIN_BYTES and up to this many bytes per rank runs between the ranks, reading and "
       "writing their numpy arenas (NUMPY_ARENA) in place of the fast path's cells or the progress "
       "process; an array outside the arena is copied through a scratch block. 0 = off. Every rank "
       "must use the same value.", 0),
    _p("FAST_MAPPED_MIN_BYTES", _parse_size_or_auto, -1,
       "Collectives up to this many bytes per rank keep the fast path's cells (one handshake fewer, "
       "but every rank reads every cell) where the middle collectives are on. -1 = automatic: 8 KiB "
       "over the node's ranks (4 KiB at 2, 1 KiB at 8), for a Reduce 2 KiB over them (its root alone "
       "reads every cell: 1 KiB at 2, 128 B at 16; measured: BENCHMARKS.md). Every rank must use "
       "the same value."),
    _p("FAST_MAX_RANKS", int, 64,
       "The fast path's shared memory grows with the square of the ranks on a node: above this many it is "
       "off.", 1, 1024),
    _p("COLL_INLINE_BYTES", _parse_size_or_auto, -1,
       "Collectives of at most this many bytes per rank run in the progress loop itself, not on workers. "
       "-1 = automatic: COLL_INLINE_AUTO_BYTES over the square of the node's ranks, between 64 KiB and "
       "1 MiB (1 MiB at 2 ranks, 128 KiB at 8)."),
    _p("COLL_INLINE_AUTO_BYTES", parse_size, 8 << 20,
       "With COLL_INLINE_BYTES=auto: the loop's pass grows with the ranks and so does the workers' "
       "parallelism, so the bytes per rank below which the loop alone beats handing a collective to "
       "workers fall with their square (measured at 2, 8 and 16 ranks: BENCHMARKS.md).", 0),
    _p("COPY_STREAMING", _parse_bool, True,
       "Collectives that write more than STREAMING_MIN_BYTES use non-temporal stores (no read for "
       "ownership, less memory traffic once their outputs outgrow the cache); 0 = never."),
    _p("STREAMING_MIN_BYTES", _parse_size_or_auto, -1,
       "A collective streams (COPY_STREAMING) when every local rank's output together exceeds this many "
       "bytes. -1 = automatic: 0 (always) where the progress process has cores of its own; where it "
       "shares the ranks' (LOOP_COPIES) half the last-level cache, at most 16 MiB.", -1),
    _p("COPY_THREADS", int, 0,
       "Copy worker threads in the progress process; 0 = one per core it is pinned to.", 0),
    _p("LOOP_COPIES", int, -1,
       "While copy jobs are queued and it has nothing else to do, the progress loop runs them itself "
       "instead of waiting for a worker. -1 = automatic: on when the ranks and the progress process "
       "share cores (no spare core: the loop's CPU is one the workers need), else 0 (off).", -1, 1),
    _p("LOOP_POLL_US", float, -1.0,
       "When the progress loop has run out of queued copy jobs and waits for workers to finish theirs, "
       "it polls this long before it sleeps (waking a sleeping thread from another CPU costs tens of us). "
       "-1 = automatic: 100 where the loop runs copy jobs itself (LOOP_COPIES), else 0.",
       -1),
    _p("PROXY_SPIN_US", float, 500.0,
       "An idle progress process polls this long before it sleeps on the pool condvar.", 0),
    _p("PROXY_WATCH_US", float, 50.0,
       "With nothing in flight but work whose end a transport can show in memory (a GPU graph's ack "
       "word), the loop waits in C for that, a post or news at most this long before its next pass "
       "(0: pass after pass, in Python). At most 10 ms, well inside a heartbeat.", 0, 10000),
    _p("KEEP_AWAKE_US", float, -1.0,
       "While the job is busy and for this long after, idle-priority threads of the progress process keep "
       "its CPUs from going idle (a halted vCPU wakes late when other guests load the host); they yield "
       "to any other thread at once, and wake the copy workers and ranks that sleep on their CPUs (no "
       "cross-CPU interrupt). -1 = automatic: 2000 when the ranks and the progress process share "
       "cores (no spare core), else 0 (off).", -1, 1e6),
    _p("PROXY_SLEEP_MS", float, 250.0,
       "Bound of one condvar sleep of the idle progress process (it rechecks abort and its ranks).", 1),
    _p("HEARTBEAT_MS", float, 100.0, "The progress process refreshes its heartbeat this often.", 1),
    _p("FAIL_LINGER_S", float, 5.0,
       "After the communicator failed, the progress process keeps its service up at most this long, until "
       "every local rank has mapped the pool (where the failure is recorded), died, closed, or had its "
       "join refused with the failure, so that a rank still joining learns who failed.", 0),
    _p("PROXY_CPUS", _parse_cpus, "",
       "Cores for the progress process: '' = automatic (cores the ranks do not use), 'none' = do not"
       " pin, or a CPU list such as '4-7'."),
    _p("PROXY_NCORES", int, 0,
       "How many cores the automatic policy gives the progress process; 0 = all spare cores, at most 16.", 0),
    _p("CUDA_GRAPHS", _parse_bool, True,
       "The progress process runs a device copy between the same two buffers, or a small device reduction "
       "on the same buffers, from its second time on as a CUDA graph (one launch call with its end event "
       "instead of separate calls). Off: separate driver calls every time."),
    _p("CUDA_DEVICE_COMPLETES", _parse_bool, True,
       "A repeated device message's requests are published by the GPU itself: its copy's CUDA graph "
       "ends with a kernel storing each request's completion word, so a rank waiting on it returns when "
       "the copy ends rather than when the progress loop notices (needs CUDA_GRAPHS). Off: the loop "
       "publishes them."),
    _p("CUDA_DEVICE_COMPLETES_MIN", parse_size, 1 << 20,
       "CUDA_DEVICE_COMPLETES applies to messages and collectives of at least this many bytes: on a "
       "small one the kernel it adds behind the copy cost more than the loop's own publishing "
       "(BENCHMARKS.md).", 0),
    _p("CUDA_ARMED_ROUTES", _parse_bool, True,
       "A device message that ran last time as a publishing graph (CUDA_DEVICE_COMPLETES) is armed when "
       "one of its halves waits in matching, and C launches it at the fetch of the other half, before "
       "the Python match (proxy/engine/armed.py). Off: every message takes the Python path."),
    _p("PROXY_LINGER_US", float, 20.0,
       "When a publishing graph's ack ends the loop's wait while routes may be armed, the loop first "
       "waits this long for the ranks' next post and takes it, before it retires the finished work (the "
       "ranks already saw their completions); where that post is the first half of an armed route, it "
       "waits as long again for the second and takes it in the same fetch, so that the route fires at "
       "once (proxy/engine/armed.py; 0: retire first).", 0, 1000),
    _p("CUDA_FUSED_REDUCE", _parse_bool, True,
       "A device Allreduce or Reduce is one kernel of our own reading every input and writing every output, "
       "at every size (float16, complex, bool and bfloat16 excepted). Off: cupy ufuncs, then copies of the "
       "result."),
    _p("TRANSPORTS", _parse_names, "",
       "Transports the progress process may use, by name, in registry order ('' = every registered one); "
       "a connection no allowed transport can carry is an error naming both ranks. The conformance "
       "tests run each transport alone with it."),
    # --- rank side ---
    _p("LOCK_SPIN_US", float, 5.0,
       "A process that finds the ops pool mutex held retries this long before it sleeps in the kernel "
       "(the holder only splices or takes a few records; a rank posting to an awake progress process "
       "does not lock at all; 0 = sleep at once).", 0, 100.0),
    _p("WAIT_SPIN_US", float, 500.0,
       "A rank in Wait() polls its completion this long before it sleeps on its futex.", 0),
    _p("WAIT_SPIN_MAX_BYTES", parse_size, 0,
       "Wait() spins only for requests up to this size; larger ones (done by copy workers) sleep at "
       "once, leaving the cores to the workers. 0 = automatic: when the node has fewer cores than "
       "local ranks + 2 (the ranks and the progress process share cores), EAGER_BYTES for messages and "
       "COLL_INLINE_BYTES for collectives (what the progress loop completes itself), else no limit.", 0),
    _p("WAIT_SLICE_MS", float, 200.0,
       "Bound of one sleep in Wait(); between sleeps the rank checks abort and the progress process. "
       "Also how often a rank whose GPU streams wait for its requests checks for the communicator's "
       "failure on a thread of its own (its host may be held by those streams).", 1),
    _p("TORCH_BLOCKING_DIRECT", _parse_bool, True,
       "The torch backend runs a blocking (async_op=False) all_reduce, broadcast, reduce or barrier of "
       "at most 64 KiB of CPU tensors (not bfloat16) as the communicator's blocking call on the calling "
       "thread, which on one node is the fast path between the ranks. Ranks must then agree on async_op "
       "for such calls (a blocking collective never matches a nonblocking one: the group fails on every "
       "rank with InvalidUsage). Off: every call is posted and its Work waited for. Every rank must use "
       "the same value."),
    _p("TORCH_ADOPT", _parse_adopt, "auto",
       "How the torch backend moves a large CPU tensor it sees a second time (DDP's buckets) into "
       "registered memory (shmproxy.torch.tensors): swap (its storage swaps memory with a comm.alloc "
       "block; torch >= 2.13), share (its storage is moved into shared memory with share_memory_(), "
       "the file-descriptor strategy of torch.multiprocessing, whose descriptor is then registered; "
       "every torch of the supported range), auto (swap where torch has it, else share) or off "
       "(such tensors are staged at every call)."),
    _p("NUMPY_ARENA", _parse_bool, True,
       "numpy arrays of at least NUMPY_ARENA_MIN_BYTES made after init (in the thread that called it) "
       "are allocated in registered memory, so that operations on them copy nothing at the rank, as "
       "with comm.alloc (shmproxy.rank.arena). Off: numpy's own allocator; such arrays are staged."),
    _p("NUMPY_ARENA_MIN_BYTES", parse_size, 64 << 10,
       "The smallest numpy array (bytes) the arena places; smaller ones come from numpy's allocator.", 0),
    _p("NUMPY_ARENA_BYTES", parse_size, 0,
       "Address space of the arena (sparse: only pages arrays touch take memory). 0 = twice the "
       "node's memory.", 0),
    _p("NUMPY_ARENA_KEEP_BYTES", parse_size, 256 << 20,
       "Bytes of freed arena blocks that keep their pages for the next array; the rest go back to "
       "the system at once.", 0),
    _p("STAGING_CACHE", parse_size, 256 << 20,
       "Bytes of staging buffers (for arrays not from comm.alloc) a rank keeps registered.", 0),
    _p("TIMEOUT", float, 600.0,
       "Seconds any rendezvous, init step or operation may take before Timeout is raised.", 0.001),
    # --- between nodes ---
    _p("BOOTSTRAP", _parse_hostport, "",
       "host:port where rank 0 serves the rendezvous of a job across nodes (NCCL_COMM_ID's convention); "
       "'' = torchrun's store, else mpi4py's COMM_WORLD."),
    _p("HOSTNAME", str, "",
       "This host's identity for grouping ranks into nodes; '' = hostname, boot id, network namespace."),
    _p("SOCKET_IFNAME", _parse_ifname, "",
       "Interfaces for traffic between nodes: prefixes, '^' excludes, '=' exact (NCCL's syntax); "
       "'' = the one that routes to the rendezvous address."),
    _p("SOCKET_NTHREADS", int, 2,
       "Sockets per peer node of the TCP transport, each with a reader and a writer thread: a message's "
       "chunks spread over all of them (a collective's take the NET_COLL_SOCKETS).", 1, 16),
    _p("NET_COLL_SOCKETS", int, 4,
       "Sockets per peer node for collectives' frames, besides SOCKET_NTHREADS, driven by C threads "
       "that never take the GIL (shm/_wire.c); a chunk is split over them. 0 = collectives' frames on "
       "the last of the Python-threaded sockets. Every node must use the same value.", 0, 16),
    _p("NET_COLL_PART_BYTES", parse_size, 256 << 10,
       "A collective's frame between nodes is split over the NET_COLL_SOCKETS in parts of at least "
       "this size.", 4096),
    _p("NET_COLL_FORWARD", int, 1,
       "A collective's step between nodes that sends on what the step before it received (a ring's next "
       "segment) is sent by the collective wire's thread that landed it, not by the loop after it "
       "(shm/_wire.c, recv's then). 0 = the loop starts every send.", 0, 1),
    _p("NSOCKS_PERTHREAD", int, 1, "TCP sockets per helper thread.", 1, 16),
    _p("NET_CHUNK_SIZE", parse_size, 1 << 20,
       "Bytes per chunk of a message between nodes (chunks spread over the sockets).", 64 << 10),
    _p("NET_EAGER_BYTES", parse_size, 64 << 10,
       "Messages between nodes up to this size travel with their envelope (the send completes at once); "
       "a larger one pays the rendezvous (envelope, clear-to-send, data, done: four crossings). "
       "Open MPI's TCP eager limit is 64 KiB too.", 0),
    _p("NET_RING_MIN_BYTES", parse_size, 256 << 10,
       "Allreduce chunks from this size go around a ring of the nodes; smaller ones up a tree to node 0 and back.", 0),
    _p("NET_DIRECT_WRITE_BYTES", parse_size, 16 << 10,
       "A bulk frame between nodes up to this size is written by the thread that makes it (the loop) when "
       "its socket is idle, without blocking, instead of waking the socket's writer thread; what does "
       "not fit in the socket's buffer goes to the writer. The collective wire's frames too (shm/_wire.c), "
       "and a frame of at most this much that came before its receive is landed by the loop, not the "
       "wire's copier thread.", 0),
    _p("NET_LOCAL_WORKERS", int, -1,
       "Collectives between nodes: a chunk's local reductions and copies (those of a node with several "
       "ranks) on the copy workers (1) or on the loop (0); its frames stay the loop's and the wire's. "
       "-1 = automatic: the workers, unless the node is crowded (no core spare for them).", -1, 1),
    _p("NET_LOOP_WAIT", int, -1,
       "While a collective between nodes waits on the network and nothing else is in flight, the progress "
       "loop waits for the link's news without passing through Python, whose GIL the link's threads "
       "would queue for: 1 = spinning in C with the GIL released (at most 1 ms per wait), 2 = asleep on "
       "the pool's condvar (news and posts wake it), 0 = Python passes; -1 = automatic: 1, or 0 where "
       "no core is spare (a spin takes the CPU the link's threads need; 2 was not measured apart from "
       "0 on a loaded 2-core VM).", -1, 2),
    _p("NET_KEEPALIVE_S", float, 5.0,
       "TCP keepalive idle time between nodes; a dead link is declared after about three times this.", 1),
    # --- shared memory ---
    _p("SHM_DIR", str, "/dev/shm", "Where POSIX shared memory lives (checked for free space at init)."),
    _p("RUN_DIR", str, "",
       "Directory for service sockets and dumps; '' = $XDG_RUNTIME_DIR or /tmp, under shmproxy-<uid>."),
    _p("JOB_ID", str, "", "Identity of the job shared by its ranks; '' = derived from the launcher."),
    # --- observability ---
    _p("DEBUG", _parse_level, "NONE", "Log level: NONE, WARN, INFO or TRACE."),
    _p("DEBUG_SUBSYS", _parse_subsys, "ALL",
       "Subsystems to log: INIT,PROXY,SHM,NET,SERVICE,BOOTSTRAP,COLL or ALL; ^NAME excludes."),
    _p("DEBUG_FILE", str, "", "Log file instead of stderr; %h = host, %p = pid."),
    _p("DUMP_SIGNAL", _parse_signal, 0,
       "Signal that makes the progress process dump its state (e.g. SIGUSR1); 0 = off."),
    _p("PROFILE", _parse_bool, False, "Record progress events (idle/active, sleep/wake, per-op times)."),
    _p("PROFILE_FILE", str, "", "Write the recorded events as a Chrome trace here at exit (%p = pid)."),
)


class Params:
    """The resolved parameter set. ``params.NAME`` gives the value."""

    def __init__(self, env: Mapping[str, str] | None = None, overrides: Mapping[str, Any] | None = None):
        env = os.environ if env is None else env
        self._params: dict[str, Param] = {p.name: dataclasses.replace(p) for p in _DECLARED}
        unknown = sorted(k for k in env if k.startswith(PREFIX) and k[len(PREFIX):] not in self._params)
        if unknown:
            raise InvalidArgument(
                f"unknown shmproxy parameter(s) in the environment: {', '.join(unknown)}; "
                f"`python -m shmproxy.core.params` lists them all")
        for p in self._params.values():
            p.value = p.default
            raw = env.get(p.env_name())
            if raw is not None:
                p.value = self._convert(p, raw, "environment")
                p.origin = "environment"
        for name, value in (overrides or {}).items():
            key = name.upper()
            if key not in self._params:
                raise InvalidArgument(f"unknown shmproxy parameter {name!r}")
            p = self._params[key]
            p.value = self._convert(p, value if isinstance(value, str) else str(value), "override")
            p.origin = "override"

    @staticmethod
    def _convert(p: Param, raw: str, origin: str) -> Any:
        try:
            value = p.parse(raw)
        except (ValueError, KeyError, TypeError) as exc:
            raise InvalidArgument(f"{p.env_name()}={raw!r} ({origin}) is invalid: {exc}") from exc
        if p.minimum is not None and value < p.minimum:
            raise InvalidArgument(f"{p.env_name()}={raw!r} ({origin}) is below the minimum {p.minimum}")
        if p.maximum is not None and value > p.maximum:
            raise InvalidArgument(f"{p.env_name()}={raw!r} ({origin}) is above the maximum {p.maximum}")
        return value

    def __getattr__(self, name: str) -> Any:
        try:
            return self.__dict__["_params"][name].value
        except KeyError:
            raise AttributeError(name) from None

    @property
    def eager_limit(self) -> int:
        """The largest message the progress loop copies itself at match time: EAGER_BYTES, but never
        more than one chunk. The loop (proxy/engine/progress.py) and Wait's spin limit
        (proxy/rank/lifecycle.py) must agree on it, so it is derived here once."""
        return min(self.EAGER_BYTES, self.CHUNK_SIZE)

    def coll_inline_bytes(self, nlocal: int) -> int:
        """The largest collective (bytes per rank) the progress loop runs itself on a node of ``nlocal``
        ranks: COLL_INLINE_BYTES, or its automatic value. The loop (proxy/coll/runner.py) and Wait's
        spin limit (proxy/rank/lifecycle.py) must agree on it."""
        if self.COLL_INLINE_BYTES >= 0:
            return self.COLL_INLINE_BYTES
        return max(64 << 10, min(1 << 20, self.COLL_INLINE_AUTO_BYTES // max(nlocal * nlocal, 1)))

    def fast_bytes(self, nlocal: int, size: int, crowded: bool = False, mem_bytes: int = 0) -> int:
        """The fast path's message limit on a communicator of ``size`` ranks, ``nlocal`` on this node:
        0 (off) unless they all are, and no more than FAST_MAX_RANKS; FAST_BYTES, or its automatic
        value (a power of two: the cells of nlocal**2 pairs, FAST_CELLS each, in FAST_AUTO_POOL_BYTES
        (automatic: from the node's ``mem_bytes``), at most FAST_AUTO_MAX_BYTES, or
        FAST_AUTO_CROWDED_MAX_BYTES on a ``crowded`` node)."""
        if nlocal != size or nlocal > self.FAST_MAX_RANKS or self.FAST_BYTES == 0:
            return 0
        if self.FAST_BYTES > 0:
            return self.FAST_BYTES
        pool = self.FAST_AUTO_POOL_BYTES
        if pool < 0:
            pool = max(FAST_AUTO_POOL_MIN, min(FAST_AUTO_POOL_MAX, mem_bytes // 4096))
        per = pool // (4 * nlocal * nlocal)
        b = 512
        cap = self.FAST_AUTO_CROWDED_MAX_BYTES if crowded else self.FAST_AUTO_MAX_BYTES
        while b * 2 <= min(per, cap):
            b *= 2
        return b

    def items(self) -> list[Param]:
        return list(self._params.values())

    def to_env(self) -> dict[str, str]:
        """Every value not at its default, as environment variables, for a child that must agree."""
        out = {}
        for p in self._params.values():
            if p.origin == "default":
                continue
            v = p.value
            out[p.env_name()] = ("1" if v else "0") if isinstance(v, bool) else str(v)
        return out

    def as_dict(self) -> dict[str, dict[str, Any]]:
        return {p.name: {"value": p.value, "default": p.default, "origin": p.origin}
                for p in self._params.values()}

    def dump(self) -> str:
        width = max(len(p.env_name()) for p in self._params.values())
        lines = []
        for p in self._params.values():
            lines.append(f"{p.env_name():<{width}}  {p.value!s:<12} [{p.origin}]  {p.description}")
        return "\n".join(lines)


_current: Params | None = None


def get(overrides: Mapping[str, Any] | None = None) -> Params:
    """The process-wide parameters, read from the environment once; overrides make a fresh set."""
    global _current
    if overrides:
        return Params(overrides=overrides)
    if _current is None:
        _current = Params()
    return _current


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    params = Params()
    if "--json" in args:
        print(json.dumps(params.as_dict(), indent=2, default=str))
    else:
        print(params.dump())
    return 0


if __name__ == "__main__":
    sys.exit(main())
