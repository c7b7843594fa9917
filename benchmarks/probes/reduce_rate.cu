// How fast can a Hopper backward add fp32 dQ tiles into global memory? (issue 44, docs/FA4.md)
//
// A fused backward (dQ from the dK/dV walk, five products per tile) adds one 64 x 128 fp32 tile
// (32 KB) per (query tile, KV block) into dQaccum: 34.6 GB at Qwen2.5-3B 64K 25%, into a 0.5 GB
// buffer. This probe adds the same volume, tile by tile at pseudo-random tiles of a window that
// slides over the buffer (the whole buffer, 128, 32 and 8 MB), one CTA per SM, four ways:
//   bulk    one thread per CTA issues cp.reduce.async.bulk add.f32 of the whole tile from shared
//           memory (FA4's way: dQaccum in the accumulator's register order, so the tile is one
//           contiguous chunk), at most `inflight` (2) tiles in flight per CTA
//   red_v4  every thread adds its 32 floats with red.global.add.v4.f32, a warp's instruction
//           covering 512 contiguous bytes (the register order, coalesced)
//   red_v2  every thread adds its wgmma fragments with red.global.add.v2.f32 into a row-major
//           tile (the fused-dq-wip branch's way: 8-byte adds spread over the tile's rows)
//   store   plain coalesced 16-byte stores of the same bytes (no read): the write bandwidth
//   bulk_s32, red_s32: bulk and red adds of int32 (fixed point, whose sum is the same in any
//           order: the deterministic reduction docs/FA4.md designs); red_s32 adds 4-byte values,
//           thread fastest, since red has no vector form for integers
// Build and run on the GPU machine: nvcc -O3 -arch=sm_90a -o /tmp/reduce_rate benchmarks/probes/reduce_rate.cu
// && /tmp/reduce_rate. Prints one JSON object per line. Timing only: the values added are not checked.
#include <cstdint>
#include <cstdio>
#include <vector>
#include <algorithm>
#include <cuda_runtime.h>

#include "cuda_check.h"
#include "fixed_point.cuh"

constexpr int TILE_ROWS = 64, TILE_COLS = 128;
constexpr int TILE_FLOATS = TILE_ROWS * TILE_COLS;  // 8192 floats, 32 KB
constexpr int THREADS = 256;                        // two warpgroups, 32 floats each per tile

__device__ __forceinline__ uint32_t tile_of(uint64_t i, uint32_t num_tiles, uint64_t adds, uint32_t window) {
  // add i goes to a pseudo-random tile (splitmix64) of a window of `window` tiles that slides over
  // dQaccum as the adds go on (window = num_tiles: spread over the whole buffer; a window that
  // fits in L2 models CTAs running together adding into the same query tiles)
  uint64_t z = i + 0x9e3779b97f4a7c15ull;
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  const uint64_t start = i * (num_tiles - window) / adds;
  return static_cast<uint32_t>(start + (z ^ (z >> 31)) % window);
}

template <int INFLIGHT, bool INT32>
__global__ void __launch_bounds__(THREADS) bulk_kernel(float* acc, uint32_t num_tiles, uint64_t adds, uint32_t window) {
  extern __shared__ __align__(128) float tile[];  // INFLIGHT tiles
  for (int i = threadIdx.x; i < INFLIGHT * TILE_FLOATS; i += THREADS) tile[i] = 1e-3f * (i & 7);
  asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
  __syncthreads();
  if (threadIdx.x != 0) return;
  int buf = 0;
  for (uint64_t i = blockIdx.x; i < adds; i += gridDim.x) {
    // as if the consumers rewrote this buffer: wait until at most INFLIGHT-1 adds still read smem
    asm volatile("cp.async.bulk.wait_group.read %0;\n" ::"n"(INFLIGHT - 1) : "memory");
    float* g = acc + static_cast<uint64_t>(tile_of(i, num_tiles, adds, window)) * TILE_FLOATS;
    uint32_t s = static_cast<uint32_t>(__cvta_generic_to_shared(tile + buf * TILE_FLOATS));
    bulk_reduce_add<INT32>(g, s, TILE_FLOATS * 4);
    buf = (buf + 1) % INFLIGHT;
  }
  asm volatile("cp.async.bulk.wait_group 0;\n" ::: "memory");
}

__global__ void __launch_bounds__(THREADS) red_v4_kernel(float* acc, uint32_t num_tiles, uint64_t adds, uint32_t window) {
  const float a = 1e-3f * (threadIdx.x & 7);
  for (uint64_t i = blockIdx.x; i < adds; i += gridDim.x) {
    float* g = acc + static_cast<uint64_t>(tile_of(i, num_tiles, adds, window)) * TILE_FLOATS;
#pragma unroll
    for (int j = 0; j < TILE_FLOATS / (4 * THREADS); ++j)
      asm volatile("red.global.add.v4.f32 [%0], {%1, %2, %3, %4};\n"
                   ::"l"(g + (j * THREADS + threadIdx.x) * 4), "f"(a), "f"(a), "f"(a), "f"(a) : "memory");
  }
}

__global__ void __launch_bounds__(THREADS) red_s32_kernel(float* acc, uint32_t num_tiles, uint64_t adds, uint32_t window) {
  const int a = threadIdx.x & 7;
  for (uint64_t i = blockIdx.x; i < adds; i += gridDim.x) {
    int* g = reinterpret_cast<int*>(acc + static_cast<uint64_t>(tile_of(i, num_tiles, adds, window)) * TILE_FLOATS);
#pragma unroll
    for (int j = 0; j < TILE_FLOATS / THREADS; ++j)
      asm volatile("red.global.add.s32 [%0], %1;\n" ::"l"(g + j * THREADS + threadIdx.x), "r"(a) : "memory");
  }
}

