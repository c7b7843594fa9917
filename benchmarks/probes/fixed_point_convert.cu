// Can a deterministic one-pass backward convert its dQ to int32 fixed point without taking the
// exponentials' pipe? (issue 44, docs/FA4.md, "A deterministic one-pass backward: the reduction")
//
// The fused int32 build of issue 44 converted each consumer thread's dQ values with cvt.rni.s32.f32
// (F2I), which runs on the same quarter-rate pipe (XU) as the exponentials: a consumer thread of a
// fused step converts as many dQ values as it takes exponentials (32 of each at head dim 128), so
// the pipe carried twice the exponentials' load, and the conversion cost 6-12% at Qwen2.5-3B. The
// same rounding can be done on the FMA pipe: for |y| < 2^30 - 256,
//   t  = y + 1.5 * 2^31          t's ulp is 256: y rounded to a multiple of 256, plus the constant
//   hi = t - 1.5 * 2^31          exact
//   lo = y - hi                  exact (|lo| <= 128, a multiple of y's ulp)
//   l  = lo + 1.5 * 2^23         l's ulp is 1: lo rounded to an integer, plus the constant
//   rint(y) = (bits(t) - bits(1.5 * 2^31)) * 256 + bits(l) - bits(1.5 * 2^23)
// four fp32 adds and two integer operations, round-to-nearest-even as cvt.rni (hi is even, so a tie
// of lo rounds as a tie of y).
//
// This probe checks that identity on the GPU against cvt.rni.s32.f32 over values of every
// magnitude and every tie, then times a consumer step's arithmetic alone: one CTA of 256 threads
// (two warpgroups, two warps per scheduler, as the fused step's consumers) per SM, each thread
// taking 64 exponentials (ex2.approx) and/or converting 64 values (none, cvt, split) per step, and
// reports cycles per step (clock64, so the power cap's clock does not enter).
// Build and run on the GPU machine: nvcc -O3 -arch=sm_90a -o /tmp/fixed_point_convert
// benchmarks/probes/fixed_point_convert.cu && /tmp/fixed_point_convert. Prints one JSON object per line.
#include <cstdint>
#include <cstdio>
#include <cuda_runtime.h>

#include "cuda_check.h"
#include "step_cycles.cuh"
#include "fixed_point.cuh"

constexpr int THREADS = 256, VALUES = 64, SUMS = 4;
enum class Convert { none, cvt, split };

// Values of every magnitude from 2^-31 to 2^30 and the ties half-way between integers, each
// converted both ways; counts the values where the two differ.
__global__ void check_kernel(uint64_t n, unsigned long long* mismatches, unsigned long long* checked) {
  unsigned long long bad = 0, seen = 0;
  for (uint64_t i = blockIdx.x * (uint64_t)blockDim.x + threadIdx.x; i < n; i += (uint64_t)gridDim.x * blockDim.x) {
    uint64_t z = i * 0x9e3779b97f4a7c15ull;  // splitmix64: a mantissa, a sign and an exponent
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    z ^= z >> 31;
    const int e = (int)(z % 61) - 31;  // 2^-31 .. 2^29, times a mantissa in [1, 2)
    float y = ldexpf(1.f + (float)((z >> 8) & 0x7fffff) / 8388608.f, e) * ((z >> 40) & 1 ? -1.f : 1.f);
    if ((z >> 41) & 1) y = rintf(y) + 0.5f;  // a tie (exact where |y| < 2^23)
    if (fabsf(y) >= 1073741568.f) continue;   // 2^30 - 256: the identity's range
    ++seen;
    bad += fixed_split(y) != fixed_cvt(y);
  }
  atomicAdd(mismatches, bad);
  atomicAdd(checked, seen);
}

