"""Multi-turn tool-calling rollouts (TRL's ``tools``, ``environment_factory``, ``max_tool_calling_iterations``).

The oracle is TRL's GRPOTrainer on the same model, prompts, tools and fixed completions (its generation patched to
return them; ours given the same through the engine): the tokens of every turn, the tool masks and every logged
number (loss, KL, entropy, clip ratios, completion lengths, tools/* frequencies) over two optimizer steps, for the
Qwen3 chat template (which TRL and hfnative swap for a multi-turn version) and Llama 3.1's (JSON tool calls).
Then the faults TRL has no word for: a tool that raises and one that sleeps past ``tool_call_timeout``, on a
sampled run.
"""

from __future__ import annotations

import json
import shutil
import time
from pathlib import Path

import pytest
import torch

from _launch import torchrun
from test_grpo import MODEL, assert_two_steps_equal

pytestmark = pytest.mark.usefixtures("one_torch_thread")  # tests/conftest.py

G = 4
MAX_COMPLETION = 256


def multiply(a: int, b: int) -> int:
    """Multiply two integers.

    Args:
        a: The first integer.
        b: The second integer.
    """
    return a * b


def explode(x: int) -> int:
    """A tool that always fails.

    Args:
        x: Any integer.
    """
    raise ValueError(f"the tool broke on {x}")


class Calculator:
    """An environment: reset reads the row, multiply is its tool, get_reward scores the episode."""

    def __init__(self):
        self.target, self.calls = None, 0

    def reset(self, target=None, **row):
        self.target, self.calls = target, 0
        return f" (target {target})"

    def multiply(self, a: int, b: int) -> int:
        """Multiply two integers.

        Args:
            a: The first integer.
            b: The second integer.
        """
        self.calls += 1
        return a * b

    def get_reward(self) -> float:
        return float(self.calls) + (self.target or 0) / 100


class Scratchpad:
    """A second environment (no reward of its own, no multiply: a call to it is an unknown tool there)."""

    def reset(self, **row):
        self.notes = []

    def note(self, text: str) -> str:
        """Write a note down.

        Args:
            text: The note.
        """
        self.notes.append(text)
        return "noted"


# --- the models: tiny-qwen3's weights with the released Qwen3 template, and a tiny Llama with Llama 3.1's ----------


def _trl_template(name: str) -> str:
    import trl

    return (Path(trl.__file__).parent / "chat_templates" / name).read_text(encoding="utf-8")


def qwen3_model(folder: Path, max_position_embeddings: int | None = None) -> str:
    shutil.copytree(MODEL, folder)
    (folder / "chat_template.jinja").write_text(_trl_template("qwen3.jinja"), encoding="utf-8")
    if max_position_embeddings is not None:  # room for three tools' schemas (~950 tokens) and the turns
        config = json.loads((folder / "config.json").read_text())
        (folder / "config.json").write_text(json.dumps({**config, "max_position_embeddings": max_position_embeddings}))
    return str(folder)


def qwen3_moe_model(folder: Path) -> str:
    """A random Qwen3-MoE (tests/test_rl_layouts.py) with tiny-qwen3's tokenizer and TRL's Qwen3 template, its
    context as long as tiny-qwen3's (room for the tools' schemas and the turns)."""
    from test_rl_layouts import save_moe_model

    save_moe_model(folder)
    (folder / "chat_template.jinja").write_text(_trl_template("qwen3.jinja"), encoding="utf-8")
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "max_position_embeddings": 1024}))
    return str(folder)


def _tool_layout_models(folder: Path, moe: bool) -> Path:
    """dense/ (qwen3_model), teacher/ (tiny-qwen3-teacher) and, with ``moe``, moe/ (qwen3_moe_model) in ``folder``."""
    qwen3_model(folder / "dense")
    shutil.copytree(Path(MODEL).parent / "tiny-qwen3-teacher", folder / "teacher")
    if moe:
        qwen3_moe_model(folder / "moe")
    return folder


def llama31_model(folder: Path) -> str:
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    tokenizer = AutoTokenizer.from_pretrained(MODEL)
    tokenizer.add_special_tokens({"bos_token": "<|begin_of_text|>", "eos_token": "<|eot_id|>", "additional_special_tokens":
                                  ["<|start_header_id|>", "<|end_header_id|>", "<|eom_id|>"]})
    tokenizer.chat_template = _trl_template("llama3_1.jinja")
    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=2048,
                         bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
                         pad_token_id=tokenizer.pad_token_id)
    torch.manual_seed(0)
    LlamaForCausalLM(config).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return str(folder)


