"""transformers' ``Trainer.hyperparameter_search`` with optuna: each trial sets the training arguments its
``hp_space`` draws, builds the model again with ``model_init`` (which may take the trial), trains, and is scored by
``compute_objective`` over the evaluation metrics (the last evaluation during training, or one made after it).
Evaluations during a trial report the objective to optuna at their step, so its pruners can stop a trial
(``optuna.TrialPruned``). Each trial's checkpoints go to ``output_dir/run-{trial number}`` (or ``hp_name(trial)``).

One process only (transformers broadcasts each trial's parameters over DDP ranks; hfnative's layouts are not
re-made per trial). The backends transformers also knows (Ray Tune, W&B sweeps) are refused by name.
"""

from __future__ import annotations

import logging
import os

from transformers.trainer_utils import (BestRun, HPSearchBackend, default_compute_objective,
                                        default_hp_space_optuna)

logger = logging.getLogger(__name__)


class HyperparameterSearchMixin:
    """``hyperparameter_search`` and the trial hooks ``train`` and evaluation call."""

    hp_search_backend = None  # HPSearchBackend.OPTUNA while a search runs
    _trial = None
    _hp_objective = None  # the trial's objective, from its last evaluation

    def hyperparameter_search(self, hp_space=None, compute_objective=None, n_trials: int = 20,
                              direction: str | list[str] = "minimize", backend=None, hp_name=None,
                              **kwargs) -> BestRun | list[BestRun]:
        """transformers' hyperparameter search with optuna (``backend`` None or "optuna"): ``n_trials`` trials,
        ``direction`` "minimize" / "maximize" (a list for several objectives), ``kwargs`` for
        ``optuna.create_study`` (``sampler``, ``pruner``, ``storage``, ``study_name``, ...) and ``timeout``,
        ``n_jobs``, ``gc_after_trial``, ``catch`` for ``study.optimize``. Returns the best run
        (``BestRun(run_id, objective, hyperparameters)``), or the best runs of several objectives."""
        backend = HPSearchBackend(backend if backend is not None else "optuna")
        if backend != HPSearchBackend.OPTUNA:
            raise ValueError(f"hyperparameter_search(backend={backend.value!r}): hfnative runs the search with optuna; "
                             "pass backend='optuna' (pip install optuna)")
        try:
            import optuna
        except ImportError as error:
            raise RuntimeError("hyperparameter_search needs optuna: pip install optuna") from error
        if self.model_init is None:
            raise RuntimeError("To use hyperparameter search, you need to pass your model through a model_init function.")
        if self.distributed is not None:
            raise ValueError(f"hyperparameter_search in a run of {self.distributed.world_size} processes: hfnative "
                             "searches on one process; run the search without a launcher")
        self.hp_search_backend = backend
        self.hp_space = default_hp_space_optuna if hp_space is None else hp_space
        self.hp_name = hp_name
        self.compute_objective = default_compute_objective if compute_objective is None else compute_objective
        output_dir = self.args.output_dir

        def objective(trial):
            self._hp_objective = None
            self.args.output_dir = os.path.join(output_dir, hp_name(trial) if hp_name is not None else f"run-{trial.number}")
            try:
                self.train(trial=trial)
                if self._hp_objective is None:  # no evaluation during training
                    self._hp_objective = self.compute_objective(self.evaluate())
            finally:
                self.args.output_dir = output_dir
            return self._hp_objective

        optimize = {name: kwargs.pop(name) for name in ("timeout", "n_jobs", "gc_after_trial", "catch") if name in kwargs}
        directions = direction if isinstance(direction, list) else None
        study = optuna.create_study(direction=None if directions is not None else direction, directions=directions,
                                    **kwargs)
        try:
            study.optimize(objective, n_trials=n_trials, **optimize)
        finally:
            self.hp_search_backend = None
        if directions is None:
            best = study.best_trial
            return BestRun(str(best.number), best.value, best.params)
        return [BestRun(str(best.number), best.values, best.params) for best in study.best_trials]

    def call_model_init(self, trial=None):
        """``model_init()``, or ``model_init(trial)`` when it takes one argument (transformers' rule)."""
        import inspect

        count = len(inspect.signature(self.model_init).parameters)
        if count > 1:
            raise RuntimeError("model_init should have 0 or 1 argument.")
        model = self.model_init(trial) if count == 1 else self.model_init()
        if model is None:
            raise RuntimeError("model_init should not return None.")
        return model

    def _hp_search_setup(self, trial) -> None:
        """A trial's hyperparameters set on the training arguments (cast to each field's type). As in transformers,
        this follows the model's rebuilding by ``model_init(trial)``, so a drawn ``seed`` does not seed the model's
        initialisation; it orders the trial's data (transformers orders it by the global generator, seeded before
        the trial's arguments are set: with the previous trial's seed)."""
        if self.hp_search_backend is None or trial is None:
            return
        for key, value in self.hp_space(trial).items():
            if not hasattr(self.args, key):
                logger.warning("Trying to set %s in the hyperparameter search but there is no corresponding field in "
                               "`TrainingArguments`.", key)
                continue
            old = getattr(self.args, key)
            setattr(self.args, key, type(old)(value) if old is not None else value)
        logger.info("Trial: %s", trial.params)

    def _report_to_hp_search(self, trial, step: int, metrics: dict) -> None:
        """An evaluation during a trial: its objective reported to optuna at ``step``; a trial its pruner stops
        ends the training (on_train_end) and raises ``optuna.TrialPruned``."""
        if self.hp_search_backend is None or trial is None:
            return
        self._hp_objective = self.compute_objective(dict(metrics))
        if not trial.study._is_multi_objective():
            trial.report(self._hp_objective, step)
            if trial.should_prune():
                import optuna

                self.control = self.callback_handler.on_train_end(self.args, self.state, self.control)
                raise optuna.TrialPruned()


__all__ = ["HyperparameterSearchMixin"]
