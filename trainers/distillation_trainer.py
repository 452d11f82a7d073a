"""Knowledge distillation on the one loop: GKDTrainer (TRL's experimental GKD) and DistillationTrainer (TRL 1.16's
on-policy distillation).

Shapes: B batch, S sequence, D student hidden dim, Dt teacher hidden dim, V vocabulary (shared).

Both losses are the generalized Jensen-Shannon divergence between the student's and the teacher's next-token
distributions over the completion tokens (``hfnative.models.head.GeneralizedJSD``): the teacher runs without a
graph up to its final hidden states [B, S, Dt], and the divergence is computed chunk by chunk through both heads,
so neither model's [B, S, V] logits exist. On-policy completions come from the native rollout engine on the
student's live weights (LoRA included), seeded, so a run is reproducible.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.nn as nn
from torch.distributed.tensor import DTensor

from hfnative.data import pad_token_id_for
from hfnative.data.collate import pad_right
from hfnative.generation import NativeRolloutEngine, SamplingParams
from hfnative.losses import IGNORE_INDEX
from hfnative.models.decoder import Transformer
from hfnative.models.head import GeneralizedJSD

from .data_loading import make_dataloader
from .distillation_config import DistillationConfig, GKDConfig
from .model_loading import resolve_model
from .objective import LanguageModelingObjective
from .sft_trainer import SFTTrainer, _as_dict, _check_peft_config, _check_train_dataset, _model_name
from .trainer import Trainer, as_hfnative_args, set_seed


# --- data ---------------------------------------------------------------------------------------------


def _prompt_ids(processing_class, prompt, chat_template_kwargs: dict) -> list[int]:
    """A prompt's token ids: a conversation through the chat template (with the generation prompt), text as is."""
    if isinstance(prompt, list):
        rendered = processing_class.apply_chat_template(
            prompt, add_generation_prompt=True, tokenize=True, return_dict=True, **chat_template_kwargs
        )
        return list(rendered["input_ids"])
    return list(processing_class(text=prompt)["input_ids"])


def _tokens_and_offsets(tokenizer, text: str) -> tuple[list[int], list[tuple[int, int]]]:
    encoded = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    return list(encoded["input_ids"]), list(encoded["offset_mapping"])


def _completion_batch(prompts: list[list[int]], completions: list[list[int]], pad_token_id: int) -> dict:
    """Rows prompt + completion, right-padded, labels on the completion tokens only."""
    rows = [torch.tensor(p + c, dtype=torch.long) for p, c in zip(prompts, completions)]
    labels = [torch.tensor([IGNORE_INDEX] * len(p) + c, dtype=torch.long) for p, c in zip(prompts, completions)]
    return {
        "input_ids": pad_right(rows, pad_token_id),
        "attention_mask": pad_right([torch.ones_like(r) for r in rows], 0),
        "labels": pad_right(labels, IGNORE_INDEX),
        "prompt_ids": [list(p) for p in prompts],
    }


