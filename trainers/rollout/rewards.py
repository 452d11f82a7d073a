"""Reward functions for GRPO and RLOO: resolving them (callables, reward models, dotted import paths,
built-ins) and scoring a batch of completions with TRL's calling convention.

A reward function is called as ``f(prompts=..., completions=..., completion_ids=..., trainer_state=...,
log_extra=..., log_metric=..., **other_dataset_columns)``, one value per completion, and may be async
(several async functions run concurrently). ``None`` means "no opinion": it is left out of that
function's statistics, and a completion no function scored gets advantage 0. A reward model (a path, or a
transformers sequence-classification model) scores ``prompt + completion`` (chat-templated for
conversations) by its first logit.

Built-ins (by name, e.g. ``--reward_funcs exact_match``):
  exact_match                  1.0 when the completion's text, stripped, equals the row's ``solution``
                               (or ``answer``) column, else 0.0; None for a row without one
  think_format_reward          1.0 when the completion is ``<think>...</think>`` (one think block, at the
                               start) followed by an answer, else 0.0 (TRL's think_format_reward)
  get_soft_overlong_punishment DAPO's length penalty with TRL's CLI values (max 1280 tokens, a 256-token
                               soft zone): 0 up to 1024 tokens, falling linearly to -1 at 1280, -1 beyond
  completion_length            the completion's length in tokens divided by 100 (a toy task's signal)
"""

from __future__ import annotations

import asyncio
import importlib
import inspect
import logging
import os
import re
import sys
import threading
from collections.abc import Callable

import torch

from hfnative.losses.policy import nanstd, weighted_rewards

logger = logging.getLogger(__name__)


# --- built-ins ---------------------------------------------------------------------------------------------


def completion_text(completion) -> str:
    """The text of a completion: a string as is, a conversation's last message content."""
    if isinstance(completion, str):
        return completion
    return completion[-1]["content"] if completion else ""


def exact_match(completions, solution=None, answer=None, **kwargs) -> list[float | None]:
    references = solution if solution is not None else answer
    if references is None:
        return [None] * len(completions)
    return [
        None if reference is None else float(completion_text(c).strip() == str(reference).strip())
        for c, reference in zip(completions, references)
    ]


_THINK_THEN_ANSWER = re.compile(r"^<think>(?!.*<think>)(.*?)</think>.*$", re.DOTALL)


def think_format_reward(completions, **kwargs) -> list[float]:
    return [1.0 if _THINK_THEN_ANSWER.match(completion_text(c)) else 0.0 for c in completions]


def get_soft_overlong_punishment(max_completion_len: int, soft_punish_cache: int) -> Callable:
    """DAPO's overlong penalty on the completion's token count L: 0 for L <= max - cache, then
    (max - cache - L) / cache down to -1 at L = max, and -1 past it."""
    if not 0 <= soft_punish_cache <= max_completion_len:
        raise ValueError(f"soft_punish_cache={soft_punish_cache}: expected 0 <= it <= max_completion_len={max_completion_len}")

    def soft_overlong_punishment_reward(completion_ids, **kwargs) -> list[float]:
        rewards = []
        for ids in completion_ids:
            length = len(ids)
            if length <= max_completion_len - soft_punish_cache:
                rewards.append(0.0)
            elif length <= max_completion_len:
                rewards.append((max_completion_len - soft_punish_cache - length) / soft_punish_cache)
            else:
                rewards.append(-1.0)
        return rewards

    return soft_overlong_punishment_reward


def completion_length(completion_ids, **kwargs) -> list[float]:
    return [len(ids) / 100 for ids in completion_ids]


BUILTIN_REWARDS: dict[str, Callable] = {
    "exact_match": exact_match,
    "think_format_reward": think_format_reward,
    "get_soft_overlong_punishment": get_soft_overlong_punishment(max_completion_len=1280, soft_punish_cache=256),
    "completion_length": completion_length,
}


# --- resolving ------------------------------------------------------------------------------------------------


def import_reward_function(path: str) -> Callable:
    """``package.module.function`` (or ``package.module:function``), importable from the working directory."""
    module_name, _, attribute = path.replace(":", ".").rpartition(".")
    if not module_name:
        raise ValueError(f"reward function {path!r}: expected a built-in ({sorted(BUILTIN_REWARDS)}) or a dotted import path")
    if os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())
    try:
        function = getattr(importlib.import_module(module_name), attribute)
    except (ImportError, AttributeError) as error:
        raise ValueError(
            f"Could not load reward function {path!r} ({error}). Expected one of {sorted(BUILTIN_REWARDS)} or a valid "
            "import path such as my_package.rewards.my_reward"
        ) from error
    if not callable(function):
        raise ValueError(f"reward function {path!r} is a {type(function).__name__}, not a callable")
    return function


