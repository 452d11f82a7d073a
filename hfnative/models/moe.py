"""Token-choice top-k mixture of experts with experts stored stacked ([E, ...] tensors), and the
router's load-balancing auxiliary loss.

Shapes: T tokens, D model dim, E experts, I expert hidden dim, k experts per token, L MoE layers.
"""

from __future__ import annotations

import contextlib

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.tensor import Partial

from hfnative.device_policy import device_policy
from hfnative.precision import autocast_dtype

from .args import MoEArgs
from .layers import clamped_swiglu, gated_activation
from .selective_checkpoint import kept_in_checkpoint


class RouterLogits:
    """What MoE layers append their router logits to: a sequence, but not a list, so FSDP2's pre-forward hooks
    (which rebuild the lists and tuples among a module's arguments) hand every layer this same object."""

    def __init__(self):
        self._items: list[torch.Tensor] = []

    def append(self, logits_TE: torch.Tensor) -> None:
        self._items.append(logits_TE)

    def __len__(self) -> int:
        return len(self._items)

    def __iter__(self):
        return iter(self._items)

    def __getitem__(self, index):
        return self._items[index]


class _ContiguousGrad(torch.autograd.Function):
    """Identity whose backward makes the upstream gradient contiguous (grouped_mm's backward rejects
    the stride-0 gradients that e.g. ``.sum()`` produces)."""

    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return grad.contiguous()


def expert_counts(experts_N: torch.Tensor, num_experts: int) -> torch.Tensor:
    """How many of the assignments ``experts_N`` go to each expert [E] (int64): ``torch.bincount(experts_N,
    minlength=num_experts)`` for ids below ``num_experts``, with a static shape: no read of the largest id on the host
    (bincount's output length depends on it, so it syncs a GPU, blocks CUDA graph capture and breaks a compiled
    graph)."""
    counts_E = torch.zeros(num_experts, dtype=torch.long, device=experts_N.device)
    return counts_E.scatter_add_(0, experts_N, torch.ones_like(experts_N, dtype=torch.long))


