"""Saving and resuming for the Trainer: Hub-format model folders, atomic checkpoints, exact resume."""

from __future__ import annotations

import contextlib
import json

from pathlib import Path

import torch
from transformers import trainer_pt_utils
from transformers.trainer_callback import ExportableState, TrainerState

from hfnative.checkpoint import atomic_directory, atomic_files, load_rng_state, safe_torch_load, save_rng_state
from hfnative.checkpoint.atomic import staging_directory
from hfnative.converters.export import LOADED_FIRST, WEIGHT_FILES
from hfnative.converters.fallback import save_hub_folder
from hfnative.converters.fallback_loading import TransformersModel, load_checkpoint_weights
from hfnative.converters.families import model_pieces
from hfnative.converters.loading import SafetensorsSource, check_checkpoint, copy_into_model

from . import checkpoints as ckpt
from ..running import hub


def full_state_dict(model) -> dict[str, torch.Tensor]:
    """The model's whole tensors under its native names, on the CPU of rank 0 (an empty dict on the other
    ranks); every rank must call it (the shards are gathered)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    return get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))


def _pipeline_full_state_dict(model, run) -> dict[str, torch.Tensor]:
    """Under pipeline parallel: every stage's whole tensors on the CPU of rank 0 (an empty dict elsewhere), made whole
    and sent one tensor at a time; every rank calls it."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    from hfnative.parallel.pipeline import gather_stages

    stage = get_model_state_dict(model, options=StateDictOptions(full_state_dict=False))  # the shards: nothing moved
    return gather_stages(stage, run.dims.pp_mesh(run.mesh).get_group())


