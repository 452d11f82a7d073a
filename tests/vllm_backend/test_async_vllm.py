"""AsyncGRPOTrainer(use_vllm=True) on examples/tiny-qwen3-hd32 (CPU build of vLLM): the generator Ray actor
generates with vLLM (colocated in the actor, or a running `vllm serve`), the lag bound holds, and after training
the actor's vLLM decodes greedily as the trained model does on the native engine (itself checked against
transformers in tests/test_generation.py), so the weight syncs reached vLLM."""

import os

import pytest

pytest.importorskip("vllm", reason="vllm is not importable: scripts/vllm_env.sh builds .venv-vllm to run these")
ray = pytest.importorskip("ray")

import torch  # noqa: E402

from conftest import VLLM_ENV  # noqa: E402
from test_vllm_backend import GREEDY, PROMPTS, assert_same_greedy  # noqa: E402

MAX_STALENESS = 1


@pytest.fixture
def local_ray():
    for name, value in {**VLLM_ENV, "OMP_NUM_THREADS": "1"}.items():
        os.environ.setdefault(name, value)  # before ray.init: the actors inherit the environment
    if ray.is_initialized():
        ray.shutdown()
    ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False)
    yield
    ray.shutdown()


def even_tokens(completion_ids, **kwargs):
    return [sum(t % 2 == 0 for t in ids) / max(len(ids), 1) for ids in completion_ids]


def train_and_probe(model_dir, tmp_path, steps: int, **vllm_settings):
    """Trains ``steps`` steps; returns the trainer, its step logs and, probed at the end of training while the
    actors still run, the generator's engine class, whether it holds a native copy of the policy and its greedy
    rollouts of PROMPTS (submitted after the last weight sync, so on the final weights)."""
    from datasets import Dataset
    from transformers import TrainerCallback

    import hfnative

    seen = {}

    class ProbeGenerator(TrainerCallback):
        def on_train_end(self, args, state, control, **kwargs):
            generator = trainer._rollout_queue.generator
            seen["engine"] = ray.get(generator.__ray_call__.remote(lambda actor: type(actor.engine).__name__))
            seen["has_native_copy"] = ray.get(generator.__ray_call__.remote(lambda actor: actor.model is not None))
            seen["greedy"] = ray.get(generator.generate.remote(PROMPTS, GREEDY))

    args = hfnative.AsyncGRPOConfig(
        output_dir=str(tmp_path), use_cpu=True, bf16=False, report_to=[], disable_tqdm=True, save_strategy="no",
        max_steps=steps, per_device_train_batch_size=8, num_generations=4, max_completion_length=8,
        learning_rate=1e-2, seed=0, gradient_checkpointing=False, max_staleness=MAX_STALENESS,
        max_inflight_tasks=16, use_vllm=True, **vllm_settings,
    )
    rows = [{"prompt": f"Tell me about the number {i}"} for i in range(32)]
    trainer = hfnative.AsyncGRPOTrainer(model=str(model_dir), reward_funcs=even_tokens, args=args,
                                        train_dataset=Dataset.from_list(rows), callbacks=[ProbeGenerator()])
    trainer.train()
    return trainer, [entry for entry in trainer.state.log_history if "loss" in entry], seen


def assert_lag_bound_and_vllm_logprobs(logs, steps: int):
    assert len(logs) == steps
    for entry in logs:  # a step-s log covers training at policy version s - 1
        policy = entry["step"] - 1
        assert policy - entry["sample/model_version_min"] <= MAX_STALENESS
        assert entry["sample/model_version_max"] <= policy
        assert entry["sample/staleness_max"] <= MAX_STALENESS
        if entry["sample/staleness_max"] == 0:  # on-policy: vLLM's log-probs are the trained policy's
            assert abs(entry["ratio"] - 1) < 1e-4, entry
    assert max(entry["sample/staleness_max"] for entry in logs) >= 1  # generation ran ahead of training
    assert any(entry["sample/staleness_max"] == 0 for entry in logs)
    assert all(entry["reward_std"] > 0 for entry in logs)  # a group's completions differ (a learning signal)


def assert_vllm_decodes_as_the_trained_model(trainer, model_dir, seen, steps: int):
    from hfnative.converters.loading import load_pretrained
    from hfnative.generation import NativeRolloutEngine, Rollouts

    assert seen["greedy"]["version"] == steps  # the generator took the last step's weights
    trainer.model.eval()
    trained = NativeRolloutEngine(trainer.model).generate(PROMPTS, GREEDY)
    initial = NativeRolloutEngine(load_pretrained(model_dir).model).generate(PROMPTS, GREEDY)
    assert trained.completion_ids != initial.completion_ids  # training changed what greedy decodes
    greedy = seen["greedy"]
    vllm_greedy = Rollouts(greedy["completion_ids"], greedy["logprobs"], greedy["finish_reason"])
    with torch.no_grad():
        assert_same_greedy(vllm_greedy, trained, trainer.model, PROMPTS)


