// Whether this build's CUDA kernels run on a given GPU. setup.py compiles them for the
// architectures of MSB_CUDA_ARCH only (sm_90a by default); on any other GPU the first launch would
// fail with "no kernel image", deep inside a layer. Python asks once per device and says so early.
#include <torch/extension.h>

#include <c10/cuda/CUDAGuard.h>

#include "cuda/bindings.h"

namespace sparsebalance {
namespace {

// Compiled with the same targets as every other kernel of the extension.
__global__ void probe_kernel() {}

bool kernels_run_on(int64_t device) {
  const c10::cuda::CUDAGuard guard((c10::DeviceIndex)device);
  cudaFuncAttributes attr;
  const bool ok = cudaFuncGetAttributes(&attr, probe_kernel) == cudaSuccess;
  (void)cudaGetLastError();  // a missing image leaves its error behind; later checks must not see it
  return ok;
}

}  // namespace

void register_device_ops(pybind11::module& m) {
  m.def("kernels_run_on", &kernels_run_on, "whether the CUDA kernels have machine code for this device",
        pybind11::arg("device"));
}

}  // namespace sparsebalance
