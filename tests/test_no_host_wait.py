"""The paths that keep the host from waiting on the GPU compute what the waiting ones did.

On a GPU they are checked for synchronisations (tests/gpu/test_host_sync.py); here, on the CPU,
that each gives the same numbers: host offsets for RoPE and the layout, the device-side coverage
bound, the one-read report of an iteration, and ``--manual-gc``.
"""
import gc

import pytest
import torch
from megatron.core.packed_seq_params import PackedSeqParams

from megatron_sparsebalance.attention import SparseAttentionConfig, budget_scope
from megatron_sparsebalance.attention.budget import read_reports
from megatron_sparsebalance.data.synthetic import copy_task_batch, thd_params
from megatron_sparsebalance.ops.layout import BlockLayout
from megatron_sparsebalance.ops.router import block_scores, coverage_curve, select_blocks
from megatron_sparsebalance.ops.sparse_attention import route
from megatron_sparsebalance.training.manual_gc import ManualGC
from megatron_sparsebalance.training.model import MODEL_PRESETS, build_gpt_model, transformer_config


def test_layout_from_host_offsets_equals_layout_from_device_offsets():
    cu = torch.tensor([0, 300, 301, 1000], dtype=torch.int32)
    a = BlockLayout.from_cu_seqlens(cu, 128, 1000)
    b = BlockLayout.from_cu_seqlens(cu.clone(), 128, 1000, host_cu_seqlens=cu.clone())
    for name in ("cu_seqlens", "cu_blocks", "block_start", "block_end", "block_seq", "block_pos", "token_block"):
        assert torch.equal(getattr(a, name), getattr(b, name)), name
    assert (a.num_blocks, a.max_blocks_per_seq) == (b.num_blocks, b.max_blocks_per_seq) == (10, 6)
    assert a.block_lengths.tolist() == [128, 128, 44, 1, 128, 128, 128, 128, 128, 59]
    with pytest.raises(ValueError, match="host_cu_seqlens has shape"):
        BlockLayout.from_cu_seqlens(cu, 128, 1000, host_cu_seqlens=cu[:3])
    with pytest.raises(ValueError, match="does not match the 999 tokens"):
        BlockLayout.from_cu_seqlens(cu, 128, 999, host_cu_seqlens=cu)


def test_mixed_and_uniform_budgets_select_per_sequence():
    torch.manual_seed(0)
    lay = BlockLayout.from_cu_seqlens(torch.tensor([0, 640, 1280], dtype=torch.int32), 64, 1280)
    scores = block_scores(torch.randn(1280, 4, 32), torch.randn(1280, 2, 32), lay)
    mixed = select_blocks(scores, lay, [2, 5])
    assert mixed.kv_cnt[:, 9].tolist() == [2, 2] and mixed.kv_cnt[:, 19].tolist() == [5, 5]
    assert mixed.kv_cnt[:, 3].tolist() == [2, 2] and mixed.kv_cnt[:, 13].tolist() == [4, 4]  # 3 earlier blocks
    uniform = select_blocks(scores, lay, 5)
    assert torch.equal(uniform.kv_idx[:, 10:], mixed.kv_idx[:, 10:])
    # A wider selection (kmax above the budgets, as under the coverage bound) picks the same blocks.
    wide = select_blocks(scores, lay, torch.tensor(5), kmax=9)
    assert torch.equal(wide.kv_cnt, uniform.kv_cnt)
    assert torch.equal(wide.kv_idx[..., :5], uniform.kv_idx) and bool((wide.kv_idx[..., 5:] == -1).all())


def test_bounded_route_reads_back_the_budget_it_chose():
    torch.manual_seed(1)
    lay = BlockLayout.from_cu_seqlens(torch.tensor([0, 2048], dtype=torch.int32), 64, 2048)
    q, k = torch.randn(2048, 4, 32), torch.randn(2048, 2, 32)
    curve = coverage_curve(block_scores(q, k, lay), 16)
    for p in (0.0, 0.05, 0.2, 1.0):
        blocks, stats = route(q, k, lay, 2, k_base=16, p=p)
        loss = float(curve[15] - curve[stats.k_used - 1])
        assert loss <= p + 1e-6  # within the bound ...
        if stats.k_used > 2:  # ... and no smaller budget would have been
            assert float(curve[15] - curve[stats.k_used - 2]) > p
        assert int(blocks.kv_cnt[:, 1:].max()) <= stats.k_used  # the selection used that budget
        assert stats.unread()[0] is not None and int(stats.unread()[0]) == stats.k_used


