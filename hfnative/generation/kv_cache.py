"""A preallocated key/value cache for a batch of left-padded sequences.

Shapes: B batch, K key/value heads, d head_dim, S new tokens, L cache entries of a layer.

Every row of the batch is left-padded to the same number of prompt slots P, so slot s of every row is
written at the same step (the prompts at prefill, slot P + t at decode step t) and a row's token
positions are ``slot - pad_B`` (its first real token at position 0, as transformers numbers
left-padded rows). Prefill runs the prompts packed in one row, without the padding, and writes each
token to its row and slot (``start_prompts`` / ``write_prompts``).

- Full-attention layers hold every slot: [B, K, P + max_new_tokens, d], slot s at entry s.
- Sliding-window layers (window W smaller than that) hold only the last W slots, a ring
  [B, K, W, d] with slot s at entry s % W: a query sees at most W keys, itself included
  (transformers' window), and nothing older is ever read again.

Each buffer length has one ``entry_slot`` [L]: the slot each entry holds (-1 when empty), shared by the
layers of that length since they are written in lockstep. An entry is visible to row b when it holds
a slot at or after the row's padding: ``entry_slot >= pad_B[b]``; the ring's overwrite keeps older slots
out of the window and empty or future entries hold -1 or are not written yet.

A cache is made once per batch shape and reused (``reset``): the buffers keep their addresses, so a decode step
captured in a CUDA graph reads and writes the same memory at every call.
"""

from __future__ import annotations

import torch


