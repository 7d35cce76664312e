"""bfloat16 on the GPU: the two device functions every bfloat16 kernel of shmproxy is written with
(the progress process's reductions, shmproxy.transports.cuda_coll; the rank's staging across nodes,
shmproxy.rank.devstage), so that both round alike. cupy has no bfloat16: a value is its 16-bit
word, widened to float32 exactly (the high half) and rounded back to nearest even; a NaN stays NaN."""

BF16_PREAMBLE = r"""
__device__ __forceinline__ float bf16_in(unsigned short h) {
    return __uint_as_float(((unsigned int)h) << 16);
}
__device__ __forceinline__ unsigned short bf16_out(float f) {
    unsigned int u = __float_as_uint(f);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (unsigned short)((u >> 16) | 0x40);   /* NaN stays NaN */
    u += 0x7fffu + ((u >> 16) & 1u);                                                   /* nearest even */
    return (unsigned short)(u >> 16);
}
"""
