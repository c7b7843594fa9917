"""Every difference between the megatron-core versions we run on, in one module.

Supported: megatron-core 0.16.1 (Python 3.11: the CPU machines and CI) and 0.17 - 0.19.x
(Python >= 3.12: the GPU machines; 0.19's wheel ships Megatron-LM's own ``megatron.training``).
The rest of the package imports what differs from here, so a new release is one module to read.

What changed between them, and where it matters to us:

- ``dist_checkpointing``'s ``torch_dist`` writer: 0.16 forks one process per bucket at every save
  (see :func:`torch_dist_save_strategy`); 0.17+ writes from threads, and its ``async_save``
  defaults to NVIDIA Resiliency Extension's queue, which a synchronous save does not need.
- ``ProcessGroupCollection``: 0.19 returns None for a declared group that was never set, and a
  None group means the whole world to torch.distributed (:func:`replica_local_process_groups`).
- the distributed optimizer's checkpoint layout: 0.16's default (flattened ranges) is refused
  by 0.19's ``ShardedTensor``; 0.17+ saves it resharding over DP only
  (:func:`optimizer_sharded_state_dict`, :func:`optimizer_state_reshards_over_tp_pp`).
- Not a version difference but megatron-core's own, 0.16 to 0.19: its distributed optimizer over
  torch's Adam (no Transformer Engine, no apex) cannot load a checkpoint into a fresh optimizer, and
  after loading holds a wrong, shared ``step`` (:func:`prepare_optimizer_for_load`, :func:`finish_optimizer_load`;
  around Megatron-LM's own loader, :func:`mend_optimizer_loading`, which also lets its legacy format's
  ``load_parameter_state`` load without a ``step`` to copy).
- ``initialize_model_parallel`` gained positional parameters after ``expert_model_parallel_size``
  in 0.19: :func:`initialize_model_parallel` passes keywords only.
- ``megatron.training`` exists from 0.19's wheel on (:data:`HAVE_MEGATRON_TRAINING`); its
  ``initialize_megatron`` rebuilds the dataset helpers with ``make``, which the wheel (whose
  helpers are prebuilt, and which has no Makefile) cannot do (:func:`use_prebuilt_dataset_helpers`).
- Not used by this package, so not wrapped here: ``schedules.backward_step`` lost ``model_type``
  (0.17), ``set_current_microbatch`` moved to ``transformer/cuda_graphs.py`` (0.17),
  ``ModelType.encoder_and_decoder`` is gone (0.17), ``get_batch_on_this_cp_rank`` takes
  ``is_hybrid_cp`` (0.18). Our schedule and data path do not call them.
"""
from __future__ import annotations

import contextlib
import functools
import importlib.util
import queue
from concurrent.futures import ThreadPoolExecutor

import torch
from megatron.core import package_info

MEGATRON_CORE_VERSION: str = package_info.__version__
MEGATRON_CORE: tuple = tuple(int(x) for x in MEGATRON_CORE_VERSION.split(".")[:2])
"""(major, minor) of the installed megatron-core."""

HAVE_MEGATRON_TRAINING: bool = importlib.util.find_spec("megatron.training") is not None
"""Megatron-LM's training package (``megatron.training``) is importable: 0.19's wheel, or a
Megatron-LM checkout on the path."""


# ---- checkpoints -----------------------------------------------------------------------------


def _forking_writer():
    """0.16's forking bucket writer, or None where the installed writer uses threads."""
    from megatron.core.dist_checkpointing.strategies.filesystem_async import FileSystemWriterAsync

    return getattr(FileSystemWriterAsync, "write_preloaded_data_multiproc", None)


def _write_buckets_in_this_process(transform_list, use_msc, rank, write_buckets, results_queue) -> None:
    """Write this rank's buckets from threads of the calling process, one per bucket as
    megatron-core 0.16 forks one process per bucket (the file writes release the GIL), and hand
    the results over as its forked writer does: one dict per save, or the first exception."""
    from megatron.core.dist_checkpointing.strategies.filesystem_async import FileSystemWriterAsync

    def write(index, bucket):
        done, count = queue.Queue(), queue.Queue()
        count.put(index)  # the writer takes one item off and marks it done, as its forked worker would
        FileSystemWriterAsync.write_preloaded_data(transform_list, index, bucket, done, count, use_fsync=True,
                                                   use_msc=use_msc)
        return done.get_nowait()[1]

    with ThreadPoolExecutor(max_workers=max(1, len(write_buckets))) as pool:
        written = list(pool.map(write, range(len(write_buckets)), write_buckets))
    failed = [w for w in written if isinstance(w, Exception)]
    results_queue.put(failed[0] if failed else dict(enumerate(written)))


