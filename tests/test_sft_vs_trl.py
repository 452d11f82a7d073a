"""hfnative's SFTTrainer against TRL's on the same tiny model, data, order and settings (fp32).

Per step: loss, grad_norm, mean_token_accuracy and num_tokens agree within 1e-4 relative; the
learning rate is identical. TRL (a dev dependency) is the oracle.
"""

import json
from pathlib import Path

import pytest
import torch
from datasets import Dataset
from transformers import AutoTokenizer

import hfnative
from hfnative.optim.bf16_updates import STATE_OPTIMIZER_NAMES

ROOT = Path(__file__).resolve().parents[1]
MODEL = str(ROOT / "examples" / "tiny-qwen3")
DATA = ROOT / "examples" / "data"
STEPS = 5


def _rows(name: str, n: int = 24) -> list[dict]:
    with open(DATA / name) as f:
        return [json.loads(line) for line in f][:n]


def _dataset(fmt: str) -> Dataset:
    if fmt == "text":
        return Dataset.from_list(_rows("sft_text.jsonl"))
    if fmt == "messages":
        return Dataset.from_list(_rows("sft_messages.jsonl"))
    if fmt == "prompt-completion":
        return Dataset.from_list(_rows("sft_prompt_completion.jsonl"))
    if fmt == "conversational-prompt-completion":
        rows = [{"prompt": r["messages"][:-1], "completion": r["messages"][-1:]} for r in _rows("sft_messages.jsonl")]
        return Dataset.from_list(rows)
    if fmt == "pretokenized":
        tokenizer = AutoTokenizer.from_pretrained(MODEL)
        return Dataset.from_list([{"input_ids": tokenizer(r["text"])["input_ids"]} for r in _rows("sft_text.jsonl")])
    raise KeyError(fmt)


def _config(module, output_dir, accumulation, **extra):
    settings = dict(
        output_dir=str(output_dir),
        use_cpu=True,
        bf16=False,
        report_to="none",
        disable_tqdm=True,
        max_steps=STEPS,
        logging_steps=1,
        save_strategy="no",
        per_device_train_batch_size=3,
        gradient_accumulation_steps=accumulation,
        learning_rate=3e-3,
        lr_scheduler_type="cosine",
        warmup_steps=0.2,
        weight_decay=0.01,
        max_length=64,
    )
    return module.SFTConfig(**{**settings, **extra})


def _run(module, fmt, tmp_path, accumulation, **extra):
    trainer = module.SFTTrainer(
        model=MODEL,
        args=_config(module, tmp_path / module.__name__, accumulation, **extra),
        train_dataset=_dataset(fmt),
        processing_class=AutoTokenizer.from_pretrained(MODEL),
    )
    trainer.train()
    return [entry for entry in trainer.state.log_history if "loss" in entry]


def _assert_same_logs(ours, theirs):
    assert len(ours) == len(theirs) == STEPS
    for mine, reference in zip(ours, theirs):
        step = reference["step"]
        assert mine["step"] == step
        assert mine["learning_rate"] == pytest.approx(reference["learning_rate"], rel=1e-12), step
        assert mine["num_tokens"] == reference["num_tokens"], step
        for key in ("loss", "grad_norm", "entropy", "mean_token_accuracy"):
            assert mine[key] == pytest.approx(reference[key], rel=1e-4, abs=1e-6), (step, key, mine[key], reference[key])
        assert mine["epoch"] == pytest.approx(reference["epoch"]), step


FORMATS = ["text", "messages", "prompt-completion", "conversational-prompt-completion", "pretokenized"]


@pytest.mark.parametrize("accumulation", [1, 2])
@pytest.mark.parametrize("fmt", FORMATS)
def test_per_step_logs_match_trl(fmt, accumulation, tmp_path):
    trl = pytest.importorskip("trl")
    extra = {"assistant_only_loss": True} if fmt == "messages" else {}
    theirs = _run(trl, fmt, tmp_path, accumulation, **extra)
    ours = _run(hfnative, fmt, tmp_path, accumulation, **extra)
    _assert_same_logs(ours, theirs)


