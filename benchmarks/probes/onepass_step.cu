// Can a deterministic one-pass backward step at head dim 128 run faster than FA4's? (issue 44,
// docs/FA4.md, "What it would take")
//
// At Qwen2.5-3B (head dim 128) our two-pass backward runs the tensor pipe 86-93% busy and still
// trails FA4's one-pass backward: only a one-pass step can carry the 3B cases, and it must be
// deterministic. FA4's step (one KV block of 128 keys, 64 query rows, five products) takes about
// 3,690 cycles an SM in its kernel (69.3% of the tensor pipe at 3B 64K 25%, one H100); our two
// passes take 2,428 + 1,678 = 4,106 for the same work. The five products alone take 2,560.
//
// This probe takes the one-pass step out of any kernel, as pipe_overlap.cu did for dK/dV's: one
// CTA of two warpgroups per SM (the step's two consumers, 64 keys each), operands already in
// shared memory, no producer, and counts cycles per step with clock64 (the power cap's clock does
// not enter). Each role adds one piece to the last:
//   dkdv        S^T = K Q^T, dP^T = V dO^T, P and dS, dV += P^T dO, dK += dS^T Q: our dK/dV step
//               at 64 query rows (lse and delta read from shared memory early, as dkdv_tile does)
//   dq_f32      + dS^T to shared memory, the two warpgroups' barrier, dQ = dS K (each warpgroup
//               64 of the head dim's 128 columns), dQ's fp32 values stored to shared memory in
//               register order (FA4's layout): the one-pass step's work
//   red_f32     + a bulk reduce-add (cp.reduce.async.bulk add.f32) of each warpgroup's 16 KB into
//               global memory, double-buffered: FA4's non-deterministic dQ
//   red_i32cvt  the values scaled to int32 fixed point by cvt.rni (the exponentials' pipe) and
//               added as s32: deterministic
//   red_i32fma  the same with the split conversion of fixed_point_convert.cu (four fp32 adds and
//               two integer operations): deterministic, off the exponentials' pipe
//   red_i32fma_dq_first  the same with dQ's product issued before dK's, so that dQ's conversion
//               and store run while dK's product does (the order of issue 44's third fused build)
// The roles above make both warpgroups meet at a barrier every step (dQ's product reads both
// warpgroups' keys of dS^T), which keeps them from running out of phase, where one warpgroup's
// exponentials overlap the other's products as in dK/dV's step. The own-keys roles drop that
// barrier: each warpgroup forms dQ over its own 64 keys only, all 128 columns in two products of
// 64, and reduce-adds both partials (twice the adds, into the same slots as the other warpgroup's):
//   own_f32     in fp32, dQ's first half issued before dK's product (non-deterministic)
//   own_i32fma  in int32 by the split conversion, the same order (deterministic: integer adds
//               give one sum in any order)
//   own_i32fma_dk_first  the same with dK's product issued before dQ's
// The FA4-order roles take FA4's SM90 step as flash-attn-4 4.0.0b36 orders it (flash_bwd_sm90.py,
// read): dP^T waited for before dV's product is issued, dS^T stored, both warpgroups' barrier,
// dQ's product, then dK's, and dQ's values handed to a writer warp of a third warpgroup (named
// barriers, one buffer per warpgroup), which issues the reduce-adds; 384 threads, setmaxnreg
// giving the consumers 240 registers as a kernel with a producer would:
//   fa4_f32     fp32 adds: FA4's step, the calibration against its in-kernel 3,690 cycles
//   fa4_i32cvt  int32 fixed point by cvt.rni: deterministic
//   fa4_i32fma  int32 fixed point by the split conversion: deterministic
// The reduce-adds go to `targets` 16 KB slots per warpgroup in turn: 1 keeps them in L2, 64 spreads
// them over 270 MB (132 SMs) as a long sequence's dQ is spread. First, the layouts of dQ's product
// (dS^T stored from A fragments, both operands read transposed) are checked against the host.
// Build and run on the GPU machine (the flags of setup.py's build):
//   nvcc -O3 -std=c++17 --use_fast_math --expt-relaxed-constexpr -gencode=arch=compute_90a,code=sm_90a
//   -Icsrc -o /tmp/onepass_step benchmarks/probes/onepass_step.cu && /tmp/onepass_step
// Prints one JSON object per line.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <vector>
#include <cuda_runtime.h>

