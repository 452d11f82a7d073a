"""Bad input and faults (README's bad-input table): no code runs from a checkpoint, no run on nothing,
every usage mistake is one line and exit status 2, output_dir problems surface before the first step,
and a save killed at any point never leaves a model folder with files missing."""

import json
import os
import shutil
import signal
import subprocess
from pathlib import Path

import datasets
import pytest
import torch
import transformers
from datasets import Dataset, IterableDataset
from test_cli import DATA, QUICK, TINY, _usage_error
from transformers import AutoModelForCausalLM, TrainerCallback

from hfnative import SFTConfig, SFTTrainer
from hfnative.checkpoint import RefusedCheckpointFile
from hfnative.converters import parity
from hfnative.trainers.loop import arguments
from hfnative.trainers.running import cli
from hfnative.trainers.loop.run_guard import LOCK_NAME, RunError, hold_output_dir


def _rows(name: str, n: int) -> list[dict]:
    with open(DATA / name) as f:
        return [json.loads(line) for line, _ in zip(f, range(n))]


def _config(output_dir, **overrides) -> SFTConfig:
    settings = dict(output_dir=str(output_dir), use_cpu=True, bf16=False, report_to="none", disable_tqdm=True,
                    max_steps=1, save_strategy="no", per_device_train_batch_size=4, max_length=64)
    return SFTConfig(**{**settings, **overrides})


class StepRecorder(TrainerCallback):
    def __init__(self):
        self.steps = 0

    def on_step_begin(self, args, state, control, **kwargs):
        self.steps += 1


@pytest.fixture
def quiet_datasets():
    """datasets' Map/Filter progress bars are not part of an error's one line."""
    datasets.disable_progress_bars()
    yield
    datasets.enable_progress_bars()


# --- 1. a checkpoint's files never run code --------------------------------------------------------


class Payload:
    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):  # what unpickling would call: os.mkdir(marker)
        return os.mkdir, (str(self.marker),)


def test_poisoned_checkpoint_files_are_refused_and_never_run(tmp_path):
    low_bit = "adamw_torch_8bit" if transformers.utils.is_torchao_available() else "adamw_torch"
    # optimizer-in-backward with torchao's 8-bit AdamW: its state (tensor subclasses) loads without extra globals
    trainer = SFTTrainer(model=TINY, train_dataset=_rows("sft_text.jsonl", 8), args=_config(
        tmp_path / "out", max_steps=2, save_strategy="steps", save_steps=1, optim=low_bit, optimizer_in_backward=True,
        max_grad_norm=0.0))
    trainer.train()
    genuine = tmp_path / "out" / "checkpoint-1"
    marker = tmp_path / "payload-ran"
    for name in ("optimizer.pt", "scheduler.pt", "rng_state.pth"):
        poisoned = tmp_path / f"poisoned-{name}"
        shutil.copytree(genuine, poisoned)
        torch.save({"state": Payload(marker)}, poisoned / name)
        with pytest.raises(RefusedCheckpointFile, match=rf"poisoned-{name}/{name}: refused to load it.*posix\.mkdir"):
            trainer.train(resume_from_checkpoint=str(poisoned))
        assert not marker.exists()
    (genuine / "scheduler.pt").write_bytes(b"not a torch file")
    with pytest.raises(RefusedCheckpointFile, match="scheduler.pt: refused to load it: it is not a torch file"):
        trainer.train(resume_from_checkpoint=str(genuine))
    # the real files of checkpoint-2 (optimizer, scheduler, numpy RNG state) all load with weights_only
    shutil.copytree(tmp_path / "out" / "checkpoint-2", tmp_path / "resume")
    assert trainer.train(resume_from_checkpoint=str(tmp_path / "resume")).global_step == 2


# --- 2. a run on nothing is an error -------------------------------------------------------------------


