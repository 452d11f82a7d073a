"""The distributed layouts, in one launch of 4 CPU processes and one of 2 (gloo), each against a single-process run.

usage: torchrun --standalone --nproc_per_node {4|2} _parallel_worker.py OUTPUT_DIR MODELS_DIR
MODELS_DIR holds Hub-format checkpoints untied/, tied/ and moe/ (see test_parallel.py).
Writes OUTPUT_DIR/world<n>-rank<r>.json: per check, the measured worst relative differences (or the error).

Each layout: the model is built on the meta device, parallelized, and loaded from the Hub checkpoint rank by
rank; then 5 AdamW steps on the same global batches as the single-process run (the reference, trained once
per launch: each rank trains a share of the references and every rank reads them all), each data-parallel rank taking its rows, the loss summed over the rows and divided by the
step's label-token count all-reduced over the data-parallel ranks. Steps alternate padded rows and packed
rows (position_ids restarting: one document after another), so both attention paths run.

On 4 processes: HSDP 2x2, FSDP2 x TP2 (eager and compiled) and the vocabulary-parallel losses over 4 ranks; on 2
processes: FSDP2 (with micro-batches, optimizer-in-backward, mixture of experts, LoRA, bf16 mixed precision,
compile), TP2 (eager, compiled, and with LoRA under selective checkpointing) and plain replication (LAYOUTS), then the
head losses through a TP2 model's head and what a TP2 LoRA model's checkpointed blocks keep.
"""

from __future__ import annotations

import json
import sys
import time
import traceback
from contextlib import nullcontext
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from safetensors.torch import load_file, save_file
from torch.distributed.tensor import DTensor

from hfnative.converters.loading import load_pretrained
from hfnative.converters.sharded_loading import copy_shard, load_sharded, meta_model
from hfnative.losses import (
    IGNORE_INDEX,
    fused_linear_cross_entropy,
    fused_linear_generalized_jsd,
    fused_linear_token_logprobs,
    linear_token_logprobs,
    shift_labels,
)
from hfnative.losses.logprobs import TOKEN_STATISTICS
from hfnative.losses.vocab_parallel import (
    vocab_parallel_cross_entropy,
    vocab_parallel_generalized_jsd,
    vocab_parallel_token_logprobs,
)
from hfnative.models.head import GeneralizedJSD, TokenLogprobs
from hfnative.device_policy import use_device_policy
from hfnative.optim import OptimizerSettings, build_optimizer
from hfnative.optim.in_backward import OptimizerInBackward
from hfnative.parallel import ParallelDims, end_process_group, parallelize
from hfnative.parallel.grad_norm import replicate_partial_gradients
from hfnative.parallel.tensor_parallel import _rows_like
from hfnative.peft.adapters import ExpertLoraTarget, LoraTarget, add_expert_lora, add_lora, mark_trainable
from hfnative.peft.settings import LoraSettings
from test_selective_checkpoint import _KeptBytes

STEPS, ROWS, SEQ = 5, 4, 16
VOCAB = 95  # the tied model's vocabulary (the others have 96): split unevenly over 2 or 4 ranks
PADDING_ID = 94  # the tied model's padding_idx, in the last rank's rows
SETTINGS = OptimizerSettings("adamw_torch", learning_rate=1e-2, weight_decay=0.1)
MAX_GRAD_NORM = 1.0


def global_batches(seed: int = 0) -> list[dict]:
    """STEPS global batches of ROWS x SEQ: even steps padded rows (right padding, prompt tokens unlabelled),
    odd steps packed rows (positions restart where a new document starts)."""
    generator = torch.Generator().manual_seed(seed)
    batches = []
    for step in range(STEPS):
        ids = torch.randint(0, VOCAB, (ROWS, SEQ), generator=generator)
        ids[:, 4] = PADDING_ID  # the tied model's padding_idx: its embedding row gets no gradient from the lookup
        labels = ids.clone()
        batch = {"input_ids": ids}
        if step % 2 == 0:
            lengths = [SEQ, SEQ - 5, SEQ - 2, 7]
            mask = torch.zeros(ROWS, SEQ, dtype=torch.long)
            for row, length in enumerate(lengths):
                mask[row, :length] = 1
                labels[row, : 2 + row] = IGNORE_INDEX  # a prompt
            labels[mask == 0] = IGNORE_INDEX
            batch["attention_mask"] = mask
        else:
            starts = [[0, 6], [0, 3, 11], [0], [0, 9]]
            positions = torch.zeros(ROWS, SEQ, dtype=torch.long)
            for row, row_starts in enumerate(starts):
                for start, end in zip(row_starts, row_starts[1:] + [SEQ]):
                    positions[row, start:end] = torch.arange(end - start)
                    labels[row, end - 1] = IGNORE_INDEX  # no target across a document boundary
            batch["position_ids"] = positions
        batch["labels"] = labels
        batches.append(batch)
    return batches


