"""PPO with a value model against TRL 0.29.1's PPOTrainer (``trl.experimental.ppo``) run beside us.

TRL 0.29.1 runs in a subprocess (tests/trl029_ppo.py: installed on its own, the dev extra's TRL 1.16 having the
same package name; skipped with the reason when it cannot be installed). Our trainer samples its completions with the
native engine (the sampled path runs); each is then given a fixed shape (an EOS at a place set by its prompt and row,
or none and the full response length) so that every case meets stop tokens and missing EOS, and TRL replays those
completions, our prompts' order and our mini-batch shuffles. Compared per update: every key TRL logs, the
statistics of every micro-batch (the per-step policy and value losses), the advantages and returns - 1e-5 relative
at the first update, 1e-4 after updates.
"""

from __future__ import annotations

import dataclasses
import json
import shutil
from pathlib import Path

import pytest
import torch

import hfnative
from trl029_ppo import run_trl029, trl029_dir, two_adapter_policy

pytestmark = pytest.mark.usefixtures("one_torch_thread")

ROOT = Path(__file__).resolve().parents[1]
MODEL = str(ROOT / "examples" / "tiny-qwen3")
EOS, PAD = 2, 0  # tiny-qwen3's <|im_end|> and <|endoftext|>
RESPONSE_LENGTH = 6

# the compared cases: PPOConfig settings beyond the common ones
CASES = {
    "plain": dict(per_device_train_batch_size=4),
    "whiten_rewards": dict(per_device_train_batch_size=4, gradient_accumulation_steps=2, whiten_rewards=True),
    "k3": dict(per_device_train_batch_size=4, kl_estimator="k3"),
    "missing_eos_penalty": dict(per_device_train_batch_size=4, missing_eos_penalty=1.0),
    "num_mini_batches": dict(per_device_train_batch_size=2, gradient_accumulation_steps=2, num_mini_batches=2),
    "accumulation": dict(per_device_train_batch_size=2, gradient_accumulation_steps=2),
    "lora": dict(per_device_train_batch_size=4),
    # a PeftModel with a trained and a reference adapter (TRL's ref_adapter_name)
    "ref_adapter": dict(per_device_train_batch_size=4, ref_adapter_name="ref"),
}
LORA = dict(r=4, lora_alpha=8, lora_dropout=0.0, target_modules=["q_proj", "v_proj"], task_type="CAUSAL_LM")


@pytest.fixture(scope="module")
def trl029(tmp_path_factory):
    return trl029_dir(tmp_path_factory.getbasetemp().parent)


def save_classifier(folder: Path, seed: int) -> str:
    """A random one-label Qwen3 sequence classifier with tiny-qwen3's tokenizer."""
    from transformers import Qwen3Config, Qwen3ForSequenceClassification

    config = Qwen3Config(vocab_size=1024, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=1, head_dim=16, num_labels=1, pad_token_id=PAD)
    torch.manual_seed(seed)
    Qwen3ForSequenceClassification(config).save_pretrained(folder)
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        shutil.copy(Path(MODEL) / name, folder / name)
    return str(folder)


def save_initial_adapter(folder: Path, seed: int = 3) -> str:
    """peft's LoRA adapter on tiny-qwen3 as peft draws it, its B made non-zero so that the policy starts away from the
    reference; both trainers start from it."""
    from peft import get_peft_model, LoraConfig
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = get_peft_model(AutoModelForCausalLM.from_pretrained(MODEL), LoraConfig(**LORA))
    from peft import get_peft_model_state_dict

    state = {k: (torch.randn_like(v) * 0.05 if "lora_B" in k else v).contiguous()
             for k, v in get_peft_model_state_dict(model).items()}
    model.save_pretrained(folder)
    save_file(state, str(folder / "adapter_model.safetensors"))
    return str(folder / "adapter_model.safetensors")


def prompts(n: int = 8) -> list[list[int]]:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(MODEL)
    words = ["sky", "fox", "robot", "count", "blue", "grass", "tree", "sun"]
    return [tokenizer(f"Tell me about the {words[i % 8]} number {i}" + " again" * (i % 3))["input_ids"] for i in range(n)]