@dataclass
class GKDCollator:
    """TRL's DataCollatorForChatML: each conversation rendered by the chat template, the loss on what follows
    its last prompt turn (the final message), the last ``max_length`` tokens kept. Also takes
    prompt-completion rows (text or conversational) and pre-tokenized rows (``input_ids``, optional
    ``completion_mask``). The batch is right-padded and carries each row's prompt ids for generation."""

    processing_class: Any
    pad_token_id: int
    max_length: int | None = None

    def __call__(self, rows: list[dict]) -> dict:
        prompts, completions = [], []
        for index, row in enumerate(rows):
            ids, prompt_length = self._tokenize(row, index)
            if self.max_length is not None and len(ids) > self.max_length:
                prompt_length = max(0, prompt_length - (len(ids) - self.max_length))
                ids = ids[-self.max_length :]
            if prompt_length == 0:
                raise ValueError(
                    f"row {index} has no prompt tokens left after truncation to max_length={self.max_length}: the "
                    "completion alone fills the window, leaving nothing to generate from. Increase `max_length`."
                )
            prompts.append(ids[:prompt_length])
            completions.append(ids[prompt_length:])
        return _completion_batch(prompts, completions, self.pad_token_id)

    def _tokenize(self, row: dict, index: int) -> tuple[list[int], int]:
        """(token ids of prompt + completion, the prompt's length)."""
        tokenizer = getattr(self.processing_class, "tokenizer", self.processing_class)
        if "input_ids" in row:
            ids = list(row["input_ids"])
            mask = row.get("completion_mask")
            if mask is not None:
                return ids, list(mask).index(1) if 1 in mask else len(ids)
            prompt = _prompt_ids(self.processing_class, row["prompt"], {}) if "prompt" in row else ids
            return ids, min(len(prompt), len(ids))
        if "messages" in row:
            prompt_text = tokenizer.apply_chat_template(row["messages"][:-1], add_generation_prompt=True, tokenize=False)
            full_text = tokenizer.apply_chat_template(row["messages"], tokenize=False)
        elif "prompt" in row and "completion" in row:
            if isinstance(row["prompt"], list):
                prompt_text = tokenizer.apply_chat_template(row["prompt"], add_generation_prompt=True, tokenize=False)
                full_text = tokenizer.apply_chat_template(row["prompt"] + row["completion"], tokenize=False)
            else:
                prompt_text, full_text = row["prompt"], row["prompt"] + row["completion"]
        else:
            raise ValueError(
                f"row {index} has columns {sorted(row)}: GKD expects a conversation {{'messages': [...]}}, a "
                "{'prompt': ..., 'completion': ...} pair or pre-tokenized {'input_ids': [...]}"
            )
        ids, offsets = _tokens_and_offsets(tokenizer, full_text)
        # the completion starts at the first token that begins after the prompt's text
        start = next((i for i, (begin, _) in enumerate(offsets) if begin >= len(prompt_text)), len(ids))
        return ids, start


@dataclass
class PromptCollator:
    """DistillationTrainer's batches: each row's "prompt" tokenized (a conversation through the chat template
    with the generation prompt, text as is), right-padded; the completions are generated later."""

    processing_class: Any
    pad_token_id: int
    chat_template_kwargs: dict = field(default_factory=dict)

    def __call__(self, rows: list[dict]) -> dict:
        prompts = []
        for index, row in enumerate(rows):
            if "prompt" not in row:
                raise ValueError(
                    f"row {index} has columns {sorted(row)}: DistillationTrainer needs a 'prompt' column (text or a "
                    "list of messages); the completions are generated by the student"
                )
            prompts.append(_prompt_ids(self.processing_class, row["prompt"], self.chat_template_kwargs))
        tensors = [torch.tensor(p, dtype=torch.long) for p in prompts]
        return {
            "input_ids": pad_right(tensors, self.pad_token_id),
            "attention_mask": pad_right([torch.ones_like(t) for t in tensors], 0),
            "prompt_ids": prompts,
        }


# --- objectives ---------------------------------------------------------------------------------------


class _GatheredHead:
    """The teacher's head as the student's head reads it inside its own loss: the whole [V, Dt] matrix, gathered
    once per call when FSDP shards it (the student's head call unshards only the student's)."""

    def __init__(self, head):
        self.head, self.softcap = head, head.softcap

    def projection(self) -> torch.Tensor:
        weight_VD = self.head.projection()
        return weight_VD.full_tensor() if isinstance(weight_VD, DTensor) else weight_VD


