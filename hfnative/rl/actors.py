"""The two Ray actors of asynchronous RL: a generator (a copy of the policy and a rollout engine on it)
and a reward scorer. Plain classes here; ``RolloutQueue`` makes them Ray actors, so importing this
module needs no Ray.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from typing import Any

import torch

from hfnative.generation import NativeRolloutEngine, RolloutEngine, SamplingParams

from .policy_copy import PolicyCopy, generator_device, load_policy_copy


def _use_assigned_threads() -> None:
    """One actor, its own cores: torch's intra-op threads follow OMP_NUM_THREADS (Ray sets it to the CPUs it
    assigned to the actor when the caller did not set it)."""
    threads = os.environ.get("OMP_NUM_THREADS")
    if threads and threads.isdigit() and int(threads) > 0:
        torch.set_num_threads(int(threads))


class RolloutGenerator:
    """Generates completions with its copy of the policy; ``version`` is the optimizer step its weights are from.

    policy: the policy as ``policy_copy.policy_copy`` describes it (its ModelArgs and safetensors bytes: nothing
    unpickled as a module), rebuilt as a plain Transformer on this actor's device;
    None when the engine starts from elsewhere (a vLLM engine loads its own model; the trainer then sends the
    weights before the first generation). engine_factory: model (or None) -> RolloutEngine, picklable, made
    by the trainer from its config (default: the native KV-cache engine). episodes: (engine, prompt_ids, sampling)
    -> dict, picklable, made by the trainer when a rollout is more than one generation (multi-turn tool calls run
    here, beside the engine, so their latency overlaps training); its dict holds at least completion_ids, logprobs
    and finish_reason. Tasks run in the order the trainer submitted them, so a ``load_weights`` lands
    between the generations before and after it.
    """

    def __init__(self, policy: PolicyCopy | None, version: int,
                 engine_factory: Callable[[Any], RolloutEngine] | None = None,
                 episodes: Callable[[RolloutEngine, list[list[int]], SamplingParams, Any], dict] | None = None):
        _use_assigned_threads()
        model = None
        if policy is not None:
            model = load_policy_copy(policy, generator_device())
        elif engine_factory is None:
            raise ValueError("RolloutGenerator: without a policy, an engine_factory must build the engine")
        self.model = model
        self.engine = (engine_factory or NativeRolloutEngine)(model)
        self.episodes = episodes
        self.version = version

    def generate(self, prompt_ids: list[list[int]], sampling: SamplingParams, payload: Any = None) -> dict:
        """Completions of ``prompt_ids``: completion_ids, logprobs (at generation time), finish_reason (and what
        ``episodes`` adds; it is given the work's ``payload`` too), the policy version that produced them and the
        seconds it took."""
        start = time.perf_counter()
        if self.episodes is not None:
            generated = dict(self.episodes(self.engine, prompt_ids, sampling, payload))
        else:
            rollouts = self.engine.generate(prompt_ids, sampling)
            generated = {"completion_ids": rollouts.completion_ids, "logprobs": rollouts.logprobs,
                         "finish_reason": rollouts.finish_reason}
        return {**generated, "version": self.version, "generation_s": time.perf_counter() - start}

    def load_weights(self, named_tensors: dict[str, torch.Tensor], version: int) -> int:
        """Copy the trainer's updated tensors in (under the names the engine takes: native for the native
        engine, Hub for vLLM) and take on their policy version."""
        self.engine.load_weights(named_tensors.items())
        self.version = version
        return version

    def ping(self) -> int:
        return self.version

    def node_id(self) -> str:
        """The Ray node this actor runs on."""
        import ray

        return ray.get_runtime_context().get_node_id()


class RewardScorer:
    """Scores generated completions with ``score_fn(generated, payload) -> dict`` (the trainer's rewards and
    advantages); ``payload``: what the trainer sent along with the prompts (e.g. the dataset rows)."""

    def __init__(self, score_fn: Callable[[dict, Any], dict]):
        _use_assigned_threads()
        self.score_fn = score_fn

    def score(self, generated: dict, payload: Any) -> dict:
        start = time.perf_counter()
        scored = self.score_fn(generated, payload)
        return {**generated, **scored, "scoring_s": time.perf_counter() - start}

    def ping(self) -> bool:
        return True
