"""resolve_parallel_plan: every way a user asks for a layout -> one ParallelPlan, or a ValueError naming the setting.

The environment of an ``accelerate launch --config_file <TRL config> ...`` run is made by accelerate itself: its
launch parser, config loading and environment preparation (``launch_command`` with the process start replaced by
a capture of the environment it prepared), plus the variables torchrun gives each process."""

import json
import os
from importlib import resources
from pathlib import Path

import pytest
from accelerate import ParallelismConfig
from accelerate.commands import launch as accelerate_launch
from accelerate.utils import launch as launch_env

from hfnative import SFTConfig
from hfnative.trainers.running.parallel_plan import ParallelPlan, resolve_parallel_plan

TRL_CONFIGS = resources.files("trl.accelerate_configs")
# what a launcher's environment or transformers' TrainingArguments may leave behind
_LAUNCH_PREFIXES = ("ACCELERATE_", "FSDP_", "PARALLELISM_CONFIG_", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "RANK", "LOCAL_RANK")


@pytest.fixture(autouse=True)
def clean_environment(monkeypatch):
    """No launcher settings from outside; and what the code under test writes into os.environ (transformers writes
    FSDP_CPU_RAM_EFFICIENT_LOADING itself) is undone afterwards."""
    saved = dict(os.environ)
    for name in list(os.environ):
        if name.startswith(_LAUNCH_PREFIXES):
            monkeypatch.delenv(name)
    yield
    os.environ.clear()
    os.environ.update(saved)


def accelerate_launch_environment(monkeypatch, *flags: str) -> int:
    """Set the environment ``accelerate launch <flags> train.py`` gives each of its processes (less torchrun's rank
    variables); returns the number of processes it starts."""
    prepared = {}

    def torchrun(args):  # multi_gpu_launcher: torch.distributed.run with this environment
        prepared.update(launch_env.prepare_multi_gpu_env(args), processes=int(args.num_processes))

    def deepspeed(args):
        prepared.update(launch_env.prepare_deepspeed_cmd_env(args)[1], processes=int(args.num_processes))

    def single(args):  # simple_launcher: one process
        prepared.update(launch_env.prepare_simple_launcher_cmd_env(args)[1], processes=1)

    monkeypatch.setattr(accelerate_launch, "multi_gpu_launcher", torchrun)
    monkeypatch.setattr(accelerate_launch, "deepspeed_launcher", deepspeed)
    monkeypatch.setattr(accelerate_launch, "simple_launcher", single)
    accelerate_launch.launch_command(accelerate_launch.launch_command_parser().parse_args([*flags, "train.py"]))
    processes = prepared.pop("processes")
    for name, value in prepared.items():
        if os.environ.get(name) != value:
            monkeypatch.setenv(name, value)
    if processes > 1:  # torchrun's processes-per-node (its WORLD_SIZE / RANK would make transformers join a group)
        monkeypatch.setenv("LOCAL_WORLD_SIZE", str(processes))
    return processes


def trl_config(name: str) -> str:
    return str(TRL_CONFIGS.joinpath(f"{name}.yaml"))


def training_args(tmp_path, **kwargs) -> SFTConfig:
    return SFTConfig(str(tmp_path / "out"), bf16=False, report_to="none", **kwargs)


def layout(plan: ParallelPlan) -> tuple:
    return plan.dims.dp_replicate, plan.dims.dp_shard, plan.dims.tp, plan.reshard_after_forward, plan.cpu_offload


# --- accelerate launch with TRL's shipped configs ------------------------------------------------


