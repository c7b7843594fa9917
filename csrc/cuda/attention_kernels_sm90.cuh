// Hopper kernels of the CUDA block-sparse attention: the same contract and walks as
// attention_kernels.cuh, with the products on wgmma (wgmma.cuh) instead of mma.sync.
//
// Why: mma.sync loads both operands into registers through ldmatrix, and a warp waits for each
// product before the next that accumulates into the same registers. wgmma reads its B operand
// (and A, unless it comes from registers) straight from shared memory and runs asynchronously:
// a warpgroup issues a whole chain of products at once, computes on while the later ones run
// (P while dP^T runs, dS while dV's products run), and the two warpgroups of a CTA interleave
// on the tensor cores.
//
// What set their speed, measured on one H200 (docs/BENCHMARKS.md): the order in which CTAs start
// (the longest first, see the grids below) and the integer work around the products (no integer
// division by R, fully unrolled tile loads, descriptors advanced by adds). Products in flight
// across a loop's back edge make ptxas serialise every wgmma of the loop (warning C7515), so each
// warpgroup waits for its products at the end of a step.
//
// The forward and dQ run for every block size; dK/dV where a block holds whole chunks of its
// KV_ROWS keys (block 128 and 256), warp-specialised at head dim 64 (dkdv_ws_kernel). The host
// dispatch (attention.cu) keeps the mma.sync kernels for the rest and for other GPUs.
#pragma once

#include "cuda/attention_kernels.cuh"
#include "cuda/wgmma.cuh"

