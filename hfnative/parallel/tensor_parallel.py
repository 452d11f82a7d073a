"""Tensor + sequence parallelism for the native decoder, with a vocabulary-parallel embedding and head.

Shapes: B batch, S sequence, D model dim, V vocabulary, P tensor-parallel ranks.

Between the blocks' sublayers activations are split along the sequence ([B, S/P, D] per rank, sequence
parallel), so the norms run on a 1/P of the tokens. Each sublayer gathers the sequence, runs on its
share of the heads / hidden units, and reduce-scatters back to the sequence split:

    tok_embeddings   rows (vocabulary) split: each rank looks up its rows, the partial sums reduce-scattered
                     over the sequence
    *_norm, norm     sequence parallel (weights replicated, as DTensors, so their gradients are summed)
    attention        wq, wk, wv column-split (H/P query and K/P key/value heads per rank), wo row-split;
                     q/k norms over head_dim run on the local heads; a LoRA layer's adapter is split with its
                     weight (ColwiseParallelLora, RowwiseParallelLora)
    feed_forward     w1, w3 column-split, w2 row-split
    output           rows (vocabulary) split: the losses run vocabulary-parallel (hfnative.losses.vocab_parallel)
                     on the gathered hidden states, so no rank holds full-vocabulary logits; plain logits
                     (``head(hidden)``) are gathered, for evaluation and generation. A sequence classifier's
                     [L, D] score head (too few rows to split) is replicated instead, its scores whole on every rank

    moe              each rank routes its own part of the sequence (no gather): the router and the experts are
                     replicated (whole experts on every rank; expert parallelism, hfnative.parallel.expert_parallel,
                     is their way to split), their gradients, each rank's tokens' share, summed over the ranks

Q/k norms over the whole projection and attention sinks are refused.
"""

from __future__ import annotations

import types

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    ParallelStyle,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)

from hfnative.peft.lora import LoraLinear
from hfnative.peft.quantize import is_quantized
from hfnative.peft.token_rows import has_token_rows
from hfnative.losses import IGNORE_INDEX
from hfnative.losses.vocab_parallel import (
    vocab_parallel_cross_entropy,
    vocab_parallel_generalized_jsd,
    vocab_parallel_token_logprobs,
)
from hfnative.models.head import GeneralizedJSD, OutputHead, TokenCrossEntropy, TokenLogprobs
from hfnative.models.moe import MoE, local_values

from .float8 import is_float8_linear


def check_tensor_parallel(model: nn.Module, tp: int) -> None:
    """Raise a ValueError naming what in ``model`` cannot be split over ``tp`` ranks."""
    args = model.args
    problems = []
    for name, count in (("n_heads", args.n_heads), ("n_kv_heads", args.n_kv_heads)):
        if count % tp:
            problems.append(f"{name}={count} is not divisible by tp={tp} (each rank takes a whole number of heads)")
    if args.qk_norm and args.qk_norm_scope == "projection":
        problems.append(
            "q/k norms over the whole projection (qk_norm_scope='projection') would need a norm across ranks"
        )
    if args.attention_sinks:
        problems.append("attention sinks are not split by tensor parallelism yet")
    shared_lora_A = _shared_lora_A(model)
    for name, module in model.named_modules():
        if name.rsplit(".", 1)[-1] not in ("wq", "wk", "wv", "wo", "w1", "w2", "w3"):
            continue
        if isinstance(module, LoraLinear):
            why = ("a DoRA layer (its weight norm is not split with the weight)"
                   if module.lora_magnitude_vector is not None else
                   "a LoRA layer over a quantized base (kept whole on every rank)" if is_quantized(module.weight) else
                   "a LoRA layer whose lora_A other layers share (a fused Hub projection's)"
                   if id(module.lora_A) in shared_lora_A else None)
            if why is not None:
                problems.append(f"{name} is {why}: not split by tensor parallelism")
                break
        elif type(module) is not nn.Linear and not is_float8_linear(module):
            problems.append(
                f"{name} is a {type(module).__name__}, not an nn.Linear (quantized layers are not split)"
            )
            break
    copies = [name for name, module in (("embed_tokens", model.tok_embeddings), ("lm_head", model.output))
              if hasattr(module, "original_weight")]  # modules_to_save: a trained copy beside the original
    if copies:
        problems.append(f"modules_to_save {copies} (a trained copy of the vocabulary matrix beside its original, which "
                        "turning the adapters off reads) is not split by tensor parallelism")
    if any(getattr(module, "lora", None) is not None for module in model.modules() if hasattr(module, "w1")):
        problems.append("LoRA on stacked MoE experts (target_parameters) is not replicated over the ranks")
    if has_token_rows(model):
        problems.append("trained token rows (trainable_token_indices) are not split with the vocabulary")
    if problems:
        raise ValueError(f"tensor parallelism over tp={tp} ranks cannot split this model: " + "; ".join(problems))


