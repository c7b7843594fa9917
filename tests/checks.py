"""Checks shared by test modules: a script under Triton's interpreter, a step without host syncs,
recomputed layers against stored activations."""
from __future__ import annotations

import dataclasses
import os
import subprocess
import sys

import pytest
import torch


def run_interpreted(script: str, timeout_s: int = 120) -> None:
    """Run ``script`` in a subprocess with ``TRITON_INTERPRET=1`` (chosen when kernels are
    decorated, at import, hence the subprocess); it must print ``OK``. Skips where the
    interpreter is too slow or cannot run."""
    env = dict(os.environ, TRITON_INTERPRET="1")
    try:
        proc = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True,
                              timeout=timeout_s)
    except subprocess.TimeoutExpired:
        pytest.skip("triton's interpreter is too slow here")
    if proc.returncode != 0 and "interpret" in proc.stderr.lower() and "not supported" in proc.stderr.lower():
        pytest.skip(f"triton's interpreter cannot run here: {proc.stderr[-300:]}")
    assert proc.returncode == 0 and "OK" in proc.stdout, proc.stdout[-2000:] + proc.stderr[-4000:]


def run_without_sync(step, warmup: bool = True) -> None:
    """Run ``step()`` with CUDA's sync debug mode set to raise: a host synchronisation fails it.
    ``warmup`` runs it once before (Triton compiles, the allocator grows, caches fill)."""
    if warmup:
        step()
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        step()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    torch.cuda.synchronize()


def recompute_gradient_errors(device: str, impl: str, head_dim: int = 32, bf16: bool = False,
                              recompute=None) -> tuple[float, float]:
    """Weight gradients of a GPT trained with activation recomputation (``recompute``, a
    ``RecomputeSettings``; default full, every layer), against the same model without it, on a
    long packed batch at budget 2 (``--moba-topk`` is 8).

    Returns the largest relative gradient error (a) with the backward inside the forward's budget
    scope, as the schedule runs it, and (b) with the backward outside any scope (recomputed layers
    then route with ``--moba-topk``). (a) must be ~0 and (b) clearly not: (b) shows that the
    routing of the recomputed forward reaches the gradients, so that (a) can fail.
    """
    from megatron_sparsebalance.attention import SparseAttentionConfig, budget_scope
    from megatron_sparsebalance.data.synthetic import copy_task_batch
    from megatron_sparsebalance.training.model import (MODEL_PRESETS, RecomputeSettings, build_gpt_model,
                                                       transformer_config)

    shape = dataclasses.replace(MODEL_PRESETS["tiny"], kv_channels=head_dim)
    sparse = SparseAttentionConfig(moba_block_size=64, moba_topk=8, sparse_attn_impl=impl)
    recompute = recompute or RecomputeSettings("full", "uniform", 1)
    plain = build_gpt_model(shape, sparse, transformer_config(shape, bf16=bf16), max_sequence_length=4096).to(device)
    recomputed = build_gpt_model(shape, sparse, transformer_config(shape, bf16=bf16, recompute=recompute),
                                 max_sequence_length=4096).to(device)
    recomputed.load_state_dict(plain.state_dict())
    batch = copy_task_batch([2048, 1536, 512], shape.vocab_size, torch.Generator().manual_seed(0)).to(device)
    psp = batch.packed_seq_params()

    def gradients(model, backward_in_scope: bool) -> list:
        model.zero_grad(set_to_none=True)
        with budget_scope(k=2) as report:
            loss = model(batch.tokens, batch.position_ids, None, labels=batch.labels,
                         packed_seq_params=psp).float().mean()
            assert len(report.layers) == shape.num_layers and report.mean_budget() == 2
            if backward_in_scope:
                loss.backward()
        if not backward_in_scope:
            loss.backward()
        return [p.grad.detach().clone() for p in model.parameters()]

    def error(a, b) -> float:
        return max(((x - y).float().norm() / y.float().norm().clamp_min(1e-12)).item() for x, y in zip(a, b))

    reference = gradients(plain, True)
    return error(gradients(recomputed, True), reference), error(gradients(recomputed, False), reference)