FORMATS = {  # how each template's model writes a tool call, ends its turn, and opens an assistant turn
    "qwen3": dict(build=qwen3_model, end="<|im_end|>", header="<|im_start|>assistant",
                  call=lambda name, args: f'<tool_call>\n{json.dumps({"name": name, "arguments": args})}\n</tool_call>',
                  several_calls=True),
    "llama3.1": dict(build=llama31_model, end="<|eot_id|>", header="<|start_header_id|>assistant",
                     call=lambda name, args: json.dumps({"name": name, "parameters": args}), several_calls=False),
}


def scripted_completion(text: str, index: int, form: dict) -> str:
    """What the "model" writes after ``text`` (the prompt, and the rollout so far): the row's place in its group
    (from ``index`` on the first turn, from what it wrote before on later ones) chooses a plain answer, one call,
    a failing call then an unknown tool, or a call then an answer too long for the budget."""
    turn = text.count(form["header"]) - 1
    number = int(text.split("number ")[1].split()[0].rstrip("?")) if "number " in text else 1
    call, end = form["call"], form["end"]
    if turn == 0:
        kind = index % G
        if kind == 0:
            return "The sky is blue." + end
        if kind == 1:
            return call("multiply", {"a": number, "b": 3}) + end
        if kind == 2:
            calls = [call("multiply", {"a": number, "b": 2}), call("explode", {"x": number})]
            return ("\n".join(calls) if form["several_calls"] else calls[1]) + end
        return call("multiply", {"a": number, "b": 5}) + end
    if "explode" in text:
        return call("divide", {"a": number, "b": 0}) + end if turn == 1 else "Giving up." + end
    if '"b": 5' in text:
        return " ".join(["one two three four five"] * 60)  # no end: cut at the completion budget
    return f"It is {number * 3}." + end


def fixed_ids(tokenizer, prompt_ids: list[list[int]], form: dict, by_prompt: bool = False) -> list[list[int]]:
    """The scripted completions' tokens; ``by_prompt``: the first turn chosen by the prompt's number, not the row's
    place in its group (distillation has no groups)."""
    texts = tokenizer.batch_decode(prompt_ids)
    places = [int(text.split("number ")[1].split()[0]) if by_prompt else i for i, text in enumerate(texts)]
    return [tokenizer(scripted_completion(text, place, form), add_special_tokens=False)["input_ids"][:MAX_COMPLETION]
            for place, text in zip(places, texts)]


def tool_use(completions, **kwargs):
    """0.3 per tool result seen, 0.1 more when the last message is a non-empty answer."""
    return [sum(m["role"] == "tool" for m in c) * 0.3 + (0.1 if c[-1]["role"] == "assistant" and c[-1]["content"] else 0.0)
            for c in completions]


def answer_length(completions, **kwargs):
    return [len(c[-1]["content"]) / 50 for c in completions]


def _prompts(n: int = 8, case: str = "") -> list[dict]:
    rows = [{"prompt": [{"role": "user", "content": f"What is number {i + 2} times three?"}], "target": 3 * i}
            for i in range(n)]
    if case == "environments":
        rows = [{**row, "environment": ("calculator", "scratchpad")[i % 2]} for i, row in enumerate(rows)]
    return rows


def _settings(tmp_path, name, **extra):
    settings = dict(output_dir=str(tmp_path / name), use_cpu=True, bf16=False, report_to="none", disable_tqdm=True,
                    max_steps=2, logging_steps=1, save_strategy="no", per_device_train_batch_size=8,
                    gradient_accumulation_steps=1, num_generations=G, max_completion_length=MAX_COMPLETION,
                    learning_rate=1e-2, seed=0, gradient_checkpointing=False, beta=0.04)
    return {**settings, **extra}


def _trainer_arguments(case: str) -> dict:
    if case == "environment":
        return dict(reward_funcs=[tool_use], environment_factory=Calculator)
    if case == "environments":  # picked per row by its `environment` column
        return dict(reward_funcs=[tool_use], environment_factory={"calculator": Calculator, "scratchpad": Scratchpad})
    return dict(reward_funcs=[tool_use, answer_length], tools=[multiply, explode])


