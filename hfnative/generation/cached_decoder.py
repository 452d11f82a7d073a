"""The native decoder's forward with a key/value cache, on the model's own modules and live weights.

Shapes: B batch, S sequence, D model dim, H query heads, K key/value heads, d head_dim, L cache entries,
V vocabulary.

``prefill`` runs the prompts in one pass, packed as the training forward runs packed documents
(no padding computed), and fills the cache; ``decode_step`` runs one new token per row against the cache. Both
call the block's submodules (norms, projections, q/k norms, MoE, feed-forward, head) as modules, so
LoRA adapters and any later weight update are what runs; the layer order of operations mirrors
``TransformerBlock.forward`` and ``Attention.forward`` in hfnative/models (the parity tests in
tests/test_generation.py hold the two together); where a replica decoded under autocast stacked the weights of the
projections reading one input (``compute_weights.FUSED``), those are one matmul, and a decode step's heads go into the
cache through one Triton kernel (``decode_qkv``) where the kernels run. RoPE's cos/sin are looked up in ``DecoderTables`` made once per cache
(the same values the model's rotary module computes per call), so a step computes no trigonometry.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from hfnative.models.attention import AttentionPlan, _attend_with_sinks, attend, plan_attention
from hfnative.models.decoder import Transformer, TransformerBlock, _pre_norm, _residual_and_pre_norm
from hfnative.models.layers import Attention, FeedForward, gated_activation, narrowing_autocast_dtype
from hfnative.models.triton_decode import (decode_attention, decode_attention_supported, decode_attention_takes,
                                           decode_qkv, decode_qkv_supported)
from hfnative.precision import autocast_dtype

from .compute_weights import FUSED, fused_outputs
from .kv_cache import KVCache


def _norm_if(norm, x: torch.Tensor) -> torch.Tensor:
    return x if norm is None else norm(x)


class DecoderTables:
    """What every step reads and none changes, made once per cache: cos/sin [N, r] of positions 0..N-1 under the
    model's RoPE (and its local RoPE, when it has one) in the dtype the decoder rotates in (``rope(positions)`` gives
    what ``model.rope(positions, dtype)`` gives, element for element), and the embedding scale rounded to the
    embedding's dtype (a Python float: no tensor made per step)."""

    def __init__(self, model: Transformer, num_positions: int, device: torch.device):
        embedding_dtype = model.tok_embeddings.weight.dtype
        dtype = torch.float32 if model.args.rotary_in_float32 else embedding_dtype
        positions_1N = torch.arange(num_positions, device=device)[None]
        self._rope = tuple(t[0] for t in model.rope(positions_1N, dtype))
        self._local_rope = (tuple(t[0] for t in model.local_rope(positions_1N, dtype))
                            if model.local_rope is not None else None)
        scale = model.args.embedding_scale
        self.embedding_scale = None if scale is None else torch.tensor(scale).to(embedding_dtype).item()

    def rope(self, positions_BS: torch.Tensor, local: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        cos_Nr, sin_Nr = self._local_rope if local and self._local_rope is not None else self._rope
        return cos_Nr[positions_BS], sin_Nr[positions_BS]


def attends_by_kernel(model: Transformer, cache: KVCache) -> bool:
    """Whether a decode step's attention to ``cache`` runs as the Triton kernel ``decode_attention`` (where the kernels
    run; not with attention sinks): each row reads only the entries it sees, with no mask made, so a step's reads
    follow the rows' lengths whatever shape the cache has."""
    return (all(layer.attention.sinks is None for layer in model.layers)
            and decode_attention_supported(cache.keys[0], cache.values[0], model.args.n_heads))


def _attend_cache(attention: Attention, q_BH1d, keys_BKLd, values_BKLd, cache: KVCache, layer_id: int,
                  by_kernel: bool) -> torch.Tensor:
    """One query per row against the layer's cache entries it may see. by_kernel (``attends_by_kernel``): the
    ``decode_attention`` kernel reading the entries each row sees (``KVCache.visible_entries``), the query in the
    cache's dtype (under autocast to it, the dtype SDPA would cast it to); a query it does not take (another dtype
    outside autocast) goes to SDPA under a mask made then. Else SDPA: the
    G = H / K query heads that share a key/value head are its G queries (q [B, K, G, d]), so no kernel repeats the
    cache per query head (SDPA's GQA works only in its flash and math kernels, and on a masked call the math kernel
    copies the whole cache G times); it takes the cache's additive mask, made once a step
    (``KVCache.attention_bias``): the same weights as the boolean mask."""
    if by_kernel and q_BH1d.dtype != keys_BKLd.dtype and autocast_dtype(q_BH1d.device.type) == keys_BKLd.dtype:
        q_BH1d = q_BH1d.to(keys_BKLd.dtype)
    if by_kernel and decode_attention_takes(q_BH1d, keys_BKLd):
        return decode_attention(q_BH1d, cache.keys[layer_id], cache.values[layer_id], *cache.visible_entries(layer_id),
                                attention.scale)
    if attention.sinks is not None:
        return _attend_with_sinks(q_BH1d, keys_BKLd, values_BKLd, cache.mask(layer_id), attention.sinks,
                                  attention.scale)
    B, H, _, d = q_BH1d.shape
    K = keys_BKLd.shape[1]
    out_BKGd = F.scaled_dot_product_attention(
        q_BH1d.reshape(B, K, H // K, d), keys_BKLd, values_BKLd, attn_mask=cache.attention_bias(layer_id),
        scale=attention.scale,
    )
    return out_BKGd.reshape(B, H, 1, d)


def _step_heads(attention: Attention, projections: tuple[torch.Tensor, ...], cos_sin, cache: KVCache,
                layer_id: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A decode step's rotated queries [B, H, 1, d] and the layer's cache as attention reads it, this step's keys and
    values written in: where the Triton kernels run, one kernel (``decode_qkv``) for what ``Attention.heads`` and the
    cache's writes do in four (the query's and the key's norm-and-rotation, a write each for keys and values), the
    same values."""
    keys_BKLd, values_BKLd = cache.keys[layer_id], cache.values[layer_id]
    norms = attention.q_norm, attention.k_norm
    per_head = norms[0] is not None and not attention.qk_norm_over_projection
    if attention.sinks is None and (norms[0] is None or per_head):
        weights = (norms[0].weight, norms[1].weight) if per_head else None
        float_offset = norms[0].float_offset if per_head else None
        xq, xk, xv = projections
        narrow = narrowing_autocast_dtype(xq, torch.float32)
        if (not per_head or (norms[0].eps, norms[0].float_offset) == (norms[1].eps, norms[1].float_offset)) and \
                decode_qkv_supported(xq, xk, xv, attention.head_dim, weights, float_offset, *cos_sin, keys_BKLd,
                                     values_BKLd, narrow):
            q_BH1d = decode_qkv(xq, xk, xv, attention.n_heads, weights, norms[0].eps if per_head else 0.0, float_offset,
                                *cos_sin, keys_BKLd, values_BKLd, cache.entries(layer_id))
            return (q_BH1d, *cache.read(layer_id))
    q_BHSd, k_BKSd, v_BKSd = attention.heads(*projections, cos_sin, for_autocast_attention=attention.sinks is None)
    return (q_BHSd, *cache.write(layer_id, k_BKSd, v_BKSd))


def _block_forward(
    block: TransformerBlock, x_BSD: torch.Tensor, update_BSD: torch.Tensor | None, cos_sin, cache: KVCache,
    plan: AttentionPlan | None, by_kernel: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One block on the residual stream ``x_BSD + update_BSD`` (the previous block's output, left unadded; None: x
    alone); returns (h, its update): the block's output is their sum, which the next block adds inside its pre-norm's
    kernel. ``plan``: the packed prompts' attention plan at prefill (B = 1), None for a decode step (S = 1), whose
    attention runs as ``decode_attention`` with ``by_kernel``."""
    attention = block.attention
    B, S, _ = x_BSD.shape
    # as ``TransformerBlock.forward``: each pre-norm's output made once for the plain linear layers reading it (in the
    # autocast dtype under autocast, instead of a cast a layer), q and k handed to attention in that dtype
    linears = block.attention_input_linears()
    if update_BSD is None:
        attention_in = _pre_norm(block.attention_norm, x_BSD, linears)
    else:  # the previous block's residual add inside this pre-norm's kernel, where the Triton kernels run
        x_BSD, attention_in = _residual_and_pre_norm(block.attention_norm, x_BSD, update_BSD, linears)
    # (under autocast the replica's q, k and v weights are rows of one tensor: one matmul)
    projections = (fused_outputs(attention, attention_in, (attention.wq, attention.wk, attention.wv))
                   if hasattr(attention, FUSED) else attention.projections(attention_in))
    if plan is not None:  # prefill: each prompt attends within itself
        q_BHSd, k_BKSd, v_BKSd = attention.heads(*projections, cos_sin, for_autocast_attention=attention.sinks is None)
        cache.write_prompts(block.layer_id, k_BKSd, v_BKSd)
        out_BHSd = attend(q_BHSd, k_BKSd, v_BKSd, plan, block.is_sliding, attention.scale, attention.sinks)
    else:
        q_BHSd, keys_BKLd, values_BKLd = _step_heads(attention, projections, cos_sin, cache, block.layer_id)
        out_BHSd = _attend_cache(attention, q_BHSd, keys_BKLd, values_BKLd, cache, block.layer_id, by_kernel)
    attn_out = attention.wo(out_BHSd.transpose(1, 2).reshape(B, S, -1))
    # the residual add and the MLP's pre-norm: one kernel where the Triton kernels run
    h, ffn_in = _residual_and_pre_norm(block.ffn_norm, x_BSD, _norm_if(block.post_attention_norm, attn_out),
                                       block.ffn_input_linears())
    ffn_out = block.moe(ffn_in) if block.moe is not None else _feed_forward(block.feed_forward, ffn_in)
    return h, _norm_if(block.post_ffn_norm, ffn_out)


def _feed_forward(mlp: FeedForward, x: torch.Tensor | tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    """``FeedForward.forward``; the gate and up projections in one matmul where the decoded replica stacked their
    weights (``compute_weights.FUSED``), the gated unit reading the two halves of its product."""
    if not hasattr(mlp, FUSED):
        return mlp(x)
    gate, up = fused_outputs(mlp, x, (mlp.w1, mlp.w3))
    return mlp.w2(gated_activation(gate, up, mlp.activation))


def _blocks(model: Transformer, tokens_BS: torch.Tensor, positions_BS: torch.Tensor, cache: KVCache,
            tables: DecoderTables, plan: AttentionPlan | None,
            by_kernel: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Embedding and blocks over ``tokens_BS`` (writing the cache): the hidden states [B, S, D] before the final norm
    are the sum of the two returned (the last block's output left unadded: None where there are no blocks)."""
    h = model.tok_embeddings(tokens_BS)
    if tables.embedding_scale is not None:
        h = h * tables.embedding_scale
    cos_sin = tables.rope(positions_BS)
    local_cos_sin = tables.rope(positions_BS, local=True) if model.local_rope is not None else cos_sin
    update = None
    for layer in model.layers:
        h, update = _block_forward(layer, h, update, local_cos_sin if layer.is_sliding else cos_sin, cache, plan,
                                   by_kernel)
    return h, update


def prefill(model: Transformer, prompts: list[list[int]], prompt_slots: int, cache: KVCache,
            tables: DecoderTables) -> torch.Tensor:
    """All prompts in one pass, packed in one row with no padding (each attends only within itself);
    fills the cache's prompt slots, each prompt ending at slot ``prompt_slots - 1``. Returns the logits
    of each prompt's last token [B, V]."""
    device = cache.pad_B.device
    lengths = [len(p) for p in prompts]
    P = prompt_slots
    tokens_1N = torch.tensor([t for p in prompts for t in p], device=device)[None]
    positions_N = torch.cat([torch.arange(n) for n in lengths])
    rows_N = torch.repeat_interleave(torch.arange(len(prompts)), torch.tensor(lengths))
    slots_N = positions_N + torch.tensor([P - n for n in lengths])[rows_N]
    last_B = torch.tensor(lengths).cumsum(0) - 1
    has_sliding = any(layer.is_sliding for layer in model.layers)
    # packed documents attend per document with no [N, N] mask (flash varlen kernels on GPU)
    plan = plan_attention(1, tokens_1N.shape[1], device, None, positions_N[None],
                          model.args.sliding_window if has_sliding else None, "varlen")
    # (the decode steps' masks made only where their attention needs them: a compiled step starts from the same state)
    cache.start_prompts(rows_N.to(device), slots_N.to(device), P, masks=not attends_by_kernel(model, cache))
    h_1ND, update_1ND = _blocks(model, tokens_1N, positions_N.to(device)[None], cache, tables, plan)
    last_B = last_B.to(device)
    h_1BD = h_1ND[:, last_B] if update_1ND is None else h_1ND[:, last_B] + update_1ND[:, last_B]
    return model.output(model.norm(h_1BD))[0]


def decode_step(model: Transformer, tokens_B: torch.Tensor, slot: torch.Tensor, cache: KVCache, tables: DecoderTables,
                read_upto: int | None = None, by_kernel: bool | None = None) -> torch.Tensor:
    """One new token per row at ``slot`` (a 0-d long tensor on the device, so a compiled step is reused at every
    slot); returns its logits [B, V]. read_upto: slot + 1 to read only the filled part of the cache
    (eager), more to read a fixed length past it, masked (a captured step's), None to read all of it, masked
    (compiled: one shape); where the attention runs as the kernel (``attends_by_kernel``) it reads each row's
    entries whatever this says, and no mask is made. by_kernel: that answer, asked before a compiled step (None: ask
    now; the question is not one compiled code can ask)."""
    positions_B1 = (slot - cache.pad_B)[:, None]
    if by_kernel is None:
        by_kernel = attends_by_kernel(model, cache)
    cache.start(slot.reshape(1), read_upto, masks=not by_kernel)
    h_B1D, update_B1D = _blocks(model, tokens_B[:, None], positions_B1, cache, tables, None, by_kernel)
    if update_B1D is None:
        return model.output(model.norm(h_B1D))[:, 0]
    # the last block's residual add inside the final norm's kernel, where the Triton kernels run
    return model.output(_residual_and_pre_norm(model.norm, h_B1D, update_B1D)[1])[:, 0]