@pytest.mark.parametrize("strategy", ["bfd", "wrapped"])
def test_packed_logs_match_trl(strategy, tmp_path):
    trl = pytest.importorskip("trl")
    extra = dict(packing=True, packing_strategy=strategy)
    theirs = _run(trl, "messages", tmp_path, 2, **extra)
    ours = _run(hfnative, "messages", tmp_path, 2, **extra)
    _assert_same_logs(ours, theirs)


@pytest.mark.parametrize(
    "optim, scheduler, scheduler_kwargs",
    [
        ("adamw_torch", "linear", None),
        ("sgd", "constant_with_warmup", None),
        ("adafactor", "polynomial", {"power": 2.0}),
        ("adamw_torch_fused", "cosine_with_min_lr", {"min_lr_rate": 0.1}),
        ("adamw_torch", "warmup_stable_decay", {"num_decay_steps": 2}),
        # bitsandbytes' names: TRL runs bitsandbytes, hfnative the same updates in PyTorch (hfnative.optim)
        ("paged_adamw_32bit", "linear", None),
        ("lion_32bit", "cosine", None),
        ("ademamix", "constant_with_warmup", None),
        ("rmsprop_bnb", "linear", None),
        ("stable_adamw", "cosine", None),
    ],
)
def test_optimizers_and_schedules_match_trl(optim, scheduler, scheduler_kwargs, tmp_path, monkeypatch):
    trl = pytest.importorskip("trl")
    if optim in STATE_OPTIMIZER_NAMES + ("paged_adamw_32bit",):
        pytest.importorskip("bitsandbytes")
    if optim == "stable_adamw":
        optimi_utils = pytest.importorskip("optimi.utils")
    extra = dict(optim=optim, lr_scheduler_type=scheduler, lr_scheduler_kwargs=scheduler_kwargs)
    with monkeypatch.context() as patch:
        if optim == "stable_adamw":  # torch-optimi takes its Triton kernels, which read no CPU tensor, whenever Triton
            patch.setattr(optimi_utils, "HAS_TRITON", False)  # imports; hfnative turns them off itself on a CPU
        theirs = _run(trl, "text", tmp_path, 1, **extra)
    ours = _run(hfnative, "text", tmp_path, 1, **extra)
    _assert_same_logs(ours, theirs)


@pytest.mark.parametrize("optim, in_backward", [("schedule_free_adamw", False), ("schedule_free_sgd", False),
                                               ("schedule_free_adamw", True)])
def test_schedule_free_matches_trl(optim, in_backward, tmp_path):
    """The schedulefree package's optimizers switched as transformers' Trainer switches them: train() before each
    training step, eval() when an evaluation starts (the parameters become the averaged weights, and stay so until
    the next step). Per-step logs, the evaluations during training and after it, and the weights left in the model
    equal TRL's; with optimizer_in_backward each parameter's own optimizer is switched (TRL steps after backward,
    unclipped here as in-backward must be)."""
    trl = pytest.importorskip("trl")
    pytest.importorskip("schedulefree")
    from safetensors.torch import load_file

    evaluation = Dataset.from_list(_rows("eval_messages.jsonl", 6))
    extra = dict(optim=optim, lr_scheduler_type="constant", warmup_steps=2, eval_strategy="steps", eval_steps=2,
                 per_device_eval_batch_size=3, max_grad_norm=0.0 if in_backward else 1.0)
    runs = {}
    for module in (trl, hfnative):
        own = dict(optimizer_in_backward=True) if module is hfnative and in_backward else {}
        trainer = module.SFTTrainer(model=MODEL, args=_config(module, tmp_path / module.__name__, 1, **extra, **own),
                                    train_dataset=_dataset("messages"), eval_dataset=evaluation,
                                    processing_class=AutoTokenizer.from_pretrained(MODEL))
        trainer.train()
        final = trainer.evaluate()
        trainer.save_model(str(tmp_path / module.__name__ / "final"))
        runs[module.__name__] = (trainer.state.log_history, final,
                                 load_file(str(tmp_path / module.__name__ / "final" / "model.safetensors")))
    (ours_logs, ours_final, ours_weights), (trl_logs, trl_final, trl_weights) = runs["hfnative"], runs["trl"]
    _assert_same_logs([e for e in ours_logs if "loss" in e], [e for e in trl_logs if "loss" in e])
    ours_evals, trl_evals = ([e for e in logs if "eval_loss" in e] for logs in (ours_logs, trl_logs))
    assert [e["step"] for e in ours_evals] == [e["step"] for e in trl_evals] == [2, 4, 5, 5]  # the last: evaluate()
    for mine, reference in zip(ours_evals, trl_evals):
        assert mine["eval_loss"] == pytest.approx(reference["eval_loss"], rel=1e-5), mine["step"]
    assert ours_final["eval_loss"] == pytest.approx(trl_final["eval_loss"], rel=1e-5)
    # to 1% of one step's update (lr 3e-3): Adam-like updates amplify fp32 round-off where a gradient is round-off
    # itself (measured: one element of 8,192 in a projection 6e-6 off, the rest within 1e-6)
    assert set(ours_weights) == set(trl_weights)
    for name, value in trl_weights.items():
        torch.testing.assert_close(ours_weights[name], value, rtol=0, atol=3e-5, msg=name)


