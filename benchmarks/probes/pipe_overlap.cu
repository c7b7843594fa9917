// Where does dK/dV's step at head dim 64 lose its time, when its own instructions are all it runs?
// (issue 44, docs/FA4.md, "Where the backward's time goes")
//
// Profiled at 0.5B 64K 25% (archive/two_pass_ncu_h100.txt), main's dK/dV step takes 2,873 cycles
// per SM where its four products alone take 2,048 on the tensor cores and its exponentials 1,024 on
// the XU. This probe takes the step out of the kernel: no producer, no mbarriers, no copies; one
// CTA of two warpgroups per SM (as the kernel's two consumers), each running ITERS iterations of a
// role on operands already in shared memory:
//   ss          S^T = K Q^T: four m64n128k16 products, both operands in shared memory
//   rs          dV += P^T dO: eight m64n64k16 products, A from registers, B read transposed
//   exp         64 exponentials per thread, exp2(s c - l) as the step takes them
//   step        the step's sequence (dkdv_tile's at QT = 128) with lse and delta in registers:
//               S^T and dP^T, the exponentials of S^T while dP^T runs, dV's products, dS, dK's
//   noexp       the same with a multiply for each exponential
//   step_il     the step with dV's eight k-steps each issued as soon as its 16 columns of P are
//               taken, and dK's as soon as their dS are
//   step_split  step_il with S^T as two products of 64 query columns (exponentials start after half)
//   step_turns  the step with the two warpgroups issuing their score products in turns
//   tile        the kernel's own step, dkdv_tile (no mask), lse and delta read from shared memory
// and reports each warpgroup's cycles per iteration (clock64, so the power cap's clock does not
// enter), alone and beside the other role: a pair of roles overlaps where its cycles stay near the
// larger of the two alone.
// Build and run on the GPU machine: nvcc -O3 -std=c++17 --use_fast_math --expt-relaxed-constexpr
// -gencode=arch=compute_90a,code=sm_90a -Icsrc -o /tmp/pipe_overlap benchmarks/probes/pipe_overlap.cu
// && /tmp/pipe_overlap (the flags of setup.py's build). Prints one JSON object per line.
#include <cstdint>
#include <cstdio>
#include <vector>
#include <cuda_runtime.h>

#include "cuda/attention_kernels_sm90.cuh"
#include "cuda_check.h"
#include "random_bf16.h"

namespace sk = sparsebalance::kernels;
namespace s90 = sparsebalance::kernels::sm90;
using T = __nv_bfloat16;

constexpr int D = 64, QT = 128, KV_ROWS = 128, NJ = QT / 8, THREADS = 2 * s90::WG_THREADS;
constexpr int WARMUP = 8, ITERS = 256;
constexpr int TILE = 128 * D;  // elements of each of K, V, Q, dO (128 rows of D)
enum Role { idle, ss, rs, exps, step, noexp, step_il, step_split, step_turns, tile, ROLES };
const char* const ROLE_NAMES[ROLES] = {"idle",  "ss",      "rs",         "exp",        "step",
                                       "noexp", "step_il", "step_split", "step_turns", "tile"};

// Named barriers 2 and 3: the turns of step_turns (0 is __syncthreads').
template <int ID>
__device__ __forceinline__ void turn_sync() { asm volatile("bar.sync %0, 256;\n" ::"n"(ID) : "memory"); }
template <int ID>
__device__ __forceinline__ void turn_arrive() { asm volatile("bar.arrive %0, 256;\n" ::"n"(ID) : "memory"); }