def _shared_lora_A(model: nn.Module) -> set[int]:
    """ids of the lora_A matrices more than one LoRA layer holds."""
    seen, shared = set(), set()
    for module in model.modules():
        if isinstance(module, LoraLinear):
            key = id(module.lora_A)
            (shared if key in seen else seen).add(key)
    return shared


def _split_parameters(module: nn.Module, device_mesh: DeviceMesh, placements: dict, src_data_rank) -> None:
    """Each of ``module``'s own parameters named in ``placements`` made a DTensor with that placement, in place."""
    for name, placement in placements.items():
        param = getattr(module, name, None)
        if param is None:
            continue
        module.register_parameter(name, nn.Parameter(
            distribute_tensor(param, device_mesh, [placement], src_data_rank=src_data_rank),
            requires_grad=param.requires_grad))


class ColwiseParallelLora(ColwiseParallel):
    """torch's ColwiseParallel, and for a LoRA layer (hfnative.peft.LoraLinear) the adapter split with it: lora_A
    [r, in] replicated (every rank reads the whole input), lora_B [out, r] split by rows like the weight, so the
    update lands on this rank's output columns."""

    def _partition_linear_fn(self, name, module, device_mesh):
        if not isinstance(module, nn.Linear):  # a LoRA layer's own submodules (its dropout): nothing to split
            return None
        if not isinstance(module, LoraLinear):
            return super()._partition_linear_fn(name, module, device_mesh)
        _split_parameters(module, device_mesh, {"weight": Shard(0), "bias": Shard(0), "lora_A": Replicate(),
                                                "lora_B": Shard(0)}, self.src_data_rank)


class RowwiseParallelLora(RowwiseParallel):
    """torch's RowwiseParallel, and for a LoRA layer the adapter split with it: lora_A [r, in] split by columns like
    the weight (each rank's share of the input gives a partial [tokens, r], summed with the base's partial output),
    lora_B [out, r] replicated."""

    def _partition_linear_fn(self, name, module, device_mesh):
        if not isinstance(module, nn.Linear):  # a LoRA layer's own submodules (its dropout): nothing to split
            return None
        if not isinstance(module, LoraLinear):
            return super()._partition_linear_fn(name, module, device_mesh)
        _split_parameters(module, device_mesh, {"weight": Shard(1), "bias": Replicate(), "lora_A": Shard(1),
                                                "lora_B": Replicate()}, self.src_data_rank)


class _GatherSequence(ParallelStyle):
    """A sublayer's first input: from the sequence split (Shard(1)) to whole sequences (Replicate), as a DTensor, so
    the column-split projections inside see full sequences and their input gradient is reduce-scattered back. The
    other inputs (rotary tables, attention plan) are left alone."""

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        def gather(module, inputs):
            x = inputs[0]
            if not isinstance(x, DTensor):
                x = DTensor.from_local(x, device_mesh, (Shard(1),), run_check=False)
            return (x.redistribute(placements=(Replicate(),)), *inputs[1:])

        module.register_forward_pre_hook(gather)
        return module


class VocabParallelEmbedding(ParallelStyle):
    """The embedding with its [V, D] weight split by rows. Each rank looks up the ids in its rows (zeros elsewhere)
    and the partial sums are reduce-scattered over the sequence. Unlike torch's RowwiseParallel on an embedding,
    the weight's gradient is computed from this rank's rows only, so it is born split (no [V, D] gradient on
    every rank)."""

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        assert isinstance(module, nn.Embedding), type(module)
        module.weight = nn.Parameter(distribute_tensor(module.weight, device_mesh, (Shard(0),), src_data_rank=None))
        module.forward = types.MethodType(_vocab_parallel_embedding_forward, module)
        return module


