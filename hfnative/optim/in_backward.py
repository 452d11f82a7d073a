"""Optimizer-in-backward: each parameter is stepped as soon as its gradient is final, and the gradient
is freed at once, so the whole model's gradients never exist at the same time.

One optimizer per trainable parameter, stepped from a ``register_post_accumulate_grad_hook``. The
object is itself a ``torch.optim.Optimizer`` whose ``param_groups`` (transformers' decay / no-decay
groups) are the single source of truth for hyperparameters: every hook copies its group's ``lr``
(and any other hyperparameter) into the parameter's optimizer just before stepping it, so any torch
LR scheduler built over this object — ``transformers.get_scheduler(name, optimizer, ...)`` included —
reaches every parameter (torchtune's version only changes an outer group the per-parameter optimizers
never read).

Usage per optimizer step with gradient accumulation::

    for micro_batch in step_micro_batches[:-1]:
        with optimizer.accumulating():   # hooks off: gradients add up in p.grad as usual
            loss(micro_batch).backward()
    loss(step_micro_batches[-1]).backward()  # each parameter is stepped inside this backward
    optimizer.step()                          # steps any parameter the last backward did not reach
    grad_norm = optimizer.grad_norm()         # 2-norm of the step's gradients, as clip_grad_norm_
    scheduler.step()

Global-norm clipping is impossible here (a parameter is updated before the others' gradients
exist), so ``max_grad_norm > 0`` is refused.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager, nullcontext
from functools import partial

import torch
from torch import nn

from .factory import OptimizerSettings, optimizer_parts

_NOT_HYPERPARAMETERS = ("params", "initial_lr")


def check_optimizer_in_backward_args(max_grad_norm: float | None) -> None:
    """Raise a ValueError for settings optimizer-in-backward cannot honour exactly."""
    if max_grad_norm is not None and max_grad_norm > 0:
        raise ValueError(
            f"optimizer_in_backward=True cannot clip gradients to max_grad_norm={max_grad_norm}: each parameter is "
            "updated inside backward before the global gradient norm is known. Set max_grad_norm=0 (grad_norm is "
            "still computed and logged), or turn optimizer_in_backward off to clip."
        )


class OptimizerInBackward(torch.optim.Optimizer):
    """Per-parameter optimizers stepped inside backward, behind one torch Optimizer interface.

    param_groups, optimizer_cls, optimizer_kwargs: as ``optimizer_parts`` returns them; each parameter gets
        its own ``optimizer_cls`` (AdamW, SGD, Adafactor, torchao's AdamW8bit/AdamW4bit, ...) with its group's
        hyperparameters.
    max_grad_norm: must be 0 or None (see ``check_optimizer_in_backward_args``).
    compile_step: let optimizers that torch.compile their step (torchao's low-bit AdamW) do so. None:
        only when the parameters are on an accelerator; on CPU the first compiled step of a tiny model
        takes ~40 s (one inductor build per parameter shape), the eager step a fraction of a second.
    """

    def __init__(self, param_groups, optimizer_cls: type[torch.optim.Optimizer], optimizer_kwargs: dict,
                 max_grad_norm: float | None = 0.0, compile_step: bool | None = None):
        check_optimizer_in_backward_args(max_grad_norm)
        if "lr" not in optimizer_kwargs:
            raise ValueError("optimizer_kwargs needs an 'lr' (the base learning rate schedules multiply)")
        super().__init__(param_groups, dict(optimizer_kwargs))
        self.optimizer_cls = optimizer_cls
        self._params: list[nn.Parameter] = [p for group in self.param_groups for p in group["params"]]
        if len(set(map(id, self._params))) != len(self._params):
            raise ValueError("a parameter appears twice in param_groups")
        self._group_of: dict[nn.Parameter, dict] = {}
        self._optimizers: dict[nn.Parameter, torch.optim.Optimizer] = {}
        for group in self.param_groups:
            # the group's settings go in the parameter's own group: some belong to no constructor (GaLore's rank)
            # (a None is left to the optimizer's own default: torch-optimi fills max_lr from lr there)
            hyperparameters = {k: v for k, v in group.items() if k not in _NOT_HYPERPARAMETERS and v is not None}
            for param in group["params"]:
                self._group_of[param] = group
                self._optimizers[param] = optimizer_cls([{"params": [param], **hyperparameters}], **optimizer_kwargs)
        if compile_step is None:
            compile_step = any(p.device.type != "cpu" for p in self._params)
        self._step_stance = nullcontext if compile_step else partial(torch.compiler.set_stance, "force_eager")
        self._accumulating = False
        self._grad_norms: dict[nn.Parameter, torch.Tensor] = {}
        self._last_grad_norm: torch.Tensor | None = None
        self._hooks = [p.register_post_accumulate_grad_hook(self._on_grad_ready) for p in self._params]

    @classmethod
    def from_model(
        cls,
        model: nn.Module,
        settings: OptimizerSettings,
        max_grad_norm: float | None = 0.0,
        compile_step: bool | None = None,
    ) -> OptimizerInBackward:
        """The per-parameter twin of ``build_optimizer``: same `optim` names, kwargs and decay groups."""
        optimizer_cls, groups, kwargs = optimizer_parts(model, settings)
        return cls(groups, optimizer_cls, kwargs, max_grad_norm, compile_step)

    # --- the step, inside backward -------------------------------------------------------------

    @contextmanager
    def accumulating(self) -> Iterator[None]:
        """Backward passes inside this context only accumulate gradients (non-final micro-batches)."""
        previous, self._accumulating = self._accumulating, True
        try:
            yield
        finally:
            self._accumulating = previous

    def _on_grad_ready(self, param: nn.Parameter) -> None:
        if not self._accumulating:
            self._step_parameter(param)

    @torch.no_grad()
    def _step_parameter(self, param: nn.Parameter) -> None:
        self._grad_norms[param] = torch.linalg.vector_norm(param.grad, 2.0)
        optimizer = self._optimizers[param]
        _copy_hyperparameters(self._group_of[param], optimizer.param_groups[0])
        with self._step_stance():
            optimizer.step()
        param.grad = None  # the point of it all: this gradient's memory is free now

    @torch.no_grad()
    def step(self, closure=None):
        """Finish the optimizer step after the last micro-batch's backward.

        Steps the parameters whose gradient is still there (the last backward did not reach them,
        or no hook ran), then fixes the step's gradient norm. Call it once per optimizer step.
        """
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for param in self._params:
            if param.grad is not None:
                self._step_parameter(param)
        # the norm of the per-parameter norms, as clip_grad_norm_ computes it (equal up to fp32 round-off:
        # it sums in model.parameters() order, this in param_groups order)
        norms = [self._grad_norms[p] for p in self._params if p in self._grad_norms]
        if norms:
            self._last_grad_norm = torch.linalg.vector_norm(torch.stack(norms), 2.0)
        else:
            self._last_grad_norm = torch.zeros(())
        self._grad_norms.clear()
        return loss

    def train(self) -> None:
        """Each parameter's optimizer's ``train()``, where it has one (the schedule-free optimizers: the parameters
        become the points gradients are taken at); nothing for the others."""
        self._each_mode("train")

    def eval(self) -> None:
        """Each parameter's optimizer's ``eval()``, where it has one (schedule-free: the parameters become the
        averaged weights evaluation uses); nothing for the others."""
        self._each_mode("eval")

    def _each_mode(self, mode: str) -> None:
        for optimizer in self._optimizers.values():
            switch = getattr(optimizer, mode, None)
            if callable(switch):
                switch()

    def grad_norm(self) -> torch.Tensor | None:
        """Total 2-norm of the last completed step's gradients (before the update); None before the first."""
        return self._last_grad_norm

    def effective_lr(self, param: nn.Parameter) -> float:
        """The learning rate the parameter's own optimizer used for its latest step."""
        return float(self._optimizers[param].param_groups[0]["lr"])

    def remove_hooks(self) -> None:
        """Detach from the parameters (before building a replacement optimizer over the same model)."""
        for handle in self._hooks:
            handle.remove()
        self._hooks = []

    # --- checkpoints ---------------------------------------------------------------------------

    def state_dict(self) -> dict:
        """The outer groups' hyperparameters (as any torch optimizer) plus each parameter's optimizer
        state, in parameter order."""
        outer = super().state_dict()
        outer["per_parameter"] = [self._optimizers[p].state_dict() for p in self._params]
        return outer

    def parameter_optimizers(self) -> list[torch.optim.Optimizer]:
        """Each trainable parameter's own optimizer, in parameter order, holding its group's current
        hyperparameters: what a distributed checkpoint saves (torch's get_state_dict takes several optimizers)."""
        for param in self._params:
            _copy_hyperparameters(self._group_of[param], self._optimizers[param].param_groups[0])
        return [self._optimizers[param] for param in self._params]

    def adopt_parameter_hyperparameters(self) -> None:
        """After the per-parameter optimizers were loaded: each outer group takes its hyperparameters (the
        scheduled lr included) back from its parameters' optimizers, as ``load_state_dict`` restores them."""
        for group in self.param_groups:
            if not group["params"]:
                continue
            inner = self._optimizers[group["params"][0]].param_groups[0]
            for key, value in inner.items():
                if key in _NOT_HYPERPARAMETERS or key not in group:
                    continue
                group[key] = value.item() if isinstance(value, torch.Tensor) and value.numel() == 1 else value

    def load_state_dict(self, state_dict: dict) -> None:
        per_parameter = state_dict.get("per_parameter")
        if per_parameter is None:
            raise ValueError(
                "this optimizer state was not saved by OptimizerInBackward (no 'per_parameter' entry); "
                "resume with the same optimizer_in_backward setting it was saved with"
            )
        if len(per_parameter) != len(self._params):
            raise ValueError(
                f"the saved optimizer state has {len(per_parameter)} parameters, this model has {len(self._params)} "
                "trainable ones"
            )
        super().load_state_dict({"state": {}, "param_groups": state_dict["param_groups"]})
        # base load_state_dict rebuilt the groups: re-point each parameter at its new group dict
        for group in self.param_groups:
            for param in group["params"]:
                self._group_of[param] = group
        for param, saved in zip(self._params, per_parameter):
            self._optimizers[param].load_state_dict(saved)
            _copy_hyperparameters(self._group_of[param], self._optimizers[param].param_groups[0])


def _copy_hyperparameters(source: dict, target: dict) -> None:
    """The outer group's hyperparameters into a parameter's own optimizer's group; a None (the optimizer decides:
    torch-optimi's kahan_sum, max_lr) leaves what that optimizer set there itself."""
    for key, value in source.items():
        if key in _NOT_HYPERPARAMETERS or key not in target or value is None:
            continue
        current = target[key]
        if isinstance(current, torch.Tensor) and not isinstance(value, torch.Tensor):
            current.fill_(value)  # torchao keeps lr as a tensor (so its compiled step never recompiles)
        else:
            target[key] = value
