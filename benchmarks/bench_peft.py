"""Full fine-tuning vs LoRA vs QLoRA vs LoRA on an 8-bit base: peak memory, tokens/s and loss, TRL + PEFT beside
hfnative.

Eight runners train the same saved model on the same token rows with the same SFTConfig; the PEFT
runners get the same ``peft.LoraConfig`` (and the quantized runners the same quantization config):

    trl-full   trl-lora   trl-qlora (bitsandbytes; reported unavailable where it cannot run)   trl-int8 (bitsandbytes)
    ours-full  ours-lora  ours-qlora (NF4 base via torchao)                                     ours-int8 (int8 rows)

Every run is its own child process (peak RSS is that runner's alone, VmHWM), runners alternate over
--rounds, and the setup, training arguments, timing and the results file are the shared harness's (harness.py).

    python benchmarks/bench_peft.py --preset smoke
    python benchmarks/bench_peft.py --preset 100m --write-results
    python benchmarks/bench_peft.py --preset 100m --clone-template --runners trl-lora,ours-lora --rounds 2
    python benchmarks/bench_peft.py --preset 100m --token-rows 8 --runners trl-lora,ours-lora --rounds 2
    python benchmarks/bench_peft.py --preset 100m --runners trl-lora,trl-int8,ours-lora,ours-int8 --rounds 2

--clone-template: the model untied, its tokenizer grown to one token short of its rows, and both runners given
``chat_template_path`` naming a tokenizer folder with one special token more, as a user adding a chat template to a
base model does: under LoRA the new token's row trains through peft's trainable_token_indices, with the head in full
(modules_to_save=["lm_head"]), as TRL's SFTTrainer arranges it.

--token-rows N: the tied model, and the LoRA runners' LoraConfig also given trainable_token_indices naming the
vocabulary's last N tokens (tokens a user added and trains): their rows train in the embedding and, through the tie,
in the output head.

LoRA's B starts at zero, so the first step's loss is the base model's and every runner's step-1 loss
must agree (QLoRA's up to the NF4 rounding of the base, int8's up to its rows' rounding and bitsandbytes' int8
activations). peft and hfnative draw A from their own
random streams, so LoRA losses part after step 1; full fine-tuning must agree at every step.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import statistics
import sys
from pathlib import Path

import datasets
import transformers
from transformers import AutoTokenizer

sys.path.insert(0, str(Path(__file__).resolve().parent))
from harness import (  # noqa: E402  (benchmarks/ is not a package)
    LORA,
    PRESETS,
    Shape,
    Unavailable,
    add_run_arguments,
    child_main,
    finish,
    finished_runs,
    loss_rows,
    machine_description,
    max_relative_difference,
    package_version,
    prepare_workload,
    rss_mib,
    run_notes,
    run_rounds,
    start_parent,
    train_and_measure,
    training_arguments,
    work_folder,
)

RUNNERS = ("trl-full", "trl-lora", "trl-qlora", "trl-int8", "ours-full", "ours-lora", "ours-qlora", "ours-int8")
PEFT_PRESETS = {
    "smoke": dataclasses.replace(PRESETS["smoke"], batch=4, steps=4, warmup=2),
    # 24.6M embedding + 12 x 6.29M blocks = 100.1M parameters
    "100m": dataclasses.replace(PRESETS["100m"], batch=4, seq=256, steps=6, warmup=2),
}
NF4 = dict(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True, bnb_4bit_compute_dtype="float32")


# ------------------------------------------------------------------------------------------------
# child: one runner, one training run


def train_peft(runner: str, spec: dict, notes: list[str]) -> dict:
    """One SFT run: full fine-tuning, LoRA, QLoRA or LoRA on an 8-bit base (``method``) with TRL or hfnative
    (``library``)."""
    rss_after_imports = rss_mib()
    shape = Shape(**spec["shape"])
    library, method = runner.split("-")
    dataset = datasets.load_from_disk(spec["data_dir"])
    tokenizer = AutoTokenizer.from_pretrained(spec["model_dir"])
    arguments = dict(training_arguments(runner, spec), max_length=shape.seq, packing=False)
    if spec.get("template_dir"):
        arguments["chat_template_path"] = spec["template_dir"]
    if method == "qlora":  # the TRL user's QLoRA recipe, unchanged for both
        arguments["model_init_kwargs"] = {"quantization_config": transformers.BitsAndBytesConfig(**NF4)}
    if method == "int8":  # TRL's --load_in_8bit
        arguments["model_init_kwargs"] = {"quantization_config": transformers.BitsAndBytesConfig(load_in_8bit=True)}
    peft_config = None
    if method != "full":
        import peft

        peft_config = peft.LoraConfig(**LORA, **token_rows_fields(spec))

    if library == "trl":
        import trl

        try:
            trainer = trl.SFTTrainer(model=spec["model_dir"], args=trl.SFTConfig(**arguments), train_dataset=dataset,
                                     processing_class=tokenizer, peft_config=peft_config)
        except ImportError as error:  # bitsandbytes missing or without a backend for this device
            if method not in ("qlora", "int8"):
                raise
            raise Unavailable(f"TRL's quantized base needs bitsandbytes: {type(error).__name__}: {error}") from error
    else:
        import hfnative

        trainer = hfnative.SFTTrainer(model=spec["model_dir"], args=hfnative.SFTConfig(**arguments),
                                      train_dataset=dataset, processing_class=tokenizer, peft_config=peft_config)

    rss_after_setup = rss_mib()  # model loaded (and quantized), adapters on, nothing trained yet
    result, _ = train_and_measure(trainer, shape, is_cuda=False)
    return {
        **result,
        "rss_after_imports_mib": rss_after_imports,
        "rss_after_setup_mib": rss_after_setup,
        "trainable_params": sum(p.numel() for p in trainer.model.parameters() if p.requires_grad),
    }


def token_rows_fields(spec: dict) -> dict:
    """The LoraConfig fields ``--token-rows`` adds: the vocabulary's last N tokens."""
    count, vocab = spec.get("token_rows", 0), spec["shape"]["vocab"]
    return {"trainable_token_indices": list(range(vocab - count, vocab))} if count else {}


