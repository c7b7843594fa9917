# The two README commands, `make demo` and `make test`, install everything they need on a fresh
# machine: a virtualenv under the repo, torch (the CPU build where no torch is installed),
# megatron-core and the package in editable mode with its native extension built.
PYTHON ?= python3
VENV ?= .venv
VPY := $(VENV)/bin/python
STAMP := $(VENV)/.installed-stamp
# torch==2.13.0 is a CPU wheel on the CPU machines; an unpinned torch drags GBs of CUDA packages.
TORCH_PIN ?= torch==2.13.0
DEPS := "megatron-core==0.16.1" triton pybind11 numpy ninja pytest pytest-timeout pytest-xdist psutil transformers tokenizers tensorboard matplotlib gguf accelerate
NATIVE_SRC := setup.py $(wildcard csrc/*.cpp csrc/*.h csrc/cuda/*)
# A test that hangs fails after 15 minutes, with every thread's stack, instead of using up CI's time.
# Two xdist workers, one per core of the CI machine: most tests wait on process start-up or on one
# rank, so the two cores sit half idle under one worker. A module's shared launch is built once for
# both workers (tests/distributed.py: once_per_run); tests that time the machine are marked `alone`
# (tests/conftest.py).
PYTEST_CPU := -m "not gpu and not multigpu" --timeout=900 -n 2 --dist load

.PHONY: install demo test test-all test-gpu test-gpu-parallel bench-attention clean

$(STAMP): $(NATIVE_SRC)
	test -x $(VPY) || $(PYTHON) -m venv $(VENV)
	$(VPY) -m pip install -q --upgrade pip setuptools wheel
	$(VPY) -c "import torch" 2>/dev/null || $(VPY) -m pip install -q $(TORCH_PIN)
	$(VPY) -m pip install -q $(DEPS)
	MAX_JOBS=$${MAX_JOBS:-2} $(VPY) -m pip install -q --no-build-isolation --no-deps -e .
	touch $(STAMP)

install: $(STAMP)

demo: install
	$(VPY) -m megatron_sparsebalance.demo

# The CPU suite (CI). pytest exits 5 when it collected no test: that is a failure here.
test: install
	$(VPY) -c "import xdist" 2>/dev/null || $(VPY) -m pip install -q pytest-xdist  # a venv from before it was in DEPS
	$(VPY) -m pytest -q $(PYTEST_CPU) tests; rc=$$?; \
	  if [ $$rc -eq 5 ]; then echo "make test: pytest collected no tests"; exit 1; fi; exit $$rc

# On the GPU machine (device image: system python3 with CUDA torch; megatron-core from carried
# wheels on PYTHONPATH). Builds the extension in place with the CUDA kernels.
test-gpu:
	MSB_CUDA=1 MAX_JOBS=$${MAX_JOBS:-16} $(PYTHON) setup.py -q build_ext --inplace
	$(PYTHON) -c "from megatron_sparsebalance.compat import MEGATRON_CORE_VERSION, HAVE_MEGATRON_TRAINING as t; print(f'make test-gpu: megatron-core {MEGATRON_CORE_VERSION}' + (' with megatron.training' if t else ''))"
	$(PYTHON) -m pytest -q -m "gpu" tests

# The same on a 4-GPU machine: two multi-process groups at once, then the kernel grid over three GPUs beside the rest (tools/test_gpu_parallel.sh).
test-gpu-parallel:
	MSB_CUDA=1 MAX_JOBS=$${MAX_JOBS:-16} $(PYTHON) setup.py -q build_ext --inplace
	PYTHON=$(PYTHON) bash tools/test_gpu_parallel.sh

bench-attention:
	MSB_CUDA=1 MAX_JOBS=$${MAX_JOBS:-16} $(PYTHON) setup.py -q build_ext --inplace
	$(PYTHON) -m benchmarks.attention

clean:
	rm -rf build $(VENV) megatron_sparsebalance/_C*.so *.egg-info
