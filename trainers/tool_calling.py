"""Multi-turn, tool-using rollouts: TRL's ``tools``, ``environment_factory`` and ``max_tool_calling_iterations``.

A rollout with tools runs in turns. The prompts are rendered with the tools' schemas; each completion is parsed
into an assistant message (transformers' ``parse_response`` with a response template for the chat template); each
tool call in it runs — only the callables the user passed, or the public methods of the row's environment, are
ever called; nothing from the dataset or the model's text is executed — and its result is appended as a ``tool``
message. The tokens the chat template renders for those messages (up to the next assistant header) are appended
to the row's prompt + completion tokens and generation continues from there, until no row calls a tool,
``max_tool_calling_iterations`` turns have run, or the results would push a completion past
``max_completion_length`` (that row then stops with the completion it has). A row's completion is everything after
its prompt: the model's tokens (tool mask 1) and the rendered tool results (tool mask 0: attended to, never trained
on), as TRL builds it.

Faults: an exception in a tool, an unknown tool name or an unsupported call type becomes the result
``{"error": "..."}`` (TRL's), counted in ``tools/failure_frequency``, and the episode goes on. With
``tool_call_timeout`` (seconds; hfnative's own setting, off by default so the numbers stay TRL's) a call that runs
longer gets the result ``{"error": "Tool <name> timed out after <t> seconds"}`` and counts as a failure. An async
tool is then cancelled. A synchronous tool cannot be stopped from outside its thread: with a timeout it runs in a
daemon thread of its own, which is abandoned when the time is up — it keeps running until it returns and its
result is discarded, so a tool that may hang should poll a deadline itself or be written as a coroutine.
"""

from __future__ import annotations

import asyncio
import copy
import inspect
import threading
from dataclasses import dataclass, field

from hfnative.data.chat_templates import multi_turn_chat_template, training_template_name

from .rewards import BackgroundLoop
from .prompts import tokenize_prompts

# --- parsing completions into messages ---------------------------------------------------------------------------

# transformers' response templates (the format ``tokenizer.parse_response`` reads) for the tool-calling formats of the
# chat templates hfnative recognises: Qwen's JSON inside <tool_call> tags (after an optional think block), and Llama
# 3.1 / 3.2's bare JSON object with "parameters" for its arguments
_QWEN_TOOL_CALLS = {
    "defaults": {"role": "assistant"},
    "start_anchor": "<|im_start|>assistant\n",
    "fields": {
        "reasoning_content": {"open": "<think>", "close_pattern": r"</think>\s*", "content": "text"},
        "tool_calls": {
            "open": "<tool_call>",
            "close_pattern": r"</tool_call>\s*",
            "repeats": True,
            "content": "json",
            "transform": {"type": "function", "function": "{content}"},
        },
        "content": {"close_pattern": r"<\|im_end\|>\s*", "content": "text"},
    },
}
_LLAMA3_TOOL_CALLS = {
    "defaults": {"role": "assistant"},
    "start_anchor": "<|start_header_id|>assistant<|end_header_id|>\n\n",
    "fields": {
        "tool_calls": {
            "open_pattern": r'\{"name":\s*"(?P<name>[^"]+)",\s*"parameters":\s*',
            "close_pattern": r"\}<\|eot_id\|>\s*",
            "repeats": True,
            "content": "json",
            "transform": {"type": "function", "function": {"name": "{name}", "arguments": "{content}"}},
        },
        "content": {"close_pattern": r"<\|eot_id\|>\s*", "content": "text"},
    },
}
RESPONSE_TEMPLATES = {
    "Qwen3": _QWEN_TOOL_CALLS, "Qwen3-Instruct-2507": _QWEN_TOOL_CALLS, "Qwen2.5": _QWEN_TOOL_CALLS,
    "Llama 3.1": _LLAMA3_TOOL_CALLS, "Llama 3.2": _LLAMA3_TOOL_CALLS,
}


def _tokenizer_of(processing_class):
    return getattr(processing_class, "tokenizer", processing_class)


def add_response_parser(processing_class) -> None:
    """Give the tokenizer a response template for parsing tool calls when it has none (TRL's add_response_schema
    for the templates hfnative recognises: Qwen2.5, Qwen3, Llama 3.1 / 3.2); a tokenizer that has one keeps it."""
    tokenizer = _tokenizer_of(processing_class)
    if getattr(tokenizer, "response_template", None) is not None:
        return
    template = RESPONSE_TEMPLATES.get(training_template_name(processing_class) or "")
    if template is None:
        raise ValueError(
            "tools: the chat template is not one whose tool-call format hfnative knows (Qwen2.5, Qwen3, Llama 3.1, "
            "Llama 3.2), so the model's tool calls cannot be parsed: set `tokenizer.response_template` (see "
            "transformers' response-parsing docs) before building the trainer"
        )
    tokenizer.response_template = copy.deepcopy(template)


