"""Bodies of the multi-process conversion tests (importable by spawned workers)."""
from __future__ import annotations

import torch
import torch.distributed as dist
from megatron.core import parallel_state

from megatron_sparsebalance.convert.converter import (Tolerance, compare_logits, full_budget_sparse_config,
                                                      load_converted)

# fp32 arithmetic on both sides; the two models differ only in summation order.
FP32 = Tolerance(atol=1e-4, rtol=1e-5, max_kl=1e-8)


def pipelined_logits(cases):
    """For each ``(checkpoint, tokens_path, reference_logits_path)``: load the converted
    checkpoint at this run's pipeline layout, run the stages in turn (activations sent to the
    next stage), and on the last stage compare the logits with the Hugging Face reference."""
    first, last = parallel_state.is_pipeline_first_stage(), parallel_state.is_pipeline_last_stage()
    for ckpt, tokens_path, ref_path in cases:
        tokens = torch.load(tokens_path)
        b, s = tokens.shape
        model, common = load_converted(ckpt, full_budget_sparse_config(s), max_sequence_length=s)
        shape = common["model_shape"]
        pp = parallel_state.get_pipeline_model_parallel_world_size()
        assert len(model.decoder.layers) == shape["num_layers"] // pp, "stage does not hold its share of the layers"
        model.eval()
        position_ids = torch.arange(s).unsqueeze(0).expand(b, s)
        with torch.no_grad():
            if not first:
                hidden = torch.empty(s, b, shape["hidden_size"])
                dist.recv(hidden, src=parallel_state.get_pipeline_model_parallel_prev_rank())
                model.set_input_tensor(hidden)
            out = model(tokens if first else None, position_ids, None)
            tp_group = parallel_state.get_tensor_model_parallel_group()
            if last and dist.get_world_size(tp_group) > 1:  # logits come split by vocabulary over TP
                parts = [torch.empty_like(out) for _ in range(dist.get_world_size(tp_group))]
                dist.all_gather(parts, out.contiguous(), group=tp_group)
                out = torch.cat(parts, -1)
            if not last:
                dist.send(out.contiguous(), dst=parallel_state.get_pipeline_model_parallel_next_rank())
            else:
                ref = torch.load(ref_path)
                report = compare_logits(ref, out[..., : ref.shape[-1]].float(), FP32)
                assert report.passed, f"{ckpt} at PP={pp}, TP={dist.get_world_size(tp_group)}: {report.line()}"
