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


@pytest.mark.parametrize("name, fold, stack", [("qwen3moe-topk-norm", False, False), ("qwen3moe-topk-norm", True, True),
                                                ("gptoss-alternating-yarn", True, False)])
def test_rollouts_decode_with_the_experts_adapters(name, fold, stack):
    """Greedy tokens and log-probs of the adapted model are the merged model's, whether the engine folds the experts'
    adapters at every token or once per call (into copies kept between calls), on the model or on a replica with
    stacked projections; an adapter switched off (the reference model) is off in the replica too, and an update to
    the adapters reaches the next call."""
    model = _adapted(name, dict(EXPERTS, target_modules=[]) if stack else EXPERTS).model.eval()
    prompts = [[5, 9, 11], [7, 3, 2, 8, 4]]
    greedy = SamplingParams(max_new_tokens=6, do_sample=False)
    engine = NativeRolloutEngine(model, fold_expert_adapters=fold, stack_projections=stack)
    with disable_adapters(model):
        base = engine.generate(prompts, greedy).completion_ids
    assert (engine._weights.replica is not None) == stack  # plain attention projections: a stacked replica
    plain = load_pretrained(make_hf_model(name)).model.eval()  # the same base, no adapters
    assert base == NativeRolloutEngine(plain).generate(prompts, greedy).completion_ids
    ours = engine.generate(prompts, greedy)
    merged = merge_lora(copy.deepcopy(model)).eval()
    assert ours.completion_ids == NativeRolloutEngine(merged).generate(prompts, greedy).completion_ids
    assert ours.completion_ids != base
    with torch.no_grad():  # an optimizer step's in-place update: the next call folds the new values
        for param_name, param in model.named_parameters():
            if param_name.endswith("lora_B") and ".experts." in param_name:
                param.mul_(-1.5)
    again = engine.generate(prompts, greedy).completion_ids
    assert again == NativeRolloutEngine(merge_lora(copy.deepcopy(model)).eval()).generate(prompts, greedy).completion_ids
    assert again != ours.completion_ids
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
    assert "'mlp.down_proj.weight' names no stacked MoE expert tensor" in peft_route_reason(dense, fields)
    with pytest.raises(ValueError, match="train it through peft"):
        apply_lora(dense, fields)
    for name, target in [("qwen3moe-topk-norm", "gate.weight"), ("mixtral-top2", "mlp.gate.weight"),
                         ("gptoss-alternating-yarn", "mlp.experts.down_proj_bias"),
                         ("qwen3moe-topk-norm", "experts.up_proj"), ("qwen3moe-topk-norm", "5.mlp.experts.down_proj")]:
        moe = load_pretrained(make_hf_model(name))
        fields = dict(EXPERTS, target_parameters=["mlp.experts.gate_up_proj", target])
        assert f"{target!r} names no stacked MoE expert tensor" in peft_route_reason(moe, fields), (name, target)
        assert f"{target!r} names no stacked MoE expert tensor" in native_lora_refusal(fields, moe.config)
        assert native_lora_refusal(EXPERTS, moe.config) is None and peft_route_reason(moe, EXPERTS) is None


def test_expert_and_tensor_parallel_refuse_adapted_experts():
    from hfnative.parallel.tensor_parallel import check_tensor_parallel

    model = _adapted("qwen3moe-topk-norm", dict(EXPERTS, target_modules=[])).model
    with pytest.raises(ValueError, match="target_parameters"):
        check_tensor_parallel(model, 2)
    from hfnative.parallel import expert_parallel

    with pytest.raises(ValueError, match="expert parallelism with LoRA on the stacked experts"):
        expert_parallel.apply_expert_parallel(model, ep_mesh=None)


def _moe_folder(tmp_path) -> str:
    """A saved tiny GPT-OSS (interleaved gate/up experts) with the tiny tokenizer."""
    from pathlib import Path

    from transformers import AutoModelForCausalLM, AutoTokenizer, GptOssConfig

    tokenizer_dir = Path(__file__).resolve().parents[1] / "examples" / "tiny-qwen3"
    tokenizer = AutoTokenizer.from_pretrained(str(tokenizer_dir))
    config = GptOssConfig(vocab_size=len(tokenizer), hidden_size=32, intermediate_size=24, num_hidden_layers=2,
                          num_attention_heads=4, num_key_value_heads=2, head_dim=8, num_local_experts=4,
                          num_experts_per_tok=2, layer_types=["sliding_attention", "full_attention"], sliding_window=8,
                          max_position_embeddings=256, pad_token_id=tokenizer.pad_token_id,
                          eos_token_id=tokenizer.eos_token_id, bos_token_id=None)
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).save_pretrained(str(tmp_path / "gpt-oss"))
    tokenizer.save_pretrained(str(tmp_path / "gpt-oss"))
    return str(tmp_path / "gpt-oss")


def test_engine_options_and_resume_reproduce_the_plain_run(tmp_path):
    """Compile, activation checkpointing and the optimizer in backward train the experts' adapters as the plain run
    does (itself equal to TRL + peft: tests/test_moe_vs_trl.py), and a run resumed from a checkpoint continues it."""
    import hfnative
    from test_sft_vs_trl import _config, _dataset
    from transformers import TrainerCallback

    model = _moe_folder(tmp_path)
    lora = dict(r=4, lora_alpha=8, lora_dropout=0.0, target_modules=["q_proj"],
                target_parameters=["mlp.experts.gate_up_proj", "mlp.experts.down_proj"])

    def losses(name, resume=None, **options):
        args = _config(hfnative, tmp_path / name, 1, **{"max_grad_norm": 0.0, "learning_rate": 1e-2, **options})
        trainer = hfnative.SFTTrainer(model=model, args=args, train_dataset=_dataset("text"),
                                      peft_config=peft.LoraConfig(**lora))
        trained = []
        trainer.add_callback(type("Steps", (TrainerCallback,), {
            "on_step_end": lambda self, args, state, control, **kw: trained.append(state.global_step)})())
        trainer.train(resume_from_checkpoint=resume)
        return {e["step"]: (e["loss"], e["grad_norm"]) for e in trainer.state.log_history
                if "loss" in e and e["step"] in trained}

    plain = losses("plain", save_strategy="steps", save_steps=2)
    assert len(plain) == 5 and plain[5][0] < plain[1][0]
    runs = {
        "resumed": losses("plain", resume=str(tmp_path / "plain" / "checkpoint-2"), save_strategy="no"),
        "in_backward": losses("in_backward", optimizer_in_backward=True),
        "all": losses("all", optimizer_in_backward=True, torch_compile=True, activation_checkpointing=True),
    }
    assert sorted(runs["resumed"]) == [3, 4, 5]
    for name, run in runs.items():
        for step, (loss, grad_norm) in run.items():
            assert loss == pytest.approx(plain[step][0], rel=1e-5), (name, step)
            assert grad_norm == pytest.approx(plain[step][1], rel=1e-4), (name, step)
    from safetensors import safe_open

    with safe_open(str(tmp_path / "plain" / "checkpoint-2" / "adapter_model.safetensors"), "pt") as saved:
        keys = set(saved.keys())
    assert {f"base_model.model.model.layers.{i}.mlp.experts.{nest}lora_{ab}.weight"
            for i in range(2) for nest in ("", "base_layer.") for ab in "AB"} <= keys