// A consumer step's arithmetic, `steps` times: VALUES scores through ex2 (EXPS) and VALUES dQ values
// converted by C, each fed back so that nothing is hoisted or folded. Thread 0 of each CTA records
// the cycles of its loop.
template <Convert C, bool EXPS>
__global__ void __launch_bounds__(THREADS, 1) step_kernel(int steps, float a, float b, int* out, long long* cycles) {
  float s[VALUES], x[VALUES];
#pragma unroll
  for (int i = 0; i < VALUES; ++i) {
    s[i] = -4.f + 1e-3f * (threadIdx.x + i);
    x[i] = 1e6f * (1 + i) + 37.f * threadIdx.x;  // dQ in fixed-point units: up to 2^26
  }
  int sum[SUMS] = {};
  __syncthreads();
  const long long start = clock64();
  for (int k = 0; k < steps; ++k) {
#pragma unroll
    for (int i = 0; i < VALUES; ++i) {
      if constexpr (EXPS) s[i] = fmaf(ex2_approx(s[i]), a, b);  // stays near -2
      if constexpr (C != Convert::none) {
        x[i] = fmaf(x[i], 1.f, a);  // fed back (a is below x's ulp: x stays, but no compiler can know)
        sum[i % SUMS] += C == Convert::cvt ? fixed_cvt(x[i]) : fixed_split(x[i]);
      }
    }
  }
  __syncthreads();
  if (threadIdx.x == 0) cycles[blockIdx.x] = clock64() - start;
  int r = 0;
#pragma unroll
  for (int i = 0; i < SUMS; ++i) r += sum[i];
  float f = 0.f;
#pragma unroll
  for (int i = 0; i < VALUES; ++i) f += s[i] + x[i];
  out[blockIdx.x * THREADS + threadIdx.x] = r + __float_as_int(f);
}

template <Convert C, bool EXPS>
int time_steps(const cudaDeviceProp& prop, const char* convert) {
  const int sms = prop.multiProcessorCount, steps = 4096;
  int* out;
  CHECK(cudaMalloc(&out, sizeof(int) * sms * THREADS));
  double per_step;
  const auto launch = [&](long long* cycles) {
    step_kernel<C, EXPS><<<sms, THREADS>>>(steps, 1e-3f, -2.f, out, cycles);
  };
  if (median_cycles_per_step(sms, steps, launch, &per_step)) return 1;
  // per scheduler: two warps of VALUES exponentials at 8 cycles each is the XU's floor
  printf("{\"gpu\": \"%s\", \"exps\": %d, \"convert\": \"%s\", \"values_per_thread\": %d, \"threads_per_sm\": %d, "
         "\"cycles_per_step\": %.1f, \"xu_floor_exps\": %d}\n",
         prop.name, EXPS ? VALUES : 0, convert, C == Convert::none ? 0 : VALUES, THREADS, per_step,
         EXPS ? 2 * VALUES * 8 : 0);
  CHECK(cudaFree(out));
  return 0;
}

int main() {
  cudaDeviceProp prop;
  CHECK(cudaGetDeviceProperties(&prop, 0));
  unsigned long long *bad, *seen;
  CHECK(cudaMalloc(&bad, 8));
  CHECK(cudaMalloc(&seen, 8));
  CHECK(cudaMemset(bad, 0, 8));
  CHECK(cudaMemset(seen, 0, 8));
  check_kernel<<<prop.multiProcessorCount * 8, 256>>>(1ull << 32, bad, seen);
  CHECK(cudaGetLastError());
  unsigned long long nbad = 0, nseen = 0;
  CHECK(cudaMemcpy(&nbad, bad, 8, cudaMemcpyDeviceToHost));
  CHECK(cudaMemcpy(&nseen, seen, 8, cudaMemcpyDeviceToHost));
  printf("{\"gpu\": \"%s\", \"check\": \"split against cvt.rni.s32.f32\", \"values\": %llu, \"mismatches\": %llu}\n",
         prop.name, nseen, nbad);
  if (nbad != 0 || nseen == 0) return 1;
  return time_steps<Convert::none, true>(prop, "none") || time_steps<Convert::cvt, true>(prop, "cvt") ||
         time_steps<Convert::split, true>(prop, "split") || time_steps<Convert::cvt, false>(prop, "cvt") ||
         time_steps<Convert::split, false>(prop, "split");
}
