"""hfnative-train and examples/sft.py: TRL's flags, YAML configs, dataset sources, clear usage errors,
and an output folder with the same files as TRL's (TRL runs the same script beside ours)."""

import dataclasses
import importlib.resources
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from datasets import Dataset, DatasetDict
from transformers import AutoModelForCausalLM, AutoTokenizer

from hfnative import SFTConfig
from hfnative.trainers.running import cli
from hfnative.trainers.running.script_arguments import (
    ModelArguments,
    ScriptArguments,
    load_dataset_dict,
    model_init_kwargs_from,
    peft_config_from,
)

ROOT = Path(__file__).resolve().parents[1]
TINY = str(ROOT / "examples" / "tiny-qwen3")
DATA = ROOT / "examples" / "data"
QUICK = ["--use_cpu", "--bf16", "false", "--report_to", "none", "--disable_tqdm", "--max_length", "64",
         "--per_device_train_batch_size", "4", "--logging_steps", "1"]
# subprocesses: offline, no telemetry, one thread each so two can share the machine's cores
SUBPROCESS_ENV = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "HF_HUB_DISABLE_TELEMETRY": "1",
                  "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}


def _rows(name: str, n: int) -> list[dict]:
    with open(DATA / name) as f:
        return [json.loads(line) for line, _ in zip(f, range(n))]


def _saved_args(output_dir: Path):
    return torch.load(output_dir / "training_args.bin", weights_only=False)


def _usage_error(capsys, argv) -> str:
    with pytest.raises(SystemExit) as exit_info:
        cli.main(argv)
    # datasets draws progress bars (with carriage returns) when it first builds a split; those are not the error
    lines = [line.split("\r")[-1] for line in capsys.readouterr().err.splitlines()]
    lines = [line for line in lines if line and not line.startswith("Generating ")]
    assert exit_info.value.code == 2
    assert len(lines) == 1 and lines[0].startswith("hfnative-train: error: "), lines
    return lines[0]


# --- help ----------------------------------------------------------------------------------------


def test_help_lists_every_field_grouped(capsys):
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["--help"])
    assert exit_info.value.code == 0
    text = capsys.readouterr().out
    groups = ["script arguments:", "model arguments:", "training arguments (SFTConfig):"]
    assert all(g in text for g in groups) and text.index(groups[1]) < text.index(groups[2])
    for dtype in (ScriptArguments, ModelArguments, SFTConfig):
        for f in dataclasses.fields(dtype):
            if f.init:
                assert f"\n  --{f.name} " in text or f"\n  --{f.name}\n" in text, f.name
    assert "--learning_rate FLOAT" in text and "(default: 2e-05)" in text and "--no_logging_nan_inf_filter" in text
    assert max(len(line) for line in text.splitlines()) <= 140  # readable: no screen-wide usage line


def _console_script(*args: str) -> subprocess.CompletedProcess:
    script = Path(sys.executable).parent / "hfnative-train"
    return subprocess.run([str(script), *args], capture_output=True, text=True, timeout=120, env=SUBPROCESS_ENV)


def test_console_script_help_without_library_noise():
    done = _console_script("--help")
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("usage: hfnative-train sft") and "model arguments:" in done.stdout
    # torchao's "Failed to load ..." and torch's pytree deprecation, logged while transformers imports torchao
    # (the indented "Deprecated ..." lines are the help of deprecated flags, not a warning)
    noise = [line for line in (done.stdout + done.stderr).splitlines()
             if "Failed to load" in line or ("deprecat" in line.lower() and not line.startswith(" "))]
    assert done.stderr == "" and not noise, noise


def test_console_script_bad_flag_prints_one_line():
    done = _console_script("--bogus")
    lines = (done.stdout + done.stderr).splitlines()
    assert done.returncode == 2
    assert lines == ["hfnative-train: error: unknown argument '--bogus'; see hfnative-train sft --help"], lines


# --- usage errors: one line on stderr, exit status 2 --------------------------------------------


