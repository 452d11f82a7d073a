"""GKDTrainer: TRL's experimental Generalized Knowledge Distillation on the one loop (the teacher, the divergence and
seeded generation are trainers/algorithms/distillation.py's).

Each micro-batch trains on the dataset's completions, the student's own (on-policy, probability ``lmbda``) or the
teacher's (``seq_kd``); the loss is the generalized JSD at temperature 1 over the completion tokens.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import torch
import transformers

from hfnative.losses import IGNORE_INDEX, generalized_jsd_terms

from .distillation_config import GKDConfig
from .distillation import _DistillationObjective, _TeacherMixin, _teacher_kwargs
from .sft import apply_tokenizer_settings
from ..rollout.prompts import generation_eos_ids, sampling_params, tokenize_prompts
from ..rollout.component import Rollout
from ..rollout.batches import completion_batch, pad_token_lists
from .sft import SFTTrainer

logger = logging.getLogger(__name__)


def _tokens_and_offsets(tokenizer, text: str) -> tuple[list[int], list[tuple[int, int]]]:
    encoded = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    return list(encoded["input_ids"]), list(encoded["offset_mapping"])


def gkd_batch(prompts: list[list[int]], completions: list[list[int]], pad_token_id: int) -> dict:
    """A GKD batch: ``completion_batch``'s rows, and TRL's keys for the prompts, ``prompts`` [B, P] left-padded and
    ``prompt_attention_mask``."""
    return {**completion_batch(prompts, completions, pad_token_id),
            "prompts": pad_token_lists(prompts, pad_token_id, side="left"),
            "prompt_attention_mask": pad_token_lists([[1] * len(p) for p in prompts], 0, side="left")}


def prompt_lists(batch: dict) -> list[list[int]]:
    """Each row's prompt ids: the batch's ``prompt_ids``, or (a batch from TRL's DataCollatorForChatML or a user's
    collator like it) the ``prompts`` tensor's tokens that ``prompt_attention_mask`` keeps."""
    if "prompt_ids" in batch:
        return batch["prompt_ids"]
    missing = [key for key in ("prompts", "prompt_attention_mask") if key not in batch]
    if missing:
        raise ValueError(
            f"GKD generates from each row's prompt, but the collated batch has no {missing} (it has {sorted(batch)}): "
            "a data_collator must return TRL's 'prompts' (left-padded prompt ids) and 'prompt_attention_mask', as "
            "trl's DataCollatorForChatML does"
        )
    ids, mask = batch["prompts"].cpu(), batch["prompt_attention_mask"].cpu().bool()
    return [row[keep].tolist() for row, keep in zip(ids, mask)]


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
        return gkd_batch(prompts, completions, self.pad_token_id)

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
        # SFTConfig's eos_token and chat_template_path, as TRL's GKDTrainer (an SFTTrainer) applies them, before the
        # stop tokens are read; a template that would change the vocabulary is refused (the teacher's would not follow)
        apply_tokenizer_settings(context, context.args)
        super().__init__(context, teacher)
        args = context.args
        self.beta, self.lmbda, self.seq_kd = args.beta, args.lmbda, args.seq_kd
        # TRL's GKD samples with the student's generation_config stop tokens, top_k 0 and top_p 1
        sampling = sampling_params(args, args.max_new_tokens, generation_eos_ids(context.model), top_k=0, top_p=1.0,
                                   min_p=0.0, repetition_penalty=1.0)
        self.rollout = Rollout(context, sampling)

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
        prompts = prompt_lists(batch)
        completions = self.generate(model, prompts, self.rollout.sampling)
        return self.context.context_parallel.split(gkd_batch(prompts, completions, self.pad_token_id))


