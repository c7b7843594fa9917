// Device code of the CUDA block-sparse causal attention (DESIGN.md §2): forward, dQ and dK/dV,
// on the tensor cores through raw mma.sync.m16n8k16 with every score kept in registers.
// Host glue (checks, launches, bindings) lives in attention.cu; this header needs only CUDA, so
// its kernels compile and can be inspected (ptxas -v) without torch. On Hopper, builds with sm_90a
// run the wgmma kernels of attention_kernels_sm90.cuh instead, except dK/dV at block 64; the
// helpers below (tile loads, walks, register repacking) serve both.
//
// Same structure as the Triton kernels (megatron_sparsebalance/ops/triton_attention.py):
// * Rows of a query tile are (token, head) pairs of ONE KV-head group, token-major
//   (row r of a query block: token r / R, head g*R + r % R, R = HQ / G), so each K/V chunk a CTA
//   stages in shared memory serves every query head of the group.
// * Off-diagonal selected blocks are full and fully visible: no masks. The diagonal block (last
//   entry of a kv_idx row; first entry of a transposed row) is causal and may be partial.
// * Backward: dK/dV per (KV chunk, group) walking the transposed CSR (q_ptr, q_idx); dQ per
//   (query tile, group) walking kv_idx. Each output element is written by one CTA: no atomics,
//   so the backward is deterministic.
//
// Each warp of a CTA owns slices of 16 rows of every tile: MI slices of query rows in the
// forward and dQ (MI per head dim in attention.cu's Tiles), one slice of keys in dK/dV. Why
// registers: the scores of a 16-row slice come out of mma.sync in the accumulator layout,
// which is also the layout of the A operand of the next product, so the softmax and P·V (or
// dS·K, P^T·dO, dS^T·Q) never touch shared memory. Shared memory holds only the operand tiles,
// filled by cp.async one chunk ahead of the one being multiplied.
//
// Shapes: q, o, dq [T, HQ, D]; k, v, dk, dv [T, G, D]; lse, delta [T, HQ] float32 (lse in base 2
// of the scaled scores); kv_idx [G, NB, K] int32 (-1 padded); kv_cnt [G, NB]; block_start,
// block_end [NB]; q_ptr [G*NB+1]; q_idx [>= q_ptr[-1]].
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>

#include "cuda/warp.cuh"

namespace sparsebalance {
namespace kernels {

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
  // The Hopper dK/dV's plan (sm90::dkdv_plan_kernel): its work items, longest first, each a part
  // of a (group, KV block) pair's query list; per pair, where its parts' partial sums go; and
  // per pair and chunk of KV rows, how many parts have finished.
  const int4* dkdv_items;
  const int2* dkdv_split;
  int* dkdv_arrivals;
  float* dkdv_partials;
  // The stored-dS backward (sm90::dq_from_ds_kernel): dS tiles as dK/dV wrote them, and each
  // route entry's tile (transpose_index's slots, [G, NB, KMAX]).
  void* ds;
  const int* ds_slots;
  int NB, KMAX, R, HQ, G, block;
  uint64_t r_magic;  // ceil(2^32 / R): div_r's multiplier
  float scale, scale_log2;
};

// x / R for 0 <= x < 2^32 / R (rows of a block are < 2^16): one wide multiply instead of the
// ~20 instructions of an integer division by a value known only at run time.
__device__ __forceinline__ int div_r(int x, const Params& p) {
  return static_cast<int>(((uint64_t)(uint32_t)x * p.r_magic) >> 32);
}

// Index in a [T, HQ] layout (q, o and dO rows, lse, delta) of packed query row gr of the block
// that starts at token q0: token q0 + tok, head g R + gr - tok R, where tok = gr / R.
__device__ __forceinline__ int64_t query_row(int q0, int gr, int tok, int g, const Params& p) {
  return (int64_t)(q0 + tok) * p.HQ + g * p.R + gr - tok * p.R;
}

constexpr int WARP_ROWS = 16;  // rows of one mma.sync tile; each warp owns one such slice
constexpr int CHUNK = 64;      // keys of a K/V chunk
// 16 bytes of padding per shared-memory row: a row of D 16-bit values is then an odd number of
// 16-byte units long, so the 8 row addresses of one ldmatrix fall in 8 different bank groups.
constexpr int PAD = 8;
constexpr float LOG2E = 1.4426950408889634f;

// ---- PTX wrappers ---------------------------------------------------------------------------

__device__ __forceinline__ uint32_t smem_u32(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

// 16-byte global -> shared copy that bypasses L1; writes zeros when !valid (src is not read).
__device__ __forceinline__ void cp_async16(void* dst, const void* src, bool valid) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(smem_u32(dst)), "l"(src),
               "r"(valid ? 16 : 0)
               : "memory");
}
// 4-byte copy (cp.async allows 4, 8 or 16 bytes through L1); zeros when !valid.
__device__ __forceinline__ void cp_async4(void* dst, const void* src, bool valid) {
  asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;\n" ::"r"(smem_u32(dst)), "l"(src), "r"(valid ? 4 : 0)
               : "memory");
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::: "memory"); }
__device__ __forceinline__ void cp_async_wait_all() { asm volatile("cp.async.wait_group 0;\n" ::: "memory"); }

