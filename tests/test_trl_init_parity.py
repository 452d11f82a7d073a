"""What TRL's trainers set up when they are built, against hfnative's on the same arguments: the pad token mirrored
onto the tokenizer, the config and the generation config (a tokenizer without one pads with its EOS), and saved so;
the reference model and reward models named by path loaded with the policy's model_init_kwargs; the tokenizer the RL
trainers load themselves padded and truncated on the left; generation_kwargs the native engine cannot honour
refused by name."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from datasets import Dataset
from transformers import AutoTokenizer

import hfnative

trl = pytest.importorskip("trl")
ROOT = Path(__file__).resolve().parents[1]
MODEL = ROOT / "examples" / "tiny-qwen3"
pytestmark = pytest.mark.usefixtures("one_torch_thread")


def _no_pad_model(folder: Path) -> str:
    """The tiny model with a tokenizer that has no pad token (a base model's, e.g. Llama 3's)."""
    shutil.copytree(MODEL, folder)
    tokenizer = AutoTokenizer.from_pretrained(str(MODEL))
    tokenizer.pad_token = None
    tokenizer.save_pretrained(str(folder))
    for name in ("config.json", "generation_config.json"):
        fields = json.loads((folder / name).read_text())
        fields.pop("pad_token_id", None)
        (folder / name).write_text(json.dumps(fields))
    assert AutoTokenizer.from_pretrained(str(folder)).pad_token is None
    return str(folder)


def _preference_rows():
    return Dataset.from_list([{"prompt": f"Say {i}", "chosen": " yes", "rejected": " no"} for i in range(8)])


def _rewarded(completions, **kwargs):
    return [float(len(c)) for c in completions]


def _trainers(model: str, out: Path):
    """name -> (a function building the trainer of ``module``)."""
    common = dict(use_cpu=True, bf16=False, report_to="none", max_steps=1, per_device_train_batch_size=2,
                  save_strategy="no")
    return {
        "sft": lambda m: m.SFTTrainer(model=model, args=m.SFTConfig(output_dir=str(out / f"sft-{m.__name__}"), **common),
                                      train_dataset=Dataset.from_list([{"text": f"row {i}"} for i in range(8)])),
        "dpo": lambda m: m.DPOTrainer(model=model, args=m.DPOConfig(output_dir=str(out / f"dpo-{m.__name__}"), **common),
                                      train_dataset=_preference_rows()),
        "grpo": lambda m: m.GRPOTrainer(model=model, reward_funcs=_rewarded, train_dataset=Dataset.from_list(
            [{"prompt": f"Say {i}"} for i in range(8)]), args=m.GRPOConfig(
                output_dir=str(out / f"grpo-{m.__name__}"), num_generations=2, max_completion_length=4, **common)),
    }


@pytest.mark.parametrize("name", ["sft", "dpo", "grpo"])
def test_the_pad_token_is_mirrored_and_saved_as_trl(name, tmp_path):
    model = _no_pad_model(tmp_path / "no-pad")
    seen = {}
    for module in (hfnative, trl):  # TRL last: its accelerate state is the one in place
        trainer = _trainers(model, tmp_path)[name](module)
        out = tmp_path / f"saved-{name}-{module.__name__}"
        trainer.save_model(str(out))
        tokenizer = trainer.processing_class
        seen[module] = (tokenizer.pad_token, trainer.model.config.pad_token_id,
                        trainer.model.generation_config.pad_token_id,
                        json.loads((out / "config.json").read_text()).get("pad_token_id"),
                        json.loads((out / "generation_config.json").read_text()).get("pad_token_id"),
                        AutoTokenizer.from_pretrained(str(out)).pad_token)
    assert seen[hfnative] == seen[trl]
    assert seen[trl][0] == AutoTokenizer.from_pretrained(model).eos_token  # the EOS pads


def test_the_rl_trainers_load_their_tokenizer_padded_on_the_left(tmp_path):
    sides = {}
    for module in (hfnative, trl):
        tokenizer = _trainers(str(MODEL), tmp_path)["grpo"](module).processing_class
        sides[module] = (tokenizer.padding_side, tokenizer.truncation_side)
    assert sides[hfnative] == sides[trl] == ("left", "left")


def test_the_reference_and_reward_models_load_with_the_policys_model_init_kwargs(tmp_path):
    """model_init_kwargs={"dtype": "bfloat16"}: the policy, the reference built from its name and a reward model named
    by path all load in bfloat16, as under TRL."""
    common = dict(use_cpu=True, bf16=False, report_to="none", max_steps=1, per_device_train_batch_size=2,
                  save_strategy="no", model_init_kwargs={"dtype": "bfloat16"})
    dtypes = {}
    for module in (hfnative, trl):
        dpo = module.DPOTrainer(model=str(MODEL), args=module.DPOConfig(output_dir=str(tmp_path / "dpo"), **common),
                                train_dataset=_preference_rows())
        grpo = module.GRPOTrainer(model=str(MODEL), reward_funcs=str(MODEL), train_dataset=Dataset.from_list(
            [{"prompt": f"Say {i}"} for i in range(8)]), args=module.GRPOConfig(
                output_dir=str(tmp_path / "grpo"), num_generations=2, max_completion_length=4, beta=0.1, **common))
        reference = dpo.ref_model if module is trl else dpo.objective.auxiliary_models["ref_model"]
        reward = grpo.reward_funcs[0]
        dtypes[module] = [next(m.parameters()).dtype for m in (dpo.model, reference, reward)]
    assert dtypes[hfnative] == dtypes[trl] == [torch.bfloat16] * 3


def test_generation_kwargs_the_engine_cannot_honour_are_refused(tmp_path):
    config = hfnative.GRPOConfig(output_dir=str(tmp_path), use_cpu=True, report_to="none", num_generations=2,
                                 per_device_train_batch_size=2, max_completion_length=4,
                                 generation_kwargs={"suppress_tokens": [5]})
    with pytest.raises(ValueError, match=r"generation_kwargs\['suppress_tokens'\] is not a setting"):
        hfnative.GRPOTrainer(model=str(MODEL), reward_funcs=_rewarded, args=config,
                             train_dataset=Dataset.from_list([{"prompt": "Say"}] * 4))


@pytest.mark.parametrize("trainer", ["GRPO", "RLOO"])
def test_reward_attributes_are_trls(trainer, tmp_path):
    """trainer.reward_funcs / reward_func_names / reward_weights / reward_processing_classes, as TRL's."""
    seen = {}
    for module in (hfnative, trl):
        config = getattr(module, f"{trainer}Config")(
            output_dir=str(tmp_path / module.__name__), use_cpu=True, bf16=False, report_to="none", max_steps=1,
            num_generations=2, per_device_train_batch_size=2, max_completion_length=4, reward_weights=[0.5, 2.0])
        built = getattr(module, f"{trainer}Trainer")(model=str(MODEL), reward_funcs=[_rewarded, str(MODEL)],
                                                     args=config, train_dataset=Dataset.from_list([{"prompt": "Hi"}] * 4))
        seen[module] = built
    ours, theirs = seen[hfnative], seen[trl]
    assert ours.reward_func_names == theirs.reward_func_names
    assert torch.equal(ours.reward_weights, theirs.reward_weights) and ours.reward_weights.dtype == torch.float32
    assert ours.reward_funcs[0] is _rewarded and ours.reward_funcs[1].config.num_labels == 1
    assert [type(t).__name__ if t is not None else None for t in ours.reward_processing_classes] == \
        [type(t).__name__ if t is not None else None for t in theirs.reward_processing_classes]