class GKDTrainer(_TeacherMixin, SFTTrainer):
    """TRL's GKDTrainer (trl.experimental.gkd): same constructor and GKDConfig; logs loss, grad_norm and
    learning_rate. The teacher: ``teacher_model`` (a path, Hub id or model), else ``teacher_model_name_or_path``."""

    algorithm_name = "GKD"
    config_class = GKDConfig
    _tag_names = ["trl", "gkd"]
    logits_for_metrics_warning = None  # TRL's GKD computes its loss itself, without SFT's warning

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
        if args.lmbda == 1.0 and args.temperature == 1.0:
            logger.warning(  # TRL's text
                "This GKD configuration (`lmbda=1.0`, `temperature=1.0`) is fully covered by `DistillationTrainer`, "
                "which is maintained in the main codebase and supports vLLM generation and a memory-efficient "
                "chunked loss. Consider migrating: replace `GKDConfig`/`GKDTrainer` with "
                "`DistillationConfig`/`DistillationTrainer`, `max_new_tokens` with `max_completion_length`, and set "
                f"`beta={args.beta}` explicitly (`beta` means the same in both, but defaults to 0.5 here and 1.0 "
                "there)."
            )
        self._teacher = self._teacher_source(teacher_model, args)
        super().__init__(
            model, args=args, data_collator=data_collator, train_dataset=train_dataset, eval_dataset=eval_dataset,
            processing_class=processing_class, compute_metrics=compute_metrics, callbacks=callbacks,
            optimizers=optimizers, preprocess_logits_for_metrics=preprocess_logits_for_metrics,
            peft_config=peft_config, formatting_func=formatting_func,
        )
        # TRL's generation config, as its constructor builds it (what users' code reads; sampling reads args)
        self.generation_kwargs = {
            "max_new_tokens": args.max_new_tokens, "temperature": args.temperature, "do_sample": True, "top_k": 0,
            "top_p": 1.0, "use_cache": not args.gradient_checkpointing, "pad_token_id": self.processing_class.pad_token_id,
        }
        self.generation_config = transformers.GenerationConfig(**self.generation_kwargs)
        eos_token_id = getattr(getattr(self.model, "generation_config", None), "eos_token_id", None)
        if eos_token_id is not None:
            self.generation_config.eos_token_id = eos_token_id

    def _make_objective(self):
        return GKDObjective(self.context, self._teacher)

    def _tokenizer_settings(self) -> list[int]:
        return []  # GKDObjective applies them, before it reads the stop tokens, and refuses a new vocabulary

    # --- TRL's static helpers (what scripts and tests call on the class) ----------------------------------------

    @staticmethod
    def generalized_jsd_loss(student_logits, teacher_logits, labels=None, beta=0.5, temperature=1.0,
                             reduction="batchmean", num_items_in_batch=None):
        """TRL's GKDTrainer.generalized_jsd_loss on full logits [B, S, V]: JSD_beta between softmax(logits /
        temperature) of the student and the teacher (beta 0: KL(teacher || student), 1: KL(student || teacher)),
        over the positions whose ``labels`` [B, S] are not -100. ``num_items_in_batch``: the sum divided by it.
        Else ``reduction``: "batchmean" (the sum / the label tokens, or / B without labels), "sum", "mean" (over
        every vocabulary entry) or "none" (the per-entry terms, [N, V] with labels, else [B, S, V])."""
        if reduction not in ("batchmean", "sum", "mean", "none"):
            raise ValueError(f"reduction={reduction!r}: expected 'batchmean', 'sum', 'mean' or 'none'")
        if student_logits.shape != teacher_logits.shape:
            raise ValueError(f"student_logits {tuple(student_logits.shape)} and teacher_logits "
                             f"{tuple(teacher_logits.shape)} must have the same shape [B, S, V]")
        student_log_probs = torch.log_softmax(student_logits / temperature, dim=-1)
        teacher_log_probs = torch.log_softmax(teacher_logits / temperature, dim=-1)
        terms = generalized_jsd_terms(student_log_probs, teacher_log_probs, float(beta))
        mask = None
        if labels is not None:
            mask = labels != IGNORE_INDEX
            terms = terms[mask]
        if num_items_in_batch is not None:  # a host number divides as it is (no copy the device waits for)
            return terms.sum() / (num_items_in_batch.to(terms.device) if isinstance(num_items_in_batch, torch.Tensor)
                                  else num_items_in_batch)
        if reduction == "batchmean":
            return terms.sum() / (mask.sum().clamp_min(1) if mask is not None else max(terms.size(0), 1))
        if reduction == "sum":
            return terms.sum()
        if reduction == "mean":
            return terms.mean()
        return terms

    @staticmethod
    def generate_on_policy_outputs(model, inputs, generation_config):
        """TRL's GKDTrainer.generate_on_policy_outputs: ``model.generate`` from ``inputs["prompts"]`` [B, P] (left-
        padded) and ``inputs["prompt_attention_mask"]`` with ``generation_config`` -> (sequences [B, P + C],
        attention_mask [B, P + C]: the prompt's mask, then 1 up to and including each row's first EOS of
        ``generation_config.eos_token_id``, labels [B, P + C]: the completion tokens, -100 on the prompt and
        wherever the mask is 0)."""
        missing = [key for key in ("prompts", "prompt_attention_mask") if key not in inputs]
        if missing:
            raise ValueError(f"generate_on_policy_outputs: inputs has no {missing} (it has {sorted(inputs)}); pass the "
                             "left-padded prompt ids as 'prompts' and their mask as 'prompt_attention_mask'")
        prompts, prompt_mask = inputs["prompts"], inputs["prompt_attention_mask"]
        generated = model.generate(input_ids=prompts, attention_mask=prompt_mask, generation_config=generation_config,
                                   return_dict_in_generate=True)
        sequences = generated.sequences
        prompt_length = prompts.shape[1]
        completions = sequences[:, prompt_length:]
        completion_mask = torch.ones_like(completions)
        eos = generation_config.eos_token_id
        if eos is not None:
            stops = torch.isin(completions, torch.as_tensor(eos, device=completions.device))
            # a row is kept through its first EOS (positions after it: 0); a row without one is kept whole
            after_first_stop = (stops.cumsum(dim=1) - stops.long()) > 0
            completion_mask = (~after_first_stop).to(completions.dtype)
        attention_mask = torch.cat([prompt_mask.to(completions.dtype), completion_mask], dim=1)
        labels = sequences.masked_fill(attention_mask == 0, IGNORE_INDEX)
        labels[:, :prompt_length] = IGNORE_INDEX
        return sequences, attention_mask, labels


# --- command line ---------------------------------------------------------------------------------------


def gkd_cli_command():
    """``hfnative-train gkd``: GKDConfig's flags with the script's and the model's; the teacher from
    ``--teacher_model_name_or_path``."""
    from ..running import cli

    return cli.Command("Generalized knowledge distillation (TRL's experimental GKD)", GKDConfig, GKDTrainer,
                       cli.train_model, trainer_kwargs=_teacher_kwargs)
