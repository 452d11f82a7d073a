"""Context parallelism: every sequence is split over the ``cp`` ranks and attention runs as ring attention.

Shapes: B batch, S (padded) sequence, c chunk length (S / (2 cp)), H query heads, K key/value heads, d head_dim.

Load balance: the padded sequence is cut into 2 cp chunks; rank r holds chunk r (head) and chunk 2 cp - 1 - r
(its mirrored tail), so under a causal mask every rank computes the same number of (query chunk, key chunk)
blocks. Each rank runs the model on its 2 c tokens; only attention needs the other ranks' keys and values.

Attention (``ring_attention``): the ranks' un-expanded keys and values are passed around the ring with
send/recv, cp - 1 steps, the next rank's received while the current one is used (or, with
``communication="all_gather"``, gathered at once). Each local query chunk attends to each key chunk it may see
as one block — the diagonal block causal, earlier blocks in full, and a block mask where documents
(packing), padding or a sliding window cut in; blocks nothing may see are skipped — and the blocks' partial
outputs are merged by their log-sum-exp. Backward walks the same ring and blocks with the merged output and
log-sum-exp (the flash backward of each block); each rank's key/value gradients travel with its keys and values
and arrive back at their owner one step after the last. Each block runs on the device's kernel
(``hfnative.parallel.ring_blocks``: the flash kernels where they serve it, else an explicit softmax).

Which blocks run and their masks are decided on the host from the whole (unsplit) batch once per batch
(``split_batch``), so no layer makes a host-side decision; a masked block keeps [B, c] vectors, not a [B, c, c]
matrix (``ring_blocks.BlockMask``). Rotary embeddings see the unsplit sequence's position ids; lengths that are not
a multiple of 2 cp are padded at the end (padding is masked and carries no label, so it never counts in the loss).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from hfnative.losses import IGNORE_INDEX
from hfnative.losses import shift_labels as shift_labels_of
from hfnative.models.attention import AttentionPlan, document_ids, repeat_kv_heads

from .ring_blocks import CAUSAL, FULL, MASKED, BlockMask, accumulation, block_backward, block_forward


def chunk_order(cp_size: int, cp_rank: int) -> tuple[int, int]:
    """The two global chunks rank ``cp_rank`` holds: its head chunk and the mirrored tail chunk."""
    return cp_rank, 2 * cp_size - 1 - cp_rank


def local_positions(seq_len: int, cp_size: int, cp_rank: int) -> torch.Tensor:
    """Indices [2 c] into the padded sequence of the tokens rank ``cp_rank`` holds (seq_len divisible by 2 cp)."""
    c = seq_len // (2 * cp_size)
    head, tail = chunk_order(cp_size, cp_rank)
    return torch.cat([torch.arange(head * c, (head + 1) * c), torch.arange(tail * c, (tail + 1) * c)])


@dataclass
class _Block:
    half: int  # which local query chunk (0: head, 1: tail)
    key_chunk: int  # global key chunk index
    kind: str  # CAUSAL, FULL or MASKED
    mask: BlockMask | None = None  # for MASKED
    has_key: torch.Tensor | None = None  # [B|1, 1, c] bool: the query row sees at least one key of the block


@dataclass(eq=False)
class ContextParallelAttention:
    """One batch's ring-attention plan for this rank: the blocks for global and sliding-window layers."""

    group: object  # the cp process group
    cp_size: int
    cp_rank: int
    chunk_len: int
    blocks: dict  # "global" / "sliding" -> list[_Block]
    # "flash_cpu" (aten's CPU flash kernel), "flash_cuda" (aten's CUDA flash kernel where it serves a block, math
    # elsewhere) or "math" (explicit softmax); None: the device's (see _kernel)
    kernel: str | None = None
    # "ring": each rank's keys and values passed from rank to rank (send/recv, the next received while one is
    # used); "all_gather": all gathered at once (fewer, larger messages)
    communication: str = "ring"
    _device_masks: dict = field(default_factory=dict, repr=False)

    def attend(self, q_BHSd, k_BKSd, v_BKSd, sliding: bool, scale: float, sinks_H=None) -> torch.Tensor:
        if sinks_H is not None:
            raise ValueError("context parallelism (cp_size > 1) does not support attention sinks (GPT-OSS) yet; "
                             "set cp_size=1 for this model")
        blocks = self.blocks["sliding" if sliding and "sliding" in self.blocks else "global"]
        return ring_attention(q_BHSd, k_BKSd, v_BKSd, self, blocks, scale)

    def _mask(self, block: _Block, device: torch.device):
        """The block's mask (its vectors) and its rows that see a key, on the device (cached per batch)."""
        key = (id(block), device)
        if key not in self._device_masks:
            self._device_masks[key] = (block.mask.to(device), block.has_key.to(device))
        return self._device_masks[key]