def _run_trl(tmp_path, monkeypatch, model, form, case, **extra):
    import trl
    import trl.trainer.grpo_trainer as trl_grpo
    from datasets import Dataset

    monkeypatch.setattr(trl_grpo, "shuffle_sequence_dict", lambda batch: batch)
    monkeypatch.setenv("TRL_EXPERIMENTAL_SILENCE", "1")
    seen = []

    def generate(self, prompt_ids, images, multimodal_fields, num_generations, has_tool_images=False):
        return fixed_ids(self.processing_class, [list(p) for p in prompt_ids], form), None

    loop = trl.GRPOTrainer._tool_call_loop

    def recorded_loop(self, *args, **kwargs):
        out = loop(self, *args, **kwargs)
        seen.append((out[0], out[2]))  # tool_mask, completion_ids
        return out

    monkeypatch.setattr(trl.GRPOTrainer, "_generate_single_turn", generate)
    monkeypatch.setattr(trl.GRPOTrainer, "_tool_call_loop", recorded_loop)
    trainer = trl.GRPOTrainer(model=model, args=trl.GRPOConfig(**_settings(tmp_path, "trl", **extra)),
                              train_dataset=Dataset.from_list(_prompts(case=case)), **_trainer_arguments(case))
    trainer.train()
    return trainer.state.log_history[:-1], seen


def _run_ours(tmp_path, monkeypatch, model, form, case, **extra):
    import hfnative
    from datasets import Dataset
    from hfnative.generation import Rollouts
    from hfnative.trainers.rollout import tool_calling

    monkeypatch.setenv("TRL_EXPERIMENTAL_SILENCE", "1")
    seen = []
    run = tool_calling.ToolCalling.run

    def recorded_run(self, *args, **kwargs):
        turns = run(self, *args, **kwargs)
        seen.append(([list(m) for m in turns.tool_mask], [list(c) for c in turns.completion_ids]))
        return turns

    monkeypatch.setattr(tool_calling.ToolCalling, "run", recorded_run)
    trainer = hfnative.GRPOTrainer(model=model, args=hfnative.GRPOConfig(**_settings(tmp_path, "ours", **extra)),
                                   train_dataset=Dataset.from_list(_prompts(case=case)), **_trainer_arguments(case))
    tokenizer = trainer.processing_class

    def generate(prompts, sampling):
        completions = fixed_ids(tokenizer, prompts, form)
        return Rollouts(completions, [[0.0] * len(c) for c in completions], ["stop"] * len(completions))

    trainer.objective.engine.generate = generate
    trainer.objective.shuffled_order = torch.arange
    trainer.objective.old_logprobs_source = "forward"
    trainer.train()
    return trainer.state.log_history[:-1], seen


@pytest.mark.parametrize("template, case, extra", [
    ("qwen3", "tools", dict(loss_type="dapo")),
    ("qwen3", "tools", dict(loss_type="grpo", max_tool_calling_iterations=1, mask_truncated_completions=True)),
    ("qwen3", "environment", dict(loss_type="dapo")),
    ("qwen3", "environments", dict(loss_type="dapo")),
    ("llama3.1", "tools", dict(loss_type="dapo")),
], ids=["qwen3-tools", "qwen3-one-turn-masked", "qwen3-environment", "qwen3-environments", "llama3.1-tools"])
def test_multi_turn_rollouts_equal_trl(tmp_path, monkeypatch, template, case, extra):
    form = FORMATS[template]
    model = form["build"](tmp_path / "model")
    theirs, their_turns = _run_trl(tmp_path, monkeypatch, model, form, case, **extra)
    ours, our_turns = _run_ours(tmp_path, monkeypatch, model, form, case, **extra)
    # the same tokens and tool masks in every generation (TRL's come as lists, padding-free)
    assert len(our_turns) == len(their_turns) == 2
    for (our_mask, our_ids), (their_mask, their_ids) in zip(our_turns, their_turns):
        assert our_ids == [list(ids) for ids in their_ids]
        assert our_mask == [list(mask) for mask in their_mask]
    first_masks = our_turns[0][0]
    assert any(0 in mask for mask in first_masks), "no tool result was rendered into a completion"
    assert "tools/call_frequency" in theirs[0] and theirs[0]["tools/call_frequency"] > 0
    if case != "environment":
        assert theirs[0]["tools/failure_frequency"] > 0
    if case != "tools":
        assert "rewards/Calculator/mean" in theirs[0]
    assert_two_steps_equal(ours, theirs)