// The step's sequence on the tiles in shared memory, lse and delta constants (see the roles above).
template <bool EXPS, bool INTERLEAVED, bool SPLIT = false, bool TURNS = false>
__device__ __forceinline__ void dkdv_like_step(float (&dk)[1][D / 8][4], float (&dv)[1][D / 8][4], uint64_t k_desc,
                                               uint64_t v_desc, uint64_t q_k, uint64_t do_k, uint64_t q_mn,
                                               uint64_t do_mn, int wg, float lse, float dl, float c) {
  static_assert(!SPLIT || INTERLEAVED, "the split order interleaves dV's products");
  float st[1][NJ][4], dpt[1][NJ][4];
  if constexpr (TURNS) {
    if (wg == 0) turn_sync<2>(); else turn_sync<3>();
  }
  s90::wgmma_fence();
  if constexpr (SPLIT) {  // S^T's query columns [0, 64) and [64, 128): two commit groups
    using Half = float[NJ / 2][4];
    s90::product_over_head_dim<T, D, KV_ROWS, QT / 2>(*reinterpret_cast<Half*>(&st[0][0]), k_desc,
                                                      wg * s90::WG_ROWS, q_k);
    s90::product_over_head_dim<T, D, KV_ROWS, QT / 2>(*reinterpret_cast<Half*>(&st[0][NJ / 2]), k_desc,
                                                      wg * s90::WG_ROWS, s90::desc_at<T>(q_k, QT / 2 * s90::SW_COLS));
  } else {
    s90::product_over_head_dim<T, D, KV_ROWS, QT>(st[0], k_desc, wg * s90::WG_ROWS, q_k);
  }
  s90::product_over_head_dim<T, D, KV_ROWS, QT>(dpt[0], v_desc, wg * s90::WG_ROWS, do_k);
  if constexpr (TURNS) {
    if (wg == 0) turn_arrive<3>(); else turn_arrive<2>();
  }
  s90::wgmma_wait<SPLIT ? 2 : 1>();  // S^T (its first half) done
  const auto p_of = [&](float x) { return EXPS ? exp2f(fmaf(x, c, -lse)) : fmaf(x, c, -lse) * 0.5f; };
  uint32_t pa[1][QT / 16][4];
  if constexpr (INTERLEAVED) {
#pragma unroll
    for (int s = 0; s < QT / 16; ++s) {
      if (SPLIT && s == QT / 32) {  // dV's first half on its own group; S^T's second half done
        s90::wgmma_commit();
        s90::wgmma_wait<2>();
      }
#pragma unroll
      for (int j = 2 * s; j < 2 * s + 2; ++j)
#pragma unroll
        for (int e = 0; e < 4; ++e) st[0][j][e] = p_of(st[0][j][e]);
      pa[0][s][0] = sk::pack2<T>(st[0][2 * s][0], st[0][2 * s][1]);  // to_a_frags' order
      pa[0][s][1] = sk::pack2<T>(st[0][2 * s][2], st[0][2 * s][3]);
      pa[0][s][2] = sk::pack2<T>(st[0][2 * s + 1][0], st[0][2 * s + 1][1]);
      pa[0][s][3] = sk::pack2<T>(st[0][2 * s + 1][2], st[0][2 * s + 1][3]);
      s90::wgmma_fence();
      s90::wgmma_rs_tb<T, D>(dv[0], pa[0][s], s90::mnmajor_at<T>(do_mn, 16 * s), true);
    }
  } else {
#pragma unroll
    for (int j = 0; j < NJ; ++j)
#pragma unroll
      for (int e = 0; e < 4; ++e) st[0][j][e] = p_of(st[0][j][e]);
    sk::to_a_frags<T, 1, QT>(pa, st);
    s90::wgmma_fence();
#pragma unroll
    for (int s = 0; s < QT / 16; ++s) s90::wgmma_rs_tb<T, D>(dv[0], pa[0][s], s90::mnmajor_at<T>(do_mn, 16 * s), true);
  }
  s90::wgmma_commit();
  s90::wgmma_wait<SPLIT ? 2 : 1>();  // dP^T done; dV's products run on
  uint32_t da[1][QT / 16][4];
#pragma unroll
  for (int s = 0; s < QT / 16; ++s) {
#pragma unroll
    for (int h = 0; h < 4; ++h) {  // dS = P (dP - delta), as dkdv_tile forms it at QT = 128
      const int j = 2 * s + h / 2, e0 = 2 * (h % 2);
      da[0][s][h] = sk::mul2<T>(pa[0][s][h], sk::pack2<T>(dpt[0][j][e0] - dl, dpt[0][j][e0 + 1] - dl));
    }
    if constexpr (INTERLEAVED) {
      s90::wgmma_fence();
      s90::wgmma_rs_tb<T, D>(dk[0], da[0][s], s90::mnmajor_at<T>(q_mn, 16 * s), true);
    }
  }
  if constexpr (!INTERLEAVED) {
    s90::wgmma_fence();
#pragma unroll
    for (int s = 0; s < QT / 16; ++s) s90::wgmma_rs_tb<T, D>(dk[0], da[0][s], s90::mnmajor_at<T>(q_mn, 16 * s), true);
  }
  s90::wgmma_commit();
  s90::wgmma_wait<0>();
}

