"""Point-to-point exchange of activations and gradients between adjacent pipeline stages.

Shapes are known on both sides from the plan (every rank knows every micro-batch's token
count), so unlike megatron-core with ``variable_seq_lengths`` nothing but the tensor itself is
sent: no shape exchange, no host sync. Paired operations (send one way, receive the other) are
posted together and then waited on, which is what keeps 1F1B's steady state free of deadlock on
both NCCL and gloo.
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist
from megatron.core import parallel_state


class StageLinks:
    """The previous and next stage of this rank, and the exchanges 1F1B needs."""

    def __init__(self, dtype: torch.dtype, device: torch.device):
        self.dtype, self.device = dtype, device
        self.first = parallel_state.is_pipeline_first_stage(ignore_virtual=True)
        self.last = parallel_state.is_pipeline_last_stage(ignore_virtual=True)
        self.prev = None if self.first else parallel_state.get_pipeline_model_parallel_prev_rank()
        self.next = None if self.last else parallel_state.get_pipeline_model_parallel_next_rank()

    def _empty(self, shape):
        return torch.empty(shape, dtype=self.dtype, device=self.device, requires_grad=False)

    def _exchange(self, send: Optional[torch.Tensor], send_to, recv_shape, recv_from) -> Optional[torch.Tensor]:
        # One batch: NCCL runs separately issued p2p ops in order on one stream, so two stages
        # that each post "receive, then send" to the other would both wait forever; a batch
        # (ncclGroupStart/End) lets the pair proceed together. gloo accepts the same call.
        ops, received = [], None
        if recv_shape is not None and recv_from is not None:
            received = self._empty(recv_shape)
            ops.append(dist.P2POp(dist.irecv, received, recv_from))
        if send is not None and send_to is not None:
            ops.append(dist.P2POp(dist.isend, send.detach().contiguous(), send_to))
        if ops:
            for work in dist.batch_isend_irecv(ops):
                work.wait()
        return received

    def recv_forward(self, shape) -> Optional[torch.Tensor]:
        return self._exchange(None, None, shape, self.prev)

    def send_forward(self, output: torch.Tensor) -> None:
        self._exchange(output, self.next, None, None)

    def recv_backward(self, shape) -> Optional[torch.Tensor]:
        return self._exchange(None, None, shape, self.next)

    def send_backward(self, input_grad: Optional[torch.Tensor]) -> None:
        self._exchange(input_grad, self.prev, None, None)

    def send_forward_recv_backward(self, output: torch.Tensor, shape) -> Optional[torch.Tensor]:
        return self._exchange(output, self.next, shape, self.next)

    def send_backward_recv_forward(self, input_grad: Optional[torch.Tensor], shape) -> Optional[torch.Tensor]:
        return self._exchange(input_grad, self.prev, shape, self.prev)
