"""Hugging Face <-> megatron-core checkpoint conversion (Qwen2/Qwen2.5, Llama).

``hf_config`` turns an HF config into a :class:`ModelShape` (and refuses what our model cannot
represent), ``mapping`` maps the tensors, ``hf_io`` reads and writes safetensors directories,
``converter`` runs whole conversions and the logit check. The CLI is ``tools/convert_checkpoint.py``.
"""
from megatron_sparsebalance.convert.converter import (Tolerance, VerificationError, VerifySettings, compare_logits,
                                                      convert_hf_to_mcore, convert_mcore_to_hf, load_converted)
from megatron_sparsebalance.convert.hf_config import (SUPPORTED_ARCHITECTURES, check_pipeline_layout, hf_model_info,
                                                      padded_vocab_size)
from megatron_sparsebalance.convert.mapping import hf_to_mcore, mcore_to_hf

__all__ = [
    "SUPPORTED_ARCHITECTURES", "Tolerance", "VerificationError", "VerifySettings", "check_pipeline_layout",
    "compare_logits", "convert_hf_to_mcore", "convert_mcore_to_hf", "hf_model_info", "hf_to_mcore", "load_converted",
    "mcore_to_hf", "padded_vocab_size",
]
