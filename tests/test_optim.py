"""hfnative.optim against transformers 5.x as the oracle: decay groups, optimizers, and transformers' schedules
driving optimizer-in-backward."""

import sys

import pytest
import torch
from torch import nn
from transformers import Qwen3Config, Qwen3ForCausalLM, Trainer, TrainingArguments
from transformers.optimization import Adafactor
from transformers.optimization import get_scheduler

from hfnative.optim import (
    OptimizerSettings,
    allocate_adam_state,
    build_optimizer,
    decay_parameter_names,
    optimizer_class_and_kwargs,
    parse_optim_args,
    split_decay_groups,
    with_fused_kernel,
)
from hfnative.optim.in_backward import OptimizerInBackward

NUM_TRAINING_STEPS = 40

# (lr_scheduler_type, num_warmup_steps, lr_scheduler_kwargs)
SCHEDULE_CASES = [
    ("linear", 8, {}),
    ("linear", 0, {}),
    ("linear", 50, {}),  # warmup longer than training
    ("cosine", 8, {}),
    ("cosine", 3, {"num_cycles": 1.3}),  # goes below 0 and is clamped
    ("cosine_with_restarts", 8, {}),
    ("cosine_with_restarts", 5, {"num_cycles": 3}),
    ("polynomial", 8, {}),
    ("polynomial", 4, {"lr_end": 1e-5, "power": 2.0}),
    ("constant", 8, {}),
    ("constant", 8, {"num_cycles": 3}),  # transformers ignores kwargs here
    ("constant_with_warmup", 8, {}),
    ("inverse_sqrt", 8, {}),
    ("inverse_sqrt", 0, {}),
    ("inverse_sqrt", 6, {"timescale": 25}),
    ("cosine_with_min_lr", 8, {"min_lr_rate": 0.1}),
    ("cosine_with_min_lr", 5, {"min_lr": 2e-5, "num_cycles": 0.75}),
    ("cosine_warmup_with_min_lr", 8, {"min_lr_rate": 0.1}),
    ("cosine_warmup_with_min_lr", 8, {"min_lr": 2e-5, "warmup_lr_rate": 0.2}),
    ("warmup_stable_decay", 8, {"num_decay_steps": 12}),
    (
        "warmup_stable_decay",
        8,
        {"num_decay_steps": 12, "warmup_type": "cosine", "decay_type": "1-sqrt", "min_lr_ratio": 0.1},
    ),
    (
        "warmup_stable_decay",
        6,
        {"num_decay_steps": 10, "num_stable_steps": 5, "warmup_type": "1-sqrt", "decay_type": "linear"},
    ),
]


@pytest.mark.filterwarnings("ignore:Both num_training_steps and num_stable_steps")
@pytest.mark.parametrize("base_lr", [1.0, 3e-4])
@pytest.mark.parametrize("name,num_warmup_steps,kwargs", SCHEDULE_CASES)
def test_transformers_schedule_reaches_every_parameter_in_backward(name, num_warmup_steps, kwargs, base_lr):
    """get_scheduler over an OptimizerInBackward: each per-parameter optimizer steps with the LR the same
    schedule gives a plain optimizer (polynomial and min_lr also read the optimizer's base LR)."""
    plain_optimizer = torch.optim.SGD([nn.Parameter(torch.zeros(1))], lr=base_lr)
    plain = get_scheduler(name, plain_optimizer, num_warmup_steps, NUM_TRAINING_STEPS, dict(kwargs))
    params = [nn.Parameter(torch.zeros(2)) for _ in range(3)]
    groups = [{"params": params[:2], "weight_decay": 0.1}, {"params": params[2:], "weight_decay": 0.0}]
    in_backward = OptimizerInBackward(groups, torch.optim.SGD, {"lr": base_lr})
    scheduler = get_scheduler(name, in_backward, num_warmup_steps, NUM_TRAINING_STEPS, dict(kwargs))

    expected_lrs = []
    for step in range(NUM_TRAINING_STEPS + 2):
        expected_lrs.append(plain.get_last_lr()[0])
        for param in params:
            param.grad = torch.zeros_like(param)
        in_backward.step()  # steps every parameter that still has a gradient, as after a backward
        assert [in_backward.effective_lr(param) for param in params] == [expected_lrs[-1]] * len(params), step
        plain_optimizer.step()  # no grads: a no-op that keeps LambdaLR from warning about the call order
        plain.step()
        scheduler.step()
    assert len(set(expected_lrs)) > 1 or name == "constant"  # the case exercises a schedule


