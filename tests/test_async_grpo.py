"""Asynchronous GRPO on Ray: a tiny random model learns a verifiable toy task from the reward alone, every
trained sample's policy lag stays within max_staleness (read from the logged versions), max_staleness=0 is
on-policy (the trainer's log-probs equal the generator's), a failing or hung reward actor stops the run with
its error, a checkpoint resumes exactly, and generator actors run on every node of a Ray cluster."""

from __future__ import annotations

import dataclasses
import gc
import json
import math
import os
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch

ray = pytest.importorskip("ray")

from datasets import Dataset  # noqa: E402
from transformers import Qwen3Config, Qwen3ForCausalLM, TrainerCallback  # noqa: E402

from _tiny_tokenizer import build_tiny_tokenizer  # noqa: E402
from hfnative import AsyncGRPOConfig, AsyncGRPOTrainer  # noqa: E402
from hfnative.rl import RolloutActorError, RolloutStalledError, StalenessFilter  # noqa: E402
from hfnative.trainers.algorithms.async_grpo import async_group_advantages  # noqa: E402

os.environ.setdefault("OMP_NUM_THREADS", "1")  # inherited by every actor
ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])  # the actors cannot import this test module

# the toy task: the fraction of the completion's tokens in a set of 32 of the 320 ids (about 0.1 at random)
TARGET_IDS = frozenset(range(100, 132))
PROMPTS = ["Count: one two", "The sky is", "def add(a, b):", "Once upon a time"]


def target_fraction(completion_ids, **kwargs):
    return [sum(t in TARGET_IDS for t in ids) / max(len(ids), 1) for ids in completion_ids]


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    """A random 2-layer Qwen3 (hidden 32) with the 320-token test tokenizer, saved to a folder."""
    folder = tmp_path_factory.mktemp("async-grpo") / "model"
    tokenizer = build_tiny_tokenizer()
    torch.manual_seed(0)
    config = Qwen3Config(
        vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=8, max_position_embeddings=128, tie_word_embeddings=True,
        eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
    )
    Qwen3ForCausalLM(config).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return str(folder)


@pytest.fixture(scope="module")
def local_ray():
    if ray.is_initialized():
        ray.shutdown()
    ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False)
    yield
    ray.shutdown()


def _config(output_dir, **overrides) -> AsyncGRPOConfig:
    settings = dict(
        output_dir=str(output_dir), per_device_train_batch_size=16, num_generations=8, max_completion_length=8,
        learning_rate=2e-2, max_steps=4, bf16=False, gradient_checkpointing=False, report_to=[], save_strategy="no",
        disable_tqdm=True, seed=0,
    )
    settings.update(overrides)
    return AsyncGRPOConfig(**settings)


_SHARED_SETTINGS = ("output_dir", "per_device_train_batch_size", "num_generations", "max_completion_length",
                    "learning_rate", "max_steps", "bf16", "gradient_checkpointing", "report_to", "save_strategy",
                    "disable_tqdm", "seed", "logging_steps", "lr_scheduler_type", "epsilon")


def _dataset(copies: int = 16) -> Dataset:
    return Dataset.from_dict({"prompt": PROMPTS * copies})


def _train_logs(trainer) -> list[dict]:
    return [entry for entry in trainer.state.log_history if "loss" in entry]


# --- pure pieces -----------------------------------------------------------------------------------------------