def shaped(sampled: list[int], prompt: list[int], row: int) -> list[int]:
    """A sampled completion given a fixed shape: an EOS after 1 to RESPONSE_LENGTH - 1 tokens, or none and the full
    length, set by the prompt and the row; the sampled tokens first (EOS and pad taken out), then fixed ones."""
    seed = sum(prompt) + 7 * row
    body = [t for t in sampled if t not in (EOS, PAD)] + [10 + (seed * 3 + 17 * k) % 300 for k in range(RESPONSE_LENGTH)]
    if seed % 4 == 0:
        return body[:RESPONSE_LENGTH]
    return body[: 1 + seed % (RESPONSE_LENGTH - 1)] + [EOS]


def settings(output_dir, **extra) -> dict:
    return dict(output_dir=str(output_dir), use_cpu=True, bf16=False, num_ppo_epochs=2, response_length=RESPONSE_LENGTH,
                stop_token="eos", total_episodes=16, learning_rate=3e-4, logging_steps=1, report_to=[],
                save_strategy="no", seed=0, num_sample_generations=0, **extra)


def run_ours(case: str, folders: dict, output_dir) -> dict:
    """Our PPOTrainer on the case; what TRL needs to replay it, and what to compare."""
    from datasets import Dataset
    from hfnative.generation import Rollouts
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(MODEL, padding_side="left")
    peft_config, policy = None, MODEL
    if case == "lora":
        from peft import LoraConfig

        peft_config = LoraConfig(**LORA)
    if case == "ref_adapter":
        policy = two_adapter_policy(MODEL, LORA, folders["adapter"], folders["ref_adapter"])
    trainer = hfnative.PPOTrainer(hfnative.PPOConfig(**settings(output_dir, **CASES[case])), tokenizer, policy, None,
                                  folders["reward"], Dataset.from_list([{"input_ids": p} for p in prompts()]),
                                  folders["value"], peft_config=peft_config)
    if case == "ref_adapter":  # the reference: the base with the reference adapter in it, apart from the policy
        assert trainer.ref_model is not None and list(policy.peft_config) == ["default"]
    if case == "lora":
        from hfnative.converters.peft import load_adapter_weights

        assert trainer.ref_model is None  # the policy with its adapters off
        load_adapter_weights(trainer.converted, Path(folders["adapter"]).parent)
    objective = trainer.objective
    record = {"prompts": [], "completions": [], "permutations": [], "rollouts": [], "stats": []}
    generate, minibatch_order = objective.rollout.generate, objective.minibatch_order
    make_rollout, after_step = objective.make_rollout, objective.after_optimizer_step

    def shaped_generate(prompt_ids, **streams):
        sampled = generate(prompt_ids, **streams)  # the native engine samples
        completions = [shaped(c, p, i) for i, (c, p) in enumerate(zip(sampled.completion_ids, prompt_ids))]
        record["prompts"].append([list(p) for p in prompt_ids])
        record["completions"].append(completions)
        record["permutations"].append([])
        return Rollouts(completions, [[0.0] * len(c) for c in completions],
                        ["stop" if c[-1] == EOS else "length" for c in completions])

    def recorded_order(update, epoch):
        order = minibatch_order(update, epoch)
        record["permutations"][-1].append(order.tolist())
        return order

    def recorded_rollout(rows, place):
        rollout = make_rollout(rows, place)
        record["rollouts"].append({k: v.tolist() for k, v in rollout.items() if k in ("advantages", "returns",
                                                                                      "rewards", "values", "scores")})
        return rollout

    def recorded_step():
        record["stats"].append(objective._stats.tolist())
        after_step()

    objective.rollout.generate, objective.minibatch_order = shaped_generate, recorded_order
    objective.make_rollout, objective.after_optimizer_step = recorded_rollout, recorded_step
    trainer.train()
    record["log_history"] = trainer.state.log_history[:-1]
    record["updates_per_pass"] = objective._updates_per_pass
    return record


@pytest.fixture(scope="module")
def runs(trl029, tmp_path_factory):
    """Every case trained by us, then replayed by TRL 0.29.1 (one subprocess for all)."""
    root = tmp_path_factory.mktemp("ppo")
    folders = {"reward": save_classifier(root / "reward", 1), "value": save_classifier(root / "value", 2),
               "adapter": save_initial_adapter(root / "adapter"),
               "ref_adapter": save_initial_adapter(root / "ref_adapter", seed=4)}
    ours = {case: run_ours(case, folders, root / f"ours-{case}") for case in CASES}
    payload = {"runs": [
        {"tokenizer": MODEL, "policy": MODEL, "reward": folders["reward"], "value": folders["value"],
         "config": settings(root / f"trl-{case}", **CASES[case]),
         "peft": ({"config": LORA, "adapter": folders["adapter"]} if case == "lora" else
                  {"config": LORA, "adapter": folders["adapter"], "ref_adapter": folders["ref_adapter"]}
                  if case == "ref_adapter" else None),
         "replay": {key: ours[case][key] for key in ("prompts", "completions", "permutations", "updates_per_pass")}}
        for case in CASES
    ]}
    theirs = run_trl029(payload, root / "trl", trl029)
    return {case: (ours[case], result) for case, result in zip(CASES, theirs)}


