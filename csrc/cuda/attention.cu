// Block-sparse causal attention (DESIGN.md §2) in CUDA C++: forward, and a backward without
// atomics (deterministic by construction), on the tensor cores through WMMA (mma.sync).
//
// Same structure as the Triton kernels (megatron_sparsebalance/ops/triton_attention.py):
// * Rows of a query tile are (token, head) pairs of ONE KV-head group, token-major
//   (row r of a query block: token r / R, head g*R + r % R, R = HQ / G), so each K/V chunk a CTA
//   stages in shared memory serves every query head of the group.
// * Off-diagonal selected blocks are full and fully visible: no masks. The diagonal block (last
//   entry of a kv_idx row; first entry of a transposed row) is causal and may be partial.
// * Backward: dK/dV per (KV chunk, group) walking the transposed CSR (q_ptr, q_idx); dQ per
//   (query tile, group) walking kv_idx. Each output element is written by one CTA.
//
// One CTA = 4 warps; warp w owns 16 rows of every 64-row tile. Scores go through shared memory
// (WMMA fragments are opaque), where each warp runs the softmax of its own rows, so inside the
// inner loop only __syncwarp is needed; __syncthreads guards the tiles all warps share.
//
// Shapes: q, o, dq [T, HQ, D]; k, v, dk, dv [T, G, D]; lse, delta [T, HQ] float32 (lse in base 2
// of the scaled scores); kv_idx [G, NB, K] int32 (-1 padded); kv_cnt [G, NB]; block_start,
// block_end [NB]; q_ptr [G*NB+1]; q_idx [>= q_ptr[-1]].
#include <torch/extension.h>

#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <mma.h>

#include "cuda/bindings.h"