@pytest.mark.parametrize("config, expected", [
    ("fsdp2", (1, 2, 1, True, False)),
    ("fsdp1", (1, 2, 1, True, False)),  # FULL_SHARD, run as FSDP2
    ("multi_gpu", (2, 1, 1, True, False)),  # DDP: replicated weights
    ("single_gpu", (1, 1, 1, True, False)),  # one process, whatever --num_processes says
])
def test_trl_accelerate_configs(config, expected, monkeypatch, tmp_path):
    processes = accelerate_launch_environment(monkeypatch, "--config_file", trl_config(config), "--num_processes", "2",
                                              "--mixed_precision", "no")
    plan = resolve_parallel_plan(training_args(tmp_path), processes)
    assert layout(plan) == expected
    assert plan.mixed_precision is None and not plan.activation_checkpointing and not plan.compile


@pytest.mark.parametrize("config", ["zero1", "zero2", "zero3"])
def test_deepspeed_configs_need_deepspeed(config, monkeypatch, tmp_path):
    args = training_args(tmp_path)  # made before the launch's environment: transformers itself needs deepspeed then
    processes = accelerate_launch_environment(monkeypatch, "--config_file", trl_config(config), "--num_processes", "2",
                                              "--mixed_precision", "no")
    monkeypatch.setattr("accelerate.utils.is_deepspeed_available", lambda: False)
    with pytest.raises(ValueError, match=r"deepspeed is not installed: pip install deepspeed .* \(--accelerate_config fsdp2\)"):
        resolve_parallel_plan(args, processes)


@pytest.mark.parametrize("config, expected", [
    ("zero1", (1, 2, 1, False, False)),
    ("zero2", (1, 2, 1, False, False)),
    ("zero3", (1, 2, 1, True, False)),
])
def test_deepspeed_configs_run_as_fsdp2_when_deepspeed_is_installed(config, expected, monkeypatch, tmp_path):
    args = training_args(tmp_path)
    processes = accelerate_launch_environment(monkeypatch, "--config_file", trl_config(config), "--num_processes", "2",
                                              "--mixed_precision", "no")
    monkeypatch.setattr("accelerate.utils.is_deepspeed_available", lambda: True)
    plan = resolve_parallel_plan(args, processes)
    assert layout(plan) == expected and f"ZeRO-{config[-1]}" in plan.describe()


def test_deepspeed_offload(monkeypatch, tmp_path):
    args = training_args(tmp_path)
    monkeypatch.setattr("accelerate.utils.is_deepspeed_available", lambda: True)
    accelerate_launch_environment(monkeypatch, "--config_file", trl_config("zero3"), "--num_processes", "2",
                                  "--mixed_precision", "no", "--offload_param_device", "cpu")
    assert layout(resolve_parallel_plan(args, 2)) == (1, 2, 1, True, True)
    monkeypatch.setenv("ACCELERATE_DEEPSPEED_OFFLOAD_PARAM_DEVICE", "nvme")
    with pytest.raises(ValueError, match="offload_param_device='nvme' is not supported .* use 'cpu' or 'none'"):
        resolve_parallel_plan(args, 2)
    monkeypatch.setenv("ACCELERATE_USE_FSDP", "true")
    with pytest.raises(ValueError, match="both FSDP .* and DeepSpeed"):
        resolve_parallel_plan(args, 2)


def test_deepspeed_config_file(monkeypatch, tmp_path):
    args = training_args(tmp_path)
    monkeypatch.setattr("accelerate.utils.is_deepspeed_available", lambda: True)
    ds_config = tmp_path / "ds.json"
    ds_config.write_text(json.dumps({"zero_optimization": {"stage": 3, "offload_optimizer": {"device": "cpu"}}}))
    accelerate_launch_environment(monkeypatch, "--use_deepspeed", "--deepspeed_config_file", str(ds_config),
                                  "--num_processes", "2", "--mixed_precision", "no")
    assert layout(resolve_parallel_plan(args, 2)) == (1, 2, 1, True, True)
    ds_config.write_text(json.dumps({"zero_optimization": {"stage": 2}, "optimizer": {"type": "Adam"}}))
    with pytest.raises(ValueError, match="'optimizer' section is not supported .* set optim instead"):
        resolve_parallel_plan(args, 2)


