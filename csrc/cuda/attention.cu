// Host side of the CUDA block-sparse attention: input checks, launch configuration and the
// pybind11 bindings of megatron_sparsebalance._C. The kernels are in attention_kernels.cuh.
#include <torch/extension.h>

#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>
#include <cudaTypedefs.h>  // PFN_cuTensorMapEncodeTiled

#include <algorithm>
#include <type_traits>
#include <vector>

#include "cuda/attention_kernels.cuh"
#include "cuda/attention_kernels_sm90.cuh"
#include "check.h"
#include "cuda/bindings.h"

namespace sparsebalance {
namespace {

using kernels::Params;

// Tiles per head dim of the mma.sync kernels (GPUs other than Hopper, and dK/dV at block 64),
// from runs on one H200 at S = 32K, 25% (docs/HISTORY.md):
// * FWD_MI, DQ_MI: slices of 16 query rows per warp. Two slices share every K/V fragment a warp
//   loads; at D = 128 the dQ kernel then spills (255 registers) and runs 1.26x slower, so it
//   keeps one there.
// * DKDV_QT: query rows per dK/dV tile. dK and dV already hold 2 D / 8 x 4 accumulators per
//   lane; 32 rows leave room for the scores without spilling (10-22% faster than 64).
template <int D>
struct Tiles;
template <>
struct Tiles<64> {
  static constexpr int FWD_MI = 2, DQ_MI = 2, DKDV_QT = 32;
};
template <>
struct Tiles<128> {
  static constexpr int FWD_MI = 2, DQ_MI = 1, DKDV_QT = 32;
};

constexpr int QUERY_WARPS = 4;

template <typename Kernel, typename... Args>
void launch(Kernel kernel, dim3 grid, int threads, size_t smem, cudaStream_t stream, const Args&... args) {
  if (grid.x == 0 || grid.y == 0) return;
  C10_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)smem));
  kernel<<<grid, threads, smem, stream>>>(args...);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

// The TMA map of a contiguous, 16-byte aligned [T, H, D] tensor of T's type whose boxes are
// `tokens` consecutive tokens by `heads` consecutive heads by 64 columns, written into shared
// memory token-major and 128-byte swizzled: one slab of a wgmma tile (wgmma.cuh). Coordinates
// outside the tensor read as zeros. The encoder is a driver function; the runtime hands out its
// address, so the extension links no libcuda.
template <typename T>
CUtensorMap row_slab_map(const at::Tensor& x, int heads, int tokens) {
  static const auto encode = [] {
    void* fn = nullptr;
    cudaDriverEntryPointQueryResult found{};
    C10_CUDA_CHECK(cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &fn, 12000, cudaEnableDefault, &found));
    MSB_CHECK(found == cudaDriverEntryPointSuccess && fn != nullptr,
              "the CUDA driver has no cuTensorMapEncodeTiled (the Hopper kernels need CUDA 12 or later)");
    return reinterpret_cast<PFN_cuTensorMapEncodeTiled_v12000>(fn);
  }();
  constexpr int64_t ELEM = sizeof(T);
  const cuuint64_t dims[3] = {(cuuint64_t)x.size(2), (cuuint64_t)x.size(1), (cuuint64_t)x.size(0)};
  const cuuint64_t strides[2] = {(cuuint64_t)(x.size(2) * ELEM), (cuuint64_t)(x.size(1) * x.size(2) * ELEM)};
  const cuuint32_t box[3] = {(cuuint32_t)kernels::sm90::SW_COLS, (cuuint32_t)heads, (cuuint32_t)tokens};
  const cuuint32_t unit[3] = {1, 1, 1};
  CUtensorMap map;
  const CUresult rc = encode(&map, std::is_same<T, __half>::value ? CU_TENSOR_MAP_DATA_TYPE_FLOAT16
                                                                   : CU_TENSOR_MAP_DATA_TYPE_BFLOAT16,
                             3, x.data_ptr(), dims, strides, box, unit, CU_TENSOR_MAP_INTERLEAVE_NONE,
                             CU_TENSOR_MAP_SWIZZLE_128B, CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
                             CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
  MSB_CHECK(rc == CUDA_SUCCESS, "cuTensorMapEncodeTiled failed with CUresult ", (int)rc);
  return map;
}

