// CUDA kernels of megatron_sparsebalance._C (built when WITH_CUDA): attention, its index, the router.
#pragma once

#include <pybind11/pybind11.h>

namespace sparsebalance {

// Adds sparse_attn_fwd_cuda, sparse_attn_bwd_dkdv_cuda and sparse_attn_bwd_dq_cuda to the
// extension module (attention.cu).
void register_cuda_ops(pybind11::module& m);

// Adds transpose_index_cuda, the backward's per-KV-block index (transpose_index.cu).
void register_index_ops(pybind11::module& m);

// Adds kernels_run_on: whether the build has machine code for a GPU (device.cu).
void register_device_ops(pybind11::module& m);

// Adds router_pool_cuda and router_select_cuda, the MoBA router (router.cu).
void register_router_ops(pybind11::module& m);

}  // namespace sparsebalance