def test_config_has_trl_async_names_and_defaults():
    from trl.experimental.async_grpo import AsyncGRPOConfig as TRLAsyncGRPOConfig

    theirs = TRLAsyncGRPOConfig("out", use_cpu=True)
    ours = AsyncGRPOConfig("out", use_cpu=True)
    names = [f.name for f in dataclasses.fields(theirs) if f.init]
    missing = [name for name in names if not hasattr(ours, name)]
    assert missing == []
    different = {n: (getattr(ours, n), getattr(theirs, n)) for n in names
                 if n not in ("accelerator_config", "logging_dir") and getattr(ours, n) != getattr(theirs, n)}
    assert different == {}
    assert (ours.max_completion_length, ours.lr_scheduler_type, ours.logging_steps, ours.max_staleness) == (2048, "constant", 1, 4)
    for removed in ("beta", "loss_type", "scale_rewards"):
        assert not hasattr(ours, removed)
    with pytest.raises(ValueError, match="weight_sync_steps"):
        AsyncGRPOConfig("out", use_cpu=True, max_staleness=0, weight_sync_steps=2)
    with pytest.raises(ValueError, match="multiple of num_generations"):
        AsyncGRPOConfig("out", use_cpu=True, per_device_train_batch_size=12, num_generations=8)
    # vLLM only when asked (GRPOConfig's names); one generator per vLLM server
    assert (ours.use_vllm, ours.vllm_mode) == (False, "colocate")
    with pytest.raises(ValueError, match="vllm_mode"):
        AsyncGRPOConfig("out", use_cpu=True, vllm_mode="remote")
    with pytest.raises(ValueError, match="num_rollout_actors=2 with vllm_mode='server'"):
        AsyncGRPOConfig("out", use_cpu=True, use_vllm=True, vllm_mode="server", num_rollout_actors=2)


def test_advantages_are_trl_async_formula():
    rewards = np.array([1.0, 0.0, 0.5, np.nan, 2.0, 2.0, 2.0, 2.0])
    advantages, std = async_group_advantages(torch.tensor(rewards, dtype=torch.float64), 4)
    for group in range(2):
        r = rewards[4 * group : 4 * group + 4]
        scored = r[~np.isnan(r)]
        expected = np.where(np.isnan(r), 0.0, (r - scored.mean()) / (scored.std() + 1e-8))  # TRL's _score_group
        np.testing.assert_allclose(advantages[4 * group : 4 * group + 4].numpy(), expected, atol=1e-12)
        np.testing.assert_allclose(std[4 * group].item(), scored.std(), atol=1e-12)


def test_staleness_filter_drops_and_counts():
    rule = StalenessFilter(max_staleness=2)
    kept = [rule.keep(step, version, 8) for step, version in [(0, 0), (3, 1), (3, 0), (5, 3), (6, 3)]]
    assert kept == [True, True, False, True, False]  # kept iff step - version <= 2
    metrics = rule.pop_metrics()
    assert metrics["sample/dropped_stale_total"] == 16 and rule.dropped_total == 16
    assert metrics["sample/staleness_max"] == 2 and metrics["sample/staleness_mean"] == pytest.approx(4 / 3)
    assert rule.pop_metrics() == {"sample/dropped_stale_total": 0.0}


def test_policy_copy_for_the_generator_of_a_compiled_model():
    """The generator's copy of a torch.compile'd policy (ModelArgs + safetensors bytes, rebuilt as a plain model)
    decodes greedily exactly as the uncompiled model does; the policy itself keeps its compiled forwards."""
    from hf_configs import make_hf_model

    from hfnative.converters.loading import load_pretrained
    from hfnative.generation import NativeRolloutEngine, SamplingParams
    from hfnative.parallel import apply_compile
    from hfnative.rl import load_policy_copy, policy_copy

    reference = load_pretrained(make_hf_model("qwen3-gqa")).model
    compiled = apply_compile(load_pretrained(make_hf_model("qwen3-gqa")).model)
    shipped = policy_copy(compiled)
    assert isinstance(shipped.weights, bytes) and shipped.weights[8:9] == b"{"  # a safetensors header, no pickle
    copy = load_policy_copy(shipped)
    assert all("_compiled_forward" in vars(block) for block in compiled.layers)
    greedy = SamplingParams(max_new_tokens=6, do_sample=False)
    prompts = [[1, 2, 3], [7, 8]]
    ours, theirs = NativeRolloutEngine(copy).generate(prompts, greedy), NativeRolloutEngine(reference).generate(prompts, greedy)
    assert ours.completion_ids == theirs.completion_ids


