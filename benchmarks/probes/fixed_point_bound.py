"""Probe: how loose the fixed-point bounds of a deterministic one-pass backward are on a real
model's activations, and what summing dQ, dK and dV in int32 by them does to the gradients
(docs/FA4.md, "A deterministic one-pass backward: the reduction", which has the figures).

A one-pass backward adds each step's dQ partial (one query tile against one KV block) into a
shared accumulator from many CTAs; fp32 adds give a sum that depends on their order. Integer adds
do not, if every partial is first rounded to a fixed unit per row whose range no partial sum can
leave. The unit comes from a bound known before the walk; the looser the bound, the fewer of the
int32's bits carry the gradient. This measures both on SmolLM2-135M (docs/REAL_MODEL.md) reading
a real document, at our block-sparse selections, in float64 on the CPU:

* dQ, per query row i: |partial sums of dQ_i| <= B_i = scale (|dO_i| max_j |V_j| + |delta_i|) max|K|
  (|dS_ij| <= P_ij (|dP_ij| + |delta_i|), |dP_ij| <= |dO_i| |V_j|, a row's P sums to 1);
* dV and dK, per key j, for the parts of a cut query list: |dV_jc| <= n_j max|dO| and
  |dK_jc| <= scale n_j max_i (|dO_i| |V_j| + |delta_i|) max|Q|, with n_j the query rows reading j
  (P_ij <= 1 is all that is known before the walk).

For each it reports the bound's looseness (bound over the row's largest |gradient|) and the error
of the int32 sum against float64, beside an fp32 sum's (FA4's adds, any order) and bf16's
rounding of the result (what the kernels store). Two unit choices for dQ: 2^30 units per bound
(a cvt.rni per value, on the exponentials' pipe) and 2^22 (a float multiply-add with 1.5 * 2^23,
whose bits are the integer, on the FMA pipe). dK/dV convert once per part, so 2^30.

    python3 -m benchmarks.probes.fixed_point_bound --model /tmp/smollm2/hf [--tokens 4096] [--out JSON]
"""
from __future__ import annotations

import argparse
import json
import math
import os
import sys
import sysconfig

import torch

from megatron_sparsebalance.data.documents import package_documents
from megatron_sparsebalance.ops.layout import BlockLayout
from megatron_sparsebalance.ops.naive import token_mask_of_sequence
from megatron_sparsebalance.ops.router import block_scores, select_blocks

BLOCK = 128
FRACTION_BITS = {"int32 cvt (2^30 units)": 30, "int32 fma (2^22 units)": 22}


def real_document_ids(tokenizer, tokens: int) -> torch.Tensor:
    """``tokens`` ids of one real document: the standard library's `email` package's source."""
    docs = package_documents(sysconfig.get_paths()["stdlib"], "email", max_chars=10**9)
    ids = tokenizer(docs[0].text, return_tensors="pt").input_ids[0]
    if ids.numel() < tokens:
        raise SystemExit(f"the document has {ids.numel()} tokens, fewer than --tokens {tokens}")
    return ids[:tokens]


def capture_attention(model, ids: torch.Tensor) -> list[dict]:
    """Per layer: q ``[L, HQ, D]`` and k, v ``[L, G, D]`` after RoPE, and dO ``[L, HQ, D]``, the
    gradient of the next-token loss at the attention's output (the input of o_proj)."""
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    layers: list[dict] = [dict() for _ in model.model.layers]
    sdpa = ALL_ATTENTION_FUNCTIONS["sdpa"]

    def recording(module, query, key, value, *args, **kwargs):
        rec = layers[module.layer_idx]
        rec["q"], rec["k"], rec["v"] = (x[0].detach().transpose(0, 1).clone() for x in (query, key, value))
        return sdpa(module, query, key, value, *args, **kwargs)

    def grad_hook(idx):
        def pre(module, inputs):
            x = inputs[0]
            if x.requires_grad:
                x.register_hook(lambda g: layers[idx].__setitem__("do", g[0].detach().clone()))
        return pre

    ALL_ATTENTION_FUNCTIONS["probe_recording"] = recording
    model.config._attn_implementation = "probe_recording"
    handles = [layer.self_attn.o_proj.register_forward_pre_hook(grad_hook(i)) for i, layer in enumerate(model.model.layers)]
    try:
        out = model(ids[None], labels=ids[None])
        out.loss.backward()
    finally:
        for h in handles:
            h.remove()
    for rec in layers:
        L, HQ = rec["q"].shape[0], rec["q"].shape[1]
        rec["do"] = rec["do"].view(L, HQ, -1)
    return layers


