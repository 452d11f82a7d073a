"""GKDTrainer: TRL's experimental Generalized Knowledge Distillation on the one loop (the teacher, the divergence and
seeded generation are trainers/distillation_trainer.py's).

Each micro-batch trains on the dataset's completions, the student's own (on-policy, probability ``lmbda``) or the
teacher's (``seq_kd``); the loss is the generalized JSD at temperature 1 over the completion tokens.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from .distillation_config import GKDConfig
from .distillation_trainer import _DistillationObjective, _TeacherMixin, _teacher_kwargs, completion_batch
from .rollout import Rollout, generation_eos_ids, sampling_params, tokenize_prompts
from .sft_trainer import SFTTrainer


def _tokens_and_offsets(tokenizer, text: str) -> tuple[list[int], list[tuple[int, int]]]:
    encoded = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    return list(encoded["input_ids"]), list(encoded["offset_mapping"])


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
        return completion_batch(prompts, completions, self.pad_token_id)

    def _tokenize(self, row: dict, index: int) -> tuple[list[int], int]:
        """(token ids of prompt + completion, the prompt's length)."""
        tokenizer = getattr(self.processing_class, "tokenizer", self.processing_class)
        if "input_ids" in row:
            ids = list(row["input_ids"])
            mask = row.get("completion_mask")
            if mask is not None:
                return ids, list(mask).index(1) if 1 in mask else len(ids)
            prompt = tokenize_prompts(self.processing_class, [row["prompt"]])[0] if "prompt" in row else ids
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


class GKDObjective(_DistillationObjective):
    """GKD: dataset, student or teacher completions per micro-batch (TRL's coin: on-policy when a uniform draw is
    <= lmbda); the generalized JSD at temperature 1, summed over completion tokens / the step's count. The count is
    taken over the completions trained on (TRL counts the dataset's, before generation replaces them)."""

    loss_temperature = 1.0

    def __init__(self, context, teacher):
        super().__init__(context, teacher)
        args = context.args
        self.beta, self.lmbda, self.seq_kd = args.beta, args.lmbda, args.seq_kd
        # TRL's GKD samples with the student's generation_config stop tokens, top_k 0 and top_p 1
        sampling = sampling_params(args, args.max_new_tokens, generation_eos_ids(context.model), top_k=0, top_p=1.0,
                                   min_p=0.0, repetition_penalty=1.0)
        self.rollout = Rollout(context, sampling)
        self.sampling = self.rollout.sampling

    def generates(self) -> bool:
        return self.lmbda > 0 or self.seq_kd

    def default_collator(self):
        return GKDCollator(self.context.processing_class, self.pad_token_id, self.args.max_length)

    def micro_batches(self, epoch_iterator, count):
        batches = super().micro_batches(epoch_iterator, count)
        return [self.choose_completions(batch) for batch in batches]

    def choose_completions(self, batch: dict) -> dict:
        """The batch with student completions (probability lmbda), else teacher ones (seq_kd), else as given."""
        if self.rng.random() <= self.lmbda:
            model = self.context.model
        elif self.seq_kd:
            model = self.teacher
        else:
            return batch
        completions = self.generate(model, batch["prompt_ids"], self.sampling)
        return self.context.context_parallel.split(completion_batch(batch["prompt_ids"], completions, self.pad_token_id))


class GKDTrainer(_TeacherMixin, SFTTrainer):
    """TRL's GKDTrainer (trl.experimental.gkd): same constructor and GKDConfig; logs loss, grad_norm and
    learning_rate. The teacher: ``teacher_model`` (a path, Hub id or model), else ``teacher_model_name_or_path``."""

    algorithm_name = "GKD"
    config_class = GKDConfig
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
        args = self.resolve_args(args, model)
        args.remove_unused_columns = False  # the collator reads the raw rows
        self._teacher = self._teacher_source(teacher_model, args)
        super().__init__(
            model, args=args, data_collator=data_collator, train_dataset=train_dataset, eval_dataset=eval_dataset,
            processing_class=processing_class, compute_metrics=compute_metrics, callbacks=callbacks,
            optimizers=optimizers, preprocess_logits_for_metrics=preprocess_logits_for_metrics,
            peft_config=peft_config, formatting_func=formatting_func,
        )

    def _make_objective(self):
        return GKDObjective(self.context, self._teacher)


# --- command line ---------------------------------------------------------------------------------------


def gkd_cli_command():
    """``hfnative-train gkd``: GKDConfig's flags with the script's and the model's; the teacher from
    ``--teacher_model_name_or_path``."""
    from . import cli

    return cli.Command("Generalized knowledge distillation (TRL's experimental GKD)", GKDConfig, GKDTrainer,
                       cli.train_model, trainer_kwargs=_teacher_kwargs)