def full(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.full_tensor() if isinstance(tensor, DTensor) else tensor


def rows_of(batch: dict, part: int, parts: int) -> dict:
    per = batch["input_ids"].shape[0] // parts
    return {key: value[part * per : (part + 1) * per] for key, value in batch.items()}


def label_tokens(labels: torch.Tensor) -> int:
    return int((labels[:, 1:] != IGNORE_INDEX).sum())


def train(model, batches, *, dims=None, mesh=None, in_backward=False, accumulation=1) -> dict:
    """STEPS optimizer steps; returns the global losses, grad norms and final (full) weights."""
    dp_group = dims.dp_mesh(mesh).get_group() if dims is not None else None
    dp_size, dp_rank = (dims.dp_size, dims.dp_rank(mesh)) if dims is not None else (1, 0)
    if in_backward:
        optimizer = OptimizerInBackward.from_model(model, SETTINGS)
    else:
        optimizer = build_optimizer(model, SETTINGS)
    losses, grad_norms, compute_dtype = [], [], None
    for batch in batches:
        local = rows_of(batch, dp_rank, dp_size)
        # the step's normalizer: label tokens over all data-parallel ranks
        num_tokens = torch.tensor(label_tokens(local["labels"]))
        if dp_group is not None:
            dist.all_reduce(num_tokens, group=dp_group)
        loss = torch.zeros(())
        for micro_index in range(accumulation):
            micro = rows_of(local, micro_index, accumulation)
            last = micro_index == accumulation - 1
            with optimizer.accumulating() if in_backward and not last else nullcontext():
                out = model(**micro, num_items_in_batch=num_tokens)
                out.loss.backward()
            loss += out.loss.detach().float()
            compute_dtype = str(out.hidden_states.dtype)
        if dp_group is not None:
            dist.all_reduce(loss, group=dp_group)
        if in_backward:
            optimizer.step()
            grad_norm = optimizer.grad_norm()
        else:
            if dims is not None:  # as the trainer's step
                replicate_partial_gradients(list(model.parameters()))
            grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_GRAD_NORM)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
        losses.append(loss.item())
        grad_norms.append(full(grad_norm).item())
    weights = {name: full(param.detach()).clone() for name, param in model.named_parameters()}
    return {"loss": losses, "grad_norm": grad_norms, "weights": weights, "compute_dtype": compute_dtype}


def relative(a: float, b: float) -> float:
    return abs(a - b) / max(abs(b), 1e-12)


def weights_difference(run: dict, reference: dict) -> tuple[float, str]:
    """The worst tensor's max |w - w_ref| / max |w_ref|, and its name."""
    assert run["weights"].keys() == reference["weights"].keys()
    per_tensor = {
        name: float((run["weights"][name] - ref).abs().max() / ref.abs().max().clamp_min(1e-12))
        for name, ref in reference["weights"].items()
    }
    worst = max(per_tensor, key=per_tensor.get)
    return per_tensor[worst], worst


def compare(run: dict, reference: dict) -> dict:
    weights, worst = weights_difference(run, reference)
    return {
        "loss": max(relative(a, b) for a, b in zip(run["loss"], reference["loss"])),
        "grad_norm": max(relative(a, b) for a, b in zip(run["grad_norm"], reference["grad_norm"])),
        "weights": weights,
        "worst_weight": worst,
        "losses": run["loss"],
        "reference_losses": reference["loss"],
        "compute_dtype": run["compute_dtype"],
    }


LORA_TARGETS = [
    LoraTarget((f"layers.{layer}.attention.{name}",), r=4, lora_alpha=8.0)
    for layer in range(2)
    for name in ("wq", "wv")
]