def test_policy_copy_of_a_lora_policy_folds_the_adapters_and_syncs_them():
    """A LoRA policy's copy is a plain model with each adapter folded into its base weight: its logits equal the
    adapted model's (fp32, 1e-5); after the adapters change, a sync of ``trainable_weights`` into the copy gives the
    logits of the changed policy again."""
    from hf_configs import make_hf_model
    from peft import LoraConfig

    from hfnative.converters.loading import load_pretrained
    from hfnative.converters.peft import apply_lora
    from hfnative.generation import NativeRolloutEngine
    from hfnative.rl import load_policy_copy, policy_copy
    from hfnative.rl.policy_copy import trainable_weights

    converted = load_pretrained(make_hf_model("qwen3-gqa"))
    apply_lora(converted, LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "down_proj"]))
    policy = converted.model.eval()

    def perturb_adapters():
        with torch.no_grad():
            for name, parameter in policy.named_parameters():
                if "lora_" in name:
                    parameter.add_(torch.randn_like(parameter) * 0.05)

    perturb_adapters()
    copy = load_policy_copy(policy_copy(policy))
    assert not any("lora_" in name for name in copy.state_dict())
    ids = torch.tensor([[1, 5, 9, 2, 7, 3]])
    with torch.no_grad():
        torch.testing.assert_close(copy(ids).logits, policy(ids).logits, rtol=0, atol=1e-5)
        perturb_adapters()  # a training step changes the adapters
        assert (copy(ids).logits - policy(ids).logits).abs().max() > 1e-3
        NativeRolloutEngine(copy).load_weights(trainable_weights(policy).items())
        torch.testing.assert_close(copy(ids).logits, policy(ids).logits, rtol=0, atol=1e-5)


# --- runs on Ray ----------------------------------------------------------------------------------------------


def test_learns_from_reward_alone_within_bounded_staleness(tiny_model, local_ray, tmp_path):
    """Reward rises clearly from its start; every trained sample was generated at most max_staleness steps ago,
    read from the versions the generator stamped on its rollouts (a step-s log covers training at version s - 1)."""
    k = 2
    args = _config(tmp_path, max_steps=40, max_staleness=k, max_inflight_tasks=48)
    trainer = AsyncGRPOTrainer(tiny_model, reward_funcs=target_fraction, args=args, train_dataset=_dataset())
    start = time.perf_counter()
    trainer.train()
    elapsed = time.perf_counter() - start
    logs = _train_logs(trainer)
    assert len(logs) == 40
    for entry in logs:
        policy = entry["step"] - 1
        assert policy - entry["sample/model_version_min"] <= k
        assert entry["sample/model_version_max"] <= policy
        assert entry["sample/staleness_max"] <= k
        assert entry["sample/dropped_stale_total"] == 0
    assert max(entry["sample/staleness_max"] for entry in logs) >= 1  # generation ran ahead of training
    rewards = [entry["reward"] for entry in logs]
    first, last = sum(rewards[:5]) / 5, sum(rewards[-5:]) / 5
    assert first < 0.25 and last > first + 0.4, (first, last)

    # the synchronous GRPOTrainer on the same model, task, seed and settings
    from hfnative import GRPOConfig, GRPOTrainer

    sync_args = GRPOConfig(**{f.name: getattr(args, f.name) for f in dataclasses.fields(GRPOConfig)
                              if f.init and f.name in _SHARED_SETTINGS})
    sync = GRPOTrainer(tiny_model, reward_funcs=target_fraction, args=sync_args, train_dataset=_dataset())
    sync_start = time.perf_counter()
    sync.train()
    sync_elapsed = time.perf_counter() - sync_start
    sync_rewards = [entry["reward"] for entry in _train_logs(sync)]
    sync_last = sum(sync_rewards[-5:]) / 5
    assert last >= 0.8 * sync_last, (last, sync_last)
    print(f"40 steps: async {elapsed:.1f} s (actor start included), reward {first:.3f} -> {last:.3f}; "
          f"sync {sync_elapsed:.1f} s, reward {sum(sync_rewards[:5]) / 5:.3f} -> {sync_last:.3f}")


