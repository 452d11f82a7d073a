"""Evaluation for the Trainer: eval loss, compute_metrics on logits, best-metric tracking; predict."""

from __future__ import annotations

import time
import warnings

import torch
from transformers.trainer_utils import EvalPrediction, PredictionOutput, denumpify_detensorize

from hfnative.losses import IGNORE_INDEX


class EvaluationMixin:
    """evaluate() / prediction_step() as transformers' Trainer, on the native model."""

    # TRL's FutureWarning when its compute_loss(return_outputs=True) recomputes the logits for compute_metrics (its
    # SFT, DPO and KTO trainers, in evaluation with compute_metrics): the trainer's text, or None
    logits_for_metrics_warning: str | None = None

    def _warn_logits_for_metrics(self) -> None:
        if self.logits_for_metrics_warning is not None:
            warnings.warn(self.logits_for_metrics_warning, FutureWarning, stacklevel=3)

    def prediction_step(self, model, inputs, prediction_loss_only=True, ignore_keys=None):
        """(loss, logits, labels) of one evaluation batch: the objective's loss when the batch has one (see
        ``Objective.has_eval_loss``), and with compute_metrics the objective's logits and labels."""
        run = self.distributed
        if run is not None and run.dims.cp_enabled:
            return self._context_parallel_prediction_step(model, inputs, prediction_loss_only)
        inputs = self._prepare_inputs(self.objective.eval_batch(inputs))
        labels = None
        with torch.no_grad(), self._autocast():
            has_loss = self.objective.has_eval_loss(inputs)
            loss = self.compute_loss(model, inputs, num_items_in_batch=self._eval_items(inputs)) if has_loss else None
            logits = None
            if not prediction_loss_only:
                self._warn_logits_for_metrics()
                logits, labels = self.objective.eval_outputs(model, inputs)
                if self.preprocess_logits_for_metrics is not None:
                    logits = self.preprocess_logits_for_metrics(logits, labels)
        return loss, logits, labels if labels is not None else inputs.get("labels")

    def _eval_items(self, inputs: dict, normalizer=None):
        """An evaluation batch's ``num_items_in_batch`` when its objective counts tokens per micro-batch (the count
        averaged over the data-parallel ranks, as in training); None otherwise (the loss is the batch's own mean)."""
        normalizer = normalizer or self.objective.normalizer([inputs])
        if normalizer is None or not normalizer.per_micro_batch:
            return None
        return self._step_normalizer(normalizer, 1).items[0]

    def _context_parallel_prediction_step(self, model, inputs, prediction_loss_only):
        """Each batch's loss over its tokens on every cp rank (the ranks' sums divided by their label-token
        count), so evaluation reports the loss one process would."""
        run = self.distributed  # compute_metrics is refused under cp (Trainer._check_supported)
        inputs = self._prepare_inputs(self.objective.eval_batch(inputs))
        if not self.objective.has_eval_loss(inputs):
            return None, None, None
        group = run.mesh["cp"].get_group()
        normalizer = self.objective.normalizer([inputs])
        if normalizer is not None and normalizer.is_mean:  # a micro-batch mean: every cp rank holds the batch's
            with torch.no_grad(), self._autocast():
                loss = self.compute_loss(model, inputs, num_items_in_batch=self._eval_items(inputs, normalizer))
                loss = loss.detach() / run.dims.cp
        else:
            count = (inputs["shift_labels"] != IGNORE_INDEX).sum()
            torch.distributed.all_reduce(count, group=group)
            with torch.no_grad(), self._autocast():
                loss = self.compute_loss(model, inputs, num_items_in_batch=count.clamp(min=1)).detach().clone()
        torch.distributed.all_reduce(loss, group=group)
        return loss, None, inputs.get("labels")

    def evaluate(self, eval_dataset=None, ignore_keys=None, metric_key_prefix: str = "eval") -> dict[str, float]:
        """transformers' evaluate: ``eval_dataset`` None (the trainer's), a dataset (prepared as the trainer's
        own, see ``objective.prepare_eval_dataset``), a name in the trainer's dict of eval datasets, or a dict
        (each evaluated, its metrics named ``{metric_key_prefix}_{name}_...``). Every metric, the objective's
        included, is named ``{metric_key_prefix}_...``."""
        self._check_supported(evaluating=True)
        given = eval_dataset is not None
        datasets = eval_dataset if given else self.eval_dataset
        if isinstance(datasets, dict):
            metrics = {}
            for name, dataset in datasets.items():
                metrics.update(self.evaluate(dataset if given else name, ignore_keys, f"{metric_key_prefix}_{name}"))
            return metrics
        self._memory_tracker.start()
        dataloader = self.get_eval_dataloader(self._dataset_to_evaluate(eval_dataset))
        self.objective.evaluation_starts(getattr(dataloader, "dataset", None))
        self.callback_handler.eval_dataloader = dataloader
        # prediction_loss_only: the loss alone, compute_metrics not called (as transformers' evaluation loop)
        want_predictions = self.compute_metrics is not None and not self.args.prediction_loss_only
        predictions, label_ids, metrics = self._prediction_loop(dataloader, want_predictions)
        # the objective's metrics (entropy, mean_token_accuracy, ...) take the prefix too, so each eval dataset
        # of a dict keeps its own (TRL names them eval_* whatever the prefix, and the last dataset's win)
        metrics.update(self._metrics["eval"].pop(self._reduce_metrics))
        metrics = {k if k.startswith(f"{metric_key_prefix}_") else f"{metric_key_prefix}_{k}": v for k, v in metrics.items()}
        self.log(metrics)  # log() adds the epoch to this same dict, as transformers does
        self.control = self.callback_handler.on_evaluate(self.args, self.state, self.control, metrics=metrics)
        self._memory_tracker.stop_and_update_metrics(metrics)  # not logged, as in transformers
        return metrics

    def predict(self, test_dataset, ignore_keys=None, metric_key_prefix: str = "test") -> PredictionOutput:
        """transformers' predict: ``PredictionOutput(predictions, label_ids, metrics)`` over ``test_dataset`` (a
        dataset the trainer takes for evaluation, prepared as its own). The predictions are what
        ``compute_metrics`` is handed in evaluate (the objective's logits, or ``preprocess_logits_for_metrics``'
        output), for every row in order; None with ``prediction_loss_only``. Metrics: ``{prefix}_loss``, the speed
        figures and compute_metrics' results, not logged (as transformers, they go to the callbacks' on_predict)."""
        self._check_supported(evaluating=True)
        run = self.distributed
        if not self.args.prediction_loss_only and run is not None and run.dims.cp_enabled:
            raise ValueError(f"predict() with context parallelism (cp_size={run.dims.cp}): each rank holds a slice of "
                             "every sequence's logits; set prediction_loss_only=True for the loss alone, or cp_size=1")
        self._memory_tracker.start()
        dataloader = self.get_test_dataloader(test_dataset)
        self.objective.evaluation_starts(getattr(dataloader, "dataset", None))
        predictions, label_ids, metrics = self._prediction_loop(dataloader, not self.args.prediction_loss_only,
                                                                 predicting=True)
        self._metrics["eval"].pop(self._reduce_metrics)  # the objective's evaluation metrics belong to evaluate()
        metrics = {f"{metric_key_prefix}_{k}": v for k, v in metrics.items()}
        self.control = self.callback_handler.on_predict(self.args, self.state, self.control, metrics)
        self._memory_tracker.stop_and_update_metrics(metrics)
        return PredictionOutput(predictions=predictions, label_ids=label_ids, metrics=metrics)

    def get_test_dataloader(self, test_dataset):
        """transformers' get_test_dataloader: ``test_dataset`` prepared as an evaluation dataset, batched as one."""
        return self.get_eval_dataloader(self._dataset_to_evaluate(test_dataset))

    def _prediction_loop(self, dataloader, want_predictions: bool, predicting: bool = False):
        """One pass of the eval model over ``dataloader``: (predictions, label_ids, metrics): the gathered logits
        and labels as numpy arrays (None unless ``want_predictions``; label_ids ``()`` for a trainer without label
        names), and the loss, runtime and speed metrics with compute_metrics' results, unprefixed.

        As transformers' evaluation loop: ``include_for_metrics`` adds each row's input ids ("inputs", padded across
        batches with -100) and its batch's loss ("loss") to the EvalPrediction; ``batch_eval_metrics`` calls
        compute_metrics on each batch (its tensors, ``compute_result=True`` on the last, whose result is the
        metrics; "inputs" is then the batch as collated) and keeps no predictions in evaluate (predict keeps them);
        ``eval_do_concat_batches=False`` hands each batch's arrays as a list. ``eval_accumulation_steps`` changes
        nothing here: each batch's outputs go to the host as soon as they are made."""
        args = self.args
        include = set(args.include_for_metrics or ()) if self.compute_metrics is not None else set()
        per_batch = want_predictions and args.batch_eval_metrics and self.compute_metrics is not None
        keep = want_predictions and (predicting or not args.batch_eval_metrics)
        start = time.time()
        self._cast_for_full_eval()
        self.native_model.eval()
        self._optimizer_mode("eval")
        kept = {"predictions": [], "label_ids": [], "inputs": []}
        losses, num_samples, num_batches, batch_metrics = [], 0, 0, None
        for inputs, last in _marking_the_last(dataloader):
            loss, logits, labels = self.prediction_step(self.native_model, inputs, prediction_loss_only=not want_predictions)
            batch_size = self.objective.samples_in_batch(inputs)
            num_samples += batch_size
            num_batches += 1
            # each sample's loss is its batch's, as transformers repeats it (the last batch's cut to its samples)
            sample_losses = None if loss is None else loss.detach().float().cpu().repeat(batch_size)
            if sample_losses is not None:
                losses.append(sample_losses)
            if want_predictions:
                batch = {"predictions": logits.float().cpu(),
                         "label_ids": labels.cpu() if isinstance(labels, torch.Tensor) else labels,
                         "inputs": self._input_ids_for_metrics(inputs) if "inputs" in include else None}
                if last and self.distributed is None:
                    _keep_last_batch_remainder(batch, num_samples % args.eval_batch_size)
                if keep:
                    for name, values in kept.items():
                        values.append(batch[name])
                if per_batch:
                    extra = {"losses": sample_losses if "loss" in include else None,
                             "inputs": inputs if "inputs" in include else None}
                    batch_metrics = self.compute_metrics(
                        EvalPrediction(predictions=batch["predictions"], label_ids=batch["label_ids"], **extra),
                        compute_result=last)
            self.control = self.callback_handler.on_prediction_step(self.args, self.state, self.control)
        # the model stays in eval mode until the next training step, as in transformers (log() reads it)
        if self.distributed is not None:  # every data-parallel rank's share, in rank order
            kept = {name: self.data_parallel.gather_lists(values) for name, values in kept.items()}
            losses = self.data_parallel.gather_lists(losses)
            num_samples = sum(self.data_parallel.gather_lists([num_samples]))
        metrics, predictions, label_ids = {}, None, None
        if keep and kept["predictions"]:
            concat = args.eval_do_concat_batches
            predictions = _arrays(kept["predictions"], concat)
            # a trainer without label names (TRL's RewardTrainer) hands compute_metrics label_ids=()
            label_ids = _arrays(kept["label_ids"], concat) if isinstance(kept["label_ids"][0], torch.Tensor) else ()
            if self.compute_metrics is not None and not per_batch:
                extra = {"losses": _arrays(losses, concat) if "loss" in include and losses else None,
                         "inputs": _arrays(kept["inputs"], concat) if "inputs" in include else None}
                metrics.update(self.compute_metrics(EvalPrediction(predictions=predictions, label_ids=label_ids, **extra)))
        if per_batch and batch_metrics is not None:
            metrics.update(batch_metrics)
        metrics = denumpify_detensorize(metrics)  # JSON-serializable, as transformers hands them on
        if losses:
            # transformers' mean: without the non-finite losses (logging_nan_inf_filter) unless none is finite
            losses = torch.cat(losses)
            finite = torch.isfinite(losses)
            if args.logging_nan_inf_filter and finite.any():
                losses = losses[finite]
            metrics["loss"] = losses.mean().item()
        # transformers prepares the model (accelerate) at the first evaluation of a trainer that has not trained and
        # from then on reports the time it took; hfnative prepares the model when the trainer is made: none here
        if not getattr(self, "_trained", False):
            self.model_preparation_time = 0.0
        if hasattr(self, "model_preparation_time"):
            metrics["model_preparation_time"] = self.model_preparation_time
        runtime = time.time() - start
        metrics.update(runtime=round(runtime, 4), samples_per_second=round(num_samples / runtime, 3),
                       steps_per_second=round(num_batches / runtime, 3))
        return predictions, label_ids, metrics

    def _cast_for_full_eval(self) -> None:
        """``bf16_full_eval`` / ``fp16_full_eval``, as transformers' evaluation loop: an evaluation outside training
        casts the model to that dtype, in place (it stays so, as transformers' does); evaluations during training
        run in the training precision."""
        dtype = torch.float16 if self.args.fp16_full_eval else torch.bfloat16 if self.args.bf16_full_eval else None
        if dtype is None or self.is_in_train:
            return
        self.native_model.to(dtype)  # (a sharded or 4-bit model is refused when the trainer is made)

    def _input_ids_for_metrics(self, inputs) -> torch.Tensor:
        """An evaluation batch's input ids, what ``include_for_metrics=["inputs"]`` hands compute_metrics (the
        model's main input, as transformers reads it from the batch)."""
        ids = inputs.get("input_ids") if isinstance(inputs, dict) else None
        if not isinstance(ids, torch.Tensor):
            keys = sorted(inputs) if isinstance(inputs, dict) else type(inputs).__name__
            raise ValueError(f"include_for_metrics=['inputs'] hands compute_metrics each evaluation batch's input_ids, "
                             f"but {type(self).__name__}'s evaluation batches have none ({keys}); drop 'inputs' from "
                             "include_for_metrics")
        return ids.cpu()

    def _evaluation_conflicts(self, evaluating: bool) -> list[str]:
        """What evaluation cannot honour in this run, checked when the trainer is made and at each evaluation:
        bf16 / fp16_full_eval's in-place cast of a model split over ranks or with a 4-bit base, and, where the loop
        evaluates (or evaluate() runs), per-batch arrays over data-parallel ranks, whose batches are gathered when
        the pass ends."""
        from hfnative.peft.quantize import is_nf4

        args, run = self.args, self.distributed
        conflicts = []
        full = ("fp16_full_eval" if getattr(args, "fp16_full_eval", False)
                else "bf16_full_eval" if getattr(args, "bf16_full_eval", False) else None)
        if full is not None and run is not None:
            conflicts.append(f"{full}=True in a run of {run.world_size} processes: it casts a one-process model in "
                             "place, and here each rank holds a part of it; leave it False")
        elif full is not None and any(is_nf4(p) for p in self.native_model.parameters()):
            conflicts.append(f"{full}=True with a 4-bit (QLoRA) base: its NF4 weights are not cast; leave it False")
        if run is None or self.compute_metrics is None or not (evaluating or getattr(args, "eval_strategy", "no") != "no"):
            return conflicts
        if args.batch_eval_metrics:
            conflicts.append(f"batch_eval_metrics=True in a run of {run.world_size} processes: each rank's predictions "
                             "are gathered when evaluation ends, not batch by batch; leave it False (compute_metrics "
                             "then runs once, on every row)")
        if not args.eval_do_concat_batches:
            conflicts.append(f"eval_do_concat_batches=False in a run of {run.world_size} processes: each rank's "
                             "predictions are gathered when evaluation ends, not batch by batch; leave it True")
        return conflicts

    def _dataset_to_evaluate(self, eval_dataset):
        """None: the trainer's eval dataset; a str: that entry of the trainer's dict of eval datasets; a dataset:
        prepared as the trainer's own were (a raw dataset in any format the trainer takes)."""
        if eval_dataset is None:
            if self.eval_dataset is None:
                raise ValueError("Trainer: evaluation requires an eval_dataset. Pass `eval_dataset` to the trainer "
                                 "or to evaluate().")
            return self.eval_dataset
        if isinstance(eval_dataset, str):
            names = list(self.eval_dataset) if isinstance(self.eval_dataset, dict) else []
            if eval_dataset not in names:
                raise KeyError(f"evaluate(eval_dataset={eval_dataset!r}) names an eval dataset, but the trainer's eval "
                               f"datasets are {names if names else 'not a dict of named datasets'}")
            return self.eval_dataset[eval_dataset]
        return self.objective.prepare_eval_dataset(eval_dataset)

    def _evaluate_and_track_best(self) -> bool:
        try:
            metrics = self.evaluate()
        except RuntimeError as error:
            # auto_find_batch_size shrinks the train batch only: as transformers, an evaluation out of memory is not
            # handed to the search (which would train again and again at smaller sizes)
            from accelerate.utils.memory import should_reduce_batch_size

            if self.args.auto_find_batch_size and should_reduce_batch_size(error):
                raise RuntimeError("Evaluation hit an out-of-memory error. `auto_find_batch_size` only adjusts the "
                                   "training batch size, reduce `per_device_eval_batch_size` instead.") from error
            raise
        self._report_to_hp_search(self._trial, self.state.global_step, metrics)
        name = self.args.metric_for_best_model
        if name is None:
            return False
        key = name if name.startswith("eval_") else f"eval_{name}"
        if key not in metrics:
            raise KeyError(
                f"The `metric_for_best_model` training argument is set to '{key}', which is not found in the "
                f"evaluation metrics. The available evaluation metrics are: {list(metrics)}. Name one of them, or "
                "return it from compute_metrics."
            )
        value = metrics[key]
        greater = self.args.greater_is_better
        best = self.state.best_metric
        if best is None or (value > best if greater else value < best):
            self.state.best_metric = value
            self.state.best_global_step = self.state.global_step
            return True
        return False