// The wgmma kernels (attention_kernels_sm90.cuh) need a Hopper GPU, an sm_90a build (setup.py's
// default MSB_CUDA_ARCH) and blocks made of whole chunks of their key rows.
bool use_sm90(int block, int kv_rows) {
#if defined(SPARSEBALANCE_HAS_SM90A)
  return block % kv_rows == 0 && at::cuda::getCurrentDeviceProperties()->major == 9;
#else
  return false;
#endif
}

// Query tiles of bm rows over every block of `block` tokens (R rows per token).
unsigned query_tiles(const Params& p, int bm) { return (unsigned)(p.NB * ((p.block * p.R + bm - 1) / bm)); }

// The kernels load 16-byte vectors from q, k, v and dout.
bool aligned16(const at::Tensor& t) { return reinterpret_cast<uintptr_t>(t.data_ptr()) % 16 == 0; }

void check_inputs(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& kv_idx,
                  const at::Tensor& kv_cnt, const at::Tensor& bstart, const at::Tensor& bend, int64_t block) {
  MSB_CHECK(q.is_cuda() && k.is_cuda() && v.is_cuda(), "q, k, v must be CUDA tensors");
  MSB_CHECK(q.dim() == 3 && k.dim() == 3 && k.sizes() == v.sizes(), "expected q [T, HQ, D], k/v [T, G, D]");
  MSB_CHECK(q.size(0) == k.size(0) && q.size(2) == k.size(2), "q and k differ in tokens or head dim");
  MSB_CHECK(q.size(1) % k.size(1) == 0, "HQ must be a multiple of G");
  MSB_CHECK(q.size(2) == 64 || q.size(2) == 128, "head dim must be 64 or 128, got ", q.size(2));
  MSB_CHECK(q.scalar_type() == at::kBFloat16 || q.scalar_type() == at::kHalf, "q must be bf16 or fp16");
  MSB_CHECK(k.scalar_type() == q.scalar_type() && v.scalar_type() == q.scalar_type(), "q, k, v dtypes differ");
  MSB_CHECK(q.is_contiguous() && k.is_contiguous() && v.is_contiguous(), "q, k, v must be contiguous");
  MSB_CHECK(block == 64 || block == 128 || block == 256, "block size must be 64, 128 or 256");
  MSB_CHECK(aligned16(q) && aligned16(k) && aligned16(v), "q, k, v must be 16-byte aligned");
  for (const at::Tensor* t : {&kv_idx, &kv_cnt, &bstart, &bend})
    MSB_CHECK(t->is_cuda() && t->scalar_type() == at::kInt && t->is_contiguous(),
              "index tensors must be contiguous int32 CUDA tensors");
}

// The kernels' element type and head dim as a value, so one generic lambda serves all four.
template <typename T, int D>
struct Kind {
  using type = T;
  static constexpr int dim = D;
};

// Calls run(Kind<T, D>{}) for q's dtype and head dim (check_inputs allows no others).
template <typename Fn>
void dispatch(const at::Tensor& q, Fn&& run) {
  const bool bf16 = q.scalar_type() == at::kBFloat16;
  if (q.size(2) == 64)
    bf16 ? run(Kind<__nv_bfloat16, 64>{}) : run(Kind<__half, 64>{});
  else
    bf16 ? run(Kind<__nv_bfloat16, 128>{}) : run(Kind<__half, 128>{});
}

Params make_params(const at::Tensor& q, const at::Tensor& k, const at::Tensor& kv_idx, const at::Tensor& kv_cnt,
                   const at::Tensor& bstart, const at::Tensor& bend, double scale, int64_t block) {
  Params p{};
  p.NB = (int)bstart.numel();
  p.KMAX = (int)kv_idx.size(-1);
  p.HQ = (int)q.size(1);
  p.G = (int)k.size(1);
  p.R = p.HQ / p.G;
  p.r_magic = ((1ull << 32) + p.R - 1) / p.R;
  p.block = (int)block;
  p.scale = (float)scale;
  p.scale_log2 = (float)scale * kernels::LOG2E;
  p.kv_idx = kv_idx.data_ptr<int>();
  p.kv_cnt = kv_cnt.data_ptr<int>();
  p.bstart = bstart.data_ptr<int>();
  p.bend = bend.data_ptr<int>();
  return p;
}

