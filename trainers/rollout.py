"""The rollout component every on-policy objective shares: GRPO, RLOO, async GRPO, on-policy distillation and GKD.

Prompts become token ids (a conversation through the chat template with the generation prompt, text as it is),
TRL's stop tokens and sampling settings become one ``SamplingParams``, completions come from a rollout engine
(the policy's: native on the live weights or vLLM, as the config asks; another model's: native), are padded into
tensors with their masks, decoded back to text or assistant messages, and measured (TRL's completions/* metrics).
"""

from __future__ import annotations

import time
from dataclasses import fields, replace

import torch

from hfnative.data.collate import pad_right
from hfnative.generation import NativeRolloutEngine, Rollouts, SamplingParams
from hfnative.generation.sampling import mix64_int
from hfnative.losses import IGNORE_INDEX
from hfnative.models.head import TokenLogprobs
from hfnative.parallel.replica import gather_replica, is_parallelized

from .reference_model import router_loss_off


def is_conversational(prompt) -> bool:
    """A prompt given as chat messages ({"role", "content"} dicts) rather than text."""
    return isinstance(prompt, list) and bool(prompt) and isinstance(prompt[0], dict) and "role" in prompt[0]


def tokenize_prompts(processing_class, prompts: list, chat_template_kwargs: dict | None = None,
                     add_special_tokens: bool = True, tools: list | None = None,
                     chat_template: str | None = None) -> list[list[int]]:
    """Token ids of each prompt: a conversation rendered by the chat template (``chat_template`` in place of the
    tokenizer's when given) with the generation prompt and the ``tools``' schemas, text tokenized as it is (with the
    tokenizer's special tokens unless ``add_special_tokens`` is False)."""
    if not prompts:
        return []
    if is_conversational(prompts[0]):
        extra = {} if tools is None and chat_template is None else {"tools": tools or None, "chat_template": chat_template}
        encoded = processing_class.apply_chat_template(
            prompts, add_generation_prompt=True, tokenize=True, return_dict=True, **extra, **(chat_template_kwargs or {})
        )
        return [list(ids) for ids in encoded["input_ids"]]
    for index, prompt in enumerate(prompts):
        if not isinstance(prompt, str):
            raise ValueError(f"prompt {index} is {prompt!r}: expected a string or a list of chat messages (role, content)")
    return [list(ids) for ids in processing_class(text=prompts, add_special_tokens=add_special_tokens)["input_ids"]]


def generation_eos_ids(model) -> list[int]:
    """The EOS ids of ``model``'s generation_config (none when it has none)."""
    ids = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    return [] if ids is None else [ids] if isinstance(ids, int) else list(ids)


def stop_token_ids(tokenizer, model) -> list[int]:
    """TRL's stop tokens: the tokenizer's EOS first, then the model's generation_config EOS ids."""
    ids = generation_eos_ids(model)
    if tokenizer.eos_token_id is not None and tokenizer.eos_token_id not in ids:
        ids = [tokenizer.eos_token_id, *ids]
    if not ids:
        raise ValueError("the tokenizer has no eos_token and the model no generation_config.eos_token_id: set one")
    return ids


# the SamplingParams fields a config's generation_kwargs may set (the stop tokens and the seed are the run's)
GENERATION_KWARGS = tuple(f.name for f in fields(SamplingParams) if f.init and f.name != "seed")


def sampling_params(args, max_new_tokens: int, stop_ids: list[int], *, generation_kwargs=None, strict: bool = False,
                    **overrides) -> SamplingParams:
    """Sampling from TRL's argument names (temperature, top_p, top_k, min_p, repetition_penalty), then
    ``overrides``, then ``generation_kwargs`` (its keys outside ``GENERATION_KWARGS`` are ignored, or refused when
    ``strict``)."""
    settings = dict(max_new_tokens=max_new_tokens, do_sample=True, temperature=args.temperature,
                    top_p=getattr(args, "top_p", 1.0), top_k=getattr(args, "top_k", 0),
                    min_p=getattr(args, "min_p", None) or 0.0, repetition_penalty=getattr(args, "repetition_penalty", 1.0))
    settings.update(overrides, eos_token_id=list(stop_ids))
    for key, value in (generation_kwargs or {}).items():
        if key in GENERATION_KWARGS:
            settings[key] = value
        elif strict:
            raise ValueError(
                f"generation_kwargs[{key!r}] is not a setting of the native generation engine; it takes "
                f"{', '.join(sorted(GENERATION_KWARGS))}"
            )
    return SamplingParams(**settings)


