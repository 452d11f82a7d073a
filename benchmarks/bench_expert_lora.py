"""LoRA on a mixture of experts' stacked expert tensors, the way gpt-oss is fine-tuned with TRL: TRL + peft (its
``ParamWrapper`` on transformers' GptOss module) beside hfnative's native adapters, the same saved model, token rows,
``peft.LoraConfig(target_modules="all-linear", target_parameters=[every layer's experts.gate_up_proj and
experts.down_proj])`` and SFTConfig. Each run is its own child process; runners alternate over --rounds.

    python benchmarks/bench_expert_lora.py --preset smoke
    python benchmarks/bench_expert_lora.py --write-results
    python benchmarks/bench_expert_lora.py --device cuda --preset gptoss_20b_2layers   # bf16 autocast on one GPU

LoRA's B starts at zero, so the step-1 loss is the base model's and must agree; peft and hfnative draw A from their
own random streams, so the losses part after it.
"""

from __future__ import annotations

import argparse
import json
import dataclasses
import statistics
import sys
from pathlib import Path

import datasets
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, GptOssConfig

sys.path.insert(0, str(Path(__file__).resolve().parent))
from harness import (  # noqa: E402  (benchmarks/ is not a package)
    Shape,
    TOKENIZER_DIR,
    Workload,
    add_run_arguments,
    build_dataset,
    child_main,
    finish,
    finished_runs,
    loss_rows,
    machine_description,
    max_relative_difference,
    package_version,
    profile_dir,
    run_notes,
    run_rounds,
    start_parent,
    train_and_measure,
    training_arguments,
    work_folder,
)

RUNNERS = ("trl", "ours")
# (Shape, experts, experts per token); Shape.intermediate is each expert's hidden size
PRESETS = {
    "smoke": (Shape(hidden=64, layers=2, heads=4, kv_heads=2, head_dim=16, intermediate=64, vocab=1024, seq=64,
                    batch=4, steps=4, warmup=2), 4, 2),
    "small": (Shape(hidden=256, layers=4, heads=4, kv_heads=2, head_dim=64, intermediate=256, vocab=4096, seq=256,
                    batch=4, steps=8, warmup=2), 16, 4),
    # gpt-oss-20b's layer shape (32 experts, top 4) and vocabulary, 2 of its 24 layers: for --device cuda
    "gptoss_20b_2layers": (Shape(hidden=2880, layers=2, heads=64, kv_heads=8, head_dim=64, intermediate=2880,
                                 vocab=201088, seq=1024, batch=2, steps=6, warmup=2), 32, 4),
}


def lora_config(layers: int) -> dict:
    parameters = [f"{i}.mlp.experts.{name}" for i in range(layers) for name in ("gate_up_proj", "down_proj")]
    return dict(r=8, lora_alpha=16, lora_dropout=0.0, target_modules="all-linear", target_parameters=parameters,
                task_type="CAUSAL_LM")


def build_model(shape: Shape, experts: int, top_k: int, folder: Path, seed: int) -> int:
    config = GptOssConfig(
        vocab_size=shape.vocab, hidden_size=shape.hidden, num_hidden_layers=shape.layers,
        num_attention_heads=shape.heads, num_key_value_heads=shape.kv_heads, head_dim=shape.head_dim,
        intermediate_size=shape.intermediate, num_local_experts=experts, num_experts_per_tok=top_k,
        layer_types=["sliding_attention", "full_attention"] * (shape.layers // 2), sliding_window=128,
        max_position_embeddings=max(shape.seq, 2048), pad_token_id=0, eos_token_id=2, bos_token_id=None,
        tie_word_embeddings=False, router_aux_loss_coef=0.0,
    )
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config)
    model.save_pretrained(folder)
    AutoTokenizer.from_pretrained(str(TOKENIZER_DIR)).save_pretrained(folder)
    return sum(p.numel() for p in model.parameters())


def train(runner: str, spec: dict, notes: list[str]) -> dict:
    import peft

    shape = Shape(**spec["shape"])
    dataset = datasets.load_from_disk(spec["data_dir"])
    tokenizer = AutoTokenizer.from_pretrained(spec["model_dir"])
    arguments = dict(training_arguments(runner, spec), max_length=shape.seq, packing=False)
    peft_config = peft.LoraConfig(**lora_config(shape.layers))
    if runner == "trl":
        import trl

        trainer = trl.SFTTrainer(model=spec["model_dir"], args=trl.SFTConfig(**arguments), train_dataset=dataset,
                                 processing_class=tokenizer, peft_config=peft_config)
    else:
        import hfnative
        from hfnative.peft import expert_lora_modules

        trainer = hfnative.SFTTrainer(model=spec["model_dir"], args=hfnative.SFTConfig(**arguments),
                                      train_dataset=dataset, processing_class=tokenizer, peft_config=peft_config)
        if not expert_lora_modules(trainer.converted.model):
            raise RuntimeError("hfnative did not adapt the experts natively")
    result, _ = train_and_measure(trainer, shape, is_cuda=spec["device"] == "cuda")
    return {**result, "trainable_params": sum(p.numel() for p in trainer.model.parameters() if p.requires_grad)}


