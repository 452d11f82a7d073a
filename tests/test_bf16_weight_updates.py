"""bf16 weights that learn: ``bf16_weight_updates`` against the fp32 run as the oracle.

The task: a linear least-squares fit whose weights start in [1, 1.5) (bf16 ulp 2^-7, so an update below 2^-8 ~ 0.0039
rounds away) and must each move 0.2, with AdamW at lr 1e-3: every AdamW update (about lr) is below half an ulp, so
torch's AdamW on bf16 weights never moves them, while fp32 weights reach a tenth of the starting loss in 200 steps.

Tolerance: the bf16 runs compute the forward in bf16 (relative error ~2^-8 on each output), and their weights are the
kept trajectory rounded to bf16: with Kahan compensation the weights (all updated alike by AdamW's first steps) cross
their rounding points together, so the loss follows the fp32 curve as a staircase a few steps wide; stochastic rounding
follows it on average. So the curves are compared as means over windows of 10 steps: every window within 4% of the
starting loss of the fp32 run's. Measured on this task: 1.3% (stochastic rounding), 0.6% (Kahan), 1.4% (8-bit AdamW),
2.5% and 3.1% (Lion with 32- and 8-bit state, against Lion's fp32 run), and 93% for plain bf16 AdamW (99% for
Lion), which ends where it started.
"""

from __future__ import annotations

import logging

import pytest
import torch
from torch import nn

from hfnative.optim import OptimizerSettings, build_optimizer
from hfnative.optim.bf16_updates import KahanAdamW
from hfnative.optim.in_backward import OptimizerInBackward

STEPS, LR, DIM = 200, 1e-3, 64
CURVE_TOLERANCE = 0.04  # of the starting loss, for every 10-step window's mean


def _task():
    generator = torch.Generator().manual_seed(0)
    inputs = torch.randn(128, DIM, generator=generator)
    start = 1 + 0.5 * torch.rand(DIM, DIM, generator=generator)
    target = start - 0.2 * torch.sign(torch.randn(DIM, DIM, generator=generator))
    return inputs, start, inputs @ target.T


def _model(dtype: torch.dtype) -> nn.Module:
    _, start, _ = _task()
    model = nn.Linear(DIM, DIM, bias=False)
    with torch.no_grad():
        model.weight.copy_(start)
    return model.to(dtype)


def _losses(dtype, mode, optim="adamw_torch_fused", in_backward=False, steps=STEPS):
    inputs, _, targets = _task()
    model = _model(dtype)
    torch.manual_seed(0)  # stochastic rounding's draws
    settings = OptimizerSettings(optim=optim, learning_rate=LR, bf16_weight_updates=mode)
    optimizer = (OptimizerInBackward.from_model(model, settings) if in_backward
                 else build_optimizer(model, settings))
    losses = []
    with torch.compiler.set_stance("force_eager"):  # torchao compiles its step; eager is the same math, faster here
        for _ in range(steps):
            loss = ((model(inputs.to(dtype)).float() - targets) ** 2).mean()
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            losses.append(loss.item())
    return optimizer, model, torch.tensor(losses)


def _follows(losses: torch.Tensor, oracle: torch.Tensor) -> float:
    """The largest gap between the two curves' 10-step means, relative to the oracle's starting loss."""
    return float((losses.view(-1, 10).mean(1) - oracle.view(-1, 10).mean(1)).abs().max() / oracle[0])


@pytest.fixture(scope="module")
def fp32_curve():
    _, _, losses = _losses(torch.float32, "auto")
    assert losses[-1] < 0.1 * losses[0]  # the oracle learns
    return losses