def _vocab_parallel_embedding_forward(self: nn.Embedding, input_ids_BS: torch.Tensor) -> torch.Tensor:
    """[B, S] ids (the same on every rank) -> this rank's part of the sequence of embeddings, [B, S/P, D] (a local
    tensor, as the residual stream between the blocks' sublayers is kept)."""
    weight = self.weight
    mesh = weight.device_mesh
    if input_ids_BS.shape[1] % mesh.size():
        raise ValueError(
            f"sequence length {input_ids_BS.shape[1]} is not divisible by tp={mesh.size()}: sequence parallelism "
            f"splits every sequence evenly across the tensor-parallel ranks; pad batches to a multiple of "
            f"{mesh.size()} tokens"
        )
    rows, offset = compute_local_shape_and_global_offset(weight.shape, mesh, weight.placements)
    start, local_rows = offset[0], rows[0]
    local_ids_BS = input_ids_BS - start
    mine_BS = (local_ids_BS >= 0) & (local_ids_BS < local_rows)
    padding_idx = self.padding_idx
    local_padding = padding_idx - start if padding_idx is not None and 0 <= padding_idx - start < local_rows else None
    partial_BSD = F.embedding(torch.where(mine_BS, local_ids_BS, 0), weight.to_local(), padding_idx=local_padding)
    partial_BSD = partial_BSD * mine_BS[..., None].to(partial_BSD.dtype)
    partial = DTensor.from_local(partial_BSD, mesh, (Partial(),), run_check=False)
    return partial.redistribute(placements=(Shard(1),)).to_local()


class LossParallelHead(ParallelStyle):
    """The output head with its [V, D] weight split by rows (the tied embedding's, when tied: the embedding's
    row split is the same); its forward runs the loss specs vocabulary-parallel."""

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        assert isinstance(module, OutputHead), type(module)
        if not module.is_tied:
            module.weight = nn.Parameter(distribute_tensor(module.weight, device_mesh, (Shard(0),), src_data_rank=None))
        # the instance's forward (as apply_compile does): hooks on the module (FSDP2's) still run around it
        module.forward = types.MethodType(_loss_parallel_head_forward, module)
        return module


def _replicated_hidden(hidden_BSD: torch.Tensor, mesh: DeviceMesh) -> DTensor:
    """The hidden states as a Replicate DTensor: gathered over the sequence when they come sequence-split."""
    if not isinstance(hidden_BSD, DTensor):
        # the same states on every rank (e.g. a head call on detached states): their gradient is summed over ranks
        return DTensor.from_local(hidden_BSD, mesh, (Replicate(),), run_check=False)
    return hidden_BSD.redistribute(placements=(Replicate(),))


