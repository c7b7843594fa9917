// Do paired exponentials (ex2.approx.f16x2, ex2.approx.ftz.bf16x2) take one slot of the
// exponentials' pipe for two values? (issue 44, docs/FA4.md)
//
// The 0.5B backward keeps the tensor pipe 69-72% busy, held by its exponentials (one MUFU.EX2 per
// value, a quarter-rate pipe). sm_90 has two paired forms in PTX. If either issues one MUFU
// instruction for its two values, a step's exponentials would cost half the pipe, and the scores
// could go in as f16 pairs (one cvt.rn.f16x2.f32, the cheap F2FP pipe) at the price of f16's
// rounding of the input (2^-11 relative: 0.27% of 2^x at |x| near 16).
//
// This probe, on the GPU machine:
//   1. errors: 2^x by each form against exp2 in double, for 2^24 evenly spaced fp32 x in [-24, 0],
//      each rounded to the pair's type first as a kernel would; max and rms relative error;
//   2. cycles per step, as bf16_pack_pipe.cu times them (one CTA of 256 threads per SM, clock64):
//      64 values a thread through ex2.approx.ftz.f32 (our kernels' form), through 32 f16x2 or bf16x2
//      exponentials with the packing and unpacking a kernel needs around them (fp32 in, fp32 out),
//      and through 32 paired exponentials alone (the pair kept packed, an HFMA2 between them).
// Build and run: nvcc -O3 -arch=sm_90a -o /tmp/ex2_pair_rate benchmarks/probes/ex2_pair_rate.cu &&
// /tmp/ex2_pair_rate; cuobjdump -sass /tmp/ex2_pair_rate | grep -o 'MUFU[.A-Z0-9]*' | sort | uniq -c
// counts the instructions each form became.
// Prints one JSON object per line.
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include "cuda_check.h"
#include "step_cycles.cuh"

constexpr int THREADS = 256, VALUES = 64;
enum class Form { f32, f16x2, bf16x2, f16x2_alone, bf16x2_alone };

__device__ __forceinline__ uint32_t ex2_f16x2(uint32_t x) {
  uint32_t r;
  asm volatile("ex2.approx.f16x2 %0, %1;" : "=r"(r) : "r"(x));
  return r;
}

__device__ __forceinline__ uint32_t ex2_bf16x2(uint32_t x) {
  uint32_t r;
  asm volatile("ex2.approx.ftz.bf16x2 %0, %1;" : "=r"(r) : "r"(x));
  return r;
}

// As pack_bf16x2 (step_cycles.cuh), to f16x2.
__device__ __forceinline__ uint32_t pack_f16x2(float hi, float lo) {
  uint32_t r;
  asm("cvt.rn.f16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));
  return r;
}

__device__ __forceinline__ float2 unpack_f16x2(uint32_t v) {  // (lo, hi)
  return __half22float2(*reinterpret_cast<__half2*>(&v));
}

__device__ __forceinline__ float2 unpack_bf16x2(uint32_t v) {  // bf16 to fp32 is a shift: integer pipe
  return make_float2(__uint_as_float(v << 16), __uint_as_float(v & 0xffff0000u));
}

// errors[form] over n fp32 inputs x = -24 * i / n: relative error of 2^x as the form gives it
// (fp32 in, rounded to the pair's type, fp32 out) against exp2 in double; max as bits, sum of squares.
__global__ void error_kernel(int n, unsigned int* max_bits, double* sum_sq) {
  const int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i >= n) return;
  const float x = -24.f * (float)i / (float)n;
  const double exact = exp2((double)x);
  const float forms[3] = {ex2_approx(x), unpack_f16x2(ex2_f16x2(pack_f16x2(x, x))).x,
                          unpack_bf16x2(ex2_bf16x2(pack_bf16x2(x, x))).x};
  for (int f = 0; f < 3; ++f) {
    const float rel = (float)fabs(((double)forms[f] - exact) / exact);
    atomicMax(max_bits + f, __float_as_uint(rel));  // non-negative floats order as their bits
    atomicAdd(sum_sq + f, (double)rel * rel);
  }
}

