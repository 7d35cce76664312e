"""The ranks' own device kernels (shmproxy.rank.devcoll) as CUDA C: the scratch's layout, the flags'
encoding, and the one-shot, two-shot, Reduce_scatter_block and Allgather kernels, written out per
element type, op and count of ranks. The protocol they follow (who writes what where, why two data
halves are enough, the bounds) is in shmproxy.rank.devcoll's header; the host side is there too.
"""
from __future__ import annotations

import numpy as np

from shmproxy.core.kernels import AVG_FINISH, REDUCE_EXPR
from shmproxy.core.ops import ReduceOp

MAX_RANKS = 8          # kernels are written out per count of ranks (each peer's scratch is a parameter)
MAX_BLOCKS = 512       # flag and signature slots per peer
BLOCK = 512            # threads per block of every kernel here
# scratch layout, in 64-bit words: flags [peer][block] (the one-shot's, and the two-shot's first), the
# two-shot's second flags [peer][block], signatures [parity][peer][block], then the two data halves (at a
# byte offset that keeps them 256-byte aligned)
FLAGS2 = MAX_RANKS * MAX_BLOCKS
SIGS = 2 * MAX_RANKS * MAX_BLOCKS
DATA = 8 * 4 * MAX_RANKS * MAX_BLOCKS
# host-mapped words: the abort word (host -> GPU), then a failed kernel's status and peer (GPU -> host)
W_ABORT, W_STATUS, W_PEER = 0, 1, 2
FLAG_SHIFT = 20        # a flag's value: the call's epoch above these bits, the chunks delivered below
ST_TIMEOUT, ST_ABORTED, ST_MISMATCH = 1, 2, 3

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
#define FLAG_SHIFT %(flag_shift)d
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
/* Copy-engine two-shot (shmproxy.rank.devcoll's header): the two exchanges are the peers' copies and
   their streams' stores of block 0's flags (FLAGS: a peer's values of this rank's part, chunk by
   chunk; FLAGS2: its reduced part); these kernels do what is left on this GPU, chunk ``c`` of
   ``cchunk`` elements each. Rank q's part is [q * sub, (q + 1) * sub) of the window's ``n`` elements
   (cut short at n); slot d of a half as the two-shot's, ``sub`` elements each. */
#define CE_SUB(n) ((((n) + NR - 1) / NR + VEC - 1) / VEC * VEC)
__device__ __forceinline__ u64 ce_len(u64 n, u64 sub, u64 q, u64 c, u64 cchunk) {
    const u64 lo = q * sub < n ? q * sub : n;
    const u64 hi = lo + sub < n ? lo + sub : n;
    const u64 at = lo + c * cchunk;
    return hi > at ? (hi - at < cchunk ? hi - at : cchunk) : 0;
}
/* this block's run [*lo, *hi) of a chunk of ``len`` elements, whole packs but the last */
__device__ __forceinline__ void block_run(u64 len, u64* lo, u64* hi) {
    u64 per = (len + gridDim.x - 1) / gridDim.x;
    per = (per + VEC - 1) / VEC * VEC;
    *lo = per * blockIdx.x < len ? per * blockIdx.x : len;
    *hi = *lo + per < len ? *lo + per : len;
}
/* A copy-engine kernel's wait for a chunk's flags: the threads that ``wait`` (one per peer) wait for
   ``flag`` to reach ``value`` (and compare the signature at ``sig_at``, if any). First a look at the
   call's status, by one thread for the whole block: a kernel queued after one of the call's that
   failed returns at once, so a failure costs one bound, not one per chunk. False: the block returns. */