// Keys per K/V chunk of the wgmma forward and dQ where blocks hold whole chunks of them and
// shared memory holds three stages of them (QueryTiles): 128 against 64 was 1.07-1.16x faster
// at 0.5B and equal at 3B (S = 32K/64K, one H200). dQ at head dim 128 keeps Q and dO tiles
// beside the chunks, which leave room for three stages of 64 keys only; the forward there, with
// two consumers (sm90::fwd_consumers), takes 128.
template <typename T, int D, int QUERY_TILES, int CONSUMERS>
constexpr int sm90_chunk() {
  return kernels::sm90::QueryTiles<T, D, QUERY_TILES, 128, CONSUMERS>::FITS ? 128 : kernels::CHUNK;
}

// Launches the wgmma forward or dQ (QUERY_TILES 1 or 2) if this GPU and block size take them:
// `large` runs chunks of LARGE_CHUNK keys where the block holds whole ones, `small` chunks of
// CHUNK, each with the TMA maps of k and v in boxes of its chunk. One CTA per (query tile,
// group), linear grid (see QueryCta). Returns whether it launched.
template <typename T, int D, int QUERY_TILES, int CONSUMERS, int LARGE_CHUNK, typename KernelLarge,
          typename KernelSmall>
bool run_query_sm90(KernelLarge large, KernelSmall small, const Params& p, cudaStream_t s, const at::Tensor& k,
                    const at::Tensor& v) {
  using namespace kernels;
  if (!use_sm90(p.block, CHUNK)) return false;
  using Large = sm90::QueryTiles<T, D, QUERY_TILES, LARGE_CHUNK, CONSUMERS>;
  using Small = sm90::QueryTiles<T, D, QUERY_TILES, CHUNK, CONSUMERS>;
  static_assert(Large::BM == Small::BM && Large::THREADS == Small::THREADS, "same CTA either way");
  const dim3 grid(query_tiles(p, Large::BM) * p.G);
  const auto maps = [&](int chunk) {
    return sm90::ChunkMaps{row_slab_map<T>(k, 1, chunk), row_slab_map<T>(v, 1, chunk)};
  };
  if (p.block % LARGE_CHUNK == 0)
    launch(large, grid, Large::THREADS, Large::smem_bytes(), s, p, maps(LARGE_CHUNK));
  else
    launch(small, grid, Small::THREADS, Small::smem_bytes(), s, p, maps(CHUNK));
  return true;
}

template <typename T, int D>
void run_fwd(const Params& p, cudaStream_t s, const at::Tensor& k, const at::Tensor& v) {
  using namespace kernels;
  constexpr int WGS = sm90::fwd_consumers(D), LARGE = sm90_chunk<T, D, 1, WGS>();
  if (run_query_sm90<T, D, 1, WGS, LARGE>(sm90::fwd_kernel<T, D, LARGE, WGS>, sm90::fwd_kernel<T, D, CHUNK, WGS>, p, s,
                                          k, v))
    return;
  constexpr int MI = Tiles<D>::FWD_MI, BM = QUERY_WARPS * MI * WARP_ROWS;
  launch(fwd_kernel<T, D, QUERY_WARPS, MI>, dim3(query_tiles(p, BM), p.G), QUERY_WARPS * 32, fwd_smem<T, D, BM>(), s,
         p);
}

// The Hopper dK/dV's plan (sm90::dkdv_plan_kernel) from the transposed index's offsets, with
// room for `max_slots` partial sums of cut lists. The caller may drop its tensors once the kernel
// that reads them is queued: the caching allocator hands their bytes out again only to work
// queued after that on this stream.
struct DkdvPlan {
  // The ints of the plan's one allocation: items [pairs + share, 4], split [pairs, 2], arrivals
  // [pairs * nsub], in that order (items first, so that its int4 rows start 16-byte aligned).
  static int64_t ints(int pairs, int share, int nsub) {
    return (int64_t)(pairs + share) * 4 + (int64_t)pairs * 2 + (int64_t)pairs * nsub;
  }
  at::Tensor items, split, arrivals;  // views of that allocation
  int max_items;
};