def test_evaluation_metrics_match_trl(tmp_path):
    trl = pytest.importorskip("trl")
    evaluation = Dataset.from_list(_rows("eval_messages.jsonl", 10))
    metrics = {}
    for module in (trl, hfnative):
        trainer = module.SFTTrainer(
            model=MODEL,
            args=_config(module, tmp_path / module.__name__, 1, per_device_eval_batch_size=4),
            train_dataset=_dataset("messages"),
            eval_dataset=evaluation,
            processing_class=AutoTokenizer.from_pretrained(MODEL),
        )
        trainer.train()
        metrics[module.__name__] = trainer.evaluate()
    ours, theirs = metrics["hfnative"], metrics["trl"]
    assert {k for k in theirs if not k.endswith(("runtime", "per_second"))} == {k for k in ours if not k.endswith(("runtime", "per_second"))}
    for key in ("eval_loss", "eval_entropy", "eval_mean_token_accuracy"):
        assert ours[key] == pytest.approx(theirs[key], rel=1e-4), key
    assert ours["eval_num_tokens"] == theirs["eval_num_tokens"]


@pytest.mark.parametrize("fused_loss", [True, False], ids=["chunked", "materialized"])
def test_dft_loss_matches_trl(fused_loss, tmp_path):
    trl = pytest.importorskip("trl")
    theirs = _run(trl, "prompt-completion", tmp_path, 2, loss_type="dft")
    ours = _run(hfnative, "prompt-completion", tmp_path, 2, loss_type="dft", fused_loss=fused_loss)
    _assert_same_logs(ours, theirs)


def test_neftune_matches_trl(tmp_path):
    """neftune_noise_alpha: transformers' NEFTune hook on the input embeddings while train() runs. The noise comes
    from the same random stream as TRL's, so every step's logs equal TRL's (and differ from a run without it); the
    hook is gone after training."""
    trl = pytest.importorskip("trl")
    theirs = _run(trl, "messages", tmp_path / "trl", 1, neftune_noise_alpha=5.0)
    trainer = hfnative.SFTTrainer(model=MODEL, args=_config(hfnative, tmp_path / "ours", 1, neftune_noise_alpha=5.0),
                                  train_dataset=_dataset("messages"), processing_class=AutoTokenizer.from_pretrained(MODEL))
    trainer.train()
    _assert_same_logs([entry for entry in trainer.state.log_history if "loss" in entry], theirs)
    plain = _run(hfnative, "messages", tmp_path / "plain", 1)
    assert plain[0]["loss"] != pytest.approx(theirs[0]["loss"], rel=1e-6)
    assert trainer.neftune_noise_alpha == 5.0 and not trainer.native_model.get_input_embeddings()._forward_hooks


