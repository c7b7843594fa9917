// Does packing fp32 pairs to bf16x2 take the exponentials' pipe? (issue 44, docs/FA4.md)
//
// At head dim 64 a consumer thread of our dK/dV step takes 64 exponentials a step and packs its 64
// values of P (for dV's product) and its 64 of dP - delta (for dS) to bf16, 64 pairs, each by one
// cvt.rn.bf16x2.f32 (F2FP.BF16.F32.PACK_AB). If that instruction issues to the quarter-rate pipe (XU) that runs
// MUFU.EX2, the pipe carries the exponentials' load twice over, which would be what holds the
// 0.5B backward at 69-72% of the tensor pipe. The same rounding can be done on the integer pipe:
// adding 0x8000 to a float's bits rounds its magnitude to the nearest bf16 (ties away from zero,
// where cvt.rn rounds ties to even), and one byte permute (PRMT) takes the two upper halves: three
// ALU instructions a pair.
//
// This probe checks that packing against cvt.rn.bf16x2.f32 over every non-NaN fp32 bit pattern
// (the two differ only at ties, counted), then times a consumer step's arithmetic alone, as
// fixed_point_convert.cu does: one CTA of 256 threads per SM (two warpgroups), each thread taking
// 64 exponentials (or none) and issuing 0, 32 or 64 packs of two values per step, by cvt or on the
// integer pipe; cycles per step by clock64, so the power cap's clock does not enter.
// Build and run on the GPU machine: nvcc -O3 -arch=sm_90a -o /tmp/bf16_pack_pipe
// benchmarks/probes/bf16_pack_pipe.cu && /tmp/bf16_pack_pipe. Prints one JSON object per line.
#include <cstdint>
#include <cstdio>
#include <cuda_runtime.h>

#include "cuda_check.h"
#include "step_cycles.cuh"

constexpr int THREADS = 256, VALUES = 64;
enum class Pack { none, cvt, alu };

// pack_bf16x2 (step_cycles.cuh) on the integer pipe: the same but at ties, rounded away from zero.
__device__ __forceinline__ uint32_t pack_alu(float hi, float lo) {
  return __byte_perm(__float_as_uint(lo) + 0x8000u, __float_as_uint(hi) + 0x8000u, 0x7632);
}

// Every 32-bit pattern as hi (lo fixed) and as lo (hi fixed): a value differs only where its low
// 16 bits are 0x8000 (a tie) or it is NaN; counts the others.
__global__ void check_kernel(unsigned long long* mismatches, unsigned long long* ties) {
  unsigned long long bad = 0, tie = 0;
  const uint64_t stride = (uint64_t)gridDim.x * blockDim.x;
  for (uint64_t i = blockIdx.x * (uint64_t)blockDim.x + threadIdx.x; i < (1ull << 32); i += stride) {
    const uint32_t bits = (uint32_t)i;
    const float v = __uint_as_float(bits);
    if (isnan(v)) continue;
    const bool is_tie = (bits & 0xffffu) == 0x8000u;
    const uint32_t a = pack_bf16x2(v, 1.5f), b = pack_alu(v, 1.5f);
    const uint32_t c = pack_bf16x2(-0.75f, v), d = pack_alu(-0.75f, v);
    if (is_tie) tie += (a != b) + (c != d);
    else bad += (a != b) + (c != d);
  }
  atomicAdd(mismatches, bad);
  atomicAdd(ties, tie);
}