namespace sparsebalance {
namespace {

using namespace nvcuda;

constexpr int BM = 64;  // rows of a query tile
constexpr int BN = 64;  // keys of a K/V chunk
constexpr int NTHREADS = 128;
constexpr int PAD = 8;  // 16 bytes of padding per 16-bit row: spreads rows over banks
constexpr float LOG2E = 1.4426950408889634f;

template <typename T>
__device__ __forceinline__ float to_f(T x);
template <>
__device__ __forceinline__ float to_f<__nv_bfloat16>(__nv_bfloat16 x) { return __bfloat162float(x); }
template <>
__device__ __forceinline__ float to_f<__half>(__half x) { return __half2float(x); }
template <typename T>
__device__ __forceinline__ T from_f(float x);
template <>
__device__ __forceinline__ __nv_bfloat16 from_f<__nv_bfloat16>(float x) { return __float2bfloat16(x); }
template <>
__device__ __forceinline__ __half from_f<__half>(float x) { return __float2half(x); }

struct Params {
  const void* q;
  const void* k;
  const void* v;
  const void* o;
  const void* dout;
  void* out;
  void* dq;
  void* dk;
  void* dv;
  float* lse;
  float* delta;
  const int* kv_idx;
  const int* kv_cnt;
  const int* bstart;
  const int* bend;
  const int* q_ptr;
  const int* q_idx;
  int NB, KMAX, R, HQ, G, block, tpb;
  float scale, scale_log2;
};

// Copies rows of packed query rows [row0, row0 + BM) of a block starting at token q0 into
// shared memory (ld = D + PAD); rows past nrows are zero.
template <typename T, int D>
__device__ __forceinline__ void load_q_rows(T* dst, const T* src, int q0, int row0, int nrows, int R, int g,
                                            int HQ) {
  constexpr int VEC = 8;  // 16-byte vectors
  constexpr int LD = D + PAD;
  for (int i = threadIdx.x; i < BM * (D / VEC); i += NTHREADS) {
    const int r = i / (D / VEC), c = (i % (D / VEC)) * VEC;
    const int gr = row0 + r;
    uint4 val = make_uint4(0, 0, 0, 0);
    if (gr < nrows) {
      const int tok = gr / R, head = g * R + gr % R;
      val = *reinterpret_cast<const uint4*>(src + ((int64_t)(q0 + tok) * HQ + head) * D + c);
    }
    *reinterpret_cast<uint4*>(dst + r * LD + c) = val;
  }
}

// Copies the keys [k0, k0 + BN) of group g (rows >= nvalid are zero).
template <typename T, int D>
__device__ __forceinline__ void load_kv_rows(T* dst, const T* src, int k0, int nvalid, int g, int G) {
  constexpr int VEC = 8;
  constexpr int LD = D + PAD;
  for (int i = threadIdx.x; i < BN * (D / VEC); i += NTHREADS) {
    const int r = i / (D / VEC), c = (i % (D / VEC)) * VEC;
    uint4 val = make_uint4(0, 0, 0, 0);
    if (r < nvalid) val = *reinterpret_cast<const uint4*>(src + ((int64_t)(k0 + r) * G + g) * D + c);
    *reinterpret_cast<uint4*>(dst + r * LD + c) = val;
  }
}

using AccFrag = wmma::fragment<wmma::accumulator, 16, 16, 16, float>;
template <typename T>
using ARow = wmma::fragment<wmma::matrix_a, 16, 16, 16, T, wmma::row_major>;
template <typename T>
using BCol = wmma::fragment<wmma::matrix_b, 16, 16, 16, T, wmma::col_major>;
template <typename T>
using BRow = wmma::fragment<wmma::matrix_b, 16, 16, 16, T, wmma::row_major>;

// C[16 x 64] (fp32, ld ldc) = A[16 x KD] (row-major, lda) * B^T, B[64 x KD] row-major (ldb).
template <typename T, int KD>
__device__ __forceinline__ void mm_abt(float* C, int ldc, const T* A, int lda, const T* B, int ldb) {
  AccFrag acc[4];
#pragma unroll
  for (int j = 0; j < 4; ++j) wmma::fill_fragment(acc[j], 0.f);
#pragma unroll
  for (int kk = 0; kk < KD; kk += 16) {
    ARow<T> a;
    wmma::load_matrix_sync(a, A + kk, lda);
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      BCol<T> b;
      wmma::load_matrix_sync(b, B + j * 16 * ldb + kk, ldb);
      wmma::mma_sync(acc[j], a, b, acc[j]);
    }
  }
#pragma unroll
  for (int j = 0; j < 4; ++j) wmma::store_matrix_sync(C + j * 16, acc[j], ldc, wmma::mem_row_major);
}

// acc[j] (16 x D, 16-column slices) += A[16 x 64] (row-major, lda) * B[64 x D] (row-major, ldb).
template <typename T, int D>
__device__ __forceinline__ void mm_ab_acc(AccFrag* acc, const T* A, int lda, const T* B, int ldb) {
#pragma unroll
  for (int kk = 0; kk < 64; kk += 16) {
    ARow<T> a;
    wmma::load_matrix_sync(a, A + kk, lda);
#pragma unroll
    for (int j = 0; j < D / 16; ++j) {
      BRow<T> b;
      wmma::load_matrix_sync(b, B + kk * ldb + j * 16, ldb);
      wmma::mma_sync(acc[j], a, b, acc[j]);
    }
  }
}

// ------------------------------------------------------------------------------------------
// Forward. Grid (NB * tpb, G). The O accumulator lives in shared memory (fp32) because the
// online softmax rescales it by row, which opaque WMMA fragments cannot do.
template <typename T, int D>
__global__ void __launch_bounds__(NTHREADS) fwd_kernel(Params p) {
  constexpr int LD = D + PAD, LDS = BN + 4, LDP = BN + PAD, LDO = D + 4;
  extern __shared__ __align__(128) unsigned char smem[];
  T* Qs = reinterpret_cast<T*>(smem);
  T* Ks = Qs + BM * LD;
  T* Vs = Ks + BN * LD;
  T* Ps = Vs + BN * LD;
  float* Ss = reinterpret_cast<float*>(Ps + BM * LDP);
  float* Os = Ss + BM * LDS;
  float* m_s = Os + BM * LDO;
  float* l_s = m_s + BM;

  const int qb = blockIdx.x / p.tpb, g = blockIdx.y;
  const int row0 = (blockIdx.x % p.tpb) * BM;
  const int q0 = p.bstart[qb], qlen = p.bend[qb] - q0, nrows = qlen * p.R;
  if (row0 >= nrows) return;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const T* Q = static_cast<const T*>(p.q);
  const T* K = static_cast<const T*>(p.k);
  const T* V = static_cast<const T*>(p.v);

  load_q_rows<T, D>(Qs, Q, q0, row0, nrows, p.R, g, p.HQ);
  for (int i = threadIdx.x; i < BM * LDO; i += NTHREADS) Os[i] = 0.f;
  if (threadIdx.x < BM) {
    m_s[threadIdx.x] = -INFINITY;
    l_s[threadIdx.x] = 0.f;
  }
  // Two lanes per row: lane 2*rr + half owns row 16*warp + rr, columns [32*half, 32*half + 32).
  const int rr = lane / 2, half = lane % 2, row = warp * 16 + rr;
  const int my_tok = (row0 + row) / p.R;
  const int cnt = p.kv_cnt[g * p.NB + qb];
  const int* idx = p.kv_idx + ((int64_t)g * p.NB + qb) * p.KMAX;
  const int nsub = p.block / BN;
  const int tok_hi = (min(row0 + BM, nrows) - 1) / p.R;
  const int n_off = (cnt - 1) * nsub;
  const int n_diag = tok_hi / BN + 1;

  for (int it = 0; it < n_off + n_diag; ++it) {
    const bool diag = it >= n_off;
    int k0, nvalid, kt0;
    if (!diag) {
      kt0 = (it % nsub) * BN;
      k0 = p.bstart[idx[it / nsub]] + kt0;
      nvalid = BN;
    } else {
      kt0 = (it - n_off) * BN;
      k0 = q0 + kt0;
      nvalid = min(BN, qlen - kt0);
    }
    __syncthreads();  // every warp is done with the previous K/V chunk
    load_kv_rows<T, D>(Ks, K, k0, nvalid, g, p.G);
    load_kv_rows<T, D>(Vs, V, k0, nvalid, g, p.G);
    __syncthreads();
    mm_abt<T, D>(Ss + warp * 16 * LDS, LDS, Qs + warp * 16 * LD, LD, Ks, LD);
    __syncwarp();
    // Online softmax of this lane's half row.
    float* srow = Ss + row * LDS + half * 32;
    float mx = -INFINITY;
    for (int c = 0; c < 32; ++c) {
      float s = srow[c] * p.scale_log2;
      if (diag) {
        const int kt = kt0 + half * 32 + c;
        if (kt >= nvalid + kt0 || kt > my_tok) s = -INFINITY;
      }
      srow[c] = s;
      mx = fmaxf(mx, s);
    }
    mx = fmaxf(mx, __shfl_xor_sync(0xffffffff, mx, 1));
    const float m_old = m_s[row];
    const float m_new = fmaxf(m_old, mx);
    const float m_use = m_new == -INFINITY ? 0.f : m_new;  // a row with nothing visible yet
    const float alpha = exp2f(m_old - m_use);
    float sum = 0.f;
    T* prow = Ps + row * LDP + half * 32;
    for (int c = 0; c < 32; ++c) {
      const float e = exp2f(srow[c] - m_use);
      const T eb = from_f<T>(e);
      prow[c] = eb;
      sum += to_f<T>(eb);  // normalise by what the P·V product actually sums
    }
    sum += __shfl_xor_sync(0xffffffff, sum, 1);
    float* orow = Os + row * LDO + half * (D / 2);
    for (int c = 0; c < D / 2; ++c) orow[c] *= alpha;
    __syncwarp();
    if (half == 0) {
      m_s[row] = m_new;
      l_s[row] = l_s[row] * alpha + sum;
    }
    AccFrag acc[D / 16];
#pragma unroll
    for (int j = 0; j < D / 16; ++j)
      wmma::load_matrix_sync(acc[j], Os + warp * 16 * LDO + j * 16, LDO, wmma::mem_row_major);
    mm_ab_acc<T, D>(acc, Ps + warp * 16 * LDP, LDP, Vs, LD);
#pragma unroll
    for (int j = 0; j < D / 16; ++j)
      wmma::store_matrix_sync(Os + warp * 16 * LDO + j * 16, acc[j], LDO, wmma::mem_row_major);
    __syncwarp();
  }
  // Write this lane's half row.
  const int gr = row0 + row;
  if (gr < nrows) {
    const int tok = gr / p.R, head = g * p.R + gr % p.R;
    const float l = l_s[row];
    const float inv = 1.f / l;
    T* out = static_cast<T*>(p.out) + ((int64_t)(q0 + tok) * p.HQ + head) * D + half * (D / 2);
    const float* orow = Os + row * LDO + half * (D / 2);
    for (int c = 0; c < D / 2; ++c) out[c] = from_f<T>(orow[c] * inv);
    if (half == 0) p.lse[(int64_t)(q0 + tok) * p.HQ + head] = m_s[row] + log2f(l);
  }
}

// delta[t, h] = sum_d o * do (one warp per row).
template <typename T, int D>
__global__ void delta_kernel(const T* O, const T* dO, float* delta, int64_t nrows) {
  const int64_t r = (int64_t)blockIdx.x * (blockDim.x / 32) + threadIdx.x / 32;
  const int lane = threadIdx.x % 32;
  if (r >= nrows) return;
  float s = 0.f;
  for (int c = lane; c < D; c += 32) s += to_f<T>(O[r * D + c]) * to_f<T>(dO[r * D + c]);
  for (int o = 16; o > 0; o /= 2) s += __shfl_xor_sync(0xffffffff, s, o);
  if (lane == 0) delta[r] = s;
}

// ------------------------------------------------------------------------------------------
// dQ. Grid (NB * tpb, G). dQ accumulates in fragments (no rescaling needed).
template <typename T, int D>
__global__ void __launch_bounds__(NTHREADS) dq_kernel(Params p) {
  constexpr int LD = D + PAD, LDS = BN + 4, LDP = BN + PAD, LDO = D + 4;
  extern __shared__ __align__(128) unsigned char smem[];
  T* Qs = reinterpret_cast<T*>(smem);
  T* dOs = Qs + BM * LD;
  T* Ks = dOs + BM * LD;
  T* Vs = Ks + BN * LD;
  T* Ps = Vs + BN * LD;
  float* Ss = reinterpret_cast<float*>(Ps + BM * LDP);
  float* dPs = Ss + BM * LDS;  // with Ss, reused as the fp32 [BM x LDO] staging of dQ
  float* lse_s = dPs + BM * LDS;
  float* delta_s = lse_s + BM;
  static_assert(2 * BM * LDS >= BM * LDO, "dQ staging must fit in the score buffers");

  const int qb = blockIdx.x / p.tpb, g = blockIdx.y;
  const int row0 = (blockIdx.x % p.tpb) * BM;
  const int q0 = p.bstart[qb], qlen = p.bend[qb] - q0, nrows = qlen * p.R;
  if (row0 >= nrows) return;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const T* K = static_cast<const T*>(p.k);
  const T* V = static_cast<const T*>(p.v);
  load_q_rows<T, D>(Qs, static_cast<const T*>(p.q), q0, row0, nrows, p.R, g, p.HQ);
  load_q_rows<T, D>(dOs, static_cast<const T*>(p.dout), q0, row0, nrows, p.R, g, p.HQ);
  if (threadIdx.x < BM) {
    const int gr = row0 + threadIdx.x;
    float l = INFINITY, d = 0.f;
    if (gr < nrows) {
      const int64_t off = (int64_t)(q0 + gr / p.R) * p.HQ + g * p.R + gr % p.R;
      l = p.lse[off];
      d = p.delta[off];
    }
    lse_s[threadIdx.x] = l;
    delta_s[threadIdx.x] = d;
  }
  const int rr = lane / 2, half = lane % 2, row = warp * 16 + rr;
  const int my_tok = (row0 + row) / p.R;
  const int cnt = p.kv_cnt[g * p.NB + qb];
  const int* idx = p.kv_idx + ((int64_t)g * p.NB + qb) * p.KMAX;
  const int nsub = p.block / BN;
  const int tok_hi = (min(row0 + BM, nrows) - 1) / p.R;
  const int n_off = (cnt - 1) * nsub;
  const int n_diag = tok_hi / BN + 1;
  AccFrag acc[D / 16];
#pragma unroll
  for (int j = 0; j < D / 16; ++j) wmma::fill_fragment(acc[j], 0.f);

  for (int it = 0; it < n_off + n_diag; ++it) {
    const bool diag = it >= n_off;
    int k0, nvalid, kt0;
    if (!diag) {
      kt0 = (it % nsub) * BN;
      k0 = p.bstart[idx[it / nsub]] + kt0;
      nvalid = BN;
    } else {
      kt0 = (it - n_off) * BN;
      k0 = q0 + kt0;
      nvalid = min(BN, qlen - kt0);
    }
    __syncthreads();
    load_kv_rows<T, D>(Ks, K, k0, nvalid, g, p.G);
    load_kv_rows<T, D>(Vs, V, k0, nvalid, g, p.G);
    __syncthreads();
    mm_abt<T, D>(Ss + warp * 16 * LDS, LDS, Qs + warp * 16 * LD, LD, Ks, LD);
    mm_abt<T, D>(dPs + warp * 16 * LDS, LDS, dOs + warp * 16 * LD, LD, Vs, LD);
    __syncwarp();
    const float lse = lse_s[row], dl = delta_s[row];
    for (int c = 0; c < 32; ++c) {
      const int col = half * 32 + c;
      float s = Ss[row * LDS + col] * p.scale_log2;
      if (diag && (col >= nvalid || kt0 + col > my_tok)) s = -INFINITY;
      const float pr = exp2f(s - lse);
      Ps[row * LDP + col] = from_f<T>(pr * (dPs[row * LDS + col] - dl));
    }
    __syncwarp();
    mm_ab_acc<T, D>(acc, Ps + warp * 16 * LDP, LDP, Ks, LD);
  }
  __syncthreads();  // the score buffers become dQ's staging
  float* Os = Ss;
#pragma unroll
  for (int j = 0; j < D / 16; ++j)
    wmma::store_matrix_sync(Os + warp * 16 * LDO + j * 16, acc[j], LDO, wmma::mem_row_major);
  __syncwarp();
  const int gr = row0 + row;
  if (gr < nrows) {
    const int tok = gr / p.R, head = g * p.R + gr % p.R;
    T* out = static_cast<T*>(p.dq) + ((int64_t)(q0 + tok) * p.HQ + head) * D + half * (D / 2);
    const float* orow = Os + row * LDO + half * (D / 2);
    for (int c = 0; c < D / 2; ++c) out[c] = from_f<T>(orow[c] * p.scale);
  }
}

// ------------------------------------------------------------------------------------------
// dK/dV. Grid (NB * block / BN, G). Warp w owns keys [16w, 16w + 16) of the chunk; dK and dV
// accumulate in fragments. Scores are computed transposed (keys x query rows).
template <typename T, int D>
__global__ void __launch_bounds__(NTHREADS) dkdv_kernel(Params p) {
  constexpr int LD = D + PAD, LDS = BM + 4, LDP = BM + PAD, LDO = D + 4;
  extern __shared__ __align__(128) unsigned char smem[];
  T* Ks = reinterpret_cast<T*>(smem);
  T* Vs = Ks + BN * LD;
  T* Qs = Vs + BN * LD;
  T* dOs = Qs + BM * LD;
  T* Pt = dOs + BM * LD;
  T* dSt = Pt + BN * LDP;
  float* St = reinterpret_cast<float*>(dSt + BN * LDP);
  float* dPt = St + BN * LDS;  // with St, reused as the fp32 staging of dK and dV
  float* lse_s = dPt + BN * LDS;
  float* delta_s = lse_s + BM;
  static_assert(2 * BN * LDS >= BN * LDO, "dK/dV staging must fit in the score buffers");

  const int nsub = p.block / BN;
  const int kb = blockIdx.x / nsub, g = blockIdx.y;
  const int n0 = (blockIdx.x % nsub) * BN;
  const int b0 = p.bstart[kb], blen = p.bend[kb] - b0;
  if (n0 >= blen) return;
  const int nvalid = min(BN, blen - n0);
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const T* Q = static_cast<const T*>(p.q);
  const T* dO = static_cast<const T*>(p.dout);
  load_kv_rows<T, D>(Ks, static_cast<const T*>(p.k), b0 + n0, nvalid, g, p.G);
  load_kv_rows<T, D>(Vs, static_cast<const T*>(p.v), b0 + n0, nvalid, g, p.G);
  AccFrag dk[D / 16], dv[D / 16];
#pragma unroll
  for (int j = 0; j < D / 16; ++j) {
    wmma::fill_fragment(dk[j], 0.f);
    wmma::fill_fragment(dv[j], 0.f);
  }
  // Two lanes per key row: lane 2*rr + half owns key 16*warp + rr, query rows [32*half, +32).
  const int rr = lane / 2, half = lane % 2, key = warp * 16 + rr;
  const int key_tok = n0 + key;  // token offset inside the block
  const int p0 = p.q_ptr[g * p.NB + kb], nq = p.q_ptr[g * p.NB + kb + 1] - p0;

  // Work list: the diagonal block's row tiles from the first row that can see this chunk, then
  // every row tile of each later query block that selected the block.
  int e = 0, qb = kb, q0 = b0, qrows = blen * p.R;
  int r0 = (n0 * p.R) / BM * BM;
  while (true) {
    if (r0 >= qrows) {
      if (++e >= nq) break;
      qb = p.q_idx[p0 + e];
      q0 = p.bstart[qb];
      qrows = (p.bend[qb] - q0) * p.R;
      r0 = 0;
      continue;
    }
    const bool diag = e == 0;
    __syncthreads();  // every warp is done with the previous Q/dO tile
    load_q_rows<T, D>(Qs, Q, q0, r0, qrows, p.R, g, p.HQ);
    load_q_rows<T, D>(dOs, dO, q0, r0, qrows, p.R, g, p.HQ);
    if (threadIdx.x < BM) {
      const int gr = r0 + threadIdx.x;
      float l = INFINITY, d = 0.f;  // rows past the block: P = 0
      if (gr < qrows) {
        const int64_t off = (int64_t)(q0 + gr / p.R) * p.HQ + g * p.R + gr % p.R;
        l = p.lse[off];
        d = p.delta[off];
      }
      lse_s[threadIdx.x] = l;
      delta_s[threadIdx.x] = d;
    }
    __syncthreads();
    mm_abt<T, D>(St + warp * 16 * LDS, LDS, Ks + warp * 16 * LD, LD, Qs, LD);
    mm_abt<T, D>(dPt + warp * 16 * LDS, LDS, Vs + warp * 16 * LD, LD, dOs, LD);
    __syncwarp();
    for (int c = 0; c < 32; ++c) {
      const int col = half * 32 + c;
      float s = St[key * LDS + col] * p.scale_log2;
      if (diag && key_tok > (r0 + col) / p.R) s = -INFINITY;
      const float pr = exp2f(s - lse_s[col]);
      const T pb = from_f<T>(pr);
      Pt[key * LDP + col] = pb;
      dSt[key * LDP + col] = from_f<T>(pr * (dPt[key * LDS + col] - delta_s[col]));
    }
    __syncwarp();
    mm_ab_acc<T, D>(dv, Pt + warp * 16 * LDP, LDP, dOs, LD);
    mm_ab_acc<T, D>(dk, dSt + warp * 16 * LDP, LDP, Qs, LD);
    r0 += BM;
  }
  __syncthreads();
  float* stage = St;
  T* dK = static_cast<T*>(p.dk);
  T* dV = static_cast<T*>(p.dv);
  for (int pass = 0; pass < 2; ++pass) {
#pragma unroll
    for (int j = 0; j < D / 16; ++j)
      wmma::store_matrix_sync(stage + warp * 16 * LDO + j * 16, pass == 0 ? dk[j] : dv[j], LDO,
                              wmma::mem_row_major);
    __syncwarp();
    if (key < nvalid) {
      T* out = (pass == 0 ? dK : dV) + ((int64_t)(b0 + n0 + key) * p.G + g) * D + half * (D / 2);
      const float* srow = stage + key * LDO + half * (D / 2);
      const float mul = pass == 0 ? p.scale : 1.f;
      for (int c = 0; c < D / 2; ++c) out[c] = from_f<T>(srow[c] * mul);
    }
    __syncwarp();
  }
}

template <int D>
constexpr size_t fwd_smem(size_t elt) {
  return elt * (BM * (D + PAD) + 2 * BN * (D + PAD) + BM * (BN + PAD)) +
         4 * (BM * (BN + 4) + BM * (D + 4) + 2 * BM);
}
template <int D>
constexpr size_t dq_smem(size_t elt) {
  return elt * (2 * BM * (D + PAD) + 2 * BN * (D + PAD) + BM * (BN + PAD)) + 4 * (2 * BM * (BN + 4) + 2 * BM);
}
template <int D>
constexpr size_t dkdv_smem(size_t elt) {
  return elt * (2 * BN * (D + PAD) + 2 * BM * (D + PAD) + 2 * BN * (BM + PAD)) + 4 * (2 * BN * (BM + 4) + 2 * BM);
}

template <typename Kernel>
void launch(Kernel kernel, dim3 grid, size_t smem, cudaStream_t stream, const Params& p) {
  if (grid.x == 0 || grid.y == 0) return;
  C10_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)smem));
  kernel<<<grid, NTHREADS, smem, stream>>>(p);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