// Four 8x8 16-bit matrices; lanes 8i..8i+7 give the row addresses of matrix i.
__device__ __forceinline__ void ldsm_x4(uint32_t (&r)[4], const void* p) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(smem_u32(p)));
}
__device__ __forceinline__ void ldsm_x4_trans(uint32_t (&r)[4], const void* p) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(smem_u32(p)));
}

// d[16x8] += a[16x16] * b[16x8], fp32 accumulate.
template <typename T>
__device__ __forceinline__ void mma16816(float (&d)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1);
template <>
__device__ __forceinline__ void mma16816<__nv_bfloat16>(float (&d)[4], const uint32_t (&a)[4], uint32_t b0,
                                                        uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
      "{%0, %1, %2, %3};\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}
template <>
__device__ __forceinline__ void mma16816<__half>(float (&d)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
      "{%0, %1, %2, %3};\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// Two floats as one 32-bit pair of 16-bit values, `lo` in the low half (the lower column).
template <typename T>
__device__ __forceinline__ uint32_t pack2(float lo, float hi);
template <>
__device__ __forceinline__ uint32_t pack2<__nv_bfloat16>(float lo, float hi) {
  __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
  return *reinterpret_cast<uint32_t*>(&v);
}
template <>
__device__ __forceinline__ uint32_t pack2<__half>(float lo, float hi) {
  __half2 v = __floats2half2_rn(lo, hi);
  return *reinterpret_cast<uint32_t*>(&v);
}

// The two 16-bit values of a packed pair, as floats (pack2's inverse).
template <typename T>
__device__ __forceinline__ float2 unpack2(uint32_t v);
template <>
__device__ __forceinline__ float2 unpack2<__nv_bfloat16>(uint32_t v) {
  return __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&v));
}
template <>
__device__ __forceinline__ float2 unpack2<__half>(uint32_t v) {
  return __half22float2(*reinterpret_cast<const __half2*>(&v));
}

// The elementwise product of two packed pairs, rounded to T (one HMUL2).
template <typename T>
__device__ __forceinline__ uint32_t mul2(uint32_t a, uint32_t b);
template <>
__device__ __forceinline__ uint32_t mul2<__nv_bfloat16>(uint32_t a, uint32_t b) {
  const __nv_bfloat162 v =
      __hmul2(*reinterpret_cast<const __nv_bfloat162*>(&a), *reinterpret_cast<const __nv_bfloat162*>(&b));
  return *reinterpret_cast<const uint32_t*>(&v);
}
template <>
__device__ __forceinline__ uint32_t mul2<__half>(uint32_t a, uint32_t b) {
  const __half2 v = __hmul2(*reinterpret_cast<const __half2*>(&a), *reinterpret_cast<const __half2*>(&b));
  return *reinterpret_cast<const uint32_t*>(&v);
}

// ---- Warp-level products ----------------------------------------------------------------------
// Accumulator layout of a 16 x N tile (mma.sync's C): acc[j] covers columns [8j, 8j + 8); lane
// holds rows lane/4 (acc[j][0..1]) and lane/4 + 8 (acc[j][2..3]), columns 8j + 2*(lane%4) + {0,1}.

// acc[MI][16 x N] += A[MI * 16 x KD] * B[N x KD]^T: MI row slices of 16 (slice mi starts at row
// 16 mi of A) share every B fragment, which halves the shared-memory reads per product at MI = 2.
// A and B are row-major in shared memory (lda, ldb elements).
template <typename T, int MI, int N, int KD>
__device__ __forceinline__ void warp_mm_nt(float (&acc)[MI][N / 8][4], const T* a, int lda, const T* b, int ldb,
                                           int lane) {
  static_assert(N % 16 == 0 && KD % 16 == 0, "tile sizes are multiples of 16");
  const T* a_lane = a + (lane % 16) * lda + (lane / 16) * 8;
  const T* b_lane = b + ((lane % 8) + (lane / 16) * 8) * ldb + ((lane / 8) % 2) * 8;
#pragma unroll
  for (int kk = 0; kk < KD; kk += 16) {
    uint32_t af[MI][4];
#pragma unroll
    for (int mi = 0; mi < MI; ++mi) ldsm_x4(af[mi], a_lane + mi * WARP_ROWS * lda + kk);
#pragma unroll
    for (int n = 0; n < N; n += 16) {
      uint32_t bf[4];  // b0, b1 of columns [n, n+8), then of [n+8, n+16)
      ldsm_x4(bf, b_lane + n * ldb + kk);
#pragma unroll
      for (int mi = 0; mi < MI; ++mi) {
        mma16816<T>(acc[mi][n / 8], af[mi], bf[0], bf[1]);
        mma16816<T>(acc[mi][n / 8 + 1], af[mi], bf[2], bf[3]);
      }
    }
  }
}