def _normalize_tool_calls(tool_calls) -> None:
    """TRL's checks of parsed tool calls: a list of dicts, each with a string name; missing arguments become {}."""
    if not isinstance(tool_calls, list):
        raise ValueError("tool_calls must be a list")
    for index, call in enumerate(tool_calls):
        if not isinstance(call, dict):
            raise ValueError(f"tool_calls[{index}] must be a dict")
        target = call.get("function", call)
        if not isinstance(target, dict) or not isinstance(target.get("name"), str):
            raise ValueError(f"tool_calls[{index}] has no string name")
        if target.get("arguments") is None:
            target["arguments"] = {}


def parse_completion(processing_class, ids: list[int], prefix: list[int], tools=None) -> dict:
    """One completion as an assistant message (``content``, and ``tool_calls`` when it made any), parsed after the
    tokens ``prefix`` that came before it, its arguments typed by the ``tools``' schemas; a completion that does not
    parse (a malformed call, a cut-off reply) is its decoded text, as TRL's parse_response falls back."""
    tokenizer = _tokenizer_of(processing_class)
    try:
        message = tokenizer.parse_response(ids, prefix=prefix, tools=tools or None)
        if message is None:
            raise ValueError("nothing parsed")
        content = message.get("content")
        if isinstance(content, str) and tokenizer.eos_token:
            message["content"] = content.removesuffix(tokenizer.eos_token)
        if not message.get("content"):
            message["content"] = ""
        if "tool_calls" in message:
            _normalize_tool_calls(message["tool_calls"])
    except (ValueError, TypeError):
        message = {"role": "assistant", "content": tokenizer.decode(ids, skip_special_tokens=True)}
    return message


# --- the chat template --------------------------------------------------------------------------------------------

_SENTINELS = ("tool_name_5e1f", "tool_arg_key_9c2d", "tool_arg_value_77ab", "tool_result_03fe")


def check_tool_calling_template(processing_class) -> None:
    """Refuse a chat template that cannot render a whole tool exchange (user, assistant with a tool call, tool):
    one that raises on it, or drops the call's name or arguments or the tool's result (TRL's check)."""
    from jinja2 import TemplateError

    name, key, value, result = _SENTINELS
    messages = [{"role": "user", "content": "hi"},
                {"role": "assistant", "content": "", "tool_calls": [
                    {"type": "function", "function": {"name": name, "arguments": {key: value}}}]},
                {"role": "tool", "name": name, "content": result}]
    text = None
    if getattr(processing_class, "chat_template", None) is not None:
        try:
            text = processing_class.apply_chat_template(messages, tokenize=False)
        except (TemplateError, TypeError):
            text = None
    if text is None or not all(sentinel in text for sentinel in _SENTINELS):
        raise ValueError(
            "The provided chat template does not support tool calling. The template must be able to render a "
            "full tool-calling conversation (user -> assistant with tool_calls -> tool)."
        )


def _dummy_exchange(name: str) -> list[dict]:
    return [{"role": "user", "content": "dummy"},
            {"role": "assistant", "content": "", "tool_calls": [{"type": "function", "function": {"name": name, "arguments": {}}}]}]


def turns_chat_template(processing_class) -> str | None:
    """The template multi-turn rollouts render with: None (the tokenizer's own) when rendering a tool result after
    an assistant turn leaves that turn's tokens as they were, else hfnative's multi-turn version of a known
    template; any other template is refused (the tokens of a continued rollout would not be the ones trained on)."""
    before = _render_ids(processing_class, _dummy_exchange("dummy"), None, {}, generation_prompt=False)
    after = _render_ids(processing_class, _dummy_exchange("dummy") + [{"role": "tool", "name": "dummy", "content": "dummy"}],
                        None, {}, generation_prompt=True)
    if after[: len(before)] == before:
        return None
    template = multi_turn_chat_template(processing_class)
    if template is None:
        raise ValueError(
            "tools: the chat template re-renders an assistant turn once a tool result follows it, and hfnative has no "
            "multi-turn version of it (it has one for Qwen3): give the tokenizer a template whose rendering of a "
            "conversation is a prefix of the rendering of its continuations"
        )
    return template


