"""Synthetic packed micro-batches whose loss needs attention far back: the copy task, and the
mock data's sample contents (random tokens, the retrieval task).

Each copy-task sequence is ``prefix + prefix`` with random tokens, so the second half is
predictable only by attending to the block holding the same token one half-length earlier. A
block-sparse router that picks the right blocks learns it; that makes it a small end-to-end check
that the sparse attention trains. The retrieval task (``--mock-content retrieval``, described
at :func:`retrieval_sample`) asks the same of a model trained on it, question by question.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple, Optional

import numpy as np
import torch
from megatron.core.packed_seq_params import PackedSeqParams


def thd_params(cu_seqlens: torch.Tensor, host_cu_seqlens: torch.Tensor) -> PackedSeqParams:
    """megatron-core's THD parameters of a pack, with its sequence offsets on the device and the host.

    Megatron's unfused RoPE for THD reads the sequence lengths with ``.tolist()`` in every
    attention layer, from ``cu_seqlens_q_padded`` when it is set. With no padding the padded
    offsets equal the real ones, so handing their host copy there makes RoPE stop the host zero
    times instead of four per layer (q and k, lengths and a size check). The core attention keeps
    the device tensor (``cu_seqlens_q``) and takes the host copy for its block layout. On CUDA the
    models built here run megatron's fused-RoPE hook with our Triton kernels
    (``ops/triton_rope.py``), which take the host offsets too: they send the pack's positions to
    the device once per micro-batch, without waiting.
    """
    lengths = (host_cu_seqlens[1:] - host_cu_seqlens[:-1]).tolist()
    return PackedSeqParams(
        qkv_format="thd", cu_seqlens_q=cu_seqlens, cu_seqlens_kv=cu_seqlens,
        cu_seqlens_q_padded=host_cu_seqlens, cu_seqlens_kv_padded=host_cu_seqlens,
        max_seqlen_q=max(lengths), max_seqlen_kv=max(lengths),
    )


@dataclass
class PackedBatch:
    """One THD micro-batch: tokens ``[1, T]``, labels ``[1, T]``, loss mask ``[1, T]``.

    ``host_cu_seqlens`` is a copy of ``cu_seqlens`` kept on the host when the batch moves to a
    GPU: the sequence lengths are then known without asking the device (see
    :meth:`packed_seq_params`).
    """

    tokens: torch.Tensor
    labels: torch.Tensor
    loss_mask: torch.Tensor
    position_ids: torch.Tensor
    cu_seqlens: torch.Tensor
    host_cu_seqlens: Optional[torch.Tensor] = None

    def _host_offsets(self) -> torch.Tensor:
        if self.cu_seqlens.device.type == "cpu":
            return self.cu_seqlens
        if self.host_cu_seqlens is None:
            self.host_cu_seqlens = self.cu_seqlens.cpu()  # one wait, then cached
        return self.host_cu_seqlens

    @property
    def lengths(self) -> list[int]:
        cu = self._host_offsets()
        return (cu[1:] - cu[:-1]).tolist()

    def packed_seq_params(self) -> PackedSeqParams:
        return thd_params(self.cu_seqlens, self._host_offsets())

    def to(self, device) -> "PackedBatch":
        tensors = (self.tokens, self.labels, self.loss_mask, self.position_ids, self.cu_seqlens)
        # Through pinned memory and non_blocking: a copy from pageable memory makes the host wait
        # for the device's whole queue, once per tensor of every micro-batch. The caching host
        # allocator keeps each pinned buffer alive until its copy has run.
        to_gpu = torch.device(device).type == "cuda"
        moved = [t.pin_memory().to(device, non_blocking=True) if to_gpu and t.device.type == "cpu" else t.to(device)
                 for t in tensors]
        return PackedBatch(*moved, host_cu_seqlens=self._host_offsets())


def pack_sequences(sequences: list[torch.Tensor], loss_masks: list[torch.Tensor]) -> PackedBatch:
    """Concatenate whole sequences (next-token labels inside each sequence) into one pack."""
    lengths = [len(s) for s in sequences]
    tokens = torch.cat(sequences)
    labels = torch.cat([torch.cat([s[1:], s[-1:]]) for s in sequences])
    # The last token of each sequence has no next token: it is never a loss position.
    mask = torch.cat([torch.cat([m[1:], m.new_zeros(1)]) for m in loss_masks]).float()
    cu = torch.zeros(len(lengths) + 1, dtype=torch.int32)
    cu[1:] = torch.cumsum(torch.tensor(lengths), 0)
    pos = torch.cat([torch.arange(n) for n in lengths])
    return PackedBatch(tokens[None], labels[None], mask[None], pos[None], cu)


def copy_task_batch(lengths: list[int], vocab_size: int, generator: torch.Generator) -> PackedBatch:
    """Sequences of the given (even) lengths, each a random half repeated; loss on the second half."""
    seqs, masks = [], []
    for n in lengths:
        half = torch.randint(1, vocab_size, (n // 2,), generator=generator)
        seqs.append(torch.cat([half, half, half[: n % 2]]))
        m = torch.zeros(n)
        m[n // 2 :] = 1.0
        masks.append(m)
    return pack_sequences(seqs, masks)


def random_token_sample(length: int, vocab_size: int, rng) -> tuple[torch.Tensor, torch.Tensor]:
    """Uniform random tokens in ``[1, vocab_size)``; every token is a loss target."""
    tokens = torch.from_numpy(rng.integers(1, vocab_size, length, dtype="int64"))
    return tokens, torch.ones(length)


# ---- the retrieval task (``--mock-content retrieval``) ---------------------------------------
#
# Many key/value records planted in filler, and later a question for every record:
#
#     filler .. KEY k v1 v2 .. filler .. KEY k' v1' v2' .. QUERY k v1 v2 .. filler .. QUERY k' v1' v2' ..
#
# The loss (the target mask) is on the value tokens of the questions only. Why this form:
#
# - *Many questions per sample.* One question gave 4 loss tokens per sample, too little signal
#   for a model trained from scratch to leave chance in a benchmark-sized run; one record per
#   RETRIEVAL_TOKENS_PER_RECORD tokens gives a 6.6K-token sample ~25 questions.
# - *Disjoint id ranges.* Markers, filler, keys and values never share an id, so a key occurs
#   exactly twice in a sample (its plant and its question) and the value after a question's key is
#   predictable only by finding that key's plant: nothing else in the sample, its position
#   included, says anything about it. The filler range is small, so the filler of every
#   attention block pools to about the same vector and the blocks differ by their records, which
#   is what a block router has to see.
# - *One-token keys, no marker between key and value.* ``QUERY k`` then predicts ``v1`` exactly as
#   an induction head does (find the earlier ``k``, copy the token after it), the mechanism small
#   transformers learn first; a marker in between would need a two-tokens-back lookup instead.
# - *Where the plants and questions go* (``--mock-retrieval-depth``): ``uniform`` puts each
#   record's plant and question at two random points of the sample, the plant first, so distances
#   run from a few tokens to the whole length, many of them short: the lookup can be learned
#   where attention is not yet spread over thousands of tokens, and the same heads then serve the
#   long distances. ``early`` plants every record in the first tenth and asks in the last tenth,
#   in another order: every question is about a whole sample away (the hardest case for a sparse
#   budget, and with no short distances to learn from). Either way plants and questions are spread out,
#   not packed, so an attention block holds a few of them: a block-sparse query block reaches
#   only ``--moba-topk`` blocks, and the task should measure whether the router finds the right
#   ones, not how many a budget can hold.

KEY_MARK, QUERY_MARK = 1, 2
# Ids below this are markers (0 is left unused, as the padding id of most tokenizers).
RETRIEVAL_RESERVED = 3
RETRIEVAL_KEY_TOKENS = 1
RETRIEVAL_VALUE_TOKENS = 2
RETRIEVAL_RECORD_TOKENS = 1 + RETRIEVAL_KEY_TOKENS + RETRIEVAL_VALUE_TOKENS
"""A plant (``KEY k v1 v2``) and a question (``QUERY k v1 v2``) are both this long."""
RETRIEVAL_FILLER_IDS = 16
RETRIEVAL_TOKENS_PER_RECORD = 256
"""``--mock-retrieval-records auto``: one record per this many tokens of a sample (at least one)."""
RETRIEVAL_EARLY_SPAN = 0.1
"""``--mock-retrieval-depth early``: plants in this first fraction of a sample, questions in the last."""
RETRIEVAL_DEPTHS = ("early", "uniform")


def retrieval_min_length(records: int) -> int:
    """Shortest sample that holds ``records`` plants and their questions, with some filler between."""
    return 2 * records * RETRIEVAL_RECORD_TOKENS + 4


@dataclass(frozen=True)
class RetrievalVocab:
    """The disjoint id ranges of the retrieval task in a vocabulary (markers below ``filler``)."""

    filler: range
    keys: range
    values: range


def retrieval_vocab(vocab_size: int) -> RetrievalVocab:
    """Split ``[RETRIEVAL_RESERVED, vocab_size)``: a small filler range, then keys and values in halves.

    Keys and values get the most ids: distinct keys bound the records of a sample, and the value
    range sets chance (``1 / len(values)`` per answer token).
    """
    usable = vocab_size - RETRIEVAL_RESERVED
    if usable < 3:
        raise ValueError(f"--mock-vocab-size must be >= {RETRIEVAL_RESERVED + 3} for --mock-content retrieval "
                         f"(markers, filler, keys and values need ids of their own), got {vocab_size}")
    filler = max(1, min(RETRIEVAL_FILLER_IDS, usable // 4))
    keys = (usable - filler) // 2
    key_start = RETRIEVAL_RESERVED + filler
    return RetrievalVocab(range(RETRIEVAL_RESERVED, key_start), range(key_start, key_start + keys),
                          range(key_start + keys, vocab_size))


def parse_retrieval_records(value) -> Optional[int]:
    """``--mock-retrieval-records``: ``auto`` (None: one record per RETRIEVAL_TOKENS_PER_RECORD
    tokens) or a positive count for every sample."""
    if str(value) == "auto":
        return None
    try:
        count = int(value)
    except ValueError:
        count = 0
    if count < 1:
        raise ValueError(f"--mock-retrieval-records must be 'auto' or a count >= 1, got {value!r}")
    return count


def retrieval_record_count(length: int, records: Optional[int]) -> int:
    """Records of a sample of ``length`` tokens (``records``: the parsed ``--mock-retrieval-records``)."""
    return records if records is not None else max(1, length // RETRIEVAL_TOKENS_PER_RECORD)


def check_retrieval_capacity(length: int, vocab_size: int, records: Optional[int]) -> None:
    """Raise unless a sample of ``length`` tokens (the longest: ``--seq-length``) holds its records
    and its vocabulary has a distinct key for each."""
    count = retrieval_record_count(length, records)
    shown = "auto" if records is None else records
    if length < retrieval_min_length(count):
        raise ValueError(f"--seq-length must be >= {retrieval_min_length(count)} for --mock-content retrieval "
                         f"with --mock-retrieval-records {shown}, got {length}")
    keys = len(retrieval_vocab(vocab_size).keys)
    if count * RETRIEVAL_KEY_TOKENS > keys:
        raise ValueError(f"--mock-retrieval-records {shown} gives a {length}-token sample {count} records, but "
                         f"--mock-vocab-size {vocab_size} has only {keys} key ids: raise --mock-vocab-size or "
                         f"lower --mock-retrieval-records")


def _lay_out(times: np.ndarray, size: int, length: int) -> np.ndarray:
    """Starts of spans of ``size`` tokens, one per time in ``[0, 1)``, in time order (ties: in the
    given order) and without overlap, at about ``time x length``: the filler between them is
    what is left, shared out by the gaps between the times."""
    order = np.argsort(times, kind="stable")
    slack = length - len(times) * size
    starts = np.empty(len(times), dtype=np.int64)
    starts[order] = np.floor(times[order] * slack).astype(np.int64) + np.arange(len(times)) * size
    return starts


def retrieval_sample(length: int, vocab_size: int, rng, depth: str = "early",
                     records: Optional[int] = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Records planted in filler and a question for each, later (layout and reasons above).

    Returns the tokens ``[length]`` and the target mask (what ``pack_sequences`` turns into the
    loss mask): 1 exactly on the questions' value tokens. ``records`` is the parsed
    ``--mock-retrieval-records`` (None: auto). ``depth`` (``--mock-retrieval-depth``): ``uniform``
    plants and asks each record at two random points, so distances spread from a few tokens to
    the length and accuracy can be told apart by distance (:func:`retrieval_questions`);
    ``early`` plants in the first tenth and asks in the last, so every question is most of a
    sample away from its record.
    """
    if depth not in RETRIEVAL_DEPTHS:
        raise ValueError(f"--mock-retrieval-depth must be one of {RETRIEVAL_DEPTHS}, got {depth!r}")
    check_retrieval_capacity(length, vocab_size, records)
    vocab, count = retrieval_vocab(vocab_size), retrieval_record_count(length, records)
    tokens = rng.integers(vocab.filler.start, vocab.filler.stop, length, dtype="int64")
    keys = vocab.keys.start + rng.choice(len(vocab.keys), (count, RETRIEVAL_KEY_TOKENS), replace=False)
    values = rng.integers(vocab.values.start, vocab.values.stop, (count, RETRIEVAL_VALUE_TOKENS), dtype="int64")
    if depth == "early":
        plant_times = rng.uniform(0.0, RETRIEVAL_EARLY_SPAN, count)
        question_times = rng.uniform(1.0 - RETRIEVAL_EARLY_SPAN, 1.0, count)
    else:
        plant_times, question_times = np.sort(rng.random((2, count)), axis=0)
    # Plants first in the list: a question drawn at its plant's very time still comes after it.
    starts = _lay_out(np.concatenate([plant_times, question_times]), RETRIEVAL_RECORD_TOKENS, length)
    mask = torch.zeros(length)
    for record in range(count):
        plant, question = starts[record], starts[count + record]
        tokens[plant:plant + RETRIEVAL_RECORD_TOKENS] = [KEY_MARK, *keys[record], *values[record]]
        tokens[question:question + RETRIEVAL_RECORD_TOKENS] = [QUERY_MARK, *keys[record], *values[record]]
        mask[question + 1 + RETRIEVAL_KEY_TOKENS:question + RETRIEVAL_RECORD_TOKENS] = 1.0
    return torch.from_numpy(tokens), mask