def test_rows_that_all_exceed_max_length_are_an_error_not_a_run(tmp_path):
    rows = _rows("sft_prompt_completion.jsonl", 6)
    with pytest.raises(ValueError, match=r"All 6 rows of the dataset were dropped.*max_length=8.*truncation_mode='keep_end'"):
        SFTTrainer(model=TINY, args=_config(tmp_path / "out", max_length=8), train_dataset=rows)
    # a stream is only read as it goes: the trainer finds it empty before the first step (it used to loop forever)
    streamed = IterableDataset.from_generator(lambda: iter(rows))
    trainer = SFTTrainer(model=TINY, args=_config(tmp_path / "out", max_length=8, max_steps=2), train_dataset=streamed)
    with pytest.raises(RunError, match="gives no row to train on"):
        trainer.train()
    trainer = SFTTrainer(model=TINY, train_dataset=rows[:3], args=_config(
        tmp_path / "out", per_device_train_batch_size=4, dataloader_drop_last=True))
    with pytest.raises(RunError, match="its 3 rows do not fill one batch of 4"):
        trainer.train()
    assert not (tmp_path / "out").exists()


def test_model_folder_without_tokenizer_fails_up_front(tmp_path):
    folder = tmp_path / "weights-only"
    folder.mkdir()
    for name in ("config.json", "model.safetensors"):
        shutil.copy(Path(TINY) / name, folder / name)
    with pytest.raises(ValueError, match=rf"model '{folder}' has no tokenizer files"):
        SFTTrainer(model=str(folder), args=_config(tmp_path / "out"), train_dataset=_rows("sft_text.jsonl", 4))


# --- 3. usage mistakes: one line naming the input (and row), exit status 2 -----------------------------


def _write_jsonl(path: Path, rows: list) -> str:
    path.write_text("".join((row if isinstance(row, str) else json.dumps(row)) + "\n" for row in rows))
    return str(path)


def test_usage_mistakes_are_one_line_and_exit_2(capsys, tmp_path, quiet_datasets):
    run = ["--model_name_or_path", TINY, "--output_dir", str(tmp_path / "out"), *QUICK, "--max_steps", "1"]
    text = ["--dataset_name", str(DATA / "sft_text.jsonl")]
    broken_config = tmp_path / "broken-config"
    shutil.copytree(TINY, broken_config)
    (broken_config / "config.json").write_text('{"model_type": "qwen3",\n  "vocab_size": }\n')
    no_tokenizer = tmp_path / "no-tokenizer"
    no_tokenizer.mkdir()
    for name in ("config.json", "model.safetensors"):
        shutil.copy(Path(TINY) / name, no_tokenizer / name)
    lines = [json.dumps(row) for row in _rows("sft_text.jsonl", 3)]
    malformed = _write_jsonl(tmp_path / "malformed.jsonl", [*lines, '{"text": "cut off', lines[0]])
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    ok = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]
    int_content = _write_jsonl(tmp_path / "int.jsonl", [{"messages": [{"role": "user", "content": 7}, ok[1]]}] * 3)
    no_role = _write_jsonl(tmp_path / "no-role.jsonl", [{"messages": ok}, {"messages": [{"content": "hi"}, ok[1]]}])
    odd_role = _write_jsonl(tmp_path / "odd-role.jsonl", [{"messages": ok}] * 2 + [{"messages": [{"role": "robot", "content": "x"}]}])
    strict = tmp_path / "strict.jinja"
    strict.write_text((Path(TINY) / "chat_template.jinja").read_text().replace(
        "{%- for message in messages %}",
        "{%- for message in messages %}{%- if message.role not in ['system', 'user', 'assistant'] %}"
        "{{ raise_exception('Unknown role: ' + message.role) }}{%- endif %}"))

    cases = [
        (["--per_device_train_batch_size", "0", *text], "per_device_train_batch_size=0; it must be at least 1"),
        (["--gradient_accumulation_steps", "0", *text], "gradient_accumulation_steps=0; it must be at least 1"),
        (["--resume_from_checkpoint", "true", *text], "has no checkpoint-N folder to resume from"),
        (["--dataset_name", malformed], "line 4 (row 3) is not valid JSON"),
        (["--dataset_name", str(empty)], "is an empty file"),
        (["--dataset_name", int_content], "Row 0: the chat template could not render its messages (TypeError"),
        (["--dataset_name", no_role], ("Row 1 of the dataset is in no format", "Hint: messages[0] has no 'role'")),
        (["--dataset_name", odd_role, "--chat_template_path", str(strict)], "Row 2: the chat template could not "
                                                                           "render its messages (TemplateError: Unknown role: robot)"),
        (["--dataset_name", str(DATA / "sft_prompt_completion.jsonl"), "--max_length", "8"],
         "All 200 rows of the dataset were dropped"),
    ]
    for extra, expected in cases:
        line = _usage_error(capsys, run + extra)
        assert all(part in line for part in ([expected] if isinstance(expected, str) else expected)), (extra, line)
    model_cases = [(broken_config, f"{broken_config}/config.json is not valid JSON at line 2, column 17"),
                   (no_tokenizer, f"model '{no_tokenizer}' has no tokenizer files")]
    for folder, expected in model_cases:
        argv = ["--model_name_or_path", str(folder), "--output_dir", str(tmp_path / "out"), *QUICK, *text]
        assert expected in _usage_error(capsys, argv)
    assert not (tmp_path / "out").exists()  # a failed start leaves no output folder behind

    assert parity.main(["--model_name_or_path", str(broken_config)]) == 2
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 1 and "config.json is not valid JSON" in err[0], err


