// Hopper kernels of the CUDA block-sparse attention: the same contract and walks as
// attention_kernels.cuh, with the products on wgmma (wgmma.cuh) instead of mma.sync.
//
// Why: mma.sync loads both operands into registers through ldmatrix, and a warp waits for each
// product before the next that accumulates into the same registers. wgmma reads its B operand
// (and A, unless it comes from registers) straight from shared memory and runs asynchronously:
// a warpgroup issues a whole chain of products at once, computes on while the later ones run
// (P while dP^T runs, dS while dV's products run), and the warpgroups of a CTA interleave on
// the tensor cores.
//
// What set their speed, measured on one H200 (docs/HISTORY.md): the order in which CTAs start
// (the longest first, see the grids below); warp specialisation (a producer warpgroup copies,
// two or three consumers multiply, and mbarriers rather than CTA barriers pass the buffers, so
// the consumers drift apart and one's exponentials overlap another's products); and the
// instructions around the products, since two or three consumer warps per scheduler are all
// there is to issue from: no integer division by R,
// copies whose addresses are set up once per CTA, the causal mask compiled only into the
// diagonal block's steps, the softmax scale folded into the exponential's multiply-add, wgmma
// descriptors the compiler can keep in uniform registers (warpgroup_index), O rescaled only when
// a row's maximum has grown far (the forward), dS as a 16-bit product (dK/dV). Products
// in flight across a loop's back edge, or waits that ptxas cannot match to their products on
// every path, make it serialise every wgmma of the loop (warnings C7515, C7514): each
// warpgroup waits for all of its products within a step.
//
// All three are warp-specialised. The forward and dQ run for every block size; dK/dV where a
// block holds whole chunks of its KV_ROWS keys (block 128 and 256). The host dispatch
// (attention.cu) keeps the mma.sync kernels for the rest and for other GPUs.
#pragma once

#include <cuda.h>  // CUtensorMap (a type only: the host encodes the maps through the runtime)

#include <cmath>

#include "cuda/attention_kernels.cuh"
#include "cuda/wgmma.cuh"

namespace sparsebalance {
namespace kernels {
namespace sm90 {

constexpr int WG_THREADS = 128;  // one warpgroup
constexpr int WG_ROWS = 64;      // rows of one wgmma tile (m64)

// Registers per thread of a CTA launched with __launch_bounds__(threads, 1): the SM's 64K over
// its threads, rounded down to 8 (168 for three warpgroups, 128 for four).
constexpr int launch_registers(int threads) { return 65536 / threads / 8 * 8; }

// Whether one producer warpgroup at `producer` registers and `consumers` warpgroups at `consumer`
// fit that pool. setmaxnreg only moves registers within it: asking for more hangs the consumers.
constexpr bool fits_register_pool(int producer, int consumer, int consumers) {
  const int threads = (consumers + 1) * WG_THREADS;
  return WG_THREADS * (producer + consumers * consumer) <= threads * launch_registers(threads);
}

// This thread's warpgroup and its warp in it, read from lane 0 so that the compiler knows them to
// be the same in every lane of a warp: the wgmma descriptors derived from them then live in
// uniform registers. Computed from threadIdx in each lane, they took vector registers, and the
// descriptors were moved over for every product or worked out again in the loop: dK/dV's step
// took 8% more instructions at head dim 64 and 29% more at 128, dQ's 34% more at 128.
__device__ __forceinline__ int warpgroup_index() { return __shfl_sync(0xffffffffu, threadIdx.x / WG_THREADS, 0); }
__device__ __forceinline__ int warp_in_warpgroup() {
  return __shfl_sync(0xffffffffu, threadIdx.x % WG_THREADS / 32, 0);
}

// A barrier of the two consumer warpgroups of dK/dV alone (named barrier 1; 0 is the CTA's).
__device__ __forceinline__ void consumer_barrier() { asm volatile("bar.sync 1, 256;\n" ::: "memory"); }
// A barrier of one consumer warpgroup of the forward or dQ (named barriers 2, 3, 4).
__device__ __forceinline__ void warpgroup_barrier(int wg) {
  asm volatile("bar.sync %0, 128;\n" ::"r"(2 + wg) : "memory");
}

template <int ROWS>
struct Swizzled128 {
  __device__ static int offset(int r, int c) { return sw128_offset<ROWS>(r, c); }
};

// The mbarriers of a warp-specialised CTA (one producer warpgroup, `consumers` consumers): per
// stage "full" (every producer thread's copies landed) and "empty" (every consumer thread is done
// with the buffer), and `once` for the operands copied once. Every thread calls it.
__device__ __forceinline__ void init_ws_barriers(uint64_t* full, uint64_t* empty, int stages, uint64_t* once,
                                                 int consumers) {
  if (threadIdx.x == 0) {
    for (int s = 0; s < stages; ++s) {
      mbar_init(full + s, WG_THREADS);
      mbar_init(empty + s, consumers * WG_THREADS);
    }
    mbar_init(once, WG_THREADS);
    mbar_init_fence();
  }
  __syncthreads();
}

// ---- dK/dV ----------------------------------------------------------------------------------------
// Linear grid of NB * block / KV_ROWS * G CTAs; CTA of three warpgroups: a producer that copies
// the chunk's K and V once and then the walk's query tiles of QT rows (BoxWalk) into a ring of
// STAGES buffers, and two consumers, each owning 64 of the chunk's KV_ROWS keys (M of every
// product), over the query tiles (N of the score products, K of the gradient products). Per
// tile, in each consumer:
//   S^T = K Q^T and dP^T = V dO^T   (shared x shared, two commit groups)
//   P = exp2(S^T - lse), once S^T is done, while dP^T still runs
//   dS^T = P (dP^T - delta)
//   dV += P^T dO and dK += dS^T Q  (registers x shared, dO and Q read transposed)
// Buffers pass on mbarriers as in the forward and dQ below ("full": the producer's copies
// landed; "empty": both consumers are done with it), so no CTA barrier is left in the loop and
// the consumers drift apart: one's softmax runs while the other's products do.
//
// The consumers hold dK and dV in fp32 for the whole walk, 2 D / 8 x 4 registers per thread, and
// setmaxnreg moves registers to them from the producer, which needs few: 232 at head dim 64, 240
// at 128, where dK and dV alone take 128 (the producer keeps 40 and 24: its copies are TMA boxes
// and lse and delta). Head dim 64 leaves room for query tiles of 128 rows, which halve the
// products' shared-memory reads per score of K and V.
template <typename T, int D>
struct DkdvTiles {
  static constexpr int KV_ROWS = 2 * WG_ROWS, QT = D == 64 ? 128 : 64, STAGES = 4;
  // 128 x 40 + 256 x 232 = 128 x 24 + 256 x 240 = the whole pool.
  static constexpr int THREADS = 3 * WG_THREADS, PRODUCER_REGS = D == 64 ? 40 : 24,
                       CONSUMER_REGS = D == 64 ? 232 : 240;
  static_assert(fits_register_pool(PRODUCER_REGS, CONSUMER_REGS, 2), "register pool");
  static constexpr size_t smem_bytes() {
    return SW_ALIGN + sizeof(T) * (2 * KV_ROWS + 2 * STAGES * QT) * D + sizeof(float) * 2 * STAGES * QT +
           sizeof(uint64_t) * (2 * STAGES + 1);
  }
};

// This thread's share of a copy of ROWS rows of D 16-bit values into a swizzled tile by NT
// threads: the 16-byte vector at column c of rows r + j ROW_STEP, j < N. ROW_STEP is a multiple
// of the swizzle's 8 rows, so the shared offsets of a thread's vectors differ by constants
// (smem_off + step(j)): set up once, a vector costs an address add and a copy.
template <int D, int NT, int ROWS>
struct CopySlice {
  static constexpr int VECS = D / 8, ROW_STEP = NT / VECS, N = ROWS / ROW_STEP;
  static_assert(NT % VECS == 0 && ROW_STEP % 8 == 0 && ROWS % ROW_STEP == 0, "whole swizzle patterns per step");
  int c, r, smem_off;
  __device__ CopySlice() : c((threadIdx.x % VECS) * 8), r(threadIdx.x / VECS), smem_off(sw128_offset<ROWS>(r, c)) {}
  __device__ static constexpr int step(int j) { return j * ROW_STEP * SW_COLS; }
};

// The TMA maps of dK/dV's operands, boxes of 64 columns (one slab of a swizzled tile, see
// attention.cu's row_slab_map): Q and dO of a query tile's heads and tokens, K and V of KV_ROWS
// tokens of one head.
struct DkdvMaps {
  CUtensorMap q, dout, k, v;
};

// The TMA maps of the forward's and dQ's K/V chunks: boxes of CH tokens of one head by 64 columns.
struct ChunkMaps {
  CUtensorMap k, v;
};

// Two swizzled tiles of ROWS rows by D columns, a from map_a and b from map_b at head h and token
// t, by TMA: one box per 64-column slab of each, their bytes announced on `bar` first. Issued by
// one thread; the caller's others only arrive on `bar`.
template <typename T, int D, int ROWS>
__device__ __forceinline__ void tma_load_tile_pair(T* a, T* b, const CUtensorMap* map_a, const CUtensorMap* map_b,
                                                   int h, int t, uint64_t* bar) {
  mbar_expect_tx(bar, 2 * ROWS * D * sizeof(T));
#pragma unroll
  for (int c = 0; c < D; c += SW_COLS) {
    tma_load_3d(a + c * ROWS, map_a, c, h, t, bar);
    tma_load_3d(b + c * ROWS, map_b, c, h, t, bar);
  }
}

// Heads per dK/dV query tile: a tile of QT rows is QT / R whole tokens of the group's R heads
// where R divides QT (the rows the forward and dQ pack), else QT tokens of one head. Either is one
// box of a TMA copy. Packed tiles at other R would start inside a token (R = 7 at 0.5B), and the
// producer then copied row by row: a quarter of the kernel's instructions, on the consumers'
// schedulers. The host shapes the maps' boxes by the same rule.
__host__ __device__ constexpr int dkdv_tile_heads(int qt, int R) { return qt % R == 0 ? R : 1; }

// The query tiles of a dK/dV CTA: for each query block of its part [lo, hi) of its KV block's
// list (the transposed index, walked from the end, so the diagonal block, entry 0, comes last),
// tiles of `heads` heads (from head h of the group) by QT / heads tokens (from token t of the
// block). In the diagonal block the walk starts at the first tile that reaches the chunk's keys
// (n0); earlier rows see none.
template <int QT>
struct BoxWalk {
  int kb, p0, e, lo, heads, tokens, t_diag;
  int q0, qlen;  // the query block: tokens [q0, q0 + qlen)
  int h, t;      // the tile's first head (of the group) and first token (of the block)