#include "cuda/attention_kernels_sm90.cuh"
#include "cuda_check.h"
#include "fixed_point.cuh"
#include "random_bf16.h"

namespace sk = sparsebalance::kernels;
namespace s90 = sparsebalance::kernels::sm90;
using T = __nv_bfloat16;

constexpr int D = 128, QT = 64, KV_ROWS = 128, NJ = QT / 8, THREADS = 2 * s90::WG_THREADS;
constexpr int DQ_COLS = D / 2;                     // each warpgroup's columns of dQ
constexpr int DQ_VALUES = QT * DQ_COLS;            // a warpgroup's dQ values a step (4,096: 16 KB)
constexpr int WARMUP = 8, ITERS = 256;
enum Role {
  dkdv, dq_f32, red_f32, red_i32cvt, red_i32fma, red_i32fma_dq_first, own_f32, own_i32fma, own_i32fma_dk_first,
  fa4_f32, fa4_i32cvt, fa4_i32fma, ROLES
};
const char* const ROLE_NAMES[ROLES] = {
    "dkdv",    "dq_f32",     "red_f32",    "red_i32cvt", "red_i32fma", "red_i32fma_dq_first", "own_f32", "own_i32fma",
    "own_i32fma_dk_first", "fa4_f32", "fa4_i32cvt", "fa4_i32fma"};
// How a role adds dQ: in int32 fixed point (else fp32), converted by cvt.rni (else by the split).
constexpr bool adds_fixed(int role) { return role != red_f32 && role != own_f32 && role != fa4_f32; }
constexpr bool converts_by_cvt(int role) { return role == red_i32cvt || role == fa4_i32cvt; }
// The FA4-order roles run a third warpgroup, whose first warp issues the adds.
constexpr bool has_writer(int role) { return role >= fa4_f32; }
constexpr int threads_of(int role) { return has_writer(role) ? 3 * s90::WG_THREADS : THREADS; }
constexpr int WRITER_REGS = 24, CONSUMER_REGS = 240;
static_assert(s90::fits_register_pool(WRITER_REGS, CONSUMER_REGS, 2), "register pool");

// Shared memory: K and V (128 keys x 128), Q and dO (64 rows x 128), two dS^T buffers (128 keys x
// 64 queries; FA4 keeps two as well), two 16 KB dQ buffers per warpgroup, lse and delta: 192 KB and
// 512 bytes, each tile 1024-aligned.
constexpr int KV_TILE = KV_ROWS * D, Q_TILE = QT * D, DS_TILE = KV_ROWS * QT;
constexpr size_t SMEM = 1024 + 2 * KV_TILE * 2 + 2 * Q_TILE * 2 + 2 * DS_TILE * 2 + 4 * DQ_VALUES * 4 + 2 * QT * 4;

// d (+)= A B with both operands MN-major in shared memory (A read transposed: dS from dS^T; B
// read transposed: K's head-dim columns), m64n64k16 bf16. wgmma.cuh has the K-major A form only.
__device__ __forceinline__ void wgmma_ss_tt64(float (&d)[8][4], uint64_t desc_a, uint64_t desc_b, bool accumulate) {
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, %34, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, "
      "%12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31}, %32, "
      "%33, p, 1, 1, 1, 1;\n}\n"
      : "+f"(d[0][0]), "+f"(d[0][1]), "+f"(d[0][2]), "+f"(d[0][3]), "+f"(d[1][0]), "+f"(d[1][1]), "+f"(d[1][2]),
        "+f"(d[1][3]), "+f"(d[2][0]), "+f"(d[2][1]), "+f"(d[2][2]), "+f"(d[2][3]), "+f"(d[3][0]), "+f"(d[3][1]),
        "+f"(d[3][2]), "+f"(d[3][3]), "+f"(d[4][0]), "+f"(d[4][1]), "+f"(d[4][2]), "+f"(d[4][3]), "+f"(d[5][0]),
        "+f"(d[5][1]), "+f"(d[5][2]), "+f"(d[5][3]), "+f"(d[6][0]), "+f"(d[6][1]), "+f"(d[6][2]), "+f"(d[6][3]),
        "+f"(d[7][0]), "+f"(d[7][1]), "+f"(d[7][2]), "+f"(d[7][3])
      : "l"(desc_a), "l"(desc_b), "r"(int(accumulate)));
}

