"""The native rollout backend: batched KV-cache decoding on the training model itself.

Shapes: B batch, P prompt slots (the longest prompt, left-padding the others), T new tokens, V vocabulary.

The engine holds a reference to the model, not a copy: every rollout runs the parameters as they are
now (LoRA adapters included), so ``load_weights`` has nothing to do when it is handed the model's own
tensors; tensors from elsewhere are copied in by native name.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

from hfnative.models.decoder import Transformer
from hfnative.precision import autocast_dtype

from .cached_decoder import decode_step, prefill
from .kv_cache import KVCache
from .rollouts import RolloutEngine, Rollouts, check_prompts
from .sampling import SamplingParams, call_row_keys, choose_tokens

# with compile=True prompts are left-padded to a multiple of this, so batches of similar lengths
# share one compiled decode step (its cache shape) instead of compiling one per prompt length
COMPILE_SLOT_MULTIPLE = 64


class NativeRolloutEngine(RolloutEngine):
    """Rollouts from a native ``Transformer`` (or a model holding one as ``.model``, e.g. a ConvertedModel).

    compile: run the decode step through ``torch.compile`` (it recompiles for a new batch size or
    cache length; prefill stays eager). max_batch_size: at most this many prompts decode together.
    The model is put in eval mode while generating (no dropout, e.g. LoRA's) and restored after.
    """

    reads_live_weights = True
    samples_row_streams = True

    def __init__(self, model: Transformer, *, compile: bool = False, max_batch_size: int | None = None):
        model = getattr(model, "model", model) if not isinstance(model, Transformer) else model
        if not isinstance(model, Transformer):
            raise ValueError(
                f"NativeRolloutEngine needs an hfnative Transformer (or a ConvertedModel), got {type(model).__name__}; "
                "load a checkpoint folder, Hub id or transformers model with hfnative.load_pretrained first"
            )
        if max_batch_size is not None and max_batch_size < 1:
            raise ValueError(f"max_batch_size={max_batch_size}: expected an int >= 1 or None")
        self.model, self.compile, self.max_batch_size = model, compile, max_batch_size
        self._decode_step = torch.compile(decode_step, dynamic=False) if compile else decode_step

    def load_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy tensors into the model by native state-dict name (``layers.0.attention.wq.weight``,
        ``...lora_B``); a tensor that already is the model's own is skipped."""
        own = self.model.state_dict(keep_vars=True)
        with torch.no_grad():
            for name, tensor in named_tensors:
                target = own.get(name)
                if target is None:
                    raise ValueError(
                        f"load_weights: the model has no tensor named {name!r} "
                        "(native names are expected, e.g. 'layers.0.attention.wq.weight')"
                    )
                if tuple(target.shape) != tuple(tensor.shape):
                    raise ValueError(
                        f"load_weights: {name} has shape {list(tensor.shape)}, the model's is {list(target.shape)}"
                    )
                if target.data_ptr() != tensor.data_ptr():
                    target.copy_(tensor)

    @torch.no_grad()
    def generate(self, prompts: list[list[int]], sampling: SamplingParams) -> Rollouts:
        prompts = check_prompts(prompts, self.model.args.vocab_size)
        step = self.max_batch_size or len(prompts)
        was_training = self.model.training
        self.model.eval()
        try:
            parts = [self._generate_batch(prompts[i : i + step], sampling, i) for i in range(0, len(prompts), step)]
        finally:
            self.model.train(was_training)
        return Rollouts(
            [c for part in parts for c in part.completion_ids],
            [lp for part in parts for lp in part.logprobs],
            [r for part in parts for r in part.finish_reason],
        )

    @property
    def _device(self) -> torch.device:
        return self.model.tok_embeddings.weight.device

    def _generate_batch(self, prompts: list[list[int]], sampling: SamplingParams, offset: int) -> Rollouts:
        """Completions of ``prompts``, rows ``offset`` onwards of the call."""
        model, device, T = self.model, self._device, sampling.max_new_tokens
        args = model.args
        B, longest = len(prompts), max(len(p) for p in prompts)
        P = -(-longest // COMPILE_SLOT_MULTIPLE) * COMPILE_SLOT_MULTIPLE if self.compile else longest
        pad_B = torch.tensor([P - len(p) for p in prompts], device=device)

        # under autocast (fp32 master weights, bf16=True) the projections give keys and values in the autocast dtype,
        # and attention reads them in it
        cache_dtype = autocast_dtype(device.type) or model.tok_embeddings.weight.dtype
        cache = KVCache(
            [layer.is_sliding for layer in model.layers], args.sliding_window, B, args.n_kv_heads, args.head_dim,
            P + T, pad_B, cache_dtype, device,
        )
        seen_BV = None
        if sampling.repetition_penalty != 1.0:  # the prompt's tokens count as seen, as in transformers
            seen_BV = torch.zeros(B, args.vocab_size, dtype=torch.bool, device=device)
            rows = torch.repeat_interleave(torch.arange(B), torch.tensor([len(p) for p in prompts]))
            seen_BV[rows.to(device), torch.tensor([t for p in prompts for t in p], device=device)] = True
        stop_ids = torch.tensor(sampling.stop_ids, dtype=torch.long, device=device)
        check_every = 1 if device.type == "cpu" else 8  # reading `finished` waits for the device

        tokens_BT = torch.zeros(B, T, dtype=torch.long, device=device)
        logprobs_BT = torch.zeros(B, T, dtype=torch.float32, device=device)
        lengths_B = torch.zeros(B, dtype=torch.long, device=device)
        finished_B = torch.zeros(B, dtype=torch.bool, device=device)
        keys_B = None
        if sampling.seed is not None:
            keys_B = call_row_keys(sampling, offset, B, device=device)
        logits_BV = prefill(model, prompts, P, cache)
        for t in range(T):
            token_B, logprob_B = choose_tokens(logits_BV, sampling, seen_BV, keys_B, t)
            tokens_BT[:, t], logprobs_BT[:, t] = token_B, logprob_B
            lengths_B += ~finished_B
            if stop_ids.numel():
                finished_B |= torch.isin(token_B, stop_ids)
            if t == T - 1 or (stop_ids.numel() and (t + 1) % check_every == 0 and bool(finished_B.all())):
                break
            if seen_BV is not None:
                seen_BV[torch.arange(B, device=device), token_B] = True
            slot = P + t
            logits_BV = self._decode_step(model, token_B, torch.tensor(slot, device=device), cache,
                                          None if self.compile else slot + 1)

        lengths = lengths_B.tolist()
        tokens, logprobs, finished = tokens_BT.tolist(), logprobs_BT.tolist(), finished_B.tolist()
        return Rollouts(
            [row[:n] for row, n in zip(tokens, lengths)],
            [row[:n] for row, n in zip(logprobs, lengths)],
            ["stop" if done else "length" for done in finished],
        )