class _DistillationObjective(LanguageModelingObjective):
    """The teacher (an auxiliary model), the generalized JSD through both heads, and seeded generation."""

    beta: float
    loss_temperature: float

    def __init__(self, trainer, teacher):
        super().__init__(trainer)
        self.auxiliary_models["teacher"] = teacher
        if trainer.processing_class is None:
            raise ValueError(f"{type(trainer).__name__} needs a processing_class (tokenizer) or a model folder that has one")
        self.pad_token_id = pad_token_id_for(trainer.processing_class)
        process = trainer.distributed.rank if trainer.distributed is not None else 0
        # one stream per process for the on-policy coin and the sampling seeds: a run with the same seed repeats
        self.rng = random.Random(f"{trainer.args.seed}-{process}")
        self._engines: dict[int, NativeRolloutEngine] = {}

    @property
    def teacher(self):
        return self.auxiliary_models["teacher"]

    # the collator reads the raw rows (the prompt and completion columns), so no column is dropped
    def prepare_train_dataset(self, dataset):
        return dataset

    def prepare_eval_dataset(self, dataset):
        return dataset

    def loss(self, model, inputs, num_items_in_batch):
        out = self.divergence(model, inputs)
        denominator = num_items_in_batch if num_items_in_batch is not None else max(out.num_tokens, 1)
        return out.loss_sum / denominator, self.metrics(inputs, out)

    def divergence(self, model, inputs):
        """DistillationOutput summed over the batch's label tokens (student entropy at the loss temperature)."""
        with torch.no_grad():
            teacher_hidden_BSD = self.teacher(
                inputs["input_ids"], attention_mask=inputs.get("attention_mask"), position_ids=inputs.get("position_ids"),
            ).hidden_states
        teacher_head = _GatheredHead(self.teacher.output)
        spec = GeneralizedJSD(inputs["shift_labels"], teacher_hidden_BSD, teacher_head, self.beta, self.loss_temperature)
        return self.forward(model, inputs, spec).head_output

    def metrics(self, inputs, out) -> dict:
        return {}

    def generate(self, model, prompts: list[list[int]], sampling: dict) -> list[list[int]]:
        """Completions of ``prompts`` sampled from ``model``'s live weights, each cut after its first stop token."""
        if not isinstance(model, Transformer):
            raise ValueError(
                f"on-policy completions need a native model; {type(model).__name__} runs through transformers' "
                "modeling code (set lmbda=0 and seq_kd=False for GKD, or use a natively supported architecture)"
            )
        engine = self._engines.get(id(model))
        if engine is None:
            engine = self._engines[id(model)] = NativeRolloutEngine(model)
        params = SamplingParams(seed=self.rng.randrange(2**63), **sampling)
        with self.trainer._autocast():
            return engine.generate(prompts, params).completion_ids


class GKDObjective(_DistillationObjective):
    """GKD: dataset, student or teacher completions per micro-batch (TRL's coin: on-policy when a uniform draw is
    <= lmbda); the generalized JSD at temperature 1, summed over completion tokens / the step's count. The count is
    taken over the completions trained on (TRL counts the dataset's, before generation replaces them)."""

    loss_temperature = 1.0

    def __init__(self, trainer, teacher):
        super().__init__(trainer, teacher)
        args = trainer.args
        self.beta, self.lmbda, self.seq_kd = args.beta, args.lmbda, args.seq_kd
        eos = getattr(getattr(trainer.model, "generation_config", None), "eos_token_id", None)
        self.sampling = dict(max_new_tokens=args.max_new_tokens, do_sample=True, temperature=args.temperature,
                             top_k=0, top_p=1.0, eos_token_id=eos)

    def default_collator(self):
        trainer = self.trainer
        return GKDCollator(trainer.processing_class, self.pad_token_id, trainer.args.max_length)

    def micro_batches(self, epoch_iterator, count):
        batches = super().micro_batches(epoch_iterator, count)
        return [self.choose_completions(batch) for batch in batches]

    def choose_completions(self, batch: dict) -> dict:
        """The batch with student completions (probability lmbda), else teacher ones (seq_kd), else as given."""
        if self.rng.random() <= self.lmbda:
            model = self.trainer.model
        elif self.seq_kd:
            model = self.teacher
        else:
            return batch
        completions = self.generate(model, batch["prompt_ids"], self.sampling)
        return _completion_batch(batch["prompt_ids"], completions, self.pad_token_id)


