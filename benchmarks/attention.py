"""Block-sparse attention, forward+backward, side by side on one GPU.

Ours (``cuda``, ``cuda_ds``: ``cuda`` with ``--sparse-attn-ds-buffer-gib`` unlimited, its backward
storing dS (Hopper, head dim 128), ``triton``, and ``fa4_backend``: ``--sparse-attn-impl fa4``,
flash-attn-4's kernels through our backend; on Hopper with our extension, our forward kernel and
FA4's backward) against
PyTorch FlexAttention (compiled, given the SAME selection as a ``BlockMask``: the selected
earlier blocks as full blocks, the diagonal block as a partial block whose mask_mod is only
``q >= kv``), FlexAttention's FLASH backend (``flex_flash``: the same call with
``kernel_options={"BACKEND": "FLASH"}``, flash-attn-4's CuTe kernels), flash-attn-4's
block-sparse API called directly (``fa4``: the BlockMask's forward and transposed tensors as
``BlockSparseTensorsTorch``, per query head, batch 1) and dense causal SDPA (cuDNN and
FlashAttention-2 backends). Before a sparse implementation's time counts, its output and
gradients are checked against ours (``cuda``, else ``triton``) on the same case: a row that
differs gets an error instead of a time. Shapes of Qwen2.5-0.5B
(14 query heads, 2 KV heads, head dim 64) and Qwen2.5-3B (16, 2, 128); one sequence of S tokens;
block size 128; density = kept fraction of the causal block triangle, reached by choosing the
MoBA budget k for each S and routing random-but-structured q/k with the MoBA router.

Reported per case: median ms of fwd+bwd (CUDA events, after warm-up; a case's implementations
take turns over ``--rounds`` rounds in a rotating order, so that the GPU's power-capped clock treats them
alike), useful TFLOP/s
(4 * kept_blocks * B^2 * d * 3.5, kept blocks counted per query head; the dense rows count the
whole causal block triangle) and the peak memory the fwd+bwd allocates beyond its inputs. The
forward alone is timed too (as training runs it: inputs requiring grad, so it saves what the
backward needs); ``bwd_ms`` is fwd+bwd minus it, which tells a slow forward from a slow backward.

Usage: ``python3 -m benchmarks.attention [--quick] [--tune] [--impls cuda,triton,flex,flex_flash,fa4,...]``.
Writes ``$OUT/attention_h200.json`` (or ``--out``) and prints a table. ``--markdown FILE`` prints
docs/BENCHMARKS.md's table of a results file instead of measuring; ``--auto-table FILE`` files the
order of our implementations measured in FILE under its GPU in ``ops/measured_order.py`` (what
``--sparse-attn-impl auto`` follows); ``--merge PART ... --out FILE`` joins runs of disjoint cases
(one process per GPU of a machine, split by ``--shapes`` and ``--seqs``) into one results file.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import statistics
import sys

import torch
import torch.nn.functional as F

from megatron_sparsebalance.ops.layout import BlockLayout
from megatron_sparsebalance.ops.router import block_scores, select_blocks
from megatron_sparsebalance.ops.sparse_attention import route as sparse_route

SHAPES = {"qwen2.5-0.5b": (14, 2, 64), "qwen2.5-3b": (16, 2, 128)}
BLOCK = 128
OURS = ("cuda", "cuda_ds", "triton", "fa4_backend")
SPARSE_IMPLS = OURS + ("flex", "flex_flash", "fa4")
ALL_IMPLS = SPARSE_IMPLS + ("cudnn_dense", "fa2_dense")
NEEDS_BLOCK_MASK = ("flex", "flex_flash", "fa4")  # built from the route by flex_block_mask
# Output and gradients of a sparse implementation against ours, in bf16: relative L2 error and
# largest difference relative to the largest value. Two correct bf16 kernels differ by rounding
# (well under 1%); a wrong mask or block moves whole rows.
CHECK_REL_L2 = 2e-2
CHECK_MAX_REL = 5e-2


NOTES = (
    "fwd+bwd medians of CUDA events over `rounds` rounds of `iters` runs, a case's implementations "
    "taking turns round by round, each round starting one implementation later (3 warm-ups before the first "
    "round, 1 before each later one); one sequence of S tokens, "
    "bf16, block 128. "
    "flex: torch.compile'd flex_attention given the same selection (off-diagonal selected blocks as full blocks, "
    "the diagonal as a partial block, mask_mod q >= kv). flex_flash: the same call with kernel_options "
    "{'BACKEND': 'FLASH'} (flash-attn-4). fa4: flash-attn-4's block-sparse API called directly with the "
    "BlockMask's forward and transposed tensors (per query head, batch 1). fa4_backend: --sparse-attn-impl fa4 "
    "(on Hopper with our extension built: our forward kernel and FA4's backward). cuda_ds: cuda with "
    "--sparse-attn-ds-buffer-gib unlimited (its backward stores dS; Hopper, head dim 128). "
    "check_vs/check: output and gradient errors against ours (rel_l2, max_rel) checked before a row's time "
    "counts. tflops: 4*kept_blocks*B^2*d*3.5 with kept blocks counted per query "
    "head (dense rows: the whole causal block triangle). peak_mem_gib: memory allocated by one fwd+bwd beyond its "
    "inputs (peak_requested_gib: the bytes requested, without the allocator's rounding). router: router_ms the "
    "torch MoBA router (block_scores+select_blocks) alone, router_gpu_ms the GPU router as the model runs it "
    "(coverage included) alone, router_in_step_ms what the GPU router adds when issued right after a Triton "
    "fwd+bwd (router_in_step_ms in benchmarks/attention.py)."
)

def cuda_times(fn, iters: int, warmup: int) -> list[float]:
    """ms of each of ``iters`` runs of ``fn`` after ``warmup`` runs, each bracketed by CUDA events."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(iters):
        a = torch.cuda.Event(enable_timing=True)
        b = torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        torch.cuda.synchronize()
        times.append(a.elapsed_time(b))
    return times


