"""Device Allreduce as the ranks' own kernels on their own streams, between GPUs of their own.

A device Allreduce through the progress process costs the post, the loop's fetch and launch, and
the completion's way back: tens of microseconds before and after the GPU's few (BENCHMARKS.md); and
there one kernel on one GPU does the whole reduction. NCCL's all-reduce is one kernel per rank that
moves data over the GPUs' link itself. These are such kernels, for an Allreduce of device memory on
a communicator of one node whose ranks each have a GPU of their own: up to DEVICE_ONESHOT_BYTES the
*one-shot* kernel (every rank reads every peer's input and reduces all of it: one exchange, for
latency), above it *two-shot* kernels (each rank reduces a 1/N share, then hands it to its peers:
each byte crosses the link twice in all, for bandwidth), up to DEVICE_TWOSHOT_BYTES.

- **Set-up, once per communicator**, at its first such call, which every rank makes alike (a
  collective, as the call is): each rank allocates a *scratch* on its device (per peer and block
  two flags and a signature, and two data halves), the ranks exchange the scratches' CUDA IPC handles
  and their GPUs' PCI bus ids (an object allgather), and each maps its peers' scratches. If two
  ranks share a GPU (their kernels would spin against each other on one GPU that runs one process's
  work at a time) or a rank cannot map a peer's memory, every rank learns it from a second
  allgather, and the communicator never takes this path again.
- **A one-shot call** launches one kernel on the caller's stream, after its queued work, as NCCL's
  kernels are. Each block copies its slice of the input into half ``epoch & 1`` of this rank's
  scratch, then, after a system-scope fence, stores the call's signature and (a release) its flag
  into its slots in every peer's scratch; it waits in its own scratch until every peer's flag for
  that block reached the call's (an acquire), then reduces the slice from every rank's scratch in
  rank order into the output: every rank gets the same bits, and the same as the progress
  process's fused kernel (shmproxy.core.kernels).
- **A two-shot call** is one kernel per window of DEVICE_TWOSHOT_WINDOW bytes. Each block's slice is
  cut in N parts, rank q reducing part q: the block writes each peer's part of its input into that
  peer's scratch and flags it; once its peers' values of its own part are there it reduces them in
  rank order with its own input's into its output and into every peer's scratch, and flags that;
  once its peers' reduced parts are there it copies them into its output. A block moves its parts in
  chunks of DEVICE_TWOSHOT_CHUNK, the steps of successive chunks overlapping. A flag's value is the
  epoch above 20 bits and the chunks delivered below, so it only grows, whichever kernel stored it.
- **Why two halves are enough**: a rank writes half ``e & 1`` of its own scratch or a peer's (and
  its signature slots of that parity) again at epoch e + 2 only after its kernel of epoch e + 1 saw
  every peer's first flag of e + 1, which each peer stored after its kernel of epoch e had read what
  it needed. So a rank's kernels must run one after another: a call on another stream than the last
  call's first makes its stream wait for the last kernel (an event recorded behind each).
- **Bounds**: a waiting block reads, every thousand spins, a host-mapped abort word, set once the
  communicator failed (``release``: from the rank's failure path, which its failure watch thread
  runs when the host is held by the GPU: shmproxy.rank.device), and the GPU's clock against TIMEOUT;
  either ends the kernel with a status in host-mapped memory. A peer whose signature (count, dtype,
  op) differs ends it at once. A blocking call reads the status after its synchronize; the torch
  backend at the group's next call. A rank that finds a kernel failed fails the communicator (Abort)
  before it raises, so no peer waits for a bound of its own. A rank that passed host memory where its
  peers passed device memory, or called Iallreduce (which stays with the progress process) where
  they called Allreduce, posts to the progress process while they wait in their kernels: they end at
  TIMEOUT (mismatched calls, which no side can see before it starts).
- **Deadlock freedom** needs a block to wait only for the same block of its peers, and GPUs to start
  a kernel's blocks in index order (they do), so that the lowest unfinished block of every rank is
  running.
"""
from __future__ import annotations

import contextlib
import ctypes
from typing import Any, Iterator

import numpy as np

from shmproxy.core import errors, log
from shmproxy.core.kernels import AVG_FINISH, C_TYPES, REDUCE_EXPR
from shmproxy.core.ops import DTYPE_BFLOAT16, IN_PLACE, ReduceOp
from shmproxy.transports.cuda_driver import Driver

_log = log.get("RANK")

MAX_RANKS = 8          # kernels are written out per count of ranks (each peer's scratch is a parameter)
MAX_BLOCKS = 512       # flag and signature slots per peer
BLOCK = 512            # threads per block
PER_THREAD = 2         # 16-byte packs a thread copies and reduces, up to DEVICE_ONESHOT_BLOCKS blocks:
                       # the loads of a peer's memory are each a round trip over the link, so they go
                       # wide (blocks, then the unrolled loop's loads in flight together), not deep