namespace sparsebalance {
namespace kernels {
namespace sm90 {

constexpr int WG_THREADS = 128;  // one warpgroup
constexpr int WG_ROWS = 64;      // rows of one wgmma tile (m64)

template <int ROWS>
struct Swizzled128 {
  __device__ static int offset(int r, int c) { return sw128_offset<ROWS>(r, c); }
};

// ---- dK/dV ----------------------------------------------------------------------------------------
// Linear grid of NB * block / KV_ROWS * G CTAs; CTA of two warpgroups, each owning 64 of the
// chunk's KV_ROWS keys (M of every product), over query tiles of QT rows (N of the score
// products, K of the gradient products). Per tile, in each warpgroup:
//   S^T = K Q^T and dP^T = V dO^T   (shared x shared, two commit groups)
//   P = exp2(S^T - lse), once S^T is done, while dP^T still runs
//   dS^T = P (dP^T - delta)
//   dV += P^T dO and dK += dS^T Q  (registers x shared, dO and Q read transposed)
// Query tiles arrive by cp.async STAGES - 1 tiles ahead: the tile being loaded overwrites the
// buffer of the previous step, whose products every warpgroup has waited for before the barrier
// that precedes the load.
template <typename T, int D>
struct DkdvTiles {
  static constexpr int KV_ROWS = 2 * WG_ROWS, QT = 64, STAGES = 3, AHEAD = STAGES - 1;
  static constexpr int THREADS = 2 * WG_THREADS;
  static constexpr size_t smem_bytes() {
    return SW_ALIGN + sizeof(T) * (2 * KV_ROWS + 2 * STAGES * QT) * D + sizeof(float) * 2 * STAGES * QT;
  }
};

// Query tile of the walk's position, by cp.async from the NT threads that call it: Q and dO rows
// into swizzled tiles, lse and delta beside them. Rows past the block get zero Q, dO, lse and
// delta, which add nothing (see the mma.sync dkdv_kernel).
template <typename T, int D, int QT, int NT>
__device__ __forceinline__ void load_query_tile(T* q_dst, T* do_dst, float* lse_dst, float* dl_dst,
                                                const QueryWalk<QT>& w, int g, const Params& p) {
  load_q_rows<T, D, QT, NT, Swizzled128<QT>>(q_dst, static_cast<const T*>(p.q), w.q0, w.r0, w.qrows, p, g);
  load_q_rows<T, D, QT, NT, Swizzled128<QT>>(do_dst, static_cast<const T*>(p.dout), w.q0, w.r0, w.qrows, p, g);
  for (int i = threadIdx.x; i < 2 * QT; i += NT) {
    const int r = i % QT, gr = w.r0 + r, tok = div_r(gr, p);
    const bool valid = gr < w.qrows;
    const int64_t off = valid ? query_row(w.q0, gr, tok, g, p) : 0;
    if (i < QT)
      cp_async4(lse_dst + r, p.lse + off, valid);
    else
      cp_async4(dl_dst + r, p.delta + off, valid);
  }
}

// One query tile of a warpgroup's 64 keys, for both dK/dV kernels: the four products and the
// scores between them (the sequence in the comment above). dK's products are left in flight.
template <typename T, int D, int KV_ROWS, int QT>
__device__ __forceinline__ void dkdv_tile(float (&dk)[1][D / 8][4], float (&dv)[1][D / 8][4], uint64_t k_desc,
                                          uint64_t v_desc, const T* Qc, const T* dOc, const float* lse_c,
                                          const float* dl_c, bool diag, int r0, int wg, int key_tok, int lane,
                                          const Params& p) {
  constexpr int NJ = QT / 8;
  const uint64_t q_k = kmajor_tile<QT>(Qc), do_k = kmajor_tile<QT>(dOc);
  const uint64_t q_mn = mnmajor_tile<T, QT>(Qc), do_mn = mnmajor_tile<T, QT>(dOc);
  float st[1][NJ][4], dpt[1][NJ][4];
  wgmma_fence();
#pragma unroll
  for (int k = 0; k < D; k += 16)
    wgmma_ss<T, QT>(st[0], kmajor_at<T, KV_ROWS>(k_desc, wg * WG_ROWS, k), kmajor_at<T, QT>(q_k, 0, k), k > 0);
  wgmma_commit();
#pragma unroll
  for (int k = 0; k < D; k += 16)
    wgmma_ss<T, QT>(dpt[0], kmajor_at<T, KV_ROWS>(v_desc, wg * WG_ROWS, k), kmajor_at<T, QT>(do_k, 0, k), k > 0);
  wgmma_commit();
  wgmma_wait<1>();  // S^T done; dP^T may still run
#pragma unroll
  for (int j = 0; j < NJ; ++j)
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      const int col = 8 * j + 2 * (lane % 4) + (e & 1);
      float x = st[0][j][e] * p.scale_log2;
      if (diag && key_tok + 8 * (e / 2) > div_r(r0 + col, p)) x = -INFINITY;
      st[0][j][e] = exp2f(x - lse_c[col]);
    }
  uint32_t pa[1][QT / 16][4];
  to_a_frags<T, 1, QT>(pa, st);
  wgmma_fence();
#pragma unroll
  for (int s = 0; s < QT / 16; ++s) wgmma_rs_tb<T, D>(dv[0], pa[0][s], mnmajor_at<T>(do_mn, 16 * s), true);
  wgmma_commit();
  wgmma_wait<1>();  // dP^T done; dV's products run on while dS is computed
  uint32_t da[1][QT / 16][4];
#pragma unroll
  for (int s = 0; s < QT / 16; ++s)
#pragma unroll
    for (int h = 0; h < 4; ++h) {  // dS = P (dP - delta), straight into A fragments (to_a_frags' order)
      const int j = 2 * s + h / 2, e0 = 2 * (h % 2), col = 8 * j + 2 * (lane % 4);
      da[0][s][h] = pack2<T>(st[0][j][e0] * (dpt[0][j][e0] - dl_c[col]),
                             st[0][j][e0 + 1] * (dpt[0][j][e0 + 1] - dl_c[col + 1]));
    }
  wgmma_fence();
#pragma unroll
  for (int s = 0; s < QT / 16; ++s) wgmma_rs_tb<T, D>(dk[0], da[0][s], mnmajor_at<T>(q_mn, 16 * s), true);
  wgmma_commit();
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

template <typename T, int D>
__global__ void __launch_bounds__(DkdvTiles<T, D>::THREADS, 1) dkdv_kernel(Params p) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  using Tiles = DkdvTiles<T, D>;
  constexpr int KV_ROWS = Tiles::KV_ROWS, QT = Tiles::QT, STAGES = Tiles::STAGES, AHEAD = Tiles::AHEAD;
  constexpr int NT = Tiles::THREADS;
  using KvLayout = Swizzled128<KV_ROWS>;
  extern __shared__ unsigned char smem_raw[];
  // Swizzled tiles start on a 1024-byte boundary (smem_bytes reserves the slack).
  T* Ks = reinterpret_cast<T*>(smem_raw + ((SW_ALIGN - smem_u32(smem_raw) % SW_ALIGN) % SW_ALIGN));
  T* Vs = Ks + KV_ROWS * D;
  T* Qs = Vs + KV_ROWS * D;      // STAGES buffers of QT rows
  T* dOs = Qs + STAGES * QT * D;  // STAGES buffers
  float* lse_s = reinterpret_cast<float*>(dOs + STAGES * QT * D);  // [STAGES][QT]
  float* dl_s = lse_s + STAGES * QT;                              // [STAGES][QT]