// CTA places a dK/dV walk is spread over: one per SM (one CTA fits an SM), so that no part of a
// cut list is longer than an SM's share of the walk. Two per SM (parts of half a share) made the
// kernel 3% slower at 0.5B 32K 25%, where they cut lists that whole ones balance as well.
int dkdv_share() { return at::cuda::getCurrentDeviceProperties()->multiProcessorCount; }

DkdvPlan dkdv_plan(const at::Tensor& q_ptr, int G, int NB, int nsub, int max_slots, int share, cudaStream_t s) {
  using kernels::sm90::PLAN_BINS;
  const int pairs = G * NB;
  int shift = 0;  // part lengths (at most NB) >> shift fit the bins
  while ((NB >> shift) >= PLAN_BINS) ++shift;
  const int max_items = pairs + share;
  const std::vector<at::Tensor> parts = at::empty({DkdvPlan::ints(pairs, share, nsub)}, q_ptr.options())
                                            .split_with_sizes({(int64_t)max_items * 4, (int64_t)pairs * 2,
                                                               (int64_t)pairs * nsub});
  DkdvPlan plan{parts[0].view({max_items, 4}), parts[1].view({pairs, 2}), parts[2], max_items};
  kernels::sm90::dkdv_plan_kernel<<<1, kernels::sm90::PLAN_THREADS, 0, s>>>(
      q_ptr.data_ptr<int>(), pairs, shift, share, max_slots, nsub, plan.max_items,
      reinterpret_cast<int4*>(plan.items.data_ptr<int>()), reinterpret_cast<int2*>(plan.split.data_ptr<int>()),
      plan.arrivals.data_ptr<int>());
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return plan;
}

// `headroom`: bytes the dK/dV phase may allocate beyond dK, dV and delta without raising the
// backward's peak (see the caller).
template <typename T, int D>
void run_dkdv(Params p, int64_t nrows, cudaStream_t s, const at::Tensor& q, const at::Tensor& dout,
              const at::Tensor& k, const at::Tensor& v, const at::Tensor& q_ptr, int64_t headroom) {
  using namespace kernels;
  if (nrows > 0) {
    const int64_t ctas = (nrows + delta_rows_per_cta<D>() - 1) / delta_rows_per_cta<D>();
    delta_kernel<T, D><<<(unsigned)ctas, DELTA_THREADS, 0, s>>>(static_cast<const T*>(p.o),
                                                               static_cast<const T*>(p.dout), p.delta, nrows);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  }
  using Sm90 = sm90::DkdvTiles<T, D>;
  if (use_sm90(p.block, Sm90::KV_ROWS)) {
    const int nsub = p.block / Sm90::KV_ROWS, pairs = p.G * p.NB, share = dkdv_share();
    // A slot holds one part's fp32 dK and dV (D per consumer thread) for each of a block's nsub
    // chunks. A list cut into n parts takes n <= 2 (n - 1) slots, and the n - 1 < L / cap parts
    // it adds come to fewer than share over all lists (total / cap0 <= share): 2 * share slots
    // at most, and never more than the headroom less the plan (one allocation, which the caching
    // allocator rounds up to 512 bytes).
    const int64_t slot_bytes = (int64_t)nsub * 2 * sm90::WG_THREADS * D * sizeof(float);
    const int64_t plan_bytes = DkdvPlan::ints(pairs, share, nsub) * (int64_t)sizeof(int) + 512;
    const int max_slots = (int)std::min<int64_t>(std::max<int64_t>(headroom - plan_bytes, 0) / slot_bytes, 2 * share);
    const DkdvPlan plan = dkdv_plan(q_ptr, p.G, p.NB, nsub, max_slots, share, s);
    const at::Tensor partials = at::empty({max_slots * slot_bytes / (int64_t)sizeof(float)},
                                          q.options().dtype(at::kFloat));
    p.dkdv_items = reinterpret_cast<const int4*>(plan.items.data_ptr<int>());
    p.dkdv_split = reinterpret_cast<const int2*>(plan.split.data_ptr<int>());
    p.dkdv_arrivals = plan.arrivals.data_ptr<int>();
    p.dkdv_partials = partials.data_ptr<float>();
    const int heads = sm90::dkdv_tile_heads(Sm90::QT, p.R), tokens = Sm90::QT / heads;
    const sm90::DkdvMaps maps{row_slab_map<T>(q, heads, tokens), row_slab_map<T>(dout, heads, tokens),
                              row_slab_map<T>(k, 1, Sm90::KV_ROWS), row_slab_map<T>(v, 1, Sm90::KV_ROWS)};
    if constexpr (D == 128) {  // stored_ds_supported
      if (p.ds != nullptr)
        return launch(sm90::dkdv_kernel<T, D, true>, dim3(plan.max_items * nsub), Sm90::THREADS, Sm90::smem_bytes(),
                      s, p, maps);
    }
    launch(sm90::dkdv_kernel<T, D, false>, dim3(plan.max_items * nsub), Sm90::THREADS, Sm90::smem_bytes(), s, p,
           maps);
    return;
  }
  MSB_CHECK(p.ds == nullptr, "the stored-dS backward needs the Hopper kernels (sm_90a, block 128)");
  constexpr int QT = Tiles<D>::DKDV_QT;
  launch(dkdv_kernel<T, D, QT>, dim3(p.NB * (p.block / CHUNK), p.G), CHUNK / WARP_ROWS * 32,
         dkdv_smem<T, D, QT>(), s, p);
}

