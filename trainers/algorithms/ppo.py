"""PPOTrainer: TRL 0.29's ``trl.experimental.ppo.PPOTrainer`` (PPO with a value model) on the one loop.

One step of the loop is one of TRL's updates (a rollout batch of ``batch_size`` prompts, trained ``num_ppo_epochs``
times in mini-batches): see trainers/algorithms/ppo_objective.py. The policy, the reference (a frozen copy, or the policy with
its new LoRA adapters off), the reward model and the value model all run natively; the value model (a
``*ForSequenceClassification`` checkpoint with one label, or a causal LM given a new score head as RewardTrainer
does) trains beside the policy under one optimizer, and is saved beside it in ``value_model/``.
"""

from __future__ import annotations

import contextlib
from pathlib import Path

from hfnative.models.decoder import Transformer
from hfnative.optim.low_rank import LOW_RANK_NAMES

from ..running.model_loading import disable_dropout, resolve_model
from .ppo_config import KL_ESTIMATORS, PPOConfig, resolve_batch_sizes
from .ppo_objective import PPOObjective
from .reference_model import reference_source
from ..loop.saving import full_state_dict
from ..loop.trainer import Trainer

# the value model's Hub-format folder inside the output folder and every checkpoint-N (TRL never saves it)
VALUE_MODEL_DIR = "value_model"


def _len(dataset, name: str) -> int:
    if not hasattr(dataset, "__len__"):
        raise ValueError(f"{name} has no length (an IterableDataset): PPOTrainer takes a map-style Dataset, as TRL's")
    return len(dataset)