def test_read_reports_matches_report_means():
    torch.manual_seed(2)
    lay = BlockLayout.from_cu_seqlens(torch.tensor([0, 1024, 2048], dtype=torch.int32), 64, 2048)
    reports = {}
    for i, (k, p) in enumerate([(3, 0.05), (12, None), (2, 1.0)]):
        with budget_scope(k=k, k_base=8, p=p) as report:
            for _ in range(3):
                _, stats = route(torch.randn(2048, 4, 32), torch.randn(2048, 2, 32), lay, k, k_base=8, p=p)
                report.layers.append(type("Layer", (), {"stats": stats})())
        reports[i] = report
    with budget_scope(k=4) as empty:
        pass
    reports[3] = empty
    budgets, coverage, layers = read_reports(reports)
    assert sorted(budgets) == [0, 1, 2] and layers == {0: 3, 1: 3, 2: 3}
    for i in range(3):
        stats = [layer.stats for layer in reports[i].layers]
        assert budgets[i] == pytest.approx(sum(st.k_used for st in stats) / 3)
        assert coverage[i] == pytest.approx(sum(st.coverage_used for st in stats) / 3)
        assert reports[i].mean_budget() == pytest.approx(budgets[i])


def test_thd_params_host_offsets_give_megatron_the_same_rope(gloo_world_of_one):
    """Megatron's RoPE reads the host offsets from cu_seqlens_q_padded: the model's output is unchanged."""
    shape = MODEL_PRESETS["tiny"]
    torch.manual_seed(3)
    model = build_gpt_model(shape, SparseAttentionConfig(moba_block_size=64, moba_topk=3, sparse_attn_impl="torch"),
                            transformer_config(shape), max_sequence_length=512)
    batch = copy_task_batch([300, 130, 82], shape.vocab_size, torch.Generator().manual_seed(0))
    plain = PackedSeqParams(qkv_format="thd", cu_seqlens_q=batch.cu_seqlens, cu_seqlens_kv=batch.cu_seqlens,
                            max_seqlen_q=300, max_seqlen_kv=300)
    hosted = thd_params(batch.cu_seqlens, batch.cu_seqlens.clone())
    assert hosted.cu_seqlens_q_padded is not hosted.cu_seqlens_q and hosted.max_seqlen_q == 300
    with torch.no_grad():
        a = model(batch.tokens, batch.position_ids, None, packed_seq_params=plain)
        b = model(batch.tokens, batch.position_ids, None, packed_seq_params=hosted)
    assert torch.equal(a, b)
    assert torch.equal(batch.packed_seq_params().cu_seqlens_q_padded, batch.cu_seqlens)


def test_manual_gc_turns_collection_off_and_restores_it():
    assert gc.isenabled()
    with ManualGC(True, 2) as manual:
        assert not gc.isenabled()
        before = gc.get_count()[0]
        tracked = [[] for _ in range(1000)]  # objects the collector counts in its young generation
        manual.between_iterations(2)  # a collection on iteration 2 resets that count
        assert gc.get_count()[0] < before + len(tracked)
    assert gc.isenabled()
    with ManualGC(False, 0):
        assert gc.isenabled()


def test_nested_manual_gc_neither_collects_nor_turns_collection_back_on(monkeypatch):
    """The profiler times every point under its own scope inside one scope per pass: the inner
    ones must not pay a full collection each, nor end the outer one's."""
    collections = []
    with ManualGC(True, 0):
        monkeypatch.setattr(gc, "collect", lambda *a: collections.append(1) or 0)
        with ManualGC(True, 0):
            assert not gc.isenabled()
        assert not gc.isenabled() and collections == []
    assert gc.isenabled()