@functools.lru_cache(maxsize=None)
def _in_process_strategy_class():
    from megatron.core.dist_checkpointing.strategies.torch import TorchDistSaveShardedStrategy

    multiproc = _forking_writer()

    class InProcessTorchDistSave(TorchDistSaveShardedStrategy):
        """megatron-core 0.16's ``torch_dist`` format, written by the calling process.

        0.16's writer forks one process per bucket at every save. A fork copies the locks that
        the parent's other threads (gloo, NCCL, queue feeders) hold at that instant, and a child
        that needs one waits forever, and so does its parent in ``count_queue.join()``: the CPU
        suite once hung there until CI's time ran out. 0.17 replaced the fork with threads; for
        0.16 the buckets are written here, one thread each. The files and the metadata are the
        same; only what writes them differs.
        """

        def __init__(self):
            super().__init__("torch_dist", 1)

        def save(self, sharded_state_dict, checkpoint_dir):
            request = self.async_save(sharded_state_dict, checkpoint_dir)
            if request.async_fn is not None:  # None: nothing to write on this rank
                forked = request.async_fn
                if getattr(forked, "func", None) is not multiproc:
                    raise RuntimeError(
                        f"megatron-core {MEGATRON_CORE_VERSION}'s torch_dist writer is not the one "
                        "InProcessTorchDistSave replaces (0.16's write_preloaded_data_multiproc)")
                request = request._replace(async_fn=functools.partial(_write_buckets_in_this_process, *forked.args))
            request.execute_sync()

    return InProcessTorchDistSave


def torch_dist_save_strategy():
    """A synchronous ``torch_dist`` save strategy that never forks the training process."""
    if _forking_writer() is not None:
        return _in_process_strategy_class()()
    from megatron.core.dist_checkpointing.strategies.torch import TorchDistSaveShardedStrategy

    # 0.17+: its synchronous ``save`` writes from threads of this process already.
    return TorchDistSaveShardedStrategy("torch_dist", 1)


def optimizer_sharded_state_dict(optimizer, model_sharded_state_dict, is_loading: bool = False):
    """The optimizer's ``dist_checkpointing`` state, in a layout this megatron-core can save and load.

    0.16's distributed optimizer defaults to ``fully_sharded_model_space`` (flattened ranges of
    each parameter), which 0.19's ``ShardedTensor`` refuses ("flattened_range is not supported").
    From 0.17 on we ask for ``dp_reshardable``, Megatron-LM's own default: ``fully_reshardable``
    would reshard over TP and PP too, but 0.19 cannot load it into torch's Adam (its per-parameter
    ``step`` tensor has no source: KeyError 'step'), which is the Adam we run without Transformer
    Engine or apex. A plain (non-distributed) optimizer ignores the metadata.
    """
    if MEGATRON_CORE < (0, 17):
        return optimizer.sharded_state_dict(model_sharded_state_dict, is_loading=is_loading)
    return optimizer.sharded_state_dict(model_sharded_state_dict, is_loading=is_loading,
                                        metadata={"distrib_optim_sharding_type": "dp_reshardable"})


def _distributed_optimizers_over_torch_adam(optimizer) -> list:
    """``(index, part)`` of each distributed optimizer among ``optimizer``'s parts (its chained
    optimizers, or itself) whose inner optimizer is torch's Adam/AdamW: where megatron-core runs
    without Transformer Engine and apex (their fused Adams keep ``step`` per param group)."""
    from megatron.core.optimizer import distrib_optimizer as dopt

    if getattr(dopt, "HAVE_APEX_OR_TE", True):
        return []
    parts = getattr(optimizer, "chained_optimizers", [optimizer])
    return [(i, p) for i, p in enumerate(parts) if isinstance(p, dopt.DistributedOptimizer)
            and isinstance(p.optimizer, (torch.optim.Adam, torch.optim.AdamW))]


def fill_empty_adam_state(adam) -> None:
    """Give every parameter of ``adam`` (torch's Adam/AdamW) the state its first step would create.

    Loading a distributed optimizer's checkpoint first calls ``load_state_dict(self.state_dict())``
    (0.16 and 0.19 alike), and without Transformer Engine or apex its ``state_dict`` reads ``step``
    from the per-parameter state and asserts a single value: a freshly built optimizer has none, so a
    resume fails on that assertion. Zeros and step 0 are what Adam's lazy init would write; the load
    then overwrites them (``step`` only through :func:`finish_optimizer_load`). Parameters that
    already have state are left alone.
    """
    for group in adam.param_groups:
        for param in group["params"]:
            state = adam.state[param]
            if state:
                continue
            state["step"] = torch.zeros((), dtype=torch.float32)
            state["exp_avg"] = torch.zeros_like(param, memory_format=torch.preserve_format)
            state["exp_avg_sq"] = torch.zeros_like(param, memory_format=torch.preserve_format)
            if group.get("amsgrad"):
                state["max_exp_avg_sq"] = torch.zeros_like(param, memory_format=torch.preserve_format)


