"""The vLLM backend against the native engine on examples/tiny-qwen3-hd32 (float32, CPU build of vLLM).

The oracle is hfnative's native engine, itself checked token for token against transformers' generate
in tests/test_generation.py: greedy completions must be the same tokens (where the two best logits are
within NEAR_TIE either token is right, and the sequences may part there), log-probs within LOGPROB_TOL.
"""

import json
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

pytest.importorskip("vllm", reason="vllm is not importable: scripts/vllm_env.sh builds .venv-vllm to run these")

import torch  # noqa: E402

from conftest import VLLM_ENV, free_port  # noqa: E402
from hfnative.converters.loading import load_pretrained  # noqa: E402
from hfnative.converters.rollouts import hub_named_tensors  # noqa: E402
from hfnative.generation import NativeRolloutEngine, SamplingParams  # noqa: E402
from hfnative.generation.vllm_backend import VLLMColocateEngine, VLLMServerEngine  # noqa: E402
from hfnative.trainers.rollout.engines import make_rollout_engine  # noqa: E402

for _name, _value in VLLM_ENV.items():
    os.environ.setdefault(_name, _value)

NEAR_TIE = 1e-4
LOGPROB_TOL = 1e-4
EOS = 2  # <|im_end|>

# ragged prompts (ids of the tiny tokenizer's vocabulary, 3 to 19 tokens)
PROMPTS = [
    [1, 882, 198, 383, 374, 279],
    [17, 29, 400, 5],
    [100, 200, 300, 400, 500, 600, 700, 800, 900, 1000, 11, 12, 13, 14, 15, 16, 17, 18, 19],
    [1, 77, 912],
    [640, 760, 287, 3, 4, 5, 6, 7],
]
GREEDY = SamplingParams(max_new_tokens=24, do_sample=False, eos_token_id=EOS)


@pytest.fixture(scope="module")
def converted(model_dir):
    return load_pretrained(model_dir)


@pytest.fixture(scope="module")
def colocated(model_dir):
    """Built as a trainer builds it: from the loaded model (vLLM starts from its folder, then takes its
    live weights) and TRL's argument names."""
    args = SimpleNamespace(use_vllm=True, vllm_mode="colocate", vllm_gpu_memory_utilization=0.3,
                           vllm_tensor_parallel_size=1, vllm_max_model_length=256)
    engine = make_rollout_engine(load_pretrained(model_dir), args, enforce_eager=True)  # eager: no compile on start
    assert isinstance(engine, VLLMColocateEngine)
    assert engine.llm.llm_engine.model_config.dtype == torch.float32  # the checkpoint's, not vLLM's CPU default
    return engine