def pad_token_lists(sequences: list[list], value, side: str = "right", dtype=torch.long) -> torch.Tensor:
    """[N, T] from N lists of up to T values, ``value`` filling the ``side`` ("left" or "right")."""
    rows = [torch.tensor(list(s), dtype=dtype) for s in sequences]
    if side == "left":  # right-padding of the reversed rows, reversed back
        return pad_right([row.flip(0) for row in rows], value).flip(1)
    return pad_right(rows, value)


def completion_length_metrics(lengths_N: torch.Tensor, clipped_N: torch.Tensor) -> dict[str, torch.Tensor]:
    """TRL's completions/* metrics from N completion lengths and whether each was cut at the length limit (no stop
    token at its end): lengths, the clipped share, and the lengths of those that ended on a stop token (0 if none)."""
    lengths_N = lengths_N.double()
    clipped_N = clipped_N.bool()
    terminated = lengths_N[~clipped_N] if (~clipped_N).any() else torch.zeros(1, dtype=torch.float64)
    return {
        "completions/mean_length": lengths_N.mean(), "completions/min_length": lengths_N.min(),
        "completions/max_length": lengths_N.max(), "completions/clipped_ratio": clipped_N.double().mean(),
        "completions/mean_terminated_length": terminated.mean(), "completions/min_terminated_length": terminated.min(),
        "completions/max_terminated_length": terminated.max(),
    }


def trimmed_rows(batch: dict, rows: torch.Tensor) -> dict:
    """``rows`` of a rollout batch (``Rollout.tensors``' keys, and any per-token [N, T] tensor beside them), cut to
    their longest prompt (the left padding) and their longest completion (``completion_lengths``, which a masked-out
    truncated completion keeps)."""
    part = {key: value[rows] for key, value in batch.items()}
    prompt_width = int(part["prompt_mask"].sum(1).max())
    completion_width = int(part["completion_lengths"].max())
    T = part["completion_ids"].shape[1]
    for key, value in part.items():
        if key in ("prompt_ids", "prompt_mask"):
            part[key] = value[:, value.shape[1] - prompt_width :]
        elif value.dim() == 2 and value.shape[1] == T:
            part[key] = value[:, :completion_width]
    return part


def model_inputs(batch: dict) -> dict:
    """A rollout batch (``Rollout.tensors``) as the model's inputs: prompt + completion ids and attention mask
    [N, P + T], the completion targets (IGNORE_INDEX where masked) at the positions that predict them as
    ``shift_labels`` [N, P + T] (what a context-parallel split cuts alike), and the prompt width P."""
    targets_NT = batch["completion_ids"].masked_fill(batch["completion_mask"] == 0, IGNORE_INDEX)
    N, P = batch["prompt_ids"].shape
    prompt_targets_NP = torch.full((N, P), IGNORE_INDEX, dtype=targets_NT.dtype)
    return {
        **batch,
        "input_ids": torch.cat([batch["prompt_ids"], batch["completion_ids"]], dim=1),
        "attention_mask": torch.cat([batch["prompt_mask"], batch["completion_mask"]], dim=1),
        "shift_labels": torch.cat([prompt_targets_NP[:, 1:], targets_NT, prompt_targets_NP[:, :1]], dim=1),
        "prompt_length": P,
    }


def completion_logprobs_of(model, inputs: dict, temperature: float, context):
    """Log-prob and entropy (at ``temperature``) of each completion token [B, T] under ``model``, zeros where the
    target is IGNORE_INDEX, and the forward's MoE router load-balancing loss (None unless the model has it on,
    ``aux_loss_enabled``; over the prompt and completion tokens the attention mask keeps, as TRL's forward takes
    it). Only the positions that predict completion tokens reach the head (vocabulary-parallel under tensor
    parallel); under context parallel each rank's positions are put back into the whole sequence."""
    head = TokenLogprobs(inputs["shift_labels"], temperature, compact=True)
    out = model(
        inputs["input_ids"], attention_mask=inputs.get("attention_mask"), position_ids=inputs.get("position_ids"),
        attention_plan=inputs.get("attention_plan"), head_loss=head,
    )
    logprobs_BS, entropy_BS = out.head_output
    P, T = inputs["prompt_length"], inputs["completion_mask"].shape[1]
    whole = context.context_parallel.gather_sequence(torch.stack([logprobs_BS, entropy_BS], dim=-1))
    return whole[:, P - 1 : P - 1 + T, 0], whole[:, P - 1 : P - 1 + T, 1], getattr(out, "aux_loss", None)