def _render_ids(processing_class, messages, chat_template, chat_template_kwargs, generation_prompt: bool) -> list[int]:
    ids = processing_class.apply_chat_template(messages, tokenize=True, return_dict=False, chat_template=chat_template,
                                               add_generation_prompt=generation_prompt, **chat_template_kwargs)
    return list(ids[0] if ids and isinstance(ids[0], list) else ids)


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


def _public_methods(instance) -> list:
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
            self.methods_of[name] = _public_methods(instance)
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


# --- the multi-turn rollout -----------------------------------------------------------------------------------------


@dataclass
class Episode:
    """One generation batch's tool-calling state: each row's prompt (after its environment's reset), the tools its
    prompt shows, the callables its calls may run and its environment."""

    prompts: list
    tools: list[list]  # per row: the schemas' callables (rendered into the prompt, used to type parsed arguments)
    environments: list | None = None

    def reward_kwargs(self) -> dict:
        return {} if self.environments is None else {"environments": self.environments}


@dataclass
class Turns:
    """A multi-turn rollout's result, per row: the completion tokens (model and tool tokens), their sampling
    log-probs (0 on tool tokens), the tool mask (1 on the model's tokens), the messages, and the batch's counts."""

    completion_ids: list[list[int]]
    logprobs: list[list[float]]
    tool_mask: list[list[int]]
    completions: list[list[dict]]
    calls: int = 0
    failures: int = 0
    metrics: dict = field(default_factory=dict)