  __device__ BoxWalk(const Params& p, int g, int kb_, int n0, int lo_, int hi)
      : kb(kb_), e(hi - 1), lo(lo_), heads(dkdv_tile_heads(QT, p.R)), tokens(QT / heads),
        t_diag(n0 / tokens * tokens) {
    p0 = p.q_ptr[g * p.NB + kb];
    if (e >= lo) enter(p);
  }
  __device__ bool done() const { return e < lo; }
  __device__ bool diag() const { return e == 0; }
  // Block-relative token of the tile's row i (i / R by div_r where tiles pack the heads).
  __device__ int token(int i, const Params& p) const { return t + (heads == 1 ? i : div_r(i, p)); }
  // How many of the tile's rows hold tokens before block-relative token `tok`: token(i) < tok
  // for i < (tok - t) heads (none where that is negative).
  __device__ int rows_before(int tok) const { return (tok - t) * heads; }
  __device__ void next(const Params& p) {
    t += tokens;
    if (t < qlen) return;
    t = e == 0 ? t_diag : 0;
    h += heads;
    if (h == p.R && --e >= lo) enter(p);
  }

 private:
  __device__ void enter(const Params& p) {
    const int qb = e == 0 ? kb : p.q_idx[p0 + e];
    q0 = p.bstart[qb];
    qlen = p.bend[qb] - q0;
    h = 0;
    t = e == 0 ? t_diag : 0;
  }
};

// lse of a query row past its block: P = exp2(S - inf) = 0, so the row (whose Q and dO the TMA
// box takes from the next tokens, or zeros past the tensor) adds nothing to dK and dV.
static __device__ float past_block_lse = INFINITY;

// The walk's query tile into one stage: Q and dO by TMA from thread 0 (counted on `full`'s
// transaction bytes), lse and delta of its rows by cp.async from the NT threads that call it.
template <typename T, int D, int QT, int NT>
__device__ __forceinline__ void load_query_tile(T* q_dst, T* do_dst, float* lse_dst, float* dl_dst, uint64_t* full,
                                                const DkdvMaps& maps, const BoxWalk<QT>& w, int g,
                                                const Params& p) {
  const int head0 = g * p.R + w.h;
  if (threadIdx.x == 0) tma_load_tile_pair<T, D, QT>(q_dst, do_dst, &maps.q, &maps.dout, head0, w.q0 + w.t, full);
  static_assert(QT <= NT, "one lse and delta value per thread");
  if (threadIdx.x < QT) {
    const int i = threadIdx.x, tok = w.token(i, p);
    const bool valid = tok < w.qlen;
    const int64_t row = (int64_t)(w.q0 + tok) * p.HQ + head0 + (i - (tok - w.t) * w.heads);
    cp_async4(lse_dst + i, valid ? p.lse + row : &past_block_lse, true);
    cp_async4(dl_dst + i, p.delta + row, valid);
  }
}

// acc = A[a_row0, +64) . B^T over the head dim, both K-major tiles in shared memory (A of A_ROWS
// rows, B of N), issued as one committed wgmma group: the scores S = Q K^T and dP = dO V^T of
// every kernel here (transposed in dK/dV, where the keys are the A side).
template <typename T, int D, int A_ROWS, int N>
__device__ __forceinline__ void product_over_head_dim(float (&acc)[N / 8][4], uint64_t a_desc, int a_row0,
                                                      uint64_t b_desc) {
#pragma unroll
  for (int k = 0; k < D; k += 16)
    wgmma_ss<T, N>(acc, kmajor_at<T, A_ROWS>(a_desc, a_row0, k), kmajor_at<T, N>(b_desc, 0, k), k > 0);
  wgmma_commit();
}

// A warp's A fragments (to_a_frags' order) of the 16 rows from row0 of a swizzled tile of ROWS
// rows and D columns, one ldmatrix per 16 columns (each lane names one 16-byte row segment, as
// in warp_mm_nt): an operand that stays in registers for a whole walk.
template <typename T, int D, int ROWS>
__device__ __forceinline__ void load_a_frags(uint32_t (&a)[D / 16][4], const T* tile, int row0, int lane) {
#pragma unroll
  for (int s = 0; s < D / 16; ++s) ldsm_x4(a[s], tile + sw128_offset<ROWS>(row0 + lane % 16, 16 * s + (lane / 16) * 8));
}

// product_over_head_dim with A in registers (load_a_frags): only B is read from shared memory.
template <typename T, int D, int N>
__device__ __forceinline__ void product_over_head_dim_rs(float (&acc)[N / 8][4], const uint32_t (&a)[D / 16][4],
                                                         uint64_t b_desc) {
#pragma unroll
  for (int k = 0; k < D; k += 16) wgmma_rs<T, N>(acc, a[k / 16], kmajor_at<T, N>(b_desc, 0, k), k > 0);
  wgmma_commit();
}

// ---- Stored dS ----------------------------------------------------------------------------------
// The stored-dS backward: dK/dV writes each dS tile it forms to global memory, and dQ = dS K is
// then one product a tile (dq_from_ds_kernel) instead of the two-pass dQ's three (S and dP formed
// again, and every exponential a second time). It trades the two products for dS's bytes, written
// once and read once: R * block * 128 16-bit values per (group, query block, KV block) of the
// route, block 128 only (DS_KEYS keys a tile).
//
// A route entry's tile is one slot, at its place in the transposed lists (q_ptr + e, which the
// dK/dV walk knows; transpose_index's slots give it to the route's walk). A slot's rows are the
// dK/dV query tiles in order (rows h block + t heads of its tile (h, t), BoxWalk), and its values
// are grouped by 16 x 16 sub-blocks: the sub-block of rows 16 r and keys 16 c holds, for each
// lane l, the A fragment of dS that lane l of an m64 wgmma's warp takes (mma's order: rows l / 4
// and + 8, keys 2 (l % 4), + 1 and + 8), 16 bytes at 8 (32 (8 r + c) + l) values. dK/dV holds
// dS transposed (keys as rows) in exactly these registers, so each of its 8 x 8 matrices is one
// movmatrix away; dQ's warps read their fragments back as 16-byte vectors, a warp 512
// contiguous bytes, after one bulk copy of a whole 128-row tile.
constexpr int DS_KEYS = 128;
__host__ __device__ constexpr int64_t ds_slot_values(int R, int block) { return (int64_t)R * block * DS_KEYS; }

// A consumer's dS^T fragments (its 16 keys a warp by QT query rows) as dQ's warps take dS: 8 x 8
// matrix (key half kh, query half qh) of A fragment index kh + 2 qh becomes matrix (qh, kh),
// index qh + 2 kh. Into new registers, so that dK's product may read da meanwhile (an A operand
// in flight must not be touched) and the stores wait until it is issued: stored first, they held
// its issue back and the kernel took 2% longer (3B 64K 25%, one H200).
template <int QT>
__device__ __forceinline__ void transpose_ds_fragments(const uint32_t (&da)[1][QT / 16][4], uint4 (&ds)[QT / 16]) {
#pragma unroll
  for (int s = 0; s < QT / 16; ++s)
    ds[s] = make_uint4(movmatrix_trans(da[0][s][0]), movmatrix_trans(da[0][s][2]), movmatrix_trans(da[0][s][1]),
                       movmatrix_trans(da[0][s][3]));
}

// Those fragments into this consumer's sub-blocks of its tile, a warp's 512 contiguous bytes a store.
template <typename T, int QT>
__device__ __forceinline__ void store_ds_fragments(const uint4 (&ds)[QT / 16], T* ds_tile, int wg, int warp,
                                                   int lane) {
  T* const dst = ds_tile + 256 * (4 * wg + warp) + 8 * lane;
  // Streaming: dQ reads it after the whole dK/dV, long after L2 would have kept it.
#pragma unroll
  for (int s = 0; s < QT / 16; ++s) __stcs(reinterpret_cast<uint4*>(dst + 256 * 8 * s), ds[s]);
}

// One query tile of a consumer's 64 keys: the four products and the scores between them (the
// sequence in the comment above). dK's products are left in flight. DIAG masks the keys after
// each query row's token (key_tok counts from the walk's block).
// STORE_DS: dS also goes to ds_tile, as dq_from_ds_kernel reads it (below).
template <typename T, int D, int KV_ROWS, int QT, bool DIAG, bool STORE_DS>
__device__ __forceinline__ void dkdv_tile(float (&dk)[1][D / 8][4], float (&dv)[1][D / 8][4], uint64_t k_desc,
                                          uint64_t v_desc, const T* Qc, const T* dOc, const float* lse_c,
                                          const float* dl_c, const BoxWalk<QT>& walk, int wg, int warp,
                                          int key_tok, int lane, T* ds_tile, const Params& p) {
  constexpr int NJ = QT / 8;
  // Query tiles of 128 rows leave no room for P in fp32 beside dK, dV and dP^T: dS is then the
  // 16-bit product of P's A fragments and dP - delta rounded to 16 bits, which spares unpacking P
  // (two instructions a value) and packing dS: the step took 633 instructions at 0.5B, now 490.
  constexpr bool P_FROM_FRAGS = QT > 64;
  const uint64_t q_k = kmajor_tile<QT>(Qc), do_k = kmajor_tile<QT>(dOc);
  const uint64_t q_mn = mnmajor_tile<T, QT>(Qc), do_mn = mnmajor_tile<T, QT>(dOc);
  float st[1][NJ][4], dpt[1][NJ][4];
  // This lane's columns of the tile come in adjacent pairs: one 8-byte load of lse or delta per pair.
  const auto stat_pair = [&](const float* stat, int j) {
    return *reinterpret_cast<const float2*>(stat + 8 * j + 2 * (lane % 4));
  };
  // Head dim 128: lse is read before the products and delta while dP^T runs (16 registers each),
  // as FA4 orders them. Read after the waits, both loads queued behind the products' operand reads
  // in the shared-memory pipe: in ncu's profile of this step (the fused variant's, 3B 64K 25%) the
  // instructions that take them waited about 900 cycles a step, FA4's 380; read early, the two-pass
  // backward took 3-6% less at 3B 64K (docs/FA4.md). At head dim 64 (twice the columns, 64
  // registers for both) the 0.5B backward was 1-5% slower with both read early and no faster with
  // lse alone: the late reads stay there.
  constexpr bool STATS_EARLY = D == 128;
  float2 lse_r[STATS_EARLY ? NJ : 1], dl_r[STATS_EARLY ? NJ : 1];
  if constexpr (STATS_EARLY) {
#pragma unroll
    for (int j = 0; j < NJ; ++j) lse_r[j] = stat_pair(lse_c, j);
  }
  wgmma_fence();
  product_over_head_dim<T, D, KV_ROWS, QT>(st[0], k_desc, wg * WG_ROWS, q_k);
  product_over_head_dim<T, D, KV_ROWS, QT>(dpt[0], v_desc, wg * WG_ROWS, do_k);
  // The causal mask: this lane's column 8 j + 2 (lane % 4) + c (a query row of the tile) is
  // hidden from its key h where 8 j + c < visible[h], a comparison with a constant. Written with
  // each column's token (walk.token), the diagonal steps held 32 hoisted divisions by R in
  // registers, and any code added after the walk made them spill.
  int visible[2];
#pragma unroll
  for (int h = 0; h < 2; ++h) visible[h] = walk.rows_before(key_tok + 8 * h) - 2 * (lane % 4);
  wgmma_wait<1>();  // S^T done; dP^T may still run
#pragma unroll
  for (int j = 0; j < NJ; ++j) {
    const float2 lse2 = STATS_EARLY ? lse_r[j] : stat_pair(lse_c, j);
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      const float pe = exp2f(fmaf(st[0][j][e], p.scale_log2, -(e & 1 ? lse2.y : lse2.x)));
      st[0][j][e] = DIAG && 8 * j + (e & 1) < visible[e / 2] ? 0.f : pe;
    }
  }
  uint32_t pa[1][QT / 16][4];
  to_a_frags<T, 1, QT>(pa, st);
  wgmma_fence();
#pragma unroll
  for (int s = 0; s < QT / 16; ++s) wgmma_rs_tb<T, D>(dv[0], pa[0][s], mnmajor_at<T>(do_mn, 16 * s), true);
  wgmma_commit();
  if constexpr (STATS_EARLY) {
#pragma unroll
    for (int j = 0; j < NJ; ++j) dl_r[j] = stat_pair(dl_c, j);
  }
  wgmma_wait<1>();  // dP^T done; dV's products run on while dS is computed
  uint32_t da[1][QT / 16][4];
#pragma unroll
  for (int s = 0; s < QT / 16; ++s)
#pragma unroll
    for (int h = 0; h < 4; ++h) {  // dS = P (dP - delta), straight into A fragments (to_a_frags' order)
      const int j = 2 * s + h / 2, e0 = 2 * (h % 2);
      const float2 dl = STATS_EARLY ? dl_r[j] : stat_pair(dl_c, j);
      if constexpr (P_FROM_FRAGS)
        da[0][s][h] = mul2<T>(pa[0][s][h], pack2<T>(dpt[0][j][e0] - dl.x, dpt[0][j][e0 + 1] - dl.y));
      else
        da[0][s][h] = pack2<T>(st[0][j][e0] * (dpt[0][j][e0] - dl.x), st[0][j][e0 + 1] * (dpt[0][j][e0 + 1] - dl.y));
    }
  uint4 ds[STORE_DS ? QT / 16 : 1];
  if constexpr (STORE_DS) transpose_ds_fragments<QT>(da, ds);
  wgmma_fence();
#pragma unroll
  for (int s = 0; s < QT / 16; ++s) wgmma_rs_tb<T, D>(dk[0], da[0][s], mnmajor_at<T>(q_mn, 16 * s), true);
  wgmma_commit();
  if constexpr (STORE_DS) store_ds_fragments<T, QT>(ds, ds_tile, wg, warp, lane);
}

// dK (times the softmax scale) and dV of this lane's two keys, rows key0 and key0 + 8 of the
// chunk starting at token tok0 (keys >= nvalid are past the block: not written).
template <typename T, int D>
__device__ __forceinline__ void store_dkdv(const float (&dk)[1][D / 8][4], const float (&dv)[1][D / 8][4], int key0,
                                           int nvalid, int tok0, int g, int lane, const Params& p) {
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const int key = key0 + 8 * h;
    if (key >= nvalid) continue;
    const int64_t off = ((int64_t)(tok0 + key) * p.G + g) * D + 2 * (lane % 4);
    uint32_t* dk_out = reinterpret_cast<uint32_t*>(static_cast<T*>(p.dk) + off);
    uint32_t* dv_out = reinterpret_cast<uint32_t*>(static_cast<T*>(p.dv) + off);
#pragma unroll
    for (int j = 0; j < D / 8; ++j) {
      dk_out[4 * j] = pack2<T>(dk[0][j][2 * h] * p.scale, dk[0][j][2 * h + 1] * p.scale);
      dv_out[4 * j] = pack2<T>(dv[0][j][2 * h], dv[0][j][2 * h + 1]);
    }
  }
}

// The dK/dV kernel's work, planned on the GPU from the transposed index's offsets (q_ptr), so
// that the host needs no list length. A CTA walks one part of a (group, KV block) pair's query
// list (BoxWalk), and the parts start longest first.
//
// Parts: the lists differ by up to 100x (a KV block that many query blocks select against one
// that few do). At S = 32K, 10% the longest took 1.2x an SM's share of the whole walk (132 SMs),
// at 8K 3-5x, and its CTA ran on alone after the rest had finished. A list longer than `cap`
// query blocks is cut into ceil(L / cap) parts of equal length. cap is the smallest of cap0,
// 2 cap0, 4 cap0, ... whose parts' partial sums fit the `max_slots` slots the host allocated,
// with cap0 = ceil(total / share) for `share` CTA places (the SMs: no part is longer than an
// SM's share). Each part of a cut list writes its fp32 dK and dV to its slot; the last to finish
// (counted in dkdv_arrivals) adds the slots up in the parts' order and stores the sum, so the
// gradients stay deterministic (dkdv_combine_parts). On one H200 this made the kernel 2.0x faster
// at 3B 8K 10%, 2.5x at 8K 25%, 17% at 3B 32K 10% and 7% at 0.5B 32K 10% (docs/HISTORY.md).
//
// Order: a schedule of the real lists, longest first, ended 0.3-1.7% after the ideal at 0.5B
// (S = 32K/64K, 10%/25%) against 1-10% in the grid's fixed order. Parts are binned by length
// >> shift (PLAN_BINS bins); the order within a bin depends on the atomics' order, which changes
// no result.
//
// Out: items[i] = (pair g NB + kb, lo, hi, part) for i < the number of parts, pair -1 after it
// (up to max_items = pairs + share, the most parts there can be); split[pair] = (first slot or
// -1 where the list is whole, parts); arrivals zeroed for the pairs' nsub chunks of KV rows.
constexpr int PLAN_THREADS = 1024, PLAN_BINS = PLAN_THREADS, PLAN_CAPS = 16, MIN_PART = 2;

__host__ __device__ constexpr int ceil_div(int a, int b) { return (a + b - 1) / b; }

__global__ void __launch_bounds__(PLAN_THREADS) dkdv_plan_kernel(const int* q_ptr, int pairs, int shift, int share,
                                                                 int max_slots, int nsub, int max_items, int4* items,
                                                                 int2* split, int* arrivals) {
  __shared__ int start[PLAN_BINS];   // bin sizes, then each bin's next free place in `items`
  __shared__ int slots[PLAN_CAPS];   // slots the cut lists take at cap0 << c
  __shared__ int n_items, cap;
  const auto length = [&](int e) { return q_ptr[e + 1] - q_ptr[e]; };
  const int cap0 = max(MIN_PART, ceil_div(q_ptr[pairs] - q_ptr[0], share));
  const auto cap_at = [&](int c) { return (int)min((long long)cap0 << c, (long long)INT_MAX); };
  start[threadIdx.x] = 0;
  if (threadIdx.x < PLAN_CAPS) slots[threadIdx.x] = 0;
  if (threadIdx.x == 0) n_items = 0;
  for (int i = threadIdx.x; i < pairs * nsub; i += PLAN_THREADS) arrivals[i] = 0;
  __syncthreads();
  for (int e = threadIdx.x; e < pairs; e += PLAN_THREADS)
    for (int c = 0, n; c < PLAN_CAPS && (n = ceil_div(length(e), cap_at(c))) > 1; ++c) atomicAdd(&slots[c], n);
  __syncthreads();
  if (threadIdx.x == 0) {
    int c = 0;
    while (c < PLAN_CAPS && slots[c] > max_slots) ++c;
    cap = c < PLAN_CAPS ? cap_at(c) : INT_MAX;  // INT_MAX: no list is cut
  }
  __syncthreads();
  const auto parts = [&](int e) { return max(1, ceil_div(length(e), cap)); };
  const auto bin = [&](int len) { return PLAN_BINS - 1 - min(len >> shift, PLAN_BINS - 1); };
  // Slots in pair order: each thread takes a contiguous run of pairs.
  const int run = ceil_div(pairs, PLAN_THREADS), e0 = min(pairs, threadIdx.x * run), e1 = min(pairs, e0 + run);
  int mine = 0;
  for (int e = e0; e < e1; ++e) mine += parts(e) > 1 ? parts(e) : 0;
  int slot = cta_exclusive_sum(mine);
  for (int e = e0; e < e1; ++e) {
    const int n = parts(e), L = length(e);
    split[e] = make_int2(n > 1 ? slot : -1, n);
    if (n > 1) slot += n;
    for (int j = 0; j < n; ++j) atomicAdd(&start[bin((j + 1) * L / n - j * L / n)], 1);
    atomicAdd(&n_items, n);
  }
  __syncthreads();
  // Each bin's first place: the sizes of the bins before it (one bin per thread). Every thread
  // has read its size before the scan's first barrier, so the write after it races with none.
  start[threadIdx.x] = cta_exclusive_sum(start[threadIdx.x]);
  __syncthreads();
  for (int e = e0; e < e1; ++e) {
    const int n = parts(e), L = length(e);
    for (int j = 0; j < n; ++j) {
      const int lo = j * L / n, hi = (j + 1) * L / n;
      items[atomicAdd(&start[bin(hi - lo)], 1)] = make_int4(e, lo, hi, j);
    }
  }
  for (int i = n_items + threadIdx.x; i < max_items; i += PLAN_THREADS) items[i] = make_int4(-1, 0, 0, 0);
}

// Consumers of a part of a cut list (split = (first slot, parts)): this part's dK and dV into
// its slot, and, in the part that finishes last, the sum of all the parts' slots in their order
// into dk and dv, which it then stores. Returns whether this CTA is that part. A slot holds each
// consumer thread's D accumulators where that thread reads them back (16-byte vectors, thread
// fastest): the parts' CTAs hold the same rows and columns in the same registers.
template <int D>
__device__ __forceinline__ bool dkdv_combine_parts(float (&dk)[1][D / 8][4], float (&dv)[1][D / 8][4], int2 split,
                                                   int part, int arrival, int nsub, int sub, const Params& p) {
  constexpr int THREADS = 2 * WG_THREADS, SLOT = THREADS * D;  // floats
  const int ct = threadIdx.x - WG_THREADS;
  const auto slot_at = [&](int j) {
    return reinterpret_cast<float4*>(p.dkdv_partials + ((int64_t)(split.x + j) * nsub + sub) * SLOT) + ct;
  };
  float4* mine = slot_at(part);
#pragma unroll
  for (int j = 0; j < D / 8; ++j) {
    mine[j * THREADS] = make_float4(dk[0][j][0], dk[0][j][1], dk[0][j][2], dk[0][j][3]);
    mine[(D / 8 + j) * THREADS] = make_float4(dv[0][j][0], dv[0][j][1], dv[0][j][2], dv[0][j][3]);
  }
  // The classic last-block pattern: every thread's writes are fenced before the consumers'
  // barrier, after which one thread counts the part in.
  __shared__ int last;
  __threadfence();
  consumer_barrier();
  if (ct == 0) last = atomicAdd(p.dkdv_arrivals + arrival, 1) == split.y - 1;
  consumer_barrier();
  if (!last) return false;
  __threadfence();
#pragma unroll
  for (int j = 0; j < D / 8; ++j) {
    float4 k4 = __ldcg(slot_at(0) + j * THREADS), v4 = __ldcg(slot_at(0) + (D / 8 + j) * THREADS);
    for (int i = 1; i < split.y; ++i) {
      const float4 a = __ldcg(slot_at(i) + j * THREADS), b = __ldcg(slot_at(i) + (D / 8 + j) * THREADS);
      k4 = make_float4(k4.x + a.x, k4.y + a.y, k4.z + a.z, k4.w + a.w);
      v4 = make_float4(v4.x + b.x, v4.y + b.y, v4.z + b.z, v4.w + b.w);
    }
    dk[0][j][0] = k4.x, dk[0][j][1] = k4.y, dk[0][j][2] = k4.z, dk[0][j][3] = k4.w;
    dv[0][j][0] = v4.x, dv[0][j][1] = v4.y, dv[0][j][2] = v4.z, dv[0][j][3] = v4.w;
  }
  return true;
}

template <typename T, int D, bool STORE_DS>
__global__ void __launch_bounds__(DkdvTiles<T, D>::THREADS, 1)
    dkdv_kernel(Params p, const __grid_constant__ DkdvMaps maps) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  using Tiles = DkdvTiles<T, D>;
  constexpr int KV_ROWS = Tiles::KV_ROWS, QT = Tiles::QT, STAGES = Tiles::STAGES;
  extern __shared__ unsigned char smem_raw[];
  // Swizzled tiles start on a 1024-byte boundary (smem_bytes reserves the slack).
  T* Ks = reinterpret_cast<T*>(smem_raw + ((SW_ALIGN - smem_u32(smem_raw) % SW_ALIGN) % SW_ALIGN));
  T* Vs = Ks + KV_ROWS * D;
  T* Qs = Vs + KV_ROWS * D;       // STAGES buffers of QT rows
  T* dOs = Qs + STAGES * QT * D;  // STAGES buffers
  float* lse_s = reinterpret_cast<float*>(dOs + STAGES * QT * D);  // [STAGES][QT]
  float* dl_s = lse_s + STAGES * QT;                              // [STAGES][QT]
  uint64_t* full = reinterpret_cast<uint64_t*>(dl_s + STAGES * QT);
  uint64_t* empty = full + STAGES;
  uint64_t* kv_full = empty + STAGES;