def _block_masks(
    key_chunk: int, query_chunk: int, c: int, padding_BS, doc_BS, window: int | None
) -> tuple[str | None, BlockMask | None, torch.Tensor | None]:
    """The kind of block (query chunk x key chunk), and when masked its mask and the query rows that see a key
    [B, 1, c] (kind None: nothing of it is seen, skip it). Decided from the block's whole [B, c, c] matrix, made here
    once on the host and not kept."""
    if padding_BS is None and doc_BS is None and window is None:
        return (CAUSAL if key_chunk == query_chunk else FULL), None, None
    queries, keys = slice(query_chunk * c, (query_chunk + 1) * c), slice(key_chunk * c, (key_chunk + 1) * c)
    mask = BlockMask(query_chunk, key_chunk, c, window,
                     None if doc_BS is None else doc_BS[:, queries].contiguous(),
                     None if doc_BS is None else doc_BS[:, keys].contiguous(),
                     None if padding_BS is None else padding_BS[:, keys].contiguous())
    allowed = mask.allowed()[:, 0]  # [B|1, c, c]
    if not allowed.any():
        return None, None, None
    if key_chunk == query_chunk and bool((allowed == torch.ones(c, c, dtype=torch.bool).tril()[None]).all()):
        return CAUSAL, None, None
    if key_chunk < query_chunk and bool(allowed.all()):
        return FULL, None, None
    mask.segments = mask.document_segments()
    return MASKED, mask, allowed.any(-1)[:, None]


def plan_context_parallel(
    seq_len: int, cp_size: int, cp_rank: int, group, padding_BS=None, doc_BS=None, sliding_window: int | None = None
) -> ContextParallelAttention:
    """The blocks rank ``cp_rank`` computes for a padded sequence of ``seq_len`` (divisible by 2 cp).

    padding_BS: bool, True for real tokens (None: no padding); doc_BS: document ids of packed rows (None: one
    document per row); sliding_window: the sliding layers' window (None: no sliding layers).
    """
    c = seq_len // (2 * cp_size)
    kinds = {"global": None}
    if sliding_window is not None and sliding_window < seq_len:
        kinds["sliding"] = sliding_window
    blocks = {}
    for name, window in kinds.items():
        entries = []
        for half, query_chunk in enumerate(chunk_order(cp_size, cp_rank)):
            for key_chunk in range(query_chunk + 1):
                kind, mask, has_key = _block_masks(key_chunk, query_chunk, c, padding_BS, doc_BS, window)
                if kind is not None:
                    entries.append(_Block(half, key_chunk, kind, mask, has_key))
        blocks[name] = entries
    return ContextParallelAttention(group, cp_size, cp_rank, c, blocks)


# --- the ring -----------------------------------------------------------------------------------------


def _peers(plan: ContextParallelAttention) -> tuple[int, int]:
    """The global ranks of the next and the previous rank of the ring."""
    cp, rank = plan.cp_size, plan.cp_rank
    return (dist.get_global_rank(plan.group, (rank + 1) % cp), dist.get_global_rank(plan.group, (rank - 1) % cp))


def _pass_on(tensors: list[torch.Tensor], plan: ContextParallelAttention):
    """Start sending ``tensors`` to the next rank of the ring and receiving the previous rank's; returns the
    receive buffers and a function that waits for both."""
    after, before = _peers(plan)
    sent = [t.contiguous() for t in tensors]  # kept alive until the sends complete
    received = [torch.empty_like(t) for t in sent]
    ops = [dist.P2POp(dist.isend, t, after, plan.group) for t in sent]
    ops += [dist.P2POp(dist.irecv, r, before, plan.group) for r in received]
    requests = dist.batch_isend_irecv(ops)

    def wait():
        for request in requests:
            request.wait()
        del sent[:]
        return received

    return wait