def test_malformed_messages_in_a_list_of_rows_name_the_row(tmp_path):
    ok = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]
    rows = [{"messages": ok}] * 3 + [{"messages": [{"role": "user", "content": ["a", "list"]}, ok[1]]}]
    with pytest.raises(ValueError, match=r"Row 3 of the dataset: messages\[\]\.content mixes a list and str"):
        SFTTrainer(model=TINY, args=_config(tmp_path / "out"), train_dataset=rows)
    rows = [{"messages": ok}] * 2 + [{"messages": [{"content": "hi"}, ok[1]]}]  # Arrow fills the missing role with None
    with pytest.raises(ValueError, match=r"Row 2: the chat template could not render .*: messages\[0\] has no 'role'"):
        SFTTrainer(model=TINY, args=_config(tmp_path / "out"), train_dataset=rows)


# --- 4. output_dir: writable, and one run at a time ---------------------------------------------------


def _read_only(folder: Path) -> None:
    folder.mkdir()
    folder.chmod(0o555)
    if os.geteuid() == 0:  # permissions do not stop root; the immutable attribute does
        if subprocess.run(["chattr", "+i", str(folder)], capture_output=True).returncode != 0:
            pytest.skip("running as root without chattr: no folder is read-only")


@pytest.mark.parametrize("case", ["read-only folder", "a file in the way"])
def test_unwritable_output_dir_fails_before_the_first_step(tmp_path, case):
    blocked = tmp_path / "blocked"
    if case == "a file in the way":
        blocked.write_text("")
    else:
        _read_only(blocked)
    recorder = StepRecorder()
    try:
        trainer = SFTTrainer(model=TINY, args=_config(blocked / "run"), train_dataset=_rows("sft_text.jsonl", 4),
                             callbacks=[recorder])
        with pytest.raises(RunError, match=rf"output_dir '{blocked}/run' cannot be written"):
            trainer.train()
    finally:
        if case != "a file in the way" and os.geteuid() == 0:
            subprocess.run(["chattr", "-i", str(blocked)], check=True)
    assert recorder.steps == 0