def _raises(completion_ids, **kwargs):
    raise ValueError("reward boom")


def test_failing_reward_function_stops_the_run_with_its_error(tiny_model, local_ray, tmp_path):
    args = _config(tmp_path, max_steps=3)
    trainer = AsyncGRPOTrainer(tiny_model, reward_funcs=_raises, args=args, train_dataset=_dataset())
    start = time.perf_counter()
    with pytest.raises(RolloutActorError, match=r"reward actor failed: ValueError: reward boom"):
        trainer.train()
    assert time.perf_counter() - start < 60
    assert trainer._rollout_queue is None  # the actors were stopped
    assert trainer.state.global_step == 0


def _sleeping_score(generated, payload):
    time.sleep(600)


def _no_score(generated, payload):
    return {}


def test_pipeline_reports_hung_and_dead_actors_and_regenerates_stale_work(tiny_model, local_ray):
    """The pipeline alone: a scorer that holds its work past heartbeat_stale_after_s is reported as hung; a
    micro-batch that became too stale is dropped, counted and generated again with the new weights; a generator
    killed mid-run is reported as dead. Nothing waits forever."""
    from hfnative.converters.loading import load_pretrained
    from hfnative.generation import SamplingParams
    from hfnative.rl import RolloutQueue

    model = load_pretrained(tiny_model).model
    work = [([[5, 6, 7], [5, 6, 7]], None)] * 4
    settings = dict(micro_batches_per_step=1, max_staleness=1, max_inflight=2, heartbeat_stale_after_s=3)
    hung = RolloutQueue(model, _sleeping_score, SamplingParams(max_new_tokens=4, seed=0), **settings)
    hung.start()
    try:
        hung.set_source(iter(work))
        start = time.perf_counter()
        with pytest.raises(RolloutStalledError, match=r"reward actor \(scoring\) produced nothing for 3 s"):
            hung.next_batch()
        assert time.perf_counter() - start < 20
    finally:
        hung.close()

    # max_staleness=0, two micro-batches a step: both are generated at version 0 before training starts
    settings.update(micro_batches_per_step=2, max_staleness=0)
    pipeline = RolloutQueue(model, _no_score, SamplingParams(max_new_tokens=4, seed=0), **settings)
    pipeline.start()
    try:
        pipeline.set_source(iter([([[5 + i, 6, 7], [5 + i, 6, 7]], i) for i in range(4)]))
        first = pipeline.next_batch()
        pipeline.policy_updated(1)  # the step ends after one micro-batch: the second one is now stale
        second, third = pipeline.next_batch(), pipeline.next_batch()
        assert [b["prompt_ids"][0][0] for b in (first, second, third)] == [5, 7, 6]  # the stale one came back
        assert [b["version"] for b in (first, second, third)] == [0, 1, 1]
        assert pipeline.pop_metrics()["sample/dropped_stale_total"] == 2  # its two completions
        ray.kill(pipeline.generator)
        with pytest.raises(RolloutActorError, match=r"the generation actor failed: .*(died|dead)"):
            pipeline.next_batch()
            pipeline.next_batch()
    finally:
        pipeline.close()


