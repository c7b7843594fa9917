"""``SparseCoreAttention``: MoBA block-sparse attention in megatron-core's ``core_attention`` slot.

Takes megatron's ``DotProductAttention`` constructor and ``forward`` signature, so a layer spec
can hold it in place of Megatron's own; accepts sbhd tensors and packed THD micro-batches
(``PackedSeqParams``), which Megatron's local attention refuses.

Shape legend: s sequence, b batch, T packed tokens, nq query heads, ng KV-head groups, d head dim.
"""
from __future__ import annotations

import math
from typing import Optional

import torch
from megatron.core.packed_seq_params import PackedSeqParams
from megatron.core.process_groups_config import ProcessGroupCollection
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.transformer_config import TransformerConfig
from megatron.core.transformer.utils import is_layer_window_attention
from megatron.core.utils import divide

from megatron_sparsebalance.attention.budget import LayerBudget, active_scope
from megatron_sparsebalance.attention.tensor_parallel import tensor_parallel_route_sync
from megatron_sparsebalance.attention.config import SparseAttentionConfig
from megatron_sparsebalance.ops.implementations import (
    attention_function,
    check_ds_buffer_request,
    check_request,
    check_stored_ds_runs,
    resolve_impl,
)
from megatron_sparsebalance.ops.layout import LayoutCache, uniform_cu_seqlens
from megatron_sparsebalance.ops.dense import dense_causal_attention
from megatron_sparsebalance.ops.sparse_attention import RouteStats, RouteSync, check_qkv, route


# Shared by all layers: they see the same cu_seqlens tensor for a micro-batch (ops/layout.py).
_LAYOUTS = LayoutCache()


def refuse_unbuilt_attention(config, layer_number: int) -> None:
    """Settings of megatron-core's core attention that SparseCoreAttention does not compute,
    refused by flag name: megatron's ``DotProductAttention`` reads them from the
    ``TransformerConfig`` and Megatron-LM takes them as flags, so without this check a layer
    would quietly compute another function. ``config``: a ``TransformerConfig``, or Megatron-LM's
    arguments (its flags carry the same field names), checked at ``layer_number`` (1-based)."""
    window = getattr(config, "window_size", None)
    if is_layer_window_attention(window, getattr(config, "window_attn_skip_freq", None), layer_number):
        raise ValueError(f"--window-size {window} (layer {layer_number}): sliding-window attention is not built into "
                         "the sparse core attention, which selects blocks over the whole causal prefix; drop "
                         "--window-size, or make the layer full attention with --window-attn-skip-freq")
    softmax_type = getattr(config, "softmax_type", "vanilla")
    if softmax_type != "vanilla":
        raise ValueError(f"--softmax-type {softmax_type}: the sparse attention kernels compute the plain softmax, "
                         "without an offset in its denominator; allowed: vanilla")
    for field, flag in (("qk_clip", "--qk-clip"), ("log_max_attention_logit", "--log-max-attention-logit")):
        if getattr(config, field, False):
            raise ValueError(f"{flag} reads each head's largest attention logit from the core attention, which the "
                             "sparse core attention does not report")


def _host_offsets(packed_seq_params: PackedSeqParams) -> Optional[torch.Tensor]:
    """A host copy of ``cu_seqlens_q``, when the micro-batch carries one.

    Packs built here (``PackedBatch.packed_seq_params``) have no padding and put the host copy of
    their offsets in ``cu_seqlens_q_padded``, where megatron's RoPE reads it. A padded-offsets
    tensor on the device (padding between sequences, as Transformer Engine uses) is not that
    copy; the layout then reads ``cu_seqlens_q`` back once per micro-batch instead.
    """
    host, offsets = packed_seq_params.cu_seqlens_q_padded, packed_seq_params.cu_seqlens_q
    if offsets.device.type == "cpu" or host is None or host.device.type != "cpu" or host.shape != offsets.shape:
        return None
    return host