def _sources(k_BKSd, v_BKSd, plan: ContextParallelAttention):
    """Every cp rank's keys and values, one rank at a time: (rank, k, v). "ring": passed from rank to rank (the next
    one is received while this one is used); "all_gather": gathered at once."""
    cp = plan.cp_size
    if plan.communication == "all_gather":
        gathered = []
        for x in (k_BKSd, v_BKSd):
            x = x.contiguous()
            parts = [torch.empty_like(x) for _ in range(cp)]
            dist.all_gather(parts, x, group=plan.group)
            gathered.append(parts)
        for rank in range(cp):
            yield rank, gathered[0][rank], gathered[1][rank]
        return
    current = [k_BKSd, v_BKSd]
    for step in range(cp):
        wait = _pass_on(current, plan) if step < cp - 1 else None
        yield (plan.cp_rank - step) % cp, current[0], current[1]
        if wait is not None:
            current = wait()


def _masks(plan, block, q):
    if block.kind != MASKED:
        return None, None
    return plan._mask(block, q.device)


def _blocks_of(blocks, plan, source_rank: int):
    """The blocks whose keys ``source_rank`` holds, with the key chunk's half in that rank's tensors."""
    head, tail = chunk_order(plan.cp_size, source_rank)
    for block in blocks:
        if block.key_chunk in (head, tail):
            yield block, 0 if block.key_chunk == head else 1


class _RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q_BHSd, k_BKSd, v_BKSd, plan, blocks, scale):
        H, c = q_BHSd.shape[1], plan.chunk_len
        queries = [q_BHSd[:, :, half * c:(half + 1) * c].contiguous() for half in (0, 1)]
        partial = ([], [])  # per local query chunk: the (output, log-sum-exp) of each block
        kernel_state = None  # what the CUDA flash kernel's backward takes back (any of its blocks')
        for source, k_BKSd_r, v_BKSd_r in _sources(k_BKSd, v_BKSd, plan):
            for block, key_half in _blocks_of(blocks, plan, source):
                q = queries[block.half]
                mask, has_key = _masks(plan, block, q)
                keys = slice(key_half * c, (key_half + 1) * c)
                k, v = repeat_kv_heads(k_BKSd_r[:, :, keys], H), repeat_kv_heads(v_BKSd_r[:, :, keys], H)
                out, lse, state = block_forward(q, k, v, block.kind, mask, has_key, scale, plan.kernel)
                partial[block.half].append((out, lse))
                kernel_state = kernel_state or state
        outs, lses = [], []
        for half in (0, 1):
            lse_stack = torch.stack([lse for _, lse in partial[half]])  # [n, B, H, c]
            lse = torch.logsumexp(lse_stack, dim=0)
            weights = torch.exp(lse_stack - lse[None])[..., None]
            outs.append(sum(w * o.to(w.dtype) for w, (o, _) in zip(weights, partial[half])).to(q_BHSd.dtype))
            lses.append(lse)
        out_BHSd = torch.cat(outs, dim=2)
        ctx.save_for_backward(q_BHSd, k_BKSd, v_BKSd, out_BHSd, torch.cat(lses, dim=2))
        ctx.plan, ctx.blocks, ctx.scale, ctx.kernel_state = plan, blocks, scale, kernel_state
        return out_BHSd

    @staticmethod
    def backward(ctx, grad_BHSd):
        q_BHSd, k_BKSd, v_BKSd, out_BHSd, lse_BHS = ctx.saved_tensors
        plan, scale = ctx.plan, ctx.scale
        H, K, c = q_BHSd.shape[1], k_BKSd.shape[1], plan.chunk_len
        acc = accumulation(q_BHSd)
        dq_BHSd = torch.zeros_like(q_BHSd, dtype=acc)
        grad_BHSd = grad_BHSd.contiguous()
        rows = [slice(half * c, (half + 1) * c) for half in (0, 1)]
        saved = [[x[:, :, r].contiguous() for r in rows] for x in (q_BHSd, grad_BHSd, out_BHSd, lse_BHS)]

        def source_gradients(source, k_BKSd_r, v_BKSd_r, dk_BKSd_r, dv_BKSd_r):
            """Add the blocks over ``source``'s keys to dq and to that rank's key/value gradients (in place)."""
            for block, key_half in _blocks_of(ctx.blocks, plan, source):
                q, grad, out, lse = (x[block.half] for x in saved)
                mask, _ = _masks(plan, block, q)
                keys = slice(key_half * c, (key_half + 1) * c)
                k, v = repeat_kv_heads(k_BKSd_r[:, :, keys], H), repeat_kv_heads(v_BKSd_r[:, :, keys], H)
                dq, dk, dv = block_backward(grad, q, k, v, out, lse, block.kind, mask, scale, plan.kernel,
                                             ctx.kernel_state)
                dq_BHSd[:, :, rows[block.half]] += dq.to(acc)
                dk_BKSd_r[:, :, keys] += _reduce_heads(dk.to(acc), K)
                dv_BKSd_r[:, :, keys] += _reduce_heads(dv.to(acc), K)

        if plan.communication == "all_gather":
            # keys and values gathered again (each rank keeps only its own 2 c tokens between forward and backward)
            by_rank = torch.zeros((2, plan.cp_size, *k_BKSd.shape), dtype=acc, device=k_BKSd.device)
            for source, k_r, v_r in _sources(k_BKSd, v_BKSd, plan):
                source_gradients(source, k_r, v_r, by_rank[0, source], by_rank[1, source])
            dist.all_reduce(by_rank, group=plan.group)  # each rank's key/value gradients, summed over the ranks
            dk_BKSd, dv_BKSd = by_rank[0, plan.cp_rank], by_rank[1, plan.cp_rank]
        else:
            # the same ring; each rank's key/value gradients travel with its keys and values and, one step after
            # the last, arrive back at their owner
            current = [k_BKSd, v_BKSd, torch.zeros_like(k_BKSd, dtype=acc), torch.zeros_like(v_BKSd, dtype=acc)]
            for step in range(plan.cp_size):
                source = (plan.cp_rank - step) % plan.cp_size
                wait = _pass_on(current[:2], plan) if step < plan.cp_size - 1 else None
                source_gradients(source, *current)
                gradients = _pass_on(current[2:], plan)() if plan.cp_size > 1 else current[2:]
                current = (wait() if wait is not None else current[:2]) + gradients
            dk_BKSd, dv_BKSd = current[2], current[3]
        return dq_BHSd.to(q_BHSd.dtype), dk_BKSd.to(k_BKSd.dtype), dv_BKSd.to(v_BKSd.dtype), None, None, None