def test_max_staleness_zero_is_on_policy_and_resumes_from_a_checkpoint(tiny_model, local_ray, tmp_path):
    """max_staleness=0: every sample comes from the weights being trained (two micro-batches a step), so the
    trainer's recomputed log-probs equal the generator's (importance ratio 1, KL 0). Steps 4-6 of a run resumed
    from checkpoint-3 equal the uninterrupted run's: the generator restarts from the checkpoint's weights at its
    policy version, with the same prompts and samples."""
    settings = dict(max_steps=6, max_staleness=0, gradient_accumulation_steps=2, save_strategy="steps", save_steps=3)
    whole = AsyncGRPOTrainer(tiny_model, reward_funcs=target_fraction, args=_config(tmp_path, **settings),
                             train_dataset=_dataset())
    whole.train()
    expected = {e["step"]: e for e in _train_logs(whole)}
    assert sorted(expected) == [1, 2, 3, 4, 5, 6]
    for entry in expected.values():
        assert entry["sample/model_version_min"] == entry["sample/model_version_max"] == entry["step"] - 1
        assert entry["sample/staleness_max"] == 0 and entry["sample/dropped_stale_total"] == 0
        assert abs(entry["ratio"] - 1) < 1e-4 and abs(entry["kl"]) < 1e-6
    del whole  # frees output_dir for the resumed run
    gc.collect()

    resumed = AsyncGRPOTrainer(tiny_model, reward_funcs=target_fraction, args=_config(tmp_path, **settings),
                               train_dataset=_dataset())
    resumed.train(resume_from_checkpoint=str(tmp_path / "checkpoint-3"))
    logs = [e for e in _train_logs(resumed) if e["step"] > 3]  # steps 1-3 come back from the checkpoint's state
    assert [e["step"] for e in logs] == [4, 5, 6]
    for entry in logs:
        assert entry["sample/model_version_min"] == entry["step"] - 1
        assert abs(entry["ratio"] - 1) < 1e-4  # the generator holds the checkpoint's weights
        for key in ("loss", "reward", "grad_norm", "entropy"):
            assert math.isclose(entry[key], expected[entry["step"]][key], rel_tol=1e-5, abs_tol=1e-7), key


def test_moe_policy_adds_the_router_loss_as_trl(local_ray, tmp_path):
    """A MoE policy (router_aux_loss_coef 0.5 in its config): the trained micro-batch's aux_loss equals
    transformers' load-balancing loss of the same ids and mask, and the logged loss is the on-policy clipped loss
    (ratio 1: minus the completion tokens' mean advantage) plus 0.5 x aux_loss, as TRL's async trainer adds it."""
    from transformers import AutoModelForCausalLM, Qwen3MoeConfig

    folder = tmp_path / "moe"
    tokenizer = build_tiny_tokenizer()
    torch.manual_seed(0)
    config = Qwen3MoeConfig(
        vocab_size=len(tokenizer), hidden_size=32, intermediate_size=48, moe_intermediate_size=24, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=8, num_experts=4, num_experts_per_tok=2,
        norm_topk_prob=True, router_aux_loss_coef=0.5, max_position_embeddings=128, tie_word_embeddings=True,
        eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
    )
    AutoModelForCausalLM.from_config(config).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    trainer = AsyncGRPOTrainer(str(folder), reward_funcs=target_fraction, train_dataset=_dataset(),
                               args=_config(tmp_path / "run", max_steps=1, max_staleness=0, logging_steps=1))
    seen = []
    loss_of = trainer.objective.loss

    def recording_loss(model, inputs, num_items_in_batch):
        seen.append({k: v.detach().clone() if isinstance(v, torch.Tensor) else v for k, v in inputs.items()})
        return loss_of(model, inputs, num_items_in_batch)

    trainer.objective.loss = recording_loss
    trainer.train()
    (logged,) = _train_logs(trainer)
    (inputs,) = seen
    reference = AutoModelForCausalLM.from_pretrained(folder)
    with torch.no_grad():
        expected = reference(inputs["input_ids"], attention_mask=inputs["attention_mask"], output_router_logits=True)
    assert logged["aux_loss"] == pytest.approx(expected.aux_loss.item(), rel=1e-5)
    mask = inputs["completion_mask"].float()
    policy_loss = -(inputs["advantages"][:, None] * mask).sum() / mask.sum()  # one process: the micro-batch's tokens
    assert logged["loss"] == pytest.approx(policy_loss.item() + 0.5 * logged["aux_loss"], abs=1e-4)


class _GeneratorNodes(TrainerCallback):
    def __init__(self, trainer):
        self.trainer, self.nodes = trainer, None

    def on_step_end(self, args, state, control, **kwargs):
        if self.nodes is None:
            self.nodes = ray.get([g.node_id.remote() for g in self.trainer._rollout_queue.generators])