// Two independent products of warp_mm_nt's form in one loop: acc1 += A1 B1^T, acc2 += A2 B2^T.
// Consecutive steps of one product accumulate into the same registers and must wait for the
// previous mma.sync; at small N one product has too few accumulators to cover that latency
// (ncu: "wait" stalls), and interleaving a second doubles them.
template <typename T, int MI, int N, int KD>
__device__ __forceinline__ void warp_mm_nt2(float (&acc1)[MI][N / 8][4], const T* a1, const T* b1,
                                            float (&acc2)[MI][N / 8][4], const T* a2, const T* b2, int ld, int lane) {
  static_assert(N % 16 == 0 && KD % 16 == 0, "tile sizes are multiples of 16");
  const int a_off = (lane % 16) * ld + (lane / 16) * 8;
  const int b_off = ((lane % 8) + (lane / 16) * 8) * ld + ((lane / 8) % 2) * 8;
#pragma unroll
  for (int kk = 0; kk < KD; kk += 16) {
    uint32_t af1[MI][4], af2[MI][4];
#pragma unroll
    for (int mi = 0; mi < MI; ++mi) {
      ldsm_x4(af1[mi], a1 + a_off + mi * WARP_ROWS * ld + kk);
      ldsm_x4(af2[mi], a2 + a_off + mi * WARP_ROWS * ld + kk);
    }
#pragma unroll
    for (int n = 0; n < N; n += 16) {
      uint32_t bf1[4], bf2[4];
      ldsm_x4(bf1, b1 + b_off + n * ld + kk);
      ldsm_x4(bf2, b2 + b_off + n * ld + kk);
#pragma unroll
      for (int mi = 0; mi < MI; ++mi) {
        mma16816<T>(acc1[mi][n / 8], af1[mi], bf1[0], bf1[1]);
        mma16816<T>(acc2[mi][n / 8], af2[mi], bf2[0], bf2[1]);
        mma16816<T>(acc1[mi][n / 8 + 1], af1[mi], bf1[2], bf1[3]);
        mma16816<T>(acc2[mi][n / 8 + 1], af2[mi], bf2[2], bf2[3]);
      }
    }
  }
}

// acc[MI][16 x N] += P[MI][16 x KK] * B[KK x N]; P in registers as A fragments (to_a_frags), B
// row-major in shared memory (ldb elements), read transposed by ldmatrix.
template <typename T, int MI, int N, int KK>
__device__ __forceinline__ void warp_mm_rn(float (&acc)[MI][N / 8][4], const uint32_t (&pa)[MI][KK / 16][4],
                                           const T* b, int ldb, int lane) {
  static_assert(N % 16 == 0 && KK % 16 == 0, "tile sizes are multiples of 16");
  const T* b_lane = b + (lane % 16) * ldb + (lane / 16) * 8;
#pragma unroll
  for (int kk = 0; kk < KK; kk += 16) {
#pragma unroll
    for (int n = 0; n < N; n += 16) {
      uint32_t bf[4];
      ldsm_x4_trans(bf, b_lane + kk * ldb + n);
#pragma unroll
      for (int mi = 0; mi < MI; ++mi) {
        mma16816<T>(acc[mi][n / 8], pa[mi][kk / 16], bf[0], bf[1]);
        mma16816<T>(acc[mi][n / 8 + 1], pa[mi][kk / 16], bf[2], bf[3]);
      }
    }
  }
}

// A fragments of MI 16 x N accumulators, rounded to T: the product's output layout is the next
// product's input layout, so this is a register-only repack.
template <typename T, int MI, int N>
__device__ __forceinline__ void to_a_frags(uint32_t (&pa)[MI][N / 16][4], const float (&acc)[MI][N / 8][4]) {
#pragma unroll
  for (int mi = 0; mi < MI; ++mi)
#pragma unroll
    for (int s = 0; s < N / 16; ++s) {
      pa[mi][s][0] = pack2<T>(acc[mi][2 * s][0], acc[mi][2 * s][1]);
      pa[mi][s][1] = pack2<T>(acc[mi][2 * s][2], acc[mi][2 * s][3]);
      pa[mi][s][2] = pack2<T>(acc[mi][2 * s + 1][0], acc[mi][2 * s + 1][1]);
      pa[mi][s][3] = pack2<T>(acc[mi][2 * s + 1][2], acc[mi][2 * s + 1][3]);
    }
}

template <int MI, int N>
__device__ __forceinline__ void zero(float (&acc)[MI][N][4]) {
#pragma unroll
  for (int mi = 0; mi < MI; ++mi)
#pragma unroll
    for (int j = 0; j < N; ++j)
#pragma unroll
      for (int e = 0; e < 4; ++e) acc[mi][j][e] = 0.f;
}
// Sum over the four lanes that share a row in the accumulator layout.
__device__ __forceinline__ float quad_sum(float x) {
  x += __shfl_xor_sync(0xffffffff, x, 1);
  return x + __shfl_xor_sync(0xffffffff, x, 2);
}
__device__ __forceinline__ float quad_max(float x) {
  x = fmaxf(x, __shfl_xor_sync(0xffffffff, x, 1));
  return fmaxf(x, __shfl_xor_sync(0xffffffff, x, 2));
}

// ---- Tile loads (cp.async, issued by the whole CTA) -----------------------------------------

// Where value (r, c) of a tile sits: row-major rows padded by PAD values (the mma.sync kernels'
// layout; wgmma.cuh has the swizzled one the Hopper kernels use).
template <int D>
struct PaddedRows {
  __device__ static int offset(int r, int c) { return r * (D + PAD) + c; }
};

