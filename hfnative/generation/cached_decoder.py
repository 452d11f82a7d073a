"""The native decoder's forward with a key/value cache, on the model's own modules and live weights.

Shapes: B batch, S sequence, D model dim, H query heads, K key/value heads, d head_dim, L cache entries,
V vocabulary.

``prefill`` runs the left-padded prompts in one pass (attention planned as the training forward
plans it) and fills the cache; ``decode_step`` runs one new token per row against the cache. Both
call the block's submodules (norms, projections, q/k norms, MoE, feed-forward, head) as modules, so
LoRA adapters and any later weight update are what runs; the layer order of operations mirrors
``TransformerBlock.forward`` and ``Attention.forward`` in hfnative/models (the parity tests in
tests/test_generation.py hold the two together).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from hfnative.models.attention import AttentionPlan, _attend_with_sinks, attend
from hfnative.models.decoder import Transformer, TransformerBlock
from hfnative.models.layers import Attention
from hfnative.models.rope import apply_rotary

from .kv_cache import KVCache


def _norm_if(norm, x: torch.Tensor) -> torch.Tensor:
    return x if norm is None else norm(x)


def _project_qkv(attention: Attention, x_BSD: torch.Tensor, cos_sin) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Rotated queries [B, H, S, d], keys and values [B, K, S, d] (as ``Attention.forward`` makes them)."""
    B, S, _ = x_BSD.shape
    xq, xk, xv = attention.wq(x_BSD), attention.wk(x_BSD), attention.wv(x_BSD)
    if attention.q_norm is not None and attention.qk_norm_over_projection:
        xq, xk = attention.q_norm(xq), attention.k_norm(xk)
    xq_BHSd = xq.view(B, S, attention.n_heads, attention.head_dim).transpose(1, 2)
    xk_BKSd = xk.view(B, S, attention.n_kv_heads, attention.head_dim).transpose(1, 2)
    xv_BKSd = xv.view(B, S, attention.n_kv_heads, attention.head_dim).transpose(1, 2)
    if attention.q_norm is not None and not attention.qk_norm_over_projection:
        xq_BHSd, xk_BKSd = attention.q_norm(xq_BHSd), attention.k_norm(xk_BKSd)
    cos, sin = cos_sin
    return apply_rotary(xq_BHSd, cos, sin), apply_rotary(xk_BKSd, cos, sin), xv_BKSd


def _attend_cache(attention: Attention, q_BH1d, keys_BKLd, values_BKLd, visible_B11L) -> torch.Tensor:
    """One query per row against the layer's cache entries it may see."""
    if attention.sinks is not None:
        return _attend_with_sinks(q_BH1d, keys_BKLd, values_BKLd, visible_B11L, attention.sinks, attention.scale)
    return F.scaled_dot_product_attention(
        q_BH1d, keys_BKLd, values_BKLd, attn_mask=visible_B11L, scale=attention.scale,
        enable_gqa=keys_BKLd.shape[1] != q_BH1d.shape[1],
    )


def _block_forward(
    block: TransformerBlock, x_BSD: torch.Tensor, cos_sin, cache: KVCache, plan: AttentionPlan | None
) -> torch.Tensor:
    """One block; ``plan``: the prompts' attention plan at prefill, None for a decode step (S = 1)."""
    attention = block.attention
    B, S, _ = x_BSD.shape
    q_BHSd, k_BKSd, v_BKSd = _project_qkv(attention, _norm_if(block.attention_norm, x_BSD), cos_sin)
    keys_BKLd, values_BKLd = cache.write(block.layer_id, k_BKSd, v_BKSd)
    if plan is not None:  # prefill: the prompts attend among themselves
        out_BHSd = attend(q_BHSd, k_BKSd, v_BKSd, plan, block.is_sliding, attention.scale, attention.sinks)
    else:
        out_BHSd = _attend_cache(attention, q_BHSd, keys_BKLd, values_BKLd, cache.mask(block.layer_id))
    attn_out = attention.wo(out_BHSd.transpose(1, 2).reshape(B, S, -1))
    h = x_BSD + _norm_if(block.post_attention_norm, attn_out)
    ffn_in = _norm_if(block.ffn_norm, h)
    ffn_out = block.moe(ffn_in) if block.moe is not None else block.feed_forward(ffn_in)
    return h + _norm_if(block.post_ffn_norm, ffn_out)


def _last_logits(model: Transformer, tokens_BS: torch.Tensor, positions_BS: torch.Tensor, cache: KVCache,
                 plan: AttentionPlan | None) -> torch.Tensor:
    """Run the blocks over ``tokens_BS`` (writing the cache); the logits of each row's last token [B, V]."""
    h = model.tok_embeddings(tokens_BS)
    if model.args.embedding_scale is not None:
        h = h * torch.tensor(model.args.embedding_scale).to(h.dtype)
    rope_dtype = torch.float32 if model.args.rotary_in_float32 else h.dtype
    cos_sin = model.rope(positions_BS, rope_dtype)
    local_cos_sin = model.local_rope(positions_BS, rope_dtype) if model.local_rope is not None else cos_sin
    for layer in model.layers:
        h = _block_forward(layer, h, local_cos_sin if layer.is_sliding else cos_sin, cache, plan)
    return model.output(model.norm(h[:, -1:]))[:, 0]


def prefill(model: Transformer, tokens_BP: torch.Tensor, attention_mask_BP: torch.Tensor, cache: KVCache) -> torch.Tensor:
    """All prompts in one pass, left-padded to P slots (attention_mask_BP: 1 for real tokens); fills
    slots 0..P-1 of the cache. Returns the logits of the last prompt token [B, V]."""
    B, P = tokens_BP.shape
    positions_BP = (torch.arange(P, device=tokens_BP.device)[None, :] - cache.pad_B[:, None]).clamp(min=0)
    plan = model.plan_attention(tokens_BP, attention_mask_BP.cpu())
    cache.start(torch.arange(P, device=tokens_BP.device))
    return _last_logits(model, tokens_BP, positions_BP, cache, plan)


def decode_step(model: Transformer, tokens_B: torch.Tensor, slot: torch.Tensor, cache: KVCache) -> torch.Tensor:
    """One new token per row at ``slot`` (a 0-d long tensor, so a compiled step is reused at every
    slot); returns its logits [B, V]."""
    positions_B1 = (slot - cache.pad_B)[:, None]
    cache.start(slot.reshape(1))
    return _last_logits(model, tokens_B[:, None], positions_B1, cache, None)
