"""The data sets a run reads samples from, and the packing of planned micro-batches.

Every data set here is a sequence of variable-length samples with their lengths known up front
(``.lengths``, already capped by ``--seq-length``), because SAB plans a global batch from lengths
alone, before any token is read. Three sources:

- :class:`MockDataset` (``--mock-data``): lengths from a named distribution
  (:mod:`.distributions`), content random tokens or the synthetic retrieval task;
- :class:`JsonlDataset` (``--data-path x.jsonl``): records with a ``text`` field or chat
  ``messages``, tokenized with a Hugging Face tokenizer from a local path (``--tokenizer-model``);
  for chats only assistant turns are loss targets;
- :class:`IndexedTokenDataset` (``--data-path prefix`` of Megatron's ``.bin``/``.idx``), read with
  megatron-core's ``IndexedDataset``; one sample per stored sequence.

A :class:`Sample` carries ``target_mask``: 1 on the tokens whose prediction counts.
:func:`pack_micro_batch` turns a planned micro-batch into the THD :class:`PackedBatch`.
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass
from typing import Optional, Sequence

import numpy as np
import torch

from megatron_sparsebalance.data.distributions import DISTRIBUTIONS, check_distribution, sample_lengths
from megatron_sparsebalance.data.synthetic import (
    RETRIEVAL_DEPTHS,
    PackedBatch,
    check_retrieval_capacity,
    pack_sequences,
    parse_retrieval_records,
    random_token_sample,
    retrieval_min_length,
    retrieval_sample,
)

OVERLONG_MODES = ("truncate", "error")
TOKENIZER_TYPES = ("NullTokenizer", "HuggingFaceTokenizer")
# Megatron-LM's other --tokenizer-type values, refused by name.
REFUSED_TOKENIZERS = ("BertWordPieceLowerCase", "BertWordPieceCase", "GPT2BPETokenizer", "SentencePieceTokenizer",
                      "GPTSentencePieceTokenizer", "Llama2Tokenizer", "TikTokenizer", "MultimodalTokenizer",
                      "NullMultimodalTokenizer", "SFTTokenizer")
# Mock token ids stay below this unless --mock-vocab-size says otherwise (and below the model's vocabulary).
MOCK_VOCAB_SIZE = 32000
MOCK_CONTENTS = ("random", "retrieval")
SPLITS = ("train", "validation")
# The validation split's seed: fixed, so that runs differing only in --seed are scored on the same
# samples. Its random streams are tagged apart from the training ones (see MockDataset), so no
# --seed makes the two splits share a stream.
VALIDATION_SEED = 20240611
# One token to read and one to predict: the shortest sample that has a loss target.
MIN_SAMPLE_LENGTH = 2


@dataclass
class Sample:
    tokens: torch.Tensor
    """``[n]`` int64 token ids."""
    target_mask: torch.Tensor
    """``[n]`` float: 1 where predicting this token counts in the loss (and in accuracy)."""


def check_overlong(mode: str) -> str:
    if mode not in OVERLONG_MODES:
        raise ValueError(f"--overlong-samples must be one of {OVERLONG_MODES}, got {mode!r}")
    return mode


def cap_length(length: int, seq_length: int, overlong: str, what: str) -> int:
    """``length`` capped by ``--seq-length``: truncated, or a ValueError under ``--overlong-samples error``."""
    if length <= seq_length:
        return length
    if overlong == "error":
        raise ValueError(
            f"{what} has {length} tokens, more than --seq-length {seq_length}; raise --seq-length "
            f"or pass --overlong-samples truncate")
    return seq_length


class TokenDataset(torch.utils.data.Dataset):
    """Samples with their capped lengths known before reading them."""

    lengths: np.ndarray
    eod_mask_id: Optional[int] = None
    """With ``--eod-mask-loss``: the end-of-document id whose positions are not loss targets."""

    def __len__(self) -> int:
        return len(self.lengths)

    def __getitem__(self, index: int) -> Sample:
        raise NotImplementedError


class MockDataset(TokenDataset):
    """``num_samples`` synthetic samples; sample ``i`` is a pure function of ``(seed, split, i)``.

    Each split draws its lengths and its samples from random streams of its own (``split``
    tags the generator keys), so a validation set has the training set's length distribution and
    content but none of its samples.
    """

    def __init__(self, num_samples: int, distribution: str, seq_length: int, content: str = "random",
                 vocab_size: int = 32000, seed: int = 1234, retrieval_depth: str = "early", split: str = "train",
                 retrieval_records="auto"):
        check_distribution(distribution)
        if content not in MOCK_CONTENTS:
            raise ValueError(f"--mock-content must be one of {MOCK_CONTENTS}, got {content!r}")
        if retrieval_depth not in RETRIEVAL_DEPTHS:
            raise ValueError(f"--mock-retrieval-depth must be one of {RETRIEVAL_DEPTHS}, got {retrieval_depth!r}")
        if split not in SPLITS:
            raise ValueError(f"split must be one of {SPLITS}, got {split!r}")
        if vocab_size < 2:
            raise ValueError(f"--mock-vocab-size must be >= 2, got {vocab_size}")
        self.retrieval_records = parse_retrieval_records(retrieval_records)
        if content == "retrieval":
            check_retrieval_capacity(seq_length, vocab_size, self.retrieval_records)
            # Even the shortest sample holds its records: the fixed count, or auto's one.
            min_length = retrieval_min_length(self.retrieval_records or 1)
        elif seq_length < MIN_SAMPLE_LENGTH:
            raise ValueError(f"--seq-length must be >= {MIN_SAMPLE_LENGTH} for --mock-content {content}, got {seq_length}")
        else:
            min_length = MIN_SAMPLE_LENGTH
        self.distribution, self.content, self.vocab_size, self.seed = distribution, content, vocab_size, seed
        self.retrieval_depth, self.split = retrieval_depth, split
        # Stream tags: 0 and 1 (lengths, samples) for training, as before splits existed, so
        # training data is unchanged; 2 and 3 for validation.
        self._stream = 2 * SPLITS.index(split)
        rng = np.random.default_rng([seed, self._stream])
        self.lengths = sample_lengths(distribution, num_samples, seq_length, rng, min_length)

    def __getitem__(self, index: int) -> Sample:
        # A generator per sample: any sample can be read alone, in any order, on any rank.
        rng = np.random.default_rng([self.seed, self._stream + 1, int(index)])
        length = int(self.lengths[index])
        if self.content == "retrieval":
            return Sample(*retrieval_sample(length, self.vocab_size, rng, self.retrieval_depth, self.retrieval_records))
        return Sample(*random_token_sample(length, self.vocab_size, rng))


class SplitDataset(TokenDataset):
    """Samples ``[start, stop)`` of a data set: one part of ``--split`` (Megatron-LM splits the
    documents of ``--data-path`` into contiguous train / validation / test ranges)."""

    def __init__(self, base: TokenDataset, start: int, stop: int):
        self.base, self.start = base, start
        self.lengths = base.lengths[start:stop]

    def __getitem__(self, index: int) -> Sample:
        if not 0 <= index < len(self.lengths):
            raise IndexError(index)
        return self.base[self.start + int(index)]


def parse_split(split: str) -> tuple[float, float, float]:
    """``--split`` as Megatron-LM reads it: ``969,30,1`` (or ``/``-separated; missing parts are 0)
    -> normalized train / validation / test fractions."""
    try:
        parts = [float(x) for x in split.replace("/", ",").split(",")]
    except ValueError:
        parts = []
    if not 1 <= len(parts) <= 3 or min(parts) < 0 or sum(parts) <= 0:
        raise ValueError(f"--split must be up to three non-negative weights (train,validation,test) like 969,30,1, "
                         f"got {split!r}")
    parts += [0.0] * (3 - len(parts))
    total = sum(parts)
    return tuple(p / total for p in parts)


def split_ranges(num_samples: int, split: str) -> list[tuple[int, int]]:
    """The contiguous ``[start, stop)`` of train, validation and test (Megatron-LM's rounding: each
    boundary is the rounded cumulative share, the last one the end)."""
    bounds = [0]
    for fraction in parse_split(split):
        bounds.append(bounds[-1] + int(round(fraction * num_samples)))
    shift = bounds[-1] - num_samples
    bounds = [b - shift if i else b for i, b in enumerate(bounds)]
    bounds = [max(0, b) for b in bounds]
    return [(bounds[i], bounds[i + 1]) for i in range(3)]


def load_tokenizer(path: str):
    """A Hugging Face tokenizer from a local directory (never the network)."""
    if not os.path.isdir(path):
        raise ValueError(f"--tokenizer-model must be a local directory with a Hugging Face tokenizer, got {path!r}")
    from transformers import AutoTokenizer  # heavy import, only for JSONL data

    return AutoTokenizer.from_pretrained(path, local_files_only=True)


def _render_chat(tokenizer, messages: list) -> str:
    if getattr(tokenizer, "chat_template", None):
        return tokenizer.apply_chat_template(messages, tokenize=False)
    # Without a template (a base model's tokenizer), a plain documented layout.
    return "".join(f"<|{m['role']}|>\n{m['content']}\n" for m in messages)


def tokenize_chat(tokenizer, messages: list, where: str) -> tuple[list[int], list[float]]:
    """Token ids and target mask of a conversation: 1 on assistant replies (with their end-of-turn).

    Each message's text is the difference between the rendering of the conversation up to it and
    up to the one before, so whatever the chat template adds (headers, end-of-turn markers, a
    default system prompt) lands in the right turn; inside an assistant turn the header before
    the reply is not a target.
    """
    if not isinstance(messages, list) or not messages:
        raise ValueError(f"{where}: 'messages' must be a non-empty list")
    ids: list[int] = []
    mask: list[float] = []
    rendered = ""
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or "role" not in m or "content" not in m:
            raise ValueError(f"{where}: message {i} needs 'role' and 'content'")
        upto = _render_chat(tokenizer, messages[: i + 1])
        if not upto.startswith(rendered):
            raise ValueError(f"{where}: the chat template does not render conversations prefix by prefix")
        piece, rendered = upto[len(rendered):], upto
        parts = [(piece, 0.0)]
        if m["role"] == "assistant":
            at = piece.find(m["content"]) if m["content"] else -1
            parts = [(piece[:at], 0.0), (piece[at:], 1.0)] if at >= 0 else [(piece, 1.0)]
        for text, target in parts:
            if text:
                part = tokenizer(text, add_special_tokens=False)["input_ids"]
                ids += part
                mask += [target] * len(part)
    return ids, mask


def tokenize_text(tokenizer, text: str) -> tuple[list[int], list[float]]:
    """Token ids of a plain document (with EOS where the tokenizer has one); every token is a target."""
    ids = list(tokenizer(text)["input_ids"])
    if tokenizer.eos_token_id is not None and (not ids or ids[-1] != tokenizer.eos_token_id):
        ids.append(tokenizer.eos_token_id)
    return ids, [1.0] * len(ids)


class JsonlDataset(TokenDataset):
    """One sample per JSONL record (``{"text": ...}`` or ``{"messages": [{"role", "content"}, ...]}``).

    Records are tokenized once, at construction (lengths are needed before planning), and kept as
    int32 arrays; for corpora that do not fit in memory convert them to ``.bin``/``.idx`` with
    :func:`write_indexed_dataset`. Records shorter than two tokens have nothing to predict and
    are skipped (their line numbers are in ``.skipped``).
    """

    def __init__(self, path: str, tokenizer, seq_length: int, overlong: str = "truncate"):
        check_overlong(overlong)
        if seq_length < MIN_SAMPLE_LENGTH:
            raise ValueError(f"--seq-length must be >= {MIN_SAMPLE_LENGTH}, got {seq_length}")
        if isinstance(tokenizer, str):
            tokenizer = load_tokenizer(tokenizer)
        self.tokens: list[np.ndarray] = []
        self.masks: list[np.ndarray] = []
        self.skipped: list[int] = []
        with open(path, encoding="utf-8") as f:
            for line_no, line in enumerate(f, 1):
                if not line.strip():
                    continue
                where = f"{path}:{line_no}"
                try:
                    record = json.loads(line)
                except json.JSONDecodeError as e:
                    raise ValueError(f"{where}: not valid JSON ({e})") from None
                if isinstance(record, dict) and "messages" in record:
                    ids, mask = tokenize_chat(tokenizer, record["messages"], where)
                elif isinstance(record, dict) and isinstance(record.get("text"), str):
                    ids, mask = tokenize_text(tokenizer, record["text"])
                else:
                    raise ValueError(f"{where}: a record needs a 'text' string or a 'messages' list")
                if len(ids) < MIN_SAMPLE_LENGTH:
                    self.skipped.append(line_no)
                    continue
                n = cap_length(len(ids), seq_length, overlong, where)
                self.tokens.append(np.asarray(ids[:n], dtype=np.int32))
                self.masks.append(np.asarray(mask[:n], dtype=np.float32))
        self.lengths = np.array([len(t) for t in self.tokens], dtype=np.int64)

    def __getitem__(self, index: int) -> Sample:
        return Sample(torch.from_numpy(self.tokens[index].astype(np.int64)), torch.from_numpy(self.masks[index].copy()))


class IndexedTokenDataset(TokenDataset):
    """Megatron's ``.bin``/``.idx`` (megatron-core's ``IndexedDataset``): one sample per sequence,
    every token a target (the format stores tokens only)."""

    def __init__(self, path_prefix: str, seq_length: int, overlong: str = "truncate"):
        from megatron.core.datasets.indexed_dataset import IndexedDataset

        check_overlong(overlong)
        if not IndexedDataset.exists(path_prefix):
            raise ValueError(f"--data-path {path_prefix!r}: no {path_prefix}.bin / {path_prefix}.idx found")
        self.data = IndexedDataset(path_prefix, mmap=True)
        stored = np.asarray(self.data.sequence_lengths, dtype=np.int64)
        if overlong == "error" and len(stored) and stored.max() > seq_length:
            i = int(stored.argmax())
            cap_length(int(stored[i]), seq_length, overlong, f"{path_prefix} sequence {i}")
        self.lengths = np.minimum(stored, seq_length)

    def __getitem__(self, index: int) -> Sample:
        n = int(self.lengths[index])
        tokens = torch.from_numpy(np.asarray(self.data.get(int(index), 0, n), dtype=np.int64))
        return Sample(tokens, torch.ones(n))


def write_indexed_dataset(path_prefix: str, sequences: Sequence, vocab_size: Optional[int] = None) -> None:
    """Write token sequences as Megatron's ``.bin``/``.idx`` (one document per sequence)."""
    from megatron.core.datasets.indexed_dataset import DType, IndexedDatasetBuilder

    dtype = DType.optimal_dtype(vocab_size)
    builder = IndexedDatasetBuilder(path_prefix + ".bin", dtype=dtype)
    for seq in sequences:
        builder.add_item(torch.as_tensor(np.asarray(seq)))
        builder.end_document()
    builder.finalize(path_prefix + ".idx")


