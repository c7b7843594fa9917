"""Checks shared by test modules: a script under Triton's interpreter, a step without host syncs."""
from __future__ import annotations

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