def _looks_like_model(spec: str) -> bool:
    """A folder or a Hub id (``org/name``); a dotted import path holds no slash."""
    return os.path.isdir(spec) or "/" in spec


def resolve_reward_function(spec, model_init_kwargs: dict | None = None,
                            device: torch.device | None = None) -> Callable | torch.nn.Module:
    """A callable, a built-in name, a dotted import path, or a reward model (a folder, a Hub id or a
    transformers model) -> the callable or the sequence-classification model (a folder or Hub id loaded with
    ``model_init_kwargs``, the policy's, as TRL loads it; a quantized base's weights quantized on ``device``)."""
    if isinstance(spec, torch.nn.Module) or (callable(spec) and not isinstance(spec, str)):
        return spec
    if not isinstance(spec, str):
        raise ValueError(f"reward_funcs: {spec!r} is neither a callable, a reward model nor a name/path string")
    if spec in BUILTIN_REWARDS:
        return BUILTIN_REWARDS[spec]
    if _looks_like_model(spec):
        return load_reward_model(spec, model_init_kwargs, device)
    return import_reward_function(spec)


def load_reward_model(name_or_path: str, model_init_kwargs: dict | None = None,
                      device: torch.device | None = None) -> torch.nn.Module:
    """A reward model folder or Hub id with one score: hfnative's native sequence classifier where the architecture
    has one (a causal LM gets a new score head, as AutoModelForSequenceClassification gives it), else transformers'
    ``AutoModelForSequenceClassification``; ``model_init_kwargs`` (the policy's, which TRL loads reward models with):
    its dtype ("auto" or none: the checkpoint's), revision, cache_dir and token, and a quantized base's request
    (``load_in_4bit`` / ``load_in_8bit`` / ``quantization_config``: the native model's linears stored in 4 or 8 bits);
    all of it on the fallback. ``device``: where a quantized base's weights are quantized, each moved there first (the
    model loads on the host; None: there)."""
    from hfnative.converters.hub_model import attach_hub_surface
    from hfnative.converters.loading import UnsupportedModelError, load_pretrained

    from ..running.model_loading import config_overrides, quantize_frozen_model

    kwargs = dict(model_init_kwargs or {})
    dtype = kwargs.get("dtype", kwargs.get("torch_dtype"))
    hub = {name: kwargs[name] for name in ("revision", "cache_dir", "token") if kwargs.get(name) is not None}
    try:
        converted = load_pretrained(name_or_path, num_labels=1, dtype=None if dtype in (None, "auto") else dtype,
                                    config_overrides=config_overrides(kwargs), **hub)
    except UnsupportedModelError:
        from transformers import AutoModelForSequenceClassification, BitsAndBytesConfig

        kwargs["trust_remote_code"] = False  # hfnative runs no code a checkpoint brings
        bits = {name: kwargs.pop(name) for name in ("load_in_4bit", "load_in_8bit") if kwargs.get(name)}
        if bits and kwargs.get("quantization_config") is None:  # transformers 5 takes them as a BitsAndBytesConfig
            kwargs["quantization_config"] = BitsAndBytesConfig(**bits)
        return AutoModelForSequenceClassification.from_pretrained(name_or_path, num_labels=1, **kwargs)
    quantize_frozen_model(converted, kwargs, "reward model", device)  # the policy's load_in_Nbit, as TRL's
    return attach_hub_surface(converted.model, converted, base_model_name_or_path=str(name_or_path))


def reward_function_name(function) -> str:
    if isinstance(function, torch.nn.Module):
        return str(function.config._name_or_path).rstrip("/").split("/")[-1]
    return getattr(function, "__name__", type(function).__name__)


# --- scoring ---------------------------------------------------------------------------------------------------


class BackgroundLoop:
    """One event loop in a daemon thread, so async reward functions (and async tools) run concurrently even when
    the caller is itself inside a running loop (a notebook)."""

    def __init__(self):
        self.loop = asyncio.new_event_loop()
        threading.Thread(target=self.loop.run_forever, daemon=True).start()

    def run(self, coroutine):
        return asyncio.run_coroutine_threadsafe(coroutine, self.loop).result()


