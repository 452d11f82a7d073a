"""The decoder: embedding -> blocks -> norm -> output head, built from ModelArgs.

Shapes: B batch, S sequence, D model dim, V vocabulary.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field

import torch
import torch.nn as nn
from torch.distributed.tensor import DTensor

from hfnative.device_policy import device_policy
from hfnative.losses import at_least_one, shift_labels as shift_labels_of
from hfnative.precision import autocast_dtype

from .args import ModelArgs
from .attention import AttentionPlan, flash_varlen_serves, plan_attention
from .block_checkpoint import checkpoint_block
from .compute_dtype import autocast_to, under_weights_autocast
from .head import OutputHead, TokenCrossEntropy
from .layers import Attention, FeedForward, RMSNorm, cast_for_linears, model_norm, plain_linears
from .moe import GroupedExperts, MoE, RouterLogits, load_balancing_loss
from .recompute import keep_as_recomputed, recomputed_in_backward
from .selective_checkpoint import affordable_keep, available_device_bytes, selective_checkpoint_context
from .rope import RotaryEmbedding


def _norm_if(norm: RMSNorm | None, x: torch.Tensor) -> torch.Tensor:
    return x if norm is None else norm(x)


def _normed(norm: RMSNorm, x: torch.Tensor, linears: int | None):
    """``norm(x)``, or for ``linears`` linear layers one input each (``RMSNorm.for_linears``)."""
    return norm(x) if linears is None else norm.for_linears(x, linears)


def _remade_in_backward(norm: RMSNorm, x: torch.Tensor, linears: int | None, outputs):
    """``outputs`` (``_normed(norm, x, linears)``'s), remade from ``x`` (kept by the norm) in backward."""
    def first(out):  # the tensor autograd keeps (the views of a fanned-out output share it)
        return out if linears is None else out[0]

    keep_as_recomputed(first(outputs), lambda: first(_normed(norm, x, linears)))
    return outputs


def _pre_norm(norm: RMSNorm | None, x: torch.Tensor, linears: int | None = None):
    """A sublayer's input norm; for ``linears`` linear layers (``RMSNorm.for_linears``; without a norm,
    ``cast_for_linears``), a tuple of one input each. Its output is remade from ``x`` (kept by the norm) in backward."""
    if norm is None:
        return x if linears is None else cast_for_linears(x, linears)
    return _remade_in_backward(norm, x, linears, _normed(norm, x, linears))


def _residual_and_pre_norm(norm: RMSNorm | None, x: torch.Tensor, update: torch.Tensor, linears: int | None = None):
    """``(x + update, the next sublayer's pre-norm of that sum)`` (``_pre_norm``'s output): one kernel each way
    where the Triton kernels run (``RMSNorm.after_residual``), else the add and ``_pre_norm``."""
    fused = None if norm is None else norm.after_residual(x, update, linears)
    if fused is None:
        h = x + update
        return h, _pre_norm(norm, h, linears)
    h, outputs = fused
    return h, _remade_in_backward(norm, h, linears, outputs)


class TransformerBlock(nn.Module):
    """One decoder layer; with pre-norms (the default) ``h = x + attention(attention_norm(x))``,
    ``out = h + feed_forward(ffn_norm(h))``; ``args.norm_placement`` adds or moves norms after the sublayers."""

    def __init__(self, layer_id: int, args: ModelArgs):
        super().__init__()
        self.layer_id = layer_id
        self.is_sliding = args.layer_type(layer_id) == "sliding_attention"
        pre_norms = args.norm_placement in ("pre", "sandwich")
        post_norms = args.norm_placement in ("sandwich", "post")
        self.attention_norm = model_norm(args) if pre_norms else None
        self.attention = Attention(args)
        self.post_attention_norm = model_norm(args) if post_norms else None
        self.ffn_norm = model_norm(args) if pre_norms else None
        if args.is_moe_layer(layer_id):
            self.moe = MoE(args.dim, args.moe, args.activation)
            self.feed_forward = None
        else:
            self.feed_forward = FeedForward(args.dim, args.intermediate_size, args.activation, args.mlp_bias)
            self.moe = None
        self.post_ffn_norm = model_norm(args) if post_norms else None

    def attention_input_linears(self) -> int | None:
        """How many plain linear projections read the attention's pre-norm output (the query, key and value), each
        handed one of its own (``_pre_norm``); None where the attention takes one tensor (a LoRA or other non-plain
        projection; forward pre-hooks, e.g. tensor parallelism's sequence gather)."""
        attention = self.attention
        fan_out = not attention._forward_pre_hooks and plain_linears(attention.wq, attention.wk, attention.wv)
        return 3 if fan_out else None

    def ffn_input_linears(self) -> int | None:
        """``attention_input_linears`` for the MLP's pre-norm (the gate and up projections); None for a MoE block."""
        mlp = self.feed_forward
        fan_out = mlp is not None and not mlp._forward_pre_hooks and plain_linears(mlp.w1, mlp.w3)
        return 2 if fan_out else None

    def forward(self, x_BSD: torch.Tensor, cos_sin, plan: AttentionPlan, router_logits: list | None = None) -> torch.Tensor:
        # the pre-norms' outputs, one for each plain linear projection reading them (the query, key and value; the
        # gate and up)
        attn_out = self.attention(_pre_norm(self.attention_norm, x_BSD, self.attention_input_linears()), cos_sin, plan,
                                  self.is_sliding)
        h, ffn_in = _residual_and_pre_norm(self.ffn_norm, x_BSD, _norm_if(self.post_attention_norm, attn_out),
                                           self.ffn_input_linears())
        ffn_out = self.moe(ffn_in, router_logits) if self.moe is not None else self.feed_forward(ffn_in)
        return h + _norm_if(self.post_ffn_norm, ffn_out)


def _attention_planning(model: Transformer) -> tuple:
    """What ``Transformer.plan_attention`` reads of the model."""
    has_sliding = any(layer.is_sliding for layer in model.layers)
    return model.args.sliding_window if has_sliding else None, model.attention_implementation


def _is_compiled(layer: nn.Module) -> bool:
    """Whether ``hfnative.parallel.compile`` compiled the block (or its attention): the compiler then chooses what
    backward recomputes."""
    return "_compiled_forward" in vars(layer) or "_compiled_forward" in vars(layer.attention)


def _checkpoints_itself(layer: nn.Module, plan: AttentionPlan, h_BSD: torch.Tensor) -> bool:
    """Whether the block runs its activation checkpoint inside its compiled graph (``hfnative.parallel.compile``,
    ``checkpoint_keep=``): compiled so, for a plan whose attention compiles into the graph: causal, dense masks, and
    variable-length attention where ``varlen_attn`` serves the layer (CUDA, bf16/fp16). Per-document attention runs
    eagerly between two graphs (``hfnative.models.attention``), and a checkpoint's graph cannot hold that break: there
    the checkpoint stays around the compiled forward."""
    if "_compiled_checkpointed" not in vars(layer):
        return False
    if plan.kind == "varlen":
        attention = layer.attention
        dtype = autocast_dtype(h_BSD.device.type) or h_BSD.dtype
        return flash_varlen_serves(h_BSD.device, dtype, attention.head_dim,
                                   plan.sliding_window if layer.is_sliding else None, attention.scale,
                                   attention.sinks is not None)
    return plan.kind in ("causal", "dense")


class BlockOnAnotherStage(nn.Module):
    """The place of a block that another pipeline stage holds (``hfnative.parallel.pipeline``): no parameters, skipped
    by the forward; it keeps every block's index, and so its parameter names, those of the whole model."""

    def __init__(self, layer_id: int, is_sliding: bool):
        super().__init__()
        self.layer_id, self.is_sliding = layer_id, is_sliding
        self.moe = None


@dataclass
class CausalLMOutput:
    """What ``Transformer.forward`` returns, with the names transformers' outputs use.

    loss: mean next-token NLL over the label tokens (summed / num_items_in_batch when given), plus
    aux_loss_coef * aux_loss for MoE when the aux loss is on; None without labels.
    logits: [B, S, V], computed on first access (a loss alone never builds them).
    head_output: what ``head_loss`` returned, when one was given.
    """

    hidden_states: torch.Tensor  # final normed states [B, S, D]
    head: OutputHead = field(repr=False)
    loss: torch.Tensor | None = None
    aux_loss: torch.Tensor | None = None
    head_output: object = None
    _logits: torch.Tensor | None = field(default=None, repr=False)
    # (device type, dtype): the forward ran under autocast to its model's linear weights' dtype (a frozen model's,
    # hfnative.models.compute_dtype), and the logits are made under it too
    autocast_for: tuple[str, torch.dtype] | None = field(default=None, repr=False)

    @property
    def logits(self) -> torch.Tensor:
        if self._logits is None:
            with autocast_to(*(self.autocast_for or (None, None))):
                self._logits = self.head(self.hidden_states)
        return self._logits

    def __getitem__(self, key: str):  # outputs["loss"], as with transformers' ModelOutput
        return getattr(self, key)


class Transformer(nn.Module):
    """A causal LM. ``forward`` takes transformers' input names and returns a CausalLMOutput."""

    def __init__(self, args: ModelArgs):
        super().__init__()
        self.args = args
        self.tok_embeddings = nn.Embedding(args.vocab_size, args.dim, padding_idx=args.padding_idx)
        self.rope = RotaryEmbedding(args.rope, args.head_dim)
        self.local_rope = RotaryEmbedding(args.local_rope, args.head_dim) if args.local_rope else None
        self.layers = nn.ModuleList(TransformerBlock(i, args) for i in range(args.n_layers))
        self.norm = model_norm(args)
        if args.num_labels is None:
            tied = self.tok_embeddings if args.tie_embeddings else None
            self.output = OutputHead(args.dim, args.vocab_size, args.final_logit_softcap, tied_embedding=tied)
        else:  # a sequence classifier's score head [num_labels, D] (hfnative.models.classifier)
            self.output = OutputHead(args.dim, args.num_labels)
        # blocks whose activations are recomputed in backward instead of kept (activation checkpointing)
        self.checkpointed_layers: frozenset[int] = frozenset()
        # what a checkpointed block keeps (hfnative.models.selective_checkpoint); None: the device policy's choice
        self.checkpoint_keeps: str | None = None
        # "varlen": packed and padded batches attend per document with no [S, S] mask; "sdpa": dense masks
        self.attention_implementation = "varlen"
        # MoE: compute the router's load-balancing loss (the trainer turns it on as TRL does)
        self.aux_loss_enabled = False
        # (stage, stages) when this model is one stage of a pipeline (hfnative.parallel.pipeline.split_into_stage):
        # its forward then maps the previous stage's hidden states (the first: token ids) to the next stage's
        self.pipeline_stage: tuple[int, int] | None = None
        # the autocast dtype a frozen model's linear weights are kept in (hfnative.models.compute_dtype): its forward
        # runs under autocast to it
        self.linear_weights_dtype: torch.dtype | None = None

    def init_buffers(self):
        """(Re)compute non-persistent buffers, e.g. after materializing from the meta device."""
        for rope in (self.rope, self.local_rope):
            if rope is not None:
                rope.reset_parameters()

    def init_weights(self, std: float = 0.02):
        """Random initialization for training from scratch (a checkpoint load overwrites it)."""
        for module in self.modules():
            if isinstance(module, (nn.Linear, nn.Embedding)):
                nn.init.normal_(module.weight, std=std)
                if getattr(module, "bias", None) is not None:
                    nn.init.zeros_(module.bias)
            elif isinstance(module, OutputHead) and not module.is_tied:
                nn.init.normal_(module.weight, std=std)
            elif isinstance(module, RMSNorm):
                module.reset_parameters()
            elif isinstance(module, GroupedExperts):
                module.reset_parameters(std)
            elif isinstance(module, Attention) and module.sinks is not None:
                nn.init.normal_(module.sinks, std=std)
        self.init_buffers()

    def plans_attention_as(self, other) -> bool:
        """Whether ``plan_attention`` makes ``other`` (a model run on the same batches, e.g. a teacher) the plan it
        makes this model: one plan, made on the host, then serves both."""
        if not isinstance(other, Transformer):
            return False
        return _attention_planning(self) == _attention_planning(other)

    def plan_attention(
        self,
        input_ids_BS: torch.Tensor,
        attention_mask_BS: torch.Tensor | None = None,
        position_ids_BS: torch.Tensor | None = None,
        device: torch.device | None = None,
    ) -> AttentionPlan:
        """How attention runs for this batch (see attention.py); call it on host tensors to avoid a sync."""
        B, S = input_ids_BS.shape
        sliding_window, implementation = _attention_planning(self)
        return plan_attention(
            B, S, device or input_ids_BS.device, attention_mask_BS, position_ids_BS, sliding_window, implementation,
        )

    def hidden_states(
        self,
        input_ids_BS: torch.Tensor,
        attention_mask_BS: torch.Tensor | None = None,
        position_ids_BS: torch.Tensor | None = None,
        attention_plan: AttentionPlan | None = None,
        router_logits: list | None = None,
    ) -> torch.Tensor:
        """Final normed hidden states [B, S, D].

        attention_mask_BS: 1 for real tokens, 0 for padding (either side).
        position_ids_BS: per-token positions; without a padding mask, a position that does not
        follow its predecessor starts a new document (packed sequences never attend across it).
        attention_plan: made by ``plan_attention`` (made here when not given).
        router_logits: a list that MoE layers append their router logits [B * S, E] to.
        A pipeline stage after the first takes the previous stage's hidden states [B, S, D] as ``input_ids_BS``, and
        a stage before the last returns its last block's output, not normed.
        """
        B, S = input_ids_BS.shape[:2]
        if attention_plan is None:
            attention_plan = self.plan_attention(input_ids_BS, attention_mask_BS, position_ids_BS)
        if position_ids_BS is None:
            position_ids_BS = torch.arange(S, device=input_ids_BS.device).expand(B, S)
        else:
            position_ids_BS = position_ids_BS.expand(B, S)

        if self.tok_embeddings is None:  # a later pipeline stage: the previous stage's output
            h = input_ids_BS
        else:
            h = self.tok_embeddings(input_ids_BS)
            if self.args.embedding_scale is not None:
                h = h * torch.tensor(self.args.embedding_scale).to(h.dtype)
        rope_dtype = torch.float32 if self.args.rotary_in_float32 else h.dtype
        cos_sin = self.rope(position_ids_BS, rope_dtype)
        local_cos_sin = cos_sin
        if self.local_rope is not None and any(layer.is_sliding for layer in self.layers):
            local_cos_sin = self.local_rope(position_ids_BS, rope_dtype)
        # the device's trades (hfnative.device_policy): a CPU remakes cheap activations in backward, a GPU keeps them;
        # under activation checkpointing a GPU keeps attention and every second matmul (what fits) and recomputes the
        # rest
        policy = device_policy(h.device)
        keep = self.checkpoint_keeps or self._default_checkpoint_keep(h, policy)
        for layer_id, layer in enumerate(self.layers):
            if isinstance(layer, BlockOnAnotherStage):
                continue
            layer_inputs = (h, local_cos_sin if layer.is_sliding else cos_sin, attention_plan)
            if layer.moe is not None:
                layer_inputs += (router_logits,)
            checkpointed = layer_id in self.checkpointed_layers and torch.is_grad_enabled()
            if checkpointed and _checkpoints_itself(layer, attention_plan, h):
                h = layer(*layer_inputs, checkpoint_keep=keep)
            elif checkpointed:
                # a block compiled otherwise recomputes its whole graph
                selective = keep != "nothing" and not _is_compiled(layer)
                h = checkpoint_block(
                    layer, *layer_inputs,
                    context_fn=functools.partial(selective_checkpoint_context, keep) if selective else None,
                )
            else:
                with recomputed_in_backward(policy.recompute_in_backward and not _is_compiled(layer)):
                    h = layer(*layer_inputs)
        return h if self.norm is None else self.norm(h)

    def _default_checkpoint_keep(self, h_BSD: torch.Tensor, policy) -> str:
        """What checkpointed blocks keep when ``checkpoint_keeps`` is not set: full checkpointing ("nothing") under
        the CPU policy and in a pipeline stage (several micro-batches' forwards are kept at once there); under the
        GPU policy the most of the attention and projections' results that fits in the device's memory for this
        batch (``affordable_keep``), once what the step allocates anyway is set aside (the parameters' gradients still
        to come, the checkpointed blocks' inputs): a run that fits with full checkpointing (TRL's) should not run out
        of memory for them."""
        if (not policy.selective_checkpointing or not self.checkpointed_layers or not torch.is_grad_enabled()
                or self.pipeline_stage is not None):
            return "nothing"
        local = h_BSD.to_local() if isinstance(h_BSD, DTensor) else h_BSD  # a sequence shard under tensor parallelism
        available = available_device_bytes(local.device)
        if available is None:  # the GPU policy forced on a CPU
            return affordable_keep([], 0, 0, None)
        blocks = [self.layers[i] for i in sorted(self.checkpointed_layers) if i < len(self.layers)]
        # (a sharded or split parameter's gradient on this rank: its local share)
        gradients = sum((p.to_local() if isinstance(p, DTensor) else p).numel() * p.element_size()
                        for p in self.parameters() if p.requires_grad and p.grad is None)
        inputs = len(blocks) * local.numel() * local.element_size()
        compute_dtype = autocast_dtype(local.device.type)
        element_size = (compute_dtype or local.dtype).itemsize
        return affordable_keep(blocks, local.numel() // local.shape[-1], element_size,
                               max(available - gradients - inputs, 0), autocast=compute_dtype is not None)

    @under_weights_autocast  # a frozen model kept in the autocast dtype (hfnative.models.compute_dtype)
    def forward(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
        labels: torch.Tensor | None = None,
        shift_labels: torch.Tensor | None = None,
        num_items_in_batch: int | torch.Tensor | None = None,
        attention_plan: AttentionPlan | None = None,
        head_loss=None,
        **unused,
    ) -> CausalLMOutput:
        """input_ids [B, S]; labels [B, S] unshifted (or shift_labels [B, S], already shifted), as
        transformers' causal LMs take them. head_loss: a loss spec from ``hfnative.models.head``
        computed through the head (its result is ``head_output``). Other transformers keyword
        arguments (use_cache, cu_seq_lens_*, ...) are accepted and not needed.

        A pipeline stage (``pipeline_stage`` set) returns its hidden states [B, S, D] (the last stage's normed, for
        the loss its schedule computes through the head), taking the previous stage's as ``input_ids``."""
        if self.pipeline_stage is not None:
            return self.hidden_states(input_ids, attention_mask, position_ids, attention_plan)
        router_logits = RouterLogits() if self.aux_loss_enabled and self.args.moe is not None else None
        hidden_BSD = self.hidden_states(input_ids, attention_mask, position_ids, attention_plan, router_logits)
        out = CausalLMOutput(hidden_BSD, self.output)
        if router_logits:
            out.aux_loss = load_balancing_loss(router_logits, self.args.moe.num_experts, self.args.moe.top_k, attention_mask)
        if head_loss is not None:
            out.head_output = self.output(hidden_BSD, loss=head_loss)
        if labels is not None or shift_labels is not None:
            targets_BS = shift_labels if shift_labels is not None else shift_labels_of(labels)
            stats = self.output(hidden_BSD, loss=TokenCrossEntropy(targets_BS))
            denominator = num_items_in_batch if num_items_in_batch is not None else at_least_one(stats.num_tokens)
            out.loss = stats.loss_sum / denominator
            if out.aux_loss is not None:
                out.loss = out.loss + self.args.moe.aux_loss_coef * out.aux_loss
        return out
