"""Megatron-LM's own ``pretrain()`` with our plugin, on one GPU (megatron-core with megatron.training)."""
import json
import os
import subprocess
import sys

import pytest
import torch

from megatron_sparsebalance.compat import HAVE_MEGATRON_TRAINING, MEGATRON_CORE
from megatron_sparsebalance.training.launch import torchrun_command
from megatron_sparsebalance.training.ports import free_port

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU"),
    pytest.mark.skipif(not HAVE_MEGATRON_TRAINING or MEGATRON_CORE < (0, 19), reason="needs megatron.training (0.19)"),
]


def _entry(nproc: int, *argv: str) -> list:
    """The command that starts our Megatron-LM entry on ``nproc`` local ranks, on a rendezvous port of
    its own (torchrun_command)."""
    return torchrun_command(nproc, "megatron_sparsebalance.megatron_lm", list(argv))


def _one_rank_env() -> dict:
    """This process's environment for a probe that starts a process group of one rank itself, on a
    port of its own."""
    return {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()), "RANK": "0", "WORLD_SIZE": "1",
            "LOCAL_RANK": "0"}


def test_megatron_lm_loop_trains_with_our_schedule_and_logs_our_figures(tmp_path):
    from benchmarks.megatron_lm_plugin import MEGATRON_LM, OURS, SHAPE, TRAINING

    argv = SHAPE + TRAINING + OURS + MEGATRON_LM + ["--train-iters", "6", "--lr-decay-iters", "6",
                                                    "--save", str(tmp_path), "--save-interval", "6",
                                                    "--timing-log-level", "2"]
    cmd = _entry(1, *argv)
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stdout[-4000:] + out.stderr[-4000:]
    lines = [ln for ln in out.stdout.splitlines() if " iteration " in ln and "lm loss:" in ln]
    assert len(lines) == 6 and all("sb imbalance:" in ln and "sb mean budget:" in ln for ln in lines), lines
    rows = [json.loads(ln) for ln in open(os.path.join(tmp_path, "sparsebalance_metrics.jsonl"))]
    assert [r["iteration"] for r in rows] == list(range(1, 7))
    assert rows[-1]["lm_loss"] < rows[0]["lm_loss"]
    # DST ran: the budgets the layers used moved off --moba-topk for some micro-batch.
    assert any(abs(r["sb_mean_budget"] - 8) > 1e-6 for r in rows)
    assert os.path.exists(os.path.join(tmp_path, "iter_0000006", "sparsebalance.pt"))
    # Megatron-LM's timers of the schedule, as its timing log prints them (--timing-log-level 2).
    timed = {ln.split()[0] for ln in out.stdout.splitlines() if "...:" in ln}
    assert {"forward-backward", "forward-compute", "backward-compute"} <= timed, out.stdout[-3000:]


def test_megatron_lm_straggler_detector_times_our_forward_and_data():
    """--log-straggler: Megatron-LM's detector reports each --log-interval from what the forward step
    timed; our forward step and schedule time the model's forward and the global batch's data as
    Megatron-LM's GPT forward step does (with nothing timed, its report divides by zero)."""
    from benchmarks.megatron_lm_plugin import MEGATRON_LM, OURS, SHAPE, TRAINING

    argv = SHAPE + TRAINING + OURS + MEGATRON_LM + ["--train-iters", "3", "--lr-decay-iters", "3", "--log-straggler"]
    cmd = _entry(1, *argv)
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    log = out.stdout + out.stderr
    assert out.returncode == 0, log[-6000:]
    reports = [ln for ln in log.splitlines() if "MnRtt/Rnk" in ln]
    assert len(reports) >= 2, log[-6000:]


def test_megatron_lm_memory_snapshot_holds_the_allocators_history(tmp_path):
    """--record-memory-history: Megatron-LM's loop writes torch's memory snapshot to
    --memory-snapshot-path every --log-interval; the history it holds is started by the model
    provider, Megatron-LM's or ours."""
    import pickle

    from benchmarks.megatron_lm_plugin import MEGATRON_LM, OURS, SHAPE, TRAINING

    path = tmp_path / "snapshot.pickle"
    argv = SHAPE + TRAINING + OURS + MEGATRON_LM + ["--train-iters", "2", "--lr-decay-iters", "2",
                                                    "--record-memory-history", "--memory-snapshot-path", str(path)]
    cmd = _entry(1, *argv)
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stdout[-4000:] + out.stderr[-4000:]
    with open(path, "rb") as f:
        snapshot = pickle.load(f)
    assert sum(len(trace) for trace in snapshot["device_traces"]) > 0