def test_second_concurrent_run_on_one_output_dir_is_refused(tmp_path, capsys, quiet_datasets):
    out = tmp_path / "out"
    ready_read, ready_write = os.pipe()
    holder = os.fork()
    if holder == 0:  # another process claiming output_dir, as a run's first step does
        try:
            hold_output_dir(out)
            os.write(ready_write, b"1")
            signal.pause()
        finally:
            os._exit(1)
    try:
        assert os.read(ready_read, 1) == b"1"
        trainer = SFTTrainer(model=TINY, args=_config(out), train_dataset=_rows("sft_text.jsonl", 4))
        with pytest.raises(RunError, match=rf"output_dir '{out}' is in use by another run \(process {holder} holds"):
            trainer.train()
        argv = ["--model_name_or_path", TINY, "--dataset_name", str(DATA / "sft_text.jsonl"), "--output_dir", str(out), *QUICK]
        assert "is in use by another run" in _usage_error(capsys, argv)
    finally:
        os.kill(holder, signal.SIGKILL)
        os.waitpid(holder, 0)
    # the kernel dropped the dead holder's lock: no stale lock to clean up, the run goes ahead
    assert (out / LOCK_NAME).exists() and trainer.train().global_step == 1


# --- 5. repr(args) keeps transformers' masking of the Hub token ----------------------------------------


def test_repr_of_every_config_class_masks_the_hub_token(tmp_path):
    classes = [c for c in vars(arguments).values() if isinstance(c, type) and issubclass(c, transformers.TrainingArguments)]
    assert {c.__name__ for c in classes} >= {"TrainingArguments", "SFTConfig"}
    for config_class in classes:
        args = config_class(output_dir=str(tmp_path), use_cpu=True, bf16=False, hub_token="hf_secret_value")
        assert "hf_secret_value" not in repr(args) and "hf_secret_value" not in str(args)
        assert "hub_token=<HUB_TOKEN>" in repr(args) and repr(args).startswith(f"{config_class.__name__}(")


# --- 6. save_model: files appear whole, config.json last ----------------------------------------------


def _names(folder: Path) -> set[str]:
    return {p.name for p in folder.iterdir() if not p.name.startswith(".")}


def _save_killed_at(trainer, out: Path, rename: int) -> None:
    """save_model in a forked child that SIGKILLs itself just before its ``rename``-th os.replace."""
    child = os.fork()
    if child == 0:
        try:
            torch.set_num_threads(1)
            real_replace, calls = os.replace, [0]

            def replace_or_die(source, target):
                calls[0] += 1
                if calls[0] == rename:
                    os.kill(os.getpid(), signal.SIGKILL)
                real_replace(source, target)

            os.replace = replace_or_die
            trainer.save_model(str(out))
        finally:
            os._exit(0)
    _, status = os.waitpid(child, 0)
    assert os.WIFSIGNALED(status) or os.WEXITSTATUS(status) == 0


def test_save_model_killed_at_any_rename_never_leaves_a_model_with_missing_files(tmp_path):
    trainer = SFTTrainer(model=TINY, args=_config(tmp_path / "run"), train_dataset=_rows("sft_text.jsonl", 4))
    trainer.save_model(str(tmp_path / "complete"))
    complete = _names(tmp_path / "complete")
    assert {"config.json", "model.safetensors", "tokenizer.json", "README.md", "training_args.bin"} <= complete
    earlier = tmp_path / "earlier"  # a folder that already holds a save (and a checkpoint) before the kill
    trainer.save_model(str(earlier))
    (earlier / "checkpoint-1").mkdir()
    seen = set()
    for rename in range(1, 30):
        fresh = tmp_path / f"fresh-{rename}"
        _save_killed_at(trainer, fresh, rename)
        names = _names(fresh) if fresh.exists() else set()
        assert "config.json" not in names or names >= complete, (rename, complete - names)
        seen.add(frozenset(names))
        _save_killed_at(trainer, earlier, rename)
        assert _names(earlier) >= complete, rename
        if names == complete:  # this kill came after the last rename
            break
    assert len(seen) > 3 and names == complete  # kills landed before, between and after the renames
    AutoModelForCausalLM.from_pretrained(str(earlier))
    save = tmp_path / "fresh-1"
    trainer.save_model(str(save))  # a save after a crash clears the staging folder left behind
    assert _names(save) == complete and not [p for p in save.iterdir() if p.name.startswith(".")]