template <typename T, int D>
void run_dq(const Params& p, cudaStream_t s, const at::Tensor& k, const at::Tensor& v) {
  using namespace kernels;
  constexpr int WGS = sm90::DQ_CONSUMERS, LARGE = sm90_chunk<T, D, 2, WGS>();
  if (run_query_sm90<T, D, 2, WGS, LARGE>(sm90::dq_kernel<T, D, LARGE, WGS>, sm90::dq_kernel<T, D, CHUNK, WGS>, p, s,
                                          k, v))
    return;
  constexpr int MI = Tiles<D>::DQ_MI, BM = QUERY_WARPS * MI * WARP_ROWS;
  launch(dq_kernel<T, D, QUERY_WARPS, MI>, dim3(query_tiles(p, BM), p.G), QUERY_WARPS * 32, dq_smem<T, D, BM>(), s,
         p);
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
  dispatch(q, [&](auto kind) { run_fwd<typename decltype(kind)::type, decltype(kind)::dim>(p, s, k, v); });
  return {out, lse};
}

void check_backward_inputs(const at::Tensor& dout, const at::Tensor& q, const at::Tensor& lse) {
  MSB_CHECK(dout.sizes() == q.sizes() && dout.is_contiguous() && dout.scalar_type() == q.scalar_type(),
            "dout must be a contiguous [T, HQ, D] tensor of q's dtype");
  MSB_CHECK(aligned16(dout), "dout must be 16-byte aligned");
  MSB_CHECK(lse.scalar_type() == at::kFloat && lse.is_contiguous() && lse.dim() == 2 && lse.size(0) == q.size(0) &&
                lse.size(1) == q.size(1),
            "lse must be contiguous float32 [T, HQ]");
}

// Whether this GPU takes the stored-dS backward (dK/dV writing dS to `ds`, then
// sparse_attn_bwd_dq_from_ds_cuda) at this block size and head dim: Hopper, block 128, head dim
// 128. At head dim 64 dK/dV forms dS as the 16-bit product of P and dP - delta, each rounded
// first, and dQ from those values missed the kernel grid's error bound (3.5e-2 against 2.6e-2
// for dQ at 97 tokens, budget 1); it was also 3-8% slower there than the two-pass backward.
bool stored_ds_supported(int64_t block, int64_t head_dim) {
  return block == kernels::sm90::DS_KEYS && head_dim == 128 && use_sm90((int)block, 128);
}