def _close(mine, reference, rel: float, where) -> None:
    mine, reference = (torch.as_tensor(x).to(torch.float64) for x in (mine, reference))
    torch.testing.assert_close(mine, reference, rtol=rel, atol=rel * 0.1, msg=lambda m: f"{where}: {m}")


@pytest.mark.parametrize("case", list(CASES))
def test_ppo_equals_trl029(runs, case):
    ours, theirs = runs[case]
    logs = theirs["log_history"]
    assert len(ours["log_history"]) == len(logs) == len(theirs["updates"]) >= 2
    for update, (mine, reference) in enumerate(zip(ours["log_history"], logs)):
        rel = 1e-5 if update == 0 else 1e-4
        where = f"{case}, update {update + 1}"
        for key, value in reference.items():
            if key in ("eps", "epoch", "step"):  # the epoch: TRL's replay counts its replayed rows
                continue
            assert key in mine, (where, key)
            _close(mine[key], value, rel, f"{where}: {key}")
        rollout, captured = ours["rollouts"][update], theirs["updates"][update]
        for name in ("scores", "values", "rewards", "advantages", "returns"):
            _close(rollout[name], captured[name], rel, f"{where}: {name}")
        stats = torch.tensor(ours["stats"][update])
        for index, name in enumerate(("approxkl", "pg_clipfrac", "pg_loss", "vf_loss", "vf_clipfrac", "entropy",
                                      "ratio")):
            _close(stats[index], theirs["stats"][update][f"{name}_stats"], rel, f"{where}: {name} per micro-batch")
    completions = [c for update in ours["completions"] for c in update]
    assert any(c[-1] == EOS for c in completions) and any(EOS not in c for c in completions)


def test_config_has_trls_fields_and_defaults(trl029, tmp_path):
    theirs = run_trl029({"mode": "config"}, tmp_path, trl029)
    ours_config = hfnative.PPOConfig("unused", use_cpu=True)
    ours = {f.name: getattr(ours_config, f.name) for f in dataclasses.fields(ours_config)}
    names = set(theirs) - {"accelerator_config", "output_dir", "logging_dir"}
    assert names <= set(ours), sorted(names - set(ours))
    mismatched = {n: (ours[n], theirs[n]) for n in names if json.loads(json.dumps(ours[n], default=repr)) != theirs[n]}
    assert not mismatched
    assert ours_config.learning_rate == 3e-6 and ours_config.response_length == 53 and ours_config.kl_coef == 0.05
    from hfnative.trainers import PPOConfig, PPOTrainer  # noqa: F401  (both import paths)

    assert PPOConfig is hfnative.PPOConfig


def test_every_config_field_is_honoured_refused_or_listed():
    """test_no_silent_settings' audit, on PPOConfig's own fields."""
    from test_no_silent_settings import names_read_by_the_library
    from hfnative.trainers.running.settings_check import CONFIG_NO_EFFECT, CONFIG_REFUSED, check_settings

    base = {f.name for f in dataclasses.fields(hfnative.TrainingArguments)}
    own = {f.name for f in dataclasses.fields(hfnative.PPOConfig)} - base
    read = names_read_by_the_library()
    assert not sorted(n for n in own if n not in read and n not in CONFIG_NO_EFFECT and n not in CONFIG_REFUSED)
    check_settings(hfnative.PPOConfig("unused", use_cpu=True))