class ToolCalling:
    """A trainer's tool-calling rollouts (see the module docstring). ``tools``: callables (sync or async);
    ``environment_factory``: see ``Environments``; ``max_iterations``: tool turns per rollout (None: no limit);
    ``timeout``: seconds per call (None: no limit); ``max_completion_length``: the completion budget;
    ``max_model_len``: the longest sequence the model takes (None: no limit)."""

    def __init__(self, processing_class, tools=None, environment_factory=None, *, max_iterations: int | None = None,
                 timeout: float | None = None, chat_template_kwargs: dict | None = None, max_completion_length: int,
                 max_model_len: int | None = None):
        tools = list(tools or [])
        for tool in tools:
            if not callable(tool) or not hasattr(tool, "__name__"):
                raise ValueError(f"tools: {tool!r} is not a named callable (a function or a bound method)")
        if max_iterations is not None and (not isinstance(max_iterations, int) or max_iterations < 0):
            raise ValueError(f"max_tool_calling_iterations={max_iterations!r}: expected an int >= 0, or None (no limit)")
        self.processing_class = processing_class
        self.tokenizer = _tokenizer_of(processing_class)
        self.standalone = tools
        self.environments = None if environment_factory is None else Environments(environment_factory)
        every = list(tools)
        if self.environments is not None:
            for methods in self.environments.methods_of.values():
                every += [m for m in methods if m.__name__ not in {t.__name__ for t in every}]
        self.tools = every  # every tool a prompt may show: whether the rollout calls tools at all
        self.max_iterations = max_iterations
        self.runner = ToolRunner(timeout)
        self.chat_template_kwargs = dict(chat_template_kwargs or {})
        self.max_completion_length = max_completion_length
        self.max_model_len = max_model_len
        self.chat_template = None
        self._exchange_ids: dict[str, list[int]] = {}  # a tool's dummy exchange, EOS-trimmed (_suffix_ids)
        if self.tools:
            check_tool_calling_template(processing_class)
            add_response_parser(processing_class)
            self.chat_template = turns_chat_template(processing_class)

    @property
    def calls_tools(self) -> bool:
        return bool(self.tools)

    def reward_functions(self) -> list:
        return [] if self.environments is None else self.environments.reward_functions()

    # --- a generation batch -------------------------------------------------------------------------------------
    def start(self, rows: list[dict], prompts: list) -> Episode:
        """The batch's episode: each row's environment drawn and reset (its prompt extended by what reset returns)."""
        if self.environments is None:
            return Episode(prompts=list(prompts), tools=[self.standalone] * len(rows))
        names = self.environments.names_of(rows)
        instances = self.environments.take(names)
        prompts = self.environments.reset(instances, rows, prompts)
        tools = [self.standalone + _public_methods(instance) for instance in instances]
        return Episode(prompts=prompts, tools=tools, environments=instances)

    def tokenize(self, episode: Episode) -> list[list[int]]:
        """The prompts rendered with their tools' schemas and the generation prompt."""
        if not all(isinstance(p, list) and p and isinstance(p[0], dict) for p in episode.prompts):
            raise ValueError("tools / environment_factory need conversational prompts (lists of {'role', 'content'} "
                             "messages): a text prompt has no chat template to render the tools and their results with")
        if self.environments is None:  # every row shows the same tools
            return tokenize_prompts(self.processing_class, episode.prompts, self.chat_template_kwargs,
                                    tools=self.standalone, chat_template=self.chat_template)
        return [tokenize_prompts(self.processing_class, [prompt], self.chat_template_kwargs, tools=tools,
                                 chat_template=self.chat_template)[0] for prompt, tools in zip(episode.prompts, episode.tools)]

    def run(self, episode: Episode, prompt_ids: list[list[int]], completion_ids: list[list[int]],
            logprobs: list[list[float]], generate) -> Turns:
        """The first completions parsed, and the rollout's later turns: ``generate(prompt_ids, rows, turn)``
        continues the given rows (their indices in the batch) from the given tokens and returns hfnative Rollouts.
        Only for a rollout that calls tools (``calls_tools``)."""
        completion_ids = [list(ids) for ids in completion_ids]
        logprobs = [list(values) for values in logprobs]
        completions = [[self._parse(ids, prompt_ids[i], episode.tools[i])] for i, ids in enumerate(completion_ids)]
        tool_mask = [[1] * len(ids) for ids in completion_ids]
        turns = Turns(completion_ids, logprobs, tool_mask, completions)
        active = [i for i, c in enumerate(completions) if c[-1].get("tool_calls")]
        iteration = 0
        while active and (self.max_iterations is None or iteration < self.max_iterations):
            continued, continued_ids = [], []
            outcomes = self.runner.run_rows([(completions[i][-1]["tool_calls"], episode.tools[i]) for i in active])
            for i, (results, failed) in zip(active, outcomes):
                turns.calls += len(completions[i][-1]["tool_calls"])
                turns.failures += failed
                messages = [{"role": "tool", "name": name, "content": result if isinstance(result, list) else str(result)}
                            for name, result in results]
                ids = prompt_ids[i] + completion_ids[i] + self._suffix_ids(messages)
                # results that would push the completion past its budget (or the sequence past the model's length)
                # are dropped: the row stops with the completion it has
                if len(ids) - len(prompt_ids[i]) > self.max_completion_length or (
                        self.max_model_len is not None and len(ids) >= self.max_model_len):
                    continue
                completions[i] += messages
                continued.append(i)
                continued_ids.append(ids)
            if not continued:
                break
            rollouts = generate(continued_ids, continued, iteration + 1)
            next_active = []
            for i, ids, new_ids, new_logprobs in zip(continued, continued_ids, rollouts.completion_ids, rollouts.logprobs):
                tool_length = len(ids) - len(prompt_ids[i]) - len(completion_ids[i])
                room = self.max_completion_length - (len(ids) - len(prompt_ids[i]))
                new_ids, new_logprobs = list(new_ids)[:room], list(new_logprobs)[:room]
                tool_mask[i] += [0] * tool_length + [1] * len(new_ids)
                logprobs[i] += [0.0] * tool_length + new_logprobs
                completion_ids[i] = ids[len(prompt_ids[i]):] + new_ids
                if new_ids:
                    message = self._parse(new_ids, ids, episode.tools[i])
                    completions[i].append(message)
                    if message.get("tool_calls"):
                        next_active.append(i)
            active = next_active
            iteration += 1
        return turns

    def _parse(self, ids: list[int], prefix: list[int], tools: list) -> dict:
        return parse_completion(self.processing_class, ids, prefix, tools)

    def _suffix_ids(self, tool_messages: list[dict]) -> list[int]:
        """The tokens the chat template renders for ``tool_messages`` after an assistant turn that ended on its
        end-of-turn token, up to and including the next assistant header (TRL's: the difference between a dummy
        exchange rendered with and without them, the shorter cut after its last EOS)."""
        name = tool_messages[0]["name"]
        exchange = _dummy_exchange(name)
        before = self._exchange_ids.get(name)
        if before is None:  # the same for every call of a tool: rendered once
            before = _render_ids(self.processing_class, exchange, self.chat_template, self.chat_template_kwargs, False)
            ends = [index for index, token in enumerate(before) if token == self.tokenizer.eos_token_id]
            before = self._exchange_ids[name] = before[: ends[-1] + 1] if ends else before
        after = _render_ids(self.processing_class, exchange + tool_messages, self.chat_template,
                            self.chat_template_kwargs, True)
        if after[: len(before)] != before:
            raise ValueError("Unexpected tokenization: the EOS-trimmed prefix IDs are not a prefix of the full IDs.")
        return after[len(before):]


