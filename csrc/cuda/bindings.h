// CUDA block-sparse attention kernels of megatron_sparsebalance._C (built when WITH_CUDA).
#pragma once

#include <pybind11/pybind11.h>

namespace sparsebalance {

// Adds sparse_attn_fwd_cuda, sparse_attn_bwd_dkdv_cuda and sparse_attn_bwd_dq_cuda to the
// extension module.
void register_cuda_ops(pybind11::module& m);

}  // namespace sparsebalance
