"""The data pipeline: length distributions, mock and retrieval content, JSONL with a local Hugging
Face tokenizer, Megatron's indexed dataset, length caps, packing of planned micro-batches."""
from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from megatron_sparsebalance.balance.sab import SparsityAwareBatcher
from megatron_sparsebalance.data.datasets import (
    DataConfig,
    IndexedTokenDataset,
    JsonlDataset,
    MockDataset,
    build_dataset,
    pack_micro_batch,
    write_indexed_dataset,
)
from megatron_sparsebalance.data.distributions import sample_lengths
from megatron_sparsebalance.data.sampler import GlobalBatchSampler
from megatron_sparsebalance.data.synthetic import (
    ANSWER_MARK,
    KEY_MARK,
    QUERY_MARK,
    RETRIEVAL_KEY_TOKENS,
    RETRIEVAL_VALUE_TOKENS,
    VALUE_MARK,
)

WORDS = "hello world good day bye see you the cat sat on a mat long story".split()
CHAT_TEMPLATE = "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}</s>{% endfor %}"


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory):
    """A tiny word-level Hugging Face tokenizer with a chat template, built locally (no network)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    specials = ["<unk>", "</s>", "<|user|>", "<|assistant|>", "<|system|>"]
    vocab = {t: i for i, t in enumerate(specials + WORDS)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", eos_token="</s>",
                                   additional_special_tokens=specials[2:])
    fast.chat_template = CHAT_TEMPLATE
    path = tmp_path_factory.mktemp("tok")
    fast.save_pretrained(str(path))
    return str(path), vocab


# ---- distributions and mock data -----------------------------------------------------------


def test_length_distributions_have_their_shapes():
    rng = np.random.default_rng(0)
    bi = sample_lengths("bimodal", 20000, 32768, rng)
    assert 0.75 < np.mean(bi <= 4096) < 0.85 and 0.15 < np.mean(bi > 16384) < 0.25
    assert not np.any((bi > 4096) & (bi < 16384)), "nothing between the two modes"
    lt = sample_lengths("longtail", 20000, 73728, rng)
    assert lt.min() >= 8192 and lt.max() <= 73728
    assert 0.7 < np.mean(lt <= 16384) < 0.8 and 0.0 < np.mean(lt > 49152) < 0.03
    # scaled by --seq-length: the same shape at 8K
    small = sample_lengths("longtail", 20000, 8192, rng)
    assert small.max() <= 8192 and 0.7 < np.mean(small <= 16384 * 8192 / 73728) < 0.8
    assert set(sample_lengths("fixed", 10, 4096, rng).tolist()) == {4096}
    un = sample_lengths("uniform", 20000, 4096, rng)
    assert un.min() >= 256 and un.max() <= 4096 and abs(un.mean() - (256 + 4096) / 2) < 40
    with pytest.raises(ValueError, match="--mock-length-distribution must be one of"):
        sample_lengths("zipf", 10, 4096, rng)


def test_mock_dataset_is_deterministic_and_capped():
    a = MockDataset(50, "bimodal", 8192, seed=3)
    b = MockDataset(50, "bimodal", 8192, seed=3)
    assert np.array_equal(a.lengths, b.lengths) and a.lengths.max() <= 8192
    assert torch.equal(a[7].tokens, b[7].tokens) and len(a[7].tokens) == a.lengths[7]
    assert not np.array_equal(a.lengths, MockDataset(50, "bimodal", 8192, seed=4).lengths)
    with pytest.raises(ValueError, match="--seq-length must be >= 24 for --mock-content retrieval"):
        MockDataset(5, "uniform", 16, content="retrieval")
    with pytest.raises(ValueError, match="--mock-content"):
        MockDataset(5, "uniform", 64, content="poems")


def test_retrieval_task_answer_mask():
    ds = MockDataset(6, "uniform", 2048, content="retrieval", vocab_size=1000, seed=1)
    batch = pack_micro_batch(ds, [0, 3, 5])
    n_answer = RETRIEVAL_VALUE_TOKENS
    assert batch.loss_mask.sum().item() == 3 * n_answer
    cu = batch.cu_seqlens.tolist()
    for s, (lo, hi) in enumerate(zip(cu[:-1], cu[1:])):
        tokens = batch.tokens[0, lo:hi]
        mask = batch.loss_mask[0, lo:hi]
        answer_positions = mask.nonzero().flatten()
        # the loss sits on the positions that predict the value, right after ANSWER_MARK
        assert answer_positions.tolist() == list(range(hi - lo - 1 - n_answer, hi - lo - 1))
        answer = batch.labels[0, lo:hi][answer_positions]
        assert tokens[hi - lo - 1 - n_answer - RETRIEVAL_KEY_TOKENS - 1] == QUERY_MARK
        assert tokens[hi - lo - 1 - n_answer] == ANSWER_MARK
        # the same key and value were planted in the first tenth of the sequence
        plant = (tokens == KEY_MARK).nonzero().flatten().tolist()
        assert len(plant) == 1 and plant[0] < (hi - lo) // 10
        p = plant[0]
        key = tokens[p + 1:p + 1 + RETRIEVAL_KEY_TOKENS]
        assert tokens[p + 1 + RETRIEVAL_KEY_TOKENS] == VALUE_MARK
        assert torch.equal(tokens[p + 2 + RETRIEVAL_KEY_TOKENS:p + 2 + RETRIEVAL_KEY_TOKENS + n_answer], answer)
        assert torch.equal(tokens[hi - lo - n_answer - 1 - RETRIEVAL_KEY_TOKENS:hi - lo - n_answer - 1], key)


def test_pack_micro_batch_layout():
    ds = MockDataset(10, "uniform", 512, seed=2)
    ids = [4, 1, 7]
    batch = pack_micro_batch(ds, ids)
    lengths = [int(ds.lengths[i]) for i in ids]
    assert batch.lengths == lengths
    assert batch.cu_seqlens.dtype == torch.int32 and batch.cu_seqlens.tolist() == [0, *np.cumsum(lengths).tolist()]
    pos = batch.position_ids[0].tolist()
    start = 0
    for n, i in zip(lengths, ids):
        assert pos[start:start + n] == list(range(n)), "positions restart per sequence"
        assert torch.equal(batch.tokens[0, start:start + n], ds[i].tokens)
        assert batch.loss_mask[0, start + n - 1] == 0, "no target across a sequence boundary"
        start += n
    params = batch.packed_seq_params()
    assert params.qkv_format == "thd" and params.max_seqlen_q == max(lengths)


def test_sampler_packs_each_ranks_micro_batches():
    ds = MockDataset(64, "bimodal", 4096, content="retrieval", seed=5)
    sampler = GlobalBatchSampler(ds.lengths, 32, SparsityAwareBatcher("lbb", 2, 4, micro_batch_tokens=20000), seed=5)
    plan = sampler.next_plan()
    seen = []
    for rank in range(2):
        packs = sampler.micro_batches(ds, plan, rank)
        assert len(packs) == 4
        for pack, ids in zip(packs, plan.micro_batches[rank]):
            assert pack.lengths == [int(ds.lengths[i]) for i in ids] and pack.tokens.shape[1] <= 20000
            seen += list(ids)
    assert sorted(seen) == sorted(plan.sample_ids)


# ---- JSONL with a local Hugging Face tokenizer ---------------------------------------------


def test_jsonl_text_and_chat(tokenizer_dir, tmp_path):
    path, vocab = tokenizer_dir
    records = [
        {"text": "the cat sat on a mat"},
        {"messages": [{"role": "user", "content": "hello world"}, {"role": "assistant", "content": "good day"},
                      {"role": "user", "content": "bye"}, {"role": "assistant", "content": "see you"}]},
        {"text": ""},  # nothing to predict: skipped
    ]
    f = tmp_path / "data.jsonl"
    f.write_text("".join(json.dumps(r) + "\n" for r in records))
    ds = JsonlDataset(str(f), path, seq_length=64)
    assert len(ds) == 2 and ds.skipped == [3]
    v = vocab
    text = ds[0]
    assert text.tokens.tolist() == [v[w] for w in "the cat sat on a mat".split()] + [v["</s>"]]
    assert text.target_mask.tolist() == [1.0] * 7
    chat = ds[1]
    expect = ["<|user|>", "hello", "world", "</s>", "<|assistant|>", "good", "day", "</s>",
              "<|user|>", "bye", "</s>", "<|assistant|>", "see", "you", "</s>"]
    assert chat.tokens.tolist() == [v[t] for t in expect]
    # only assistant replies (and their end of turn) are targets, never the role header
    assert chat.target_mask.tolist() == [0, 0, 0, 0, 0, 1, 1, 1, 0, 0, 0, 0, 1, 1, 1]
    assert ds.lengths.tolist() == [7, 15]

    truncated = JsonlDataset(str(f), path, seq_length=10)
    assert truncated.lengths.tolist() == [7, 10]
    assert torch.equal(truncated[1].tokens, chat.tokens[:10])
    with pytest.raises(ValueError, match="--seq-length 10.*--overlong-samples truncate"):
        JsonlDataset(str(f), path, seq_length=10, overlong="error")
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"prompt": "x"}) + "\n")
    with pytest.raises(ValueError, match="bad.jsonl:1: a record needs a 'text' string or a 'messages' list"):
        JsonlDataset(str(bad), path, seq_length=64)
    with pytest.raises(ValueError, match="--tokenizer-model must be a local directory"):
        JsonlDataset(str(f), str(tmp_path / "nope"), seq_length=64)


# ---- Megatron's indexed dataset --------------------------------------------------------------


def test_indexed_dataset_round_trip(tmp_path):
    rng = np.random.default_rng(0)
    seqs = [rng.integers(0, 50000, int(n)) for n in (5, 300, 17, 1024, 2)]
    prefix = str(tmp_path / "corpus")
    write_indexed_dataset(prefix, seqs, vocab_size=50000)
    ds = IndexedTokenDataset(prefix, seq_length=4096)
    assert ds.lengths.tolist() == [5, 300, 17, 1024, 2]
    for i, s in enumerate(seqs):
        assert ds[i].tokens.tolist() == s.tolist() and ds[i].target_mask.sum() == len(s)
    capped = IndexedTokenDataset(prefix, seq_length=256)
    assert capped.lengths.tolist() == [5, 256, 17, 256, 2]
    assert capped[3].tokens.tolist() == seqs[3][:256].tolist()
    with pytest.raises(ValueError, match="1024 tokens, more than --seq-length 256"):
        IndexedTokenDataset(prefix, seq_length=256, overlong="error")
    cfg = DataConfig(data_path=prefix, seq_length=512)
    assert build_dataset(cfg).lengths.tolist() == [5, 300, 17, 512, 2]
    with pytest.raises(ValueError, match="--data-path .*no .*bin"):
        build_dataset(DataConfig(data_path=str(tmp_path / "missing")))


def test_data_config_validation():
    with pytest.raises(ValueError, match="--data-path is required unless --mock-data"):
        DataConfig().validate()
    with pytest.raises(ValueError, match="--tokenizer-model"):
        DataConfig(data_path="x.jsonl").validate()
    with pytest.raises(ValueError, match="--overlong-samples must be one of"):
        DataConfig(mock_data=True, overlong_samples="drop").validate()
    with pytest.raises(ValueError, match="--seq-length must be >= 2"):
        DataConfig(mock_data=True, seq_length=1).validate()
    ds = build_dataset(DataConfig(mock_data=True, mock_length_distribution="fixed", mock_samples=4, seq_length=128))
    assert ds.lengths.tolist() == [128] * 4