// VALUES scores through ex2 (EXPS), then PAIRS packs: the first VALUES / 2 of the scores as they
// are (P), the next VALUES / 2 of them less a constant (dP - delta), each result xor-ed into one of
// four sums (one LOP3 a pack, in both forms: ptxas drops a pack whose result nothing reads). Thread
// 0 of each CTA records the cycles of its loop.
template <Pack P, int PAIRS, bool EXPS>
__global__ void __launch_bounds__(THREADS, 1) step_kernel(int steps, float a, float b, float* out, long long* cycles) {
  float s[VALUES];
#pragma unroll
  for (int i = 0; i < VALUES; ++i) s[i] = -4.f + 1e-3f * (threadIdx.x + i);
  uint32_t sums[4] = {};
  __syncthreads();
  const long long start = clock64();
  for (int k = 0; k < steps; ++k) {
#pragma unroll
    for (int i = 0; i < VALUES; ++i) s[i] = EXPS ? fmaf(ex2_approx(s[i]), a, b) : fmaf(s[i], a, b);  // stays near -2
    if constexpr (P != Pack::none) {
#pragma unroll
      for (int j = 0; j < PAIRS; ++j) {
        const int i = 2 * j % VALUES;
        const float hi = j < VALUES / 2 ? s[i] : s[i] - b, lo = j < VALUES / 2 ? s[i + 1] : s[i + 1] - b;
        sums[j % 4] ^= P == Pack::cvt ? pack_bf16x2(hi, lo) : pack_alu(hi, lo);
      }
    }
  }
  __syncthreads();
  if (threadIdx.x == 0) cycles[blockIdx.x] = clock64() - start;
  float f = 0.f;
#pragma unroll
  for (int i = 0; i < VALUES; ++i) f += s[i];
  out[blockIdx.x * THREADS + threadIdx.x] = f + __uint_as_float((sums[0] ^ sums[1] ^ sums[2] ^ sums[3]) & 0x3fffffffu);
}

template <Pack P, int PAIRS, bool EXPS>
int time_steps(const cudaDeviceProp& prop, const char* pack) {
  const int sms = prop.multiProcessorCount, steps = 4096;
  float* out;
  CHECK(cudaMalloc(&out, sizeof(float) * sms * THREADS));
  double per_step;
  const auto launch = [&](long long* cycles) {
    step_kernel<P, PAIRS, EXPS><<<sms, THREADS>>>(steps, 1e-3f, -2.f, out, cycles);
  };
  if (median_cycles_per_step(sms, steps, launch, &per_step)) return 1;
  // per scheduler: two warps of VALUES exponentials at 8 cycles each is the XU's floor
  printf("{\"gpu\": \"%s\", \"exps\": %d, \"pack\": \"%s\", \"packs_per_thread\": %d, \"threads_per_sm\": %d, "
         "\"cycles_per_step\": %.1f, \"xu_floor_exps\": %d}\n",
         prop.name, EXPS ? VALUES : 0, pack, P == Pack::none ? 0 : PAIRS, THREADS, per_step, EXPS ? 2 * VALUES * 8 : 0);
  CHECK(cudaFree(out));
  return 0;
}

int main() {
  cudaDeviceProp prop;
  CHECK(cudaGetDeviceProperties(&prop, 0));
  unsigned long long *bad, *ties;
  CHECK(cudaMalloc(&bad, 8));
  CHECK(cudaMalloc(&ties, 8));
  CHECK(cudaMemset(bad, 0, 8));
  CHECK(cudaMemset(ties, 0, 8));
  check_kernel<<<prop.multiProcessorCount * 8, 256>>>(bad, ties);
  CHECK(cudaGetLastError());
  unsigned long long nbad = 0, nties = 0;
  CHECK(cudaMemcpy(&nbad, bad, 8, cudaMemcpyDeviceToHost));
  CHECK(cudaMemcpy(&nties, ties, 8, cudaMemcpyDeviceToHost));
  printf("{\"gpu\": \"%s\", \"check\": \"alu pack against cvt.rn.bf16x2.f32, every non-NaN pattern in both halves\", "
         "\"mismatches_off_ties\": %llu, \"tie_differences\": %llu}\n",
         prop.name, nbad, nties);
  if (nbad != 0) return 1;
  return time_steps<Pack::none, 0, true>(prop, "none") || time_steps<Pack::cvt, 32, true>(prop, "cvt") ||
         time_steps<Pack::cvt, 64, true>(prop, "cvt") || time_steps<Pack::alu, 32, true>(prop, "alu") ||
         time_steps<Pack::alu, 64, true>(prop, "alu") ||
         time_steps<Pack::none, 0, false>(prop, "none") || time_steps<Pack::cvt, 64, false>(prop, "cvt") ||
         time_steps<Pack::alu, 64, false>(prop, "alu");
}