def test_megatron_lm_entry_refuses_the_interleaved_schedule():
    from benchmarks.megatron_lm_plugin import MEGATRON_LM, OURS, SHAPE, TRAINING

    argv = SHAPE + TRAINING + OURS + MEGATRON_LM + ["--train-iters", "2", "--pipeline-model-parallel-size", "1",
                                                    "--num-layers-per-virtual-pipeline-stage", "1"]
    cmd = _entry(1, *argv)
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert out.returncode != 0
    assert "interleaved" in out.stdout + out.stderr


@pytest.mark.parametrize("extra, flag", [
    (["--rampup-batch-size", "2", "2", "8"], "--rampup-batch-size"),
    (["--decrease-batch-size-if-needed"], "--decrease-batch-size-if-needed"),
    (["--context-parallel-size", "2"], "--context-parallel-size"),
    (["--attention-backend", "flash"], "--attention-backend flash selects"),
    (["--num-experts", "4"], "--num-experts"),
    (["--position-embedding-type", "yarn"], "--position-embedding-type yarn"),
    (["--window-size", "256,0"], r"--window-size \(256, 0\) \(layer 1\)"),
    (["--softmax-type", "learnable"], "--softmax-type learnable"),
    (["--experimental-attention-variant", "gated_delta_net", "--linear-attention-freq", "2"],
     "--experimental-attention-variant"),
    (["--spec", "my_specs", "layer_spec"], "--spec"),
    (["--iterations-to-skip", "3"], "--iterations-to-skip"),
    (["--sft"], "--sft"),
    (["--full-validation"], "--full-validation"),
    (["--cuda-graph-impl", "local"], "--cuda-graph-impl local"),
    (["--fp8-format", "hybrid", "--fp8-amax-history-len", "1024"], "--fp8-format hybrid"),
    (["--transformer-impl", "inference_optimized"], "--transformer-impl inference_optimized"),
    (["--phase-transition-iterations", "1"], "--phase-transition-iterations"),
    (["--defer-embedding-wgrad-compute"], "--defer-embedding-wgrad-compute"),
    (["--non-persistent-save-interval", "2", "--non-persistent-ckpt-type", "local"],
     "--non-persistent-ckpt-type local"),
    (["--yaml-cfg=run.yaml"], "--yaml-cfg"),
    (["--inprocess-restart"], "--inprocess-restart"),
    (["--eval-global-batch-size", "32"], "--eval-global-batch-size"),
])
def test_megatron_lm_parser_flags_we_cannot_run_are_refused_before_any_process_group(extra, flag):
    """Through Megatron-LM's own parser (the names its arguments get there), in this process: the
    refusal comes before ``validate_args`` and ``initialize_megatron``."""
    from benchmarks.megatron_lm_plugin import MEGATRON_LM, OURS, SHAPE, TRAINING
    from megatron_sparsebalance.megatron_lm import parse_megatron_args

    with pytest.raises(ValueError, match=flag):
        parse_megatron_args(SHAPE + TRAINING + OURS + MEGATRON_LM + ["--train-iters", "2", *extra])