_C_TYPE = {np.dtype(name): ctype for name, ctype in C_TYPES.items()}   # by dtype (its .name is slow)
# scratch layout, in 64-bit words: flags [peer][block] (the one-shot's, and the two-shot's first), the
# two-shot's second flags [peer][block], signatures [parity][peer][block], then the two data halves (at a
# byte offset that keeps them 256-byte aligned)
_FLAGS2 = MAX_RANKS * MAX_BLOCKS
_SIGS = 2 * MAX_RANKS * MAX_BLOCKS
_DATA = 8 * 4 * MAX_RANKS * MAX_BLOCKS
# host-mapped words: the abort word (host -> GPU), then a failed kernel's status and peer (GPU -> host)
W_ABORT, W_STATUS, W_PEER = 0, 1, 2
ST_TIMEOUT, ST_ABORTED, ST_MISMATCH = 1, 2, 3
_MAPPED = 3            # cudaHostAllocPortable | cudaHostAllocMapped
_LAZY_PEER_ACCESS = 1  # cudaIpcMemLazyEnablePeerAccess

_SRC = r"""
typedef %(ctype)s T;
#define NR %(nranks)d
#define MAXB %(maxb)d
#define FLAGS2 %(flags2)d
#define SIGS %(sigs)d
#define DATA %(data)d
#define VEC (16 / sizeof(T))
/* a flag's value: the call's epoch above FLAG_SHIFT bits, and the chunks delivered below them
   (one-shot: 1), so that it only grows from call to call whichever kernel stored it */
#define FLAG_SHIFT 20
#define CHUNK (%(chunk)d / sizeof(T))
typedef unsigned long long u64;
union Pack { uint4 v; T e[VEC]; };
__device__ __forceinline__ u64 ld_acquire(const u64* p) {
    u64 v;
    asm volatile("ld.acquire.sys.global.u64 %%0, [%%1];" : "=l"(v) : "l"(p) : "memory");
    return v;
}
__device__ __forceinline__ void st_release(u64* p, u64 v) {
    asm volatile("st.release.sys.global.u64 [%%0], %%1;" :: "l"(p), "l"(v) : "memory");
}
__device__ __forceinline__ u64 clock_ns() {
    u64 t;
    asm volatile("mov.u64 %%0, %%globaltimer;" : "=l"(t));
    return t;
}
/* One thread's wait for peer ``t``'s flag of this block to reach ``value`` (an acquire); ``sig_at``:
   where the peer stored its signature, compared once the flag is there (0: none to compare). On a
   failure (the abort word, the GPU clock past the timeout, another signature) the status goes to
   the host-mapped words and the block is told through ``failed``. */
__device__ __forceinline__ void wait_flag(const u64* flag, const u64* sig_at, u64 sig, u64 value,
                                          volatile u64* words, u64 timeout_ns, unsigned t, int* failed) {
    u64 start = 0, why = 0;
    unsigned int spins = 0;
    while (ld_acquire(flag) < value) {
        if (++spins & 1023)
            continue;
        if (words[0]) { why = 2; break; }
        const u64 now = clock_ns();
        if (start == 0) start = now;
        else if (now - start > timeout_ns) { why = 1; break; }
    }
    if (!why && sig_at && *sig_at != sig)
        why = 3;
    if (why) {
        words[2] = t;
        __threadfence_system();
        words[1] = why;
        *failed = 1;
    }
}
/* a: the value so far, b: the next rank's, in rank order (the progress process's expressions) */
__device__ __forceinline__ T combine(const T* const* src, u64 k) {
    T a = src[0][k], b;
%(steps)s
%(finish)s
    return a;
}
__device__ __forceinline__ uint4 combine_pack(const T* const* src, u64 k) {
    Pack p[NR];
#pragma unroll
    for (int r = 0; r < NR; r++)   /* every rank's load first: one round trip for all of them */
        p[r].v = ((const uint4*)src[r])[k];
#pragma unroll
    for (int j = 0; j < VEC; j++) {
        T a = p[0].e[j], b;
%(pack_steps)s
%(finish)s
        p[0].e[j] = a;
    }
    return p[0].v;
}
/* One-shot. Slices of a multiple of VEC elements per block; with ``vec`` (the input and the output
   16-byte aligned) a slice moves in 16-byte packs, the rest of the last one element by element. */
extern "C" __global__ void shmproxy_oneshot(
        u64 in_, u64 out_, u64 n, u64 epoch, u64 me, u64 cap, u64 words_,
        u64 timeout_ns, u64 sig, u64 vec, %(params)s) {
    const u64 sc[NR] = {%(scratch)s};
    __shared__ int failed;
    u64 per = (n + gridDim.x - 1) / gridDim.x;
    per = (per + VEC - 1) / VEC * VEC;
    const u64 lo = per * blockIdx.x < n ? per * blockIdx.x : n;
    const u64 hi = lo + per < n ? lo + per : n;
    const u64 packs_end = vec ? lo + (hi - lo) / VEC * VEC : lo;
    const u64 half = DATA + (epoch & 1) * cap;
    const u64 sigs = SIGS + (epoch & 1) * NR * MAXB;
    const unsigned int t = threadIdx.x;
    T* mine = (T*)(sc[me] + half);
#pragma unroll 4
    for (u64 k = lo / VEC + t; k < packs_end / VEC; k += blockDim.x)
        ((uint4*)mine)[k] = ((const uint4*)in_)[k];
    for (u64 k = packs_end + t; k < hi; k += blockDim.x)
        mine[k] = ((const T*)in_)[k];
    if (t == 0)
        failed = 0;
    __syncthreads();
    if (t < NR && t != me) {
        /* the block's copies (ordered before this thread's next stores by the barrier), before any
           peer can see the flag */
        __threadfence_system();
        u64* peer = (u64*)sc[t];
        peer[sigs + me * MAXB + blockIdx.x] = sig;
        st_release(peer + me * MAXB + blockIdx.x, (epoch << FLAG_SHIFT) + 1);
        const u64* own = (const u64*)sc[me];
        wait_flag(own + t * MAXB + blockIdx.x, own + sigs + t * MAXB + blockIdx.x, sig, (epoch << FLAG_SHIFT) + 1,
                  (volatile u64*)words_, timeout_ns, t, &failed);
    }
    __syncthreads();
    if (failed)
        return;
    const T* src[NR];
#pragma unroll
    for (int r = 0; r < NR; r++)
        src[r] = (const T*)(sc[r] + half);
#pragma unroll 4
    for (u64 k = lo / VEC + t; k < packs_end / VEC; k += blockDim.x)
        ((uint4*)out_)[k] = combine_pack(src, k);
    for (u64 k = packs_end + t; k < hi; k += blockDim.x)
        ((T*)out_)[k] = combine(src, k);
}
/* Copy ``len`` elements, in 16-byte packs where ``vec`` (both ends aligned: ``len`` past its packs
   is the buffer's tail), element by element otherwise. */
__device__ __forceinline__ void copy_run(T* dst, const T* s, u64 len, u64 vec) {
    const u64 packs = vec ? len / VEC : 0;
#pragma unroll 4
    for (u64 k = threadIdx.x; k < packs; k += blockDim.x)
        ((uint4*)dst)[k] = ((const uint4*)s)[k];
    for (u64 k = packs * VEC + threadIdx.x; k < len; k += blockDim.x)
        dst[k] = s[k];
}
/* Two-shot (reduce-scatter, then all-gather, through the peers' scratches). The block's slice of
   ``per`` elements is cut in NR parts; rank q reduces part q. In rank r's scratch, slot d (of
   ``slot`` elements) holds rank q's values of r's parts, and slot NR-1+d rank q's reduced parts,
   d = (q - r + NR) %% NR - 1; within a slot, block b's part starts at b * sub. A part moves in
   chunks of CHUNK elements, each through three steps:
   1. the chunk of each peer's part is written into that peer's scratch (over the link), then a flag;
   2. once every peer's chunk of this rank's part is here: reduced in rank order (this rank's own
      values from its input), into its output and into every peer's scratch, then a second flag;
   3. once every peer's reduced chunk is here: copied into the output.
   A block runs step 1 of chunk c, 2 of chunk c - 1 and 3 of chunk c - 2 in turn, so the link
   carries step 1's and step 2's writes while step 3 copies and the flags travel. */
__device__ __forceinline__ void signal(const u64* sc, u64 me, u64 at, u64 value) {
    /* the block's stores (ordered before this thread's next ones by the barrier before), then the
       flag at ``at`` of every peer's scratch: thread t signals rank t */
    const unsigned t = threadIdx.x;
    if (t < NR && t != me) {
        __threadfence_system();
        st_release((u64*)sc[t] + at + me * MAXB + blockIdx.x, value);
    }
}
extern "C" __global__ void shmproxy_twoshot(
        u64 in_, u64 out_, u64 n, u64 epoch, u64 me, u64 cap, u64 words_,
        u64 timeout_ns, u64 sig, u64 vec, %(params)s) {
    const u64 sc[NR] = {%(scratch)s};
    __shared__ int failed;
    u64 per = (n + gridDim.x - 1) / gridDim.x;
    per = (per + NR * VEC - 1) / (NR * VEC) * (NR * VEC);
    const u64 sub = per / NR, slot = sub * gridDim.x;
    const u64 lo = per * blockIdx.x < n ? per * blockIdx.x : n;
    const u64 hi = lo + per < n ? lo + per : n;
    const u64 half = DATA + (epoch & 1) * cap;
    const u64 sigs = SIGS + (epoch & 1) * NR * MAXB;
    const u64 base = epoch << FLAG_SHIFT;
    const u64 chunks = (sub + CHUNK - 1) / CHUNK;   /* the same on every rank and block */
    const unsigned int t = threadIdx.x;
    const T* in = (const T*)in_;
    T* out = (T*)out_;
    volatile u64* words = (volatile u64*)words_;
    const u64* own = (const u64*)sc[me];
#define PART_LO(q) (lo + (q) * sub < hi ? lo + (q) * sub : hi)
#define PART_HI(q) (lo + ((q) + 1) * sub < hi ? lo + ((q) + 1) * sub : hi)
#define SLOT(r, d) ((T*)(sc[r] + half) + (d) * slot + blockIdx.x * sub)
/* chunk c of part q: its offset in the part, and its length (0 past the part's end) */
#define C_LO(c) ((c) * CHUNK)
#define C_LEN(q, c) (PART_HI(q) - PART_LO(q) > C_LO(c) ? \
    (PART_HI(q) - PART_LO(q) - C_LO(c) < CHUNK ? PART_HI(q) - PART_LO(q) - C_LO(c) : CHUNK) : 0)
    if (t == 0)
        failed = 0;
    if (t < NR && t != me)
        ((u64*)sc[t])[sigs + me * MAXB + blockIdx.x] = sig;   /* before the first flag (signal's fence) */
    const u64 mlo = PART_LO(me);
    const T* src[NR];
    T* dst[NR];
    for (u64 it = 0; it < chunks + 2; it++) {
        if (it < chunks) {                       /* step 1 of chunk ``it`` */
            const u64 c = it;
            for (int q = 0; q < NR; q++) {
                if (q == me)
                    continue;
                copy_run(SLOT(q, (me - q + NR) %% NR - 1) + C_LO(c), in + PART_LO(q) + C_LO(c), C_LEN(q, c), vec);
            }
            __syncthreads();
            signal(sc, me, 0, base + c + 1);
        }
        if (it >= 1 && it <= chunks) {           /* step 2 of chunk ``it - 1`` */
            const u64 c = it - 1;
            if (t < NR && t != me)
                wait_flag(own + t * MAXB + blockIdx.x, c == 0 ? own + sigs + t * MAXB + blockIdx.x : 0, sig,
                          base + c + 1, words, timeout_ns, t, &failed);
            __syncthreads();
            if (failed)
                return;
            const u64 len = C_LEN(me, c);
#pragma unroll
            for (int r = 0; r < NR; r++) {
                src[r] = r == me ? in + mlo + C_LO(c) : SLOT(me, (r - me + NR) %% NR - 1) + C_LO(c);
                dst[r] = r == me ? out + mlo + C_LO(c) : SLOT(r, NR - 1 + (me - r + NR) %% NR - 1) + C_LO(c);
            }
            const u64 packs = vec ? len / VEC : 0;
#pragma unroll 2
            for (u64 k = t; k < packs; k += blockDim.x) {
                const uint4 v = combine_pack(src, k);
#pragma unroll
                for (int r = 0; r < NR; r++)
                    ((uint4*)dst[r])[k] = v;
            }
            for (u64 k = packs * VEC + t; k < len; k += blockDim.x) {
                const T v = combine(src, k);
#pragma unroll
                for (int r = 0; r < NR; r++)
                    dst[r][k] = v;
            }
            __syncthreads();
            signal(sc, me, FLAGS2, base + c + 1);
        }
        if (it >= 2) {                           /* step 3 of chunk ``it - 2`` */
            const u64 c = it - 2;
            if (t < NR && t != me)
                wait_flag(own + FLAGS2 + t * MAXB + blockIdx.x, 0, 0, base + c + 1, words, timeout_ns, t, &failed);
            __syncthreads();
            if (failed)
                return;
            for (int q = 0; q < NR; q++) {
                if (q == me)
                    continue;
                copy_run(out + PART_LO(q) + C_LO(c), SLOT(me, NR - 1 + (q - me + NR) %% NR - 1) + C_LO(c),
                         C_LEN(q, c), vec);
            }
        }
    }
}
/* Reduce_scatter_block and Allgather: every rank's share is ``n`` elements (this window's), ``stride``
   apart in the buffer that holds one per rank; block b moves elements [b * sub, b * sub + sub) of
   each share. Rank r's scratch slot d holds rank q's values for r, d = (q - r + NR) %% NR - 1. */
#define BLO (blockIdx.x * sub < n ? blockIdx.x * sub : n)
#define BLEN ((blockIdx.x + 1) * sub < n ? sub : n - BLO)
#define SHARE_SLOT(r, d) ((T*)(sc[r] + half) + (d) * sub * gridDim.x + blockIdx.x * sub)
/* The flag of this block to every peer, then the wait for theirs (see the one-shot's). */
__device__ __forceinline__ bool exchange_flags(const u64* sc, u64 me, u64 sigs, u64 sig, u64 value,
                                               volatile u64* words, u64 timeout_ns, int* failed) {
    const unsigned t = threadIdx.x;
    if (t == 0)
        *failed = 0;
    __syncthreads();
    if (t < NR && t != me) {
        __threadfence_system();
        u64* peer = (u64*)sc[t];
        peer[sigs + me * MAXB + blockIdx.x] = sig;
        st_release(peer + me * MAXB + blockIdx.x, value);
        const u64* own = (const u64*)sc[me];
        wait_flag(own + t * MAXB + blockIdx.x, own + sigs + t * MAXB + blockIdx.x, sig, value, words,
                  timeout_ns, t, failed);
    }
    __syncthreads();
    return !*failed;
}
/* Each rank's share of ``in`` is written into its rank's scratch; this rank's own share is then
   reduced, in rank order, from its input and the peers' values into ``out``. */
extern "C" __global__ void shmproxy_reduce_scatter(
        u64 in_, u64 out_, u64 n, u64 epoch, u64 me, u64 cap, u64 words_,
        u64 timeout_ns, u64 sig, u64 vec, %(params)s, u64 stride) {
    const u64 sc[NR] = {%(scratch)s};
    __shared__ int failed;
    u64 sub = (n + gridDim.x - 1) / gridDim.x;
    sub = (sub + VEC - 1) / VEC * VEC;
    const u64 half = DATA + (epoch & 1) * cap;
    const u64 sigs = SIGS + (epoch & 1) * NR * MAXB;
    const T* in = (const T*)in_;
    for (int q = 0; q < NR; q++)
        if (q != me)
            copy_run(SHARE_SLOT(q, (me - q + NR) %% NR - 1), in + q * stride + BLO, BLEN, vec);
    if (!exchange_flags(sc, me, sigs, sig, (epoch << FLAG_SHIFT) + 1, (volatile u64*)words_, timeout_ns,
                        &failed))
        return;
    const T* src[NR];
#pragma unroll
    for (int r = 0; r < NR; r++)
        src[r] = r == me ? in + me * stride + BLO : SHARE_SLOT(me, (r - me + NR) %% NR - 1);
    T* out = (T*)out_ + BLO;
    const u64 len = BLEN, packs = vec ? len / VEC : 0;
#pragma unroll 2
    for (u64 k = threadIdx.x; k < packs; k += blockDim.x)
        ((uint4*)out)[k] = combine_pack(src, k);
    for (u64 k = packs * VEC + threadIdx.x; k < len; k += blockDim.x)
        out[k] = combine(src, k);
}
/* This rank's input is written into every peer's scratch and its own share of ``out``; the peers'
   are then copied from the scratch into theirs. */
extern "C" __global__ void shmproxy_allgather(
        u64 in_, u64 out_, u64 n, u64 epoch, u64 me, u64 cap, u64 words_,
        u64 timeout_ns, u64 sig, u64 vec, %(params)s, u64 stride) {
    const u64 sc[NR] = {%(scratch)s};
    __shared__ int failed;
    u64 sub = (n + gridDim.x - 1) / gridDim.x;
    sub = (sub + VEC - 1) / VEC * VEC;
    const u64 half = DATA + (epoch & 1) * cap;
    const u64 sigs = SIGS + (epoch & 1) * NR * MAXB;
    const T* in = (const T*)in_ + BLO;
    T* out = (T*)out_;
    for (int q = 0; q < NR; q++)
        if (q != me)
            copy_run(SHARE_SLOT(q, (me - q + NR) %% NR - 1), in, BLEN, vec);
    if (in != out + me * stride + BLO)   /* IN_PLACE: the share is there already */
        copy_run(out + me * stride + BLO, in, BLEN, vec);
    if (!exchange_flags(sc, me, sigs, sig, (epoch << FLAG_SHIFT) + 1, (volatile u64*)words_, timeout_ns,
                        &failed))
        return;
    for (int q = 0; q < NR; q++)
        if (q != me)
            copy_run(out + q * stride + BLO, SHARE_SLOT(me, (q - me + NR) %% NR - 1), BLEN, vec);
}
"""