// A warpgroup's own barrier (named barriers 2 and 3; 1 is consumer_barrier's, 0 __syncthreads').
__device__ __forceinline__ void own_barrier(int wg) { asm volatile("bar.sync %0, 128;\n" ::"r"(2 + wg) : "memory"); }
// A consumer warpgroup and the writer warp: barriers 4 + wg ("full": its dQ values are in its
// buffer) and 6 + wg ("empty": the writer's last add from that buffer has read it).
constexpr int WRITER_PAIR = s90::WG_THREADS + 32;
__device__ __forceinline__ int dq_full(int wg) { return 4 + wg; }
__device__ __forceinline__ int dq_empty(int wg) { return 6 + wg; }
__device__ __forceinline__ void named_sync(int id) { asm volatile("bar.sync %0, %1;\n" ::"r"(id), "n"(WRITER_PAIR) : "memory"); }
__device__ __forceinline__ void named_arrive(int id) {
  asm volatile("bar.arrive %0, %1;\n" ::"r"(id), "n"(WRITER_PAIR) : "memory");
}

struct Tiles {
  T *Ks, *Vs, *Qs, *dOs, *dSs;  // dSs: [buffer][DS_TILE]
  float *dq, *lse, *dl;          // dq: [wg][buffer][DQ_VALUES]
};

// dS^T to shared memory: this lane's keys (rows) 16 w + lane / 4 (+ 8) of its warpgroup's 64, its
// queries (columns) 16 s + 2 (lane % 4) (+ 8), two 16-bit values a word (to_a_frags' order).
__device__ __forceinline__ void store_ds_t(T* dSs, const uint32_t (&da)[1][QT / 16][4], int wg, int lane) {
  const int key0 = wg * s90::WG_ROWS + 16 * s90::warp_in_warpgroup() + lane / 4, q0 = 2 * (lane % 4);
#pragma unroll
  for (int s = 0; s < QT / 16; ++s)
#pragma unroll
    for (int h = 0; h < 4; ++h)
      *reinterpret_cast<uint32_t*>(dSs + s90::sw128_offset<KV_ROWS>(key0 + 8 * (h % 2), 16 * s + q0 + 8 * (h / 2))) =
          da[0][s][h];
}

// dQ[:, 64 half + (0..64)] (+)= dS[:, keys] K[keys, 64 half + (0..64)] over KEYS keys from key0:
// A = dS (queries x keys) read from dS^T, B = K's columns, both read transposed; committed (not
// waited for). `accumulate` false starts from zero.
template <int KEYS>
__device__ __forceinline__ void dq_product(float (&dq)[8][4], const T* dSs, const T* Ks, int half, int key0,
                                           bool accumulate) {
  const uint64_t ds_mn = s90::mnmajor_tile<T, KV_ROWS>(dSs);
  const uint64_t k_mn = s90::desc_at<T>(s90::mnmajor_tile<T, KV_ROWS>(Ks), half * KV_ROWS * s90::SW_COLS);
  s90::wgmma_fence();
#pragma unroll
  for (int k = key0; k < key0 + KEYS; k += 16)
    wgmma_ss_tt64(dq, s90::mnmajor_at<T>(ds_mn, k), s90::mnmajor_at<T>(k_mn, k), accumulate || k > key0);
  s90::wgmma_commit();
}

// A warpgroup's dQ values (one product's 64 rows x 64 columns) to its shared buffer dq_s in
// register order, 16-byte vectors (vector i of thread x at (i * 128 + x) * 16 bytes), as int32
// fixed point where ROLE adds so.
template <int ROLE>
__device__ __forceinline__ void dq_to_smem(const float (&dq)[8][4], float* dq_s, float unit) {
  const int x = threadIdx.x % s90::WG_THREADS;
#pragma unroll
  for (int i = 0; i < 8; ++i) {
    float4 v = make_float4(dq[i][0], dq[i][1], dq[i][2], dq[i][3]);
    if constexpr (ROLE != dq_f32 && adds_fixed(ROLE)) {
      // One fixed-point unit here; a kernel holds one per query row (two a thread), the same
      // multiply a value.
      const auto fixed = [&](float y) {
        return __int_as_float(converts_by_cvt(ROLE) ? fixed_cvt(y * unit) : fixed_split(y * unit));
      };
      v = make_float4(fixed(v.x), fixed(v.y), fixed(v.z), fixed(v.w));
    }
    reinterpret_cast<float4*>(dq_s)[i * s90::WG_THREADS + x] = v;
  }
}

