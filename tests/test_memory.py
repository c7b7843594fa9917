"""GPU memory: ``--empty-unused-memory-level`` releases the cache where Megatron-LM does, and running
out of memory says which stage and which flags lower it."""
import pytest
import torch

from megatron_sparsebalance.balance.dst import DSTConfig
from megatron_sparsebalance.config import build_parser, config_from_args
from megatron_sparsebalance.data.synthetic import pack_sequences
from megatron_sparsebalance.training.cpu_compat import enable_cpu_megatron
from megatron_sparsebalance.training.dist import init_distributed
from megatron_sparsebalance.training.trainer import OptimSettings, Trainer
from tests.pipeline_cases import SHAPE, SPARSE


@pytest.mark.parametrize("level,per_step", [(0, []), (1, ["after forward/backward"]),
                                            (2, ["after forward/backward", "after the optimizer step"])])
def test_cache_released_after_forward_backward_and_after_the_step(megatron_world, monkeypatch, level, per_step):
    enable_cpu_megatron()
    init_distributed(backend="gloo")
    trainer = Trainer(SHAPE, SPARSE, DSTConfig(anchor="none", k_base=2), OptimSettings(lr=1e-3, min_lr=1e-3), 512,
                      empty_unused_memory_level=level)
    events = []
    step_of = trainer.optimizer.step

    def step():  # the optimizer step, recorded in order with the releases
        events.append("optimizer step")
        return step_of()

    monkeypatch.setattr(trainer.optimizer, "step", step)
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: events.append("release"))
    gen = torch.Generator().manual_seed(3)
    seqs = [torch.randint(0, SHAPE.vocab_size, (n,), generator=gen) for n in (96, 64)]
    batch = pack_sequences(seqs, [torch.ones(len(s)) for s in seqs])
    for _ in range(2):
        trainer.train_step([[[96, 64]]], [batch])
    expected = {0: ["optimizer step"], 1: ["release", "optimizer step"],
                2: ["release", "optimizer step", "release"]}[level]
    assert events == expected * 2, per_step


@pytest.mark.parametrize("value", ["3", "-1"])
def test_levels_other_than_0_1_2_are_refused(value):
    args = build_parser().parse_args(["--mock-data", "--empty-unused-memory-level", value])
    with pytest.raises(ValueError, match="--empty-unused-memory-level must be 0, 1 or 2"):
        config_from_args(args).validate(world_size=1)


@pytest.mark.parametrize("error", [torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 36.17 GiB"),
                                   torch.distributed.DistBackendError("NCCL error: Cuda failure 2 'out of memory'")])
def test_out_of_memory_names_the_stage_and_the_flags_that_lower_it(megatron_world, monkeypatch, error):
    from megatron_sparsebalance.config import parse_config
    from megatron_sparsebalance.pretrain import pretrain
    from tests.pretrain_cases import TINY

    def runs_out(self, lengths, batches, measure=True):
        raise error

    monkeypatch.setattr(Trainer, "train_step", runs_out)
    with pytest.raises(torch.OutOfMemoryError) as info:
        pretrain(parse_config(TINY + ["--train-iters", "2", "--num-layers", "2"]))
    message = str(info.value)
    assert "pipeline stage 0 of 1 (2 layers and the output layer) ran out of GPU memory in iteration 1" in message
    assert "--recompute-granularity selective --recompute-modules mlp" in message
    assert "--empty-unused-memory-level 1" in message
    assert info.value.__cause__ is error


def test_other_nccl_errors_pass_through(megatron_world, monkeypatch):
    from megatron_sparsebalance.config import parse_config
    from megatron_sparsebalance.pretrain import pretrain
    from tests.pretrain_cases import TINY

    def fails(self, lengths, batches, measure=True):
        raise torch.distributed.DistBackendError("NCCL error: unhandled system error")

    monkeypatch.setattr(Trainer, "train_step", fails)
    with pytest.raises(torch.distributed.DistBackendError, match="unhandled system error"):
        pretrain(parse_config(TINY + ["--train-iters", "2", "--num-layers", "2"]))
