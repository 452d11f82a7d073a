"""Optimizers by the names transformers gives third-party ones, and their state: bitsandbytes' names (Lion,
AdEMAMix, RMSprop, AdamW, 32- and 8-bit) against bitsandbytes itself; optimizer state through checkpoints (torch.save
and the distributed checkpoint, over bf16 weights, quantized, an empty shard); schedule-free optimizers' modes."""

import pytest
import torch
from torch import nn
from transformers import Qwen3Config, Qwen3ForCausalLM

from hfnative.optim import OptimizerSettings, build_optimizer, parse_optim_args
from test_optim import _hf_trainer_optimizer, _step_each


# bitsandbytes' optimizers by transformers' names, made in PyTorch (hfnative.optim.state_optimizers); the oracle is
# bitsandbytes itself, as transformers' Trainer builds it
BNB_HYPERPARAMETERS = dict(learning_rate=1e-3, weight_decay=0.05, adam_beta1=0.8, adam_beta2=0.95, adam_epsilon=1e-7)
BNB_32BIT_CASES = [
    ("paged_adamw_32bit", None, "AdamW"),
    ("lion_32bit", None, "Lion"),
    ("paged_lion_32bit", None, "Lion"),
    ("ademamix", None, "AdEMAMix"),
    ("paged_ademamix_32bit", "beta3=0.999,alpha=2.0,t_alpha=3,t_beta3=4", "AdEMAMix"),
    ("rmsprop_bnb", None, "RMSprop"),
    ("rmsprop_bnb_32bit", "alpha=0.9,eps=1e-6", "RMSprop"),
]


def _bnb_model():
    torch.manual_seed(0)
    config = Qwen3Config(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=16)
    return Qwen3ForCausalLM(config)


def _bnb_reference(model, optim, optim_args, tmp_path):
    """What transformers' Trainer builds for ``optim`` (bitsandbytes' class); RMSprop's optim_args are given as
    numbers (transformers hands bitsandbytes the strings, which its RMSprop cannot use)."""
    pytest.importorskip("bitsandbytes")
    rmsprop_args = optim.startswith("rmsprop") and optim_args
    hf = _hf_trainer_optimizer(model, tmp_path, optim=optim, optim_args=None if rmsprop_args else optim_args,
                               **BNB_HYPERPARAMETERS)
    if rmsprop_args:
        values = {key: float(value) for key, value in parse_optim_args(optim_args).items()}
        for group in hf.param_groups:
            group["eps"] = values["eps"]
            group["betas"] = (values["alpha"], group["betas"][1])  # bitsandbytes keeps RMSprop's alpha as beta1
    return hf


def _train_steps(model, optimizer, steps=6):
    torch.manual_seed(1)
    ids = torch.randint(0, 256, (4, 32))
    losses = []
    for _ in range(steps):
        loss = model(ids, labels=ids).loss
        losses.append(loss.item())
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    return losses


@pytest.mark.parametrize("optim, optim_args, class_name", BNB_32BIT_CASES)
def test_bitsandbytes_32bit_names_make_bitsandbytes_updates(optim, optim_args, class_name, tmp_path):
    """Each step's parameters equal bitsandbytes' (Lion's signs, AdEMAMix's schedules of alpha and beta3, RMSprop's
    alpha and eps from optim_args, the decay groups) to within 3% of one step's update (lr 1e-3): fp32 round-off,
    which Adam-like updates amplify where a gradient is round-off itself (the scheduled AdEMAMix case: 3e-6 after 6
    steps on an Intel CPU, 1.4e-5 on an AMD one; the others 1e-7 or less). A wrong term moves them by a step's order
    (1e-4 and more)."""
    hf_model, ours_model = _bnb_model(), _bnb_model()
    hf = _bnb_reference(hf_model, optim, optim_args, tmp_path)
    ours = build_optimizer(ours_model, OptimizerSettings(optim, optim_args=optim_args, **BNB_HYPERPARAMETERS))
    assert type(ours).__name__ == class_name and type(hf).__module__.startswith("bitsandbytes")
    assert [group["weight_decay"] for group in ours.param_groups] == [0.05, 0.0]
    for _ in range(6):
        _step_each(((hf_model, hf), (ours_model, ours)), torch.randint(0, 256, (4, 32)))
        for (name, a), b in zip(ours_model.named_parameters(), hf_model.parameters()):
            torch.testing.assert_close(a, b, rtol=0, atol=3e-5, msg=name)


def _distance(model, other, start) -> float:
    """The largest over parameters of |a - b| / |b - start|: how far apart two runs ended, relative to how far the
    reference moved."""
    return max(float((a - b).norm() / (b - s).norm()) for a, b, s in zip(model.parameters(), other.parameters(), start))