__device__ __forceinline__ bool ce_wait(const u64* flag, const u64* sig_at, u64 sig, u64 value, bool wait,
                                        volatile u64* words, u64 timeout_ns, int* failed) {
    if (threadIdx.x == 0)
        *failed = words[1] != 0;
    __syncthreads();
    const bool before = *failed;
    __syncthreads();   /* every thread has read it before a wait can store it */
    if (before)
        return false;
    if (wait)
        wait_flag(flag, sig_at, sig, value, words, timeout_ns, threadIdx.x, failed);
    __syncthreads();
    return !*failed;
}
/* out[k] = the reduction in rank order of src[r][k], k < len: in 16-byte packs where ``vec`` */
__device__ __forceinline__ void reduce_run(const T* const* src, T* out, u64 len, u64 vec) {
    const u64 packs = vec ? len / VEC : 0;
#pragma unroll 2
    for (u64 k = threadIdx.x; k < packs; k += blockDim.x)
        ((uint4*)out)[k] = combine_pack(src, k);
    for (u64 k = packs * VEC + threadIdx.x; k < len; k += blockDim.x)
        out[k] = combine(src, k);
}
/* Chunk c of this rank's part: once every peer's copy of it is here (their flags), reduced in rank
   order with this rank's input into its output; the host then queues the copies of the result into
   the peers' scratches. */
extern "C" __global__ void shmproxy_ce_reduce(
        u64 in_, u64 out_, u64 n, u64 epoch, u64 me, u64 cap, u64 words_,
        u64 timeout_ns, u64 sig, u64 vec, %(params)s, u64 c, u64 cchunk) {
    const u64 sc[NR] = {%(scratch)s};
    __shared__ int failed;
    const unsigned t = threadIdx.x;
    const u64* own = (const u64*)sc[me];
    const u64 sigs = SIGS + (epoch & 1) * NR * MAXB;
    if (!ce_wait(own + t * MAXB, c == 0 ? own + sigs + t * MAXB : 0, sig, (epoch << FLAG_SHIFT) + c + 1,
                 t < NR && t != me, (volatile u64*)words_, timeout_ns, &failed))
        return;
    const u64 sub = CE_SUB(n), half = DATA + (epoch & 1) * cap, at = me * sub + c * cchunk;
    u64 lo, hi;
    block_run(ce_len(n, sub, me, c, cchunk), &lo, &hi);
    const T* src[NR];
#pragma unroll
    for (int r = 0; r < NR; r++)
        src[r] = r == me ? (const T*)in_ + at + lo
                         : (const T*)(sc[me] + half) + ((r - me + NR) %% NR - 1) * sub + c * cchunk + lo;
    reduce_run(src, (T*)out_ + at + lo, hi - lo, vec);
}
/* Chunk c of every peer's reduced part: once each is here (their second flags), copied into the
   output. */
extern "C" __global__ void shmproxy_ce_copy_out(
        u64 in_, u64 out_, u64 n, u64 epoch, u64 me, u64 cap, u64 words_,
        u64 timeout_ns, u64 sig, u64 vec, %(params)s, u64 c, u64 cchunk) {
    const u64 sc[NR] = {%(scratch)s};
    __shared__ int failed;
    const unsigned t = threadIdx.x;
    const u64 sub = CE_SUB(n), half = DATA + (epoch & 1) * cap;
    const u64* own = (const u64*)sc[me];
    if (!ce_wait(own + FLAGS2 + t * MAXB, 0, 0, (epoch << FLAG_SHIFT) + c + 1,
                 t < NR && t != me && ce_len(n, sub, t, c, cchunk), (volatile u64*)words_, timeout_ns, &failed))
        return;
    for (int q = 0; q < NR; q++) {
        if (q == me)
            continue;
        u64 lo, hi;
        block_run(ce_len(n, sub, q, c, cchunk), &lo, &hi);
        copy_run((T*)out_ + q * sub + c * cchunk + lo,
                 (const T*)(sc[me] + half) + (NR - 1 + (q - me + NR) %% NR - 1) * sub + c * cchunk + lo,
                 hi - lo, vec);
    }
}
/* Reduce_scatter_block and Allgather by the copy engines: each peer's copies of its values for this
   rank's share arrive in slot d (the window's ``n`` elements), chunk by chunk, each flagged in
   block 0's slot of FLAGS; a kernel waits for chunk ``c`` of every peer and either reduces it
   (``reduce``: in rank order, this rank's own values from its input) into the output, or copies each
   peer's into its share of the output. ``stride``: elements between the ranks' shares of the buffer that holds
   one per rank; a slot is ``n`` rounded up to a pack, so that every slot starts aligned. */
