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

import copy
from dataclasses import dataclass, field

from .prompts import tokenize_prompts
from .tool_parsing import (
    add_response_parser,
    check_tool_calling_template,
    dummy_exchange,
    parse_completion,
    render_ids,
    tokenizer_of,
    turns_chat_template,
)
from .tool_runner import Environments, EpisodeReward, ToolRunner, call_to_completion, public_methods

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
        self.tokenizer = tokenizer_of(processing_class)
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
        tools = [self.standalone + public_methods(instance) for instance in instances]
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
        exchange = dummy_exchange(name)
        before = self._exchange_ids.get(name)
        if before is None:  # the same for every call of a tool: rendered once
            before = render_ids(self.processing_class, exchange, self.chat_template, self.chat_template_kwargs, False)
            ends = [index for index, token in enumerate(before) if token == self.tokenizer.eos_token_id]
            before = self._exchange_ids[name] = before[: ends[-1] + 1] if ends else before
        after = render_ids(self.processing_class, exchange + tool_messages, self.chat_template,
                            self.chat_template_kwargs, True)
        if after[: len(before)] != before:
            raise ValueError("Unexpected tokenization: the EOS-trimmed prefix IDs are not a prefix of the full IDs.")
        return after[len(before):]


def tool_calling_for(context, tools=None, environment_factory=None) -> ToolCalling | None:
    """A trainer's ToolCalling from its config (max_tool_calling_iterations, tool_call_timeout, chat_template_kwargs,
    max_completion_length) and the policy's length limit; None without tools or environments, where the two tool
    settings are refused (a setting that would do nothing)."""
    from ..running.construction import config_dict

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
            out["episode_rewards"] = {function.__name__: call_to_completion(function, environments=episode.environments)
                                      for function in tools.reward_functions()}
        stops = set(sampling.stop_ids)
        return {**out, "completion_ids": turns.completion_ids, "logprobs": turns.logprobs,
                "finish_reason": ["stop" if ids and ids[-1] in stops else "length" for ids in turns.completion_ids],
                "tool_mask": turns.tool_mask, "messages": turns.completions, "tool_calls": turns.calls,
                "tool_failures": turns.failures}


__all__ = ["Episode", "EpisodeReward", "ToolCalling", "ToolEpisodes", "Turns", "tool_calling_for", "tool_metrics"]