void check_inputs(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& kv_idx,
                  const at::Tensor& kv_cnt, const at::Tensor& bstart, const at::Tensor& bend, int64_t block) {
  TORCH_CHECK(q.is_cuda() && k.is_cuda() && v.is_cuda(), "q, k, v must be CUDA tensors");
  TORCH_CHECK(q.dim() == 3 && k.dim() == 3 && k.sizes() == v.sizes(), "expected q [T, HQ, D], k/v [T, G, D]");
  TORCH_CHECK(q.size(0) == k.size(0) && q.size(2) == k.size(2), "q and k differ in tokens or head dim");
  TORCH_CHECK(q.size(1) % k.size(1) == 0, "HQ must be a multiple of G");
  TORCH_CHECK(q.size(2) == 64 || q.size(2) == 128, "head dim must be 64 or 128, got ", q.size(2));
  TORCH_CHECK(q.scalar_type() == at::kBFloat16 || q.scalar_type() == at::kHalf, "q must be bf16 or fp16");
  TORCH_CHECK(k.scalar_type() == q.scalar_type() && v.scalar_type() == q.scalar_type(), "q, k, v dtypes differ");
  TORCH_CHECK(q.is_contiguous() && k.is_contiguous() && v.is_contiguous(), "q, k, v must be contiguous");
  TORCH_CHECK(block == 64 || block == 128 || block == 256, "block size must be 64, 128 or 256");
  for (const at::Tensor* t : {&q, &k, &v})  // 16-byte vector loads
    TORCH_CHECK(reinterpret_cast<uintptr_t>(t->data_ptr()) % 16 == 0, "q, k, v must be 16-byte aligned");
  for (const at::Tensor* t : {&kv_idx, &kv_cnt, &bstart, &bend})
    TORCH_CHECK(t->is_cuda() && t->scalar_type() == at::kInt && t->is_contiguous(),
                "index tensors must be contiguous int32 CUDA tensors");
}

