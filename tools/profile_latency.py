"""Profile the forward+backward time of one pipeline stage into a latency table.

Builds the real layer stack of a stage (a megatron-core ``GPTModel`` from ``build_gpt_model``
with ``--layers-per-stage`` layers and our sparse core attention; embedding / output layer only
when the stage holds them; in bf16 behind ``Float16Module``, as training runs it), then
times single-sequence micro-batches over a grid of (length, budget) and writes a
:class:`~megatron_sparsebalance.balance.latency.ProfiledLatencyModel` as JSON with the
metadata a run checks when it loads the table.

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

A tensor-parallel stage is profiled on its TP group, one process per GPU (the table records TP
and sequence parallelism, and a run of another layout refuses it):
  torchrun --nproc-per-node 2 tools/profile_latency.py --model qwen2.5-3b --tensor-model-parallel-size 2 \\
      --sequence-parallel --pipeline-model-parallel-size 2 --out latency_3b_tp2pp2.json
The ranks of the group time the same points in lockstep (their collectives need it): how long a
point is timed and whether it is host-bound are agreed over the group, and a point's time is its
slowest rank's (a TP stage waits for all its ranks). Rank 0 writes the table.
"""
from __future__ import annotations

import argparse
import gc
import os
import statistics
import sys
import time
from typing import Callable, Optional, Sequence

import torch
from megatron.core.transformer.module import Float16Module

