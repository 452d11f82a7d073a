"""Optimizer, LR schedule and the optimizer step for the Trainer (transformers' method names)."""

from __future__ import annotations

import logging
from contextlib import nullcontext

import torch
import transformers
from transformers.trainer_utils import check_target_module_exists

from hfnative.converters.loading import ConvertedModel
from hfnative.converters.lora_targets import optim_target_parameters
from hfnative.log_once import warn_once
from hfnative.optim import OptimizerSettings, build_optimizer
from hfnative.optim.low_rank import LOW_RANK_NAMES
from hfnative.optim.factory import decay_parameter_names
from hfnative.optim.in_backward import OptimizerInBackward
from hfnative.optim.loss_scale import LossScale, scales_loss

logger = logging.getLogger(__name__)


class OptimizationMixin:
    """create_optimizer / create_scheduler as transformers' Trainer names them (users override them),
    and the step that clips, steps the optimizer and scheduler, and clears the gradients."""

    _loss_scale: LossScale | None = None  # fp16 on an accelerator (_new_loss_scale)
    _optimizer_stepped = True  # whether the last optimizer step ran (fp16: not after an overflow)

    def create_optimizer(self):
        if self.optimizer is None:
            trainable = [p for p in self.native_model.parameters() if p.requires_grad]
            if self.optimizer_cls_and_kwargs is not None:
                cls, kwargs = self.optimizer_cls_and_kwargs
                if self.args.optimizer_in_backward:
                    self.optimizer = OptimizerInBackward(trainable, cls, kwargs, max_grad_norm=self.args.max_grad_norm)
                else:
                    self.optimizer = cls(trainable, **kwargs)
            elif self.args.optimizer_in_backward:
                self.optimizer = OptimizerInBackward.from_model(self.native_model, self._optimizer_settings(),
                                                                max_grad_norm=self.args.max_grad_norm)
            else:
                self.optimizer = build_optimizer(self.native_model, self._optimizer_settings())
        return self.optimizer

    def _optimizer_settings(self) -> OptimizerSettings:
        """The TrainingArguments fields hfnative's optimizers are built from."""
        a = self.args
        return OptimizerSettings(
            optim=a.optim, learning_rate=a.learning_rate, weight_decay=a.weight_decay, adam_beta1=a.adam_beta1,
            adam_beta2=a.adam_beta2, adam_epsilon=a.adam_epsilon, optim_args=a.optim_args,
            adafactor_class=transformers.Adafactor, bf16_weight_updates=a.bf16_weight_updates,
            # a ratio (< 1) in steps, as the LR schedule reads it (transformers hands the schedule-free optimizers the
            # ratio itself, which they take as a step count below one)
            warmup_steps=a.get_warmup_steps(self.state.max_steps),
            optim_target_names=self._optim_target_names(),
        )

    # transformers' static helper: the optimizer class and kwargs TrainingArguments' ``optim`` names
    get_optimizer_cls_and_kwargs = staticmethod(transformers.Trainer.get_optimizer_cls_and_kwargs)

    def get_decay_parameter_names(self, model) -> list[str]:
        """The names of ``model``'s parameters that get weight decay (all but biases and norms), in order."""
        decayed = decay_parameter_names(model)
        return [name for name, _ in model.named_parameters() if name in decayed]

    def get_num_trainable_parameters(self) -> int:
        return sum(p.numel() for p in self.model.parameters() if p.requires_grad)

    def get_learning_rates(self) -> list[float]:
        """Each optimizer parameter group's current learning rate."""
        return [group["lr"] for group in self._made_optimizer().param_groups]

    def get_optimizer_group(self, param=None):
        """The optimizer's parameter group holding ``param``, or (None, or a parameter it does not hold) every
        group's parameters, as transformers' Trainer."""
        optimizer = self._made_optimizer()
        if param is not None:
            for group in optimizer.param_groups:
                if any(param is p for p in group["params"]):
                    return group
        return [group["params"] for group in optimizer.param_groups]

    def _optim_target_names(self) -> tuple[str, ...] | None:
        """The parameters a GaLore / APOLLO ``optim`` projects: ``optim_target_modules`` (transformers' module names)
        resolved as transformers' Trainer resolves them, named in the native model; None for other optimizers."""
        a = self.args
        optim = str(getattr(a.optim, "value", a.optim))
        if optim not in LOW_RANK_NAMES:
            return None
        if a.optim_target_modules is None:
            raise ValueError(f"You need to define `optim_target_modules` to use {optim} optimizers")
        if not isinstance(a.optim_target_modules, (list, str)):
            raise TypeError("`optim_target_modules` must be a list of strings, a regex string, or 'all-linear'. "
                            f"Got: {a.optim_target_modules}")
        if self.distributed is not None:
            raise ValueError(f"optim={optim!r} runs on one process in hfnative: its projections are not made for "
                             "sharded or replicated parameters; launch one process, or choose another optimizer")
        if self.lora_settings is not None:
            raise ValueError(f"optim={optim!r} projects the gradients of full weights; with LoRA adapters only the "
                             "adapters train: drop peft_config, or choose another optimizer")
        if isinstance(self.converted, ConvertedModel):
            names, fused = optim_target_parameters(self.converted, a.optim_target_modules)
            if fused:
                warn_once(logger, f"optim={optim!r}: the fused projections {fused} are split in this model's blocks, "
                                  "and each part is projected on its own (transformers projects the fused matrix)")
        else:  # transformers' own module (converters/fallback.py holds it as ``module``): its paths
            all_linear = (isinstance(a.optim_target_modules, str)
                          and a.optim_target_modules.replace("_", "-") == "all-linear")
            hub = self.native_model.module
            parameters = dict(hub.named_parameters())
            names = [f"module.{path}.weight" for path, module in hub.named_modules()
                     if isinstance(module, torch.nn.Linear) and f"{path}.weight" in parameters
                     and (all_linear or check_target_module_exists(a.optim_target_modules, path))]
        if not names:
            raise ValueError(f"No target modules found for {optim} ({a.optim_target_modules}).")
        return tuple(names)

    def _optimizer_mode(self, mode: str) -> None:
        """The optimizer's ``train()`` or ``eval()`` where it has one (schedule-free optimizers swap the parameters
        between the points gradients are taken at and the averaged weights): transformers' Trainer calls them at
        each training step and when its evaluation loop starts."""
        switch = getattr(self.optimizer, mode, None)
        if callable(switch):
            switch()

    def _optimizer_ready_to_load(self) -> None:
        """Before torch's distributed loader fills the optimizer: it first steps an optimizer without state at lr 0 to
        make its state, and a schedule-free optimizer steps only in train mode (the saved mode comes back with its
        groups). Switching a fresh one leaves empty per-parameter entries (its state is a defaultdict), which would
        tell the loader the state is made already: they are dropped."""
        self._optimizer_mode("train")
        optimizers = (self.optimizer.parameter_optimizers() if isinstance(self.optimizer, OptimizerInBackward)
                      else [self.optimizer])
        for optimizer in optimizers:
            for param in [param for param, state in optimizer.state.items() if not state]:
                del optimizer.state[param]

    def _made_optimizer(self):
        if self.optimizer is None:
            raise ValueError("Trainer optimizer is None, please make sure you have setup the optimizer before.")
        return self.optimizer

    def create_scheduler(self, num_training_steps: int, optimizer=None):
        if self.lr_scheduler is None:
            a = self.args
            from ..running.deepspeed_config import deepspeed_scheduler

            self.lr_scheduler = deepspeed_scheduler(a, optimizer or self.optimizer, num_training_steps)
            if self.lr_scheduler is not None:  # a DeepSpeed config's schedule replaces the arguments', as in transformers
                return self.lr_scheduler
            if a.lr_scheduler_type in ("reduce_lr_on_plateau", "greedy"):
                raise ValueError(f"lr_scheduler_type={a.lr_scheduler_type.value!r} steps on an evaluation metric, "
                                 "which hfnative's loop does not pass; choose a schedule that follows the step count")
            self.lr_scheduler = transformers.get_scheduler(
                a.lr_scheduler_type,
                optimizer or self.optimizer,
                num_warmup_steps=a.get_warmup_steps(num_training_steps),
                num_training_steps=num_training_steps,
                scheduler_specific_kwargs=a.lr_scheduler_kwargs,
            )
        return self.lr_scheduler

    def create_optimizer_and_scheduler(self, num_training_steps: int):
        self.create_optimizer()
        self.create_scheduler(num_training_steps)

    def _new_loss_scale(self) -> LossScale | None:
        """fp16=True on an accelerator: the loss scaled before backward and the gradients unscaled before the step
        (``hfnative.optim.loss_scale``), as accelerate does there; None otherwise (``loss_scale_conflicts`` refused
        what it cannot serve when the trainer was made)."""
        return LossScale() if scales_fp16_loss(self) else None

    def _trained_parameters(self) -> list:
        """The parameters the optimizer steps (clipped together)."""
        return [p for p in self.native_model.parameters() if p.requires_grad]

    def _max_grad_norm(self) -> float:
        """The global gradient norm clipped to (inf: not clipped)."""
        max_norm = self.args.max_grad_norm
        return max_norm if max_norm and max_norm > 0 else float("inf")

    def _zero_gradients(self) -> None:
        self.native_model.zero_grad(set_to_none=True)

    def _clip_gradients(self, params) -> torch.Tensor:
        """Clips the gradients of ``params`` to ``max_grad_norm`` together: their global norm."""
        max_norm = self._max_grad_norm()
        if self.distributed is not None and self.distributed.dims.pp_enabled:  # each stage holds its parameters
            from hfnative.parallel.pipeline import clip_grad_norm_over_stages

            pp_group = self.distributed.dims.pp_mesh(self.distributed.mesh).get_group()
            return clip_grad_norm_over_stages(params, max_norm, pp_group)
        if self.distributed is not None:  # the parameters may be DTensors of several meshes
            from hfnative.parallel.grad_norm import clip_grad_norm_over_meshes

            return clip_grad_norm_over_meshes(params, max_norm)
        return torch.nn.utils.clip_grad_norm_(params, max_norm)

    def _step_parameters(self):
        """Clip, step the optimizer and clear the gradients (the schedule does not move): the gradient norm. Under fp16
        loss scaling the gradients are unscaled first, and a step whose norm overflowed is skipped
        (``_optimizer_stepped``)."""
        args = self.args
        in_backward = isinstance(self.optimizer, OptimizerInBackward)
        if not in_backward:
            params = self._trained_parameters()
            if self.distributed is not None:
                from hfnative.parallel.grad_norm import replicate_partial_gradients

                replicate_partial_gradients(params)
            if self._loss_scale is not None:
                self._loss_scale.unscale_(params)
            grad_norm = _whole(self._clip_gradients(params))
        self._optimizer_stepped = in_backward or self._loss_scale is None or self._loss_scale.update(grad_norm)
        self.control = self.callback_handler.on_pre_optimizer_step(args, self.state, self.control)
        # on CPU, optimizers that compile their own step (torchao's low-bit AdamW) run eagerly: compiling
        # one step per parameter shape costs far more than it saves there
        eager = torch.compiler.set_stance("force_eager") if self.device.type == "cpu" else nullcontext()
        with eager, self._performance.timed("optimizer"):
            if self._optimizer_stepped:
                self.optimizer.step()  # in backward: only parameters the last backward did not reach
        if in_backward:
            grad_norm = _whole(self.optimizer.grad_norm())
        self.control = self.callback_handler.on_optimizer_step(args, self.state, self.control)
        self._zero_gradients()
        return grad_norm

    def _optimizer_step(self):
        """The step's last optimizer step, then the schedule's step and the objective's ``after_optimizer_step``:
        (gradient norm, the learning rate the step used)."""
        grad_norm = self._step_parameters()
        learning_rate = self.lr_scheduler.get_last_lr()[0]
        if self._optimizer_stepped:  # a step fp16's overflow skipped leaves the schedule where it was (as transformers)
            self.lr_scheduler.step()
        self.objective.after_optimizer_step()
        return grad_norm, learning_rate


def _whole(norm: torch.Tensor) -> torch.Tensor:
    """A norm of sharded parameters (a DTensor) as the norm over every shard."""
    return norm.full_tensor() if hasattr(norm, "full_tensor") else norm


def scales_fp16_loss(trainer) -> bool:
    """Whether the trainer's run scales its loss: fp16=True on a device where it does (``scales_loss``)."""
    return bool(trainer.args.fp16) and scales_loss(trainer.device)


def loss_scale_conflicts(trainer) -> list[str]:
    """What fp16's loss scaling cannot serve, each "what: what to do" (for the trainer's one capability check)."""
    if not scales_fp16_loss(trainer) or not trainer.args.optimizer_in_backward:
        return []
    return ["fp16=True with optimizer_in_backward=True on an accelerator (fp16's loss scaling skips a step whose "
            "gradients overflowed, known only once every gradient is made, after the parameters stepped in "
            "backward): use bf16=True, or optimizer_in_backward=False"]