@pytest.mark.parametrize("eight_bit, exact", [("adamw_bnb_8bit", "paged_adamw_32bit"),
                                              ("paged_adamw_8bit", "paged_adamw_32bit"),
                                              ("lion_8bit", "lion_32bit"), ("paged_lion_8bit", "lion_32bit"),
                                              ("ademamix_8bit", "ademamix"), ("paged_ademamix_8bit", "ademamix"),
                                              ("rmsprop_bnb_8bit", "rmsprop_bnb")])
def test_bitsandbytes_8bit_names_stay_as_close_to_32bit_as_bitsandbytes(eight_bit, exact, tmp_path):
    """8-bit state (torchao's blockwise dynamic quantization; the embedding's in 32 bits, as transformers has
    bitsandbytes keep it) moves the parameters off the exact 32-bit run no further than bitsandbytes' own 8-bit
    optimizer does (measured: ours 0.8-7%, bitsandbytes 0.9-7% of the distance moved in 6 steps), and the losses stay
    within 1e-3 of bitsandbytes' 8-bit run's."""
    pytest.importorskip("torchao.optim")
    start = [p.detach().clone() for p in _bnb_model().parameters()]
    exact_model, bnb_model, ours_model = _bnb_model(), _bnb_model(), _bnb_model()
    _train_steps(exact_model, _bnb_reference(exact_model, exact, None, tmp_path))
    bnb_losses = _train_steps(bnb_model, _bnb_reference(bnb_model, eight_bit, None, tmp_path))
    ours = build_optimizer(ours_model, OptimizerSettings(eight_bit, **BNB_HYPERPARAMETERS))
    with torch.compiler.set_stance("force_eager"):  # torchao compiles its AdamW step; eager is the same math
        ours_losses = _train_steps(ours_model, ours)
    state = ours.state[ours_model.model.layers[0].mlp.gate_proj.weight]
    assert any(type(value).__name__ == "OptimState8bit" for value in state.values())  # 8 bits where bnb has them
    # 32 bits: a parameter under 4,096 values, and the embedding (transformers' override for bitsandbytes)
    for fp32 in (ours_model.model.norm.weight, ours_model.model.embed_tokens.weight):
        assert all(value.dtype == torch.float32 and type(value) is torch.Tensor
                   for key, value in ours.state[fp32].items() if key != "step")
    ours_off, bnb_off = _distance(ours_model, exact_model, start), _distance(bnb_model, exact_model, start)
    assert 0 < ours_off <= 1.5 * bnb_off + 0.005, (ours_off, bnb_off)
    assert ours_losses == pytest.approx(bnb_losses, rel=1e-3)


def test_bitsandbytes_rmsprop_settings_it_lacks_are_refused():
    with pytest.raises(ValueError, match="no momentum; use optim='rmsprop'"):
        build_optimizer(nn.Linear(2, 2), OptimizerSettings("rmsprop_bnb", optim_args="momentum=0.9"))
    with pytest.raises(ValueError, match="no centered"):
        build_optimizer(nn.Linear(2, 2), OptimizerSettings("rmsprop_bnb_8bit", optim_args="centered=true"))
    build_optimizer(nn.Linear(2, 2), OptimizerSettings("rmsprop_bnb", optim_args="momentum=0"))  # bnb's default


def test_paged_names_say_the_state_is_not_paged(caplog, monkeypatch):
    import logging

    from hfnative import log_once

    monkeypatch.setattr(log_once, "_said", set())
    with caplog.at_level(logging.WARNING, logger="hfnative.optim.factory"):
        build_optimizer(nn.Linear(2, 2), OptimizerSettings("paged_lion_32bit"))
    assert "paging to host memory under pressure is not implemented" in caplog.text


@pytest.mark.parametrize("optim, optim_args", [("lion_8bit", None), ("ademamix_8bit", "t_alpha=3,t_beta3=3"),
                                              ("schedule_free_adamw", None)])
