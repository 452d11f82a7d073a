"""The model a rollout decodes under autocast: its matmul weights in the autocast dtype, made once per generation call.

Under autocast a model with fp32 (master) weights has every matmul weight cast to the autocast dtype at every use:
in a compiled decode step, at every token (reading 4 bytes a parameter and writing 2 before the matmul reads them),
and in eager decoding of a frozen model (autocast keeps its casts only of weights that require grad).
``DecodingWeights`` keeps a replica of the model whose matmul weights (nn.Linear's, LoRA's A and B, the output head's,
and on a GPU the stacked experts') are copies in the autocast dtype — what autocast's cast makes — and every other parameter
and buffer shared with the model. The copies are refreshed in place at every call (one cast pass over the weights, not
one a token), so their addresses stay fixed for a CUDA graph; a model whose parameters were replaced gets a new
replica. Every call, not when a weight's version counter moves: torch's fused AdamW (the default optimizer) and writes
through ``.data`` change a weight without moving its counter, and rollouts after them would come from the old weights.
The copies of a block's query, key and value weights are rows of one tensor, and so are those of its gate and up
weights (``fused_projections``): the decoder multiplies each stack once, one matmul where the model runs three (two),
at no memory cost over separate copies (the same bf16 operands; the products summed in another order).
With ``fold`` a LoRA layer (``foldable_adapters``) decodes as a plain linear layer whose weight is the adapter folded
into the base weight, ``W + s B A`` (DoRA's rescaled sum), made once per call in the layer's base dtype and rounded
once to the copy's, as a merged model (``merge_lora``) decodes and as TRL merges adapters for vLLM: a decode step
multiplies each weight once (its stack with the others'), where an unfolded layer multiplies its base's and its
adapter's A and B at every token. Where the base weight is copied anyway (float32 under autocast, not DoRA's) the
fold costs no memory (the adapter's own copies go); else it is a copy of every adapted weight (``fold_copy_bytes``).
"""

from __future__ import annotations

import copy

import torch
from torch import nn

from hfnative.device_policy import device_policy
from hfnative.models.compute_dtype import linear_weights
from hfnative.models.decoder import Transformer
from hfnative.models.moe import GroupedExperts
from hfnative.peft.lora import LoraLinear
from hfnative.peft.quantize import dequantize, is_quantized


def _matmul_weights(model: Transformer) -> list[nn.Parameter]:
    """The linear layers' weights (``hfnative.models.compute_dtype.linear_weights``), the untied output head's matrix,
    and the stacked experts' weights where their grouped matmuls run in the autocast dtype on the model's device
    (``hfnative.device_policy``'s ``experts_in_autocast_dtype``: a copy in it, not a cast at every token). Not the
    experts that carry adapters: training folds their adapters into the float32 weights, then casts, and so must the
    rollouts (a fold into a bf16 copy rounds twice)."""
    found = linear_weights(model)
    if not model.output.is_tied:
        found.append(model.output.weight)
    if device_policy(model.tok_embeddings.weight.device).experts_in_autocast_dtype:
        found += [w for module in model.modules() if isinstance(module, GroupedExperts) and module.lora is None
                  for w in (module.w1, module.w2, module.w3) if type(w.data) is torch.Tensor and w.is_floating_point()]
    return found


FUSED = "fused_weight"  # a replica's attention or MLP: its input projections' weights as rows of one tensor


def foldable_adapters(model: Transformer, dtype: torch.dtype | None) -> list[LoraLinear]:
    """The LoRA layers a replica decoding under autocast to ``dtype`` (None: autocast off) can run as plain linear
    layers over their folded weights: those without hooks whose adapter is a plain tensor and whose base weight is one
    or a quantized one (not a sharded DTensor); without autocast, only those whose weight is in the activations' dtype
    (the embedding's: a quantized layer computing in another dtype casts its input and output, which a plain one
    does not)."""
    return [m for m in model.modules()
            if isinstance(m, LoraLinear) and not (m._forward_hooks or m._forward_pre_hooks)
            and all(type(p.data) is torch.Tensor for p in (m.lora_A, m.lora_B))
            and (type(m.weight.data) is torch.Tensor or is_quantized(m.weight))
            and (dtype is not None or m.weight.dtype == model.tok_embeddings.weight.dtype)]


def folded_weight(layer: LoraLinear) -> torch.Tensor:
    """What a folded layer's weight holds: ``W + s B A`` (``merged_weight``) with its adapter on, W without; computed
    outside autocast (as ``merge_lora`` computes it: the generation call runs under autocast)."""
    with torch.autocast(layer.lora_A.device.type, enabled=False):
        return layer.merged_weight() if layer.adapter_enabled else dequantize(layer.weight)