  // Linear grid, group fastest: both groups' chunks of a KV block start together. Early blocks
  // have the longest query lists (every later query block can select them), so the longest
  // CTAs of every group start first rather than group 1's after all of group 0's.
  const int nsub = p.block / KV_ROWS, g = blockIdx.x % p.G, chunk = blockIdx.x / p.G;
  const int kb = chunk / nsub, n0 = (chunk % nsub) * KV_ROWS;
  const int b0 = p.bstart[kb], blen = p.bend[kb] - b0;
  if (n0 >= blen) return;
  const int nvalid = min(KV_ROWS, blen - n0);
  const int wg = threadIdx.x / WG_THREADS, warp = (threadIdx.x % WG_THREADS) / 32, lane = threadIdx.x % 32;
  auto load_tile = [&](const QueryWalk<QT>& w, int buf) {
    load_query_tile<T, D, QT, NT>(Qs + buf * QT * D, dOs + buf * QT * D, lse_s + buf * QT, dl_s + buf * QT, w, g, p);
  };

  // K and V travel with the first query tile; every step then commits exactly one group (maybe
  // empty), so "all but the newest AHEAD - 1 groups" is always the tile about to be used.
  load_kv_rows<T, D, NT, KV_ROWS, KvLayout>(Ks, static_cast<const T*>(p.k), b0 + n0, nvalid, g, p.G);
  load_kv_rows<T, D, NT, KV_ROWS, KvLayout>(Vs, static_cast<const T*>(p.v), b0 + n0, nvalid, g, p.G);
  QueryWalk<QT> walk(p, g, kb, n0);  // the tile being multiplied
  QueryWalk<QT> ahead = walk;        // the next tile to load
#pragma unroll
  for (int s = 0; s < AHEAD; ++s) {
    if (!ahead.done()) {
      load_tile(ahead, s);
      ahead.next(p);
    }
    cp_async_commit();
  }

  const uint64_t k_desc = kmajor_tile<KV_ROWS>(Ks), v_desc = kmajor_tile<KV_ROWS>(Vs);
  const int key_tok = n0 + wg * WG_ROWS + warp * 16 + lane / 4;  // this lane's keys: key_tok + 8 h
  // One 64-row tile per warpgroup; the [1] makes them the MI = 1 tiles of the mma.sync helpers.
  float dk[1][D / 8][4], dv[1][D / 8][4];
  zero(dk);
  zero(dv);

