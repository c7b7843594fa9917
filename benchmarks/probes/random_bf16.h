// Inputs of the step probes (pipe_overlap.cu, onepass_step.cu): bf16 values uniform in
// [-width / 2, width / 2) from a linear congruential generator, the same sequence for a seed on
// every machine (width 0.5: scores of a few units, as a real step's).
#pragma once

#include <cstdint>
#include <vector>

#include <cuda_bf16.h>

inline std::vector<__nv_bfloat16> uniform_bf16(size_t n, uint32_t seed, float width) {
  std::vector<__nv_bfloat16> v(n);
  for (auto& x : v) {
    seed = seed * 1664525u + 1013904223u;
    x = __float2bfloat16(((seed >> 8) / 16777216.f - 0.5f) * width);
  }
  return v;
}