def fixed_point_sum(partials: torch.Tensor, bound: torch.Tensor, bits: int) -> tuple[torch.Tensor, float]:
    """Sum of ``partials`` ``[P, ..., D]`` (float32) over dim 0 after rounding each to units of
    ``bound / 2^bits`` (``bound`` broadcast over D), exactly (int64), and the largest |partial sum|
    in units in the blocks' order (every order's stays under the bound, 2^(bits - 1) units)."""
    unit = (bound / 2.0**bits).unsqueeze(-1)
    q = torch.round(partials.double() / unit).to(torch.int64)
    if bits <= 22 and int(q.abs().max()) >= 2**22:
        raise AssertionError("a partial past the float multiply-add's exact range")
    prefix = q.cumsum(0)
    return prefix[-1].double() * unit, float(prefix.abs().max())


def live_rows(exact: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row's largest |exact| (the last dim the columns) and the rows to measure: those whose
    gradient does not vanish (a row that reads only its own key has dS = 0, and any error there is
    absolute, not relative)."""
    scale = exact.abs().amax(-1)
    return scale, scale > 1e-9 * scale.median()


def errors(approx: torch.Tensor, exact: torch.Tensor) -> dict:
    """Error over each row's largest |exact|, log2: the largest and the median over live rows."""
    scale, live = live_rows(exact)
    rel = ((approx - exact).abs().amax(-1)[live] / scale[live]).flatten()
    return {"max_log2": round(math.log2(float(rel.max()) + 1e-300), 2),
            "median_log2": round(math.log2(float(rel.median()) + 1e-300), 2)}


def looseness(bound: torch.Tensor, exact: torch.Tensor) -> dict:
    """log2 of bound over the row's largest |exact|: quantiles over live rows."""
    scale, live = live_rows(exact)
    r = torch.log2(bound[live] / scale[live]).flatten()
    return {q: round(float(torch.quantile(r, p)), 2) for q, p in (("p50", 0.5), ("p99", 0.99), ("max", 1.0))}


def probe_group(q, k, v, do, allowed, scale, bands: int) -> dict:
    """One KV group: q, do ``[R, L, D]``, k, v ``[L, D]``, allowed ``[L, L]`` bool, all float64."""
    R, L, D = q.shape
    s = torch.einsum("rid,jd->rij", q, k) * scale
    s = s.masked_fill(~allowed, float("-inf"))
    p = torch.softmax(s, -1)
    o = torch.einsum("rij,jd->rid", p, v)
    delta = (do * o).sum(-1)  # [R, L]
    dp = torch.einsum("rid,jd->rij", do, v)
    ds = p * (dp - delta[..., None])
    nb = (L + BLOCK - 1) // BLOCK
    # dQ partials per KV block, from bf16 dS and K multiplied in fp32 (the kernel's product).
    ds16, k16 = ds.to(torch.bfloat16).float(), k.to(torch.bfloat16).float()
    parts = torch.stack([torch.einsum("rij,jd->rid", ds16[..., b * BLOCK:(b + 1) * BLOCK], k16[b * BLOCK:(b + 1) * BLOCK])
                         for b in range(nb)]) * scale  # [nb, R, L, D] float32
    dq = torch.einsum("rij,jd->rid", ds, k) * scale
    b_dq = 2 * scale * (do.norm(dim=-1) * v.norm(dim=-1).max() + delta.abs()) * k.abs().max()  # [R, L]
    exact_prefix = torch.einsum("rij,jd->rid", ds.abs(), k.abs()).amax(-1) * scale  # sum of |terms|
    assert bool((exact_prefix <= b_dq / 2 * (1 + 1e-9)).all()), "the dQ bound fails"
    out = {"dq": {"looseness_log2": looseness(b_dq, dq)}}
    order = torch.randperm(nb, generator=torch.Generator().manual_seed(0))
    fp32 = torch.zeros_like(parts[0])  # fp32 adds in one order
    for b in order.tolist():
        fp32 = fp32 + parts[b]
    rows = lambda x: x.reshape(-1, D)  # noqa: E731
    # Each sum against the exact sum of the same partials (what a sum adds to the products' error),
    # beside the products' own error (bf16 operands) and bf16's rounding of the stored result.
    summed = parts.double().sum(0)
    out["dq"]["products_bf16"] = errors(rows(summed), rows(dq))
    out["dq"]["fp32_sum"] = errors(rows(fp32.double()), rows(summed))
    for name, bits in FRACTION_BITS.items():
        fx, peak = fixed_point_sum(parts, b_dq, bits)
        out["dq"][name] = errors(rows(fx), rows(summed)) | {"peak_units_log2": round(math.log2(peak + 1), 2)}
    out["dq"]["bf16_store"] = errors(rows(dq.to(torch.bfloat16).double()), rows(dq))

    # dK and dV of the group's keys: partials over `bands` bands of query rows (the parts of a cut list).
    n_j = allowed.sum(0).double() * R  # query rows (of all R heads) that read key j
    dv = torch.einsum("rij,rid->jd", p, do)
    dk = torch.einsum("rij,rid->jd", ds, q) * scale
    b_dv = 2 * n_j * do.abs().max()
    b_dk = 2 * scale * n_j * (do.norm(dim=-1).max() * v.norm(dim=-1) + delta.abs().max()) * q.abs().max()
    assert bool((torch.einsum("rij,rid->jd", p, do.abs()).amax(-1) <= b_dv / 2 * (1 + 1e-9)).all()), "dV bound"
    assert bool((torch.einsum("rij,rid->jd", ds.abs(), q.abs()).amax(-1) * scale <= b_dk / 2 * (1 + 1e-9)).all()), "dK bound"
    edges = [round(L * i / bands) for i in range(bands + 1)]
    p16, do16, q16 = p.to(torch.bfloat16).float(), do.to(torch.bfloat16).float(), q.to(torch.bfloat16).float()

    def per_band(scores, rows):  # [bands, L, D]: each band of query rows' share of scores^T rows
        return torch.stack([torch.einsum("rij,rid->jd", scores[:, a:b], rows[:, a:b]) for a, b in zip(edges, edges[1:])])

    dv_parts = per_band(p16, do16)
    dk_parts = per_band(ds16, q16) * scale
    live = n_j > 0
    for name, exact, parts_, bound in (("dv", dv, dv_parts, b_dv), ("dk", dk, dk_parts, b_dk)):
        fx, peak = fixed_point_sum(parts_[:, live], bound[live], 30)
        summed = parts_[:, live].double().sum(0)
        out[name] = {"looseness_log2": looseness(bound[live], exact[live]),
                     "products_bf16": errors(summed, exact[live]),
                     "fp32_sum": errors(parts_[:, live].sum(0).double(), summed),
                     "int32 cvt (2^30 units)": errors(fx, summed) | {"peak_units_log2": round(math.log2(peak + 1), 2)},
                     "bf16_store": errors(exact[live].to(torch.bfloat16).double(), exact[live])}
    return out


def summarize(cases: list[dict]) -> dict:
    """Per gradient and figure: the worst case's value (largest looseness or error) and the
    median case's."""
    out: dict = {}
    for grad in ("dq", "dv", "dk"):
        for name, fig in cases[0][grad].items():
            for key in fig:
                vals = sorted(c[grad][name][key] for c in cases)
                out.setdefault(grad, {}).setdefault(name, {})[key] = {"worst": vals[-1], "median_case": vals[len(vals) // 2]}
    return out


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", required=True, help="an HF directory (tools/get_model.py --hf-out)")
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--budgets", default="4,8,32", help="blocks per query block (32 = all at 4096 tokens)")
    ap.add_argument("--layers", default="0,7,14,21,29")
    ap.add_argument("--bands", type=int, default=8, help="parts of a cut query list, for dK/dV")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.manual_seed(0)
    tok = AutoTokenizer.from_pretrained(args.model)
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32)
    ids = real_document_ids(tok, args.tokens)
    layers = capture_attention(model, ids)
    cfg = model.config
    D = cfg.hidden_size // cfg.num_attention_heads
    G, R = cfg.num_key_value_heads, cfg.num_attention_heads // cfg.num_key_value_heads
    scale = 1.0 / math.sqrt(D)
    layout = BlockLayout.from_cu_seqlens(torch.tensor([0, args.tokens], dtype=torch.int32), BLOCK, args.tokens)
    result = {"model": os.path.basename(os.path.normpath(args.model)), "tokens": args.tokens, "block": BLOCK,
              "document": "stdlib email package source", "bands": args.bands, "cases": []}
    for li in (int(x) for x in args.layers.split(",")):
        rec = layers[li]
        q, k, v, do = (rec[n].double() for n in ("q", "k", "v", "do"))
        for budget in (int(x) for x in args.budgets.split(",")):
            route = select_blocks(block_scores(q.float(), k.float(), layout), layout, budget)
            allowed = token_mask_of_sequence(route, 0)  # [G, L, L]
            for g in range(G):
                hs = slice(g * R, (g + 1) * R)
                case = probe_group(q[:, hs].transpose(0, 1), k[:, g], v[:, g], do[:, hs].transpose(0, 1),
                                   allowed[g], scale, args.bands)
                result["cases"].append({"layer": li, "budget": budget, "group": g} | case)
                print(json.dumps(result["cases"][-1]), flush=True)
    result["summary"] = summarize(result["cases"])
    print(json.dumps(result["summary"], indent=1))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    sys.exit(main())