def test_group_by_length_orders_rows_as_transformers_sampler(tmp_path):
    """train_sampling_strategy="group_by_length": the rows' lengths are those TRL's trainer hands transformers'
    LengthGroupedSampler, the order is that sampler's (mega-batches of the step's rows sorted longest first, the
    longest row in the first batch) drawn from the data seed's generator, epoch by epoch, and the run trains. A
    trainer that makes its own batches (GRPO's prompt groups) refuses it."""
    from transformers.trainer_pt_utils import LengthGroupedSampler

    trl = pytest.importorskip("trl")
    tokenizer = AutoTokenizer.from_pretrained(MODEL)
    made = {}
    for module in (trl, hfnative):
        config = _config(module, tmp_path / module.__name__, 2, train_sampling_strategy="group_by_length")
        made[module.__name__] = module.SFTTrainer(model=MODEL, args=config, train_dataset=_dataset("text"),
                                                  processing_class=tokenizer)
    ours, theirs = made["hfnative"], made["trl"]
    reference = theirs._get_train_sampler()
    assert isinstance(reference, LengthGroupedSampler) and reference.batch_size == 3 * 2
    loader = ours.get_train_dataloader()
    for epoch in (0, 1):
        loader.batch_sampler.set_epoch(epoch)
        reference.generator = torch.Generator().manual_seed(ours.args.seed + epoch)
        expected = list(reference)
        assert [i for batch in loader.batch_sampler for i in batch] == expected
        lengths = reference.lengths
        assert lengths[expected[0]] == max(lengths)
    assert [len(row["input_ids"]) for row in ours.train_dataset] == reference.lengths
    ours.train()
    assert all(entry["loss"] > 0 for entry in ours.state.log_history if "loss" in entry)

    prompts = Dataset.from_list([{"prompt": "Say something"}] * 8)
    with pytest.raises(ValueError, match="group_by_length"):
        hfnative.GRPOTrainer(model=MODEL, reward_funcs=lambda completions, **_: [1.0] * len(completions),
                             args=hfnative.GRPOConfig(output_dir=str(tmp_path / "grpo"), use_cpu=True, bf16=False,
                                                      report_to="none", per_device_train_batch_size=4, num_generations=4,
                                                      train_sampling_strategy="group_by_length"),
                             train_dataset=prompts, processing_class=tokenizer)


def test_torch_empty_cache_steps_empties_where_trl_does(tmp_path, monkeypatch):
    """torch_empty_cache_steps: the device cache emptied in the micro-batches of every N-th step, as TRL's trainer
    (transformers') empties it: the same calls, counted on both."""
    import accelerate.utils.memory
    import transformers.trainer

    trl = pytest.importorskip("trl")
    calls = {"trl": 0, "hfnative": 0}
    current = ["trl"]

    def counted(*args, **kwargs):
        calls[current[0]] += 1

    monkeypatch.setattr(transformers.trainer, "clear_device_cache", counted)  # TRL's step's own call
    _run(trl, "text", tmp_path, 2, torch_empty_cache_steps=2)
    current[0] = "hfnative"
    monkeypatch.setattr(accelerate.utils.memory, "clear_device_cache", counted)
    _run(hfnative, "text", tmp_path, 2, torch_empty_cache_steps=2)
    assert calls["hfnative"] == calls["trl"] == 2 * len(range(0, STEPS, 2))


@pytest.mark.parametrize("mode", ["all", "non_padding"])
def test_input_tokens_seen_match_trl(mode, tmp_path):
    """include_num_input_tokens_seen: every log's num_input_tokens_seen equals TRL's (the input ids' entries, or the
    attention mask's ones, of every micro-batch so far), with transformers' train_tokens_per_second beside it."""
    trl = pytest.importorskip("trl")
    ours = _run(hfnative, "messages", tmp_path / "ours", 2, include_num_input_tokens_seen=mode)
    theirs = _run(trl, "messages", tmp_path / "trl", 2, include_num_input_tokens_seen=mode)
    assert [entry["num_input_tokens_seen"] for entry in ours] == [entry["num_input_tokens_seen"] for entry in theirs]
    assert ours[-1]["num_input_tokens_seen"] > ours[0]["num_input_tokens_seen"] > 0
    assert all({"train_runtime", "train_tokens_per_second"} <= entry.keys() for entry in ours)