class _ScriptedEngine:
    """A rollout engine that writes the scripted completions (sampling log-probs 0)."""

    reads_live_weights = True

    def __init__(self, tokenizer, form):
        self.tokenizer, self.form = tokenizer, form

    def generate(self, prompts, sampling):
        from hfnative.generation import Rollouts

        completions = fixed_ids(self.tokenizer, prompts, self.form, by_prompt=True)
        return Rollouts(completions, [[0.0] * len(c) for c in completions], ["stop"] * len(completions))


def test_distillation_multi_turn_equals_trl(tmp_path, monkeypatch):
    """TRL's DistillationTrainer takes tools too: the same tool-masked divergence, entropy, lengths and tools/*."""
    import hfnative
    import trl
    from datasets import Dataset
    from transformers import AutoTokenizer

    form = FORMATS["qwen3"]
    student = qwen3_model(tmp_path / "student")
    teacher = str(Path(MODEL).parent / "tiny-qwen3-teacher")
    monkeypatch.setattr(trl.DistillationTrainer, "_generate_single_turn",
                        lambda self, prompt_ids, *a, **k: fixed_ids(self.processing_class, [list(p) for p in prompt_ids],
                                                                    form, by_prompt=True))

    def run(module, name):
        args = module.DistillationConfig(output_dir=str(tmp_path / name), use_cpu=True, bf16=False, report_to="none",
                                         disable_tqdm=True, logging_steps=1, save_strategy="no", learning_rate=3e-3,
                                         max_steps=2, per_device_train_batch_size=4, max_completion_length=MAX_COMPLETION,
                                         beta=0.5, temperature=1.0, seed=0)
        trainer = module.DistillationTrainer(model=student, teacher_model=teacher, args=args,
                                             train_dataset=Dataset.from_list(_prompts()),
                                             processing_class=AutoTokenizer.from_pretrained(student), tools=[multiply, explode])
        if module is hfnative:
            trainer.objective.rollout.engine = _ScriptedEngine(trainer.processing_class, form)
        trainer.train()
        return [log for log in trainer.state.log_history if "loss" in log]

    theirs, ours = run(trl, "trl"), run(hfnative, "ours")
    assert len(ours) == len(theirs) == 2
    assert theirs[0]["tools/call_frequency"] > 0 and theirs[0]["tools/failure_frequency"] > 0
    for step, (mine, reference) in enumerate(zip(ours, theirs), start=1):
        keys = ["loss", "grad_norm", "entropy", "num_tokens"] + [k for k in reference if k.startswith(("completions/", "tools/"))]
        for key in keys:
            assert mine[key] == pytest.approx(reference[key], rel=1e-6 if step == 1 else 1e-4, abs=1e-6), (step, key)


# --- faults and timeouts on a sampled run ------------------------------------------------------------------------


def slow(seconds: float) -> str:
    """A tool that takes its time.

    Args:
        seconds: How long to sleep.
    """
    time.sleep(seconds)
    return "woke up"


def test_tool_runner_errors_and_timeouts():
    from hfnative.trainers.rollout.tool_runner import ToolRunner

    async def slow_async(seconds: float) -> str:
        import asyncio

        await asyncio.sleep(seconds)
        return "async woke up"

    calls = [{"type": "function", "function": {"name": name, "arguments": arguments}} for name, arguments in
             [("multiply", {"a": 2, "b": 3}), ("explode", {"x": 1}), ("missing", {}), ("slow", {"seconds": 5}),
              ("slow_async", {"seconds": 5}), ("slow_async", {"seconds": 0.0})]]
    calls.append({"type": "code", "name": "shell"})
    start = time.perf_counter()
    results, failures = ToolRunner(timeout=0.2).run(calls, [multiply, explode, slow, slow_async])
    assert time.perf_counter() - start < 2.0  # the sleeping calls were not waited for
    assert results == [("multiply", 6), ("explode", {"error": "the tool broke on 1"}),
                       ("missing", {"error": "Tool missing not found."}),
                       ("slow", {"error": "Tool slow timed out after 0.2 seconds"}),
                       ("slow_async", {"error": "Tool slow_async timed out after 0.2 seconds"}),
                       ("slow_async", "async woke up"), ("shell", {"error": "Unsupported tool call type: code"})]
    assert failures == 5
    assert ToolRunner().run(calls[:1], [multiply]) == ([("multiply", 6)], 0)
    # the rows of a turn at once (the async trainer's generator actors): the same results, in the slowest call's time
    runner = ToolRunner()
    runner.concurrent_rows = True
    rows = [([{"type": "function", "function": {"name": "slow", "arguments": {"seconds": 0.4}}}], [slow])] * 3
    rows.append((calls[:2], [multiply, explode]))
    start = time.perf_counter()
    assert runner.run_rows(rows) == [([("slow", "woke up")], 0)] * 3 + [([("multiply", 6), ("explode", {"error": "the tool broke on 1"})], 1)]
    assert time.perf_counter() - start < 1.0
    with pytest.raises(ValueError, match="tool_call_timeout"):
        ToolRunner(timeout=0)


