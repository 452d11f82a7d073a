"""Saving training state under FSDP2 on 2 ranks and resuming it in other layouts, in one launch of 4 CPU processes.

usage: torchrun --standalone --nproc_per_node 4 _dcp_worker.py OUTPUT_DIR MODEL_DIR
MODEL_DIR holds a Hub-format checkpoint of the tied test model (see test_distributed_checkpoint.py).

Ranks {0, 1} and {2, 3} form two pairs, each a 2-rank mesh of its own, so 2-rank layouts run beside each other:
1. every rank: the uninterrupted single-process run (5 AdamW steps with a warm-up + linear LR schedule), the oracle;
2. pair {0, 1}: FSDP2, 3 steps, ``save_training_state`` into OUTPUT_DIR/saved, then 2 more steps (the
   uninterrupted FSDP2 run); the full weights and optimizer state at the save go to OUTPUT_DIR/at_save.safetensors
   and the losses to OUTPUT_DIR/uninterrupted.json (with the single-process ones and final weights, for the
   1-process resume that the test runs itself);
3. all 4 ranks: resume in FSDP2 x TP2, save that state again into OUTPUT_DIR/saved_again (2-D shards, the
   norms replicated over the tensor-parallel ranks), 2 steps;
4. all 4 ranks: resume from saved_again in HSDP 2x2, 2 steps;
5. pair {0, 1} resumes in FSDP2, pair {2, 3} in TP2, 2 steps each.
Each resume records whether the loaded state equals the saved one exactly, its losses and final weights against the
uninterrupted runs, and the extra dict and random draws it got back. Writes OUTPUT_DIR/rank<r>.json.
"""

from __future__ import annotations

import json
import random
import sys
import time
import traceback
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
from _parallel_worker import MAX_GRAD_NORM, SETTINGS, full, global_batches, label_tokens, rows_of
from safetensors.torch import load_file, save_file
from torch.distributed.device_mesh import DeviceMesh
from transformers import get_linear_schedule_with_warmup

from hfnative.checkpoint import load_training_state, save_training_state
from hfnative.converters.loading import load_pretrained
from hfnative.converters.sharded_loading import load_sharded, meta_model
from hfnative.optim import build_optimizer
from hfnative.parallel import ParallelDims, end_process_group, parallelize
from hfnative.parallel.dims import MESH_DIMS
from hfnative.parallel.grad_norm import replicate_partial_gradients

SAVED_AT, STEPS = 3, 5
EXTRA = {"global_step": SAVED_AT, "sampler": {"epoch": 0, "position": (SAVED_AT * 4, "rows")}}


class Run:
    """A model, its AdamW and LR schedule, in one layout; ``dp_group``: the ranks splitting each global batch."""

    def __init__(self, model, dp_group=None):
        self.model, self.dp_group = model, dp_group
        self.optimizer = build_optimizer(model, SETTINGS)
        self.scheduler = get_linear_schedule_with_warmup(self.optimizer, num_warmup_steps=1, num_training_steps=STEPS)

    def step(self, batch) -> float:
        group = self.dp_group
        dp_rank, dp_size = (dist.get_rank(group), dist.get_world_size(group)) if group is not None else (0, 1)
        local = rows_of(batch, dp_rank, dp_size)
        num_tokens = torch.tensor(label_tokens(local["labels"]))
        if self.dp_group is not None:
            dist.all_reduce(num_tokens, group=self.dp_group)
        loss = self.model(**local, num_items_in_batch=num_tokens).loss
        loss.backward()
        loss = loss.detach().clone()
        if self.dp_group is not None:
            dist.all_reduce(loss, group=self.dp_group)
        replicate_partial_gradients(list(self.model.parameters()))  # as the trainer's step
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), MAX_GRAD_NORM)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.scheduler.step()
        return loss.item()

    def full_state(self) -> dict[str, torch.Tensor]:
        """Every weight and AdamW state tensor, whole, by name."""
        state = {f"model.{name}": full(param.detach()).clone() for name, param in self.model.named_parameters()}
        for name, param in self.model.named_parameters():
            for field, value in self.optimizer.state[param].items():
                state[f"optimizer.{name}.{field}"] = full(value).clone()
        return state