  // Linear grid over dkdv_plan_kernel's items, the longest parts first; a KV block's chunks are
  // adjacent. The grid has room for the most parts there can be; the rest return here.
  const int nsub = p.block / KV_ROWS, sub = blockIdx.x % nsub;
  const int4 item = p.dkdv_items[blockIdx.x / nsub];  // (pair, lo, hi, part)
  if (item.x < 0) return;
  const int g = item.x / p.NB, kb = item.x % p.NB, n0 = sub * KV_ROWS;
  const int b0 = p.bstart[kb], blen = p.bend[kb] - b0;
  if (n0 >= blen) return;
  const int nvalid = min(KV_ROWS, blen - n0);
  init_ws_barriers(full, empty, STAGES, kv_full, 2);

  if (threadIdx.x < WG_THREADS) {  // producer: thread 0 issues the TMA copies, all 128 lse and delta
    regs_dec<Tiles::PRODUCER_REGS>();
    // K and V rows past the block hold the next tokens (or zeros past the tensor): they only
    // reach their own rows of dK and dV, which store_dkdv does not write.
    if (threadIdx.x == 0) tma_load_tile_pair<T, D, KV_ROWS>(Ks, Vs, &maps.k, &maps.v, g, b0 + n0, kv_full);
    mbar_arrive(kv_full);
    BoxWalk<QT> w(p, g, kb, n0, item.y, item.z);
    for (int j = 0; !w.done(); ++j) {
      const int buf = j % STAGES;
      if (j >= STAGES) mbar_wait(empty + buf, (j / STAGES - 1) & 1);
      load_query_tile<T, D, QT, WG_THREADS>(Qs + buf * QT * D, dOs + buf * QT * D, lse_s + buf * QT, dl_s + buf * QT,
                                            full + buf, maps, w, g, p);
      mbar_arrive_cp_async(full + buf);
      w.next(p);
    }
    cp_async_wait_all();  // no copy outlives the CTA
  } else {  // consumers: the two warpgroups that multiply
    regs_inc<Tiles::CONSUMER_REGS>();
    const int wg = warpgroup_index() - 1, warp = warp_in_warpgroup(), lane = threadIdx.x % 32;
    const uint64_t k_desc = kmajor_tile<KV_ROWS>(Ks), v_desc = kmajor_tile<KV_ROWS>(Vs);
    const int key_tok = n0 + wg * WG_ROWS + warp * 16 + lane / 4;  // this lane's keys: key_tok + 8 h
    // One 64-row tile per warpgroup; the [1] makes them the MI = 1 tiles of the mma.sync helpers.
    float dk[1][D / 8][4], dv[1][D / 8][4];
    zero(dk);
    zero(dv);
    mbar_wait(kv_full, 0);
    BoxWalk<QT> walk(p, g, kb, n0, item.y, item.z);
    // One step per query tile; `diag` (std::true_type for the diagonal block's tiles, the walk's
    // last) compiles the causal mask into the steps that need it only.
    auto step = [&](int it, auto diag) {
      const int buf = it % STAGES;
      mbar_wait(full + buf, (it / STAGES) & 1);  // the operands of wgmma came by TMA: no proxy fence
      T* ds_tile = nullptr;
      if constexpr (STORE_DS)  // the slot of this list entry, the tile's first row h block + t heads
        ds_tile = static_cast<T*>(p.ds) + (int64_t)(walk.p0 + walk.e) * ds_slot_values(p.R, p.block) +
                  (int64_t)(walk.h * p.block + walk.t * walk.heads) * DS_KEYS;
      dkdv_tile<T, D, KV_ROWS, QT, decltype(diag)::value, STORE_DS>(
          dk, dv, k_desc, v_desc, Qs + buf * QT * D, dOs + buf * QT * D, lse_s + buf * QT, dl_s + buf * QT, walk, wg,
          warp, key_tok, lane, ds_tile, p);
      walk.next(p);
      // Waiting here rather than in the next tile: ptxas serialises every wgmma of the loop when
      // accumulators are in flight across its back edge (warning C7515). The other consumer keeps
      // the tensor cores busy meanwhile.
      wgmma_wait<0>();
      mbar_arrive(empty + buf);
    };
    // The diagonal block comes last, so the outer loop runs once. It is there for ptxas (nvcc
    // 13.0): with the two loops at the top level it spilled 32 bytes (68 with stored dS) at head
    // dim 128, reloaded in every step; with them inside it, none. Same work, bitwise the same
    // gradients; on one H200 the 3B stored-dS step 1.4-1.8% faster
    // (benchmarks/results/archive/nested_walk_ab_h200.log).
    int it = 0;
    while (!walk.done()) {
      for (; !walk.done() && !walk.diag(); ++it) step(it, std::false_type{});
      for (; !walk.done() && walk.diag(); ++it) step(it, std::true_type{});
    }
    const int2 split = p.dkdv_split[item.x];
    if (split.x >= 0 && !dkdv_combine_parts<D>(dk, dv, split, item.w, item.x * nsub + sub, nsub, sub, p)) return;
    store_dkdv<T, D>(dk, dv, key_tok - n0, nvalid, b0 + n0, g, lane, p);
  }
#else
  __trap();  // built without sm_90a: attention.cu launches the mma.sync kernels instead
#endif
}

