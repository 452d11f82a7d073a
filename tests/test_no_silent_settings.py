"""No silent settings: every field of hfnative's TrainingArguments (transformers' fields plus hfnative's own) is
honoured — read by hfnative's code (an attribute or a name in a library module, found by AST) or by the transformers
code it runs (trainers/running/settings_check.py says which) — refused when set away from its default, or listed with the
reason it has no effect. Each refused field, set away from its default, raises a ValueError naming it."""

import ast
import dataclasses
from pathlib import Path

import pytest

import hfnative
from hfnative import SFTConfig, SFTTrainer, TrainingArguments
from hfnative.trainers.running import settings_check
from hfnative.trainers.running.settings_check import (CONFIG_NO_EFFECT, CONFIG_REFUSED, HONOURED_BY_TRANSFORMERS, NO_EFFECT,
                                              REFUSED, check_settings)

ROOT = Path(__file__).resolve().parents[1]
LIBRARY = ("hfnative", "converters", "trainers")
AUDIT = Path(settings_check.__file__).resolve()
CONFIGS = ["TrainingArguments", "SFTConfig", "DPOConfig", "GRPOConfig", "RLOOConfig", "DistillationConfig", "GKDConfig",
           "AsyncGRPOConfig", "KTOConfig", "RewardConfig", "ORPOConfig", "CPOConfig", "OnlineDPOConfig", "PPOConfig"]

# a value away from the default for each refused field
AWAY_FROM_DEFAULT = {
    "label_names": ["targets"], "debug": ["tpu_metrics_debug"],
}


def names_read_by_the_library() -> set[str]:
    """Every attribute name and string constant in the library's modules (in the audit's own module only attribute
    names: its lists name every field as a string)."""
    names = set()
    for folder in LIBRARY:
        for path in (ROOT / folder).rglob("*.py"):
            strings = path.resolve() != AUDIT
            for node in ast.walk(ast.parse(path.read_text())):
                if isinstance(node, ast.Attribute):
                    names.add(node.attr)
                elif strings and isinstance(node, ast.Constant) and isinstance(node.value, str):
                    names.add(node.value)
    return names


def test_every_training_argument_is_honoured_refused_or_listed_with_a_reason():
    fields = {field.name for field in dataclasses.fields(TrainingArguments)}
    assert len(fields) > 100
    lists = {"HONOURED_BY_TRANSFORMERS": HONOURED_BY_TRANSFORMERS, "NO_EFFECT": NO_EFFECT, "REFUSED": REFUSED}
    for name, listed in lists.items():
        assert set(listed) <= fields, (name, sorted(set(listed) - fields))  # no stale names
        assert all(isinstance(reason, str) and len(reason) > 20 for reason in listed.values()), name
    listed_twice = [field for field in fields if sum(field in listed for listed in lists.values()) > 1]
    assert not listed_twice
    read = names_read_by_the_library()
    unaccounted = sorted(field for field in fields if field not in read and not any(field in l for l in lists.values()))
    assert not unaccounted, f"fields neither read, refused nor listed as having no effect: {unaccounted}"
    # a field listed as refused or without effect is not one the library reads (a stale entry), except where the
    # name is one where only some values are refused (debug: tpu_metrics_debug)
    assert not [field for field in (*REFUSED, *NO_EFFECT) if field in read and field != "debug"]


def test_every_trl_config_field_is_honoured_refused_or_listed_with_a_reason():
    """The TRL configs' own fields (beyond TrainingArguments'): each read by the library, refused, or listed in
    CONFIG_NO_EFFECT with its reason; the lists name only fields some config has, and nothing the library reads."""
    base = {field.name for field in dataclasses.fields(TrainingArguments)}
    own = {field.name: name for name in CONFIGS[1:] for field in dataclasses.fields(getattr(hfnative, name))
           if field.name not in base}
    assert len(own) > 120
    read = names_read_by_the_library()
    unaccounted = sorted(f"{own[field]}.{field}" for field in own
                         if field not in read and field not in CONFIG_NO_EFFECT and field not in CONFIG_REFUSED)
    assert not unaccounted, f"config fields neither read, refused nor listed as having no effect: {unaccounted}"
    for listed in (CONFIG_NO_EFFECT, CONFIG_REFUSED):
        assert set(listed) <= set(own) and not set(listed) & base, sorted(set(listed) - set(own))
        assert all(isinstance(reason, str) and len(reason) > 20 for reason in listed.values())
    assert not [field for field in CONFIG_NO_EFFECT if field in read]
    for field in CONFIG_REFUSED:  # each refused when set, naming it
        args = hfnative.GRPOConfig(output_dir="unused", use_cpu=True)
        setattr(args, field, "[a-z]+")
        with pytest.raises(ValueError, match=rf"{field}="):
            check_settings(args)


