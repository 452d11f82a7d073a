"""Rollouts as tensors: the layouts the on-policy objectives train on, and the completion log-probs read from them.

Shapes: N rows, P prompt tokens (left-padded), T completion tokens (right-padded), S = P + T, B rows of a micro-batch.

Two layouts, one builder each:
- ``model_inputs``: a rollout batch (``Rollout.tensors``: prompts left-padded, completions right-padded) as prompt +
  completion [N, P + T], the completion tokens as the targets of the positions before them (GRPO, RLOO, async GRPO,
  online DPO, PPO); the completion log-probs are read back with ``completion_logprobs_of``.
- ``completion_batch``: prompt + completion rows right-padded whole, labels on the completion tokens (the distillation
  objectives, which train like SFT on the completions).
"""

from __future__ import annotations

import torch

from hfnative.data.collate import pad_right
from hfnative.losses import IGNORE_INDEX
from hfnative.models.head import TokenLogprobs


def pad_token_lists(sequences: list[list], value, side: str = "right", dtype=torch.long) -> torch.Tensor:
    """[N, T] from N lists of up to T values, ``value`` filling the ``side`` ("left" or "right")."""
    rows = [torch.tensor(list(s), dtype=dtype) for s in sequences]
    if side == "left":  # right-padding of the reversed rows, reversed back
        return pad_right([row.flip(0) for row in rows], value).flip(1)
    return pad_right(rows, value)


def completion_length_metrics(lengths_N: torch.Tensor, clipped_N: torch.Tensor) -> dict[str, torch.Tensor]:
    """TRL's completions/* metrics from N completion lengths and whether each was cut at the length limit (no stop
    token at its end): lengths, the clipped share, and the lengths of those that ended on a stop token (0 if none)."""
    lengths_N = lengths_N.double()
    clipped_N = clipped_N.bool()
    terminated = lengths_N[~clipped_N] if (~clipped_N).any() else torch.zeros(1, dtype=torch.float64)
    return {
        "completions/mean_length": lengths_N.mean(), "completions/min_length": lengths_N.min(),
        "completions/max_length": lengths_N.max(), "completions/clipped_ratio": clipped_N.double().mean(),
        "completions/mean_terminated_length": terminated.mean(), "completions/min_terminated_length": terminated.min(),
        "completions/max_terminated_length": terminated.max(),
    }


def trimmed_rows(batch: dict, rows: torch.Tensor) -> dict:
    """``rows`` of a rollout batch (``Rollout.tensors``' keys, and any per-token [N, T] tensor beside them), cut to
    their longest prompt (the left padding) and their longest completion (``completion_lengths``, which a masked-out
    truncated completion keeps)."""
    part = {key: value[rows] for key, value in batch.items()}
    prompt_width = int(part["prompt_mask"].sum(1).max())
    completion_width = int(part["completion_lengths"].max())
    T = part["completion_ids"].shape[1]
    for key, value in part.items():
        if key in ("prompt_ids", "prompt_mask"):
            part[key] = value[:, value.shape[1] - prompt_width :]
        elif value.dim() == 2 and value.shape[1] == T:
            part[key] = value[:, :completion_width]
    return part