def test_sampled_run_with_failing_and_slow_tools_goes_on(tmp_path, monkeypatch):
    """Real sampling from the native engine, the model's first turn steered to call each tool (a fixed first
    completion, as a model that has learned the format would write), later turns sampled: the failing and the
    timed-out calls come back as error results in the completions the reward functions see, and training goes on."""
    import hfnative
    from datasets import Dataset

    monkeypatch.setenv("TRL_EXPERIMENTAL_SILENCE", "1")
    model = qwen3_model(tmp_path / "model", max_position_embeddings=2048)
    seen = []

    def record(completions, **kwargs):
        seen.extend(completions)
        return [float(len(c)) for c in completions]

    args = hfnative.GRPOConfig(**_settings(tmp_path, "sampled", max_completion_length=120, tool_call_timeout=0.3,
                                           max_tool_calling_iterations=2, max_steps=2))
    trainer = hfnative.GRPOTrainer(model=model, reward_funcs=record, args=args, train_dataset=Dataset.from_list(_prompts()),
                                   tools=[multiply, explode, slow])
    engine = trainer.objective.engine
    sample = engine.generate
    tokenizer = trainer.processing_class
    form = FORMATS["qwen3"]
    first = [form["call"]("explode", {"x": 1}), form["call"]("slow", {"seconds": 3}), form["call"]("multiply", {"a": 2, "b": 4}),
             "No tools needed."]

    def generate(prompts, sampling):
        out = sample(prompts, sampling)  # sampled: the later turns keep these
        for i, prompt in enumerate(prompts):
            if tokenizer.decode(prompt).count(form["header"]) == 1:  # a first turn: steered
                ids = tokenizer(first[i % 4] + form["end"], add_special_tokens=False)["input_ids"]
                out.completion_ids[i], out.logprobs[i] = ids, [0.0] * len(ids)
        return out

    engine.generate = generate
    start = time.perf_counter()
    trainer.train()
    assert time.perf_counter() - start < 60
    results = [m["content"] for c in seen for m in c if m["role"] == "tool"]
    assert "{'error': 'the tool broke on 1'}" in results
    assert "{'error': 'Tool slow timed out after 0.3 seconds'}" in results
    assert "8" in results
    logs = trainer.state.log_history
    assert [log["step"] for log in logs if "loss" in log] == [1, 2]
    assert logs[0]["tools/call_frequency"] == pytest.approx(0.75)
    assert logs[0]["tools/failure_frequency"] == pytest.approx(2 / 3)
    assert all(torch.isfinite(torch.tensor(log["loss"])) for log in logs if "loss" in log)


def test_tool_settings_are_checked(tmp_path, monkeypatch):
    import hfnative
    from datasets import Dataset

    monkeypatch.setenv("TRL_EXPERIMENTAL_SILENCE", "1")
    data = Dataset.from_list(_prompts())
    args = hfnative.GRPOConfig(**_settings(tmp_path, "no-tools", max_tool_calling_iterations=2))
    with pytest.raises(ValueError, match="max_tool_calling_iterations=2 has no effect without tools"):
        hfnative.GRPOTrainer(model=MODEL, reward_funcs=tool_use, args=args, train_dataset=data)
    # tiny-qwen3's own template renders no tool calls
    args = hfnative.GRPOConfig(**_settings(tmp_path, "plain"))
    with pytest.raises(ValueError, match="does not support tool calling"):
        hfnative.GRPOTrainer(model=MODEL, reward_funcs=tool_use, args=args, train_dataset=data, tools=[multiply])
    with pytest.raises(ValueError, match="No reward source provided"):
        hfnative.GRPOTrainer(model=qwen3_model(tmp_path / "model"), reward_funcs=[], args=args, train_dataset=data,
                             tools=[multiply])


# --- every data-parallel layout equals one process ---------------------------------------------------------------


