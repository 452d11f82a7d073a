"""transformers' optional training features, switched on by its TrainingArguments fields, that the loop calls into:
NEFTune's embedding noise (``neftune_noise_alpha``), the underflow/overflow debugger (``debug``), the input tokens
seen (``include_num_input_tokens_seen``), each micro-batch's FLOPs (``floating_point_ops``, a hook subclasses
override) and the memory tracker's end of a stage (``skip_memory_metrics=False``)."""

from __future__ import annotations

import logging

import torch

logger = logging.getLogger(__name__)


class TrainingFeaturesMixin:
    """The Trainer's optional transformers features (see the module docstring)."""

    def _stop_memory_tracker(self, stage: str) -> None:
        """Stop the memory tracker's sampling of ``stage`` if it still runs (it ends when the stage's metrics are
        taken)."""
        tracker = self._memory_tracker
        if not tracker.skip_memory_metrics and tracker.cur_stage == stage:
            tracker.stop(stage)

    @property
    def neftune_noise_alpha(self) -> float | None:
        return self.args.neftune_noise_alpha

    def _activate_neftune(self):
        """transformers' NEFTune (``neftune_noise_alpha``): its own forward hook on the policy's input embeddings for
        the length of train(), adding uniform noise of alpha / sqrt(sequence length x hidden size) to the
        embeddings of each training forward; the hook's handle, or None. Refused where a rank's embeddings are a
        slice of the sequence or of the hidden size (context or tensor parallel: the noise's scale would be a
        slice's)."""
        alpha = self.args.neftune_noise_alpha
        if alpha is None:
            return None
        run = self.distributed
        if run is not None and (run.dims.tp_enabled or run.dims.cp_enabled):
            raise ValueError(f"neftune_noise_alpha={alpha} with tensor or context parallelism (tp_size={run.dims.tp}, "
                             f"cp_size={run.dims.cp}): each rank holds a slice of the embeddings, so the noise would not "
                             "be scaled as NEFTune's; unset neftune_noise_alpha or set tp_size=1 and cp_size=1")
        from transformers.integrations.neftune import neftune_post_forward_hook

        embeddings = self.native_model.get_input_embeddings()
        if embeddings is None:  # a pipeline stage after the first: the first stage's rank adds the noise
            return None
        embeddings.neftune_noise_alpha = alpha
        return embeddings.register_forward_hook(neftune_post_forward_hook)

    def floating_point_ops(self, inputs: dict) -> float:
        """transformers' estimate of a micro-batch's training FLOPs (``state.total_flos``): 6 x its input tokens x the
        model's non-embedding parameters (forward and backward); override it for another count."""
        return 6.0 * inputs["input_ids"].numel() * self._non_embedding_params

    def _watch_underflow_overflow(self) -> None:
        """``debug="underflow_overflow"``: transformers' DebugUnderflowOverflow on the policy's modules (forward hooks
        that keep the last frames of activation and weight extremes and raise, printing them, at the first inf or
        nan), once per model."""
        from transformers.debug_utils import DebugOption, DebugUnderflowOverflow

        if DebugOption.UNDERFLOW_OVERFLOW in self.args.debug and not hasattr(self.native_model, "_underflow_overflow"):
            self.native_model._underflow_overflow = DebugUnderflowOverflow(self.native_model)

    def _count_input_tokens(self, batches: list) -> None:
        """include_num_input_tokens_seen ("all" / "non_padding"): this rank's micro-batches' input tokens, counted
        on the host as transformers counts them (the input ids' entries, or the attention mask's ones), added to the
        state at the next log or save (``_gather_input_tokens``); a batch without input ids is not counted (warned
        once, as transformers warns)."""
        mode = self.args.include_num_input_tokens_seen
        if mode == "no":
            return
        pad_id = getattr(self.processing_class, "pad_token_id", None)
        for batch in batches:
            ids = batch.get("input_ids") if isinstance(batch, dict) else None
            if not isinstance(ids, torch.Tensor):
                if not self.__dict__.get("_warned_input_tokens"):
                    self._warned_input_tokens = True
                    logger.warning("include_num_input_tokens_seen: the training batches have no input_ids to count")
                continue
            if mode == "non_padding" and isinstance(batch.get("attention_mask"), torch.Tensor):
                self._input_tokens_local += int(batch["attention_mask"].sum())
            elif mode == "non_padding" and pad_id is not None:
                self._input_tokens_local += int((ids != pad_id).sum())
            else:
                self._input_tokens_local += ids.numel()

    def _gather_input_tokens(self) -> None:
        """The input tokens every data-parallel rank counted since the last call, added to the state."""
        if self.args.include_num_input_tokens_seen == "no":
            return
        local, self._input_tokens_local = self._input_tokens_local, 0
        self.state.num_input_tokens_seen += sum(self.data_parallel.gather_lists([local]))


__all__ = ["TrainingFeaturesMixin"]
