#pragma once
#include <torch/extension.h>

namespace sparsebalance {

// Top-(budget-1) finite-score candidates plus the diagonal block per (group, query block).
// scores: [G, NB, NB] float32 (-inf = not a candidate); block_budget: [NB] int64.
// Returns kv_idx [G, NB, kmax] int32 (ascending, -1 padded) and kv_cnt [G, NB] int32.
std::tuple<torch::Tensor, torch::Tensor> select_blocks_cpu(
    const torch::Tensor& scores, const torch::Tensor& block_budget, int64_t kmax);

// CSR of query blocks per (group, KV block): q_ptr [G*NB+1], q_idx [nnz], both int32.
std::tuple<torch::Tensor, torch::Tensor> transpose_index_cpu(const torch::Tensor& kv_idx,
                                                             const torch::Tensor& kv_cnt);

}  // namespace sparsebalance