// ---- Forward and dQ ----------------------------------------------------------------------------
// Linear grid of (query tile, group) CTAs (QueryCta); CTA of a producer warpgroup that copies the
// query tiles once and then the walk's K/V chunks of CH keys (KvWalk) into a ring of STAGES
// buffers, and CONSUMERS warpgroups, each owning 64 of the tile's BM query rows (M of every
// product), over the chunks (N of the score products, K of O += P V and dQ += dS K, with V and K
// read transposed). Buffers pass between them on mbarriers ("full": the producer's copies landed;
// "empty": every consumer is done with it), so no CTA-wide barrier is left in the loop and the
// consumers drift apart: one's exponentials run while another's products do. setmaxnreg moves
// registers from the producer to the consumers, which hold O or dQ and the scores.
//
// The forward runs three consumers at head dim 64 and two at 128 (fwd_consumers), dQ two
// (DQ_CONSUMERS). A step of the forward waits on its products and then on its exponentials,
// which take the MUFU as long as its two products take the tensor cores at head dim 64: with two
// consumers per scheduler, neither unit was half busy. A third one (160 registers) made the
// forward 8-10% faster at 0.5B; a fourth (112 registers, 64-key chunks) was up to 9% slower. At
// head dim 128 three consumers fit only with 64-key chunks (O alone takes 64 registers), whose
// score product, both operands in shared memory, reads 4 KB per 32 cycles of math, all that an
// SM's shared memory delivers meanwhile. Two consumers (224 registers) take 128-key chunks and
// keep Q in registers as the score product's A operand (load_a_frags), which then reads only K:
// the 3B forward is 3-5% faster than with three at 25% density and as fast at 10%; without Q in
// registers, two consumers were 1-1.5% faster at 25% (S = 32K/64K, one H200). dQ holds S and dP
// as well: three consumers fit only with 64-key chunks, and at 0.5B the backward was no faster;
// Q in registers there (head dim 128) made the 3B backward 3-4% slower (docs/HISTORY.md).
//
// The product that closes a step (P V, dS K) runs during the next step's exponentials: a
// consumer issues chunk it's score products and then chunk it - 1's closing product, and hands
// chunk it - 1 back once that is done. A loop back edge stays free of products in flight
// (C7515): every step waits for all of its own.
constexpr int DQ_CONSUMERS = 2;
constexpr int fwd_consumers(int D) { return D == 128 ? 2 : 3; }
constexpr float RESCALE_LOG2 = 8.f;  // how far (log2) a row's maximum may pass the forward's m

