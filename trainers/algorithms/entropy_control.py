"""TRL's entropy bonus for the policy-gradient losses: ``entropy_coef`` and the adaptive controller
(``use_adaptive_entropy``, ``entropy_target``, ``entropy_coef_delta`` / ``_min`` / ``_max``).

The loss becomes L - coef * H over the tokens the loss acts on. In adaptive mode the coefficient applies only while
the last step's mean token entropy (over every rank's completion tokens) is at most ``entropy_target``, and at each
step's end moves by ``entropy_coef_delta`` toward more bonus (entropy at most the target) or less (above it), within
``[entropy_coef_min, entropy_coef_max]``; its state is saved in checkpoints under TRL's file name and keys.
"""

from __future__ import annotations

import torch

from hfnative.losses.policy import entropy_bonus

# the adaptive controller's state in a checkpoint (TRL's file)
ENTROPY_STATE_FILE = "entropy_ctrl_state.json"


class EntropyBonus:
    """The bonus of one run: ``apply`` to each micro-batch's policy loss, ``end_step`` after each optimizer step."""

    def __init__(self, args):
        self.args = args
        self.coef = getattr(args, "entropy_coef", 0.0)
        self.adaptive = bool(getattr(args, "use_adaptive_entropy", False))
        self.last_step_entropy = float("inf")  # the whole batch's mean token entropy of the last step
        self._window = None  # this step's (entropy sum, token count) on this rank

    @property
    def active(self) -> bool:
        return self.coef != 0.0 or self.adaptive

    def apply(self, out, entropy_BT: torch.Tensor, mask_BT: torch.Tensor, training: bool):
        """The policy loss ``out`` minus the bonus (the coefficient of the step's start; 0 in adaptive mode while the
        last step's entropy is above entropy_target), with policy_loss logged; in training the controller's sums
        kept."""
        coef = self.coef
        if self.adaptive:
            coef = coef if self.last_step_entropy <= self.args.entropy_target else 0.0
            if training:
                mask = mask_BT.to(entropy_BT.dtype)
                sums = torch.stack([(entropy_BT.detach() * mask).sum(), mask.sum()]).double()
                self._window = sums if self._window is None else self._window + sums
        metrics = {**out.metrics, "policy_loss": out.loss.detach()}
        return type(out)(out.loss + entropy_bonus(entropy_BT, mask_BT, coef), out.per_token_loss_BT, metrics)

    def end_step(self, ratio_of_sums, metrics) -> None:
        """At a step's end: the adaptive controller's update from the step's mean token entropy over every rank
        (``ratio_of_sums(numerator, denominator)``: the ranks' sums divided), and entropy_coef logged."""
        args = self.args
        if self.adaptive and self._window is not None:
            self.last_step_entropy = ratio_of_sums(*self._window)
            if self.last_step_entropy <= args.entropy_target:
                self.coef = min(self.coef + args.entropy_coef_delta, args.entropy_coef_max)
            else:
                self.coef = max(self.coef - args.entropy_coef_delta, args.entropy_coef_min)
            self._window = None
        if self.active:
            metrics.add("entropy_coef", torch.tensor(float(self.coef)))

    def checkpoint_state(self) -> dict[str, dict]:
        if not self.adaptive:
            return {}
        return {ENTROPY_STATE_FILE: {"entropy_coef": self.coef, "last_world_entropy": self.last_step_entropy}}

    def load_checkpoint_state(self, files: dict[str, dict]) -> None:
        state = files.get(ENTROPY_STATE_FILE)
        if state is not None:
            self.coef = float(state["entropy_coef"])
            self.last_step_entropy = float(state["last_world_entropy"])


__all__ = ["ENTROPY_STATE_FILE", "EntropyBonus"]
