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
//               (with dkdv_fold_stats.patch applied: the folded step below, in fold_il's order)
//   fold        the step with lse and delta folded into the score products: S^T and dP^T take a
//               fifth k-step whose A is ones at three columns (registers) and whose B is a 32-byte
//               swizzled tile of the query rows holding -lse / c and -delta as three bf16 terms
//               each (fold_stats_row); P = exp2(c S'^T) and dS = P dP'^T need no statistic at all
//   fold_il     fold in step_il's order
// and reports each warpgroup's cycles per iteration (clock64, so the power cap's clock does not
// enter), alone and beside the other role: a pair of roles overlaps where its cycles stay near the
// larger of the two alone.
// Build and run on the GPU machine: nvcc -O3 -std=c++17 --use_fast_math --expt-relaxed-constexpr
// -gencode=arch=compute_90a,code=sm_90a -Icsrc -o /tmp/pipe_overlap benchmarks/probes/pipe_overlap.cu
// && /tmp/pipe_overlap (the flags of setup.py's build). Prints one JSON object per line.
#include <algorithm>
#include <cmath>
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
enum Role { idle, ss, rs, exps, step, noexp, step_il, step_split, step_turns, tile, fold, fold_il, ROLES };
const char* const ROLE_NAMES[ROLES] = {"idle",    "ss",         "rs",         "exp",  "step", "noexp",
                                       "step_il", "step_split", "step_turns", "tile", "fold", "fold_il"};
// ---- The fold (what dkdv_fold_stats.patch builds into the kernel) ----
constexpr int EXT_COLS = 16;  // the fold's extra k-step: one wgmma K of 16-bit values
constexpr int FOLD_LSE_COL = 0, FOLD_DELTA_COL = 4;

// A K-major tile of rows of 16 16-bit values (32 bytes) in the 32-byte swizzle: the 16-byte half
// u of row r sits at half u ^ ((r / 4) % 2); 8-row groups 256 bytes apart, 256-byte aligned.
__host__ __device__ constexpr int sw32_offset(int r, int c) {
  return r * EXT_COLS + (((c / 8) ^ ((r / 4) % 2)) * 8) + c % 8;
}
__device__ __forceinline__ uint64_t sw32_desc(const void* start) {
  const uint32_t addr = static_cast<uint32_t>(__cvta_generic_to_shared(start));
  return (uint64_t)((addr & 0x3FFFF) >> 4) | ((uint64_t)(16 >> 4) << 16) | ((uint64_t)(256 >> 4) << 32) | (3ull << 62);
}
// Columns 0-7 of a folded row: x's three bf16 terms at 0-2 and y's at 4-6 (24 bits of each).
__device__ __forceinline__ uint4 fold_stats_row(float x, float y) {
  const auto terms = [](float v, uint32_t& ab, uint32_t& c0) {
    const float a = __bfloat162float(__float2bfloat16_rn(v));
    const float b = __bfloat162float(__float2bfloat16_rn(v - a));
    ab = sk::pack2<T>(a, b);
    c0 = sk::pack2<T>(v - a - b, 0.f);
  };
  uint4 row;
  terms(x, row.x, row.y);
  terms(y, row.z, row.w);
  return row;
}
// The A fragment (m64 x k16) whose every row is ones at columns c0, c0 + 1, c0 + 2 (c0 = 0 or 4).
__device__ __forceinline__ void fold_ones(uint32_t (&a)[4], int c0, int lane) {
  const int pair = lane % 4 - c0 / 2;
  a[0] = a[1] = pair == 0 ? sk::pack2<T>(1.f, 1.f) : pair == 1 ? sk::pack2<T>(1.f, 0.f) : 0u;
  a[2] = a[3] = 0u;
}

// What the fold's products take beside the tiles: the statistics tile's descriptor and the ones.
struct FoldOperands {
  uint64_t desc;
  uint32_t ones_lse[4], ones_dl[4];
};

// acc = A[a_row0, +64) . B^T over the head dim, then the fold's fifth K step (ones x the
// statistics tile), as one commit group.
__device__ __forceinline__ void folded_product(float (&acc)[NJ][4], uint64_t a_desc, int a_row0, uint64_t b_desc,
                                               const uint32_t (&ones)[4], uint64_t stats_desc) {
#pragma unroll
  for (int k = 0; k < D; k += 16)
    s90::wgmma_ss<T, QT>(acc, s90::kmajor_at<T, KV_ROWS>(a_desc, a_row0, k), s90::kmajor_at<T, QT>(b_desc, 0, k),
                         k > 0);
  s90::wgmma_rs<T, QT>(acc, ones, stats_desc, true);
  s90::wgmma_commit();
}

// Named barriers 2 and 3: the turns of step_turns (0 is __syncthreads').
template <int ID>
__device__ __forceinline__ void turn_sync() { asm volatile("bar.sync %0, 256;\n" ::"n"(ID) : "memory"); }
template <int ID>
__device__ __forceinline__ void turn_arrive() { asm volatile("bar.arrive %0, 256;\n" ::"n"(ID) : "memory"); }