// One bulk reduce-add of a 16 KB dQ buffer into dst (one thread issues it), committed.
template <int ROLE>
__device__ __forceinline__ void bulk_add(float* dst, const float* dq_s) {
  bulk_reduce_add<adds_fixed(ROLE)>(dst, sk::smem_u32(dq_s), DQ_VALUES * 4);
}

// dQ_s staged and (roles past dq_f32) added by the warpgroup's first thread; the buffer's add
// issued two adds ago must have read it first.
template <int ROLE>
__device__ __forceinline__ void stage_and_add(const float (&dq)[8][4], float* dq_s, float* dst, float unit) {
  constexpr bool ADD = ROLE != dq_f32;
  const int wg = s90::warpgroup_index();
  const bool issuer = threadIdx.x % s90::WG_THREADS == 0;
  if constexpr (ADD) {
    if (issuer) asm volatile("cp.async.bulk.wait_group.read 1;\n" ::: "memory");
    own_barrier(wg);
  }
  dq_to_smem<ROLE>(dq, dq_s, unit);
  if constexpr (ADD) {
    s90::fence_proxy_async();
    own_barrier(wg);
    if (issuer) bulk_add<ROLE>(dst, dq_s);
  }
}

// The slot a warpgroup's dQ adds into at step `it`: its own, in turn over `targets` slots.
__device__ __forceinline__ float* dq_slot(float* dq_global, int wg, int it, int targets) {
  return dq_global + ((size_t)(blockIdx.x * 2 + wg) * targets + it % targets) * DQ_VALUES;
}

