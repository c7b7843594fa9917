"""Bodies of the multi-process evaluation tests (importable by spawned workers)."""
from __future__ import annotations

import torch
from megatron.core import parallel_state

from megatron_sparsebalance.pipeline.schedule import MicroBatchPlan, PipelinePlan, forward_backward_sparsebalance
from megatron_sparsebalance.training.model import build_gpt_model, transformer_config
from megatron_sparsebalance.training.step import gpt_forward_step, mean_loss
from tests.pipeline_cases import SHAPE, SPARSE, micro_batches, stage_key_to_full

# The retrieval model of the pretrain evaluation tests: tiny, untied (PP needs it on CPU).
RETRIEVAL = ["--model", "tiny", "--untie-embeddings-and-output-weights", "--mock-data", "--mock-length-distribution",
             "longtail", "--mock-content", "retrieval", "--mock-retrieval-depth", "uniform", "--seq-length", "1024",
             "--mock-samples", "256", "--mock-vocab-size", "64", "--global-batch-size", "4", "--moba-block-size", "64",
             "--moba-topk", "4", "--sparse-attn-impl", "torch", "--lr", "3e-3", "--min-lr", "1e-4", "--lr-decay-iters", "40"]


def forward_only_pipelined(weights_path, ref_path, lengths, seed, budget):
    """forward_only=True through PP stages: the reference's losses, and no gradient anywhere."""
    pp = parallel_state.get_pipeline_model_parallel_world_size()
    rank = parallel_state.get_pipeline_model_parallel_rank()
    model = build_gpt_model(SHAPE, SPARSE, transformer_config(SHAPE, pipeline_parallel_size=pp), max_sequence_length=4096,
                            pre_process=parallel_state.is_pipeline_first_stage(),
                            post_process=parallel_state.is_pipeline_last_stage())
    full = torch.load(weights_path)
    model.load_state_dict({k: full[stage_key_to_full(k, rank, pp)] for k in model.state_dict()})
    batches = micro_batches(lengths, seed)
    plan = PipelinePlan([MicroBatchPlan(mb, budget=budget) for mb in lengths], hidden_size=SHAPE.hidden_size)
    with torch.no_grad():
        reports = forward_backward_sparsebalance(
            forward_step_func=gpt_forward_step, data_iterator=iter(batches), model=[model],
            num_microbatches=len(batches), plan=plan, forward_only=True)
    if parallel_state.is_pipeline_last_stage():
        expect = torch.load(ref_path)[0]["loss"]
        assert len(reports) == len(batches)
        assert abs(mean_loss(reports) - expect) < 1e-5 * max(1.0, abs(expect)), (mean_loss(reports), expect)
    else:
        assert reports == []
    assert all(p.grad is None for p in model.parameters())
    m = plan.measured
    assert m is not None and all(t > 0 for t in m.micro_batch_ms)
    assert all(s.kind == "F" for r in m.records for s in r.spans)  # forward spans only
    assert len(m.records[0].spans) == len(batches)


def run_printing_to(argv, rows_path, stdout_path):
    """``pretrain_cases.run`` with what this rank prints kept in ``stdout_path``: a launch shared
    by several tests runs in a fixture, where no test's captured output can see it."""
    import contextlib

    from tests.pretrain_cases import run

    with open(stdout_path, "a") as f, contextlib.redirect_stdout(f):
        run(argv, rows_path)
