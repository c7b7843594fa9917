// int32 fixed point of a float, rint(y), two ways (issue 44, docs/FA4.md, "A deterministic one-pass
// backward: the reduction"): cvt.rni on the exponentials' quarter-rate pipe, and the split on the
// FMA and integer pipes, exact for |y| < 2^30 - 256 (fixed_point_convert.cu checks the two equal on
// every magnitude and tie; onepass_step.cu times them inside the step); and the bulk reduce-add
// that carries such values (or fp32 ones) into global memory (reduce_rate.cu, onepass_step.cu).
#pragma once

#include <cstdint>

constexpr float FIXED_M_HI = 3221225472.f;  // 1.5 * 2^31: t's ulp is 256
constexpr float FIXED_M_LO = 12582912.f;    // 1.5 * 2^23: l's ulp is 1

__device__ __forceinline__ int fixed_cvt(float y) {
  int r;
  asm("cvt.rni.s32.f32 %0, %1;" : "=r"(r) : "f"(y));
  return r;
}

// __fadd_rn: each add rounds on its own (never contracted into an FMA, whose single rounding
// would change t and l).
__device__ __forceinline__ int fixed_split(float y) {
  const float t = __fadd_rn(y, FIXED_M_HI);
  const float hi = __fadd_rn(t, -FIXED_M_HI);
  const float lo = __fadd_rn(y, -hi);
  const float l = __fadd_rn(lo, FIXED_M_LO);
  return (__float_as_int(t) - __float_as_int(FIXED_M_HI)) * 256 + (__float_as_int(l) - __float_as_int(FIXED_M_LO));
}

// One bulk reduce-add of `bytes` from shared memory (src, a shared-space address) into dst, in
// int32 (INT32) or fp32, committed as its own bulk group; issued by one thread.
template <bool INT32>
__device__ __forceinline__ void bulk_reduce_add(void* dst, uint32_t src, uint32_t bytes) {
  if constexpr (INT32)
    asm volatile("cp.reduce.async.bulk.global.shared::cta.bulk_group.add.s32 [%0], [%1], %2;\n" ::"l"(dst), "r"(src),
                 "r"(bytes)
                 : "memory");
  else
    asm volatile("cp.reduce.async.bulk.global.shared::cta.bulk_group.add.f32 [%0], [%1], %2;\n" ::"l"(dst), "r"(src),
                 "r"(bytes)
                 : "memory");
  asm volatile("cp.async.bulk.commit_group;\n" ::: "memory");
}