def _sft_run(module, out: Path, model_init_kwargs: dict):
    trainer = module.SFTTrainer(model=str(MODEL), train_dataset=Dataset.from_list([{"text": f"row {i} " * 6} for i in range(12)]),
                                args=module.SFTConfig(output_dir=str(out), use_cpu=True, bf16=False, report_to="none",
                                                      max_steps=3, per_device_train_batch_size=4, logging_steps=1,
                                                      save_strategy="no", learning_rate=1e-2,
                                                      model_init_kwargs=model_init_kwargs))
    trainer.train()
    trainer.save_model()
    return trainer, [(e["loss"], e["grad_norm"]) for e in trainer.state.log_history if "loss" in e]


@pytest.mark.parametrize("case", ["rope-and-cache", "dropout"])
def test_config_fields_in_model_init_kwargs_train_and_save_as_trl(case, tmp_path):
    """model_init_kwargs holding config fields (as from_pretrained takes them): a linear RoPE scaling and use_cache
    train natively, a dropout the native models lack trains through transformers' module (with a warning); the steps
    equal TRL's and the saved config.json holds the fields as TRL's does."""
    if case == "rope-and-cache":
        kwargs = {"rope_parameters": {"rope_type": "linear", "factor": 2.0, "rope_theta": 10000.0}, "use_cache": False}
    else:
        kwargs = {"attention_dropout": 0.1}
    runs = {module: _sft_run(module, tmp_path / module.__name__, dict(kwargs)) for module in (hfnative, trl)}
    (ours_trainer, ours), (_, theirs) = runs[hfnative], runs[trl]
    for (loss, grad_norm), (their_loss, their_grad_norm) in zip(ours, theirs, strict=True):
        assert loss == pytest.approx(their_loss, rel=1e-5) and grad_norm == pytest.approx(their_grad_norm, rel=1e-4)
    saved = {m: json.loads((tmp_path / m.__name__ / "config.json").read_text()) for m in (hfnative, trl)}
    for name in kwargs:
        assert saved[hfnative][name] == saved[trl][name], name
    from hfnative.models.decoder import Transformer

    assert isinstance(ours_trainer.native_model, Transformer) == (case == "rope-and-cache")
    # the scaling is what trained: without it the first loss differs
    if case == "rope-and-cache":
        _, plain = _sft_run(hfnative, tmp_path / "plain", {})
        assert plain[0][0] != pytest.approx(ours[0][0], rel=1e-6)