@dataclass
class DataConfig:
    """The data flags (Megatron's names where Megatron has one)."""

    seq_length: int = 8192
    """Longest sample in tokens (Megatron's ``--seq-length``); longer samples follow ``--overlong-samples``."""

    overlong_samples: str = "truncate"
    """What to do with a sample longer than ``--seq-length``: truncate it, or stop with an error."""

    data_path: Optional[str] = None
    """A ``.jsonl`` file, or the prefix of Megatron's ``.bin``/``.idx`` (Megatron's ``--data-path``)."""

    tokenizer_model: Optional[str] = None
    """Local directory of a Hugging Face tokenizer, for JSONL data (Megatron's ``--tokenizer-model``)."""

    mock_data: bool = False
    """Synthetic samples instead of ``--data-path`` (Megatron's ``--mock-data``)."""

    mock_length_distribution: str = "longtail"
    """Length distribution of the mock samples: bimodal, longtail, uniform or fixed."""

    mock_content: str = "random"
    """Mock sample content: random tokens, or the retrieval task (key/value records planted in filler, a
    question for each later on; loss on the answers)."""

    mock_samples: int = 16384
    """Number of mock samples (one epoch)."""

    mock_vocab_size: Optional[int] = None
    """Token ids of mock samples are below this (default: the model's --vocab-size, at most 32000)."""

    mock_retrieval_depth: str = "early"
    """Where --mock-content retrieval plants the records and asks for them: early (plants in the first
    tenth, questions in the last: each question is most of a sample away) or uniform (each record
    planted and asked at two random points: distances from a few tokens to the length)."""

    mock_retrieval_records: str = "auto"
    """Records (and questions) per --mock-content retrieval sample: auto (one per 256 tokens of the
    sample, at least one) or a count N for every sample."""

    valid_data_path: Optional[str] = None
    """Validation data for --eval-interval when it is not mock data: a .jsonl file or a .bin/.idx
    prefix (Megatron's --valid-data-path). Mock runs draw a held-out mock split instead."""

    seed: int = 1234
    """Seed of the mock data, of the sample order, and of Python's, NumPy's and torch's generators
    (Megatron's ``--seed``)."""

    tokenizer_type: Optional[str] = None
    """NullTokenizer (pre-tokenized or mock data; ids below --vocab-size, the last one the end of a
    document) or HuggingFaceTokenizer (--tokenizer-model); default: HuggingFaceTokenizer when
    --tokenizer-model is given, else NullTokenizer."""

    split: Optional[str] = None
    """Train,validation,test weights of --data-path's samples, e.g. 969,30,1 (Megatron's ``--split``):
    contiguous ranges; evaluation reads the validation range when no --valid-data-path is given."""

    eod_mask_loss: bool = False
    """Do not count predictions made from an end-of-document token (Megatron's ``--eod-mask-loss``):
    the tokenizer's EOS with --tokenizer-model, else the last id of the vocabulary."""

    def mock_vocab(self) -> int:
        """Mock token ids are below this (resolved against the model by SparseBalanceConfig)."""
        return MOCK_VOCAB_SIZE if self.mock_vocab_size is None else self.mock_vocab_size

    def validate(self) -> "DataConfig":
        check_overlong(self.overlong_samples)
        if self.tokenizer_type in REFUSED_TOKENIZERS:
            raise ValueError(f"--tokenizer-type {self.tokenizer_type} is not built here: use HuggingFaceTokenizer with "
                             "--tokenizer-model (a local Hugging Face tokenizer directory, which GPT-2 BPE, "
                             "SentencePiece and tiktoken models have), or NullTokenizer with pre-tokenized data; "
                             "the Megatron-LM entry (python -m megatron_sparsebalance.megatron_lm) reads token files "
                             "under any of Megatron-LM's tokenizer types")
        if self.tokenizer_type is not None and self.tokenizer_type not in TOKENIZER_TYPES:
            raise ValueError(f"--tokenizer-type must be one of {', '.join(TOKENIZER_TYPES)}, got {self.tokenizer_type!r}")
        if self.tokenizer_type == "HuggingFaceTokenizer" and not self.tokenizer_model:
            raise ValueError("--tokenizer-type HuggingFaceTokenizer needs --tokenizer-model (a local tokenizer directory)")
        if self.tokenizer_type == "NullTokenizer" and self.tokenizer_model:
            raise ValueError("--tokenizer-type NullTokenizer reads no --tokenizer-model: give one or the other")
        if self.tokenizer_type == "NullTokenizer" and self.data_path and self.data_path.endswith(".jsonl") \
                and not self.mock_data:
            raise ValueError("--tokenizer-type NullTokenizer cannot tokenize .jsonl text: use HuggingFaceTokenizer "
                             "with --tokenizer-model, or pre-tokenized .bin/.idx data")
        if self.split is not None:
            parse_split(self.split)
        if self.mock_vocab_size is not None and self.mock_vocab_size < 2:
            raise ValueError(f"--mock-vocab-size must be >= 2, got {self.mock_vocab_size}")
        if self.seq_length < MIN_SAMPLE_LENGTH:
            raise ValueError(f"--seq-length must be >= {MIN_SAMPLE_LENGTH}, got {self.seq_length}")
        if self.mock_data:
            check_distribution(self.mock_length_distribution)
            if self.mock_content not in MOCK_CONTENTS:
                raise ValueError(f"--mock-content must be one of {MOCK_CONTENTS}, got {self.mock_content!r}")
            if self.mock_samples < 1:
                raise ValueError(f"--mock-samples must be >= 1, got {self.mock_samples}")
            if self.mock_retrieval_depth not in RETRIEVAL_DEPTHS:
                raise ValueError(f"--mock-retrieval-depth must be one of {RETRIEVAL_DEPTHS}, got {self.mock_retrieval_depth!r}")
            records = parse_retrieval_records(self.mock_retrieval_records)
            if self.mock_content == "retrieval":
                check_retrieval_capacity(self.seq_length, self.mock_vocab(), records)
        elif not self.data_path:
            raise ValueError("--data-path is required unless --mock-data is given")
        elif self.data_path.endswith(".jsonl") and not self.tokenizer_model:
            raise ValueError("--tokenizer-model (a local Hugging Face tokenizer directory) is required for .jsonl --data-path")
        return self