template <int ROLE>
__device__ __forceinline__ void onepass_step(float (&dk)[1][D / 8][4], float (&dv)[1][D / 8][4], const Tiles& t,
                                             float* dq_global, int it, int targets, int wg, int lane, float c,
                                             float unit) {
  const uint64_t k_desc = s90::kmajor_tile<KV_ROWS>(t.Ks), v_desc = s90::kmajor_tile<KV_ROWS>(t.Vs);
  const uint64_t q_k = s90::kmajor_tile<QT>(t.Qs), do_k = s90::kmajor_tile<QT>(t.dOs);
  const uint64_t q_mn = s90::mnmajor_tile<T, QT>(t.Qs), do_mn = s90::mnmajor_tile<T, QT>(t.dOs);
  const auto stat_pair = [&](const float* stat, int j) {
    return *reinterpret_cast<const float2*>(stat + 8 * j + 2 * (lane % 4));
  };
  float st[1][NJ][4], dpt[1][NJ][4];
  float2 lse_r[NJ], dl_r[NJ];
#pragma unroll
  for (int j = 0; j < NJ; ++j) lse_r[j] = stat_pair(t.lse, j);
  s90::wgmma_fence();
  s90::product_over_head_dim<T, D, KV_ROWS, QT>(st[0], k_desc, wg * s90::WG_ROWS, q_k);
  s90::product_over_head_dim<T, D, KV_ROWS, QT>(dpt[0], v_desc, wg * s90::WG_ROWS, do_k);
  s90::wgmma_wait<1>();  // S^T done
#pragma unroll
  for (int j = 0; j < NJ; ++j)
#pragma unroll
    for (int e = 0; e < 4; ++e) st[0][j][e] = exp2f(fmaf(st[0][j][e], c, -(e & 1 ? lse_r[j].y : lse_r[j].x)));
  uint32_t pa[1][QT / 16][4];
  sk::to_a_frags<T, 1, QT>(pa, st);
  constexpr bool FA4_ORDER = has_writer(ROLE);
  // acc += frags^T B over the tile's queries (dV's product from P^T and dO, dK's from dS^T and Q),
  // B read transposed; one committed group.
  const auto gradient_product = [](float(&acc)[D / 8][4], const uint32_t(&frags)[QT / 16][4], uint64_t b_mn) {
    s90::wgmma_fence();
#pragma unroll
    for (int s = 0; s < QT / 16; ++s) s90::wgmma_rs_tb<T, D>(acc, frags[s], s90::mnmajor_at<T>(b_mn, 16 * s), true);
    s90::wgmma_commit();
  };
  const auto dv_product = [&] { gradient_product(dv[0], pa[0], do_mn); };
  if constexpr (!FA4_ORDER) dv_product();
#pragma unroll
  for (int j = 0; j < NJ; ++j) dl_r[j] = stat_pair(t.dl, j);
  s90::wgmma_wait<FA4_ORDER ? 0 : 1>();  // dP^T done
  uint32_t da[1][QT / 16][4];
#pragma unroll
  for (int s = 0; s < QT / 16; ++s)
#pragma unroll
    for (int h = 0; h < 4; ++h) {  // dS^T = P^T (dP^T - delta), in A fragments (to_a_frags' order)
      const int j = 2 * s + h / 2, e0 = 2 * (h % 2);
      da[0][s][h] = sk::pack2<T>(st[0][j][e0] * (dpt[0][j][e0] - dl_r[j].x),
                                 st[0][j][e0 + 1] * (dpt[0][j][e0 + 1] - dl_r[j].y));
    }
  constexpr bool DQ_FIRST = ROLE == red_i32fma_dq_first || ROLE == own_f32 || ROLE == own_i32fma || FA4_ORDER;
  constexpr bool OWN_KEYS = ROLE >= own_f32;
  const auto dk_product = [&] { gradient_product(dk[0], da[0], q_mn); };
  if constexpr (!DQ_FIRST) dk_product();
  if constexpr (ROLE == dkdv) {
    s90::wgmma_wait<0>();
  } else if constexpr (FA4_ORDER) {
    T* dSs = t.dSs + (it & 1) * DS_TILE;
    store_ds_t(dSs, da, wg, lane);
    dv_product();
    s90::fence_proxy_async();
    s90::consumer_barrier();  // both warpgroups' keys are in dS^T
    float dq[8][4];
    dq_product<KV_ROWS>(dq, dSs, t.Ks, wg, 0, false);
    s90::wgmma_wait<1>();  // dV's product done
    dk_product();
    s90::wgmma_wait<1>();  // dQ's product done; dK's runs on
    named_sync(dq_empty(wg));
    dq_to_smem<ROLE>(dq, t.dq + wg * DQ_VALUES, unit);
    s90::fence_proxy_async();
    named_arrive(dq_full(wg));
    s90::wgmma_wait<0>();
  } else if constexpr (OWN_KEYS) {
    // Only this warpgroup reads its keys of dS^T, and it has waited for its last step's dQ
    // products before writing them again: one buffer, the warpgroup's own barrier.
    store_ds_t(t.dSs, da, wg, lane);
    s90::fence_proxy_async();
    own_barrier(wg);
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      float dq[8][4];
      dq_product<s90::WG_ROWS>(dq, t.dSs, t.Ks, half, wg * s90::WG_ROWS, false);
      if (DQ_FIRST && half == 0) {
        dk_product();
        s90::wgmma_wait<1>();  // dQ's first half done; dK's product runs on
      } else {
        s90::wgmma_wait<0>();
      }
      // Both warpgroups add into the slot of this column half of the step's query tile.
      stage_and_add<ROLE>(dq, t.dq + (wg * 2 + half) * DQ_VALUES, dq_slot(dq_global, half, it, targets), unit);
    }
  } else {
    const int buffer = it & 1;
    T* dSs = t.dSs + buffer * DS_TILE;
    store_ds_t(dSs, da, wg, lane);
    s90::fence_proxy_async();
    s90::consumer_barrier();  // both warpgroups' keys are in dS^T
    float dq[8][4];
    dq_product<KV_ROWS>(dq, dSs, t.Ks, wg, 0, false);
    if constexpr (DQ_FIRST) {
      dk_product();
      s90::wgmma_wait<1>();  // dQ's product done; dK's runs on
    } else {
      s90::wgmma_wait<0>();  // dK's and dQ's products done
    }
    // dS^T's other buffer is written next step, after its barrier: both warpgroups have then
    // finished this step's products, which read this buffer.
    stage_and_add<ROLE>(dq, t.dq + (wg * 2 + buffer) * DQ_VALUES, dq_slot(dq_global, wg, it, targets), unit);
    if constexpr (DQ_FIRST) s90::wgmma_wait<0>();  // dK's product, before the next step's
  }
}

