"""Every trainer's path on a device: a few optimizer steps of each on the shipped tiny model and data.

    python benchmarks/gpu_trainers.py --device cuda          # bf16, as a GPU user runs it
    python benchmarks/gpu_trainers.py --device cpu           # fp32 on the CPU (use_cpu=True)
    python benchmarks/gpu_trainers.py --device cpu --precision bf16   # the GPU's autocast path, rehearsed on the CPU
    python benchmarks/gpu_trainers.py --only SFT,GRPO

Each trainer (SFT, DPO, KTO, reward, distillation, GKD, GRPO, RLOO, SFT with a LoRA config that also trains
two token rows: ``SFT-lora-tokens``, LoRA on an 8-bit base: ``SFT-lora-int8``, and QLoRA: ``SFT-qlora``) is built from its config exactly as a user's script builds it, trains ``--steps`` optimizer steps on examples/tiny-qwen3 with examples/data, and saves its
model. One line per trainer: PASS when every logged loss is finite, the model's parameters moved and sit on the
device, the saved folder loads with transformers, and the perf/ metrics the README lists for that device were
logged (on CUDA: cuda_max_allocated_gib, and mfu_wall_clock where the GPU is in hfnative.metrics.PEAK_FLOPS);
the line shows the last loss, tokens/s, MFU and peak memory, each step's seconds and their median after the first
(the steady state; a later step of 0.1 s or more is named with the Triton variants compiled in it), and on CUDA how
many variants of hfnative's Triton kernels were compiled after the first step (each a stall in the middle of
training). A last line gives the generating trainers' (distillation, GKD, GRPO, RLOO) steady steps. The exit status
is 1 when any trainer failed.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import tempfile
import time
import traceback
from pathlib import Path

import torch

import hfnative  # noqa: F401  (first: it quiets torchao's import-time lines)

ROOT = Path(__file__).resolve().parents[1]
TINY = ROOT / "examples" / "tiny-qwen3"
TEACHER = ROOT / "examples" / "tiny-qwen3-teacher"
DATA = ROOT / "examples" / "data"


def letter_e(completions, **kwargs) -> list[float]:
    texts = [c if isinstance(c, str) else c[-1]["content"] for c in completions]
    return [t.count("e") / max(len(t), 1) for t in texts]


def _dataset(name: str, rows: int):
    from datasets import load_dataset

    return load_dataset("json", data_files=str(DATA / name), split="train").select(range(rows))


# name: (config class, trainer class, data file, rows, config settings, trainer keywords beyond model/args/data)
_RL = dict(num_generations=4, max_completion_length=16, per_device_train_batch_size=8)
SETUPS = {
    "SFT": ("SFTConfig", "SFTTrainer", "sft_messages.jsonl", 64, dict(max_length=128, per_device_train_batch_size=8), {}),
    "DPO": ("DPOConfig", "DPOTrainer", "preference.jsonl", 32, dict(max_length=128, per_device_train_batch_size=4), {}),
    "KTO": ("KTOConfig", "KTOTrainer", "preference.jsonl", 32, dict(max_length=128, per_device_train_batch_size=8), {}),
    "reward": ("RewardConfig", "RewardTrainer", "preference.jsonl", 32,
               dict(max_length=128, per_device_train_batch_size=4), {}),
    "distillation": ("DistillationConfig", "DistillationTrainer", "sft_prompt_completion.jsonl", 32,
                     dict(max_completion_length=16, per_device_train_batch_size=4,
                          teacher_model_name_or_path=str(TEACHER)), {}),
    "GKD": ("GKDConfig", "GKDTrainer", "sft_messages.jsonl", 32,
            dict(max_length=128, per_device_train_batch_size=4, lmbda=0.5), dict(teacher_model=str(TEACHER))),
    "GRPO": ("GRPOConfig", "GRPOTrainer", "sft_prompt_completion.jsonl", 32, _RL, dict(reward_funcs=letter_e)),
    "RLOO": ("RLOOConfig", "RLOOTrainer", "sft_prompt_completion.jsonl", 32, _RL, dict(reward_funcs=letter_e)),
    # peft's trainable_token_indices on the tied tiny model: the chat template's <|im_start|> and <|im_end|> rows (in
    # every example) train in the embedding and, through the tie, in the fused head (hfnative.losses.ReplacedRows)
    "SFT-lora-tokens": ("SFTConfig", "SFTTrainer", "sft_messages.jsonl", 64,
                        dict(max_length=128, per_device_train_batch_size=8),
                        dict(peft_config=dict(r=8, lora_alpha=16, target_modules="all-linear",
                                              trainable_token_indices=[1, 2]))),
    # load_in_8bit: LoRA over int8 rows (hfnative.peft.Int8Weight), the custom op hfnative::int8_linear on the device
    "SFT-lora-int8": ("SFTConfig", "SFTTrainer", "sft_messages.jsonl", 64,
                      dict(max_length=128, per_device_train_batch_size=8, model_init_kwargs={"load_in_8bit": True}),
                      dict(peft_config=dict(r=8, lora_alpha=16, target_modules="all-linear"))),
    # QLoRA as TRL's scripts ask for it: an NF4 base computed in bf16, each weight made whole by hfnative's Triton
    # kernel on the device (hfnative.models.triton_dequant)
    "SFT-qlora": ("SFTConfig", "SFTTrainer", "sft_messages.jsonl", 64,
                  dict(max_length=128, per_device_train_batch_size=8, model_init_kwargs={"quantization_config": {
                      "load_in_4bit": True, "bnb_4bit_quant_type": "nf4", "bnb_4bit_compute_dtype": "bfloat16"}}),
                  dict(peft_config=dict(r=8, lora_alpha=16, target_modules="all-linear"))),
}


ON_POLICY = ("distillation", "GKD", "GRPO", "RLOO")  # the setups that generate in their steps


def triton_variants(device: torch.device) -> dict[str, int]:
    """Each of hfnative's Triton kernels: how many variants Triton holds for it in this process, compiled or read
    from its disk cache (on CUDA; an empty dict where the kernels are not in use or run interpreted). A variant
    compiled after a trainer's first step is a stall in the middle of training, a fraction of a second or more."""
    from hfnative.models import triton_kernels

    kernels = triton_kernels._kernels() if device.type == "cuda" else None
    if kernels is None:
        return {}
    return {name: sum(len(cache[0]) for cache in getattr(getattr(kernels, name), "device_caches", {}).values())
            for name in triton_kernels.KERNEL_NAMES}


