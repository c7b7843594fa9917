"""Real documents with no download: package source trees as documents (deterministic, held out by
package, cut along directories), preprocess_data's JSONL -> .bin/.idx round trip, and the length
mixes (lengths as declared, fresh crops never overlapping, shapes of the paper's data)."""
from __future__ import annotations

import json
import os

import numpy as np
import pytest
import torch

from megatron_sparsebalance.data.datasets import IndexedTokenDataset
from megatron_sparsebalance.data.documents import HEADER, build_documents, package_hash, split_packages, write_jsonl
from megatron_sparsebalance.data.mixes import mix_summary, plan_mix, write_histogram, write_mix
from tests.tiny_gguf import tiny_hf_dir


def _write(path, text):
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w", encoding="utf-8") as f:
        f.write(text)


@pytest.fixture(scope="module")
def tree(tmp_path_factory):
    """A small site-packages: twelve packages, one of them large enough to be cut, plus what must be skipped."""
    root = str(tmp_path_factory.mktemp("site"))
    for i in range(11):
        pkg = f"pkg{i:02d}"
        _write(f"{root}/{pkg}/__init__.py", f"'''Package {i}.'''\nVALUE = {i}\n" * (i + 1))
        _write(f"{root}/{pkg}/core/impl.py", "def f(x):\n    return x + 1\n" * (3 + i))
        _write(f"{root}/{pkg}/README.md", f"# {pkg}\n\nSome prose about it.\n")
    # "big": two sub-packages each over the cut size, one small one, and files at its top.
    _write(f"{root}/big/__init__.py", "from .a import *\n")
    _write(f"{root}/big/a/x.py", "A = 1\n" * 400)
    _write(f"{root}/big/a/y.pyi", "def g() -> int: ...\n" * 150)
    _write(f"{root}/big/b/z.py", "B = 2\n" * 500)
    _write(f"{root}/big/small/s.py", "S = 3\n")
    # Skipped: binary, non-UTF-8, caches, metadata, a directory without Python.
    with open(f"{root}/pkg00/blob.txt", "wb") as f:
        f.write(b"\xff\xfe not utf-8")
    _write(f"{root}/pkg00/__pycache__/impl.cpython-311.py", "cached\n")
    _write(f"{root}/pkg00/lib.so", "binary\n")
    _write(f"{root}/pkg00-1.0.dist-info/METADATA", "Name: pkg00\n")
    _write(f"{root}/notes/only.txt", "no python here\n")
    return root


def test_documents_are_deterministic_and_complete(tree, tmp_path):
    a = build_documents([tree], valid_fraction=0.3, max_chars=2000)
    b = build_documents([tree], valid_fraction=0.3, max_chars=2000)
    for split in ("train", "valid"):
        write_jsonl(str(tmp_path / f"a_{split}.jsonl"), getattr(a, split))
        write_jsonl(str(tmp_path / f"b_{split}.jsonl"), getattr(b, split))
        assert (tmp_path / f"a_{split}.jsonl").read_bytes() == (tmp_path / f"b_{split}.jsonl").read_bytes()
    docs = a.train + a.valid
    packages = {d.package for d in docs}
    assert packages == {f"pkg{i:02d}" for i in range(11)} | {"big"}  # no dist-info, no 'notes'
    files = [f for d in docs for f in d.files]
    assert len(files) == len(set(files)), "a file is in two documents"
    assert not any("__pycache__" in f or f.endswith((".so", "blob.txt")) for f in files)
    pkg3 = next(d for d in docs if d.package == "pkg03")
    assert pkg3.files == ("pkg03/README.md", "pkg03/__init__.py", "pkg03/core/impl.py")  # sorted paths
    assert pkg3.text.startswith(HEADER.format(path="pkg03/README.md") + "# pkg03\n")
    assert HEADER.format(path="pkg03/core/impl.py") + "def f(x):" in pkg3.text


