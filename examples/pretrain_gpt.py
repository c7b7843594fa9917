"""Megatron-LM-style entry point: ``torchrun ... examples/pretrain_gpt.py <flags>``.

A thin wrapper over :mod:`megatron_sparsebalance.pretrain` for users who launch a script path
rather than a module; every flag is the same.
"""
import sys

from megatron_sparsebalance.pretrain import main

if __name__ == "__main__":
    sys.exit(main())