class RetrievalQuestion(NamedTuple):
    """One question of a retrieval sample, read from its tokens."""

    distance: int
    """Tokens from the record's plant (its KEY marker) to the question (its QUERY marker)."""
    answers: range
    """Positions of the answer (value) tokens in the sample."""


def retrieval_questions(tokens: torch.Tensor) -> list:
    """Every :class:`RetrievalQuestion` of one retrieval sample (``tokens``: ``[n]`` ids), in order.

    Read from the markers, which filler never contains, rather than carried beside the sample:
    they are then facts about the tokens the model saw, and need no metadata through packing.
    """
    ids = tokens.tolist()
    plants = {tuple(ids[p + 1:p + 1 + RETRIEVAL_KEY_TOKENS]): p for p, t in enumerate(ids) if t == KEY_MARK}
    out = []
    for q, t in enumerate(ids):
        if t != QUERY_MARK:
            continue
        key = tuple(ids[q + 1:q + 1 + RETRIEVAL_KEY_TOKENS])
        if key not in plants or q + RETRIEVAL_RECORD_TOKENS > len(ids):
            raise ValueError(f"not a retrieval sample: the question at {q} has no planted record or no answer")
        out.append(RetrievalQuestion(q - plants[key], range(q + 1 + RETRIEVAL_KEY_TOKENS, q + RETRIEVAL_RECORD_TOKENS)))
    if not out:
        raise ValueError("not a retrieval sample: no QUERY marker")
    return out