def tool_calling_for(context, tools=None, environment_factory=None) -> ToolCalling | None:
    """A trainer's ToolCalling from its config (max_tool_calling_iterations, tool_call_timeout, chat_template_kwargs,
    max_completion_length) and the policy's length limit; None without tools or environments, where the two tool
    settings are refused (a setting that would do nothing)."""
    from .construction import config_dict

    args = context.args
    if not tools and environment_factory is None:
        for name in ("max_tool_calling_iterations", "tool_call_timeout"):
            if getattr(args, name, None) is not None:
                raise ValueError(f"{name}={getattr(args, name)!r} has no effect without tools or environment_factory: "
                                 "pass tools to the trainer, or leave it at None")
        return None
    return ToolCalling(
        context.processing_class, tools, environment_factory, max_iterations=args.max_tool_calling_iterations,
        timeout=getattr(args, "tool_call_timeout", None), chat_template_kwargs=config_dict(args.chat_template_kwargs),
        max_completion_length=args.max_completion_length,
        max_model_len=getattr(getattr(context.model, "config", None), "max_position_embeddings", None))


def tool_metrics(calls, failures, completions, sum_over_ranks) -> dict:
    """TRL's tools/call_frequency (calls per completion) and tools/failure_frequency (failed calls per call, 0 when
    there were none), over every data-parallel rank: ``sum_over_ranks`` sums a float64 tensor over them."""
    import torch

    totals = sum_over_ranks(torch.tensor([float(calls), float(failures), float(completions)], dtype=torch.float64))
    calls, failures, completions = (float(v) for v in totals)
    return {"tools/call_frequency": calls / completions,
            "tools/failure_frequency": failures / calls if calls > 0 else 0.0}


class ToolEpisodes:
    """A tool-calling rollout as one call on a rollout engine: ``(engine, prompt_ids, sampling, rows) -> dict`` (the
    generator actors' ``episodes`` of hfnative.rl; picklable, environments included). With environments, each
    completion's environment is drawn from the pool and reset with its row (``rows``: the micro-batch's dataset rows,
    each prompt's ``num_generations`` completions consecutive), the prompts tokenized again after reset, and each
    environment class's ``get_reward()`` scored here, where the episode ran, at its end. The first turn samples with
    ``sampling``, later turns with ``SamplingParams.for_turn``. Returns completion_ids, logprobs (0 on tool tokens),
    finish_reason, tool_mask, the completions as messages, the tool calls and failures of the batch, and with
    environments the prompt_ids after reset and ``episode_rewards`` ({environment class name: one value or None per
    completion})."""

    def __init__(self, tool_calling: ToolCalling):
        self.tool_calling = copy.copy(tool_calling)
        self.tool_calling.runner = copy.copy(tool_calling.runner)
        self.tool_calling.runner.concurrent_rows = True  # the actor's turns call every row's tools at once

    def __call__(self, engine, prompt_ids: list[list[int]], sampling, rows: list[dict] | None = None) -> dict:
        tools = self.tool_calling
        out = {}
        if tools.environments is not None:
            repeats = len(prompt_ids) // len(rows)
            rows = [row for row in rows for _ in range(repeats)]
            episode = tools.start(rows, [row.get("prompt", [{"role": "user", "content": ""}]) for row in rows])
            prompt_ids = out["prompt_ids"] = tools.tokenize(episode)
        else:
            episode = Episode(prompts=[], tools=[tools.tools] * len(prompt_ids))
        first = engine.generate(prompt_ids, sampling)
        turns = tools.run(episode, prompt_ids, first.completion_ids, first.logprobs,
                          lambda ids, batch_rows, turn: engine.generate(ids, sampling.for_turn(turn, batch_rows)))
        if episode.environments is not None:
            out["episode_rewards"] = {function.__name__: _call(function, environments=episode.environments)
                                      for function in tools.reward_functions()}
        stops = set(sampling.stop_ids)
        return {**out, "completion_ids": turns.completion_ids, "logprobs": turns.logprobs,
                "finish_reason": ["stop" if ids and ids[-1] in stops else "length" for ids in turns.completion_ids],
                "tool_mask": turns.tool_mask, "messages": turns.completions, "tool_calls": turns.calls,
                "tool_failures": turns.failures}


def _call(function, **kwargs):
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