def test_mixed_precision_from_accelerate(monkeypatch, tmp_path):
    # the TRL config's own bf16 (no --mixed_precision no): bf16, though bf16=False, as under transformers' Trainer
    accelerate_launch_environment(monkeypatch, "--config_file", trl_config("fsdp2"), "--num_processes", "2")
    assert resolve_parallel_plan(training_args(tmp_path), 2).mixed_precision == "bf16"
    # fp8: float8 layers (trainers/running/float8_plan.py, tests/test_float8.py), everything else in bf16 as accelerate runs it
    monkeypatch.setenv("ACCELERATE_MIXED_PRECISION", "fp8")
    assert resolve_parallel_plan(training_args(tmp_path), 2).mixed_precision == "bf16"


def test_accelerate_flags_beyond_the_config(monkeypatch, tmp_path):
    accelerate_launch_environment(
        monkeypatch, "--config_file", trl_config("fsdp2"), "--num_processes", "2", "--mixed_precision", "no",
        "--fsdp_reshard_after_forward", "false", "--fsdp_offload_params", "true", "--fsdp_activation_checkpointing", "true",
        "--dynamo_backend", "inductor",
    )
    plan = resolve_parallel_plan(training_args(tmp_path, gradient_checkpointing=False), 2)
    assert layout(plan) == (1, 2, 1, False, True) and plan.activation_checkpointing
    assert (plan.compile.backend, plan.compile.mode) == ("inductor", "default")
    # accelerate's backend and mode, as transformers' Trainer hands them to torch.compile
    monkeypatch.setenv("ACCELERATE_DYNAMO_BACKEND", "AOT_EAGER")
    assert resolve_parallel_plan(training_args(tmp_path), 2).compile.backend == "aot_eager"
    monkeypatch.setenv("ACCELERATE_DYNAMO_BACKEND", "INDUCTOR")
    monkeypatch.setenv("ACCELERATE_DYNAMO_MODE", "max-autotune")
    assert "compiled (inductor, mode max-autotune)" in resolve_parallel_plan(training_args(tmp_path), 2).describe()
    # the training arguments' own switch wins, as in transformers' Trainer
    assert resolve_parallel_plan(training_args(tmp_path, torch_compile_mode="reduce-overhead"), 2).compile.mode == \
        "reduce-overhead"
    # a backend accelerate names but this torch does not have (torch-tensorrt not installed)
    monkeypatch.setenv("ACCELERATE_DYNAMO_BACKEND", "TENSORRT")
    with pytest.raises(ValueError, match="dynamo config .*torch_compile_backend='tensorrt': torch.compile has no such"):
        resolve_parallel_plan(training_args(tmp_path), 2)


def test_fsdp1_sharding_strategy_flag(monkeypatch, tmp_path):
    accelerate_launch_environment(monkeypatch, "--config_file", trl_config("fsdp1"), "--num_processes", "4",
                                  "--mixed_precision", "no", "--fsdp_sharding_strategy", "HYBRID_SHARD")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")  # two nodes of two processes
    assert layout(resolve_parallel_plan(training_args(tmp_path), 4)) == (2, 2, 1, True, False)


# --- transformers' fsdp / fsdp_config --------------------------------------------------------------


