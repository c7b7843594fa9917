// Warp-wide sums by shuffles, shared by the extension's kernels.
#pragma once

namespace sparsebalance {

// The sum over the warp's 32 lanes, in every lane (butterfly: the same order in every lane, so
// every lane holds the same bits).
template <typename T>
__device__ __forceinline__ T warp_sum(T v) {
  for (int off = 16; off > 0; off /= 2) v += __shfl_xor_sync(0xffffffffu, v, off);
  return v;
}

// The sum of v over lanes 0..lane (inclusive), in each lane.
template <typename T>
__device__ __forceinline__ T warp_inclusive_sum(T v, int lane) {
  for (int off = 1; off < 32; off *= 2) {
    const T up = __shfl_up_sync(0xffffffffu, v, off);
    if (lane >= off) v += up;
  }
  return v;
}

// The sum of v over the threads before this one in its CTA, in each thread: within warps by
// shuffles, then over the warps' totals. For CTAs of whole warps, at most 1024 threads; every
// thread calls it, once per kernel (its shared totals are not fenced for a second call).
template <typename T>
__device__ __forceinline__ T cta_exclusive_sum(T v) {
  __shared__ T warp_total[32];
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  const T incl = warp_inclusive_sum(v, lane);
  if (lane == 31) warp_total[warp] = incl;
  __syncthreads();
  if (warp == 0) warp_total[lane] = warp_inclusive_sum(warp_total[lane], lane);  // inclusive over warps
  __syncthreads();
  return incl - v + (warp ? warp_total[warp - 1] : T(0));
}

}  // namespace sparsebalance