# ------------------------------------------------------------------------------------------------
# report


def summarize(results: list[dict], runners: list[str], total_params: int) -> str:
    """Table, ratios, step-1 agreement and per-step losses of the runners that finished."""
    header = (f"{'runner':<12}{'peak RSS MiB':>14}{'RSS@import':>12}{'RSS@setup':>11}{'tokens/s':>10}{'min..max':>16}"
              f"{'final loss':>12}{'trainable params':>22}")
    lines, summary = [header, "-" * len(header)], {}
    for runner, ok, rates in finished_runs(results, runners, lines, runner_width=12, status_width=14):
        summary[runner] = s = {
            "peak": max(r["peak_rss_mib"] for r in ok),
            "tokens_per_second": statistics.median(rates),
            "losses": ok[0]["losses"],
            "trainable": ok[0]["trainable_params"],
            "checkpointing": ok[0]["activation_checkpointing"],
        }
        trainable = f"{s['trainable']:,} ({s['trainable'] / total_params:.2%})"
        lines.append(
            f"{runner:<12}{s['peak']:>14,.0f}{statistics.median(r['rss_after_imports_mib'] for r in ok):>12,.0f}"
            f"{statistics.median(r['rss_after_setup_mib'] for r in ok):>11,.0f}"
            f"{s['tokens_per_second']:>10,.0f}{f'{min(rates):,.0f}..{max(rates):,.0f}':>16}"
            f"{s['losses'][-1]:>12.6f}{trainable:>22}"
        )

    lines.append("")
    for ours, other in (("ours-full", "trl-full"), ("ours-lora", "trl-lora"), ("ours-qlora", "trl-qlora"),
                        ("ours-int8", "trl-int8"), ("ours-lora", "ours-full"), ("ours-qlora", "ours-lora"),
                        ("ours-int8", "ours-lora"), ("trl-lora", "trl-full")):
        if ours in summary and other in summary:
            a, b = summary[ours], summary[other]
            lines.append(f"{ours + ' / ' + other:<24} peak RSS x{a['peak'] / b['peak']:.2f}, "
                         f"tokens/s x{a['tokens_per_second'] / b['tokens_per_second']:.2f}")

    names = list(summary)
    if names:
        reference = names[0]
        first = summary[reference]["losses"][0]
        lines += ["", "step-1 loss (LoRA's B starts at 0, so before the first update every runner computes the base "
                      "model's loss;", "QLoRA's and int8's differ by the rounding of the base weights):"]
        for name in names:
            loss = summary[name]["losses"][0]
            lines.append(f"  {name:<12}{loss:>12.6f}   rel. diff to {reference} {abs(loss - first) / abs(first):.2e}")
        lines += ["", "per-step loss (maxrel: the largest relative difference to the TRL runner of the same method over all",
                  "steps; it must be fp32 round-off for full fine-tuning, while LoRA runs part after step 1 because peft",
                  "and hfnative draw lora_A from different random streams):"]
        rows, widths = loss_rows({n: summary[n]["losses"] for n in names}, range(len(summary[reference]["losses"])),
                                 min_width=12)
        lines += rows
        peers = {n: n.replace("ours-", "trl-") for n in names if n.startswith("ours-")}
        lines.append(f"{'maxrel':>6}" + "".join(
            f"{max_relative_difference(summary[n]['losses'], summary[peers[n]]['losses']):>{w}.2e}"
            if peers.get(n) in summary else f"{'':>{w}}" for n, w in zip(names, widths)))

    notes = sorted(run_notes(results))
    for ours in ("ours-full", "ours-lora", "ours-qlora", "ours-int8"):
        peer = ours.replace("ours-", "trl-")
        if ours in summary and peer in summary and summary[ours]["trainable"] != summary[peer]["trainable"]:
            notes.append(f"{ours} trains {summary[ours]['trainable']:,} parameters, {peer} {summary[peer]['trainable']:,}")
    checkpointing = {n: summary[n]["checkpointing"] for n in names}
    if any(checkpointing.values()):
        notes.append(f"activation checkpointing was on for some runner (it was asked off for all): {checkpointing}")
    if notes:
        lines += ["", "notes:"] + [f"  - {n}" for n in notes]
    return "\n".join(lines)