  for (int it = 0; !walk.done(); ++it) {
    const int buf = it % STAGES;
    asm volatile("cp.async.wait_group %0;\n" ::"n"(AHEAD - 1) : "memory");
    fence_proxy_async();
    __syncthreads();  // tile `buf` is visible; every warpgroup is done with tile it - 1's buffer
    if (!ahead.done()) {
      load_tile(ahead, (it + AHEAD) % STAGES);
      ahead.next(p);
    }
    cp_async_commit();
    dkdv_tile<T, D, KV_ROWS, QT>(dk, dv, k_desc, v_desc, Qs + buf * QT * D, dOs + buf * QT * D, lse_s + buf * QT,
                                 dl_s + buf * QT, walk.diag(), walk.r0, wg, key_tok, lane, p);
    walk.next(p);
    // Waiting here rather than in the next tile: ptxas serialises every wgmma of the loop when
    // accumulators are in flight across its back edge (warning C7515). The other warpgroup keeps
    // the tensor cores busy meanwhile.
    wgmma_wait<0>();
  }
  asm volatile("cp.async.wait_group 0;\n" ::: "memory");  // no copy outlives the CTA
  store_dkdv<T, D>(dk, dv, key_tok - n0, nvalid, b0 + n0, g, lane, p);
#else
  __trap();  // built without sm_90a: attention.cu launches the mma.sync kernels instead
#endif
}

// ---- dK/dV, warp-specialised ---------------------------------------------------------------------
// The dK/dV kernel above with its loads moved to a third warpgroup: the producer issues every
// cp.async (K/V once, then the query tiles STAGES deep) and signals each buffer on a "full"
// mbarrier; the two consumer warpgroups only multiply, and hand each buffer back on an "empty"
// mbarrier. No CTA-wide barrier is left in the loop, so the consumers drift apart and one's
// softmax runs while the other's products do. setmaxnreg moves registers from the producer
// (which needs few) to the consumers (which hold dK and dV).
template <typename T, int D>
struct DkdvWsTiles {
  static constexpr int KV_ROWS = 2 * WG_ROWS, QT = 64, STAGES = 4;
  // setmaxnreg moves registers within what the CTA was launched with (168 per thread at 384
  // threads): 128 x 40 + 256 x 232 = 128 x 168 x 3. Asking for more hangs the consumers.
  static constexpr int THREADS = 3 * WG_THREADS, PRODUCER_REGS = 40, CONSUMER_REGS = 232;
  static_assert(WG_THREADS * PRODUCER_REGS + 2 * WG_THREADS * CONSUMER_REGS <= THREADS * 168, "register pool");
  static constexpr size_t smem_bytes() {
    return SW_ALIGN + sizeof(T) * (2 * KV_ROWS + 2 * STAGES * QT) * D + sizeof(float) * 2 * STAGES * QT +
           sizeof(uint64_t) * (2 * STAGES + 1);
  }
};

template <typename T, int D>
__global__ void __launch_bounds__(DkdvWsTiles<T, D>::THREADS, 1) dkdv_ws_kernel(Params p) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  using Tiles = DkdvWsTiles<T, D>;
  constexpr int KV_ROWS = Tiles::KV_ROWS, QT = Tiles::QT, STAGES = Tiles::STAGES;
  extern __shared__ unsigned char smem_raw[];
  T* Ks = reinterpret_cast<T*>(smem_raw + ((SW_ALIGN - smem_u32(smem_raw) % SW_ALIGN) % SW_ALIGN));
  T* Vs = Ks + KV_ROWS * D;
  T* Qs = Vs + KV_ROWS * D;
  T* dOs = Qs + STAGES * QT * D;
  float* lse_s = reinterpret_cast<float*>(dOs + STAGES * QT * D);
  float* dl_s = lse_s + STAGES * QT;
  uint64_t* full = reinterpret_cast<uint64_t*>(dl_s + STAGES * QT);
  uint64_t* empty = full + STAGES;
  uint64_t* kv_full = empty + STAGES;