// VALUES values a thread, kept near -2 (2^-2 * a + b with a = 1e-3, b = -2), through FORM's
// exponentials each step; thread 0 of each CTA records its loop's cycles.
template <Form FORM>
__global__ void __launch_bounds__(THREADS, 1) step_kernel(int steps, float a, float b, float* out, long long* cycles) {
  float s[VALUES];
#pragma unroll
  for (int i = 0; i < VALUES; ++i) s[i] = -2.f + 1e-3f * ((threadIdx.x + i) % 7);
  uint32_t h[VALUES / 2];  // the pairs, for the forms that keep them packed
#pragma unroll
  for (int j = 0; j < VALUES / 2; ++j)
    h[j] = FORM == Form::bf16x2_alone ? pack_bf16x2(s[2 * j + 1], s[2 * j]) : pack_f16x2(s[2 * j + 1], s[2 * j]);
  const __half2 a16 = __float2half2_rn(a), b16 = __float2half2_rn(b);
  const __nv_bfloat162 a_bf = __float2bfloat162_rn(a), b_bf = __float2bfloat162_rn(b);
  __syncthreads();
  const long long start = clock64();
  for (int k = 0; k < steps; ++k) {
#pragma unroll
    for (int j = 0; j < VALUES / 2; ++j) {
      const int i = 2 * j;
      if constexpr (FORM == Form::f32) {
        s[i] = fmaf(ex2_approx(s[i]), a, b);
        s[i + 1] = fmaf(ex2_approx(s[i + 1]), a, b);
      } else if constexpr (FORM == Form::f16x2 || FORM == Form::bf16x2) {
        const float2 e = FORM == Form::f16x2 ? unpack_f16x2(ex2_f16x2(pack_f16x2(s[i + 1], s[i])))
                                             : unpack_bf16x2(ex2_bf16x2(pack_bf16x2(s[i + 1], s[i])));
        s[i] = fmaf(e.x, a, b);
        s[i + 1] = fmaf(e.y, a, b);
      } else if constexpr (FORM == Form::f16x2_alone) {
        uint32_t e = ex2_f16x2(h[j]);
        const __half2 r = __hfma2(*reinterpret_cast<__half2*>(&e), a16, b16);
        h[j] = *reinterpret_cast<const uint32_t*>(&r);
      } else {
        uint32_t e = ex2_bf16x2(h[j]);
        const __nv_bfloat162 r = __hfma2(*reinterpret_cast<__nv_bfloat162*>(&e), a_bf, b_bf);
        h[j] = *reinterpret_cast<const uint32_t*>(&r);
      }
    }
  }
  __syncthreads();
  if (threadIdx.x == 0) cycles[blockIdx.x] = clock64() - start;
  float f = 0.f;
  uint32_t x = 0;
#pragma unroll
  for (int i = 0; i < VALUES; ++i) f += s[i];
#pragma unroll
  for (int j = 0; j < VALUES / 2; ++j) x ^= h[j];
  out[blockIdx.x * THREADS + threadIdx.x] = f + __uint_as_float(x & 0x3fffffffu);
}

template <Form FORM>
int time_steps(const cudaDeviceProp& prop, const char* form) {
  const int sms = prop.multiProcessorCount, steps = 4096;
  float* out;
  CHECK(cudaMalloc(&out, sizeof(float) * sms * THREADS));
  double per_step;
  const auto launch = [&](long long* cycles) { step_kernel<FORM><<<sms, THREADS>>>(steps, 1e-3f, -2.f, out, cycles); };
  if (median_cycles_per_step(sms, steps, launch, &per_step)) return 1;
  // per scheduler: two warps of VALUES fp32 exponentials at 8 cycles each is the pipe's floor
  printf("{\"gpu\": \"%s\", \"form\": \"%s\", \"values_per_thread\": %d, \"threads_per_sm\": %d, "
         "\"cycles_per_step\": %.1f, \"f32_floor\": %d}\n",
         prop.name, form, VALUES, THREADS, per_step, 2 * VALUES * 8);
  CHECK(cudaFree(out));
  return 0;
}

int main() {
  cudaDeviceProp prop;
  CHECK(cudaGetDeviceProperties(&prop, 0));
  const int n = 1 << 24;
  unsigned int* max_bits;
  double* sum_sq;
  CHECK(cudaMalloc(&max_bits, 3 * sizeof(unsigned int)));
  CHECK(cudaMalloc(&sum_sq, 3 * sizeof(double)));
  CHECK(cudaMemset(max_bits, 0, 3 * sizeof(unsigned int)));
  CHECK(cudaMemset(sum_sq, 0, 3 * sizeof(double)));
  error_kernel<<<n / 256, 256>>>(n, max_bits, sum_sq);
  CHECK(cudaGetLastError());
  unsigned int mb[3];
  double ss[3];
  CHECK(cudaMemcpy(mb, max_bits, sizeof(mb), cudaMemcpyDeviceToHost));
  CHECK(cudaMemcpy(ss, sum_sq, sizeof(ss), cudaMemcpyDeviceToHost));
  const char* names[3] = {"ex2.approx.ftz.f32", "f16x2 (cvt.rn.f16x2.f32 in)", "bf16x2 (cvt.rn.bf16x2.f32 in)"};
  for (int f = 0; f < 3; ++f) {
    float m;
    memcpy(&m, mb + f, 4);
    printf("{\"gpu\": \"%s\", \"errors_of\": \"%s\", \"x_range\": [-24, 0], \"inputs\": %d, \"max_rel\": %.3e, \"rms_rel\": %.3e, "
           "\"bf16_half_ulp\": %.3e}\n",
           prop.name, names[f], n, m, sqrt(ss[f] / n), ldexp(1.0, -9));
  }
  return time_steps<Form::f32>(prop, "ex2.approx.ftz.f32, 64 a thread") ||
         time_steps<Form::f16x2>(prop, "ex2.approx.f16x2, 32 a thread, fp32 packed in and unpacked out") ||
         time_steps<Form::bf16x2>(prop, "ex2.approx.ftz.bf16x2, 32 a thread, fp32 packed in and unpacked out") ||
         time_steps<Form::f16x2_alone>(prop, "ex2.approx.f16x2, 32 a thread, kept packed (HFMA2)") ||
         time_steps<Form::bf16x2_alone>(prop, "ex2.approx.ftz.bf16x2, 32 a thread, kept packed (HFMA2.BF16)");
}