def expert_lora_targets(args) -> list[ExpertLoraTarget]:
    """LoRA on every MoE layer's stacked gate/up (its halves) and down tensors (peft's target_parameters)."""
    D, I = args.dim, args.moe.intermediate_size
    return [target for layer in range(args.n_layers) if args.is_moe_layer(layer) for target in (
        ExpertLoraTarget(f"layers.{layer}.moe.experts", "gate_up_proj", D, 2 * I,
                         (("w1", slice(0, I)), ("w3", slice(I, 2 * I))), r=4, lora_alpha=8.0),
        ExpertLoraTarget(f"layers.{layer}.moe.experts", "down_proj", I, D, (("w2", slice(None)),), r=2, lora_alpha=8.0))]


def add_adapters(model) -> None:
    """LoRA on the q and v projections, and on a mixture of experts' stacked experts; only the adapters train."""
    add_lora(model, LORA_TARGETS, LoraSettings(r=4, lora_alpha=8))
    if model.args.moe is not None:
        add_expert_lora(model, expert_lora_targets(model.args), LoraSettings(r=4, lora_alpha=8))
    mark_trainable(model)


def init_adapters(model) -> None:
    """The same adapter values on every rank and in the single-process run (B non-zero, so A trains too)."""
    generator = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_" in name:
                copy_shard(param, torch.randn(tuple(param.shape), generator=generator) * 0.1)


class References:
    """Single-process runs, computed once per (model, optimizer kind, LoRA, micro-batches)."""

    def __init__(self, model_dirs: dict, batches):
        self.model_dirs, self.batches, self.cache = model_dirs, batches, {}

    def loaded(self, name: str, lora: bool = False):
        model = load_pretrained(self.model_dirs[name]).model
        if lora:
            add_adapters(model)
            init_adapters(model)
        return model

    def run(self, name: str, in_backward: bool, lora: bool = False, accumulation: int = 1) -> dict:
        key = (name, in_backward, lora, accumulation)
        if key not in self.cache:
            model = self.loaded(name, lora)
            self.cache[key] = train(model, self.batches, in_backward=in_backward, accumulation=accumulation)
        return self.cache[key]

    def round_off(self, name: str, in_backward: bool, lora: bool) -> float:
        """How far fp32 round-off alone moves the final weights: the single-process run against itself with each
        step's gradient summed in other orders (2 or 4 micro-batches instead of 1). AdamW divides each gradient by
        its own running magnitude, so an entry whose gradient is near zero turns a round-off difference into a
        visible one (up to ~1e-4 of the largest weight here)."""
        reference = self.run(name, in_backward, lora)
        return max(
            weights_difference(self.run(name, in_backward, lora, accumulation=parts), reference)[0] for parts in (2, 4)
        )

    def share(self, layouts: list, folder: Path, rank: int, world: int) -> None:
        """Every single-process run ``layouts`` compare against (each with its round-off runs), trained once per
        launch instead of once per rank: rank r trains every world-th of them and writes it to ``folder``
        (safetensors and JSON, nothing pickled), then every rank reads all of them. A run that fails here is left
        out and trained (and its error recorded) by the layout that needs it."""
        keys = []
        for _, model, _, options in layouts:
            for parts in (1, 2, 4):
                key = (model, options.get("in_backward", False), options.get("lora", False), parts)
                if key not in keys:
                    keys.append(key)
        stem = lambda key: folder / "-".join(str(part) for part in key)  # noqa: E731
        folder.mkdir(parents=True, exist_ok=True)
        for key in keys[rank::world]:
            try:
                run = self.run(*key)
            except Exception:  # noqa: BLE001 - recorded by the layout that needs it
                continue
            save_file(run["weights"], f"{stem(key)}.safetensors")
            Path(f"{stem(key)}.json").write_text(json.dumps({k: v for k, v in run.items() if k != "weights"}))
        dist.barrier()
        for key in keys:
            if key not in self.cache and Path(f"{stem(key)}.json").exists():
                self.cache[key] = {**json.loads(Path(f"{stem(key)}.json").read_text()),
                                   "weights": load_file(f"{stem(key)}.safetensors")}


def parallel_run(refs: References, name: str, dims: ParallelDims, mesh, accumulation: int = 1,
                 in_backward: bool = False, lora: bool = False, device_policy: str | None = None,
                 **parallelize_options) -> dict:
    if device_policy is not None:  # a device's code paths forced (the reference runs under the machine's own)
        with use_device_policy(device_policy):
            return parallel_run(refs, name, dims, mesh, accumulation, in_backward, lora, **parallelize_options)
    converted = meta_model(refs.model_dirs[name])
    if lora:
        add_adapters(converted.model)  # before sharding: the adapters are sharded with their blocks
    parallelize(converted.model, dims, mesh, **parallelize_options)
    load_sharded(converted, "cpu")
    if lora:
        init_adapters(converted.model)
    single = refs.loaded(name, lora).state_dict()
    load_diff = max(
        float((full(param.detach()) - single[param_name]).abs().max())
        for param_name, param in converted.model.named_parameters()
    )
    run = train(converted.model, refs.batches, dims=dims, mesh=mesh, in_backward=in_backward, accumulation=accumulation)
    result = compare(run, refs.run(name, in_backward, lora))
    return {**result, "load_max_abs_diff": load_diff, "weights_round_off": refs.round_off(name, in_backward, lora)}