// The tiles in shared memory, filled by all threads: K, V, Q and dO from global memory as they
// lie (any bf16 values serve a timing, and the descriptors read them in the swizzled layout the
// kernels use), lse and delta of a few units.
__device__ Tiles fill_tiles(unsigned char* smem_raw, const T* src) {
  unsigned char* base = smem_raw + ((1024 - sk::smem_u32(smem_raw) % 1024) % 1024);
  Tiles t;
  t.Ks = reinterpret_cast<T*>(base);
  t.Vs = t.Ks + KV_TILE;
  t.Qs = t.Vs + KV_TILE;
  t.dOs = t.Qs + Q_TILE;
  t.dSs = t.dOs + Q_TILE;
  t.dq = reinterpret_cast<float*>(t.dSs + 2 * DS_TILE);
  t.lse = t.dq + 4 * DQ_VALUES;
  t.dl = t.lse + QT;
  for (int i = threadIdx.x; i < 2 * KV_TILE + 2 * Q_TILE; i += blockDim.x) t.Ks[i] = src[i];
  for (int i = threadIdx.x; i < QT; i += blockDim.x) {
    t.lse[i] = 0.25f + 0.001f * i;
    t.dl[i] = 0.125f - 0.001f * i;
  }
  s90::fence_proxy_async();
  __syncthreads();
  return t;
}

// A consumer warpgroup's steps, timed from the end of the warm-up; dK and dV kept alive in sink.
template <int ROLE>
__device__ void consume(const Tiles& t, int wg, float c, float unit, int targets, float* dq_global, long long* cycles,
                        float* sink) {
  const int lane = threadIdx.x % 32;
  float dk[1][D / 8][4], dv[1][D / 8][4];
  sk::zero(dk);
  sk::zero(dv);
  long long t0 = 0;
  for (int it = 0; it < WARMUP + ITERS; ++it) {
    if (it == WARMUP) t0 = clock64();
    onepass_step<ROLE>(dk, dv, t, dq_global, it, targets, wg, lane, c, unit);
  }
  const long long t1 = clock64();
  const bool first = threadIdx.x % s90::WG_THREADS == 0;
  if (!has_writer(ROLE) && first) asm volatile("cp.async.bulk.wait_group 0;\n" ::: "memory");
  float keep = 0.f;
#pragma unroll
  for (int j = 0; j < D / 8; ++j)
#pragma unroll
    for (int e = 0; e < 4; ++e) keep += dk[0][j][e] + dv[0][j][e];
  sink[blockIdx.x * blockDim.x + threadIdx.x] = keep;
  if (first) cycles[blockIdx.x * 2 + wg] = t1 - t0;
}

// The writer warp of the FA4-order roles: each step, each warpgroup's buffer handed back once
// the add before has read it, then its add issued once the warpgroup has filled it (FA4's
// dQaccum_store order).
template <int ROLE>
__device__ void write_dq(const Tiles& t, int targets, float* dq_global) {
  const bool issuer = threadIdx.x == 0;
  for (int it = 0; it < WARMUP + ITERS; ++it) {
    if (issuer) asm volatile("cp.async.bulk.wait_group.read 1;\n" ::: "memory");
    __syncwarp();
    named_arrive(dq_empty(0));
    if (issuer) asm volatile("cp.async.bulk.wait_group.read 0;\n" ::: "memory");
    __syncwarp();
    named_arrive(dq_empty(1));
#pragma unroll
    for (int wg = 0; wg < 2; ++wg) {
      named_sync(dq_full(wg));
      if (issuer) bulk_add<ROLE>(dq_slot(dq_global, wg, it, targets), t.dq + wg * DQ_VALUES);
    }
  }
  if (issuer) asm volatile("cp.async.bulk.wait_group 0;\n" ::: "memory");
}

template <int ROLE>
__global__ void __launch_bounds__(threads_of(ROLE), 1) step_kernel(const T* src, float c, float unit, int targets,
                                                                   float* dq_global, long long* cycles, float* sink) {
  extern __shared__ unsigned char smem_raw[];
  const Tiles t = fill_tiles(smem_raw, src);
  if constexpr (has_writer(ROLE)) {
    if (threadIdx.x < s90::WG_THREADS) {
      s90::regs_dec<WRITER_REGS>();
      if (threadIdx.x < 32) write_dq<ROLE>(t, targets, dq_global);
    } else {
      s90::regs_inc<CONSUMER_REGS>();
      consume<ROLE>(t, s90::warpgroup_index() - 1, c, unit, targets, dq_global, cycles, sink);
    }
  } else {
    consume<ROLE>(t, s90::warpgroup_index(), c, unit, targets, dq_global, cycles, sink);
  }
}