def _tiny_qwen3(tie_word_embeddings=False, attention_bias=True):
    torch.manual_seed(0)
    config = Qwen3Config(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        attention_bias=attention_bias,
        tie_word_embeddings=tie_word_embeddings,
    )
    return Qwen3ForCausalLM(config)


def _hf_trainer_optimizer(model, tmp_path, **training_args):
    args = TrainingArguments(output_dir=str(tmp_path), use_cpu=True, report_to="none", **training_args)
    return Trainer(model=model, args=args).create_optimizer()


@pytest.mark.parametrize("tie_word_embeddings", [False, True])
def test_decay_split_matches_trainer(tie_word_embeddings, tmp_path):
    model = _tiny_qwen3(tie_word_embeddings)
    model.model.layers[0].mlp.up_proj.weight.requires_grad_(False)
    hf_names = set(Trainer.get_decay_parameter_names(None, model))
    names = {name for name, _ in model.named_parameters()}
    assert decay_parameter_names(model) == hf_names & names
    assert any("bias" in name for name in names) and any("norm" in name for name in names)

    hf_groups = _hf_trainer_optimizer(model, tmp_path, optim="sgd", weight_decay=0.1).param_groups
    ours = split_decay_groups(model, 0.1)
    assert [group["weight_decay"] for group in ours] == [group["weight_decay"] for group in hf_groups] == [0.1, 0.0]
    for our_group, hf_group in zip(ours, hf_groups):
        assert [id(p) for p in our_group["params"]] == [id(p) for p in hf_group["params"]]


def test_decay_split_detects_norm_modules_by_structure():
    class FancyNorm(nn.Module):
        def __init__(self):
            super().__init__()
            self.scale = nn.Parameter(torch.ones(4))

    model = nn.ModuleDict(
        {"proj": nn.Linear(4, 4), "ln_f": nn.LayerNorm(4), "post": FancyNorm(), "gate": nn.RMSNorm(4)}
    )
    assert decay_parameter_names(model) == {"proj.weight"}


OPTIMIZER_CASES = [
    ("adamw_torch", None),
    ("adamw_torch_fused", None),
    ("sgd", None),
    ("sgd", "momentum=0.9, nesterov=True,dampening=0"),
    ("adagrad", "lr_decay=0.01,eps=1e-9"),
    ("rmsprop", "momentum=0.5,centered=true,alpha=0.95"),
    ("adafactor", None),
    ("adamw_torch_8bit", None),
    ("adamw_torch_4bit", "bf16_stochastic_round=true"),
    ("schedule_free_adamw", "weight_lr_power=1.5,r=0.5"),
    ("schedule_free_radam", None),
    ("schedule_free_sgd", None),
    ("stable_adamw", "decouple_lr=true,max_lr=1e-3"),
]
HYPERPARAMETERS = dict(learning_rate=3e-4, weight_decay=0.05, adam_beta1=0.8, adam_beta2=0.95, adam_epsilon=1e-7)


