"""Tensor mapping between Hugging Face Qwen2/Llama state dicts and megatron-core's GPT model.

Both families share one layout; Llama is Qwen2 without QKV bias. Names (HF -> megatron, layer i):

    model.embed_tokens.weight                       embedding.word_embeddings.weight (rows padded)
    model.layers.i.input_layernorm.weight           decoder.layers.i.input_layernorm.weight
    model.layers.i.self_attn.{q,k,v}_proj.{w,b}     decoder.layers.i.self_attention.linear_qkv.{w,b}
    model.layers.i.self_attn.o_proj.weight          decoder.layers.i.self_attention.linear_proj.weight
    model.layers.i.post_attention_layernorm.weight  decoder.layers.i.pre_mlp_layernorm.weight
    model.layers.i.mlp.{gate,up}_proj.weight        decoder.layers.i.mlp.linear_fc1.weight (cat gate, up)
    model.layers.i.mlp.down_proj.weight             decoder.layers.i.mlp.linear_fc2.weight
    model.norm.weight                               decoder.final_layernorm.weight
    lm_head.weight (untied only)                    output_layer.weight (rows padded)

``linear_qkv`` is grouped per KV group (its query heads, then its key, then its value head): that
is how megatron's attention splits the fused projection. A plain [Q; K; V] concatenation has the
right shape, runs, and gives wrong logits, which is why the converter's ``--verify`` exists.
Shape legend: H hidden, ng KV groups, nq query heads, d head dim, V vocab, F ffn hidden.
"""
from __future__ import annotations

from typing import Dict

import torch

from megatron_sparsebalance.convert.hf_config import HFModelInfo

# Buffers some older HF checkpoints saved; recomputed from the config on both sides.
_IGNORED_HF_SUFFIXES = ("rotary_emb.inv_freq",)


def expected_hf_shapes(info: HFModelInfo) -> Dict[str, tuple]:
    """Every tensor an HF checkpoint of this config holds, with its shape (tied: no lm_head)."""
    s = info.shape
    H, F, d = s.hidden_size, s.ffn_hidden_size, s.kv_channels
    q, kv = s.num_attention_heads * d, s.num_query_groups * d
    shapes = {"model.embed_tokens.weight": (info.hf_vocab_size, H), "model.norm.weight": (H,)}
    if not info.tie_word_embeddings:
        shapes["lm_head.weight"] = (info.hf_vocab_size, H)
    for i in range(s.num_layers):
        p = f"model.layers.{i}."
        shapes.update({
            p + "input_layernorm.weight": (H,),
            p + "self_attn.q_proj.weight": (q, H),
            p + "self_attn.k_proj.weight": (kv, H),
            p + "self_attn.v_proj.weight": (kv, H),
            p + "self_attn.o_proj.weight": (H, q),
            p + "post_attention_layernorm.weight": (H,),
            p + "mlp.gate_proj.weight": (F, H),
            p + "mlp.up_proj.weight": (F, H),
            p + "mlp.down_proj.weight": (H, F),
        })
        if s.add_qkv_bias:
            shapes.update({p + "self_attn.q_proj.bias": (q,), p + "self_attn.k_proj.bias": (kv,),
                           p + "self_attn.v_proj.bias": (kv,)})
    return shapes


def _config_words(info: HFModelInfo) -> str:
    s = info.shape
    return (f"vocab_size {info.hf_vocab_size}, hidden_size {s.hidden_size}, intermediate_size {s.ffn_hidden_size}, "
            f"num_hidden_layers {s.num_layers}, num_attention_heads {s.num_attention_heads}, "
            f"num_key_value_heads {s.num_query_groups}, head_dim {s.kv_channels}")


def check_hf_state(hf: Dict[str, torch.Tensor], info: HFModelInfo) -> Dict[str, torch.Tensor]:
    """The HF tensors the mapping uses, after checking them against the config.

    Raises a ValueError naming the tensor (and both shapes) for any missing, unexpected or
    mis-shaped tensor; a tied model may carry an ``lm_head.weight`` only if it equals the embedding.
    """
    expected = expected_hf_shapes(info)
    hf = {k: v for k, v in hf.items() if not k.endswith(_IGNORED_HF_SUFFIXES)}
    if info.tie_word_embeddings and "lm_head.weight" in hf:
        if not torch.equal(hf["lm_head.weight"], hf.get("model.embed_tokens.weight", torch.empty(0))):
            raise ValueError("config says tie_word_embeddings=True but lm_head.weight differs from model.embed_tokens.weight")
        hf = {k: v for k, v in hf.items() if k != "lm_head.weight"}
    missing = sorted(set(expected) - set(hf))
    unexpected = sorted(set(hf) - set(expected))
    if missing or unexpected:
        raise ValueError(
            f"weights do not match the config ({_config_words(info)}): "
            f"missing tensors {missing[:6]}{' ...' if len(missing) > 6 else ''}, "
            f"unexpected tensors {unexpected[:6]}{' ...' if len(unexpected) > 6 else ''}"
        )
    for name, want in expected.items():
        if tuple(hf[name].shape) != want:
            raise ValueError(
                f"tensor {name} has shape {tuple(hf[name].shape)} in the weights but the config "
                f"({_config_words(info)}) implies {want}"
            )
    return hf