Params make_params(const at::Tensor& q, const at::Tensor& k, const at::Tensor& kv_idx, const at::Tensor& kv_cnt,
                   const at::Tensor& bstart, const at::Tensor& bend, double scale, int64_t block) {
  Params p{};
  p.NB = (int)bstart.numel();
  p.KMAX = (int)kv_idx.size(-1);
  p.HQ = (int)q.size(1);
  p.G = (int)k.size(1);
  p.R = p.HQ / p.G;
  p.block = (int)block;
  p.tpb = (int)((block * p.R + BM - 1) / BM);
  p.scale = (float)scale;
  p.scale_log2 = (float)scale * LOG2E;
  p.kv_idx = kv_idx.data_ptr<int>();
  p.kv_cnt = kv_cnt.data_ptr<int>();
  p.bstart = bstart.data_ptr<int>();
  p.bend = bend.data_ptr<int>();
  return p;
}

template <typename T, int D>
void run_fwd(const Params& p, cudaStream_t s) {
  launch(fwd_kernel<T, D>, dim3(p.NB * p.tpb, p.G), fwd_smem<D>(sizeof(T)), s, p);
}

template <typename T, int D>
void run_bwd(const Params& p, int64_t nrows, cudaStream_t s) {
  if (nrows > 0) {
    delta_kernel<T, D><<<(unsigned)((nrows + 7) / 8), 256, 0, s>>>(static_cast<const T*>(p.o),
                                                                   static_cast<const T*>(p.dout), p.delta, nrows);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  }
  launch(dkdv_kernel<T, D>, dim3(p.NB * (p.block / BN), p.G), dkdv_smem<D>(sizeof(T)), s, p);
  launch(dq_kernel<T, D>, dim3(p.NB * p.tpb, p.G), dq_smem<D>(sizeof(T)), s, p);
}