def test_group_by_length_resumes_exactly(tmp_path):
    """group_by_length's order comes from the data seed, epoch by epoch: a run resumed from a checkpoint (mid-epoch,
    then across an epoch boundary) logs the uninterrupted run's losses step for step."""

    def run(output_dir, resume=None, save=False):
        config = _config(hfnative, output_dir, 1, train_sampling_strategy="group_by_length")
        config.max_steps = 12  # 8 batches an epoch: a boundary after step 8
        if save:
            config.save_strategy, config.save_steps = "steps", 5
        trainer = hfnative.SFTTrainer(model=MODEL, args=config, train_dataset=_dataset("text"),
                                      processing_class=AutoTokenizer.from_pretrained(MODEL))
        trainer.train(resume_from_checkpoint=resume)
        return {entry["step"]: entry["loss"] for entry in trainer.state.log_history if "loss" in entry}

    whole = run(tmp_path / "whole")
    run(tmp_path / "cut", save=True)
    resumed = run(tmp_path / "cut", resume=str(tmp_path / "cut" / "checkpoint-5"))
    assert [resumed[step] for step in range(6, 13)] == pytest.approx([whole[step] for step in range(6, 13)], rel=1e-6)


def test_ignore_data_skip_resumes_as_trl_does(tmp_path):
    """ignore_data_skip=True: a run resumed mid-epoch starts that epoch from its first batch instead of skipping the
    batches trained before the checkpoint; each runner resumes its own checkpoint, and the resumed steps' losses
    equal TRL's (which also differ from the uninterrupted run's)."""
    trl = pytest.importorskip("trl")

    def resumed(module):
        output_dir = tmp_path / module.__name__
        config = _config(module, output_dir, 1, save_strategy="steps", save_steps=5)
        config.max_steps = 10  # 8 batches an epoch: the resumed run restarts epoch 0 at step 6
        module.SFTTrainer(model=MODEL, args=config, train_dataset=_dataset("text"),
                          processing_class=AutoTokenizer.from_pretrained(MODEL)).train()
        whole = {entry["step"]: entry["loss"] for entry in json.loads(
            (output_dir / "checkpoint-10" / "trainer_state.json").read_text())["log_history"] if "loss" in entry}
        config.ignore_data_skip = True
        trainer = module.SFTTrainer(model=MODEL, args=config, train_dataset=_dataset("text"),
                                    processing_class=AutoTokenizer.from_pretrained(MODEL))
        trainer.train(resume_from_checkpoint=str(output_dir / "checkpoint-5"))
        return whole, {entry["step"]: entry["loss"] for entry in trainer.state.log_history if "loss" in entry}

    (our_whole, ours), (their_whole, theirs) = resumed(hfnative), resumed(trl)
    steps = range(6, 11)
    assert [ours[step] for step in steps] == pytest.approx([theirs[step] for step in steps], rel=1e-4)
    assert ours[6] != pytest.approx(our_whole[6], rel=1e-3) and theirs[6] != pytest.approx(their_whole[6], rel=1e-3)


class _OutOfMemoryAbove:
    """Raises the CUDA allocator's out-of-memory error while the run's train batch size is above ``fits``."""

    def __init__(self, fits: int):
        self.fits, self.sizes_tried = fits, []

    def check(self, state):
        if not self.sizes_tried or self.sizes_tried[-1] != state.train_batch_size:
            self.sizes_tried.append(state.train_batch_size)
        if state.train_batch_size > self.fits:
            raise RuntimeError("CUDA out of memory. Tried to allocate 2.00 GiB")