def test_plain_bf16_adamw_stalls_where_the_kept_updates_follow_fp32(fp32_curve, caplog):
    _, _, plain = _losses(torch.bfloat16, "round_to_nearest")
    assert (plain[-1] - plain[0]).abs() < 0.01 * plain[0], "round-to-nearest bf16 AdamW was expected to stall"
    with caplog.at_level(logging.WARNING, logger="hfnative.optim.bf16_updates"):
        optimizer, _, rounded = _losses(torch.bfloat16, "auto")
    assert type(optimizer).__name__ == "_AdamW" and optimizer.bf16_stochastic_round  # auto: stochastic rounding
    assert _follows(rounded, fp32_curve) < CURVE_TOLERANCE
    optimizer, _, kahan = _losses(torch.bfloat16, "kahan")
    assert isinstance(optimizer, KahanAdamW)
    assert _follows(kahan, fp32_curve) < CURVE_TOLERANCE


def test_fp32_weights_keep_torchs_adamw_in_every_mode():
    for mode in ("auto", "kahan", "stochastic_round"):
        optimizer = build_optimizer(_model(torch.float32), OptimizerSettings(learning_rate=LR, bf16_weight_updates=mode))
        assert type(optimizer) is torch.optim.AdamW and optimizer.defaults["fused"]


def test_eight_bit_adamw_rounds_bf16_weights_stochastically(fp32_curve):
    optimizer, _, eight_bit = _losses(torch.bfloat16, "auto", optim="adamw_torch_8bit")
    assert type(optimizer).__name__ == "AdamW8bit" and optimizer.bf16_stochastic_round
    assert _follows(eight_bit, fp32_curve) < CURVE_TOLERANCE


def test_optimizer_in_backward_makes_the_same_kahan_steps():
    _, plain_model, plain = _losses(torch.bfloat16, "kahan", steps=20)
    optimizer, model, in_backward = _losses(torch.bfloat16, "kahan", in_backward=True, steps=20)
    assert optimizer.optimizer_cls is KahanAdamW
    assert torch.equal(plain, in_backward) and torch.equal(plain_model.weight, model.weight)


def test_stochastic_rounding_in_backward_follows_fp32(fp32_curve):
    optimizer, _, losses = _losses(torch.bfloat16, "stochastic_round", in_backward=True)
    assert optimizer.optimizer_cls.__name__ == "_AdamW"
    assert _follows(losses, fp32_curve) < CURVE_TOLERANCE


@pytest.mark.parametrize("optim, mode, optim_args, match", [
    ("sgd", "kahan", None, "has no such update"),
    ("adamw_torch_8bit", "kahan", None, "can only round stochastically"),
    ("adamw_torch_8bit", "stochastic_round", "bf16_stochastic_round=False", "set one of them"),
    ("adamw_torch", "nearest", None, "expected one of"),
    ("stable_adamw", "kahan", None, "keeps bf16 weights' small updates itself"),
])
def test_a_mode_the_optimizer_cannot_honour_is_refused(optim, mode, optim_args, match):
    settings = OptimizerSettings(optim=optim, learning_rate=LR, bf16_weight_updates=mode, optim_args=optim_args)
    with pytest.raises(ValueError, match=match):
        build_optimizer(_model(torch.bfloat16), settings)


def test_training_arguments_check_the_field(tmp_path):
    from hfnative import SFTConfig

    with pytest.raises(ValueError, match="bf16_weight_updates='sometimes'"):
        SFTConfig(output_dir=str(tmp_path), bf16_weight_updates="sometimes", use_cpu=True)


def test_without_torchao_auto_takes_kahan(monkeypatch):
    import hfnative.optim.bf16_updates as bf16_updates

    monkeypatch.setattr(bf16_updates, "find_spec", lambda name: None if name == "torchao" else object())
    optimizer = build_optimizer(_model(torch.bfloat16), OptimizerSettings(learning_rate=LR))
    assert isinstance(optimizer, KahanAdamW)