std::vector<at::Tensor> sparse_attn_fwd_cuda(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                             const at::Tensor& kv_idx, const at::Tensor& kv_cnt,
                                             const at::Tensor& bstart, const at::Tensor& bend, double scale,
                                             int64_t block) {
  check_inputs(q, k, v, kv_idx, kv_cnt, bstart, bend, block);
  const c10::cuda::CUDAGuard guard(q.device());
  auto out = at::empty_like(q);
  auto lse = at::empty({q.size(0), q.size(1)}, q.options().dtype(at::kFloat));
  Params p = make_params(q, k, kv_idx, kv_cnt, bstart, bend, scale, block);
  if (q.size(0) == 0 || p.NB == 0) return {out, lse};
  p.q = q.data_ptr();
  p.k = k.data_ptr();
  p.v = v.data_ptr();
  p.out = out.data_ptr();
  p.lse = lse.data_ptr<float>();
  auto s = at::cuda::getCurrentCUDAStream().stream();
  const bool bf16 = q.scalar_type() == at::kBFloat16;
  if (q.size(2) == 64)
    bf16 ? run_fwd<__nv_bfloat16, 64>(p, s) : run_fwd<__half, 64>(p, s);
  else
    bf16 ? run_fwd<__nv_bfloat16, 128>(p, s) : run_fwd<__half, 128>(p, s);
  return {out, lse};
}