@pytest.mark.parametrize("fsdp, fsdp_config, expected", [
    (True, None, (1, 4, 1, True, False)),
    ("full_shard", None, (1, 4, 1, True, False)),
    ("full_shard auto_wrap", None, (1, 4, 1, True, False)),
    ("shard_grad_op", None, (1, 4, 1, False, False)),
    ("full_shard offload", None, (1, 4, 1, True, True)),
    (["shard_grad_op", "offload"], None, (1, 4, 1, False, True)),
    ("full_shard", {"version": 1}, (1, 4, 1, True, False)),
    ("shard_grad_op", {"fsdp_version": 1}, (1, 4, 1, False, False)),
    ("hybrid_shard", {"version": 1}, (2, 2, 1, True, False)),
    ("hybrid_shard_zero2", {"version": 1}, (2, 2, 1, False, False)),
    ("no_shard", {"version": 1}, (4, 1, 1, True, False)),
    (True, {"reshard_after_forward": False}, (1, 4, 1, False, False)),
    (True, {"fsdp_reshard_after_forward": "false", "cpu_offload": True}, (1, 4, 1, False, True)),
])
def test_fsdp_options(fsdp, fsdp_config, expected, monkeypatch, tmp_path):
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    plan = resolve_parallel_plan(training_args(tmp_path, fsdp=fsdp, fsdp_config=fsdp_config), 4)
    assert layout(plan) == expected


def test_fsdp_config_file_and_activation_checkpointing(tmp_path):
    path = tmp_path / "fsdp.json"
    path.write_text(json.dumps({"fsdp_version": 2, "fsdp_reshard_after_forward": False, "activation_checkpointing": True}))
    plan = resolve_parallel_plan(training_args(tmp_path, fsdp=True, fsdp_config=str(path), gradient_checkpointing=False), 2)
    assert layout(plan) == (1, 2, 1, False, False) and plan.activation_checkpointing


def test_fsdp_args_win_over_the_launch(monkeypatch, tmp_path):
    accelerate_launch_environment(monkeypatch, "--config_file", trl_config("multi_gpu"), "--num_processes", "2",
                                  "--mixed_precision", "no")
    assert layout(resolve_parallel_plan(training_args(tmp_path, fsdp="shard_grad_op"), 2)) == (1, 2, 1, False, False)


def test_fsdp_on_one_process_is_a_single_process_run(tmp_path, caplog):
    plan = resolve_parallel_plan(training_args(tmp_path, fsdp="full_shard"), 1)
    assert layout(plan) == (1, 1, 1, True, False)
    assert "on one process: there is nothing to shard" in caplog.text
    assert plan.describe().startswith("one process") and "[1 process;" in plan.describe()


def test_fsdp1_is_said_to_run_as_fsdp2(tmp_path, caplog):
    resolve_parallel_plan(training_args(tmp_path, fsdp="full_shard", fsdp_config={"version": 1}), 2)
    assert "FSDP1 (full_shard) runs as FSDP2 with the same sharding" in caplog.text


def test_hybrid_shard_refusals(monkeypatch, tmp_path):
    args = training_args(tmp_path, fsdp="hybrid_shard", fsdp_config={"version": 1})
    with pytest.raises(ValueError, match="LOCAL_WORLD_SIZE .* is not set"):
        resolve_parallel_plan(args, 4)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    with pytest.raises(ValueError, match=r"world size \(6\) to be a multiple of the processes per node \(LOCAL_WORLD_SIZE=4\)"):
        resolve_parallel_plan(args, 6)
    with pytest.raises(ValueError, match="only available with FSDP1"):  # transformers' own refusal for FSDP2
        training_args(tmp_path, fsdp="hybrid_shard")


def test_fsdp_settings_hfnative_cannot_honour(monkeypatch, tmp_path):
    with pytest.raises(ValueError, match="XLA FSDP, for TPUs"):
        resolve_parallel_plan(training_args(tmp_path, fsdp=True, fsdp_config={"xla": True}), 2)
    monkeypatch.setenv("ACCELERATE_USE_FSDP", "true")
    monkeypatch.setenv("FSDP_VERSION", "2")
    monkeypatch.setenv("FSDP_IGNORED_MODULES", "lm_head")
    with pytest.raises(ValueError, match="ignored_modules='lm_head' is not supported"):
        resolve_parallel_plan(training_args(tmp_path), 2)
    monkeypatch.delenv("FSDP_IGNORED_MODULES")
    monkeypatch.setenv("FSDP_ACTIVATION_CHECKPOINTING", "true")
    monkeypatch.setenv("FSDP_ACTIVATION_CHECKPOINTING_OFFLOAD", "true")
    with pytest.raises(ValueError, match="activation_checkpointing_offload is not supported"):
        resolve_parallel_plan(training_args(tmp_path), 2)
    monkeypatch.setenv("ACCELERATE_USE_MEGATRON_LM", "true")
    with pytest.raises(ValueError, match="Megatron-LM config is not supported"):
        resolve_parallel_plan(training_args(tmp_path), 2)