def _loss_parallel_head_forward(self: OutputHead, hidden_BSD: torch.Tensor, loss=None):
    """OutputHead.forward over a row-split weight: logits gathered to [B, S, V], or a loss spec run
    vocabulary-parallel (TokenCrossEntropy, TokenLogprobs, GeneralizedJSD), returning what the spec returns in one
    process."""
    weight = self.projection()
    mesh = weight.device_mesh
    hidden = _replicated_hidden(hidden_BSD, mesh)
    if loss is None:
        logits = hidden @ weight.T  # [B, S, V] split over V
        if self.softcap is not None:
            logits = torch.tanh(logits / self.softcap) * self.softcap
        return logits.full_tensor()
    if not isinstance(loss, (TokenCrossEntropy, TokenLogprobs, GeneralizedJSD)):
        raise ValueError(
            f"{type(loss).__name__} is not a loss spec the tensor-parallel head can run (TokenCrossEntropy, "
            "TokenLogprobs, GeneralizedJSD from hfnative.models.head); compute it from model.output(hidden) logits, "
            "or run without tensor parallelism (tp=1)"
        )
    # each rank's gradient of the (replicated) states is its vocabulary rows' share: a partial sum
    hidden_local = hidden.to_local(grad_placements=(Partial(),))
    weight_local = weight.to_local()
    _, offset = compute_local_shape_and_global_offset(weight.shape, mesh, weight.placements)
    split = dict(vocab_start=offset[0], vocab_size=weight.shape[0], group=mesh.get_group())
    if isinstance(loss, TokenCrossEntropy):
        return loss.on_positions(hidden_local, lambda hidden_ND, targets_N, masked: vocab_parallel_cross_entropy(
            hidden_ND, weight_local, targets_N, softcap=self.softcap, masked=masked, **split))
    if isinstance(loss, TokenLogprobs):
        return loss.per_position(hidden_local, lambda hidden_ND, targets_N: vocab_parallel_token_logprobs(
            hidden_ND, weight_local, targets_N, softcap=self.softcap, temperature=loss.temperature,
            statistics=tuple(loss.statistics), **split,
        ))
    keep_BS = loss.targets_BS != IGNORE_INDEX
    teacher_hidden_BSD = loss.teacher_hidden_BSD.detach()
    if isinstance(teacher_hidden_BSD, DTensor):  # a tensor-parallel teacher's states come split over the sequence
        teacher_hidden_BSD = teacher_hidden_BSD.full_tensor()
    teacher_weight = _rows_like(loss.teacher_head.projection().detach(), weight, offset[0])
    return vocab_parallel_generalized_jsd(
        hidden_local[keep_BS], weight_local, teacher_hidden_BSD[keep_BS], teacher_weight, beta=loss.beta,
        temperature=loss.temperature, student_softcap=self.softcap, teacher_softcap=loss.teacher_head.softcap, **split,
    )


def _rows_like(teacher_weight_VD: torch.Tensor, student_weight: DTensor, vocab_start: int) -> torch.Tensor:
    """The rows of the teacher's [V, Dt] head that this rank holds of the student's: the local shard when the teacher
    is split the same way (a teacher parallelized on the same mesh), else sliced from the whole matrix."""
    if teacher_weight_VD.shape[0] != student_weight.shape[0]:
        raise ValueError(
            f"the teacher's head has {teacher_weight_VD.shape[0]} vocabulary rows, the student's "
            f"{student_weight.shape[0]}: distillation needs a shared vocabulary"
        )
    if isinstance(teacher_weight_VD, DTensor):
        same_split = (teacher_weight_VD.device_mesh == student_weight.device_mesh
                      and teacher_weight_VD.placements == student_weight.placements)
        if same_split:
            return teacher_weight_VD.to_local()
        teacher_weight_VD = teacher_weight_VD.full_tensor()
    local_rows = student_weight.to_local().shape[0]
    return teacher_weight_VD[vocab_start : vocab_start + local_rows]


class ReplicatedScoreHead(ParallelStyle):
    """A sequence classifier's [L, D] score head (a reward or value model: L labels, too few rows to split): the weight
    replicated (a Replicate DTensor, so the ranks' gradients stay one), the hidden states gathered over the sequence,
    and the scores returned whole, the same on every rank (the loss computed from them is then every rank's)."""

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        assert isinstance(module, OutputHead) and not module.is_tied, type(module)
        module.weight = nn.Parameter(distribute_tensor(module.weight, device_mesh, (Replicate(),), src_data_rank=None))
        module.forward = types.MethodType(_replicated_score_forward, module)
        return module


def _replicated_score_forward(self: OutputHead, hidden_BSD: torch.Tensor, loss=None) -> torch.Tensor:
    if loss is not None:
        raise ValueError(f"a tensor-parallel sequence classifier's score head returns scores, not {type(loss).__name__}")
    weight = self.projection()
    scores = F.linear(_replicated_hidden(hidden_BSD, weight.device_mesh), weight)
    if self.softcap is not None:
        scores = torch.tanh(scores / self.softcap) * self.softcap
    return scores.to_local()


class RoutedOnLocalTokens(ParallelStyle):
    """A mixture-of-experts layer under sequence parallel: each rank routes its own [B, S/P, D] part of the sequence
    (taken as a local tensor), through a router and experts replicated over the ranks (Replicate DTensors, read
    through ``local_values``: each rank's gradient is its tokens' share, summed over the ranks). The router's loss
    is shared by the ranks (``MoE.sequence_group``)."""

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        assert isinstance(module, MoE), type(module)
        for owner in (module.router, module.experts):
            for name, param in list(owner.named_parameters(recurse=False)):
                replicated = distribute_tensor(param.data, device_mesh, (Replicate(),), src_data_rank=None)
                setattr(owner, name, nn.Parameter(replicated, requires_grad=param.requires_grad))
        module.router.forward = types.MethodType(_local_linear_forward, module.router)
        module.register_forward_pre_hook(_local_tokens)
        module.sequence_group = device_mesh.get_group()
        return module


