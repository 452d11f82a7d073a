"""TRL 0.29.1's PPOTrainer (``trl.experimental.ppo``, the last TRL with PPO) run beside hfnative, for the tests and
benchmarks/bench_ppo.py.

The dev extra's TRL 1.16 has the same package name, so TRL 0.29.1 is installed on its own
(``pip install --no-deps --target DIR trl==0.29.1``, into ``HFNATIVE_TRL029`` when set, else a cache folder the
caller names) and run in a subprocess with ``PYTHONPATH=DIR``: ``run_trl029(payload, folder)``. When it cannot be
installed (no registry) the caller is skipped with the reason.

Run as a script (``python trl029_ppo.py payload.json result.json``, inside that subprocess) it trains TRL's
PPOTrainer on the payload's models and settings (its per-update seconds and peak RSS returned too). With ``replay`` it replays the given rollouts: each update's prompts
(in order, cut into TRL's passes over the dataset so accelerate's end-of-dataloader rule holds), their completions
(``batch_generation`` patched: the policy's forward gives the generation logits) and the mini-batch shuffles
(``np.random.permutation`` patched), so both trainers see the same data; it returns the log history, each update's
tensors (rewards, values, advantages, returns, ...) and its statistics slots. ``{"mode": "config"}`` returns
PPOConfig's fields and defaults.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

TRL_VERSION = "0.29.1"


class NotInstalled(RuntimeError):
    """TRL 0.29.1 could not be installed; the message says why."""


def install_trl029(cache_root) -> Path:
    """A folder holding TRL 0.29.1 (``HFNATIVE_TRL029``, else ``cache_root/trl-0.29.1``, installed there if needed);
    raises NotInstalled with the reason when it cannot be."""
    folder = Path(os.environ.get("HFNATIVE_TRL029") or Path(cache_root) / f"trl-{TRL_VERSION}")
    if (folder / "trl" / "experimental" / "ppo" / "ppo_trainer.py").exists():
        return folder
    command = [sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--target", str(folder),
               f"trl=={TRL_VERSION}"]
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=300)
    except (OSError, subprocess.TimeoutExpired) as error:
        raise NotInstalled(f"TRL {TRL_VERSION} could not be installed: {error}") from error
    if done.returncode != 0:
        raise NotInstalled(f"TRL {TRL_VERSION} could not be installed (no package registry?): "
                           f"{done.stderr.strip()[-300:]}")
    return folder


def trl029_dir(cache_root) -> Path:
    """``install_trl029`` for a test: skipped with the reason when TRL 0.29.1 cannot be installed."""
    import pytest

    try:
        return install_trl029(cache_root)
    except NotInstalled as error:
        pytest.skip(str(error))


def run_trl029(payload: dict, folder, trl_dir, timeout: float = 900) -> dict:
    """This script on ``payload`` in a subprocess with TRL 0.29.1 first on the path; its result."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "payload.json").write_text(json.dumps(payload))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(trl_dir), os.environ.get("PYTHONPATH", "")]),
           "TRL_EXPERIMENTAL_SILENCE": "1"}
    done = subprocess.run([sys.executable, __file__, str(folder / "payload.json"), str(folder / "result.json")],
                          capture_output=True, text=True, env=env, timeout=timeout)
    if done.returncode != 0:
        raise RuntimeError(f"TRL {TRL_VERSION}'s run failed:\n{done.stderr[-4000:]}")
    return json.loads((folder / "result.json").read_text())


# --- inside the subprocess ----------------------------------------------------------------------------------------


def _jsonable(value):
    if isinstance(value, (str, int, float, bool)) or value is None:
        return value
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    if isinstance(value, dict):
        return {str(k): _jsonable(v) for k, v in value.items()}
    return repr(value)


def config_defaults() -> dict:
    import dataclasses

    import trl
    from trl.experimental.ppo import PPOConfig

    assert trl.__version__ == TRL_VERSION, trl.__version__
    config = PPOConfig("unused", use_cpu=True)
    return {f.name: _jsonable(getattr(config, f.name)) for f in dataclasses.fields(config)}


def _replay_loader(trainer, tokenizer, updates: list[list[list[int]]], updates_per_pass: int):
    """A prepared loader yielding the given updates' prompts in order, ``updates_per_pass`` batches per pass."""
    import torch
    from torch.utils.data import DataLoader
    from transformers import DataCollatorWithPadding

    rows = [{"input_ids": ids} for batch in updates for ids in batch]
    size = len(updates[0])

    class ReplaySampler:
        def __init__(self):
            self.passes = 0

        def __iter__(self):
            first = self.passes * updates_per_pass
            self.passes += 1
            for update in range(first, min(first + updates_per_pass, len(updates))):
                yield list(range(update * size, (update + 1) * size))

        def __len__(self):
            return updates_per_pass

    loader = DataLoader(rows, batch_sampler=ReplaySampler(), collate_fn=DataCollatorWithPadding(tokenizer))
    torch.manual_seed(trainer.args.seed)
    return trainer.accelerator.prepare(loader)