def max_relative(got: torch.Tensor, expected: torch.Tensor) -> float:
    return float((got - expected).abs().max() / expected.abs().max())


def vocab_parallel_check(mesh) -> dict:
    """The vocabulary-parallel CE, log-probs (with every token statistic) and generalized JSD (beta 0, 0.5, 1) over
    the ranks of ``mesh`` (95 rows split unevenly over 4 ranks), plain and with soft-caps and a temperature, against
    the single-process fused losses on the full weight: values and gradients (the hidden states' gradient summed over
    the ranks, the weight's compared on this rank's rows)."""
    group, rank, size = mesh.get_group(), mesh.get_local_rank(), mesh.size()
    generator = torch.Generator().manual_seed(3)
    N, D, V, teacher_D = 21, 16, 95, 12
    hidden = torch.randn(N, D, generator=generator)
    weight = torch.randn(V, D, generator=generator) * 0.5
    weight[60] = weight[7]  # the same top logit in two ranks' rows: top-1 ties go to the first index
    hidden[:2] = weight[7] * 4
    targets = torch.randint(0, V, (N,), generator=generator)
    targets[0], targets[1] = 7, 60
    logprob_targets = targets.clone()
    logprob_targets[5] = IGNORE_INDEX
    upstream = torch.randn(N, generator=generator)
    teacher_hidden = torch.randn(N, teacher_D, generator=generator)
    teacher_weight = torch.randn(V, teacher_D, generator=generator) * 0.5
    rows = torch.tensor_split(torch.arange(V), size)[rank]
    start, end = int(rows[0]), int(rows[-1]) + 1

    def leaves():  # (single-process hidden, weight), (this rank's hidden, weight rows)
        return ((hidden.clone().requires_grad_(), weight.clone().requires_grad_()),
                (hidden.clone().requires_grad_(), weight[start:end].clone().requires_grad_()))

    def gradients(reference, split) -> dict:
        (h_ref, w_ref), (h, w) = reference, split
        grad_h = h.grad.clone()
        dist.all_reduce(grad_h, group=group)
        return {"grad_hidden": max_relative(grad_h, h_ref.grad),
                "grad_weight": float((w.grad - w_ref.grad[start:end]).abs().max() / w_ref.grad.abs().max())}

    results = {}
    for softcap, temperature, teacher_softcap in ((None, 1.0, None), (3.0, 0.7, 5.0)):
        head = dict(softcap=softcap, temperature=temperature, chunk_size=8)
        on_group = dict(vocab_start=start, vocab_size=V, group=group, **head)
        keep = logprob_targets != IGNORE_INDEX
        # on the label positions; and masked (a GPU's way, every position projected): the label positions' sums and
        # gradients, zero elsewhere
        for case, masked in (("ce", False), ("ce masked", True)):
            reference, split = leaves()
            if masked:
                expected = fused_linear_cross_entropy(reference[0][keep], reference[1], targets[keep], **head)
                got = vocab_parallel_cross_entropy(*split, logprob_targets, masked=True, **on_group)
            else:
                expected = fused_linear_cross_entropy(*reference, targets, **head)
                got = vocab_parallel_cross_entropy(*split, targets, **on_group)
            (expected.loss_sum * 0.5).backward()
            (got.loss_sum * 0.5).backward()
            results[f"{case} softcap={softcap} T={temperature}"] = {
                "loss": relative(got.loss_sum.item(), expected.loss_sum.item()),
                "entropy": relative(got.entropy_sum.item(), expected.entropy_sum.item()),
                "correct": [int(got.correct_sum), int(expected.correct_sum)],
                "count": [int(got.num_tokens), int(expected.num_tokens)],
                **gradients(reference, split),
            }

        reference, split = leaves()
        expected_logprobs, expected_entropy, *expected_stats = fused_linear_token_logprobs(
            *reference, logprob_targets, statistics=TOKEN_STATISTICS, **head)
        got_logprobs, got_entropy, *got_stats = vocab_parallel_token_logprobs(
            *split, logprob_targets, statistics=TOKEN_STATISTICS, **on_group)
        (expected_logprobs * upstream).sum().backward()
        (got_logprobs * upstream).sum().backward()
        plain_logprobs, _, *plain_stats = linear_token_logprobs(
            hidden, weight, logprob_targets, softcap=softcap, temperature=temperature, statistics=TOKEN_STATISTICS)
        got_stats, expected_stats, plain_stats = (dict(zip(TOKEN_STATISTICS, x))
                                                  for x in (got_stats, expected_stats, plain_stats))
        results[f"logprobs softcap={softcap} T={temperature}"] = {
            "logprobs": max_relative(got_logprobs.detach(), expected_logprobs.detach()),
            "logprobs_vs_plain": max_relative(got_logprobs.detach(), plain_logprobs),
            "entropy": max_relative(got_entropy, expected_entropy),
            **{name: max_relative(got_stats[name], expected_stats[name])
               for name in ("mean_logits", "log_sum_sq_probs")},
            **{f"{name}_vs_plain": max_relative(got_stats[name], plain_stats[name])
               for name in ("mean_logits", "log_sum_sq_probs")},
            # tokens 0 and 1: the top logit tied in rows 7 and 60 (ranks 0 and 2): only row 7 counts as the argmax
            "is_top1": [got_stats["is_top1"].tolist(), expected_stats["is_top1"].tolist()],
            "is_top1_tie": [got_stats["is_top1"][:2].tolist(), plain_stats["is_top1"][:2].tolist()],
            "ignored_is_zero": bool(got_logprobs[5] == 0 and got_entropy[5] == 0
                                    and all(not got_stats[name][5] for name in TOKEN_STATISTICS)),
            "no_grad_statistics": not any(x.requires_grad for x in (got_entropy, *got_stats.values())),
            **gradients(reference, split),
        }

        for beta in (0.0, 0.5, 1.0):
            reference, split = leaves()
            jsd = dict(beta=beta, temperature=temperature, student_softcap=softcap, teacher_softcap=teacher_softcap,
                       chunk_size=8)
            expected = fused_linear_generalized_jsd(*reference, teacher_hidden, teacher_weight, **jsd)
            got = vocab_parallel_generalized_jsd(*split, teacher_hidden, teacher_weight[start:end], vocab_start=start,
                                                 vocab_size=V, group=group, **jsd)
            (expected.loss_sum * 0.5).backward()
            (got.loss_sum * 0.5).backward()
            results[f"jsd beta={beta} softcap={softcap},{teacher_softcap} T={temperature}"] = {
                "loss": relative(got.loss_sum.item(), expected.loss_sum.item()),
                "entropy": relative(got.student_entropy_sum.item(), expected.student_entropy_sum.item()),
                **gradients(reference, split),
            }
    return results