def test_async_grpo_with_vllm_colocated_in_its_generator_actor(model_dir, local_ray, tmp_path):
    steps = 4
    trainer, logs, seen = train_and_probe(model_dir, tmp_path, steps, vllm_mode="colocate", vllm_max_model_length=128)
    assert seen["engine"] == "VLLMColocateEngine" and not seen["has_native_copy"]
    assert_lag_bound_and_vllm_logprobs(logs, steps)
    assert_vllm_decodes_as_the_trained_model(trainer, model_dir, seen, steps)


def test_async_grpo_with_a_vllm_server(vllm_server, model_dir, local_ray, tmp_path):
    """The generator actor generates on the server and sends it the weights (files transport) at start, so the
    server's earlier weights do not matter, and after every step."""
    from hfnative.converters.loading import load_pretrained
    from hfnative.converters.rollouts import hub_named_tensors
    from hfnative.generation.vllm_backend import VLLMServerEngine

    steps = 3
    try:
        trainer, logs, seen = train_and_probe(model_dir, tmp_path, steps, vllm_mode="server",
                                              vllm_server_base_url=vllm_server, vllm_weight_transport="files")
        assert seen["engine"] == "VLLMServerEngine" and not seen["has_native_copy"]
        assert_lag_bound_and_vllm_logprobs(logs, steps)
        assert_vllm_decodes_as_the_trained_model(trainer, model_dir, seen, steps)
    finally:  # the server is shared: back to the checkpoint's weights for the tests after this one
        server = VLLMServerEngine(vllm_server, weight_transport="files", weights_dir=tmp_path / "restore", timeout=60)
        server.load_weights(hub_named_tensors(load_pretrained(model_dir)))


def test_async_grpo_tool_calling_with_a_vllm_server(vllm_server, model_dir, local_ray, tmp_path):
    """AsyncGRPOTrainer(use_vllm=True, vllm_mode="server", tools=...): the episodes run in the generator actor, each
    turn generated on the server (the first one steered to a tool call by the row's place in its group, the later ones
    sampled), the tools run there, the trainer trains on the tool-masked completions, and the actor pushes the
    trained weights to the server."""
    import shutil
    import sys
    from pathlib import Path

    from datasets import Dataset

    import hfnative
    from hfnative.converters.loading import load_pretrained
    from hfnative.converters.rollouts import hub_named_tensors
    from hfnative.data.chat_templates import TEMPLATE_DIR
    from hfnative.generation import NativeRolloutEngine
    from hfnative.generation.vllm_backend import VLLMServerEngine

    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from _tool_calling_worker import double, fail, steered_episodes, tool_results

    folder = tmp_path / "model"
    shutil.copytree(model_dir, folder)
    shutil.copy(TEMPLATE_DIR / "qwen3_multiturn.jinja", folder / "chat_template.jinja")
    args = hfnative.AsyncGRPOConfig(
        output_dir=str(tmp_path / "out"), use_cpu=True, bf16=False, report_to=[], disable_tqdm=True,
        save_strategy="no", max_steps=2, logging_steps=1, per_device_train_batch_size=8, num_generations=4,
        max_completion_length=128, learning_rate=1e-2, seed=0, gradient_checkpointing=False,
        max_staleness=MAX_STALENESS, max_tool_calling_iterations=1, use_vllm=True, vllm_mode="server",
        vllm_server_base_url=vllm_server, vllm_weight_transport="files",
    )
    rows = [{"prompt": [{"role": "user", "content": f"Double {i}."}]} for i in range(8)]
    server = VLLMServerEngine(vllm_server, weight_transport="files", weights_dir=tmp_path / "restore", timeout=60)
    try:
        trainer = hfnative.AsyncGRPOTrainer(model=str(folder), reward_funcs=tool_results, args=args,
                                            train_dataset=Dataset.from_list(rows), tools=[double, fail])
        trainer.objective.episodes_class = steered_episodes()
        trainer.train()
        logs = [entry for entry in trainer.state.log_history if "loss" in entry]
        assert len(logs) == 2
        for entry in logs:  # 3 of each group's 4 first turns called a tool, 1 of those 3 failed
            assert entry["tools/call_frequency"] == pytest.approx(0.75)
            assert entry["tools/failure_frequency"] == pytest.approx(1 / 3)
            assert torch.isfinite(torch.tensor(entry["loss"])) and entry["grad_norm"] > 0
        trainer.model.eval()
        checkpoint = NativeRolloutEngine(load_pretrained(model_dir).model).generate(PROMPTS, GREEDY).completion_ids
        assert NativeRolloutEngine(trainer.model).generate(PROMPTS, GREEDY).completion_ids != checkpoint
        assert server.generate(PROMPTS, GREEDY).completion_ids != checkpoint  # the actor pushed trained weights
    finally:  # the server is shared: back to the checkpoint's weights for the tests after this one
        server.load_weights(hub_named_tensors(load_pretrained(model_dir)))