def test_batch_sizes_are_trls_and_bad_ones_refused():
    from hfnative.trainers.algorithms.ppo_config import resolve_batch_sizes

    args = hfnative.PPOConfig("unused", use_cpu=True, per_device_train_batch_size=3, gradient_accumulation_steps=4,
                              num_mini_batches=2, num_train_epochs=2)
    resolve_batch_sizes(args, world_size=2, dataset_length=50)
    assert (args.local_batch_size, args.micro_batch_size, args.batch_size) == (12, 6, 24)
    assert (args.local_mini_batch_size, args.mini_batch_size, args.total_episodes) == (6, 12, 100)
    assert args.num_total_batches == 5  # ceil(100 / 24)
    args = hfnative.PPOConfig("unused", use_cpu=True, per_device_train_batch_size=3, num_mini_batches=2)
    with pytest.raises(ValueError, match="`batch_size` must be a multiple of `num_mini_batches`, inexact division"):
        resolve_batch_sizes(args, world_size=1, dataset_length=8)
    args = hfnative.PPOConfig("unused", use_cpu=True, per_device_train_batch_size=4, whiten_rewards=True)
    with pytest.raises(ValueError, match="insufficient for whitening"):
        resolve_batch_sizes(args, world_size=1, dataset_length=8)


@pytest.mark.parametrize("settings_, message", [
    (dict(stop_token="eos", stop_token_id=2), "You cannot set both `stop_token` and `stop_token_id`"),
    (dict(stop_token="end"), "Unknown `stop_token` end"),
    (dict(kl_estimator="k2"), "kl_estimator must be either 'k1'"),
    (dict(ref_adapter_name="ref"), "name adapters of a peft PeftModel; `model` is a str"),
    (dict(optimizer_in_backward=True, max_grad_norm=0), "optimizer_in_backward"),
])
def test_bad_settings_are_refused_with_trls_messages(tmp_path, settings_, message):
    from datasets import Dataset

    args = hfnative.PPOConfig(str(tmp_path), use_cpu=True, bf16=False, **settings_)
    with pytest.raises(ValueError, match=message):
        hfnative.PPOTrainer(args, None, MODEL, None, "unused", Dataset.from_list([{"input_ids": [1, 2]}]), "unused")


def test_bad_models_and_rows_are_refused(tmp_path):
    from datasets import Dataset
    from transformers import AutoTokenizer

    args = hfnative.PPOConfig(str(tmp_path), use_cpu=True, bf16=False, per_device_train_batch_size=1)
    rows = Dataset.from_list([{"input_ids": [1, 2]}])
    with pytest.raises(ValueError, match="cannot be the same object"):
        hfnative.PPOTrainer(args, None, rows, rows, "unused", rows, "unused")
    folder = save_classifier(tmp_path / "classifier", 1)
    tokenizer = AutoTokenizer.from_pretrained(MODEL, padding_side="left")
    with pytest.raises(ValueError, match="'input_ids' column"):
        hfnative.PPOTrainer(args, tokenizer, MODEL, None, folder, Dataset.from_list([{"text": "hi"}]), folder)


def test_named_adapters_are_checked(tmp_path):
    """ref_adapter_name / model_adapter_name name adapters the PeftModel holds, and nothing else is in it."""
    from datasets import Dataset
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    def build(**settings_):
        policy = get_peft_model(AutoModelForCausalLM.from_pretrained(MODEL), LoraConfig(**LORA))
        args = hfnative.PPOConfig(str(tmp_path), use_cpu=True, bf16=False, **settings_)
        return hfnative.PPOTrainer(args, None, policy, None, "unused", Dataset.from_list([{"input_ids": [1, 2]}]),
                                   "unused")

    with pytest.raises(ValueError, match=r"holds the adapters \['default'\], not \['ref'\]"):
        build(ref_adapter_name="ref")
    with pytest.raises(ValueError, match=r"not \['trained'\]"):
        build(model_adapter_name="trained")


def test_low_rank_optimizers_are_refused(tmp_path):
    """GaLore / APOLLO resolve their targets over one model; PPO trains the policy and the value model under one
    optimizer: refused by name when the optimizer is made."""
    from datasets import Dataset
    from transformers import AutoTokenizer

    folder = save_classifier(tmp_path / "classifier", 1)
    tokenizer = AutoTokenizer.from_pretrained(MODEL, padding_side="left")
    args = hfnative.PPOConfig(str(tmp_path / "out"), use_cpu=True, bf16=False, per_device_train_batch_size=2,
                              optim="galore_adamw", optim_target_modules=["attn"])
    trainer = hfnative.PPOTrainer(args, tokenizer, MODEL, None, folder, Dataset.from_list([{"input_ids": [1, 2]}] * 4),
                                  folder)
    with pytest.raises(ValueError, match="GaLore / APOLLO targets are not resolved over both"):
        trainer.create_optimizer()