def _pad_rows(t: torch.Tensor, rows: int) -> torch.Tensor:
    # Zero rows for the padding tokens, as Megatron-LM: no real token id ever indexes them.
    if t.shape[0] == rows:
        return t
    return torch.cat([t, t.new_zeros(rows - t.shape[0], *t.shape[1:])], 0)


def _group_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, ng: int) -> torch.Tensor:
    """[nq*d, ...], [ng*d, ...], [ng*d, ...] -> [ng * (nq/ng + 2) * d, ...], grouped per KV group."""
    rest = q.shape[1:]
    return torch.cat([q.reshape(ng, -1, *rest), k.reshape(ng, -1, *rest), v.reshape(ng, -1, *rest)], 1).reshape(-1, *rest)


def _ungroup_qkv(qkv: torch.Tensor, ng: int, nq: int, d: int):
    rest = qkv.shape[1:]
    per_group = qkv.reshape(ng, (nq // ng + 2) * d, *rest)
    q, k, v = torch.split(per_group, [nq // ng * d, d, d], dim=1)
    return q.reshape(-1, *rest), k.reshape(-1, *rest), v.reshape(-1, *rest)


def hf_to_mcore(hf: Dict[str, torch.Tensor], info: HFModelInfo) -> Dict[str, torch.Tensor]:
    """HF state dict -> megatron parameter dict (full model, TP = PP = 1 names)."""
    hf = check_hf_state(hf, info)
    s = info.shape
    ng = s.num_query_groups
    out = {
        "embedding.word_embeddings.weight": _pad_rows(hf["model.embed_tokens.weight"], s.vocab_size),
        "decoder.final_layernorm.weight": hf["model.norm.weight"],
    }
    if not info.tie_word_embeddings:
        out["output_layer.weight"] = _pad_rows(hf["lm_head.weight"], s.vocab_size)
    for i in range(s.num_layers):
        h, m = f"model.layers.{i}.", f"decoder.layers.{i}."
        out[m + "input_layernorm.weight"] = hf[h + "input_layernorm.weight"]
        out[m + "self_attention.linear_qkv.weight"] = _group_qkv(
            hf[h + "self_attn.q_proj.weight"], hf[h + "self_attn.k_proj.weight"], hf[h + "self_attn.v_proj.weight"], ng)
        if s.add_qkv_bias:
            out[m + "self_attention.linear_qkv.bias"] = _group_qkv(
                hf[h + "self_attn.q_proj.bias"], hf[h + "self_attn.k_proj.bias"], hf[h + "self_attn.v_proj.bias"], ng)
        out[m + "self_attention.linear_proj.weight"] = hf[h + "self_attn.o_proj.weight"]
        out[m + "pre_mlp_layernorm.weight"] = hf[h + "post_attention_layernorm.weight"]
        out[m + "mlp.linear_fc1.weight"] = torch.cat([hf[h + "mlp.gate_proj.weight"], hf[h + "mlp.up_proj.weight"]], 0)
        out[m + "mlp.linear_fc2.weight"] = hf[h + "mlp.down_proj.weight"]
    return out


def mcore_to_hf(mc: Dict[str, torch.Tensor], info: HFModelInfo) -> Dict[str, torch.Tensor]:
    """Megatron parameter dict (full model) -> HF state dict; drops the vocab padding rows."""
    s = info.shape
    nq, ng, d, V = s.num_attention_heads, s.num_query_groups, s.kv_channels, info.hf_vocab_size
    out = {
        "model.embed_tokens.weight": mc["embedding.word_embeddings.weight"][:V],
        "model.norm.weight": mc["decoder.final_layernorm.weight"],
    }
    if not info.tie_word_embeddings:
        out["lm_head.weight"] = mc["output_layer.weight"][:V]
    for i in range(s.num_layers):
        h, m = f"model.layers.{i}.", f"decoder.layers.{i}."
        out[h + "input_layernorm.weight"] = mc[m + "input_layernorm.weight"]
        q, k, v = _ungroup_qkv(mc[m + "self_attention.linear_qkv.weight"], ng, nq, d)
        out.update({h + "self_attn.q_proj.weight": q, h + "self_attn.k_proj.weight": k, h + "self_attn.v_proj.weight": v})
        if s.add_qkv_bias:
            q, k, v = _ungroup_qkv(mc[m + "self_attention.linear_qkv.bias"], ng, nq, d)
            out.update({h + "self_attn.q_proj.bias": q, h + "self_attn.k_proj.bias": k, h + "self_attn.v_proj.bias": v})
        out[h + "self_attn.o_proj.weight"] = mc[m + "self_attention.linear_proj.weight"]
        out[h + "post_attention_layernorm.weight"] = mc[m + "pre_mlp_layernorm.weight"]
        gate, up = torch.chunk(mc[m + "mlp.linear_fc1.weight"], 2, dim=0)
        out[h + "mlp.gate_proj.weight"], out[h + "mlp.up_proj.weight"] = gate, up
        out[h + "mlp.down_proj.weight"] = mc[m + "mlp.linear_fc2.weight"]
    # Views of the fused tensors: make each its own storage, as safetensors requires.
    return {k: v.contiguous().clone() for k, v in out.items()}