// Where the stored-dS backward runs (stored_ds_supported), and its buffer: a slot for every entry
// the route's shape holds (G * NB * K), since the true count is on the device and the kernels
// index slots up to it. Both entries that take `ds` check it here.
void check_ds(const at::Tensor& ds, const at::Tensor& q, const at::Tensor& k, const at::Tensor& kv_idx,
              int64_t block) {
  MSB_CHECK(stored_ds_supported(block, q.size(2)),
            "the stored-dS backward runs on Hopper (sm_90a) at block 128 and head dim 128 only");
  const int64_t slots = kv_idx.size(0) * kv_idx.size(1) * kv_idx.size(2);
  MSB_CHECK(ds.is_cuda() && ds.is_contiguous() && ds.scalar_type() == q.scalar_type() && aligned16(ds) &&
                ds.numel() == slots * kernels::sm90::ds_slot_values((int)(q.size(1) / k.size(1)), (int)block),
            "ds must be a contiguous, 16-byte aligned tensor of q's dtype of G * NB * K slots of R * block * 128 "
            "values");
}

// dK, dV and delta (= rowsum(out * dout), which dQ needs as well). The caller frees the
// transposed index (q_ptr, q_idx) before it asks for dQ, so the backward's peak holds the three
// gradients and delta but never the index beside dQ.
std::vector<at::Tensor> sparse_attn_bwd_dkdv_cuda(const at::Tensor& dout, const at::Tensor& q, const at::Tensor& k,
                                                  const at::Tensor& v, const at::Tensor& out, const at::Tensor& lse,
                                                  const at::Tensor& kv_idx, const at::Tensor& kv_cnt,
                                                  const at::Tensor& bstart, const at::Tensor& bend,
                                                  const at::Tensor& q_ptr, const at::Tensor& q_idx, double scale,
                                                  int64_t block, const c10::optional<at::Tensor>& ds) {
  check_inputs(q, k, v, kv_idx, kv_cnt, bstart, bend, block);
  if (ds.has_value()) {
    check_ds(*ds, q, k, kv_idx, block);
  }
  check_backward_inputs(dout, q, lse);
  MSB_CHECK(out.sizes() == q.sizes() && out.is_contiguous() && out.scalar_type() == q.scalar_type() && aligned16(out),
            "out must be a contiguous, 16-byte aligned [T, HQ, D] tensor of q's dtype");
  MSB_CHECK(q_ptr.is_cuda() && q_idx.is_cuda() && q_ptr.scalar_type() == at::kInt &&
                q_idx.scalar_type() == at::kInt && q_ptr.is_contiguous() && q_idx.is_contiguous() &&
                q_ptr.numel() == k.size(1) * bstart.numel() + 1,
            "q_ptr/q_idx must be contiguous int32 CUDA tensors, q_ptr of G * NB + 1 offsets");
  const c10::cuda::CUDAGuard guard(q.device());
  auto delta = at::empty({q.size(0), q.size(1)}, q.options().dtype(at::kFloat));
  auto dk = at::empty_like(k);
  auto dv = at::empty_like(v);
  Params p = make_params(q, k, kv_idx, kv_cnt, bstart, bend, scale, block);
  if (q.size(0) == 0 || p.NB == 0) return {dk, dv, delta};
  p.q = q.data_ptr();
  p.k = k.data_ptr();
  p.v = v.data_ptr();
  p.o = out.data_ptr();
  p.dout = dout.data_ptr();
  p.dk = dk.data_ptr();
  p.dv = dv.data_ptr();
  p.lse = lse.data_ptr<float>();
  p.delta = delta.data_ptr<float>();
  p.q_ptr = q_ptr.data_ptr<int>();
  p.q_idx = q_idx.data_ptr<int>();
  if (ds.has_value()) p.ds = ds->data_ptr();
  auto s = at::cuda::getCurrentCUDAStream().stream();
  const int64_t nrows = q.size(0) * q.size(1);
  // The caller frees the index before it allocates dQ (q's size): what dK/dV allocates besides
  // the index may take the rest of those bytes (512-byte rounding each) and leave the peak as is,
  // less 1 MiB: the caching allocator hands out a cached block whole when at most 1 MiB of it
  // would be left over (the partial sums took a freed 32 MiB block for 31.9 MiB and passed dQ).
  const int64_t headroom = q.nbytes() - q_ptr.nbytes() - q_idx.nbytes() - 2 * 512 - (1 << 20);
  dispatch(q, [&](auto kind) {
    run_dkdv<typename decltype(kind)::type, decltype(kind)::dim>(p, nrows, s, q, dout, k, v, q_ptr, headroom);
  });
  return {dk, dv, delta};
}