# the kernels' parameters past the scratches: the stride between the ranks' shares
_STRIDED = ("shmproxy_reduce_scatter", "shmproxy_allgather")
# a signature's op byte for the kernels that take no op (the peers compare whole signatures)
_SIG_ALLGATHER = 0xA0
_SIG_REDUCE_SCATTER = 0x40   # | the op


def kernel_source(ctype: str, redop: int, nranks: int, chunk: int = 128 << 10) -> str:
    """Both kernels' CUDA C for one element type, op and count of ranks; ``chunk``: the bytes of a
    two-shot step."""
    expr = REDUCE_EXPR[redop]
    return _SRC % {
        "ctype": ctype, "chunk": chunk, "nranks": nranks, "maxb": MAX_BLOCKS, "flags2": _FLAGS2, "sigs": _SIGS,
        "data": _DATA,
        "params": ", ".join(f"u64 s{r}" for r in range(nranks)),
        "scratch": ", ".join(f"s{r}" for r in range(nranks)),
        "steps": "\n".join(f"    b = src[{r}][k]; a = {expr};" for r in range(1, nranks)),
        "pack_steps": "\n".join(f"        b = p[{r}].e[j]; a = {expr};" for r in range(1, nranks)),
        "finish": "    " + AVG_FINISH % nranks if redop == ReduceOp.AVG else ""}