def test_large_package_is_cut_along_its_directories(tree):
    docs = [d for d in build_documents([tree], valid_fraction=0.3, max_chars=2000).train
            + build_documents([tree], valid_fraction=0.3, max_chars=2000).valid if d.package == "big"]
    roots = {d.root: d for d in docs}
    # a/ (2400 + 3000 chars) and b/ (3000) are over 2000: documents of their own; the top files and
    # the small sub-package stay together in big's document.
    assert set(roots) == {"big", "big/a", "big/b"}
    assert roots["big"].files == ("big/__init__.py", "big/small/s.py")
    assert roots["big/a"].files == ("big/a/x.py", "big/a/y.pyi")
    uncut = [d for d in build_documents([tree], 0.3, max_chars=10**6).train + build_documents([tree], 0.3, 10**6).valid
             if d.package == "big"]
    assert len(uncut) == 1 and len(uncut[0].files) == 5


def test_held_out_split_is_by_package(tree):
    docs = build_documents([tree], valid_fraction=0.3, max_chars=2000)
    train = {d.package for d in docs.train}
    valid = {d.package for d in docs.valid}
    assert train and valid and not train & valid
    assert valid == set(docs.packages["valid"]) and train == set(docs.packages["train"])
    # The rule is the name's hash alone: the same package is held out whatever else is installed.
    assert all(package_hash(p) < 0.3 for p in valid) and all(package_hash(p) >= 0.3 for p in train)
    sub_train, sub_valid = split_packages(sorted(train | valid)[:6], 0.3)
    assert set(sub_valid) <= valid or len(sub_valid) == 1
    with pytest.raises(ValueError, match="--valid-fraction must be in"):
        split_packages(["a", "b"], 1.0)
    with pytest.raises(ValueError, match="--packages: not found"):
        build_documents([tree], include=["nope"])


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory):
    return tiny_hf_dir(str(tmp_path_factory.mktemp("tok")))


def test_preprocess_round_trip(tree, tokenizer_dir, tmp_path):
    from transformers import AutoTokenizer

    from tools.preprocess_data import preprocess

    docs = build_documents([tree], valid_fraction=0.3, max_chars=2000)
    jsonl = str(tmp_path / "train.jsonl")
    write_jsonl(jsonl, docs.train)
    with open(jsonl, "a") as f:
        f.write("\n")  # blank lines are skipped, as in Megatron-LM
    one = preprocess(jsonl, str(tmp_path / "w1"), tokenizer_dir, append_eod=True, workers=1, log=lambda *_: None)
    two = preprocess(jsonl, str(tmp_path / "w2"), tokenizer_dir, append_eod=True, workers=2, log=lambda *_: None)
    assert one["text"].endswith("w1_text_document")
    tok = AutoTokenizer.from_pretrained(tokenizer_dir)
    ds1 = IndexedTokenDataset(one["text"], seq_length=10**7)
    ds2 = IndexedTokenDataset(two["text"], seq_length=10**7)
    assert len(ds1) == len(docs.train) == len(ds2)
    for i, d in enumerate(docs.train):
        expect = tok(d.text)["input_ids"] + [tok.eos_token_id]
        assert ds1[i].tokens.tolist() == expect
        assert ds2[i].tokens.tolist() == expect  # the worker count changes nothing
    assert (tmp_path / "w1_text_document.bin").read_bytes() == (tmp_path / "w2_text_document.bin").read_bytes()
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"content": "x"}\n')
    with pytest.raises(ValueError, match="no string field 'text'"):
        preprocess(str(bad), str(tmp_path / "bad"), tokenizer_dir, log=lambda *_: None)