class SparseCoreAttention(MegatronModule):
    """Block-sparse (or dense) causal core attention for megatron-core.

    The budget of the current micro-batch comes from an enclosing
    :func:`~megatron_sparsebalance.attention.budget.budget_scope` (DST), else from
    ``--moba-topk``. After each forward, :attr:`last_stats` holds the budget used and its
    coverage, and the enclosing scope's report receives the same record.
    """

    def __init__(
        self,
        config: TransformerConfig,
        layer_number: int,
        attn_mask_type: AttnMaskType,
        attention_type: str = "self",
        attention_dropout: Optional[float] = None,
        softmax_scale: Optional[float] = None,
        cp_comm_type: Optional[str] = None,
        pg_collection: Optional[ProcessGroupCollection] = None,
        sparse_config: Optional[SparseAttentionConfig] = None,
        model_query_groups: Optional[int] = None,
    ):
        super().__init__(config=config)
        self.sparse_config = (sparse_config or SparseAttentionConfig()).validate()
        if config.context_parallel_size != 1:
            raise ValueError("SparseCoreAttention does not support --context-parallel-size > 1 yet")
        if attention_type != "self":
            raise ValueError(f"SparseCoreAttention supports self-attention only, got attention_type={attention_type!r}")
        if attn_mask_type not in (AttnMaskType.causal, AttnMaskType.padding_causal):
            raise ValueError(f"SparseCoreAttention is causal attention; attn_mask_type={attn_mask_type} is not supported")
        dropout = config.attention_dropout if attention_dropout is None else attention_dropout
        if dropout and dropout > 0:
            raise ValueError(f"attention dropout is not supported by sparse attention (got {dropout}); set it to 0")
        self.layer_number = max(1, layer_number)
        self.attn_mask_type = attn_mask_type
        if pg_collection is None:
            pg_collection = ProcessGroupCollection.use_mpu_process_groups(required_pgs=["tp"])
        tp = pg_collection.tp.size()
        if config.num_attention_heads % config.num_query_groups:
            raise ValueError(
                f"--num-attention-heads ({config.num_attention_heads}) must be a multiple of "
                f"--num-query-groups ({config.num_query_groups})"
            )
        self.num_heads = divide(config.num_attention_heads, tp)
        self.num_groups = divide(config.num_query_groups, tp)
        self.route_sync = tensor_parallel_route_sync(pg_collection.tp, config.num_query_groups, model_query_groups)
        self.head_dim = config.kv_channels
        # --apply-query-key-layer-scaling leaves the attention function as it is: megatron's
        # DotProductAttention scales the half-precision product QK^T down by the layer number
        # (against overflow) and its fp32 softmax scales it back up. The kernels here accumulate
        # scores in fp32, so there is nothing to guard, and the scale stays the softmax scale.
        self.softmax_scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(self.head_dim)
        refuse_unbuilt_attention(config, self.layer_number)
        self.last_stats: Optional[RouteStats] = None
        # Megatron-LM's --deterministic-mode reaches us as the TransformerConfig field; ours as the flag.
        self.deterministic = bool(self.sparse_config.deterministic_mode or getattr(config, "deterministic_mode", False))
        if self.sparse_config.sparse_attention:
            cfg = self.sparse_config
            check_request(cfg.sparse_attn_impl, self.deterministic, cfg.moba_block_size)
            check_ds_buffer_request(cfg.sparse_attn_ds_buffer_gib, cfg.sparse_attn_impl, cfg.moba_block_size,
                                    self.head_dim)
        self._stored_ds_checked = False  # --sparse-attn-ds-buffer-gib against the device, at the first call

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        attention_mask: Optional[torch.Tensor],
        attn_mask_type: Optional[AttnMaskType] = None,
        attention_bias: Optional[torch.Tensor] = None,
        packed_seq_params: Optional[PackedSeqParams] = None,
    ) -> torch.Tensor:
        """Attention over ``query [s, b, nq, d]`` (or THD ``[T, nq, d]``); returns ``[s, b, nq*d]`` / ``[T, nq*d]``.

        ``attention_mask`` is not read: the mask is causal by construction (per sequence for
        THD packs), which is what Megatron passes for GPT.
        """
        if attention_bias is not None:
            raise ValueError("SparseCoreAttention does not support attention_bias")
        thd = packed_seq_params is not None and packed_seq_params.qkv_format == "thd"
        if thd:
            cu_seqlens = packed_seq_params.cu_seqlens_q
            cu_kv = packed_seq_params.cu_seqlens_kv
            # Megatron passes the same tensor for both; comparing values would stop the host every layer.
            if cu_kv is not None and cu_kv is not cu_seqlens and not torch.equal(cu_seqlens, cu_kv):
                raise ValueError("self-attention needs cu_seqlens_q == cu_seqlens_kv")
            q, k, v = (x.reshape(x.shape[0], x.shape[-2], x.shape[-1]) for x in (query, key, value))
            host_cu_seqlens = _host_offsets(packed_seq_params)
        else:
            s, b = query.shape[:2]
            q, k, v = (x.transpose(0, 1).reshape(b * s, x.shape[2], x.shape[3]) for x in (query, key, value))
            cu_seqlens = uniform_cu_seqlens(b, s, device=q.device)
            host_cu_seqlens = None
        check_qkv(q, k, v)
        out = self._attend(q.contiguous(), k.contiguous(), v.contiguous(), cu_seqlens, host_cu_seqlens)  # [T, nq, d]
        if thd:
            return out.reshape(out.shape[0], -1)
        return out.reshape(b, s, -1).transpose(0, 1).contiguous()

    def _attend(self, q, k, v, cu_seqlens, host_cu_seqlens=None) -> torch.Tensor:
        cfg = self.sparse_config
        if not cfg.sparse_attention:
            return dense_causal_attention(q, k, v, cu_seqlens, self.softmax_scale, host_cu_seqlens)
        impl = resolve_impl(cfg.sparse_attn_impl, q.device, self.deterministic, cfg.moba_block_size)
        if cfg.sparse_attn_ds_buffer_gib > 0 and not self._stored_ds_checked:
            check_stored_ds_runs(cfg.sparse_attn_impl, impl, q.device, cfg.moba_block_size, self.head_dim)
            self._stored_ds_checked = True
        scope = active_scope()
        request = scope.request if scope is not None else None
        budget = request.k if request is not None else cfg.moba_topk
        k_base = (request.k_base or cfg.moba_topk) if request is not None else None
        p = request.p if request is not None else None
        layout = _LAYOUTS.get(cu_seqlens, cfg.moba_block_size, q.shape[0], host_cu_seqlens)
        blocks, stats = route(q, k, layout, budget, k_base=k_base, p=p, track_coverage=cfg.track_coverage,
                              sync=self.route_sync)
        self.last_stats = stats
        if scope is not None:
            scope.layers.append(LayerBudget(self.layer_number, stats))
        return attention_function(impl, cfg.sparse_attn_ds_buffer_gib)(q, k, v, blocks, self.softmax_scale)
