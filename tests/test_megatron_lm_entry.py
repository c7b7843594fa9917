"""The Megatron-LM entry where megatron.training is missing (megatron-core 0.16, CI) and the parts of
it that need no training loop: our flags added to Megatron-LM's parser, our config read back."""
import argparse
import subprocess
import sys

import pytest

from megatron_sparsebalance.compat import HAVE_MEGATRON_TRAINING, MEGATRON_CORE


@pytest.mark.skipif(HAVE_MEGATRON_TRAINING and MEGATRON_CORE >= (0, 19), reason="megatron.training is installed")
def test_without_megatron_training_the_entry_says_which_entry_to_use():
    out = subprocess.run([sys.executable, "-m", "megatron_sparsebalance.megatron_lm", "--num-layers", "2"],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 2
    assert "megatron_sparsebalance.pretrain" in out.stderr and "0.19" in out.stderr


def test_extra_args_provider_adds_only_the_flags_megatron_lm_lacks():
    from megatron_sparsebalance.megatron_lm import add_sparsebalance_args

    parser = argparse.ArgumentParser()
    # Flags Megatron-LM owns (a few of them): ours must not redefine them.
    for flag in ("--seq-length", "--mock-data", "--seed", "--data-path"):
        parser.add_argument(flag)
    add_sparsebalance_args(parser)
    args = parser.parse_args(["--dst-anchor", "max", "--dst-p", "0.2", "--moba-topk", "16", "--batching", "lbb",
                              "--mock-length-distribution", "bimodal", "--seq-length", "4096"])
    assert (args.dst_anchor, args.dst_p, args.moba_topk, args.batching) == ("max", 0.2, 16, "lbb")
    assert args.mock_length_distribution == "bimodal" and args.seq_length == "4096"
    # Megatron-LM's own training flags are not ours to add.
    for name in ("train_iters", "micro_batch_size", "lr", "pipeline_model_parallel_size", "save"):
        assert not hasattr(args, name), name


def test_what_the_plugin_cannot_run_is_refused_by_name():
    from types import SimpleNamespace

    from megatron_sparsebalance.megatron_lm import _refuse_what_we_cannot_run

    fine = dict(virtual_pipeline_model_parallel_size=None, context_parallel_size=1, use_legacy_models=False,
                dataloader_type=None, decoder_pipeline_split="even", attention_dropout=0.0,
                variable_micro_batches=False, calculate_per_token_loss=False, rampup_batch_size=None,
                step_batch_size_schedule=None, decrease_batch_size_if_needed=False,
                attention_backend=SimpleNamespace(name="auto"), position_embedding_type="rope", num_experts=None,
                multi_latent_attention=False, mtp_num_layers=None, heterogeneous_layers_config_path=None,
                experimental_attention_variant=None, spec=None, num_layers=4, window_size=None,
                window_attn_skip_freq=None, softmax_type="vanilla", transformer_impl="local",
                layernorm_zero_centered_gamma=False, normalization="RMSNorm", global_batch_size=16,
                micro_batch_size=2)
    _refuse_what_we_cannot_run(SimpleNamespace(**fine))
    # Every layer is checked: a --window-attn-skip-freq pattern that makes each layer full attention uses no window.
    _refuse_what_we_cannot_run(SimpleNamespace(**{**fine, "window_size": (64, 0), "window_attn_skip_freq": [0] * 4}))
    # FP8 runs in Transformer Engine's layers (its linear layers; the core attention stays ours, in bf16).
    _refuse_what_we_cannot_run(SimpleNamespace(**{**fine, "fp8": "hybrid", "transformer_impl": "transformer_engine"}))
    # --apply-layernorm-1p: Transformer Engine's norms centre gamma, and so do the local spec's (ours).
    for impl in ("transformer_engine", "local"):
        _refuse_what_we_cannot_run(SimpleNamespace(**{**fine, "layernorm_zero_centered_gamma": True,
                                                       "transformer_impl": impl}))
    for change, flag in ((dict(virtual_pipeline_model_parallel_size=2), "--num-layers-per-virtual-pipeline-stage"),
                         (dict(context_parallel_size=2), "--context-parallel-size"),
                         (dict(dataloader_type="cyclic"), "--dataloader-type cyclic"),
                         (dict(decoder_pipeline_split="auto"), "--decoder-pipeline-split auto"),
                         (dict(attention_dropout=0.1), "--attention-dropout 0.1"),
                         (dict(variable_micro_batches=True), "--calculate-per-token-loss"),
                         (dict(rampup_batch_size=[16, 8, 1000]), "--rampup-batch-size"),
                         (dict(step_batch_size_schedule="0:16 1K:32"), "--step-batch-size-schedule"),
                         (dict(decrease_batch_size_if_needed=True), "--decrease-batch-size-if-needed"),
                         (dict(attention_backend=SimpleNamespace(name="flash")), "--attention-backend flash selects"),
                         (dict(position_embedding_type="yarn"), "--position-embedding-type yarn is not supported"),
                         (dict(num_experts=8), "--num-experts"),
                         (dict(multi_latent_attention=True), "--multi-latent-attention"),
                         (dict(mtp_num_layers=1), "--mtp-num-layers"),
                         (dict(heterogeneous_layers_config_path="h.json"), "--heterogeneous-layers-config-path"),
                         (dict(experimental_attention_variant="gated_delta_net"), "--experimental-attention-variant"),
                         (dict(spec=["my_specs", "layer_spec"]), "--spec"),
                         (dict(window_size=(64, 0), window_attn_skip_freq=4), r"--window-size \(64, 0\) \(layer 1\)"),
                         (dict(softmax_type="learnable"), "--softmax-type learnable"),
                         (dict(transformer_impl="inference_optimized"), "--transformer-impl inference_optimized"),
                         (dict(phase_transition_iterations="100,200"), "--phase-transition-iterations"),
                         (dict(defer_embedding_wgrad_compute=True), "--defer-embedding-wgrad-compute"),
                         (dict(non_persistent_ckpt_type="local"), "--non-persistent-ckpt-type local"),
                         (dict(inprocess_restart=True), "--inprocess-restart"),
                         (dict(eval_global_batch_size=32, global_batch_size=16), "--eval-global-batch-size"),
                         (dict(eval_micro_batch_size=1, micro_batch_size=2), "--eval-micro-batch-size"),
                         (dict(fp8="hybrid"), "--fp8-format hybrid"),
                         (dict(fp4="e2m1"), "--fp4-format e2m1"),
                         (dict(test_data_path=["test_docs"]), "--test-data-path"),
                         (dict(data_args_path="paths.txt"), "--data-args-path"),
                         (dict(sft=True), "--sft"),
                         (dict(fim_data=True), "--fim-data"),
                         (dict(multiple_validation_sets=True), "--multiple-validation-sets"),
                         (dict(cuda_graph_impl="local"), "--cuda-graph-impl local"),
                         (dict(enable_cuda_graph=True), "--enable-cuda-graph")):
        with pytest.raises(ValueError, match=flag):
            _refuse_what_we_cannot_run(SimpleNamespace(**{**fine, **change}))


def test_our_state_lies_in_the_checkpoint_megatron_lm_writes_and_reads(tmp_path):
    """Our state goes into the iteration directory of the checkpoint Megatron-LM saves, persistent
    (--save) or non-persistent (--non-persistent-global-ckpt-dir, else <save>/non_persistent), and is
    read from the one Megatron-LM loaded: the non-persistent checkpoint where its tracker names the
    loaded iteration, else --load's."""
    from types import SimpleNamespace

    from megatron_sparsebalance.megatron_lm import STATE_FILE, _state_dir_to_save, _state_path_to_load

    save = str(tmp_path / "ckpt")
    args = SimpleNamespace(save=save, load=save, non_persistent_global_ckpt_dir=None,
                           non_persistent_ckpt_type="global", iteration=30)
    assert _state_dir_to_save(args, 20, non_persistent=False) == f"{save}/iter_0000020"
    assert _state_dir_to_save(args, 30, non_persistent=True) == f"{save}/non_persistent/iter_0000030"
    scratch = str(tmp_path / "scratch")
    elsewhere = SimpleNamespace(**{**vars(args), "non_persistent_global_ckpt_dir": scratch})
    assert _state_dir_to_save(elsewhere, 30, non_persistent=True) == f"{scratch}/iter_0000030"

    # No non-persistent tracker: Megatron-LM loaded --load's checkpoint.
    assert _state_path_to_load(args) == f"{save}/iter_0000030/{STATE_FILE}"
    (tmp_path / "ckpt" / "non_persistent").mkdir(parents=True)
    tracker = tmp_path / "ckpt" / "non_persistent" / "latest_checkpointed_iteration.txt"
    tracker.write_text("30")
    assert _state_path_to_load(args) == f"{save}/non_persistent/iter_0000030/{STATE_FILE}"
    tracker.write_text("25")  # older than the persistent one Megatron-LM then loaded
    assert _state_path_to_load(args) == f"{save}/iter_0000030/{STATE_FILE}"
    tracker.write_text("30")
    assert _state_path_to_load(SimpleNamespace(**{**vars(args), "non_persistent_ckpt_type": None})) == \
        f"{save}/iter_0000030/{STATE_FILE}"
    (tmp_path / "scratch").mkdir()
    (tmp_path / "scratch" / "latest_checkpointed_iteration.txt").write_text("30")
    assert _state_path_to_load(elsewhere) == f"{scratch}/iter_0000030/{STATE_FILE}"


def test_megatron_lm_tokenizers_read_token_files_and_text_needs_ours():
    """Any of Megatron-LM's tokenizer types works with token files (our data reads ids; the EOD
    comes from Megatron-LM's tokenizer); .jsonl text with a type we cannot tokenize with is refused
    by name."""
    from types import SimpleNamespace

    from megatron_sparsebalance.megatron_lm import _token_source

    def args(tokenizer_type, data_path, mock_data=False):
        return SimpleNamespace(tokenizer_type=tokenizer_type, data_path=data_path, valid_data_path=None,
                               mock_data=mock_data)

    assert _token_source(args("GPT2BPETokenizer", ["corpus_text_document"])) == dict(tokenizer_type=None,
                                                                                   tokenizer_model=None)
    assert _token_source(args("Llama2Tokenizer", None, mock_data=True)) == dict(tokenizer_type=None,
                                                                              tokenizer_model=None)
    assert _token_source(args("HuggingFaceTokenizer", ["a.jsonl"])) == {}  # ours: its fields pass as they are
    assert _token_source(args("NullTokenizer", ["corpus"])) == {}
    with pytest.raises(ValueError, match="--tokenizer-type SentencePieceTokenizer with .jsonl text"):
        _token_source(args("SentencePieceTokenizer", ["a.jsonl"]))


def test_data_loader_flags_are_found_as_megatron_lms_parser_reads_them():
    """The flags named in the note (they tune Megatron-LM's data loader, which is not built here),
    found in a command line as Megatron-LM's parser reads it: whole names, ``--flag value`` or
    ``--flag=value``, no abbreviations."""
    from megatron_sparsebalance.megatron_lm import DATA_LOADER_FLAGS, _given_flags

    argv = ["--num-workers", "8", "--data-cache-path=/cache", "--no-mmap-bin-files", "--num-workers-extra", "1",
            "--data-path", "docs", "--num-dataset-builder", "4"]
    assert _given_flags(argv, DATA_LOADER_FLAGS) == ["--num-workers", "--data-cache-path", "--no-mmap-bin-files"]
    assert _given_flags(["--data-path", "docs"], DATA_LOADER_FLAGS) == []
