"""A checkpoint is written by the process that saves it (no fork), loads back bit for bit, and a
shard that cannot be written fails the save without marking it complete."""
import os

import pytest
import torch

from megatron_sparsebalance import compat
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
    shards = [f for f in os.listdir(path) if f.endswith(".distcp")]
    # 0.16: our writer, one file per bucket, two buckets written by two threads; 0.17+: megatron-core's
    # own threaded writer, one file per thread of its strategy (one).
    assert len(shards) == (2 if compat._forking_writer() is not None else 1), shards

    torch.manual_seed(1)
    loaded = build_gpt_model(SHAPE, SPARSE, transformer_config(SHAPE), max_sequence_length=256)
    assert any(not torch.equal(a, b) for a, b in zip(tensors(saved).values(), tensors(loaded).values()))
    common = checkpointing.load_checkpoint(checkpointing.latest_checkpoint(str(tmp_path)), loaded)
    assert (common["iteration"], common["run"]) == (3, "test")
    want, got = tensors(saved), tensors(loaded)
    assert want.keys() == got.keys()
    assert all(torch.equal(want[k], got[k]) for k in want)


def test_a_failed_shard_write_raises_and_leaves_no_complete_checkpoint(gloo_world_of_one, tmp_path, monkeypatch):
    """A bucket that cannot be written (a full disk, say) fails the save; the directory is not
    marked complete and latest_checkpointed_iteration.txt is not written."""
    from megatron.core.dist_checkpointing.strategies import filesystem_async
    from torch.distributed.checkpoint.api import CheckpointException  # a BaseException

    model = build_gpt_model(SHAPE, SPARSE, transformer_config(SHAPE), max_sequence_length=256)

    def disk_full(*args, **kwargs):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(filesystem_async, "_write_item", disk_full)
    # 0.16 passes the OSError's text on; 0.17+'s threaded writer names its class.
    with pytest.raises(CheckpointException, match="No space left on device|OSError"):
        checkpointing.save_checkpoint(str(tmp_path), 1, model)
    assert not os.path.exists(os.path.join(checkpointing.iteration_dir(str(tmp_path), 1), checkpointing.COMPLETE))
    assert checkpointing.latest_checkpoint(str(tmp_path)) is None