// The step's sequence on the tiles in shared memory, lse and delta constants (see the roles above).
template <bool EXPS, bool INTERLEAVED, bool SPLIT = false, bool TURNS = false, bool FOLD = false>
__device__ __forceinline__ void dkdv_like_step(float (&dk)[1][D / 8][4], float (&dv)[1][D / 8][4], uint64_t k_desc,
                                               uint64_t v_desc, uint64_t q_k, uint64_t do_k, uint64_t q_mn,
                                               uint64_t do_mn, int wg, float lse, float dl, float c,
                                               const FoldOperands* fold = nullptr) {
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
  } else if constexpr (FOLD) {  // S'^T = [K 1] [Q -lse/c]^T, dP'^T = [V 1] [dO -delta]^T
    folded_product(st[0], k_desc, wg * s90::WG_ROWS, q_k, fold->ones_lse, fold->desc);
  } else {
    s90::product_over_head_dim<T, D, KV_ROWS, QT>(st[0], k_desc, wg * s90::WG_ROWS, q_k);
  }
  if constexpr (FOLD) {
    folded_product(dpt[0], v_desc, wg * s90::WG_ROWS, do_k, fold->ones_dl, fold->desc);
  } else {
    s90::product_over_head_dim<T, D, KV_ROWS, QT>(dpt[0], v_desc, wg * s90::WG_ROWS, do_k);
  }
  if constexpr (TURNS) {
    if (wg == 0) turn_arrive<3>(); else turn_arrive<2>();
  }
  s90::wgmma_wait<SPLIT ? 2 : 1>();  // S^T (its first half) done
  const auto p_of = [&](float x) {
    if constexpr (FOLD) return exp2f(x * c);
    return EXPS ? exp2f(fmaf(x, c, -lse)) : fmaf(x, c, -lse) * 0.5f;
  };
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
      // Folded, dP'^T already holds dP^T - delta.
      const float sub = FOLD ? 0.f : dl;
      da[0][s][h] = sk::mul2<T>(pa[0][s][h], sk::pack2<T>(dpt[0][j][e0] - sub, dpt[0][j][e0 + 1] - sub));
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
                                              const float* dl_s, const T* ext_s, const sk::Params& p, int wg, int lane,
                                              float c, float& keep) {
  const uint64_t k_desc = s90::kmajor_tile<KV_ROWS>(Ks), v_desc = s90::kmajor_tile<KV_ROWS>(Vs);
  const uint64_t q_k = s90::kmajor_tile<QT>(Qs), do_k = s90::kmajor_tile<QT>(dOs);
  const uint64_t q_mn = s90::mnmajor_tile<T, QT>(Qs), do_mn = s90::mnmajor_tile<T, QT>(dOs);
  const float lse = 0.25f, dl = 0.125f;
  FoldOperands fold_ops;
  fold_ops.desc = sw32_desc(ext_s);
  fold_ones(fold_ops.ones_lse, FOLD_LSE_COL, lane);
  fold_ones(fold_ops.ones_dl, FOLD_DELTA_COL, lane);
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
    } else if constexpr (ROLE == fold || ROLE == fold_il) {
      dkdv_like_step<true, ROLE == fold_il, false, false, true>(dk, dv, k_desc, v_desc, q_k, do_k, q_mn, do_mn, wg, lse,
                                                                 dl, c, &fold_ops);
    } else if constexpr (ROLE == step_turns) {
      dkdv_like_step<true, false, false, true>(dk, dv, k_desc, v_desc, q_k, do_k, q_mn, do_mn, wg, lse, dl, c);
    } else if constexpr (ROLE == tile) {
      // The kernel's own step (no mask), lse and delta read from shared memory as it reads them.
      const s90::BoxWalk<QT> walk(p, 0, 0, 0, 0, 0);
      s90::dkdv_tile<T, D, KV_ROWS, QT, false, false>(dk, dv, k_desc, v_desc, Qs, dOs, lse_s, dl_s, walk, wg, 0, 0,
                                                      lane, nullptr, p);
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

// Row r of the fold's tile as the patch's producer writes it (fold_stats_row), the rest zeros.
__device__ inline void fill_ext_row(T* ext, int r, float lse_over_c, float delta) {
  *reinterpret_cast<uint4*>(ext + sw32_offset(r, 0)) = fold_stats_row(-lse_over_c, -delta);
  *reinterpret_cast<uint4*>(ext + sw32_offset(r, 8)) = make_uint4(0, 0, 0, 0);
}

// The fold's layout, checked: one warpgroup forms ones x ext^T for the lse columns and the delta
// columns (fold_ones) of a tile filled by fill_ext_row; out[which][row][col] for the host to
// compare with -lse / c and -delta.
__global__ void fold_layout_check(const float* lse_over_c, const float* delta, float* out) {
  __shared__ __align__(1024) T ext[QT * EXT_COLS];
  for (int i = threadIdx.x; i < QT; i += blockDim.x) fill_ext_row(ext, i, lse_over_c[i], delta[i]);
  s90::fence_proxy_async();
  __syncthreads();
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  for (int which = 0; which < 2; ++which) {
    float acc[NJ][4];
    uint32_t a[4];
    fold_ones(a, which == 0 ? FOLD_LSE_COL : FOLD_DELTA_COL, lane);
    s90::wgmma_fence();
    s90::wgmma_rs<T, QT>(acc, a, sw32_desc(ext), false);
    s90::wgmma_commit();
    s90::wgmma_wait<0>();
    for (int j = 0; j < NJ; ++j)
      for (int e = 0; e < 4; ++e) {
        const int row = 16 * warp + lane / 4 + 8 * (e / 2), col = 8 * j + 2 * (lane % 4) + e % 2;
        out[(which * 64 + row) * QT + col] = acc[j][e];
      }
  }
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
  T* ext_s = reinterpret_cast<T*>(dl_s + QT);  // [QT][EXT_COLS], 256-byte aligned (the tiles above are 1 KB each)
  for (int i = threadIdx.x; i < QT; i += THREADS) {
    lse_s[i] = 0.25f + 0.001f * i;
    dl_s[i] = 0.125f - 0.001f * i;
    fill_ext_row(ext_s, i, lse_s[i] / c, dl_s[i]);
  }
  // The four tiles from global memory as they lie: any bf16 values serve a timing, and the
  // descriptors read them in the swizzled layout the kernels use.
  for (int i = threadIdx.x; i < 4 * TILE; i += THREADS) Ks[i] = src[i];
  s90::fence_proxy_async();
  __syncthreads();
  const int wg = threadIdx.x / s90::WG_THREADS, lane = threadIdx.x % 32;
  float keep = 0.f;
  const long long t = wg == 0 ? run_role<ROLE0>(Ks, Vs, Qs, dOs, lse_s, dl_s, ext_s, p, wg, lane, c, keep)
                              : run_role<ROLE1>(Ks, Vs, Qs, dOs, lse_s, dl_s, ext_s, p, wg, lane, c, keep);
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
  {  // the fold's tile and descriptor, against the host's sums
    std::vector<float> lse_c(QT), dl(QT), out(2 * 64 * QT);
    for (int i = 0; i < QT; ++i) {
      lse_c[i] = (0.25f + 0.37f * i) / 0.18f;
      dl[i] = 0.125f - 0.0031f * i;
    }
    float *d_lse, *d_dl, *d_out;
    CHECK(cudaMalloc(&d_lse, QT * sizeof(float)));
    CHECK(cudaMalloc(&d_dl, QT * sizeof(float)));
    CHECK(cudaMalloc(&d_out, out.size() * sizeof(float)));
    CHECK(cudaMemcpy(d_lse, lse_c.data(), QT * sizeof(float), cudaMemcpyHostToDevice));
    CHECK(cudaMemcpy(d_dl, dl.data(), QT * sizeof(float), cudaMemcpyHostToDevice));
    fold_layout_check<<<1, s90::WG_THREADS>>>(d_lse, d_dl, d_out);
    CHECK(cudaGetLastError());
    CHECK(cudaMemcpy(out.data(), d_out, out.size() * sizeof(float), cudaMemcpyDeviceToHost));
    double worst[2] = {0, 0};
    for (int w = 0; w < 2; ++w)
      for (int r = 0; r < 64; ++r)
        for (int q = 0; q < QT; ++q) {
          const double want = w == 0 ? -lse_c[q] : -dl[q];
          const double err = std::fabs(out[(w * 64 + r) * QT + q] - want) / std::max(1.0, std::fabs(want));
          worst[w] = std::max(worst[w], err);
        }
    printf("{\"gpu\": \"%s\", \"fold_check\": {\"lse_rel_err\": %.3g, \"delta_rel_err\": %.3g}}\n", gpu,
           worst[0], worst[1]);
    if (worst[0] > 1e-6 || worst[1] > 1e-6) rc = 1;  // three bf16 terms: 24 bits of each value
  }
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
  rc |= run_pair<fold, idle>(sms, gpu, src, cycles, sink, p);
  rc |= run_pair<fold, fold>(sms, gpu, src, cycles, sink, p);
  rc |= run_pair<fold_il, idle>(sms, gpu, src, cycles, sink, p);
  rc |= run_pair<fold_il, fold_il>(sms, gpu, src, cycles, sink, p);
  rc |= run_pair<tile, idle>(sms, gpu, src, cycles, sink, p);
  rc |= run_pair<tile, tile>(sms, gpu, src, cycles, sink, p);
  return rc;
}