def _tp_model(refs: References, dims: ParallelDims, mesh, name: str = "untied"):
    converted = meta_model(refs.model_dirs[name])
    parallelize(converted.model, dims, mesh)
    load_sharded(converted, "cpu")
    return converted.model


def _set_head(model, seed: int, softcap: float) -> None:
    """A head of random rows (std 0.3, from ``seed``: the same values in every copy of the model) and a soft-cap, so
    the distributions are far from uniform and the student's far from its teacher's."""
    weight = model.output.projection()
    with torch.no_grad():
        copy_shard(weight, torch.randn(tuple(weight.shape), generator=torch.Generator().manual_seed(seed)) * 0.3)
    model.output.softcap = softcap


def head_losses_under_tp(refs: References, dims: ParallelDims, mesh) -> dict:
    """Through the real tensor-parallel head of a TP2 model (``model(..., head_loss=...)``), against the same model in
    one process: TokenLogprobs with every statistic and compact=True (values, gradients of every parameter), and
    GeneralizedJSD (a soft-capped student) with a tensor-parallel teacher and with a plain one-process teacher."""
    batch = global_batches()[0]  # padded rows with unlabelled prompts: ignored targets
    inputs = {"input_ids": batch["input_ids"], "attention_mask": batch["attention_mask"]}
    student, single = _tp_model(refs, dims, mesh), refs.loaded("untied")
    for model in (student, single):
        _set_head(model, seed=6, softcap=6.0)
    targets_BS = shift_labels(batch["labels"])
    with torch.no_grad():  # every other labelled target is the model's argmax: is_top1 has hits
        greedy_BS = single(**inputs).logits.argmax(dim=-1)
    even_BS = torch.arange(targets_BS.shape[1]) % 2 == 0
    targets_BS = torch.where((targets_BS != IGNORE_INDEX) & even_BS, greedy_BS, targets_BS)
    upstream_BS = torch.randn(targets_BS.shape, generator=torch.Generator().manual_seed(4))

    def parameter_gradients() -> float:
        """The worst parameter's max |grad - grad_ref| / max |grad_ref|; clears the gradients."""
        single_grads = dict(single.named_parameters())
        worst = 0.0
        for name, param in student.named_parameters():
            expected = single_grads[name].grad
            worst = max(worst, float((full(param.grad) - expected).abs().max() / expected.abs().max()))
        student.zero_grad(set_to_none=True)
        single.zero_grad(set_to_none=True)
        return worst

    results = {}
    spec = dict(temperature=0.8, statistics=TOKEN_STATISTICS, compact=True)
    got_logprobs, got_entropy, got_stats = student(**inputs, head_loss=TokenLogprobs(targets_BS, **spec)).head_output
    expected_logprobs, expected_entropy, expected_stats = single(
        **inputs, head_loss=TokenLogprobs(targets_BS, **spec)).head_output
    (got_logprobs * upstream_BS).sum().backward()
    (expected_logprobs * upstream_BS).sum().backward()
    ignored_BS = targets_BS == IGNORE_INDEX
    results["TokenLogprobs statistics compact"] = {
        "logprobs": max_relative(got_logprobs.detach(), expected_logprobs.detach()),
        "entropy": max_relative(got_entropy, expected_entropy),
        **{name: max_relative(got_stats[name], expected_stats[name]) for name in ("mean_logits", "log_sum_sq_probs")},
        "is_top1": [got_stats["is_top1"].tolist(), expected_stats["is_top1"].tolist()],
        "top1_hits": [int(got_stats["is_top1"].sum()), int(((targets_BS == greedy_BS) & ~ignored_BS).sum())],
        "ignored_is_zero": bool(ignored_BS.any()) and all(
            not x[ignored_BS].any() for x in (got_logprobs, got_entropy, *got_stats.values())),
        "shapes": all(x.shape == targets_BS.shape for x in (got_logprobs, got_entropy, *got_stats.values())),
        "parameter_grads": parameter_gradients(),
    }

    tp_teacher, single_teacher = _tp_model(refs, dims, mesh), refs.loaded("untied")
    for model in (tp_teacher, single_teacher):
        _set_head(model, seed=7, softcap=4.0)
    with torch.no_grad():
        tp_teacher_hidden = tp_teacher(**inputs).hidden_states  # a DTensor split over the sequence
        single_teacher_hidden = single_teacher(**inputs).hidden_states
    teachers = {"tensor-parallel teacher": (tp_teacher_hidden, tp_teacher.output),
                "one-process teacher": (single_teacher_hidden, single_teacher.output)}
    start = torch.tensor_split(torch.arange(student.args.vocab_size), dims.tp)[mesh["tp"].get_local_rank()][0].item()
    for teacher_name, (teacher_hidden, teacher_head) in teachers.items():
        jsd = dict(beta=0.5, temperature=0.8)
        got = student(**inputs, head_loss=GeneralizedJSD(targets_BS, teacher_hidden, teacher_head, **jsd)).head_output
        expected = single(**inputs, head_loss=GeneralizedJSD(targets_BS, single_teacher_hidden, single_teacher.output,
                                                             **jsd)).head_output
        got.loss_sum.backward()
        expected.loss_sum.backward()
        results[f"GeneralizedJSD, {teacher_name}"] = {
            # far from 0 (13.7 nats over 34 tokens): the relative differences are well conditioned
            "divergence_not_small": expected.loss_sum.item() > 1.0,
            "loss": relative(got.loss_sum.item(), expected.loss_sum.item()),
            "entropy": relative(got.student_entropy_sum.item(), expected.student_entropy_sum.item()),
            "num_tokens": [got.num_tokens, expected.num_tokens],
            "teacher_has_no_grad": all(p.grad is None for p in tp_teacher.parameters()),
            # the tensor-parallel teacher's head is read as its local shard (no gather), the other's rows sliced
            "teacher_rows": [_rows_like(teacher_head.projection(), student.output.projection(), start).data_ptr(),
                             (teacher_head.projection().to_local() if teacher_head is tp_teacher.output
                              else teacher_head.projection()[start:]).data_ptr()],
            "parameter_grads": parameter_gradients(),
        }
    return results