@torch.compiler.disable
def _grouped_mm_eager(x: torch.Tensor, w: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    return F.grouped_mm(x, w, offs=offs)


def _grouped_mm(x: torch.Tensor, w: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    """``F.grouped_mm``; inside a compiled graph, in a dtype other than bf16 it runs eagerly (the compiler's meta
    kernel takes bf16 only, while the CPU kernel also runs fp32): a graph break instead of a failure."""
    if x.dtype != torch.bfloat16 and torch.compiler.is_compiling():
        return _grouped_mm_eager(x, w, offs)
    return F.grouped_mm(x, w, offs=offs)


def experts_compute_dtype(device: torch.device) -> torch.dtype | None:
    """The dtype a mixture of experts' grouped matmuls run in on ``device``: autocast's where autocast is on there and
    the device policy asks it (``experts_in_autocast_dtype``: torch's grouped matmul is not an autocast op), else None
    (the operands' own)."""
    dtype = autocast_dtype(device.type)
    return dtype if dtype is not None and device_policy(device).experts_in_autocast_dtype else None


class GroupedExperts(nn.Module):
    """E gated MLPs held as three stacked weights (plus stacked biases when ``moe.expert_bias``), run as
    grouped matmuls over the tokens sorted by expert."""

    def __init__(self, dim: int, moe: MoEArgs, activation: str):
        super().__init__()
        self.activation = activation
        self.swiglu_limit, self.swiglu_alpha = moe.swiglu_limit, moe.swiglu_alpha
        E, I = moe.num_experts, moe.intermediate_size
        self.w1 = nn.Parameter(torch.empty(E, I, dim))  # gate
        self.w2 = nn.Parameter(torch.empty(E, dim, I))  # down
        self.w3 = nn.Parameter(torch.empty(E, I, dim))  # up
        if moe.expert_bias:
            self.b1, self.b2, self.b3 = (nn.Parameter(torch.empty(E, n)) for n in (I, dim, I))
        else:
            self.b1 = self.b2 = self.b3 = None
        # adapters on the stacked weights (hfnative.peft.expert_lora, peft's target_parameters): a ModuleDict whose
        # modules have ``parts`` (the weights each changes), ``adapter_enabled`` and ``fold(name, weight)``
        self.lora: nn.ModuleDict | None = None
        # while decoding (``adapters_folded``): (w1, w2, w3) with the adapters folded in once, read instead
        self.decode_weights: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None

    def reset_parameters(self, std: float = 0.02):
        for w in (self.w1, self.w2, self.w3):
            nn.init.normal_(w, std=std)
        for b in (self.b1, self.b2, self.b3):
            if b is not None:
                nn.init.zeros_(b)

    def forward(self, x_TD: torch.Tensor, tokens_per_expert_E: torch.Tensor, expert_of_row_T: torch.Tensor | None = None) -> torch.Tensor:
        """x_TD: the routed tokens sorted by expert; tokens_per_expert_E: how many each expert gets (a
        tensor: no host sync); expert_of_row_T: each row's expert (needed with biases).
        Returns each token's expert output [T, D]."""
        offsets_E = tokens_per_expert_E.cumsum(0).to(torch.int32)
        # under expert parallelism the stacked weights are DTensors split over the experts: this rank's experts
        w1, w2, w3, b1, b2, b3 = (local_values(t) for t in (self.w1, self.w2, self.w3, self.b1, self.b2, self.b3))
        if self.decode_weights is not None:
            w1, w2, w3 = self.decode_weights
        elif self.lora is not None:
            w1, w2, w3 = (self.adapted(name, w) for name, w in (("w1", w1), ("w2", w2), ("w3", w3)))
        cast = experts_compute_dtype(x_TD.device)

        def grouped(x, w_EOI, b_EO):  # x [T, I] @ w[e].T (+ b[e]) for each expert's rows
            if cast is not None:  # as autocast casts a linear layer's input and weight (a no-op where they are in it)
                x, w_EOI = x.to(cast), w_EOI.to(cast)
            out = _ContiguousGrad.apply(_grouped_mm(x, w_EOI.transpose(-2, -1), offsets_E))
            return out if b_EO is None else out + b_EO[expert_of_row_T]

        gate_TI, up_TI = grouped(x_TD, w1, b1), grouped(x_TD, w3, b3)
        if self.swiglu_limit is not None:
            hidden_TI = clamped_swiglu(gate_TI, up_TI, self.swiglu_alpha, self.swiglu_limit)
        else:
            hidden_TI = gated_activation(gate_TI, up_TI, self.activation)
        return grouped(hidden_TI, w2, b2)

    def adapted(self, name: str, weight: torch.Tensor) -> torch.Tensor:
        """``weight`` (the stacked weight ``name``) with every enabled adapter on it folded in."""
        for adapter in (self.lora or {}).values():
            if adapter.adapter_enabled and name in adapter.parts:
                weight = adapter.fold(name, weight)
        return weight


def adapted_experts(model: nn.Module) -> dict[str, GroupedExperts]:
    """The stacked experts of ``model`` that carry adapters, by module name."""
    return {name: m for name, m in model.named_modules() if isinstance(m, GroupedExperts) and m.lora is not None}


def folded_copy_bytes(model: nn.Module) -> int:
    """The bytes of the copies ``adapters_folded`` holds: every stacked weight an adapter changes."""
    return sum(getattr(experts, name).numel() * getattr(experts, name).element_size()
               for experts in adapted_experts(model).values()
               for name in {part for adapter in experts.lora.values() for part in adapter.parts})


@contextlib.contextmanager
def adapters_folded(model: nn.Module, held: dict[tuple[int, str], torch.Tensor]):
    """Inside, every adapted GroupedExperts of ``model`` reads its weights with its enabled adapters folded in once
    (decoding, under no_grad: a forward a token would fold them again at every token). The folded copies live in
    ``held`` (the caller's, kept between calls): a copy of the same shape is refreshed in place, so its address stays
    fixed for a captured decode step."""
    experts = list(adapted_experts(model).values())
    try:
        with torch.no_grad():
            for module in experts:
                weights = []
                for name in ("w1", "w2", "w3"):
                    weight = local_values(getattr(module, name))
                    folded = module.adapted(name, weight)
                    key = (id(module), name)
                    if folded is not weight:
                        copy = held.get(key)
                        if copy is not None and copy.shape == folded.shape and copy.dtype == folded.dtype:
                            folded = copy.copy_(folded)
                        held[key] = folded
                    weights.append(folded)
                module.decode_weights = tuple(weights)
        yield model
    finally:
        for module in experts:
            module.decode_weights = None


def local_values(t: torch.Tensor | None) -> torch.Tensor | None:
    """A DTensor's local values (a plain tensor as it is). Where it is replicated (over tensor-parallel ranks, each
    routing its own tokens) its gradient is this rank's share, a partial sum that is summed over those ranks."""
    if not hasattr(t, "to_local"):
        return t
    return t.to_local(grad_placements=[Partial() if p.is_replicate() else p for p in t.placements])


class MoE(nn.Module):
    def __init__(self, dim: int, moe: MoEArgs, activation: str):
        super().__init__()
        self.top_k, self.normalize_top_k = moe.top_k, moe.normalize_top_k
        self.softmax_after_top_k = moe.softmax_after_top_k
        self.num_experts = moe.num_experts
        self.router = nn.Linear(dim, moe.num_experts, bias=moe.router_bias)
        self.experts = GroupedExperts(dim, moe, activation)
        # expert parallel (hfnative.parallel.expert_parallel): the exchange of routed rows with the ep ranks
        self.expert_parallel = None
        # distributed runs: the group of ranks holding different tokens, over which the router's loss is taken
        self.token_group = None
        # tensor (sequence) parallel: the ranks holding the other parts of the same sequences, which share one loss
        self.sequence_group = None

    def route(self, logits_TE: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Each token's k routing weights and experts [T, k]."""
        if self.softmax_after_top_k:
            top_logits_Tk, experts_Tk = torch.topk(logits_TE, self.top_k, dim=-1)
            return F.softmax(top_logits_Tk, dim=-1), experts_Tk
        probs_TE = F.softmax(logits_TE, dim=-1, dtype=torch.float32)
        weights_Tk, experts_Tk = torch.topk(probs_TE, self.top_k, dim=-1)
        if self.normalize_top_k:
            weights_Tk = weights_Tk / weights_Tk.sum(dim=-1, keepdim=True)
        return weights_Tk, experts_Tk

    def forward(self, x_BSD: torch.Tensor, router_logits: list | None = None) -> torch.Tensor:
        """router_logits: when a list, this layer's router logits [T, E] are appended (for the aux loss)."""
        x_TD = x_BSD.reshape(-1, x_BSD.shape[-1])
        logits_TE = kept_in_checkpoint("projection", self.router, x_TD)
        if router_logits is not None:
            # read by load_balancing_loss
            logits_TE.token_group, logits_TE.sequence_group = self.token_group, self.sequence_group
            router_logits.append(logits_TE)
        weights_Tk, experts_Tk = self.route(logits_TE)
        weights_Tk = weights_Tk.to(x_TD.dtype)

        # sort the (token, slot) pairs by expert so each expert sees one contiguous chunk
        order = torch.argsort(experts_Tk.reshape(-1), stable=True)
        token_of_slot = order // self.top_k
        tokens_per_expert_E = expert_counts(experts_Tk.reshape(-1), self.num_experts)
        if self.expert_parallel is not None:
            routed_out = self.expert_parallel(x_TD[token_of_slot], tokens_per_expert_E, self.experts)
        else:
            routed_out = self.experts(x_TD[token_of_slot], tokens_per_expert_E, experts_Tk.reshape(-1)[order])
        routed_out = routed_out * weights_Tk.reshape(-1)[order, None]
        out_TD = torch.zeros_like(x_TD).index_add_(0, token_of_slot, routed_out)
        return out_TD.view_as(x_BSD)


def load_balancing_loss(
    router_logits: list[torch.Tensor], num_experts: int, top_k: int, attention_mask_BS: torch.Tensor | None = None
) -> torch.Tensor:
    """Switch-Transformer load balancing over all MoE layers' tokens together (transformers' definition):
    E * sum_e f_e * P_e, with f_e the fraction of top-k assignments and P_e the mean router probability
    of expert e, both over (layer, token) rows that are not padding.

    router_logits: L tensors [T, E]; attention_mask_BS: 1 for real tokens (T = B * S), or None.
    When the logits carry a ``token_group`` (a distributed run: the ranks holding different tokens), f_e and
    the row count are taken over every rank of the group and P_e's numerator over this rank's rows, so the
    ranks' losses sum to the loss over all their tokens, and their gradients to its gradient.
    A ``sequence_group`` (sequence parallel: each rank routes S / P tokens of every sequence, T = B * S / P) sums
    f_e, the row count and P_e's numerator over its ranks, which then hold the same loss, each rank's gradient
    flowing to its own tokens.
    """
    assignments_E = torch.zeros(num_experts, dtype=torch.float32, device=router_logits[0].device)
    prob_sum_E = torch.zeros_like(assignments_E)
    rows = 0.0
    sequence_group = getattr(router_logits[0], "sequence_group", None)
    if sequence_group is not None and attention_mask_BS is not None:  # this rank's part of each sequence
        import torch.distributed as dist

        parts = dist.get_world_size(sequence_group)
        attention_mask_BS = attention_mask_BS.chunk(parts, dim=1)[dist.get_rank(sequence_group)]
    weight_T = None if attention_mask_BS is None else attention_mask_BS.reshape(-1).to(assignments_E)
    for logits_TE in router_logits:
        probs_TE = F.softmax(logits_TE, dim=-1, dtype=torch.float32)
        experts_Tk = torch.topk(probs_TE, top_k, dim=-1).indices
        if weight_T is None:
            assignments_E = assignments_E + expert_counts(experts_Tk.reshape(-1), num_experts)
            prob_sum_E = prob_sum_E + probs_TE.sum(0)
            rows = rows + probs_TE.shape[0]
        else:
            slot_weight = weight_T.repeat_interleave(top_k)
            assignments_E = assignments_E.scatter_add(0, experts_Tk.reshape(-1), slot_weight)
            prob_sum_E = prob_sum_E + (probs_TE * weight_T[:, None]).sum(0)
            rows = rows + weight_T.sum()
    groups = [g for g in (getattr(router_logits[0], "token_group", None), sequence_group) if g is not None]
    if groups:
        import torch.distributed as dist

        # a host row count made on the device (a tensor copied from the host would wait for the device's queue)
        rows_1 = rows.reshape(1) if isinstance(rows, torch.Tensor) else assignments_E.new_full((1,), float(rows))
        totals = torch.cat([assignments_E.detach(), rows_1.to(assignments_E.dtype)])
        for group in groups:
            dist.all_reduce(totals, group=group)
        assignments_E, rows = totals[:-1], totals[-1]
    if sequence_group is not None:
        prob_sum_E = _SumOverSequence.apply(prob_sum_E, sequence_group)
    return num_experts * torch.sum((assignments_E / rows) * (prob_sum_E / rows))


class _SumOverSequence(torch.autograd.Function):
    """The sum over a sequence-parallel group of its ranks' values; the gradient of each rank's value is the sum's
    (every rank holds the same loss and backpropagates into its own tokens only, as tensor parallel does)."""

    @staticmethod
    def forward(ctx, x, group):
        import torch.distributed as dist

        total = x.clone()
        dist.all_reduce(total, group=group)
        return total

    @staticmethod
    def backward(ctx, grad):
        return grad, None
