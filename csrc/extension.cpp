// Python bindings of megatron_sparsebalance._C. The CPU index kernels are always built; the
// CUDA attention kernels are compiled in when setup.py finds nvcc (WITH_CUDA).
#include <torch/extension.h>

#include "index_cpu.h"

#ifdef WITH_CUDA
#include "cuda/bindings.h"
#endif

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "megatron-sparsebalance native kernels";
  m.def("select_blocks_cpu", &sparsebalance::select_blocks_cpu, "top-k block selection (CPU)",
        pybind11::arg("scores"), pybind11::arg("block_budget"), pybind11::arg("kmax"));
  m.def("transpose_index_cpu", &sparsebalance::transpose_index_cpu,
        "per-KV-block query index for backward (CPU)", pybind11::arg("kv_idx"), pybind11::arg("kv_cnt"));
#ifdef WITH_CUDA
  m.attr("with_cuda") = true;
  sparsebalance::register_device_ops(m);
  sparsebalance::register_cuda_ops(m);
  sparsebalance::register_index_ops(m);
  sparsebalance::register_router_ops(m);
#else
  m.attr("with_cuda") = false;
#endif
#if defined(WITH_CUDA) && defined(SPARSEBALANCE_HAS_SM90A)
  m.attr("with_sm90a") = true;  // the Hopper (wgmma) kernels are compiled in
#else
  m.attr("with_sm90a") = false;
#endif
}