class PPOTrainer(Trainer):
    """TRL 0.29's PPOTrainer: ``PPOTrainer(args, processing_class, model, ref_model, reward_model, train_dataset,
    value_model, data_collator=None, eval_dataset=None, optimizers=(None, None), callbacks=None, peft_config=None)``.
    ``model``, ``ref_model``: causal LMs (a folder, Hub id, transformers or native model; ``ref_model`` None: a frozen
    copy of the policy, or the policy with its adapters off under ``peft_config``); ``reward_model``, ``value_model``:
    sequence classifiers with one label (a causal LM gets a new score head seeded by ``args.seed``)."""

    algorithm_name = "PPO"
    config_class = PPOConfig
    requires_train_dataset = True
    _tag_names = ["trl", "ppo"]
    _saving_policy_only = False  # save_model writes the value model apart (its folder is published whole)

    def __init__(self, args, processing_class, model, ref_model, reward_model, train_dataset, value_model,
                 data_collator=None, eval_dataset=None, optimizers=(None, None), callbacks=None, peft_config=None):
        if ref_model is model:
            raise ValueError(
                "`model` and `ref_model` cannot be the same object. If you want `ref_model` to be the same as `model`, "
                "you must make a copy of it, or `None` if you use peft."
            )
        args = self.resolve_args(args, model)
        self._check_args(args)
        if args.ref_adapter_name is not None or args.model_adapter_name is not None:
            model, ref_model = named_adapters(model, ref_model, args.model_adapter_name, args.ref_adapter_name)
        if reward_model is None or value_model is None:
            raise ValueError("PPOTrainer needs a reward_model and a value_model (sequence classifiers with one label)")
        self._dataset_length = _len(train_dataset, "train_dataset")
        self._ref_source, self._ref_given = reference_source(model, ref_model)
        self._reward_source, self._value_source = reward_model, value_model
        super().__init__(model=model, args=args, data_collator=data_collator, train_dataset=train_dataset,
                         eval_dataset=eval_dataset, processing_class=processing_class, callbacks=callbacks,
                         optimizers=optimizers, peft_config=peft_config)
        self.value_model = self._load_value_model(self._value_source)
        self.objective.value_model = self.value_model
        self._value_source = None

    @staticmethod
    def _check_args(args) -> None:
        """TRL's refusals, and what hfnative's PPO does not run."""
        if args.stop_token and args.stop_token_id:
            raise ValueError("You cannot set both `stop_token` and `stop_token_id`.")
        if args.stop_token and args.stop_token != "eos":
            raise ValueError(f"Unknown `stop_token` {args.stop_token}. Allowed values are: `'eos'` and `None` (no stop "
                             "token).")
        if args.kl_estimator not in KL_ESTIMATORS:
            raise ValueError(
                "kl_estimator must be either 'k1' (straightforward, unbiased) or 'k3' (lower variance, unbiased, appears "
                "to be a strictly better estimator). See [Approximating KL Divergence](http://joschu.net/blog/kl-approx.html) "
                "for details."
            )
        if args.optimizer_in_backward:
            raise ValueError("optimizer_in_backward with PPO: a PPO step takes several optimizer steps (epochs x "
                             "mini-batches) over the policy and the value model; set optimizer_in_backward=False")

    def _make_objective(self):
        resolve_batch_sizes(self.args, self.data_parallel.size, self._dataset_length)
        self.args.max_steps = self.args.num_total_batches  # the loop's steps are TRL's updates
        reward_model = resolve_model(self._reward_source, self.device, self._classifier_kwargs()).model
        disable_dropout(reward_model)
        users_reward_model = reward_model is self._reward_source or reward_model is getattr(self._reward_source,
                                                                                            "model", None)
        source, given = self._ref_source, self._ref_given
        self._ref_source = self._reward_source = None
        return PPOObjective(self.context, source, given, reward_model, users_reward_model)

    def _classifier_kwargs(self) -> dict:
        return {"num_labels": 1, "score_seed": self.args.seed}

    def _load_value_model(self, source) -> Transformer:
        """The value model as a native sequence classifier with one score, trainable, placed as the policy."""
        loaded = resolve_model(source, self.device, self._classifier_kwargs())
        value_model = loaded.model
        if getattr(value_model.args, "num_labels", None) != 1:
            raise ValueError(f"value_model scores {value_model.args.num_labels} labels; a value model has one "
                             "(num_labels=1)")
        value_model.requires_grad_(True).train()
        disable_dropout(value_model)
        self._value_converted = loaded.converted
        self._place(value_model)
        return value_model

    # --- one optimizer over the policy and the value model (TRL's PolicyAndValueWrapper), never clipped (TRL's PPO
    # steps accelerate's optimizer without clipping) ---------------------------------------------------------------
    def create_optimizer(self):
        if self.optimizer is None and self.optimizer_cls_and_kwargs is None:
            from hfnative.optim import build_optimizer

            self.optimizer = build_optimizer(self._trained_module(), self._optimizer_settings())
        elif self.optimizer is None:
            cls, kwargs = self.optimizer_cls_and_kwargs
            self.optimizer = cls(self._trained_parameters(), **kwargs)
        return self.optimizer

    def _optim_target_names(self):
        """GaLore / APOLLO targets are the policy's; one optimizer here steps the policy and the value model."""
        optim = str(getattr(self.args.optim, "value", self.args.optim))
        if optim in LOW_RANK_NAMES:
            raise ValueError(f"optim={optim!r} with PPO: the policy and the value model train under one optimizer "
                             "here, and GaLore / APOLLO targets are not resolved over both; choose another optim")
        return None

    def _trained_module(self):
        """The policy and the value model under one module (TRL's PolicyAndValueWrapper): one optimizer, and one
        training state in a distributed checkpoint."""
        import torch.nn as nn

        return nn.ModuleDict({"policy": self.native_model, "value_model": self.value_model})

    def _trained_parameters(self) -> list:
        return super()._trained_parameters() + [p for p in self.value_model.parameters() if p.requires_grad]

    def _max_grad_norm(self) -> float:
        return float("inf")

    def _zero_gradients(self) -> None:
        super()._zero_gradients()
        self.value_model.zero_grad(set_to_none=True)

    # --- the value model saved beside the policy, and resumed with it --------------------------------------------------
    @contextlib.contextmanager
    def _whole_model(self):
        with super()._whole_model() as native_state:
            self._value_state = None if self.distributed is None else full_state_dict(self.value_model)
            try:
                yield native_state
            finally:
                self._value_state = None

    def _save(self, output_dir: Path, native_state: dict | None = None) -> None:
        """The policy as the Trainer saves it, and (in a checkpoint) the value model in ``value_model/``."""
        super()._save(output_dir, native_state)
        if not self._saving_policy_only:
            self._save_value_model(Path(output_dir) / VALUE_MODEL_DIR)

    def save_model(self, output_dir: str | None = None, _internal_call: bool = False) -> None:
        """The policy as the Trainer saves it (what TRL's save_model writes), then the value model into
        ``value_model/`` beside it, a Hub-format sequence classifier with the tokenizer, published whole."""
        from hfnative.checkpoint import atomic_directory

        self._saving_policy_only = True
        try:
            super().save_model(output_dir, _internal_call)
        finally:
            self._saving_policy_only = False
        with self._whole_model():
            if self.state.is_world_process_zero:
                with atomic_directory(Path(output_dir or self.args.output_dir) / VALUE_MODEL_DIR) as folder:
                    self._save_value_model(folder)
        if self.distributed is not None:
            self.distributed.barrier()

    def _save_value_model(self, folder: Path) -> None:
        from hfnative.converters.export import export_hf, save_tokenizer

        state = getattr(self, "_value_state", None)
        if self._value_converted is not None:
            export_hf(self._value_converted, folder, processing_class=self.processing_class, native_state=state)
            return
        from safetensors.torch import save_file

        folder.mkdir(parents=True, exist_ok=True)
        state = state or {k: v.detach().cpu().contiguous() for k, v in self.value_model.state_dict().items()}
        save_file(state, str(folder / "model.safetensors"), metadata={"format": "pt"})
        save_tokenizer(folder, self.processing_class)

    def _load_model_weights(self, checkpoint: Path) -> None:
        super()._load_model_weights(checkpoint)
        folder = Path(checkpoint) / VALUE_MODEL_DIR
        if not folder.is_dir():
            raise ValueError(f"{checkpoint} has no {VALUE_MODEL_DIR}/: it was not written by a PPOTrainer, whose "
                             "checkpoints hold the value model beside the policy")
        if self._value_converted is None:
            from safetensors.torch import load_file

            self.value_model.load_state_dict(load_file(str(folder / "model.safetensors")))
            return
        from hfnative.converters.families import model_pieces
        from hfnative.converters.loading import SafetensorsSource, check_checkpoint, copy_into_model
        from hfnative.converters.sharded_loading import copy_shards_into_model

        source = SafetensorsSource(folder)
        pieces = model_pieces(self._value_converted.family, self.value_model.args)
        check_checkpoint(source, pieces, self.value_model, str(folder))
        (copy_into_model if self.distributed is None else copy_shards_into_model)(source, pieces, self.value_model)

    @property
    def ref_model(self):
        """The frozen reference (None when it is the policy with its adapters off)."""
        return self.objective.reference.model

    @property
    def reward_model(self):
        return self.objective.auxiliary_models["reward_model"]


