"""Profile the forward+backward time of one pipeline stage into a latency table.

Builds the real layer stack of a stage (a megatron-core ``GPTModel`` from ``build_gpt_model``
with ``--layers-per-stage`` layers and our sparse core attention; embedding / output layer only
when the stage holds them), then times single-sequence micro-batches over a grid of
(length, budget) and writes a :class:`~megatron_sparsebalance.balance.latency.ProfiledLatencyModel`
as JSON with the metadata a run checks when it loads the table.

For every grid point it measures two things (see ``ProfiledLatencyModel`` for why):
  * the whole stage, forward + backward, on one sequence of that length at that budget;
  * the sparse attention alone (router included), forward + backward, times the stage's layers,
    minus the attention's fixed cost measured on a one-block sequence; this splits the stage
    time into a part per sequence (attention) and a part per token (everything else), which is
    what lets the table predict packed micro-batches from single-sequence measurements.

Timing: CUDA events around forward+backward after warm-up iterations (the first call of a shape
compiles Triton kernels and grows the caching allocator), median of ``--iters``; on a CPU the
wall clock, so the tool also runs (slowly, on small grids) without a GPU.

Example (H200, Qwen2.5-0.5B with PP=4: 6 layers per stage):
  python tools/profile_latency.py --model qwen2.5-0.5b --layers-per-stage 6 \\
      --pipeline-model-parallel-size 4 --sparse-attn-impl triton --out latency_0.5b_h200.json
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from typing import Optional, Sequence

import torch

from megatron_sparsebalance.attention import SparseAttentionConfig, budget_scope
from megatron_sparsebalance.data.synthetic import thd_params
from megatron_sparsebalance.balance.latency import ProfiledLatencyModel, device_name, latency_metadata
from megatron_sparsebalance.ops.implementations import IMPLEMENTATIONS, resolve_impl
from megatron_sparsebalance.training.cpu_compat import enable_cpu_megatron
from megatron_sparsebalance.training.dist import init_distributed
from megatron_sparsebalance.training.manual_gc import ManualGC
from megatron_sparsebalance.training.model import MODEL_PRESETS, RecomputeSettings, build_gpt_model, transformer_config

GRID_HELP = """\
Grid choice. Lengths: powers of two from 1K to 64K by default (the range of the paper's data
sets). The stage time is smooth between them: the dense part is linear in tokens and the
attention part follows min(k, L/B)*L, which the model interpolates along, so a geometric grid
keeps the relative interpolation error even across the range while its cost is dominated by the
few long points. Budgets: 1 (diagonal only: the floor DST can shrink to), then doubling up to
twice the paper's k_base of 32, with 24 and 48 added where DST moves most often; the cost is
close to linear in k for long sequences, so linear interpolation between these loses little.
Points where the budget exceeds the blocks of the sequence (k >= L/B) are all the same dense
computation: the tool measures one of them and copies it, which saves most of the short rows.
"""

MAX_TIMED_ITERS = 50  # per point, whatever --min-time-s asks

DEFAULT_LENGTHS = (1024, 2048, 4096, 8192, 16384, 32768, 65536)
DEFAULT_BUDGETS = (1, 4, 8, 16, 24, 32, 48, 64)


class StageProfiler:
    """Times forward+backward of one pipeline stage's layer stack on packed micro-batches.

    Args:
        model_name: a key of ``MODEL_PRESETS``.
        layers_per_stage: transformer layers of the stage.
        block_size / impl: the sparse attention's ``--moba-block-size`` / ``--sparse-attn-impl``.
        pre_process / post_process: the stage holds the embedding / the output layer and loss.
        bf16: run in bfloat16 (the GPU default) instead of float32.
        max_length: the longest pack to be timed (sizes the RoPE table).
        min_time_s: keep timing a point past ``iters`` until this much time is measured (at most
            :data:`MAX_TIMED_ITERS` iterations). A short pack is host-bound and its time jitters
            by 10-25% from one step to the next; more samples steady its median at little cost.
    """

    def __init__(
        self,
        model_name: str,
        layers_per_stage: int,
        block_size: int = 128,
        impl: str = "auto",
        pre_process: bool = False,
        post_process: bool = False,
        bf16: Optional[bool] = None,
        max_length: int = 65536,
        device: Optional[str] = None,
        seed: int = 1234,
        min_time_s: float = 0.0,
        recompute: Optional[RecomputeSettings] = None,
    ):
        self.min_time_s = min_time_s
        self.device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
        self.bf16 = (self.device.type == "cuda") if bf16 is None else bf16
        self.dtype = torch.bfloat16 if self.bf16 else torch.float32
        self.shape = MODEL_PRESETS[model_name]
        self.layers_per_stage = layers_per_stage
        self.block_size = block_size
        self.pre_process, self.post_process = pre_process, post_process
        self.impl = resolve_impl(impl, self.device)
        enable_cpu_megatron()
        init_distributed()
        torch.manual_seed(seed)
        if self.device.type == "cuda":
            # Megatron initialises weights on the GPU under its tensor-parallel RNG tracker,
            # which must be seeded first (as Megatron-LM's initialize does).
            from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

            model_parallel_cuda_manual_seed(seed)
        self.sparse = SparseAttentionConfig(moba_block_size=block_size, sparse_attn_impl=self.impl).validate()
        self.recompute = recompute or RecomputeSettings()
        config = transformer_config(self.shape, bf16=self.bf16, num_layers=layers_per_stage, recompute=self.recompute)
        self.model = build_gpt_model(
            self.shape, self.sparse, config, max_sequence_length=max_length,
            pre_process=pre_process, post_process=post_process,
        ).to(self.device)
        self.model.train()
        self.core_attention = self.model.decoder.layers[0].self_attention.core_attention
        self._gen = torch.Generator(device="cpu").manual_seed(seed)

    def _sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def _timed(self, step, warmup: int, iters: int) -> float:
        """Median ms of ``step()`` after ``warmup`` untimed calls: ``iters`` timed calls, more while
        under ``min_time_s`` of measured time.

        The garbage collector is off while timing (``--manual-gc``'s setting in training): an
        automatic collection lands in a random call and adds tens of ms of host time to it.
        """
        for _ in range(warmup):
            step()
        self._sync()
        times = []
        with ManualGC(True, 0):
            while len(times) < iters or (sum(times) < self.min_time_s * 1e3 and len(times) < MAX_TIMED_ITERS):
                if self.device.type == "cuda":
                    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                    start.record()
                    step()
                    end.record()
                    end.synchronize()
                    times.append(start.elapsed_time(end))
                else:
                    t0 = time.perf_counter()
                    step()
                    times.append((time.perf_counter() - t0) * 1e3)
        return statistics.median(times)

    def _packed_params(self, lengths: Sequence[int]):
        cu = torch.zeros(len(lengths) + 1, dtype=torch.int32)
        cu[1:] = torch.cumsum(torch.tensor(lengths, dtype=torch.int64), 0)
        return thd_params(cu.to(self.device), cu)  # as training packs them (data/synthetic.py)

    def stage_step(self, lengths: Sequence[int], k: int, k_base: Optional[int] = None, p: Optional[float] = None):
        """A closure running one forward+backward of the stage on the pack ``lengths`` at budget ``k``
        (DST's coverage bound against ``k_base`` when ``p`` is given)."""
        T = int(sum(lengths))
        psp = self._packed_params(lengths)
        h = self.shape.hidden_size
        pos = torch.cat([torch.arange(n) for n in lengths])[None].to(self.device)
        tokens = torch.randint(0, self.shape.vocab_size, (1, T), generator=self._gen).to(self.device)
        hidden = None if self.pre_process else torch.randn(T, 1, h, generator=self._gen).to(self.device, self.dtype).requires_grad_()
        grad = None if self.post_process else torch.randn(T, 1, h, generator=self._gen).to(self.device, self.dtype)

        def step():
            if hidden is not None:
                self.model.set_input_tensor(hidden)
            # backward inside the scope too: recomputed layers route again there (as in training)
            with budget_scope(k=k, k_base=k_base, p=p):
                out = self.model(tokens if self.pre_process else None, pos if self.pre_process else None, None,
                                 labels=tokens if self.post_process else None, packed_seq_params=psp)
                if self.post_process:
                    out.float().sum().backward()
                else:
                    out.backward(grad)
            self.model.zero_grad(set_to_none=True)
            if hidden is not None:
                hidden.grad = None

        return step

    def attention_step(self, lengths: Sequence[int], k: int):
        """A closure running the stage's core attention (routing included) once, forward+backward."""
        T = int(sum(lengths))
        psp = self._packed_params(lengths)
        ca = self.core_attention
        nq, ng, d = ca.num_heads, ca.num_groups, ca.head_dim

        def rand(*shape):
            return torch.randn(*shape, generator=self._gen).to(self.device, self.dtype).requires_grad_()

        q, kk, v = rand(T, nq, d), rand(T, ng, d), rand(T, ng, d)
        grad = torch.randn(T, nq * d, generator=self._gen).to(self.device, self.dtype)

        def step():
            with budget_scope(k=k):
                out = ca(q, kk, v, None, packed_seq_params=psp)
            out.backward(grad)
            q.grad = kk.grad = v.grad = None

        return step

    def measure(self, lengths: Sequence[int], k: int, warmup: int = 2, iters: int = 5) -> float:
        """Median forward+backward ms of the stage on the pack ``lengths`` at budget ``k``."""
        return self._timed(self.stage_step(lengths, k), warmup, iters)

    def measure_attention(self, lengths: Sequence[int], k: int, warmup: int = 2, iters: int = 5) -> float:
        """Median forward+backward ms of ONE layer's core attention on the pack at budget ``k``."""
        return self._timed(self.attention_step(lengths, k), warmup, iters)

    def metadata(self, pipeline_parallel_size: int = 1, tensor_parallel_size: int = 1) -> dict:
        return latency_metadata(
            self.shape, self.block_size, self.layers_per_stage, dtype=str(self.dtype), kernel_impl=self.impl,
            gpu=device_name() if self.device.type == "cuda" else "cpu", pre_process=self.pre_process,
            post_process=self.post_process, tensor_parallel_size=tensor_parallel_size,
            pipeline_parallel_size=pipeline_parallel_size, recompute=self.recompute.transformer_config_kwargs(),
        )


def profile(
    profiler: StageProfiler,
    lengths: Sequence[int],
    budgets: Sequence[int],
    warmup: int = 2,
    iters: int = 5,
    candidates: Optional[Sequence[int]] = None,
    pipeline_parallel_size: int = 1,
    tensor_parallel_size: int = 1,
    log=print,
    time_budget_s: Optional[float] = None,
) -> ProfiledLatencyModel:
    """Measure the grid and return the table as a model (its ``profile`` info in ``model.profile_info``).

    Lengths are measured shortest first. A length that runs out of GPU memory, or any length
    after ``time_budget_s`` has passed, is dropped with all longer ones (said in the log and in
    ``profile_info``): the table then extrapolates there.
    """
    lengths, budgets = sorted(set(lengths)), sorted(set(budgets))
    B, nl = profiler.block_size, profiler.layers_per_stage
    t_start = time.perf_counter()
    # The attention's fixed cost per call (launches, layout, router set-up): a one-block sequence
    # computes one block pair, so its time is almost all fixed cost. Paid once per pack.
    # The very first forward+backward pays one-off costs (allocator growth, lazy inits, kernel
    # compiles for the dtype) that no later micro-batch pays: run it before anything is timed.
    profiler.measure([lengths[0]], budgets[-1], warmup=1, iters=1)
    attn_fixed = profiler.measure_attention([B], budgets[0], warmup, iters)
    log(f"attention fixed cost per layer: {attn_fixed:.3f} ms")
    total = [[0.0] * len(budgets) for _ in lengths]
    attention = [[0.0] * len(budgets) for _ in lengths]
    points = [(j, i) for j in range(len(lengths)) for i in range(len(budgets))]
    # cost weight of a point, to show an honest ETA (long sequences dominate)
    weights = {p: lengths[p[0]] * (1 + min(budgets[p[1]], lengths[p[0]] / B) * B / 4096) for p in points}
    done_weight, all_weight = 0.0, sum(weights.values())
    dropped = None
    for n, (j, i) in enumerate(points, 1):
        L, k = lengths[j], budgets[i]
        if i == 0 and time_budget_s is not None and time.perf_counter() - t_start > time_budget_s:
            dropped = (j, f"time budget of {time_budget_s:.0f} s spent")
            break
        blocks = -(-L // B)
        if i > 0 and budgets[i - 1] >= blocks:
            # k >= blocks of the sequence: the same (dense) computation as the previous budget
            total[j][i], attention[j][i] = total[j][i - 1], attention[j][i - 1]
            src = "copied"
        else:
            try:
                total[j][i] = profiler.measure([L], k, warmup, iters)
                a = profiler.measure_attention([L], k, warmup, iters)
            except torch.cuda.OutOfMemoryError:
                dropped = (j, f"out of GPU memory at L={L}, k={k}")
                break
            attention[j][i] = max(0.0, nl * (a - attn_fixed))
            src = "measured"
        done_weight += weights[(j, i)]
        elapsed = time.perf_counter() - t_start
        eta = elapsed * (all_weight - done_weight) / max(done_weight, 1e-9)
        log(f"[{n:3d}/{len(points)}] L={L:6d} k={k:3d}: stage {total[j][i]:9.3f} ms, attention "
            f"{attention[j][i]:9.3f} ms ({src}); elapsed {elapsed:6.1f} s, eta {eta:6.1f} s", flush=True)
    if dropped is not None:
        j, why = dropped
        if j == 0:
            raise RuntimeError(f"nothing profiled: {why}")
        log(f"{why}: dropping lengths {lengths[j:]}; the table extrapolates beyond {lengths[j - 1]}", flush=True)
        lengths, total, attention = lengths[:j], total[:j], attention[:j]
        if profiler.device.type == "cuda":
            torch.cuda.empty_cache()
    meta = profiler.metadata(pipeline_parallel_size, tensor_parallel_size)
    common = {"metadata": meta}
    if candidates is not None:
        common["candidates"] = candidates
    model = ProfiledLatencyModel(lengths, budgets, total, attention, B, **common)
    model.profile_info = {
        "warmup": warmup, "iters": iters, "min_time_s": profiler.min_time_s, "attention_fixed_ms_per_layer": attn_fixed,
        "seconds": round(time.perf_counter() - t_start, 2), "torch": torch.__version__,
        "timer": "cuda_events" if profiler.device.type == "cuda" else "wall_clock",
        "dropped": None if dropped is None else dropped[1],
    }
    return model


def save_profile(model: ProfiledLatencyModel, path: str) -> None:
    import json

    d = model.to_dict()
    d["profile"] = getattr(model, "profile_info", {})
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        json.dump(d, f, indent=1)
        f.write("\n")


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__ + "\n" + GRID_HELP, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", choices=sorted(MODEL_PRESETS), default="qwen2.5-0.5b", help="model shape preset")
    p.add_argument("--layers-per-stage", type=int, default=None,
                   help="transformer layers of the profiled stage (default: num_layers / --pipeline-model-parallel-size)")
    p.add_argument("--pipeline-model-parallel-size", type=int, default=1, help="recorded in the table's parallel layout")
    p.add_argument("--tensor-model-parallel-size", type=int, default=1,
                   help="recorded in the table's parallel layout (the profile itself runs on one GPU: only 1 is supported)")
    p.add_argument("--stage", choices=("middle", "first", "last", "only"), default="middle",
                   help="which stage: first holds the embedding, last the output layer and loss, only both")
    p.add_argument("--moba-block-size", type=int, default=128)
    p.add_argument("--sparse-attn-impl", choices=IMPLEMENTATIONS, default="auto")
    p.add_argument("--lengths", type=int, nargs="+", default=list(DEFAULT_LENGTHS), help="profiled sequence lengths (see grid choice)")
    p.add_argument("--budgets", type=int, nargs="+", default=list(DEFAULT_BUDGETS), help="profiled budgets k (see grid choice)")
    p.add_argument("--candidates", type=int, nargs="+", default=None, help="DST's budget candidates stored with the table")
    p.add_argument("--warmup", type=int, default=2, help="untimed iterations per point (Triton compile, allocator growth)")
    p.add_argument("--iters", type=int, default=5, help="timed iterations per point; the median is kept")
    p.add_argument("--min-time-s", type=float, default=0.3,
                   help="time a point longer than --iters until this many seconds are measured (at most "
                        f"{MAX_TIMED_ITERS} iterations): short, host-bound packs jitter, more samples steady the median")
    p.add_argument("--fp32", action="store_true", help="profile in float32 (the default on a GPU is bfloat16)")
    p.add_argument("--recompute-granularity", choices=("full", "selective"), default=None,
                   help="profile the stage with activation recomputation, as the run will train it (pretrain's flag)")
    p.add_argument("--recompute-method", choices=("uniform", "block"), default=None)
    p.add_argument("--recompute-num-layers", type=int, default=None)
    p.add_argument("--out", required=True, help="where to write the JSON table")
    args = p.parse_args(argv)
    if args.tensor_model_parallel_size != 1:
        p.error("--tensor-model-parallel-size > 1 is not supported by the single-GPU profiler yet")
    shape = MODEL_PRESETS[args.model]
    if args.layers_per_stage is None:
        if shape.num_layers % args.pipeline_model_parallel_size:
            p.error(f"--pipeline-model-parallel-size {args.pipeline_model_parallel_size} does not divide "
                    f"the {shape.num_layers} layers of {args.model}; give --layers-per-stage")
        args.layers_per_stage = shape.num_layers // args.pipeline_model_parallel_size
    if args.layers_per_stage < 1:
        p.error("--layers-per-stage must be >= 1")
    if min(args.lengths) < 1 or min(args.budgets) < 1:
        p.error("--lengths and --budgets must be >= 1")
    args.recompute = RecomputeSettings(args.recompute_granularity, args.recompute_method, args.recompute_num_layers)
    try:
        args.recompute.validate()
    except ValueError as e:
        p.error(str(e))
    return args


def main(argv=None) -> ProfiledLatencyModel:
    args = parse_args(argv)
    profiler = StageProfiler(
        args.model, args.layers_per_stage, block_size=args.moba_block_size, impl=args.sparse_attn_impl,
        pre_process=args.stage in ("first", "only"), post_process=args.stage in ("last", "only"),
        bf16=False if args.fp32 else None, max_length=max(args.lengths), min_time_s=args.min_time_s,
        recompute=args.recompute,
    )
    print(f"profiling {args.model}, {args.layers_per_stage} layers ({args.stage} stage), block {args.moba_block_size}, "
          f"attention {profiler.impl}, {profiler.dtype}, on {device_name() if profiler.device.type == 'cuda' else 'cpu'}: "
          f"{len(args.lengths)} lengths x {len(args.budgets)} budgets", flush=True)
    model = profile(profiler, args.lengths, args.budgets, args.warmup, args.iters, args.candidates,
                    args.pipeline_model_parallel_size, args.tensor_model_parallel_size)
    save_profile(model, args.out)
    print(f"wrote {args.out}")
    return model


if __name__ == "__main__":
    sys.exit(0 if main() is not None else 1)