class OnPolicyDistillationObjective(_DistillationObjective):
    """TRL's DistillationTrainer: every step's prompts completed by the student in one generation call, the
    generalized JSD with ``beta`` at ``temperature`` over the completion tokens / the step's completion-token
    count; logs entropy, num_tokens and completions/* as TRL does."""

    def __init__(self, trainer, teacher):
        super().__init__(trainer, teacher)
        args = trainer.args
        self.beta, self.loss_temperature = args.beta, args.temperature
        self.sampling = self._sampling(args, trainer)
        self._tokens_seen = torch.zeros((), dtype=torch.float64, device=trainer.device)
        self._pending: dict[str, torch.Tensor] = {}

    @staticmethod
    def _sampling(args, trainer) -> dict:
        tokenizer = trainer._tokenizer()
        eos = getattr(getattr(trainer.model, "generation_config", None), "eos_token_id", None)
        eos = [] if eos is None else [eos] if isinstance(eos, int) else list(eos)
        if tokenizer.eos_token_id is not None and tokenizer.eos_token_id not in eos:
            eos = [tokenizer.eos_token_id, *eos]
        sampling = dict(max_new_tokens=args.max_completion_length, do_sample=True, temperature=args.temperature,
                        top_p=args.top_p, top_k=args.top_k, min_p=args.min_p or 0.0,
                        repetition_penalty=args.repetition_penalty, eos_token_id=eos)
        known = set(SamplingParams.__dataclass_fields__) - {"seed", "stop_ids"}
        for key, value in (_as_dict(args.generation_kwargs)).items():
            if key not in known:
                raise ValueError(
                    f"generation_kwargs[{key!r}] is not a setting of the native generation engine; it takes "
                    f"{', '.join(sorted(known))}"
                )
            sampling[key] = value
        return sampling

    def default_collator(self):
        trainer = self.trainer
        kwargs = _as_dict(trainer.args.chat_template_kwargs)
        return PromptCollator(trainer.processing_class, self.pad_token_id, kwargs)

    def micro_batches(self, epoch_iterator, count):
        batches = super().micro_batches(epoch_iterator, count)
        if not batches:
            return batches
        prompts = [p for batch in batches for p in batch["prompt_ids"]]
        completions = self.completions(prompts, training=True)
        built, start = [], 0
        for batch in batches:
            size = len(batch["prompt_ids"])
            built.append(self.build(prompts[start : start + size], completions[start : start + size]))
            start += size
        return built

    def build(self, prompts: list[list[int]], completions: list[list[int]]) -> dict:
        return _completion_batch(prompts, completions, self.pad_token_id)

    def completions(self, prompts: list[list[int]], training: bool) -> list[list[int]]:
        """The student's completions for one step's (or evaluation batch's) prompts, and their length metrics
        (logged with the next loss); training completions count towards num_tokens."""
        completions = self.generate(self.trainer.model, prompts, self.sampling)
        self.record_lengths(prompts, completions, training)
        return completions

    def record_lengths(self, prompts, completions, training: bool) -> None:
        lengths = torch.tensor([len(c) for c in completions], dtype=torch.float64)
        stops = set(self.sampling["eos_token_id"]) | {self.pad_token_id}
        clipped = torch.tensor([bool(c) and c[-1] not in stops for c in completions])
        terminated = lengths[~clipped] if (~clipped).any() else torch.zeros(1, dtype=torch.float64)
        if training:
            self._tokens_seen += sum(len(p) for p in prompts) + lengths.sum().item()
        self._pending = {
            "completions/mean_length": lengths.mean(), "completions/min_length": lengths.min(),
            "completions/max_length": lengths.max(), "completions/clipped_ratio": clipped.double().mean(),
            "completions/mean_terminated_length": terminated.mean(),
            "completions/min_terminated_length": terminated.min(),
            "completions/max_terminated_length": terminated.max(),
        }

    def metrics(self, inputs, out) -> dict:
        # the completion lengths once per generation; entropy as a ratio of sums over the data-parallel ranks
        metrics = {name: value.to(out.loss_sum.device) for name, value in self._pending.items()}
        self._pending = {}
        metrics["num_tokens"] = self._tokens_seen
        metrics["entropy"] = (out.student_entropy_sum, torch.tensor(float(out.num_tokens)))
        return metrics


# --- trainers -----------------------------------------------------------------------------------------


