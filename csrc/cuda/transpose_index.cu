// The transposed (per-KV-block) index of a route, built on the GPU for the backward's dK/dV
// kernels: for every (group g, KV block j), the query blocks whose selection holds j, ascending.
// The same lists in flash-attn-4's layout (fa4_backward_index_cuda) for --sparse-attn-impl fa4.
//
// Why by hand: the same CSR from torch ops (a stable sort of the keys, a division, a
// searchsorted) is eight launches, about 0.3 ms of host time in every layer's backward; these
// are three launches from C++. The order inside each list is fixed by construction (no atomics),
// so the gradients that depend on it stay deterministic.
#include <torch/extension.h>

#include <c10/cuda/CUDAStream.h>
#include <c10/cuda/CUDAGuard.h>

#include "check.h"
#include "cuda/bindings.h"
#include "cuda/warp.cuh"

namespace sparsebalance {
namespace {

constexpr int LIST_THREADS = 256;  // one CTA per (group, KV block), one query block per thread
constexpr int LIST_WARPS = LIST_THREADS / 32;
constexpr int SCAN_THREADS = 1024;

// Where a route row holds block j, or -1. The row's `cnt` valid entries are ascending (the
// route's contract: selected blocks in order, the diagonal block, the largest, last).
__device__ __forceinline__ int row_position(const int* __restrict__ row, int cnt, int j) {
  int lo = 0, hi = cnt;
  while (lo < hi) {
    const int mid = (lo + hi) >> 1;
    if (__ldg(row + mid) < j) lo = mid + 1;
    else hi = mid;
  }
  return lo < cnt && __ldg(row + lo) == j ? lo : -1;
}

// Where row i of group g holds j, or -1. Only rows i >= j can hold j (a row selects blocks up
// to its own).
__device__ __forceinline__ int position(const int* kv_idx, const int* kv_cnt, int g, int nb, int width, int i,
                                       int j) {
  if (i >= nb) return -1;
  const int64_t row = (int64_t)g * nb + i;
  return row_position(kv_idx + row * width, __ldg(kv_cnt + row), j);
}

__device__ __forceinline__ bool holds(const int* kv_idx, const int* kv_cnt, int g, int nb, int width, int i,
                                      int j) {
  return position(kv_idx, kv_cnt, g, nb, width, i, j) >= 0;
}

// counts[g * nb + j] (stored at q_ptr[g * nb + j + 1]) = query blocks that hold j.
__global__ void __launch_bounds__(LIST_THREADS)
count_kernel(const int* kv_idx, const int* kv_cnt, int nb, int width, int* q_ptr) {
  const int g = blockIdx.y, j = blockIdx.x;
  int n = 0;
  for (int i = j + threadIdx.x; i < nb; i += LIST_THREADS) n += holds(kv_idx, kv_cnt, g, nb, width, i, j);
  n = warp_sum(n);
  __shared__ int warp_n[LIST_WARPS];
  if (threadIdx.x % 32 == 0) warp_n[threadIdx.x / 32] = n;
  __syncthreads();
  if (threadIdx.x == 0) {
    int total = 0;
    for (int w = 0; w < LIST_WARPS; ++w) total += warp_n[w];
    q_ptr[(int64_t)g * nb + j + 1] = total;
  }
}

// In place: q_ptr[1..n] from counts to their running sums (q_ptr[0] = 0). One CTA; each thread
// owns a contiguous run of entries.
__global__ void __launch_bounds__(SCAN_THREADS) scan_kernel(int* q_ptr, int n) {
  const int per = (n + SCAN_THREADS - 1) / SCAN_THREADS;
  const int lo = 1 + threadIdx.x * per, hi = min(n + 1, lo + per);
  int own = 0;
  for (int e = lo; e < hi; ++e) own += q_ptr[e];
  int run = cta_exclusive_sum(own);  // the threads' sums before this one's
  for (int e = lo; e < hi; ++e) {
    run += q_ptr[e];
    q_ptr[e] = run;
  }
  if (threadIdx.x == 0) q_ptr[0] = 0;
}

// One pass of a CTA over LIST_THREADS consecutive rows: (the rank of this thread's hit among the
// pass's hits in row order, the pass's hits), by a ballot within each warp and the warps' counts
// before it. Every thread of the CTA calls it.
__device__ __forceinline__ int2 pass_rank(bool hit) {
  __shared__ int warp_n[LIST_WARPS];
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  const unsigned ballot = __ballot_sync(0xffffffffu, hit);
  if (lane == 0) warp_n[warp] = __popc(ballot);
  __syncthreads();
  int before = 0, total = 0;
  for (int w = 0; w < LIST_WARPS; ++w) {
    before += w < warp ? warp_n[w] : 0;
    total += warp_n[w];
  }
  __syncthreads();  // warp_n is rewritten by the next pass
  return make_int2(before + __popc(ballot & ((1u << lane) - 1u)), total);
}

// q_idx[q_ptr[g * nb + j] ...]: the query blocks that hold j, ascending: each pass of the CTA
// covers LIST_THREADS consecutive rows and writes its hits in row order. Where `slots` is given
// ([G, NB, width], like kv_idx), each hit's place in the transposed lists goes to the route's
// entry it came from: the stored-dS backward's dQ walks the route and finds there the tile the
// dK/dV kernel wrote while walking the transposed lists.
__global__ void __launch_bounds__(LIST_THREADS)
fill_kernel(const int* kv_idx, const int* kv_cnt, int nb, int width, const int* q_ptr, int* q_idx, int* slots) {
  const int g = blockIdx.y, j = blockIdx.x;
  int base = q_ptr[(int64_t)g * nb + j];
  for (int i0 = j; i0 < nb; i0 += LIST_THREADS) {
    const int i = i0 + threadIdx.x, pos = position(kv_idx, kv_cnt, g, nb, width, i, j);
    const int2 rank = pass_rank(pos >= 0);
    if (pos >= 0) {
      q_idx[base + rank.x] = i;
      if (slots != nullptr) slots[((int64_t)g * nb + i) * width + pos] = base + rank.x;
    }
    base += rank.y;
  }
}

// FA4's transposed block-sparse tensors for its backward (ops/fa4_attention.py, FA4BlockPlan's
// bwd_full_*), one query head at a time: for every KV sub-block n of 128 keys, the query
// sub-blocks that read it as a *full* block, ascending (the diagonal one, each list's partial
// block, is FA4's mask tensor and not listed here). With f = block / 128 sub-blocks per block of
// ours, sub-block n = f j + s of block j is read by sub-blocks f i + t of every query block i > j
// whose selection holds j, and, for s < t < f, by its own block's later sub-blocks.
//
// Why by hand: the same tensors from torch ops (a dense [G, M, M] selection, a sort, a repeat for
// the heads of each group) are about twenty launches, 0.4-0.6 ms of host time on an H100 in every
// layer's backward, which at 32K tokens the GPU waited for; this is one launch, writing every
// head of the group at once and only the entries FA4 reads (the rest of idx is left as
// allocated). The order inside each list is fixed by construction (ballots in row order, no
// atomics).
__global__ void __launch_bounds__(LIST_THREADS)
fa4_backward_index_kernel(const int* kv_idx, const int* kv_cnt, int nb, int width, int heads_per_group, int f,
                          int out_width, int* cnt, int* idx) {
  const int g = blockIdx.y, j = blockIdx.x, m = nb * f;
  const int h0 = g * heads_per_group;
  // Rows of (head h, sub-block f j + s): sub-block s of the diagonal block is first read, in
  // full, by its own block's sub-blocks s + 1 .. f - 1, then by f sub-blocks of each later
  // reader; a reader's t-th sub-block lands at own(s) + f r + t, r its rank among the readers.
  const auto row = [&](int h, int s) { return ((int64_t)h * m + (int64_t)f * j + s) * out_width; };
  const auto own = [&](int s) { return f - 1 - s; };
  for (int e = threadIdx.x; e < heads_per_group * f * f; e += LIST_THREADS) {
    const int h = h0 + e / (f * f), s = e / f % f, t = e % f;
    if (t > s && t - s - 1 < out_width) idx[row(h, s) + (t - s - 1)] = f * j + t;
  }
  int readers = 0;
  for (int i0 = j + 1; i0 < nb; i0 += LIST_THREADS) {
    const int i = i0 + threadIdx.x;
    const bool hit = holds(kv_idx, kv_cnt, g, nb, width, i, j);
    const int2 rank = pass_rank(hit);
    if (hit) {
      const int r = readers + rank.x;
      for (int h = h0; h < h0 + heads_per_group; ++h)
        for (int s = 0; s < f; ++s)
          for (int t = 0; t < f; ++t)
            if (own(s) + f * r + t < out_width) idx[row(h, s) + own(s) + f * r + t] = f * i + t;
    }
    readers += rank.y;
  }
  for (int e = threadIdx.x; e < heads_per_group * f; e += LIST_THREADS)
    cnt[(int64_t)(h0 + e / f) * m + f * j + e % f] = own(e % f) + f * readers;
}

// The route's tensors as both kernels read them.
void check_route(const at::Tensor& kv_idx, const at::Tensor& kv_cnt) {
  MSB_CHECK(kv_idx.is_cuda() && kv_idx.dim() == 3 && kv_idx.scalar_type() == at::kInt && kv_idx.is_contiguous(),
            "kv_idx must be a contiguous int32 CUDA tensor [G, NB, K]");
  MSB_CHECK(kv_cnt.is_cuda() && kv_cnt.scalar_type() == at::kInt && kv_cnt.is_contiguous() &&
                kv_cnt.dim() == 2 && kv_cnt.size(0) == kv_idx.size(0) && kv_cnt.size(1) == kv_idx.size(1),
            "kv_cnt must be a contiguous int32 CUDA tensor [G, NB] matching kv_idx");
  const int64_t G = kv_idx.size(0), NB = kv_idx.size(1), K = kv_idx.size(2);
  MSB_CHECK(G * NB * K < INT32_MAX, "route too large for an int32 index: G * NB * K = ", G * NB * K);
  MSB_CHECK(G < 65536, "at most 65535 KV-head groups, got ", G);
}

// (q_ptr, q_idx) and, with `with_slots`, slots [G, NB, K] (see fill_kernel; entries past a
// row's count unspecified).
std::vector<at::Tensor> transpose_index_cuda(const at::Tensor& kv_idx, const at::Tensor& kv_cnt, bool with_slots) {
  check_route(kv_idx, kv_cnt);
  const int64_t G = kv_idx.size(0), NB = kv_idx.size(1), K = kv_idx.size(2);
  const c10::cuda::CUDAGuard guard(kv_idx.device());
  const auto opts = kv_idx.options();
  // q_idx is sized by the upper bound G * NB * K: its true length, q_ptr[-1], is on the device,
  // and reading it would stop the host in every backward.
  at::Tensor q_ptr = at::empty({G * NB + 1}, opts), q_idx = at::empty({G * NB * K}, opts);
  at::Tensor slots = with_slots ? at::empty({G, NB, K}, opts) : at::Tensor();
  const auto result = [&]() -> std::vector<at::Tensor> {
    if (with_slots) return {q_ptr, q_idx, slots};
    return {q_ptr, q_idx};
  };
  if (G * NB == 0) {
    q_ptr.zero_();
    return result();
  }
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  const dim3 grid((unsigned)NB, (unsigned)G);
  const int* idx = kv_idx.data_ptr<int>();
  const int* cnt = kv_cnt.data_ptr<int>();
  count_kernel<<<grid, LIST_THREADS, 0, stream>>>(idx, cnt, (int)NB, (int)K, q_ptr.data_ptr<int>());
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  scan_kernel<<<1, SCAN_THREADS, 0, stream>>>(q_ptr.data_ptr<int>(), (int)(G * NB));
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  fill_kernel<<<grid, LIST_THREADS, 0, stream>>>(idx, cnt, (int)NB, (int)K, q_ptr.data_ptr<int>(),
                                                 q_idx.data_ptr<int>(), with_slots ? slots.data_ptr<int>() : nullptr);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return result();
}

// (cnt [1, G R, NB f], idx [1, G R, NB f, out_width]) int32: fa4_backward_index_kernel's tensors
// for R query heads per group; entries of idx past a row's count are unspecified (FA4 reads cnt
// of them). out_width must bound every list: f * (the most blocks of one sequence) - 1, since a
// block's readers are in its sequence (known on the host: no device read). Entries past it are
// not written.
std::vector<at::Tensor> fa4_backward_index_cuda(const at::Tensor& kv_idx, const at::Tensor& kv_cnt,
                                                int64_t heads_per_group, int64_t sub_blocks, int64_t out_width) {
  check_route(kv_idx, kv_cnt);
  const int64_t G = kv_idx.size(0), NB = kv_idx.size(1), K = kv_idx.size(2), f = sub_blocks;
  MSB_CHECK(heads_per_group >= 1 && (f == 1 || f == 2), "heads_per_group >= 1 and sub_blocks in (1, 2), got ",
            heads_per_group, " and ", f);
  MSB_CHECK(out_width >= 1 && out_width < INT32_MAX, "out_width must be in [1, 2^31), got ", out_width);
  const c10::cuda::CUDAGuard guard(kv_idx.device());
  const auto opts = kv_idx.options();
  at::Tensor cnt = at::empty({1, G * heads_per_group, NB * f}, opts);
  at::Tensor idx = at::empty({1, G * heads_per_group, NB * f, out_width}, opts);
  if (G * NB == 0) return {cnt, idx};
  const dim3 grid((unsigned)NB, (unsigned)G);
  fa4_backward_index_kernel<<<grid, LIST_THREADS, 0, c10::cuda::getCurrentCUDAStream()>>>(
      kv_idx.data_ptr<int>(), kv_cnt.data_ptr<int>(), (int)NB, (int)K, (int)heads_per_group, (int)f, (int)out_width,
      cnt.data_ptr<int>(), idx.data_ptr<int>());
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return {cnt, idx};
}

}  // namespace

void register_index_ops(pybind11::module& m) {
  m.def("transpose_index_cuda", &transpose_index_cuda,
        "per-KV-block query index of a route (CUDA): (q_ptr [G*NB+1], q_idx [G*NB*K], valid up to q_ptr[-1]), "
        "with_slots: and slots [G, NB, K], each route entry's place in q_idx",
        pybind11::arg("kv_idx"), pybind11::arg("kv_cnt"), pybind11::arg("with_slots") = false);
  m.def("fa4_backward_index_cuda", &fa4_backward_index_cuda,
        "flash-attn-4's transposed block-sparse tensors of a route for its backward, per query head (CUDA): "
        "(full_cnt [1, HQ, M], full_idx [1, HQ, M, out_width])",
        pybind11::arg("kv_idx"), pybind11::arg("kv_cnt"), pybind11::arg("heads_per_group"),
        pybind11::arg("sub_blocks"), pybind11::arg("out_width"));
}

}  // namespace sparsebalance
