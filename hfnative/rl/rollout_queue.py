"""The trainer's side of asynchronous RL: generation and reward scoring run as Ray actors, joined to the
trainer by a bounded first-in-first-out queue of rollouts, so generation for the next steps overlaps training.

Each unit of work is one micro-batch of prompts: the trainer's process submits it to a generator actor
(several take turns), whose result goes straight to the reward actor; the queue holds the scored result's
future. The trainer takes rollouts from the head of the queue, drops those older than ``max_staleness``
policy versions (their prompts are generated again with newer weights) and, every ``weight_sync_steps``
optimizer steps, sends the updated weights to the generators. A generator runs its tasks in order, so
every rollout carries the exact version of the weights that made it.

Work is submitted ahead only as far as it can still be trained on: a micro-batch submitted now is
consumed ``len(queue)`` micro-batches later, so its lag is known before it is generated, and none
is submitted that would arrive too stale (with ``max_staleness=0`` generation waits for each step's weights).

Failures stop the run instead of hanging it: an actor that raises or dies is reported with its error
(``RolloutActorError``), and a stage that produces nothing for ``heartbeat_stale_after_s`` seconds while
holding work is reported as hung (``RolloutStalledError``).
"""

from __future__ import annotations

import dataclasses
import os
import time
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch

from hfnative.generation import RolloutEngine, SamplingParams

from .actors import RewardScorer, RolloutGenerator
from .policy_copy import policy_copy, trainable_weights
from .staleness import StalenessFilter


class RolloutActorError(RuntimeError):
    """A generation or reward actor raised or died; the message names which and carries its error."""


class RolloutStalledError(TimeoutError):
    """A generation or reward actor held work without producing anything for heartbeat_stale_after_s."""


@dataclass
class _Task:
    prompt_ids: list[list[int]]
    payload: Any
    generated: Any  # ray.ObjectRef of RolloutGenerator.generate
    scored: Any  # ray.ObjectRef of RewardScorer.score


def _import_ray():
    try:
        import ray
    except ImportError as error:
        raise ImportError("asynchronous RL runs on Ray: pip install 'hfnative[rl]' (ray>=2.40)") from error
    return ray