template <typename T, int D, int QUERY_TILES, int CH, int CONSUMERS>
struct QueryTiles {
  // 128 x 56 + 256 x 224, or 128 x 32 + 384 x 160: the whole pool.
  static constexpr int BM = CONSUMERS * WG_ROWS, THREADS = (CONSUMERS + 1) * WG_THREADS,
                       PRODUCER_REGS = CONSUMERS == 2 ? 56 : 32, CONSUMER_REGS = CONSUMERS == 2 ? 224 : 160;
  static_assert(fits_register_pool(PRODUCER_REGS, CONSUMER_REGS, CONSUMERS), "register pool");
  // As many chunk stages as an SM's 227 KB of shared memory holds beside the query tiles (a
  // consumer holds two chunks, so the third is the producer's lead), four at most.
  static constexpr int SMEM_LIMIT = 227 * 1024, BARRIERS = 64;
  static constexpr int FIXED = SW_ALIGN + BARRIERS + QUERY_TILES * BM * D * (int)sizeof(T);
  static constexpr int STAGE = 2 * CH * D * (int)sizeof(T);
  static constexpr int STAGES = (SMEM_LIMIT - FIXED) / STAGE < 4 ? (SMEM_LIMIT - FIXED) / STAGE : 4;
  static constexpr bool FITS = STAGES >= 3;  // the host instantiates only the shapes that fit
  static constexpr size_t smem_bytes() { return FIXED + STAGES * STAGE; }
};

// This thread's share of the copies of a K/V chunk of CH keys (CopySlice): the global addresses
// of its vectors differ by a fixed stride, where the general load_kv_rows recomputes both.
template <typename T, int D, int NT, int CH>
struct ChunkCopier {
  using Slice = CopySlice<D, NT, CH>;
  Slice sl;
  const T* k;  // this thread's column of group g's row 0
  const T* v;
  int64_t row_stride;  // elements between consecutive tokens' rows

  __device__ ChunkCopier(const T* k_, const T* v_, int g, int G)
      : k(k_ + g * D + sl.c), v(v_ + g * D + sl.c), row_stride((int64_t)G * D) {}
  // Rows past c.nvalid get zeros, so a masked P times V stays 0.
  __device__ void copy(T* k_dst, T* v_dst, const Chunk& ch) const {
    const int64_t row = (int64_t)(ch.k0 + sl.r) * row_stride;
#pragma unroll
    for (int j = 0; j < Slice::N; ++j) {
      const bool valid = sl.r + j * Slice::ROW_STEP < ch.nvalid;  // else no byte is read: any valid address
      const int64_t off = row + j * Slice::ROW_STEP * row_stride;
      cp_async16(k_dst + sl.smem_off + Slice::step(j), valid ? k + off : k, valid);
      cp_async16(v_dst + sl.smem_off + Slice::step(j), valid ? v + off : v, valid);
    }
  }
};


// The first tokens of a walk's off-diagonal blocks, for the producer, read by a warp's lanes
// together a batch of 32 blocks at a time (lane i holds block base + i), the next batch while
// this one is used. A chunk's first token is two dependent reads from global memory (the walk's
// index, then the block's start), and the producer paid both, one chunk after the other, for
// each of the first STAGES copies before any consumer could start, where a walk at 10% density
// is 13 to 26 chunks long (3B, S = 32K/64K). chunk() hands out every chunk of the walk, the
// diagonal block's (whose start is the CTA's own query block's) as KvWalk does. Every lane of a
// warp calls it with the same `it`, in increasing order.
template <int CH>
struct BlockStarts {
  int base = 0, cur, nxt;

  __device__ BlockStarts(const KvWalk<CH>& w, const Params& p) : cur(read(w, p, 0)), nxt(read(w, p, 32)) {}
  __device__ Chunk chunk(const KvWalk<CH>& w, const Params& p, int it) {
    if (it >= w.n_off) return w.chunk(p, it);
    const int b = it >> w.sub_shift, kt0 = (it & ((1 << w.sub_shift) - 1)) * CH;
    if (b >= base + 32) {
      base += 32;
      cur = nxt;
      nxt = read(w, p, base + 32);
    }
    return {__shfl_sync(0xffffffffu, cur, b - base) + kt0, CH, kt0};
  }

 private:
  // The index read waits for no count (its row holds KMAX entries); the start only for blocks
  // the walk has.
  __device__ static int read(const KvWalk<CH>& w, const Params& p, int b0) {
    const int b = b0 + threadIdx.x % 32, blk = b < p.KMAX ? w.idx[b] : 0;
    return b < w.n_off >> w.sub_shift ? p.bstart[blk] : 0;
  }
};


