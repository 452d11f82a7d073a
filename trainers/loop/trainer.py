"""Trainer: transformers' Trainer interface over hfnative's native engine.

The loop reads top to bottom in ``train``: for each optimizer step it fetches the step's
micro-batches, counts their label tokens, runs forward + loss + backward per micro-batch
(each loss divided by the whole step's token count), clips, steps the optimizer and scheduler,
then logs / evaluates / saves as transformers' DefaultFlowCallback decides. Callbacks are
transformers' own classes, so users' callbacks work unchanged.
"""

from __future__ import annotations

import functools
import logging
import math
import os
import sys
import time
from contextlib import ExitStack, nullcontext
from pathlib import Path

import torch
import transformers
from transformers.trainer_callback import (
    CallbackHandler,
    DefaultFlowCallback,
    ExportableState,
    PrinterCallback,
    ProgressCallback,
    TrainerControl,
)
from transformers.trainer_utils import TrainerMemoryTracker, TrainOutput, speed_metrics

from hfnative.models.decoder import Transformer
from hfnative.allocator import keep_freed_cpu_memory, pool_cpu_tensors, pool_requested
from hfnative.optim.in_backward import OptimizerInBackward, check_optimizer_in_backward_args
from hfnative.parallel.groups import DataParallelGroup
from hfnative.parallel.teardown import end_process_group

from ..running import hub
from .arguments import TrainingArguments, mixed_precision_dtype
from ..running.construction import (
    as_config,
    check_peft_config,
    check_train_dataset,
    head_tied_to_embedding,
    model_init_kwargs,
    train_new_tokens,
)
from .batch_size_search import batch_size_search_conflicts, train_finding_batch_size
from .data_loading import DataMixin, has_length, start_epoch, worker_options
from .hyperparameter_search import HyperparameterSearchMixin
from .overrides import check_overrides
from .training_features import TrainingFeaturesMixin
from ..running.distributed import (
    DistributedMixin,
    is_collective_failure,
    start_distributed,
)
from .evaluation import EvaluationMixin
from .model_mixin import ModelMixin
from ..running.model_loading import disable_dropout, load_processing_class
from .objective import (
    LanguageModelingObjective,
    MetricAverages,
    Objective,
    ObjectiveContext,
    check_supported,
    without_labels,
)
from .optimization import OptimizationMixin, loss_scale_conflicts
from .performance import StepPerformance, warn_if_cpu_low_precision_is_slow
from .pipeline_training import PipelineMixin, pipeline_conflicts
from .preemption import SIGTERM_REASON, STOPPED_BY, Preemption
from .run_guard import check_run_can_start
from .saving import SavingMixin
from ..running.settings_check import apply_accelerator_config, check_settings, seed_everything, set_log_level

logger = logging.getLogger(__name__)

def resolve_device(args) -> torch.device:
    if args.use_cpu or not torch.cuda.is_available():
        return torch.device("cpu")
    # a launcher that shows each process only its own GPU (one visible device) leaves LOCAL_RANK past it
    return torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)) % torch.cuda.device_count())


