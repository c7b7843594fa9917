"""A checkpoint is written by the process that saves it (no fork) and loads back bit for bit."""
import os

import torch

from megatron_sparsebalance.training import checkpointing
from megatron_sparsebalance.training.model import build_gpt_model, transformer_config
from tests.pipeline_cases import SHAPE, SPARSE


def tensors(model):
    return {k: v for k, v in model.state_dict().items() if isinstance(v, torch.Tensor)}


def test_checkpoint_is_written_without_a_fork_and_loads_back(gloo_world_of_one, tmp_path, monkeypatch):
    """megatron-core's own writer forks a process per bucket; a forked child can hang on a lock
    copied from one of the parent's threads, so any fork during the save fails this test."""
    torch.manual_seed(0)
    saved = build_gpt_model(SHAPE, SPARSE, transformer_config(SHAPE), max_sequence_length=256)

    def no_fork():
        raise AssertionError("the checkpoint writer forked")

    monkeypatch.setattr(os, "fork", no_fork)
    path = checkpointing.save_checkpoint(str(tmp_path), 3, saved, common={"run": "test"})
    monkeypatch.undo()
    assert sorted(f for f in os.listdir(path) if f.endswith(".distcp"))  # the shards were written

    torch.manual_seed(1)
    loaded = build_gpt_model(SHAPE, SPARSE, transformer_config(SHAPE), max_sequence_length=256)
    assert any(not torch.equal(a, b) for a, b in zip(tensors(saved).values(), tensors(loaded).values()))
    common = checkpointing.load_checkpoint(checkpointing.latest_checkpoint(str(tmp_path)), loaded)
    assert (common["iteration"], common["run"]) == (3, "test")
    want, got = tensors(saved), tensors(loaded)
    assert want.keys() == got.keys()
    assert all(torch.equal(want[k], got[k]) for k in want)