// The parts of a forward or dQ CTA that do not depend on what it computes: its query rows, the
// K/V chunks it walks, the ring of buffers they pass through and its barriers.
template <typename T, int D, int QUERY_TILES, int CH, int CONSUMERS>
struct QueryCta {
  using Tiles = QueryTiles<T, D, QUERY_TILES, CH, CONSUMERS>;
  static_assert(Tiles::FITS, "three chunk stages at least");
  static constexpr int BM = Tiles::BM, STAGES = Tiles::STAGES;

  T* qtiles;  // QUERY_TILES tiles of BM rows (Q, then dO)
  T* Ks;      // STAGES chunk buffers
  T* Vs;
  uint64_t* full;  // [STAGES]
  uint64_t* empty;
  uint64_t* queries_full;
  int g, qb, q0, row0, nrows;

  __device__ QueryCta(unsigned char* smem_raw, const Params& p) {
    qtiles = reinterpret_cast<T*>(smem_raw + ((SW_ALIGN - smem_u32(smem_raw) % SW_ALIGN) % SW_ALIGN));
    Ks = qtiles + QUERY_TILES * BM * D;
    Vs = Ks + STAGES * CH * D;
    full = reinterpret_cast<uint64_t*>(Vs + STAGES * CH * D);
    empty = full + STAGES;
    queries_full = empty + STAGES;
    // Linear grid, walked from the last tile and group fastest: late query blocks select the
    // full budget and early ones fewer, so the longest CTAs start first.
    const int tiles = (p.block * p.R + BM - 1) / BM, lin = gridDim.x - 1 - blockIdx.x, tile = lin / p.G;
    g = lin % p.G;
    qb = tile / tiles;
    row0 = (tile % tiles) * BM;
    q0 = p.bstart[qb];
    nrows = (p.bend[qb] - q0) * p.R;
  }
  __device__ bool empty_tile() const { return row0 >= nrows; }
  __device__ KvWalk<CH> walk(const Params& p) const {
    return KvWalk<CH>(p, g, qb, q0, nrows / p.R, (min(row0 + BM, nrows) - 1) / p.R);
  }
  // Whether key column col of a diagonal chunk c is hidden from a row of token tok: past the
  // block's end or after the row's token (every key of an off-diagonal chunk is visible).
  __device__ static bool masked(const Chunk& c, int col, int tok) { return col >= c.nvalid || c.kt0 + col > tok; }
  // The causal mask of a diagonal chunk c on a thread's scores s (its two rows, of tokens tok).
  template <int NJ>
  __device__ static void mask_diagonal(float (&s)[NJ][4], const Chunk& c, int lane, const int (&tok)[2]) {
#pragma unroll
    for (int j = 0; j < NJ; ++j)
#pragma unroll
      for (int e = 0; e < 4; ++e)
        if (masked(c, 8 * j + 2 * (lane % 4) + (e & 1), tok[e / 2])) s[j][e] = -INFINITY;
  }
  // Called by every thread: the barriers, then the roles. The producer warpgroup copies the
  // query tiles from `sources` and the walk's chunks and gets false; a consumer whose 64 rows all
  // lie past the block (the last tile of a block whose rows are not a multiple of BM) gets false
  // too, and the buffers wait for the others only; the rest get their registers and true.
  __device__ bool start(const KvWalk<CH>& w, const T* const (&sources)[QUERY_TILES], const ChunkMaps& maps,
                        const Params& p) {
    const int active = min(CONSUMERS, (nrows - row0 + WG_ROWS - 1) / WG_ROWS);
    init_ws_barriers(full, empty, STAGES, queries_full, active);
    if (threadIdx.x < WG_THREADS) {
      regs_dec<Tiles::PRODUCER_REGS>();
      produce(w, sources, maps, p);
      return false;
    }
    if (threadIdx.x / WG_THREADS > active) return false;
    regs_inc<Tiles::CONSUMER_REGS>();
    return true;
  }
  // The producer warpgroup (threads 0..127): the query tiles, then every chunk of the walk, each
  // into the buffer its chunk STAGES earlier has been handed back from. A whole chunk comes as
  // TMA boxes from thread 0 (counted on `full`'s transaction bytes): the 128 threads' cp.async
  // copies took 16 address computations and copies each per chunk, issued on the consumers'
  // schedulers. Only a diagonal block's last chunk can be partial (the end of a sequence), and
  // its rows past the block must be zeros, since P times V of a masked key is 0 times that row:
  // cp.async's zero fill gives them.
  __device__ void produce(const KvWalk<CH>& w, const T* const (&sources)[QUERY_TILES], const ChunkMaps& maps,
                          const Params& p) {
    BlockStarts<CH> starts(w, p);  // its reads first: the first chunk's copy waits for them, not for Q's
#pragma unroll
    for (int t = 0; t < QUERY_TILES; ++t)
      load_q_rows<T, D, BM, WG_THREADS, Swizzled128<BM>>(qtiles + t * BM * D, sources[t], q0, row0, nrows, p, g);
    mbar_arrive_cp_async(queries_full);
    const ChunkCopier<T, D, WG_THREADS, CH> copier(static_cast<const T*>(p.k), static_cast<const T*>(p.v), g, p.G);
    for (int it = 0; it < w.n_total; ++it) {
      const int buf = it % STAGES;
      const Chunk c = starts.chunk(w, p, it);
      if (it >= STAGES) mbar_wait(empty + buf, (it / STAGES - 1) & 1);
      T* const k_dst = Ks + buf * CH * D;
      T* const v_dst = Vs + buf * CH * D;
      if (c.nvalid == CH) {
        if (threadIdx.x == 0) tma_load_tile_pair<T, D, CH>(k_dst, v_dst, &maps.k, &maps.v, g, c.k0, full + buf);
        mbar_arrive(full + buf);
      } else {
        copier.copy(k_dst, v_dst, c);
        mbar_arrive_cp_async(full + buf);
      }
    }
    cp_async_wait_all();  // no copy outlives the CTA
  }
  // Consumers: wait for the query tiles, for chunk `it`, and hand chunk `it` back. Only a
  // diagonal chunk (DIAG) may have come by cp.async, through the generic proxy, which wgmma's
  // async proxy reads after a proxy fence; TMA writes through the async proxy itself.
  __device__ void wait_queries() const { mbar_wait(queries_full, 0); }
  template <bool DIAG>
  __device__ void wait_chunk(int it) const {
    mbar_wait(full + it % STAGES, (it / STAGES) & 1);
    if constexpr (DIAG) fence_proxy_async();
  }
  __device__ void release(int it) const { mbar_arrive(empty + it % STAGES); }
  __device__ const T* keys(int it) const { return Ks + (it % STAGES) * CH * D; }
  __device__ const T* values(int it) const { return Vs + (it % STAGES) * CH * D; }
};

// Folds t[h][0, 2W) into t[h][0, W), then on down to t[h][0]: one level of reduce_rows' tree
// per call (a template parameter per level, so that every loop is unrolled and t stays in
// registers; nvcc leaves a loop over the levels rolled and t in local memory).
template <int W, int NJ, typename Op>
__device__ __forceinline__ void fold_levels(float (&t)[2][NJ], Op op) {
#pragma unroll
  for (int j = 0; j < W; ++j)
#pragma unroll
    for (int h = 0; h < 2; ++h) t[h][j] = op(t[h][j], t[h][j + W]);
  if constexpr (W > 1) fold_levels<W / 2>(t, op);
}

// Reduces each of the two rows a thread holds of a score tile (values 0, 1 of every j for its
// first row, 2, 3 for its second) with `op`, as a tree: log2(2 NJ) dependent steps instead of a
// chain of 2 NJ, which was the longest dependency of the forward's step.
template <int NJ, typename Op>
__device__ __forceinline__ void reduce_rows(const float (&s)[NJ][4], float (&out)[2], Op op) {
  static_assert(NJ > 1 && (NJ & (NJ - 1)) == 0, "a power of two");
  float t[2][NJ];
#pragma unroll
  for (int j = 0; j < NJ; ++j)
#pragma unroll
    for (int h = 0; h < 2; ++h) t[h][j] = op(s[j][2 * h], s[j][2 * h + 1]);
  fold_levels<NJ / 2>(t, op);
#pragma unroll
  for (int h = 0; h < 2; ++h) out[h] = t[h][0];
}

// acc += A B for one chunk, A (P or dS) from registers, B (the chunk's V or K tile) read
// transposed: O += P V in the forward, dQ += dS K in dQ. Left in flight.
template <typename T, int D, int CH>
__device__ __forceinline__ void accumulate_chunk(float (&acc)[1][D / 8][4], const uint32_t (&a)[1][CH / 16][4],
                                                 const T* tile) {
  const uint64_t b_mn = mnmajor_tile<T, CH>(tile);
  wgmma_fence();
#pragma unroll
  for (int k = 0; k < CH / 16; ++k) wgmma_rs_tb<T, D>(acc[0], a[0][k], mnmajor_at<T>(b_mn, 16 * k), true);
  wgmma_commit();
}