at::Tensor sparse_attn_bwd_dq_cuda(const at::Tensor& dout, const at::Tensor& q, const at::Tensor& k,
                                   const at::Tensor& v, const at::Tensor& lse, const at::Tensor& delta,
                                   const at::Tensor& kv_idx, const at::Tensor& kv_cnt, const at::Tensor& bstart,
                                   const at::Tensor& bend, double scale, int64_t block) {
  check_inputs(q, k, v, kv_idx, kv_cnt, bstart, bend, block);
  check_backward_inputs(dout, q, lse);
  MSB_CHECK(delta.sizes() == lse.sizes() && delta.scalar_type() == at::kFloat && delta.is_contiguous(),
            "delta must be contiguous float32 [T, HQ]");
  const c10::cuda::CUDAGuard guard(q.device());
  auto dq = at::empty_like(q);
  Params p = make_params(q, k, kv_idx, kv_cnt, bstart, bend, scale, block);
  if (q.size(0) == 0 || p.NB == 0) return dq;
  p.q = q.data_ptr();
  p.k = k.data_ptr();
  p.v = v.data_ptr();
  p.dout = dout.data_ptr();
  p.dq = dq.data_ptr();
  p.lse = lse.data_ptr<float>();
  p.delta = delta.data_ptr<float>();
  auto s = at::cuda::getCurrentCUDAStream().stream();
  dispatch(q, [&](auto kind) { run_dq<typename decltype(kind)::type, decltype(kind)::dim>(p, s, k, v); });
  return dq;
}

// dQ from the dS tiles that sparse_attn_bwd_dkdv_cuda stored in `ds`, at the places that
// transpose_index_cuda's `slots` name.
at::Tensor sparse_attn_bwd_dq_from_ds_cuda(const at::Tensor& q, const at::Tensor& k, const at::Tensor& ds,
                                           const at::Tensor& slots, const at::Tensor& kv_idx,
                                           const at::Tensor& kv_cnt, const at::Tensor& bstart,
                                           const at::Tensor& bend, double scale, int64_t block) {
  check_inputs(q, k, k, kv_idx, kv_cnt, bstart, bend, block);
  check_ds(ds, q, k, kv_idx, block);
  MSB_CHECK(slots.is_cuda() && slots.scalar_type() == at::kInt && slots.is_contiguous() &&
                slots.sizes() == kv_idx.sizes(),
            "slots must be a contiguous int32 CUDA tensor shaped like kv_idx");
  const c10::cuda::CUDAGuard guard(q.device());
  auto dq = at::empty_like(q);
  Params p = make_params(q, k, kv_idx, kv_cnt, bstart, bend, scale, block);
  if (q.size(0) == 0 || p.NB == 0) return dq;
  p.dq = dq.data_ptr();
  p.ds = const_cast<void*>(ds.data_ptr());
  p.ds_slots = slots.data_ptr<int>();
  auto s = at::cuda::getCurrentCUDAStream().stream();
  const auto run = [&](auto element) {
    using T = decltype(element);
    using Tiles = kernels::sm90::DsTiles<T, 128>;
    const dim3 grid((unsigned)(p.G * p.NB * (p.R * p.block / Tiles::BM)));
    launch(kernels::sm90::dq_from_ds_kernel<T, 128>, grid, Tiles::THREADS, Tiles::smem_bytes(), s, p,
           row_slab_map<T>(k, 1, kernels::sm90::DS_KEYS));
  };
  q.scalar_type() == at::kBFloat16 ? run(__nv_bfloat16{}) : run(__half{});
  return dq;
}

}  // namespace

