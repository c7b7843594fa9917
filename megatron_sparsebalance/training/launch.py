"""The command that starts a module under torchrun on local ranks, for the demo, the benchmarks and
the test launches. Standard library only, as ports.py: the test launches import it without
megatron-core."""
from __future__ import annotations

import sys


def torchrun_command(nproc: int, module: str, argv: list) -> list:
    """``python -m torch.distributed.run --standalone --nproc_per_node NPROC -m MODULE ARGV...``.

    ``--standalone``: the rendezvous takes a port the kernel hands it, so that launches running at
    once on one machine (a second benchmark, tools/test_gpu_parallel.sh's groups) never meet on
    torchrun's default 29500."""
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(nproc), "-m", module,
            *argv]