// Packed query rows [row0, row0 + ROWS) of the block starting at token q0 (rows >= nrows: zeros).
// Every tile is a whole number of 16-byte vectors per thread, so the loop unrolls fully.
template <typename T, int D, int ROWS, int NT, typename Layout = PaddedRows<D>>
__device__ __forceinline__ void load_q_rows(T* dst, const T* src, int q0, int row0, int nrows, const Params& p,
                                            int g) {
  constexpr int VECS = D / 8;  // 16-byte vectors per row
  static_assert(ROWS * VECS % NT == 0, "each thread loads the same number of vectors");
#pragma unroll
  for (int j = 0; j < ROWS * VECS / NT; ++j) {
    const int i = threadIdx.x + j * NT, r = i / VECS, c = (i % VECS) * 8, gr = row0 + r, tok = div_r(gr, p);
    const bool valid = gr < nrows;
    const T* s = valid ? src + query_row(q0, gr, tok, g, p) * D + c : src;
    cp_async16(dst + Layout::offset(r, c), s, valid);
  }
}

// Keys [k0, k0 + CHUNK) of group g into padded rows (rows >= nvalid: zeros, so a masked P times V
// stays 0).
template <typename T, int D, int NT>
__device__ __forceinline__ void load_kv_rows(T* dst, const T* src, int k0, int nvalid, int g, int G) {
  constexpr int VECS = D / 8;
  static_assert(CHUNK * VECS % NT == 0, "each thread loads the same number of vectors");
#pragma unroll
  for (int j = 0; j < CHUNK * VECS / NT; ++j) {
    const int i = threadIdx.x + j * NT, r = i / VECS, c = (i % VECS) * 8;
    const bool valid = r < nvalid;
    const T* s = valid ? src + ((int64_t)(k0 + r) * G + g) * D + c : src;
    cp_async16(dst + PaddedRows<D>::offset(r, c), s, valid);
  }
}

struct Chunk {
  int k0, nvalid, kt0;
};

// The K/V chunks one query tile visits: first the selected off-diagonal blocks, each as
// block / CH chunks of CH keys, then the diagonal block's chunks up to the tile's last token.
template <int CH = CHUNK>
struct KvWalk {
  const int* idx;  // kv_idx row of (group, query block)
  int sub_shift, n_off, n_total, q0, qlen;  // a block is 1 << sub_shift chunks

  __device__ KvWalk(const Params& p, int g, int qb, int q0_, int qlen_, int tok_hi) : q0(q0_), qlen(qlen_) {
    const int cnt = p.kv_cnt[g * p.NB + qb];
    idx = p.kv_idx + ((int64_t)g * p.NB + qb) * p.KMAX;
    sub_shift = __ffs(p.block / CH) - 1;
    n_off = (cnt - 1) << sub_shift;
    n_total = n_off + tok_hi / CH + 1;
  }
  // Chunk `it`: first key token, valid keys, offset inside its block (the diagonal's mask needs it).
  __device__ Chunk chunk(const Params& p, int it) const {
    if (it < n_off) {
      const int kt0 = (it & ((1 << sub_shift) - 1)) * CH;
      return {p.bstart[idx[it >> sub_shift]] + kt0, CH, kt0};
    }
    const int kt0 = (it - n_off) * CH;
    return {q0 + kt0, min(CH, qlen - kt0), kt0};
  }
};