def test_megatron_lm_loop_on_token_files_masks_its_tokenizers_eod_and_evaluates_on_the_split(tmp_path):
    """Megatron-LM's usual data: a .bin/.idx prefix, its tokenizer's EOD for --eod-mask-loss (here
    NullTokenizer's, moved by --null-tokenizer-eod-id), and no --split, so Megatron-LM's default
    969,30,1 holds a validation share that --eval-interval evaluates on."""
    from benchmarks.megatron_lm_plugin import MEGATRON_LM, SHAPE, TRAINING
    from tests import megatron_flags_cases as cases

    prefix = str(tmp_path / "docs")
    cases.write_documents(prefix, count=700)  # EOD = cases.VOCAB - 1, some inside documents
    ours = "--dst-anchor mean --dst-p 0.1 --batching sab --moba-block-size 128 --moba-topk 8".split()
    argv = SHAPE + TRAINING + ours + MEGATRON_LM + [
        "--train-iters", "2", "--lr-decay-iters", "2", "--eval-iters", "1", "--eval-interval", "2",
        "--data-path", prefix, "--eod-mask-loss", "--null-tokenizer-eod-id", str(cases.VOCAB - 1)]
    probe = ("import sys; from megatron.training import get_args; "
             "from megatron_sparsebalance.megatron_lm import checked_config, end_of_document, parse_megatron_args; "
             "parse_megatron_args(sys.argv[1:]); print('EOD', end_of_document(checked_config(get_args())))")
    out = subprocess.run([sys.executable, "-c", probe, *argv], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0 and f"EOD {cases.VOCAB - 1}" in out.stdout, out.stdout[-2000:] + out.stderr[-4000:]
    cmd = _entry(1, *argv)
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stdout[-4000:] + out.stderr[-4000:]
    assert len([ln for ln in out.stdout.splitlines() if " iteration " in ln and "lm loss:" in ln]) == 2
    assert " validation loss at " in out.stdout, out.stdout[-4000:]


def test_megatron_lm_per_split_data_paths_are_read_as_megatron_lm_reads_them():
    """--train-data-path (Megatron-LM's per-split data): all of it trains, --valid-data-path validates,
    --split does not apply."""
    from benchmarks.megatron_lm_plugin import MEGATRON_LM, SHAPE, TRAINING

    ours = "--dst-anchor mean --dst-p 0.1 --batching sab --moba-block-size 128 --moba-topk 8".split()
    argv = SHAPE + TRAINING + ours + MEGATRON_LM + ["--train-iters", "2", "--train-data-path", "train_docs",
                                                    "--valid-data-path", "valid_docs", "--split", "90,10,0"]
    probe = ("import sys; from megatron_sparsebalance.megatron_lm import checked_config, parse_megatron_args; "
             "d = checked_config(parse_megatron_args(sys.argv[1:])).data; print('DATA', d.data_path, d.valid_data_path, d.split)")
    out = subprocess.run([sys.executable, "-c", probe, *argv], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0 and "DATA train_docs valid_docs None" in out.stdout, out.stdout[-2000:] + out.stderr[-4000:]


def test_megatron_lm_data_loader_flags_are_named_as_changing_nothing(capsys):
    """A launch script's --num-workers and --data-cache-path tune Megatron-LM's data loader, which
    SparseBalance's streams replace: taken, and named in a note rather than dropped without a word."""
    from benchmarks.megatron_lm_plugin import MEGATRON_LM, OURS, SHAPE, TRAINING
    from megatron_sparsebalance.megatron_lm import parse_megatron_args

    parse_megatron_args(SHAPE + TRAINING + OURS + MEGATRON_LM + ["--train-iters", "2", "--num-workers", "8",
                                                                "--data-cache-path", "/tmp/cache"])
    note = [ln for ln in capsys.readouterr().out.splitlines() if "change nothing" in ln]
    assert note and note[0].endswith("change nothing: --num-workers, --data-cache-path"), note


FLOPS_PROBE = """
import sys, types, torch
from megatron.core import parallel_state
from megatron.training.training import consume_seqlen_stats_in_iteration
from megatron_sparsebalance.data.synthetic import copy_task_batch
from megatron_sparsebalance.megatron_lm import forward_step, install, parse_megatron_args


class PerTokenLoss(torch.nn.Module):  # what forward_step calls: a GPT model's per-token loss
    config = types.SimpleNamespace(sequence_parallel=False)

    def forward(self, tokens, position_ids, attention_mask, labels=None, packed_seq_params=None):
        return torch.zeros(labels.shape, device=labels.device)


install()
parse_megatron_args(sys.argv[1:])
torch.distributed.init_process_group("nccl")
torch.cuda.set_device(0)
parallel_state.initialize_model_parallel()
model = PerTokenLoss()
batch = copy_task_batch([100, 300, 1000], 64, torch.Generator().manual_seed(0)).to("cuda")
forward_step(iter([batch]), model.train())
print("TRAIN", consume_seqlen_stats_in_iteration())
forward_step(iter([batch]), model.eval())
print("EVAL", consume_seqlen_stats_in_iteration())
"""


def test_megatron_lm_flops_count_reads_the_documents_of_each_pack():
    """Megatron-LM's FLOPs count (--log-throughput, the checkpoints' running total) prices each
    document of a THD pack (sum L, sum L^2) where its own THD path records them; without, every
    sample was priced as --seq-length tokens of one causal sequence. Evaluation is not counted."""
    from benchmarks.megatron_lm_plugin import MEGATRON_LM, OURS, SHAPE, TRAINING

    env = _one_rank_env()
    out = subprocess.run([sys.executable, "-c", FLOPS_PROBE, *SHAPE, *TRAINING, *OURS, *MEGATRON_LM,
                          "--train-iters", "2"], capture_output=True, text=True, timeout=300, env=env)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-4000:]
    assert "TRAIN (1400.0, 1100000.0)" in out.stdout and "EVAL (None, None)" in out.stdout, out.stdout[-2000:]


MODEL_PROBE = """
import sys, torch
from megatron.core import parallel_state, tensor_parallel
from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding
from megatron_sparsebalance.megatron_lm import install, model_provider, parse_megatron_args
install()
args = parse_megatron_args(sys.argv[1:])
torch.distributed.init_process_group("nccl")
torch.cuda.set_device(0)
parallel_state.initialize_model_parallel()
tensor_parallel.model_parallel_cuda_manual_seed(args.seed)
model = model_provider()
rope = model.rotary_pos_emb
expect = RotaryEmbedding(args.kv_channels, 1.0, seq_len_interpolation_factor=4, rotary_base=args.rotary_base,
                         rope_scaling=True, rope_scaling_factor=16.0)
print("ROPE", rope.seq_len_interpolation_factor, torch.equal(rope.inv_freq, expect.inv_freq))
print("QK", type(model.decoder.layers[0].self_attention.q_layernorm).__name__)
norms = [model.decoder.layers[0].input_layernorm, model.decoder.layers[0].pre_mlp_layernorm, model.decoder.final_layernorm]
print("NORM", *sorted({type(n).__name__ for n in norms}), all(torch.count_nonzero(n.weight) == 0 for n in norms))
"""


def test_megatron_lm_rope_and_norm_flags_reach_the_model():
    """--rotary-seq-len-interpolation-factor, --rope-scaling-factor (with --use-rope-scaling),
    --qk-l2-norm and --apply-layernorm-1p are the model's: Megatron-LM 0.19's own GPT builder keeps
    the default factor 8, its local spec drops --qk-l2-norm, and its torch norms refuse 1p."""
    from benchmarks.megatron_lm_plugin import MEGATRON_LM, OURS, SHAPE, TRAINING

    argv = SHAPE + TRAINING + OURS + MEGATRON_LM + [
        "--train-iters", "2", "--rotary-seq-len-interpolation-factor", "4", "--use-rope-scaling",
        "--rope-scaling-factor", "16", "--qk-l2-norm", "--apply-layernorm-1p"]
    env = _one_rank_env()
    out = subprocess.run([sys.executable, "-c", MODEL_PROBE, *argv], capture_output=True, text=True, timeout=300,
                         env=env)
    assert out.returncode == 0 and "ROPE 4 True" in out.stdout, out.stdout[-2000:] + out.stderr[-4000:]
    assert "QK L2Norm" in out.stdout, out.stdout[-2000:]
    assert "NORM ZeroCenteredRMSNorm True" in out.stdout, out.stdout[-2000:]  # SHAPE's --normalization RMSNorm


def _losses(stdout: str) -> list:
    return [float(ln.split("lm loss:")[1].split("|")[0]) for ln in stdout.splitlines()
            if " iteration " in ln and "lm loss:" in ln]


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
def test_megatron_lm_loop_with_qk_layernorm_at_tp2_with_sequence_parallel_equals_tp1(tmp_path):
    """--qk-layernorm (Qwen3's q/k norms) under --sequence-parallel: megatron-core's torch norm
    refuses sequence parallelism, ours builds it; with the same initial weights
    (--use-cpu-initialization) and a fixed budget, TP=2 trains as TP=1 does."""
    from benchmarks.megatron_lm_plugin import MEGATRON_LM, SHAPE, TRAINING

    fixed = ("--mock-data --mock-length-distribution longtail --batching none --moba-block-size 128 "
             "--moba-topk 8 --qk-layernorm --use-cpu-initialization --train-iters 4 --lr-decay-iters 4").split()
    losses = {}
    for tp, extra in ((1, []), (2, ["--tensor-model-parallel-size", "2", "--sequence-parallel"])):
        cmd = _entry(tp, *SHAPE, *TRAINING, *MEGATRON_LM, *fixed, *extra)
        # Megatron-LM asserts it under tensor parallelism; its launch scripts export it.
        env = {**os.environ, "CUDA_DEVICE_MAX_CONNECTIONS": "1"}
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=env)
        assert out.returncode == 0, out.stdout[-4000:] + out.stderr[-4000:]
        losses[tp] = _losses(out.stdout)
    assert len(losses[1]) == len(losses[2]) == 4, losses
    assert all(abs(a - b) <= 1e-3 * a for a, b in zip(losses[1], losses[2])), losses