# --- parallelism_config ------------------------------------------------------------------------------


@pytest.mark.parametrize("config, fsdp, expected", [
    (ParallelismConfig(dp_shard_size=2, tp_size=2), None, (1, 2, 2, True, False)),
    (ParallelismConfig(dp_replicate_size=2, dp_shard_size=2), None, (2, 2, 1, True, False)),
    (ParallelismConfig(tp_size=4), None, (1, 1, 4, True, False)),
    (ParallelismConfig(dp_shard_size=2, tp_size=2), "shard_grad_op offload", (1, 2, 2, False, True)),
    (ParallelismConfig(), None, (4, 1, 1, True, False)),  # all sizes 1: plain data parallel, as accelerate
    ({"dp_shard_size": 2, "tp_size": 2}, None, (1, 2, 2, True, False)),
])
def test_parallelism_config(config, fsdp, expected, tmp_path):
    plan = resolve_parallel_plan(training_args(tmp_path, parallelism_config=config, fsdp=fsdp), 4)
    assert layout(plan) == expected
    if expected[2] > 1:
        assert "4-way tensor parallel" in plan.describe() or "2-way tensor parallel" in plan.describe()


def test_parallelism_config_from_accelerate_launch(monkeypatch, tmp_path):
    # TRL's fsdp2 config with the section `accelerate config` writes for a parallelism config
    config = tmp_path / "fsdp2_tp.yaml"
    config.write_text(Path(trl_config("fsdp2")).read_text() + "parallelism_config:\n  parallelism_config_dp_shard_size: 2\n"
                      "  parallelism_config_tp_size: 2\n")
    accelerate_launch_environment(monkeypatch, "--config_file", str(config), "--num_processes", "4",
                                  "--mixed_precision", "no")
    assert os.environ["PARALLELISM_CONFIG_TP_SIZE"] == "2"
    plan = resolve_parallel_plan(training_args(tmp_path), 4)
    assert layout(plan) == (1, 2, 2, True, False) and "parallelism_config with accelerate's FSDP config" in plan.describe()


def test_parallelism_config_refusals(monkeypatch, tmp_path):
    with pytest.raises(ValueError, match="ep_size=3 must divide dp_shard_size=2"):
        resolve_parallel_plan(training_args(tmp_path, parallelism_config={"dp_shard_size": 2, "ep_size": 3}), 2)
    monkeypatch.setenv("ACCELERATE_USE_PARALLELISM_CONFIG", "true")
    monkeypatch.setenv("PARALLELISM_CONFIG_SP_SIZE", "2")
    with pytest.raises(ValueError, match="sp_size=2: DeepSpeed-Ulysses sequence parallelism is not available"):
        resolve_parallel_plan(training_args(tmp_path), 2)
    monkeypatch.delenv("ACCELERATE_USE_PARALLELISM_CONFIG")
    monkeypatch.delenv("PARALLELISM_CONFIG_SP_SIZE")  # an explicit ParallelismConfig reads what it is not given
    with pytest.raises(ValueError, match=r"dp_shard_size=2 x tp_size=2 = 4, but 8 processes .* \(e.g. dp_shard_size=4\)"):
        resolve_parallel_plan(training_args(tmp_path, parallelism_config=ParallelismConfig(dp_shard_size=2, tp_size=2)), 8)
    with pytest.raises(ValueError, match=r"tp_size=3 = 3, but 4 processes were launched"):
        resolve_parallel_plan(training_args(tmp_path, parallelism_config=ParallelismConfig(tp_size=3)), 4)