def test_auto_find_batch_size_as_trl_finds_it(tmp_path):
    """auto_find_batch_size: out of memory at 4 and 3 rows (raised before a step's forward), TRL's trainer and
    hfnative's both try accelerate's sizes 4, 3, 2 and train at 2 with the same losses; the arguments keep the size
    given, the state holds the one trained with."""
    from transformers import TrainerCallback

    trl = pytest.importorskip("trl")
    runs = {}
    for module in (hfnative, trl):
        memory = _OutOfMemoryAbove(fits=2)

        class OutOfMemory(TrainerCallback):
            def on_step_begin(self, args, state, control, **kwargs):
                memory.check(state)

        config = _config(module, tmp_path / module.__name__, 2, auto_find_batch_size=True)
        config.per_device_train_batch_size = 4
        trainer = module.SFTTrainer(model=MODEL, args=config, train_dataset=_dataset("text"),
                                    processing_class=AutoTokenizer.from_pretrained(MODEL), callbacks=[OutOfMemory()])
        trainer.train()
        runs[module.__name__] = (memory.sizes_tried, trainer, [e for e in trainer.state.log_history if "loss" in e])
    (our_sizes, ours, our_logs), (their_sizes, theirs, their_logs) = runs["hfnative"], runs["trl"]
    assert our_sizes == their_sizes == [4, 3, 2]
    assert ours.state.train_batch_size == theirs.state.train_batch_size == 2
    assert ours.args.per_device_train_batch_size == theirs.args.per_device_train_batch_size == 4
    _assert_same_logs(our_logs, their_logs)


def test_auto_find_batch_size_puts_back_what_an_in_backward_optimizer_stepped(tmp_path):
    """With optimizer_in_backward a backward that runs out of memory has already stepped the parameters whose
    gradients came first (the last blocks'): the next try starts from the weights as they were, so the run equals one
    made at the size that fits from the start."""

    def run(name, batch_size, fits=None):
        config = _config(hfnative, tmp_path / name, 1, optimizer_in_backward=True, max_grad_norm=0.0, warmup_steps=0,
                         auto_find_batch_size=fits is not None)
        config.per_device_train_batch_size = batch_size
        trainer = hfnative.SFTTrainer(model=MODEL, args=config, train_dataset=_dataset("text"),
                                      processing_class=AutoTokenizer.from_pretrained(MODEL))
        if fits is not None:  # out of memory in backward, at the first block's first weight (its gradient comes last)
            memory = _OutOfMemoryAbove(fits)
            first = next(p for name, p in trainer.native_model.named_parameters() if ".0." in name and p.dim() == 2)
            first.register_hook(lambda grad: memory.check(trainer.state) or grad)
        trainer.train()
        if fits is not None:
            assert memory.sizes_tried == [4, 3, 2]
        return [value for e in trainer.state.log_history if "loss" in e for value in (e["loss"], e["grad_norm"])]

    plain = run("plain", 2)
    found = run("found", 4, fits=2)
    assert found == pytest.approx(plain, rel=1e-6)

    # a trainer that makes its own batches refuses it, by name
    with pytest.raises(ValueError, match="auto_find_batch_size=True with GRPOTrainer"):
        hfnative.GRPOTrainer(model=MODEL, reward_funcs=lambda completions, **_: [1.0] * len(completions),
                             args=hfnative.GRPOConfig(output_dir=str(tmp_path / "grpo"), use_cpu=True, bf16=False,
                                                      report_to="none", per_device_train_batch_size=4, num_generations=4,
                                                      auto_find_batch_size=True),
                             train_dataset=Dataset.from_list([{"prompt": "Say something"}] * 8),
                             processing_class=AutoTokenizer.from_pretrained(MODEL))