__global__ void __launch_bounds__(THREADS) red_v2_kernel(float* acc, uint32_t num_tiles, uint64_t adds, uint32_t window) {
  // wgmma m64nNk16 accumulator fragments: warpgroup wg owns columns wg*64.., warp w%4 rows
  // 16*(w%4).., lane rows lane/4 and lane/4+8, column pairs 2*(lane%4) + 8*j
  const int wg = threadIdx.x / 128, warp = (threadIdx.x / 32) % 4, lane = threadIdx.x % 32;
  const float a = 1e-3f * (lane & 7);
  for (uint64_t i = blockIdx.x; i < adds; i += gridDim.x) {
    float* g = acc + static_cast<uint64_t>(tile_of(i, num_tiles, adds, window)) * TILE_FLOATS;
#pragma unroll
    for (int h = 0; h < 2; ++h)
#pragma unroll
      for (int j = 0; j < 8; ++j) {
        const int row = 16 * warp + lane / 4 + 8 * h, col = 64 * wg + 8 * j + 2 * (lane % 4);
        asm volatile("red.global.add.v2.f32 [%0], {%1, %2};\n" ::"l"(g + row * TILE_COLS + col), "f"(a), "f"(a)
                     : "memory");
      }
  }
}

__global__ void __launch_bounds__(THREADS) store_kernel(float* acc, uint32_t num_tiles, uint64_t adds, uint32_t window) {
  const float4 a = make_float4(1.f, 2.f, 3.f, 4.f);
  for (uint64_t i = blockIdx.x; i < adds; i += gridDim.x) {
    float4* g = reinterpret_cast<float4*>(acc + static_cast<uint64_t>(tile_of(i, num_tiles, adds, window)) * TILE_FLOATS);
#pragma unroll
    for (int j = 0; j < TILE_FLOATS / (4 * THREADS); ++j) g[j * THREADS + threadIdx.x] = a;
  }
}

template <typename Launch>
float median_ms(Launch launch, int reps) {
  cudaEvent_t a, b;
  cudaEventCreate(&a);
  cudaEventCreate(&b);
  launch();  // warm-up
  std::vector<float> ms;
  for (int r = 0; r < reps; ++r) {
    cudaEventRecord(a);
    launch();
    cudaEventRecord(b);
    cudaEventSynchronize(b);
    float t;
    cudaEventElapsedTime(&t, a, b);
    ms.push_back(t);
  }
  std::sort(ms.begin(), ms.end());
  return ms[ms.size() / 2];
}

int main() {
  cudaDeviceProp prop;
  CHECK(cudaGetDeviceProperties(&prop, 0));
  const uint32_t num_tiles = 16384;  // 3B at 64K: 65536 tokens x 16 heads / 64 rows: 0.5 GB
  const uint64_t adds = 1u << 20;    // 34.4 GB of adds, 3B 64K 25%'s 34.6 GB
  float* acc;
  CHECK(cudaMalloc(&acc, static_cast<size_t>(num_tiles) * TILE_FLOATS * 4));
  CHECK(cudaMemset(acc, 0, static_cast<size_t>(num_tiles) * TILE_FLOATS * 4));
  const double gb = adds * TILE_FLOATS * 4.0 / 1e9;
  const int sms = prop.multiProcessorCount;
  CHECK(cudaFuncSetAttribute(bulk_kernel<2, false>, cudaFuncAttributeMaxDynamicSharedMemorySize, 2 * TILE_FLOATS * 4));
  CHECK(cudaFuncSetAttribute(bulk_kernel<2, true>, cudaFuncAttributeMaxDynamicSharedMemorySize, 2 * TILE_FLOATS * 4));
  auto report = [&](const char* mode, int inflight, int ctas_per_sm, uint32_t window, float ms) {
    printf("{\"gpu\": \"%s\", \"mode\": \"%s\", \"inflight\": %d, \"ctas_per_sm\": %d, \"window_mb\": %.0f, "
           "\"gb\": %.2f, \"ms\": %.3f, \"tb_per_s\": %.3f}\n",
           prop.name, mode, inflight, ctas_per_sm, window * TILE_FLOATS * 4.0 / (1 << 20), gb, ms, gb / ms);
  };
  for (uint32_t window : {num_tiles, 4096u, 1024u, 256u}) {
    const int grid = sms;
    report("bulk", 2, 1, window, median_ms([&] {
      bulk_kernel<2, false><<<grid, THREADS, 2 * TILE_FLOATS * 4>>>(acc, num_tiles, adds, window); }, 5));
    report("bulk_s32", 2, 1, window, median_ms([&] {
      bulk_kernel<2, true><<<grid, THREADS, 2 * TILE_FLOATS * 4>>>(acc, num_tiles, adds, window); }, 5));
    report("red_s32", 0, 1, window, median_ms([&] { red_s32_kernel<<<grid, THREADS>>>(acc, num_tiles, adds, window); }, 5));
    report("red_v4", 0, 1, window, median_ms([&] { red_v4_kernel<<<grid, THREADS>>>(acc, num_tiles, adds, window); }, 5));
    report("red_v2", 0, 1, window, median_ms([&] { red_v2_kernel<<<grid, THREADS>>>(acc, num_tiles, adds, window); }, 5));
    report("store", 0, 1, window, median_ms([&] { store_kernel<<<grid, THREADS>>>(acc, num_tiles, adds, window); }, 5));
  }
  CHECK(cudaGetLastError());
  CHECK(cudaDeviceSynchronize());
  return 0;
}