def _marking_the_last(iterable):
    """(item, whether it is the last) for each item of ``iterable`` (accelerate's end_of_dataloader)."""
    iterator = iter(iterable)
    try:
        item = next(iterator)
    except StopIteration:
        return
    for following in iterator:
        yield item, False
        item = following
    yield item, True


def _keep_last_batch_remainder(batch: dict, remainder: int) -> None:
    """accelerate's gather_for_metrics, which transformers' evaluation runs: when the dataset's length is not a
    multiple of the eval batch size, the last batch's rows are cut to that remainder, counted in the dataset's
    samples (a no-op for a batch of one row per sample; for a batch of chosen and rejected rows it keeps the first
    ``remainder`` rows, as TRL's trainers hand them)."""
    if remainder > 0:
        for name, value in batch.items():
            if isinstance(value, torch.Tensor):
                batch[name] = value[:remainder]


def _arrays(tensors: list[torch.Tensor], concat: bool):
    """Per-batch tensors as transformers' evaluation hands them on: one numpy array, concatenated with -100 padding
    (``eval_do_concat_batches``), or a list of each batch's array."""
    if not concat:
        return [t.numpy() for t in tensors]
    return _concat_padded(tensors, -100).numpy()


def _concat_padded(tensors: list[torch.Tensor], pad_value) -> torch.Tensor:
    """Concatenate [B, S, ...] batches whose S differ, right-padding to the longest with ``pad_value`` (-100 for
    logits and labels alike, as transformers' evaluation pads them); [B] batches are concatenated as they are."""
    if tensors[0].dim() == 1:
        return torch.cat(tensors)
    longest = max(t.shape[1] for t in tensors)
    padded = []
    for t in tensors:
        pad = [0, 0] * (t.dim() - 2) + [0, longest - t.shape[1]]
        padded.append(torch.nn.functional.pad(t, pad, value=pad_value))
    return torch.cat(padded)
