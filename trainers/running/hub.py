"""Pushing a run to the Hub with transformers' ``hub_strategy`` semantics; the token is used, never written.

hub_strategy (TrainingArguments):
  end              push only when ``push_to_hub()`` runs (the CLI, or a user's ``save_model()``, calls it)
  every_save       also push the model folder (output_dir) at each checkpoint save
  checkpoint       every_save, plus the latest checkpoint as ``last-checkpoint/`` (resumable from the Hub)
  all_checkpoints  every_save, plus each checkpoint folder under its own name

Checkpoint pushes upload in the background, one at a time. As in transformers, a save that finds the
previous push still uploading skips its own push; with ``hub_always_push`` it waits for it instead
(transformers queues it, which lets the next save overwrite files an upload is still reading).
The repository is created (exist_ok) on the first push and its full id kept in ``trainer.hub_model_id``.

The token goes to huggingface_hub's calls only: training_args.bin is written by
``checkpoints.save_training_args`` (token removed), and nothing here logs it.
"""

from __future__ import annotations

import json
import logging
import shutil
from pathlib import Path

from hfnative.checkpoint import atomic_files
from hfnative.converters.export import LOADED_FIRST, WEIGHT_FILES

from ..loop import checkpoints as ckpt

logger = logging.getLogger(__name__)

# what a push of output_dir leaves out: transformers' "_*" and checkpoint folders (pushed only by the
# strategy), plus the hidden temporary files and folders of our atomic writes
OUTPUT_DIR_IGNORE_PATTERNS = ["_*", f"{ckpt.PREFIX_CHECKPOINT_DIR}-*", ".*"]
# the files of a checkpoint that make up the model at the top of the repository
MODEL_FILES = (
    "config.json",
    "generation_config.json",
    "model.safetensors",
    "model.safetensors.index.json",
    "adapter_config.json",
    "adapter_model.safetensors",
)
CARD_ARGUMENTS = ("model_name", "dataset_name", "dataset", "tags", "finetuned_from", "license", "language")


def _strategy(args) -> str:
    return str(getattr(args.hub_strategy, "value", args.hub_strategy))


def _api(trainer):
    """One HfApi per trainer: its single background worker keeps the pushes in order."""
    api = trainer.__dict__.get("_hub_api")
    if api is None:
        from huggingface_hub import HfApi

        api = trainer._hub_api = HfApi()
    return api


def repo_name(args) -> str:
    """hub_model_id, or output_dir's folder name (the Hub puts it under the token's user)."""
    return args.hub_model_id or Path(args.output_dir).absolute().name


def init_repo(trainer, token: str | None = None, private: bool | None = None) -> str:
    """Create the repository (and the ``hub_revision`` branch) if missing; returns its full id."""
    args = trainer.args
    token = token if token is not None else args.hub_token
    private = private if private is not None else args.hub_private_repo
    api = _api(trainer)
    url = api.create_repo(repo_name(args), token=token, private=private, exist_ok=True)
    if args.hub_revision and args.hub_revision != "main":
        api.create_branch(url.repo_id, branch=args.hub_revision, token=token, exist_ok=True)
    trainer.hub_model_id = url.repo_id
    return url.repo_id


def push_in_progress(trainer) -> bool:
    return any(not job.done() for job in trainer.__dict__.get("_hub_jobs", []))


def wait_for_push(trainer) -> None:
    """Block until the background pushes finish; a failed one is reported, not raised (the next push
    uploads the same files again)."""
    jobs, trainer._hub_jobs = trainer.__dict__.get("_hub_jobs", []), []
    for job in jobs:
        error = job.exception()
        if error is not None:
            logger.warning("A background push to the Hub failed: %s", error)