// One warpgroup's role, ITERS timed iterations after WARMUP; returns its cycles and leaves a value
// that depends on every result in `keep` (so that nothing is optimised away).
template <int ROLE>
__device__ __forceinline__ long long run_role(const T* Ks, const T* Vs, const T* Qs, const T* dOs, const float* lse_s,
                                              const float* dl_s, const sk::Params& p, int wg, int lane, float c,
                                              float& keep) {
  const uint64_t k_desc = s90::kmajor_tile<KV_ROWS>(Ks), v_desc = s90::kmajor_tile<KV_ROWS>(Vs);
  const uint64_t q_k = s90::kmajor_tile<QT>(Qs), do_k = s90::kmajor_tile<QT>(dOs);
  const uint64_t q_mn = s90::mnmajor_tile<T, QT>(Qs), do_mn = s90::mnmajor_tile<T, QT>(dOs);
  const float lse = 0.25f, dl = 0.125f;
  float dk[1][D / 8][4], dv[1][D / 8][4], acc[NJ][4], vals[ROLE == exps ? 64 : 1];
#pragma unroll
  for (int j = 0; j < NJ; ++j)
#pragma unroll
    for (int e = 0; e < 4; ++e) acc[j][e] = 0.f;
  sk::zero(dk);
  sk::zero(dv);
  uint32_t pa[ROLE == rs ? QT / 16 : 1][4];
  if constexpr (ROLE == rs) {
#pragma unroll
    for (int s = 0; s < QT / 16; ++s)
#pragma unroll
      for (int h = 0; h < 4; ++h) pa[s][h] = sk::pack2<T>(0.01f * (lane + h), -0.01f * (s + 1));
  }
  if constexpr (ROLE == exps) {
#pragma unroll
    for (int i = 0; i < 64; ++i) vals[i] = 0.001f * (i + lane);
  }
  if constexpr (ROLE == step_turns) {
    if (wg == 1) turn_arrive<2>();  // warpgroup 0 takes the first turn
  }
  long long t0 = 0;
  for (int it = 0; it < WARMUP + ITERS; ++it) {
    if (it == WARMUP) t0 = clock64();
    if constexpr (ROLE == ss) {
      s90::wgmma_fence();  // accumulating over the iterations: every product's result is read
#pragma unroll
      for (int k = 0; k < D; k += 16)
        s90::wgmma_ss<T, QT>(acc, s90::kmajor_at<T, KV_ROWS>(k_desc, wg * s90::WG_ROWS, k),
                             s90::kmajor_at<T, QT>(q_k, 0, k), true);
      s90::wgmma_commit();
      s90::wgmma_wait<0>();
    } else if constexpr (ROLE == rs) {
      s90::wgmma_fence();
#pragma unroll
      for (int s = 0; s < QT / 16; ++s) s90::wgmma_rs_tb<T, D>(dv[0], pa[s], s90::mnmajor_at<T>(do_mn, 16 * s), true);
      s90::wgmma_commit();
      s90::wgmma_wait<0>();
    } else if constexpr (ROLE == exps) {
#pragma unroll
      for (int i = 0; i < 64; ++i) vals[i] = exp2f(fmaf(vals[i], c, -lse));
    } else if constexpr (ROLE == step || ROLE == noexp || ROLE == step_il) {
      dkdv_like_step<ROLE != noexp, ROLE == step_il>(dk, dv, k_desc, v_desc, q_k, do_k, q_mn, do_mn, wg, lse, dl, c);
    } else if constexpr (ROLE == step_split) {
      dkdv_like_step<true, true, true>(dk, dv, k_desc, v_desc, q_k, do_k, q_mn, do_mn, wg, lse, dl, c);
    } else if constexpr (ROLE == step_turns) {
      dkdv_like_step<true, false, false, true>(dk, dv, k_desc, v_desc, q_k, do_k, q_mn, do_mn, wg, lse, dl, c);
    } else if constexpr (ROLE == tile) {
      // The kernel's own step (no mask), lse and delta read from shared memory as it reads them.
      const s90::BoxWalk<QT> walk(p, 0, 0, 0, 0, 0);
      s90::dkdv_tile<T, D, KV_ROWS, QT, false>(dk, dv, k_desc, v_desc, Qs, dOs, lse_s, dl_s, walk, wg, 0, lane, p);
      s90::wgmma_wait<0>();
    }
  }
  const long long t1 = clock64();
  if constexpr (ROLE == step_turns) {
    if (wg == 0) turn_sync<2>();  // warpgroup 1's arrival after its last turn
  }
  keep = 0.f;
#pragma unroll
  for (int j = 0; j < D / 8; ++j)
#pragma unroll
    for (int e = 0; e < 4; ++e) keep += dk[0][j][e] + dv[0][j][e];
  if constexpr (ROLE == ss) {
#pragma unroll
    for (int j = 0; j < NJ; ++j)
#pragma unroll
      for (int e = 0; e < 4; ++e) keep += acc[j][e];
  }
  if constexpr (ROLE == exps) {
#pragma unroll
    for (int i = 0; i < 64; ++i) keep += vals[i];
  }
  return t1 - t0;
}

