"""Running the tools of a tool-calling rollout (trainers/rollout/tool_calling.py): only the callables the user passed, or the
public methods of a row's environment, are ever called; nothing from the dataset or the model's text is executed. A
fault becomes the result ``{"error": "..."}`` (TRL's) and the episode goes on; ``tool_call_timeout`` bounds a call
(see trainers/rollout/tool_calling.py's docstring for what a timeout can and cannot stop). Environments: TRL's
``environment_factory``, a pool of instances drawn and reset per row, whose ``get_reward`` scores the episode."""

from __future__ import annotations

import asyncio
import inspect
import threading

from .rewards import BackgroundLoop

# --- running tools --------------------------------------------------------------------------------------------------


_LOOP_LOCK = threading.Lock()


def _run_with_timeout(function, arguments: dict, timeout: float):
    """``function(**arguments)`` in a daemon thread, waited for ``timeout`` seconds: its result, or TimeoutError (the
    thread is left to finish on its own)."""
    outcome = {}

    def target():
        try:
            outcome["result"] = function(**arguments)
        except BaseException as error:  # noqa: BLE001 - handed to the caller as the tool's error
            outcome["error"] = error

    thread = threading.Thread(target=target, daemon=True, name=f"hfnative-tool-{getattr(function, '__name__', 'tool')}")
    thread.start()
    thread.join(timeout)
    if thread.is_alive():
        raise TimeoutError
    if "error" in outcome:
        raise outcome["error"]
    return outcome["result"]


def public_methods(instance) -> list:
    """An environment's tools: its class's public functions other than reset and get_reward, bound to it (listed on
    the class, so properties are not evaluated)."""
    return [getattr(instance, name) for name, _ in inspect.getmembers(type(instance), predicate=inspect.isfunction)
            if name not in ("reset", "get_reward") and not name.startswith("_")]


class ToolRunner:
    """Runs one turn's tool calls of a row against that row's callables (by ``__name__``), with TRL's error results
    and hfnative's optional per-call timeout."""

    def __init__(self, timeout: float | None = None):
        if timeout is not None and not timeout > 0:
            raise ValueError(f"tool_call_timeout={timeout!r}: expected a number of seconds > 0, or None (no limit)")
        self.timeout = timeout
        self.concurrent_rows = False  # run the rows of a turn at once (threads), as TRL's async worker does
        self._loop = None

    def __getstate__(self):  # a runner travels to the generator actors without its event loop thread
        return {**self.__dict__, "_loop": None}

    def run_rows(self, rows: list[tuple[list[dict], list]]) -> list[tuple[list[tuple[str, object]], int]]:
        """``run`` for each row's (tool calls, callables) of a turn: one after the other (TRL's GRPOTrainer), or at
        once in threads when ``concurrent_rows``, so a turn takes as long as its slowest call rather than their sum."""
        if not self.concurrent_rows or len(rows) < 2:
            return [self.run(calls, callables) for calls, callables in rows]
        from concurrent.futures import ThreadPoolExecutor

        with ThreadPoolExecutor(max_workers=len(rows), thread_name_prefix="hfnative-tool-rows") as pool:
            return list(pool.map(lambda row: self.run(*row), rows))

    def run(self, tool_calls: list[dict], callables: list) -> tuple[list[tuple[str, object]], int]:
        """(name, result) of each call in order, and how many failed."""
        by_name = {function.__name__: function for function in callables}
        results, failures, pending = [None] * len(tool_calls), 0, []
        for index, call in enumerate(tool_calls):
            if call.get("type") != "function":
                results[index] = (call.get("name", "unknown"), {"error": f"Unsupported tool call type: {call.get('type')}"})
                failures += 1
                continue
            name, arguments = call["function"]["name"], call["function"].get("arguments") or {}
            function = by_name.get(name)
            try:
                if function is None:
                    raise ValueError(f"Tool {name} not found.")
                if inspect.iscoroutinefunction(function):
                    pending.append((index, name, function, arguments))
                    continue
                if self.timeout is None:
                    results[index] = (name, function(**arguments))
                else:
                    results[index] = (name, _run_with_timeout(function, arguments, self.timeout))
            except TimeoutError:
                results[index] = (name, {"error": self._timeout_message(name)})
                failures += 1
            except Exception as error:  # noqa: BLE001 - TRL's error result: the episode goes on
                results[index] = (name, {"error": str(error)})
                failures += 1
        if pending:
            with _LOOP_LOCK:  # the rows of a turn may run at once
                self._loop = self._loop or BackgroundLoop()
            outcomes = self._loop.run(self._gather([(function, arguments) for _, _, function, arguments in pending]))
            for (index, name, _, _), outcome in zip(pending, outcomes):
                if isinstance(outcome, asyncio.TimeoutError):
                    results[index] = (name, {"error": self._timeout_message(name)})
                    failures += 1
                elif isinstance(outcome, BaseException):
                    results[index] = (name, {"error": str(outcome)})
                    failures += 1
                else:
                    results[index] = (name, outcome)
        return results, failures

    async def _gather(self, calls):
        coroutines = [function(**arguments) for function, arguments in calls]
        if self.timeout is not None:
            coroutines = [asyncio.wait_for(coroutine, self.timeout) for coroutine in coroutines]
        return await asyncio.gather(*coroutines, return_exceptions=True)

    def _timeout_message(self, name: str) -> str:
        return f"Tool {name} timed out after {self.timeout:g} seconds"


