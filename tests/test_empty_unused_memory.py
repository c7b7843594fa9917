"""``--empty-unused-memory-level``: the cached memory is released where Megatron-LM releases it."""
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