@pytest.mark.parametrize("optim,optim_args", OPTIMIZER_CASES)
def test_optimizer_matches_trainer(optim, optim_args, tmp_path):
    if "bit" in optim:
        pytest.importorskip("torchao.optim")
    for prefix, module in (("schedule_free", "schedulefree"), ("stable_adamw", "optimi")):
        if optim.startswith(prefix):
            pytest.importorskip(module)
    model = _tiny_qwen3()
    hf = _hf_trainer_optimizer(model, tmp_path, optim=optim, optim_args=optim_args, **HYPERPARAMETERS)
    settings = OptimizerSettings(optim, optim_args=optim_args, adafactor_class=Adafactor, **HYPERPARAMETERS)
    ours = build_optimizer(model, settings)

    # torchao's low-bit classes are subclassed only to load distributed checkpoints' states back quantized
    assert type(ours) is type(hf) or "bit" in optim and type(ours).__bases__ == (type(hf),)
    # the one deliberate difference: adamw_torch runs torch's fused kernel (same update, see below)
    differs = {"params", "fused"} if optim == "adamw_torch" else {"params"}
    if optim == "adamw_torch":
        assert ours.defaults["fused"] is True and hf.defaults["fused"] is None
    if optim == "stable_adamw":  # and torch-optimi's Triton kernels off for CPU parameters (they read no CPU tensor)
        differs.add("triton")
        assert ours.defaults["triton"] is False and hf.defaults["triton"] is None
    assert {k: v for k, v in ours.defaults.items() if k not in differs} == {
        k: v for k, v in hf.defaults.items() if k not in differs
    }
    assert len(ours.param_groups) == len(hf.param_groups) == 2
    for our_group, hf_group in zip(ours.param_groups, hf.param_groups):
        assert {k: v for k, v in our_group.items() if k not in differs} == {
            k: v for k, v in hf_group.items() if k not in differs
        }
        assert [id(p) for p in our_group["params"]] == [id(p) for p in hf_group["params"]]
    if optim == "adamw_torch_fused":
        assert ours.defaults["fused"] is True  # transformers sets it unconditionally; torch has CPU kernels
        model(torch.arange(8)[None], labels=torch.arange(8)[None]).loss.backward()
        ours.step()  # the fused CPU kernel runs


def _step_each(pairs, ids) -> None:
    """One optimizer step of each (model, optimizer) on the language-modeling loss of ``ids``."""
    for model, optimizer in pairs:
        model(ids, labels=ids).loss.backward()
        optimizer.step()
        optimizer.zero_grad()


def test_adamw_torch_fused_kernel_makes_the_for_loop_update(tmp_path):
    """adamw_torch: the fused kernel we pick gives torch's default (for-loop) AdamW parameters, step after step."""
    ours_model, hf_model = _tiny_qwen3(), _tiny_qwen3()  # same seed inside: same weights
    ours = build_optimizer(ours_model, OptimizerSettings("adamw_torch", **HYPERPARAMETERS))
    hf = _hf_trainer_optimizer(hf_model, tmp_path, optim="adamw_torch", **HYPERPARAMETERS)
    ids = torch.randint(0, 64, (2, 12))
    for _ in range(4):
        _step_each(((ours_model, ours), (hf_model, hf)), ids)
    for (name, a), b in zip(ours_model.named_parameters(), hf_model.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7, msg=name)
    # a parameter the fused kernel does not take keeps torch's default
    assert "fused" not in with_fused_kernel("adamw_torch", {}, [nn.Parameter(torch.zeros(2, device="meta"))])


def _assert_same_steps(ours_model, ours, lazy_model, lazy) -> None:
    """3 steps on the same batch: the parameters and the state (keys, dtypes, devices, values) equal after each."""
    ids = torch.randint(0, 64, (2, 12))
    for _ in range(3):
        _step_each(((ours_model, ours), (lazy_model, lazy)), ids)
        for a, b in zip(ours_model.parameters(), lazy_model.parameters()):
            assert torch.equal(a, b)
            assert ours.state[a].keys() == lazy.state[b].keys()
            for key, value in lazy.state[b].items():
                mine = ours.state[a][key]
                assert (mine.dtype, mine.device, mine.shape) == (value.dtype, value.device, value.shape), key
                assert torch.equal(mine, value), key


