"""megatron-core integration of the sparse attention: core_attention module, specs, budgets."""
from megatron_sparsebalance.attention.budget import BudgetReport, BudgetRequest, budget_scope
from megatron_sparsebalance.attention.config import SparseAttentionConfig
from megatron_sparsebalance.attention.core_attention import SparseCoreAttention
from megatron_sparsebalance.attention.spec import get_gpt_layer_spec, patch_layer_spec

__all__ = [
    "BudgetReport", "BudgetRequest", "budget_scope", "SparseAttentionConfig", "SparseCoreAttention",
    "get_gpt_layer_spec", "patch_layer_spec",
]