class RewardFunctions:
    """The run's reward functions, their names and weights, scoring batches of completions.

    reward_funcs: one item or a list (callables, names, paths, models). reward_weights: one per function
    (default all 1.0). reward_processing_classes: tokenizers of the reward models, in the same order (None:
    loaded from each model's folder).
    """

    def __init__(self, reward_funcs, reward_weights=None, reward_processing_classes=None, device="cpu",
                 chat_template_kwargs: dict | None = None, episode_rewards: list | None = None,
                 model_init_kwargs: dict | None = None):
        """``episode_rewards``: functions added after the user's, weight 1 each (an environment's get_reward);
        ``model_init_kwargs``: how reward models named by folder or Hub id load (the config's, as TRL's)."""
        specs = [] if reward_funcs is None else reward_funcs if isinstance(reward_funcs, (list, tuple)) else [reward_funcs]
        if not specs and not episode_rewards:
            raise ValueError("No reward source provided. Pass `reward_funcs`, or an `environment_factory` whose "
                             "environment defines a `get_reward` method.")
        self.device = torch.device(device)
        self.functions = [resolve_reward_function(spec, model_init_kwargs, self.device) for spec in specs]
        self.names = [reward_function_name(f) for f in self.functions]
        if reward_weights is None:
            reward_weights = [1.0] * len(self.functions)
        if len(reward_weights) != len(self.functions):
            raise ValueError(
                f"Number of reward weights ({len(reward_weights)}) must match number of reward functions "
                f"({len(self.functions)})"
            )
        self.weights_F = torch.tensor(reward_weights, dtype=torch.float32)
        self.chat_template_kwargs = chat_template_kwargs or {}
        # TRL's rules: None for every function, one tokenizer for a single function, else one entry per function
        processing = reward_processing_classes
        if processing is None:
            processing = [None] * len(self.functions)
        elif not isinstance(processing, (list, tuple)):
            processing = [processing]
        if len(processing) != len(self.functions):
            raise ValueError(
                f"The number of reward processing classes ({len(processing)}) must match the number of reward "
                f"functions ({len(self.functions)})."
            )
        self.tokenizers = []
        for function, tokenizer in zip(self.functions, processing):
            if isinstance(function, torch.nn.Module):
                function.to(self.device).eval().requires_grad_(False)
                tokenizer = tokenizer if tokenizer is not None else _reward_tokenizer(function)
                _pad_like_trl(function, tokenizer)
            self.tokenizers.append(tokenizer)
        for function in episode_rewards or []:
            self.functions.append(function)
            self.names.append(reward_function_name(function))
            self.tokenizers.append(None)
        self.weights_F = torch.cat([self.weights_F, torch.ones(len(episode_rewards or []))])
        self._loop = None

    def __len__(self) -> int:
        return len(self.functions)

    def metrics(self, rewards_NF: torch.Tensor) -> dict[str, torch.Tensor]:
        """TRL's reward metrics of a batch's rewards [N, F] (NaN where a function scored nothing, left out): each
        function's rewards/<name>/mean and /std, and the weighted sum's reward and reward_std."""
        metrics = {}
        for index, name in enumerate(self.names):
            metrics[f"rewards/{name}/mean"] = torch.nanmean(rewards_NF[:, index])
            metrics[f"rewards/{name}/std"] = nanstd(rewards_NF[:, index])
        rewards_N = weighted_rewards(rewards_NF, self.weights_F)
        return {**metrics, "reward": torch.nanmean(rewards_N), "reward_std": nanstd(rewards_N)}

    def score(self, prompts: list, completions: list, completion_ids: list[list[int]], rows: list[dict],
              trainer_state=None, log_extra=None, log_metric=None, extra: dict | None = None) -> torch.Tensor:
        """Rewards [N, F] (float32, NaN where a function returned None). rows: the dataset rows, one per
        completion; their columns other than prompt/completion/completion_ids are passed by name, and so is
        ``extra`` (TRL's ``environments``, one per completion)."""
        columns = [key for key in rows[0] if key not in ("prompt", "completion", "completion_ids")]
        kwargs = {key: [row.get(key) for row in rows] for key in columns}
        kwargs.update(trainer_state=trainer_state, log_extra=log_extra, log_metric=log_metric, **(extra or {}))
        call = dict(prompts=prompts, completions=completions, completion_ids=completion_ids, **kwargs)
        rewards_NF = torch.full((len(prompts), len(self.functions)), torch.nan, dtype=torch.float32)
        pending = []
        for index, (function, tokenizer) in enumerate(zip(self.functions, self.tokenizers)):
            if isinstance(function, torch.nn.Module):
                rewards_NF[:, index] = self._score_with_model(function, tokenizer, prompts, completions)
            elif inspect.iscoroutinefunction(function) or inspect.iscoroutinefunction(getattr(function, "__call__", None)):
                pending.append((index, function))
            else:
                rewards_NF[:, index] = self._as_rewards(function(**call), index, len(prompts))
        if pending:
            self._loop = self._loop or BackgroundLoop()

            async def gather():
                return await asyncio.gather(*(function(**call) for _, function in pending))

            for (index, _), values in zip(pending, self._loop.run(gather())):
                rewards_NF[:, index] = self._as_rewards(values, index, len(prompts))
        unscored_N = torch.isnan(rewards_NF).all(dim=1)
        if unscored_N.any():  # TRL's warning, with the first such row's arguments
            row = int(unscored_N.nonzero()[0, 0])
            arguments = {key: values[row] for key, values in kwargs.items()
                         if key not in ("trainer_state", "log_extra", "log_metric")}
            arguments.update(prompt=prompts[row], completion=completions[row])
            logger.warning(f"All reward functions returned None for the following kwargs:\n{arguments}\n"
                           "Please ensure that at least one reward function returns a valid reward.")
        return rewards_NF

    def _as_rewards(self, values, index: int, expected: int) -> torch.Tensor:
        values = list(values)
        if len(values) != expected:
            raise ValueError(
                f"The reward function '{self.names[index]}' returned {len(values)} rewards, but {expected} were "
                "expected (one per prompt-completion pair). Make sure the reward function returns exactly one reward "
                "per completion."
            )
        return torch.tensor([torch.nan if v is None else float(v) for v in values], dtype=torch.float32)

    @torch.no_grad()
    def _score_with_model(self, model, tokenizer, prompts, completions) -> torch.Tensor:
        if isinstance(prompts[0], list):  # conversational
            texts = [tokenizer.apply_chat_template(p + c, tokenize=False, **self.chat_template_kwargs)
                     for p, c in zip(prompts, completions)]
        else:
            texts = [p + c for p, c in zip(prompts, completions)]
        inputs = tokenizer(text=texts, return_tensors="pt", padding=True, padding_side="right", add_special_tokens=False)
        inputs = {k: v.to(self.device) for k, v in inputs.items()}
        return model(**inputs).logits[:, 0].float().cpu()