def perturbed(converted, seed: int):
    """The model's weights, each with seeded noise of 30% of its own scale added (norm weights included)."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for parameter in converted.model.parameters():
            noise = torch.randn(parameter.shape, generator=generator, dtype=parameter.dtype)
            parameter.add_(noise * 0.3 * parameter.abs().mean())


def assert_same_greedy(ours, reference, model, prompts):
    """Token for token, except at a near-tie of the reference model (then the rest may differ)."""
    for index, (prompt, got, want) in enumerate(zip(prompts, ours.completion_ids, reference.completion_ids)):
        parted = next((i for i, (a, b) in enumerate(zip(got, want)) if a != b), None)
        if parted is None:
            assert got == want, f"prompt {index}: lengths differ: {got} vs {want}"
            assert ours.finish_reason[index] == reference.finish_reason[index]
            torch.testing.assert_close(torch.tensor(ours.logprobs[index]), torch.tensor(reference.logprobs[index]),
                                       atol=LOGPROB_TOL, rtol=0)
            continue
        with torch.no_grad():
            logits = model(input_ids=torch.tensor([prompt + want[:parted]])).logits[0, -1].float()
        top2 = logits.topk(2).values
        assert top2[0] - top2[1] < NEAR_TIE, (
            f"prompt {index} parts at token {parted} ({got[parted]} vs {want[parted]}) with a logit gap of "
            f"{(top2[0] - top2[1]).item():.3g}: not a near-tie"
        )
        torch.testing.assert_close(torch.tensor(ours.logprobs[index][:parted]),
                                   torch.tensor(reference.logprobs[index][:parted]), atol=LOGPROB_TOL, rtol=0)


def assert_native_logprobs(model, rollouts, temperature: float):
    """log_softmax(logits / temperature) of the sampled tokens, from a forward pass of ``model``."""
    for prompt, tokens, logprobs in zip(PROMPTS, rollouts.completion_ids, rollouts.logprobs):
        with torch.no_grad():
            logits = model(input_ids=torch.tensor([prompt + tokens])).logits[0, len(prompt) - 1 : -1]
        expected = torch.log_softmax(logits.float() / temperature, dim=-1).gather(-1, torch.tensor(tokens)[:, None])[:, 0]
        torch.testing.assert_close(torch.tensor(logprobs), expected, atol=LOGPROB_TOL, rtol=0)


def test_colocated_greedy_equals_native(colocated, converted):
    reference = NativeRolloutEngine(converted.model).generate(PROMPTS, GREEDY)
    ours = colocated.generate(PROMPTS, GREEDY)
    assert len(ours) == len(PROMPTS)
    assert_same_greedy(ours, reference, converted.model, PROMPTS)
    # the stop token ends a sequence and is kept; with no stop token every sequence runs to the limit
    unstopped = colocated.generate(PROMPTS, SamplingParams(max_new_tokens=24, do_sample=False))
    assert all(len(c) == 24 for c in unstopped.completion_ids) and set(unstopped.finish_reason) == {"length"}
    for tokens, reason in zip(ours.completion_ids, ours.finish_reason):
        assert (reason == "stop") == (tokens[-1] == EOS)


def test_colocated_sampling_is_seeded_with_the_native_logprobs(colocated, converted):
    sampling = SamplingParams(max_new_tokens=16, temperature=0.8, seed=7)
    first, second = colocated.generate(PROMPTS, sampling), colocated.generate(PROMPTS, sampling)
    assert first.completion_ids == second.completion_ids
    other = colocated.generate(PROMPTS, SamplingParams(max_new_tokens=16, temperature=0.8, seed=8))
    assert other.completion_ids != first.completion_ids
    assert_native_logprobs(converted.model, first, temperature=0.8)


def test_colocated_load_weights_gives_the_updated_models_greedy(colocated, model_dir):
    updated = load_pretrained(model_dir)
    perturbed(updated, seed=1)
    before = colocated.generate(PROMPTS, GREEDY)
    colocated.load_weights(hub_named_tensors(updated))
    after = colocated.generate(PROMPTS, GREEDY)
    reference = NativeRolloutEngine(updated.model).generate(PROMPTS, GREEDY)
    assert after.completion_ids != before.completion_ids  # the update changed what greedy decodes
    assert_same_greedy(after, reference, updated.model, PROMPTS)
    colocated.load_weights(hub_named_tensors(load_pretrained(model_dir)))  # back to the checkpoint
    assert colocated.generate(PROMPTS, GREEDY).completion_ids == before.completion_ids


def test_server_greedy_and_weight_reload(vllm_server, converted, model_dir, tmp_path):
    args = SimpleNamespace(use_vllm=True, vllm_mode="server", vllm_server_base_url=vllm_server,
                           vllm_server_timeout=60, vllm_weight_transport="files", vllm_weights_dir=str(tmp_path))
    engine = make_rollout_engine(str(model_dir), args)
    assert isinstance(engine, VLLMServerEngine)
    reference = NativeRolloutEngine(converted.model).generate(PROMPTS, GREEDY)
    ours = engine.generate(PROMPTS, GREEDY)
    assert_same_greedy(ours, reference, converted.model, PROMPTS)
    sampled = engine.generate(PROMPTS, SamplingParams(max_new_tokens=16, temperature=0.8, seed=7))
    assert_native_logprobs(converted.model, sampled, temperature=0.8)

    updated = load_pretrained(model_dir)
    perturbed(updated, seed=2)
    engine.load_weights(hub_named_tensors(updated))
    after = engine.generate(PROMPTS, GREEDY)
    assert after.completion_ids != ours.completion_ids
    assert_same_greedy(after, NativeRolloutEngine(updated.model).generate(PROMPTS, GREEDY), updated.model, PROMPTS)


def test_colocated_tensor_parallel_over_two_ranks(model_dir, tmp_path):
    """torchrun with 2 processes, vllm_tensor_parallel_size=2: one vLLM over both ranks, each rank handing its
    own prompts (2 and 3 of them) and getting their rollouts back, before and after load_weights."""
    worker = Path(__file__).with_name("_tp_worker.py")
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port",
               str(free_port()), str(worker), str(model_dir), str(tmp_path)]
    run = subprocess.run(command, capture_output=True, text=True, timeout=600, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert run.returncode == 0, run.stderr[-4000:]
    for rank, count in ((0, 2), (1, 3)):
        result = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert len(result["greedy"]) == count
        assert result["greedy"] == result["native"]
        assert result["updated"] == result["native_updated"] and result["updated"] != result["greedy"]


def test_grpo_trainer_generates_through_colocated_vllm(model_dir, tmp_path):
    """GRPOTrainer(use_vllm=True): two optimizer steps with vLLM's rollouts; then vLLM, given the trained
    weights as the trainer pushes them, decodes greedily as the trained model does (native engine)."""
    from datasets import Dataset

    import hfnative

    def even_tokens(completion_ids, **kwargs):
        return [sum(t % 2 == 0 for t in ids) / max(len(ids), 1) for ids in completion_ids]

    args = hfnative.GRPOConfig(
        output_dir=str(tmp_path), use_cpu=True, bf16=False, report_to="none", disable_tqdm=True, max_steps=2,
        logging_steps=1, save_strategy="no", per_device_train_batch_size=8, num_generations=4,
        max_completion_length=8, learning_rate=1e-2, seed=0, gradient_checkpointing=False,
        use_vllm=True, vllm_mode="colocate", vllm_max_model_length=128,
    )
    rows = [{"prompt": f"Tell me about the number {i}"} for i in range(16)]
    trainer = hfnative.GRPOTrainer(model=str(model_dir), reward_funcs=even_tokens, args=args,
                                   train_dataset=Dataset.from_list(rows))
    engine = trainer.objective.engine
    assert isinstance(engine, VLLMColocateEngine)
    before = engine.generate(PROMPTS, GREEDY).completion_ids
    trainer.train()
    assert sum("reward" in entry for entry in trainer.state.log_history) == 2
    trainer.model.eval()
    engine.load_weights(hub_named_tensors(trainer.model))  # what the trainer pushes before each generation
    after = engine.generate(PROMPTS, GREEDY)
    assert after.completion_ids != before
    assert_same_greedy(after, NativeRolloutEngine(trainer.model).generate(PROMPTS, GREEDY), trainer.model, PROMPTS)


@pytest.mark.parametrize("mode", ["colocate", "server"])
def test_grpo_tool_calling_rollouts_through_vllm(model_dir, tmp_path, request, mode):
    """GRPOTrainer(use_vllm=True, tools=...), vLLM colocated or a `vllm serve`: every turn of the multi-turn rollouts
    is generated by vLLM (the first one steered to a tool call, as a model that has learned the format writes it; the
    later ones sampled), the tools run between turns, and two optimizer steps train on the tool-masked completions.
    The server gets the trained weights before each generation, so after the run it decodes as the trained model."""
    import shutil

    from datasets import Dataset

    import hfnative

    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from _tool_calling_worker import SteeredEngine, double, fail, tool_results

    folder = tmp_path / "model"
    shutil.copytree(model_dir, folder)
    from hfnative.data.chat_templates import TEMPLATE_DIR

    # hfnative's multi-turn Qwen3 template (recognised as Qwen3's: its tool calls parse as Qwen3's)
    shutil.copy(TEMPLATE_DIR / "qwen3_multiturn.jinja", folder / "chat_template.jinja")
    os.environ["TRL_EXPERIMENTAL_SILENCE"] = "1"
    args = hfnative.GRPOConfig(
        output_dir=str(tmp_path / "out"), use_cpu=True, bf16=False, report_to="none", disable_tqdm=True, max_steps=2,
        logging_steps=1, save_strategy="no", per_device_train_batch_size=8, num_generations=4, max_completion_length=128,
        learning_rate=1e-2, seed=0, gradient_checkpointing=False, use_vllm=True, vllm_mode=mode,
        vllm_max_model_length=1024, max_tool_calling_iterations=1,
        # the steered first turns carry sampling log-probs of 0 (probability 1), which the importance-sampling
        # correction would read as rows the policy is far from and mask: every row would weigh ~0 and nothing train
        vllm_importance_sampling_correction=False,
    )
    if mode == "server":
        args.vllm_server_base_url = request.getfixturevalue("vllm_server")
        args.vllm_weight_transport, args.vllm_weights_dir = "files", str(tmp_path / "weights")
    rows = [{"prompt": [{"role": "user", "content": f"Double {i}."}]} for i in range(8)]
    trainer = hfnative.GRPOTrainer(model=str(folder), reward_funcs=tool_results, args=args,
                                   train_dataset=Dataset.from_list(rows), tools=[double, fail])
    engine, tokenizer = trainer.objective.engine, trainer.processing_class
    assert isinstance(engine, VLLMColocateEngine if mode == "colocate" else VLLMServerEngine)
    steered, calls = SteeredEngine(engine, tokenizer), []
    sample = steered.sample  # vLLM's own generate

    def generate(prompt_ids, sampling):
        calls.append(len(prompt_ids))
        return steered.generate(prompt_ids, sampling)

    engine.generate = generate
    try:
        trainer.train()
        logs = [entry for entry in trainer.state.log_history if "loss" in entry]
        assert len(logs) == 2
        assert calls == [8, 6, 8, 6]  # per generation: the first turn of every row, then the 3 of 4 that called a tool
        for entry in logs:
            assert entry["tools/call_frequency"] == pytest.approx(0.75)
            assert entry["tools/failure_frequency"] == pytest.approx(1 / 3)
            assert torch.isfinite(torch.tensor(entry["loss"])) and entry["grad_norm"] > 0
        if mode == "server":  # the trainer pushed the first step's weights before the second generation
            checkpoint = NativeRolloutEngine(load_pretrained(model_dir).model).generate(PROMPTS, GREEDY)
            assert sample(PROMPTS, GREEDY).completion_ids != checkpoint.completion_ids
            trainer.model.eval()  # and, given the second step's, the server decodes as the trained model
            engine.load_weights(hub_named_tensors(trainer.model))
            assert_same_greedy(sample(PROMPTS, GREEDY), NativeRolloutEngine(trainer.model).generate(PROMPTS, GREEDY),
                               trainer.model, PROMPTS)
    finally:
        if mode == "server":  # the server is shared: back to the checkpoint's weights for the tests after this one
            engine.load_weights(hub_named_tensors(load_pretrained(model_dir)))


def test_ppo_trainer_generates_through_colocated_vllm(model_dir, tmp_path):
    """PPOTrainer(use_vllm=True): two updates with vLLM's rollouts; then vLLM holds the trained weights (pushed after
    every update) and decodes greedily as the trained model does (native engine)."""
    from datasets import Dataset
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    import hfnative

    classifier = tmp_path / "classifier"
    AutoModelForSequenceClassification.from_pretrained(model_dir, num_labels=1).save_pretrained(classifier)
    tokenizer = AutoTokenizer.from_pretrained(model_dir, padding_side="left")
    rows = [{"input_ids": tokenizer(f"Tell me about the number {i}")["input_ids"]} for i in range(8)]
    args = hfnative.PPOConfig(
        output_dir=str(tmp_path / "run"), use_cpu=True, bf16=False, report_to="none", disable_tqdm=True,
        logging_steps=1, save_strategy="no", per_device_train_batch_size=4, num_ppo_epochs=1, response_length=8,
        total_episodes=8, learning_rate=1e-2, seed=0, gradient_checkpointing=False, use_vllm=True,
        vllm_mode="colocate", vllm_max_model_length=128,
    )
    trainer = hfnative.PPOTrainer(args, tokenizer, str(model_dir), None, str(classifier), Dataset.from_list(rows),
                                  str(classifier))
    engine = trainer.objective.rollout.engine
    assert isinstance(engine, VLLMColocateEngine)
    before = engine.generate(PROMPTS, GREEDY).completion_ids
    trainer.train()
    assert sum("objective/scores" in entry for entry in trainer.state.log_history) == 2
    trainer.model.eval()
    after = engine.generate(PROMPTS, GREEDY)  # the weights the trainer pushed after the last update
    assert after.completion_ids != before
    assert_same_greedy(after, NativeRolloutEngine(trainer.model).generate(PROMPTS, GREEDY), trainer.model, PROMPTS)


@pytest.mark.parametrize("mode", ["colocate", "server"])
def test_grpo_rollouts_constrained_to_a_regex(model_dir, tmp_path, request, mode):
    """GRPOConfig(use_vllm=True, vllm_structured_outputs_regex=...): every rollout vLLM makes for the trainer, colocated
    or served, matches the regex (its text, the stop token off), as TRL's vLLM generation constrains it; the same
    sampling without the regex does not (a random tiny model writes anything)."""
    import re

    from datasets import Dataset
    from transformers import AutoTokenizer

    import hfnative

    regex = r"(yes|no), (red|green|blue)\."
    args = hfnative.GRPOConfig(
        output_dir=str(tmp_path / "out"), use_cpu=True, bf16=False, report_to="none", disable_tqdm=True, max_steps=2,
        logging_steps=1, save_strategy="no", per_device_train_batch_size=8, num_generations=4,
        max_completion_length=16, learning_rate=1e-2, seed=0, gradient_checkpointing=False, use_vllm=True,
        vllm_mode=mode, vllm_max_model_length=256, vllm_structured_outputs_regex=regex,
    )
    if mode == "server":
        args.vllm_server_base_url = request.getfixturevalue("vllm_server")
        args.vllm_weight_transport, args.vllm_weights_dir = "files", str(tmp_path / "weights")
    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    texts = []

    def matches(completion_ids, **kwargs):
        decoded = [tokenizer.decode([t for t in ids if t != EOS]) for ids in completion_ids]
        texts.extend(decoded)
        return [float(re.fullmatch(regex, text) is not None) for text in decoded]

    rows = [{"prompt": f"Answer {i}:"} for i in range(16)]
    trainer = hfnative.GRPOTrainer(model=str(model_dir), reward_funcs=matches, args=args,
                                   train_dataset=Dataset.from_list(rows))
    trainer.train()
    assert len(texts) == 16 and all(re.fullmatch(regex, text) for text in texts), texts
    free = trainer.objective.engine.generate(PROMPTS, SamplingParams(max_new_tokens=16, seed=3, eos_token_id=EOS))
    assert not any(re.fullmatch(regex, tokenizer.decode([t for t in ids if t != EOS])) for ids in free.completion_ids)