def test_model_init_kwargs_that_are_no_config_field_are_refused(tmp_path):
    with pytest.raises(ValueError, match=r"model_init_kwargs \['not_a_field'\]: neither a loading option"):
        _sft_run(hfnative, tmp_path, {"not_a_field": 1})


MARKED_WITHOUT_STOP = ("{% for message in messages %}<|im_start|>{{ message['role'] }}\n{% if message['role'] == 'assistant' %}"
                       "{% generation %}{{ message['content'] }}{% endgeneration %}{% else %}{{ message['content'] }}"
                       "{% endif %}<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


@pytest.mark.parametrize("stop_in_mask", [False, True])
def test_assistant_only_loss_warns_where_the_stop_token_is_not_trained(stop_in_mask, tmp_path, caplog):
    """TRL's warning when the template's generation markers leave the assistant's end-of-turn token out of the mask
    (the model would never learn to stop); none where the token is inside."""
    import logging

    template = MARKED_WITHOUT_STOP.replace("{% endgeneration %}{% else %}{{ message['content'] }}{% endif %}<|im_end|>",
                                           "<|im_end|>{% endgeneration %}{% else %}{{ message['content'] }}<|im_end|>"
                                           "{% endif %}") if stop_in_mask else MARKED_WITHOUT_STOP
    rows = Dataset.from_list([{"messages": [{"role": "user", "content": f"hi {i}"},
                                            {"role": "assistant", "content": "hello"}]} for i in range(4)])
    warned = {}
    for module in (hfnative, trl):
        tokenizer = AutoTokenizer.from_pretrained(str(MODEL))
        tokenizer.chat_template = template
        caplog.clear()
        with caplog.at_level(logging.WARNING):
            module.SFTTrainer(model=str(MODEL), train_dataset=rows, processing_class=tokenizer,
                              args=module.SFTConfig(output_dir=str(tmp_path / module.__name__), use_cpu=True,
                                                    report_to="none", max_steps=1, assistant_only_loss=True))
        warned[module] = any("end-of-turn token in the loss mask" in r.getMessage() for r in caplog.records)
    assert warned[hfnative] == warned[trl] == (not stop_in_mask)


def test_config_fields_given_by_alias_are_saved_as_trl(tmp_path):
    """transformers 5 reads rope_scaling as rope_parameters: the saved config holds what trained, as TRL's."""
    kwargs = {"rope_scaling": {"rope_type": "linear", "factor": 2.0, "rope_theta": 10000.0}}
    for module in (hfnative, trl):
        _sft_run(module, tmp_path / module.__name__, dict(kwargs))
    saved = {m: json.loads((tmp_path / m.__name__ / "config.json").read_text()) for m in (hfnative, trl)}
    assert saved[hfnative]["rope_parameters"] == saved[trl]["rope_parameters"]
    assert saved[trl]["rope_parameters"]["rope_type"] == "linear"


def test_dropout_sends_only_the_trained_model_to_transformers(tmp_path):
    """attention_dropout in model_init_kwargs: DPO's policy trains in transformers' module (dropout on, as TRL's), and
    so does its reference made from the same name (where the policy's batches are laid out); the steps equal TRL's. A
    teacher or any other frozen model stays native (eval mode: no dropout). A reward model (a classifier) takes the
    field through transformers' classifier."""
    from hfnative.models.decoder import Transformer

    common = dict(use_cpu=True, bf16=False, report_to="none", max_steps=2, per_device_train_batch_size=2,
                  logging_steps=1, save_strategy="no", learning_rate=1e-2, model_init_kwargs={"attention_dropout": 0.2})
    logs = {}
    for module in (hfnative, trl):
        trainer = module.DPOTrainer(model=str(MODEL), train_dataset=_preference_rows(),
                                    args=module.DPOConfig(output_dir=str(tmp_path / module.__name__), **common))
        if module is hfnative:
            assert not isinstance(trainer.native_model, Transformer)
            assert not isinstance(trainer.objective.auxiliary_models["ref_model"], Transformer)
        trainer.train()
        logs[module] = [(e["loss"], e["grad_norm"]) for e in trainer.state.log_history if "loss" in e]
    for (loss, grad_norm), (their_loss, their_grad_norm) in zip(logs[hfnative], logs[trl], strict=True):
        assert loss == pytest.approx(their_loss, rel=1e-5) and grad_norm == pytest.approx(their_grad_norm, rel=1e-4)
    reward = hfnative.RewardTrainer(model=str(MODEL), train_dataset=_preference_rows().remove_columns("prompt"),
                                    args=hfnative.RewardConfig(output_dir=str(tmp_path / "reward"), **common))
    assert reward.model.config.attention_dropout == 0.2


def test_a_teacher_of_the_policys_name_loads_with_its_own_kwargs(tmp_path):
    """model_init_kwargs are the student's: a teacher named like it loads as given (TRL: teacher_model_init_kwargs)."""
    dtypes = {}
    for module in (hfnative, trl):
        config_class = module.GKDConfig if module is hfnative else __import__("trl.experimental.gkd", fromlist=["x"]).GKDConfig
        trainer_class = module.GKDTrainer if module is hfnative else __import__("trl.experimental.gkd", fromlist=["x"]).GKDTrainer
        args = config_class(output_dir=str(tmp_path / module.__name__), use_cpu=True, bf16=False, report_to="none",
                            max_steps=1, model_init_kwargs={"dtype": "bfloat16"})
        trainer = trainer_class(model=str(MODEL), teacher_model=str(MODEL), args=args,
                                processing_class=AutoTokenizer.from_pretrained(str(MODEL)),
                                train_dataset=Dataset.from_list([{"messages": [{"role": "user", "content": "hi"},
                                                                               {"role": "assistant", "content": "yo"}]}] * 4))
        teacher = trainer.teacher_model if module is trl else trainer.objective.teacher
        dtypes[module] = (next(trainer.model.parameters()).dtype, next(teacher.parameters()).dtype)
    assert dtypes[hfnative] == dtypes[trl] == (torch.bfloat16, torch.float32)


def test_loading_options_without_effect_pass_and_others_are_refused(tmp_path):
    from hfnative.trainers.running.model_loading import config_overrides

    assert config_overrides({"max_memory": {"cpu": "1GB"}, "device_map": "auto", "use_cache": False}) == {"use_cache": False}
    with pytest.raises(ValueError, match="subfolder: a checkpoint in a subfolder"):
        config_overrides({"subfolder": "step-100"})


def test_harmless_generation_kwargs_pass_and_reward_weights_can_be_set(tmp_path):
    config = hfnative.GRPOConfig(output_dir=str(tmp_path), use_cpu=True, report_to="none", num_generations=2,
                                 per_device_train_batch_size=2, max_completion_length=4,
                                 generation_kwargs={"use_cache": True, "pad_token_id": 0, "top_k": 3})
    trainer = hfnative.GRPOTrainer(model=str(MODEL), reward_funcs=[_rewarded, _rewarded], args=config,
                                   train_dataset=Dataset.from_list([{"prompt": "Say"}] * 4))
    assert trainer.objective.rollout.sampling.top_k == 3
    trainer.reward_weights = [0.25, 4.0]
    assert torch.equal(trainer.reward_weights, torch.tensor([0.25, 4.0]))


def test_online_dpo_saves_use_cache_off_under_gradient_checkpointing_as_trl(tmp_path):
    from trl.experimental.online_dpo import OnlineDPOConfig, OnlineDPOTrainer

    saved = {}
    for module, (config_class, trainer_class) in ((hfnative, (hfnative.OnlineDPOConfig, hfnative.OnlineDPOTrainer)),
                                                  (trl, (OnlineDPOConfig, OnlineDPOTrainer))):
        out = tmp_path / module.__name__
        trainer = trainer_class(model=str(MODEL), reward_funcs=[_rewarded], train_dataset=Dataset.from_list(
            [{"prompt": "Hello"}] * 4), args=config_class(output_dir=str(out), use_cpu=True, bf16=False,
                                                         report_to="none", max_steps=1, max_new_tokens=4,
                                                         gradient_checkpointing=True),
            processing_class=AutoTokenizer.from_pretrained(str(MODEL)))
        trainer.save_model(str(out / "saved"))
        saved[module] = json.loads((out / "saved" / "config.json").read_text()).get("use_cache")
    assert saved[hfnative] == saved[trl] is False


def test_a_config_field_that_changes_a_shape_is_named_in_the_error(tmp_path):
    with pytest.raises(Exception, match=r"as model_init_kwargs \['num_hidden_layers'\] change it"):
        _sft_run(hfnative, tmp_path, {"num_hidden_layers": 1})