def model_inputs(batch: dict, *, max_length: int | None = None, target_padding: bool = False) -> dict:
    """A rollout batch (``Rollout.tensors``) as the model's inputs: prompt + completion ids and attention mask
    [N, P + T], the completion targets at the positions that predict them as ``shift_labels`` [N, P + T] (what a
    context-parallel split cuts alike), and the prompt width P. The targets are IGNORE_INDEX where the completion is
    masked, or with ``target_padding`` every completion position's token (TRL's online DPO reads the padding's
    log-probs too). ``max_length``: the prompts' left ends cut so that P + T fits it."""
    completion_ids_NT = batch["completion_ids"]
    targets_NT = completion_ids_NT if target_padding else completion_ids_NT.masked_fill(
        batch["completion_mask"] == 0, IGNORE_INDEX)
    prompt_ids_NP, prompt_mask_NP = batch["prompt_ids"], batch["prompt_mask"]
    T = completion_ids_NT.shape[1]
    cut = 0 if max_length is None else max(prompt_ids_NP.shape[1] + T - max_length, 0)
    if cut >= prompt_ids_NP.shape[1]:
        raise ValueError(f"max_length={max_length} leaves no prompt token before completions of {T} tokens: raise "
                         "max_length above the completions' length limit")
    prompt_ids_NP, prompt_mask_NP = prompt_ids_NP[:, cut:], prompt_mask_NP[:, cut:]
    N, P = prompt_ids_NP.shape
    prompt_targets_NP = torch.full((N, P), IGNORE_INDEX, dtype=targets_NT.dtype)
    return {
        **batch,
        "prompt_ids": prompt_ids_NP,
        "prompt_mask": prompt_mask_NP,
        "input_ids": torch.cat([prompt_ids_NP, completion_ids_NT], dim=1),
        "attention_mask": torch.cat([prompt_mask_NP, batch["completion_mask"]], dim=1),
        "shift_labels": torch.cat([prompt_targets_NP[:, 1:], targets_NT, prompt_targets_NP[:, :1]], dim=1),
        "prompt_length": P,
    }


def completion_batch(prompts: list[list[int]], completions: list[list[int]], pad_token_id: int,
                     tool_masks: list[list[int]] | None = None) -> dict:
    """Rows prompt + completion, right-padded, labels on the completion tokens only (with a multi-turn rollout's
    tool masks, only on the model's own tokens: the rendered tool results are attended to, never trained on)."""
    rows = [torch.tensor(p + c, dtype=torch.long) for p, c in zip(prompts, completions)]
    masks = tool_masks if tool_masks is not None else [None] * len(completions)
    labels = [torch.tensor([IGNORE_INDEX] * len(p) + (c if m is None else [t if keep else IGNORE_INDEX for t, keep in zip(c, m)]),
                           dtype=torch.long) for p, c, m in zip(prompts, completions, masks)]
    return {
        "input_ids": pad_right(rows, pad_token_id),
        "attention_mask": pad_right([torch.ones_like(r) for r in rows], 0),
        "labels": pad_right(labels, IGNORE_INDEX),
        "prompt_ids": [list(p) for p in prompts],
    }


def completion_logprobs_of(model, inputs: dict, temperature: float, context, fused: bool = True):
    """Log-prob and entropy (at ``temperature``) of each completion token [B, T] under ``model`` (``model_inputs``'
    layout), zeros where the target is IGNORE_INDEX, and the forward's MoE router load-balancing loss (None unless the
    model has it on, ``aux_loss_enabled``; over the prompt and completion tokens the attention mask keeps, as TRL's
    forward takes it). Only the positions that predict completion tokens reach the head (vocabulary-parallel under
    tensor parallel); under context parallel each rank's positions are put back into the whole sequence."""
    head = TokenLogprobs(inputs["shift_labels"], temperature, fused=fused, compact=True)
    out = model(
        inputs["input_ids"], attention_mask=inputs.get("attention_mask"), position_ids=inputs.get("position_ids"),
        attention_plan=inputs.get("attention_plan"), head_loss=head,
    )
    logprobs_BS, entropy_BS = out.head_output
    P, T = inputs["prompt_length"], inputs["completion_mask"].shape[1]
    whole = context.context_parallel.gather_sequence(torch.stack([logprobs_BS, entropy_BS], dim=-1))
    return whole[:, P - 1 : P - 1 + T, 0], whole[:, P - 1 : P - 1 + T, 1], getattr(out, "aux_loss", None)


__all__ = [
    "completion_batch",
    "completion_length_metrics",
    "completion_logprobs_of",
    "model_inputs",
    "pad_token_lists",
    "trimmed_rows",
]