def fold_copy_bytes(model: Transformer, dtype: torch.dtype | None) -> int:
    """The bytes folding a model's adapters takes over the replica without it, under autocast to ``dtype`` (None:
    off): a copy of each adapted weight the replica would not copy anyway (one already in ``dtype``, a quantized one,
    a DoRA layer's; dtype None: every one)."""
    copied = {id(w) for w in _matmul_weights(model) if dtype is not None and w.dtype != dtype}
    return sum(m.out_features * m.in_features * (dtype or m.weight.dtype).itemsize
               for m in foldable_adapters(model, dtype) if id(m.weight) not in copied)


def fused_projections(model: Transformer, folded: frozenset[int] = frozenset()) -> list[tuple[str, tuple[nn.Linear, ...]]]:
    """(module name, its linear layers) for each attention's query, key and value projections and each gated MLP's
    gate and up projections: plain ``nn.Linear`` layers (or LoRA layers whose id() is in ``folded``) without a bias or
    hooks, which read one input (the pre-norm's output), so one matmul over their weights stacked gives their three
    (two) outputs side by side."""
    found = []
    for index, layer in enumerate(model.layers):
        for name, module, linears in (("attention", layer.attention, ("wq", "wk", "wv")),
                                      ("feed_forward", layer.feed_forward, ("w1", "w3"))):
            if module is None or module._forward_pre_hooks or module._forward_hooks:
                continue
            modules = tuple(getattr(module, n) for n in linears)
            if all((type(m) is nn.Linear or id(m) in folded) and m.bias is None
                   and not (m._forward_hooks or m._forward_pre_hooks) for m in modules):
                found.append((f"layers.{index}.{name}", modules))
    return found


def fused_outputs(module: nn.Module, x: torch.Tensor | tuple[torch.Tensor, ...],
                  linears: tuple[nn.Linear, ...]) -> tuple[torch.Tensor, ...]:
    """The outputs of ``linears`` on x (or on the first of the views of it a pre-norm hands them) from the module's
    ``FUSED`` weight in one matmul: slices of one product."""
    x = x[0] if isinstance(x, tuple) else x
    product = torch.nn.functional.linear(x, getattr(module, FUSED))
    return product.split([linear.out_features for linear in linears], dim=-1)