  const int nsub = p.block / KV_ROWS, g = blockIdx.x % p.G, chunk = blockIdx.x / p.G;
  const int kb = chunk / nsub, n0 = (chunk % nsub) * KV_ROWS;
  const int b0 = p.bstart[kb], blen = p.bend[kb] - b0;
  if (n0 >= blen) return;
  const int nvalid = min(KV_ROWS, blen - n0);
  if (threadIdx.x == 0) {
    for (int s = 0; s < STAGES; ++s) {
      mbar_init(full + s, WG_THREADS);       // every producer thread's copies
      mbar_init(empty + s, 2 * WG_THREADS);  // every consumer thread is done with the buffer
    }
    mbar_init(kv_full, WG_THREADS);
    mbar_init_fence();
  }
  __syncthreads();

  if (threadIdx.x < WG_THREADS) {  // producer: threads 0..127 issue the copies
    regs_dec<Tiles::PRODUCER_REGS>();
    load_kv_rows<T, D, WG_THREADS, KV_ROWS, Swizzled128<KV_ROWS>>(Ks, static_cast<const T*>(p.k), b0 + n0, nvalid, g,
                                                                  p.G);
    load_kv_rows<T, D, WG_THREADS, KV_ROWS, Swizzled128<KV_ROWS>>(Vs, static_cast<const T*>(p.v), b0 + n0, nvalid, g,
                                                                  p.G);
    mbar_arrive_cp_async(kv_full);
    QueryWalk<QT> w(p, g, kb, n0);
    for (int j = 0; !w.done(); ++j) {
      const int buf = j % STAGES;
      if (j >= STAGES) mbar_wait(empty + buf, (j / STAGES - 1) & 1);
      load_query_tile<T, D, QT, WG_THREADS>(Qs + buf * QT * D, dOs + buf * QT * D, lse_s + buf * QT, dl_s + buf * QT, w,
                                            g, p);
      mbar_arrive_cp_async(full + buf);
      w.next(p);
    }
    cp_async_wait_all();
  } else {  // consumers: the two warpgroups that multiply
  regs_inc<Tiles::CONSUMER_REGS>();
  const int wg = threadIdx.x / WG_THREADS - 1, warp = (threadIdx.x % WG_THREADS) / 32, lane = threadIdx.x % 32;
  const uint64_t k_desc = kmajor_tile<KV_ROWS>(Ks), v_desc = kmajor_tile<KV_ROWS>(Vs);
  const int key_tok = n0 + wg * WG_ROWS + warp * 16 + lane / 4;
  float dk[1][D / 8][4], dv[1][D / 8][4];
  zero(dk);
  zero(dv);
  mbar_wait(kv_full, 0);
  QueryWalk<QT> walk(p, g, kb, n0);
  for (int it = 0; !walk.done(); ++it) {
    const int buf = it % STAGES;
    mbar_wait(full + buf, (it / STAGES) & 1);
    fence_proxy_async();
    dkdv_tile<T, D, KV_ROWS, QT>(dk, dv, k_desc, v_desc, Qs + buf * QT * D, dOs + buf * QT * D, lse_s + buf * QT,
                                 dl_s + buf * QT, walk.diag(), walk.r0, wg, key_tok, lane, p);
    walk.next(p);
    wgmma_wait<0>();
    mbar_arrive(empty + buf);
  }

  store_dkdv<T, D>(dk, dv, key_tok - n0, nvalid, b0 + n0, g, lane, p);
  }
#else
  __trap();
#endif
}

// ---- Forward and dQ ----------------------------------------------------------------------------
// Linear grid of (query tile, group) CTAs (QueryCta); CTA of two warpgroups, each owning 64 of
// the tile's BM query rows (M of every product), over the K/V chunks of CH keys of KvWalk (N of
// the score products, K of O += P V and dQ += dS K, with V and K read transposed). K/V chunks
// arrive by cp.async STAGES - 1 chunks ahead; each warpgroup waits for its products before the
// next chunk's barrier, so the chunk loaded after it may reuse the oldest buffer.
template <typename T, int D, int QUERY_TILES, int CH>
struct QueryTiles {
  // Three chunk buffers of 64 keys, two of 128 (shared memory); at 128 the loads get one step.
  static constexpr int BM = 2 * WG_ROWS, STAGES = CH == 64 ? 3 : 2, THREADS = 2 * WG_THREADS;
  static constexpr size_t smem_bytes() { return SW_ALIGN + sizeof(T) * (QUERY_TILES * BM + 2 * STAGES * CH) * D; }
};

// The parts of a forward or dQ CTA that do not depend on what it computes: its query rows, the
// K/V chunks it walks, and their ring of shared-memory buffers.
template <typename T, int D, int QUERY_TILES, int CH>
struct QueryCta {
  using Tiles = QueryTiles<T, D, QUERY_TILES, CH>;
  static constexpr int BM = Tiles::BM, STAGES = Tiles::STAGES, NT = Tiles::THREADS;

