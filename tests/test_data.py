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
    build_validation_dataset,
    has_validation_data,
    pack_micro_batch,
    write_indexed_dataset,
)
from megatron_sparsebalance.data.distributions import sample_lengths
from megatron_sparsebalance.data.sampler import GlobalBatchSampler
from megatron_sparsebalance.data.synthetic import (
    KEY_MARK,
    QUERY_MARK,
    RETRIEVAL_KEY_TOKENS,
    RETRIEVAL_RECORD_TOKENS,
    RETRIEVAL_TOKENS_PER_RECORD,
    RETRIEVAL_VALUE_TOKENS,
    retrieval_questions,
    retrieval_sample,
    retrieval_vocab,
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
    with pytest.raises(ValueError, match="--seq-length must be >= 12 for --mock-content retrieval"):
        MockDataset(5, "uniform", 10, content="retrieval")
    with pytest.raises(ValueError, match="--mock-content"):
        MockDataset(5, "uniform", 64, content="poems")


def _records(tokens):
    """Plants and questions of a retrieval sample, read naively: {key: position} each."""
    ids = tokens.tolist()
    found = {KEY_MARK: {}, QUERY_MARK: {}}
    for p, t in enumerate(ids):
        if t in found:
            key = tuple(ids[p + 1:p + 1 + RETRIEVAL_KEY_TOKENS])
            assert key not in found[t], "keys are distinct within a sample"
            found[t][key] = p
    return found[KEY_MARK], found[QUERY_MARK]


@pytest.mark.parametrize("depth", ["early", "uniform"])
def test_retrieval_task_layout(depth):
    vocab = retrieval_vocab(1000)
    ds = MockDataset(6, "uniform", 4096, content="retrieval", vocab_size=1000, seed=1, retrieval_depth=depth)
    batch = pack_micro_batch(ds, [0, 3, 5])
    cu = batch.cu_seqlens.tolist()
    assert batch.loss_mask.sum().item() == sum(n // RETRIEVAL_TOKENS_PER_RECORD * RETRIEVAL_VALUE_TOKENS for n in batch.lengths)
    for lo, hi in zip(cu[:-1], cu[1:]):
        n, tokens = hi - lo, batch.tokens[0, lo:hi]
        plants, questions = _records(tokens)
        assert len(plants) == n // RETRIEVAL_TOKENS_PER_RECORD and plants.keys() == questions.keys()
        in_record = torch.zeros(n, dtype=torch.bool)
        answers = []
        # where --mock-retrieval-depth puts them (a tenth of the span the records leave to filler)
        slack = n - 2 * len(plants) * RETRIEVAL_RECORD_TOKENS
        early_plant_end = 0.1 * slack + len(plants) * RETRIEVAL_RECORD_TOKENS
        early_question_start = 0.9 * slack - 1 + len(plants) * RETRIEVAL_RECORD_TOKENS
        for key, p in plants.items():
            q = questions[key]
            assert all(k in vocab.keys for k in key) and p < q
            value = tokens[p + 1 + RETRIEVAL_KEY_TOKENS:p + RETRIEVAL_RECORD_TOKENS]
            assert all(int(v) in vocab.values for v in value)
            # the question repeats the key, then the answer: the planted value
            assert torch.equal(tokens[q + 1 + RETRIEVAL_KEY_TOKENS:q + RETRIEVAL_RECORD_TOKENS], value)
            answers += range(q + 1 + RETRIEVAL_KEY_TOKENS, q + RETRIEVAL_RECORD_TOKENS)
            in_record[p:p + RETRIEVAL_RECORD_TOKENS] = in_record[q:q + RETRIEVAL_RECORD_TOKENS] = True
            if depth == "early":
                assert p < early_plant_end and q >= early_question_start
        # everything else is filler, whose ids nothing else uses: a key occurs only where planted and asked
        assert all(int(t) in vocab.filler for t in tokens[~in_record])
        # the loss sits on the positions that predict an answer token, and only there
        assert batch.loss_mask[0, lo:hi].nonzero().flatten().tolist() == sorted(a - 1 for a in answers)
        if depth == "early":  # questions are not asked in the order the records were planted
            assert sorted(plants, key=plants.get) != sorted(questions, key=questions.get)
        assert retrieval_questions(tokens) == sorted(
            ((questions[k] - plants[k], range(questions[k] + 1 + RETRIEVAL_KEY_TOKENS, questions[k] + RETRIEVAL_RECORD_TOKENS))
             for k in plants), key=lambda d: d[1].start)


def test_retrieval_records_flag():
    rng = np.random.default_rng(0)
    tokens, mask = retrieval_sample(300, 64, rng, "uniform", records=5)
    assert len(retrieval_questions(tokens)) == 5 and mask.sum() == 5 * RETRIEVAL_VALUE_TOKENS
    # auto: one record per RETRIEVAL_TOKENS_PER_RECORD tokens, at least one
    assert len(retrieval_questions(retrieval_sample(100, 64, rng)[0])) == 1
    ds = MockDataset(20, "longtail", 4096, content="retrieval", vocab_size=512, seed=2, retrieval_records="3")
    assert all(len(retrieval_questions(ds[i].tokens)) == 3 for i in range(len(ds)))
    with pytest.raises(ValueError, match="not a retrieval sample: no QUERY marker"):
        retrieval_questions(torch.full((40,), 9))


@pytest.mark.parametrize("fields, match", [
    ({"mock_retrieval_records": "many"}, r"--mock-retrieval-records must be 'auto' or a count >= 1, got 'many'"),
    ({"mock_retrieval_records": "0"}, r"--mock-retrieval-records must be 'auto' or a count >= 1"),
    ({"mock_retrieval_records": "100", "seq_length": 512}, r"--seq-length must be >= 804 .* --mock-retrieval-records 100"),
    ({"mock_vocab_size": 64}, r"--mock-retrieval-records auto gives a 32768-token sample 128 records, but "
                              r"--mock-vocab-size 64 has only 23 key ids"),
    ({"mock_vocab_size": 5}, r"--mock-vocab-size must be >= 6 for --mock-content retrieval"),
    ({"mock_retrieval_depth": "late"}, r"--mock-retrieval-depth must be one of"),
])
def test_bad_retrieval_flags_name_the_flag(fields, match):
    cfg = DataConfig(**{"seq_length": 32768, "mock_data": True, "mock_content": "retrieval", **fields})
    with pytest.raises(ValueError, match=match):
        cfg.validate()
    with pytest.raises(ValueError, match=match):
        build_dataset(cfg)


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


def test_end_of_document_given_by_the_caller_masks_token_files_only(tmp_path):
    """The Megatron-LM entry hands over its tokenizer's EOD (``eod``): it masks in token files,
    the validation split included; mock samples keep their own EOD, the last mock id."""
    prefix = str(tmp_path / "corpus")
    write_indexed_dataset(prefix, [np.array([5, 7, 9, 3, 8]), np.array([4, 9, 6, 1])], vocab_size=16)
    cfg = DataConfig(data_path=prefix, seq_length=64, eod_mask_loss=True, split="1,1")
    train = build_dataset(cfg, vocab_size=16, eod=9)
    assert train.eod_mask_id == 9 and build_dataset(cfg, vocab_size=16).eod_mask_id == 15
    packed = pack_micro_batch(train, [0])  # the prediction made from the 9 is not a target
    unmasked = pack_micro_batch(build_dataset(DataConfig(data_path=prefix, seq_length=64, split="1,1")), [0])
    assert unmasked.loss_mask.sum() - packed.loss_mask.sum() == 1
    assert build_validation_dataset(cfg, 1, vocab_size=16, eod=9).eod_mask_id == 9
    mock = DataConfig(mock_data=True, mock_samples=2, seq_length=64, eod_mask_loss=True, mock_vocab_size=100)
    assert build_dataset(mock, eod=9).eod_mask_id == 99


def test_has_validation_data_follows_split_and_paths():
    assert has_validation_data(DataConfig(data_path="p", split="969, 30, 1"))
    assert not has_validation_data(DataConfig(data_path="p", split="100,0,0"))
    assert not has_validation_data(DataConfig(data_path="p"))
    assert has_validation_data(DataConfig(data_path="p", valid_data_path="v"))
    assert has_validation_data(DataConfig(mock_data=True))


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


def test_powerlaw_lengths_start_at_the_shortest_sample_and_reach_seq_length():
    """Pareto(1) from x_min to --seq-length: half the samples under 2 x_min, one in 16 over 16 x_min."""
    lengths = sample_lengths("powerlaw", 40000, 8192, np.random.default_rng(3), min_length=200)
    assert lengths.min() >= 200 and lengths.max() <= 8192
    assert abs(np.mean(lengths < 400) - 0.5) < 0.02  # P(L > 2 x_min) = 1/2, less the truncation
    assert abs(np.mean(lengths > 3200) - (200 / 3200 - 200 / 8192) / (1 - 200 / 8192)) < 0.01
    assert lengths.max() > 7000  # the tail reaches --seq-length
    # without a data minimum the short end is seq_length / 256, and it does not scale with it
    short = sample_lengths("powerlaw", 20000, 65536, np.random.default_rng(4))
    assert short.min() >= 256 and np.median(short) < 600