def build_dataset(cfg: DataConfig, vocab_size: Optional[int] = None, eod: Optional[int] = None) -> TokenDataset:
    """The training samples; ``vocab_size`` (the model's) gives the EOD id of ``--eod-mask-loss``
    without a tokenizer, and ``eod`` overrides both for token files (the Megatron-LM entry passes
    Megatron-LM's tokenizer's, whichever its --tokenizer-type)."""
    cfg.validate()
    if cfg.mock_data:
        dataset = MockDataset(cfg.mock_samples, cfg.mock_length_distribution, cfg.seq_length, cfg.mock_content,
                              cfg.mock_vocab(), cfg.seed, cfg.mock_retrieval_depth,
                              retrieval_records=cfg.mock_retrieval_records)
    else:
        dataset = _file_dataset(cfg.data_path, cfg)
        if cfg.split is not None:
            dataset = SplitDataset(dataset, *split_ranges(len(dataset), cfg.split)[0])
    return _with_eod_mask(dataset, cfg, vocab_size, eod)


def eod_id(cfg: DataConfig, vocab_size: Optional[int] = None) -> int:
    """The end-of-document id: the tokenizer's EOS, else the vocabulary's last id (NullTokenizer:
    Megatron-LM's puts EOD one above --vocab-size and pads; here --vocab-size counts it)."""
    if cfg.tokenizer_model and cfg.tokenizer_type != "NullTokenizer":
        eos = load_tokenizer(cfg.tokenizer_model).eos_token_id
        if eos is None:
            raise ValueError(f"--eod-mask-loss: the tokenizer of --tokenizer-model {cfg.tokenizer_model} has no EOS token")
        return int(eos)
    if cfg.mock_data:
        return cfg.mock_vocab() - 1
    if vocab_size is None:
        raise ValueError("--eod-mask-loss without a tokenizer needs the model's --vocab-size")
    return vocab_size - 1