  T* qtiles;  // QUERY_TILES tiles of BM rows (Q, then dO)
  T* Ks;      // STAGES chunk buffers
  T* Vs;
  int g, qb, q0, row0, nrows;

  __device__ QueryCta(unsigned char* smem_raw, const Params& p) {
    qtiles = reinterpret_cast<T*>(smem_raw + ((SW_ALIGN - smem_u32(smem_raw) % SW_ALIGN) % SW_ALIGN));
    Ks = qtiles + QUERY_TILES * BM * D;
    Vs = Ks + STAGES * CH * D;
    // Linear grid, walked from the last tile and group fastest: late query blocks select the
    // full budget and early ones fewer, so the longest CTAs start first.
    const int tiles = (p.block * p.R + BM - 1) / BM, lin = gridDim.x - 1 - blockIdx.x, tile = lin / p.G;
    g = lin % p.G;
    qb = tile / tiles;
    row0 = (tile % tiles) * BM;
    q0 = p.bstart[qb];
    nrows = (p.bend[qb] - q0) * p.R;
  }
  __device__ bool empty() const { return row0 >= nrows; }
  // Chunk `it`'s K and V tiles in the ring of buffers.
  __device__ const T* keys(int it) const { return Ks + (it % STAGES) * CH * D; }
  __device__ const T* values(int it) const { return Vs + (it % STAGES) * CH * D; }
  // Whether key column col of a diagonal chunk c is hidden from a row of token tok: past the
  // block's end or after the row's token (every key of an off-diagonal chunk is visible).
  __device__ static bool masked(const Chunk& c, int col, int tok) { return col >= c.nvalid || c.kt0 + col > tok; }
  __device__ KvWalk<CH> walk(const Params& p) const {
    return KvWalk<CH>(p, g, qb, q0, nrows / p.R, (min(row0 + BM, nrows) - 1) / p.R);
  }
  __device__ void load_queries(int t, const T* src, const Params& p) {
    load_q_rows<T, D, BM, NT, Swizzled128<BM>>(qtiles + t * BM * D, src, q0, row0, nrows, p, g);
  }
  __device__ void load_chunk(const Chunk& c, int buf, const Params& p) {
    load_kv_rows<T, D, NT, CH, Swizzled128<CH>>(Ks + buf * CH * D, static_cast<const T*>(p.k), c.k0,
                                                      c.nvalid, g, p.G);
    load_kv_rows<T, D, NT, CH, Swizzled128<CH>>(Vs + buf * CH * D, static_cast<const T*>(p.v), c.k0,
                                                      c.nvalid, g, p.G);
  }
  // Called at the top of step `it`: chunk `it` is visible to every thread afterwards, and the
  // load of chunk it + STAGES - 1 is issued into the buffer that chunk it - 1 used.
  __device__ void next_chunk(const KvWalk<CH>& w, int it, const Params& p) {
    asm volatile("cp.async.wait_group %0;\n" ::"n"(STAGES - 2) : "memory");
    fence_proxy_async();
    __syncthreads();
    const int ahead = it + STAGES - 1;
    if (ahead < w.n_total) load_chunk(w.chunk(p, ahead), ahead % STAGES, p);
    cp_async_commit();
  }
  // The first STAGES - 1 chunks, each its own commit group (the query tiles join the first).
  __device__ void prologue(const KvWalk<CH>& w, const Params& p) {
#pragma unroll
    for (int s = 0; s < STAGES - 1; ++s) {
      if (s < w.n_total) load_chunk(w.chunk(p, s), s, p);
      cp_async_commit();
    }
  }
};

template <typename T, int D, int CH>
__global__ void __launch_bounds__(QueryTiles<T, D, 1, CH>::THREADS, 1) fwd_kernel(Params p) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  using Cta = QueryCta<T, D, 1, CH>;
  constexpr int BM = Cta::BM, NJ = CH / 8;
  extern __shared__ unsigned char smem_raw[];
  Cta cta(smem_raw, p);
  if (cta.empty()) return;
  const int wg = threadIdx.x / WG_THREADS, warp = (threadIdx.x % WG_THREADS) / 32, lane = threadIdx.x % 32;
  const KvWalk<CH> walk = cta.walk(p);
  cta.load_queries(0, static_cast<const T*>(p.q), p);
  cta.prologue(walk, p);
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