class RolloutQueue:
    """Generator and reward actors feeding the trainer, with bounded staleness.

    model: the policy being trained (its current weights seed the generator). score_fn(generated, payload) ->
    dict: runs in the reward actor; ``generated`` holds completion_ids, logprobs, finish_reason, version.
    sampling: how the generator decodes (its seed, when set, is offset by each micro-batch's place in the run).
    micro_batches_per_step: micro-batches one optimizer step consumes (for the lag of work submitted ahead).
    max_inflight: micro-batches submitted and not yet consumed, at most. version: the optimizer steps the
    policy has taken (a resumed run starts at its checkpoint's step).
    ray_address: join this Ray cluster (None: the running Ray instance, else the cluster RAY_ADDRESS names, else a
    new local one).
    generator_options / scorer_options: Ray actor options (num_cpus, num_gpus, resources, ...).
    engine_factory: model -> RolloutEngine in the generator actor (default: the native engine; the model is None
    when ship_policy is False), picklable; the async GRPO trainer passes one that builds the engine its config
    selects.
    named_weights: model -> {name: tensor} sent at each weight sync, under the names the engine's
    ``load_weights`` takes (default: ``policy_copy.trainable_weights``: the trainable parameters by native name, each
    LoRA adapter folded into its base weight, on the CPU).
    num_generators: generator actors (each its own copy of the policy), given micro-batches in turn; every
    weight sync goes to all of them, after the work already submitted to each.
    ship_policy: send the policy to the generators as a ``PolicyCopy`` (ModelArgs + safetensors bytes; the native
    engine runs on the plain model rebuilt from it). False when the
    engine loads its own copy (vLLM from a Hub folder, or a vLLM server): the generators then get the policy's
    current weights through ``named_weights`` at start, before any generation.
    episodes: (engine, prompt_ids, sampling, payload) -> dict run by each generator in place of one generation (see
    ``RolloutGenerator``), picklable; the dict may carry the prompt_ids it generated from.
    """

    @property
    def generator(self):
        """The first generator actor."""
        return self.generators[0] if self.generators else None

    def __init__(
        self,
        model: torch.nn.Module,
        score_fn: Callable[[dict, Any], dict],
        sampling: SamplingParams,
        *,
        micro_batches_per_step: int,
        max_staleness: int,
        max_inflight: int,
        weight_sync_steps: int = 1,
        heartbeat_stale_after_s: float = 300.0,
        version: int = 0,
        ray_address: str | None = None,
        generator_options: dict | None = None,
        scorer_options: dict | None = None,
        engine_factory: Callable[[Any], RolloutEngine] | None = None,
        named_weights: Callable[[torch.nn.Module], dict[str, torch.Tensor]] | None = None,
        num_generators: int = 1,
        ship_policy: bool = True,
        episodes: Callable | None = None,
    ):
        if weight_sync_steps < 1:
            raise ValueError(f"weight_sync_steps={weight_sync_steps}: expected an int >= 1")
        if weight_sync_steps > max_staleness + 1:
            raise ValueError(
                f"weight_sync_steps={weight_sync_steps} with max_staleness={max_staleness}: between two weight syncs "
                "every rollout would be too stale to train on; set weight_sync_steps <= max_staleness + 1"
            )
        if num_generators < 1:
            raise ValueError(f"num_generators={num_generators}: expected an int >= 1")
        if max_inflight < 1 or micro_batches_per_step < 1:
            raise ValueError(f"max_inflight={max_inflight}, micro_batches_per_step={micro_batches_per_step}: expected >= 1")
        self.model, self.score_fn, self.sampling = model, score_fn, sampling
        self.micro_batches_per_step, self.max_inflight = micro_batches_per_step, max_inflight
        self.weight_sync_steps, self.heartbeat_stale_after_s = weight_sync_steps, heartbeat_stale_after_s
        self.staleness = StalenessFilter(max_staleness)
        self.version = self.synced_version = version
        self.ray_address, self.engine_factory = ray_address, engine_factory
        self.named_weights = named_weights or trainable_weights
        self.generator_options = {"num_cpus": 1, **(generator_options or {})}
        self.scorer_options = {"num_cpus": 0, **(scorer_options or {})}
        self.num_generators, self.ship_policy = num_generators, ship_policy
        self.episodes = episodes  # RolloutGenerator's: multi-turn rollouts run in the generator actors
        self.generators: list = []
        self.scorer = None
        self._ray = None
        self._owns_ray = False
        self._source: Iterator | None = None
        self._queue: deque[_Task] = deque()
        self._retry: deque[tuple[list[list[int]], Any]] = deque()
        self._pending_syncs: list = []
        self._consumed_in_step = 0
        self._wait_s = 0.0
        self._sync_s: list[float] = []
        self._generation_s: list[float] = []

    # --- lifecycle --------------------------------------------------------------------------------------

    def start(self, policy=None, weights: dict[str, torch.Tensor] | None = None) -> None:
        """Start the actors. ``policy`` (a ``PolicyCopy``, when ship_policy) and ``weights`` (``named_weights``'
        result, when not): the policy as made by the caller, e.g. gathered from a parallelized model by every rank;
        default: made here from ``model``."""
        ray = self._ray = _import_ray()
        if not ray.is_initialized():
            # "local": a new instance, not a cluster some other process left registered on this machine
            address = self.ray_address or os.environ.get("RAY_ADDRESS") or "local"
            ray.init(address=address, include_dashboard=False)
            self._owns_ray = True
        generator = ray.remote(RolloutGenerator).options(max_restarts=0, **self.generator_options)
        scorer = ray.remote(RewardScorer).options(max_restarts=0, **self.scorer_options)
        policy = ray.put(policy if policy is not None else policy_copy(self.model)) if self.ship_policy else None
        self.generators = [generator.remote(policy, self.version, self.engine_factory, self.episodes)
                           for _ in range(self.num_generators)]
        self.scorer = scorer.remote(self.score_fn)
        startup_s = max(self.heartbeat_stale_after_s, 300.0)
        pings = [actor.ping.remote() for actor in (*self.generators, self.scorer)]
        ready, _ = ray.wait(pings, num_returns=len(pings), timeout=startup_s)
        if len(ready) < len(pings):
            self.close()
            raise RolloutStalledError(
                f"the rollout actors did not start within {startup_s:.0f} s: does a Ray node have the resources "
                f"asked for (generator {self.generator_options}, reward scorer {self.scorer_options})?"
            )
        try:
            ray.get(ready)
        except ray.exceptions.RayError as error:
            self.close()
            raise RolloutActorError(f"a rollout actor failed to start: {_describe(error)}") from error
        if not self.ship_policy:  # the engines started from their own weights: the policy's go in first
            self._pending_syncs += self._send_weights(self.version, weights)

    def _send_weights(self, version: int, weights: dict[str, torch.Tensor] | None = None) -> list:
        ref = self._ray.put(weights if weights is not None else self.named_weights(self.model))
        return [generator.load_weights.remote(ref, version) for generator in self.generators]

    def close(self) -> None:
        """Stop the actors (and Ray, when this queue started it)."""
        ray = self._ray
        if ray is None:
            return
        for actor in (*self.generators, self.scorer):
            if actor is not None:
                ray.kill(actor, no_restart=True)
        self.generators, self.scorer = [], None
        self._queue.clear()
        if self._owns_ray:
            ray.shutdown()
        self._ray = None

    # --- the queue ----------------------------------------------------------------------------------------

    def set_source(self, source: Iterator[tuple[list[list[int]], Any]]) -> None:
        """Where new work comes from: (prompt_ids, payload) per micro-batch, e.g. the epoch's prompt batches."""
        self._source = source

    def next_batch(self) -> dict | None:
        """The next scored micro-batch fresh enough to train on at the current version; None when the source
        is exhausted and nothing is queued. Raises RolloutActorError / RolloutStalledError."""
        while True:
            self._check_syncs()
            self._fill()
            if not self._queue:
                return None
            task = self._queue[0]
            scored = self._wait(task)
            self._queue.popleft()
            scored.setdefault("prompt_ids", task.prompt_ids)  # an episode that re-tokenized its prompts sent its own
            self._generation_s.append(scored.get("generation_s", 0.0))
            if self.staleness.keep(self.version, scored["version"], len(task.prompt_ids)):
                self._consumed_in_step += 1
                return scored
            self._retry.append((task.prompt_ids, task.payload))  # generated again, with newer weights

    def syncs_at(self, version: int) -> bool:
        """Whether the generators get the policy's weights when it reaches ``version`` (every weight_sync_steps)."""
        return version % self.weight_sync_steps == 0

    def policy_updated(self, version: int, weights: dict[str, torch.Tensor] | None = None) -> None:
        """The optimizer stepped: the policy is now ``version``; every ``weight_sync_steps`` the generator gets it
        (``weights``: ``named_weights``' result made by the caller; default: made here)."""
        self.version = version
        self._consumed_in_step = 0
        if self.syncs_at(version):
            start = time.perf_counter()
            self._pending_syncs += self._send_weights(version, weights)
            self.synced_version = version
            self._sync_s.append(time.perf_counter() - start)
        self._fill()

    def pop_metrics(self) -> dict[str, float]:
        """The logging window's numbers (TRL's keys): staleness, dropped samples, time waited for rollouts."""
        metrics = self.staleness.pop_metrics()
        metrics["perf/rollout_wait_s"] = self._wait_s
        if self._sync_s:
            metrics["perf/weight_sync_s"] = sum(self._sync_s) / len(self._sync_s)
        if self._generation_s:
            metrics["perf/generation_s"] = sum(self._generation_s) / len(self._generation_s)
        self._wait_s, self._sync_s, self._generation_s = 0.0, [], []
        return metrics

    # --- internals ------------------------------------------------------------------------------------------

    def _lag_if_submitted_now(self) -> int:
        ahead = self._consumed_in_step + len(self._queue)
        return self.version + ahead // self.micro_batches_per_step - self.synced_version

    def _fill(self) -> None:
        # ahead only while the work can still be trained on; an empty queue always takes work (progress)
        while not self._queue or (
            len(self._queue) < self.max_inflight and self._lag_if_submitted_now() <= self.staleness.max_staleness
        ):
            if self._retry:
                prompt_ids, payload = self._retry.popleft()
            else:
                work = next(self._source, None) if self._source is not None else None
                if work is None:
                    return
                prompt_ids, payload = work
            place = self.version * self.micro_batches_per_step + self._consumed_in_step + len(self._queue)
            sampling = self.sampling
            if sampling.seed is not None:  # seeded by the micro-batch's place in the run, so a resumed run draws alike
                sampling = dataclasses.replace(sampling, seed=sampling.seed + place)
            generator = self.generators[place % len(self.generators)]
            if self.episodes is not None:  # an episode may need the work's payload (an environment's reset)
                generated = generator.generate.remote(prompt_ids, sampling, payload)
            else:
                generated = generator.generate.remote(prompt_ids, sampling)
            scored = self.scorer.score.remote(generated, payload)
            self._queue.append(_Task(prompt_ids, payload, generated, scored))

    def _wait(self, task: _Task) -> dict:
        ray = self._ray
        start = time.monotonic()
        deadline = start + self.heartbeat_stale_after_s
        generated = False
        while True:
            now = time.monotonic()
            ready, _ = ray.wait([task.scored], timeout=max(0.0, min(1.0, deadline - now)))
            if ready:
                break
            if not generated and ray.wait([task.generated], timeout=0)[0]:
                generated, deadline = True, time.monotonic() + self.heartbeat_stale_after_s  # the generator's heartbeat
            if time.monotonic() >= deadline:
                stage = "reward actor (scoring)" if generated else "generation actor"
                raise RolloutStalledError(
                    f"the {stage} produced nothing for {self.heartbeat_stale_after_s:.0f} s "
                    "(heartbeat_stale_after_s): it is hung or far too slow; the run stops"
                )
        self._wait_s += time.monotonic() - start
        try:
            return ray.get(task.scored)
        except ray.exceptions.RayError as error:
            raise RolloutActorError(f"the {self._failed_stage(task)} failed: {_describe(error)}") from error

    def _failed_stage(self, task: _Task) -> str:
        try:
            self._ray.get(task.generated, timeout=0)
        except Exception:  # noqa: BLE001 - any failure there means generation failed
            return "generation actor"
        return "reward actor"

    def _check_syncs(self) -> None:
        ray = self._ray
        if not self._pending_syncs:
            return
        done, self._pending_syncs = ray.wait(self._pending_syncs, num_returns=len(self._pending_syncs), timeout=0)
        try:
            ray.get(done)
        except ray.exceptions.RayError as error:
            raise RolloutActorError(f"the generation actor failed to load new weights: {_describe(error)}") from error


def _describe(error: Exception) -> str:
    """The original error of a Ray task (type and message), or Ray's account of a dead actor."""
    cause = getattr(error, "cause", None)
    while isinstance(getattr(cause, "cause", None), BaseException):  # a task that failed on a failed input
        cause = cause.cause
    if isinstance(cause, BaseException):
        return f"{type(cause).__name__}: {cause}"
    lines = [line.strip() for line in str(error).strip().splitlines() if line.strip()]
    if not lines:
        return type(error).__name__
    return lines[0] if len(lines) == 1 else f"{lines[0]} ... {lines[-1]}"  # Ray's account, and the error it ends with