def test_generators_run_on_every_node_of_a_cluster(tiny_model, tmp_path):
    """Two Ray nodes of one CPU each on this machine: the trainer joins the cluster by address, and its two
    generator actors (one CPU each) run one on each node; the lag bound holds across both."""
    from ray.cluster_utils import Cluster

    if ray.is_initialized():
        ray.shutdown()
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 1, "include_dashboard": False})
    try:
        cluster.add_node(num_cpus=1)
        cluster.wait_for_nodes()
        args = _config(tmp_path, max_steps=4, max_staleness=1, gradient_accumulation_steps=2, ray_address=cluster.address,
                       num_rollout_actors=2, rollout_actor_options={"num_cpus": 1})
        trainer = AsyncGRPOTrainer(tiny_model, reward_funcs=target_fraction, args=args, train_dataset=_dataset())
        probe = _GeneratorNodes(trainer)
        trainer.add_callback(probe)
        trainer.train()
        assert sorted(probe.nodes) == sorted(node.node_id for node in cluster.list_all_nodes())
        logs = _train_logs(trainer)
        assert [e["step"] for e in logs] == [1, 2, 3, 4]
        assert all(e["step"] - 1 - e["sample/model_version_min"] <= 1 for e in logs)
        assert not ray.is_initialized()  # the trainer joined the cluster itself and left it
    finally:
        if ray.is_initialized():
            ray.shutdown()
        cluster.shutdown()


# --- tool-calling rollouts in the generator actors ----------------------------------------------------------------


def _calc_multiply(a: int, b: int) -> int:
    """Multiply two integers.

    Args:
        a: The first integer.
        b: The second integer.
    """
    return a * b


def _calc_explode(x: int) -> int:
    """A tool that always fails.

    Args:
        x: Any integer.
    """
    raise ValueError(f"the tool broke on {x}")


def _calc_slow(seconds: float) -> str:
    """A tool that takes its time.

    Args:
        seconds: How long to sleep.
    """
    time.sleep(seconds)
    return "woke up"


_STEERED_CALLS = [("_calc_explode", {"x": 1}), ("_calc_slow", {"seconds": 3}), ("_calc_multiply", {"a": 2, "b": 4}), None]


class _SteeredEngine:
    """The actor's engine, with each rollout's first turn written as a model that has learned the call format would
    (a different tool per row of a group); later turns are sampled."""

    def __init__(self, engine, tokenizer, calls=None):
        self.engine, self.tokenizer, self.calls = engine, tokenizer, calls or _STEERED_CALLS

    def generate(self, prompts, sampling):
        out = self.engine.generate(prompts, sampling)
        for i, prompt in enumerate(prompts):
            if self.tokenizer.decode(prompt).count("<|im_start|>assistant") == 1:  # a first turn
                call = self.calls[i % 4]
                text = "No tools needed." if call is None else (
                    '<tool_call>\n{"name": "%s", "arguments": %s}\n</tool_call>' % (call[0], json.dumps(call[1])))
                out.completion_ids[i] = self.tokenizer(text + "<|im_end|>", add_special_tokens=False)["input_ids"]
                out.logprobs[i] = [0.0] * len(out.completion_ids[i])
        return out


def _steered_episodes(calls=None):
    from hfnative.trainers.rollout.tool_calling import ToolEpisodes

    class SteeredEpisodes(ToolEpisodes):
        def __call__(self, engine, prompt_ids, sampling, rows=None):
            return super().__call__(_SteeredEngine(engine, self.tool_calling.tokenizer, calls), prompt_ids, sampling, rows)

    return SteeredEpisodes


class _Counter:
    """An environment: reset reads the row's start, add is its tool, get_reward the episode's total."""

    def __init__(self):
        self.total = 0

    def reset(self, start=0, **row):
        self.total = start
        return f" Start at {start}."

    def add(self, amount: int) -> int:
        """Add to the running total.

        Args:
            amount: How much to add.
        """
        self.total += amount
        return self.total

    def get_reward(self) -> float:
        return float(self.total)