def refusals_under_tp(refs: References, dims: ParallelDims, mesh) -> dict:
    """What tensor parallelism cannot do yet fails with a message naming it; returns the messages."""
    messages = {}
    converted = meta_model(refs.model_dirs["untied"])
    parallelize(converted.model, dims, mesh)
    load_sharded(converted, "cpu")
    with pytest.raises(ValueError) as caught:
        converted.model(torch.zeros(1, SEQ - 1, dtype=torch.long))
    messages["odd sequence length"] = str(caught.value)
    hidden = converted.model.hidden_states(torch.zeros(1, SEQ, dtype=torch.long))

    class OwnLoss:  # a spec the head does not know: it cannot be run vocabulary-parallel
        def __call__(self, hidden_BSD, weight_VD, softcap):
            return (hidden_BSD @ weight_VD.T).sum()

    with pytest.raises(ValueError) as caught:
        converted.model.output(hidden, loss=OwnLoss())
    messages["unknown loss spec"] = str(caught.value)
    return messages


def kept_bytes_under_tp(refs: References, dims: ParallelDims, mesh) -> dict:
    """A TP2 model with LoRA on its query and value projections, checkpointed keeping the attention and the query,
    value and gate projections' results: the bytes one forward keeps on this rank (local tensors) against
    ``kept_bytes_per_token``'s estimate for a rank (its sequence shard's tokens times the whole widths), and how many
    LoRA base products (their ``addmm``'s addends only) were let go."""
    from hfnative.models import selective_checkpoint

    converted = meta_model(refs.model_dirs["untied"])
    add_adapters(converted.model)
    parallelize(converted.model, dims, mesh, activation_checkpointing="full",
                checkpoint_keeps="attention_and_projections")
    load_sharded(converted, "cpu")
    init_adapters(converted.model)
    model = converted.model.train()

    ids = torch.randint(0, VOCAB, (ROWS, SEQ), generator=torch.Generator().manual_seed(3))
    with pytest.MonkeyPatch.context() as patch:
        counted = _KeptBytes(patch)  # test_selective_checkpoint's count (a DTensor's local bytes)
        out = model(input_ids=ids, labels=ids)
    out.loss.backward()
    per_token = sum(selective_checkpoint.kept_bytes_per_token(block, "attention_and_projections", 4)
                    for block in model.layers)
    tokens = ids.numel() // dims.tp  # a rank's sequence shard
    # the GPU policy's default keep (no keep set): the most that fits in half the free memory once the rank's own
    # gradients (local shares of the split parameters) and the blocks' inputs are set aside; given exactly enough for
    # the attention and projections, it keeps them
    from hfnative.models import decoder

    model.zero_grad(set_to_none=True)
    model.checkpoint_keeps = None
    gradients = sum((p.to_local() if isinstance(p, DTensor) else p).numel() * p.element_size()
                    for p in model.parameters() if p.requires_grad)
    available = gradients + len(model.layers) * tokens * model.args.dim * 4 + 2 * tokens * per_token
    chosen, real = [], decoder.selective_checkpoint_context
    with pytest.MonkeyPatch.context() as patch, use_device_policy("gpu"):
        patch.setattr(decoder, "available_device_bytes", lambda device: available)
        patch.setattr(decoder, "selective_checkpoint_context", lambda keep: chosen.append(keep) or real(keep))
        model(input_ids=ids, labels=ids)
    return {"bytes": counted.bytes, "let_go": counted.let_go, "estimate": tokens * per_token,
            "default_keeps": sorted(set(chosen)),
            "lora_layers": sum("lora_B" in name for name, _ in model.named_parameters()),
            "finite_loss": bool(torch.isfinite(out.loss.detach()).item())}


