"""The rollout component every on-policy objective shares: GRPO, RLOO, async GRPO, online DPO, on-policy distillation
and GKD.

Prompts in, completions out: prompts become token ids (a conversation through the chat template with the generation
prompt, text as it is), TRL's stop tokens and sampling settings become one ``SamplingParams``, and completions come
from a rollout engine (the policy's: native on the live weights or vLLM, as the config asks; another model's:
native), through multi-turn tool calls and environments (trainers/rollout/tool_calling.py) or the user's ``rollout_func``
when the run has them. The component decodes them back to text or assistant messages, pads them into tensors
(trainers/rollout/batches.py), logs TRL's completions/* and tools/* metrics and the tokens seen, and after each
optimizer step hands an engine that holds its own weights the policy's new ones. A native engine on a parallelized
policy (FSDP2, DDP; LoRA adapters folded in) decodes a replica of its whole weights gathered before each generation.
"""

from __future__ import annotations

import copy
import time
from dataclasses import dataclass, replace

import torch

from hfnative.generation import NativeRolloutEngine, Rollouts, SamplingParams
from hfnative.generation.sampling import mix64_int
from hfnative.parallel.replica import gather_replica, is_parallelized

from .prompts import is_conversational, tokenize_prompts
from ..algorithms.reference_model import router_loss_off
from .batches import completion_length_metrics, completion_logprobs_of, model_inputs, pad_token_lists
from .tool_calling import Episode, tool_metrics


@dataclass
class Completions:
    """One generation batch's completions, per row (``rows``: the dataset rows, one per completion, with the fields a
    ``rollout_func`` adds): the prompts (after an environment's reset), their token ids, the completion token ids and
    sampling log-probs, the completions decoded (text, or assistant messages), the tool mask (1 on the model's own
    tokens; None without tool turns) and the extra arguments of the reward functions (an episode's environments)."""

    rows: list[dict]
    prompts: list
    prompt_ids: list[list[int]]
    completion_ids: list[list[int]]
    logprobs: list[list[float]]
    completions: list
    tool_mask: list[list[int]] | None = None
    reward_kwargs: dict | None = None