// ---- Forward ------------------------------------------------------------------------------------
// Grid (NB * tiles per block, G); CTA of NW warps, each owning MI slices of 16 query rows
// (BM = 16 MI NW rows). Online softmax per row in registers: a row's state sits in the four
// lanes of its quad.
template <typename T, int D, int NW, int MI>
__global__ void __launch_bounds__(NW * 32) fwd_kernel(Params p) {
  constexpr int NT = NW * 32, WM = MI * WARP_ROWS, BM = NW * WM, LD = D + PAD, NJ = CHUNK / 8;
  extern __shared__ __align__(128) unsigned char smem[];
  T* Qs = reinterpret_cast<T*>(smem);
  T* Ks = Qs + BM * LD;  // two buffers of CHUNK rows each
  T* Vs = Ks + 2 * CHUNK * LD;

  const int tiles = (p.block * p.R + BM - 1) / BM;
  const int qb = blockIdx.x / tiles, g = blockIdx.y;
  const int row0 = (blockIdx.x % tiles) * BM;
  const int q0 = p.bstart[qb], qlen = p.bend[qb] - q0, nrows = qlen * p.R;
  if (row0 >= nrows) return;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const T* K = static_cast<const T*>(p.k);
  const T* V = static_cast<const T*>(p.v);
  const KvWalk<> walk(p, g, qb, q0, qlen, (min(row0 + BM, nrows) - 1) / p.R);

  load_q_rows<T, D, BM, NT>(Qs, static_cast<const T*>(p.q), q0, row0, nrows, p, g);
  Chunk cur = walk.chunk(p, 0);
  load_kv_rows<T, D, NT>(Ks, K, cur.k0, cur.nvalid, g, p.G);
  load_kv_rows<T, D, NT>(Vs, V, cur.k0, cur.nvalid, g, p.G);
  cp_async_commit();
  // The walk reads the index from global memory; each position is read one iteration before
  // its loads are issued, so that latency hides behind a chunk's products.
  Chunk nxt = walk.chunk(p, min(1, walk.n_total - 1));
  // This lane's rows: wrow + 16 mi + 8 h, and their token offsets inside the block.
  const int wrow = row0 + warp * WM + lane / 4;
  int tok[MI][2];
  float m[MI][2], l[MI][2];
#pragma unroll
  for (int mi = 0; mi < MI; ++mi)
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      tok[mi][h] = (wrow + WARP_ROWS * mi + 8 * h) / p.R;
      m[mi][h] = -INFINITY;
      l[mi][h] = 0.f;
    }
  float o[MI][D / 8][4];
  zero(o);

  for (int it = 0; it < walk.n_total; ++it) {
    const int buf = it & 1;
    cp_async_wait_all();
    __syncthreads();  // chunk `it` is visible, and every warp is done with chunk it-1's buffer
    if (it + 1 < walk.n_total) {
      load_kv_rows<T, D, NT>(Ks + (buf ^ 1) * CHUNK * LD, K, nxt.k0, nxt.nvalid, g, p.G);
      load_kv_rows<T, D, NT>(Vs + (buf ^ 1) * CHUNK * LD, V, nxt.k0, nxt.nvalid, g, p.G);
      cp_async_commit();
    }
    const Chunk after = walk.chunk(p, min(it + 2, walk.n_total - 1));
    const int nvalid = cur.nvalid, kt0 = cur.kt0;
    float s[MI][NJ][4];
    zero(s);
    warp_mm_nt<T, MI, CHUNK, D>(s, Qs + warp * WM * LD, LD, Ks + buf * CHUNK * LD, LD, lane);

    const bool diag = it >= walk.n_off;
#pragma unroll
    for (int mi = 0; mi < MI; ++mi) {
      float mx[2] = {-INFINITY, -INFINITY};
#pragma unroll
      for (int j = 0; j < NJ; ++j)
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          float x = s[mi][j][e] * p.scale_log2;
          if (diag) {
            const int col = 8 * j + 2 * (lane % 4) + (e & 1);
            if (col >= nvalid || kt0 + col > tok[mi][e / 2]) x = -INFINITY;
          }
          s[mi][j][e] = x;
          mx[e / 2] = fmaxf(mx[e / 2], x);
        }
      float alpha[2], m_use[2];
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const float m_new = fmaxf(m[mi][h], quad_max(mx[h]));
        m_use[h] = m_new == -INFINITY ? 0.f : m_new;  // a row with nothing visible yet
        alpha[h] = exp2f(m[mi][h] - m_use[h]);
        m[mi][h] = m_new;
        l[mi][h] *= alpha[h];
      }
#pragma unroll
      for (int j = 0; j < NJ; ++j)
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          s[mi][j][e] = exp2f(s[mi][j][e] - m_use[e / 2]);
          l[mi][e / 2] += s[mi][j][e];  // this lane's share of the row sum; reduced at the end
        }
#pragma unroll
      for (int j = 0; j < D / 8; ++j)
#pragma unroll
        for (int e = 0; e < 4; ++e) o[mi][j][e] *= alpha[e / 2];
    }
    uint32_t pa[MI][CHUNK / 16][4];
    to_a_frags<T, MI, CHUNK>(pa, s);
    warp_mm_rn<T, MI, D, CHUNK>(o, pa, Vs + buf * CHUNK * LD, LD, lane);
    cur = nxt;
    nxt = after;
  }

#pragma unroll
  for (int mi = 0; mi < MI; ++mi)
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int gr = wrow + WARP_ROWS * mi + 8 * h;
      const float lsum = quad_sum(l[mi][h]);
      if (gr >= nrows) continue;
      const float inv = 1.f / lsum;
      const int64_t off = (int64_t)(q0 + tok[mi][h]) * p.HQ + g * p.R + gr % p.R;
      uint32_t* out = reinterpret_cast<uint32_t*>(static_cast<T*>(p.out) + off * D + 2 * (lane % 4));
#pragma unroll
      for (int j = 0; j < D / 8; ++j) out[4 * j] = pack2<T>(o[mi][j][2 * h] * inv, o[mi][j][2 * h + 1] * inv);
      if (lane % 4 == 0) p.lse[off] = m[mi][h] + log2f(lsum);
    }
}

// delta[t, h] = sum_d o * do. A row is D / 8 threads' 16-byte vectors, and each thread loads
// DELTA_ROWS rows before it sums any, so a CTA keeps 2 x DELTA_ROWS x 4 KB in flight. One warp
// per row with 2-byte loads read the 235 MB of O and dO at 0.5B, 64K tokens in 0.12 ms, half
// of what HBM gives.
constexpr int DELTA_THREADS = 256, DELTA_ROWS = 4;

template <int D>
constexpr int delta_rows_per_cta() { return DELTA_THREADS / (D / 8) * DELTA_ROWS; }