def record(results: dict, name: str, fn) -> None:
    started = time.perf_counter()
    try:
        results[name] = fn()
    except Exception:
        results[name] = {"error": traceback.format_exc()}
    results[name]["seconds"] = round(time.perf_counter() - started, 2)


# (name, model, ParallelDims sizes, options: accumulation, in_backward, lora, and parallelize's keywords)
LAYOUTS = {
    4: [
        ("HSDP 2x2 (untied, qk-norm), activation checkpointing", "untied", dict(dp_replicate=2, dp_shard=2),
         {"activation_checkpointing": "full"}),
        ("FSDP2 x TP2 (tied, bias, padding_idx), selective activation checkpointing", "tied", dict(dp_shard=2, tp=2),
         {"activation_checkpointing": "selective"}),
        ("FSDP2 x TP2 (untied, qk-norm), optimizer in backward", "untied", dict(dp_shard=2, tp=2),
         {"in_backward": True}),
        # compiled under TP (static shapes, no compile caches), inside the recomputed blocks
        ("FSDP2 x TP2 (tied, bias, padding_idx), compiled, full activation checkpointing", "tied",
         dict(dp_shard=2, tp=2), {"compile": True, "activation_checkpointing": "full"}),
    ],
    2: [
        ("FSDP2 (tied), 2 micro-batches", "tied", dict(dp_shard=2), {"accumulation": 2}),
        ("FSDP2 (untied), optimizer in backward", "untied", dict(dp_shard=2), {"in_backward": True}),
        ("FSDP2 (mixture of experts)", "moe", dict(dp_shard=2), {}),
        ("FSDP2 + LoRA (adapters sharded with their blocks)", "untied", dict(dp_shard=2), {"lora": True}),
        ("FSDP2 + LoRA on the stacked experts (target_parameters)", "moe", dict(dp_shard=2), {"lora": True}),
        ("TP2 (untied, qk-norm)", "untied", dict(dp_shard=1, tp=2), {}),
        ("TP2 (tied, bias, padding_idx)", "tied", dict(dp_shard=1, tp=2), {}),
        ("replicate only (dp_replicate=2, DDP-like)", "untied", dict(dp_replicate=2, dp_shard=1), {}),
        ("FSDP2, bf16 parameters, fp32 reduction", "untied", dict(dp_shard=2), {"mixed_precision": "bf16"}),
        # the checkpoint inside each compiled block's graph, keeping the attention and projections' results
        ("FSDP2, compiled blocks, selective checkpoints", "untied", dict(dp_shard=2),
         {"compile": True, "activation_checkpointing": "full", "checkpoint_keeps": "attention_and_projections"}),
        # the GPU policy's head: every position projected, the ignored ones masked (no host read of the labels)
        ("TP2 (untied, qk-norm), the GPU policy", "untied", dict(dp_shard=1, tp=2), {"device_policy": "gpu"}),
        ("TP2 (untied, qk-norm), compiled blocks", "untied", dict(dp_shard=1, tp=2),
         {"compile": True}),
        # the adapters split with their weights, the blocks checkpointed keeping the attention and the query, value and
        # gate projections' results: the LoRA base products (DTensors) let go and rebuilt in the recompute
        ("TP2 + LoRA, selective checkpoints", "untied", dict(dp_shard=1, tp=2),
         {"lora": True, "activation_checkpointing": "full", "checkpoint_keeps": "attention_and_projections"}),
    ],
}