// The dQ product's layouts, checked before any timing: dS^T stored from A fragments as the step
// stores them, dQ = dS K by the two transposed reads, written out by the accumulator's layout,
// against the host's product of the same values (a kernel built on this step needs them right).
__global__ void __launch_bounds__(THREADS, 1) dq_layout_kernel(const T* ds /* [QT][KV_ROWS] */,
                                                               const T* k /* [KV_ROWS][D] */, float* dq_out) {
  extern __shared__ unsigned char smem_raw[];
  T* Ks = reinterpret_cast<T*>(smem_raw + ((1024 - sk::smem_u32(smem_raw) % 1024) % 1024));
  T* dSs = Ks + KV_TILE;
  for (int i = threadIdx.x; i < KV_TILE; i += THREADS) Ks[s90::sw128_offset<KV_ROWS>(i / D, i % D)] = k[i];
  const int wg = s90::warpgroup_index(), lane = threadIdx.x % 32, w = s90::warp_in_warpgroup();
  const int key0 = wg * s90::WG_ROWS + 16 * w + lane / 4, q0 = 2 * (lane % 4);
  uint32_t da[1][QT / 16][4];
#pragma unroll
  for (int s = 0; s < QT / 16; ++s)
#pragma unroll
    for (int h = 0; h < 4; ++h) {  // this word's key and its two queries, as store_ds_t reads them
      const int key = key0 + 8 * (h % 2), q = 16 * s + q0 + 8 * (h / 2);
      da[0][s][h] = sk::pack2<T>(__bfloat162float(ds[q * KV_ROWS + key]), __bfloat162float(ds[(q + 1) * KV_ROWS + key]));
    }
  store_ds_t(dSs, da, wg, lane);
  s90::fence_proxy_async();
  __syncthreads();
  float dq[8][4];  // over the keys in two products, as the own-keys roles split them
  dq_product<s90::WG_ROWS>(dq, dSs, Ks, wg, 0, false);
  dq_product<s90::WG_ROWS>(dq, dSs, Ks, wg, s90::WG_ROWS, true);
  s90::wgmma_wait<0>();
#pragma unroll
  for (int j = 0; j < 8; ++j)
#pragma unroll
    for (int e = 0; e < 4; ++e)
      dq_out[(16 * w + lane / 4 + 8 * (e / 2)) * D + wg * DQ_COLS + 8 * j + 2 * (lane % 4) + e % 2] = dq[j][e];
}

int check_dq_layout(const char* gpu, const std::vector<T>& host_k) {
  const std::vector<T> host_ds = uniform_bf16(QT * KV_ROWS, 777, 1.f);
  std::vector<float> ref(QT * D, 0.f), got(QT * D);
  for (int q = 0; q < QT; ++q)
    for (int key = 0; key < KV_ROWS; ++key)
      for (int d = 0; d < D; ++d)
        ref[q * D + d] += __bfloat162float(host_ds[q * KV_ROWS + key]) * __bfloat162float(host_k[key * D + d]);
  T *ds, *k;
  float* out;
  CHECK(cudaMalloc(&ds, host_ds.size() * sizeof(T)));
  CHECK(cudaMalloc(&k, KV_TILE * sizeof(T)));
  CHECK(cudaMalloc(&out, got.size() * sizeof(float)));
  CHECK(cudaMemcpy(ds, host_ds.data(), host_ds.size() * sizeof(T), cudaMemcpyHostToDevice));
  CHECK(cudaMemcpy(k, host_k.data(), KV_TILE * sizeof(T), cudaMemcpyHostToDevice));
  const int smem = 1024 + (KV_TILE + DS_TILE) * 2;
  CHECK(cudaFuncSetAttribute(dq_layout_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem));
  dq_layout_kernel<<<1, THREADS, smem>>>(ds, k, out);
  CHECK(cudaGetLastError());
  CHECK(cudaDeviceSynchronize());
  CHECK(cudaMemcpy(got.data(), out, got.size() * sizeof(float), cudaMemcpyDeviceToHost));
  double err = 0, scale = 0;
  for (size_t i = 0; i < ref.size(); ++i) {
    err = std::max(err, (double)std::fabs(got[i] - ref[i]));
    scale = std::max(scale, (double)std::fabs(ref[i]));
  }
  const bool ok = err <= 1e-4 * scale;
  printf("{\"gpu\": \"%s\", \"check\": \"dq_layout\", \"max_abs_err\": %.3g, \"max_abs\": %.3g, \"ok\": %s}\n", gpu, err,
         scale, ok ? "true" : "false");
  return ok ? 0 : 1;
}