def test_underflow_overflow_debugging_stops_where_trl_does(tmp_path):
    """debug="underflow_overflow": transformers' DebugUnderflowOverflow watches the forwards; a weight set to inf
    stops training with its error (TRL's trainer the oracle), and a sound model trains to the same losses as without
    the hooks."""
    from transformers import AutoModelForCausalLM

    trl = pytest.importorskip("trl")

    def poisoned():
        model = AutoModelForCausalLM.from_pretrained(MODEL, dtype=torch.float32)
        with torch.no_grad():
            model.model.layers[1].mlp.down_proj.weight[0, 0] = float("inf")
        return model

    for module in (hfnative, trl):
        trainer = module.SFTTrainer(model=poisoned(), args=_config(module, tmp_path / module.__name__, 1, debug="underflow_overflow"),
                                    train_dataset=_dataset("text"), processing_class=AutoTokenizer.from_pretrained(MODEL))
        with pytest.raises(ValueError, match="DebugUnderflowOverflow: inf/nan detected"):
            trainer.train()
    _assert_same_logs(_run(hfnative, "text", tmp_path / "watched", 1, debug="underflow_overflow"),
                      _run(trl, "text", tmp_path / "plain", 1))


def test_batch_rebalance_batches_as_trl(tmp_path):
    """train_sampling_strategy="batch_rebalance": the micro-batches of transformers' BatchRebalanceSampler (variable
    row counts, each step's rows balanced by cost), the same rows in each as TRL's train loader gives at the default
    seed, and TRL's losses step for step; a run resumed mid-epoch logs the uninterrupted run's losses."""
    trl = pytest.importorskip("trl")
    settings = dict(train_sampling_strategy="batch_rebalance")

    def micro_batches(module):
        trainer = module.SFTTrainer(model=MODEL, args=_config(module, tmp_path / "loader", 2, **settings),
                                    train_dataset=_dataset("text"), processing_class=AutoTokenizer.from_pretrained(MODEL))
        return [sorted(tuple(row[mask.bool()].tolist()) for row, mask in zip(batch["input_ids"], batch["attention_mask"]))
                for batch in trainer.get_train_dataloader()]

    ours, theirs = micro_batches(hfnative), micro_batches(trl)
    assert ours == theirs and len({len(batch) for batch in ours}) > 1  # rows counts vary: rebalanced, not cut evenly
    _assert_same_logs(_run(hfnative, "text", tmp_path, 2, **settings), _run(trl, "text", tmp_path, 2, **settings))

    def run(output_dir, resume=None):
        config = _config(hfnative, output_dir, 2, save_strategy="steps", save_steps=2, **settings)
        trainer = hfnative.SFTTrainer(model=MODEL, args=config, train_dataset=_dataset("text"),
                                      processing_class=AutoTokenizer.from_pretrained(MODEL))
        trainer.train(resume_from_checkpoint=resume)
        return {entry["step"]: entry["loss"] for entry in trainer.state.log_history if "loss" in entry}

    whole = run(tmp_path / "cut")
    resumed = run(tmp_path / "cut", resume=str(tmp_path / "cut" / "checkpoint-2"))
    assert [resumed[step] for step in range(3, STEPS + 1)] == pytest.approx([whole[step] for step in range(3, STEPS + 1)], rel=1e-6)


def test_auto_find_batch_size_leaves_an_evaluation_out_of_memory_alone(tmp_path):
    """An evaluation that runs out of memory during training is not handed to the batch size search (which shrinks
    the train batch only): transformers' error, asking for a smaller per_device_eval_batch_size, after one try."""
    tries = []

    class EvaluationOutOfMemory(hfnative.SFTTrainer):
        def prediction_step(self, model, inputs, prediction_loss_only=True, ignore_keys=None):
            tries.append(self.state.train_batch_size)
            raise RuntimeError("CUDA out of memory. Tried to allocate 2.00 GiB")

    config = _config(hfnative, tmp_path, 1, auto_find_batch_size=True, eval_strategy="steps", eval_steps=1)
    trainer = EvaluationOutOfMemory(model=MODEL, args=config, train_dataset=_dataset("text"),
                                    eval_dataset=_dataset("text").select(range(3)),
                                    processing_class=AutoTokenizer.from_pretrained(MODEL))
    with pytest.raises(RuntimeError, match="reduce `per_device_eval_batch_size` instead"):
        trainer.train()
    assert tries == [3]