def test_megatron_lm_reruns_replay_the_global_batch_and_the_balancer_learns_once(tmp_path):
    """Megatron-LM's rerun state machine reruns an iteration whose validated result it rejects (here
    an injected rejection of --check-for-spiky-loss, which our loss checks as Megatron-LM's own GPT
    loss does): the rerun gets the same global batch and plans, training continues with its
    gradients, and the balancer learns once, so the run equals one without the rerun."""
    from benchmarks.megatron_lm_plugin import MEGATRON_LM, OURS, SHAPE, TRAINING

    rows, logs = {}, {}
    for name, inject in (("straight", []), ("rerun", ["--error-injection-rate", "1", "--error-injection-type",
                                                        "correct_result"])):
        save = tmp_path / name
        argv = SHAPE + TRAINING + OURS + MEGATRON_LM + [
            "--train-iters", "4", "--lr-decay-iters", "4", "--save", str(save), "--save-interval", "100",
            "--check-for-spiky-loss", "--no-check-for-nan-in-loss-and-grad", *inject]
        cmd = _entry(1, *argv)
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
        logs[name] = out.stdout + out.stderr
        assert out.returncode == 0, logs[name][-6000:]
        rows[name] = [json.loads(ln) for ln in open(save / "sparsebalance_metrics.jsonl")]
    assert "First rerun: unexpected result is reproducible" in logs["rerun"], logs["rerun"][-6000:]
    assert "First rerun" not in logs["straight"]
    assert [r["iteration"] for r in rows["rerun"]] == [1, 2, 3, 4]
    assert [r["lm_loss_hex"] for r in rows["rerun"]] == [r["lm_loss_hex"] for r in rows["straight"]]
    assert [r["sb_mean_budget"] for r in rows["rerun"]] == [r["sb_mean_budget"] for r in rows["straight"]]