def summarize(results: list[dict]) -> str:
    header = f"{'runner':<8}{'peak MiB':>14}{'tokens/s':>10}{'min..max':>16}{'final loss':>12}{'trainable':>12}"
    lines, summary = [header, "-" * len(header)], {}
    for runner, ok, rates in finished_runs(results, RUNNERS, lines, runner_width=8, status_width=14):
        summary[runner] = s = {"peak": max(r["peak_gpu_mib"] or r["peak_rss_mib"] for r in ok), "rate": statistics.median(rates),
                               "losses": ok[0]["losses"], "trainable": ok[0]["trainable_params"]}
        lines.append(f"{runner:<8}{s['peak']:>14,.0f}{s['rate']:>10,.0f}{f'{min(rates):,.0f}..{max(rates):,.0f}':>16}"
                     f"{s['losses'][-1]:>12.6f}{s['trainable']:>12,}")
    if len(summary) == 2:
        ours, theirs = summary["ours"], summary["trl"]
        lines += ["", f"ours / trl: tokens/s x{ours['rate'] / theirs['rate']:.2f}, peak memory x{ours['peak'] / theirs['peak']:.2f}",
                  f"step-1 loss rel. diff {max_relative_difference(ours['losses'][:1], theirs['losses'][:1]):.2e} "
                  "(B starts at 0: the base model's loss)", ""]
        rows, _ = loss_rows({n: summary[n]["losses"] for n in RUNNERS}, range(len(theirs["losses"])), min_width=12)
        lines += rows
        if ours["trainable"] != theirs["trainable"]:
            lines.append(f"note: ours trains {ours['trainable']:,} parameters, trl {theirs['trainable']:,}")
    notes = sorted(run_notes(results))
    if notes:
        lines += ["", "notes:"] + [f"  - {n}" for n in notes]
    return "\n".join(lines)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", choices=sorted(PRESETS), default="small")
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                        help="cuda: bf16 autocast over fp32 weights on one GPU (TRL's bf16=True), peak GPU memory")
    add_run_arguments(parser, timeout=900, rounds=2, overrides=("seq", "batch", "steps", "warmup"))
    cli = parser.parse_args(argv)
    if cli.child:
        child_main(cli, train)
        return
    presets = {name: shape for name, (shape, _, _) in PRESETS.items()}
    shape = start_parent(cli, presets)
    _, experts, top_k = PRESETS[cli.preset]
    with work_folder("bench-expert-lora-", cli.keep) as work:
        parameters = build_model(shape, experts, top_k, work / "model", cli.seed)
        data = build_dataset(shape, work / "data", packing=False, seed=cli.seed)
        spec = {"device": cli.device, "shape": dataclasses.asdict(shape), "model_dir": str(work / "model"),
                "data_dir": str(work / "data"), "work_dir": str(work), "packing": False,
                "max_grad_norm": cli.max_grad_norm, "seed": cli.seed, "threads": cli.threads,
                "profile_dir": profile_dir(cli)}
        spec_path = work / "spec.json"
        spec_path.write_text(json.dumps(spec))
        results = run_rounds(list(RUNNERS), Workload(parameters, data, spec_path), cli, __file__,
                             lambda r: f"{r['tokens_per_second']:,.0f} tokens/s")
    machine = machine_description(cli.device)
    setup = "\n".join([
        f"machine: {machine['cpu']}, {machine['cores']} cores, torch threads {machine['torch_threads']}",
        f"software: torch {machine['torch']}, transformers {machine['transformers']}, trl {machine['trl']}, "
        f"peft {package_version('peft')}; date {machine['date']}; load average {machine['load_average']}",
        f"model: GPT-OSS-shaped, hidden {shape.hidden}, {shape.layers} layers, {experts} experts (top {top_k}) of "
        f"hidden {shape.intermediate}, vocab {shape.vocab}; {parameters / 1e6:.2f}M parameters",
        f"training: {'bf16 autocast' if cli.device == 'cuda' else 'fp32'}, seq {shape.seq}, batch {shape.batch}, "
        f"{shape.steps} steps ({shape.warmup} warm-up not timed), "
        f"AdamW lr 1e-3; data {data['rows']} rows",
        "LoRA: peft.LoraConfig(" + ", ".join(f"{k}={v!r}" for k, v in lora_config(shape.layers).items()) + ")",
    ])
    print(setup)
    finish(cli, setup, summarize(results), results,
           f"## {machine['date'][:10]} — LoRA on stacked MoE experts (target_parameters), preset `{cli.preset}`, "
           f"{cli.device}",
           __file__)


if __name__ == "__main__":
    main()