def _reward_tokenizer(model):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model.config._name_or_path)


def _pad_like_trl(model, tokenizer) -> None:
    """TRL's padding rule for a reward model: a tokenizer without a pad token pads with its EOS, and the model scores
    each row at its last token that is not the tokenizer's pad token."""
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    config = getattr(model, "config", None)
    if config is not None:
        (config.get_text_config() if hasattr(config, "get_text_config") else config).pad_token_id = tokenizer.pad_token_id


class RewardAttributes:
    """The reward attributes TRL's GRPO, RLOO and online DPO trainers have, over the objective's ``rewards``
    (a RewardFunctions): what callbacks and user code read."""

    @property
    def reward_funcs(self) -> list:
        """TRL's: the reward functions and models, resolved (a name or path is the loaded model)."""
        return self.objective.rewards.functions

    @property
    def reward_func_names(self) -> list[str]:
        return self.objective.rewards.names

    @property
    def reward_weights(self) -> torch.Tensor:
        """TRL's: the functions' weights [F] (float32, all 1.0 unless ``reward_weights`` is set); assignable, as
        TRL's attribute is (the next scoring uses it)."""
        return self.objective.rewards.weights_F

    @reward_weights.setter
    def reward_weights(self, weights) -> None:
        weights = torch.as_tensor(weights, dtype=torch.float32)
        if weights.shape != self.objective.rewards.weights_F.shape:
            raise ValueError(f"reward_weights: {list(weights.shape)} weights for "
                             f"{self.objective.rewards.weights_F.numel()} reward functions")
        self.objective.rewards.weights_F = weights

    @property
    def reward_processing_classes(self) -> list:
        """TRL's: each reward model's tokenizer (None for a callable)."""
        return self.objective.rewards.tokenizers