template <typename T, int D>
__global__ void __launch_bounds__(DELTA_THREADS) delta_kernel(const T* O, const T* dO, float* delta, int64_t nrows) {
  constexpr int VECS = D / 8, PASS = DELTA_THREADS / VECS;  // rows of one pass of the CTA
  const int part = threadIdx.x % VECS;
  const int64_t row0 = (int64_t)blockIdx.x * delta_rows_per_cta<D>() + threadIdx.x / VECS;
  uint4 o[DELTA_ROWS], d[DELTA_ROWS];
#pragma unroll
  for (int j = 0; j < DELTA_ROWS; ++j) {
    const int64_t r = row0 + j * PASS;
    o[j] = d[j] = make_uint4(0, 0, 0, 0);
    if (r < nrows) {
      o[j] = __ldg(reinterpret_cast<const uint4*>(O + r * D) + part);
      d[j] = __ldg(reinterpret_cast<const uint4*>(dO + r * D) + part);
    }
  }
#pragma unroll
  for (int j = 0; j < DELTA_ROWS; ++j) {
    const uint32_t* ov = reinterpret_cast<const uint32_t*>(&o[j]);
    const uint32_t* dv = reinterpret_cast<const uint32_t*>(&d[j]);
    float s = 0.f;
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      const float2 a = unpack2<T>(ov[e]), b = unpack2<T>(dv[e]);
      s = fmaf(a.x, b.x, fmaf(a.y, b.y, s));
    }
#pragma unroll
    for (int m = VECS / 2; m > 0; m /= 2) s += __shfl_xor_sync(0xffffffffu, s, m);  // the row's VECS lanes
    const int64_t r = row0 + j * PASS;
    if (part == 0 && r < nrows) delta[r] = s;
  }
}

// ---- dQ -------------------------------------------------------------------------------------------
// Grid and rows as the forward: S = Q K^T, dP = dO V^T, dS = P (dP - delta), dQ += dS K, all per
// warp slice in registers.
template <typename T, int D, int NW, int MI>
__global__ void __launch_bounds__(NW * 32) dq_kernel(Params p) {
  constexpr int NT = NW * 32, WM = MI * WARP_ROWS, BM = NW * WM, LD = D + PAD, NJ = CHUNK / 8;
  extern __shared__ __align__(128) unsigned char smem[];
  T* Qs = reinterpret_cast<T*>(smem);
  T* dOs = Qs + BM * LD;
  T* Ks = dOs + BM * LD;  // two buffers each
  T* Vs = Ks + 2 * CHUNK * LD;

  const int tiles = (p.block * p.R + BM - 1) / BM;
  const int qb = blockIdx.x / tiles, g = blockIdx.y;
  const int row0 = (blockIdx.x % tiles) * BM;
  const int q0 = p.bstart[qb], qlen = p.bend[qb] - q0, nrows = qlen * p.R;
  if (row0 >= nrows) return;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const T* K = static_cast<const T*>(p.k);
  const T* V = static_cast<const T*>(p.v);
  const KvWalk<> walk(p, g, qb, q0, qlen, (min(row0 + BM, nrows) - 1) / p.R);

  load_q_rows<T, D, BM, NT>(Qs, static_cast<const T*>(p.q), q0, row0, nrows, p, g);
  load_q_rows<T, D, BM, NT>(dOs, static_cast<const T*>(p.dout), q0, row0, nrows, p, g);
  Chunk cur = walk.chunk(p, 0);
  load_kv_rows<T, D, NT>(Ks, K, cur.k0, cur.nvalid, g, p.G);
  load_kv_rows<T, D, NT>(Vs, V, cur.k0, cur.nvalid, g, p.G);
  cp_async_commit();
  // The walk reads the index from global memory; each position is read one iteration before
  // its loads are issued, so that latency hides behind a chunk's products.
  Chunk nxt = walk.chunk(p, min(1, walk.n_total - 1));
  const int wrow = row0 + warp * WM + lane / 4;
  int tok[MI][2];
  float lse[MI][2], dl[MI][2];
#pragma unroll
  for (int mi = 0; mi < MI; ++mi)
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int gr = wrow + WARP_ROWS * mi + 8 * h;
      tok[mi][h] = gr / p.R;
      lse[mi][h] = INFINITY;  // rows past the block: P = 0
      dl[mi][h] = 0.f;
      if (gr < nrows) {
        const int64_t off = (int64_t)(q0 + tok[mi][h]) * p.HQ + g * p.R + gr % p.R;
        lse[mi][h] = p.lse[off];
        dl[mi][h] = p.delta[off];
      }
    }
  float dq[MI][D / 8][4];
  zero(dq);

  for (int it = 0; it < walk.n_total; ++it) {
    const int buf = it & 1;
    cp_async_wait_all();
    __syncthreads();
    if (it + 1 < walk.n_total) {
      load_kv_rows<T, D, NT>(Ks + (buf ^ 1) * CHUNK * LD, K, nxt.k0, nxt.nvalid, g, p.G);
      load_kv_rows<T, D, NT>(Vs + (buf ^ 1) * CHUNK * LD, V, nxt.k0, nxt.nvalid, g, p.G);
      cp_async_commit();
    }
    const Chunk after = walk.chunk(p, min(it + 2, walk.n_total - 1));
    const int nvalid = cur.nvalid, kt0 = cur.kt0;
    const T* Kc = Ks + buf * CHUNK * LD;
    float s[MI][NJ][4], dp[MI][NJ][4];
    zero(s);
    zero(dp);
    warp_mm_nt<T, MI, CHUNK, D>(s, Qs + warp * WM * LD, LD, Kc, LD, lane);
    warp_mm_nt<T, MI, CHUNK, D>(dp, dOs + warp * WM * LD, LD, Vs + buf * CHUNK * LD, LD, lane);
    const bool diag = it >= walk.n_off;
#pragma unroll
    for (int mi = 0; mi < MI; ++mi)
#pragma unroll
      for (int j = 0; j < NJ; ++j)
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          float x = s[mi][j][e] * p.scale_log2;
          if (diag) {
            const int col = 8 * j + 2 * (lane % 4) + (e & 1);
            if (col >= nvalid || kt0 + col > tok[mi][e / 2]) x = -INFINITY;
          }
          const float pr = exp2f(x - lse[mi][e / 2]);
          dp[mi][j][e] = pr * (dp[mi][j][e] - dl[mi][e / 2]);
        }
    uint32_t da[MI][CHUNK / 16][4];
    to_a_frags<T, MI, CHUNK>(da, dp);
    warp_mm_rn<T, MI, D, CHUNK>(dq, da, Kc, LD, lane);
    cur = nxt;
    nxt = after;
  }