def test_usage_errors_are_one_line_and_exit_2(capsys, tmp_path):
    broken = tmp_path / "broken.yaml"
    broken.write_text("learning_rate: 1e-3\nmax_steps: [3\n")
    misspelt = tmp_path / "misspelt.yaml"
    misspelt.write_text("lerning_rate: 1e-3\n")
    a_list = tmp_path / "list.yaml"
    a_list.write_text("- learning_rate\n")
    run = ["--model_name_or_path", TINY, "--output_dir", str(tmp_path / "out"), *QUICK]

    assert "unknown argument '--lerning_rate' (did you mean '--learning_rate'?)" in _usage_error(capsys, ["--lerning_rate", "1"])
    assert "unknown command 'sfft' (did you mean 'sft'?)" in _usage_error(capsys, ["sfft", "--model_name_or_path", TINY])
    assert "not valid YAML at line 3" in _usage_error(capsys, ["--config", str(broken)])
    assert "unknown argument 'lerning_rate'" in _usage_error(capsys, ["--config", str(misspelt)])
    assert "expected a mapping" in _usage_error(capsys, ["--config", str(a_list)])
    assert "cannot read it" in _usage_error(capsys, ["--config", str(tmp_path / "absent.yaml")])
    assert "invalid float value: 'fast'" in _usage_error(capsys, ["--learning_rate", "fast"])
    assert "invalid choice: 'cosin'" in _usage_error(capsys, ["--lr_scheduler_type", "cosin"])
    assert "dataset_name is required" in _usage_error(capsys, run)
    jsonl = ["--dataset_name", str(DATA / "sft_text.jsonl")]
    assert "no split 'trian' (available: train)" in _usage_error(capsys, run + jsonl + ["--dataset_train_split", "trian"])
    assert "no split 'test' (available: train)" in _usage_error(capsys, run + jsonl + ["--eval_strategy", "steps"])
    assert "no such file or folder" in _usage_error(capsys, run + ["--dataset_name", str(tmp_path / "absent.jsonl")])
    assert "cannot both be set" in _usage_error(capsys, run + jsonl + ["--load_in_8bit", "--load_in_4bit"])
    if not torch.cuda.is_available():  # TRL's bf16 default on a CPU-only machine
        cpu_run = ["--model_name_or_path", TINY, "--output_dir", str(tmp_path / "out"), *jsonl]
        assert "pass --bf16 false" in _usage_error(capsys, cpu_run)
    assert not (tmp_path / "out").exists()


# --- runs ----------------------------------------------------------------------------------------


def test_yaml_config_bare_and_no_flags(tmp_path, monkeypatch):
    out = tmp_path / "out"
    config = tmp_path / "sft.yaml"
    config.write_text(
        f"model_name_or_path: {TINY}\ndataset_name: {DATA / 'sft_messages.jsonl'}\noutput_dir: {out}\n"
        "learning_rate: 1e-3\nweight_decay: 1e-2\nmax_steps: 3\nsave_steps: 3\nlr_scheduler_type: cosine\n"
        "env:\n  HFNATIVE_CLI_TEST: from-yaml\n"
    )
    monkeypatch.delenv("HFNATIVE_CLI_TEST", raising=False)
    assert cli.main(["sft", "--config", str(config), *QUICK, "--learning_rate", "3e-3",
                     "--logging_first_step", "--no_logging_nan_inf_filter", "--assistant_only_loss"]) == 0
    args = _saved_args(out)
    assert args.learning_rate == 3e-3  # the flag beats the YAML
    assert args.max_steps == 3 and args.lr_scheduler_type.value == "cosine"  # from the YAML
    assert args.weight_decay == 0.01  # YAML reads 1e-2 as a string; the flag's type makes it a float
    assert args.logging_first_step is True and args.assistant_only_loss is True  # bare flags
    assert args.logging_nan_inf_filter is False and args.bf16 is False  # --no_flag, "--bf16 false"
    assert args.model_init_kwargs == {"revision": "main", "dtype": "float32"}
    assert os.environ["HFNATIVE_CLI_TEST"] == "from-yaml"
    monkeypatch.delenv("HFNATIVE_CLI_TEST")
    state = json.loads((out / "checkpoint-3" / "trainer_state.json").read_text())
    assert [entry["step"] for entry in state["log_history"] if "loss" in entry] == [1, 2, 3]
    # a Hub-format folder transformers loads, with the trained weights
    model = AutoModelForCausalLM.from_pretrained(str(out))
    assert not torch.equal(model.model.embed_tokens.weight, AutoModelForCausalLM.from_pretrained(TINY).model.embed_tokens.weight)
    assert AutoTokenizer.from_pretrained(str(out)).chat_template
    assert (out / "README.md").read_text().startswith("---\n")