std::vector<at::Tensor> sparse_attn_bwd_cuda(const at::Tensor& dout, const at::Tensor& q, const at::Tensor& k,
                                             const at::Tensor& v, const at::Tensor& out, const at::Tensor& lse,
                                             const at::Tensor& kv_idx, const at::Tensor& kv_cnt,
                                             const at::Tensor& bstart, const at::Tensor& bend,
                                             const at::Tensor& q_ptr, const at::Tensor& q_idx, double scale,
                                             int64_t block) {
  check_inputs(q, k, v, kv_idx, kv_cnt, bstart, bend, block);
  TORCH_CHECK(dout.sizes() == q.sizes() && out.sizes() == q.sizes() && dout.is_contiguous() && out.is_contiguous(),
              "dout and out must be contiguous [T, HQ, D]");
  TORCH_CHECK(dout.scalar_type() == q.scalar_type() && out.scalar_type() == q.scalar_type(), "dout/out dtype");
  TORCH_CHECK(lse.scalar_type() == at::kFloat && lse.is_contiguous(), "lse must be contiguous float32 [T, HQ]");
  TORCH_CHECK(q_ptr.scalar_type() == at::kInt && q_idx.scalar_type() == at::kInt, "q_ptr/q_idx must be int32");
  const c10::cuda::CUDAGuard guard(q.device());
  auto dq = at::empty_like(q);
  auto dk = at::empty_like(k);
  auto dv = at::empty_like(v);
  Params p = make_params(q, k, kv_idx, kv_cnt, bstart, bend, scale, block);
  if (q.size(0) == 0 || p.NB == 0) return {dq, dk, dv};
  auto delta = at::empty({q.size(0), q.size(1)}, q.options().dtype(at::kFloat));
  p.q = q.data_ptr();
  p.k = k.data_ptr();
  p.v = v.data_ptr();
  p.o = out.data_ptr();
  p.dout = dout.data_ptr();
  p.dq = dq.data_ptr();
  p.dk = dk.data_ptr();
  p.dv = dv.data_ptr();
  p.lse = lse.data_ptr<float>();
  p.delta = delta.data_ptr<float>();
  p.q_ptr = q_ptr.data_ptr<int>();
  p.q_idx = q_idx.data_ptr<int>();
  auto s = at::cuda::getCurrentCUDAStream().stream();
  const int64_t nrows = q.size(0) * q.size(1);
  const bool bf16 = q.scalar_type() == at::kBFloat16;
  if (q.size(2) == 64)
    bf16 ? run_bwd<__nv_bfloat16, 64>(p, nrows, s) : run_bwd<__half, 64>(p, nrows, s);
  else
    bf16 ? run_bwd<__nv_bfloat16, 128>(p, nrows, s) : run_bwd<__half, 128>(p, nrows, s);
  return {dq, dk, dv};
}

}  // namespace

void register_cuda_ops(pybind11::module& m) {
  m.def("sparse_attn_fwd_cuda", &sparse_attn_fwd_cuda, "block-sparse attention forward (CUDA): (out, lse)",
        pybind11::arg("q"), pybind11::arg("k"), pybind11::arg("v"), pybind11::arg("kv_idx"), pybind11::arg("kv_cnt"),
        pybind11::arg("block_start"), pybind11::arg("block_end"), pybind11::arg("softmax_scale"),
        pybind11::arg("block_size"));
  m.def("sparse_attn_bwd_cuda", &sparse_attn_bwd_cuda, "block-sparse attention backward (CUDA): (dq, dk, dv)",
        pybind11::arg("dout"), pybind11::arg("q"), pybind11::arg("k"), pybind11::arg("v"), pybind11::arg("out"),
        pybind11::arg("lse"), pybind11::arg("kv_idx"), pybind11::arg("kv_cnt"), pybind11::arg("block_start"),
        pybind11::arg("block_end"), pybind11::arg("q_ptr"), pybind11::arg("q_idx"), pybind11::arg("softmax_scale"),
        pybind11::arg("block_size"));
}

}  // namespace sparsebalance
