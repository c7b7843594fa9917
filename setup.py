"""Build of megatron-sparsebalance and its native extension ``megatron_sparsebalance._C``.

Environment switches:
  MSB_CUDA=auto|1|0   build the CUDA kernels: when torch has CUDA and nvcc is found (auto, the
                      default), always (1: fails loudly if that is impossible), never (0).
  MSB_CUDA_ARCH       gencode targets for nvcc, default "90a" (Hopper: wgmma/TMA need sm_90a).
                      Several as "80;90a".
  MAX_JOBS            parallel compile jobs (honoured by torch's ninja build).
"""
import glob
import os

from setuptools import find_packages, setup

ROOT = os.path.dirname(os.path.abspath(__file__))


def _want_cuda() -> bool:
    mode = os.environ.get("MSB_CUDA", "auto").lower()
    if mode not in ("auto", "1", "0"):
        raise SystemExit(f"MSB_CUDA must be auto, 1 or 0, got {mode!r}")
    if mode == "0":
        return False
    import torch
    from torch.utils.cpp_extension import CUDA_HOME

    available = torch.version.cuda is not None and CUDA_HOME is not None
    if mode == "1" and not available:
        raise SystemExit(
            "MSB_CUDA=1 but the CUDA build is impossible: "
            f"torch.version.cuda={torch.version.cuda}, CUDA_HOME={CUDA_HOME}"
        )
    return available


def _extensions():
    from torch.utils.cpp_extension import CppExtension, CUDAExtension

    sources = [os.path.relpath(p, ROOT) for p in sorted(glob.glob(os.path.join(ROOT, "csrc", "*.cpp")))]
    cxx = ["-O3", "-std=c++17"]
    if not _want_cuda():
        return [CppExtension("megatron_sparsebalance._C", sources, extra_compile_args={"cxx": cxx})]
    cuda_sources = sorted(glob.glob(os.path.join(ROOT, "csrc", "cuda", "*.cu")))
    cuda_sources += sorted(glob.glob(os.path.join(ROOT, "csrc", "cuda", "*.cpp")))
    sources += [os.path.relpath(p, ROOT) for p in cuda_sources]
    archs = os.environ.get("MSB_CUDA_ARCH", "90a").split(";")
    nvcc = ["-O3", "-std=c++17", "--use_fast_math", "-lineinfo", "--expt-relaxed-constexpr"]
    nvcc += [f"-gencode=arch=compute_{a},code=sm_{a}" for a in archs]
    if "90a" in archs:  # the host launches the wgmma kernels only when their machine code exists
        nvcc.append("-DSPARSEBALANCE_HAS_SM90A")
        cxx.append("-DSPARSEBALANCE_HAS_SM90A")  # the bindings say so (`auto` prefers them)
    return [
        CUDAExtension(
            "megatron_sparsebalance._C",
            sources,
            define_macros=[("WITH_CUDA", None)],
            include_dirs=[os.path.join(ROOT, "csrc")],
            extra_compile_args={"cxx": cxx, "nvcc": nvcc},
        )
    ]


def _build_ext():
    from torch.utils.cpp_extension import BuildExtension

    return BuildExtension.with_options(use_ninja=True)


setup(
    name="megatron-sparsebalance",
    version="0.1.0",
    description="Dynamic block-sparse attention and sparsity-aware load balancing for megatron-core",
    packages=find_packages(include=["megatron_sparsebalance", "megatron_sparsebalance.*"]),
    python_requires=">=3.10",
    install_requires=["torch>=2.6", "megatron-core>=0.16,<0.17", "triton", "pybind11", "numpy"],
    extras_require={"test": ["pytest"], "hf": ["transformers", "safetensors"]},
    ext_modules=_extensions(),
    cmdclass={"build_ext": _build_ext()},
)