// Stores a forward or dQ consumer's 64 rows of its accumulator (O or dQ), each row times its
// `scale`, as T into `out` ([T, HQ, D]): first into the warpgroup's own rows of the query tile in
// shared memory, which only its own products read and which all are done with, then as 16-byte
// vectors, a warp's store covering 512 contiguous bytes where its rows are heads of one token.
// Stored from the accumulator's fragments as they lie, a warp's store touched 8 rows with 16
// bytes each, and the forward's epilogue took 3,500 cycles of a 3B CTA's 56,000 at 10% density
// (one H200, 28 Nov; benchmarks/probes/cta_stamps.py).
template <typename T, int D, int BM>
__device__ __forceinline__ void store_rows_through_tile(const float (&acc)[1][D / 8][4], const float (&scale)[2],
                                                        T* tile, int wg, int warp, int lane, int row0, int nrows,
                                                        int q0, int g, T* out, const Params& p) {
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const int r = wg * WG_ROWS + warp * 16 + lane / 4 + 8 * h;
#pragma unroll
    for (int j = 0; j < D / 8; ++j)
      *reinterpret_cast<uint32_t*>(tile + sw128_offset<BM>(r, 8 * j + 2 * (lane % 4))) =
          pack2<T>(acc[0][j][2 * h] * scale[h], acc[0][j][2 * h + 1] * scale[h]);
  }
  warpgroup_barrier(wg);
  constexpr int VECS = D / 8;  // 16-byte vectors per row
#pragma unroll
  for (int i = 0; i < WG_ROWS * VECS / WG_THREADS; ++i) {
    const int v = i * WG_THREADS + threadIdx.x % WG_THREADS, r = wg * WG_ROWS + v / VECS, c = (v % VECS) * 8;
    const int gr = row0 + r;
    if (gr >= nrows) continue;
    const int64_t off = query_row(q0, gr, div_r(gr, p), g, p);
    *reinterpret_cast<uint4*>(out + off * D + c) = *reinterpret_cast<const uint4*>(tile + sw128_offset<BM>(r, c));
  }
}

// Runs a forward or dQ consumer's step(it, diag, first) over the walk: the off-diagonal chunks,
// then the diagonal block's, with std::true_type / std::false_type naming which (diag) and
// whether the chunk is the walk's first (first), peeled off the loops. A step multiplies the
// previous chunk's P (or dS) by its V (or K) beside its own score products; the first has none.
// Until 28 Nov it multiplied zeros instead, which kept one step for all, at the cost of half a
// step's products per CTA in the forward and a third in dQ, where a walk at 10% density is 13
// to 26 chunks long (3B, S = 32K/64K). Peeled, the loops still hold no product in flight across
// a back edge and match every wait to its products (C7515, C7514 stay silent).
template <int CH, typename Step>
__device__ __forceinline__ void for_each_step(const KvWalk<CH>& walk, Step& step) {
  // Walks hold at least the diagonal block's first chunk.
  if (walk.n_off > 0)
    step(0, std::false_type{}, std::true_type{});
  else
    step(0, std::true_type{}, std::true_type{});
  int it = 1;
  for (; it < walk.n_off; ++it) step(it, std::false_type{}, std::false_type{});
  for (; it < walk.n_total; ++it) step(it, std::true_type{}, std::false_type{});
}

template <typename T, int D, int CH, int CONSUMERS>
__global__ void __launch_bounds__(QueryTiles<T, D, 1, CH, CONSUMERS>::THREADS, 1)
    fwd_kernel(Params p, const __grid_constant__ ChunkMaps maps) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  using Cta = QueryCta<T, D, 1, CH, CONSUMERS>;
  constexpr int BM = Cta::BM, NJ = CH / 8;
  extern __shared__ unsigned char smem_raw[];
  Cta cta(smem_raw, p);
  if (cta.empty_tile()) return;
  const KvWalk<CH> walk = cta.walk(p);
  if (!cta.start(walk, {static_cast<const T*>(p.q)}, maps, p)) return;
  const int wg = warpgroup_index() - 1, warp = warp_in_warpgroup(), lane = threadIdx.x % 32;
  const uint64_t q_desc = kmajor_tile<BM>(cta.qtiles);
  const int wrow = cta.row0 + wg * WG_ROWS + warp * 16 + lane / 4;  // this lane's rows: wrow + 8 h
  int tok[2];
  float m[2], l[2];
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    tok[h] = div_r(wrow + 8 * h, p);
    m[h] = -INFINITY;
    l[h] = 0.f;
  }
  float o[1][D / 8][4];
  zero(o);

  // P of the previous chunk, multiplied by its V during this step.
  uint32_t pa[1][CH / 16][4];
  cta.wait_queries();
  constexpr bool Q_IN_REGISTERS = CONSUMERS == 2;  // room for it beside O and the scores (above)
  uint32_t qa[Q_IN_REGISTERS ? D / 16 : 1][4];
  if constexpr (Q_IN_REGISTERS) load_a_frags<T, D, BM>(qa, cta.qtiles, wg * WG_ROWS + warp * 16, lane);
  // One step per chunk; `diag` (std::true_type for the diagonal block's chunks) compiles the
  // causal mask into the steps that need it only, and `first` the walk's first chunk, which has
  // no P before it (for_each_step).
  auto step = [&](int it, auto diag, auto first) {
    constexpr bool FIRST = decltype(first)::value;
    cta.wait_chunk<decltype(diag)::value>(it);
    const uint64_t k_desc = kmajor_tile<CH>(cta.keys(it));
    float s[1][NJ][4];
    wgmma_fence();
    if constexpr (Q_IN_REGISTERS)
      product_over_head_dim_rs<T, D, CH>(s[0], qa, k_desc);
    else
      product_over_head_dim<T, D, BM, CH>(s[0], q_desc, wg * WG_ROWS, k_desc);
    if constexpr (!FIRST) accumulate_chunk<T, D, CH>(o, pa, cta.values(it - 1));
    wgmma_wait<FIRST ? 0 : 1>();  // S done; the previous chunk's P V runs on
    // Scores stay unscaled until the exponential folds the scale in: exp2(s scale - m), where m
    // is the running maximum in scaled units.
    if constexpr (decltype(diag)::value) Cta::mask_diagonal(s[0], walk.chunk(p, it), lane, tok);
    float mx[2];
    reduce_rows<NJ>(s[0], mx, [](float a, float b) { return fmaxf(a, b); });
    // m is the maximum the exponentials subtract, and it moves only when a row's maximum passes
    // it by more than RESCALE_LOG2 (so P stays below 2^RESCALE_LOG2, far inside bf16 and fp16):
    // O and l then keep their scale, and the step skips O's rescaling (a multiply per
    // accumulator). All rows of a warp move together, so the choice is one branch per warp.
    float m_new[2];
    bool grows = false;
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      m_new[h] = fmaxf(m[h], quad_max(mx[h]) * p.scale_log2);
      grows |= m_new[h] > m[h] + RESCALE_LOG2;  // m = -inf: as soon as a key is visible
    }
    const bool rescale = __any_sync(0xffffffffu, grows);
    float alpha[2] = {1.f, 1.f};
    if (rescale) {
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        alpha[h] = exp2f(m[h] - (m_new[h] == -INFINITY ? 0.f : m_new[h]));  // 0 while m = -inf
        m[h] = m_new[h];
      }
    }
    float m_use[2];
#pragma unroll
    for (int h = 0; h < 2; ++h) m_use[h] = m[h] == -INFINITY ? 0.f : m[h];  // a row with nothing visible yet
#pragma unroll
    for (int j = 0; j < NJ; ++j)
#pragma unroll
      for (int e = 0; e < 4; ++e) s[0][j][e] = exp2f(fmaf(s[0][j][e], p.scale_log2, -m_use[e / 2]));
    float row_sum[2];
    reduce_rows<NJ>(s[0], row_sum, [](float a, float b) { return a + b; });
#pragma unroll
    for (int h = 0; h < 2; ++h) l[h] = fmaf(l[h], alpha[h], row_sum[h]);
    if constexpr (!FIRST) {
      wgmma_wait<0>();  // O holds every chunk before this one: rescale it to this chunk's maximum
      cta.release(it - 1);
      if (rescale) {
#pragma unroll
        for (int j = 0; j < D / 8; ++j)
#pragma unroll
          for (int e = 0; e < 4; ++e) o[0][j][e] *= alpha[e / 2];
      }
    }
    to_a_frags<T, 1, CH>(pa, s);
  };
  for_each_step(walk, step);
  accumulate_chunk<T, D, CH>(o, pa, cta.values(walk.n_total - 1));
  wgmma_wait<0>();

  float inv[2];
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const int gr = wrow + 8 * h;
    const float lsum = quad_sum(l[h]);
    inv[h] = 1.f / lsum;
    if (gr < cta.nrows && lane % 4 == 0) p.lse[query_row(cta.q0, gr, tok[h], cta.g, p)] = m[h] + log2f(lsum);
  }
  store_rows_through_tile<T, D, BM>(o, inv, cta.qtiles, wg, warp, lane, cta.row0, cta.nrows, cta.q0, cta.g,
                                    static_cast<T*>(p.out), p);
#else
  __trap();
#endif
}

