"""Expert parallelism: the experts of every MoE layer are split over the ``ep`` ranks.

Shapes: T routed (token, slot) rows, D model dim, E experts, e = E / ep experts per rank.

Each MoE layer's stacked expert weights ([E, ...]) become DTensors sharded along the expert dim over
``mesh["ep"]`` (rank i holds experts i e .. (i + 1) e - 1), and FSDP2 shards them further over the
ranks outside the ep group (``mesh["dp_mod_ep"]``: dp_replicate x dp_shard_mod_ep x cp). Every ep rank holds
different tokens (under tensor parallel each tp rank its own part of the sequence, through whole experts). After
the router (local), a layer:
  1. exchanges per-expert token counts with ``all_to_all_single`` (so each rank knows how many rows it sends to
     and receives from every other);
  2. sends each row, already sorted by expert, to the rank holding its expert (``all_to_all_single`` with those
     uneven splits, autograd-aware: its backward is the reverse exchange);
  3. runs its e experts as grouped matmuls over the rows received, regrouped by local expert;
  4. returns the outputs with the reverse all-to-all, where the router weights combine them as in one process.

The router's load-balancing loss is taken over every rank's tokens as one process would
(``hfnative.models.moe.load_balancing_loss`` with the tokens' group): per-expert assignment counts and row
counts are all-reduced, and each rank contributes its tokens' router probabilities, so the ranks' losses add up
to the single-process loss and their gradients to its gradient.

Checkpoints are unchanged: the stacked weights are whole DTensors, gathered to the Hub's per-expert keys on
save like any other sharded parameter.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed._functional_collectives import all_to_all_single_autograd
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor

from hfnative.models.moe import MoE


class ExpertParallel:
    """The exchange of one MoE layer's routed rows with the ranks of an ep group."""

    def __init__(self, group, ep_size: int, ep_rank: int, num_experts: int):
        if num_experts % ep_size:
            raise ValueError(
                f"ep_size={ep_size} must divide the number of experts ({num_experts}): each expert-parallel rank "
                f"holds the same number of experts; choose an ep_size that divides {num_experts}"
            )
        self.group, self.ep_size, self.ep_rank = group, ep_size, ep_rank
        self.num_experts, self.local_experts = num_experts, num_experts // ep_size

    @torch.compiler.disable
    def __call__(self, x_TD: torch.Tensor, tokens_per_expert_E: torch.Tensor, experts: nn.Module) -> torch.Tensor:
        """x_TD: this rank's routed rows sorted by expert; tokens_per_expert_E: their count per (global) expert.
        Returns each row's expert output [T, D], in the same order. Runs eagerly under torch.compile (the splits
        are read on the host)."""
        ep, e = self.ep_size, self.local_experts
        # 1. counts: received_Re[r, j] = rows rank r sends to this rank's local expert j
        received_Re = torch.empty_like(tokens_per_expert_E)
        dist.all_to_all_single(received_Re, tokens_per_expert_E.contiguous(), group=self.group)
        received_Re = received_Re.view(ep, e)
        # the splits read on the host in one read (each read waits for the device)
        splits = torch.stack([tokens_per_expert_E.view(ep, e).sum(1), received_Re.sum(1)]).tolist()
        send_splits, receive_splits = splits
        # 2. rows to the ranks holding their experts
        x_ND = all_to_all_single_autograd(x_TD, receive_splits, send_splits, self.group)
        # 3. regrouped by local expert (they arrive grouped by source rank, then expert), the experts run; the rows'
        # count known on the host (repeat_interleave would read it from the device)
        expert_of_row_N = torch.arange(e, device=x_TD.device).repeat(ep).repeat_interleave(
            received_Re.reshape(-1), output_size=sum(receive_splits))
        order = torch.argsort(expert_of_row_N, stable=True)
        y_sorted = experts(x_ND[order], received_Re.sum(0), expert_of_row_N[order])
        y_ND = torch.empty_like(y_sorted).index_copy(0, order, y_sorted)
        # 4. back to the ranks the rows came from
        return all_to_all_single_autograd(y_ND, send_splits, receive_splits, self.group)


def apply_expert_parallel(model: nn.Module, ep_mesh: DeviceMesh, token_group=None) -> nn.Module:
    """Split every MoE layer's experts of ``model`` (a native Transformer) over ``ep_mesh``; in place.

    ep_mesh: 1-D ``mesh["ep"]``, or 2-D ``mesh["ep", "tp"]`` after tensor parallel (the experts, replicated over the
    tp ranks by ``apply_tensor_parallel``, stay whole on each tp rank: every tp rank routes its own tokens).
    token_group: the process group of all ranks holding different tokens (the router's loss is taken over them).
    Call before FSDP2 (``parallelize`` does), on the meta device or on real weights.
    """
    for module in model.modules():
        if isinstance(module, MoE) and module.experts.lora is not None:
            raise ValueError("expert parallelism with LoRA on the stacked experts (target_parameters) is not "
                             "available: the adapters are not split over the experts; use FSDP2 without ep, or leave "
                             "the experts out of target_parameters")
    exchange_mesh = ep_mesh["ep"] if ep_mesh.ndim > 1 else ep_mesh
    ep_size, ep_rank = exchange_mesh.size(), exchange_mesh.get_local_rank()
    placements = [Shard(0)] + [Replicate()] * (ep_mesh.ndim - 1)
    for module in model.modules():
        if not isinstance(module, MoE):
            continue
        module.expert_parallel = ExpertParallel(exchange_mesh.get_group(), ep_size, ep_rank, module.num_experts)
        if token_group is not None:
            module.token_group = token_group
        for name, param in list(module.experts.named_parameters(recurse=False)):
            values = param.data.to_local() if isinstance(param.data, DTensor) else param.data
            sharded = distribute_tensor(values, ep_mesh, placements)
            setattr(module.experts, name, nn.Parameter(sharded, requires_grad=param.requires_grad))
    return model


def set_router_loss_group(model: nn.Module, token_group) -> None:
    """The router's load-balancing loss of every MoE layer is taken over the ranks of ``token_group``."""
    for module in model.modules():
        if isinstance(module, MoE):
            module.token_group = token_group


def shard_experts(model: nn.Module, dp_mesh: DeviceMesh, **fsdp_options) -> None:
    """FSDP2 over the data-parallel ranks left by ep: one unit per MoE layer's experts (before ``apply_fsdp``, whose
    block units then leave them out). fsdp_options: mixed_precision, reshard_after_forward, cpu_offload."""
    from torch.distributed.fsdp import fully_shard

    from .fsdp import mixed_precision_policy, offload_policy

    for module in model.modules():
        if isinstance(module, MoE):
            fully_shard(module.experts, mesh=dp_mesh, mp_policy=mixed_precision_policy(fsdp_options["mixed_precision"]),
                        offload_policy=offload_policy(fsdp_options["cpu_offload"], dp_mesh),
                        reshard_after_forward=fsdp_options["reshard_after_forward"])


__all__ = ["ExpertParallel", "apply_expert_parallel", "set_router_loss_group", "shard_experts"]