def _save_to_disk_with_test_split(path: Path) -> Path:
    DatasetDict({"train": Dataset.from_list(_rows("sft_messages.jsonl", 16)),
                 "test": Dataset.from_list(_rows("eval_messages.jsonl", 8))}).save_to_disk(str(path))
    return path


def _csv(path: Path) -> Path:
    Dataset.from_list(_rows("sft_prompt_completion.jsonl", 16)).to_csv(str(path), index=False)
    return path


def _parquet(path: Path) -> Path:
    Dataset.from_list(_rows("sft_text.jsonl", 16)).to_parquet(str(path))
    return path


@pytest.mark.parametrize("make, name, evaluate", [
    (_save_to_disk_with_test_split, "saved", True),
    (_csv, "data.csv", False),
    (_parquet, "data.parquet", False),
])
def test_dataset_sources(make, name, evaluate, tmp_path):
    dataset = make(tmp_path / name)
    out = tmp_path / "out"
    extra = ["--eval_strategy", "steps", "--eval_steps", "2"] if evaluate else []
    cli.main(["--model_name_or_path", TINY, "--dataset_name", str(dataset), "--output_dir", str(out), *QUICK,
              "--max_steps", "2", "--save_steps", "2", *extra])
    log = json.loads((out / "checkpoint-2" / "trainer_state.json").read_text())["log_history"]
    assert [e["step"] for e in log if "loss" in e] == [1, 2]
    assert any("eval_loss" in e for e in log) == evaluate  # the test split is evaluated when eval_strategy asks
    AutoModelForCausalLM.from_pretrained(str(out))


def test_local_folders_of_files_and_saved_datasets(tmp_path):
    files = tmp_path / "files"
    files.mkdir()
    Dataset.from_list(_rows("sft_text.jsonl", 6)).to_json(str(files / "train.jsonl"))
    Dataset.from_list(_rows("sft_text.jsonl", 3)).to_json(str(files / "test.jsonl"))
    splits = load_dataset_dict(str(files))
    assert {name: len(split) for name, split in splits.items()} == {"train": 6, "test": 3}
    Dataset.from_list(_rows("sft_text.jsonl", 5)).save_to_disk(str(tmp_path / "one"))
    assert {name: len(split) for name, split in load_dataset_dict(str(tmp_path / "one")).items()} == {"train": 5}
    (tmp_path / "notes.txt").write_text("x")
    with pytest.raises(ValueError, match=r"\.txt file; expected one of \.json, \.jsonl, \.parquet, \.csv"):
        load_dataset_dict(str(tmp_path / "notes.txt"))


# --- LoRA / 4-bit flags --------------------------------------------------------------------------


