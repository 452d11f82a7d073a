"""TRL's completions table for the online RL trainers and on-policy distillation (``log_completions``): the latest
prompts, completions, rewards and advantages of every data-parallel rank, the reward functions' own columns
(``log_extra``) and metrics (``log_metric``); at each log the table printed, written to
``output_dir/completions/completions_{step:05d}.parquet`` and logged as ``completions`` to W&B and trackio, as TRL
does (``publish_completions``)."""

from __future__ import annotations

import logging
import os
import random
from collections import deque

logger = logging.getLogger(__name__)


class CompletionLog:
    """The last ``maxlen`` completions of the run, in rank order, with what the reward functions logged for them."""

    def __init__(self, reward_names: list[str], maxlen: int):
        self.maxlen = maxlen
        self.logged = {"prompt": deque(maxlen=maxlen), "completion": deque(maxlen=maxlen),
                       "rewards": {name: deque(maxlen=maxlen) for name in reward_names},
                       "advantages": deque(maxlen=maxlen), "extra": {}}
        self._pending_extra: dict[str, list] = {}
        self._pending_metrics: dict[str, list[float]] = {}

    def log_extra(self, column: str, values: list) -> None:
        """A reward function's own column, one value per completion (TRL's ``log_extra``)."""
        self._pending_extra.setdefault(column, []).extend(values)

    def log_metric(self, name: str, value: float) -> None:
        """A reward function's own metric (TRL's ``log_metric``)."""
        self._pending_metrics.setdefault(name, []).append(float(value))

    def flush(self, prompts, completions, rewards_NF, advantages_N, data_parallel) -> dict[str, float]:
        """Adds this generation batch (every rank's rows, in rank order) and returns the reward functions' metrics:
        each the sum of every rank's values over their count, as TRL."""
        local = dict(prompts=prompts, completions=completions, count=len(prompts), extra=self._pending_extra,
                     metrics={name: (sum(values), len(values)) for name, values in self._pending_metrics.items()})
        ranks = data_parallel.gather_objects(local)
        self._pending_extra, self._pending_metrics = {}, {}
        for part in ranks:
            self.logged["prompt"].extend(part["prompts"])
            self.logged["completion"].extend(part["completions"])
        for index, name in enumerate(self.logged["rewards"]):
            self.logged["rewards"][name].extend(rewards_NF[:, index].tolist())
        self.logged["advantages"].extend(advantages_N.tolist())
        for column in sorted({column for part in ranks for column in part["extra"]}):
            values = [v for part in ranks for v in part["extra"].get(column, [None] * part["count"])]
            self.logged["extra"].setdefault(column, deque(maxlen=self.maxlen)).extend(values)
        metrics = {}
        for name in sorted({name for part in ranks for name in part["metrics"]}):
            total = sum(part["metrics"][name][0] for part in ranks if name in part["metrics"])
            count = sum(part["metrics"][name][1] for part in ranks if name in part["metrics"])
            metrics[name] = total / count
        return metrics


class TextCompletionLog:
    """On-policy distillation's log (TRL's DistillationTrainer): the last ``maxlen`` prompts and completions as text,
    every data-parallel rank's in rank order, training's and evaluation's generations alike."""

    def __init__(self, maxlen: int):
        self.logged = {"prompt": deque(maxlen=maxlen), "completion": deque(maxlen=maxlen)}

    def add(self, prompts: list[str], completions: list[str], data_parallel) -> None:
        for part in data_parallel.gather_objects((prompts, completions)):
            self.logged["prompt"].extend(part[0])
            self.logged["completion"].extend(part[1])


class CompletionsUpload:
    """``log_completions_hub_repo`` (GRPO): the completions tables (``output_dir/completions/*.parquet``) pushed to a
    Hub dataset repository, as TRL pushes them: the repository made (private with ``hub_private_repo``) with a
    dataset card, then huggingface_hub's ``CommitScheduler`` uploading new tables every 2 minutes in the background,
    and once more when training ends (``finish``), so the last tables are there when ``train()`` returns."""

    EVERY_MINUTES = 2
    FINAL_PUSH_SECONDS = 300  # how long the end of training waits for the last upload

    def __init__(self, repo_id: str, folder: str, private: bool | None, token: str | None, model_name: str):
        from huggingface_hub import CommitScheduler, DatasetCard, DatasetCardData, HfApi

        api = HfApi(token=token)
        repo_id = api.create_repo(repo_id, private=private, repo_type="dataset", exist_ok=True).repo_id
        data = DatasetCardData(pretty_name="Completion logs", tags=["hfnative", "completions"])
        card = DatasetCard(f"---\n{data.to_yaml()}\n---\n\n# Completion logs\n\nThe prompts, completions, rewards and "
                           f"advantages that GRPO training of `{model_name}` logged: one parquet table per log "
                           "(`completions_{step:05d}.parquet`: step, prompt, completion, each reward function's reward, "
                           "the reward functions' own columns, advantage).\n")
        api.upload_file(path_or_fileobj=str(card).encode(), path_in_repo="README.md", repo_id=repo_id,
                        repo_type="dataset", commit_message="Dataset card")
        self.scheduler = CommitScheduler(repo_id=repo_id, repo_type="dataset", folder_path=folder,
                                         every=self.EVERY_MINUTES, allow_patterns=["*.parquet"], private=private,
                                         hf_api=api)

    def finish(self) -> None:
        """The tables written since the last upload pushed now (waiting at most ``FINAL_PUSH_SECONDS``). A failed or
        late push is logged, never raised: training's own result or error stands (huggingface_hub's scheduler tries
        again when the process exits)."""
        try:
            self.scheduler.trigger().result(timeout=self.FINAL_PUSH_SECONDS)
        except Exception as error:  # noqa: BLE001  (a Hub or network error, or the wait's timeout)
            logger.warning("the last completions tables were not pushed to the Hub dataset %s: %s: %s",
                           self.scheduler.repo_id, type(error).__name__, error)


