"""DiLoCo / SparseLoCo (``--dp-comm``): compressor, quantizer, error feedback, replicas over gloo, DP=2 x PP=2."""
import json
import math

import pytest
import torch

from megatron_sparsebalance.training.outer_sync import (
    ChunkLayout,
    DPCommConfig,
    SparseLoCoCompressor,
    dequantize,
    pack_bits,
    quantization_error_bound,
    quantize,
    unpack_bits,
)
from tests import pretrain_cases, sparseloco_cases
from tests.distributed import run_workers

# Odd shapes: edge tiles with padding, a vector shorter than k, a vector over several runs.
SHAPES = [(70, 45), (16, 16), (5,), (600,)]
CHUNK, TOPK = 16, 8


def _chunks_of(t: torch.Tensor, c: int):
    """Naive reference tiling: the chunks of one tensor as flat lists of (position, value)."""
    if t.dim() == 2:
        for i in range(0, t.shape[0], c):
            for j in range(0, t.shape[1], c):
                yield t[i:i + c, j:j + c].reshape(-1)
    else:
        flat = t.reshape(-1)
        for i in range(0, flat.numel(), c * c):
            yield flat[i:i + c * c]


def test_layout_round_trip_and_pack_bits():
    tensors = [torch.randn(s) for s in SHAPES]
    layout = ChunkLayout([t.shape for t in tensors], CHUNK)
    back = layout.from_rows(layout.to_rows(tensors))
    assert all(torch.equal(a, b) for a, b in zip(tensors, back))
    assert int(layout.valid.sum()) == sum(t.numel() for t in tensors)
    for bits in (1, 2, 3, 12):
        values = torch.randint(0, 1 << bits, (101,))
        packed = pack_bits(values, bits)
        assert packed.dtype == torch.uint8 and packed.numel() == math.ceil(101 * bits / 8)
        assert torch.equal(unpack_bits(packed, bits, 101), values)


def test_compressor_keeps_exactly_topk_per_chunk_and_error_holds_the_rest():
    torch.manual_seed(0)
    tensors = [torch.randn(s) for s in SHAPES]
    layout = ChunkLayout([t.shape for t in tensors], CHUNK)
    comp = SparseLoCoCompressor(layout, TOPK, bits=2)
    error = torch.randn(layout.num_rows, layout.width) * layout.valid  # a buffer from earlier steps
    decay = 0.999
    acc = error * decay + layout.to_rows(tensors)
    message, idx, sent = comp.feedback(error, layout.to_rows(tensors), decay)

    # What travels decodes to what the sender believes it sent.
    r_idx, r_values = comp.decompress(message)
    assert torch.equal(r_idx[comp.slot_mask], idx[comp.slot_mask]) and torch.equal(r_values, sent)
    assert message.numel() == comp.message_bytes

    # Per chunk: the kept entries are exactly the k largest magnitudes (min(k, size) in small chunks).
    acc_tensors = layout.from_rows(acc)
    sent_dense = torch.zeros_like(acc).scatter_(1, idx, sent)
    kept_dense = torch.zeros_like(acc, dtype=torch.bool).scatter_(1, idx, comp.slot_mask)
    row = 0
    for t in acc_tensors:
        for chunk in _chunks_of(t, CHUNK):
            k = min(TOPK, chunk.numel())
            kept = acc[row][kept_dense[row]]
            assert kept.numel() == k
            expect = chunk.abs().topk(k).values
            assert torch.equal(kept.abs().sort(descending=True).values, expect)
            row += 1
    assert row == layout.num_rows

    # The buffer holds exactly what was not sent: untouched where nothing was sent, the residual elsewhere.
    assert torch.equal(error[~kept_dense], acc[~kept_dense])
    assert torch.equal(error[kept_dense], acc[kept_dense] - sent_dense[kept_dense])
    assert torch.allclose(error + sent_dense, acc, atol=1e-6)


