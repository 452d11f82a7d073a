"""Evaluation for the Trainer: eval loss, compute_metrics on logits, best-metric tracking."""

from __future__ import annotations

import time

import torch
from transformers.trainer_utils import EvalPrediction

from .objective import without_labels


class EvaluationMixin:
    """evaluate() / prediction_step() as transformers' Trainer, on the native model."""

    def prediction_step(self, model, inputs, prediction_loss_only=True, ignore_keys=None):
        inputs = self._prepare_inputs(inputs)
        with torch.no_grad(), self._autocast():
            loss = self.compute_loss(model, inputs) if "labels" in inputs else None
            logits = None
            if not prediction_loss_only:
                logits = model(**without_labels(inputs)).logits
                if self.preprocess_logits_for_metrics is not None:
                    logits = self.preprocess_logits_for_metrics(logits, inputs.get("labels"))
        return loss, logits, inputs.get("labels")

    def evaluate(self, eval_dataset=None, ignore_keys=None, metric_key_prefix: str = "eval") -> dict[str, float]:
        if isinstance(eval_dataset if eval_dataset is not None else self.eval_dataset, dict):
            datasets = eval_dataset if eval_dataset is not None else self.eval_dataset
            metrics = {}
            for name, dataset in datasets.items():
                metrics.update(self.evaluate(dataset, ignore_keys, f"{metric_key_prefix}_{name}"))
            return metrics
        dataloader = self.get_eval_dataloader(eval_dataset)
        self.callback_handler.eval_dataloader = dataloader
        start = time.time()
        self.model.eval()
        losses, all_logits, all_labels, num_samples, num_batches = [], [], [], 0, 0
        want_predictions = self.compute_metrics is not None
        for inputs in dataloader:
            loss, logits, labels = self.prediction_step(self.model, inputs, prediction_loss_only=not want_predictions)
            batch_size = inputs["input_ids"].shape[0]
            if loss is not None and torch.isfinite(loss):
                losses.append(loss.detach().float().repeat(batch_size))
            if want_predictions:
                all_logits.append(logits.float().cpu())
                all_labels.append(labels.cpu())
            num_samples += batch_size
            num_batches += 1
            self.control = self.callback_handler.on_prediction_step(self.args, self.state, self.control)
        # the model stays in eval mode until the next training step, as in transformers (log() reads it)
        metrics = {}
        if want_predictions:
            predictions = _concat_padded(all_logits, 0.0)
            label_ids = _concat_padded(all_labels, -100)
            metrics.update(self.compute_metrics(EvalPrediction(predictions=predictions.numpy(), label_ids=label_ids.numpy())))
        if losses:
            metrics["loss"] = torch.cat(losses).mean().item()
        runtime = time.time() - start
        metrics.update(runtime=round(runtime, 4), samples_per_second=round(num_samples / runtime, 3),
                       steps_per_second=round(num_batches / runtime, 3))
        metrics = {k if k.startswith(f"{metric_key_prefix}_") else f"{metric_key_prefix}_{k}": v for k, v in metrics.items()}
        self.log(metrics)  # log() adds epoch (and SFT metrics) to this same dict, as transformers does
        self.control = self.callback_handler.on_evaluate(self.args, self.state, self.control, metrics=metrics)
        return metrics

    def _evaluate_and_track_best(self) -> bool:
        metrics = self.evaluate()
        name = self.args.metric_for_best_model
        if name is None:
            return False
        key = name if name.startswith("eval_") else f"eval_{name}"
        if key not in metrics:
            raise KeyError(f"metric_for_best_model={name!r} is not among the evaluation metrics {sorted(metrics)}")
        value = metrics[key]
        greater = self.args.greater_is_better
        best = self.state.best_metric
        if best is None or (value > best if greater else value < best):
            self.state.best_metric = value
            self.state.best_global_step = self.state.global_step
            return True
        return False


def _concat_padded(tensors: list[torch.Tensor], pad_value) -> torch.Tensor:
    """Concatenate [B, S, ...] batches whose S differ, right-padding to the longest."""
    longest = max(t.shape[1] for t in tensors)
    padded = []
    for t in tensors:
        pad = [0, 0] * (t.dim() - 2) + [0, longest - t.shape[1]]
        padded.append(torch.nn.functional.pad(t, pad, value=pad_value))
    return torch.cat(padded)
