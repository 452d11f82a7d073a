"""LoRA on stacked MoE experts (peft's target_parameters) beyond tests/test_peft.py's logits, folders and merges: the
rollout engine decodes with the adapters as they are now, the policy's plain copy folds them in, and what hfnative
does not carry natively is refused or routed to peft by name."""

from __future__ import annotations

import copy

import pytest
import torch
from hf_configs import VOCAB, make_hf_model

from hfnative.converters.fallback_loading import native_lora_refusal, peft_route_reason
from hfnative.converters.loading import load_pretrained
from hfnative.converters.peft import apply_lora
from hfnative.generation import NativeRolloutEngine, SamplingParams
from hfnative.parallel.replica import gather_replica, trainable_tensors
from hfnative.peft import disable_adapters, expert_lora_modules, lora_settings, merge_lora

peft = pytest.importorskip("peft")

EXPERTS = dict(r=2, lora_alpha=4, target_modules=["q_proj"],
               target_parameters=["mlp.experts.gate_up_proj", "mlp.experts.down_proj"])


def _adapted(name: str, fields=EXPERTS):
    """A native model with the adapters on, every lora_B perturbed so the adapters change the outputs."""
    converted = load_pretrained(make_hf_model(name))
    apply_lora(converted, fields)
    generator = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for param_name, param in converted.model.named_parameters():
            if param_name.endswith("lora_B"):
                param.add_(torch.randn(param.shape, generator=generator) * 0.3)
    return converted


def _ids() -> torch.Tensor:
    return torch.randint(0, VOCAB, (2, 7), generator=torch.Generator().manual_seed(0))


@pytest.mark.parametrize("name", ["qwen3moe-topk-norm", "gptoss-alternating-yarn"])
def test_rollouts_decode_with_the_experts_adapters(name):
    """Greedy tokens and log-probs of the adapted model are the merged model's, and change as the adapters train."""
    model = _adapted(name).model.eval()
    prompts = [[5, 9, 11], [7, 3, 2, 8, 4]]
    greedy = SamplingParams(max_new_tokens=6, do_sample=False)
    engine = NativeRolloutEngine(model)
    with disable_adapters(model):
        base = engine.generate(prompts, greedy).completion_ids
    ours = engine.generate(prompts, greedy)
    merged = merge_lora(copy.deepcopy(model)).eval()
    assert ours.completion_ids == NativeRolloutEngine(merged).generate(prompts, greedy).completion_ids
    assert ours.completion_ids != base
    for prompt, completion, logprobs in zip(prompts, ours.completion_ids, ours.logprobs):
        with torch.no_grad():
            logits = merged(torch.tensor([prompt + completion])).logits[0, len(prompt) - 1 : -1]
        expected = torch.log_softmax(logits.float(), -1).gather(-1, torch.tensor(completion)[:, None])[:, 0]
        assert (expected - torch.tensor(logprobs)).abs().max() <= 1e-5


def test_the_plain_copy_folds_the_experts_adapters():
    """The policy's plain copy (generator actors, sharded rollouts) computes what the adapted model computes; the
    tensors a weight sync sends are the folded expert weights, not the adapters."""
    model = _adapted("qwen3moe-topk-norm").model.eval()
    ids = _ids()
    with torch.no_grad():
        assert (gather_replica(model)(ids).logits - model(ids).logits).abs().max() <= 1e-5
    sent = dict(trainable_tensors(model))
    assert not any(".lora" in name for name in sent if ".moe." in name)
    for layer in range(model.args.n_layers):
        for weight in ("w1", "w2", "w3"):
            assert f"layers.{layer}.moe.experts.{weight}" in sent
    adapters = expert_lora_modules(model)
    assert sorted(adapters) == [f"layers.{i}.moe.experts.lora.{p}" for i in range(2) for p in ("down_proj", "gate_up_proj")]


def test_settings_peft_refuses_on_parameters():
    with pytest.raises(ValueError, match="lora_dropout"):
        lora_settings(dict(EXPERTS, lora_dropout=0.05))
    with pytest.raises(ValueError, match="use_dora"):
        lora_settings(dict(EXPERTS, use_dora=True))


def test_targets_hfnative_does_not_adapt_go_to_peft():
    """A parameter that is no stacked expert tensor (a dense model's weight, a router's) is peft's to adapt: the
    trainers route it there, saying why; a name that matches nothing is an error."""
    dense = load_pretrained(make_hf_model("qwen3-gqa"))
    fields = dict(r=2, target_modules=["q_proj"], target_parameters=["mlp.down_proj.weight"])
    assert "model.layers.0.mlp.down_proj.weight" in peft_route_reason(dense, fields)
    with pytest.raises(ValueError, match="train it through peft"):
        apply_lora(dense, fields)
    moe = load_pretrained(make_hf_model("qwen3moe-topk-norm"))
    router = dict(EXPERTS, target_parameters=["mlp.experts.gate_up_proj", "gate.weight"])
    assert "mlp.gate.weight" in peft_route_reason(moe, router)
    assert "mlp.gate.weight" in native_lora_refusal(router, moe.config)
    assert native_lora_refusal(EXPERTS, moe.config) is None and peft_route_reason(moe, EXPERTS) is None
    with pytest.raises(ValueError, match="matches no parameter.*gate_up_proj"):
        apply_lora(moe, dict(EXPERTS, target_parameters=["experts.up_proj"]))


def test_expert_and_tensor_parallel_refuse_adapted_experts():
    from hfnative.parallel.tensor_parallel import check_tensor_parallel

    model = _adapted("qwen3moe-topk-norm", dict(EXPERTS, target_modules=[])).model
    with pytest.raises(ValueError, match="target_parameters"):
        check_tensor_parallel(model, 2)
    from hfnative.parallel import expert_parallel

    with pytest.raises(ValueError, match="expert parallelism with LoRA on the stacked experts"):
        expert_parallel.apply_expert_parallel(model, ep_mesh=None)
