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

}  // namespace sparsebalance
