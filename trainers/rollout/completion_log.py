"""TRL's completions table for the online RL trainers (``log_completions``): the latest prompts, completions, rewards
and advantages of every data-parallel rank, the reward functions' own columns (``log_extra``) and metrics
(``log_metric``), and the table printed at each log."""

from __future__ import annotations

from collections import deque


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

    def print(self, step: int, limit: int | None, unique_prompts: bool = False) -> None:
        print_completions(self.logged, step, limit, unique_prompts)


def print_completions(logged: dict, step: int, limit: int | None, unique_prompts: bool = False) -> None:
    """The latest prompts, completions, rewards and advantages as a table (rich's when installed)."""
    names = list(logged["rewards"])
    extra = list(logged["extra"])
    rows = []
    seen = set()
    for index, (prompt, completion) in enumerate(zip(logged["prompt"], logged["completion"])):
        if unique_prompts and str(prompt) in seen:
            continue
        seen.add(str(prompt))
        prompt_text = prompt if isinstance(prompt, str) else "\n".join(f"{m['role']}: {m['content']}" for m in prompt)
        completion_text = completion if isinstance(completion, str) else completion[-1]["content"]
        values = [f"{logged['rewards'][n][index]:.2f}" for n in names]
        extras = [str(logged["extra"][c][index]) if index < len(logged["extra"][c]) else "" for c in extra]
        rows.append([prompt_text, completion_text, *values, *extras, f"{logged['advantages'][index]:.2f}"])
    if limit is not None:
        rows = rows[:limit]
    header = ["Prompt", "Completion", *names, *extra, "Advantage"]
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