template <int ROLE0, int ROLE1>
__global__ void __launch_bounds__(THREADS, 1) overlap_kernel(const T* src, float c, long long* cycles, float* sink,
                                                             const sk::Params p) {
  extern __shared__ unsigned char smem_raw[];
  T* Ks = reinterpret_cast<T*>(smem_raw + ((1024 - sk::smem_u32(smem_raw) % 1024) % 1024));
  T* Vs = Ks + TILE;
  T* Qs = Vs + TILE;
  T* dOs = Qs + TILE;
  float* lse_s = reinterpret_cast<float*>(dOs + TILE);  // [QT]
  float* dl_s = lse_s + QT;
  for (int i = threadIdx.x; i < QT; i += THREADS) {
    lse_s[i] = 0.25f + 0.001f * i;
    dl_s[i] = 0.125f - 0.001f * i;
  }
  // The four tiles from global memory as they lie: any bf16 values serve a timing, and the
  // descriptors read them in the swizzled layout the kernels use.
  for (int i = threadIdx.x; i < 4 * TILE; i += THREADS) Ks[i] = src[i];
  s90::fence_proxy_async();
  __syncthreads();
  const int wg = threadIdx.x / s90::WG_THREADS, lane = threadIdx.x % 32;
  float keep = 0.f;
  const long long t = wg == 0 ? run_role<ROLE0>(Ks, Vs, Qs, dOs, lse_s, dl_s, p, wg, lane, c, keep)
                              : run_role<ROLE1>(Ks, Vs, Qs, dOs, lse_s, dl_s, p, wg, lane, c, keep);
  sink[blockIdx.x * THREADS + threadIdx.x] = keep;
  if (threadIdx.x % s90::WG_THREADS == 0) cycles[blockIdx.x * 2 + wg] = t;
}