template <typename T, int D, int CH, int CONSUMERS>
__global__ void __launch_bounds__(QueryTiles<T, D, 2, CH, CONSUMERS>::THREADS, 1)
    dq_kernel(Params p, const __grid_constant__ ChunkMaps maps) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  using Cta = QueryCta<T, D, 2, CH, CONSUMERS>;
  constexpr int BM = Cta::BM, NJ = CH / 8;
  extern __shared__ unsigned char smem_raw[];
  Cta cta(smem_raw, p);
  if (cta.empty_tile()) return;
  const KvWalk<CH> walk = cta.walk(p);
  if (!cta.start(walk, {static_cast<const T*>(p.q), static_cast<const T*>(p.dout)}, maps, p)) return;
  const int wg = warpgroup_index() - 1, warp = warp_in_warpgroup(), lane = threadIdx.x % 32;
  const uint64_t q_desc = kmajor_tile<BM>(cta.qtiles), do_desc = kmajor_tile<BM>(cta.qtiles + BM * D);
  const int wrow = cta.row0 + wg * WG_ROWS + warp * 16 + lane / 4;
  int tok[2];
  float lse[2], dl[2];
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const int gr = wrow + 8 * h;
    tok[h] = div_r(gr, p);
    lse[h] = INFINITY;  // rows past the block: P = 0
    dl[h] = 0.f;
    if (gr < cta.nrows) {
      const int64_t off = query_row(cta.q0, gr, tok[h], cta.g, p);
      lse[h] = p.lse[off];
      dl[h] = p.delta[off];
    }
  }
  float dq[1][D / 8][4];
  zero(dq);

  uint32_t da[1][CH / 16][4];  // dS of the previous chunk, as the forward's P
  cta.wait_queries();
  auto step = [&](int it, auto diag, auto first) {  // as the forward's
    constexpr bool FIRST = decltype(first)::value;
    cta.wait_chunk<decltype(diag)::value>(it);
    const uint64_t k_desc = kmajor_tile<CH>(cta.keys(it)), v_desc = kmajor_tile<CH>(cta.values(it));
    float s[1][NJ][4], dp[1][NJ][4];
    wgmma_fence();
    product_over_head_dim<T, D, BM, CH>(s[0], q_desc, wg * WG_ROWS, k_desc);
    product_over_head_dim<T, D, BM, CH>(dp[0], do_desc, wg * WG_ROWS, v_desc);
    if constexpr (!FIRST) accumulate_chunk<T, D, CH>(dq, da, cta.keys(it - 1));
    wgmma_wait<FIRST ? 1 : 2>();  // S done; dP and the previous chunk's dS K run on
    if constexpr (decltype(diag)::value) Cta::mask_diagonal(s[0], walk.chunk(p, it), lane, tok);
#pragma unroll
    for (int j = 0; j < NJ; ++j)
#pragma unroll
      for (int e = 0; e < 4; ++e) s[0][j][e] = exp2f(fmaf(s[0][j][e], p.scale_log2, -lse[e / 2]));
    wgmma_wait<FIRST ? 0 : 1>();  // dP done
#pragma unroll
    for (int j = 0; j < NJ; ++j)
#pragma unroll
      for (int e = 0; e < 4; ++e) s[0][j][e] *= dp[0][j][e] - dl[e / 2];  // dS = P (dP - delta)
    if constexpr (!FIRST) {
      wgmma_wait<0>();  // the previous chunk's dS K has read da and its K
      cta.release(it - 1);
    }
    to_a_frags<T, 1, CH>(da, s);
  };
  for_each_step(walk, step);
  accumulate_chunk<T, D, CH>(dq, da, cta.keys(walk.n_total - 1));
  wgmma_wait<0>();

  const float scale[2] = {p.scale, p.scale};
  store_rows_through_tile<T, D, BM>(dq, scale, cta.qtiles, wg, warp, lane, cta.row0, cta.nrows, cta.q0, cta.g,
                                    static_cast<T*>(p.dq), p);
#else
  __trap();
#endif
}

// ---- dQ from stored dS ---------------------------------------------------------------------------
// Linear grid of (128 rows of a slot, group, query block) CTAs, longest walks first as in
// QueryCta; CTA of a producer warpgroup (thread 0 copies, per route entry, the KV block's K by
// TMA and the CTA's 32 KB of dS by one bulk copy into a ring of STAGES buffers) and two
// consumers, each owning 64 of the rows: dQ += dS K per entry, dS's fragments from shared memory
// into registers (the layout above), K read transposed as in dq_kernel. No mask: dK/dV stored the
// masked and past-the-block values as zeros. Head dim 128 only (stored_ds_supported in attention.cu
// says why): a stage is 32 KB of K and 32 KB of dS, and three fill the SM's shared memory.
template <typename T, int D>
struct DsTiles {
  static_assert(D == 128, "the stored-dS backward runs at head dim 128");
  static constexpr int BM = 2 * WG_ROWS, THREADS = 3 * WG_THREADS, STAGES = 3;
  static constexpr int K_VALUES = DS_KEYS * D, DS_VALUES = BM * DS_KEYS;
  static constexpr size_t smem_bytes() {
    return SW_ALIGN + sizeof(T) * STAGES * (K_VALUES + DS_VALUES) + sizeof(uint64_t) * 2 * STAGES;
  }
};

template <typename T, int D>
__global__ void __launch_bounds__(DsTiles<T, D>::THREADS, 1)
    dq_from_ds_kernel(Params p, const __grid_constant__ CUtensorMap k_map) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  using Tiles = DsTiles<T, D>;
  constexpr int BM = Tiles::BM, STAGES = Tiles::STAGES, QT = DkdvTiles<T, D>::QT;
  extern __shared__ unsigned char smem_raw[];
  T* Ks = reinterpret_cast<T*>(smem_raw + ((SW_ALIGN - smem_u32(smem_raw) % SW_ALIGN) % SW_ALIGN));
  T* dSs = Ks + STAGES * Tiles::K_VALUES;
  uint64_t* full = reinterpret_cast<uint64_t*>(dSs + STAGES * Tiles::DS_VALUES);
  uint64_t* empty = full + STAGES;

  const int ctas = p.R * p.block / BM, lin = gridDim.x - 1 - blockIdx.x;
  const int g = lin % p.G, qb = lin / p.G / ctas, row0 = lin / p.G % ctas * BM;
  const int q0 = p.bstart[qb], qlen = p.bend[qb] - q0;
  // (token, head) of slot row r: the dK/dV tiles (h, t) start at rows h block + t heads, so the
  // rows pack the heads as the forward's do where the tiles do (heads = R), else they are a
  // block's tokens of head 0, then of head 1, ...
  const bool packed = dkdv_tile_heads(QT, p.R) == p.R;
  const auto token_head = [&](int r) {
    const int tok = packed ? div_r(r, p) : r % p.block;
    return make_int2(tok, packed ? r - tok * p.R : r / p.block);
  };
  const int active = (token_head(row0).x < qlen) + (token_head(row0 + WG_ROWS).x < qlen);
  if (active == 0) return;  // rows dK/dV wrote no tile for: past the block
  const int row = g * p.NB + qb, cnt = p.kv_cnt[row];
  if (threadIdx.x == 0) {
    for (int s = 0; s < STAGES; ++s) {
      mbar_init(full + s, 1);
      mbar_init(empty + s, active * WG_THREADS);
    }
    mbar_init_fence();
  }
  __syncthreads();

  if (threadIdx.x < WG_THREADS) {
    if (threadIdx.x != 0) return;
    const int* idx = p.kv_idx + (int64_t)row * p.KMAX;
    const int* slots = p.ds_slots + (int64_t)row * p.KMAX;
    const T* ds = static_cast<const T*>(p.ds) + (int64_t)row0 * DS_KEYS;
    for (int it = 0; it < cnt; ++it) {
      const int buf = it % STAGES;
      if (it >= STAGES) mbar_wait(empty + buf, (it / STAGES - 1) & 1);
      T* const k_dst = Ks + buf * Tiles::K_VALUES;
      mbar_expect_tx(full + buf, sizeof(T) * (Tiles::K_VALUES + Tiles::DS_VALUES));
      const int k0 = p.bstart[idx[it]];
#pragma unroll
      for (int c = 0; c < D; c += SW_COLS) tma_load_3d(k_dst + c * DS_KEYS, &k_map, c, g, k0, full + buf);
      bulk_load(dSs + buf * Tiles::DS_VALUES, ds + (int64_t)slots[it] * ds_slot_values(p.R, p.block),
                sizeof(T) * Tiles::DS_VALUES, full + buf);
      mbar_arrive(full + buf);
    }
    return;
  }
  const int wg = warpgroup_index() - 1, warp = warp_in_warpgroup(), lane = threadIdx.x % 32;
  if (wg >= active) return;
  float dq[1][D / 8][4];
  zero(dq);
  for (int it = 0; it < cnt; ++it) {
    const int buf = it % STAGES;
    mbar_wait(full + buf, (it / STAGES) & 1);
    const T* src = dSs + buf * Tiles::DS_VALUES + 256 * 8 * (4 * wg + warp) + 8 * lane;
    uint32_t a[1][DS_KEYS / 16][4];
#pragma unroll
    for (int c = 0; c < DS_KEYS / 16; ++c)
      *reinterpret_cast<uint4*>(a[0][c]) = *reinterpret_cast<const uint4*>(src + 256 * c);
    accumulate_chunk<T, D, DS_KEYS>(dq, a, Ks + buf * Tiles::K_VALUES);
    wgmma_wait<0>();
    mbar_arrive(empty + buf);
  }
  // Stored from the fragments as they lie, each quad of lanes 16 bytes of a row: once a CTA, beside a
  // walk of up to k tiles of 64 KB.
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const int2 th = token_head(row0 + wg * WG_ROWS + warp * 16 + lane / 4 + 8 * h);
    if (th.x >= qlen) continue;
    uint32_t* out = reinterpret_cast<uint32_t*>(static_cast<T*>(p.dq) +
                                                ((int64_t)(q0 + th.x) * p.HQ + g * p.R + th.y) * D + 2 * (lane % 4));
#pragma unroll
    for (int j = 0; j < D / 8; ++j) out[4 * j] = pack2<T>(dq[0][j][2 * h] * p.scale, dq[0][j][2 * h + 1] * p.scale);
  }
#else
  __trap();
#endif
}

}  // namespace sm90
}  // namespace kernels
}  // namespace sparsebalance
