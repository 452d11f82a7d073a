"""No silent overrides: a subclass that overrides one of transformers' Trainer hooks hfnative's loop never calls
(its evaluation loop, its inner training loop, its samplers, its checkpoint internals, ...) would train as if the
override were not there. The trainer refuses it when it is made, naming the method and what hfnative calls instead.
The hooks it does call keep transformers' names and roles: compute_loss, training_step, prediction_step, log,
create_optimizer / create_scheduler, get_train_dataloader / get_eval_dataloader / get_test_dataloader, evaluate,
predict, save_model, floating_point_ops, and the callbacks.
"""

from __future__ import annotations

_LOOP = "hfnative runs its own training loop; override training_step or compute_loss, or add a TrainerCallback"
_EVALUATION = ("hfnative's evaluate() runs its own loop over prediction_step; override prediction_step, or pass "
               "compute_metrics / preprocess_logits_for_metrics")
_DATA = "override get_train_dataloader / get_eval_dataloader (which hfnative calls), or pass a data_collator"
_COLUMNS = ("remove_unused_columns keeps the columns the trainer's objective reads; pass a data_collator, or set "
            "remove_unused_columns=False")
_PLACEMENT = ("hfnative places, shards and compiles the model itself (fsdp / parallelism_config, torch_compile); "
              "there is no accelerator to prepare")
_CHECKPOINTS = ("checkpoints are written and read by hfnative (save_model is called for the model's files); add a "
                "TrainerCallback's on_save to act on each")
_COMPUTED = "hfnative's loop computes this itself; override training_step or compute_loss, or add a TrainerCallback"

# transformers.Trainer's methods hfnative's trainers do not define (so never call), and what to do instead
NOT_CALLED = {
    **dict.fromkeys(("_inner_training_loop", "_run_epoch", "_init_training_state", "set_initial_training_values",
                     "_prepare_for_training", "_finalize_training"), _LOOP),
    **dict.fromkeys(("evaluation_loop", "prediction_loop", "_evaluate"), _EVALUATION),
    **dict.fromkeys(("_get_train_sampler", "_get_eval_sampler", "get_batch_samples", "_get_dataloader",
                     "get_resumed_dataloader", "_prepare_input", "_prepare_context_parallel_inputs"), _DATA),
    **dict.fromkeys(("_remove_unused_columns", "_set_signature_columns_if_needed",
                     "_get_collator_with_removed_columns"), _COLUMNS),
    **dict.fromkeys(("_wrap_model", "_move_model_to_device", "create_accelerator_and_postprocess",
                     "_build_accelerator_args", "_defer_fsdp_gradient_reduction",
                     "_sync_replicated_trainable_parameters"), _PLACEMENT),
    **dict.fromkeys(("_load_from_checkpoint", "_load_best_model", "_load_optimizer_and_scheduler", "_load_rng_state",
                     "_load_scaler", "_save_optimizer_and_scheduler", "_save_rng_state", "_save_scaler",
                     "_load_callback_state", "_get_output_dir", "_tune_save_checkpoint", "_push_from_checkpoint",
                     "_finish_current_push", "init_hf_repo", "_issue_warnings_after_load"), _CHECKPOINTS),
    **dict.fromkeys(("_clip_grad_norm", "_get_grad_norm", "_has_mixed_mesh_grads", "_mixed_mesh_grad_norm",
                     "_get_learning_rate", "_get_num_items_in_batch", "_track_num_input_tokens",
                     "_determine_best_metric", "_update_auto_batch_size", "_validate_args", "store_flos"), _COMPUTED),
}


def ignored_overrides(trainer_class) -> list[str]:
    """``Class.method: what to do`` for each method of ``NOT_CALLED`` that ``trainer_class`` (or a class it derives
    from) defines."""
    found = []
    for name, what_to_do in NOT_CALLED.items():
        owner = next((cls for cls in trainer_class.__mro__ if name in vars(cls)), None)
        if owner is not None:
            found.append(f"{owner.__name__}.{name}: {what_to_do}")
    return found


def check_overrides(trainer_class) -> None:
    """Raise ValueError naming every override of a transformers Trainer hook hfnative's loop never calls."""
    found = ignored_overrides(trainer_class)
    if found:
        raise ValueError("these overrides of transformers' Trainer methods would change nothing, as hfnative's trainer "
                         "does not call them: " + "; ".join(found))


__all__ = ["NOT_CALLED", "check_overrides", "ignored_overrides"]
