// The transposed (per-KV-block) index of a route, built on the GPU for the backward's dK/dV
// kernels: for every (group g, KV block j), the query blocks whose selection holds j, ascending.
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

// Whether a route row holds block j. The row's `cnt` valid entries are ascending (the route's
// contract: selected blocks in order, the diagonal block, the largest, last).
__device__ __forceinline__ bool row_holds(const int* __restrict__ row, int cnt, int j) {
  int lo = 0, hi = cnt;
  while (lo < hi) {
    const int mid = (lo + hi) >> 1;
    if (__ldg(row + mid) < j) lo = mid + 1;
    else hi = mid;
  }
  return lo < cnt && __ldg(row + lo) == j;
}

// Only rows i >= j can hold j (a row selects blocks up to its own).
__device__ __forceinline__ bool holds(const int* kv_idx, const int* kv_cnt, int g, int nb, int width, int i,
                                      int j) {
  if (i >= nb) return false;
  const int64_t row = (int64_t)g * nb + i;
  return row_holds(kv_idx + row * width, __ldg(kv_cnt + row), j);
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

// q_idx[q_ptr[g * nb + j] ...]: the query blocks that hold j, ascending: each pass of the CTA
// covers LIST_THREADS consecutive rows and writes its hits in row order (ballot within a warp,
// the warps' counts before it).
__global__ void __launch_bounds__(LIST_THREADS)
fill_kernel(const int* kv_idx, const int* kv_cnt, int nb, int width, const int* q_ptr, int* q_idx) {
  const int g = blockIdx.y, j = blockIdx.x;
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  __shared__ int warp_n[LIST_WARPS];
  int base = q_ptr[(int64_t)g * nb + j];
  for (int i0 = j; i0 < nb; i0 += LIST_THREADS) {
    const bool hit = holds(kv_idx, kv_cnt, g, nb, width, i0 + threadIdx.x, j);
    const unsigned ballot = __ballot_sync(0xffffffffu, hit);
    if (lane == 0) warp_n[warp] = __popc(ballot);
    __syncthreads();
    int before = 0, total = 0;
    for (int w = 0; w < LIST_WARPS; ++w) {
      before += w < warp ? warp_n[w] : 0;
      total += warp_n[w];
    }
    if (hit) q_idx[base + before + __popc(ballot & ((1u << lane) - 1u))] = i0 + threadIdx.x;
    base += total;
    __syncthreads();  // warp_n is rewritten by the next pass
  }
}

std::vector<at::Tensor> transpose_index_cuda(const at::Tensor& kv_idx, const at::Tensor& kv_cnt) {
  MSB_CHECK(kv_idx.is_cuda() && kv_idx.dim() == 3 && kv_idx.scalar_type() == at::kInt && kv_idx.is_contiguous(),
            "kv_idx must be a contiguous int32 CUDA tensor [G, NB, K]");
  MSB_CHECK(kv_cnt.is_cuda() && kv_cnt.scalar_type() == at::kInt && kv_cnt.is_contiguous() &&
                kv_cnt.dim() == 2 && kv_cnt.size(0) == kv_idx.size(0) && kv_cnt.size(1) == kv_idx.size(1),
            "kv_cnt must be a contiguous int32 CUDA tensor [G, NB] matching kv_idx");
  const int64_t G = kv_idx.size(0), NB = kv_idx.size(1), K = kv_idx.size(2);
  MSB_CHECK(G * NB * K < INT32_MAX, "route too large for an int32 index: G * NB * K = ", G * NB * K);
  MSB_CHECK(G < 65536, "at most 65535 KV-head groups, got ", G);
  const c10::cuda::CUDAGuard guard(kv_idx.device());
  const auto opts = kv_idx.options();
  // q_idx is sized by the upper bound G * NB * K: its true length, q_ptr[-1], is on the device,
  // and reading it would stop the host in every backward.
  at::Tensor q_ptr = at::empty({G * NB + 1}, opts), q_idx = at::empty({G * NB * K}, opts);
  if (G * NB == 0) return {q_ptr.zero_(), q_idx};
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  const dim3 grid((unsigned)NB, (unsigned)G);
  const int* idx = kv_idx.data_ptr<int>();
  const int* cnt = kv_cnt.data_ptr<int>();
  count_kernel<<<grid, LIST_THREADS, 0, stream>>>(idx, cnt, (int)NB, (int)K, q_ptr.data_ptr<int>());
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  scan_kernel<<<1, SCAN_THREADS, 0, stream>>>(q_ptr.data_ptr<int>(), (int)(G * NB));
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  fill_kernel<<<grid, LIST_THREADS, 0, stream>>>(idx, cnt, (int)NB, (int)K, q_ptr.data_ptr<int>(),
                                                 q_idx.data_ptr<int>());
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return {q_ptr, q_idx};
}

}  // namespace

void register_index_ops(pybind11::module& m) {
  m.def("transpose_index_cuda", &transpose_index_cuda,
        "per-KV-block query index of a route (CUDA): (q_ptr [G*NB+1], q_idx [G*NB*K], valid up to q_ptr[-1])",
        pybind11::arg("kv_idx"), pybind11::arg("kv_cnt"));
}

}  // namespace sparsebalance