def describe_setup(cli, shape: Shape, total_params: int, data: dict) -> str:
    machine = machine_description("cpu")
    return "\n".join([
        f"machine: {machine['cpu']}, {machine['cores']} cores, torch threads {machine['torch_threads']}",
        f"software: python {machine['python']}, torch {machine['torch']}, transformers {machine['transformers']}, "
        f"trl {machine['trl']}, peft {package_version('peft')}, torchao {package_version('torchao')}, "
        f"bitsandbytes {package_version('bitsandbytes')}; date {machine['date']}; load average {machine['load_average']}",
        f"model: Qwen3-shaped, hidden {shape.hidden}, {shape.layers} layers, {shape.heads} heads / {shape.kv_heads} KV, "
        f"head_dim {shape.head_dim}, intermediate {shape.intermediate}, vocab {shape.vocab}, "
        f"{'untied, a cloned chat template adding a token (chat_template_path)' if cli.clone_template else 'tied'}; "
        f"{total_params / 1e6:.2f}M parameters",
        f"training: fp32 (use_cpu, bf16=False), seq {shape.seq}, batch {shape.batch}, {shape.steps} steps "
        f"({shape.warmup} warm-up steps not timed), AdamW lr 1e-3 constant, max_grad_norm {cli.max_grad_norm}, "
        f"no gradient checkpointing, seed {cli.seed}; data: {data['rows']} rows of {shape.seq} tokens",
        "LoRA: peft.LoraConfig(" + ", ".join(f"{k}={v!r}" for k, v in LORA.items())
        + (f", trainable_token_indices=[{shape.vocab - cli.token_rows}..{shape.vocab - 1}]" if cli.token_rows else "")
        + ")",
        "QLoRA: SFTConfig(model_init_kwargs={'quantization_config': BitsAndBytesConfig("
        + ", ".join(f"{k}={v!r}" for k, v in NF4.items()) + ")}) + the LoRA config",
        "int8: SFTConfig(model_init_kwargs={'quantization_config': BitsAndBytesConfig(load_in_8bit=True)}) + the LoRA "
        "config",
    ])