  for (int it = 0; it < walk.n_total; ++it) {
    cta.next_chunk(walk, it, p);
    const Chunk cur = walk.chunk(p, it);
    const T* Kc = cta.keys(it);
    const T* Vc = cta.values(it);
    const uint64_t k_desc = kmajor_tile<CH>(Kc), v_mn = mnmajor_tile<T, CH>(Vc);
    float s[1][NJ][4];
    wgmma_fence();
#pragma unroll
    for (int k = 0; k < D; k += 16)
      wgmma_ss<T, CH>(s[0], kmajor_at<T, BM>(q_desc, wg * WG_ROWS, k), kmajor_at<T, CH>(k_desc, 0, k), k > 0);
    wgmma_commit();
    wgmma_wait<0>();
    const bool diag = it >= walk.n_off;
    float mx[2] = {-INFINITY, -INFINITY};
#pragma unroll
    for (int j = 0; j < NJ; ++j)
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        float x = s[0][j][e] * p.scale_log2;
        if (diag) {
          const int col = 8 * j + 2 * (lane % 4) + (e & 1);
          if (Cta::masked(cur, col, tok[e / 2])) x = -INFINITY;
        }
        s[0][j][e] = x;
        mx[e / 2] = fmaxf(mx[e / 2], x);
      }
    float alpha[2], m_use[2];
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const float m_new = fmaxf(m[h], quad_max(mx[h]));
      m_use[h] = m_new == -INFINITY ? 0.f : m_new;  // a row with nothing visible yet
      alpha[h] = exp2f(m[h] - m_use[h]);
      m[h] = m_new;
      l[h] *= alpha[h];
    }
#pragma unroll
    for (int j = 0; j < NJ; ++j)
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        s[0][j][e] = exp2f(s[0][j][e] - m_use[e / 2]);
        l[e / 2] += s[0][j][e];
      }
#pragma unroll
    for (int j = 0; j < D / 8; ++j)
#pragma unroll
      for (int e = 0; e < 4; ++e) o[0][j][e] *= alpha[e / 2];
    uint32_t pa[1][CH / 16][4];
    to_a_frags<T, 1, CH>(pa, s);
    wgmma_fence();
#pragma unroll
    for (int k = 0; k < CH / 16; ++k) wgmma_rs_tb<T, D>(o[0], pa[0][k], mnmajor_at<T>(v_mn, 16 * k), true);
    wgmma_commit();
    wgmma_wait<0>();
  }
  asm volatile("cp.async.wait_group 0;\n" ::: "memory");

#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const int gr = wrow + 8 * h;
    const float lsum = quad_sum(l[h]);
    if (gr >= cta.nrows) continue;
    const float inv = 1.f / lsum;
    const int64_t off = query_row(cta.q0, gr, tok[h], cta.g, p);
    uint32_t* out = reinterpret_cast<uint32_t*>(static_cast<T*>(p.out) + off * D + 2 * (lane % 4));