def push_to_hub(
    trainer,
    commit_message: str | None = "End of training",
    blocking: bool = True,
    token: str | None = None,
    revision: str | None = None,
    private: bool | None = None,
    **card_kwargs,
):
    """Save the model and its card into output_dir and upload the folder (checkpoints left out).

    Returns huggingface_hub's CommitInfo, or a Future of it when ``blocking=False``.
    card_kwargs: model_name, dataset_name (TRL) / dataset (transformers), tags, finetuned_from,
    license, language — written into the model card.
    """
    unknown = sorted(set(card_kwargs) - set(CARD_ARGUMENTS))
    if unknown:
        raise TypeError(f"push_to_hub() got unexpected keyword arguments {unknown}; model card arguments are {list(CARD_ARGUMENTS)}")
    from .model_card import write_model_card

    args = trainer.args
    token = token if token is not None else args.hub_token
    main = trainer.state.is_world_process_zero  # in a distributed run every rank saves (gathers), rank 0 pushes
    if main and trainer.hub_model_id is None:
        init_repo(trainer, token=token, private=private)
    output_dir = Path(args.output_dir)
    if main:
        wait_for_push(trainer)  # a background upload may still be reading output_dir
    trainer.save_model(str(output_dir), _internal_call=True)
    if not main:
        return None
    write_model_card(trainer, output_dir, **card_kwargs)
    job = _api(trainer).upload_folder(
        repo_id=trainer.hub_model_id,
        folder_path=output_dir,
        commit_message=commit_message,
        token=token,
        run_as_future=not blocking,
        ignore_patterns=OUTPUT_DIR_IGNORE_PATTERNS,
        revision=revision if revision is not None else args.hub_revision,
    )
    if not blocking:
        trainer._hub_jobs = [job]
    return job


def _model_files(checkpoint_dir: Path) -> list[str]:
    names = [name for name in MODEL_FILES if (checkpoint_dir / name).is_file()]
    index = checkpoint_dir / "model.safetensors.index.json"
    if index.is_file():
        names += sorted(set(json.loads(index.read_text())["weight_map"].values()))
    return names


def push_checkpoint(trainer, checkpoint_dir: Path) -> None:
    """After a checkpoint save: push the model folder (and the checkpoint) as hub_strategy says."""
    args = trainer.args
    strategy = _strategy(args)
    if strategy == "end":
        return
    if push_in_progress(trainer):
        if not args.hub_always_push:
            logger.info("Not pushing %s: the previous push to the Hub is still uploading", checkpoint_dir.name)
            return
        wait_for_push(trainer)
    if trainer.hub_model_id is None:
        init_repo(trainer)
    from .model_card import write_model_card

    # the model folder gets the checkpoint's model files instead of a second export of the weights,
    # renamed in whole as save_model's are
    output_dir = Path(args.output_dir)
    with atomic_files(output_dir, last=LOADED_FIRST, replaces=WEIGHT_FILES) as stage:
        for name in _model_files(checkpoint_dir):
            shutil.copy(checkpoint_dir / name, stage / name)
        if trainer.processing_class is not None:
            trainer.processing_class.save_pretrained(str(stage))
        ckpt.save_training_args(args, stage / ckpt.TRAINING_ARGS_NAME)
        write_model_card(trainer, stage)

    save_strategy = str(getattr(args.save_strategy, "value", args.save_strategy))
    if save_strategy == "epoch":
        message = f"Training in progress, epoch {int(trainer.state.epoch)}"
    else:
        message = f"Training in progress, step {trainer.state.global_step}"
    api = _api(trainer)
    upload = dict(repo_id=trainer.hub_model_id, token=args.hub_token, run_as_future=True, revision=args.hub_revision)
    jobs = [api.upload_folder(folder_path=output_dir, commit_message=message, ignore_patterns=OUTPUT_DIR_IGNORE_PATTERNS, **upload)]
    if strategy in ("checkpoint", "all_checkpoints"):
        path_in_repo = "last-checkpoint" if strategy == "checkpoint" else checkpoint_dir.name
        jobs.append(api.upload_folder(folder_path=checkpoint_dir, path_in_repo=path_in_repo,
                                      commit_message=f"{message}, checkpoint", **upload))
    trainer._hub_jobs = jobs