#pragma unroll
  for (int mi = 0; mi < MI; ++mi)
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int gr = wrow + WARP_ROWS * mi + 8 * h;
      if (gr >= nrows) continue;
      const int64_t off = (int64_t)(q0 + tok[mi][h]) * p.HQ + g * p.R + gr % p.R;
      uint32_t* out = reinterpret_cast<uint32_t*>(static_cast<T*>(p.dq) + off * D + 2 * (lane % 4));
#pragma unroll
      for (int j = 0; j < D / 8; ++j)
        out[4 * j] = pack2<T>(dq[mi][j][2 * h] * p.scale, dq[mi][j][2 * h + 1] * p.scale);
    }
}

// ---- dK/dV -----------------------------------------------------------------------------------------
// The query tiles one KV chunk visits, from the last query block of its transposed CSR row to the
// first, which is the diagonal block, entered at the first tile that can see the chunk. Walking
// from the end was measured on the Triton kernel: CTAs of neighbouring KV blocks then share
// their first query tiles in L2 (hit rate 24% -> 44% at 3B, 32K).
template <int QT>
struct QueryWalk {
  int kb, p0, e, diag_r0, q0, qrows, r0;

  __device__ QueryWalk(const Params& p, int g, int kb_, int n0) : kb(kb_) {
    p0 = p.q_ptr[g * p.NB + kb];
    e = p.q_ptr[g * p.NB + kb + 1] - p0 - 1;
    diag_r0 = (n0 * p.R) / QT * QT;
    if (e >= 0) enter(p);
  }
  __device__ bool done() const { return e < 0; }
  __device__ bool diag() const { return e == 0; }
  __device__ void next(const Params& p) {
    r0 += QT;
    if (r0 >= qrows && --e >= 0) enter(p);
  }

 private:
  __device__ void enter(const Params& p) {
    const int qb = e == 0 ? kb : p.q_idx[p0 + e];
    q0 = p.bstart[qb];
    qrows = (p.bend[qb] - q0) * p.R;
    r0 = e == 0 ? diag_r0 : 0;
  }
};

