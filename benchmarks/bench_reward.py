"""Reward-model, KTO, ORPO, CPO and online DPO throughput, memory and loss agreement: TRL 1.16's trainers vs hfnative's.

``--trainer reward``: both runners train the same saved Qwen3ForSequenceClassification (the preset's Qwen3 shape,
one label, pad token 0, its score head drawn under the seed) on the same preference rows (prompt, chosen,
rejected), ``batch / 2`` pairs (``batch`` sequences) per step, Bradley-Terry loss.

``--trainer kto``: both runners train the preset's causal LM on the same unpaired rows (prompt, completion,
label), ``batch`` rows per step, the reference being a frozen copy of the checkpoint that each trainer loads
itself (``ref_model=None``), the KTO loss with its KL reference point (mismatched completions, TRL's default).

``--trainer orpo`` / ``--trainer cpo``: hfnative's ORPOTrainer / CPOTrainer against TRL's experimental ones
(``trl.experimental.orpo``, ``trl.experimental.cpo``) on the preset's causal LM and the preference rows, ``batch / 2``
pairs (``batch`` sequences) per step, no reference model: ORPO with beta (its lambda) 0.1, CPO with its defaults
(loss_type sigmoid, beta 0.1, cpo_alpha 1.0, no label smoothing); max_length ``seq``.

``--trainer online_dpo``: hfnative's OnlineDPOTrainer against ``trl.experimental.online_dpo``'s on the preset's
causal LM, ``batch / 2`` prompts per step (two completions each: ``batch`` sequences), the reference a frozen copy
(``ref_model=None``), sigmoid loss, beta 0.1, one reward function (``even_token_share``). The completions are FIXED
(sampled ones differ between the two and the losses could not agree): each prompt's first completion is its row's
chosen answer + EOS, the second its rejected answer + EOS; TRL's ``Qwen3ForCausalLM.generate`` is patched to return
them, ours gets them from its rollout engine (``trainer.objective.engine.generate``), as tests/test_online_dpo.py
does. max_new_tokens is the longest completion, max_length the longest prompt + that (no prompt is cut). The
reward function picks which of the two is chosen. TRL logs the loss rounded to 4 digits: its per-step loss is read
from ``training_step``'s return value instead.

Same seed, same order and the same hyperparameters for both runners; each run in its own child process (so peak
memory is per runner), runners alternating over several rounds. Printed: tokens/s (non-padding tokens of the
trained sequences, warm-up steps excluded; for KTO the prompt + completion sequences only, the KL sequences'
forward passes are work on top of them and are not counted; for ORPO / CPO the chosen and rejected sequences; for
online DPO the two prompt + completion sequences of each prompt, counted where the completions are handed over,
i.e. the prompt twice and both completions; generation itself is skipped), peak RSS (peak GPU memory on CUDA),
peak heap, per-step losses and grad norms side by side with their largest relative difference from TRL's.

    python benchmarks/bench_reward.py --trainer reward --preset smoke --rounds 1
    python benchmarks/bench_reward.py --trainer kto --preset smoke --rounds 1
    python benchmarks/bench_reward.py --trainer orpo --preset smoke --rounds 1
    python benchmarks/bench_reward.py --trainer cpo --preset smoke --rounds 1
    python benchmarks/bench_reward.py --trainer online_dpo --preset smoke --rounds 1
    python benchmarks/bench_reward.py --trainer reward --preset reference
    python benchmarks/bench_reward.py --trainer kto --preset 100m --rounds 1
    python benchmarks/bench_reward.py --trainer kto --device cuda --preset qwen3_0.6b

Rows: bench_dpo.py's (text prompts of several "Question: ...\\nAnswer: ..." pairs from examples/data/preference.jsonl,
grown until prompt + the longer completion fill about ``seq`` tokens). For KTO each row keeps the chosen or the
rejected completion, picked at random under the seed, with label True / False. Online DPO trains on the prompts
alone (the completions come from the fixed table above).
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import os
import random
import shutil
import sys
from pathlib import Path

import datasets
import torch
import transformers
from transformers import AutoModelForSequenceClassification, AutoTokenizer

sys.path.insert(0, str(Path(__file__).resolve().parent))
import harness  # noqa: E402  (its token counter is swapped in the child for the batches it cannot read)
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
TRAINERS = ("reward", "kto", "orpo", "cpo", "online_dpo")
KTO_BETA = 0.1
PREFERENCE_BETA = 0.1  # ORPO's lambda and CPO's beta (both TRL's default)
ONLINE_DPO_BETA = 0.1


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
# online DPO: fixed completions, the reward, the token count


def fixed_completion_table(dataset, tokenizer) -> dict[tuple[int, ...], tuple[list[int], list[int]]]:
    """Each row's prompt token ids (tokenized without special tokens, as both trainers tokenize an online DPO prompt)
    -> its two fixed completions: the chosen answer + EOS, then the rejected answer + EOS."""
    eos = tokenizer.eos_token_id
    table = {}
    for row in dataset:
        key = tuple(tokenizer(row["prompt"], add_special_tokens=False)["input_ids"])
        table[key] = tuple(tokenizer(row[side], add_special_tokens=False)["input_ids"] + [eos]
                           for side in ("chosen", "rejected"))
    return table


def completion_limits(table: dict) -> tuple[int, int]:
    """(max_new_tokens, max_length) under which no fixed completion is over the limit and no prompt is cut."""
    longest_completion = max(len(c) for pair in table.values() for c in pair)
    return longest_completion, max(len(p) for p in table) + longest_completion


GENERATED_TOKENS: list[int] = []  # per generation call (one per step): its sequences' prompt + completion tokens


def completions_for(prompts: list[list[int]], table: dict) -> list[list[int]]:
    """The fixed completions of a generation call's prompts in the block layout both trainers use (every prompt once,
    then every prompt again): the first block gets each prompt's first completion, the second block its second.
    Records the call's tokens (each sequence's prompt + completion) in GENERATED_TOKENS."""
    half = len(prompts) // 2
    completions = [list(table[tuple(p)][0 if i < half else 1]) for i, p in enumerate(prompts)]
    GENERATED_TOKENS.append(sum(len(p) + len(c) for p, c in zip(prompts, completions)))
    return completions


def make_reward(eos_id: int):
    def even_token_share(completion_ids, **kwargs):
        """Share of even token ids in each completion, up to and including its first EOS (the padding after it, which
        the two trainers may fill differently, not read)."""
        scores = []
        for ids in completion_ids:
            ids = list(ids)
            ids = ids[: ids.index(eos_id) + 1] if eos_id in ids else ids
            scores.append(sum(t % 2 == 0 for t in ids) / max(len(ids), 1))
        return scores

    return even_token_share


class _PairTokenCounter:
    """harness's counting collator for preference batches: the attention mask of the [2B, S] chosen + rejected rows
    (ours), or the chosen and the rejected masks (TRL's experimental ORPO / CPO collator)."""

    def __init__(self, inner):
        self.inner, self.tokens = inner, []

    def __call__(self, features):
        batch = self.inner(features)
        keys = (("attention_mask",) if "attention_mask" in batch
                else ("chosen_attention_mask", "rejected_attention_mask"))
        self.tokens.append(sum(int(batch[key].sum()) for key in keys))
        return batch


class _GeneratedTokenCounter:
    """harness's counting collator for online DPO, whose collated batch holds only the prompts: the tokens are counted
    where the fixed completions are handed over (GENERATED_TOKENS)."""

    def __init__(self, inner):
        self.inner, self.tokens = inner, GENERATED_TOKENS

    def __call__(self, features):
        return self.inner(features)


def _sampled_tokens(prompt_lengths: list[int], completions: list[list[int]], eos_id: int) -> int:
    """A generation call's tokens as the trainers keep them: each sequence's prompt and its completion up to and
    including its first EOS."""
    return sum(n + (c.index(eos_id) + 1 if eos_id in c else len(c)) for n, c in zip(prompt_lengths, completions))


def _online_dpo(runner: str, spec: dict, settings: dict, reward, dataset, tokenizer):
    """Either runner's OnlineDPOTrainer on the rows' prompts; TRL's keeps each training step's loss unrounded (its log
    rounds it to 4 digits) in ``step_losses``."""
    prompts = dataset.select_columns(["prompt"])
    if runner == "trl":
        os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")
        from trl.experimental.online_dpo import OnlineDPOConfig, OnlineDPOTrainer

        class RecordingOnlineDPOTrainer(OnlineDPOTrainer):
            def training_step(self, *args, **kwargs):
                loss = super().training_step(*args, **kwargs)  # the micro-batch's loss / accumulation steps
                self.step_losses.append(float(loss))
                return loss

        trainer = RecordingOnlineDPOTrainer(model=spec["model_dir"], reward_funcs=[reward],
                                            args=OnlineDPOConfig(**settings), train_dataset=prompts,
                                            processing_class=tokenizer)
        trainer.step_losses = []
        return trainer
    import hfnative

    return hfnative.OnlineDPOTrainer(model=spec["model_dir"], reward_funcs=[reward],
                                     args=hfnative.OnlineDPOConfig(**settings), train_dataset=prompts,
                                     processing_class=tokenizer)


def online_dpo_trainer(runner: str, spec: dict, common: dict, dataset, tokenizer, notes: list[str]):
    """Either runner's OnlineDPOTrainer on the fixed completions (module docstring), or with ``on_policy`` on the
    completions each samples with its own engine (max_new_tokens ``spec['completion']``), each generation call's
    tokens recorded in GENERATED_TOKENS where the trainer gets them back."""
    on_policy = spec.get("on_policy", False)
    eos_id = tokenizer.eos_token_id
    settings = dict(common, max_new_tokens=spec["completion"] if on_policy else spec["max_new_tokens"],
                    max_length=spec["max_length"], beta=ONLINE_DPO_BETA, loss_type="sigmoid", missing_eos_penalty=None)
    trainer = _online_dpo(runner, spec, settings, make_reward(eos_id), dataset, tokenizer)
    if on_policy:
        notes.append("completions sampled by each trainer: the losses follow different samples")
    elif runner == "trl":
        notes.append("per-step loss from training_step (TRL's log rounds it to 4 digits)")
    table = None if on_policy else fixed_completion_table(dataset, tokenizer)
    if runner == "trl":
        generate = transformers.Qwen3ForCausalLM.generate
        pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else eos_id

        def patched(self, input_ids=None, attention_mask=None, **kwargs):
            if on_policy:  # TRL's own sampling, its tokens counted
                output = generate(self, input_ids=input_ids, attention_mask=attention_mask, **kwargs)
                completions = output[:, input_ids.shape[1]:].tolist()
                GENERATED_TOKENS.append(_sampled_tokens(attention_mask.sum(1).tolist(), completions, eos_id))
                return output
            rows = [ids[mask.bool()].tolist() for ids, mask in zip(input_ids, attention_mask)]
            completions = completions_for(rows, table)
            width = max(len(c) for c in completions)
            padded = torch.tensor([c + [pad_id] * (width - len(c)) for c in completions], dtype=input_ids.dtype)
            return torch.cat([input_ids, padded.to(input_ids.device)], dim=1)

        transformers.Qwen3ForCausalLM.generate = patched  # this child process only
        return trainer
    from hfnative.generation import Rollouts

    engine_generate = trainer.objective.engine.generate

    def patched_engine(prompt_ids, sampling):
        if on_policy:  # the native engine's own sampling, its tokens counted
            rollouts = engine_generate(prompt_ids, sampling)
            GENERATED_TOKENS.append(_sampled_tokens([len(p) for p in prompt_ids], rollouts.completion_ids, eos_id))
            return rollouts
        completions = completions_for([list(p) for p in prompt_ids], table)
        return Rollouts(completions, [[0.0] * len(c) for c in completions], ["stop"] * len(completions))

    trainer.objective.engine.generate = patched_engine
    return trainer


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
    pairs = max(shape.batch // 2, 1)
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
    elif spec["trainer"] in ("orpo", "cpo"):
        common["per_device_train_batch_size"] = pairs  # pairs: 2x that many sequences per forward
        if runner == "trl":
            if spec["trainer"] == "orpo":
                from trl.experimental.orpo import ORPOConfig as Config, ORPOTrainer as Trainer
            else:
                from trl.experimental.cpo import CPOConfig as Config, CPOTrainer as Trainer
        else:
            Config, Trainer = ((module.ORPOConfig, module.ORPOTrainer) if spec["trainer"] == "orpo"
                               else (module.CPOConfig, module.CPOTrainer))
        config = Config(**common, max_length=shape.seq, beta=PREFERENCE_BETA)
        trainer = Trainer(model=spec["model_dir"], args=config, train_dataset=dataset, processing_class=tokenizer)
        harness._CountingCollator = _PairTokenCounter  # TRL's batches carry no single attention_mask
    elif spec["trainer"] == "online_dpo":
        common["per_device_train_batch_size"] = pairs  # prompts: 2 completions each, 2x that many sequences
        trainer = online_dpo_trainer(runner, spec, common, dataset, tokenizer, notes)
        harness._CountingCollator = _GeneratedTokenCounter  # the collated batches are prompts only
    else:
        raise ValueError(f"unknown trainer {spec['trainer']!r}")
    result, _ = train_and_measure(trainer, shape, spec["device"] == "cuda")
    if spec["trainer"] == "online_dpo" and runner == "trl":
        if len(trainer.step_losses) != shape.steps:
            raise RuntimeError(f"{len(trainer.step_losses)} training steps recorded for {shape.steps} optimizer steps")
        result["losses"] = list(trainer.step_losses)  # gradient_accumulation_steps 1: one training step per step
    return result


# ------------------------------------------------------------------------------------------------
# command line


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--trainer", choices=TRAINERS, default=None,
                        help="RewardTrainer (sequence classifier, preference pairs), KTOTrainer (causal LM, unpaired "
                             "rows), ORPOTrainer / CPOTrainer (causal LM, preference pairs) or OnlineDPOTrainer "
                             "(causal LM, prompts, fixed completions); required")
    parser.add_argument("--preset", choices=sorted(PRESETS), default=None,
                        help="model and batch shape (default: reference on cpu, qwen3_0.6b on cuda)")
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--on-policy", "--on_policy", action="store_true",
                        help="online_dpo: each trainer samples its completions with its own engine (TRL: transformers' "
                             "generate, use_vllm=False; hfnative: the native engine) instead of the fixed ones: the "
                             "step then times generation too, and the losses are not comparable (other samples)")
    parser.add_argument("--completion", type=int, default=None,
                        help="with --on-policy: max_new_tokens of the sampled completions (default: the longest fixed "
                             "completion)")
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
        sys.exit(f"--trainer {'|'.join(TRAINERS)} is required")
    cli.preset = cli.preset or ("qwen3_0.6b" if cli.device == "cuda" else "reference")
    shape = start_parent(cli, PRESETS)
    reward = cli.trainer == "reward"
    with work_folder(f"bench_{cli.trainer}_", cli.keep) as work:
        if reward:
            parameters = build_reward_model(shape, work / "model", cli.seed)
            data = build_preference_rows(shape, work / "data", cli.seed)
        elif cli.trainer == "kto":
            parameters = build_model(shape, work / "model", cli.seed)
            data = build_unpaired_rows(shape, work / "data", cli.seed)
        else:
            parameters = build_model(shape, work / "model", cli.seed)
            data = build_preference_rows(shape, work / "data", cli.seed)
        spec = {"trainer": cli.trainer, "device": cli.device, "shape": shape.__dict__, "model_dir": str(work / "model"),
                "data_dir": str(work / "data"), "work_dir": str(work), "checkpointing": cli.activation_checkpointing,
                "max_grad_norm": cli.max_grad_norm, "seed": cli.seed, "threads": cli.threads}
        if cli.trainer == "online_dpo":
            table = fixed_completion_table(datasets.load_from_disk(str(work / "data")),
                                           AutoTokenizer.from_pretrained(str(work / "model")))
            spec["max_new_tokens"], spec["max_length"] = completion_limits(table)
            if cli.on_policy:  # sampled completions of --completion tokens at most (the fixed ones' longest)
                completion = cli.completion or spec["max_new_tokens"]
                spec["max_length"] += completion - spec["max_new_tokens"]
                spec["on_policy"], spec["completion"], spec["max_new_tokens"] = True, completion, completion
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
        elif cli.trainer == "kto":
            model = (f"model: Qwen3-shaped causal LM, {body}, tied; {parameters / 1e6:.2f}M parameters; "
                     f"reference: a frozen copy (ref_model=None)")
            method = (f"KTO (loss_type kto, KL reference point from mismatched completions) beta {KTO_BETA}, "
                      f"max_length {shape.seq}, {shape.batch} rows per step")
            rows = (f"data: {data['rows']} unpaired rows ({data['desirable']} desirable), {data['tokens']:,} tokens "
                    f"(prompt + completion)")
        else:
            pairs = max(shape.batch // 2, 1)
            online = cli.trainer == "online_dpo"
            model = (f"model: Qwen3-shaped causal LM, {body}, tied; {parameters / 1e6:.2f}M parameters; "
                     + ("reference: a frozen copy (ref_model=None)" if online else "no reference model"))
            if cli.trainer == "orpo":
                method = (f"ORPO (chosen NLL - beta * log sigmoid(log odds ratio)) beta {PREFERENCE_BETA}, "
                          f"max_length {shape.seq}, {pairs} pairs ({shape.batch} sequences) per step")
            elif cli.trainer == "cpo":
                method = (f"CPO (loss_type sigmoid, beta {PREFERENCE_BETA}, cpo_alpha 1.0, label_smoothing 0), "
                          f"max_length {shape.seq}, {pairs} pairs ({shape.batch} sequences) per step")
            elif cli.on_policy:
                method = (f"online DPO (loss_type sigmoid) beta {ONLINE_DPO_BETA}, reward even_token_share, "
                          f"{pairs} prompts x 2 SAMPLED completions (each trainer's own engine; TRL use_vllm=False) = "
                          f"{shape.batch} sequences per step, max_new_tokens {spec['max_new_tokens']}, max_length "
                          f"{spec['max_length']}; tokens/s counts prompts and completions up to their EOS")
            else:
                method = (f"online DPO (loss_type sigmoid) beta {ONLINE_DPO_BETA}, reward even_token_share, "
                          f"{pairs} prompts x 2 FIXED completions (each row's chosen and rejected answer + EOS; "
                          f"generation patched out on both sides) = {shape.batch} sequences per step, "
                          f"max_new_tokens {spec['max_new_tokens']}, max_length {spec['max_length']}")
            rows = (f"data: {data['rows']} {'prompts' if online else 'pairs'}, {data['tokens']:,} tokens "
                    f"(prompt + chosen and prompt + rejected)")
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
        what = {"reward": "reward model (RewardTrainer)", "kto": "KTO", "orpo": "ORPO", "cpo": "CPO",
                "online_dpo": f"online DPO ({'sampled' if cli.on_policy else 'fixed'} completions)"}[cli.trainer]
        title = f"## {datetime.date.today().isoformat()} — {what}, preset `{cli.preset}`, {cli.device}"
        finish(cli, setup, summarize(results, cli.device), results, title, __file__)


if __name__ == "__main__":
    main()