void register_cuda_ops(pybind11::module& m) {
  m.def("sparse_attn_fwd_cuda", &sparse_attn_fwd_cuda, "block-sparse attention forward (CUDA): (out, lse)",
        pybind11::arg("q"), pybind11::arg("k"), pybind11::arg("v"), pybind11::arg("kv_idx"), pybind11::arg("kv_cnt"),
        pybind11::arg("block_start"), pybind11::arg("block_end"), pybind11::arg("softmax_scale"),
        pybind11::arg("block_size"));
  m.def("sparse_attn_bwd_dkdv_cuda", &sparse_attn_bwd_dkdv_cuda,
        "block-sparse attention backward, first half (CUDA): (dk, dv, delta)", pybind11::arg("dout"),
        pybind11::arg("q"), pybind11::arg("k"), pybind11::arg("v"), pybind11::arg("out"), pybind11::arg("lse"),
        pybind11::arg("kv_idx"), pybind11::arg("kv_cnt"), pybind11::arg("block_start"), pybind11::arg("block_end"),
        pybind11::arg("q_ptr"), pybind11::arg("q_idx"), pybind11::arg("softmax_scale"), pybind11::arg("block_size"),
        pybind11::arg("ds") = pybind11::none());
  m.def("stored_ds_supported", &stored_ds_supported,
        "whether the current GPU takes the stored-dS backward at this block size and head dim",
        pybind11::arg("block_size"), pybind11::arg("head_dim"));
  m.def("sparse_attn_bwd_dq_from_ds_cuda", &sparse_attn_bwd_dq_from_ds_cuda,
        "block-sparse attention backward, dQ from the dS tiles dK/dV stored (CUDA)", pybind11::arg("q"),
        pybind11::arg("k"), pybind11::arg("ds"), pybind11::arg("slots"), pybind11::arg("kv_idx"),
        pybind11::arg("kv_cnt"), pybind11::arg("block_start"), pybind11::arg("block_end"),
        pybind11::arg("softmax_scale"), pybind11::arg("block_size"));
  m.def(
      "dkdv_plan_cuda",
      [](const at::Tensor& q_ptr, int64_t G, int64_t NB, int64_t nsub, int64_t max_slots) {
        MSB_CHECK(q_ptr.is_cuda() && q_ptr.scalar_type() == at::kInt && q_ptr.is_contiguous() &&
                      q_ptr.numel() == G * NB + 1,
                  "q_ptr must be a contiguous int32 CUDA tensor of G * NB + 1 offsets");
        MSB_CHECK(nsub >= 1 && max_slots >= 0, "nsub must be >= 1 and max_slots >= 0");
        const c10::cuda::CUDAGuard guard(q_ptr.device());
        const int share = dkdv_share();
        const DkdvPlan plan = dkdv_plan(q_ptr, (int)G, (int)NB, (int)nsub, (int)max_slots, share,
                                        at::cuda::getCurrentCUDAStream().stream());
        return std::make_tuple(plan.items, plan.split, share);
      },
      "the Hopper dK/dV kernel's plan: (items [pairs + share, 4] = (pair g * NB + kb, lo, hi, part), longest "
      "first, pair -1 past the last; split [pairs, 2] = (first slot or -1, parts); share)",
      pybind11::arg("q_ptr"), pybind11::arg("G"), pybind11::arg("NB"), pybind11::arg("nsub"),
      pybind11::arg("max_slots"));
  m.def("sparse_attn_bwd_dq_cuda", &sparse_attn_bwd_dq_cuda, "block-sparse attention backward, dQ (CUDA)",
        pybind11::arg("dout"), pybind11::arg("q"), pybind11::arg("k"), pybind11::arg("v"), pybind11::arg("lse"),
        pybind11::arg("delta"), pybind11::arg("kv_idx"), pybind11::arg("kv_cnt"), pybind11::arg("block_start"),
        pybind11::arg("block_end"), pybind11::arg("softmax_scale"), pybind11::arg("block_size"));
}

}  // namespace sparsebalance
