/*
 * Copies shared by shm/_native.c and shm/_reduce.c.
 */
#ifndef SHM_COPY_H
#define SHM_COPY_H

#include <stdint.h>
#include <string.h>
#if defined(__x86_64__)
#include <emmintrin.h>
#endif

/*
 * Copy with non-temporal (streaming) stores: the destination lines are written without being read
 * into the cache first (no write-allocate), so a large copy moves n bytes out instead of 2n. Worth it
 * for destinations nobody reads soon (the copies out of a collective's chunk, large messages).
 * Falls back to memmove for small, overlapping or unaligned-by-more-than-a-head cases.
 */
static inline void copy_streaming_unfenced(char *d, const char *s, size_t n, size_t min_bytes) {
#if defined(__x86_64__)
    if (n < min_bytes || (d < s + n && s < d + n)) {
        memmove(d, s, n);
        return;
    }
    size_t head = (16 - ((uintptr_t)d & 15)) & 15;
    memcpy(d, s, head);
    d += head; s += head; n -= head;
    size_t blocks = n / 64;
    for (size_t i = 0; i < blocks; i++) {
        __m128i a = _mm_loadu_si128((const __m128i *)(s + 0));
        __m128i b = _mm_loadu_si128((const __m128i *)(s + 16));
        __m128i c = _mm_loadu_si128((const __m128i *)(s + 32));
        __m128i e = _mm_loadu_si128((const __m128i *)(s + 48));
        _mm_stream_si128((__m128i *)(d + 0), a);
        _mm_stream_si128((__m128i *)(d + 16), b);
        _mm_stream_si128((__m128i *)(d + 32), c);
        _mm_stream_si128((__m128i *)(d + 48), e);
        s += 64; d += 64;
    }
    memcpy(d, s, n - blocks * 64);
#else
    memmove(d, s, n);
#endif
}

/* Streaming stores are weakly ordered: fence before anyone is told the data is there. */
static inline void streaming_fence(void) {
#if defined(__x86_64__)
    _mm_sfence();
#endif
}

static inline void copy_streaming(char *d, const char *s, size_t n) {
    copy_streaming_unfenced(d, s, n, 4096);
    streaming_fence();
}

#endif