def test_the_deprecated_importance_sampling_cap_is_the_clip_max():
    with pytest.warns(FutureWarning, match="vllm_importance_sampling_cap"):
        args = hfnative.GRPOConfig(output_dir="unused", use_cpu=True, vllm_importance_sampling_cap=2.5)
    assert args.vllm_importance_sampling_clip_max == 2.5


@pytest.mark.parametrize("name", sorted(REFUSED))
def test_a_refused_setting_away_from_its_default_raises_naming_it(name):
    args = TrainingArguments(output_dir="unused", use_cpu=True)
    check_settings(args)  # the defaults pass
    setattr(args, name, AWAY_FROM_DEFAULT[name])
    with pytest.raises(ValueError, match=rf"{name}="):
        check_settings(args)


@pytest.mark.parametrize("config_class", CONFIGS)
def test_every_config_s_defaults_pass(config_class):
    check_settings(getattr(hfnative, config_class)(output_dir="unused", use_cpu=True))


def test_the_trainer_refuses_before_loading_anything(tmp_path):
    with pytest.raises(ValueError, match="label_names=\\['targets'\\]: the objectives read their own columns"):
        SFTTrainer(model=str(tmp_path / "never-loaded"), train_dataset=[{"text": "a row"}],
                   args=SFTConfig(output_dir=str(tmp_path), use_cpu=True, label_names=["targets"]))


def test_save_on_each_node_is_refused_only_over_several_nodes(monkeypatch):
    """On one node, each node's first process (transformers' rule with save_on_each_node) is rank 0, which writes
    anyway: the setting changes nothing there. Over several nodes rank 0 alone writes: refused, naming the nodes."""
    args = TrainingArguments(output_dir="unused", use_cpu=True, save_on_each_node=True)
    default = TrainingArguments(output_dir="unused", use_cpu=True)  # made before torchrun's variables are set
    check_settings(args)  # one process
    monkeypatch.setenv("WORLD_SIZE", "4")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    check_settings(args)  # four processes on one node
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    with pytest.raises(ValueError, match="save_on_each_node=True: this run spans 2 nodes, and rank 0 writes"):
        check_settings(args)
    check_settings(default)  # the default, over two nodes


@pytest.mark.parametrize("options, match", [
    (dict(split_batches=True), "accelerator_config.split_batches=True: each rank trains on per_device_train_batch_size"),
    (dict(even_batches=False), "accelerator_config.even_batches=False"),
    (dict(use_seedable_sampler=False), "accelerator_config.use_seedable_sampler=False"),
    (dict(gradient_accumulation_kwargs={"num_step": 2}), r"gradient_accumulation_kwargs \['num_step'\]"),
    (dict(dispatch_batches=True), "accelerator_config.dispatch_batches=True: each rank reads its own rows"),
])
def test_accelerator_options_that_would_change_training_are_refused(options, match):
    args = TrainingArguments(output_dir="unused", use_cpu=True, accelerator_config=options)
    with pytest.raises(ValueError, match=match):
        check_settings(args)


def test_num_steps_is_refused_where_the_generation_batch_is_sized_from_the_accumulation():
    from hfnative.trainers.running.settings_check import apply_accelerator_config

    args = hfnative.GRPOConfig(output_dir="unused", use_cpu=True,
                               accelerator_config=dict(gradient_accumulation_kwargs={"num_steps": 2}))
    with pytest.raises(ValueError, match="num_steps=2 with GRPOConfig: its generation batch is sized"):
        apply_accelerator_config(args)


def test_accelerator_options_without_effect_pass_and_num_steps_sets_the_accumulation(tmp_path):
    """non_blocking, dispatch_batches, use_configured_state and the accumulation plugin's sync options change nothing
    here (transformers accumulates and schedules itself); num_steps becomes gradient_accumulation_steps when that is 1,
    and is refused beside it, as transformers' Trainer does."""
    options = dict(non_blocking=True, dispatch_batches=False,
                   gradient_accumulation_kwargs={"sync_each_batch": True, "num_steps": 3})
    rows = [{"text": "a row of text"}] * 4
    trainer = SFTTrainer(model=str(ROOT / "examples" / "tiny-qwen3"), train_dataset=rows,
                         args=SFTConfig(output_dir=str(tmp_path), use_cpu=True, accelerator_config=options))
    assert trainer.args.gradient_accumulation_steps == 3
    with pytest.raises(ValueError, match="`num_steps` is set but `gradient_accumulation_steps` is greater than 1"):
        SFTTrainer(model=str(ROOT / "examples" / "tiny-qwen3"), train_dataset=rows,
                   args=SFTConfig(output_dir=str(tmp_path), use_cpu=True, accelerator_config=options,
                                  gradient_accumulation_steps=2))
