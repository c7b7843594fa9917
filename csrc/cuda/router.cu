// The MoBA router on the GPU, issued from C++: block pooling (`router_pool_cuda`), then block
// scores, ranking, coverage and selection (`router_select_cuda`).
//
// Same rules as the torch router (ops/router.py, the oracle) and the Triton router: the score of
// block pair (i, j) is pooled q(i) . pooled k(j) * scale; block i's candidates are the earlier
// blocks of its sequence; ties go to the lower block; the diagonal block is always kept and comes
// last; C(k) is the softmax mass of the top k - 1 candidates, averaged over the rows that have
// candidates.
//
// Why by hand: routing runs in every layer of every micro-batch, and a short micro-batch's stage
// is host-bound. The Triton router with the torch ops around it costs about half a millisecond
// of host time per layer (each Triton launch alone tens of microseconds); these launches cost a
// few microseconds each, and the coverage bound's choice of budget is made inside them. A row's
// scores are computed by the CTA that ranks it, from the pooled vectors, so no [G, NB, NB] score
// matrix is written and no GEMM is dispatched.
//
// Shape legend: T tokens, HQ query heads, G KV-head groups, R = HQ / G, D head dim, NB blocks,
// W the selection's width (its largest budget), CL the coverage curve's length.
#include <torch/extension.h>

#include <c10/cuda/CUDAStream.h>
#include <c10/cuda/CUDAGuard.h>

#include "check.h"
#include "cuda/bindings.h"
#include "cuda/warp.cuh"