# --- environments ---------------------------------------------------------------------------------------------------


class Environments:
    """TRL's ``environment_factory``: a callable making one environment (every row uses it), or a dict naming
    several (each row picks one by its ``environment`` column). An environment defines ``reset(**row)`` (returning
    text appended to the prompt's last message, or None) and public methods, which are the row's tools; an optional
    ``get_reward()`` scores the episode (one reward column per environment class that has it). Instances are made
    once and reused across batches (reset before each episode); a batch that needs more of one than exist makes more.
    """

    def __init__(self, environment_factory):
        self.multiple = isinstance(environment_factory, dict)
        self.factories = dict(environment_factory) if self.multiple else {None: environment_factory}
        self.methods_of: dict = {}  # environment name -> the probe instance's tool methods' names
        self.pool: dict = {}
        self.reward_classes: list[type] = []
        for name, factory in self.factories.items():
            instance = factory()
            functions = dict(inspect.getmembers(type(instance), predicate=inspect.isfunction))
            if "reset" not in functions:
                raise ValueError("Each environment instance returned by `environment_factory` must define a callable `reset`.")
            self.methods_of[name] = public_methods(instance)
            self.pool[name] = [instance]
            if "get_reward" in functions and type(instance) not in self.reward_classes:
                self.reward_classes.append(type(instance))

    def reward_functions(self) -> list:
        """One reward function per environment class with ``get_reward`` (named after the class, weight 1): the
        episode's reward for rows of that class, None (no opinion) for the others; async when get_reward is."""
        functions = []
        for cls in self.reward_classes:
            if inspect.iscoroutinefunction(cls.get_reward):
                async def reward(environments, _cls=cls, **kwargs):
                    return [await env.get_reward() if type(env) is _cls else None for env in environments]
            else:
                def reward(environments, _cls=cls, **kwargs):
                    return [env.get_reward() if type(env) is _cls else None for env in environments]
            reward.__name__ = cls.__name__
            functions.append(reward)
        return functions

    def names_of(self, rows: list[dict]) -> list:
        if not self.multiple:
            return [None] * len(rows)
        names = [row.get("environment") for row in rows]
        for name in dict.fromkeys(names):
            if name not in self.factories:
                raise ValueError(f"Example has `environment={name!r}`, which is not among the environments passed to "
                                 f"`environment_factory`. Expected one of: {list(self.factories)}.")
        return names

    def take(self, names: list) -> list:
        """One instance per row, drawn from the pool (more made when the batch needs more)."""
        used: dict = {}
        instances = []
        for name in names:
            pool, index = self.pool[name], used.get(name, 0)
            if index == len(pool):
                pool.append(self.factories[name]())
            used[name] = index + 1
            instances.append(pool[index])
        return instances

    def reset(self, instances: list, rows: list[dict], prompts: list) -> list:
        """Reset each row's environment with the row's columns (without ``environment`` when several are named);
        the text it returns is appended to the content of the prompt's last message (the row is left as it was)."""
        prompts = list(prompts)
        for index, (instance, row) in enumerate(zip(instances, rows)):
            arguments = {k: v for k, v in row.items() if k != "environment"} if self.multiple else dict(row)
            observation = instance.reset(**arguments)
            if observation is None:
                continue
            prompt = prompts[index]
            content = prompt[-1]["content"]
            if isinstance(observation, list) and isinstance(content, str):
                content = [{"type": "text", "text": content}]
            if isinstance(observation, str) and isinstance(content, list):
                observation = [{"type": "text", "text": observation}]
            prompts[index] = prompt[:-1] + [{**prompt[-1], "content": content + observation}]
        return prompts


def call_to_completion(function, **kwargs):
    """A function's result, run to completion when it is a coroutine function."""
    if inspect.iscoroutinefunction(function):
        return asyncio.run(function(**kwargs))
    return function(**kwargs)


class EpisodeReward:
    """An environment class's ``get_reward`` column in a reward actor that did not run the episodes: the values the
    generator actor scored (``ToolEpisodes``' episode_rewards), set on it before each scoring call (``values``)."""

    def __init__(self, name: str):
        self.__name__ = name
        self.values: list | None = None

    def __call__(self, **kwargs) -> list:
        if self.values is None:
            raise RuntimeError(f"{self.__name__}: no episode rewards were shipped with this micro-batch")
        return self.values


__all__ = ["EpisodeReward", "Environments", "ToolRunner", "call_to_completion", "public_methods"]