def eligible(comm: Any, nbytes: int, dtype: np.dtype, op: int) -> bool:
    """Whether an Allreduce of this signature takes the one-shot kernel, if its buffers are device
    memory: the same answer on every rank of a correct program (nothing here is the rank's own)."""
    p = comm.params
    return (0 < nbytes <= max(p.DEVICE_ONESHOT_BYTES, p.DEVICE_TWOSHOT_BYTES) and comm.local_size == comm.size
            and 2 <= comm.size <= MAX_RANKS and dtype in _C_TYPE and op in REDUCE_EXPR
            and comm.__dict__.get("_oneshot") is not False)


def allreduce(comm: Any, sendbuf: Any, recvbuf: Any, op: int, stream: Any) -> bool:
    """A blocking Allreduce of device arrays through the ranks' kernels, done on return (the data
    in place, as after the progress process's path); False where the call does not take it (the
    caller posts it). Host and device mixed in one call raise here, as on the posted path."""
    send, recv, mem = comm._device_args("Allreduce", sendbuf, recvbuf)
    if not mem or recv is None:
        return False
    dev = comm._device
    if dev.dtype_code(recv) == DTYPE_BFLOAT16:
        return False
    in_place = sendbuf is IN_PLACE
    if not in_place and (send is None or send.dtype != recv.dtype or send.size != recv.size):
        return False   # the posted path names what is wrong
    if not eligible(comm, recv.nbytes, recv.dtype, op):
        return False
    did = recv.device.id
    shot = shared(comm, did)
    if shot is None:
        return False
    s = dev.as_stream(stream, did)
    sp = (s if s is not None else dev.cp.cuda.get_current_stream()).ptr
    shot.launch(recv.data.ptr if in_place else send.data.ptr, recv.data.ptr, recv.size, recv.dtype, op, sp)
    shot.synchronize(sp)
    shot.check(comm)
    return True