# ------------------------------------------------------------------------------------------------


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", choices=sorted(PEFT_PRESETS), default="100m")
    parser.add_argument("--runners", default=",".join(RUNNERS), help=f"comma-separated subset of {','.join(RUNNERS)}")
    parser.add_argument("--clone-template", action="store_true",
                        help="untied model; chat_template_path adds a token (its rows train under LoRA)")
    parser.add_argument("--token-rows", type=int, default=0, metavar="N",
                        help="LoRA also trains the rows of the vocabulary's last N tokens (trainable_token_indices)")
    add_run_arguments(parser, timeout=1800, rounds=1, overrides=("seq", "batch", "steps", "warmup"))
    return parser.parse_args(argv)


def main() -> None:
    cli = parse_args()
    if cli.child:
        child_main(cli, train=train_peft)
        return

    if cli.token_rows and cli.clone_template:
        sys.exit("--token-rows and --clone-template: choose one (the cloned template chooses its own token rows)")
    if cli.token_rows < 0:
        sys.exit(f"--token-rows {cli.token_rows}: expected a number of tokens, at least 0")
    shape = start_parent(cli, PEFT_PRESETS)
    runners = cli.runners.split(",")
    unknown = [r for r in runners if r not in RUNNERS]
    if unknown:
        sys.exit(f"--runners: unknown runner(s) {', '.join(unknown)}; use a subset of {','.join(RUNNERS)}")

    with work_folder("bench_peft_", cli.keep) as work:
        template_dir = None
        if cli.clone_template:
            template_dir = work / "template"
        workload = prepare_workload(work, shape, cli, device="cpu", packing=False, tied=not cli.clone_template,
                                    template_dir=str(template_dir) if template_dir else None,
                                    token_rows=cli.token_rows)
        if template_dir is not None:
            # the model's tokenizer grown to one token short of its rows (placeholders), so that the template's token
            # takes the last row and the vocabulary keeps the preset's size; the template folder: that tokenizer plus
            # one special token, with a template that writes it
            tokenizer = AutoTokenizer.from_pretrained(str(work / "model"))
            tokenizer.add_tokens([f"<placeholder_{i}>" for i in range(shape.vocab - 1 - len(tokenizer))])
            tokenizer.save_pretrained(str(work / "model"))
            tokenizer.add_special_tokens({"additional_special_tokens": ["<|tool_start|>"]})
            tokenizer.chat_template = ("{% for message in messages %}<|tool_start|>{{ message['content'] }}"
                                       "{% endfor %}")
            tokenizer.save_pretrained(str(template_dir))
        setup = describe_setup(cli, shape, workload.parameters, workload.data)
        print(setup, flush=True)

        def shown(result: dict) -> str:
            return (f"peak RSS {result['peak_rss_mib']:,.0f} MiB, {result['tokens_per_second']:,.0f} tokens/s, "
                    f"final loss {result['losses'][-1]:.6f}")

        results = run_rounds(runners, workload, cli, __file__, shown)
        report = summarize(results, runners, workload.parameters)
        cloned = (", a cloned chat template adding a token" if cli.clone_template
                  else f", {cli.token_rows} trained token rows" if cli.token_rows else "")
        title = f"## {datetime.date.today().isoformat()} — PEFT (`bench_peft.py`{cloned}), preset `{cli.preset}`, cpu"
        finish(cli, setup, report, results, title, __file__)


if __name__ == "__main__":
    main()