#define CE_SLOT(n) (((n) + VEC - 1) / VEC * VEC)
extern "C" __global__ void shmproxy_ce_shares(
        u64 in_, u64 out_, u64 n, u64 epoch, u64 me, u64 cap, u64 words_,
        u64 timeout_ns, u64 sig, u64 vec, %(params)s, u64 c, u64 cchunk, u64 stride, u64 reduce) {
    const u64 sc[NR] = {%(scratch)s};
    __shared__ int failed;
    const unsigned t = threadIdx.x;
    const u64* own = (const u64*)sc[me];
    const u64 sigs = SIGS + (epoch & 1) * NR * MAXB;
    if (!ce_wait(own + t * MAXB, c == 0 ? own + sigs + t * MAXB : 0, sig, (epoch << FLAG_SHIFT) + c + 1,
                 t < NR && t != me, (volatile u64*)words_, timeout_ns, &failed))
        return;
    const u64 half = DATA + (epoch & 1) * cap, at = c * cchunk, clen = n - at < cchunk ? n - at : cchunk;
    u64 lo, hi;
    block_run(clen, &lo, &hi);
    const T* src[NR];
#pragma unroll
    for (int r = 0; r < NR; r++)
        src[r] = r == me ? (const T*)in_ + me * stride + at + lo
                         : (const T*)(sc[me] + half) + ((r - me + NR) %% NR - 1) * CE_SLOT(n) + at + lo;
    if (reduce) {
        reduce_run(src, (T*)out_ + at + lo, hi - lo, vec);
        return;
    }
    for (int q = 0; q < NR; q++)
        if (q != me)
            copy_run((T*)out_ + q * stride + at + lo, src[q], hi - lo, vec);
}
"""

# the kernels' parameters past the scratches: the stride between the ranks' shares; the chunk and its
# size (and the stride)
EXTRA_PARAMS = {"shmproxy_reduce_scatter": 1, "shmproxy_allgather": 1, "shmproxy_ce_reduce": 2,
                "shmproxy_ce_copy_out": 2, "shmproxy_ce_shares": 4}
# a signature's op byte for the kernels that take no op (the peers compare whole signatures)
SIG_ALLGATHER = 0xA0
SIG_REDUCE_SCATTER = 0x40   # | the op


def signature(count: int, dtype: np.dtype, op: int) -> int:
    """A call's signature, which every peer's kernel compares with its own: the count, the dtype and
    the op (or the collective's bits above)."""
    return (count << 16) | (dtype.num << 8) | op


def kernel_source(ctype: str, redop: int, nranks: int, chunk: int = 128 << 10) -> str:
    """The kernels' CUDA C for one element type, op and count of ranks; ``chunk``: the bytes of a
    two-shot step."""
    expr = REDUCE_EXPR[redop]
    return _SRC % {
        "ctype": ctype, "chunk": chunk, "nranks": nranks, "maxb": MAX_BLOCKS, "flags2": FLAGS2, "sigs": SIGS,
        "data": DATA, "flag_shift": FLAG_SHIFT,
        "params": ", ".join(f"u64 s{r}" for r in range(nranks)),
        "scratch": ", ".join(f"s{r}" for r in range(nranks)),
        "steps": "\n".join(f"    b = src[{r}][k]; a = {expr};" for r in range(1, nranks)),
        "pack_steps": "\n".join(f"        b = p[{r}].e[j]; a = {expr};" for r in range(1, nranks)),
        "finish": "    " + AVG_FINISH % nranks if redop == ReduceOp.AVG else ""}