@pytest.mark.parametrize("optim", ["adamw_torch", "adamw_torch_fused"])
def test_adam_state_made_at_construction_is_torchs_first_step_state(optim, tmp_path):
    """build_optimizer allocates Adam's state up front; after every step the state and the parameters equal those
    of the optimizer transformers builds (given the fused kernel ours takes), whose state torch makes lazily."""
    ours_model, hf_model = _tiny_qwen3(), _tiny_qwen3()
    ours = build_optimizer(ours_model, OptimizerSettings(optim, **HYPERPARAMETERS))
    hf = _hf_trainer_optimizer(hf_model, tmp_path, optim=optim, **HYPERPARAMETERS)
    for group in hf.param_groups:  # adamw_torch: ours takes the fused kernel (the test above)
        group["fused"] = ours.defaults["fused"]
    assert len(ours.state) == sum(p.requires_grad for p in ours_model.parameters()) and not hf.state
    _assert_same_steps(ours_model, ours, hf_model, hf)


@pytest.mark.parametrize("cls, kwargs", [(torch.optim.AdamW, dict(amsgrad=True)), (torch.optim.Adam, dict(foreach=True)),
                                         (torch.optim.AdamW, dict(fused=True, amsgrad=True))])
def test_allocated_adam_state_under_other_options_is_torchs(cls, kwargs):
    ours_model, lazy_model = _tiny_qwen3(), _tiny_qwen3()
    ours = allocate_adam_state(cls(ours_model.parameters(), lr=1e-3, **kwargs))
    lazy = cls(lazy_model.parameters(), lr=1e-3, **kwargs)
    _assert_same_steps(ours_model, ours, lazy_model, lazy)
    sgd = torch.optim.SGD(ours_model.parameters(), lr=0.1)
    assert allocate_adam_state(sgd) is sgd and not sgd.state  # other optimizers untouched


def test_low_bit_names_build_torchao():
    torchao_optim = pytest.importorskip("torchao.optim")
    model = nn.Linear(8, 8)
    # torchao's classes, loading distributed checkpoints' fp32 states back quantized; bitsandbytes' name also keeps
    # 32-bit moments for embeddings (transformers' override)
    assert isinstance(build_optimizer(model, OptimizerSettings("adamw_8bit")), torchao_optim.AdamW8bit)
    assert type(build_optimizer(model, OptimizerSettings("adamw_torch_8bit"))).__bases__ == (torchao_optim.AdamW8bit,)
    assert type(build_optimizer(model, OptimizerSettings("adamw_torch_4bit"))).__bases__ == (torchao_optim.AdamW4bit,)
    _, kwargs = optimizer_class_and_kwargs(OptimizerSettings("adamw_torch_4bit", optim_args="block_size=128"))
    assert kwargs["block_size"] == 128  # an int, where transformers would pass the string "128"


def test_missing_torchao_names_the_extra(monkeypatch):
    monkeypatch.setitem(sys.modules, "torchao.optim", None)  # makes the import fail
    with pytest.raises(ImportError, match=r"pip install hfnative\[quant\]"):
        build_optimizer(nn.Linear(2, 2), OptimizerSettings("adamw_torch_8bit"))


def test_optimizer_input_errors():
    with pytest.raises(ValueError, match="adamw_torch_fused"):
        build_optimizer(nn.Linear(2, 2), OptimizerSettings("lomo"))
    with pytest.raises(ValueError, match="key=value"):
        parse_optim_args("momentum")
    assert parse_optim_args("a=1, b=x") == {"a": "1", "b": "x"}
    with pytest.warns(UserWarning, match="mometum"):
        optimizer_class_and_kwargs(OptimizerSettings("sgd", optim_args="mometum=0.9"))
    with pytest.raises(ValueError, match="adafactor_class=transformers.optimization.Adafactor"):
        build_optimizer(nn.Linear(2, 2), OptimizerSettings("adafactor"))
    with pytest.raises(ValueError, match="requires_grad"):
        build_optimizer(nn.Linear(2, 2).requires_grad_(False), OptimizerSettings("sgd"))