def test_optimizer_state_resumes_to_the_uninterrupted_steps(optim, optim_args, tmp_path):
    """SFT with the optimizer's state in a checkpoint (8-bit states, the per-parameter step that AdEMAMix's
    schedules read; schedule-free's, saved after an evaluation left the averaged weights in the model): resumed from
    checkpoint-2, steps 3 and 4 and the evaluation at 4 equal the uninterrupted run's."""
    pytest.importorskip("schedulefree" if optim.startswith("schedule_free") else "torchao.optim")
    import json
    from pathlib import Path

    from datasets import Dataset

    import hfnative

    root = Path(__file__).resolve().parents[1]
    with open(root / "examples" / "data" / "sft_prompt_completion.jsonl") as f:
        rows = [json.loads(line) for line, _ in zip(f, range(16))]

    def trainer():
        args = hfnative.SFTConfig(output_dir=str(tmp_path / "run"), use_cpu=True, bf16=False, report_to="none",
                                  disable_tqdm=True, logging_steps=1, save_strategy="steps", save_steps=2, max_steps=4,
                                  per_device_train_batch_size=2, learning_rate=3e-3, optim=optim,
                                  optim_args=optim_args, seed=5, eval_strategy="steps", eval_steps=2)
        return hfnative.SFTTrainer(model=str(root / "examples" / "tiny-qwen3"), args=args,
                                   train_dataset=Dataset.from_list(rows[:12]), eval_dataset=Dataset.from_list(rows[12:]))

    whole = trainer()
    whole.train()
    state = next(iter(whole.optimizer.state.values()))
    assert type(whole.optimizer).__name__ in ("Lion", "AdEMAMix", "AdamWScheduleFree") and state
    expected = {e["step"]: e for e in whole.state.log_history if "loss" in e}
    expected_eval = [e["eval_loss"] for e in whole.state.log_history if "eval_loss" in e and e["step"] == 4]
    resumed = trainer()
    resumed.train(resume_from_checkpoint=str(tmp_path / "run" / "checkpoint-2"))
    got = {e["step"]: e for e in resumed.state.log_history if "loss" in e and e["step"] > 2}  # 1-2: the checkpoint's
    assert sorted(got) == [3, 4]
    for step, entry in got.items():
        for key in ("loss", "grad_norm"):
            assert entry[key] == pytest.approx(expected[step][key], rel=1e-6), (step, key)
    got_eval = [e["eval_loss"] for e in resumed.state.log_history if "eval_loss" in e and e["step"] == 4]
    assert len(got_eval) == 1 and got_eval == pytest.approx(expected_eval, rel=1e-6)


def test_schedule_free_warmup_is_the_schedules_steps(tmp_path):
    """warmup_steps reaches the schedule-free AdamW / SGD as a step count: transformers' own for a count, and for a
    ratio (< 1) the steps the LR schedule warms up over (transformers hands the ratio over as it is)."""
    pytest.importorskip("schedulefree")
    from pathlib import Path

    from datasets import Dataset

    import hfnative

    model = str(Path(__file__).resolve().parents[1] / "examples" / "tiny-qwen3")
    for warmup, expected in ((3, 3), (0.25, 2)):
        args = hfnative.SFTConfig(output_dir=str(tmp_path), use_cpu=True, report_to="none", max_steps=8,
                                  optim="schedule_free_adamw", warmup_steps=warmup)
        trainer = hfnative.SFTTrainer(model=model, args=args, train_dataset=Dataset.from_list([{"text": "a b c"}] * 4))
        trainer.state.max_steps = 8
        assert trainer.create_optimizer().defaults["warmup_steps"] == expected


@pytest.mark.parametrize("optim", ["lion_32bit", "ademamix", "rmsprop_bnb_8bit", "kahan"])
def test_state_over_bf16_weights_loads_as_saved(optim, tmp_path):
    """torch's load_state_dict casts floating-point state to the parameter's dtype; over bf16 weights the moments
    come back fp32 (8-bit ones as saved), equal to the saved values, and the step count on the host."""
    from hfnative.checkpoint import safe_torch_load
    from hfnative.optim.bf16_updates import KahanAdamW

    def made():
        torch.manual_seed(0)
        model = nn.Linear(128, 64, bias=False).to(torch.bfloat16)  # 8,192 values: 8-bit state where asked
        if optim == "kahan":
            return model, KahanAdamW(model.parameters(), lr=1e-3)
        return model, build_optimizer(model, OptimizerSettings(optim, learning_rate=1e-3, bf16_weight_updates="round_to_nearest"))

    model, optimizer = made()
    for _ in range(2):
        model.weight.grad = torch.randn_like(model.weight)
        optimizer.step()
    torch.save(optimizer.state_dict(), tmp_path / "optimizer.pt")
    saved = {k: v for k, v in optimizer.state[model.weight].items()}
    model2, optimizer2 = made()
    optimizer2.load_state_dict(safe_torch_load(tmp_path / "optimizer.pt"))
    loaded = optimizer2.state[model2.weight]
    assert set(loaded) == set(saved)
    for name, value in saved.items():
        if name in ("step", "compensation"):
            continue
        assert loaded[name].dtype == torch.float32 and type(loaded[name]) is type(value), name
        assert torch.equal(loaded[name].float(), value.float()) if type(value) is torch.Tensor else \
            torch.equal(loaded[name].dequantize(), value.dequantize()), name
    if optim != "kahan":
        assert loaded["step"].device.type == "cpu" and float(loaded["step"]) == 2


