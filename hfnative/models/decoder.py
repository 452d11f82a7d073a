"""The decoder: embedding -> blocks -> norm -> output head, built from ModelArgs.

Shapes: B batch, S sequence, D model dim, V vocabulary.
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.utils.checkpoint

from .args import ModelArgs
from .layers import Attention, FeedForward, RMSNorm, build_attention_mask, document_ids
from .moe import GroupedExperts, MoE
from .rope import RotaryEmbedding


class TransformerBlock(nn.Module):
    def __init__(self, layer_id: int, args: ModelArgs):
        super().__init__()
        self.layer_id = layer_id
        self.is_sliding = args.layer_type(layer_id) == "sliding_attention"
        self.attention_norm = RMSNorm(args.dim, args.norm_eps, args.norm_unit_offset)
        self.attention = Attention(args)
        self.ffn_norm = RMSNorm(args.dim, args.norm_eps, args.norm_unit_offset)
        if args.is_moe_layer(layer_id):
            self.moe = MoE(args.dim, args.moe, args.activation)
            self.feed_forward = None
        else:
            self.feed_forward = FeedForward(args.dim, args.intermediate_size, args.activation, args.mlp_bias)
            self.moe = None
        if args.post_sublayer_norms:
            self.post_attention_norm = RMSNorm(args.dim, args.norm_eps, args.norm_unit_offset)
            self.post_ffn_norm = RMSNorm(args.dim, args.norm_eps, args.norm_unit_offset)
        else:
            self.post_attention_norm = self.post_ffn_norm = None

    def forward(self, x_BSD: torch.Tensor, cos_sin, mask) -> torch.Tensor:
        attn_out = self.attention(self.attention_norm(x_BSD), cos_sin, mask)
        if self.post_attention_norm is not None:
            attn_out = self.post_attention_norm(attn_out)
        h = x_BSD + attn_out
        ffn = self.moe if self.moe is not None else self.feed_forward
        ffn_out = ffn(self.ffn_norm(h))
        if self.post_ffn_norm is not None:
            ffn_out = self.post_ffn_norm(ffn_out)
        return h + ffn_out


class Transformer(nn.Module):
    """A causal LM. ``forward`` returns logits [B, S, V]; ``hidden_states`` the normed final states."""

    def __init__(self, args: ModelArgs):
        super().__init__()
        self.args = args
        self.tok_embeddings = nn.Embedding(args.vocab_size, args.dim, padding_idx=args.padding_idx)
        self.rope = RotaryEmbedding(args.rope, args.head_dim)
        self.local_rope = RotaryEmbedding(args.local_rope, args.head_dim) if args.local_rope else None
        self.layers = nn.ModuleList(TransformerBlock(i, args) for i in range(args.n_layers))
        self.norm = RMSNorm(args.dim, args.norm_eps, args.norm_unit_offset)
        self.output = None if args.tie_embeddings else nn.Linear(args.dim, args.vocab_size, bias=False)
        # blocks whose activations are recomputed in backward instead of kept (activation checkpointing)
        self.checkpointed_layers: frozenset[int] = frozenset()

    @property
    def output_weight(self) -> torch.Tensor:
        """The [V, D] head matrix (the embedding when tied)."""
        return self.tok_embeddings.weight if self.output is None else self.output.weight

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
            elif isinstance(module, RMSNorm):
                module.reset_parameters()
            elif isinstance(module, GroupedExperts):
                module.reset_parameters(std)
        self.init_buffers()

    def hidden_states(
        self,
        input_ids_BS: torch.Tensor,
        attention_mask_BS: torch.Tensor | None = None,
        position_ids_BS: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Final normed hidden states [B, S, D].

        attention_mask_BS: 1 for real tokens, 0 for padding (either side).
        position_ids_BS: per-token positions; without a padding mask, a position that does not
        follow its predecessor starts a new document (packed sequences never attend across it).
        """
        B, S = input_ids_BS.shape
        if position_ids_BS is None:
            position_ids_BS = torch.arange(S, device=input_ids_BS.device).expand(B, S)
            doc_ids = None
        else:
            position_ids_BS = position_ids_BS.expand(B, S)
            doc_ids = document_ids(position_ids_BS) if attention_mask_BS is None else None
            if doc_ids is not None and bool((doc_ids[:, -1] == 0).all()):
                doc_ids = None
        if attention_mask_BS is not None and bool(attention_mask_BS.all()):
            attention_mask_BS = None

        h = self.tok_embeddings(input_ids_BS)
        if self.args.embedding_scale is not None:
            h = h * torch.tensor(self.args.embedding_scale).to(h.dtype)
        global_mask = build_attention_mask(S, h.device, attention_mask_BS, doc_ids)
        cos_sin = self.rope(position_ids_BS, h.dtype)
        sliding_mask = local_cos_sin = None
        if any(layer.is_sliding for layer in self.layers):
            sliding_mask = build_attention_mask(S, h.device, attention_mask_BS, doc_ids, self.args.sliding_window)
            local_cos_sin = self.local_rope(position_ids_BS, h.dtype) if self.local_rope else cos_sin
        for layer_id, layer in enumerate(self.layers):
            layer_inputs = (h, local_cos_sin, sliding_mask) if layer.is_sliding else (h, cos_sin, global_mask)
            if layer_id in self.checkpointed_layers and torch.is_grad_enabled():
                h = torch.utils.checkpoint.checkpoint(layer, *layer_inputs, use_reentrant=False)
            else:
                h = layer(*layer_inputs)
        return self.norm(h)

    def logits(self, h_BSD: torch.Tensor) -> torch.Tensor:
        logits = h_BSD @ self.output_weight.T
        cap = self.args.final_logit_softcap
        if cap is not None:
            logits = torch.tanh(logits / cap) * cap
        return logits

    def forward(
        self,
        input_ids_BS: torch.Tensor,
        attention_mask_BS: torch.Tensor | None = None,
        position_ids_BS: torch.Tensor | None = None,
    ) -> torch.Tensor:
        return self.logits(self.hidden_states(input_ids_BS, attention_mask_BS, position_ids_BS))
