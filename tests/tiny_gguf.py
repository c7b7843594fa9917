"""A tiny Llama model written as a GGUF file with the ``gguf`` package's writer (for the CPU tests).

Shaped like SmolLM2 (tied embeddings, GQA, byte-level BPE vocabulary with control tokens), but
2 layers of width 64. The tensors are F32 and the Q/K rows carry llama.cpp's rotary permutation,
as real GGUF files do, so transformers' loader must undo it to give back the model we started from.
"""
from __future__ import annotations

import numpy as np
import torch

SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
# Byte-level merges (GPT-2 spelling: "Ġ" is a leading space), enough to make words of a few tokens.
MERGES = ("Ġ t", "h e", "Ġt he", "i n", "d e", "de f", "r e", "Ġ a", "o n", "Ġ re", "Ġre t", "u r", "Ġret ur",
          "Ġretur n", "s e", "l f", "se lf", "i m", "im p", "imp o", "r t", "impo rt")
SHAPE = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
             rope_theta=100000.0, rms_norm_eps=1e-5, max_position_embeddings=2048)


def _byte_alphabet() -> list[str]:
    """GPT-2's printable spelling of the 256 bytes (the vocabulary byte-level BPE starts from)."""
    keep = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    chars, extra = {}, 0
    for b in range(256):
        if b in keep:
            chars[b] = chr(b)
        else:
            chars[b] = chr(256 + extra)
            extra += 1
    return [chars[b] for b in range(256)]


def vocabulary() -> list[str]:
    return list(SPECIAL_TOKENS) + _byte_alphabet() + [m.replace(" ", "") for m in MERGES]


def _llama_cpp_permute(w: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's row order for Q/K (rotary halves interleaved per head); transformers undoes it."""
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def random_llama(seed: int = 0):
    """The HF model the GGUF file holds (random weights; norm gains around 1)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=len(vocabulary()), tie_word_embeddings=True, bos_token_id=1, eos_token_id=2,
                         **SHAPE)
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(1 + 0.1 * torch.randn_like(p) if name.endswith("norm.weight") else 0.1 * torch.randn_like(p))
    return model.eval()


def write_tiny_llama_gguf(path: str, seed: int = 0, dtype: str = "F32"):
    """Write the model of :func:`random_llama` to ``path``; returns that HF model."""
    import gguf

    model = random_llama(seed)
    c = model.config
    sd = {k: v.detach().numpy() for k, v in model.state_dict().items()}
    np_dtype = {"F32": np.float32, "F16": np.float16}[dtype]
    w = gguf.GGUFWriter(path, "llama")
    w.add_name("tiny-llama-test")
    w.add_context_length(c.max_position_embeddings)
    w.add_embedding_length(c.hidden_size)
    w.add_block_count(c.num_hidden_layers)
    w.add_feed_forward_length(c.intermediate_size)
    w.add_head_count(c.num_attention_heads)
    w.add_head_count_kv(c.num_key_value_heads)
    w.add_rope_dimension_count(c.hidden_size // c.num_attention_heads)
    w.add_rope_freq_base(SHAPE["rope_theta"])
    w.add_layer_norm_rms_eps(c.rms_norm_eps)
    w.add_file_type(gguf.LlamaFileType.ALL_F32 if dtype == "F32" else gguf.LlamaFileType.MOSTLY_F16)
    tokens = vocabulary()
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("smollm")
    w.add_token_list(tokens)
    w.add_token_types([gguf.TokenType.CONTROL if t in SPECIAL_TOKENS else gguf.TokenType.NORMAL for t in tokens])
    w.add_token_merges(list(MERGES))
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_unk_token_id(0)
    w.add_pad_token_id(2)
    names = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight"}
    per_layer = {"self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
                 "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
                 "mlp.down_proj": "ffn_down", "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm"}
    for i in range(c.num_hidden_layers):
        for hf, gg in per_layer.items():
            names[f"model.layers.{i}.{hf}.weight"] = f"blk.{i}.{gg}.weight"
    for hf, gg in names.items():
        t = sd[hf]
        if ".attn_q." in gg:
            t = _llama_cpp_permute(t, c.num_attention_heads)
        elif ".attn_k." in gg:
            t = _llama_cpp_permute(t, c.num_key_value_heads)
        # Norm gains stay F32 in llama.cpp's files whatever the file type.
        w.add_tensor(gg, np.ascontiguousarray(t.astype(np.float32 if t.ndim == 1 else np_dtype)))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return model


def tiny_hf_dir(workdir: str, seed: int = 0) -> str:
    """The tiny GGUF written under ``workdir`` and turned into an HF directory (model + tokenizer)
    by the same code as ``tools/get_model.py --gguf``; returns the directory."""
    import os

    from megatron_sparsebalance.convert.gguf_source import gguf_to_hf

    path = os.path.join(workdir, "tiny.gguf")
    write_tiny_llama_gguf(path, seed)
    out = os.path.join(workdir, "hf")
    gguf_to_hf(path, out, log=lambda *_: None)
    return out