def _with_eod_mask(dataset: TokenDataset, cfg: DataConfig, vocab_size: Optional[int],
                   eod: Optional[int] = None) -> TokenDataset:
    if cfg.eod_mask_loss:
        # Mock samples carry our own EOD (the last mock id), whoever tokenizes the real data.
        dataset.eod_mask_id = eod if eod is not None and not cfg.mock_data else eod_id(cfg, vocab_size)
    return dataset


def has_validation_data(cfg: DataConfig) -> bool:
    """Whether :func:`build_validation_dataset` has samples to draw: a --valid-data-path, mock
    data, or a --split of --data-path whose validation share is not zero."""
    return bool(cfg.valid_data_path or cfg.mock_data
                or (cfg.data_path and cfg.split is not None and parse_split(cfg.split)[1] > 0))


def _file_dataset(path: str, cfg: DataConfig) -> TokenDataset:
    if path.endswith(".jsonl"):
        return JsonlDataset(path, cfg.tokenizer_model, cfg.seq_length, cfg.overlong_samples)
    return IndexedTokenDataset(path, cfg.seq_length, cfg.overlong_samples)


def build_validation_dataset(cfg: DataConfig, num_samples: int, vocab_size: Optional[int] = None,
                             eod: Optional[int] = None) -> TokenDataset:
    """The held-out samples of evaluation: ``--valid-data-path``, else the validation range of
    ``--split`` of ``--data-path``, else (mock data) ``num_samples`` of the mock validation split,
    drawn like the training samples but from their own streams and seed (``VALIDATION_SEED``), so
    they never repeat a training sample whatever ``--seed`` is."""
    cfg.validate()
    if cfg.valid_data_path:
        return _with_eod_mask(_file_dataset(cfg.valid_data_path, cfg), cfg, vocab_size, eod)
    if not cfg.mock_data and cfg.data_path and cfg.split is not None:
        full = _file_dataset(cfg.data_path, cfg)
        return _with_eod_mask(SplitDataset(full, *split_ranges(len(full), cfg.split)[1]), cfg, vocab_size, eod)
    if not cfg.mock_data:
        raise ValueError("evaluation needs validation data: --split with --data-path, --valid-data-path, or --mock-data")
    return _with_eod_mask(MockDataset(num_samples, cfg.mock_length_distribution, cfg.seq_length, cfg.mock_content,
                                      cfg.mock_vocab(), VALIDATION_SEED, cfg.mock_retrieval_depth, split="validation",
                                      retrieval_records=cfg.mock_retrieval_records), cfg, vocab_size)


