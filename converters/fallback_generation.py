"""Rollouts from a model without a native implementation (``TransformersCausalLM``): transformers' own
``generate`` on the live weights, behind the ``RolloutEngine`` interface the RL and distillation trainers use.

A seeded call samples each row from its own stream with the native engine's choice (``RowStreamChoice``: repetition
penalty -> temperature -> top-k -> top-p -> min-p, then one draw per row and step), so a row's samples depend on
its place in the whole batch only, as the native engine's; unseeded sampling is transformers' own (the same order
and definitions, torch's RNG). The returned log-probs are log_softmax(logits / temperature) of the model's raw
logits at each step (``output_logits``), as the native engine returns them. Each completion is cut after its first
stop token. On a parallelized model (FSDP2, DDP, TP: DTensor weights) each rank generates from a plain replica of
the whole weights, gathered before each call.

Shapes: B prompts, P the longest prompt (left-padded), T new tokens, V vocabulary.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor
from transformers import LogitsProcessorList

from hfnative.generation.rollouts import RolloutEngine, Rollouts, check_prompts
from hfnative.generation.sampling import SamplingParams, call_row_keys, choose_tokens
from hfnative.parallel.replica import is_parallelized, whole_tensor

from .fallback import TransformersCausalLM


class TransformersRolloutEngine(RolloutEngine):
    """Completions from ``model`` (a ``TransformersCausalLM``: its live weights, adapters included) through
    transformers' ``generate``. ``pad_token_id``: the id left padding uses (default the model's, else the first
    stop token)."""

    reads_live_weights = True
    samples_row_streams = True

    def __init__(self, model: TransformersCausalLM, pad_token_id: int | None = None):
        if not isinstance(model, TransformersCausalLM):
            raise ValueError(f"TransformersRolloutEngine runs a TransformersCausalLM; got {type(model).__name__}")
        self.model = model
        self.pad_token_id = pad_token_id if pad_token_id is not None else getattr(model.config, "pad_token_id", None)
        self._replica = None  # a parallelized model's whole weights, gathered before each generation
        self._check_layout()

    def _check_layout(self) -> None:
        if is_parallelized(self.model) and self.model.peft_model is not None:
            raise ValueError(
                f"generating from {type(self.model.hf_model).__name__} with peft adapters (transformers' own module: "
                "no native implementation) in a multi-process run needs the adapters folded into a whole copy of the "
                "weights, which is not done: run on one process, or generate with vLLM (use_vllm=True)"
            )

    def _generator(self) -> nn.Module:
        """The module ``generate`` runs: the model's own on one process; on a parallelized model (FSDP2, DDP, TP
        shards as DTensors, gathered only inside a training forward's module calls) a plain replica holding its
        current whole weights, gathered here (a collective: every rank generates in step, as the trainers do)."""
        if not is_parallelized(self.model):
            return self.model.module
        self._replica = gather_module_replica(self.model.hf_model, self._replica)
        return self._replica

    @torch.no_grad()
    def generate(self, prompts: list[list[int]], sampling: SamplingParams) -> Rollouts:
        self._check_layout()
        generator = self._generator()
        hf_model = self.model.hf_model if generator is self.model.module else generator
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
        if sampling.do_sample and sampling.seed is not None:  # each row from its own stream: the native choice
            choice = RowStreamChoice(sampling, prompts, P, self.model.args.vocab_size, device)
            settings.update(do_sample=False, repetition_penalty=1.0, logits_processor=LogitsProcessorList([choice]))
        elif sampling.do_sample:
            settings.update(temperature=sampling.temperature, top_p=sampling.top_p, top_k=sampling.top_k,
                            min_p=sampling.min_p or None)
        was_training = hf_model.training
        hf_model.eval()
        try:
            with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
                out = generator.generate(input_ids=input_ids.to(device), attention_mask=attention_mask.to(device),
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


class RowStreamChoice:
    """A transformers logits processor that picks each row's next token as the native engine does
    (``choose_tokens``: repetition penalty, temperature, top-k, top-p, min-p, then one draw from the row's own
    stream at its decode step) and leaves only that token possible, for ``generate`` to take greedily. So a
    seeded row's samples depend on its place in the whole batch (``SamplingParams.first_row`` / ``row_indices``),
    not on which other rows share the call or the process."""

    def __init__(self, sampling: SamplingParams, prompts: list[list[int]], width: int, vocab_size: int, device):
        self.sampling, self.width = sampling, width
        self.keys_B = call_row_keys(sampling, 0, len(prompts), device=device)
        self.seen_BV = None
        if sampling.repetition_penalty != 1.0:  # the prompt's tokens count as seen, as in transformers
            self.seen_BV = torch.zeros(len(prompts), vocab_size, dtype=torch.bool, device=device)
            for row, prompt in enumerate(prompts):
                self.seen_BV[row, torch.tensor(prompt, device=device)] = True

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        step = input_ids.shape[1] - self.width
        if self.seen_BV is not None and step > 0:
            self.seen_BV[torch.arange(input_ids.shape[0], device=input_ids.device), input_ids[:, -1]] = True
        tokens_B, _ = choose_tokens(scores, self.sampling, self.seen_BV, self.keys_B, step)
        chosen = torch.full_like(scores, float("-inf"))
        return chosen.scatter_(-1, tokens_B[:, None], 0.0)


@torch.no_grad()
def gather_module_replica(hf_model: nn.Module, replica: nn.Module | None = None) -> nn.Module:
    """``replica`` (when None, a new frozen transformers model of ``hf_model``'s config, class and attention
    implementation, in eval mode on this rank's device) holding ``hf_model``'s whole current weights: each DTensor
    gathered (every rank of the mesh must call this), the buffers (rotary tables, ...) copied as they are."""
    state = hf_model.state_dict()
    if replica is None:
        from transformers import AutoModelForCausalLM

        local = next(iter(state.values()))
        local = local.to_local() if isinstance(local, DTensor) else local
        with torch.device("meta"):
            replica = AutoModelForCausalLM.from_config(
                hf_model.config, dtype=local.dtype, attn_implementation=hf_model.config._attn_implementation)
        replica.to_empty(device=local.device)
        replica.requires_grad_(False).eval()
        replica.generation_config = hf_model.generation_config
    own = replica.state_dict()
    if set(own) != set(state):
        raise ValueError(
            f"gather_module_replica: {type(replica).__name__}'s tensors are not the model's (missing "
            f"{sorted(set(state) - set(own))[:3]}, extra {sorted(set(own) - set(state))[:3]})"
        )
    for name, tensor in state.items():
        own[name].copy_(whole_tensor(tensor))
    buffers = dict(replica.named_buffers())
    for name, buffer in hf_model.named_buffers():
        buffers[name].copy_(whole_tensor(buffer))
    return replica


__all__ = ["TransformersRolloutEngine", "gather_module_replica"]