# --- nothing set ------------------------------------------------------------------------------------


def test_nothing_set_is_data_parallel(tmp_path):
    plan = resolve_parallel_plan(training_args(tmp_path), 4)
    assert layout(plan) == (4, 1, 1, True, False) and plan.mixed_precision is None
    assert plan.describe().startswith("data parallel over 4 ranks (replicated weights)")
    assert layout(resolve_parallel_plan(training_args(tmp_path), 1)) == (1, 1, 1, True, False)
    assert resolve_parallel_plan(training_args(tmp_path, torch_compile=True), 2).compile
    with pytest.raises(ValueError, match="world_size=0"):
        resolve_parallel_plan(training_args(tmp_path), 0)


# --- TrainingArguments(deepspeed=...): read without DeepSpeed ------------------------------------

def _ds_file(tmp_path, config) -> str:
    path = tmp_path / "ds_config.json"
    path.write_text(json.dumps(config))
    return str(path)


@pytest.mark.parametrize("stage, expected", [(0, (2, 1, 1, True, False)), (1, (1, 2, 1, False, False)),
                                             (2, (1, 2, 1, False, False)), (3, (1, 2, 1, True, False))])
@pytest.mark.parametrize("given_as", ["file", "dict", "base64", "json"])
def test_deepspeed_argument_runs_as_fsdp2_without_deepspeed(stage, expected, given_as, tmp_path, monkeypatch):
    """transformers' ``deepspeed=`` (a JSON file, a dict, base64 JSON or a JSON string, as transformers and accelerate
    take it): the ZeRO stage's FSDP2 layout, DeepSpeed never imported (an import of it fails here); the argument
    keeps the user's value (a JSON string parsed, as transformers parses it)."""
    import base64
    import sys

    monkeypatch.setitem(sys.modules, "deepspeed", None)
    config = {"zero_optimization": {"stage": stage}, "train_micro_batch_size_per_gpu": "auto"}
    value = {"file": lambda: _ds_file(tmp_path, config), "dict": lambda: config, "json": lambda: json.dumps(config),
             "base64": lambda: base64.urlsafe_b64encode(json.dumps(config).encode()).decode()}[given_as]()
    args = training_args(tmp_path, deepspeed=value)
    assert args.deepspeed == (config if given_as == "json" else value)
    plan = resolve_parallel_plan(args, 2)
    assert layout(plan) == expected and f"DeepSpeed ZeRO-{stage}" in plan.describe()
    assert layout(resolve_parallel_plan(args, 1))[:3] == (1, 1, 1)  # one process: nothing to shard


def test_the_arguments_device_setup_does_not_start_deepspeed(tmp_path, monkeypatch):
    """transformers' ``_setup_devices`` starts accelerate's state for DeepSpeed when ``deepspeed`` is set (its
    ACCELERATE_USE_DEEPSPEED while the state is made); the arguments' own does not, whenever it runs."""
    import transformers
    from accelerate import PartialState

    seen = []
    made = PartialState.__init__

    def recording(self, *args, **kwargs):
        seen.append(os.environ.get("ACCELERATE_USE_DEEPSPEED"))
        made(self, *args, **kwargs)

    args = training_args(tmp_path, deepspeed={"zero_optimization": {"stage": 3}})
    monkeypatch.setattr(PartialState, "__init__", recording)
    args.__dict__.pop("_setup_devices", None)  # the cached device setup, made again
    assert args.device.type == "cpu" and args.world_size == 1
    transformers.TrainingArguments._setup_devices.func(args)  # the check can fail: transformers' own asks for it
    assert seen == [None, "true"]


