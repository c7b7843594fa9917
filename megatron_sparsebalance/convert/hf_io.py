"""Reading and writing a Hugging Face model directory: ``config.json`` plus safetensors
(one ``model.safetensors`` or shards listed in ``model.safetensors.index.json``)."""
from __future__ import annotations

import json
import os
import re
import shutil
from typing import Dict, Optional

import torch
from safetensors import safe_open
from safetensors.torch import save_file

SINGLE = "model.safetensors"
INDEX = "model.safetensors.index.json"
# Files of the tokenizer and generation settings that travel with the weights unchanged.
SIDE_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "vocab.json", "merges.txt",
              "tokenizer.model", "added_tokens.json", "generation_config.json")


def load_hf_config(path: str):
    """``transformers`` config of a model directory (or a config.json file); local files only."""
    from transformers import AutoConfig

    if os.path.isfile(path):
        path = os.path.dirname(path) or "."
    if not os.path.exists(os.path.join(path, "config.json")):
        raise ValueError(f"{path} has no config.json: not a Hugging Face model directory")
    try:
        return AutoConfig.from_pretrained(path, local_files_only=True)
    except (ValueError, TypeError, KeyError, OSError) as e:  # transformers' own validation errors vary in type
        raise ValueError(f"cannot read the config of {path}: {e}") from e
    except Exception as e:  # e.g. huggingface_hub's StrictDataclassClassValidationError
        raise ValueError(f"cannot read the config of {path}: {type(e).__name__}: {e}") from e


def load_hf_weights(model_dir: str) -> Dict[str, torch.Tensor]:
    """All tensors of a model directory, as stored (dtype unchanged)."""
    index = os.path.join(model_dir, INDEX)
    if os.path.exists(index):
        with open(index) as f:
            files = sorted(set(json.load(f)["weight_map"].values()))
    elif os.path.exists(os.path.join(model_dir, SINGLE)):
        files = [SINGLE]
    else:
        bins = [f for f in os.listdir(model_dir) if f.endswith(".bin")]
        hint = f" (found {bins}: re-save them as safetensors)" if bins else ""
        raise ValueError(f"{model_dir} has neither {SINGLE} nor {INDEX}{hint}")
    tensors: Dict[str, torch.Tensor] = {}
    for name in files:
        with safe_open(os.path.join(model_dir, name), framework="pt") as f:
            for key in f.keys():
                if key in tensors:
                    raise ValueError(f"tensor {key} appears in more than one shard of {model_dir}")
                tensors[key] = f.get_tensor(key)
    return tensors


def save_hf_weights(tensors: Dict[str, torch.Tensor], model_dir: str, metadata: Optional[dict] = None,
                    max_shard_bytes: int = 5 * 1024**3) -> list:
    """Write ``tensors`` as safetensors (sharded above ``max_shard_bytes``, with HF's index file).

    ``metadata`` (str -> str) is stored in every file's header beside ``format: pt``, which
    transformers requires. Returns the file names written.
    """
    os.makedirs(model_dir, exist_ok=True)
    meta = {"format": "pt", **(metadata or {})}
    shards, current, size = [], {}, 0
    for key in sorted(tensors):
        nbytes = tensors[key].numel() * tensors[key].element_size()
        if current and size + nbytes > max_shard_bytes:
            shards.append(current)
            current, size = {}, 0
        current[key] = tensors[key]
        size += nbytes
    shards.append(current)
    # A previous conversion into the same directory: its weight files would be read as ours.
    for stale in os.listdir(model_dir):
        if stale in (SINGLE, INDEX) or re.fullmatch(r"model-\d{5}-of-\d{5}\.safetensors", stale):
            os.remove(os.path.join(model_dir, stale))
    if len(shards) == 1:
        save_file(shards[0], os.path.join(model_dir, SINGLE), metadata=meta)
        return [SINGLE]
    names, weight_map = [], {}
    for i, shard in enumerate(shards):
        name = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        save_file(shard, os.path.join(model_dir, name), metadata=meta)
        names.append(name)
        weight_map.update({k: name for k in shard})
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    with open(os.path.join(model_dir, INDEX), "w") as f:
        json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f, indent=2)
    return names


def copy_side_files(src_dir: str, dst_dir: str) -> list:
    """Copy tokenizer and generation files so the output directory is a complete HF model."""
    copied = []
    for name in SIDE_FILES:
        src = os.path.join(src_dir, name)
        if os.path.isfile(src):
            shutil.copy2(src, os.path.join(dst_dir, name))
            copied.append(name)
    return copied