def restore_adam_steps(adam, step: float) -> None:
    """Give every parameter of ``adam`` a ``step`` tensor of its own holding ``step``.

    What the distributed optimizer's load (without Transformer Engine or apex) leaves there is wrong
    twice: it hands every parameter the *same* tensor, which torch's Adam, incrementing each
    parameter's ``step`` in place, would advance once per parameter per iteration; and its
    ``dp_reshardable`` loader then copies into that tensor the ``step`` the state held when the
    load was requested (zero for a fresh optimizer), since the bucket state carries ``step`` as a
    local object. Either way the bias correction of every later update would differ from an
    unbroken run's. The checkpoint's own value is in its param groups.
    """
    for state in adam.state.values():
        if "step" in state:
            state["step"] = torch.tensor(float(step), dtype=torch.float32)


def prepare_optimizer_for_load(optimizer) -> None:
    """Before asking ``optimizer`` for the sharded state dict to load into: :func:`fill_empty_adam_state`."""
    for _, part in _distributed_optimizers_over_torch_adam(optimizer):
        fill_empty_adam_state(part.optimizer)


def finish_optimizer_load(optimizer, state_dict) -> None:
    """After ``optimizer.load_state_dict(state_dict)``: :func:`restore_adam_steps` with the step the
    checkpoint's param groups hold (one state dict per chained optimizer, as megatron-core loads them)."""
    targets = _distributed_optimizers_over_torch_adam(optimizer)
    if not targets:
        return
    if len(getattr(optimizer, "chained_optimizers", [optimizer])) == 1:
        states = [state_dict]
    else:
        states = [v for _, v in sorted(state_dict.items())] if isinstance(state_dict, dict) else list(state_dict)
    for i, part in targets:
        steps = {group["step"] for group in states[i]["optimizer"]["param_groups"]}
        if len(steps) != 1:
            raise ValueError(f"the checkpoint's optimizer param groups disagree on the step: {sorted(steps)}")
        restore_adam_steps(part.optimizer, steps.pop())


@contextlib.contextmanager
def _adam_steps_set_aside(optimizer):
    """The per-parameter ``step`` tensors of ``optimizer``'s torch Adams out of their states inside,
    put back as they were on leaving."""
    held = [(state, state.pop("step")) for _, part in _distributed_optimizers_over_torch_adam(optimizer)
            for state in part.optimizer.state.values() if "step" in state]
    try:
        yield
    finally:
        for state, step in held:
            state["step"] = step


def mend_optimizer_loading(optimizer):
    """``optimizer`` with :func:`prepare_optimizer_for_load` and :func:`finish_optimizer_load` around
    its own two loading calls, for a loader that is not ours: Megatron-LM's ``load_checkpoint``
    asks ``optimizer.sharded_state_dict(..., is_loading=True)`` for what to load, then calls
    ``optimizer.load_state_dict(...)``. Without it, Megatron-LM's own loop over torch's Adam (no
    Transformer Engine, no apex) stops at the first call's ``step`` assertion when it resumes, and
    would restart Adam's bias correction after the second. In Megatron-LM's legacy checkpoint format
    (``--ckpt-format torch``) a third call, ``load_parameter_state``, copies the saved tensors into
    every tensor of each parameter's state, and the saved ones have no ``step`` (megatron-core
    0.19.2: KeyError 'step'): it runs with the steps set aside, which the second call has already
    set right. Returned as it is where none of these faults can occur."""
    if not _distributed_optimizers_over_torch_adam(optimizer):
        return optimizer
    sharded_state_dict, load_state_dict = optimizer.sharded_state_dict, optimizer.load_state_dict
    load_parameter_state = getattr(optimizer, "load_parameter_state", None)

    @functools.wraps(sharded_state_dict)
    def sharded_state_dict_ready_to_load(*args, **kwargs):
        if kwargs.get("is_loading", False):
            prepare_optimizer_for_load(optimizer)
        return sharded_state_dict(*args, **kwargs)

    @functools.wraps(load_state_dict)
    def load_state_dict_with_steps(state_dict):
        load_state_dict(state_dict)
        finish_optimizer_load(optimizer, state_dict)

    optimizer.sharded_state_dict = sharded_state_dict_ready_to_load
    optimizer.load_state_dict = load_state_dict_with_steps
    if load_parameter_state is not None:
        @functools.wraps(load_parameter_state)
        def load_parameter_state_around_steps(*args, **kwargs):
            with _adam_steps_set_aside(optimizer):
                return load_parameter_state(*args, **kwargs)

        optimizer.load_parameter_state = load_parameter_state_around_steps
    return optimizer