def parallel_model(model_dir: str, dims: ParallelDims, mesh: DeviceMesh):
    converted = meta_model(model_dir)
    parallelize(converted.model, dims, mesh)
    load_sharded(converted, "cpu")  # the Hub weights: the resumes must overwrite them
    return converted.model


def pair_mesh(pair, pair_group, single_group, tp: bool) -> DeviceMesh:
    """This pair's 2-rank mesh with the dims MESH_DIMS: FSDP2 (1, 2, 1) or TP2 (1, 1, 2)."""
    shape = (1, 1, 2) if tp else (1, 2, 1)
    groups = [single_group, single_group, pair_group] if tp else [single_group, pair_group, single_group]
    return DeviceMesh.from_group(groups, "cpu", mesh=torch.tensor(pair).reshape(shape), mesh_dim_names=MESH_DIMS)


def max_difference(got: dict, expected: dict) -> tuple[float, str]:
    """The worst tensor's max |got - expected| / max |expected| (0.0 only when all are equal), and its name."""
    assert got.keys() == expected.keys(), sorted(set(got) ^ set(expected))
    per_tensor = {name: float((got[name] - value).abs().max() / value.abs().max().clamp_min(1e-12))
                  for name, value in expected.items()}
    worst = max(per_tensor, key=per_tensor.get)
    return per_tensor[worst], worst


def random_draws() -> list[float]:
    return [*torch.rand(2).tolist(), random.random(), float(np.random.rand())]


def resumed(run: Run, saved_dir: Path, at_save: dict, batches, uninterrupted: dict, process_group=None,
            save_again: Path | None = None) -> dict:
    """Load the saved state into ``run``, check it against the state at the save (and save it again into
    ``save_again`` in this layout), and train the last 2 steps."""
    extra = load_training_state(saved_dir, run.model, run.optimizer, lr_scheduler=run.scheduler,
                                process_group=process_group)
    draws = random_draws()
    loaded_state = run.full_state()
    state_difference, state_worst = max_difference(loaded_state, at_save)
    if save_again is not None:
        save_training_state(save_again, run.model, run.optimizer, lr_scheduler=run.scheduler, extra=extra,
                            process_group=process_group)
    step_dtypes = sorted({str(value.dtype) for name, value in loaded_state.items() if name.endswith(".step")})
    losses = [run.step(batch) for batch in batches[SAVED_AT:]]
    weights = {name: value for name, value in run.full_state().items() if name.startswith("model.")}
    result = {
        "loaded_state_max_difference": state_difference,
        "loaded_state_worst": state_worst,
        "step_dtypes": step_dtypes,
        "extra": extra,
        "extra_matches": extra == EXTRA,
        "random_draws": draws,
        "learning_rate": run.optimizer.param_groups[0]["lr"],
        "scheduler_last_epoch": run.scheduler.last_epoch,
        "losses": losses,
    }
    for name, reference in uninterrupted.items():
        result[f"loss_vs_{name}"] = max(abs(a - b) / abs(b) for a, b in zip(losses, reference["losses"][SAVED_AT:]))
        result[f"weights_vs_{name}"] = max_difference(weights, reference["weights"])[0]
    return result


def record(results: dict, name: str, fn) -> None:
    started = time.perf_counter()
    try:
        results[name] = fn()
    except Exception:
        results[name] = {"error": traceback.format_exc()}
    results[name]["seconds"] = round(time.perf_counter() - started, 2)