class _TeacherMixin:
    """Loads the teacher as the trainer loads its auxiliary models (with ``teacher_model_init_kwargs`` when it is
    given by name), and refuses one whose vocabulary differs from the student's."""

    def _build_auxiliary_models(self) -> None:
        source = self.objective.auxiliary_models["teacher"]
        kwargs = _as_dict(self.args.teacher_model_init_kwargs)
        revision = getattr(self.args, "teacher_model_revision", None)
        if revision is not None:
            kwargs.setdefault("revision", revision)
        if kwargs and isinstance(source, (str, Path)):
            self.objective.auxiliary_models["teacher"] = resolve_model(source, self.device, kwargs).converted
        super()._build_auxiliary_models()
        student_vocab, teacher_vocab = self.model.args.vocab_size, self.objective.teacher.args.vocab_size
        if student_vocab != teacher_vocab:
            raise ValueError(
                f"The student model has vocab_size {student_vocab} but the teacher model has vocab_size "
                f"{teacher_vocab}. Distillation compares the teacher's full next-token distribution, which requires a "
                "shared vocabulary: use a teacher with the same tokenizer and vocab_size."
            )

    def _teacher_source(self, teacher_model, args):
        teacher = teacher_model if teacher_model is not None else args.teacher_model_name_or_path
        if teacher is None:
            raise ValueError(
                f"{type(self).__name__} needs a teacher: pass `teacher_model` (a path, Hub id or model) or set "
                "`teacher_model_name_or_path` in the config"
            )
        if args.teacher_model_init_kwargs is not None and not isinstance(teacher, (str, Path)):
            raise ValueError(
                "You passed teacher_model_init_kwargs to the config, but your teacher_model is already instantiated: "
                "drop teacher_model_init_kwargs, or pass the teacher by name."
            )
        return teacher

    def _check_generation_layout(self, generates: bool) -> None:
        if generates and self.distributed is not None:
            raise ValueError(
                f"{type(self).__name__} generates completions with the native engine on one process's whole model; "
                "a distributed run cannot generate yet. Run on one process (or, for GKD, set lmbda=0 and seq_kd=False)."
            )

    @staticmethod
    def _disable_dropout(model: nn.Module) -> None:
        for module in model.modules():
            if isinstance(module, nn.Dropout):
                module.p = 0.0


class GKDTrainer(_TeacherMixin, SFTTrainer):
    """TRL's GKDTrainer (trl.experimental.gkd): same constructor and GKDConfig; logs loss, grad_norm and
    learning_rate. The teacher: ``teacher_model`` (a path, Hub id or model), else ``teacher_model_name_or_path``."""

    algorithm_name = "GKD"
    _tag_names = ["trl", "gkd"]

    def __init__(
        self,
        model=None,
        teacher_model=None,
        args: GKDConfig | None = None,
        data_collator=None,
        train_dataset=None,
        eval_dataset=None,
        processing_class=None,
        compute_metrics=None,
        callbacks=None,
        optimizers=(None, None),
        preprocess_logits_for_metrics=None,
        peft_config=None,
        formatting_func=None,
    ):
        if args is None:
            args = GKDConfig(f"{_model_name(model)}-GKD")
        args = as_hfnative_args(args, GKDConfig)
        args.remove_unused_columns = False  # the collator reads the raw rows
        self._teacher = self._teacher_source(teacher_model, args)
        super().__init__(
            model, args=args, data_collator=data_collator, train_dataset=train_dataset, eval_dataset=eval_dataset,
            processing_class=processing_class, compute_metrics=compute_metrics, callbacks=callbacks,
            optimizers=optimizers, preprocess_logits_for_metrics=preprocess_logits_for_metrics,
            peft_config=peft_config, formatting_func=formatting_func,
        )
        self._check_generation_layout(args.lmbda > 0 or args.seq_kd)
        if args.disable_dropout:
            self._disable_dropout(self.model)

    @staticmethod
    def _args_class():
        return GKDConfig

    def _make_objective(self):
        return GKDObjective(self, self._teacher)


