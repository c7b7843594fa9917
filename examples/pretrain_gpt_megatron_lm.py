"""Megatron-LM's ``pretrain_gpt.py``, with SparseBalance: ``torchrun ... examples/pretrain_gpt_megatron_lm.py <flags>``.

Megatron-LM's own ``pretrain()`` runs the loop (megatron-core 0.19's wheel ships it); our flags,
layer spec, data stream, schedule and figures go in at its seams (``megatron_sparsebalance/megatron_lm.py``).
With megatron-core 0.16 use ``examples/pretrain_gpt.py`` (the standalone entry, same flags).
"""
import sys

from megatron_sparsebalance.megatron_lm import main

if __name__ == "__main__":
    sys.exit(main())
