"""Checkpoints: megatron-core ``dist_checkpointing`` in Megatron-LM's directory layout.

::

    <save>/iter_0000100/                      one checkpoint (dist_checkpointing format)
        sharded: model (and optimizer) state, resharded on load to any TP/PP layout
        common:  iteration, resolved config, LR scheduler, sampler + SAB estimator, latency
                 model calibration, DST's coverage floor, format tag, the TP/PP/DP layout
        rng_rank<r>.pt                        each rank's RNG states
        <name>_rank<r>.pt                     optional per-rank state (e.g. dp_comm: DiLoCo/SparseLoCo)
        complete                              written last: the checkpoint is whole
    <save>/latest_checkpointed_iteration.txt  the newest complete checkpoint, replaced atomically

The sharded state loads at any TP x PP layout (saved at TP=2 x PP=2, loaded at TP=1 x PP=4 and
back). The per-rank files belong to the layout that wrote them: rank r of another layout is
another part of the model, so on a resharded load the RNG states are not restored (a resharded
run cannot repeat the saved one bitwise anyway: its reductions differ) and a per-rank state
(``dp_comm``) is refused by name.

A crash mid-save leaves a directory without ``complete`` and an unchanged
``latest_checkpointed_iteration.txt``: the half-written checkpoint is never loaded.
"""
from __future__ import annotations

import os
import random
import shutil
from typing import Any, Optional

import numpy as np
import torch
import torch.distributed as dist
from megatron.core import dist_checkpointing
from megatron.core.utils import unwrap_model

from megatron_sparsebalance.compat import (finish_optimizer_load, optimizer_sharded_state_dict,
                                           optimizer_state_reshards_over_tp_pp, prepare_optimizer_for_load,
                                           torch_dist_save_strategy)

FORMAT = "megatron-sparsebalance/1"
LATEST = "latest_checkpointed_iteration.txt"
COMPLETE = "complete"


def iteration_dir(root: str, iteration: int) -> str:
    return os.path.join(root, f"iter_{iteration:07d}")


def _barrier():
    if dist.is_initialized():
        dist.barrier()


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def parallel_layout() -> dict:
    """This process's model-parallel layout (all 1 without megatron's groups)."""
    from megatron.core import parallel_state

    if not parallel_state.model_parallel_is_initialized():
        return {"tp": 1, "pp": 1, "dp": 1}
    return {"tp": parallel_state.get_tensor_model_parallel_world_size(),
            "pp": parallel_state.get_pipeline_model_parallel_world_size(),
            "dp": parallel_state.get_data_parallel_world_size()}


def saved_layout(path: str) -> Optional[dict]:
    """The layout checkpoint ``path`` was saved at (None for checkpoints from before it was recorded)."""
    return dist_checkpointing.load_common_state_dict(path).get("common", {}).get("layout")


def rng_state() -> dict:
    state = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def set_rng_state(state: dict) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if torch.cuda.is_available() and "cuda" in state:
        torch.cuda.set_rng_state(state["cuda"])


def save_checkpoint(root: str, iteration: int, model, optimizer=None, common: Optional[dict] = None,
                    rank_files: Optional[dict] = None) -> str:
    """Save on every rank (collective); returns the checkpoint directory.

    ``model`` may be wrapped (DDP, Float16Module); ``common`` holds picklable state that is the
    same on every rank (rank 0's copy is written); ``rank_files`` maps a name to this rank's own
    state, written as ``<name>_rank<r>.pt`` before the completion marker.
    """
    path = iteration_dir(root, iteration)
    if _rank() == 0:
        if os.path.exists(path):  # a stale, incomplete attempt at the same iteration
            shutil.rmtree(path)
        os.makedirs(path)
    _barrier()
    model_sd = unwrap_model(model).sharded_state_dict()
    state: dict[str, Any] = {"model": model_sd}
    if optimizer is not None:
        state["optimizer"] = optimizer_sharded_state_dict(optimizer, model_sd)
    state["common"] = {"format": FORMAT, "iteration": iteration, "layout": parallel_layout(), **(common or {})}
    dist_checkpointing.save(state, path, sharded_strategy=torch_dist_save_strategy())
    torch.save(rng_state(), os.path.join(path, f"rng_rank{_rank()}.pt"))
    for name, value in (rank_files or {}).items():
        torch.save(value, rank_file(path, name))
    _barrier()
    if _rank() == 0:
        open(os.path.join(path, COMPLETE), "w").close()
        tmp = os.path.join(root, LATEST + ".tmp")
        with open(tmp, "w") as f:
            f.write(f"{iteration}\n")
        os.replace(tmp, os.path.join(root, LATEST))  # atomic: readers see the old or the new file
    _barrier()
    return path


def rank_file(path: str, name: str) -> str:
    """Where this rank's ``name`` state lives in checkpoint ``path``."""
    return os.path.join(path, f"{name}_rank{_rank()}.pt")