# GRPO, then DistillationTrainer, with tools under each 2-process layout (tests/_tool_calling_worker.py)
TWO_PROCESS_TOOL_LAYOUTS = ["ddp", "fsdp2", "tp2", "cp2", "ep2",
                            "distill-ddp", "distill-fsdp2", "distill-tp2", "distill-cp2", "distill-ep2"]


def test_tool_rollouts_in_every_layout_equal_one_process(tmp_path):
    """Two processes, GRPO and DistillationTrainer with the same tools, each under DDP, FSDP2, EP2 on a
    mixture-of-experts policy (each rank completes its share of the generation batch), TP2 and CP2 (both ranks
    complete the whole batch alike): the first turns steered by each row's place in the batch, the later turns
    sampled from each row's own stream on the policy's replica, the tools run on each rank; rewards, lengths,
    tools/* and the grad norm equal the one-process run's."""
    from _tool_calling_worker import GLOBAL_BATCH, train, train_distillation

    models = _tool_layout_models(tmp_path / "models", moe=True)
    (tmp_path / "out").mkdir()
    torchrun("_tool_calling_worker.py", [str(tmp_path / "out"), str(models), *TWO_PROCESS_TOOL_LAYOUTS], 2, timeout=600)
    one_process = {name: train(str(models / name), str(tmp_path / f"one-{name}"), GLOBAL_BATCH) for name in ("dense", "moe")}
    for name in ("dense", "moe"):
        one_process[f"distill-{name}"] = train_distillation(str(models / name), str(models / "teacher"),
                                                            str(tmp_path / f"one-kd-{name}"), GLOBAL_BATCH)
    for expected in one_process.values():
        assert len(expected) == 2 and expected[0]["tools/call_frequency"] == pytest.approx(0.75)
        assert expected[0]["tools/failure_frequency"] == pytest.approx(1 / 3)
        assert expected[0]["later_turn_rows"] == 12  # 3 of each 4 rows went on after their tool result, in both steps
    for layout in TWO_PROCESS_TOOL_LAYOUTS:
        model = "moe" if layout.endswith("ep2") else "dense"
        expected = one_process[f"distill-{model}" if layout.startswith("distill-") else model]
        _assert_layout_equals(tmp_path / "out", layout, 2, expected)


def _assert_layout_equals(out: Path, layout: str, processes: int, expected: list[dict]) -> None:
    """Every rank's logs of ``layout`` equal the one-process run's: the same completions (rewards, lengths, tool
    metrics exactly), the grad norm within 1e-5 and the loss within 1e-5 relative or 1e-6 absolute."""
    for rank in range(processes):
        logs = json.loads((out / f"{layout}-rank{rank}.json").read_text())
        assert len(logs) == 2
        for step, (got, want) in enumerate(zip(logs, expected), start=1):
            where = (layout, rank, step)
            for key in ("reward", "completions/mean_length", "completions/max_length", "num_tokens",
                        "tools/call_frequency", "tools/failure_frequency"):
                if key in want or key != "reward":  # distillation has no reward
                    assert got[key] == pytest.approx(want[key], rel=1e-9, abs=1e-9), (where, key)
            assert got["grad_norm"] == pytest.approx(want["grad_norm"], rel=1e-5), where
            assert abs(got["loss"] - want["loss"]) <= max(1e-5 * abs(want["loss"]), 1e-6), where


def test_tool_rollouts_under_fsdp2_x_tp2_equal_one_process(tmp_path):
    """Four processes, FSDP2 x TP2, GRPO and DistillationTrainer: each tensor-parallel pair completes its
    data-parallel rank's share of the generation batch alike; the steered first turns, sampled later turns and tools
    as in the test above."""
    from _tool_calling_worker import GLOBAL_BATCH, train, train_distillation

    models = _tool_layout_models(tmp_path / "models", moe=False)
    (tmp_path / "out").mkdir()
    torchrun("_tool_calling_worker.py", [str(tmp_path / "out"), str(models), "fsdp2xtp2", "distill-fsdp2xtp2"], 4,
             timeout=600)
    expected = train(str(models / "dense"), str(tmp_path / "one-dense"), GLOBAL_BATCH)
    _assert_layout_equals(tmp_path / "out", "fsdp2xtp2", 4, expected)
    expected = train_distillation(str(models / "dense"), str(models / "teacher"), str(tmp_path / "one-kd"), GLOBAL_BATCH)
    _assert_layout_equals(tmp_path / "out", "distill-fsdp2xtp2", 4, expected)