def _local_tokens(module, inputs):
    x = inputs[0]
    return (x.to_local() if isinstance(x, DTensor) else x, *inputs[1:])


def _local_linear_forward(self: nn.Linear, x: torch.Tensor) -> torch.Tensor:
    return F.linear(x, local_values(self.weight), local_values(self.bias))


def _block_plan(block: nn.Module) -> dict[str, ParallelStyle]:
    plan: dict[str, ParallelStyle] = {
        "attention": _GatherSequence(),
        "attention.wq": ColwiseParallelLora(),
        "attention.wk": ColwiseParallelLora(),
        "attention.wv": ColwiseParallelLora(),
        "attention.wo": RowwiseParallelLora(output_layouts=Shard(1)),
    }
    if block.moe is not None:
        plan["moe"] = RoutedOnLocalTokens()
    else:
        plan.update({
            "feed_forward": _GatherSequence(),
            "feed_forward.w1": ColwiseParallelLora(),
            "feed_forward.w2": RowwiseParallelLora(output_layouts=Shard(1)),
            "feed_forward.w3": ColwiseParallelLora(),
        })
    for norm in ("attention_norm", "post_attention_norm", "ffn_norm", "post_ffn_norm"):
        if getattr(block, norm) is not None:
            plan[norm] = SequenceParallel()
    if block.attention.q_norm is not None:
        # the q/k norms see [B, H/P, S, d]: split over the head dim (1), each head normed on its own rank
        plan["attention.q_norm"] = SequenceParallel(sequence_dim=1, use_local_output=True)
        plan["attention.k_norm"] = SequenceParallel(sequence_dim=1, use_local_output=True)
    return plan


def apply_tensor_parallel(model: nn.Module, tp_mesh: DeviceMesh) -> nn.Module:
    """Split ``model`` (a native Transformer) over the 1-D ``tp_mesh``; in place. Every parameter becomes a DTensor
    on ``tp_mesh``, each rank keeping its slice of the values it holds: build the model on the meta device (and load
    afterwards), or with the same values on every rank. Raises ValueError for what cannot be split.

    Under it the model takes sequences whose length is a multiple of tp, ``hidden_states`` returns a DTensor split
    over the sequence, and ``model.output`` runs the losses vocabulary-parallel."""
    tp = tp_mesh.size()
    check_tensor_parallel(model, tp)
    # the styles make new parameters (torch's SequenceParallel, the embedding's and head's here) trainable; a frozen
    # one (a LoRA run's norms, embedding, base weights) stays frozen
    frozen = {name for name, param in model.named_parameters() if not param.requires_grad}
    tied_head = model.output.base_projection() is model.tok_embeddings.weight
    parallelize_module(model, tp_mesh, {
        "tok_embeddings": VocabParallelEmbedding(),
        "norm": SequenceParallel(),
    })
    if tied_head:
        model.output.tie(model.tok_embeddings)  # the head reads the embedding's (now split) parameter
    classifier = getattr(model.args, "num_labels", None) is not None
    parallelize_module(model.output, tp_mesh, ReplicatedScoreHead() if classifier else LossParallelHead())
    for block in model.layers:
        parallelize_module(block, tp_mesh, _block_plan(block))
        # the attention reshapes its projections by its head counts: each rank now holds 1/tp of the heads
        block.attention.n_heads //= tp
        block.attention.n_kv_heads //= tp
    for name, param in model.named_parameters():
        if name in frozen:
            param.requires_grad_(False)
    return model


__all__ = ["ColwiseParallelLora", "LossParallelHead", "ReplicatedScoreHead", "RoutedOnLocalTokens", "RowwiseParallelLora",
           "VocabParallelEmbedding", "apply_tensor_parallel", "check_tensor_parallel"]