def main(output_dir: str, models_dir: str) -> None:
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    refs = References({name: str(Path(models_dir, name)) for name in ("untied", "tied", "moe")}, global_batches())
    refs.share(LAYOUTS[world], Path(output_dir, f"references-world{world}"), rank, world)
    results = {}
    for name, model, sizes, options in LAYOUTS[world]:
        dims = ParallelDims(**sizes, world_size=world)
        mesh = dims.build_mesh("cpu")
        record(results, name, lambda: parallel_run(refs, model, dims, mesh, **options))
    if world == 4:
        tp_mesh = ParallelDims(dp_shard=1, tp=4, world_size=4).build_mesh("cpu")["tp"]
        record(results, "vocab-parallel losses over 4 ranks", lambda: vocab_parallel_check(tp_mesh))
    else:
        tp2 = ParallelDims(dp_shard=1, tp=2, world_size=2)
        tp2_mesh = tp2.build_mesh("cpu")
        record(results, "refusals under TP2", lambda: refusals_under_tp(refs, tp2, tp2_mesh))
        record(results, "head losses through the TP2 head", lambda: head_losses_under_tp(refs, tp2, tp2_mesh))
        record(results, "kept bytes under TP2 with LoRA", lambda: kept_bytes_under_tp(refs, tp2, tp2_mesh))
    Path(output_dir, f"world{world}-rank{rank}.json").write_text(json.dumps(results, indent=1))
    dist.barrier()
    end_process_group()


if __name__ == "__main__":
    main(*sys.argv[1:3])