@pytest.mark.parametrize("optim", ["lion_32bit", "ademamix_8bit", "kahan", "adamw_torch_8bit", "adamw_bnb_8bit"])
def test_state_resumes_through_the_distributed_checkpoint(optim, tmp_path):
    """torch's distributed loader hands load_state_dict the state keyed by parameter name, not index, and the
    safetensors files hold 8-bit states as their fp32 values: the states come back as saved (fp32 over bf16
    weights; 8-bit where they were, quantized again), on one gloo process."""
    if "8bit" in optim:
        pytest.importorskip("torchao.optim")
    import torch.distributed as dist

    from hfnative.checkpoint import load_training_state, save_training_state
    from hfnative.optim.bf16_updates import KahanAdamW

    def made():
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(128, 64, bias=False), nn.Linear(64, 8)).to(torch.bfloat16)
        if optim == "kahan":
            return model, KahanAdamW(model.parameters(), lr=1e-3)
        return model, build_optimizer(model, OptimizerSettings(optim, learning_rate=1e-3))

    owned = not dist.is_initialized()
    if owned:
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        model, optimizer = made()
        for _ in range(2):
            for param in model.parameters():
                param.grad = torch.randn_like(param)
            optimizer.step()
        save_training_state(tmp_path / "state", model, optimizer)
        model2, optimizer2 = made()
        load_training_state(tmp_path / "state", model2, optimizer2)
        for param, param2 in zip(model.parameters(), model2.parameters()):
            saved, loaded = optimizer.state[param], optimizer2.state[param2]
            assert set(saved) == set(loaded)
            for name, value in saved.items():
                if name in ("step", "compensation"):
                    continue
                assert type(loaded[name]) is type(value), name
                if type(value) is torch.Tensor:  # as saved: fp32 (torchao keeps small states in the weight's dtype)
                    assert loaded[name].dtype == value.dtype and torch.equal(loaded[name], value), name
                else:  # quantized again from the stored values: within one quantization step of them (a block
                    # whose largest value is negative gets a scale 0.7% smaller: the signed map ends at -0.993)
                    error = (loaded[name].dequantize() - value.dequantize()).norm() / value.dequantize().norm()
                    assert error < 0.02, (name, float(error))
    finally:
        if owned:
            dist.destroy_process_group()


def test_an_empty_shard_keeps_fp32_state():
    """A parameter larger than the 8-bit threshold whose shard on this rank holds nothing (a 1-row weight over
    several ranks) gets plain fp32 state, not an 8-bit tensor of no blocks."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard

    from hfnative.optim.state_optimizers import Lion

    owned = not dist.is_initialized()
    if owned:
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        mesh = init_device_mesh("cpu", (1,))
        local = torch.zeros(0, 4096)
        param = nn.Parameter(DTensor.from_local(local, mesh, [Shard(0)], run_check=False, shape=(1, 4096),
                                                stride=(4096, 1)))
        optimizer = Lion([param], optim_bits=8)
        state = optimizer._zeros(param, True, optimizer.param_groups[0])
        assert type(state.to_local()) is torch.Tensor and state.to_local().shape == (0, 4096)
    finally:
        if owned:
            dist.destroy_process_group()


def test_schedule_free_trains_from_its_training_weights_after_an_evaluation(tmp_path):
    """An evaluation leaves a schedule-free optimizer in eval mode (the averaged weights); the next step switches it
    back before the step's micro-batches are made, where the online trainers generate their rollouts."""
    pytest.importorskip("schedulefree")
    from pathlib import Path

    from datasets import Dataset

    import hfnative

    root = Path(__file__).resolve().parents[1]
    args = hfnative.SFTConfig(output_dir=str(tmp_path), use_cpu=True, report_to="none", max_steps=3,
                              per_device_train_batch_size=2, optim="schedule_free_adamw", eval_strategy="steps",
                              eval_steps=1, save_strategy="no")
    rows = Dataset.from_list([{"text": f"row {i} of the data"} for i in range(8)])
    trainer = hfnative.SFTTrainer(model=str(root / "examples" / "tiny-qwen3"), args=args, train_dataset=rows,
                                  eval_dataset=rows)
    modes = []
    make = trainer.objective.micro_batches

    def recording(*args, **kwargs):
        if trainer.optimizer is not None:
            modes.append(trainer.optimizer.param_groups[0]["train_mode"])
        return make(*args, **kwargs)

    trainer.objective.micro_batches = recording
    trainer.train()
    assert len([e for e in trainer.state.log_history if "eval_loss" in e]) == 3 and modes == [True, True, True]