class SavingMixin:
    """save_model / save_state / push_to_hub, checkpoint-N writing and resume_from_checkpoint."""

    @contextlib.contextmanager
    def _whole_model(self):
        """In a distributed run, the whole model for writing it out (every rank enters; rank 0 writes): yields
        the gathered tensors under the model's own names (on rank 0); with native LoRA adapters only what the adapter
        folder holds, gathered one tensor at a time (the frozen base never whole on a GPU). A single process yields
        None."""
        if self.distributed is None:
            yield None
            return
        if self.distributed.dims.pp_enabled:  # each stage's whole tensors, merged on rank 0
            yield _pipeline_full_state_dict(self.native_model, self.distributed)
            return
        if self.lora_settings is None:
            yield full_state_dict(self.native_model)  # the model's own names; TP and FSDP shards gathered
            return
        from hfnative.converters.peft import adapter_tensors, saves_token_layers

        # whether the embedding layers are saved whole is read from the base's config.json: rank 0's answer, so
        # that every rank gathers the same tensors (another node may not have the file)
        token_layers = torch.tensor([int(saves_token_layers(self.converted, self.base_model_name_or_path))],
                                    device=self.device)
        yield adapter_tensors(self.native_model, bool(self.distributed.broadcast(token_layers).item()))

    def _save(self, output_dir: Path, native_state: dict | None = None) -> None:
        """Model (Hub format), tokenizer and training_args.bin into ``output_dir``. native_state: a sharded
        model's gathered tensors (see ``_whole_model``)."""
        from hfnative.converters.export import export_hf, save_tokenizer

        output_dir.mkdir(parents=True, exist_ok=True)
        if isinstance(self.converted, TransformersModel):  # transformers' / peft's own save_pretrained
            save_hub_folder(self.converted.model, output_dir, wrapper_state=native_state)
            save_tokenizer(output_dir, self.processing_class, self.converted.source_dir)
        elif self.lora_settings is not None:
            from hfnative.converters.peft import save_adapter

            save_adapter(self.converted, output_dir, self.lora_settings, base_model_name_or_path=self.base_model_name_or_path,
                         native_state=native_state)
            save_tokenizer(output_dir, self.processing_class)
        elif self.converted is not None:
            export_hf(self.converted, output_dir, processing_class=self.processing_class, native_state=native_state,
                      generation_config=getattr(self.native_model, "generation_config", None))
        else:
            from safetensors.torch import save_file

            state = {k: v.detach().cpu().contiguous() for k, v in self.native_model.state_dict().items()}
            save_file(state, str(output_dir / "model.safetensors"), metadata={"format": "pt"})
            save_tokenizer(output_dir, self.processing_class)
        ckpt.save_training_args(self.args, output_dir / ckpt.TRAINING_ARGS_NAME)

    def save_model(self, output_dir: str | None = None, _internal_call: bool = False) -> None:
        """Write the model in Hub format (safetensors + config.json + tokenizer) and a model card.

        Every file is written aside and renamed in whole, config.json last: a crash leaves the previous
        save or nothing that loads, never a model folder with files missing."""
        from ..running.model_card import write_model_card

        output_dir = Path(output_dir or self.args.output_dir)
        with self._whole_model() as native_state:
            if self.state.is_world_process_zero:
                with atomic_files(output_dir, last=LOADED_FIRST, replaces=WEIGHT_FILES) as stage:
                    self._save(stage, native_state)
                    if not _internal_call:
                        write_model_card(self, stage)
        if self.distributed is not None:
            self.distributed.barrier()  # the folder is complete before any rank goes on
        if not _internal_call:
            if self.args.push_to_hub:
                self.push_to_hub(commit_message="Model save", revision=self.args.hub_revision)

    def push_to_hub(self, commit_message: str | None = "End of training", blocking: bool = True, token: str | None = None,
                    revision: str | None = None, private: bool | None = None, **kwargs):
        """Save the model and card into output_dir and upload it to ``hub_model_id`` (see trainers/running/hub.py)."""
        return hub.push_to_hub(self, commit_message, blocking, token, revision, private, **kwargs)

    # transformers' Trainer's own: print a split's metrics, write {split}_results.json and all_results.json to
    # output_dir (on the main process), format them
    log_metrics = trainer_pt_utils.log_metrics
    save_metrics = trainer_pt_utils.save_metrics
    metrics_format = trainer_pt_utils.metrics_format

    def create_model_card(self, model_name: str | None = None, dataset_name: str | None = None,
                          tags: str | list[str] | None = None) -> None:
        """TRL's create_model_card: output_dir/README.md (on the main process)."""
        from ..running.model_card import write_model_card

        if self.is_world_process_zero():
            Path(self.args.output_dir).mkdir(parents=True, exist_ok=True)
            write_model_card(self, Path(self.args.output_dir), model_name=model_name, dataset_name=dataset_name, tags=tags)

    def save_state(self) -> None:
        if not self.state.is_world_process_zero:
            return
        Path(self.args.output_dir).mkdir(parents=True, exist_ok=True)
        self.state.save_to_json(str(Path(self.args.output_dir) / ckpt.TRAINER_STATE_NAME))

    def _save_checkpoint(self) -> None:
        args = self.args
        run_dir = Path(args.output_dir)
        final = run_dir / f"{ckpt.PREFIX_CHECKPOINT_DIR}-{self.state.global_step}"
        if self.state.best_global_step is not None:
            best = run_dir / f"{ckpt.PREFIX_CHECKPOINT_DIR}-{self.state.best_global_step}"
            if best == final or best.exists():
                self.state.best_model_checkpoint = str(best)
        for callback in self.callback_handler.callbacks + [self.control]:
            if isinstance(callback, ExportableState):
                self.state.stateful_callbacks[type(callback).__name__] = callback.state()
        if self.distributed is not None:
            self._save_distributed_checkpoint(final)
        else:
            self._save_single_process_checkpoint(final)
        if args.push_to_hub and self.state.is_world_process_zero:
            hub.push_checkpoint(self, final)
        if self.state.is_world_process_zero:
            ckpt.rotate_checkpoints(run_dir, args.save_total_limit, self.state.best_model_checkpoint)

    def _save_single_process_checkpoint(self, final: Path) -> None:
        """transformers' checkpoint-N layout: the model in Hub format, optimizer.pt, scheduler.pt, rng_state.pth."""
        args = self.args
        with atomic_directory(final) as tmp:
            self._save(tmp)
            if not args.save_only_model:
                torch.save(self.optimizer.state_dict(), tmp / ckpt.OPTIMIZER_NAME)
                torch.save(self.lr_scheduler.state_dict(), tmp / ckpt.SCHEDULER_NAME)
                save_rng_state(tmp / ckpt.RNG_STATE_NAME)
                self._save_loss_scale(tmp)
            self.state.save_to_json(str(tmp / ckpt.TRAINER_STATE_NAME))
            _write_objective_state(tmp, self.objective.checkpoint_state())

    def _save_loss_scale(self, folder: Path) -> None:
        """fp16's loss scale (the same on every rank), for a resume that goes on with it."""
        if self._loss_scale is not None:
            (folder / ckpt.LOSS_SCALE_NAME).write_text(json.dumps(self._loss_scale.state_dict(), indent=2) + "\n")

    def _load_objective_state(self, checkpoint: Path) -> None:
        names = self.objective.checkpoint_state()
        files = {name: json.loads((checkpoint / name).read_text()) for name in names if (checkpoint / name).is_file()}
        if files:
            self.objective.load_checkpoint_state(files)

    def _trained_module(self) -> torch.nn.Module:
        """The module whose parameters the optimizer steps, as a distributed checkpoint's training state holds it."""
        return self.native_model

    def _save_distributed_checkpoint(self, final: Path) -> None:
        """checkpoint-N of a distributed run: the model in Hub format (gathered, written by rank 0) and, unless
        save_only_model, ``training_state/`` (model, optimizer, scheduler and per-rank RNG through
        torch.distributed.checkpoint, as safetensors + JSON: see hfnative.checkpoint.distributed), which resumes
        under any layout. Staged by rank 0 and renamed when every rank has written its part."""
        from hfnative.checkpoint import save_training_state

        run = self.distributed
        staging = atomic_directory(final) if run.is_main else contextlib.nullcontext(staging_directory(final))
        with staging as tmp:
            run.barrier()  # rank 0 has made the staging folder
            with self._whole_model() as native_state:
                if run.is_main:
                    self._save(tmp, native_state)
            if not self.args.save_only_model:
                save_training_state(tmp / ckpt.TRAINING_STATE_DIR, self._trained_module(), self.optimizer,
                                    lr_scheduler=self.lr_scheduler, extra={"global_step": self.state.global_step})
            state = self.objective.checkpoint_state()
            if run.is_main:
                self.state.save_to_json(str(tmp / ckpt.TRAINER_STATE_NAME))
                _write_objective_state(tmp, state)
                if not self.args.save_only_model:
                    self._save_loss_scale(tmp)
            run.barrier()  # every rank's part is written before rank 0 renames the folder
        run.barrier()

    # --- resuming --------------------------------------------------------------------------------

    def _resolve_checkpoint(self, resume_from_checkpoint) -> Path | None:
        return ckpt.resolve_checkpoint(resume_from_checkpoint, self.args.output_dir)

    def _load_model_weights(self, checkpoint: Path) -> None:
        if isinstance(self.converted, TransformersModel):
            load_checkpoint_weights(self.converted.model, checkpoint)
            return
        if self.converted is None:
            from safetensors.torch import load_file

            self.native_model.load_state_dict(load_file(str(checkpoint / "model.safetensors")))
            return
        if self.lora_settings is not None:
            if self.distributed is not None and self.distributed.dims.pp_enabled:
                raise ValueError("load_best_model_at_end with LoRA under pipeline parallelism is not available (each "
                                 f"stage holds some blocks' adapters): resume the best checkpoint ({checkpoint}) "
                                 "without pipeline parallelism")
            from hfnative.converters.peft import load_adapter_weights

            load_adapter_weights(self.converted, checkpoint)  # a sharded adapter takes its rows on each rank
            return
        source = SafetensorsSource(checkpoint)
        pieces = model_pieces(self.converted.family, self.native_model.args)
        check_checkpoint(source, pieces, self.native_model, str(checkpoint))
        if self.distributed is not None:  # each rank copies its slice of every tensor
            from hfnative.converters.sharded_loading import copy_shards_into_model

            copy_shards_into_model(source, pieces, self.native_model)
        else:
            copy_into_model(source, pieces, self.native_model)

    def _load_checkpoint(self, checkpoint: Path) -> None:
        saved = TrainerState.load_from_json(str(checkpoint / ckpt.TRAINER_STATE_NAME))
        for name in ("global_step", "epoch", "log_history", "total_flos", "best_metric", "best_global_step",
                     "best_model_checkpoint", "num_input_tokens_seen", "logging_steps", "eval_steps", "save_steps"):
            setattr(self.state, name, getattr(saved, name))
        if self.args.restore_callback_states_from_checkpoint:
            self.state.stateful_callbacks = saved.stateful_callbacks
        self._load_objective_state(checkpoint)
        if self._loss_scale is not None and (checkpoint / ckpt.LOSS_SCALE_NAME).is_file():
            self._loss_scale.load_state_dict(json.loads((checkpoint / ckpt.LOSS_SCALE_NAME).read_text()))
        if (checkpoint / ckpt.TRAINING_STATE_DIR).is_dir():  # a distributed run's: any layout resumes it
            from hfnative.checkpoint import load_training_state

            self._optimizer_ready_to_load()
            load_training_state(checkpoint / ckpt.TRAINING_STATE_DIR, self._trained_module(), self.optimizer,
                                lr_scheduler=self.lr_scheduler,
                                model_is_part=self.distributed is not None and self.distributed.dims.pp_enabled)
            return
        if self.distributed is not None:
            raise ValueError(
                f"{checkpoint} was written by a single process (transformers' layout: optimizer.pt); a distributed run "
                "resumes only from a distributed run's checkpoint (training_state/). Resume it on one process"
            )
        self._load_model_weights(checkpoint)
        if (checkpoint / ckpt.OPTIMIZER_NAME).exists():
            # weights_only loading: a checkpoint from someone else cannot run code here
            self.optimizer.load_state_dict(safe_torch_load(checkpoint / ckpt.OPTIMIZER_NAME, self.device))
            self.lr_scheduler.load_state_dict(safe_torch_load(checkpoint / ckpt.SCHEDULER_NAME, "cpu"))

    def _restore_rng(self, checkpoint: Path) -> None:
        if (checkpoint / ckpt.RNG_STATE_NAME).exists():
            load_rng_state(checkpoint / ckpt.RNG_STATE_NAME)

    def model_tags(self) -> list[str]:
        tags = ["generated_from_trainer", "hfnative", *self._tag_names]
        return tags + [tag for tag in (getattr(self.native_model, "model_tags", None) or []) if tag not in tags]

    def dataset_names(self) -> list[str] | None:
        return [self.dataset_name] if self.dataset_name else None


def _write_objective_state(folder: Path, state: dict[str, dict]) -> None:
    """The objective's ``checkpoint_state`` files (JSON) in a checkpoint folder being written."""
    for name, values in state.items():
        (folder / name).write_text(json.dumps(values, indent=2) + "\n")