#pragma unroll
    for (int j = 0; j < D / 8; ++j) out[4 * j] = pack2<T>(o[0][j][2 * h] * inv, o[0][j][2 * h + 1] * inv);
    if (lane % 4 == 0) p.lse[off] = m[h] + log2f(lsum);
  }
#else
  __trap();
#endif
}

template <typename T, int D, int CH>
__global__ void __launch_bounds__(QueryTiles<T, D, 2, CH>::THREADS, 1) dq_kernel(Params p) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  using Cta = QueryCta<T, D, 2, CH>;
  constexpr int BM = Cta::BM, NJ = CH / 8;
  extern __shared__ unsigned char smem_raw[];
  Cta cta(smem_raw, p);
  if (cta.empty()) return;
  const int wg = threadIdx.x / WG_THREADS, warp = (threadIdx.x % WG_THREADS) / 32, lane = threadIdx.x % 32;
  const KvWalk<CH> walk = cta.walk(p);
  cta.load_queries(0, static_cast<const T*>(p.q), p);
  cta.load_queries(1, static_cast<const T*>(p.dout), p);
  cta.prologue(walk, p);
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

  for (int it = 0; it < walk.n_total; ++it) {
    cta.next_chunk(walk, it, p);
    const Chunk cur = walk.chunk(p, it);
    const T* Kc = cta.keys(it);
    const T* Vc = cta.values(it);
    const uint64_t k_desc = kmajor_tile<CH>(Kc), v_desc = kmajor_tile<CH>(Vc), k_mn = mnmajor_tile<T, CH>(Kc);
    float s[1][NJ][4], dp[1][NJ][4];
    wgmma_fence();
#pragma unroll
    for (int k = 0; k < D; k += 16)
      wgmma_ss<T, CH>(s[0], kmajor_at<T, BM>(q_desc, wg * WG_ROWS, k), kmajor_at<T, CH>(k_desc, 0, k), k > 0);
    wgmma_commit();
#pragma unroll
    for (int k = 0; k < D; k += 16)
      wgmma_ss<T, CH>(dp[0], kmajor_at<T, BM>(do_desc, wg * WG_ROWS, k), kmajor_at<T, CH>(v_desc, 0, k), k > 0);
    wgmma_commit();
    wgmma_wait<1>();  // S done; dP may still run
    const bool diag = it >= walk.n_off;
#pragma unroll
    for (int j = 0; j < NJ; ++j)
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        float x = s[0][j][e] * p.scale_log2;
        if (diag) {
          const int col = 8 * j + 2 * (lane % 4) + (e & 1);
          if (Cta::masked(cur, col, tok[e / 2])) x = -INFINITY;
        }
        s[0][j][e] = exp2f(x - lse[e / 2]);
      }
    wgmma_wait<0>();
    uint32_t da[1][CH / 16][4];
#pragma unroll
    for (int k = 0; k < CH / 16; ++k)
#pragma unroll
      for (int h = 0; h < 4; ++h) {  // dS = P (dP - delta), straight into A fragments (to_a_frags' order)
        const int j = 2 * k + h / 2, e0 = 2 * (h % 2);
        da[0][k][h] = pack2<T>(s[0][j][e0] * (dp[0][j][e0] - dl[e0 / 2]),
                               s[0][j][e0 + 1] * (dp[0][j][e0 + 1] - dl[e0 / 2]));
      }
    wgmma_fence();
#pragma unroll
    for (int k = 0; k < CH / 16; ++k) wgmma_rs_tb<T, D>(dq[0], da[0][k], mnmajor_at<T>(k_mn, 16 * k), true);
    wgmma_commit();
    wgmma_wait<0>();
  }
  asm volatile("cp.async.wait_group 0;\n" ::: "memory");

#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const int gr = wrow + 8 * h;
    if (gr >= cta.nrows) continue;
    const int64_t off = query_row(cta.q0, gr, tok[h], cta.g, p);
    uint32_t* out = reinterpret_cast<uint32_t*>(static_cast<T*>(p.dq) + off * D + 2 * (lane % 4));
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