def allgather(comm: Any, sendbuf: Any, recvbuf: Any, stream: Any) -> bool:
    """A blocking Allgather of device arrays through the ranks' kernels, as ``allreduce``."""
    send, recv, mem = comm._device_args("Allgather", sendbuf, recvbuf)
    if not mem or recv is None:
        return False
    count, in_place = recv.size // comm.size, sendbuf is IN_PLACE
    fits = in_place or (send is not None and send.dtype == recv.dtype and send.size == count)
    if recv.size != count * comm.size or not fits:
        return False   # the posted path names what is wrong
    src = recv.data.ptr + comm.rank * count * recv.dtype.itemsize if in_place else send.data.ptr
    return _run_shares(comm, "shmproxy_allgather", src, recv, count, ReduceOp.SUM, stream)


def reduce_scatter_block(comm: Any, sendbuf: Any, recvbuf: Any, op: int, stream: Any) -> bool:
    """A blocking Reduce_scatter_block of device arrays through the ranks' kernels, as ``allreduce``
    (IN_PLACE stays with the progress process: a rank's result would overwrite the first share of
    its input while its peers' may still be read)."""
    if sendbuf is IN_PLACE:
        return False
    send, recv, mem = comm._device_args("Reduce_scatter_block", sendbuf, recvbuf)
    if not mem or recv is None or send is None:
        return False
    if send.dtype != recv.dtype or send.size != recv.size * comm.size:
        return False
    return _run_shares(comm, "shmproxy_reduce_scatter", send.data.ptr, recv, recv.size, op, stream)