def test_mix_lengths_are_as_declared(tmp_path):
    from megatron_sparsebalance.data.datasets import write_indexed_dataset
    from megatron.core.datasets.indexed_dataset import IndexedDataset

    rng = np.random.default_rng(0)
    doc_lengths = [40000, 30000, 20000, 9000, 5000, 3000]
    docs = [rng.integers(0, 300, n) for n in doc_lengths]
    write_indexed_dataset(str(tmp_path / "docs"), docs, vocab_size=300)
    cuts = plan_mix(doc_lengths, "longtail", 12, 8192, seed=3)
    assert cuts == plan_mix(doc_lengths, "longtail", 12, 8192, seed=3)  # deterministic
    assert all(c.rule == "fresh" and c.length == c.drawn for c in cuts)
    used = {}
    for c in cuts:  # fresh crops of a document are consecutive, never overlapping
        assert c.start == used.get(c.document, 0) and c.start + c.length <= doc_lengths[c.document]
        used[c.document] = c.start + c.length
    write_mix(IndexedDataset(str(tmp_path / "docs")), cuts, str(tmp_path / "mix"))
    mix = IndexedTokenDataset(str(tmp_path / "mix"), seq_length=8192)
    assert mix.lengths.tolist() == [c.length for c in cuts]
    for i, c in enumerate(cuts):
        assert mix[i].tokens.tolist() == docs[c.document][c.start:c.start + c.length].tolist()
    # Longer than any document: clipped to the longest, and said so.
    clipped = plan_mix([100, 50], "longtail", 3, 8192, seed=0)
    assert {c.rule for c in clipped} == {"clipped"} and all(c.length == 100 < c.drawn for c in clipped)
    # Not enough unused text: crops of whole documents again, still at the declared length.
    reused = plan_mix([9000], "longtail", 4, 8192, seed=1)
    assert [c.rule for c in reused][0] == "fresh" and "reused" in {c.rule for c in reused}
    assert all(c.length == c.drawn for c in reused)
    with pytest.raises(ValueError, match="--distribution must be one of"):
        plan_mix(doc_lengths, "uniform", 4, 8192, seed=0)


def test_mix_shapes_match_the_papers_data(tmp_path):
    """Plenty of long documents: every sample fresh at its drawn length, and the two shapes hold."""
    doc_lengths = [400_000] * 64
    longtail = mix_summary(plan_mix(doc_lengths, "longtail", 600, 73728, seed=0), "longtail", 73728, 0)
    assert longtail["rules"] == {"fresh": 600, "reused": 0, "clipped": 0}
    assert longtail["quantiles"]["0.0"] >= 8192 and longtail["quantiles"]["1.0"] <= 73728
    assert 0.65 < longtail["fraction_8192_16384"] < 0.85  # LongAlign-10k: most in 8-16K
    bimodal = mix_summary(plan_mix(doc_lengths, "bimodal", 600, 32768, seed=0), "bimodal", 32768, 0)
    assert 0.72 < bimodal["fraction_below_4096"] < 0.88 and 0.12 < bimodal["fraction_above_16384"] < 0.28
    write_histogram({"longtail": longtail, "bimodal": bimodal}, str(tmp_path / "h.png"), str(tmp_path / "h.json"))
    assert (tmp_path / "h.png").stat().st_size > 1000
    saved = json.loads((tmp_path / "h.json").read_text())
    assert sum(saved["longtail"]["histogram"]["counts"]) == 600 and len(saved["bimodal"]["lengths"]) == 600


def test_text_budget_skips_whole_packages(tree):
    full = build_documents([tree], valid_fraction=0.3, max_chars=2000)
    size = {}
    for d in full.train + full.valid:
        size[d.package] = size.get(d.package, 0) + len(d.text)
    budget = sum(size.values()) // 2
    part = build_documents([tree], valid_fraction=0.3, max_chars=2000, max_total_chars=budget)
    kept = {d.package for d in part.train + part.valid}
    assert 0 < sum(size[p] for p in kept) <= budget
    # Whole packages only, taken in hash order: each package left out would not have fitted.
    for p in sorted(size, key=package_hash):
        if p not in kept:
            assert sum(size[q] for q in kept if package_hash(q) < package_hash(p)) + size[p] > budget