class KVCache:
    def __init__(
        self,
        sliding_layers: list[bool],
        sliding_window: int | None,
        batch_size: int,
        n_kv_heads: int,
        head_dim: int,
        num_slots: int,
        pad_B: torch.Tensor,
        dtype: torch.dtype,
        device: torch.device,
    ):
        """sliding_layers: per layer, whether it uses the sliding window; num_slots: prompt slots +
        max_new_tokens; pad_B: each row's left padding (long, on ``device``)."""
        ring = sliding_window if sliding_window is not None and sliding_window < num_slots else None
        self.num_slots = num_slots
        self.lengths = [ring if (sliding and ring) else num_slots for sliding in sliding_layers]
        self.pad_B = pad_B
        self.entry_slot = {n: torch.full((n,), -1, dtype=torch.long, device=device) for n in set(self.lengths)}
        self.keys = [torch.zeros(batch_size, n_kv_heads, n, head_dim, dtype=dtype, device=device) for n in self.lengths]
        self.values = [torch.zeros_like(keys) for keys in self.keys]
        # per buffer length, set by ``start``: the entries this step's slots go to, and who sees what
        self.index: dict[int, torch.Tensor] = {}
        self.visible: dict[int, torch.Tensor] = {}
        self.bias: dict[int, torch.Tensor] = {}  # ``visible`` as SDPA's additive mask (0, -inf) in the cache's dtype
        # its two values, made once (a step's mask is one ``where`` over them)
        self.bias_values = (torch.zeros((), dtype=dtype, device=device), torch.full((), float("-inf"), dtype=dtype,
                                                                                   device=device))
        self.read_upto = num_slots  # full-length buffers: entries past this are empty and not read
        self.slot_1: torch.Tensor | None = None  # set by ``start``: the last slot it claimed ([1], on the device)
        # per buffer length, set by ``start_prompts``: packed prompt tokens kept, their rows and entries
        self.prompt_index: dict[int, tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = {}

    def front(self, rows: int) -> "KVCache":
        """The cache of the first ``rows`` rows: views into these buffers and padding, the same entry slots (every row
        writes the same slot at a step)."""
        view = object.__new__(KVCache)
        view.num_slots, view.lengths, view.entry_slot = self.num_slots, self.lengths, self.entry_slot
        view.pad_B = self.pad_B[:rows]
        view.keys, view.values = [k[:rows] for k in self.keys], [v[:rows] for v in self.values]
        # the keys ``start`` fills, as the whole cache's (a compiled step's guards hold a dict's keys: an empty one
        # would compile each front's step twice)
        view.index = dict(self.index)
        view.visible = {n: visible[:rows] for n, visible in self.visible.items()}
        view.bias = {n: bias[:rows] for n, bias in self.bias.items()}
        view.prompt_index, view.read_upto, view.bias_values = {}, self.num_slots, self.bias_values
        view.slot_1 = self.slot_1
        return view

    def reset(self, pad_B: torch.Tensor) -> None:
        """Empty the cache for a new batch of the same shape, with each row's left padding ``pad_B`` [B]; the buffers
        are refilled in place (zeros: a masked entry weighs 0 in attention, and 0 times a stale inf or NaN is not 0)."""
        self.pad_B.copy_(pad_B)
        for entry_slot in self.entry_slot.values():
            entry_slot.fill_(-1)
        for buffer in self.keys + self.values:
            buffer.zero_()

    def start(self, slots_S: torch.Tensor, read_upto: int | None = None, masks: bool = True) -> None:
        """Claim the entries of the slots written next (consecutive, increasing); a ring keeps only
        the last of them that fit. read_upto: one past the last slot written so far, when known on the
        host: attention then reads only that prefix of full-length buffers (eager decoding); None reads
        them whole, masked (one shape for every step of a compiled decode step). masks: make each buffer
        length's masks now, for every layer of the step (False: an attention that reads ``visible_entries``
        instead needs none; ``mask`` and ``attention_bias`` make them if asked)."""
        self.read_upto = self.num_slots if read_upto is None else read_upto
        self.slot_1 = slots_S[-1:]
        for n, entry_slot in self.entry_slot.items():
            kept = slots_S[-n:]
            index = kept % n
            entry_slot.index_copy_(0, index, kept)
            self.index[n] = index
            if masks:
                self._make_masks(n)
            else:
                self.visible.pop(n, None)
                self.bias.pop(n, None)

    def _make_masks(self, n: int) -> None:
        entry_slot = self.entry_slot[n]
        read = entry_slot if n != self.num_slots else entry_slot[: self.read_upto]
        visible = (read[None, :] >= self.pad_B[:, None])[:, None, None, :]  # [B, 1, 1, L]
        self.visible[n] = visible
        # made once a step for every layer of this length: SDPA would turn a boolean mask into this per call
        self.bias[n] = torch.where(visible, *self.bias_values)

    def start_prompts(self, rows_N: torch.Tensor, slots_N: torch.Tensor, prompt_slots: int, masks: bool = True) -> None:
        """Claim slots 0..P-1 for the prompts, given as N packed tokens: token i goes to row rows_N[i],
        slot slots_N[i]; a ring keeps only the tokens of its last slots. masks: as ``start``'s."""
        self.start(torch.arange(prompt_slots, device=slots_N.device), masks=masks)
        for n in self.entry_slot:
            kept_N = slots_N >= prompt_slots - n
            self.prompt_index[n] = (kept_N.nonzero()[:, 0], rows_N[kept_N], slots_N[kept_N] % n)

    def write_prompts(self, layer_id: int, k_1KNd: torch.Tensor, v_1KNd: torch.Tensor) -> None:
        """Store the packed prompt tokens' keys and values [1, K, N, d] in their rows and slots (in the cache's dtype:
        under autocast the rotated keys can come out in fp32 while the values are in the autocast dtype)."""
        token_M, rows_M, entries_M = self.prompt_index[self.lengths[layer_id]]
        keys, values = self.keys[layer_id], self.values[layer_id]
        keys[rows_M, :, entries_M] = k_1KNd[0, :, token_M].transpose(0, 1).to(keys.dtype)
        values[rows_M, :, entries_M] = v_1KNd[0, :, token_M].transpose(0, 1).to(values.dtype)

    def write(self, layer_id: int, k_BKSd: torch.Tensor, v_BKSd: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Store the keys and values of the slots ``start`` claimed (the same slots in every row);
        returns the layer's buffers [B, K, L, d] (full-length ones up to ``read_upto``)."""
        index = self.entries(layer_id)
        keys, values = self.keys[layer_id], self.values[layer_id]
        keys.index_copy_(2, index, k_BKSd[:, :, -index.shape[0]:].to(keys.dtype))
        values.index_copy_(2, index, v_BKSd[:, :, -index.shape[0]:].to(values.dtype))
        return self.read(layer_id)

    def entries(self, layer_id: int) -> torch.Tensor:
        """The entries [S'] of the layer's buffers the slots ``start`` claimed go to (on the device)."""
        return self.index[self.lengths[layer_id]]

    def read(self, layer_id: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The layer's buffers [B, K, L, d] as attention reads them this step (full-length ones up to ``read_upto``),
        once this step's keys and values are in them (``write``, or a kernel writing at ``entries``)."""
        keys, values = self.keys[layer_id], self.values[layer_id]
        if self.lengths[layer_id] == self.num_slots and self.read_upto < self.num_slots:
            return keys[:, :, : self.read_upto], values[:, :, : self.read_upto]
        return keys, values

    def mask(self, layer_id: int) -> torch.Tensor:
        """Boolean [B, 1, 1, L]: which entries of the layer each row's query may attend to."""
        n = self.lengths[layer_id]
        if n not in self.visible:
            self._make_masks(n)
        return self.visible[n]

    def attention_bias(self, layer_id: int) -> torch.Tensor:
        """``mask`` as an additive mask [B, 1, 1, L] in the cache's dtype: 0 where visible, -inf elsewhere (what SDPA
        makes of a boolean mask, made once a step here instead of once a layer)."""
        n = self.lengths[layer_id]
        if n not in self.bias:
            self._make_masks(n)
        return self.bias[n]

    def visible_entries(self, layer_id: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """What ``mask`` says, as a kernel reads it without a mask: (pad_B [B], slot_1 [1], entry_slot [L] or None).
        A full-length buffer (entry_slot None) holds slot s at entry s: row b sees entries pad_B[b] .. slot_1, the
        last slot claimed; a ring's entry e is seen where entry_slot[e] >= pad_B[b]."""
        n = self.lengths[layer_id]
        return self.pad_B, self.slot_1, None if n == self.num_slots else self.entry_slot[n]
