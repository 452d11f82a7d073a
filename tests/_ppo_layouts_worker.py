"""PPOTrainer as the ranks of a torchrun launch, for tests/test_ppo_layouts.py.

usage: torchrun --standalone --nproc_per_node 2 _ppo_layouts_worker.py OUTPUT_DIR MODELS_DIR RUN [RUN ...]
Each RUN is a layout (``ddp``, ``fsdp2``, ``tp2``, ``cp2`` on 2 processes, ``fsdp2xtp2`` on 4), ``ep2-moe`` (expert
parallel over a mixture-of-experts policy), ``fsdp2-resume`` (a second FSDP2 run that resumes the ``fsdp2`` run's
checkpoint of update SAVED and trains the updates after it) or ``pp2-untied``, which PPO refuses when the trainer is
built (its error is written instead of a log; a dense policy with untied embeddings, which pipeline stages take). Every run samples from the native engine on each rank,
scores with the reward model and values with the value model, on the same global batch as the test's one-process run.
Rank r writes OUTPUT_DIR/RUN-rank<r>.json (the log history).
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from _ppo_worker import MODEL, ppo_trainer, prompt_rows  # noqa: E402

GLOBAL_BATCH = 8  # rollouts per update: the 8 prompts once
UPDATES, SAVED = 3, 2
# layout -> (parallelism_config, data-parallel ranks)
LAYOUTS = {
    "ddp": (dict(dp_replicate_size=2), 2),
    "fsdp2": (dict(dp_shard_size=2), 2),
    "tp2": (dict(tp_size=2), 1),
    "fsdp2xtp2": (dict(dp_shard_size=2, tp_size=2), 2),
    "ep2": (dict(dp_shard_size=2, ep_size=2), 2),
    "cp2": (dict(cp_size=2), 1),
    "pp2": (dict(pp_size=2), 1),
}
REFUSED = ("pp2",)


def policy_folder(models_dir: str, run: str) -> Path:
    """The policy a run trains: MODELS_DIR/moe-policy for a run named ``...-moe``, MODELS_DIR/untied-policy for
    ``...-untied``, else MODELS_DIR/policy."""
    for suffix in ("moe", "untied"):
        if run.endswith(f"-{suffix}"):
            return Path(models_dir) / f"{suffix}-policy"
    return Path(models_dir) / "policy"


def save_stopping_policy(folder: Path, source: str = MODEL, logit_spread: float = 5.0) -> None:
    """The causal LM in ``source`` (tiny-qwen3 by default, whose samples are near uniform over its 1,024 tokens) with
    its head's EOS row replaced by a random direction scaled so that the EOS logit spreads ``logit_spread`` over the
    prompts' positions: some responses stop after a few tokens and some run to the length limit."""
    import shutil

    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(source)
    eos = AutoTokenizer.from_pretrained(MODEL).eos_token_id
    with torch.no_grad():
        hidden = torch.cat([model(torch.tensor([row["input_ids"]]), output_hidden_states=True).hidden_states[-1][0]
                            for row in prompt_rows()])
        direction = torch.randn(hidden.shape[-1], generator=torch.Generator().manual_seed(0))
        model.get_output_embeddings().weight[eos] = direction * (logit_spread / (hidden @ direction).std())
    model.save_pretrained(folder)
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        shutil.copy(Path(MODEL) / name, folder / name)


def train(output_dir: str, models_dir: str, ranks: int, resume: str | None = None, policy: str | None = None,
          **extra) -> list[dict]:
    """The run's log history (one entry per update, the summary dropped): GLOBAL_BATCH rollouts per update over
    ``ranks`` data-parallel ranks, 2 accumulation steps, 2 PPO epochs, saving at update SAVED; ``policy``: a folder
    of ``save_stopping_policy`` (default MODELS_DIR/policy)."""
    trainer = ppo_trainer(output_dir, models_dir, policy=policy or str(Path(models_dir) / "policy"),
                          per_device_train_batch_size=GLOBAL_BATCH // (2 * ranks),
                          gradient_accumulation_steps=2, total_episodes=GLOBAL_BATCH * UPDATES, save_steps=SAVED,
                          **extra)
    trainer.train(resume_from_checkpoint=resume)
    return [entry for entry in trainer.state.log_history if "train_runtime" not in entry]


def main(output_dir: str, models_dir: str, runs: list[str]) -> None:
    rank = int(os.environ["RANK"])
    for run in runs:
        layout = run.split("-")[0]
        resume = str(Path(output_dir) / layout / f"checkpoint-{SAVED}") if run.endswith("-resume") else None
        sizes, ranks = LAYOUTS[layout]
        try:
            logs = train(str(Path(output_dir) / run), models_dir, ranks, resume=resume,
                         policy=str(policy_folder(models_dir, run)), parallelism_config=dict(sizes))
        except ValueError as error:
            if layout not in REFUSED:
                raise
            logs = {"error": f"{type(error).__name__}: {error}"}
        (Path(output_dir) / f"{run}-rank{rank}.json").write_text(json.dumps(logs))


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], sys.argv[3:])