def _peak_rss_mib() -> float:
    """This process's peak RSS (VmHWM: ru_maxrss would count the parent's RSS at fork)."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    return float("nan")


def two_adapter_policy(model: str, lora: dict, adapter: str, ref_adapter: str):
    """A peft PeftModel on the causal LM in ``model`` with two LoRA adapters of the settings ``lora``: "default" (the
    trained one) and "ref" (the reference's), their weights read from the safetensors files ``adapter`` and
    ``ref_adapter``; "default" active."""
    from peft import LoraConfig, get_peft_model, set_peft_model_state_dict
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    policy = get_peft_model(AutoModelForCausalLM.from_pretrained(model), LoraConfig(**lora))
    set_peft_model_state_dict(policy, load_file(adapter))
    policy.add_adapter("ref", LoraConfig(**lora))
    set_peft_model_state_dict(policy, load_file(ref_adapter), adapter_name="ref")
    policy.set_adapter("default")
    return policy


def train(payload: dict) -> dict:
    import sys as _sys

    import numpy as np
    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification, AutoTokenizer
    from trl.experimental.ppo import PPOConfig, PPOTrainer
    from trl.experimental.ppo import ppo_trainer as module

    tokenizer = AutoTokenizer.from_pretrained(payload["tokenizer"], padding_side="left")
    policy = AutoModelForCausalLM.from_pretrained(payload["policy"])
    ref = AutoModelForCausalLM.from_pretrained(payload["policy"]) if payload.get("peft") is None else None
    reward = AutoModelForSequenceClassification.from_pretrained(payload["reward"], num_labels=1)
    value = AutoModelForSequenceClassification.from_pretrained(payload["value"], num_labels=1)
    peft_config = None
    two_adapters = payload.get("peft") is not None and payload["peft"].get("ref_adapter") is not None
    if two_adapters:  # the trained and the reference adapter in one PeftModel (ref_adapter_name)
        peft = payload["peft"]
        policy = two_adapter_policy(payload["policy"], peft["config"], peft["adapter"], peft["ref_adapter"])
    elif payload.get("peft") is not None:
        from peft import LoraConfig

        peft_config = LoraConfig(**payload["peft"]["config"])
    replay = payload.get("replay")
    prompts = [ids for batch in replay["prompts"] for ids in batch] if replay else payload["prompts"]
    args = PPOConfig(**payload["config"])
    import time

    from transformers import TrainerCallback

    step_seconds, step_cpu_seconds = [], []

    class Clock(TrainerCallback):  # TRL's PPO calls on_step_end once per update
        def on_step_end(self, args, state, control, **kwargs):
            now, cpu_now = time.perf_counter(), time.process_time()
            step_seconds.append(now - getattr(self, "last", start))
            step_cpu_seconds.append(cpu_now - getattr(self, "cpu_last", cpu_start))
            self.last, self.cpu_last = now, cpu_now

    trainer = PPOTrainer(args=args, processing_class=tokenizer, model=policy, ref_model=ref, reward_model=reward,
                         train_dataset=Dataset.from_list([{"input_ids": ids} for ids in prompts]), value_model=value,
                         peft_config=peft_config, callbacks=[Clock()])
    if peft_config is not None:
        from peft import set_peft_model_state_dict
        from safetensors.torch import load_file

        set_peft_model_state_dict(trainer.model.policy, load_file(payload["peft"]["adapter"]))
    captured, stats = [], []
    if replay:
        trainer.dataloader = _replay_loader(trainer, tokenizer, replay["prompts"], replay["updates_per_pass"])
        completions = iter(replay["completions"])
        permutations = iter(p for update in replay["permutations"] for p in update)
        temperature = args.temperature + 1e-7

        def batch_generation(model, queries, batch_size, pad_token_id, generation_config):
            responses = next(completions)
            width = max(len(r) for r in responses)
            padded = torch.tensor([r + [pad_token_id] * (width - len(r)) for r in responses])
            query_responses = torch.cat([queries, padded.to(queries.device)], dim=1)
            logits = module.forward(model, query_responses, pad_token_id).logits[:, queries.shape[1] - 1 : -1]
            return query_responses, logits / temperature

        module.batch_generation = batch_generation
        np.random.permutation = lambda n: np.asarray(next(permutations))
    whiten = module.__dict__.setdefault("original_masked_whiten", module.masked_whiten)  # not a previous run's wrapper

    def capture_whiten(values, mask, shift_mean=True):
        out = whiten(values, mask, shift_mean)
        if shift_mean:  # the advantages' whitening: the update's tensors are train()'s locals
            frame = _sys._getframe(1).f_locals
            update = {name: frame[name].tolist() for name in ("values", "rewards", "scores", "returns", "logprobs",
                                                              "ref_logprobs", "padding_mask", "responses")}
            update["advantages"] = out.masked_fill(~mask, 0).tolist()
            captured.append(update)
        return out

    module.masked_whiten = capture_whiten
    log = trainer.log

    def capture_log(logs, *rest):
        frame = _sys._getframe(1).f_locals
        stats.append({name: frame[name].tolist() for name in ("approxkl_stats", "pg_clipfrac_stats", "pg_loss_stats",
                                                             "vf_loss_stats", "vf_clipfrac_stats", "entropy_stats",
                                                             "ratio_stats")})
        return log(logs, *rest)

    trainer.log = capture_log
    start, cpu_start = time.perf_counter(), time.process_time()
    trainer.train()
    return {"log_history": trainer.state.log_history, "updates": captured, "stats": stats, "step_seconds": step_seconds,
            "step_cpu_seconds": step_cpu_seconds,            "peak_rss_mib": _peak_rss_mib()}


if __name__ == "__main__":
    request = json.loads(Path(sys.argv[1]).read_text())
    if request.get("mode") == "config":
        result = config_defaults()
    else:  # one run, or several in this one process (the interpreter and TRL imported once)
        result = [train(run) for run in request["runs"]] if "runs" in request else train(request)
    Path(sys.argv[2]).write_text(json.dumps(result))
