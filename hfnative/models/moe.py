"""Token-choice top-k mixture of experts with experts stored stacked ([E, ...] tensors).

Shapes: T tokens, D model dim, E experts, I expert hidden dim, k experts per token.
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from .args import MoEArgs
from .layers import ACTIVATIONS


class GroupedExperts(nn.Module):
    """E gated MLPs held as three stacked weights so all experts run as one grouped matmul."""

    def __init__(self, dim: int, moe: MoEArgs, activation: str):
        super().__init__()
        self.act = ACTIVATIONS[activation]
        self.w1 = nn.Parameter(torch.empty(moe.num_experts, moe.intermediate_size, dim))  # gate
        self.w2 = nn.Parameter(torch.empty(moe.num_experts, dim, moe.intermediate_size))  # down
        self.w3 = nn.Parameter(torch.empty(moe.num_experts, moe.intermediate_size, dim))  # up

    def reset_parameters(self, std: float = 0.02):
        for w in (self.w1, self.w2, self.w3):
            nn.init.normal_(w, std=std)

    def forward(self, x_TD: torch.Tensor, tokens_per_expert: list[int]) -> torch.Tensor:
        """x_TD holds the routed tokens sorted by expert; returns each token's expert output."""
        outputs = []
        for expert, x_chunk in enumerate(torch.split(x_TD, tokens_per_expert)):
            if x_chunk.shape[0] == 0:
                continue
            hidden = self.act(x_chunk @ self.w1[expert].T) * (x_chunk @ self.w3[expert].T)
            outputs.append(hidden @ self.w2[expert].T)
        if not outputs:
            return x_TD.new_zeros(x_TD.shape)
        return torch.cat(outputs)


class MoE(nn.Module):
    def __init__(self, dim: int, moe: MoEArgs, activation: str):
        super().__init__()
        self.top_k, self.normalize_top_k = moe.top_k, moe.normalize_top_k
        self.num_experts = moe.num_experts
        self.router = nn.Linear(dim, moe.num_experts, bias=False)
        self.experts = GroupedExperts(dim, moe, activation)

    def forward(self, x_BSD: torch.Tensor) -> torch.Tensor:
        x_TD = x_BSD.reshape(-1, x_BSD.shape[-1])
        probs_TE = F.softmax(self.router(x_TD), dim=-1, dtype=torch.float32)
        weights_Tk, experts_Tk = torch.topk(probs_TE, self.top_k, dim=-1)
        if self.normalize_top_k:
            weights_Tk = weights_Tk / weights_Tk.sum(dim=-1, keepdim=True)
        weights_Tk = weights_Tk.to(x_TD.dtype)

        # sort the (token, slot) pairs by expert so each expert sees one contiguous chunk
        order = torch.argsort(experts_Tk.reshape(-1), stable=True)
        token_of_slot = order // self.top_k
        tokens_per_expert = torch.bincount(experts_Tk.reshape(-1), minlength=self.num_experts).tolist()
        routed_out = self.experts(x_TD[token_of_slot], tokens_per_expert)
        routed_out = routed_out * weights_Tk.reshape(-1)[order, None]
        out_TD = torch.zeros_like(x_TD).index_add_(0, token_of_slot, routed_out)
        return out_TD.view_as(x_BSD)
