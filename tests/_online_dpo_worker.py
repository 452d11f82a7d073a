"""Online DPO as ranks of a torchrun launch, for tests/test_online_dpo.py.

usage: torchrun --standalone --nproc_per_node 2 _online_dpo_worker.py OUTPUT_DIR CELL [CELL ...]
Each CELL (a key of CELLS) trains with its layout's parallelism_config, 2 prompts per rank, on fixed completions (the
rollout engine's ``generate`` replaced: each completion depends on its prompt and on which of the prompt's two copies
it is); a key of SAMPLED trains on the native engine's sampled completions; rank 0 writes OUTPUT_DIR/CELL/log.json (the log history). The test runs each cell on one process with 4
prompts per micro-batch (``trainer_for`` with ``layout=None``): the prompts the ranks held together.
"""

import json
import os
import sys
from pathlib import Path

from datasets import Dataset

import hfnative
from hfnative.generation import Rollouts

ROOT = Path(__file__).resolve().parents[1]
MODEL = str(ROOT / "examples" / "tiny-qwen3")
EOS, STEPS, MAX_NEW = 2, 2, 6
LAYOUTS = {"ddp": dict(dp_replicate_size=2, dp_shard_size=1), "fsdp2": dict(dp_shard_size=2)}
# name -> (layout, settings)
CELLS = {
    "sigmoid-ddp": ("ddp", dict(loss_type="sigmoid", beta=0.2, missing_eos_penalty=0.5)),
    "ipo-fsdp2": ("fsdp2", dict(loss_type="ipo", beta=0.5)),
}
# cells whose completions the native engine samples (the path a user runs; each layout samples other completions)
SAMPLED = {"sampled-fsdp2": ("fsdp2", dict(loss_type="sigmoid", beta=0.1))}


def fixed_completion(prompt_ids: list[int], copy: int) -> list[int]:
    """Depends on the prompt and on the copy (0 or 1) only, so that every layout completes a prompt alike."""
    seed = sum(prompt_ids) + 11 * copy
    if seed % 3 == 0:
        return [10 + (seed * 5 + 31 * k) % 300 for k in range(MAX_NEW)]
    return [10 + (seed * 3 + 17 * k) % 300 for k in range(1 + seed % (MAX_NEW - 1))] + [EOS]


def generate(prompts, sampling):
    half = len(prompts) // 2  # the block layout: every prompt once, then again
    completions = [fixed_completion(list(p), i // half) for i, p in enumerate(prompts)]
    return Rollouts(completions, [[0.0] * len(c) for c in completions], ["stop"] * len(completions))


def prompts(n: int) -> list[dict]:
    return [{"prompt": f"Say something about the number {i}" + " please" * (i % 3), "target": 4 + 2 * i}
            for i in range(n)]


def near_target_length(completions, target, **kwargs):
    return [1.0 / (1.0 + abs(len(c) - t)) for c, t in zip(completions, target)]


def trainer_for(cell: str, output_dir: str, layout: str | None = "cell"):
    """The cell's trainer under its layout, or (``layout=None``) one process holding the ranks' prompts together."""
    layout_name, settings = CELLS[cell] if cell in CELLS else SAMPLED[cell]
    common = dict(output_dir=output_dir, use_cpu=True, bf16=False, report_to="none", disable_tqdm=True,
                  max_steps=STEPS, logging_steps=1, save_strategy="no", per_device_train_batch_size=2,
                  learning_rate=5e-3, max_new_tokens=MAX_NEW, max_length=64, gradient_checkpointing=False, seed=3)
    if layout is None:
        common["per_device_train_batch_size"] = 4
    else:
        common["parallelism_config"] = dict(LAYOUTS[layout_name])
    trainer = hfnative.OnlineDPOTrainer(model=MODEL, reward_funcs=near_target_length,
                                        args=hfnative.OnlineDPOConfig(**common, **settings),
                                        train_dataset=Dataset.from_list(prompts(16)))
    if cell in CELLS:
        trainer.objective.engine.generate = generate
    return trainer


def main(output_dir: str, cells: list[str]) -> None:
    rank = int(os.environ["RANK"])
    for cell in cells:
        out = Path(output_dir) / cell
        trainer = trainer_for(cell, str(out))
        trainer.train()
        if rank == 0:
            out.mkdir(parents=True, exist_ok=True)
            (out / "log.json").write_text(json.dumps(trainer.state.log_history))


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2:])