namespace sparsebalance {
namespace {

constexpr int POOL_THREADS = 256;
constexpr int MAX_HEAD_DIM = POOL_THREADS;  // one thread per dimension of a row
constexpr int RANK_THREADS = 256;
constexpr int SELECT_THREADS = 128;
constexpr int MEAN_WARPS = 8;
// A row's candidates are sorted in shared memory (8-byte key and 4-byte score each): 8192 of
// them take 96 KB, rows of 1M tokens at block 128. Longer rows take the Triton router.
constexpr int MAX_CANDIDATES = 8192;

// ---------------------------------------------------------------------------------------------
// Pooling: out[g, b, :] = mean of x over block b's tokens and group g's heads.

// VEC consecutive elements of a row, loaded as one 16-byte vector where VEC * sizeof(T) == 16.
template <typename T, int VEC>
struct alignas(sizeof(T) * VEC) Pack {
  T v[VEC];
};

// Each thread owns VEC dims of a row and walks the block's (token, head) rows with a stride of
// rows_per_pass; the partial sums of the row lanes are then added in shared memory.
template <typename T, int VEC>
__global__ void __launch_bounds__(POOL_THREADS)
pool_kernel(const T* __restrict__ x, const int* __restrict__ block_start, const int* __restrict__ block_end,
            int nb, int heads, int group_heads, int dim, float* __restrict__ out) {
  const int b = blockIdx.x, g = blockIdx.y;
  const int lanes_per_row = dim / VEC, rows_per_pass = POOL_THREADS / lanes_per_row;
  const int lane = threadIdx.x % lanes_per_row, lane_row = threadIdx.x / lanes_per_row;
  const int t0 = block_start[b];
  const int nrows = (block_end[b] - t0) * group_heads;  // (token, head) rows of the block
  __shared__ float partial[POOL_THREADS * VEC];         // [rows_per_pass][dim]
  if (lane_row < rows_per_pass) {
    float acc[VEC] = {};
#pragma unroll 4
    for (int r = lane_row; r < nrows; r += rows_per_pass) {
      const int64_t t = t0 + r / group_heads, h = (int64_t)g * group_heads + r % group_heads;
      const Pack<T, VEC> p = *reinterpret_cast<const Pack<T, VEC>*>(x + (t * heads + h) * dim + lane * VEC);
#pragma unroll
      for (int e = 0; e < VEC; ++e) acc[e] += static_cast<float>(p.v[e]);
    }
#pragma unroll
    for (int e = 0; e < VEC; ++e) partial[lane_row * dim + lane * VEC + e] = acc[e];
  }
  __syncthreads();
  for (int d = threadIdx.x; d < dim; d += POOL_THREADS) {
    float sum = 0.f;
    for (int rr = 0; rr < rows_per_pass; ++rr) sum += partial[rr * dim + d];
    out[((int64_t)g * nb + b) * dim + d] = sum / (float)nrows;
  }
}

template <typename T>
void launch_pool(const at::Tensor& x, const at::Tensor& block_start, const at::Tensor& block_end, int64_t groups,
                 const at::Tensor& out, cudaStream_t stream) {
  constexpr int VEC = 16 / sizeof(T);
  const int64_t NB = block_start.size(0), H = x.size(1), D = x.size(2);
  const dim3 grid((unsigned)NB, (unsigned)groups);
  const bool vectors = D % VEC == 0 && D / VEC <= POOL_THREADS && reinterpret_cast<uintptr_t>(x.data_ptr()) % 16 == 0;
  auto kernel = vectors ? pool_kernel<T, VEC> : pool_kernel<T, 1>;
  kernel<<<grid, POOL_THREADS, 0, stream>>>(x.data_ptr<T>(), block_start.data_ptr<int>(), block_end.data_ptr<int>(),
                                            (int)NB, (int)H, (int)(H / groups), (int)D, out.data_ptr<float>());
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

// ---------------------------------------------------------------------------------------------
// Ranking: one CTA per (query block i, group g) sorts the row's candidates by score.

// Sorting key of candidate c with score s: ascending keys = descending scores, ties to the lower
// candidate. -0.0 counts as 0.0, as in torch's sort.
__device__ __forceinline__ uint64_t rank_key(float s, int c) {
  uint32_t u = __float_as_uint(s);
  if ((u << 1) == 0) u = 0;
  const uint32_t ordered = (u & 0x80000000u) ? ~u : (u | 0x80000000u);  // increasing with s
  return ((uint64_t)(~ordered) << 32) | (uint32_t)c;
}

__device__ __forceinline__ int key_candidate(uint64_t key) { return (int)(uint32_t)key; }

// Bitonic sort of key[0..n) ascending, n a power of two, by the whole CTA.
__device__ void bitonic_sort(uint64_t* key, int n) {
  for (int size = 2; size <= n; size <<= 1) {
    for (int stride = size >> 1; stride > 0; stride >>= 1) {
      for (int t = threadIdx.x; t < n; t += blockDim.x) {
        const int partner = t ^ stride;
        if (partner > t) {
          const uint64_t a = key[t], b = key[partner];
          if ((a > b) == ((t & size) == 0)) {
            key[t] = b;
            key[partner] = a;
          }
        }
      }
      __syncthreads();
    }
  }
}

// Writes a route row: the n best candidates (`ranked(t)`, t < n, block ids) in ascending block
// order, then the diagonal block i, then -1 up to the width w.
template <typename Ranked>
__device__ void write_selection(Ranked ranked, int n, int i, int w, int* __restrict__ out_row, int* __restrict__ cnt) {
  for (int t = threadIdx.x; t < n; t += blockDim.x) {
    const int b = ranked(t);
    int slot = 0;  // n is at most the width: counting beats a second sort
    for (int u = 0; u < n; ++u) slot += ranked(u) < b;
    out_row[slot] = b;
  }
  for (int s = n + threadIdx.x; s < w; s += blockDim.x) out_row[s] = s == n ? i : -1;
  if (threadIdx.x == 0) *cnt = n + 1;
}

struct RankArgs {
  const float* pooled_q;      // [G, NB, D]
  const float* pooled_k;      // [G, NB, D]
  const int64_t* block_pos;   // [NB]
  int nb, dim, width, capacity;  // capacity: the shared-memory sort's size, a power of two
  float scale;
  int budget;                 // > 0: select with it here; 0: leave the ranked lists in `top`
  int* kv_idx;                // [G, NB, W]
  int* kv_cnt;                // [G, NB]
  int* top;                   // [G * NB, W - 1] block ids by rank, when budget == 0
  int curve_len;              // 0: no coverage
  float* cover_rows;          // [G * NB, CL]
};

__global__ void __launch_bounds__(RANK_THREADS) rank_kernel(RankArgs a) {
  extern __shared__ __align__(16) unsigned char smem[];
  uint64_t* key = reinterpret_cast<uint64_t*>(smem);
  float* score = reinterpret_cast<float*>(key + a.capacity);
  __shared__ float warp_part[RANK_THREADS / 32];
  const int i = blockIdx.x, g = blockIdx.y;
  const int64_t row = (int64_t)g * a.nb + i;
  const int pos = (int)a.block_pos[i], first = i - pos;  // candidates: blocks first .. i - 1
  int n = 1;
  while (n < pos) n <<= 1;
  // scores: one warp per candidate, its lanes over the head dim
  const float* pq = a.pooled_q + row * a.dim;
  const float* pk = a.pooled_k + ((int64_t)g * a.nb + first) * a.dim;
  const int lane = threadIdx.x % 32;
  for (int c = threadIdx.x / 32; c < n; c += RANK_THREADS / 32) {
    if (c < pos) {
      float dot = 0.f;
      for (int d = lane; d < a.dim; d += 32) dot += pq[d] * pk[(int64_t)c * a.dim + d];
      const float s = warp_sum(dot) * a.scale;
      if (lane == 0) {
        score[c] = s;
        key[c] = rank_key(s, c);
      }
    } else if (lane == 0) {
      key[c] = ~0ull;
    }
  }
  __syncthreads();
  bitonic_sort(key, n);

  if (a.curve_len) {
    float* cover = a.cover_rows + row * a.curve_len;
    if (pos == 0) {  // no candidates: no information, left out of the mean (counted as 0)
      for (int k = 1 + threadIdx.x; k <= a.curve_len; k += RANK_THREADS) cover[k - 1] = 0.f;
    } else {
      const float top_score = score[key_candidate(key[0])];
      float part = 0.f;
      for (int c = threadIdx.x; c < pos; c += RANK_THREADS) part += __expf(score[c] - top_score);
      part = warp_sum(part);
      if (threadIdx.x % 32 == 0) warp_part[threadIdx.x / 32] = part;
      __syncthreads();
      float total = 0.f;
      for (int w = 0; w < RANK_THREADS / 32; ++w) total += warp_part[w];
      const float inv_total = 1.f / total;
      // C(k) = mass of the top k - 1: a running sum over the ranks, 32 at a time, by warp 0
      if (threadIdx.x < 32) {
        const int ranks = min(a.curve_len, pos) - 1;  // C(k) for k - 1 < pos
        float run = 0.f;
        for (int t0 = 0; t0 < ranks; t0 += 32) {
          const int t = t0 + lane;
          const float mass = warp_inclusive_sum(
              t < ranks ? __expf(score[key_candidate(key[t])] - top_score) * inv_total : 0.f, lane);
          if (t < ranks) cover[t + 1] = run + mass;  // C(t + 2)
          run += __shfl_sync(0xffffffffu, mass, 31);
        }
      }
      for (int k = 1 + threadIdx.x; k <= a.curve_len; k += RANK_THREADS) {
        if (k == 1) cover[0] = 0.f;  // the diagonal alone keeps no candidate
        else if (k - 1 >= pos) cover[k - 1] = 1.f;  // every candidate kept
      }
    }
  }

  const int ranked_max = min(pos, a.width - 1);
  if (a.budget > 0) {
    const int kept = min(a.budget - 1, ranked_max);
    write_selection([&](int t) { return first + key_candidate(key[t]); }, kept, i, a.width,
                    a.kv_idx + row * a.width, a.kv_cnt + row);
  } else {
    for (int t = threadIdx.x; t < ranked_max; t += RANK_THREADS)
      a.top[row * (a.width - 1) + t] = first + key_candidate(key[t]);
  }
}

// ---------------------------------------------------------------------------------------------
// The curve: C(k) = mean of the rows' C(k) over the rows with candidates. A fixed summation
// order (no atomics), so the coverage bound decides the same way on every run.

__global__ void __launch_bounds__(32 * MEAN_WARPS)
mean_kernel(const float* __restrict__ cover_rows, int rows, int curve_len, int valid_rows, float* __restrict__ curve,
            float* __restrict__ coverage, int used_k, int base_k) {
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32, k = blockIdx.x * 32 + lane;
  float sum = 0.f;
  if (k < curve_len)
    for (int r = warp; r < rows; r += MEAN_WARPS) sum += cover_rows[(int64_t)r * curve_len + k];
  __shared__ float part[MEAN_WARPS][32];
  part[warp][lane] = sum;
  __syncthreads();
  if (warp == 0 && k < curve_len) {
    float total = 0.f;
    for (int w = 0; w < MEAN_WARPS; ++w) total += part[w][lane];
    const float c = valid_rows ? total * (1.f / (float)valid_rows) : 1.f;  // a pack without candidates: C = 1
    curve[k] = c;
    if (k + 1 == used_k) coverage[0] = c;
    if (k + 1 == base_k) coverage[1] = c;
  }
}

// ---------------------------------------------------------------------------------------------
// Selection under the coverage bound: the budget is the smallest k in [k_request, k_base] that
// loses at most p of coverage against k_base (router.coverage_bounded_budget); every CTA finds
// it from the curve, so no launch waits for a single choosing thread.

struct SelectArgs {
  const int* top;             // [G * NB, W - 1]
  const float* curve;         // [CL], CL >= k_base
  const int64_t* block_pos;
  int nb, width, k_request, k_base;
  float max_loss;             // p, and the torch rule's 1e-7 slack
  int* kv_idx;
  int* kv_cnt;
  int64_t* k_used;            // 0-dim
  float* coverage;            // [2]: C(k_used) is written here
};

__global__ void __launch_bounds__(SELECT_THREADS) select_kernel(SelectArgs a) {
  __shared__ int chosen;
  if (threadIdx.x < 32) {
    const int lane = threadIdx.x;
    const float base = a.curve[a.k_base - 1];
    for (int k0 = a.k_request; k0 <= a.k_base; k0 += 32) {
      const int k = k0 + lane;
      const unsigned ok = __ballot_sync(0xffffffffu, k <= a.k_base && base - a.curve[k - 1] <= a.max_loss);
      if (ok) {  // found at k_base at the latest: its loss is 0
        if (lane == 0) chosen = k0 + __ffs(ok) - 1;
        break;
      }
    }
  }
  __syncthreads();
  const int i = blockIdx.x, g = blockIdx.y;
  const int64_t row = (int64_t)g * a.nb + i;
  const int pos = (int)a.block_pos[i];
  const int kept = min(chosen - 1, min(pos, a.width - 1));
  const int* ranked = a.top + row * (a.width - 1);
  write_selection([&](int t) { return ranked[t]; }, kept, i, a.width, a.kv_idx + row * a.width, a.kv_cnt + row);
  if (row == 0 && threadIdx.x == 0) {
    *a.k_used = chosen;
    a.coverage[0] = a.curve[chosen - 1];
  }
}

// ---------------------------------------------------------------------------------------------
// Host side.

void check_layout(const at::Tensor& t, at::ScalarType dtype, const char* name) {
  MSB_CHECK(t.is_cuda() && t.dim() == 1 && t.scalar_type() == dtype && t.is_contiguous(), name,
            " must be a contiguous 1-D ", c10::toString(dtype), " CUDA tensor");
}

// [G, NB, D] fp32: the mean of x [T, H, D] over each block's tokens and each group's heads.
at::Tensor router_pool_cuda(const at::Tensor& x, const at::Tensor& block_start, const at::Tensor& block_end,
                            int64_t groups) {
  MSB_CHECK(x.is_cuda() && x.dim() == 3, "x must be a CUDA tensor [T, H, D]");
  MSB_CHECK(groups > 0 && groups < 65536 && x.size(1) % groups == 0, "heads (", x.size(1),
            ") must be a multiple of the groups (", groups, "), at most 65535 groups");
  MSB_CHECK(x.size(2) <= MAX_HEAD_DIM, "the CUDA router pools head dims up to ", MAX_HEAD_DIM, ", got ", x.size(2));
  const auto dtype = x.scalar_type();
  MSB_CHECK(dtype == at::kBFloat16 || dtype == at::kHalf || dtype == at::kFloat,
            "the CUDA router pools bf16, fp16 or fp32, got ", c10::toString(dtype));
  check_layout(block_start, at::kInt, "block_start");
  check_layout(block_end, at::kInt, "block_end");
  MSB_CHECK(block_start.size(0) == block_end.size(0), "block_start and block_end differ in length");
  const c10::cuda::CUDAGuard guard(x.device());
  const at::Tensor xc = x.contiguous();
  at::Tensor out = at::empty({groups, block_start.size(0), x.size(2)}, x.options().dtype(at::kFloat));
  if (block_start.size(0) == 0 || x.size(2) == 0) return out;
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  if (dtype == at::kBFloat16) launch_pool<at::BFloat16>(xc, block_start, block_end, groups, out, stream);
  else if (dtype == at::kHalf) launch_pool<at::Half>(xc, block_start, block_end, groups, out, stream);
  else launch_pool<float>(xc, block_start, block_end, groups, out, stream);
  return out;
}

// (kv_idx [G, NB, W] int32, kv_cnt [G, NB] int32, curve [CL] or None, coverage [2] or None,
// k_used 0-dim int64 or None). Without the bound (p < 0, or k_request >= k_base) the selection
// uses k_request and coverage is [C(k_request), C(k_base or k_request)]; under it the budget is
// chosen on the device and returned as k_used.
std::vector<at::Tensor> router_select_cuda(const at::Tensor& pooled_q, const at::Tensor& pooled_k,
                                           const at::Tensor& block_pos, int64_t max_blocks_per_seq,
                                           int64_t rows_with_candidates, double scale, int64_t k_request,
                                           int64_t k_base, double p, int64_t curve_len) {
  for (const at::Tensor* t : {&pooled_q, &pooled_k})
    MSB_CHECK(t->is_cuda() && t->dim() == 3 && t->scalar_type() == at::kFloat && t->is_contiguous(),
              "pooled_q and pooled_k must be contiguous float32 CUDA tensors [G, NB, D]");
  MSB_CHECK(pooled_q.sizes() == pooled_k.sizes(), "pooled_q and pooled_k differ in shape");
  check_layout(block_pos, at::kLong, "block_pos");
  const int64_t G = pooled_q.size(0), NB = pooled_q.size(1);
  MSB_CHECK(block_pos.size(0) == NB, "block_pos has ", block_pos.size(0), " blocks, the pooled vectors ", NB);
  MSB_CHECK(k_request >= 1, "budget must be >= 1, got ", k_request);
  MSB_CHECK(curve_len >= 0, "curve_len must be >= 0, got ", curve_len);
  MSB_CHECK(max_blocks_per_seq - 1 <= MAX_CANDIDATES, "the CUDA router ranks at most ", MAX_CANDIDATES,
            " candidates per block, got ", max_blocks_per_seq - 1);
  const bool bounded = p >= 0 && k_base > k_request;
  MSB_CHECK(!bounded || curve_len >= k_base, "the coverage bound needs a curve of k_base = ", k_base,
            " entries, got ", curve_len);
  MSB_CHECK(G < 65536, "at most 65535 KV-head groups, got ", G);
  const int64_t width = std::max<int64_t>(1, std::min<int64_t>(bounded ? k_base : k_request, max_blocks_per_seq));
  const c10::cuda::CUDAGuard guard(pooled_q.device());
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  const auto floats = pooled_q.options(), ints = floats.dtype(at::kInt);
  at::Tensor kv_idx = at::empty({G, NB, width}, ints), kv_cnt = at::empty({G, NB}, ints);
  at::Tensor curve, coverage, k_used, rows, top;
  if (curve_len) {
    curve = at::empty({curve_len}, floats);
    coverage = at::empty({2}, floats);
    rows = at::empty({G * NB, curve_len}, floats);
  }
  if (bounded) {
    k_used = at::empty({}, floats.dtype(at::kLong));
    top = at::empty({std::max<int64_t>(1, G * NB * (width - 1))}, ints);
  }
  if (NB == 0) {  // nothing to route; a pack without candidates has C = 1
    if (curve_len) {
      curve.fill_(1.f);
      coverage.fill_(1.f);
    }
    if (bounded) k_used.fill_(k_request);
    return {kv_idx, kv_cnt, curve, coverage, k_used};
  }

  int capacity = 1;
  while (capacity < max_blocks_per_seq - 1) capacity <<= 1;
  const size_t smem = (size_t)capacity * (sizeof(uint64_t) + sizeof(float));
  if (smem > 48 * 1024)  // past the default, shared memory is opted into (rows of over 4096 candidates)
    C10_CUDA_CHECK(cudaFuncSetAttribute(rank_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)smem));
  RankArgs ra{pooled_q.data_ptr<float>(), pooled_k.data_ptr<float>(), block_pos.data_ptr<int64_t>(), (int)NB,
              (int)pooled_q.size(2), (int)width, capacity, (float)scale,
              bounded ? 0 : (int)k_request, kv_idx.data_ptr<int>(), kv_cnt.data_ptr<int>(),
              bounded ? top.data_ptr<int>() : nullptr, (int)curve_len, curve_len ? rows.data_ptr<float>() : nullptr};
  const dim3 grid((unsigned)NB, (unsigned)G);
  rank_kernel<<<grid, RANK_THREADS, smem, stream>>>(ra);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  if (curve_len) {
    const int used_k = bounded ? 0 : (int)k_request;  // under the bound, the select launch writes C(k_used)
    const int base_k = (int)(k_base ? k_base : k_request);
    mean_kernel<<<(unsigned)((curve_len + 31) / 32), 32 * MEAN_WARPS, 0, stream>>>(
        rows.data_ptr<float>(), (int)(G * NB), (int)curve_len, (int)(G * rows_with_candidates),
        curve.data_ptr<float>(), coverage.data_ptr<float>(), used_k, base_k);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  }
  if (bounded) {
    // the torch rule compares float32 losses with p + 1e-7 rounded to float32
    SelectArgs sa{top.data_ptr<int>(), curve.data_ptr<float>(), block_pos.data_ptr<int64_t>(), (int)NB, (int)width,
                  (int)k_request, (int)k_base, (float)(p + 1e-7), kv_idx.data_ptr<int>(), kv_cnt.data_ptr<int>(),
                  k_used.data_ptr<int64_t>(), coverage.data_ptr<float>()};
    select_kernel<<<grid, SELECT_THREADS, 0, stream>>>(sa);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  }
  return {kv_idx, kv_cnt, curve, coverage, k_used};
}

}  // namespace

void register_router_ops(pybind11::module& m) {
  m.attr("router_max_candidates") = MAX_CANDIDATES;
  m.attr("router_max_head_dim") = MAX_HEAD_DIM;
  m.def("router_pool_cuda", &router_pool_cuda,
        "block pooling of the MoBA router (CUDA): [G, NB, D] fp32, the mean over each block's tokens and "
        "each group's heads", pybind11::arg("x"), pybind11::arg("block_start"), pybind11::arg("block_end"),
        pybind11::arg("groups"));
  m.def("router_select_cuda", &router_select_cuda,
        "block scores, ranking, coverage and selection of the MoBA router (CUDA): "
        "(kv_idx, kv_cnt, curve, coverage, k_used)",
        pybind11::arg("pooled_q"), pybind11::arg("pooled_k"), pybind11::arg("block_pos"), pybind11::arg("max_blocks_per_seq"),
        pybind11::arg("rows_with_candidates"), pybind11::arg("scale"), pybind11::arg("k_request"),
        pybind11::arg("k_base"), pybind11::arg("p"), pybind11::arg("curve_len"));
}

}  // namespace sparsebalance