def cuda_time(fn, iters: int = 10, warmup: int = 3) -> float:
    """Median ms of ``fn`` over ``iters`` runs, each bracketed by CUDA events."""
    return statistics.median(cuda_times(fn, iters, warmup))


def router_in_step_ms(step, route, iters: int) -> float:
    """What routing adds to a forward+backward when other GPU work precedes it, as in a layer.

    Timed alone (``router_gpu_ms``) the router starts on an idle GPU, so the host's gaps between
    its few launches count; in a layer the GPU is still busy with the work before it (the QKV
    projections), and the gaps are hidden. Here the router is issued right after a step, while
    the GPU still runs it: difference of the medians of ``step(); route()`` and ``step()``, each
    timed twice, interleaved, the lower of each pair taken.
    """
    def step_then_route():
        step()
        route()

    plain, routed = [], []
    for _ in range(2):
        plain.append(cuda_time(step, iters=iters))
        routed.append(cuda_time(step_then_route, iters=iters))
    return min(routed) - min(plain)


def peak_extra_gib(fn) -> tuple[float, float]:
    """GiB one call of ``fn`` allocated above what was allocated before it, at its peak:
    ``(allocated, requested)``, the blocks as the caching allocator counts them and the bytes
    its callers asked for. They differ where the allocator rounds a request up (to 512 bytes) or
    hands out a cached block whole that is up to 1 MiB larger than the request (it does not split
    off less)."""
    torch.cuda.synchronize()
    before = torch.cuda.memory_stats()
    torch.cuda.reset_peak_memory_stats()
    fn()
    torch.cuda.synchronize()
    after = torch.cuda.memory_stats()
    return tuple((after[f"{key}.all.peak"] - before[f"{key}.all.current"]) / 2**30
                 for key in ("allocated_bytes", "requested_bytes"))


def kept_fraction(nb: int, k: int) -> float:
    """Kept fraction of the causal block triangle of ``nb`` blocks at budget ``k``."""
    kept = sum(min(i + 1, k) for i in range(nb))
    return kept / (nb * (nb + 1) / 2)


def budget_for_density(nb: int, density: float) -> int:
    return min(range(1, nb + 1), key=lambda k: abs(kept_fraction(nb, k) - density))


def make_inputs(S, hq, g, d, gen):
    """q/k/v of one sequence in THD ([S, H, D]) with per-block offsets (structured routing)."""
    nb = S // BLOCK
    tb = torch.arange(S, device="cuda") // BLOCK
    q = torch.randn(S, hq, d, device="cuda", generator=gen) + 0.5 * torch.randn(nb, hq, d, device="cuda", generator=gen)[tb]
    k = torch.randn(S, g, d, device="cuda", generator=gen) + 0.5 * torch.randn(nb, g, d, device="cuda", generator=gen)[tb]
    v = torch.randn(S, g, d, device="cuda", generator=gen)
    return [x.to(torch.bfloat16) for x in (q, k, v)]


