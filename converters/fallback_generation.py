"""Rollouts from a model without a native implementation (``TransformersCausalLM``): transformers' own
``generate`` on the live weights, behind the ``RolloutEngine`` interface the RL and distillation trainers use.

transformers applies the sampling settings (repetition penalty -> temperature -> top-k -> top-p -> min-p, the
native engine's order and definitions); the returned log-probs are log_softmax(logits / temperature) of the
model's raw logits at each step (``output_logits``), as the native engine returns them. Each completion is cut
after its first stop token. Seeded sampling draws from torch's RNG seeded with the seed for the call (the RNG
state outside the call is left as it was), so the same prompts and settings give the same samples.

Shapes: B prompts, P the longest prompt (left-padded), T new tokens, V vocabulary.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
import torch.nn.functional as F

from hfnative.generation.rollouts import RolloutEngine, Rollouts, check_prompts
from hfnative.generation.sampling import SamplingParams
from hfnative.parallel.replica import is_parallelized

from .fallback import TransformersCausalLM


class TransformersRolloutEngine(RolloutEngine):
    """Completions from ``model`` (a ``TransformersCausalLM``: its live weights, adapters included) through
    transformers' ``generate``. ``pad_token_id``: the id left padding uses (default the model's, else the first
    stop token)."""

    reads_live_weights = True

    def __init__(self, model: TransformersCausalLM, pad_token_id: int | None = None):
        if not isinstance(model, TransformersCausalLM):
            raise ValueError(f"TransformersRolloutEngine runs a TransformersCausalLM; got {type(model).__name__}")
        self.model = model
        self.pad_token_id = pad_token_id if pad_token_id is not None else getattr(model.config, "pad_token_id", None)
        self._check_layout()

    def _check_layout(self) -> None:
        if is_parallelized(self.model):
            raise ValueError(
                f"generating from {type(self.model.hf_model).__name__} (transformers' own module: no native "
                "implementation) in a multi-process run is not available: its sharded weights are gathered only "
                "inside the module calls of a training forward. Run on one process, generate with vLLM "
                "(use_vllm=True), or use an architecture hfnative implements natively"
            )

    @torch.no_grad()
    def generate(self, prompts: list[list[int]], sampling: SamplingParams) -> Rollouts:
        self._check_layout()
        hf_model = self.model.hf_model
        prompts = check_prompts(prompts, self.model.args.vocab_size)
        pad = self.pad_token_id if self.pad_token_id is not None else (sampling.stop_ids or (0,))[0]
        device = hf_model.get_input_embeddings().weight.device
        B, P = len(prompts), max(len(p) for p in prompts)
        input_ids = torch.full((B, P), pad, dtype=torch.long)
        attention_mask = torch.zeros(B, P, dtype=torch.long)
        for row, prompt in enumerate(prompts):
            input_ids[row, P - len(prompt):] = torch.tensor(prompt)
            attention_mask[row, P - len(prompt):] = 1
        settings = dict(
            max_new_tokens=sampling.max_new_tokens, min_new_tokens=0, do_sample=sampling.do_sample,
            repetition_penalty=sampling.repetition_penalty, eos_token_id=list(sampling.stop_ids) or None,
            pad_token_id=pad, output_logits=True, return_dict_in_generate=True, use_cache=True,
        )
        if sampling.do_sample:
            settings.update(temperature=sampling.temperature, top_p=sampling.top_p, top_k=sampling.top_k,
                            min_p=sampling.min_p or None)
        was_training = hf_model.training
        hf_model.eval()
        try:
            with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
                if sampling.seed is not None:
                    torch.manual_seed(sampling.seed + sampling.first_row)
                out = self.model.module.generate(input_ids=input_ids.to(device), attention_mask=attention_mask.to(device),
                                                 **settings)
        finally:
            hf_model.train(was_training)
        new_BT = out.sequences[:, P:].cpu()
        logits_BTV = torch.stack(out.logits, dim=1).float().cpu()
        logprobs_BT = F.log_softmax(logits_BTV / sampling.logprob_temperature, dim=-1).gather(-1, new_BT[..., None])[..., 0]
        completion_ids, logprobs, finish_reason = [], [], []
        stops = set(sampling.stop_ids)
        for tokens, values in zip(new_BT.tolist(), logprobs_BT.tolist()):
            end = next((t + 1 for t, token in enumerate(tokens) if token in stops), None)
            completion_ids.append(tokens[:end] if end is not None else tokens)
            logprobs.append(values[:end] if end is not None else values)
            finish_reason.append("stop" if end is not None else "length")
        return Rollouts(completion_ids, logprobs, finish_reason)

    def load_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Nothing to copy: the engine reads the model's live parameters."""


__all__ = ["TransformersRolloutEngine"]