@pytest.mark.parametrize("ckpt_format", ["torch_dist", "torch"])
def test_megatron_lm_resumes_the_distributed_optimizer_bit_for_bit(tmp_path, ckpt_format):
    """--use-distributed-optimizer (with --overlap-grad-reduce and --overlap-param-gather, as
    Megatron-LM's Llama scripts run it) saved by Megatron-LM's loop and resumed by its own
    load_checkpoint: over torch's Adam (no Transformer Engine, no apex) the resume stopped at
    megatron-core's step assertion, and would have restarted Adam's bias correction
    (compat.mend_optimizer_loading). The resumed iterations equal the straight run's to the bit,
    in Megatron-LM's default format and in its legacy one (whose optimizer state loads through
    load_state_dict, then load_parameter_state)."""
    from benchmarks.megatron_lm_plugin import MEGATRON_LM, OURS, SHAPE, TRAINING

    dp = min(torch.cuda.device_count(), 2)
    common = SHAPE + TRAINING + OURS + MEGATRON_LM + [
        "--use-distributed-optimizer", "--overlap-grad-reduce", "--overlap-param-gather", "--ckpt-format", ckpt_format,
        "--train-iters", "4", "--lr-decay-iters", "4", "--save-interval", "100"]

    def run(save, *extra):
        cmd = _entry(dp, *common, "--save", str(save), *extra)
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
        assert out.returncode == 0, out.stdout[-4000:] + out.stderr[-4000:]
        return out.stdout

    run(tmp_path / "straight")
    run(tmp_path / "halves", "--exit-interval", "2")
    resumed = run(tmp_path / "halves", "--load", str(tmp_path / "halves"))
    assert "successfully loaded checkpoint" in resumed, resumed[-4000:]
    rows = {name: [json.loads(ln) for ln in open(tmp_path / name / "sparsebalance_metrics.jsonl")]
            for name in ("straight", "halves")}
    assert [r["iteration"] for r in rows["halves"]] == [1, 2, 3, 4]
    assert [r["lm_loss_hex"] for r in rows["halves"]] == [r["lm_loss_hex"] for r in rows["straight"]]