def test_deepspeed_argument_fills_auto_and_refuses_mismatches_as_transformers_does(tmp_path):
    """"auto" takes the training arguments' value; a value given must equal it (transformers' rule and message:
    the global batch is world size x micro-batch x accumulation)."""
    from hfnative.trainers.running.deepspeed_config import deepspeed_config

    config = {"zero_optimization": {"stage": 3}, "train_micro_batch_size_per_gpu": "auto", "train_batch_size": "auto",
              "gradient_accumulation_steps": "auto", "gradient_clipping": "auto", "bf16": {"enabled": "auto"},
              "fp16": {"enabled": False},
              "optimizer": {"type": "AdamW", "params": {"lr": "auto", "betas": "auto", "eps": "auto",
                                                        "weight_decay": "auto"}}}
    args = training_args(tmp_path, deepspeed=config, per_device_train_batch_size=3, gradient_accumulation_steps=2,
                         learning_rate=1e-4, weight_decay=0.1, max_grad_norm=0.5)
    filled = deepspeed_config(args, 4).deepspeed_config
    assert (filled["train_micro_batch_size_per_gpu"], filled["train_batch_size"], filled["gradient_accumulation_steps"],
            filled["gradient_clipping"], filled["bf16"]["enabled"]) == (3, 24, 2, 0.5, False)
    assert filled["optimizer"]["params"] == {"lr": 1e-4, "betas": [0.9, 0.999], "eps": 1e-8, "weight_decay": 0.1}
    assert config["train_batch_size"] == "auto"  # the user's dict is not written into
    assert layout(resolve_parallel_plan(args, 4)) == (1, 4, 1, True, False)

    wrong = dict(config, train_batch_size=12, gradient_clipping=1.0, bf16={"enabled": True},
                 optimizer={"type": "Adam", "params": {"lr": 3e-4, "betas": "auto", "eps": "auto",
                                                       "weight_decay": "auto"}})
    with pytest.raises(ValueError) as error:
        resolve_parallel_plan(training_args(tmp_path, deepspeed=wrong, per_device_train_batch_size=3,
                                            gradient_accumulation_steps=2, learning_rate=1e-4, max_grad_norm=0.5), 4)
    assert str(error.value) == (
        "Please correct the following DeepSpeed config values that mismatch TrainingArguments values:\n"
        "- ds train_batch_size=12 vs hf train_batch_size (calculated)=24\n"
        "- ds gradient_clipping=1.0 vs hf max_grad_norm=0.5\n"
        "- ds optimizer.params.lr=0.0003 vs hf learning_rate=0.0001\n"
        "- ds bf16.enabled=True vs hf bf16|bf16_full_eval=False\n"
        "The easiest method is to set these DeepSpeed config values to 'auto'.")


