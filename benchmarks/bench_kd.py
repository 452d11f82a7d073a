"""Knowledge-distillation throughput and memory: TRL's DistillationTrainer vs hfnative's, teacher ~2x the student.

Both runners train the same saved student against the same saved teacher (same vocabulary, about twice the
student's parameters) on the same prompts, in the same seeded order, with the same hyperparameters, each in its own
child process. Generation is taken out of the measurement: both trainers' generation step is replaced by the same
fixed completions (``--completion`` tokens per prompt, cut from the corpus), so the timed work is the teacher's
forward, the student's forward and backward and the generalized JSD through both heads (TRL's chunked divergence;
hfnative's fused chunked JSD), and the optimizer step. Generation speed is bench_generate.py's subject; with
``--on-policy`` each trainer samples its completions itself (TRL with transformers' ``generate``, use_vllm=False;
hfnative with its native engine), as on-policy distillation runs, and the step's time includes it.

    python benchmarks/bench_kd.py --preset smoke --rounds 1
    python benchmarks/bench_kd.py --preset reference
    python benchmarks/bench_kd.py --preset 100m --rounds 1
    python benchmarks/bench_kd.py --device cuda --preset 100m
    python benchmarks/bench_kd.py --device cuda --preset qwen3_0.6b --on-policy --seq 320 --completion 256 --batch 8

Printed: tokens/s (prompt + completion tokens of the timed steps, warm-up steps excluded), peak memory (RSS on
CPU, max_memory_allocated on CUDA), per-step losses side by side with their largest relative difference.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import shutil
import statistics
import sys
from pathlib import Path

import datasets
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, Qwen3Config

sys.path.insert(0, str(Path(__file__).resolve().parent))
from harness import (  # noqa: E402  (benchmarks/ is not a package)
    CORPUS,
    HeapPeak,
    PRESETS,
    Shape,
    TOKENIZER_DIR,
    _CountingCollator,
    _StepClock,
    add_run_arguments,
    build_model,
    child_main,
    finish,
    finished_runs,
    loss_rows,
    machine_description,
    max_relative_difference,
    peak_rss_mib,
    run_rounds,
    start_parent,
    training_arguments,
    work_folder,
)

RUNNERS = ("trl", "ours")

# the teacher of each student preset: same vocabulary, about twice the parameters
TEACHERS = {
    "smoke": Shape(hidden=96, layers=3, heads=6, kv_heads=2, head_dim=16, intermediate=128, vocab=1024,
                   seq=0, batch=0, steps=0, warmup=0),
    "reference": Shape(hidden=384, layers=6, heads=6, kv_heads=2, head_dim=64, intermediate=1536, vocab=32000,
                       seq=0, batch=0, steps=0, warmup=0),
    "100m": Shape(hidden=1024, layers=16, heads=16, kv_heads=4, head_dim=64, intermediate=2816, vocab=32000,
                  seq=0, batch=0, steps=0, warmup=0),
    "qwen3_0.6b": Shape(hidden=1024, layers=56, heads=16, kv_heads=8, head_dim=128, intermediate=3072, vocab=151936,
                        seq=0, batch=0, steps=0, warmup=0),
}


# ------------------------------------------------------------------------------------------------
# the workload


def build_rows(shape: Shape, completion: int, folder: Path, tokenizer) -> dict:
    """``steps * batch`` prompts of ``seq - completion`` tokens and their fixed completions of ``completion`` tokens,
    cut from the corpus's token stream. Prompts are stored as text (decoded); the completions by the prompt's ids."""
    with open(CORPUS) as f:
        stream = [t for line in f for t in tokenizer(json.loads(line)["text"])["input_ids"] + [tokenizer.eos_token_id]]
    prompt_length = shape.seq - completion
    rows, completions, offset = [], {}, 0
    while len(rows) < shape.steps * shape.batch:
        if offset + shape.seq > len(stream):
            offset = (offset + 7) % prompt_length  # another pass over the corpus, cut elsewhere
        text = tokenizer.decode(stream[offset : offset + prompt_length])
        ids = tokenizer(text)["input_ids"]
        key = json.dumps(ids)
        if key not in completions:
            completions[key] = stream[offset + prompt_length : offset + shape.seq]
            rows.append({"prompt": text, "completion": tokenizer.decode(completions[key])})
        offset += shape.seq
    datasets.Dataset.from_list(rows).save_to_disk(str(folder / "data"))
    (folder / "completions.json").write_text(json.dumps(completions))
    lengths = [len(json.loads(k)) + completion for k in completions]
    return {"rows": len(rows), "tokens": sum(lengths)}


def parameters_of(folder: Path) -> int:
    return sum(p.numel() for p in AutoModelForCausalLM.from_pretrained(folder).parameters())


def build_teacher(shape: Shape, folder: Path, seed: int) -> int:
    config = Qwen3Config(
        vocab_size=shape.vocab, hidden_size=shape.hidden, num_hidden_layers=shape.layers,
        num_attention_heads=shape.heads, num_key_value_heads=shape.kv_heads, head_dim=shape.head_dim,
        intermediate_size=shape.intermediate, max_position_embeddings=2048, tie_word_embeddings=True,
        pad_token_id=0, eos_token_id=2, bos_token_id=None, dtype="float32",
    )
    torch.manual_seed(seed + 1)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.save_pretrained(folder)
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        shutil.copy(TOKENIZER_DIR / name, folder / name)
    return sum(p.numel() for p in model.parameters())


# ------------------------------------------------------------------------------------------------
# child: one runner, one training run


def train_once(runner: str, spec: dict, notes: list[str]) -> dict:
    device, shape = spec["device"], Shape(**spec["shape"])
    work = Path(spec["work_dir"])
    dataset = datasets.load_from_disk(str(work / "data"))
    tokenizer = AutoTokenizer.from_pretrained(spec["model_dir"])
    common = dict(training_arguments(runner, spec), beta=spec["beta"], temperature=spec["temperature"])
    on_policy = spec.get("on_policy", False)  # each trainer generates its completions with its own engine
    if spec.get("trainer") == "gkd":  # off-policy: the conversations as they are; on-policy: the student's samples
        rows = [{"messages": [{"role": "user", "content": r["prompt"]}, {"role": "assistant", "content": r["completion"]}]}
                for r in dataset]
        dataset = datasets.Dataset.from_list(rows)
        if runner == "trl":
            from trl.experimental.gkd import GKDConfig, GKDTrainer
        else:
            from hfnative import GKDConfig, GKDTrainer
        args = GKDConfig(**common, lmbda=1.0 if on_policy else 0.0, max_new_tokens=spec["completion"])
        trainer = GKDTrainer(model=spec["model_dir"], teacher_model=spec["teacher_dir"], args=args,
                             train_dataset=dataset, processing_class=tokenizer)
        counter = _CountingCollator(trainer.data_collator)
        trainer.data_collator = counter
        return train_and_measure(trainer, shape, device == "cuda", lambda: counter.tokens)

    completions = {tuple(json.loads(k)): v for k, v in json.loads((work / "completions.json").read_text()).items()}
    common.update(max_completion_length=spec["completion"], shuffle_dataset=True)

    def fixed(prompt_ids) -> list[list[int]]:
        return [list(completions[tuple(p)]) for p in prompt_ids]

    if runner == "trl":
        import trl

        if not on_policy:
            trl.DistillationTrainer._generate_single_turn = lambda self, prompt_ids, *a, **k: fixed(prompt_ids)
        tokenizer.padding_side = "left"
        args = trl.DistillationConfig(**common)
        trainer = trl.DistillationTrainer(model=spec["model_dir"], teacher_model=spec["teacher_dir"], args=args,
                                          train_dataset=dataset, processing_class=tokenizer)
    elif runner == "ours":
        import hfnative
        from hfnative.trainers.algorithms import distillation as distillation_trainer

        if not on_policy:
            distillation_trainer._DistillationObjective.generate = lambda self, model, prompts, sampling: fixed(prompts)
        args = hfnative.DistillationConfig(**common)
        trainer = hfnative.DistillationTrainer(model=spec["model_dir"], teacher_model=spec["teacher_dir"], args=args,
                                               train_dataset=dataset, processing_class=tokenizer)
    else:
        raise ValueError(f"unknown runner {runner!r}")
    # fixed-length prompts and completions: every step trains batch * seq tokens (on-policy: at most, a completion
    # stopping early at a sampled EOS)
    return train_and_measure(trainer, shape, device == "cuda", lambda: [shape.batch * shape.seq] * shape.steps)


def train_and_measure(trainer, shape: Shape, is_cuda: bool, step_tokens) -> dict:
    """``trainer.train()`` timed per optimizer step; ``step_tokens()``: the tokens each step trained, in order."""
    clock = _StepClock(is_cuda)
    trainer.add_callback(clock)
    if is_cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    with HeapPeak() as heap:
        trainer.train()
    steps = [e for e in trainer.state.log_history if "loss" in e and "train_loss" not in e]
    if len(clock.step_end_times) < shape.steps:
        raise RuntimeError(f"only {len(clock.step_end_times)} of {shape.steps} steps ran")
    times = clock.step_end_times
    timed_seconds = times[shape.steps - 1] - times[shape.warmup - 1]
    timed_tokens = sum(step_tokens()[shape.warmup : shape.steps])
    return {
        "losses": [e["loss"] for e in steps],
        "grad_norms": [e.get("grad_norm") for e in steps],
        "tokens_per_second": timed_tokens / timed_seconds,
        "timed_tokens": timed_tokens,
        "step_seconds": [b - a for a, b in zip(times, times[1:])],
        "peak_rss_mib": peak_rss_mib(),
        "peak_gpu_mib": torch.cuda.max_memory_allocated() / 2**20 if is_cuda else None,
        "peak_heap_mib": heap.peak_mib,
    }


# ------------------------------------------------------------------------------------------------
# report


def summarize(results: list[dict], device: str) -> str:
    lines, summary = [], {}
    memory = "peak GPU MiB" if device == "cuda" else "peak RSS MiB"
    header = f"{'runner':<10}{'tokens/s':>12}{'min..max':>20}{memory:>14}{'peak heap':>11}{'final loss':>14}"
    lines += [header, "-" * len(header)]
    for runner, ok, rates in finished_runs(results, RUNNERS, lines, runner_width=10, status_width=12):
        peak = max(r["peak_gpu_mib"] if device == "cuda" else r["peak_rss_mib"] for r in ok)
        heap = max((r.get("peak_heap_mib") or float("nan") for r in ok), default=float("nan"))
        summary[runner] = {"rate": statistics.median(rates), "peak": peak, "losses": ok[0]["losses"],
                           "grad_norms": ok[0]["grad_norms"]}
        lines.append(f"{runner:<10}{statistics.median(rates):>12,.0f}{f'{min(rates):,.0f}..{max(rates):,.0f}':>20}"
                     f"{peak:>14,.0f}{heap:>11,.0f}{ok[0]['losses'][-1]:>14.6f}")
    if len(summary) == 2:
        ours, trl = summary["ours"], summary["trl"]
        lines += ["", f"ours / trl: tokens/s x{ours['rate'] / trl['rate']:.2f}, {memory} x{ours['peak'] / trl['peak']:.2f}"]
        rows, widths = loss_rows({n: summary[n]["losses"] for n in RUNNERS}, range(len(trl["losses"])), min_width=14)
        lines += ["", "per-step loss:"] + rows
        lines.append(f"{'maxrel':>6}" + "".join(
            f"{max_relative_difference(summary[n]['losses'], trl['losses']):>{w}.2e}" for n, w in zip(RUNNERS, widths)))
        lines.append(f"{'gnorm':>6}" + "".join(
            f"{max_relative_difference(summary[n]['grad_norms'], trl['grad_norms']):>{w}.2e}" for n, w in zip(RUNNERS, widths)))
    return "\n".join(lines)


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", choices=sorted(TEACHERS), default=None,
                        help="student shape (default: reference on cpu, 100m on cuda); the teacher is ~2x")
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--trainer", choices=("distillation", "gkd"), default="distillation",
                        help="DistillationTrainer with fixed completions (TRL's chunked divergence), or GKDTrainer "
                             "off-policy (lmbda=0; TRL's materializes both models' logits; with --on-policy lmbda=1: "
                             "every step trains on the student's samples)")
    parser.add_argument("--runners", default=",".join(RUNNERS), help="comma-separated subset of trl,ours")
    parser.add_argument("--completion", type=int, default=None, help="completion tokens per row (default: seq / 2)")
    parser.add_argument("--on-policy", "--on_policy", action="store_true",
                        help="each trainer samples its completions (--completion tokens) with its own "
                             "engine (TRL: transformers' generate, use_vllm=False; hfnative: the native engine) instead "
                             "of the fixed ones: the step then times generation too")
    parser.add_argument("--beta", type=float, default=0.5)
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--activation_checkpointing", action="store_true", help="activation checkpointing for both")
    add_run_arguments(parser, timeout=3600, rounds=2, overrides=("seq", "batch", "steps", "warmup", "vocab"))
    return parser.parse_args(argv)


def main() -> None:
    cli = parse_args()
    if cli.child:
        child_main(cli, train=train_once)
        return
    cli.preset = cli.preset or ("100m" if cli.device == "cuda" else "reference")
    shape = start_parent(cli, PRESETS)
    teacher_shape = dataclasses.replace(TEACHERS[cli.preset], vocab=shape.vocab)
    completion = cli.completion or shape.seq // 2
    runners = cli.runners.split(",")
    if not set(runners) <= set(RUNNERS):
        sys.exit(f"--runners: use a subset of {','.join(RUNNERS)}")

    with work_folder("bench_kd_", cli.keep) as work:
        student_params = build_model(shape, work / "model", cli.seed)
        teacher_params = build_teacher(teacher_shape, work / "teacher", cli.seed)
        data = build_rows(shape, completion, work, AutoTokenizer.from_pretrained(str(TOKENIZER_DIR)))
        spec = {"device": cli.device, "shape": dataclasses.asdict(shape), "model_dir": str(work / "model"),
                "teacher_dir": str(work / "teacher"), "work_dir": str(work), "completion": completion, "trainer": cli.trainer,
                "beta": cli.beta, "temperature": cli.temperature, "max_grad_norm": cli.max_grad_norm, "seed": cli.seed,
                "threads": cli.threads, "checkpointing": cli.activation_checkpointing, "on_policy": cli.on_policy}
        (work / "spec.json").write_text(json.dumps(spec))
        machine = machine_description(cli.device)
        setup = "\n".join([
            f"machine: {machine['cpu']}, {machine['cores']} cores, torch threads {machine['torch_threads']}"
            + (f", GPU {machine['gpu']}" if "gpu" in machine else ""),
            f"software: torch {machine['torch']}, transformers {machine['transformers']}, trl {machine['trl']}; "
            f"date {machine['date']}",
            f"student: Qwen3-shaped, hidden {shape.hidden}, {shape.layers} layers, vocab {shape.vocab}, "
            f"{student_params / 1e6:.2f}M parameters; teacher: hidden {teacher_shape.hidden}, {teacher_shape.layers} "
            f"layers, {teacher_params / 1e6:.2f}M parameters ({teacher_params / student_params:.2f}x)",
            f"training: {cli.trainer}, {'bf16 autocast' if cli.device == 'cuda' else 'fp32'}, {shape.batch} rows of "
            f"{shape.seq - completion} prompt + {completion} "
            f"{'sampled (on-policy; tokens/s counts them all)' if cli.on_policy else 'fixed'} completion tokens, "
            f"{shape.steps} steps "
            f"({shape.warmup} warm-up not timed), beta {cli.beta}, temperature {cli.temperature}, AdamW lr 1e-3, "
            f"{'activation checkpointing' if cli.activation_checkpointing else 'no activation checkpointing'}; "
            f"data: {data['rows']} rows, {data['tokens']:,} tokens",
        ])
        print(setup, flush=True)

        def shown(result: dict) -> str:
            return (f"{result['tokens_per_second']:,.0f} tokens/s, peak RSS {result['peak_rss_mib']:,.0f} MiB"
                    + (f", peak GPU {result['peak_gpu_mib']:,.0f} MiB" if result.get("peak_gpu_mib") else "")
                    + f", final loss {result['losses'][-1]:.6f}")

        from harness import Workload

        workload = Workload(student_params, data, work / "spec.json")
        results = run_rounds(runners, workload, cli, __file__, shown)
        title = f"## {datetime.date.today().isoformat()} — knowledge distillation ({cli.trainer}), preset `{cli.preset}`, {cli.device}"
        finish(cli, setup, summarize(results, cli.device), results, title, __file__)


if __name__ == "__main__":
    main()