def _run_shares(comm: Any, name: str, src: int, recv: Any, count: int, op: int, stream: Any) -> bool:
    dev = comm._device
    if count == 0 or dev.dtype_code(recv) == DTYPE_BFLOAT16:
        return False
    if not eligible(comm, count * recv.dtype.itemsize, recv.dtype, op):
        return False
    did = recv.device.id
    shot = shared(comm, did)
    if shot is None:
        return False
    s = dev.as_stream(stream, did)
    sp = (s if s is not None else dev.cp.cuda.get_current_stream()).ptr
    shot.launch_shares(name, src, recv.data.ptr, count, recv.dtype, op, sp)
    shot.synchronize(sp)
    shot.check(comm)
    return True


def shared(comm: Any, device: int) -> "PeerKernels | None":
    """The communicator's one-shot state, set up at its first call (a collective); None where its
    ranks cannot use it, which every rank learns alike."""
    shot: PeerKernels | None | bool = comm.__dict__.get("_oneshot")
    if shot is None:
        shot = comm.__dict__["_oneshot"] = PeerKernels.set_up(comm, device) or False
    if not isinstance(shot, PeerKernels):
        return None
    if device != shot.device:
        raise errors.InvalidArgument(
            f"Allreduce: the buffers are on GPU {device}, and this communicator's device Allreduce runs on "
            f"GPU {shot.device}, where its first one's buffers were: a rank keeps one GPU per communicator")
    return shot