def pack_micro_batch(dataset: TokenDataset, indices: Sequence[int]) -> PackedBatch:
    """The THD micro-batch of the given samples, in the given order."""
    if not len(indices):
        raise ValueError("a micro-batch needs at least one sample")
    samples = [dataset[int(i)] for i in indices]
    masks = [s.target_mask for s in samples]
    if dataset.eod_mask_id is not None:
        # pack_sequences shifts the mask onto the position that predicts the token: masking the
        # token after an EOD removes the prediction made from the EOD, as Megatron-LM's
        # loss_mask[tokens == eod] = 0 does.
        masks = [_after_eod_masked(s.tokens, m, dataset.eod_mask_id) for s, m in zip(samples, masks)]
    return pack_sequences([s.tokens for s in samples], masks)


def _after_eod_masked(tokens: torch.Tensor, mask: torch.Tensor, eod: int) -> torch.Tensor:
    mask = mask.clone()
    mask[1:][tokens[:-1] == eod] = 0.0
    return mask


__all__ = [
    "DISTRIBUTIONS", "MOCK_CONTENTS", "OVERLONG_MODES", "DataConfig", "IndexedTokenDataset", "JsonlDataset",
    "MockDataset", "Sample", "SplitDataset", "TokenDataset", "VALIDATION_SEED", "build_dataset",
    "build_validation_dataset", "eod_id", "parse_split", "split_ranges",
    "load_tokenizer", "pack_micro_batch",
    "write_indexed_dataset",
]