def test_peft_and_4bit_flags_reach_the_trainer(tmp_path, monkeypatch):
    received = {}

    class Recorder:
        def __init__(self, **kwargs):
            received.update(kwargs)
            raise KeyboardInterrupt  # stop before loading anything

    monkeypatch.setitem(cli.COMMANDS, "sft", dataclasses.replace(cli.COMMANDS["sft"], trainer_class=Recorder))
    with pytest.raises(KeyboardInterrupt):
        cli.main(["--model_name_or_path", TINY, "--dataset_name", str(DATA / "sft_text.jsonl"), "--output_dir",
                  str(tmp_path), *QUICK, "--use_peft", "--lora_r", "8", "--lora_target_modules", "q_proj", "v_proj",
                  "--lora_modules_to_save", "lm_head", "--load_in_4bit", "--dtype", "bfloat16"])
    assert received["peft_config"] == {"r": 8, "lora_alpha": 32, "lora_dropout": 0.05, "target_modules": ["q_proj", "v_proj"],
                                       "modules_to_save": ["lm_head"], "bias": "none", "task_type": "CAUSAL_LM"}
    assert received["args"].model_init_kwargs == {"revision": "main", "dtype": "bfloat16", "load_in_4bit": True}

    # examples/sft_lora.yaml: one target module ("all-linear") is passed on as a string, as in TRL
    parser = cli.COMMANDS["sft"].parser("sft")
    script_args, training_args, model_args = parser.parse(["--config", str(ROOT / "examples" / "sft_lora.yaml")])
    assert peft_config_from(model_args) == {"r": 16, "lora_alpha": 32, "lora_dropout": 0.05, "target_modules": "all-linear",
                                            "modules_to_save": None, "bias": "none", "task_type": "CAUSAL_LM"}
    assert model_init_kwargs_from(model_args, training_args) == {"revision": "main", "dtype": "float32"}
    assert peft_config_from(ModelArguments()) is None