class PeerKernels:
    """A rank's scratch, its peers' mapped scratches, its one-shot and two-shot kernels and the host-mapped
    words."""

    def __init__(self, cp: Any, device: int, rank: int, nranks: int, oneshot_bytes: int, twoshot_bytes: int,
                 window: int, blocks: int, blocks2: int, chunk: int, timeout_s: float):
        self.cp, self.device, self.rank, self.nranks = cp, device, rank, nranks
        self.oneshot_bytes = oneshot_bytes
        self.window = min(window, twoshot_bytes) if twoshot_bytes > oneshot_bytes else 0
        # a half holds one one-shot call's data, or one two-shot window's slots: 2 (NR - 1) of them, each
        # a 1/NR share of the window (and a pack per block of rounding)
        twoshot_half = 2 * (nranks - 1) * (self.window // nranks + MAX_BLOCKS * 16) if self.window else 0
        self.cap = (max(oneshot_bytes, twoshot_half) + 255) // 256 * 256   # the halves stay 256-byte aligned
        self.blocks = min(max(blocks, 1), MAX_BLOCKS)     # a one-shot kernel's most
        self.blocks2 = min(max(blocks2, 1), MAX_BLOCKS)   # a two-shot kernel's
        self.chunk = max(chunk // 16 * 16, 16)            # a two-shot step's bytes
        self.timeout_ns = int(timeout_s * 1e9)
        self.drv = Driver()
        rt = cp.cuda.runtime
        self.epoch = 0
        self.peers: list[int] = []      # every rank's scratch as this device sees it (ours included)
        self._opened: list[int] = []    # the peers' mappings, closed at close
        self._kernels: dict[tuple[str, int, str], Any] = {}   # (dtype char, op, kernel) -> its Launch
        self._modules: list[Any] = []   # the compiled kernels, loaded as long as their launches live
        self._last_stream: int | None = None
        self.failed = False
        self.closed = False
        with cp.cuda.Device(device):
            self.scratch = rt.malloc(_DATA + 2 * self.cap)
            rt.memset(self.scratch, 0, _DATA + 2 * self.cap)
            self.words_host = rt.hostAlloc(64, _MAPPED)
            ctypes.memset(self.words_host, 0, 64)
            self.words = self.drv.host_device_pointer(self.words_host)
            rt.deviceSynchronize()   # the zeroed flags, before any peer maps them
            self.handle = bytes(rt.ipcGetMemHandle(self.scratch))
            self.bus_id = rt.deviceGetPCIBusId(device)
            self._after = cp.cuda.Event(disable_timing=True)   # recorded behind each kernel
            self._before = cp.cuda.Event(disable_timing=True)  # on the caller's stream (``after``)

    @classmethod
    def set_up(cls, comm: Any, device: int) -> "PeerKernels | None":
        """Every rank's part of the set-up (see the header): the state, or None on every rank alike."""
        dev = comm._device_memory()
        shot: PeerKernels | None = None
        mine: tuple[str, bytes] | None = None
        try:
            cp = dev.cp if dev.cp is not None else dev._cupy()
            p = comm.params
            shot = cls(cp, device, comm.rank, comm.size, p.DEVICE_ONESHOT_BYTES, p.DEVICE_TWOSHOT_BYTES,
                       p.DEVICE_TWOSHOT_WINDOW, p.DEVICE_ONESHOT_BLOCKS, p.DEVICE_TWOSHOT_BLOCKS,
                       p.DEVICE_TWOSHOT_CHUNK, p.TIMEOUT)
            mine = (shot.bus_id, shot.handle)
        except Exception as exc:   # whatever cupy raises for memory it cannot allocate or export
            _log.info("rank %d: no one-shot device Allreduce on GPU %d: %s", comm.rank, device, exc)
        infos = comm.allgather(mine)
        ok = shot is not None and all(i is not None for i in infos) and len({i[0] for i in infos}) == comm.size
        if shot is not None and ok:
            try:
                shot.map_peers([i[1] for i in infos])
            except Exception as exc:   # whatever cupy raises for a peer's memory it cannot map
                _log.info("rank %d: cannot map its peers' one-shot scratch: %s", comm.rank, exc)
                ok = False
        if not all(comm.allgather(ok)):
            if shot is not None:
                shot.close(barrier=None)
            _log.info("rank %d: device Allreduce stays with the progress process (%s)", comm.rank,
                      "ranks share a GPU" if all(i is not None for i in infos) else "a rank has no scratch")
            return None
        assert shot is not None
        dev.watch()   # a failure must reach kernels that wait while the host is held by the GPU
        return shot

    def map_peers(self, handles: list[bytes]) -> None:
        rt = self.cp.cuda.runtime
        with self.cp.cuda.Device(self.device):
            for r, h in enumerate(handles):
                if r == self.rank:
                    self.peers.append(self.scratch)
                    continue
                ptr = rt.ipcOpenMemHandle(h, _LAZY_PEER_ACCESS)
                self._opened.append(ptr)
                self.peers.append(ptr)

    def _kernel(self, dtype: np.dtype, op: int, name: str) -> Any:
        key = (dtype.char, op, name)
        launch = self._kernels.get(key)
        if launch is None:
            k = self.cp.RawKernel(kernel_source(_C_TYPE[dtype], op, self.nranks, self.chunk), name)
            strided = name in _STRIDED
            launch = self._kernels[key] = self.drv.launcher(k.kernel.ptr, 10 + self.nranks + strided)
            launch.set((0, 0, 0, 0, self.rank, self.cap, self.words, self.timeout_ns, 0, 0, *self.peers)
                       + ((0,) if strided else ()))
            self._modules.append(k)
        return launch

    @staticmethod
    def _grid(count: int, itemsize: int, most: int) -> int:
        per_block = BLOCK * PER_THREAD * 16 // itemsize
        return min((count + per_block - 1) // per_block, most)

    def window_count(self, itemsize: int) -> int:
        """The most elements of one two-shot kernel: its 2 (NR - 1) slots, of a 1/NR share of each of
        the most blocks' slices (rounded up to NR packs: the kernel's rounding), fit in a half."""
        vec = 16 // itemsize
        nr = self.nranks
        sub = self.cap // (2 * (nr - 1) * self.blocks2 * itemsize) // vec * vec   # a part per block
        return min(sub * nr * self.blocks2, self.window // itemsize)

    def share_window(self, itemsize: int) -> int:
        """The most elements of each rank's share in one Reduce_scatter_block or Allgather kernel: its
        N - 1 slots, each of the share and a pack of rounding per block, fit in a half."""
        vec = 16 // itemsize
        room = self.cap // ((self.nranks - 1) * itemsize) - self.blocks2 * vec   # a slot, less the rounding
        return room // vec * vec

    def launch(self, src: int, dst: int, count: int, dtype: np.dtype, op: int, stream: int,
               after: int | None = None) -> None:
        """Queue one Allreduce of ``count`` elements from ``src`` into ``dst`` on ``stream`` (this
        device's), after the work queued so far on stream ``after`` too (the caller's, where the
        kernel runs on a stream of its own, as NCCL's do); ``check`` before, so a kernel that failed
        is reported before another is queued. Up to DEVICE_ONESHOT_BYTES one one-shot kernel, above
        it two-shot kernels of a window each (the same choice on every rank: it is the call's size)."""
        with self._ordered(stream, after):
            isz = dtype.itemsize
            if count * isz <= self.oneshot_bytes or not self.window:
                self._queue(self._kernel(dtype, op, "shmproxy_oneshot"), src, dst, count, dtype, op, stream,
                            self.blocks)
            else:
                launch, step = self._kernel(dtype, op, "shmproxy_twoshot"), self.window_count(isz)
                for off in range(0, count, step):
                    self._queue(launch, src + off * isz, dst + off * isz, min(step, count - off), dtype, op,
                                stream, self.blocks2)

    def launch_shares(self, name: str, src: int, dst: int, count: int, dtype: np.dtype, op: int, stream: int,
                      after: int | None = None) -> None:
        """Queue a Reduce_scatter_block (``op``) or an Allgather (``op`` None) of ``count`` elements
        per rank, as ``launch`` queues an Allreduce; in windows of ``share_window`` elements of each
        share."""
        reduce = name == "shmproxy_reduce_scatter"
        isz = dtype.itemsize
        stride = count * isz
        with self._ordered(stream, after):
            launch, step = self._kernel(dtype, op if reduce else ReduceOp.SUM, name), self.share_window(isz)
            for off in range(0, count, step):
                n = min(step, count - off)
                launch.values[10 + self.nranks] = count   # in elements: the kernel's strides
                self._queue(launch, src + off * isz, dst + off * isz, n, dtype,
                            (_SIG_REDUCE_SCATTER | op) if reduce else _SIG_ALLGATHER, stream, self.blocks2,
                            aligned=not stride & 15)

    @contextlib.contextmanager
    def _ordered(self, stream: int, after: int | None) -> Iterator[None]:
        """This device current, ``stream`` after ``after``'s work and after our last kernel (see the
        header) for what is queued inside; the last kernel's event recorded behind it."""
        rt = self.cp.cuda.runtime
        prev = rt.getDevice()
        if prev != self.device:
            rt.setDevice(self.device)
        try:
            if after is not None:
                self.drv.record(self._before.ptr, after)
                self.drv.wait(stream, self._before.ptr)
            if self._last_stream is not None and stream != self._last_stream:
                # one kernel after another (see the header): the new stream waits for the last kernel
                self.drv.wait(stream, self._after.ptr)
            self._last_stream = stream
            yield
            self.drv.record(self._after.ptr, stream)
        finally:
            if prev != self.device:
                rt.setDevice(prev)

    def _queue(self, launch: Any, src: int, dst: int, count: int, dtype: np.dtype, op: int, stream: int,
               blocks: int, aligned: bool = True) -> None:
        self.epoch += 1
        v = launch.values   # the call's own; the rest were set with the kernel (_kernel)
        v[0], v[1], v[2], v[3] = src, dst, count, self.epoch
        v[8] = (count << 16) | (dtype.num << 8) | op   # the signature the peers compare
        v[9] = aligned and not ((src | dst) & 15)       # 16-byte packs
        launch(self._grid(count, dtype.itemsize, blocks), BLOCK, stream)

    def synchronize(self, stream: int) -> None:
        self.cp.cuda.runtime.streamSynchronize(stream)

    def status(self) -> tuple[int, int]:
        """(status, peer) of a kernel that failed; status 0 while none did."""
        words = (ctypes.c_uint64 * 3).from_address(self.words_host)
        st = words[W_STATUS]
        return (st, words[W_PEER]) if st else (0, 0)

    def check(self, comm: Any) -> None:
        """Raise a kernel's failure: the communicator's own error when it failed (ST_ABORTED), else
        the kernel's, after failing the communicator on every rank."""
        st, peer = self.status()
        if not st:
            return
        self.failed = True
        if st == ST_ABORTED:
            comm._check_usable()
        if st == ST_MISMATCH:
            exc: errors.ProxyError = errors.InvalidUsage(
                f"rank {comm.rank}: device Allreduce #{self.epoch}: rank {peer} passed another count, dtype or op")
        else:
            exc = errors.Timeout(
                f"rank {comm.rank}: device Allreduce #{self.epoch}: rank {peer} did not join within "
                f"{self.timeout_ns / 1e9:.0f} s (a rank that passed host memory, or called another collective)")
        comm.Abort(str(exc))
        raise exc

    def release(self) -> None:
        """The communicator failed: every kernel of ours still waiting ends (ST_ABORTED)."""
        self.failed = True
        if self.closed:
            return
        ctypes.c_uint64.from_address(self.words_host + 8 * W_ABORT).value = 1

    def close(self, barrier: Any) -> None:
        """Free the scratch once no kernel may read it: this rank's ended (the device synchronized) and
        every peer's (``barrier``, the communicator's, after each peer synchronized too). Without one
        (a failed communicator) a peer may still read ours until it learns of the failure: the
        memory is then left to the process's exit, unless no kernel ever ran (a declined set-up)."""
        if self.closed:
            return
        if self.epoch and (barrier is None or self.failed):
            self.release()
            return
        rt = self.cp.cuda.runtime
        with self.cp.cuda.Device(self.device):
            if self.epoch:
                rt.deviceSynchronize()
                barrier()
            for ptr in self._opened:
                rt.ipcCloseMemHandle(ptr)
            self._opened.clear()
            self.closed = True
            rt.free(self.scratch)
            rt.freeHost(self.words_host)