@pytest.mark.parametrize("bits", [1, 2, 3, 4])
def test_quantize_error_within_bound(bits):
    torch.manual_seed(bits)
    values = torch.randn(50, 32) * torch.rand(50, 1) * 10
    mask = torch.rand(50, 32) < 0.9
    mask[:, 0] = True
    codes, lo, hi = quantize(values, mask, bits)
    assert int(codes.max()) < (1 << bits)
    deq = dequantize(codes, lo, hi, bits)
    err = (values - deq).abs()
    bound = quantization_error_bound(lo, hi, bits).unsqueeze(1) + 4 * torch.finfo(torch.float32).eps * hi.unsqueeze(1)
    assert bool((err <= bound)[mask].all())
    assert torch.equal(torch.sign(deq)[mask & (values != 0)], torch.sign(values)[mask & (values != 0)])
    if bits == 2:  # the default: two magnitude levels, the chunk's smallest and largest kept magnitude
        mags = deq.abs()[mask]
        assert bool(((mags == lo.unsqueeze(1).expand_as(deq)[mask]) | (mags == hi.unsqueeze(1).expand_as(deq)[mask])).all())


def test_config_validation_names_the_flag():
    for kwargs, match in [({"dp_comm": "gossip"}, "--dp-comm must be one of"),
                          ({"outer_steps_interval": 0}, "--outer-steps-interval must be >= 1"),
                          ({"sparseloco_topk": 5000}, r"--sparseloco-topk must be in \[1"),
                          ({"sparseloco_quant_bits": 0}, r"--sparseloco-quant-bits must be in \[1, 8\]"),
                          ({"sparseloco_error_decay": 1.5}, "--sparseloco-error-decay must be in")]:
        with pytest.raises(ValueError, match=match):
            DPCommConfig(**kwargs).validate()
    from megatron_sparsebalance.config import parse_config

    cfg = parse_config(["--mock-data", "--dp-comm", "sparseloco", "--use-distributed-optimizer"])
    with pytest.raises(ValueError, match="--use-distributed-optimizer is not allowed"):
        cfg.validate(1)


def test_two_replicas_identical_after_every_outer_step(tmp_path):
    out = str(tmp_path / "rows.json")
    run_workers(sparseloco_cases.replicas_stay_identical, world=2, args=(("sparseloco", "diloco"), 2, 4, out))
    for mode, rows in json.load(open(out)).items():
        _check_replicas(mode, rows[:-1], rows[-1])


def _check_replicas(mode, steps, sizes):
    assert [r["outer_step"] for r in steps] == [False, True, False, True]
    for r in steps:
        # Between outer steps the replicas drift apart (no gradient all-reduce); at one they meet.
        assert r["identical"] == r["outer_step"], steps
        assert math.isfinite(r["loss"])
        assert r["bytes_sent"] == (sizes["payload_bytes"] if r["outer_step"] else 0)  # n = 2: wire = payload
    if mode == "diloco":
        assert sizes["payload_bytes"] == 4 * sizes["numel"]
    else:
        # 8 of 256 per chunk, 8-bit indices + 2-bit codes + two fp32 scales per chunk: ~ 1/13 of dense fp32.
        assert sizes["payload_bytes"] * 10 < sizes["dense_fp32"]


def test_dp2_pp2_sparseloco_pretrain_and_exact_resume(tmp_path):
    base = pretrain_cases.TINY + ["--pipeline-model-parallel-size", "2", "--num-layers", "4", "--dp-comm", "sparseloco",
                                  "--outer-steps-interval", "2", "--sparseloco-chunk", "16", "--sparseloco-topk", "8",
                                  "--train-iters", "5"]
    straight, resumed = str(tmp_path / "straight.json"), str(tmp_path / "resumed.json")
    ck = str(tmp_path / "ck")
    # Saved mid-interval (after 3 inner steps, H = 2): local weights differ per replica then.
    run_workers(pretrain_cases.run, world=4, pp=2, args=(base + ["--save", ck, "--save-interval", "3"], straight))
    run_workers(pretrain_cases.run, world=4, pp=2, args=(base + ["--load", str(tmp_path / "ck" / "iter_0000003")], resumed))
    rows = json.load(open(straight))
    assert len(rows) == 5 and all(math.isfinite(r["loss"]) for r in rows)
    assert [r["bytes_sent"] > 0 for r in rows] == [False, True, False, True, False]
    assert rows[-1]["bytes_sent_total"] == 2 * rows[1]["bytes_sent"]
    assert rows[1]["bytes_sent"] * 10 < rows[1]["dense_fp32_bytes"]
    after = json.load(open(resumed))
    assert [r["iteration"] for r in after] == [4, 5]
    assert [r["loss"] for r in after] == [r["loss"] for r in rows[3:]]  # bitwise: error buffers, local weights, Adam
    assert after[-1]["bytes_sent_total"] == rows[-1]["bytes_sent_total"]