def test_bf16_rounded_is_the_cast_to_bf16():
    """The Kahan step rounds with integer ops (a compiler keeps them where it may fold a cast away): the same bits as
    torch's cast to bf16 and back, over magnitudes, exact ties (to even), subnormals, the largest floats (to inf),
    infinities and NaN."""
    from hfnative.optim.bf16_updates import bf16_rounded

    generator = torch.Generator().manual_seed(0)
    values = [torch.randn(4096, generator=generator) * 10.0 ** torch.randint(-38, 38, (4096,), generator=generator)]
    halfway = torch.arange(-40, 40, dtype=torch.int32) * 0x10000 + 0x3F808000  # exactly between two bf16 values
    values += [halfway.view(torch.float32), (halfway + 0x10000).view(torch.float32)]
    values.append(torch.tensor([0.0, -0.0, 1e-40, -3e-39, 1e-45, 3.4e38, -3.4e38, float("inf"), float("-inf")]))
    x = torch.cat(values)
    expected = x.to(torch.bfloat16).float()
    assert torch.equal(bf16_rounded(x).view(torch.int32), expected.view(torch.int32))
    assert bf16_rounded(torch.tensor([float("nan")])).isnan().all()


@pytest.mark.skipif(not torch._dynamo.is_dynamo_supported(), reason="torch.compile is unavailable here")
def test_the_compiled_kahan_step_takes_a_models_many_parameter_shapes(monkeypatch):
    """On an accelerator every parameter's update goes through one compiled step: a model has more parameter shapes
    than torch's recompile limit (8), and each must update as the eager step does, the compensation (what rounding
    the bf16 weight dropped) included."""
    from torch._dynamo.utils import counters

    from hfnative.optim import bf16_updates

    torch._dynamo.reset()
    counters.clear()
    monkeypatch.setattr(bf16_updates, "_COMPILED", None)
    shapes = [(16,), (24,), (8, 16), (16, 8), (24, 16), (16, 24), (32, 16), (16, 32), (40, 8), (8, 40), (4, 4, 4)]
    generator = torch.Generator().manual_seed(0)
    for shape in shapes:
        weight = torch.randn(shape, generator=generator).bfloat16()
        grad = torch.randn(shape, generator=generator).bfloat16()
        states = []
        for step in (bf16_updates._kahan_adamw_step, bf16_updates._compiled_step()):
            param = weight.clone()
            state = [torch.tensor(3.0), torch.full(shape, 0.1), torch.full(shape, 0.02), torch.zeros_like(param)]
            step(param, grad, *state[:3], state[3], torch.tensor(1e-2), 0.9, 0.999, 0.01, 1e-8)
            states.append([param.float(), *state[1:]])
        for eager, compiled in zip(*states):
            torch.testing.assert_close(compiled.float(), eager.float(), rtol=1e-5, atol=1e-6)
    assert counters["stats"]["unique_graphs"] <= 6  # per rank of the shapes, not per shape


@pytest.mark.parametrize("optim", ["lion_32bit", "lion_8bit"])
def test_lion_rounds_bf16_weights_stochastically(optim):
    """bitsandbytes' Lion by name: each update is +-lr = 1e-3, below half a bf16 ulp here, so rounded to nearest the
    bf16 weights never move; with "auto" (its own stochastic rounding flag) they follow Lion's fp32 run."""
    if optim == "lion_8bit":
        pytest.importorskip("torchao.optim")
    _, _, fp32 = _losses(torch.float32, "auto", optim=optim)
    assert fp32[-1] < 0.5 * fp32[0]  # the oracle learns
    _, _, plain = _losses(torch.bfloat16, "round_to_nearest", optim=optim)
    assert (plain[-1] - plain[0]).abs() < 0.01 * plain[0], "round-to-nearest bf16 Lion was expected to stall"
    optimizer, _, rounded = _losses(torch.bfloat16, "auto", optim=optim)
    assert type(optimizer).__name__ == "Lion" and optimizer.bf16_stochastic_round
    assert _follows(rounded, fp32) < CURVE_TOLERANCE