def test_megatron_lm_resumes_from_a_non_persistent_checkpoint_bit_for_bit(tmp_path):
    """--non-persistent-save-interval with --non-persistent-ckpt-type global: our state goes into the
    non-persistent checkpoint Megatron-LM writes (not into --save's directories, where it left
    iteration directories without Megatron-LM's files), and a run that dies after it, before any
    persistent checkpoint, resumes from it (Megatron-LM's choice) to the straight run's losses."""
    import shutil

    from benchmarks.megatron_lm_plugin import MEGATRON_LM, OURS, SHAPE, TRAINING
    from megatron_sparsebalance.megatron_lm import METRICS_FILE, STATE_FILE

    common = SHAPE + TRAINING + OURS + MEGATRON_LM + ["--train-iters", "4", "--lr-decay-iters", "4",
                                                     "--save-interval", "100"]

    def run(save, *extra):
        cmd = _entry(1, *common, "--save", str(save), *extra)
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
        assert out.returncode == 0, out.stdout[-4000:] + out.stderr[-4000:]
        return out.stdout

    non_persistent = ["--non-persistent-save-interval", "2", "--non-persistent-ckpt-type", "global"]
    run(tmp_path / "straight")
    save = tmp_path / "died"
    run(save, "--exit-interval", "3", *non_persistent)
    assert (save / "non_persistent" / "iter_0000002" / STATE_FILE).is_file()
    assert not (save / "iter_0000002").exists()  # nothing of a non-persistent checkpoint among the persistent ones
    # The run dies after its third iteration, before the persistent checkpoint of its exit is written.
    shutil.rmtree(save / "iter_0000003")
    (save / "latest_checkpointed_iteration.txt").unlink()
    resumed = run(save, "--load", str(save), *non_persistent)
    assert "non-persistent" in resumed.lower(), resumed[-4000:]
    straight = [json.loads(ln) for ln in open(tmp_path / "straight" / METRICS_FILE)]
    died = [json.loads(ln) for ln in open(save / METRICS_FILE)]
    assert [r["iteration"] for r in died] == [1, 2, 3, 3, 4]
    assert [r["lm_loss_hex"] for r in died[3:]] == [r["lm_loss_hex"] for r in straight[2:]]


def test_megatron_lm_loop_trains_under_torch_fsdp2_and_megatron_fsdp_as_under_ddp():
    """Megatron-LM's two FSDP wrappers in place of its DDP (DP=1 here; the parameters sharded over
    DP where there are more GPUs): our schedule and core attention train through them, to the losses
    of DDP's run within what the gradients' other accumulation moves (three iterations)."""
    import re

    from benchmarks.megatron_lm_plugin import MEGATRON_LM, OURS, SHAPE, TRAINING

    env = {k: v for k, v in os.environ.items() if k != "CUDA_DEVICE_MAX_CONNECTIONS"}  # FSDP asserts it unset
    losses = {}
    for name, extra in (("ddp", []), ("torch_fsdp2", ["--use-torch-fsdp2"]),
                        ("megatron_fsdp", ["--use-megatron-fsdp", "--ckpt-format", "fsdp_dtensor"])):
        cmd = _entry(1, *SHAPE, *TRAINING, *OURS, *MEGATRON_LM,
                     "--train-iters", "3", "--lr-decay-iters", "3", *extra)
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=env)
        assert out.returncode == 0, out.stdout[-4000:] + out.stderr[-4000:]
        losses[name] = [float(x) for x in re.findall(r"lm loss: ([0-9.E+-]+)", out.stdout)]
        assert len(losses[name]) == 3, out.stdout[-4000:]
    for name in ("torch_fsdp2", "megatron_fsdp"):
        assert losses[name][0] == losses["ddp"][0]  # the same weights and batch before any update
        assert losses[name] == pytest.approx(losses["ddp"], abs=2e-4), (name, losses)