class DistillationTrainer(_TeacherMixin, Trainer):
    """TRL's DistillationTrainer: same constructor and DistillationConfig. Always on-policy: each optimizer step's
    prompts ("prompt" column, text or conversational) are completed by the student in one generation call; logs
    loss, grad_norm, learning_rate, entropy, num_tokens and completions/* (eval_* in evaluation)."""

    algorithm_name = "Distillation"
    _tag_names = ["trl", "distillation"]

    def __init__(
        self,
        model,
        teacher_model=None,
        args: DistillationConfig | None = None,
        train_dataset=None,
        eval_dataset=None,
        processing_class=None,
        callbacks=None,
        optimizers=(None, None),
        quantization_config=None,
        peft_config=None,
        tools=None,
    ):
        if args is None:
            args = DistillationConfig(f"{_model_name(model)}-Distillation")
        args = as_hfnative_args(args, DistillationConfig)
        if tools:
            raise ValueError("tools: tool calling during generation is not available in hfnative's DistillationTrainer")
        _check_train_dataset(train_dataset)
        _check_peft_config(peft_config, model)
        set_seed(args.seed)
        self._teacher = self._teacher_source(teacher_model, args)
        self.peft_config = peft_config
        model_init_kwargs = _as_dict(args.model_init_kwargs) if isinstance(model, (str, Path)) else {}
        if quantization_config is not None and isinstance(model, (str, Path)):
            if "quantization_config" in model_init_kwargs:
                raise ValueError(
                    "You set `quantization_config` both as a trainer argument and in `args.model_init_kwargs`: keep one."
                )
            model_init_kwargs["quantization_config"] = quantization_config
        super().__init__(model=model, args=args, train_dataset=train_dataset, eval_dataset=eval_dataset,
                         processing_class=processing_class, callbacks=callbacks, optimizers=optimizers,
                         model_init_kwargs=model_init_kwargs)
        self._check_generation_layout(True)
        if args.disable_dropout:
            self._disable_dropout(self.model)

    @staticmethod
    def _args_class():
        return DistillationConfig

    def _make_objective(self):
        return OnPolicyDistillationObjective(self, self._teacher)

    _tokenizer = SFTTrainer._tokenizer
    _add_adapters = SFTTrainer._add_adapters

    def get_train_dataloader(self):
        if self.train_dataset is None:
            raise ValueError("Trainer: training requires a train_dataset.")
        a = self.args
        return make_dataloader(
            self.train_dataset, a.per_device_train_batch_size, self.data_collator, seed=a.seed,
            shuffle=bool(a.shuffle_dataset), drop_last=a.dataloader_drop_last, num_workers=a.dataloader_num_workers,
            **self._data_shard(),
        )

    def _prepare_inputs(self, inputs: dict) -> dict:
        """A batch of prompts (evaluation) is completed by the student first; built batches pass through."""
        if "labels" not in inputs:
            prompts = inputs["prompt_ids"]
            inputs = self.objective.build(prompts, self.objective.completions(prompts, training=False))
        return super()._prepare_inputs(inputs)


# --- command line ---------------------------------------------------------------------------------------


def _teacher_kwargs(script_args, training_args, model_args) -> dict:
    if not training_args.teacher_model_name_or_path:
        raise ValueError(
            "A teacher model is required for distillation training. Set it with `--teacher_model_name_or_path`."
        )
    return {"teacher_model": training_args.teacher_model_name_or_path}


def distillation_cli_command():
    """``hfnative-train distillation``: TRL's ``trl distillation`` flags (DistillationConfig's, the script's and the
    model's); the teacher from ``--teacher_model_name_or_path``."""
    from . import cli

    return cli.Command("On-policy knowledge distillation (TRL's `trl distillation`)", DistillationConfig,
                       DistillationTrainer, cli.train_model, trainer_kwargs=_teacher_kwargs)


def gkd_cli_command():
    """``hfnative-train gkd``: GKDConfig's flags with the script's and the model's; the teacher from
    ``--teacher_model_name_or_path``."""
    from . import cli

    return cli.Command("Generalized knowledge distillation (TRL's experimental GKD)", GKDConfig, GKDTrainer,
                       cli.train_model, trainer_kwargs=_teacher_kwargs)