def test_lora_config_trains_an_adapter(tmp_path, monkeypatch):
    monkeypatch.chdir(ROOT)  # the example config's paths are relative to the repository root
    out = tmp_path / "lora"
    cli.main(["--config", "examples/sft_lora.yaml", "--output_dir", str(out), "--max_steps", "2", "--disable_tqdm"])
    adapter = json.loads((out / "adapter_config.json").read_text())
    assert (adapter["peft_type"], adapter["r"], adapter["lora_alpha"], adapter["lora_dropout"]) == ("LORA", 16, 32, 0.05)
    adapted = {name.rsplit(".", 1)[-1] for name in adapter["target_modules"]}  # all-linear
    assert {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"} <= adapted
    assert (out / "adapter_model.safetensors").exists() and not (out / "model.safetensors").exists()
    assert "library_name: peft" in (out / "README.md").read_text()


def test_load_in_8bit_trains_an_adapter_on_an_int8_base(tmp_path, monkeypatch):
    """TRL's --load_in_8bit with --use_peft: the base's linears stored as int8 rows, the adapter trained and saved."""
    from hfnative.peft import quantize

    made = []
    real = quantize.to_int8_parameter
    monkeypatch.setattr(quantize, "to_int8_parameter", lambda *a, **k: made.append(real(*a, **k)) or made[-1])
    out = tmp_path / "int8"
    cli.main(["--model_name_or_path", TINY, "--dataset_name", str(DATA / "sft_text.jsonl"), "--output_dir", str(out),
              *QUICK, "--max_steps", "2", "--use_peft", "--lora_target_modules", "q_proj", "v_proj", "--load_in_8bit"])
    assert len(made) == 2 * 7 and all(p.data_int8.dtype == torch.int8 for p in made)  # 2 layers x 7 projections
    assert (out / "adapter_model.safetensors").exists() and not (out / "model.safetensors").exists()
    assert json.loads((out / "adapter_config.json").read_text())["r"] == 16


# --- examples/sft.py, on hfnative and on TRL -----------------------------------------------------


def test_example_script_writes_the_same_files_as_trl(tmp_path):
    script = (ROOT / "examples" / "sft.py").read_text()
    ours_import = "from hfnative import SFTConfig, SFTTrainer\n"
    assert ours_import in script
    trl_script = tmp_path / "sft_trl.py"
    trl_script.write_text(script.replace(ours_import, "from trl import SFTConfig, SFTTrainer\n"))
    overrides = ["--max_steps", "2", "--save_steps", "2", "--logging_steps", "1", "--disable_tqdm"]
    runs = {
        name: subprocess.Popen(
            [sys.executable, str(path), "--config", "examples/sft_full.yaml", "--output_dir", str(tmp_path / name), *overrides],
            cwd=ROOT, env=SUBPROCESS_ENV, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        )
        for name, path in [("ours", ROOT / "examples" / "sft.py"), ("trl", trl_script)]
    }
    for name, process in runs.items():
        output, _ = process.communicate(timeout=300)
        assert process.returncode == 0, f"{name}:\n{output[-3000:]}"

    def names(folder: Path) -> set[str]:
        return {p.name for p in folder.iterdir()}

    assert names(tmp_path / "ours") == names(tmp_path / "trl")
    assert names(tmp_path / "ours" / "checkpoint-2") == names(tmp_path / "trl" / "checkpoint-2")
    assert {"README.md", "model.safetensors", "config.json", "tokenizer.json", "training_args.bin", "checkpoint-2"} <= names(tmp_path / "ours")
    losses = {name: [e["loss"] for e in json.loads((tmp_path / name / "checkpoint-2" / "trainer_state.json").read_text())["log_history"]
                     if "loss" in e] for name in runs}
    assert losses["ours"] == pytest.approx(losses["trl"], rel=1e-4)


# --- launching processes: TRL's --num_processes / --accelerate_config --------------------------------


def _launched_with(monkeypatch, argv, outcome=None) -> list:
    """cli.main(argv) with accelerate's launch_command replaced by a recorder (``outcome``: what it raises);
    returns [(main's exit status, the parsed accelerate launch arguments, the marker the processes see)]."""
    calls = []

    def launch_command(args):
        calls.append((args, os.environ.get(cli.LAUNCHED_BY_CLI)))
        if outcome is not None:
            raise outcome

    monkeypatch.setattr("accelerate.commands.launch.launch_command", launch_command)
    status = cli.main(argv)
    return [(status, *call) for call in calls]


def test_launch_flags_start_the_run_through_accelerate_launch(monkeypatch, tmp_path):
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    monkeypatch.delenv("LOCAL_RANK", raising=False)
    training = ["--model_name_or_path", TINY, "--dataset_name", str(DATA / "sft_text.jsonl"), *QUICK,
                "--output_dir", str(tmp_path / "out"), "--debug", "underflow_overflow"]
    argv = ["sft", *training[:2], "--num_processes", "2", *training[2:], "--accelerate_config", "fsdp2",
            "--mixed_precision=no", "--main_process_port", "29555"]
    [(status, launch, marker)] = _launched_with(monkeypatch, argv)
    assert status == 0 and marker == "1" and cli.LAUNCHED_BY_CLI not in os.environ
    trl_fsdp2 = Path(importlib.resources.files("trl.accelerate_configs").joinpath("fsdp2.yaml"))
    assert Path(launch.config_file) == trl_fsdp2
    assert (launch.num_processes, launch.mixed_precision, launch.main_process_port) == (2, "no", 29555)
    # every process runs this command again, without the launch flags (--debug is the training argument, as in TRL)
    assert launch.module and launch.training_script == "hfnative.trainers.running.cli"
    assert launch.training_script_args == ["sft", *training]
    assert not launch.multi_gpu and not (tmp_path / "out").exists()  # the config decides; nothing trained here

    # no accelerate config: accelerate would start one process where it finds fewer than two GPUs
    monkeypatch.setattr("accelerate.commands.config.config_args.default_config_file", str(tmp_path / "none.yaml"))
    [(status, launch, _)] = _launched_with(monkeypatch, ["--num_processes", "2", "--model_name_or_path", TINY])
    assert launch.multi_gpu and launch.config_file is None and launch.training_script_args == ["sft", "--model_name_or_path", TINY]

    # an accelerate config file given by path, and the launch settings of a --config YAML (TRL passes them on too)
    config = tmp_path / "sft.yaml"
    config.write_text(f"model_name_or_path: {TINY}\nnum_processes: 2\naccelerate_config: {trl_fsdp2}\nmax_steps: 3\n")
    [(status, launch, _)] = _launched_with(monkeypatch, ["--config", str(config), "--num_processes", "3"])
    assert Path(launch.config_file) == trl_fsdp2 and launch.num_processes == 3  # the command line beats the YAML
    assert launch.training_script_args == ["sft", "--config", str(config)]
    # in the processes it started, the YAML's launch settings were applied already
    monkeypatch.setenv(cli.LAUNCHED_BY_CLI, "1")
    parser = cli.COMMANDS["sft"].parser("sft")
    assert parser.launch_arguments(["--config", str(config), "--bf16", "false"]) == ([], ["--config", str(config), "--bf16", "false"])
    assert parser.parse(["--config", str(config), "--bf16", "false"])[1].max_steps == 3


def test_launch_exit_status_is_the_runs(monkeypatch):
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, ProcessFailure

    argv = ["--num_processes", "2", "--accelerate_config", "multi_gpu", "--model_name_or_path", TINY]
    [(status, _, _)] = _launched_with(monkeypatch, argv, subprocess.CalledProcessError(3, ["python"]))
    assert status == 3
    for exitcode, expected in [(2, 2), (-9, 137)]:  # a usage error in the processes; a process killed by SIGKILL
        failure = ProcessFailure(local_rank=1, pid=1, exitcode=exitcode, error_file="<N/A>")
        [(status, _, _)] = _launched_with(monkeypatch, argv, ChildFailedError("hfnative.trainers.running.cli", {1: failure}))
        assert status == expected


@pytest.mark.parametrize("name, stage", [("zero1", 1), ("zero2", 2), ("zero3", 3)])
def test_trls_deepspeed_configs_without_deepspeed_start_torchrun_processes(name, stage, monkeypatch, tmp_path):
    """TRL's zero1/2/3 configs where deepspeed is not installed (accelerate's launcher would stop with an ImportError):
    the same accelerate settings as torchrun processes (MULTI_GPU), each given the config's ZeRO settings as
    --deepspeed, which the processes' arguments run as its FSDP2 layout."""
    from accelerate.commands.config.config_args import load_config_from_file

    from hfnative.trainers.running.parallel_plan import resolve_parallel_plan

    monkeypatch.delenv("WORLD_SIZE", raising=False)
    monkeypatch.delenv("LOCAL_RANK", raising=False)
    seen = _deepspeed_launches(monkeypatch)
    training = ["--model_name_or_path", TINY, "--output_dir", str(tmp_path / "out"), "--bf16", "false"]
    assert cli.main(["sft", *training, "--num_processes", "2", "--accelerate_config", name,
                     "--mixed_precision", "no"]) == 0
    [(config, launch, validated)] = seen
    trl_config = load_config_from_file(str(importlib.resources.files("trl.accelerate_configs").joinpath(f"{name}.yaml")))
    expected = {key: value for key, value in trl_config.to_dict().items() if key != "deepspeed_config"}
    assert config == dict(expected, distributed_type="MULTI_GPU")  # the rest of TRL's settings as they were
    assert (launch.num_processes, launch.mixed_precision) == (2, "no")
    assert validated.multi_gpu and not validated.use_deepspeed  # accelerate then starts torchrun's processes
    command, *args = launch.training_script_args
    assert command == "sft" and args[:-2] == training and args[-2] == "--deepspeed"
    assert json.loads(args[-1])["zero_optimization"] == {"stage": stage, "offload_optimizer": {"device": "none"},
                                                         "offload_param": {"device": "none"}}
    parsed = cli.COMMANDS["sft"].parser("sft").parse(args)[1]  # what each process makes of its command line
    plan = resolve_parallel_plan(parsed, 2)
    assert (plan.dims.dp_shard, plan.reshard_after_forward) == (2, stage == 3)
    assert f"DeepSpeed ZeRO-{stage}" in plan.source


def _deepspeed_launches(monkeypatch) -> list:
    """Launches recorded with deepspeed not installed: (the accelerate config each reads, its arguments, and the
    arguments accelerate's own validation makes of them: which launcher it picks)."""
    import copy

    from accelerate.commands import launch as accelerate_launch
    from accelerate.commands.config.config_args import load_config_from_file

    monkeypatch.delenv("WORLD_SIZE", raising=False)
    monkeypatch.delenv("LOCAL_RANK", raising=False)
    monkeypatch.setattr("accelerate.utils.is_deepspeed_available", lambda: False)
    seen = []

    def record(launch):
        validated, *_ = accelerate_launch._validate_launch_command(copy.deepcopy(launch))
        seen.append((load_config_from_file(launch.config_file).to_dict(), launch, validated))

    monkeypatch.setattr("accelerate.commands.launch.launch_command", record)
    return seen


def test_deepspeed_launch_flags_one_process_and_conflicts(capsys, monkeypatch, tmp_path):
    """accelerate's DeepSpeed flags take priority over the config's (as accelerate gives them); one process runs as
    one process; what cannot run without DeepSpeed's own launcher, or names two DeepSpeed configs, is refused."""
    seen = _deepspeed_launches(monkeypatch)
    run = ["sft", "--model_name_or_path", TINY, "--output_dir", str(tmp_path / "out")]
    assert cli.main([*run, "--num_processes", "2", "--accelerate_config", "zero2", "--zero_stage", "3",
                     "--offload_param_device", "cpu"]) == 0
    assert json.loads(seen[-1][1].training_script_args[-1])["zero_optimization"] == {
        "stage": 3, "offload_optimizer": {"device": "none"}, "offload_param": {"device": "cpu"}}
    assert cli.main([*run, "--num_processes", "1", "--accelerate_config", "zero3"]) == 0
    config, _, validated = seen[-1]
    assert config["distributed_type"] == "NO" and not validated.multi_gpu and not validated.use_deepspeed
    many = tmp_path / "two_nodes.yaml"
    many.write_text(Path(importlib.resources.files("trl.accelerate_configs").joinpath("zero3.yaml")).read_text()
                    .replace("deepspeed_multinode_launcher: standard", "deepspeed_multinode_launcher: pdsh")
                    .replace("num_machines: 1", "num_machines: 2"))
    assert "2 machines with deepspeed_multinode_launcher 'pdsh' start every node from this one" \
        in _usage_error(capsys, [*run, "--accelerate_config", str(many)])
    yaml_config = tmp_path / "sft.yaml"
    yaml_config.write_text(f"model_name_or_path: {TINY}\ndeepspeed: mine.json\n")
    assert "runs DeepSpeed and --deepspeed names a DeepSpeed config too; keep one" \
        in _usage_error(capsys, ["sft", "--config", str(yaml_config), "--accelerate_config", "zero3"])
    assert "with --multi_gpu / --use_fsdp asks for DeepSpeed's own launcher" \
        in _usage_error(capsys, [*run, "--accelerate_config", "zero3", "--multi_gpu", "--num_processes", "2"])
    assert len(seen) == 2


def test_launch_usage_errors(capsys, monkeypatch, tmp_path):
    monkeypatch.setattr("accelerate.commands.launch.launch_command", lambda args: pytest.fail("launched"))
    monkeypatch.setattr("accelerate.utils.is_deepspeed_available", lambda: False)
    run = ["--model_name_or_path", TINY]
    assert "not one of TRL's configs (fsdp1, fsdp2, multi_gpu, single_gpu, zero1, zero2, zero3) (did you mean 'fsdp2'?)" \
        in _usage_error(capsys, [*run, "--accelerate_config", "fsdp3"])
    assert "--use_deepspeed asks for DeepSpeed's own launcher, and deepspeed is not installed: pip install deepspeed" \
        in _usage_error(capsys, [*run, "--use_deepspeed", "--num_processes", "2"])
    assert "runs DeepSpeed and --deepspeed names a DeepSpeed config too; keep one" \
        in _usage_error(capsys, [*run, "--accelerate_config", "zero3", "--deepspeed", "ds.json"])
    assert "distributed_type is NO (one process): use --accelerate_config multi_gpu or fsdp2" \
        in _usage_error(capsys, [*run, "--accelerate_config", "single_gpu", "--num_processes", "2"])
    assert "accelerate starts several CPU processes only through MPI" in _usage_error(capsys, [*run, "--cpu", "--num_processes", "2"])
    assert "-m is not for hfnative-train" in _usage_error(capsys, [*run, "-m", "--num_processes", "2"])
    assert "accelerate launch: argument --num_processes/--num-processes: invalid int value: 'two'" \
        in _usage_error(capsys, [*run, "--num_processes", "two"])
    assert "--accelerate_config and --config_file both name an accelerate config" \
        in _usage_error(capsys, [*run, "--accelerate_config", "fsdp2", "--config_file", "x.yaml"])
    assert "unknown argument '--bogus'" in _usage_error(capsys, [*run, "--num_processes", "2", "--bogus"])  # before launching
    # inside a process torchrun or accelerate launch started, the launch flags are refused
    monkeypatch.setenv("WORLD_SIZE", "2")
    assert "--num_processes asks hfnative-train to start the processes, not in a process a launcher started (WORLD_SIZE=2)" \
        in _usage_error(capsys, [*run, "--num_processes", "2"])
    config = tmp_path / "sft.yaml"
    config.write_text(f"model_name_or_path: {TINY}\nnum_processes: 2\n")
    assert "--num_processes asks hfnative-train to start the processes" in _usage_error(capsys, ["--config", str(config)])
    # a script's parser (examples/sft.py) names the launcher a launch setting belongs to
    monkeypatch.delenv("WORLD_SIZE")
    parser = cli.COMMANDS["sft"].parser("sft")
    with pytest.raises(cli.UsageError, match="--num_processes is a flag of accelerate launch"):
        parser.parse(["--num_processes", "2"])
    with pytest.raises(cli.UsageError, match="num_processes is an accelerate launch setting, which hfnative-train applies"):
        parser.parse(["--config", str(config)])


def test_parallelism_config_flag_takes_json(capsys, tmp_path):
    parser = cli.COMMANDS["sft"].parser("sft")
    _, training_args, _ = parser.parse(["--parallelism_config", '{"dp_shard_size": 2, "tp_size": 2}', "--bf16", "false"])
    assert (training_args.parallelism_config.dp_shard_size, training_args.parallelism_config.tp_size) == (2, 2)
    config = tmp_path / "sft.yaml"
    config.write_text("parallelism_config:\n  dp_replicate_size: 2\nbf16: false\n")
    assert parser.parse(["--config", str(config)])[1].parallelism_config.dp_replicate_size == 2
    assert "invalid parallelism_config '{dp_shard_size: 2}': not a JSON object" \
        in _usage_error(capsys, ["--parallelism_config", "{dp_shard_size: 2}"])


def test_console_script_launches_the_processes(tmp_path):
    """A real accelerate launch of two processes (each stops at its arguments' check): the processes run this
    command, and the run's exit status is theirs."""
    done = _console_script("--num_processes", "2", "--accelerate_config", "multi_gpu", "--mixed_precision", "no",
                           "--main_process_port", "0", "--model_name_or_path", TINY, "--per_device_train_batch_size", "0",
                           "--bf16", "false", "--output_dir", str(tmp_path / "out"))
    message = "hfnative-train: error: invalid arguments: per_device_train_batch_size=0; it must be at least 1"
    assert done.returncode == 2, done.stderr[-3000:]
    # the launcher stops the other process once one has failed, so the second may be ended before it prints
    assert 1 <= done.stderr.count(message) <= 2, done.stderr[-3000:]
    assert done.stderr.count("hfnative-train: error: ") == done.stderr.count(message), done.stderr[-3000:]