@pytest.mark.parametrize("config, optim, match", [
    ({"optimizer": {"type": "Adam", "params": {"adam_w_mode": False}}}, "adamw_torch", "not the training arguments'"),
    ({"optimizer": {"type": "Lamb"}}, "adamw_torch", "DeepSpeed's Adam / AdamW"),
    ({"optimizer": {"type": "AdamW", "params": dict.fromkeys(["lr", "betas", "eps", "weight_decay"], "auto")}},
     "adafactor", "optim='adafactor'"),
    ({"optimizer": {"type": "AdamW", "params": dict.fromkeys(["lr", "betas", "eps", "weight_decay"], "auto")}},
     "adamw_torch_8bit", "optim='adamw_torch_8bit'"),
    ({"optimizer": {"type": "AdamW", "params": {"amsgrad": True}}}, "adamw_torch", r"it sets \['amsgrad'\]"),
    ({"optimizer": {"type": "AdamW", "params": {"lr": "auto"}}}, "adamw_torch",
     r"it leaves \['betas', 'eps', 'weight_decay'\] to DeepSpeed's defaults"),
    ({"zero_optimization": {"stage": 2, "cpu_offload": True}}, "adamw_torch", "cpu_offload=True is not supported"),
    ({"tensor_parallel": {"autotp_size": 2}}, "adamw_torch", "autotp_size=2 is not supported .* parallelism_config"),
    ({"scheduler": {"type": "OneCycle", "params": {"cycle_min_lr": 0}}}, "adamw_torch",
     "scheduler section .* is not one hfnative runs: type 'OneCycle'. It runs DeepSpeed's WarmupLR, WarmupDecayLR"),
    ({"scheduler": {"type": "WarmupDecayLR", "params": {"warmup_num_steps": "auto"}}}, "adamw_torch",
     r"it leaves out total_num_steps \(\"auto\": the run's steps\)"),
    ({"scheduler": {"type": "WarmupLR", "params": {"warmup_type": "cosine"}}}, "adamw_torch", "warmup_type='cosine'"),
    ({"scheduler": {"type": "WarmupCosineLR", "params": {"total_num_steps": "auto", "cos_min_ratio": "auto"}}},
     "adamw_torch", "cos_min_ratio='auto' \\(a number\\)"),
    ({"scheduler": {"type": "WarmupLR", "params": {"warmup_min_lr": [0.0, 1e-5]}}}, "adamw_torch",
     r"warmup_min_lr=\[0.0, 1e-05\] \(a number, or \"auto\"\)"),
    ({"zero_optimization": {"stage": 3, "offload_param": {"device": "nvme"}}}, "adamw_torch",
     "offload_param_device='nvme' is not supported"),
    ({"zero_optimization": {"stage": 4}}, "adamw_torch", "zero_stage=4: expected 0, 1, 2 or 3"),
])
def test_deepspeed_argument_refuses_what_it_would_change_beyond_the_layout(config, optim, match, tmp_path):
    args = training_args(tmp_path, deepspeed=config, optim=optim)
    with pytest.raises(ValueError, match=match):
        resolve_parallel_plan(args, 2)


def test_deepspeed_argument_cpu_offload(tmp_path):
    config = {"zero_optimization": {"stage": 3, "offload_optimizer": {"device": "cpu"}, "offload_param": {"device": "cpu"}}}
    assert layout(resolve_parallel_plan(training_args(tmp_path, deepspeed=config), 2)) == (1, 2, 1, True, True)


@pytest.mark.parametrize("value, match", [
    ("missing.json", "no such file; pass the path of a DeepSpeed JSON config"),
    ("BROKEN", "not a readable JSON file"),
    ("LIST", "the config is a JSON list, not an object"),
    (3, "expected the path of a DeepSpeed JSON config or a dict"),
])
def test_bad_deepspeed_arguments_are_refused_when_the_arguments_are_made(value, match, tmp_path):
    if value == "BROKEN":
        value = str(tmp_path / "broken.json")
        Path(value).write_text("{'zero_optimization': ")
    elif value == "LIST":
        value = _ds_file(tmp_path, [1, 2])
    with pytest.raises(ValueError, match=match):
        training_args(tmp_path, deepspeed=value)


def test_deepspeed_global_batch_counts_the_data_parallel_ranks(tmp_path):
    """With tensor parallelism from parallelism_config, the global batch is micro-batch x accumulation x the
    data-parallel ranks (DeepSpeed's own count), not x every process."""
    config = {"zero_optimization": {"stage": 3}, "train_micro_batch_size_per_gpu": 3, "train_batch_size": 6}
    args = training_args(tmp_path, deepspeed=config, per_device_train_batch_size=3,
                         parallelism_config=ParallelismConfig(dp_shard_size=2, tp_size=2))
    assert layout(resolve_parallel_plan(args, 4))[:3] == (1, 2, 2)
    args = training_args(tmp_path, deepspeed=dict(config, train_batch_size=12), per_device_train_batch_size=3,
                         parallelism_config=ParallelismConfig(dp_shard_size=2, tp_size=2))
    with pytest.raises(ValueError, match=r"train_batch_size=12 vs hf train_batch_size \(calculated\)=6"):
        resolve_parallel_plan(args, 4)