class DecodingWeights:
    """``model_for(model, dtype, stack, fold)``: the model to decode under autocast to ``dtype`` (None: autocast off):
    a replica whose matmul weights are copies in ``dtype``, their stackable projections stacked; with ``stack``, also
    where no weight needs a cast (a model already in the decoding dtype), a replica whose stackable projections are
    stacked copies (a second copy of those weights, which the engine makes only where the device can afford it); with
    ``fold``, a replica whose LoRA layers are plain linear layers over their folded weights; else the model itself."""

    def __init__(self):
        self.key: tuple = ()  # what the replica was made for: the model's parameters (their id()), dtype, stack, fold
        self.replica: Transformer | None = None
        self.pairs: list[tuple[torch.Tensor, torch.Tensor]] = []  # (the model's weight, its copy)
        self.folds: list[tuple[LoraLinear, torch.Tensor]] = []  # (the model's LoRA layer, its folded weight's copy)
        self.switches: list[tuple[nn.Module, nn.Module]] = []  # (the model's adapter, the replica's)

    def model_for(self, model: Transformer, dtype: torch.dtype | None, stack: bool = False,
                  fold: bool = False) -> Transformer:
        folded = foldable_adapters(model, dtype) if fold else []
        weights = _matmul_weights(model)
        head = model.output.base_projection()  # trained token rows: the replica applies them
        if dtype is not None and all(p.dtype == dtype for p in weights + [head] + [m.weight for m in folded]):
            dtype = None  # nothing to cast (a folded layer's weight in another dtype, e.g. NF4 computing in float32,
            # keeps its copy in the autocast dtype)
        if dtype is None and not folded and not (stack and fused_projections(model)):
            return model
        key = (tuple(id(p) for p in model.parameters()), dtype, stack, fold)
        if self.replica is None or key != self.key:
            self._make(model, weights, head, dtype, stack, folded)
            self.key = key
        with torch.no_grad():
            if self.pairs:
                torch._foreach_copy_([copy for _, copy in self.pairs], [weight for weight, _ in self.pairs])
            for layer, copy in self.folds:  # one layer at a time: a float32 sum at most alive
                copy.copy_(folded_weight(layer))
        for source, copy in self.switches:  # adapters switched on or off since (disable_adapters) are so here too
            copy.adapter_enabled = source.adapter_enabled
        return self.replica

    def _make(self, model: Transformer, weights: list[nn.Parameter], head: torch.Tensor, dtype: torch.dtype | None,
              stack: bool, folded: list[LoraLinear] = ()) -> None:
        """A replica sharing every parameter and buffer but the matmul weights, which get copies in ``dtype`` (one
        already in ``dtype``, a frozen model's kept so, is shared too; dtype None: none). The copies of the projections
        that read one input (``fused_projections``) are rows of one tensor, which the replica's module holds as
        ``FUSED`` and the decoder multiplies once; with ``stack`` those projections are copied so even where they
        need no cast (in their own dtype). The LoRA layers in ``folded`` become plain linear layers over a copy (in
        ``dtype``, else their base's) that ``model_for`` fills with the folded weight; their adapters get no copies
        (but one that a layer left unfolded shares)."""
        self.replica = None  # the old copies are freed before the new are made
        memo = {id(t): t for t in list(model.parameters()) + list(model.buffers())}
        by_id = {id(layer): layer for layer in folded}
        fold_copies: dict[int, nn.Parameter] = {}  # id(LoRA layer) -> the copy its folded weight goes in
        self.pairs, self.folds = [], []
        fused = {}
        for name, linears in fused_projections(model, frozenset(by_id)):
            target = dtype or linears[0].weight.dtype
            uncast = [linear for linear in linears if linear.weight.dtype == target and id(linear) not in by_id]
            # a copy only for the stacking: made with stack, for a stack of plain layers only (what the engine's
            # stacked_copy_bytes counts), not for the plain layers beside folded ones
            if uncast and not (stack and not any(id(linear) in by_id for linear in linears)):
                continue
            rows = torch.empty(sum(linear.out_features for linear in linears), linears[0].in_features, dtype=target,
                               device=linears[0].weight.device)
            for linear, part in zip(linears, rows.split([linear.out_features for linear in linears])):
                if id(linear) in by_id:
                    fold_copies[id(linear)] = nn.Parameter(part, requires_grad=False)
                else:
                    memo[id(linear.weight)] = nn.Parameter(part, requires_grad=False)
                    self.pairs.append((linear.weight, memo[id(linear.weight)]))
            fused[name] = rows
        for layer in folded:
            if id(layer) not in fold_copies:
                fold_copies[id(layer)] = nn.Parameter(
                    torch.empty(layer.out_features, layer.in_features, dtype=dtype or layer.weight.dtype,
                                device=layer.lora_A.device), requires_grad=False)
            self.folds.append((layer, fold_copies[id(layer)]))
        # the weights only folded layers read get no copies of their own
        unfolded = {id(p) for m in model.modules() if id(m) not in by_id for p in m.parameters(recurse=False)}
        fold_only = {id(p) for layer in folded for p in layer.parameters(recurse=False)} - unfolded
        for weight in weights:
            if dtype is None or weight.dtype == dtype or memo[id(weight)] is not weight or id(weight) in fold_only:
                continue
            memo[id(weight)] = nn.Parameter(torch.empty_like(weight, dtype=dtype), requires_grad=False)
            self.pairs.append((weight, memo[id(weight)]))
        replica = copy.deepcopy(model, memo)
        for name, rows in fused.items():
            setattr(replica.get_submodule(name), FUSED, rows)
        for name, module in model.named_modules():
            if id(module) in by_id:
                linear = nn.Linear(module.in_features, module.out_features, bias=False, device="meta")
                linear.weight = fold_copies[id(module)]
                linear.bias = module.bias  # shared, as every other parameter
                parent, _, child = name.rpartition(".")
                setattr(replica.get_submodule(parent), child, linear)
        copies = dict(replica.named_modules())
        self.switches = [(source, copies[name]) for name, source in model.named_modules()
                         if hasattr(source, "adapter_enabled") and id(source) not in by_id]
        if dtype is not None and model.output.is_tied:  # the head gets a copy of its own; the embedding lookup keeps
            # reading the table
            replica.output.untie()
            replica.output.weight = nn.Parameter(torch.empty_like(head, dtype=dtype), requires_grad=False)
            self.pairs.append((head, replica.output.weight))
        self.replica = replica.eval()


def stacked_copy_bytes(model: Transformer) -> int:
    """The bytes a replica's stacked projections take where they are copies only for the stacking (the model's own
    dtype)."""
    return sum(linear.weight.numel() * linear.weight.element_size()
               for _, linears in fused_projections(model) for linear in linears)