def completions_folder(output_dir: str) -> str:
    """``output_dir/completions``, made if need be: where the tables are written (TRL makes it with the trainer)."""
    folder = os.path.join(output_dir, "completions")
    os.makedirs(folder, exist_ok=True)
    return folder


def completions_table(logged: dict, step: int) -> dict[str, list]:
    """TRL's columns: step, prompt, completion, then (where logged) each reward function's reward, the reward
    functions' own columns (None where a row has no value) and the advantage."""
    count = len(logged["prompt"])
    table = {"step": [step] * count, "prompt": list(logged["prompt"]), "completion": list(logged["completion"])}
    for name, values in logged.get("rewards", {}).items():
        table[name] = list(values)
    for column, values in logged.get("extra", {}).items():  # a column first logged later lacks the older rows
        table[column] = [None] * (count - len(values)) + list(values)
    if "advantages" in logged:
        table["advantage"] = list(logged["advantages"])
    return table


def publish_completions(logged: dict, step: int, args, write_file: bool = True) -> None:
    """At a log, on the main process: the table printed (``num_completions_to_print`` rows, unique prompts as
    ``log_unique_prompts`` asks), written to ``output_dir/completions/completions_{step:05d}.parquet``
    (``write_file``: TRL's GRPO and distillation write it, its RLOO does not), and logged as ``completions`` to W&B
    (with ``report_to`` naming it and a run started) and trackio (with ``report_to`` naming it)."""
    import pandas as pd

    print_completions(logged, step, args.num_completions_to_print)
    frame = pd.DataFrame(completions_table(logged, step))
    if write_file:
        _write_parquet(frame, os.path.join(completions_folder(args.output_dir), f"completions_{step:05d}.parquet"))
    backends = []
    if args.report_to and "wandb" in args.report_to:
        import wandb

        if wandb.run is not None:
            backends.append(wandb)
    if args.report_to and "trackio" in args.report_to:
        import trackio

        backends.append(trackio)
    if getattr(args, "log_unique_prompts", False):  # prompts may be conversations (lists of messages): by their text
        frame = frame[~frame["prompt"].astype(str).duplicated()]
    for backend in backends:
        backend.log({"completions": backend.Table(dataframe=frame)})


def print_completions(logged: dict, step: int, limit: int | None) -> None:
    """TRL's printout of the latest completions: ``limit`` rows drawn at random (all when None or as many; nothing
    when 0 or less), the prompt, the completion, each reward, the advantage (where logged), then the reward functions'
    own columns; rich's table when rich is installed, plain text otherwise."""
    count = len(logged["prompt"])
    if limit is not None and limit <= 0:
        return
    indices = list(range(count)) if limit is None or limit >= count else random.sample(range(count), limit)
    names = list(logged.get("rewards", {}))
    extra = list(logged.get("extra", {}))
    advantages = logged.get("advantages")
    rows = []
    for index in indices:
        prompt, completion = logged["prompt"][index], logged["completion"][index]
        prompt_text = prompt if isinstance(prompt, str) else "\n".join(f"{m['role']}: {m['content']}" for m in prompt)
        completion_text = completion if isinstance(completion, str) else completion[-1]["content"]
        values = [f"{logged['rewards'][n][index]:.2f}" for n in names]
        advantage = [] if advantages is None else [f"{advantages[index]:.2f}"]
        extras = [_entry(logged["extra"][c], index, count) for c in extra]
        rows.append([prompt_text, completion_text, *values, *advantage, *extras])
    header = ["Prompt", "Completion", *names, *([] if advantages is None else ["Advantage"]), *extra]
    try:
        from rich.console import Console
        from rich.table import Table
    except ImportError:
        print(f"Step {step}")
        print(" | ".join(header))
        for row in rows:
            print(" | ".join(row))
        return
    table = Table(*header, title=f"Step {step}", show_lines=True)
    for row in rows:
        table.add_row(*row)
    Console().print(table)


def _write_parquet(frame, path: str) -> None:
    """The table as parquet; a column whose values parquet cannot hold as one type (a reward function's own column
    mixing numbers and text, say) is written as their text."""
    import pandas as pd
    import pyarrow

    try:
        frame.to_parquet(path)
    except (pyarrow.ArrowInvalid, pyarrow.ArrowNotImplementedError, pyarrow.ArrowTypeError):
        mixed = {column: frame[column].map(lambda v: None if pd.api.types.is_scalar(v) and pd.isna(v) else str(v))
                 for column in frame.columns if frame[column].dtype == object and column not in ("prompt", "completion")}
        frame.assign(**mixed).to_parquet(path)


def _entry(values, index: int, count: int) -> str:
    """Row ``index`` of a reward function's own column, which lacks the rows logged before it first appeared."""
    offset = count - len(values)
    return str(values[index - offset]) if index >= offset else ""