template <int ROLE>
int run_role(int sms, const char* gpu, const T* src, int targets, float* dq_global, long long* cycles, float* sink) {
  CHECK(cudaFuncSetAttribute(step_kernel<ROLE>, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)SMEM));
  for (int rep = 0; rep < 2; ++rep)  // the second launch is reported
    step_kernel<ROLE><<<sms, threads_of(ROLE), SMEM>>>(src, 0.18f, 1048576.f, targets, dq_global, cycles, sink);
  CHECK(cudaGetLastError());
  CHECK(cudaDeviceSynchronize());
  std::vector<long long> c(2 * sms);
  CHECK(cudaMemcpy(c.data(), cycles, c.size() * sizeof(long long), cudaMemcpyDeviceToHost));
  double per = 0, worst = 0;
  for (long long x : c) {
    per += (double)x / ITERS / c.size();
    worst = std::max(worst, (double)x / ITERS);
  }
  // The products a step: S^T, dP^T, dV, dK (and dQ) of 128 keys x 64 queries x 128, at 4,096 FLOP
  // per cycle and SM.
  const double ideal = (ROLE == dkdv ? 4 : 5) * 2.0 * KV_ROWS * QT * D / 4096;
  printf("{\"gpu\": \"%s\", \"role\": \"%s\", \"targets\": %d, \"cycles_per_step\": %.1f, \"slowest_warpgroup\": %.1f, "
         "\"products_ideal\": %.0f, \"tensor_share\": %.3f}\n",
         gpu, ROLE_NAMES[ROLE], ROLE >= red_f32 ? targets : 0, per, worst, ideal, ideal / per);
  return 0;
}

int main() {
  int sms = 0;
  CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));
  cudaDeviceProp prop;
  CHECK(cudaGetDeviceProperties(&prop, 0));
  // Uniform in [-0.25, 0.25): scores of a few units, as a real step's.
  const std::vector<T> host = uniform_bf16(2 * KV_TILE + 2 * Q_TILE, 12345, 0.5f);
  constexpr int MAX_TARGETS = 64;
  T* src;
  float *dq_global, *sink;
  long long* cycles;
  CHECK(cudaMalloc(&src, host.size() * sizeof(T)));
  CHECK(cudaMalloc(&dq_global, (size_t)sms * 2 * MAX_TARGETS * DQ_VALUES * sizeof(float)));
  CHECK(cudaMemset(dq_global, 0, (size_t)sms * 2 * MAX_TARGETS * DQ_VALUES * sizeof(float)));
  CHECK(cudaMalloc(&cycles, 2 * sms * sizeof(long long)));
  CHECK(cudaMalloc(&sink, (size_t)sms * threads_of(fa4_f32) * sizeof(float)));
  CHECK(cudaMemcpy(src, host.data(), host.size() * sizeof(T), cudaMemcpyHostToDevice));
  const char* gpu = prop.name;
  int rc = check_dq_layout(gpu, std::vector<T>(host.begin(), host.begin() + KV_TILE));  // K: the tiles' first
  rc |= run_role<dkdv>(sms, gpu, src, 1, dq_global, cycles, sink);
  rc |= run_role<dq_f32>(sms, gpu, src, 1, dq_global, cycles, sink);
  for (int targets : {1, MAX_TARGETS}) {
    rc |= run_role<red_f32>(sms, gpu, src, targets, dq_global, cycles, sink);
    rc |= run_role<red_i32cvt>(sms, gpu, src, targets, dq_global, cycles, sink);
    rc |= run_role<red_i32fma>(sms, gpu, src, targets, dq_global, cycles, sink);
    rc |= run_role<red_i32fma_dq_first>(sms, gpu, src, targets, dq_global, cycles, sink);
    rc |= run_role<own_f32>(sms, gpu, src, targets, dq_global, cycles, sink);
    rc |= run_role<own_i32fma>(sms, gpu, src, targets, dq_global, cycles, sink);
    rc |= run_role<own_i32fma_dk_first>(sms, gpu, src, targets, dq_global, cycles, sink);
    rc |= run_role<fa4_f32>(sms, gpu, src, targets, dq_global, cycles, sink);
    rc |= run_role<fa4_i32cvt>(sms, gpu, src, targets, dq_global, cycles, sink);
    rc |= run_role<fa4_i32fma>(sms, gpu, src, targets, dq_global, cycles, sink);
  }
  return rc;
}