def _before_each_step(snapshots: list, device: torch.device):
    """A callback that appends ``triton_variants(device)`` to ``snapshots`` as every optimizer step begins (the caller
    appends one more after training): what step k compiled, its logging included, is snapshots[k] - snapshots[k-1]
    counted from 1."""
    from transformers import TrainerCallback

    class BeforeEachStep(TrainerCallback):
        def on_step_begin(self, args, state, control, **kwargs):
            snapshots.append(triton_variants(device))

    return BeforeEachStep()


def compiled_between(before: dict[str, int], after: dict[str, int]) -> str:
    """The Triton variants each kernel gained from ``before`` to ``after`` (``triton_variants`` snapshots), or "none"."""
    gained = {kernel: count - before.get(kernel, 0) for kernel, count in after.items()}
    return ", ".join(f"{kernel} {count}" for kernel, count in sorted(gained.items()) if count > 0) or "none"


def steady_step_seconds(logs: list[dict]) -> float | None:
    """The median ``perf/step_s`` of the steps after the first (the lower one of an even count, so that of two steps
    a one-off in either is not the figure); None without them."""
    later = sorted(entry["perf/step_s"] for entry in logs[1:] if "perf/step_s" in entry)
    return later[(len(later) - 1) // 2] if later else None


def step_times(logs: list[dict], snapshots: list[dict]) -> str:
    """Each step's seconds (``perf/step_s``), the median of the steps after the first (the steady state the device
    check reads), and each later step of 0.1 s or more with the Triton variants compiled in it (a one-off: a kernel
    path first taken then), where the kernels are counted."""
    seconds = [entry.get("perf/step_s") for entry in logs]
    if not seconds or None in seconds:
        return "step s -"
    text = "step s " + " ".join(f"{value:.3g}" for value in seconds)
    steady = steady_step_seconds(logs)
    if steady is not None:
        text += f", median after the first {steady:.3g}"
    slow = []
    for index, value in enumerate(seconds[1:], start=1):
        if value < 0.1:
            continue
        compiled = ""
        if len(snapshots) == len(seconds) + 1 and snapshots[index + 1]:
            compiled = f" (Triton variants compiled in it: {compiled_between(snapshots[index], snapshots[index + 1])})"
        slow.append(f"step {index + 1} {value:.3g} s{compiled}")
    if slow:
        text += "; 0.1 s or more after the first: " + "; ".join(slow)
    return text


def _build(name: str, common: dict):
    """One trainer, built from its config as a user's script builds it."""
    import hfnative

    config_class, trainer_class, data, rows, settings, keywords = SETUPS[name]
    if "peft_config" in keywords:
        import peft

        keywords = dict(keywords, peft_config=peft.LoraConfig(task_type="CAUSAL_LM", **keywords["peft_config"]))
    args = getattr(hfnative, config_class)(**common, **settings)
    return getattr(hfnative, trainer_class)(model=str(TINY), args=args, train_dataset=_dataset(data, rows), **keywords)


def run_one(name: str, device: torch.device, steps: int, folder: Path, bf16: bool) -> tuple[bool, str, float | None]:
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification

    on_cuda = device.type == "cuda"
    common = dict(output_dir=str(folder / name), max_steps=steps, logging_steps=1, learning_rate=1e-3,
                  report_to="none", disable_tqdm=True, save_strategy="no", seed=0,
                  use_cpu=not on_cuda, bf16=bf16)
    begin = time.perf_counter()
    trainer = _build(name, common)
    module = trainer.model
    before = {key: value.detach().float().cpu().clone() for key, value in module.named_parameters()}
    snapshots: list[dict[str, int]] = []
    trainer.add_callback(_before_each_step(snapshots, device))
    trainer.train()
    variants = triton_variants(device)
    snapshots.append(variants)
    trainer.save_model(str(folder / name))
    seconds = time.perf_counter() - begin

    problems = []
    logs = [entry for entry in trainer.state.log_history if "loss" in entry]
    losses = [entry["loss"] for entry in logs]
    if len(losses) != steps:
        problems.append(f"{len(losses)} losses logged for {steps} steps")
    if not all(math.isfinite(loss) for loss in losses):
        problems.append(f"a loss is not finite: {losses}")
    parameters = dict(module.named_parameters())
    off_device = [key for key, value in parameters.items() if value.device.type != device.type]
    if off_device:
        problems.append(f"{len(off_device)} parameters not on {device.type}, e.g. {off_device[0]}")
    moved = sum(not torch.equal(before[key], value.detach().float().cpu()) for key, value in parameters.items())
    if moved == 0:
        problems.append("no parameter changed")
    wanted = ["perf/step_s", "perf/trained_tok_s_wall_clock", "perf/max_rss_gib"]
    if on_cuda:
        from hfnative.metrics import listed_peak_flops

        wanted.append("perf/cuda_max_allocated_gib")
        if listed_peak_flops(torch.cuda.get_device_name(device), torch.bfloat16) is not None:
            wanted.append("perf/mfu_wall_clock")
    last = logs[-1] if logs else {}
    missing = [key for key in wanted if key not in last]
    if missing:
        problems.append(f"not logged: {', '.join(missing)}")
    loader = AutoModelForSequenceClassification if name == "reward" else AutoModelForCausalLM
    try:
        loader.from_pretrained(str(folder / name))
    except Exception as error:  # noqa: BLE001  (the line names whatever stops the load)
        problems.append(f"saved folder does not load: {type(error).__name__}: {error}")

    def shown(key, scale=1.0, digits=3):
        return f"{last[key] * scale:.{digits}g}" if key in last else "-"

    detail = (f"loss {losses[-1] if losses else float('nan'):.4g}, {moved}/{len(parameters)} parameters moved, "
              f"tok/s {shown('perf/trained_tok_s_wall_clock')}, MFU% {shown('perf/mfu_wall_clock')}, "
              f"cuda max alloc GiB {shown('perf/cuda_max_allocated_gib')}, {step_times(logs, snapshots)}, "
              f"{seconds:.1f} s")
    if len(snapshots) > 2 and snapshots[1]:  # informational: a kernel path first taken after step 1 compiles then
        detail += f"; Triton variants compiled after step 1: {compiled_between(snapshots[1], variants)}"
    steady = steady_step_seconds(logs)
    if problems:
        return False, "; ".join(problems) + " | " + detail, steady
    return True, detail, steady


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu", choices=("cuda", "cpu"))
    parser.add_argument("--steps", type=int, default=4,
                        help="optimizer steps of each trainer (the line reads the steps after the first as the steady state)")
    parser.add_argument("--precision", choices=("bf16", "fp32"), default=None,
                        help="bf16 (autocast over fp32 weights, the default on cuda) or fp32 (the default on cpu)")
    parser.add_argument("--only", default=",".join(SETUPS), help="comma-separated trainer names")
    parser.add_argument("--json", type=Path, default=None, help="also write the results here")
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        print("--device cuda: torch sees no CUDA device here", file=sys.stderr)
        return 2
    bf16 = (args.precision or ("bf16" if device.type == "cuda" else "fp32")) == "bf16"
    names = [name.strip() for name in args.only.split(",") if name.strip()]
    unknown = [name for name in names if name not in SETUPS]
    if unknown:
        parser.error(f"--only: unknown trainer(s) {', '.join(unknown)}; choose from {', '.join(SETUPS)}")
    import transformers

    transformers.utils.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
    failures, results = 0, {}
    with tempfile.TemporaryDirectory() as folder:
        for name in names:
            try:
                ok, detail, steady = run_one(name, device, args.steps, Path(folder), bf16)
            except Exception as error:  # noqa: BLE001  (one trainer's failure must not hide the next's)
                ok, steady = False, None
                detail = f"{type(error).__name__}: {str(error).splitlines()[0][:200] if str(error) else ''}"
                traceback.print_exc()
            failures += not ok
            results[name] = {"ok": ok, "detail": detail, "steady_step_s": steady}
            print(f"{'PASS' if ok else 'FAIL':<5} trainer {name:<14} {detail}", flush=True)
    on_policy = {name: results[name]["steady_step_s"] for name in ON_POLICY if name in results}
    if on_policy:  # the generating trainers' steady state (a bar of the rollout issue: under 0.1 s a step)
        print("on-policy steps, median after the first (s): "
              + ", ".join(f"{name} {'-' if value is None else f'{value:.3g}'}" for name, value in on_policy.items()),
              flush=True)
    if args.json:
        args.json.write_text(json.dumps(results, indent=1))
    print(f"{failures} failed" if failures else "all passed")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