def tool_errors(completions, **kwargs):
    """The share of tool results that are errors (what the reward actor sees of the turns)."""
    return [sum("error" in m["content"] for m in c if m["role"] == "tool") / max(1, sum(m["role"] == "tool" for m in c))
            for c in completions]


def timed_out(completions, **kwargs):
    return [float(any("timed out" in m["content"] for m in c if m["role"] == "tool")) for c in completions]


def test_tool_calling_rollouts_run_in_the_generator_actors(local_ray, tmp_path):
    """Tools run where the episodes are generated: the failing and the timed-out calls come back as error results in
    the completions the reward actor scores, tools/* are logged, and training goes on."""
    sys.path.insert(0, str(Path(__file__).parent))
    from test_tool_calling import qwen3_model

    model = qwen3_model(tmp_path / "model", max_position_embeddings=2048)
    args = _config(tmp_path, per_device_train_batch_size=8, num_generations=4, max_completion_length=160, max_steps=2,
                   max_staleness=1, tool_call_timeout=0.3, max_tool_calling_iterations=2, logging_steps=1)
    prompts = [[{"role": "user", "content": f"What is number {i} times three?"}] for i in range(4)]
    trainer = AsyncGRPOTrainer(model, reward_funcs=[tool_errors, timed_out], args=args,
                               train_dataset=Dataset.from_dict({"prompt": prompts * 4}),
                               tools=[_calc_multiply, _calc_explode, _calc_slow])
    trainer.objective.episodes_class = _steered_episodes()
    trainer.train()
    logs = _train_logs(trainer)
    assert [entry["step"] for entry in logs] == [1, 2]
    for entry in logs:
        assert entry["tools/call_frequency"] == pytest.approx(0.75)
        assert entry["tools/failure_frequency"] == pytest.approx(2 / 3)
        assert entry["rewards/tool_errors"] == pytest.approx(0.5)  # 2 of the 4 rows' results are errors
        assert entry["rewards/timed_out"] == pytest.approx(0.25)
        assert math.isfinite(entry["loss"])
    with pytest.raises(ValueError, match="environment_factory"):
        AsyncGRPOTrainer(model, reward_funcs=tool_errors, args=args, train_dataset=_dataset(), environment_factory=dict)
    with pytest.raises(ValueError, match="max_tool_calling_iterations=2 has no effect without tools"):
        AsyncGRPOTrainer(model, reward_funcs=tool_errors, args=args, train_dataset=_dataset())


def test_environment_episodes_run_and_are_scored_in_the_generator_actors(local_ray, tmp_path):
    """environment_factory in the async trainer: each completion's environment is reset with its row and offered as
    tools in the generator actor, and its get_reward() (a reward column named after the class) is scored there."""
    sys.path.insert(0, str(Path(__file__).parent))
    from test_tool_calling import qwen3_model

    model = qwen3_model(tmp_path / "model", max_position_embeddings=2048)
    args = _config(tmp_path, per_device_train_batch_size=8, num_generations=4, max_completion_length=160, max_steps=2,
                   max_staleness=1, max_tool_calling_iterations=1, logging_steps=1)
    rows = [{"prompt": [{"role": "user", "content": "Count."}], "start": 10 * i} for i in range(4)]
    trainer = AsyncGRPOTrainer(model, reward_funcs=None, args=args, train_dataset=Dataset.from_list(rows * 4),
                               environment_factory=_Counter)
    calls = [("add", {"amount": 1}), ("add", {"amount": 2}), ("add", {"amount": 3}), None]
    trainer.objective.episodes_class = _steered_episodes(calls)
    trainer.train()
    logs = _train_logs(trainer)
    assert [entry["step"] for entry in logs] == [1, 2]
    starts = []
    for entry in logs:
        assert entry["tools/call_frequency"] == pytest.approx(0.75)
        assert entry["tools/failure_frequency"] == 0.0
        # the group's mean total: its start plus the 6 / 4 added on average
        starts.append(entry["rewards/_Counter"] - 1.5)
    assert all(start in (0.0, 10.0, 20.0, 30.0, 5.0, 15.0, 25.0) for start in starts), starts
