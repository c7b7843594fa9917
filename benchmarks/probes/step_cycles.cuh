// The probes' timing of a step's arithmetic alone (fixed_point_convert.cu, bf16_pack_pipe.cu,
// ex2_pair_rate.cu), and the step's instructions as our kernels issue them: one CTA per SM runs
// `steps` steps and its thread 0 records the cycles of its loop, by clock64, so that the power
// cap's clock does not enter.
#pragma once
#include <algorithm>
#include <cstdint>
#include <vector>
#include <cuda_runtime.h>

#include "cuda_check.h"

// ex2.approx as our kernels issue it (one MUFU.EX2); volatile, so that a step keeps its count.
__device__ __forceinline__ float ex2_approx(float x) {
  float r;
  asm volatile("ex2.approx.ftz.f32 %0, %1;" : "=f"(r) : "f"(x));
  return r;
}

// Two floats packed to bf16x2 as our kernels pack P and dS (one F2FP): hi to the upper half, lo to
// the lower, rounded to nearest.
__device__ __forceinline__ uint32_t pack_bf16x2(float hi, float lo) {
  uint32_t r;
  asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));
  return r;
}

// Six runs of launch(cycles), the first a warm-up; launch starts one CTA per SM, each writing its
// loop's cycles to cycles[blockIdx.x]. *per_step: the median over the five runs of each run's
// median CTA, over `steps`.
template <typename Launch>
int median_cycles_per_step(int sms, int steps, Launch launch, double* per_step) {
  long long* cycles;
  CHECK(cudaMalloc(&cycles, sizeof(long long) * sms));
  std::vector<double> runs;
  for (int rep = 0; rep < 6; ++rep) {
    launch(cycles);
    CHECK(cudaGetLastError());
    CHECK(cudaDeviceSynchronize());
    std::vector<long long> c(sms);
    CHECK(cudaMemcpy(c.data(), cycles, sizeof(long long) * sms, cudaMemcpyDeviceToHost));
    std::sort(c.begin(), c.end());
    if (rep > 0) runs.push_back((double)c[sms / 2] / steps);
  }
  std::sort(runs.begin(), runs.end());
  *per_step = runs[runs.size() / 2];
  CHECK(cudaFree(cycles));
  return 0;
}