def main(output_dir: str, model_dir: str) -> None:
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    assert world == 4, "launch 4 processes"
    out, saved_dir = Path(output_dir), Path(output_dir, "saved")
    batches = global_batches()
    assert len(batches) == STEPS
    pair = [0, 1] if rank < 2 else [2, 3]
    pair_group, _ = dist.new_subgroups(group_size=2)
    single_group, _ = dist.new_subgroups(group_size=1)
    results = {}

    # 1. the uninterrupted single-process run: the oracle
    single = Run(load_pretrained(model_dir).model)
    single_losses = [single.step(batch) for batch in batches]
    uninterrupted = {"single": {"losses": single_losses,
                                "weights": {k: v for k, v in single.full_state().items() if k.startswith("model.")}}}

    # 2. pair {0, 1}: FSDP2, save after 3 steps, then the uninterrupted FSDP2 run
    if rank < 2:
        fsdp = ParallelDims(dp_shard=2, world_size=2)
        run = Run(parallel_model(model_dir, fsdp, pair_mesh(pair, pair_group, single_group, tp=False)), pair_group)
        losses = [run.step(batch) for batch in batches[:SAVED_AT]]
        at_save = run.full_state()
        torch.manual_seed(100 + rank)
        random.seed(200 + rank)
        np.random.seed(300 + rank)
        started = time.perf_counter()
        save_training_state(saved_dir, run.model, run.optimizer, lr_scheduler=run.scheduler, extra=EXTRA,
                            process_group=pair_group)
        save_seconds = time.perf_counter() - started
        draws_after_save = random_draws()
        losses += [run.step(batch) for batch in batches[SAVED_AT:]]
        weights = {name: value for name, value in run.full_state().items() if name.startswith("model.")}
        if rank == 0:
            save_file(at_save, str(out / "at_save.safetensors"))
            save_file(weights, str(out / "fsdp_weights.safetensors"))
            save_file(uninterrupted["single"]["weights"], str(out / "single_weights.safetensors"))
            summary = {"fsdp_losses": losses, "single_losses": single_losses, "save_seconds": save_seconds}
            (out / "uninterrupted.json").write_text(json.dumps(summary, indent=1))
        results["saved under FSDP2 on ranks 0, 1"] = {"losses": losses, "save_seconds": save_seconds,
                                                     "random_draws_after_save": draws_after_save}
    dist.barrier()
    at_save = load_file(str(out / "at_save.safetensors"))
    summary = json.loads((out / "uninterrupted.json").read_text())
    fsdp_weights = load_file(str(out / "fsdp_weights.safetensors"))
    uninterrupted["fsdp"] = {"losses": summary["fsdp_losses"], "weights": fsdp_weights}

    # 3. all 4 ranks: FSDP2 x TP2
    dims = ParallelDims(dp_shard=2, tp=2, world_size=4)
    mesh = dims.build_mesh("cpu")

    def fsdp_tp():
        run = Run(parallel_model(model_dir, dims, mesh), dims.dp_mesh(mesh).get_group())
        return resumed(run, saved_dir, at_save, batches, uninterrupted, save_again=out / "saved_again")

    record(results, "resumed under FSDP2 x TP2 on 4 ranks", fsdp_tp)

    # 4. all 4 ranks: HSDP 2x2, from the state saved again under FSDP2 x TP2
    hsdp = ParallelDims(dp_replicate=2, dp_shard=2, world_size=4)
    hsdp_mesh = hsdp.build_mesh("cpu")

    def hsdp_from_fsdp_tp():
        run = Run(parallel_model(model_dir, hsdp, hsdp_mesh), hsdp.dp_mesh(hsdp_mesh).get_group())
        return resumed(run, out / "saved_again", at_save, batches, uninterrupted)

    record(results, "resumed under HSDP 2x2 on 4 ranks, saved again under FSDP2 x TP2", hsdp_from_fsdp_tp)

    # 5. pair {0, 1}: FSDP2; pair {2, 3}: TP2
    tp = rank >= 2
    layout = ParallelDims(dp_shard=1, tp=2, world_size=2) if tp else ParallelDims(dp_shard=2, world_size=2)
    name = "resumed under TP2 on ranks 2, 3" if tp else "resumed under FSDP2 on ranks 0, 1"

    def on_pair():
        model = parallel_model(model_dir, layout, pair_mesh(pair, pair_group, single_group, tp=tp))
        run = Run(model, None if tp else pair_group)
        return resumed(run, saved_dir, at_save, batches, uninterrupted, process_group=pair_group)

    record(results, name, on_pair)
    Path(output_dir, f"rank{rank}.json").write_text(json.dumps(results, indent=1))
    dist.barrier()
    end_process_group()


if __name__ == "__main__":
    main(*sys.argv[1:3])