def load_rank_file(path: str, name: str) -> Optional[Any]:
    """This rank's ``name`` state from checkpoint ``path``, or None if the checkpoint has none.

    Refused when the checkpoint was saved at another TP/PP/DP layout: its rank r held another part."""
    f = rank_file(path, name)
    if not os.path.exists(f):
        return None
    layout = saved_layout(path)
    if layout is not None and layout != parallel_layout():
        raise ValueError(f"{path} holds per-rank '{name}' state saved at {layout}; this run is {parallel_layout()}: "
                         f"that state cannot be resharded (load with --no-load-optim, or at the saved "
                         "--tensor-model-parallel-size / --pipeline-model-parallel-size and world size)")
    return torch.load(f, weights_only=False)


def latest_checkpoint(root: str) -> Optional[str]:
    """The newest complete checkpoint under ``root`` (a ``--save``/``--load`` directory), or None.

    ``root`` may also be one checkpoint directory itself (it has ``complete``).
    """
    if os.path.exists(os.path.join(root, COMPLETE)):
        return root
    latest = os.path.join(root, LATEST)
    if not os.path.exists(latest):
        return None
    with open(latest) as f:
        path = iteration_dir(root, int(f.read().strip()))
    if not os.path.exists(os.path.join(path, COMPLETE)):
        newest = newest_complete_checkpoint(root)
        raise ValueError(
            f"--load {root}: {LATEST} names {path}, which is not a complete checkpoint (deleted or torn); "
            + (f"the newest complete checkpoint there is {newest}: write its iteration into {LATEST}, or "
               f"pass --load {newest}" if newest else "there is no complete checkpoint there"))
    return path


def newest_complete_checkpoint(root: str) -> Optional[str]:
    """The ``iter_*`` directory under ``root`` with the highest iteration that is complete, or None."""
    best = None
    for name in os.listdir(root) if os.path.isdir(root) else ():
        if name.startswith("iter_") and name[5:].isdigit() and os.path.exists(os.path.join(root, name, COMPLETE)):
            if best is None or int(name[5:]) > int(best[5:]):
                best = name
    return os.path.join(root, best) if best else None


def missing_tracker_warning(root: str) -> Optional[str]:
    """Megatron-LM's warning for a --load directory without ``latest_checkpointed_iteration.txt``
    (the run then starts from scratch), or None when there is one."""
    if os.path.exists(os.path.join(root, COMPLETE)) or os.path.exists(os.path.join(root, LATEST)):
        return None
    newest = newest_complete_checkpoint(root)
    return (f"could not find the metadata file {os.path.join(root, LATEST)}; will not load any checkpoint and will "
            "start from random (iteration 1)"
            + (f". {newest} is complete: pass --load {newest} to resume from it" if newest else ""))


def load_checkpoint(path: str, model, optimizer=None, strict: bool = True, optimizer_state: bool = True) -> dict:
    """Load model (and optimizer) state into ``model``; returns the checkpoint's common state.

    The model may have another TP/PP layout than the one that saved: dist_checkpointing reshards.
    With ``optimizer`` and ``optimizer_state`` its state and the RNG states are restored too (a
    resume); with ``optimizer_state=False`` only the weights are loaded and the optimizer's main
    weights are refreshed from them: in bf16 the mixed-precision optimizer copied its fp32 main
    weights from the random initialization when it was built, and its first step would write those
    back over the loaded weights (a fine-tuning run that silently starts from scratch). Megatron-LM
    refreshes them the same way.
    """
    if not os.path.exists(os.path.join(path, COMPLETE)):
        raise ValueError(f"{path} is not a complete checkpoint (no '{COMPLETE}' marker)")
    resume = optimizer is not None and optimizer_state
    inner = unwrap_model(model)
    model_sd = inner.sharded_state_dict()
    request: dict[str, Any] = {"model": model_sd}
    common = dist_checkpointing.load_common_state_dict(path).get("common", {})
    if resume:
        saved, now = common.get("layout"), parallel_layout()
        if saved is not None and (saved["tp"], saved["pp"]) != (now["tp"], now["pp"]) \
                and not optimizer_state_reshards_over_tp_pp(optimizer):
            raise ValueError(f"--load {path}: the distributed optimizer's state was saved at TP={saved['tp']} "
                             f"PP={saved['pp']} and reshards only over DP on this megatron-core; resume at that "
                             "TP x PP, or pass --no-load-optim to load the weights alone")
        prepare_optimizer_for_load(optimizer)
        request["optimizer"] = optimizer_sharded_state_dict(optimizer, model_sd, is_loading=True)
    loaded = dist_checkpointing.load(request, path)
    if common.get("format") != FORMAT:
        raise ValueError(f"{path} is not a megatron-sparsebalance checkpoint (format {common.get('format')!r})")
    inner.load_state_dict(loaded["model"], strict=strict)
    if resume:
        with torch.no_grad():  # the distributed optimizer copies into its fp32 main params in place
            optimizer.load_state_dict(loaded["optimizer"])
        finish_optimizer_load(optimizer, loaded["optimizer"])
    elif optimizer is not None:
        optimizer.reload_model_params()
    rng = os.path.join(path, f"rng_rank{_rank()}.pt")
    same_layout = common.get("layout") in (None, parallel_layout())
    if resume and same_layout and os.path.exists(rng):
        set_rng_state(torch.load(rng, weights_only=False))
    return common