// Grid (NB * block / CHUNK, G); CTA of CHUNK / 16 warps, each owning 16 keys of the chunk, over
// query tiles of QT rows. Scores are computed transposed (keys x query rows): S^T = K Q^T,
// dP^T = V dO^T, then dV += P^T dO and dK += dS^T Q, with P^T and dS^T repacked in registers as
// A fragments. dK and dV hold 2 D / 8 x 4 accumulators per lane already; QT sets what the scores
// add on top, and so how far ahead the compiler can load operands. A second 16-key slice per
// warp (MI = 2) spilled even at head dim 64 (ptxas, 64-row query tiles).
template <typename T, int D, int QT>
__global__ void __launch_bounds__(CHUNK / WARP_ROWS * 32) dkdv_kernel(Params p) {
  constexpr int MI = 1, WM = MI * WARP_ROWS, NT = CHUNK / WM * 32, LD = D + PAD, NJ = QT / 8;
  extern __shared__ __align__(128) unsigned char smem[];
  T* Ks = reinterpret_cast<T*>(smem);
  T* Vs = Ks + CHUNK * LD;
  T* Qs = Vs + CHUNK * LD;    // two buffers of QT query rows each
  T* dOs = Qs + 2 * QT * LD;  // two buffers
  float* lse_s = reinterpret_cast<float*>(dOs + 2 * QT * LD);  // [2][QT]
  float* dl_s = lse_s + 2 * QT;                                // [2][QT]

  const int nsub = p.block / CHUNK;
  const int kb = blockIdx.x / nsub, g = blockIdx.y;
  const int n0 = (blockIdx.x % nsub) * CHUNK;
  const int b0 = p.bstart[kb], blen = p.bend[kb] - b0;
  if (n0 >= blen) return;
  const int nvalid = min(CHUNK, blen - n0);
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const T* Q = static_cast<const T*>(p.q);
  const T* dO = static_cast<const T*>(p.dout);

  // Query tile of the walk's position into buffer `buf`, all by cp.async. Rows past the block get
  // zero Q, dO, lse and delta: their P is then 1, but it multiplies dO = 0 in dV, and their
  // dS = P (dP - delta) is 0 since dP = V dO^T = 0, so they add nothing.
  auto load_tile = [&](const QueryWalk<QT>& w, int buf) {
    load_q_rows<T, D, QT, NT>(Qs + buf * QT * LD, Q, w.q0, w.r0, w.qrows, p, g);
    load_q_rows<T, D, QT, NT>(dOs + buf * QT * LD, dO, w.q0, w.r0, w.qrows, p, g);
    for (int i = threadIdx.x; i < 2 * QT; i += NT) {
      const int r = i % QT, gr = w.r0 + r;
      const bool valid = gr < w.qrows;
      const int64_t off = valid ? (int64_t)(w.q0 + gr / p.R) * p.HQ + g * p.R + gr % p.R : 0;
      if (i < QT)
        cp_async4(lse_s + buf * QT + r, p.lse + off, valid);
      else
        cp_async4(dl_s + buf * QT + r, p.delta + off, valid);
    }
    cp_async_commit();
  };

  load_kv_rows<T, D, NT>(Ks, static_cast<const T*>(p.k), b0 + n0, nvalid, g, p.G);
  load_kv_rows<T, D, NT>(Vs, static_cast<const T*>(p.v), b0 + n0, nvalid, g, p.G);
  QueryWalk<QT> walk(p, g, kb, n0);
  if (!walk.done()) load_tile(walk, 0);
  QueryWalk<QT> ahead = walk;  // read one iteration early, as in the forward
  ahead.next(p);

  const int key_tok = n0 + warp * WM + lane / 4;  // this lane's keys: key_tok + 16 mi + 8 h
  float dk[MI][D / 8][4], dv[MI][D / 8][4];
  zero(dk);
  zero(dv);
  for (int buf = 0; !walk.done(); buf ^= 1) {
    const bool diag = walk.diag();
    const int r0 = walk.r0;
    cp_async_wait_all();
    __syncthreads();  // tile `buf` is visible, and every warp is done with the other buffer
    if (!ahead.done()) load_tile(ahead, buf ^ 1);
    QueryWalk<QT> after = ahead;
    if (!after.done()) after.next(p);
    const T* Qc = Qs + buf * QT * LD;
    const T* dOc = dOs + buf * QT * LD;
    const float* lse_c = lse_s + buf * QT;
    const float* dl_c = dl_s + buf * QT;

    float st[MI][NJ][4], dpt[MI][NJ][4];
    zero(st);
    zero(dpt);
    warp_mm_nt2<T, MI, QT, D>(st, Ks + warp * WM * LD, Qc, dpt, Vs + warp * WM * LD, dOc, LD, lane);
#pragma unroll
    for (int mi = 0; mi < MI; ++mi)
#pragma unroll
      for (int j = 0; j < NJ; ++j)
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const int col = 8 * j + 2 * (lane % 4) + (e & 1);
          float x = st[mi][j][e] * p.scale_log2;
          if (diag && key_tok + WARP_ROWS * mi + 8 * (e / 2) > (r0 + col) / p.R) x = -INFINITY;
          const float pr = exp2f(x - lse_c[col]);
          st[mi][j][e] = pr;
          dpt[mi][j][e] = pr * (dpt[mi][j][e] - dl_c[col]);
        }
    uint32_t pa[MI][QT / 16][4], da[MI][QT / 16][4];
    to_a_frags<T, MI, QT>(pa, st);
    to_a_frags<T, MI, QT>(da, dpt);
    warp_mm_rn<T, MI, D, QT>(dv, pa, dOc, LD, lane);
    warp_mm_rn<T, MI, D, QT>(dk, da, Qc, LD, lane);
    walk = ahead;
    ahead = after;
  }

#pragma unroll
  for (int mi = 0; mi < MI; ++mi)
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int key = key_tok + WARP_ROWS * mi + 8 * h - n0;
      if (key >= nvalid) continue;
      const int64_t off = ((int64_t)(b0 + n0 + key) * p.G + g) * D + 2 * (lane % 4);
      uint32_t* dk_out = reinterpret_cast<uint32_t*>(static_cast<T*>(p.dk) + off);
      uint32_t* dv_out = reinterpret_cast<uint32_t*>(static_cast<T*>(p.dv) + off);
#pragma unroll
      for (int j = 0; j < D / 8; ++j) {
        dk_out[4 * j] = pack2<T>(dk[mi][j][2 * h] * p.scale, dk[mi][j][2 * h + 1] * p.scale);
        dv_out[4 * j] = pack2<T>(dv[mi][j][2 * h], dv[mi][j][2 * h + 1]);
      }
    }
}

// Dynamic shared memory of each kernel, in bytes.
template <typename T, int D, int BM>
constexpr size_t fwd_smem() {
  return sizeof(T) * (BM + 4 * CHUNK) * (D + PAD);
}
template <typename T, int D, int BM>
constexpr size_t dq_smem() {
  return sizeof(T) * (2 * BM + 4 * CHUNK) * (D + PAD);
}
template <typename T, int D, int QT>
constexpr size_t dkdv_smem() {
  return sizeof(T) * (2 * CHUNK + 4 * QT) * (D + PAD) + sizeof(float) * 4 * QT;
}

}  // namespace kernels
}  // namespace sparsebalance