def routed_case(S, hq, g, d, density, gen):
    """One sequence of S tokens (make_inputs) routed at ``density``: q, k, v, the route, and the
    kernels' arguments after q, k, v (``cuda_attention._forward``'s and its kin's)."""
    q, k, v = make_inputs(S, hq, g, d, gen)
    lay = BlockLayout.from_cu_seqlens(torch.tensor([0, S], dtype=torch.int32, device="cuda"), BLOCK, S)
    route = select_blocks(block_scores(q, k, lay), lay, budget_for_density(S // BLOCK, density))
    args = (route.kv_idx, route.kv_cnt, lay.block_start, lay.block_end, 1 / math.sqrt(d), BLOCK)
    return q, k, v, route, args


def flex_block_mask(route, hq, S):
    """The route as a FlexAttention BlockMask: off-diagonal selections full, the diagonal partial."""
    from torch.nn.attention.flex_attention import BlockMask

    kv_idx, kv_cnt = route.kv_idx, route.kv_cnt  # [G, NB, K], [G, NB]
    G, NB, K = kv_idx.shape
    R = hq // G
    dev = kv_idx.device
    full_cnt = (kv_cnt - 1).clamp(min=0)
    full_idx = torch.zeros(G, NB, NB, dtype=torch.int32, device=dev)
    slot = torch.arange(K, device=dev).view(1, 1, K)
    # Off-diagonal entries are the first kv_cnt-1 ones (ascending, diagonal last).
    keep = slot < full_cnt.unsqueeze(-1)
    full_idx[:, :, :K] = torch.where(keep, kv_idx, torch.zeros_like(kv_idx))
    part_cnt = torch.ones(G, NB, dtype=torch.int32, device=dev)
    part_idx = torch.zeros(G, NB, NB, dtype=torch.int32, device=dev)
    part_idx[:, :, 0] = torch.arange(NB, dtype=torch.int32, device=dev)

    def per_head(x):
        return x.repeat_interleave(R, 0).unsqueeze(0).contiguous()

    # Compiled Flex evaluates the mask_mod only on the partial blocks, the diagonal ones, where the
    # selection is causal: the mask_mod says only that. A mask_mod that also looked the selection
    # up in a table would be the same function but cost Flex 14-22% at 0.5B (a weakened anchor).
    # Eager Flex ignores the block structure: this mask is for compiled Flex (and FA4) only.
    def mask_mod(b, h, qi, ki):
        return qi >= ki

    return BlockMask.from_kv_blocks(
        per_head(part_cnt), per_head(part_idx), per_head(full_cnt.to(torch.int32)), per_head(full_idx),
        BLOCK_SIZE=BLOCK, mask_mod=mask_mod, seq_lengths=(S, S),
    )


def fa4_direct_tensors(bm):
    """flash-attn-4's forward and backward ``BlockSparseTensorsTorch`` of a FlexAttention BlockMask:
    its KV-direction (forward) and Q-direction (transposed, backward) block lists as they are."""
    from flash_attn.cute.block_sparsity import BlockSparseTensorsTorch

    size = (BLOCK, BLOCK)
    fwd = BlockSparseTensorsTorch(bm.kv_num_blocks, bm.kv_indices, bm.full_kv_num_blocks, bm.full_kv_indices,
                                  block_size=size)
    bwd = BlockSparseTensorsTorch(bm.q_num_blocks, bm.q_indices, bm.full_q_num_blocks, bm.full_q_indices,
                                  block_size=size)
    return fwd, bwd


def run_case(impl, q, k, v, go, route, S, hq, flex_fn, bm):
    """Closures ``(forward, forward_backward)`` of ``impl``: the forward alone (its output and
    what autograd saves are dropped on return) and one forward+backward.

    ``flex_fn`` (compiled flex_attention) serves flex and flex_flash, ``bm`` (:func:`flex_block_mask`)
    flex, flex_flash and fa4. The forward returns its output in the layout of its inputs."""
    d = q.shape[-1]
    scale = 1.0 / math.sqrt(d)
    if impl in OURS:
        from megatron_sparsebalance.ops.implementations import attention_function

        if impl == "cuda_ds":  # --sparse-attn-ds-buffer-gib without a limit
            from megatron_sparsebalance.ops.cuda_attention import takes_stored_ds

            fn = attention_function("cuda", ds_buffer_gib=math.inf)
            if not takes_stored_ds(q, k, route, fn.keywords["ds_buffer_bytes"]):
                raise ValueError("the cuda backward stores dS on Hopper at block 128 and head dim 128 only")
        else:
            fn = attention_function("fa4" if impl == "fa4_backend" else impl)
        inputs, grad_out = (q, k, v), go

        def forward():
            return fn(q, k, v, route, scale)
    elif impl == "fa4":
        from megatron_sparsebalance.ops.fa4_attention import _fa4

        flash_attn_func, _, causal_mask_mod = _fa4()
        fwd_tensors, bwd_tensors = fa4_direct_tensors(bm)
        inputs, grad_out = (q, k, v), go

        def forward():  # [S, H, D] is FA4's [batch 1, seqlen, heads, dim] without the batch
            out = flash_attn_func(q.unsqueeze(0), k.unsqueeze(0), v.unsqueeze(0), softmax_scale=scale,
                                  mask_mod=causal_mask_mod, block_sparse_tensors=fwd_tensors,
                                  block_sparse_tensors_bwd=bwd_tensors)
            return (out[0] if isinstance(out, tuple) else out)[0]
    else:
        # Flex and SDPA take [1, H, S, D]; they get their own contiguous copies (layout not timed).
        qh, kh, vh, goh = (x.detach().transpose(0, 1).unsqueeze(0).contiguous() for x in (q, k, v, go))
        for x in (qh, kh, vh):
            x.requires_grad_()
        inputs, grad_out = (qh, kh, vh), goh
        if impl in ("flex", "flex_flash"):
            options = {"BACKEND": "FLASH"} if impl == "flex_flash" else None

            def forward():
                return flex_fn(qh, kh, vh, block_mask=bm, enable_gqa=True, scale=scale, kernel_options=options)
        else:
            from torch.nn.attention import SDPBackend, sdpa_kernel

            backend = SDPBackend.CUDNN_ATTENTION if impl == "cudnn_dense" else SDPBackend.FLASH_ATTENTION

            def forward():
                with sdpa_kernel([backend]):
                    return F.scaled_dot_product_attention(qh, kh, vh, is_causal=True, enable_gqa=True, scale=scale)

    def step():
        torch.autograd.grad(forward(), inputs, grad_out)
    forward.inputs, forward.grad_out = inputs, grad_out  # for check_case
    return forward, step


def outputs_and_grads(forward) -> list:
    """``[out, dq, dk, dv]`` of one forward+backward, in our layout ``[S, H, D]``."""
    out = forward()
    grads = torch.autograd.grad(out, forward.inputs, forward.grad_out)
    tensors = [out, *grads]
    if out.dim() == 4:  # Flex and SDPA: [1, H, S, D]
        tensors = [x[0].transpose(0, 1) for x in tensors]
    return [x.detach() for x in tensors]


def compare(got: list, ref: list) -> dict:
    """Relative L2 error and largest difference over the largest reference value, per tensor."""
    check = {}
    for name, a, b in zip(("out", "dq", "dk", "dv"), got, ref):
        a, b = a.float(), b.float()
        if not torch.isfinite(a).all():
            check[name] = dict(rel_l2=float("inf"), max_rel=float("inf"))
            continue
        check[name] = dict(rel_l2=((a - b).norm() / b.norm().clamp(min=1e-30)).item(),
                           max_rel=((a - b).abs().max() / b.abs().max().clamp(min=1e-30)).item())
    return check


def check_failure(check: dict, ref_impl: str) -> str | None:
    """Why a checked row's time must not count, or None when it agrees with ours."""
    bad = [f"{name} rel_l2 {c['rel_l2']:.2e} max_rel {c['max_rel']:.2e}" for name, c in check.items()
           if not (c["rel_l2"] <= CHECK_REL_L2 and c["max_rel"] <= CHECK_MAX_REL)]
    return f"differs from {ref_impl}: " + ", ".join(bad) if bad else None


def reference_impl() -> str | None:
    """Ours to check the others against: cuda where it runs, else triton (measured or not)."""
    from megatron_sparsebalance.ops.implementations import unavailable_reason

    return next((i for i in ("cuda", "triton") if unavailable_reason(i, torch.device("cuda")) is None), None)


def tune_triton(shape_names, S=32768, density=0.25):
    """Coordinate search over the Triton tile configs (forward, dK/dV, dQ) at one shape each."""
    from megatron_sparsebalance.ops import triton_attention as ta

    cands = {
        # 4-warp tiles with two stages fit two programs on an SM (registers and shared memory):
        # one program's products then overlap the other's softmax work, where a single program
        # of a Triton loop waits for each of its products.
        "fwd": [(128, 64, 4, 3), (128, 64, 8, 3), (128, 128, 8, 2), (128, 128, 8, 3), (64, 64, 4, 3), (64, 128, 4, 3),
                (64, 64, 4, 2), (128, 64, 4, 2)],
        "dkdv": [(64, 128, 8, 2), (32, 128, 4, 3), (64, 64, 4, 3), (64, 128, 4, 2), (128, 128, 8, 2), (32, 64, 4, 3),
                 (64, 64, 8, 3), (64, 128, 8, 3), (64, 64, 4, 2), (128, 64, 4, 2)],
        "dq": [(128, 64, 8, 2), (128, 32, 4, 3), (64, 64, 4, 3), (128, 64, 4, 3), (128, 128, 8, 2), (64, 128, 4, 2),
               (64, 64, 4, 2), (128, 64, 4, 2)],
    }
    gen = torch.Generator(device="cuda").manual_seed(1)
    report, timings = {}, {}
    for name in shape_names:
        hq, g, d = SHAPES[name]
        q, k, v, _, args = routed_case(S, hq, g, d, density, gen)
        out, lse = ta._forward(q, k, v, *args)
        go = torch.randn_like(q)
        for kind in ("fwd", "dkdv", "dq"):
            best = None
            for cfg in cands[kind]:
                ta.CONFIGS[(kind, d)] = cfg
                try:
                    if kind == "fwd":
                        ms = cuda_time(lambda: ta._forward(q, k, v, *args), iters=5, warmup=2)
                    else:
                        ms = cuda_time(lambda: ta._backward(go, q, k, v, out, lse, *args), iters=5, warmup=2)
                except Exception as e:  # a config may not fit in shared memory
                    print(f"tune {name} {kind} {cfg}: {type(e).__name__}", flush=True)
                    continue
                print(f"tune {name} {kind} {cfg}: {ms:.3f} ms", flush=True)
                timings.setdefault(f"{kind}/{d}", []).append(dict(cfg=list(cfg), ms=ms))
                if best is None or ms < best[0]:
                    best = (ms, cfg)
            ta.CONFIGS[(kind, d)] = best[1]
            report[f"{kind}/{d}"] = best
        del q, k, v, out, lse, go
    print("tuned:", json.dumps({k: v[1] for k, v in report.items()}), flush=True)
    return {k: list(v[1]) for k, v in report.items()}, timings


def error_text(e: Exception) -> str:
    """What a row's ``error`` says of an exception."""
    return f"{type(e).__name__}: {str(e)[:200]}"


def failed(row: dict, error: str) -> None:
    """Marks ``row`` as a row without figures: ``error`` says why."""
    row.update(ms=None, tflops=None, peak_mem_gib=None, error=error)


def interleaved_rounds(timers: dict, rounds: int) -> tuple[dict, dict]:
    """Every timer once per round, round r starting at the r-th: ``(samples, errors)`` by key.

    A timer is called with the round's index and returns a list of samples. Why rounds: under
    load an H100 or H200 holds its power limit by moving its SM clock, so a step's time drifts
    by up to 10% within seconds (docs/FA4.md, "Where the backward's time goes"); implementations
    timed one after the other would each see another part of that drift, and taking turns gives
    each the same mix. Why the turns rotate: the drift is fastest right after a pause (the first
    steps after one run at the highest clock), so in a fixed order the first timer of every round
    would get the fast steps; over as many rounds as timers each takes every place once. A timer
    that raises gets its error and is left out of later rounds."""
    samples = {key: [] for key in timers}
    errors = {}
    keys = list(timers)
    for r in range(rounds if keys else 0):  # a case whose implementations all failed their checks has none
        for key in keys[r % len(keys):] + keys[:r % len(keys)]:
            timer = timers[key]
            if key in errors:
                continue
            try:
                samples[key].extend(timer(r))
            except Exception as e:  # a backend that fails while timed is a row with an error
                errors[key] = error_text(e)
    return samples, errors


def interleaved_medians(fns: dict, rounds: int, iters: int, warmup: int) -> dict:
    """Median ms of each function of ``fns`` over ``rounds`` rounds (:func:`interleaved_rounds`) of
    ``iters`` runs after ``warmup``, for probes: a function that fails raises here."""
    samples, errors = interleaved_rounds({key: (lambda r, fn=fn: cuda_times(fn, iters, warmup))
                                          for key, fn in fns.items()}, rounds)
    if errors:
        raise RuntimeError(f"failed while timed: {errors}")
    return {key: round(statistics.median(t), 3) for key, t in samples.items()}


@dataclasses.dataclass
class Case:
    """One measured case: a shape's inputs at S tokens and, for a sparse density, its route (budget
    ``kk``) and Flex's BlockMask (``bm``, where an implementation of the case needs it)."""
    shape: str
    S: int
    density: float
    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    go: torch.Tensor
    lay: BlockLayout
    kept_heads: int
    route: object = None
    bm: object = None
    kk: int | None = None


def timed_row(impl, step_samples, fwd_samples, step, c, flex_fn, impls, router, iters) -> dict:
    """A timed implementation's figures: medians of its samples, useful TFLOP/s, peak memory; for
    flex its difference from triton's output, for triton what the router adds inside its step."""
    q, k, v, d = c.q, c.k, c.v, c.q.shape[-1]
    ms, fwd_ms = statistics.median(step_samples), statistics.median(fwd_samples)
    mem, requested = peak_extra_gib(step)
    row = dict(fwd_ms=fwd_ms, bwd_ms=ms - fwd_ms)
    if impl == "flex" and "triton" in impls:  # same selection => same output
        from megatron_sparsebalance.ops.triton_attention import block_sparse_attention

        with torch.no_grad():
            ours = block_sparse_attention(q, k, v, c.route, 1.0 / math.sqrt(d))
            theirs = flex_fn(*(x.transpose(0, 1).unsqueeze(0) for x in (q, k, v)), block_mask=c.bm, enable_gqa=True,
                             scale=1.0 / math.sqrt(d))
        row["max_abs_diff_vs_triton"] = (ours.float() - theirs[0].transpose(0, 1).float()).abs().max().item()
    flops = 4 * c.kept_heads * BLOCK * BLOCK * d * 3.5
    row.update(ms=ms, tflops=flops / ms / 1e9, peak_mem_gib=mem, peak_requested_gib=requested)
    if impl == "triton" and c.density < 1.0:
        router["router_in_step_ms"] = router_in_step_ms(
            step, lambda: sparse_route(q, k, c.lay, c.kk, track_coverage=True), iters)
    return row


def measure_case(group, c: Case, args, flex_fn, ref_impl, impls, router) -> list:
    """The rows of case ``c`` for the implementations of ``group``: each checked against ours first
    (sparse cases), then all timed in ``args.rounds`` interleaved rounds of ``args.iters`` steps
    and forwards (:func:`interleaved_rounds`), then their peak memory. ``router``: the case's
    router row, which the triton row completes."""
    q, k, v, go, route, bm, S, density = c.q, c.k, c.v, c.go, c.route, c.bm, c.S, c.density
    hq, kept_heads = q.shape[1], c.kept_heads
    rows, prepared, reference = {}, {}, None
    for impl in group:
        row = dict(impl=impl, shape=c.shape, seq=S, density=density)
        if density < 1.0:
            row.update(k=c.kk, kept_frac=kept_heads / (hq * (S // BLOCK) * (S // BLOCK + 1) / 2))
        rows[impl] = row
        try:
            forward, step = run_case(impl, q, k, v, go, route, S, hq, flex_fn, bm)
            if density < 1.0:  # the same function as ours, gradients included, before it is timed
                if ref_impl is None:
                    raise RuntimeError("no implementation of ours (cuda, triton) runs here to check against")
                if reference is None:
                    ref_forward, _ = run_case(ref_impl, q, k, v, go, route, S, hq, flex_fn, bm)
                    reference = outputs_and_grads(ref_forward)
                    del ref_forward
                if impl != ref_impl:
                    check = compare(outputs_and_grads(forward), reference)
                    row.update(check_vs=ref_impl, check=check)
                    failure = check_failure(check, ref_impl)
                    if failure:
                        raise AssertionError(failure)
            prepared[impl] = (forward, step)
        except Exception as e:  # keep going: a missing backend is a row, not a crash
            failed(row, error_text(e))
    del reference
    def timer(forward, step):  # a round of one implementation: its steps, then its forwards
        def run(r):
            warmup = 3 if r == 0 else 1
            return ([("step", ms) for ms in cuda_times(step, args.iters, warmup)] +
                    [("fwd", ms) for ms in cuda_times(forward, args.iters, warmup)])
        return run

    samples, errors = interleaved_rounds({impl: timer(*fns) for impl, fns in prepared.items()}, args.rounds)
    out = []
    for impl in group:
        row = rows[impl]
        if impl in prepared:
            forward, step = prepared.pop(impl)
            error = errors.get(impl)
            if error is None:
                try:
                    step_samples = [ms for kind, ms in samples[impl] if kind == "step"]
                    fwd_samples = [ms for kind, ms in samples[impl] if kind == "fwd"]
                    row.update(timed_row(impl, step_samples, fwd_samples, step, c, flex_fn, impls, router, args.iters))
                except Exception as e:
                    error = error_text(e)
            if error is not None:
                failed(row, error)
            del forward, step
        out.append(row)
        print(json.dumps(row), flush=True)
    return out


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="S=8K and 32K, densities 10%% and 25%%")
    ap.add_argument("--tune", action="store_true", help="sweep Triton tile configs first")
    ap.add_argument("--impls", default=",".join(ALL_IMPLS))
    ap.add_argument("--shapes", default=",".join(SHAPES))
    ap.add_argument("--seqs", default=None, help="comma-separated sequence lengths")
    ap.add_argument("--densities", default=None)
    ap.add_argument("--iters", type=int, default=10, help="timed runs per round")
    ap.add_argument("--rounds", type=int, default=3,
                    help="rounds in which a case's implementations take turns (interleaved_rounds); as many "
                         "as implementations give each every place once")
    ap.add_argument("--out", default=None, help="JSON path (default $OUT/attention_h200.json)")
    ap.add_argument("--markdown", default=None, metavar="JSON",
                    help="print the markdown table of a results file (docs/BENCHMARKS.md's) and exit")
    ap.add_argument("--auto-table", default=None, metavar="JSON",
                    help="file the order of our implementations measured in a results file under its GPU in "
                         f"{MEASURED_ORDER_PATH} (what --sparse-attn-impl auto follows) and exit")
    ap.add_argument("--merge", nargs="+", default=None, metavar="JSON",
                    help="join results files of disjoint cases, measured alike (same GPU, versions, rounds), "
                         "into --out and exit")
    args = ap.parse_args(argv)
    if args.merge:
        if not args.out:
            ap.error("--merge needs --out, the merged file's path")
        parts = []
        for path in args.merge:
            with open(path) as f:
                parts.append(json.load(f))
        result = merge_results(parts, args.merge)
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)
        print_table(result)
        return result
    if args.markdown:
        with open(args.markdown) as f:
            print(markdown_table(json.load(f)))
        return None
    if args.auto_table:
        print(json.dumps(update_measured_order(args.auto_table)))
        return None
    impls = [x for x in args.impls.split(",") if x]
    shapes = [x for x in args.shapes.split(",") if x]
    seqs = [int(x) for x in args.seqs.split(",")] if args.seqs else ([8192, 32768] if args.quick else [8192, 32768, 65536])
    dens = [float(x) for x in args.densities.split(",")] if args.densities else ([0.1, 0.25] if args.quick else [0.05, 0.1, 0.25, 0.5])

    import triton

    meta = dict(gpu=torch.cuda.get_device_name(), torch=torch.__version__, triton=triton.__version__,
                cuda=torch.version.cuda, cudnn=torch.backends.cudnn.version(), block_size=BLOCK, dtype="bfloat16",
                rounds=args.rounds, iters=args.iters, notes=NOTES)
    tuned = None
    if args.tune and "triton" in impls:
        tuned, meta["triton_tune_ms"] = tune_triton(shapes)  # every candidate's time, kept with the pick
    if "triton" in impls:
        from megatron_sparsebalance.ops.triton_attention import CONFIGS

        meta["triton_configs"] = tuned or {f"{kind}/{d}": list(cfg) for (kind, d), cfg in CONFIGS.items()}
    unknown = sorted(set(impls) - set(ALL_IMPLS))
    if unknown:
        raise ValueError(f"--impls: unknown {unknown}; choose from {ALL_IMPLS}")
    if any(i in impls for i in ("fa4", "fa4_backend", "flex_flash")):
        from importlib.metadata import PackageNotFoundError, version

        for package in ("flash-attn-4", "nvidia-cutlass-dsl"):
            try:
                meta[package.replace("-", "_")] = version(package)
            except PackageNotFoundError:
                meta[package.replace("-", "_")] = None
    flex_fn = None
    if "flex" in impls or "flex_flash" in impls:
        from torch.nn.attention.flex_attention import flex_attention

        flex_fn = torch.compile(flex_attention, dynamic=False)
        # One compilation per case (shape, length, mask). Past dynamo's recompile limit (8) Flex
        # would silently run eagerly, materialising the S x S scores (128 GiB at 3B, 32K).
        torch._dynamo.config.recompile_limit = 256
    ref_impl = reference_impl()
    meta["check_vs"] = ref_impl
    rows, routers = [], {}  # routers: one row per (shape, S, density), in measuring order
    gen = torch.Generator(device="cuda").manual_seed(0)
    for name in shapes:
        hq, g, d = SHAPES[name]
        for S in seqs:
            nb = S // BLOCK
            q, k, v = make_inputs(S, hq, g, d, gen)
            for x in (q, k, v):
                x.requires_grad_()
            go = torch.randn_like(q)
            lay = BlockLayout.from_cu_seqlens(torch.tensor([0, S], dtype=torch.int32, device="cuda"), BLOCK, S)
            groups = [(1.0, ("cudnn_dense", "fa2_dense"))] + [(x, SPARSE_IMPLS) for x in dens]
            for density, group in groups:
                group = [i for i in group if i in impls]
                if not group:
                    continue
                route = bm = kk = None
                kept_heads = hq * nb * (nb + 1) // 2
                if density < 1.0:
                    kk = budget_for_density(nb, density)
                    with torch.no_grad():
                        route = select_blocks(block_scores(q, k, lay), lay, kk)
                    # router cost once per case (the same for every impl)
                    rms = cuda_time(lambda: select_blocks(block_scores(q, k, lay), lay, kk), iters=5, warmup=1)
                    # the router as the model runs it on a GPU (Triton: pooling, one GEMM, one
                    # selection + coverage launch), coverage curve included
                    fms = cuda_time(lambda: sparse_route(q, k, lay, kk, track_coverage=True), iters=5, warmup=1)
                    routers[name, S, density] = dict(shape=name, seq=S, density=density, k=kk, router_ms=rms,
                                                     router_gpu_ms=fms)
                    kept_heads = route.kept_blocks() * (hq // g)
                    if any(i in NEEDS_BLOCK_MASK for i in group):
                        bm = flex_block_mask(route, hq, S)
                case = Case(name, S, density, q, k, v, go, lay, kept_heads, route, bm, kk)
                rows += measure_case(group, case, args, flex_fn, ref_impl, impls, routers.get((name, S, density)))
                del case
            del q, k, v, go
            torch.cuda.empty_cache()
    result = dict(meta, rows=rows, router=list(routers.values()))
    out = args.out or (os.path.join(os.environ["OUT"], "attention_h200.json") if os.environ.get("OUT") else None)
    if out:
        with open(out, "w") as f:
            json.dump(result, f, indent=1)
    print_table(result)
    return result


def merge_results(parts: list, names: list) -> dict:
    """One results file from runs of disjoint cases: the first run's metadata, every run's rows and
    router rows in order. Refused: runs whose metadata differ (another GPU, versions, rounds or
    Triton tiles: their times would not compare) and a case measured twice (which one to keep
    would be a guess). ``names`` name the runs in the errors."""
    first = {k: v for k, v in parts[0].items() if k not in ("rows", "router")}
    seen = {}
    for part, name in zip(parts, names):
        meta = {k: v for k, v in part.items() if k not in ("rows", "router")}
        differing = sorted(k for k in first.keys() | meta.keys() if first.get(k) != meta.get(k))
        if differing:
            raise ValueError(f"--merge: {name} was measured unlike {names[0]} ({', '.join(differing)} differ)")
        for row in part["rows"]:
            key = (row["impl"], row["shape"], row["seq"], row["density"])
            if key in seen:
                raise ValueError(f"--merge: {key} is in both {seen[key]} and {name}")
            seen[key] = name
    return dict(first, rows=[r for p in parts for r in p["rows"]],
                router=[r for p in parts for r in p.get("router", [])])


def sparse_cases(rows):
    """``(shape, S, density, got, dense)`` for each sparse case of ``rows``, in the tables' order
    (shape, S, density): ``got`` its rows by impl, ``dense`` the dense rows of its shape and S."""
    for shape, S in sorted({(r["shape"], r["seq"]) for r in rows}):
        here = [r for r in rows if r["shape"] == shape and r["seq"] == S]
        dense = {r["impl"]: r for r in here if r["density"] == 1.0}
        for density in sorted({r["density"] for r in here if r["density"] < 1.0}):
            yield shape, S, density, {r["impl"]: r for r in here if r["density"] == density}, dense


def best_ours_ms(got) -> float | None:
    """The fastest of our implementations' ms in a case's rows by impl (None if none ran)."""
    return min((got[i]["ms"] for i in OURS if got.get(i, {}).get("ms")), default=None)


MEASURED_ORDER_PATH = "megatron_sparsebalance/ops/measured_order.py"


def render_measured_order(table: dict) -> str:
    """The source of ``ops/measured_order.py`` holding ``table``."""
    from megatron_sparsebalance.ops import measured_order

    lines = ["MEASURED = {"]
    for gpu in sorted(table):
        lines.append(f"    {gpu!r}: {{")
        lines += [f"        {key!r}: {value!r}," for key, value in sorted(table[gpu].items())]
        lines.append("    },")
    lines.append("}")
    return f'"""{measured_order.__doc__}"""\n\n' + "\n".join(lines) + "\n"


def update_measured_order(results_path: str, module_path: str | None = None) -> dict:
    """File the order measured in ``results_path`` under its GPU in ``ops/measured_order.py``."""
    from megatron_sparsebalance.ops import measured_order
    from megatron_sparsebalance.ops.implementations import measured_entry

    with open(results_path) as f:
        result = json.load(f)
    entry = dict(measured_entry(result), source=os.path.relpath(results_path))
    table = dict(measured_order.MEASURED, **{result["gpu"]: entry})
    module_path = module_path or measured_order.__file__
    with open(module_path, "w") as f:
        f.write(render_measured_order(table))
    return {result["gpu"]: entry}


def markdown_table(result) -> str:
    """The results as docs/BENCHMARKS.md shows them: one line per (shape, S, density), the dense
    rows of that shape and S beside each, and the ratios recomputed from the rows' ms."""
    rows = result["rows"]

    def ms(r):
        return f"{r['ms']:.2f} ({r['tflops']:.0f})" if r and r.get("ms") else "-"

    def fwd_bwd(r):
        return f"{r['fwd_ms']:.2f} / {r['bwd_ms']:.2f}" if r and r.get("fwd_ms") is not None else "-"

    def gib(r):
        return f"{r['peak_mem_gib']:.4f}" if r and r.get("peak_mem_gib") is not None else "-"

    def ratio(a, b):
        return f"{a / b:.2f}x" if a and b else "-"

    lines = ["| shape | S | density (kept) | cuda ms (TF/s) | triton ms (TF/s) | flex ms (TF/s) | cuDNN dense ms (TF/s) "
             "| FA2 dense ms (TF/s) | flex / cuda | flex / best ours | cuda fwd / bwd ms | triton fwd / bwd ms "
             "| flex fwd / bwd ms | extra GiB cuda / triton / flex |",
             "|" + "---|" * 14]
    # FA4's columns appear where a file measured it (files from before it keep their table)
    with_fa4 = any(r["impl"] in ("flex_flash", "fa4", "fa4_backend") for r in rows)
    if with_fa4:
        lines[0] += (" flex FLASH ms (TF/s) | FA4 ms (TF/s) | fa4 (ours) ms (TF/s) | FA4 / cuda | FA4 / best ours "
                     "| FA4 fwd / bwd ms |")
        lines[1] += "---|" * 6
    # and the stored-dS rows where a file measured them
    with_ds = any(r["impl"] == "cuda_ds" for r in rows)
    if with_ds:
        lines[0] += " cuda (stored dS) ms (TF/s) | cuda (stored dS) fwd / bwd ms | extra GiB cuda (stored dS) |"
        lines[1] += "---|" * 3
        if with_fa4:
            lines[0] += " FA4 / cuda (stored dS) |"
            lines[1] += "---|"
    for shape, S, density, got, dense in sparse_cases(rows):
        cuda, triton, flex = (got.get(i) for i in ("cuda", "triton", "flex"))
        kept = next((r["kept_frac"] for r in got.values() if "kept_frac" in r), None)
        cells = [shape, f"{S // 1024}K", f"{density:.2f}" + (f" ({kept:.3f})" if kept is not None else ""),
                 ms(cuda), ms(triton), ms(flex), ms(dense.get("cudnn_dense")), ms(dense.get("fa2_dense")),
                 ratio(flex and flex.get("ms"), cuda and cuda.get("ms")),
                 ratio(flex and flex.get("ms"), best_ours_ms(got)),
                 fwd_bwd(cuda), fwd_bwd(triton), fwd_bwd(flex), " / ".join(gib(r) for r in (cuda, triton, flex))]
        flash, fa4, fa4_ours = (got.get(i) for i in ("flex_flash", "fa4", "fa4_backend"))
        if with_fa4:
            fa4_ms = fa4 and fa4.get("ms")
            cells += [ms(flash), ms(fa4), ms(fa4_ours), ratio(fa4_ms, cuda and cuda.get("ms")),
                      ratio(fa4_ms, best_ours_ms(got)), fwd_bwd(fa4)]
        if with_ds:
            stored = got.get("cuda_ds")
            cells += [ms(stored), fwd_bwd(stored), gib(stored)]
            if with_fa4:
                cells.append(ratio(fa4 and fa4.get("ms"), stored and stored.get("ms")))
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def print_table(result):
    rows = result["rows"]
    print(f"\n{result['gpu']}  torch {result['torch']}  triton {result.get('triton')}  fwd+bwd, bf16, block {BLOCK}")
    print(f"{'shape':14s} {'S':>6s} {'dens':>5s} | " + " | ".join(f"{i:>19s}" for i in ALL_IMPLS)
          + " | flex/best | fa4/best")
    for shape, S, dens, got, dense in sparse_cases(rows):
        cells = []
        for i in ALL_IMPLS:
            r = got.get(i) or dense.get(i)
            cells.append(f"{r['ms']:8.2f}ms {r['tflops']:5.0f}TF" if r and r.get("ms") else f"{'-':>19s}")
        ours = best_ours_ms(got)
        ratios = []
        for anchor in ("flex", "fa4"):
            theirs = got.get(anchor, {}).get("ms")
            ratios.append(f"{theirs / ours:8.2f}x" if ours and theirs else f"{'-':>9s}")
        print(f"{shape:14s} {S:6d} {dens:5.2f} | " + " | ".join(cells) + " | " + " | ".join(ratios))
    print("\nforward | backward ms (backward = fwd+bwd - fwd)")
    for shape, S, dens, got, _ in sparse_cases(rows):
        cells = [f"{i} {got[i]['fwd_ms']:.2f} | {got[i]['bwd_ms']:.2f}" for i in SPARSE_IMPLS
                 if got.get(i, {}).get("fwd_ms") is not None]
        print(f"{shape:14s} {S:6d} {dens:5.2f}   " + "   ".join(cells))
    for r in result.get("router", []):
        best = best_ours_ms({x["impl"]: x for x in rows if x["shape"] == r["shape"] and x["seq"] == r["seq"]
                             and x["density"] == r["density"]})
        frac = f" = {100 * r['router_gpu_ms'] / best:.1f}% of our best fwd+bwd" if best else ""
        in_step = (f"; inside a Triton step {r['router_in_step_ms']:.3f} ms"
                   + (f" = {100 * r['router_in_step_ms'] / best:.1f}%" if best else "")) if "router_in_step_ms" in r else ""
        print(f"router {r['shape']} S={r['seq']} d={r['density']} k={r['k']}: torch {r['router_ms']:.3f} ms, "
              f"GPU router {r['router_gpu_ms']:.3f} ms{frac}{in_step}")


if __name__ == "__main__":
    main(sys.argv[1:])