def record_packed_lengths(cu_seqlens: torch.Tensor) -> None:
    """Add a THD pack's documents to what Megatron-LM's FLOPs count of the iteration reads
    (``sum L`` and ``sum L^2``: ``megatron.training.training.update_seqlen_stats_from_cu_seqlens``,
    0.19.2; on the device, no host sync). Where a release lacks it, Megatron-LM prices every sample
    as ``--seq-length`` tokens of one causal sequence and there is nothing to record."""
    from megatron.training import training

    update = getattr(training, "update_seqlen_stats_from_cu_seqlens", None)
    if update is not None:
        update(cu_seqlens)


def optimizer_state_reshards_over_tp_pp(optimizer) -> bool:
    """Whether ``optimizer``'s checkpointed state loads at another TP or PP size (see above)."""
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    parts = getattr(optimizer, "chained_optimizers", [optimizer])
    return MEGATRON_CORE < (0, 17) or not any(isinstance(o, DistributedOptimizer) for o in parts)


# ---- process groups --------------------------------------------------------------------------

# The data-parallel groups of a ProcessGroupCollection, as DDP and the distributed optimizer read
# them (the names that one version lacks are skipped).
_DATA_PARALLEL_GROUPS = ("dp", "dp_cp", "expt_dp", "intra_dp_cp", "intra_expt_dp", "dp_cp_gtp_remat",
                         "expt_dp_gtp_remat", "dp_cp_ag", "expt_dp_ag", "inter_dist_opt", "intra_dist_opt")


def replica_local_process_groups(own_group):
    """megatron-core's process groups with every data-parallel group replaced by ``own_group``.

    Built from every group parallel_state has, not from an empty collection: 0.19 answers None
    for a group never set, and torch.distributed takes a None group for the whole world, so a
    collection with only the groups we thought of would make DDP reduce over every rank.
    """
    from dataclasses import fields

    from megatron.core.process_groups_config import ProcessGroupCollection

    names = {f.name for f in fields(ProcessGroupCollection)}
    pg = ProcessGroupCollection.use_mpu_process_groups(
        required_pgs=[n for n in ("tp", "pp", "mp", "cp", "tp_cp", "ep", "expt_tp", "tp_ep", "tp_ep_pp", "embd",
                                  "pos_embd", "tp_dp_cp") if n in names])
    for name in _DATA_PARALLEL_GROUPS:
        if name in names:
            setattr(pg, name, own_group)
    return pg


def initialize_model_parallel(tensor_parallel_size: int, pipeline_parallel_size: int, **kwargs) -> None:
    """``parallel_state.initialize_model_parallel`` by keywords (0.19 inserted positional ones)."""
    from megatron.core import parallel_state

    parallel_state.initialize_model_parallel(tensor_model_parallel_size=tensor_parallel_size,
                                             pipeline_model_parallel_size=pipeline_parallel_size, **kwargs)


# ---- Megatron-LM's training package -----------------------------------------------------------


def use_prebuilt_dataset_helpers() -> None:
    """Make ``megatron.training``'s start-up use the dataset helpers the wheel ships prebuilt.

    ``initialize_megatron`` runs ``make -C megatron/core/datasets`` on rank 0 (``compile_helpers``);
    the wheel has no Makefile there, so ``make`` fails and the job exits. The helpers are already
    compiled in the wheel: checking that they import is all that start-up needs. Idempotent.
    """
    from megatron.core.datasets import utils

    if getattr(utils.compile_helpers, "_sparsebalance_prebuilt", False):
        return

    def compile_helpers():
        # Nothing to build. A dataset that needs the helpers and finds none (a source checkout
        # that was never built) fails at its own import with megatron-core's message.
        pass

    compile_helpers._sparsebalance_prebuilt = True
    utils.compile_helpers = compile_helpers


__all__ = ["HAVE_MEGATRON_TRAINING", "MEGATRON_CORE", "MEGATRON_CORE_VERSION", "fill_empty_adam_state",
           "finish_optimizer_load", "initialize_model_parallel", "mend_optimizer_loading",
           "optimizer_sharded_state_dict", "optimizer_state_reshards_over_tp_pp", "prepare_optimizer_for_load",
           "record_packed_lengths", "replica_local_process_groups", "restore_adam_steps",
           "torch_dist_save_strategy", "use_prebuilt_dataset_helpers"]