class Trainer(ModelMixin, DataMixin, DistributedMixin, PipelineMixin, OptimizationMixin, EvaluationMixin, SavingMixin,
              HyperparameterSearchMixin, TrainingFeaturesMixin):
    """transformers.Trainer's constructor, methods and outputs, running hfnative's engine.

    ``model``: a model folder or Hub id, a transformers PreTrainedModel (converted in memory),
    an hfnative ConvertedModel, or a native ``Transformer``. The TRL trainers' ``quantization_config`` and
    ``peft_config`` are keyword-only here. A trainer class states what differs in its construction in the four
    class attributes below; the steps themselves are trainers/running/construction.py's.
    """

    config_class = TrainingArguments  # ``args`` is made one of these (TRL's default output_dir for a TRL config)
    algorithm_name = "the Trainer"  # the model card's algorithm, and the suffix of TRL's default output_dir
    requires_train_dataset = False  # TRL's trainers refuse to be built without one; transformers' Trainer does not
    # a quantization_config with a model object: an error (TRL's DPOTrainer), else a warning that it is ignored
    refuses_quantization_of_instances = False
    # how the trainer loads the tokenizer when none is given (TRL's RL trainers: padded and truncated on the left)
    loaded_tokenizer_kwargs: dict = {}
    _last_micro_batch = True  # is the micro-batch in training_step the optimizer step's last one
    _current_accumulation_steps = 1  # this rank's micro-batches in the step being trained
    _stopped_by: str | None = None  # why train() stopped before its last step (enable_jit_checkpoint: "SIGTERM")
    _preemption: Preemption | None = None  # the SIGTERM flag while train() runs with enable_jit_checkpoint
    _loss_divisor = 1  # what training_step divides a micro-batch's loss by (the step's normalization; 1: nothing)
    _logged_share = 1.0  # the share of that loss the logs count (summed micro-batch means log their mean)
    _tag_names: list[str] = []
    dataset_name: str | None = None  # shown on the model card (the CLI sets it)
    hub_model_id: str | None = None  # the Hub repository's full id, set by the first push (trainers/running/hub.py)
    peft_config = None  # the TRL trainers' peft_config: LoRA / DoRA adapters put on the model as it is loaded

    def __init__(
        self,
        model=None,
        args: TrainingArguments | None = None,
        data_collator=None,
        train_dataset=None,
        eval_dataset=None,
        processing_class=None,
        model_init=None,
        compute_loss_func=None,
        compute_metrics=None,
        callbacks=None,
        optimizers=(None, None),
        optimizer_cls_and_kwargs=None,
        preprocess_logits_for_metrics=None,
        *,
        quantization_config=None,
        peft_config=None,
    ):
        self.args = self.resolve_args(args, model)
        if self.requires_train_dataset:
            check_train_dataset(train_dataset, type(self).__name__)
        check_peft_config(peft_config, model)
        self.peft_config = peft_config
        if self.args.optimizer_in_backward:
            check_optimizer_in_backward_args(self.args.max_grad_norm)
        check_settings(self.args)  # nothing hfnative would ignore is set
        apply_accelerator_config(self.args)  # gradient_accumulation_kwargs' num_steps, as transformers' Trainer
        check_overrides(type(self))  # nor a transformers hook the loop never calls overridden
        worker_options(self.args)  # the loaders' worker fields agree, checked before anything loads
        # transformers' memory metrics (skip_memory_metrics=False): init_/train_/eval_/test_mem_cpu_*_delta and, on a
        # GPU, *_mem_gpu_*; its start() and stop_and_update_metrics() name the stage after the calling method
        self._memory_tracker = TrainerMemoryTracker(self.args.skip_memory_metrics)
        self._memory_tracker.start()
        seed_everything(self.args)
        self.device = resolve_device(self.args)
        self.distributed = start_distributed(self.args, self.device)  # None for a single process
        run = self.distributed
        set_log_level(self.args, 0 if run is None else run.rank, 0 if run is None else run.local_rank)
        self.data_parallel = DataParallelGroup(None if run is None or run.dp_size == 1 else run.dp_mesh, self.device)
        self.context = ObjectiveContext(self)  # what the objective sees of the run
        self._performance = StepPerformance(self.device, 1 if run is None else run.world_size,
                                            self.context_parallel.size, getattr(self.args, "peak_tflops", None))
        if model is None and model_init is None:
            raise RuntimeError(
                "`Trainer` requires either a `model` or `model_init` argument (a path, a Hub id or a model object)"
            )
        self.model_init = model_init
        self._model_init_kwargs = model_init_kwargs(model, self.args, quantization_config,
                                                    self.refuses_quantization_of_instances)
        self._set_model(model if model is not None else self.call_model_init(),
                        before_adapters=functools.partial(self._set_processing_class, processing_class))
        if getattr(self.args, "disable_dropout", False):  # the TRL configs that have the option
            disable_dropout(self.native_model)

        self.compute_loss_func = compute_loss_func
        self.compute_metrics = compute_metrics
        self.preprocess_logits_for_metrics = preprocess_logits_for_metrics
        self.optimizer, self.lr_scheduler = optimizers
        self.optimizer_cls_and_kwargs = optimizer_cls_and_kwargs
        if self.optimizer_cls_and_kwargs is not None and self.optimizer is not None:
            raise RuntimeError("Passing both `optimizers` and `optimizer_cls_and_kwargs` arguments is incompatible.")
        if self.model_init is not None and (self.optimizer is not None or self.lr_scheduler is not None):
            raise RuntimeError(
                "Passing a `model_init` is incompatible with providing the `optimizers` argument: the model (and its "
                "parameters) is rebuilt at train(); subclass the trainer and override `create_optimizer_and_scheduler`"
            )
        if self.optimizer is not None and isinstance(model, transformers.PreTrainedModel) and isinstance(self.native_model, Transformer):
            raise ValueError(
                "optimizers=(optimizer, scheduler) were built over the transformers model's parameters, but hfnative "
                "trains a native copy of it; pass `optimizer_cls_and_kwargs=(cls, kwargs)` instead"
            )
        self.data_collator = data_collator
        self.objective = self._make_objective()
        self._check_supported()
        self._build_auxiliary_models()
        self.objective.auxiliary_models_ready()
        self._aux_loss_enabled = self._router_loss_rule()  # decided once, as TRL's trainers decide it
        self._metrics = {"train": MetricAverages(), "eval": MetricAverages()}
        self.train_dataset, self.eval_dataset = self.objective.prepare_datasets(train_dataset, eval_dataset)
        if self.data_collator is None:
            self.data_collator = self.objective.default_collator()

        default_callbacks = [DefaultFlowCallback, *transformers.integrations.get_reporting_integration_callbacks(self.args.report_to)]
        progress = PrinterCallback if self.args.disable_tqdm else ProgressCallback
        self.callback_handler = CallbackHandler(
            default_callbacks + list(callbacks or []) + [progress], self.model, self.processing_class, self.optimizer, self.lr_scheduler
        )
        self.state = self._new_state()
        self.control = TrainerControl()
        self.control = self.callback_handler.on_init_end(self.args, self.state, self.control)
        self._memory_tracker.stop_and_update_metrics()

    # --- hooks subclasses specialise -----------------------------------------------------------

    @classmethod
    def resolve_args(cls, args, model):
        """``args`` as this trainer's ``config_class`` (TRL's default when None); a subclass that reads its
        arguments before ``Trainer.__init__`` calls this first."""
        return as_config(args, cls.config_class, model, cls.algorithm_name)

    def _set_processing_class(self, processing_class) -> None:
        """``processing_class`` (or the model folder's tokenizer) and the config's tokenizer settings on it
        (``_tokenizer_settings``), between loading the weights and adding the adapters, as TRL orders them."""
        self.processing_class = (processing_class if processing_class is not None
                                 else load_processing_class(self.converted, **self.loaded_tokenizer_kwargs))
        added = self._tokenizer_settings()
        if added and self.peft_config is not None:
            train_new_tokens(self.peft_config, added, tied_head=head_tied_to_embedding(self.native_model))

    def _tokenizer_settings(self) -> list[int]:
        """The config's settings of the tokenizer that come before the adapters (a trainer's own: SFTConfig's
        eos_token and chat_template_path, say); returns the ids of the tokens they added, which the adapters then
        train (``train_new_tokens``). None here."""
        return []

    def _make_objective(self):
        """The algorithm's piece of the loop (see trainers/loop/objective.py), built on ``self.context``."""
        return LanguageModelingObjective(self.context)

    @property
    def is_in_train(self) -> bool:
        """Whether train() is running."""
        return self.__dict__.get("_in_train", False)

    def compute_loss_context_manager(self):
        """transformers' context for a compute_loss override's own forwards; the loop runs compute_loss under the
        run's autocast already, as accelerate does for transformers, so it adds nothing."""
        return ExitStack()

    def autocast_smart_context_manager(self, cache_enabled: bool | None = True):
        return nullcontext()  # as transformers: autocast is the loop's (see compute_loss_context_manager)

    def _check_supported(self, evaluating: bool = False) -> None:
        """The one place a run's layout, features and settings are checked against what its objective declares."""
        check_supported(self.objective, self.context, evaluating, algorithm=type(self).__name__,
                        conflicts=pipeline_conflicts(self, evaluating) + self._context_parallel_conflicts(evaluating)
                        + loss_scale_conflicts(self) + self._sampling_conflicts() + batch_size_search_conflicts(self)
                        + self._evaluation_conflicts(evaluating) + self._token_rows_conflicts())

    def _token_rows_conflicts(self) -> list[str]:
        """A head tied to the embedding that trains token rows of its own: no plain model holds it, and rollouts
        through vLLM, over several processes or in async GRPO's actors decode a plain copy (the native engine on one
        process decodes the model itself)."""
        from hfnative.peft.token_rows import tied_head_apart

        model = getattr(self, "native_model", None)
        if not (isinstance(model, Transformer) and tied_head_apart(model) and self.objective.generates()):
            return []
        if not (self.context.world_size > 1 or getattr(self.args, "use_vllm", False)
                or self.objective.decodes_a_copy):
            return []
        return ["trainable_token_indices giving lm_head rows other than embed_tokens' on a model whose head is tied "
                "to its embedding, with rollouts that decode a plain copy of the policy (vLLM, several processes, "
                "async GRPO): give lm_head the embedding's rows (or leave it out of trainable_token_indices)"]

    @property
    def batches_are_dataset_rows(self) -> bool:
        """Whether the loop's batches are rows of the train dataset drawn by the objective's default loader (not
        batches the trainer makes itself: prompt groups for generation, rollouts)."""
        return type(self.objective).train_dataloader is Objective.train_dataloader

    def _sampling_conflicts(self) -> list[str]:
        """group_by_length and batch_rebalance order the rows of the loop's own batches; a trainer that makes its
        batches otherwise (prompt groups for generation, rollouts) would not follow them."""
        strategy = getattr(self.args, "train_sampling_strategy", None)
        if strategy not in ("group_by_length", "batch_rebalance") or self.batches_are_dataset_rows:
            return []
        return [f"train_sampling_strategy={strategy!r} with {type(self).__name__}, whose batches are made by the "
                "trainer itself (prompt groups, rollouts), not drawn row by row: use 'random' or 'sequential'"]

    def _context_parallel_conflicts(self, evaluating: bool) -> list[str]:
        """Under context parallelism each rank holds a slice of every sequence: no loss or metric over whole outputs."""
        run = self.distributed
        if run is None or not run.dims.cp_enabled:
            return []
        conflicts = []
        if self.compute_loss_func is not None:
            conflicts.append(f"compute_loss_func with context parallelism (cp_size={run.dims.cp}): each rank holds a "
                             "slice of every sequence, so a loss over the model's outputs and labels cannot be computed "
                             "there; set cp_size=1 or drop compute_loss_func")
        if evaluating and self.compute_metrics is not None:
            conflicts.append(f"compute_metrics with context parallelism (cp_size={run.dims.cp}): each rank holds a slice "
                             "of every sequence's logits; evaluate the loss only (drop compute_metrics) or set cp_size=1")
        if not self.args.average_tokens_across_devices and self.objective.follows_average_tokens_across_devices:
            conflicts.append(f"average_tokens_across_devices=False with context parallelism (cp_size={run.dims.cp}): a "
                             "data-parallel rank's tokens are spread over its context-parallel ranks; leave it True "
                             "(the step's loss over all its tokens) or set cp_size=1")
        return conflicts

    # --- forward and loss ------------------------------------------------------------------------

    def _activation_offloading(self):
        """SFTConfig.activation_offloading: tensors kept for backward live in (pinned) CPU memory
        until backward needs them; on a CPU device they stay where they are."""
        if getattr(self.args, "activation_offloading", False) and self.device.type != "cpu":
            return torch.autograd.graph.save_on_cpu(pin_memory=True)
        return nullcontext()

    def _autocast(self):
        dtype = mixed_precision_dtype(self.args)
        return nullcontext() if dtype is None else torch.autocast(self.device.type, dtype=dtype)

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        """The objective's loss (summed over label tokens / num_items_in_batch, the whole optimizer
        step's count, or the batch's token mean when no count is given); its metrics are kept for
        the next log. With ``compute_loss_func``: that function on the model's outputs, as transformers."""
        if self.compute_loss_func is not None:
            outputs = model(**without_labels(inputs))
            loss = self.compute_loss_func(outputs, inputs["labels"], num_items_in_batch=num_items_in_batch)
            return (loss, outputs) if return_outputs else loss
        loss, metrics = self.objective.loss(model, inputs, num_items_in_batch)
        self._metrics["train" if model.training else "eval"].record(metrics)
        if return_outputs:
            self._warn_logits_for_metrics()
            with torch.no_grad():
                outputs = model(**without_labels(inputs))
            return loss, outputs
        return loss

    def training_step(self, model, inputs, num_items_in_batch=None) -> torch.Tensor:
        model.train()
        self._optimizer_mode("train")
        inputs = self._prepare_inputs(inputs)
        with self._autocast(), self._activation_offloading(), self._performance.timed("fwd"):
            loss = self.compute_loss(model, inputs, num_items_in_batch=num_items_in_batch)
        loss = loss / self._loss_divisor  # e.g. a micro-batch mean: its share of the step's mean over every rank
        empty_cache = self.args.torch_empty_cache_steps
        if empty_cache is not None and self.state.global_step % empty_cache == 0:  # as transformers: before backward
            from accelerate.utils.memory import clear_device_cache

            clear_device_cache()
        # with optimizer-in-backward, parameters step inside the last micro-batch's backward only
        accumulate_only = isinstance(self.optimizer, OptimizerInBackward) and not self._last_micro_batch
        with self.optimizer.accumulating() if accumulate_only else nullcontext():
            (loss if self._loss_scale is None else self._loss_scale.scaled(loss)).backward()
        return loss.detach() * self._logged_share

    # --- the loop --------------------------------------------------------------------------------

    def train(self, resume_from_checkpoint: str | bool | None = None, trial=None, ignore_keys_for_eval=None, **kwargs):
        """transformers' ``train``. With ``enable_jit_checkpoint`` a SIGTERM ends it after the step it arrived in:
        ``checkpoint-N`` is saved and ``SystemExit(0)`` raised (trainers/loop/preemption.py). In a distributed run a
        failed or timed-out collective (a rank died or hung, ``ddp_timeout``) raises ``RankFailureError`` naming
        the ranks that did not answer and the last completed step."""
        if kwargs:
            raise TypeError(f"train() got unexpected keyword arguments: {sorted(kwargs)}")
        self._stopped_by = None
        self._preemption = None
        self._memory_tracker.start()
        self._trial = trial  # a hyperparameter search's trial (hyperparameter_search.py)
        if self.model_init is not None:
            self._remake_model()
        # a search trial's arguments, set after the model is made again (transformers' order: model_init runs with
        # the seed set before the trial's) and before a batch size search starts from them
        self._hp_search_setup(trial)
        self._watch_underflow_overflow()
        neftune = self._activate_neftune()
        self._in_train = True
        if self.args.enable_jit_checkpoint:
            self._preemption = Preemption(self.distributed is not None, self.device)
            self._preemption.install()
        try:
            if self.args.auto_find_batch_size:
                output = train_finding_batch_size(self, resume_from_checkpoint)
            else:
                output = self._train(resume_from_checkpoint)
        except Exception as error:
            if self.distributed is not None and is_collective_failure(error):
                raise self.distributed.failure(error, self.state.global_step, self.args) from error
            raise
        finally:
            self._stop_memory_tracker("train")  # a train() that failed or was stopped: its sampling thread too
            self._in_train = False
            if neftune is not None:
                neftune.remove()
            if self._preemption is not None:
                self._preemption.uninstall()
            self._performance.unwatch()
            self.objective.end_training()
        if self._stopped_by is not None:
            logger.warning("stopped by %s at step %d with checkpoint-%d saved: exiting with status 0",
                           self._stopped_by, self.state.global_step, self.state.global_step)
            raise SystemExit(0)
        self.update_given_model()
        return output

    def _remake_model(self) -> None:
        """``model_init``'s model, made again at each train() (a hyperparameter search trial's, with the trial), from
        the run's seed; the optimizer and scheduler are made again for it."""
        seed_everything(self.args)
        if isinstance(self.optimizer, OptimizerInBackward):
            self.optimizer.remove_hooks()
        self._set_model(self.call_model_init(self._trial))
        self.optimizer = self.lr_scheduler = None

    def _train(self, resume_from_checkpoint):
        args = self.args
        self._trained = True  # (evaluation.py: what an evaluation reports before any training)
        checkpoint = self._resolve_checkpoint(resume_from_checkpoint)
        if self.device.type == "cpu":
            keep_freed_cpu_memory()
            if pool_requested():  # opt-in: a preloaded tcmalloc / jemalloc does about as well (README)
                pool_cpu_tensors()
            if self.is_world_process_zero():
                warn_if_cpu_low_precision_is_slow(args)

        dataloader = self.get_train_dataloader()
        accumulation = args.gradient_accumulation_steps
        if has_length(dataloader.dataset):
            batches_per_epoch = len(dataloader)
            steps_per_epoch = max(math.ceil(batches_per_epoch / accumulation), 1)
            if args.max_steps > 0:
                max_steps = args.max_steps
                num_epochs = math.ceil(max_steps / steps_per_epoch)
            else:
                max_steps = math.ceil(args.num_train_epochs * steps_per_epoch)
                num_epochs = math.ceil(args.num_train_epochs)
        elif args.max_steps > 0:
            max_steps, num_epochs = args.max_steps, sys.maxsize
            steps_per_epoch, batches_per_epoch = max_steps, max_steps * accumulation
        else:
            raise ValueError("train_dataset has no length (an IterableDataset): set max_steps > 0")
        num_train_samples = max_steps * args.per_device_train_batch_size * accumulation
        check_run_can_start(self, dataloader)  # something to train on; output_dir writable and not in use

        self.state = self._new_state(
            stateful_callbacks=[cb for cb in self.callback_handler.callbacks + [self.control] if isinstance(cb, ExportableState)],
        )
        self.state.max_steps, self.state.num_train_epochs = max_steps, num_epochs
        self.state.train_batch_size = args.per_device_train_batch_size
        self.state.compute_steps(args, max_steps)
        self.create_optimizer_and_scheduler(max_steps)
        self._loss_scale = self._new_loss_scale()
        if checkpoint is not None:
            self._load_checkpoint(checkpoint)
        self.callback_handler.model, self.callback_handler.optimizer = self.model, self.optimizer
        self._watch_performance()
        self.callback_handler.lr_scheduler, self.callback_handler.train_dataloader = self.lr_scheduler, dataloader

        epochs_trained = self.state.global_step // steps_per_epoch
        # ignore_data_skip: the resumed epoch starts from its first batch (transformers' fast-forward left out)
        replay = args.ignore_data_skip and not self.objective.always_skips_trained_batches
        batches_to_skip = 0 if replay else (self.state.global_step % steps_per_epoch) * accumulation
        start_time = time.time()
        initial_step = self.state.global_step
        self._input_tokens_local, self._initial_num_input_tokens_seen = 0, self.state.num_input_tokens_seen
        self._tr_loss = torch.zeros((), device=self.device)
        self._total_loss_scalar = 0.0
        self._globalstep_last_logged = self.state.global_step
        self._zero_gradients()
        self.control = self.callback_handler.on_train_begin(args, self.state, self.control)
        if args.eval_on_start:
            self._evaluate_and_track_best()

        grad_norm = learning_rate = None
        for epoch in range(epochs_trained, num_epochs):
            skip = batches_to_skip if epoch == epochs_trained else 0
            if checkpoint is not None and epoch == epochs_trained:
                self._restore_rng(checkpoint)
            epoch_iterator = start_epoch(dataloader, epoch, skip)
            self.control = self.callback_handler.on_epoch_begin(args, self.state, self.control)
            step = skip - 1
            last_group = batches_per_epoch % accumulation or accumulation
            for update_step in range(skip // accumulation, steps_per_epoch):
                wanted = accumulation if update_step != steps_per_epoch - 1 else last_group
                self._performance.step_started()  # the step's time includes making its micro-batches (generation)
                # a schedule-free optimizer's training weights before the step's rollouts are generated (TRL
                # generates after transformers' training_step has called optimizer.train())
                self._optimizer_mode("train")
                batches = self.objective.micro_batches(epoch_iterator, wanted)
                if not batches:
                    self._performance.step_cancelled()
                    break
                # the normalizer counts on the host batches (no device read), then they move to the device
                batches = [self._complete_on_host(b) for b in batches]
                self._count_input_tokens(batches)
                self._current_accumulation_steps = len(batches)
                normalization = self._step_normalizer(self.objective.normalizer(batches), len(batches))
                self._loss_divisor, self._logged_share = normalization.divisor, normalization.logged_share
                if self._pipeline_parallel is not None:  # the step's micro-batches go through the pipeline stages together
                    step += len(batches)
                    self._pipeline_step(batches, normalization.items)  # (from the host: padded there, then moved)
                    batches = []
                batches = [self._to_device(b) for b in batches]
                for index, inputs in enumerate(batches):
                    step += 1
                    self._last_micro_batch = index == len(batches) - 1
                    if index == 0:
                        self.control = self.callback_handler.on_step_begin(args, self.state, self.control)
                    with self._performance.timed("fwd_bwd"):
                        loss = self.training_step(self.native_model, inputs, normalization.items[index])
                    if args.logging_nan_inf_filter:  # on the device: no host read of the loss
                        mean = self._tr_loss / (1 + self.state.global_step - self._globalstep_last_logged)
                        loss = torch.where(torch.isfinite(loss), loss, mean)
                    self._tr_loss += loss
                    self.state.total_flos += self.floating_point_ops(inputs)
                    if index < len(batches) - 1:
                        if self.objective.steps_optimizer_after(index):
                            self._step_parameters()
                        self.control = self.callback_handler.on_substep_end(args, self.state, self.control)
                grad_norm, learning_rate = self._optimizer_step()
                self._performance.step_ended()
                self.state.global_step += 1
                self.state.epoch = epoch + (step + 1) / batches_per_epoch
                self.control = self.callback_handler.on_step_end(args, self.state, self.control)
                self._stop_if_preempted()
                self._maybe_log_save_evaluate(grad_norm, learning_rate, start_time)
                if self.control.should_epoch_stop or self.control.should_training_stop:
                    break
            self.control = self.callback_handler.on_epoch_end(args, self.state, self.control)
            if self._stopped_by is None:  # a preempted step is saved already; no evaluation in the grace period
                self._maybe_log_save_evaluate(grad_norm, learning_rate, start_time)
            if self.control.should_training_stop:
                break
        return self._finish_training(start_time, initial_step, num_train_samples)

    def end(self) -> None:
        """transformers' ``end``: the process group the trainer joined, ended; call it once, last in a script (train,
        evaluate, predict, save_model and push_to_hub communicate between the processes)."""
        end_process_group()

    def _watch_performance(self) -> None:
        """The perf/ metrics count the forwards of the policy and of the objective's frozen models."""
        args = self.args
        performance = self._performance
        performance.dtype = mixed_precision_dtype(args) or next(self.native_model.parameters()).dtype
        performance.watch([self.native_model, *self.objective.auxiliary_models.values()])

    def _maybe_log_save_evaluate(self, grad_norm, learning_rate, start_time):
        if self.control.should_log or self.control.should_save:
            self._gather_input_tokens()
        if self.control.should_log and self.state.global_step > self._globalstep_last_logged:
            tr_loss = self._summed_over_ranks(self._tr_loss).item()
            self._tr_loss.zero_()
            logs = {"loss": tr_loss / (self.state.global_step - self._globalstep_last_logged)}
            if grad_norm is not None:
                logs["grad_norm"] = float(grad_norm)
            logs["learning_rate"] = learning_rate
            logs.update(self._performance.pop(lambda values: self._reduce_metrics(values, [True] * len(values))))
            self._total_loss_scalar += tr_loss
            self._globalstep_last_logged = self.state.global_step
            self.log(logs, start_time)
        if self.control.should_evaluate:
            is_new_best = self._evaluate_and_track_best()
            if self.args.save_strategy == "best":
                self.control.should_save = is_new_best
        if self.control.should_save:
            stopping = self._stopped_by is not None
            if stopping and not (self.state.log_history and STOPPED_BY in self.state.log_history[-1]):
                self.state.log_history.append({STOPPED_BY: self._stopped_by, "epoch": self.state.epoch,
                                               "step": self.state.global_step})
            with self._preemption.saving() if self._preemption is not None else nullcontext():
                self._save_checkpoint()
            self.control = self.callback_handler.on_save(self.args, self.state, self.control)

    def _stop_if_preempted(self) -> None:
        """At the end of an optimizer step (every rank, with enable_jit_checkpoint): when any rank got SIGTERM,
        this step is saved, without evaluating, and training stops."""
        if self._preemption is None or not self._preemption.agreed():
            return
        self._stopped_by = SIGTERM_REASON
        self.control.should_save, self.control.should_evaluate = True, False
        self.control.should_training_stop = True

    def _finish_training(self, start_time, initial_step, num_train_samples) -> TrainOutput:
        self._gather_input_tokens()
        self._total_loss_scalar += self._summed_over_ranks(self._tr_loss).item()
        steps_done = self.state.global_step - initial_step
        train_loss = self._total_loss_scalar / max(steps_done, 0.001)
        runtime = time.time() - start_time
        samples = num_train_samples * steps_done / max(self.state.max_steps, 1)
        metrics = {
            "train_runtime": round(runtime, 4),
            "train_samples_per_second": round(samples / runtime, 3),
            "train_steps_per_second": round(steps_done / runtime, 3),
            "total_flos": self.state.total_flos,
            "train_loss": train_loss,
        }
        self._stop_memory_tracker("train")
        self._memory_tracker.update_metrics("train", metrics)  # with the init stage's, as transformers reports them
        self.log(metrics)
        if self.args.load_best_model_at_end and self.state.best_model_checkpoint and self._stopped_by is None:
            self._load_model_weights(Path(self.state.best_model_checkpoint))
        self.control = self.callback_handler.on_train_end(self.args, self.state, self.control)
        hub.wait_for_push(self)  # the last checkpoint's upload
        return TrainOutput(self.state.global_step, train_loss, metrics)

    # --- logging and evaluation ------------------------------------------------------------------

    def log(self, logs: dict[str, float], start_time: float | None = None) -> None:
        """Adds the objective's metrics since the last log (eval_-prefixed in evaluation) and the epoch."""
        mode = "train" if self.native_model.training else "eval"
        self.objective.on_log(logs, mode)
        metrics = self._pop_metrics(mode)
        if mode == "eval":
            metrics = {f"eval_{key}": value for key, value in metrics.items()}
        logs.update(metrics)
        if self.state.epoch is not None:
            logs["epoch"] = self.state.epoch
        if self.args.include_num_input_tokens_seen != "no":  # transformers' keys, a training log's speed with them
            logs["num_input_tokens_seen"] = self.state.num_input_tokens_seen
            if start_time is not None:
                seen = self.state.num_input_tokens_seen - self._initial_num_input_tokens_seen
                logs.update(speed_metrics("train", start_time, num_tokens=seen))
        self.state.log_history.append({**logs, "step": self.state.global_step})
        self.control = self.callback_handler.on_log(self.args, self.state, self.control, logs)
        self.objective.after_log(logs, mode)

    # --- callbacks -------------------------------------------------------------------------------

    def add_callback(self, callback):
        self.callback_handler.add_callback(callback)

    def pop_callback(self, callback):
        return self.callback_handler.pop_callback(callback)

    def remove_callback(self, callback):
        self.callback_handler.remove_callback(callback)