// Launches one pair twice (the second is reported) and prints its line.
template <int ROLE0, int ROLE1>
int run_pair(int sms, const char* gpu, const T* src, long long* cycles, float* sink, const sk::Params& p) {
  // The tiles take 65 KB; asking for 160 KB keeps one CTA per SM, as the kernels run.
  const int smem = 160 * 1024;
  CHECK(cudaFuncSetAttribute(overlap_kernel<ROLE0, ROLE1>, cudaFuncAttributeMaxDynamicSharedMemorySize, smem));
  for (int rep = 0; rep < 2; ++rep) overlap_kernel<ROLE0, ROLE1><<<sms, THREADS, smem>>>(src, 0.18f, cycles, sink, p);
  CHECK(cudaGetLastError());
  CHECK(cudaDeviceSynchronize());
  std::vector<long long> c(2 * sms);
  CHECK(cudaMemcpy(c.data(), cycles, c.size() * sizeof(long long), cudaMemcpyDeviceToHost));
  double per[2] = {0, 0};
  for (int b = 0; b < sms; ++b)
    for (int w = 0; w < 2; ++w) per[w] += (double)c[2 * b + w] / ITERS / sms;
  printf("{\"gpu\": \"%s\", \"wg0\": \"%s\", \"wg1\": \"%s\", \"wg0_cycles_per_iter\": %.1f, "
         "\"wg1_cycles_per_iter\": %.1f}\n",
         gpu, ROLE_NAMES[ROLE0], ROLE_NAMES[ROLE1], ROLE0 == idle ? 0.0 : per[0], ROLE1 == idle ? 0.0 : per[1]);
  return 0;
}

int main() {
  int sms = 0;
  CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));
  cudaDeviceProp prop;
  CHECK(cudaGetDeviceProperties(&prop, 0));
  const std::vector<T> host = uniform_bf16(4 * TILE, 12345, 0.5f);
  T* src;
  long long* cycles;
  float* sink;
  CHECK(cudaMalloc(&src, host.size() * sizeof(T)));
  CHECK(cudaMalloc(&cycles, 2 * sms * sizeof(long long)));
  CHECK(cudaMalloc(&sink, (size_t)sms * THREADS * sizeof(float)));
  CHECK(cudaMemcpy(src, host.data(), host.size() * sizeof(T), cudaMemcpyHostToDevice));
  // What the kernel's step reads of Params without a walk to take: the scale, R and a list offset.
  int* q_ptr;
  CHECK(cudaMalloc(&q_ptr, 2 * sizeof(int)));
  CHECK(cudaMemset(q_ptr, 0, 2 * sizeof(int)));
  sk::Params p{};
  p.q_ptr = q_ptr;
  p.R = 8;
  p.NB = 1;
  p.scale_log2 = 0.18f;
  const char* gpu = prop.name;
  int rc = 0;
  rc |= run_pair<ss, idle>(sms, gpu, src, cycles, sink, p);
  rc |= run_pair<rs, idle>(sms, gpu, src, cycles, sink, p);
  rc |= run_pair<exps, idle>(sms, gpu, src, cycles, sink, p);
  rc |= run_pair<ss, exps>(sms, gpu, src, cycles, sink, p);
  rc |= run_pair<rs, exps>(sms, gpu, src, cycles, sink, p);
  rc |= run_pair<ss, ss>(sms, gpu, src, cycles, sink, p);
  rc |= run_pair<rs, rs>(sms, gpu, src, cycles, sink, p);
  rc |= run_pair<exps, exps>(sms, gpu, src, cycles, sink, p);
  rc |= run_pair<step, idle>(sms, gpu, src, cycles, sink, p);
  rc |= run_pair<step, step>(sms, gpu, src, cycles, sink, p);
  rc |= run_pair<noexp, idle>(sms, gpu, src, cycles, sink, p);
  rc |= run_pair<noexp, noexp>(sms, gpu, src, cycles, sink, p);
  rc |= run_pair<step_il, idle>(sms, gpu, src, cycles, sink, p);
  rc |= run_pair<step_il, step_il>(sms, gpu, src, cycles, sink, p);
  rc |= run_pair<step_split, idle>(sms, gpu, src, cycles, sink, p);
  rc |= run_pair<step_split, step_split>(sms, gpu, src, cycles, sink, p);
  rc |= run_pair<step_turns, step_turns>(sms, gpu, src, cycles, sink, p);
  rc |= run_pair<tile, idle>(sms, gpu, src, cycles, sink, p);
  rc |= run_pair<tile, tile>(sms, gpu, src, cycles, sink, p);
  return rc;
}