class Rollout:
    """One trainer's rollouts: tokenization, sampling settings, engines, padding, decoding and length metrics.

    ``engine``: the policy's rollout engine (default: the native engine on the policy's live weights); any other
    model given to ``generate`` (a teacher) gets a native engine of its own. ``sampling``: the run's
    SamplingParams; ``chat_template_kwargs``: passed to the chat template; ``add_special_tokens``: for text
    prompts (TRL's async trainer tokenizes them without).

    A native engine on a parallelized model (FSDP2, DDP) decodes a replica of its whole weights, gathered on every
    rank before each generation (hfnative.parallel.replica), so each data-parallel rank completes its own prompts.
    """

    def __init__(self, context, sampling: SamplingParams, *, engine=None, chat_template_kwargs: dict | None = None,
                 add_special_tokens: bool = True):
        self.context = context
        self.tokenizer = context.tokenizer
        self.sampling = sampling
        self.stop_ids = list(sampling.stop_ids)
        self.pad_token_id = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else self.stop_ids[0]
        self.chat_template_kwargs = dict(chat_template_kwargs or {})
        self.add_special_tokens = add_special_tokens
        self._replicas: dict[int, object] = {}  # id(model) -> the replica a native engine decodes
        self._other_engines: dict[int, NativeRolloutEngine] = {}
        if engine is not None and isinstance(engine, NativeRolloutEngine) and is_parallelized(context.model):
            engine = None  # decodes a replica instead, made below
        self.engine = engine
        if engine is None and is_parallelized(context.model):
            self.engine = self._replica_engine(context.model)

    def tokenize(self, prompts: list) -> list[list[int]]:
        return tokenize_prompts(self.context.processing_class, prompts, self.chat_template_kwargs, self.add_special_tokens)

    def engine_for(self, model=None):
        """The policy's engine (``model`` None or the policy), else a native engine on ``model``'s weights; an
        engine on a replica has the model's current weights gathered into it first (every rank calls this)."""
        policy = model is None or model is self.context.model
        model = self.context.model if policy else model
        if policy and self.engine is None:
            self.engine = self._native_engine(model)
        if not policy and id(model) not in self._other_engines:  # a new replica is gathered as it is made
            parallel = is_parallelized(model)
            self._other_engines[id(model)] = self._replica_engine(model) if parallel else self._native_engine(model)
        elif id(model) in self._replicas and any(p.requires_grad for p in model.parameters()):  # a frozen one stays
            self._replicas[id(model)] = gather_replica(model, self._replicas[id(model)])
        return self.engine if policy else self._other_engines[id(model)]

    def _replica_engine(self, model) -> NativeRolloutEngine:
        if self.context.uses_adapters and model is self.context.model:
            raise ValueError(
                "generating from a LoRA policy in a multi-process run needs its adapters folded into a whole copy of "
                "the weights, which the native engine does not do yet: run on one process, or generate with vLLM "
                "(use_vllm=True)"
            )
        self._replicas[id(model)] = replica = gather_replica(model)
        return self._native_engine(replica)

    def _native_engine(self, model) -> NativeRolloutEngine:
        """A native engine on ``model``; with ``torch_compile`` its decode step is compiled (a CUDA graph on CUDA)."""
        return NativeRolloutEngine(model, compile=bool(getattr(self.context.args, "torch_compile", False)))

    def row_streams(self, place: int, rows: int) -> dict:
        """``generate``'s seed and first row for this data-parallel rank's ``rows`` rows of the generation batch made
        at the run's micro-batch ``place``: per-row sampling streams, so the samples do not depend on how the batch
        is cut over processes, and the ranks that split one batch's sequences or weights (context, tensor parallel)
        complete it alike. Empty (the engine's own RNG, as TRL's vLLM) for a vLLM engine on a data-parallel layout."""
        layout = self.context.layout
        model_parallel = layout is not None and (layout.cp_enabled or layout.tp_enabled)
        # None: native, made lazily
        streams = self.engine is None or getattr(self.engine, "samples_row_streams", False)
        if not streams and not model_parallel:
            return {}
        seed = mix64_int(mix64_int(int(self.context.args.seed)) ^ place) & ((1 << 63) - 1)
        return {"seed": seed, "first_row": self.context.data_parallel.rank * rows}

    def generate(self, prompt_ids: list[list[int]], model=None, seed: int | None = None, first_row: int = 0) -> Rollouts:
        """Completions of ``prompt_ids`` (each cut after its first stop token) with their sampling log-probs, from
        ``model`` (default: the policy); ``seed`` replaces the run's sampling seed, ``first_row`` is the place of
        the call's first row in its whole batch (see SamplingParams)."""
        sampling = self.sampling if seed is None else replace(self.sampling, seed=seed, first_row=first_row)
        return self.sample(prompt_ids, sampling, model)

    def continuation(self, streams: dict, model=None):
        """``generate(prompt_ids, rows, turn)`` for the later turns of a multi-turn rollout whose first turn sampled
        with ``streams`` (``row_streams``' seed and first row, or none): the given rows (their indices in the call's
        batch) continued from the given tokens, each from its own stream for that turn (``SamplingParams.for_turn``)."""
        first = self.sampling if not streams else replace(self.sampling, **streams)

        def generate(prompt_ids: list[list[int]], rows: list[int], turn: int) -> Rollouts:
            return self.sample(prompt_ids, first.for_turn(turn, rows), model)

        return generate

    def sample(self, prompt_ids: list[list[int]], sampling: SamplingParams, model=None) -> Rollouts:
        """Completions of ``prompt_ids`` with ``sampling`` from ``model`` (default: the policy), the call's wall time
        (a replica's weight gather included) and generated tokens recorded for the perf/ metrics."""
        start = time.perf_counter()
        with self.context.autocast():
            rollouts = self.engine_for(model).generate(prompt_ids, sampling)
        self.context.record_generation(time.perf_counter() - start, sum(len(ids) for ids in rollouts.completion_ids))
        return rollouts

    def tensors(self, prompt_ids, completion_ids, sampling_logprobs, mask_truncated: bool = False) -> dict:
        """The rollouts as padded tensors: prompts left-padded [N, P] with their mask, completions right-padded
        [N, T] with their mask (zero for completions cut at the length limit when ``mask_truncated``), the sampling
        log-probs [N, T] and the completion lengths [N]."""
        pad = self.pad_token_id
        completion_mask_NT = pad_token_lists([[1] * len(ids) for ids in completion_ids], 0)
        if mask_truncated:
            truncated_N = torch.tensor([self.is_truncated(ids) for ids in completion_ids])
            completion_mask_NT = completion_mask_NT * (~truncated_N)[:, None].long()
        return {
            "prompt_ids": pad_token_lists(prompt_ids, pad, side="left"),
            "prompt_mask": pad_token_lists([[1] * len(ids) for ids in prompt_ids], 0, side="left"),
            "completion_ids": pad_token_lists(completion_ids, pad),
            "completion_mask": completion_mask_NT,
            "sampling_logprobs": pad_token_lists(sampling_logprobs, 0.0, dtype=torch.float32),
            "completion_lengths": torch.tensor([len(ids) for ids in completion_ids]),
        }

    @torch.no_grad()
    def completion_logprobs(self, model, batch: dict, batch_size: int) -> torch.Tensor:
        """Per-token log-probs [N, T] of a rollout batch's completions under ``model`` (at the sampling
        temperature), without a graph, ``batch_size`` rows at a time, on the CPU in float32."""
        parts, was_training = [], model.training
        model.eval()
        try:
            for start in range(0, batch["prompt_ids"].shape[0], batch_size):
                chunk = {k: v[start : start + batch_size] for k, v in batch.items() if isinstance(v, torch.Tensor)}
                inputs = self.context.prepare_inputs(self.context.context_parallel.split(model_inputs(chunk)))
                with self.context.autocast(), router_loss_off(model):
                    logprobs, _, _ = completion_logprobs_of(model, inputs, self.sampling.logprob_temperature, self.context)
                parts.append(logprobs.float().cpu())
        finally:
            model.train(was_training)
        return torch.cat(parts)

    def is_truncated(self, completion_ids: list[int]) -> bool:
        """Cut at the length limit: the completion does not end on a stop (or the padding) token."""
        return bool(completion_ids) and completion_ids[-1] not in (*self.stop_ids, self.pad_token_id)

    def decode(self, prompts: list, completion_ids: list[list[int]]) -> list:
        """Completions as text, or as one assistant message each for conversational prompts (TRL's)."""
        texts = self.tokenizer.batch_decode(completion_ids, skip_special_tokens=True)
        if prompts and is_conversational(prompts[0]):
            return [[{"role": "assistant", "content": text}] for text in texts]
        return texts

    def lengths(self, completion_ids: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
        """(lengths [N] float64, cut at the length limit [N] bool) of the completions."""
        return (torch.tensor([len(c) for c in completion_ids], dtype=torch.float64),
                torch.tensor([self.is_truncated(c) for c in completion_ids], dtype=torch.bool))


__all__ = [
    "GENERATION_KWARGS",
    "Rollout",
    "completion_logprobs_of",
    "completion_length_metrics",
    "is_conversational",
    "model_inputs",
    "pad_token_lists",
    "sampling_params",
    "stop_token_ids",
    "tokenize_prompts",
]
