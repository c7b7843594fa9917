"""Convert Qwen2/Qwen2.5 and Llama checkpoints between Hugging Face and megatron-core.

  hf-to-mcore   HF model directory (config.json + safetensors) -> weights-only checkpoint
                <save>/iter_0000000 that ``pretrain --pretrained-checkpoint <save>`` (or --load)
                accepts at any pipeline layout dividing the layers.
  mcore-to-hf   checkpoint directory (converted or trained) -> HF model directory.

``--verify`` runs the source and the converted model on the same random tokens (megatron with
our sparse attention at a budget covering every block, i.e. dense) and fails with exit code 3
when the largest logit difference or the KL divergence is above tolerance. The conversion runs
on the CPU in one process and never touches the network.

Examples:
  python tools/convert_checkpoint.py hf-to-mcore --hf-dir Qwen2.5-0.5B --save ckpt/qwen0.5b --verify
  python tools/convert_checkpoint.py mcore-to-hf --load runs/long --hf-config Qwen2.5-0.5B \\
      --save Qwen2.5-0.5B-long --dtype bfloat16 --verify
"""
from __future__ import annotations

import argparse
import os
import sys
from typing import Optional, Sequence


def _add_verify_flags(p: argparse.ArgumentParser) -> None:
    from megatron_sparsebalance.convert.converter import Tolerance, VerifySettings

    d, t = VerifySettings(), Tolerance()
    g = p.add_argument_group("verification")
    g.add_argument("--verify", action="store_true", help="compare the logits of the source and the converted model")
    g.add_argument("--verify-seq-length", type=int, default=d.seq_length, help="tokens per sequence")
    g.add_argument("--verify-batch-size", type=int, default=d.batch_size, help="random sequences compared")
    g.add_argument("--verify-seed", type=int, default=d.seed, help="seed of the random tokens")
    g.add_argument("--verify-atol", type=float, default=t.atol, help="largest logit difference allowed ...")
    g.add_argument("--verify-rtol", type=float, default=t.rtol, help="... plus this times the largest |logit|")
    g.add_argument("--verify-max-kl", type=float, default=t.max_kl, help="largest mean KL(source || converted), nats")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)

    h = sub.add_parser("hf-to-mcore", help="Hugging Face directory -> megatron-core checkpoint")
    h.add_argument("--hf-dir", required=True, help="HF model directory (config.json + safetensors)")
    h.add_argument("--save", required=True, help="output checkpoint root (Megatron-LM layout)")
    h.add_argument("--make-vocab-size-divisible-by", type=int, default=128,
                   help="pad the embedding rows to a multiple of this x --target-tensor-model-parallel-size "
                        "(Megatron-LM's flag and rule)")
    h.add_argument("--target-tensor-model-parallel-size", type=int, default=1,
                   help="the TP the vocabulary is padded for, as a Megatron-LM run at that TP pads it; also "
                        "checks that this TP splits the heads, KV groups and FFN")
    h.add_argument("--target-pipeline-model-parallel-size", type=int, default=1,
                   help="check that this pipeline layout divides the layers (the checkpoint loads at any that does)")
    _add_verify_flags(h)

    m = sub.add_parser("mcore-to-hf", help="megatron-core checkpoint -> Hugging Face directory")
    m.add_argument("--load", required=True, help="checkpoint root (latest iteration) or one iter_* directory")
    m.add_argument("--save", required=True, help="output HF model directory")
    m.add_argument("--hf-config", default=None,
                   help="HF directory or config.json of the model (default: the config the converter recorded); "
                        "tokenizer files found beside it are copied")
    m.add_argument("--dtype", default="auto", choices=("auto", "float32", "bfloat16", "float16"),
                   help="dtype of the written weights (auto: the config's, else float32)")
    m.add_argument("--make-vocab-size-divisible-by", type=int, default=None,
                   help="vocab padding of the checkpoint (default: recorded, else 128)")
    m.add_argument("--max-shard-size-gb", type=float, default=5.0, help="split the safetensors above this size")
    _add_verify_flags(m)
    return parser


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = build_parser().parse_args(argv)
    from megatron_sparsebalance.convert.converter import (Tolerance, VerificationError, VerifySettings,
                                                          convert_hf_to_mcore, convert_mcore_to_hf, provenance)

    verify = None
    if args.verify:
        verify = VerifySettings(seq_length=args.verify_seq_length, batch_size=args.verify_batch_size,
                                seed=args.verify_seed,
                                tolerance=Tolerance(args.verify_atol, args.verify_rtol, args.verify_max_kl))
    record = provenance(args.command, vars(args))
    try:
        if args.command == "hf-to-mcore":
            convert_hf_to_mcore(args.hf_dir, args.save, args.make_vocab_size_divisible_by,
                                args.target_pipeline_model_parallel_size, verify, record,
                                target_tensor_parallel_size=args.target_tensor_model_parallel_size)
        else:
            convert_mcore_to_hf(args.load, args.save, args.hf_config, args.dtype, args.make_vocab_size_divisible_by,
                                verify, record, max_shard_bytes=int(args.max_shard_size_gb * 1024**3))
    except VerificationError as e:
        print(f"error: {e}", file=sys.stderr)
        return 3
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    # Before torch is imported: the conversion is CPU work by design, and hiding GPUs keeps it
    # identical on every machine and off an accelerator a training job may be using. Offline:
    # transformers reads local files only.
    os.environ["CUDA_VISIBLE_DEVICES"] = ""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    sys.exit(main())