from megatron_sparsebalance.attention import SparseAttentionConfig, budget_scope
from megatron_sparsebalance.data.synthetic import thd_params
from megatron_sparsebalance.balance.latency import ProfiledLatencyModel, device_name, latency_metadata
from megatron_sparsebalance.ops.implementations import IMPLEMENTATIONS, resolve_impl
from megatron_sparsebalance.training.cpu_compat import enable_cpu_megatron
from megatron_sparsebalance.training.dist import init_distributed
from megatron_sparsebalance.training.manual_gc import ManualGC
from megatron_sparsebalance.training.model import MODEL_PRESETS, RecomputeSettings, build_gpt_model, transformer_config
from megatron_sparsebalance.training.tensor_parallel import validate_tensor_parallel

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
# A point is host-bound when issuing it takes at least this share of its wall time: its time is
# the CPU's, which drifts between moments (docs/LATENCY.md); the GPU's time does not (0.4%).
HOST_BOUND_FRACTION = 0.5

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

    tensor_parallel_size = 1  # a stage of one GPU unless built at a TP
    sequence_parallel = False

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
        tensor_parallel_size: int = 1,
        sequence_parallel: bool = False,
    ):
        self.min_time_s = min_time_s
        self.tensor_parallel_size, self.sequence_parallel = tensor_parallel_size, sequence_parallel
        self.last_host_fraction = 1.0  # of the last timed point (see _timed)
        self.device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
        self.bf16 = (self.device.type == "cuda") if bf16 is None else bf16
        self.dtype = torch.bfloat16 if self.bf16 else torch.float32
        self.shape = MODEL_PRESETS[model_name]
        self.layers_per_stage = layers_per_stage
        self.block_size = block_size
        self.pre_process, self.post_process = pre_process, post_process
        self.impl = resolve_impl(impl, self.device)
        enable_cpu_megatron()
        init_distributed(tensor_parallel_size=tensor_parallel_size)
        torch.manual_seed(seed)
        if self.device.type == "cuda":
            # Megatron initialises weights on the GPU under its tensor-parallel RNG tracker,
            # which must be seeded first (as Megatron-LM's initialize does).
            from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

            model_parallel_cuda_manual_seed(seed)
        self.sparse = SparseAttentionConfig(moba_block_size=block_size, sparse_attn_impl=self.impl).validate()
        self.recompute = recompute or RecomputeSettings()
        config = transformer_config(self.shape, bf16=self.bf16, num_layers=layers_per_stage, recompute=self.recompute,
                                    tensor_parallel_size=tensor_parallel_size, sequence_parallel=sequence_parallel)
        self.model = build_gpt_model(
            self.shape, self.sparse, config, max_sequence_length=max_length,
            pre_process=pre_process, post_process=post_process,
        ).to(self.device)
        self.model.train()
        # Run the stage as training does (training/trainer.py): in bf16 behind megatron-core's
        # Float16Module, which casts every parameter, the norms' included. Unwrapped, the norm
        # weights stay fp32 and torch's RMSNorm falls back to its unfused kernels, a slower stage
        # than the one being planned. (Training's DDP wrapper is left out: its per-parameter
        # gradient hooks add host time that the table does not see; docs/LATENCY.md.)
        self.stage = Float16Module(config, self.model) if self.bf16 else self.model
        self.core_attention = self.model.decoder.layers[0].self_attention.core_attention
        self._gen = torch.Generator(device="cpu").manual_seed(seed)

    def _sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def _over_tp(self, value: float) -> float:
        """The largest ``value`` over the TP group (the value itself at TP=1)."""
        if self.tensor_parallel_size == 1:
            return value
        from megatron.core import parallel_state

        t = torch.tensor([float(value)], dtype=torch.float64, device=self.device)
        torch.distributed.all_reduce(t, op=torch.distributed.ReduceOp.MAX,
                                     group=parallel_state.get_tensor_model_parallel_group())
        return float(t)

    def _timed(self, step, warmup: int, iters: int) -> float:
        """Median ms of ``step()`` after ``warmup`` untimed calls: ``iters`` timed calls, more while
        under ``min_time_s`` of measured time.

        Sets ``last_host_fraction``: the share of the wall time the host spent issuing the step
        (1.0 on a CPU). The garbage collector is off while timing (``--manual-gc``'s setting in
        training): an automatic collection lands in a random call and adds tens of ms of host
        time to it.
        """
        for _ in range(warmup):
            step()
        self._sync()
        times, issue = [], []
        with ManualGC(True, 0):
            # agreed over TP: every rank of the group must call the step as often as the others
            while len(times) < iters or (self._over_tp(sum(times) < self.min_time_s * 1e3)
                                         and len(times) < MAX_TIMED_ITERS):
                t0 = time.perf_counter()
                if self.device.type == "cuda":
                    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                    start.record()
                    step()
                    end.record()
                    issue.append((time.perf_counter() - t0) * 1e3)
                    end.synchronize()
                    times.append(start.elapsed_time(end))
                else:
                    step()
                    times.append((time.perf_counter() - t0) * 1e3)
                    issue.append(times[-1])
        ms = self._over_tp(statistics.median(times))
        self.last_host_fraction = self._over_tp(min(1.0, statistics.median(issue) / ms) if ms > 0 else 1.0)
        return ms

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
        if self.sequence_parallel and T % self.tensor_parallel_size:
            raise ValueError(f"--sequence-parallel: a profiled pack of {T} tokens must be a multiple of "
                             f"--tensor-model-parallel-size ({self.tensor_parallel_size})")
        # Under sequence parallelism a stage's input and output are its rank's share of the tokens.
        T_act = T // self.tensor_parallel_size if self.sequence_parallel else T

        def activation():
            return torch.randn(T_act, 1, h, generator=self._gen).to(self.device, self.dtype)

        hidden = None if self.pre_process else activation().requires_grad_()
        grad = None if self.post_process else activation()

        def step():
            if hidden is not None:
                self.model.set_input_tensor(hidden)
            # backward inside the scope too: recomputed layers route again there (as in training)
            with budget_scope(k=k, k_base=k_base, p=p):
                out = self.stage(tokens if self.pre_process else None, pos if self.pre_process else None, None,
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
            sequence_parallel=self.sequence_parallel,
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
    rounds: int = 1,
    after_pass: Optional[Callable[[int], None]] = None,
) -> ProfiledLatencyModel:
    """Measure the grid and return the table as a model (its ``profile`` info in ``model.profile_info``).

    Lengths are measured shortest first. A length that runs out of GPU memory, or any length
    after ``time_budget_s`` has passed, is dropped with all longer ones (said in the log and in
    ``profile_info``): the table then extrapolates there. No later pass starts after
    ``time_budget_s`` either.

    ``rounds`` > 1 times the host-bound points again in that many passes over the grid and keeps
    the median of each point's passes. A host-bound point (a short pack: issuing it takes at least
    :data:`HOST_BOUND_FRACTION` of its wall time, so its time is the CPU's) drifts by 10-30%
    between moments seconds to minutes apart (docs/LATENCY.md); timed at one moment, each such
    point of the table would carry its moment's drift. A GPU-bound point does not drift (0.4%
    between rounds) and is timed once. The first pass decides which lengths are kept (time
    budget, memory) and which points are host-bound; its own figures stay in ``profile_info``.
    ``after_pass(r)`` runs after pass ``r`` (0-based): a benchmark measures its held-out
    micro-batches there, so that they and the table see the same moments.
    """
    if rounds < 1:
        raise ValueError(f"rounds must be >= 1, got {rounds}")
    if tensor_parallel_size > 1 and time_budget_s is not None:
        # the ranks' clocks would drop lengths at different points and leave the group's collectives unmatched
        raise ValueError("time_budget_s is not supported for a tensor-parallel stage")
    lengths, budgets = sorted(set(lengths)), sorted(set(budgets))
    B, nl = profiler.block_size, profiler.layers_per_stage
    t_start = time.perf_counter()
    points = [(j, i) for j in range(len(lengths)) for i in range(len(budgets))]
    # k >= the blocks of the sequence: the same (dense) computation as the previous budget, so
    # the point is copied from there instead of measured
    copied = {(j, i) for j, i in points if i > 0 and budgets[i - 1] >= -(-lengths[j] // B)}
    # cost weight of a point, to show an honest ETA (long sequences dominate)
    weights = {p: 0.0 if p in copied else lengths[p[0]] * (1 + min(budgets[p[1]], lengths[p[0]] / B) * B / 4096)
               for p in points}
    # per pass: {point: (stage ms, attention ms of the stage's layers without the fixed cost)}
    passes: list = []
    attn_fixed_passes: list = []
    host_bound: set = set()
    dropped = None
    # One collection per pass instead of one per point (the nested ManualGC scopes of _timed are no-ops).
    with ManualGC(True, 0):
        # The very first forward+backward pays one-off costs (allocator growth, lazy inits, kernel
        # compiles for the dtype) that no later micro-batch pays: run it before anything is timed.
        profiler.measure([lengths[0]], budgets[-1], warmup=1, iters=1)
        for r in range(rounds):
            if r > 0 and time_budget_s is not None and time.perf_counter() - t_start > time_budget_s:
                log(f"time budget of {time_budget_s:.0f} s spent: {r} of {rounds} passes made", flush=True)
                break
            gc.collect()
            # The attention's fixed cost per call (launches, layout, router set-up): a one-block
            # sequence computes one block pair, so its time is almost all fixed cost. Paid once per pack.
            attn_fixed = profiler.measure_attention([B], budgets[0], warmup, iters)
            attn_fixed_passes.append(attn_fixed)
            label = f"pass {r + 1}/{rounds}: " if rounds > 1 else ""
            log(f"{label}attention fixed cost per layer: {attn_fixed:.3f} ms")
            measured: dict = {}
            if r == 0:
                todo = [p for p in points if p not in copied]
            else:
                todo = [p for p in points if p in host_bound and (dropped is None or p[0] < dropped[0])]
            all_weight = sum(weights[p] for p in todo)
            done_weight, t_pass = 0.0, time.perf_counter()
            for n, (j, i) in enumerate(todo, 1):
                L, k = lengths[j], budgets[i]
                if r == 0 and i == 0 and time_budget_s is not None and time.perf_counter() - t_start > time_budget_s:
                    dropped = (j, f"time budget of {time_budget_s:.0f} s spent")
                    break
                try:
                    total = profiler.measure([L], k, warmup if r == 0 else 1, iters)
                    if r == 0 and profiler.last_host_fraction >= HOST_BOUND_FRACTION:
                        host_bound.add((j, i))
                    a = profiler.measure_attention([L], k, warmup if r == 0 else 1, iters)
                except torch.cuda.OutOfMemoryError:
                    if r > 0:  # fitted in the first pass: a fragmented allocator, not the point's size
                        gc.collect()  # the pass keeps the collector off; free what only it can
                        torch.cuda.empty_cache()
                        log(f"{label}L={L} k={k}: out of GPU memory, this pass skips it", flush=True)
                        continue
                    dropped = (j, f"out of GPU memory at L={L}, k={k}")
                    break
                measured[(j, i)] = (total, max(0.0, nl * (a - attn_fixed)))
                done_weight += weights[(j, i)]
                elapsed = time.perf_counter() - t_start
                pass_s = time.perf_counter() - t_pass
                # the first pass cannot know how many points the later ones repeat: its ETA is its own
                eta = pass_s * (all_weight - done_weight) / max(done_weight, 1e-9)
                if r > 0:
                    eta += (rounds - 1 - r) * pass_s * all_weight / max(done_weight, 1e-9)
                bound = "host" if (j, i) in host_bound else "GPU"
                log(f"{label}[{n:3d}/{len(todo)}] L={L:6d} k={k:3d}: stage {total:9.3f} ms ({bound}-bound), attention "
                    f"{measured[(j, i)][1]:9.3f} ms; elapsed {elapsed:6.1f} s, "
                    f"eta {eta:6.1f} s{' (this pass)' if r == 0 and rounds > 1 else ''}", flush=True)
            passes.append({"points": measured, "seconds": time.perf_counter() - t_pass})
            if r == 0 and dropped is not None:
                j, why = dropped
                if j == 0:
                    raise RuntimeError(f"nothing profiled: {why}")
                log(f"{why}: dropping lengths {lengths[j:]}; the table extrapolates beyond {lengths[j - 1]}", flush=True)
                if profiler.device.type == "cuda":
                    torch.cuda.empty_cache()
            if after_pass is not None:
                after_pass(r)
    if dropped is not None:
        lengths = lengths[:dropped[0]]

    def table(pass_list):
        """[length][budget] stage and attention ms: each point's median over ``pass_list``, copied
        points from the budget before them."""
        total = [[0.0] * len(budgets) for _ in lengths]
        attention = [[0.0] * len(budgets) for _ in lengths]
        for j in range(len(lengths)):
            for i in range(len(budgets)):
                if (j, i) in copied:
                    total[j][i], attention[j][i] = total[j][i - 1], attention[j][i - 1]
                    continue
                got = [p["points"][(j, i)] for p in pass_list if (j, i) in p["points"]]
                total[j][i] = statistics.median(t for t, _ in got)
                attention[j][i] = statistics.median(a for _, a in got)
        return total, attention

    total, attention = table(passes)
    meta = profiler.metadata(pipeline_parallel_size, tensor_parallel_size)
    common = {"metadata": meta}
    if candidates is not None:
        common["candidates"] = candidates
    model = ProfiledLatencyModel(lengths, budgets, total, attention, B, **common)
    model.profile_info = {
        "warmup": warmup, "iters": iters, "min_time_s": profiler.min_time_s, "rounds": len(passes),
        "attention_fixed_ms_per_layer": statistics.median(attn_fixed_passes),
        "seconds": round(time.perf_counter() - t_start, 2), "torch": torch.__version__,
        "timer": "cuda_events" if profiler.device.type == "cuda" else "wall_clock",
        "dropped": None if dropped is None else dropped[1],
    }
    if rounds > 1:
        first_total, first_attention = table(passes[:1])
        model.profile_info["first_pass"] = {"total_ms": first_total, "attention_ms": first_attention}
        model.profile_info["pass_seconds"] = [round(p["seconds"], 1) for p in passes]
        model.profile_info["host_bound_points"] = len(host_bound)
        model.profile_info["host_bound_fraction"] = HOST_BOUND_FRACTION
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
                   help="profile a TP stage: run under torchrun with this many processes (one per GPU)")
    p.add_argument("--sequence-parallel", action="store_true",
                   help="the stage runs with Megatron's sequence parallelism (needs TP > 1; --lengths multiples of TP)")
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
    p.add_argument("--rounds", type=int, default=1,
                   help="time every point in this many passes over the grid and keep the median of its passes: "
                        "a short pack's time drifts with the host's speed over seconds to minutes, and passes "
                        "minutes apart keep one moment's drift out of the table; the later passes repeat only the "
                        f"host-bound points (issuing them takes >= {HOST_BOUND_FRACTION:g} of their wall time)")
    p.add_argument("--fp32", action="store_true", help="profile in float32 (the default on a GPU is bfloat16)")
    p.add_argument("--recompute-granularity", choices=("full", "selective"), default=None,
                   help="profile the stage with activation recomputation, as the run will train it (pretrain's flag)")
    p.add_argument("--recompute-method", choices=("uniform", "block"), default=None)
    p.add_argument("--recompute-num-layers", type=int, default=None)
    p.add_argument("--recompute-modules", nargs="+", default=None, metavar="MODULE",
                   help="with --recompute-granularity selective: core_attn and/or mlp (pretrain's flag)")
    p.add_argument("--out", required=True, help="where to write the JSON table")
    args = p.parse_args(argv)
    shape = MODEL_PRESETS[args.model]
    tp = args.tensor_model_parallel_size
    try:
        validate_tensor_parallel(shape, tp, args.sequence_parallel)
    except ValueError as e:
        p.error(str(e))
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world != tp:
        p.error(f"--tensor-model-parallel-size {tp} profiles one TP group: run {tp} processes (torchrun "
                f"--nproc-per-node {tp}), not {world}")
    if args.sequence_parallel and any(L % tp for L in args.lengths):
        p.error(f"--sequence-parallel: --lengths must be multiples of --tensor-model-parallel-size ({tp})")
    if args.layers_per_stage is None:
        if shape.num_layers % args.pipeline_model_parallel_size:
            p.error(f"--pipeline-model-parallel-size {args.pipeline_model_parallel_size} does not divide "
                    f"the {shape.num_layers} layers of {args.model}; give --layers-per-stage")
        args.layers_per_stage = shape.num_layers // args.pipeline_model_parallel_size
    if args.layers_per_stage < 1:
        p.error("--layers-per-stage must be >= 1")
    if min(args.lengths) < 1 or min(args.budgets) < 1:
        p.error("--lengths and --budgets must be >= 1")
    if args.rounds < 1:
        p.error(f"--rounds must be >= 1, got {args.rounds}")
    args.recompute = RecomputeSettings(args.recompute_granularity, args.recompute_method, args.recompute_num_layers,
                                       tuple(args.recompute_modules) if args.recompute_modules else None)
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
        recompute=args.recompute, tensor_parallel_size=args.tensor_model_parallel_size,
        sequence_parallel=args.sequence_parallel,
    )
    print(f"profiling {args.model}, {args.layers_per_stage} layers ({args.stage} stage), block {args.moba_block_size}, "
          f"attention {profiler.impl}, {profiler.dtype}, on {device_name() if profiler.device.type == 'cuda' else 'cpu'}: "
          f"{len(args.lengths)} lengths x {len(args.budgets)} budgets", flush=True)
    model = profile(profiler, args.lengths, args.budgets, args.warmup, args.iters, args.candidates,
                    args.pipeline_model_parallel_size, args.tensor_model_parallel_size, rounds=args.rounds)
    if not torch.distributed.is_initialized() or torch.distributed.get_rank() == 0:
        save_profile(model, args.out)
        print(f"wrote {args.out}")
    return model


if __name__ == "__main__":
    sys.exit(0 if main() is not None else 1)