def _reduce_heads(x_BHcd: torch.Tensor, kv_heads: int) -> torch.Tensor:
    """The gradient of an expanded K/V summed back over the query heads that shared each key/value head."""
    B, H, c, d = x_BHcd.shape
    return x_BHcd if H == kv_heads else x_BHcd.view(B, kv_heads, H // kv_heads, c, d).sum(2)


@torch.compiler.disable
def ring_attention(q_BHSd, k_BKSd, v_BKSd, plan: ContextParallelAttention, blocks, scale: float) -> torch.Tensor:
    """Attention output [B, H, 2 c, d] of this rank's query chunks over the whole sequence's keys (see the module
    docstring). q_BHSd, k_BKSd, v_BKSd: this rank's head and tail chunks, concatenated. Runs eagerly under
    torch.compile (its blocks change with every batch's plan)."""
    return _RingAttention.apply(q_BHSd, k_BKSd, v_BKSd, plan, blocks, scale)


# --- the batch split ------------------------------------------------------------------------------------


def split_batch(
    batch: dict, cp_size: int, cp_rank: int, group, *, multiple: int = 1, sliding_window: int | None = None
) -> dict:
    """This rank's share of a collated batch (host tensors [B, S]), with the ring-attention plan as
    ``attention_plan``.

    Shifted labels are taken from the whole sequence before the split; position ids of the unsplit sequence are
    added when absent (rotary embeddings and document boundaries read them). The sequence is padded at the end
    to a multiple of 2 cp x ``multiple``: padding is masked (an attention mask is added when the batch has
    none), carries no label, and its position ids run on past the last token.
    sliding_window: the model's window when it has sliding-window layers, else None.
    """
    if "input_ids" not in batch:
        raise ValueError(f"context parallelism splits batches of token sequences (input_ids [B, S]); this batch has "
                         f"{sorted(batch)}: set cp_size=1 for this trainer")
    batch = dict(batch)
    input_ids = batch["input_ids"]
    B, S = input_ids.shape
    if "labels" in batch and "shift_labels" not in batch:
        batch["shift_labels"] = shift_labels_of(batch["labels"])
    mask = batch.get("attention_mask")
    padded_rows = mask is not None and not bool(mask.bool().all())
    positions_given = "position_ids" in batch
    if not positions_given:
        batch["position_ids"] = torch.arange(S, dtype=torch.long).expand(B, S).clone()
    extra = -S % (2 * cp_size * multiple)
    if extra and mask is None:
        batch["attention_mask"] = torch.ones(B, S, dtype=torch.long)
    batch = _pad_end(batch, S, extra)
    seq_len = S + extra
    padding_BS = batch["attention_mask"].bool() if (padded_rows or extra) else None
    # packed documents, read from the position ids as the single-process plan reads them (not with padded rows)
    doc_BS = document_ids(batch["position_ids"].expand(B, seq_len)) if positions_given and not padded_rows else None
    if doc_BS is not None and bool((doc_BS == doc_BS[:, :1]).all()):
        doc_BS = None
    plan = plan_context_parallel(seq_len, cp_size, cp_rank, group, padding_BS, doc_BS, sliding_window)
    index = local_positions(seq_len, cp_size, cp_rank)
    local = {}
    for key, value in batch.items():
        if isinstance(value, torch.Tensor) and value.dim() == 2 and value.shape[1] == seq_len:
            value = value.expand(B, seq_len) if value.shape[0] == 1 else value
            local[key] = value[:, index]
        else:
            local[key] = value
    local["attention_plan"] = AttentionPlan("context_parallel", 2 * plan.chunk_len, sliding_window,
                                            context_parallel=plan)
    return local


def _pad_end(batch: dict, length: int, extra: int) -> dict:
    if extra == 0:
        return batch
    fill = {"labels": IGNORE_INDEX, "shift_labels": IGNORE_INDEX, "attention_mask": 0, "completion_mask": 0,
            "assistant_masks": 0}
    padded = {}
    for key, value in batch.items():
        if isinstance(value, torch.Tensor) and value.dim() == 2 and value.shape[1] == length:
            if key == "position_ids":
                tail = value[:, -1:] + torch.arange(1, extra + 1, dtype=value.dtype)
            else:
                tail = torch.full((value.shape[0], extra), fill.get(key, 0), dtype=value.dtype)
            value = torch.cat([value, tail], dim=1)
        padded[key] = value
    return padded


def place_in_sequence(x_BS: torch.Tensor, cp_size: int, cp_rank: int) -> torch.Tensor:
    """Per-position values of this rank's tokens [B, 2 c, ...] (in ``split_batch``'s order) at their places in the
    whole padded sequence [B, 2 c cp, ...], zeros elsewhere (differentiable): summed over the cp ranks, the whole
    sequence's values."""
    B, local = x_BS.shape[:2]
    index = local_positions(local * cp_size, cp_size, cp_rank).to(x_BS.device)
    return x_BS.new_zeros((B, local * cp_size, *x_BS.shape[2:])).index_copy(1, index, x_BS)


class ContextParallelCollator:
    """A collator whose batches are split over the cp ranks (``split_batch``) after ``collator`` builds them."""

    def __init__(self, collator, cp_size: int, cp_rank: int, group, *, multiple: int = 1,
                 sliding_window: int | None = None):
        self.collator, self.cp_size, self.cp_rank, self.group = collator, cp_size, cp_rank, group
        self.multiple, self.sliding_window = multiple, sliding_window

    def __call__(self, features):
        return split_batch(self.collator(features), self.cp_size, self.cp_rank, self.group, multiple=self.multiple,
                           sliding_window=self.sliding_window)

    def __getattr__(self, name):  # the wrapped collator's settings (pad_token_id, ...)
        if name == "collator":
            raise AttributeError(name)
        return getattr(self.collator, name)


__all__ = [
    "ContextParallelAttention",
    "ContextParallelCollator",
    "chunk_order",
    "local_positions",
    "place_in_sequence",
    "plan_context_parallel",
    "ring_attention",
    "split_batch",
]