class Rollout:
    """One trainer's rollouts (see the module docstring).

    ``engine``: the policy's rollout engine (default: the native engine on the policy's live weights, made at first
    use); any other model given to ``generate`` (a teacher) gets a native engine of its own. ``sampling``: the run's
    SamplingParams; ``chat_template_kwargs``: passed to the chat template; ``add_special_tokens``: for text prompts
    (TRL's async trainer tokenizes them without); ``tool_calling``: the run's ``ToolCalling`` (tools, environments);
    ``rollout_func``: the user's rollout (prompts -> TRL's rollout dict), which then makes the completions.
    """

    def __init__(self, context, sampling: SamplingParams, *, engine=None, chat_template_kwargs: dict | None = None,
                 add_special_tokens: bool = True, tool_calling=None, rollout_func=None):
        if tool_calling is not None and rollout_func is not None:
            raise ValueError("rollout_func makes the completions itself: pass it without tools / environment_factory")
        self.context = context
        self.tokenizer = context.tokenizer
        self.sampling = sampling
        self.stop_ids = list(sampling.stop_ids)
        self.pad_token_id = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else self.stop_ids[0]
        self.chat_template_kwargs = dict(chat_template_kwargs or {})
        self.add_special_tokens = add_special_tokens
        self.tool_calling, self.rollout_func = tool_calling, rollout_func
        self._replicas: dict[int, object] = {}  # id(model) -> the replica a native engine decodes
        self._other_engines: dict[int, NativeRolloutEngine] = {}
        if isinstance(engine, NativeRolloutEngine) and is_parallelized(context.model):
            engine = None  # decodes a replica instead, made at first use
        self._engine = engine

    @property
    def engine(self):
        """The policy's engine, made at first use (after the run's capabilities are checked): a native engine on the
        live weights, or on a gathered replica of a parallelized policy."""
        if self._engine is None:
            model = self.context.model
            self._engine = self._replica_engine(model) if is_parallelized(model) else self._native_engine(model)
        return self._engine

    @engine.setter
    def engine(self, engine) -> None:
        self._engine = engine

    @property
    def mode(self) -> str:
        return "train" if self.context.model.training else "eval"

    def tokenize(self, prompts: list) -> list[list[int]]:
        return tokenize_prompts(self.context.processing_class, prompts, self.chat_template_kwargs, self.add_special_tokens)

    def engine_for(self, model=None):
        """The policy's engine (``model`` None or the policy), else a native engine on ``model``'s weights; an
        engine on a replica has the model's current weights gathered into it first (every rank calls this)."""
        policy = model is None or model is self.context.model
        model = self.context.model if policy else model
        engine = self.engine if policy else None
        if not policy and id(model) not in self._other_engines:  # a new replica is gathered as it is made
            parallel = is_parallelized(model)
            self._other_engines[id(model)] = self._replica_engine(model) if parallel else self._native_engine(model)
        elif id(model) in self._replicas and any(p.requires_grad for p in model.parameters()):  # a frozen one stays
            self._replicas[id(model)] = gather_replica(model, self._replicas[id(model)])
        return engine if policy else self._other_engines[id(model)]

    def _replica_engine(self, model) -> NativeRolloutEngine:
        self._replicas[id(model)] = replica = gather_replica(model)
        return self._native_engine(replica)

    def _native_engine(self, model) -> NativeRolloutEngine:
        """A native engine on ``model``; with ``torch_compile`` its decode step is compiled (a CUDA graph on CUDA).
        A model without a native implementation generates through transformers' generate."""
        from types import SimpleNamespace

        from .engines import make_rollout_engine

        native_only = SimpleNamespace(use_vllm=False, torch_compile=getattr(self.context.args, "torch_compile", False))
        return make_rollout_engine(model, native_only)

    def sync_weights(self) -> None:
        """After an optimizer step: an engine that holds its own copy of the weights (vLLM) gets the policy's new
        ones; one that reads the live weights (or gathers a replica before each generation) needs nothing."""
        if not self.engine.reads_live_weights:
            from hfnative.converters.rollouts import hub_named_tensors

            self.engine.load_weights(hub_named_tensors(self.context.model))

    def row_streams(self, place: int, rows: int) -> dict:
        """``generate``'s seed and first row for this data-parallel rank's ``rows`` rows of the generation batch made
        at the run's micro-batch ``place``: per-row sampling streams, so the samples do not depend on how the batch
        is cut over processes, and the ranks that split one batch's sequences or weights (context, tensor parallel)
        complete it alike. Empty (the engine's own RNG, as TRL's vLLM) for a vLLM engine on a data-parallel layout."""
        layout = self.context.layout
        model_parallel = layout is not None and (layout.cp_enabled or layout.tp_enabled)
        # None: native, made at first use
        streams = self._engine is None or getattr(self._engine, "samples_row_streams", False)
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

    # --- a generation batch ------------------------------------------------------------------------------------
    def complete(self, rows: list[dict], place: int) -> Completions:
        """The completions of ``rows`` (one dataset row per completion): the user's ``rollout_func``, else tool turns
        (environments reset first), else one sampled completion per prompt. ``place``: the run's micro-batch that
        generates; with the run's seed it keys the native engine's per-row sampling streams, so the completions do
        not depend on the number of processes, and a resumed run draws alike. Logs tools/* for tool turns."""
        if self.tool_calling is not None:
            return self._tool_turns(rows, place)
        prompts = [row["prompt"] for row in rows]
        if self.rollout_func is not None:
            return self._custom_rollout(rows, prompts)
        prompt_ids = self.tokenize(prompts)
        rollouts = self.generate(prompt_ids, **self.row_streams(place, len(prompt_ids)))
        return Completions(rows, prompts, prompt_ids, rollouts.completion_ids, rollouts.logprobs,
                           self.decode(prompts, rollouts.completion_ids))

    def complete_ids(self, prompt_ids: list[list[int]], place: int, model=None, sampling=None) -> Completions:
        """The completions of prompts given as token ids (rendered with the run's tools when it has them) from
        ``model`` (default: the policy), with ``sampling`` (default: the run's), keyed by ``place`` as ``complete``'s;
        with tools, the rollout's later turns too. ``rows``, ``prompts`` and ``completions`` stay empty."""
        streams = self.row_streams(place, len(prompt_ids))
        first = self.sample(prompt_ids, replace(sampling or self.sampling, **streams), model)
        done = Completions([], [], prompt_ids, first.completion_ids, first.logprobs, [])
        if self.tool_calling is not None and self.tool_calling.calls_tools:
            episode = Episode(prompts=[], tools=[self.tool_calling.tools] * len(prompt_ids))
            self._continue_turns(done, episode, streams, model)
        return done

    def _tool_turns(self, rows: list[dict], place: int) -> Completions:
        """A multi-turn rollout (trainers/rollout/tool_calling.py): each row's environment reset, the prompts rendered with
        their tools, completed, and continued after each turn's tool results; later turns sample from per-row streams
        of their own (``continuation``)."""
        tools = self.tool_calling
        prompts = [row.get("prompt", [{"role": "user", "content": ""}]) for row in rows]
        episode = tools.start(rows, prompts)
        prompt_ids = tools.tokenize(episode)
        streams = self.row_streams(place, len(prompt_ids))
        first = self.generate(prompt_ids, **streams)
        done = Completions(rows, episode.prompts, prompt_ids, first.completion_ids, first.logprobs, [],
                           reward_kwargs=episode.reward_kwargs())
        if not tools.calls_tools:  # environments without tool methods: one turn, the completions as text messages
            done.completions = self.decode(episode.prompts, first.completion_ids)
            return done
        return self._continue_turns(done, episode, streams)

    def _continue_turns(self, done: Completions, episode, streams: dict, model=None) -> Completions:
        turns = self.tool_calling.run(episode, done.prompt_ids, done.completion_ids, done.logprobs,
                                      self.continuation(streams, model))
        done.completion_ids, done.logprobs, done.tool_mask = turns.completion_ids, turns.logprobs, turns.tool_mask
        done.completions = turns.completions
        metrics = self.context.metrics(self.mode)
        for name, value in tool_metrics(turns.calls, turns.failures, len(done.prompt_ids),
                                        self.context.data_parallel.sum).items():
            metrics.add_value(name, value)
        return done

    def _custom_rollout(self, rows: list[dict], prompts: list) -> Completions:
        """TRL's ``rollout_func`` contract: it gets the prompts (each num_generations times, chat messages left
        untemplated) and returns prompt_ids, completion_ids and logprobs (one entry per prompt), optionally
        ``env_mask`` (1 on the model's tokens, 0 on tokens an environment wrote) and other fields, which go to the
        reward functions with the rows."""
        output = self.rollout_func(copy.deepcopy(prompts))
        if not isinstance(output, dict):
            raise ValueError(f"rollout_func returned a {type(output).__name__}: it must return a dict with "
                             "'prompt_ids', 'completion_ids' and 'logprobs'")
        missing = sorted({"prompt_ids", "completion_ids", "logprobs"} - output.keys())
        if missing:
            raise ValueError(f"rollout_func must return keys {missing} in its output dict.")
        extra = {key: value for key, value in output.items() if key not in ("prompt_ids", "completion_ids", "logprobs")}
        tool_mask = extra.pop("env_mask", None)
        extra.pop("logprob_token_ids", None)  # the sampled tokens' own log-probs are the ones used
        prompt_ids, completion_ids = [list(ids) for ids in output["prompt_ids"]], [list(ids) for ids in output["completion_ids"]]
        logprobs = output["logprobs"]
        for name, values in (("prompt_ids", prompt_ids), ("completion_ids", completion_ids), ("logprobs", logprobs),
                             ("env_mask", tool_mask)):
            if values is not None and len(values) != len(prompts):
                raise ValueError(f"rollout_func returned {len(values)} {name} for {len(prompts)} prompts (each prompt "
                                 "comes num_generations times): return one entry per prompt")
        if logprobs is None:
            logprobs = [[0.0] * len(ids) for ids in completion_ids]
        logprobs = [[float("nan") if x is None else float(x[0] if isinstance(x, (list, tuple)) else x) for x in row]
                    for row in logprobs]
        for index, (ids, row) in enumerate(zip(completion_ids, logprobs)):
            mask = None if tool_mask is None else tool_mask[index]
            if len(row) != len(ids) or (mask is not None and len(mask) != len(ids)):
                raise ValueError(f"rollout_func's completion {index} has {len(ids)} tokens but {len(row)} logprobs"
                                 + ("" if mask is None else f" and {len(mask)} env_mask values") + ": give one per token")
        rows = [{**row, **{key: values[i] if isinstance(values, list) else values for key, values in extra.items()}}
                for i, row in enumerate(rows)]  # TRL hands the extra fields to the reward functions
        return Completions(rows, prompts, prompt_ids, completion_ids, logprobs, self.decode(prompts, completion_ids),
                           tool_mask=tool_mask)

    def record(self, done: Completions) -> None:
        """TRL's generation metrics: the tokens seen (prompt and model tokens, counted once by the context-parallel
        ranks of a batch; evaluation logs the training's count) and completions/* over every data-parallel rank's
        completions (with a tool mask, the lengths count the model's own tokens)."""
        state, mode = self.context.state, self.mode
        lengths_N, truncated_N = self.lengths(done.completion_ids, done.tool_mask)
        if mode == "train" and self.context.context_parallel.rank == 0:
            state.num_input_tokens_seen += int(sum(len(p) for p in done.prompt_ids) + lengths_N.sum())  # this rank's
        metrics = self.context.metrics(mode)
        metrics.set("num_tokens", torch.tensor(float(state.num_input_tokens_seen)))  # summed over the ranks
        all_N2 = self.context.data_parallel.gather_rows(torch.stack([lengths_N, truncated_N.double()], dim=1))
        for name, value in completion_length_metrics(all_N2[:, 0], all_N2[:, 1]).items():
            metrics.add_value(name, value)

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

    def lengths(self, completion_ids: list[list[int]], tool_mask=None) -> tuple[torch.Tensor, torch.Tensor]:
        """(lengths [N] float64, cut at the length limit [N] bool) of the completions; with a tool mask the lengths
        count the model's own tokens."""
        counted = completion_ids if tool_mask is None else [[1] * int(sum(mask)) for mask in tool_mask]
        return (torch.tensor([len(c) for c in counted], dtype=torch.float64),
                torch.tensor([self.is_truncated(c) for c in completion_ids], dtype=torch.bool))


__all__ = ["Completions", "Rollout"]