def named_adapters(model, ref_model, trained_name: str | None, ref_name: str | None):
    """TRL's LoRA policy with several named adapters (``model_adapter_name``, ``ref_adapter_name``): ``model`` a peft
    PeftModel holding the trained adapter (``trained_name``, default "default") and, when ``ref_name`` is set, the
    reference's. Returns (the policy, the reference): the policy is ``model`` with the trained adapter active and the
    reference adapter taken out of it; the reference is the base with the reference adapter merged into a copy (TRL
    switches that adapter on in its reference passes: the same weights), or ``ref_model`` (None: the policy with its
    adapters off) when no reference adapter is named."""
    import copy

    try:
        from peft import PeftModel
    except ImportError:  # no peft: no PeftModel either
        PeftModel = ()
    if not isinstance(model, PeftModel):
        raise ValueError(f"model_adapter_name / ref_adapter_name name adapters of a peft PeftModel; `model` is a "
                         f"{type(model).__name__}: pass the PeftModel that holds them")
    trained = trained_name or "default"
    held = set(model.peft_config)
    missing = [name for name in (trained, ref_name) if name is not None and name not in held]
    if missing:
        raise ValueError(f"the PeftModel holds the adapters {sorted(held)}, not {missing} (model_adapter_name="
                         f"{trained_name!r}, ref_adapter_name={ref_name!r})")
    others = sorted(held - {trained, ref_name})
    if others:
        raise ValueError(f"the PeftModel holds the adapters {others} besides the trained {trained!r}"
                         + (f" and the reference {ref_name!r}" if ref_name else "")
                         + ": remove them (PeftModel.delete_adapter) before training")
    if ref_name is not None and ref_model is not None:
        raise ValueError(f"ref_adapter_name={ref_name!r} names the reference: pass ref_model=None")
    if ref_name is not None:
        reference = copy.deepcopy(model)
        reference.set_adapter(ref_name)
        ref_model = reference.merge_and_unload(adapter_names=[ref_name])
        model.delete_adapter(ref_name)
    model.set_adapter(trained)
    return model, ref_model


def ppo_trainer_kwargs(script_args, training_args, model_args) -> dict:
    """TRL's PPO example (examples/scripts/ppo/ppo.py): the tokenizer of the model, left-padded (its EOS as the pad
    token when it has none); the reward and the value model both from ``reward_model_path``; the reference a frozen
    copy of the policy (the policy with its adapters off under --use_peft)."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_args.model_name_or_path, padding_side="left",
                                              revision=model_args.model_revision)
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    return {"processing_class": tokenizer, "ref_model": None, "reward_model": training_args.reward_model_path,
            "value_model": training_args.reward_model_path}


def cli_command():
    """``hfnative-train ppo``: TRL's PPO example's arguments; the dataset's ``prompt`` column (text or messages) is
    tokenized, or its ``input_ids`` taken as they are."""
    from ..running import cli

    return cli.Command("Proximal Policy Optimization with a value model (TRL 0.29's PPO example)", PPOConfig,
                       PPOTrainer, cli.train_model, trainer_kwargs=ppo_trainer_kwargs)


__all__ = ["PPOConfig", "PPOTrainer"]
