"""Reward-model and KTO throughput, memory and loss agreement: TRL 1.16's RewardTrainer / KTOTrainer vs hfnative's.

``--trainer reward``: both runners train the same saved Qwen3ForSequenceClassification (the preset's Qwen3 shape,
one label, pad token 0, its score head drawn under the seed) on the same preference rows (prompt, chosen,
rejected), ``batch / 2`` pairs (``batch`` sequences) per step, Bradley-Terry loss.

``--trainer kto``: both runners train the preset's causal LM on the same unpaired rows (prompt, completion,
label), ``batch`` rows per step, the reference being a frozen copy of the checkpoint that each trainer loads
itself (``ref_model=None``), the KTO loss with its KL reference point (mismatched completions, TRL's default).

Same seed, same order and the same hyperparameters for both runners; each run in its own child process (so peak
memory is per runner), runners alternating over several rounds. Printed: tokens/s (non-padding tokens of the
trained sequences, warm-up steps excluded; for KTO the prompt + completion sequences only, the KL sequences'
forward passes are work on top of them and are not counted), peak RSS (peak GPU memory on CUDA), peak heap,
per-step losses and grad norms side by side with their largest relative difference from TRL's.

    python benchmarks/bench_reward.py --trainer reward --preset smoke --rounds 1
    python benchmarks/bench_reward.py --trainer kto --preset smoke --rounds 1
    python benchmarks/bench_reward.py --trainer reward --preset reference
    python benchmarks/bench_reward.py --trainer kto --preset 100m --rounds 1
    python benchmarks/bench_reward.py --trainer kto --device cuda --preset qwen3_0.6b

Rows: bench_dpo.py's (text prompts of several "Question: ...\\nAnswer: ..." pairs from examples/data/preference.jsonl,
grown until prompt + the longer completion fill about ``seq`` tokens). For KTO each row keeps the chosen or the
rejected completion, picked at random under the seed, with label True / False.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import random
import shutil
import sys
from pathlib import Path

import datasets
import torch
import transformers
from transformers import AutoModelForSequenceClassification, AutoTokenizer

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_dpo import build_preference_rows, summarize  # noqa: E402  (the same rows and report as DPO)
from harness import (  # noqa: E402  (benchmarks/ is not a package)
    PRESETS,
    TOKENIZER_DIR,
    Shape,
    Workload,
    add_run_arguments,
    build_model,
    child_main,
    finish,
    machine_description,
    run_rounds,
    start_parent,
    train_and_measure,
    training_arguments,
    work_folder,
)

RUNNERS = ("trl", "ours")
KTO_BETA = 0.1


# ------------------------------------------------------------------------------------------------
# workload


def build_reward_model(shape: Shape, folder: Path, seed: int) -> int:
    """The preset's Qwen3 as a sequence classifier with one label and a pad token, saved to ``folder``: the body is
    harness.build_model's, the score head drawn by transformers' init under ``seed``. Returns its parameter count."""
    causal = folder.parent / "causal"
    build_model(shape, causal, seed)
    torch.manual_seed(seed)
    verbosity = transformers.logging.get_verbosity()
    transformers.logging.set_verbosity_error()  # not the load report of the new score head
    try:
        model = AutoModelForSequenceClassification.from_pretrained(str(causal), num_labels=1, pad_token_id=0,
                                                                   dtype=torch.float32)
    finally:
        transformers.logging.set_verbosity(verbosity)
    model.save_pretrained(folder)
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        shutil.copy(TOKENIZER_DIR / name, folder / name)
    shutil.rmtree(causal)
    return sum(p.numel() for p in model.parameters())


def build_unpaired_rows(shape: Shape, folder: Path, seed: int) -> dict:
    """Unpaired rows (prompt, completion, label) from bench_dpo's preference rows: ``batch`` rows per step, each with
    the chosen (label True) or the rejected (label False) completion, picked at random under ``seed``."""
    paired_folder = folder.parent / "paired"
    # bench_dpo makes batch / 2 pairs per step; twice the batch gives `batch` rows per step
    build_preference_rows(dataclasses.replace(shape, batch=2 * shape.batch), paired_folder, seed)
    pairs = datasets.load_from_disk(str(paired_folder)).to_list()
    tokenizer = AutoTokenizer.from_pretrained(str(TOKENIZER_DIR))
    picks = random.Random(seed + 1)
    rows, tokens = [], 0
    for pair in pairs:
        label = picks.random() < 0.5
        completion = pair["chosen"] if label else pair["rejected"]
        rows.append({"prompt": pair["prompt"], "completion": completion, "label": label})
        tokens += len(tokenizer(pair["prompt"] + completion)["input_ids"])
    datasets.Dataset.from_list(rows).save_to_disk(str(folder))
    shutil.rmtree(paired_folder)
    return {"rows": len(rows), "tokens": tokens, "desirable": sum(r["label"] for r in rows)}


# ------------------------------------------------------------------------------------------------
# child: one runner, one training run


def train_once(runner: str, spec: dict, notes: list[str]) -> dict:
    shape = Shape(**spec["shape"])
    dataset = datasets.load_from_disk(spec["data_dir"])
    tokenizer = AutoTokenizer.from_pretrained(spec["model_dir"])
    if runner == "trl":
        import trl

        module = trl
    elif runner == "ours":
        import hfnative

        module = hfnative
    else:
        raise ValueError(f"unknown runner {runner!r}")
    common = training_arguments(runner, spec)
    if spec["trainer"] == "reward":
        common["per_device_train_batch_size"] = max(shape.batch // 2, 1)  # pairs: 2x that many sequences per forward
        config = module.RewardConfig(**common, max_length=shape.seq)
        trainer = module.RewardTrainer(model=spec["model_dir"], args=config, train_dataset=dataset,
                                       processing_class=tokenizer)
    elif spec["trainer"] == "kto":
        # TRL 1.16 has KTO in its stable API (trl.experimental.kto is a deprecated alias of the same classes)
        config = module.KTOConfig(**common, max_length=shape.seq, beta=KTO_BETA)
        trainer = module.KTOTrainer(model=spec["model_dir"], ref_model=None, args=config, train_dataset=dataset,
                                    processing_class=tokenizer)
    else:
        raise ValueError(f"unknown trainer {spec['trainer']!r}")
    result, _ = train_and_measure(trainer, shape, spec["device"] == "cuda")
    return result


# ------------------------------------------------------------------------------------------------
# command line


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--trainer", choices=("reward", "kto"), default=None,
                        help="RewardTrainer (sequence classifier, preference pairs) or KTOTrainer (causal LM, "
                             "unpaired rows); required")
    parser.add_argument("--preset", choices=sorted(PRESETS), default=None,
                        help="model and batch shape (default: reference on cpu, qwen3_0.6b on cuda)")
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--activation_checkpointing", action="store_true",
                        help="activation checkpointing for both runners (TRL's default)")
    add_run_arguments(parser, timeout=3600, rounds=3, overrides=("seq", "batch", "steps", "warmup", "vocab"))
    return parser.parse_args(argv)


def main() -> None:
    cli = parse_args()
    if cli.child:
        child_main(cli, train=train_once)
        return
    if cli.trainer is None:
        sys.exit("--trainer reward|kto is required")
    cli.preset = cli.preset or ("qwen3_0.6b" if cli.device == "cuda" else "reference")
    shape = start_parent(cli, PRESETS)
    reward = cli.trainer == "reward"
    with work_folder(f"bench_{cli.trainer}_", cli.keep) as work:
        if reward:
            parameters = build_reward_model(shape, work / "model", cli.seed)
            data = build_preference_rows(shape, work / "data", cli.seed)
        else:
            parameters = build_model(shape, work / "model", cli.seed)
            data = build_unpaired_rows(shape, work / "data", cli.seed)
        spec = {"trainer": cli.trainer, "device": cli.device, "shape": shape.__dict__, "model_dir": str(work / "model"),
                "data_dir": str(work / "data"), "work_dir": str(work), "checkpointing": cli.activation_checkpointing,
                "max_grad_norm": cli.max_grad_norm, "seed": cli.seed, "threads": cli.threads}
        spec_path = work / "spec.json"
        spec_path.write_text(json.dumps(spec))
        machine = machine_description(cli.device)
        body = f"hidden {shape.hidden}, {shape.layers} layers, vocab {shape.vocab}"
        if reward:
            model = (f"model: Qwen3ForSequenceClassification, {body}, 1 label, pad token 0; "
                     f"{parameters / 1e6:.2f}M parameters")
            method = (f"Bradley-Terry reward loss, max_length {shape.seq}, {max(shape.batch // 2, 1)} pairs "
                      f"({shape.batch} sequences) per step")
            rows = f"data: {data['rows']} pairs, {data['tokens']:,} tokens"
        else:
            model = (f"model: Qwen3-shaped causal LM, {body}, tied; {parameters / 1e6:.2f}M parameters; "
                     f"reference: a frozen copy (ref_model=None)")
            method = (f"KTO (loss_type kto, KL reference point from mismatched completions) beta {KTO_BETA}, "
                      f"max_length {shape.seq}, {shape.batch} rows per step")
            rows = (f"data: {data['rows']} unpaired rows ({data['desirable']} desirable), {data['tokens']:,} tokens "
                    f"(prompt + completion)")
        setup = "\n".join([
            f"machine: {machine['cpu']}, {machine['cores']} cores, torch threads {machine['torch_threads']}"
            + (f", GPU {machine['gpu']}" if "gpu" in machine else ""),
            f"software: python {machine['python']}, torch {machine['torch']}, transformers {machine['transformers']}, "
            f"trl {machine['trl']}; date {machine['date']}; load average {machine['load_average']}",
            model,
            f"training: {'bf16 autocast' if cli.device == 'cuda' else 'fp32'}, {method}, {shape.steps} steps "
            f"({shape.warmup} warm-up not timed), AdamW lr 1e-3 constant, max_grad_norm {cli.max_grad_norm}, "
            f"{'activation checkpointing' if cli.activation_checkpointing else 'no activation checkpointing'}; {rows}",
        ])
        print(setup, flush=True)

        def shown(result: dict) -> str:
            memory = result["peak_gpu_mib"] if cli.device == "cuda" else result["peak_rss_mib"]
            return (f"{result['tokens_per_second']:,.0f} tokens/s, peak {memory:,.0f} MiB, "
                    f"final loss {result['losses'][-1]:.6f}")

        results = run_rounds(list(RUNNERS), Workload(parameters, data, spec_path), cli, __file__, shown)
        what = "reward model (RewardTrainer)" if reward else "KTO"
        title = f"## {datetime.date.today().isoformat()} — {what}, preset `{cli.preset}`, {cli.device}"
        finish(cli, setup, summarize(results, cli.device), results, title, __file__)


if __name__ == "__main__":
    main()
