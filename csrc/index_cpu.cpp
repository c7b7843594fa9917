// CPU index kernels shared by every sparse-attention implementation: top-k block selection
// from router scores, and the transposed (per-KV-block) index that backward walks.
// They mirror megatron_sparsebalance/ops/router.py exactly (ties go to the lower block index)
// and are tested against it. Written by hand because no library offers a batched, tie-stable
// top-k with a per-row budget plus the CSR transpose in one pass.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <numeric>
#include <vector>

#include "check.h"
#include "index_cpu.h"

namespace sparsebalance {

std::tuple<torch::Tensor, torch::Tensor> select_blocks_cpu(
    const torch::Tensor& scores, const torch::Tensor& block_budget, int64_t kmax) {
  MSB_CHECK(scores.device().is_cpu() && scores.dim() == 3 && scores.scalar_type() == torch::kFloat32,
            "scores must be a CPU float32 tensor [G, NB, NB]");
  MSB_CHECK(scores.size(1) == scores.size(2), "scores must be [G, NB, NB]");
  MSB_CHECK(block_budget.device().is_cpu() && block_budget.scalar_type() == torch::kInt64 &&
                block_budget.dim() == 1 && block_budget.size(0) == scores.size(1),
            "block_budget must be a CPU int64 tensor [NB]");
  MSB_CHECK(kmax >= 1, "kmax must be >= 1");
  const auto s = scores.contiguous();
  const auto bud = block_budget.contiguous();
  const int64_t G = s.size(0), NB = s.size(1);
  auto kv_idx = torch::full({G, NB, kmax}, -1, torch::kInt32);
  auto kv_cnt = torch::zeros({G, NB}, torch::kInt32);
  const float* sp = s.data_ptr<float>();
  const int64_t* bp = bud.data_ptr<int64_t>();
  int32_t* kvp = kv_idx.data_ptr<int32_t>();
  int32_t* cp = kv_cnt.data_ptr<int32_t>();

  at::parallel_for(0, G * NB, 16, [&](int64_t begin, int64_t end) {
    std::vector<int32_t> cand;
    for (int64_t row = begin; row < end; ++row) {
      const int64_t i = row % NB;
      const float* r = sp + row * NB;
      cand.clear();
      for (int64_t j = 0; j < NB; ++j)
        if (std::isfinite(r[j])) cand.push_back(static_cast<int32_t>(j));
      const int64_t want = std::min<int64_t>({bp[i] - 1, kmax - 1, static_cast<int64_t>(cand.size())});
      auto better = [r](int32_t a, int32_t b) { return r[a] > r[b] || (r[a] == r[b] && a < b); };
      std::partial_sort(cand.begin(), cand.begin() + want, cand.end(), better);
      cand.resize(want);
      cand.push_back(static_cast<int32_t>(i));  // the diagonal block, always kept
      std::sort(cand.begin(), cand.end());
      std::copy(cand.begin(), cand.end(), kvp + row * kmax);
      cp[row] = static_cast<int32_t>(cand.size());
    }
  });
  return {kv_idx, kv_cnt};
}

std::tuple<torch::Tensor, torch::Tensor> transpose_index_cpu(const torch::Tensor& kv_idx,
                                                             const torch::Tensor& kv_cnt) {
  MSB_CHECK(kv_idx.device().is_cpu() && kv_idx.scalar_type() == torch::kInt32 && kv_idx.dim() == 3,
            "kv_idx must be a CPU int32 tensor [G, NB, K]");
  MSB_CHECK(kv_cnt.device().is_cpu() && kv_cnt.scalar_type() == torch::kInt32 && kv_cnt.dim() == 2,
            "kv_cnt must be a CPU int32 tensor [G, NB]");
  const auto kv = kv_idx.contiguous();
  const auto cnt = kv_cnt.contiguous();
  const int64_t G = kv.size(0), NB = kv.size(1), K = kv.size(2);
  const int32_t* kvp = kv.data_ptr<int32_t>();
  const int32_t* cp = cnt.data_ptr<int32_t>();
  auto q_ptr = torch::zeros({G * NB + 1}, torch::kInt32);
  int32_t* qp = q_ptr.data_ptr<int32_t>();
  // Counting sort: one pass to count, one to place. Query blocks are visited in ascending order,
  // so every per-KV-block list comes out ascending without a sort.
  for (int64_t g = 0; g < G; ++g)
    for (int64_t i = 0; i < NB; ++i)
      for (int64_t t = 0; t < cp[g * NB + i]; ++t) qp[g * NB + kvp[(g * NB + i) * K + t] + 1] += 1;
  for (int64_t x = 0; x < G * NB; ++x) qp[x + 1] += qp[x];
  auto q_idx = torch::empty({static_cast<int64_t>(qp[G * NB])}, torch::kInt32);
  int32_t* qi = q_idx.data_ptr<int32_t>();
  std::vector<int32_t> fill(qp, qp + G * NB);
  for (int64_t g = 0; g < G; ++g)
    for (int64_t i = 0; i < NB; ++i)
      for (int64_t t = 0; t < cp[g * NB + i]; ++t) qi[fill[g * NB + kvp[(g * NB + i) * K + t]]++] = static_cast<int32_t>(i);
  return {q_ptr, q_idx};
}

}  // namespace sparsebalance
