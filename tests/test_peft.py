"""LoRA, DoRA and QLoRA on native models, with peft 0.21 as the oracle.

Each case builds the same tiny transformers checkpoint twice: peft wraps one (``get_peft_model``),
hfnative the other (``apply_lora``). peft's adapter weights are perturbed (so lora_B is non-zero and
the DoRA magnitude is not just the weight norm), saved with peft's own ``save_pretrained`` and copied
into the native adapters; then logits, saved folders, merges and training steps must agree.
"""

from __future__ import annotations

import json
import math

import pytest
import torch

peft = pytest.importorskip("peft")
from hf_configs import VOCAB, save_hf_model  # noqa: E402
from peft import LoraConfig, PeftModel, get_peft_model  # noqa: E402
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402
from transformers import AutoModelForCausalLM  # noqa: E402

from hfnative.converters.export import export_hf  # noqa: E402
from hfnative.converters.loading import load_pretrained  # noqa: E402
from hfnative.converters.peft import (  # noqa: E402
    apply_lora,
    load_adapter,
    load_adapter_weights,
    save_adapter,
)
from hfnative.peft import (  # noqa: E402
    LoraLinear,
    adapter_parameters,
    disable_adapters,
    lora_settings,
    lora_state_dict,
    merge_lora,
    quantization_settings,
)

TOLERANCE = 1e-5  # fp32 logits, max abs difference
# peft warns about the configurations under test (bias with disabled adapters, tied modules_to_save)
pytestmark = pytest.mark.filterwarnings("ignore::UserWarning:peft")

# (case id, checkpoint, LoraConfig fields)
CASES = [
    ("lora-default-targets", "llama-gqa", dict(r=4, lora_alpha=16)),
    ("rslora-dropout-eval", "qwen3-gqa", dict(r=4, lora_alpha=8, use_rslora=True, lora_dropout=0.1, target_modules=["q_proj", "k_proj", "v_proj", "o_proj"])),
    ("dora-all-linear", "qwen3-gqa", dict(r=4, use_dora=True, target_modules="all-linear")),
    ("dora-bias-all", "llama-linear-headdim12-bias", dict(r=4, use_dora=True, bias="all", target_modules=["q_proj", "o_proj"])),
    ("bias-lora-only", "llama-linear-headdim12-bias", dict(r=2, bias="lora_only", target_modules=["q_proj", "up_proj"])),
    ("modules-to-save-lm-head", "llama-gqa", dict(r=4, target_modules="all-linear", modules_to_save=["lm_head"])),
    ("tied-modules-to-save", "qwen3-mha-tied-bias", dict(r=4, target_modules=["q_proj"], modules_to_save=["lm_head", "embed_tokens"])),
    ("regex", "llama-gqa", dict(r=4, target_modules=r".*\.0\.self_attn\.(q|v)_proj")),
    ("layers-to-transform", "llama-gqa", dict(r=4, target_modules=["q_proj", "down_proj"], layers_to_transform=[1])),
    ("rank-alpha-pattern", "llama-gqa", dict(r=4, target_modules=["q_proj", "v_proj"], rank_pattern={"v_proj": 2}, alpha_pattern={r"layers\.1\.self_attn\.q_proj": 3})),
    ("phi3-fused-dora", "phi3-gqa", dict(r=4, use_dora=True, target_modules=["qkv_proj", "gate_up_proj"])),
    ("phi3-all-linear", "phi3-gqa", dict(r=4, target_modules="all-linear", exclude_modules=["o_proj"])),
    # 3 layers x 7 linears >= 20: peft condenses the resolved all-linear paths to suffixes before saving
    ("all-linear-condensed", "gemma3-alternating", dict(r=2, target_modules="all-linear")),
    # target_parameters: transformers 5's stacked expert tensors (gate/up as halves, or interleaved for GPT-OSS)
    ("experts-qwen3moe", "qwen3moe-topk-norm", dict(r=2, target_modules=["q_proj"], target_parameters=["mlp.experts.gate_up_proj", "mlp.experts.down_proj"])),
    ("experts-gptoss-by-layer", "gptoss-alternating-yarn", dict(r=4, target_modules="all-linear", target_parameters=["1.mlp.experts.gate_up_proj", "0.mlp.experts.down_proj"])),
    ("experts-mixtral-only", "mixtral-top2", dict(r=2, lora_alpha=4, target_parameters=["mlp.experts.down_proj", "mlp.experts.gate_up_proj"], rank_pattern={"down_proj": 3})),
    ("experts-gptoss-only", "gptoss-alternating-yarn", dict(r=2, target_parameters=["mlp.experts.gate_up_proj"])),
    ("experts-qwen3moe-one-layer", "qwen3moe-topk-norm", dict(r=2, target_parameters=["1.mlp.experts.down_proj"], alpha_pattern={"down_proj": 5})),
    # trainable_token_indices: token rows trained on their own (a tied head follows the embedding's rows)
    ("tokens-tied", "qwen3-mha-tied-bias", dict(r=4, target_modules=["q_proj"], trainable_token_indices=[7, 15, 44])),  # tokens _input_ids holds
    ("tokens-tied-head-apart", "qwen3-mha-tied-bias", dict(r=4, target_modules=["v_proj"], trainable_token_indices={"embed_tokens": [0, 7], "lm_head": [4]})),
    ("tokens-padding-row", "phi3-gqa", dict(r=4, target_modules=["qkv_proj"], trainable_token_indices=[0, 7, 15])),  # 0: pad
    ("tokens-untied-both", "llama-gqa", dict(r=4, target_modules=["q_proj"], trainable_token_indices={"embed_tokens": [15, 53], "lm_head": [4, 9]})),
]
MERGE_CASES = ["lora-default-targets", "dora-bias-all", "modules-to-save-lm-head", "phi3-fused-dora", "rank-alpha-pattern",
               "experts-qwen3moe", "experts-gptoss-by-layer", "tokens-tied", "tokens-untied-both"]
_BY_ID = {case_id: (checkpoint, fields) for case_id, checkpoint, fields in CASES}


@pytest.fixture(scope="module")
def checkpoint_dir(tmp_path_factory):
    """checkpoint name -> a saved tiny transformers model folder (made once per module)."""
    made = {}

    def get(name: str):
        if name not in made:
            made[name] = tmp_path_factory.mktemp(name)
            save_hf_model(name, made[name])
        return made[name]

    return get


def _input_ids(seed: int = 0) -> torch.Tensor:
    return torch.randint(0, VOCAB, (2, 9), generator=torch.Generator().manual_seed(seed))


def _peft_model(base_dir, fields: dict, seed: int = 1):
    """peft's model over the checkpoint, its trainable tensors perturbed (lora_B included) reproducibly."""
    hf_model = AutoModelForCausalLM.from_pretrained(str(base_dir), dtype=torch.float32)
    model = get_peft_model(hf_model, LoraConfig(task_type="CAUSAL_LM", **fields))
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for _, param in sorted(model.named_parameters()):
            if param.requires_grad:
                param.add_(torch.randn(param.shape, generator=generator) * 0.1)
    return model.eval()


def _native_pair(base_dir, fields: dict, tmp_path):
    """(peft model, native ConvertedModel carrying the same adapter)."""
    peft_model = _peft_model(base_dir, fields)
    peft_dir = tmp_path / "peft-adapter"
    peft_model.save_pretrained(str(peft_dir))
    converted = load_pretrained(base_dir)
    apply_lora(converted, fields)
    load_adapter_weights(converted, peft_dir)  # raises unless our targets are exactly peft's
    converted.model.eval()
    return peft_model, converted


def _max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a - b).abs().max().item()


@torch.no_grad()
def _logits(model, ids) -> torch.Tensor:
    out = model(input_ids=ids) if hasattr(model, "config") else model(ids)
    return getattr(out, "logits", out)


# --- (a) logits and (b) saved adapter folders ----------------------------------------------------------


@pytest.mark.parametrize("case_id", [c[0] for c in CASES])
def test_logits_and_saved_adapter_match_peft(case_id, checkpoint_dir, tmp_path):
    checkpoint, fields = _BY_ID[case_id]
    base_dir = checkpoint_dir(checkpoint)
    peft_model, converted = _native_pair(base_dir, fields, tmp_path)
    ids = _input_ids()
    expected = _logits(peft_model, ids)
    with peft_model.disable_adapter():
        base = _logits(peft_model, ids)
    assert _max_diff(expected, base) > 1e-3, "the adapter should change the logits"
    assert _max_diff(_logits(converted.model, ids), expected) <= TOLERANCE

    # our folder loads in peft and gives the same logits
    ours_dir = save_adapter(converted, tmp_path / "ours", fields, base_model_name_or_path=str(base_dir))
    reloaded = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(str(base_dir)), str(ours_dir)).eval()
    assert _max_diff(_logits(reloaded, ids), expected) <= TOLERANCE

    # adapter_config.json: the keys and values peft writes for the same LoraConfig
    ours = json.loads((ours_dir / "adapter_config.json").read_text())
    theirs = json.loads((tmp_path / "peft-adapter" / "adapter_config.json").read_text())
    assert sorted(ours) == sorted(theirs)
    for key in ("target_modules", "exclude_modules", "target_parameters"):  # sets in peft, in no particular order
        if isinstance(theirs[key], list):
            assert sorted(ours.pop(key)) == sorted(theirs.pop(key)), key
    assert ours == theirs

    # and the same tensor names and shapes as peft's adapter_model.safetensors
    from safetensors.torch import load_file

    ours_tensors = load_file(str(ours_dir / "adapter_model.safetensors"))
    theirs_tensors = load_file(str(tmp_path / "peft-adapter" / "adapter_model.safetensors"))
    assert {k: tuple(v.shape) for k, v in ours_tensors.items()} == {k: tuple(v.shape) for k, v in theirs_tensors.items()}


# --- (c) merged export -------------------------------------------------------------------------------------


@pytest.mark.parametrize("case_id", MERGE_CASES)
def test_merged_export_matches_merge_and_unload(case_id, checkpoint_dir, tmp_path):
    checkpoint, fields = _BY_ID[case_id]
    base_dir = checkpoint_dir(checkpoint)
    peft_model, converted = _native_pair(base_dir, fields, tmp_path)
    ids = _input_ids()
    expected = _logits(peft_model.merge_and_unload(), ids)

    merge_lora(converted.model)
    assert not any(isinstance(m, LoraLinear) for m in converted.model.modules())
    assert all(p.requires_grad for p in converted.model.parameters())
    export_hf(converted, tmp_path / "merged")
    merged = AutoModelForCausalLM.from_pretrained(str(tmp_path / "merged")).eval()
    assert _max_diff(_logits(merged, ids), expected) <= TOLERANCE


@pytest.mark.parametrize("case_id", ["tied-modules-to-save", "tokens-tied-head-apart"])
def test_merge_refuses_a_tied_head_trained_apart(case_id, checkpoint_dir, tmp_path):
    _, converted = _native_pair(checkpoint_dir("qwen3-mha-tied-bias"), _BY_ID[case_id][1], tmp_path)
    with pytest.raises(ValueError, match="tie_word_embeddings=False"):
        merge_lora(converted.model)


def test_token_rows_refuse_a_trained_copy_of_a_tied_head(checkpoint_dir):
    """peft's forward fails on this adapter (its tied token adapter wraps the head's copy): refused, saying why."""
    converted = load_pretrained(checkpoint_dir("qwen3-mha-tied-bias"))
    fields = dict(r=4, target_modules=["q_proj"], modules_to_save=["lm_head"], trainable_token_indices=[3, 5])
    with pytest.raises(ValueError, match="tied to its embedding: peft cannot run that adapter"):
        apply_lora(converted, fields)
    with pytest.raises(ValueError, match="trained fully, either specify"):  # peft's own refusal, in its words
        apply_lora(converted, dict(fields, modules_to_save=["embed_tokens"], trainable_token_indices={"embed_tokens": [3]}))
    with pytest.raises(ValueError, match=r"\[200\] are not token ids"):
        apply_lora(converted, dict(fields, modules_to_save=None, trainable_token_indices=[200]))
    assert not any(p.requires_grad is False for p in converted.model.parameters())  # nothing was put on before those
    from hfnative.parallel.tensor_parallel import check_tensor_parallel

    apply_lora(converted, dict(fields, modules_to_save=None))
    with pytest.raises(ValueError, match="trained token rows"):  # the vocabulary split would not carry them
        check_tensor_parallel(converted.model, 2)


# --- (d) what trains, and training steps ------------------------------------------------------------------


def _sgd_steps(model, ids, steps: int, lr: float = 0.5):
    """A few SGD steps on next-token cross-entropy; returns the logits after each step."""
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.SGD(params, lr=lr)
    model.train()
    history = []
    for _ in range(steps):
        out = model(input_ids=ids) if hasattr(model, "config") else model(ids)
        logits = getattr(out, "logits", out)
        loss = torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, VOCAB), ids[:, 1:].reshape(-1))
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        model.eval()
        history.append(_logits(model, ids))
        model.train()
    model.eval()
    return history


def test_only_adapters_train_and_steps_match_peft(checkpoint_dir, tmp_path):
    fields = dict(r=4, use_dora=True, bias="lora_only", target_modules=["q_proj", "v_proj", "down_proj"], modules_to_save=["lm_head"])
    peft_model, converted = _native_pair(checkpoint_dir("llama-linear-headdim12-bias"), fields, tmp_path)
    model = converted.model

    trainable = {name for name, p in model.named_parameters() if p.requires_grad}
    loras = {name for name, m in model.named_modules() if isinstance(m, LoraLinear)}
    expected = {f"{m}.{a}" for m in loras for a in ("lora_A", "lora_B", "lora_magnitude_vector")}
    expected |= {f"{m}.bias" for m in loras if model.get_submodule(m).bias is not None} | {"output.weight"}
    assert trainable == expected
    assert sum(p.numel() for p in adapter_parameters(model)) == sum(p.numel() for p in peft_model.parameters() if p.requires_grad)

    frozen_before = {n: p.detach().clone() for n, p in model.named_parameters() if not p.requires_grad}
    adapter_before = {n: t.clone() for n, t in lora_state_dict(model).items()}
    ours = _sgd_steps(model, _input_ids(), steps=3)
    theirs = _sgd_steps(peft_model, _input_ids(), steps=3)
    for step, (a, b) in enumerate(zip(ours, theirs)):
        assert _max_diff(a, b) <= TOLERANCE, f"step {step + 1}"
    for name, value in frozen_before.items():
        assert torch.equal(dict(model.named_parameters())[name], value), f"{name} changed"
    after = lora_state_dict(model)
    for name, value in adapter_before.items():
        assert not torch.equal(after[name], value), f"{name} did not train"


@pytest.mark.parametrize("case_id", ["tokens-tied", "tokens-untied-both", "tokens-padding-row"])
def test_token_rows_train_alone_and_steps_match_peft(case_id, checkpoint_dir, tmp_path):
    """trainable_token_indices: the rows named (and the adapters) train, the rest of the table stays as it was;
    SGD steps follow peft's (the tied head with the embedding's rows)."""
    checkpoint, fields = _BY_ID[case_id]
    peft_model, converted = _native_pair(checkpoint_dir(checkpoint), fields, tmp_path)
    model = converted.model
    rows = {name for name, p in model.named_parameters() if p.requires_grad and ".token_rows." in name}
    assert rows == ({"tok_embeddings.token_rows.values"} | ({"output.token_rows.values"} if "lm_head" in str(fields) else set()))
    assert sum(p.numel() for p in adapter_parameters(model)) == sum(p.numel() for p in peft_model.parameters() if p.requires_grad)
    table = model.tok_embeddings.weight.detach().clone()
    ours = _sgd_steps(model, _input_ids(), steps=3)
    theirs = _sgd_steps(peft_model, _input_ids(), steps=3)
    for step, (a, b) in enumerate(zip(ours, theirs)):
        assert _max_diff(a, b) <= TOLERANCE, f"step {step + 1}"
    assert torch.equal(model.tok_embeddings.weight, table)
    trained = model.tok_embeddings.token_rows.values.detach()
    assert not torch.equal(trained, table[model.tok_embeddings.token_rows.indices])


@pytest.mark.parametrize("case_id", ["tokens-tied", "tokens-tied-head-apart", "tokens-untied-both"])
def test_token_rows_in_the_fused_loss_match_peft(case_id, checkpoint_dir, tmp_path):
    """The loss through the fused head (the rows read in place of the matrix's, no copy of it) and the rows' gradients
    equal peft's cross-entropy over its logits, on a tied head (the embedding's rows, or rows of its own) and an
    untied one."""
    checkpoint, fields = _BY_ID[case_id]
    peft_model, converted = _native_pair(checkpoint_dir(checkpoint), fields, tmp_path)
    ids = _input_ids(seed=3)
    ids[0, 2:5] = torch.tensor([7, 4, 0])  # trained tokens as inputs and as labels
    model = converted.model.train()
    peft_model.train()
    loss = model(ids, labels=ids).loss
    loss.backward()
    expected = peft_model(input_ids=ids, labels=ids).loss
    expected.backward()
    assert abs(loss.item() - expected.item()) <= TOLERANCE
    theirs = {name.split("base_model.model.")[-1]: p.grad for name, p in peft_model.named_parameters()
              if "trainable_tokens_delta" in name}
    ours = {name: p.grad for name, p in model.named_parameters() if ".token_rows." in name}
    layers = {"tok_embeddings.token_rows.values": "model.embed_tokens.token_adapter.trainable_tokens_delta.default",
              "output.token_rows.values": "lm_head.token_adapter.trainable_tokens_delta.default"}
    assert {layers[name] for name in ours} == set(theirs)
    for name, grad in ours.items():
        assert grad.abs().sum() > 0, name
        assert _max_diff(grad, theirs[layers[name]]) <= TOLERANCE, name


@pytest.mark.parametrize("case_id", ["modules-to-save-lm-head", "tied-modules-to-save", "experts-gptoss-by-layer",
                                     "tokens-tied", "tokens-untied-both"])
def test_disable_adapters_runs_the_base_model(case_id, checkpoint_dir, tmp_path):
    checkpoint, fields = _BY_ID[case_id]
    fields = dict(fields, use_dora=not fields.get("target_parameters"))  # peft's parameter adapters take no DoRA
    peft_model, converted = _native_pair(checkpoint_dir(checkpoint), fields, tmp_path)
    ids = _input_ids()
    base = AutoModelForCausalLM.from_pretrained(str(checkpoint_dir(checkpoint))).eval()
    adapted = _logits(converted.model, ids)
    with disable_adapters(converted.model):
        assert _max_diff(_logits(converted.model, ids), _logits(base, ids)) <= TOLERANCE
    assert torch.equal(_logits(converted.model, ids), adapted)
    assert _max_diff(adapted, _logits(peft_model, ids)) <= TOLERANCE


@pytest.mark.parametrize("use_dora", [False, True])
def test_dropout_in_training_matches_peft(use_dora, checkpoint_dir, tmp_path):
    """Same seed, same module order -> the same dropout masks as peft, so training-mode logits agree."""
    fields = dict(r=4, lora_dropout=0.3, use_dora=use_dora, target_modules="all-linear")
    peft_model, converted = _native_pair(checkpoint_dir("qwen3-gqa"), fields, tmp_path)
    peft_model.train()
    converted.model.train()
    ids = _input_ids()
    torch.manual_seed(5)
    theirs = peft_model(input_ids=ids).logits
    torch.manual_seed(5)
    ours = converted.model(ids).logits
    assert _max_diff(ours, theirs) <= TOLERANCE
    with torch.no_grad():
        torch.manual_seed(6)
        assert _max_diff(converted.model(ids).logits, ours) > 1e-4, "dropout should be active in training mode"


def test_bf16_base_keeps_float32_adapters(checkpoint_dir, tmp_path):
    """peft's autocast_adapter_dtype: a bf16 base gets float32 adapters (trained token rows too); logits agree to
    bf16 precision (the base models themselves differ by about 3e-3 in bf16)."""
    base_dir = checkpoint_dir("qwen3-gqa")
    fields = dict(r=4, use_dora=True, target_modules="all-linear", trainable_token_indices=[7, 15, 44])
    _peft_model(base_dir, fields).save_pretrained(str(tmp_path / "peft"))
    hf_model = AutoModelForCausalLM.from_pretrained(str(base_dir), dtype=torch.bfloat16)
    peft_model = PeftModel.from_pretrained(hf_model, str(tmp_path / "peft")).eval()
    converted = load_pretrained(base_dir, dtype=torch.bfloat16)
    load_adapter(converted, tmp_path / "peft")
    converted.model.eval()
    assert {p.dtype for p in adapter_parameters(converted.model)} == {torch.float32}
    assert converted.model.tok_embeddings.token_rows.values.dtype == torch.float32
    ids = _input_ids()
    ours = _logits(converted.model, ids)
    assert ours.dtype == torch.bfloat16
    assert _max_diff(ours.float(), _logits(peft_model, ids).float()) <= 2e-2


_NATIVE_PROJECTIONS = {"wq": "q_proj", "wk": "k_proj", "wv": "v_proj", "wo": "o_proj", "w1": "gate_proj",
                       "w3": "up_proj", "w2": "down_proj"}


def _logits_and_adapter_grads(model, ids, bf16: bool):
    """Training-mode logits and the adapters' gradients, keyed (layer, Hub projection name, factor), under CPU bf16
    autocast or not."""
    model.train()
    model.zero_grad(set_to_none=True)
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
        out = model(input_ids=ids) if hasattr(model, "config") else model(ids)
    logits = out.logits.float()
    weights = torch.linspace(-1.0, 1.0, logits.numel()).view_as(logits)  # every logit's gradient differs
    (logits * weights).sum().backward()
    grads = {}
    for name, param in model.named_parameters():
        if param.grad is None or "lora_A" not in name and "lora_B" not in name:  # A and B (not DoRA's magnitudes)
            continue
        parts = name.split(".")
        layer = int(parts[parts.index("layers") + 1])
        factor = "lora_A" if "lora_A" in parts else "lora_B"
        projection = parts[parts.index(factor) - 1]
        grads[layer, _NATIVE_PROJECTIONS.get(projection, projection), factor] = param.grad.float()
    model.eval()
    return logits.detach(), grads


def test_lora_under_bf16_autocast_is_as_close_to_fp32_as_peft(checkpoint_dir, tmp_path):
    """Under bf16 autocast a LoRA layer adds its update inside the up-projection's matmul (``addmm``, one rounding
    where peft rounds the product, its scaled copy and the sum) and hands the adapter its input without a round trip
    through float32: logits and adapter gradients stay as close to the fp32 computation as peft's own."""
    fields = dict(r=4, lora_alpha=8, target_modules="all-linear")
    ids = _input_ids()
    # squared distances of the bf16 runs to the fp32 one and the fp32 run's squared norms, summed over adapters drawn
    # from 4 seeds (peft draws lora_A from torch's global generator): one adapter's ratio of two bf16 round-off errors
    # is a noisy draw (0.85x to 1.35x over 8 seeds, 1.7x once), their sum over several is not
    squared = {(name, what): 0.0 for name in ("peft", "ours", "exact") for what in ("logits", "adapter gradients")}
    for seed in range(4):
        torch.manual_seed(seed)
        peft_model, converted = _native_pair(checkpoint_dir("qwen3-gqa"), fields, tmp_path / str(seed))
        results = {name: {bf16: _logits_and_adapter_grads(model, ids, bf16) for bf16 in (False, True)}
                   for name, model in (("peft", peft_model), ("ours", converted.model))}
        exact_logits, exact_grads = results["peft"][False]
        assert _max_diff(results["ours"][False][0], exact_logits) <= TOLERANCE
        assert results["ours"][True][1].keys() == results["peft"][True][1].keys() == exact_grads.keys()
        assert len(exact_grads) == 2 * 7 * 2  # 2 layers x 7 projections x (A, B)
        exact = {"logits": exact_logits,
                 "adapter gradients": torch.cat([exact_grads[key].flatten() for key in sorted(exact_grads)])}
        for what in exact:
            squared["exact", what] += exact[what].norm().item() ** 2
        for name in ("peft", "ours"):
            logits, grads = results[name][True]
            got = {"logits": logits,
                   "adapter gradients": torch.cat([grads[key].flatten() for key in sorted(exact_grads)])}
            for what in exact:
                squared[name, what] += (got[what] - exact[what]).norm().item() ** 2

    for what in ("logits", "adapter gradients"):  # each run's relative distance to fp32 over the 4 adapters
        ours, theirs = ((squared[name, what] / squared["exact", what]) ** 0.5 for name in ("ours", "peft"))
        assert 0 < ours <= 1.5 * theirs, (what, ours, theirs)


class _Ops(TorchDispatchMode):
    """Records each op that makes a tensor: (its name, the output's shape, its dtype)."""

    def __init__(self):
        super().__init__()
        self.seen = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if isinstance(out, torch.Tensor):
            self.seen.append((func.overloadpacket.__name__, tuple(out.shape), out.dtype))
        return out

    def casts(self, shape_matches) -> int:
        """How many dtype casts made a tensor whose shape ``shape_matches``."""
        return sum(name == "_to_copy" and shape_matches(shape) for name, shape, _ in self.seen)


def test_a_lora_layer_writes_no_extra_activation_sized_tensors():
    """The update's scale and sum run inside the matmul, and under autocast the adapter reads the input as the base
    does: forward and backward make no elementwise pass over a [tokens, out] tensor and no float32 copy of a bf16
    input (the separate ops ran a scale and a sum over [tokens, out] forward and a scale backward, and under autocast
    copied a bf16 input to float32 for autocast to cast back)."""
    tokens, features_in, features_out = 24, 32, 48
    base = torch.nn.Linear(features_in, features_out, bias=False).requires_grad_(False)
    layer = LoraLinear(base, r=4, scaling=2.0)
    torch.nn.init.normal_(layer.lora_B)

    for bf16, dtype in ((False, torch.float32), (True, torch.bfloat16)):
        x = torch.randn(2, tokens // 2, features_in, dtype=dtype, requires_grad=True)
        with _Ops() as ops:
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
                out = layer(x)
            out.float().sum().backward()
        matmuls = {"mm", "addmm"}
        activation_sized = [(name, shape) for name, shape, _ in ops.seen
                            if name not in matmuls and shape in ((tokens, features_out), (2, tokens // 2, features_out))
                            and name not in ("view", "_unsafe_view", "reshape", "t", "transpose", "detach", "expand",
                                             "ones_like", "sum", "_to_copy")]
        assert activation_sized == [], (bf16, activation_sized)
        assert not [op for op in ops.seen if op[0] == "_to_copy" and op[2] == torch.float32 and op[1][0] in (2, tokens)
                    and op[1][-1] == features_in], (bf16, ops.seen)
        assert sum(name == "addmm" for name, _, _ in ops.seen) == 1


# --- (e) continuing from a peft-saved adapter -------------------------------------------------------------


def test_load_adapter_continues_a_peft_adapter(checkpoint_dir, tmp_path):
    base_dir = checkpoint_dir("qwen3-gqa")
    fields = dict(r=4, lora_alpha=16, use_dora=True, target_modules="all-linear")
    peft_model = _peft_model(base_dir, fields)
    peft_model.save_pretrained(str(tmp_path / "peft"))

    converted = load_pretrained(base_dir)
    settings = load_adapter(converted, tmp_path / "peft")  # settings from adapter_config.json alone
    converted.model.eval()
    assert settings.use_dora and settings.lora_alpha == 16 and settings.r == 4
    assert all(p.requires_grad for p in adapter_parameters(converted.model))
    ids = _input_ids(3)
    assert _max_diff(_logits(converted.model, ids), _logits(peft_model, ids)) <= TOLERANCE

    # a training step from there, as peft would take it
    peft_model.train()  # peft keeps inference-mode off after get_peft_model
    ours, theirs = _sgd_steps(converted.model, ids, 2), _sgd_steps(peft_model, ids, 2)
    assert _max_diff(ours[-1], theirs[-1]) <= TOLERANCE

    # resume: save, rebuild from the base, reload -> the same adapter tensors
    save_adapter(converted, tmp_path / "ckpt", settings)
    resumed = load_pretrained(base_dir)
    apply_lora(resumed, settings)
    load_adapter_weights(resumed, tmp_path / "ckpt")
    saved, restored = lora_state_dict(converted.model), lora_state_dict(resumed.model)
    assert saved.keys() == restored.keys() and all(torch.equal(saved[k], restored[k]) for k in saved)


# --- settings and errors ----------------------------------------------------------------------------------


def test_settings_read_from_loraconfig_dict_and_dataclass():
    config = LoraConfig(r=16, lora_alpha=32, lora_dropout=0.05, target_modules=["q_proj", "v_proj"], use_dora=True, task_type="CAUSAL_LM")
    from_config = lora_settings(config)
    assert (from_config.r, from_config.lora_alpha, from_config.lora_dropout, from_config.use_dora) == (16, 32, 0.05, True)
    assert from_config.target_modules == ["q_proj", "v_proj"]
    assert lora_settings(config.to_dict()) == from_config
    assert lora_settings(from_config) is from_config
    assert lora_settings(dict(r=4, use_rslora=True, lora_alpha=8)).scaling() == pytest.approx(8 / 2)
    with pytest.raises(ValueError, match="lora_bias"):
        lora_settings(LoraConfig(r=4, lora_bias=True))
    with pytest.raises(ValueError, match="LoRA"):
        lora_settings({"peft_type": "IA3"})


def test_unsupported_targets_raise_clear_errors(checkpoint_dir):
    converted = load_pretrained(checkpoint_dir("llama-gqa"))
    with pytest.raises(ValueError, match="modules_to_save"):
        apply_lora(converted, dict(target_modules=["lm_head"]))
    with pytest.raises(ValueError, match="not found"):
        apply_lora(converted, dict(target_modules=["qkv_proj"]))
    phi3 = load_pretrained(checkpoint_dir("phi3-gqa"))
    with pytest.raises(ValueError, match="no default target modules"):
        apply_lora(phi3, dict(r=4))
    moe = load_pretrained(checkpoint_dir("qwen3moe-sparse-step"))
    with pytest.raises(ValueError, match="reaches the MoE experts"):
        apply_lora(moe, dict(target_modules="all-linear"))
    assert len(apply_lora(moe, dict(target_modules=["q_proj", "o_proj"]))) == 6


def test_quantization_config_shapes():
    from transformers import BitsAndBytesConfig, GPTQConfig

    from hfnative.peft import Int8Settings, NF4Settings

    assert quantization_settings() is None
    assert quantization_settings(load_in_4bit=True).compute_dtype == torch.float32
    bnb = dict(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_compute_dtype="bfloat16", bnb_4bit_use_double_quant=True)
    assert quantization_settings(quantization_config=bnb).compute_dtype == torch.bfloat16
    with pytest.raises(ValueError, match="nf4"):
        quantization_settings(quantization_config=dict(load_in_4bit=True, bnb_4bit_quant_type="fp4"))
    assert quantization_settings(load_in_8bit=True) == Int8Settings()
    assert quantization_settings(quantization_config=dict(load_in_8bit=True, llm_int8_skip_modules=["mlp"])) \
        == Int8Settings(("mlp",))
    four_bits = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", llm_int8_skip_modules=["lm_head"])
    assert quantization_settings(quantization_config=four_bits) \
        == NF4Settings(torch.float32, ("lm_head",))
    with pytest.raises(ValueError, match="both set"):
        quantization_settings(load_in_4bit=True, quantization_config=dict(load_in_8bit=True))
    with pytest.raises(ValueError, match="llm_int8_has_fp16_weight=True"):
        quantization_settings(quantization_config=BitsAndBytesConfig(load_in_8bit=True, llm_int8_has_fp16_weight=True))
    with pytest.raises(ValueError, match="quant_method='gptq'"):
        quantization_settings(quantization_config=GPTQConfig(bits=4))
    from transformers import Mxfp4Config  # GPT-OSS's recipe: an MXFP4 checkpoint loads dequantized, as it does anyway

    assert quantization_settings(quantization_config=Mxfp4Config(dequantize=True)) is None
    with pytest.raises(ValueError, match="set dequantize=True"):
        quantization_settings(quantization_config=Mxfp4Config())


# --- (f) QLoRA ---------------------------------------------------------------------------------------------

# NF4 keeps 16 levels per 64-weight block. On this tiny random model the quantized-base logits differ
# from the full-precision LoRA model's by ~3.5% in relative L2 norm (max abs ~0.013 on logits up to
# ~0.36), in float32 and bfloat16 compute alike; allow 10%.
QLORA_RELATIVE_TOLERANCE = 0.1


@pytest.mark.parametrize("compute_dtype", ["float32", "bfloat16"])
def test_qlora_nf4_base_trains_the_adapter_only(compute_dtype, checkpoint_dir, tmp_path):
    pytest.importorskip("torchao")
    base_dir = checkpoint_dir("llama-gqa")
    fields = dict(r=4, use_dora=True, target_modules="all-linear")
    peft_model = _peft_model(base_dir, fields)
    peft_model.save_pretrained(str(tmp_path / "peft"))
    quantization_config = dict(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_compute_dtype=compute_dtype, bnb_4bit_use_double_quant=True)

    converted = load_pretrained(base_dir)
    load_adapter(converted, tmp_path / "peft", quantization_config=quantization_config)
    model = converted.model.eval()
    quantized = {n: p for n, p in model.named_parameters() if type(p).__name__ == "NF4Tensor"}
    assert len(quantized) == 2 * 7  # every projection of both layers; not the head or the embedding
    before = {n: p.get_original_weight().clone() for n, p in quantized.items()}

    assert {p.dtype for p in quantized.values()} == {getattr(torch, compute_dtype)}
    ids = _input_ids()
    ours, full_precision = _logits(model, ids), _logits(peft_model, ids)
    assert ours.dtype == torch.float32  # computed in compute_dtype, returned in the input's dtype
    assert ((ours - full_precision).norm() / full_precision.norm()).item() <= QLORA_RELATIVE_TOLERANCE

    model.train()
    logits = model(ids).logits
    torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, VOCAB), ids[:, 1:].reshape(-1)).backward()
    trainable = adapter_parameters(model)
    assert trainable and all(p.grad is not None and p.grad.abs().sum() > 0 for p in trainable)
    assert all(not p.requires_grad and p.grad is None for p in quantized.values())
    torch.optim.AdamW(trainable, lr=1e-2).step()
    for name, param in dict(model.named_parameters()).items():
        if name in before:
            assert type(param).__name__ == "NF4Tensor" and torch.equal(param.get_original_weight(), before[name])

    # the merged export is a plain checkpoint (weights dequantized)
    merge_lora(model)
    assert not any(type(p).__name__ == "NF4Tensor" for p in model.parameters())
    export_hf(converted, tmp_path / "merged")
    assert AutoModelForCausalLM.from_pretrained(str(tmp_path / "merged")) is not None


# --- (g) an 8-bit base (load_in_8bit) -------------------------------------------------------------------------


@pytest.mark.parametrize("skip", [None, ["down_proj", "self_attn.o_proj"]])
def test_int8_base_is_what_bitsandbytes_stores(skip, checkpoint_dir):
    """load_in_8bit quantizes the linears transformers' bitsandbytes integration quantizes (its default, or what
    llm_int8_skip_modules leaves, but for the output head, which stays in full precision), each into bitsandbytes'
    own int8 rows and row maxima, value for value."""
    bnb = pytest.importorskip("bitsandbytes")
    from transformers import BitsAndBytesConfig

    from hfnative.converters.lora_targets import hub_modules
    from hfnative.peft import Int8Weight

    base_dir = checkpoint_dir("llama-gqa")
    config = BitsAndBytesConfig(load_in_8bit=True, llm_int8_skip_modules=skip)
    theirs = AutoModelForCausalLM.from_pretrained(str(base_dir), quantization_config=config, dtype=torch.float32)
    quantized = {name: m for name, m in theirs.named_modules() if isinstance(m, bnb.nn.Linear8bitLt)}
    # a list replaces transformers' default (which skips lm_head): it quantizes the head, which stays full here
    assert ("lm_head" in quantized) == (skip is not None)
    quantized.pop("lm_head", None)
    assert len(quantized) == (2 * 5 if skip else 2 * 7)

    converted = load_pretrained(base_dir)
    apply_lora(converted, dict(r=4, target_modules=["q_proj", "down_proj"]), quantization_config=config)
    modules = hub_modules(converted)
    ours = {path for path, module in modules.items()
            if all(isinstance(converted.model.get_submodule(n).weight, Int8Weight) for n in module.native)}
    assert ours == set(quantized)
    for path, module in quantized.items():
        (native,) = modules[path].native
        weight = converted.model.get_submodule(native).weight
        assert weight.data_int8.dtype == torch.int8 and torch.equal(weight.data_int8, module.weight.data), path
        assert torch.equal(weight.absmax, module.weight.SCB), path


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_int8_rows_dequantize_as_bitsandbytes_in_float32(dtype):
    """The values an int8 weight stands for are bitsandbytes' own dequantization (``int8_vectorwise_dequant``, in
    float32) rounded once to the compute dtype, rows of tiny and zero maxima included (a row scale rounded to bf16 or
    fp16 first would bias whole rows)."""
    bnb = pytest.importorskip("bitsandbytes")
    from hfnative.peft.quantize import int8_rows, int8_values

    g = torch.Generator().manual_seed(0)
    weight = torch.randn(64, 48, generator=g) * torch.logspace(-5, 0, 64)[:, None]
    weight[3] = 0.0
    rows, maxima = int8_rows(weight)
    expected = bnb.functional.int8_vectorwise_dequant(rows, maxima).to(dtype)
    assert torch.equal(int8_values(rows, maxima, dtype), expected)


@pytest.mark.parametrize("weight_dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("x_dtype", [torch.float32, torch.bfloat16, torch.float64])
@pytest.mark.parametrize("autocast", [False, True], ids=["plain", "bf16-autocast"])
def test_nf4_linear_is_linear_over_the_dequantized_weight(weight_dtype, x_dtype, autocast):
    """An NF4 base's matmul (``frozen_linear``) is torchao's ``linear_nf4`` on the input cast to the weight's dtype,
    the bias added in the product's dtype and the result cast back, written out with explicit casts outside autocast:
    the weight's values torchao's ``get_original_weight``, cast where autocast casts (an input autocast leaves alone,
    float64, stays the weight's dtype). Output, the input's gradient and the bias's equal it to the bit, under bf16
    autocast and without, for weights of another half dtype than autocast's too."""
    pytest.importorskip("torchao")
    import torch.nn.functional as F

    from hfnative.peft.quantize import frozen_linear, to_nf4_parameter

    g = torch.Generator().manual_seed(0)
    weight = to_nf4_parameter(torch.randn(48, 128, generator=g) * 0.1, weight_dtype)
    x0 = torch.randn(3, 5, 128, generator=g).to(x_dtype)
    grad = torch.randn(3, 5, 48, generator=g)

    def explicit(x, w, b):
        x_w, values = x.to(w.dtype), w.get_original_weight()
        if autocast:  # autocast narrows both operands of the matmul to bf16
            x_w, values = x_w.to(torch.bfloat16), values.to(torch.bfloat16)
        out = F.linear(x_w, values)
        return (out + b.to(out.dtype)).to(x.dtype)

    results = []
    for function, autocast_on in ((frozen_linear, autocast), (explicit, False)):
        x = x0.clone().requires_grad_()
        bias = torch.zeros(48, requires_grad=True)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast_on):
            out = function(x, weight, bias)
        out.backward(grad.to(out.dtype))
        results.append((out, x.grad, bias.grad))
    for name, got, want in zip(("output", "input grad", "bias grad"), *results):
        assert got.dtype == want.dtype and torch.equal(got, want), f"{name}: {(got - want).abs().max()}"


@pytest.mark.parametrize("base", ["plain", "int8"])
def test_lora_casts_an_input_without_a_gradient_once_under_autocast(base):
    """Under autocast, a LoRA layer whose float32 input needs no gradient (rollouts, a reference's forward, the first
    block's projections in training) casts it to bf16 once for its base's matmul and its adapter's, where autocast
    casts it for each: the same output to the bit as for an input that needs a gradient (which keeps autocast's two
    casts), the same adapter gradients, one cast of the input fewer; with dropout in eval mode too."""
    from hfnative.peft.lora import LoraLinear
    from hfnative.peft.quantize import QuantizedLinear, to_int8_parameter

    g = torch.Generator().manual_seed(0)
    linear = torch.nn.Linear(64, 48)
    if base == "int8":
        linear = QuantizedLinear(linear, to_int8_parameter(linear.weight))
    x = torch.randn(5, 64, generator=g)
    grad_out = torch.randn(5, 48, generator=g).bfloat16()

    for dropout in (0.0, 0.05):
        layer = LoraLinear(linear, r=4, scaling=2.0, dropout=dropout).eval()
        torch.nn.init.normal_(layer.lora_B, generator=g)
        results = []
        for grad, input_grad in ((True, True), (True, False), (False, False)):
            layer.zero_grad(set_to_none=True)
            with torch.set_grad_enabled(grad), torch.autocast("cpu", dtype=torch.bfloat16), _Ops() as ops:
                out = layer(x.clone().requires_grad_(input_grad))
            casts = ops.casts(lambda shape: shape == x.shape)
            if grad:
                out.backward(grad_out)
            results.append((out.detach(), casts, layer.lora_A.grad, layer.lora_B.grad))
        (want, want_casts, want_a, want_b), *others = results
        assert want_casts == 2, (dropout, want_casts)
        for out, casts, a, b in others:
            assert out.dtype == want.dtype and torch.equal(out, want) and casts == 1, (dropout, casts)
        _, _, a, b = others[0]
        assert torch.equal(a, want_a) and torch.equal(b, want_b), dropout


@pytest.mark.parametrize("name", ["qwen3-gqa", "olmo3-sliding-gqa"])
@pytest.mark.parametrize("base", ["plain", "int8"])
def test_lora_model_without_a_gradient_fans_its_pre_norms_out_in_bf16(name, base, checkpoint_dir, monkeypatch):
    """A LoRA model's forward without a gradient under bf16 autocast (rollouts, a reference's log-probs): each pre-norm
    (or a post-norm block's sublayer input) is made once in bf16 for the LoRA projections reading it, as for plain
    ones, and no layer casts an input of its own. Against the same model with that switched off (every layer's input
    cast by autocast, layer by layer): the logits to the bit with adapters on and off, with lora_dropout (in eval
    mode) and without, and the native engine's greedy rollouts and log-probs; fewer casts of activations."""
    from hfnative.generation.native import NativeRolloutEngine
    from hfnative.generation.sampling import SamplingParams
    from hfnative.peft.lora import LoraLinear
    from hfnative.peft.quantize import FrozenLinear

    converted = load_pretrained(checkpoint_dir(name))
    apply_lora(converted, dict(r=4, lora_alpha=8, target_modules="all-linear", lora_dropout=0.05),
               load_in_8bit=base == "int8")
    model = converted.model.eval()
    with torch.no_grad():
        for parameter_name, parameter in model.named_parameters():
            if "lora_B" in parameter_name:
                parameter.normal_(generator=torch.Generator().manual_seed(len(parameter_name)))
    ids = torch.randint(0, VOCAB, (2, 9), generator=torch.Generator().manual_seed(0))
    hidden = model.args.dim
    adapters = [module for module in model.modules() if isinstance(module, LoraLinear)]

    def activations(shape):
        return shape[-1] == hidden and math.prod(shape) == ids.numel() * hidden

    def run():
        results = []
        for enabled in (True, False):
            for adapter in adapters:
                adapter.adapter_enabled = enabled
            with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16), _Ops() as ops:
                logits = model(ids).logits
            results.append((logits, ops.casts(activations)))
        for adapter in adapters:
            adapter.adapter_enabled = True
        with torch.autocast("cpu", dtype=torch.bfloat16):
            rollouts = NativeRolloutEngine(model).generate([[5, 9, 11, 3], [7, 2]],
                                                           SamplingParams(max_new_tokens=4, do_sample=False))
        return results, rollouts

    (fanned, fanned_rollouts) = run()
    for cls in (LoraLinear, FrozenLinear):  # the oracle: every layer's input cast by autocast
        monkeypatch.setattr(cls, "narrow_input_without_grad", property(lambda self: False))
    (cast_per_layer, rollouts) = run()
    for (logits, casts), (want, want_casts) in zip(fanned, cast_per_layer):
        assert torch.equal(logits, want)
        assert casts < want_casts, (casts, want_casts)
    assert fanned_rollouts.completion_ids == rollouts.completion_ids
    assert fanned_rollouts.logprobs == rollouts.logprobs


def _bitsandbytes_dequantized(model) -> None:
    """Every nn.Linear of a peft model but the head and the adapters given the values of bitsandbytes' int8 rows
    (``CB * SCB / 127`` from its own quantization of the fp16 weight): the 8-bit base's oracle in float32."""
    bnb = pytest.importorskip("bitsandbytes")
    with torch.no_grad():
        for name, module in model.named_modules():
            if type(module) is torch.nn.Linear and not name.endswith("lm_head") and ".lora_" not in name:
                rows, maxima, _ = bnb.functional.int8_vectorwise_quant(module.weight.to(torch.float16).contiguous())
                module.weight.copy_(rows.float() * (maxima / 127).unsqueeze(1))


@pytest.mark.parametrize("fields", [dict(r=4, target_modules="all-linear"),
                                    dict(r=4, use_dora=True, target_modules=["q_proj", "v_proj", "down_proj"])],
                         ids=["lora", "dora"])
def test_int8_base_computes_peft_over_the_dequantized_rows(fields, checkpoint_dir, tmp_path):
    """An adapter on the 8-bit base: logits and the adapters' gradients are peft's over bitsandbytes' dequantized
    weights (fp32, to round-off; under bf16 autocast as close as peft's own bf16 run); backward keeps only the int8
    rows of a base weight, which gets no gradient and does not change; the merged export is a plain checkpoint of
    the dequantized weights plus the adapters."""
    from hfnative.peft import Int8Weight
    from hfnative.peft.quantize import int8_linear

    base_dir = checkpoint_dir("llama-gqa")
    peft_model = _peft_model(base_dir, fields)
    peft_model.save_pretrained(str(tmp_path / "peft"))
    _bitsandbytes_dequantized(peft_model)
    converted = load_pretrained(base_dir)
    load_adapter(converted, tmp_path / "peft", load_in_8bit=True)
    model = converted.model
    quantized = {n: p for n, p in model.named_parameters() if isinstance(p, Int8Weight)}
    assert len(quantized) == 2 * 7 and {p.dtype for p in quantized.values()} == {torch.float32}
    before = {n: p.data_int8.clone() for n, p in quantized.items()}

    ids = _input_ids()
    results = {name: {bf16: _logits_and_adapter_grads(m, ids, bf16) for bf16 in (False, True)}
               for name, m in (("peft", peft_model), ("ours", model))}
    (exact_logits, exact_grads), (logits, grads) = results["peft"][False], results["ours"][False]
    assert _max_diff(logits, exact_logits) <= TOLERANCE
    assert grads.keys() == exact_grads.keys() and grads
    for key, grad in grads.items():
        torch.testing.assert_close(grad, exact_grads[key], rtol=1e-4, atol=1e-5, msg=str(key))
    for name in ("ours", "peft"):  # bf16: ours within 1.5x peft's own distance from the fp32 logits
        results[name] = ((results[name][True][0] - exact_logits).norm() / exact_logits.norm()).item()
    assert 0 < results["ours"] <= 1.5 * results["peft"], results
    assert all(not p.requires_grad and p.grad is None for p in quantized.values())
    assert all(torch.equal(p.data_int8, before[n]) for n, p in dict(model.named_parameters()).items() if n in before)

    # backward keeps the int8 rows and their maxima of a base weight, not a float copy of it
    weight = next(iter(quantized.values()))
    kept = []
    x = torch.randn(3, weight.shape[1], requires_grad=True)
    with torch.autograd.graph.saved_tensors_hooks(lambda t: kept.append(t) or t, lambda t: t):
        int8_linear(x, weight, None).sum().backward()
    assert [t.dtype for t in kept] == [torch.int8, torch.float32] and kept[1].shape == weight.shape[:1]

    merge_lora(model)
    assert not any(isinstance(p, Int8Weight) for p in model.parameters())
    export_hf(converted, tmp_path / "merged")
    merged = AutoModelForCausalLM.from_pretrained(str(tmp_path / "merged"), dtype=torch.float32)
    with torch.no_grad():
        assert _max_diff(_logits(merged, ids), _logits(peft_model.eval(), ids)) <= TOLERANCE


@pytest.mark.parametrize("bits", [8, 4])
def test_a_host_model_is_quantized_weight_by_weight_on_the_device(bits, checkpoint_dir):
    """quantize_base(device=...): each weight of a model loaded on the host is moved to the device and quantized
    there (the meta device stands in for a GPU here), the rest left where it is: the device never holds the
    full-precision model."""
    from hfnative.peft import Int8Settings, NF4Settings, quantize_base
    from hfnative.peft.quantize import is_quantized

    if bits == 4:
        pytest.importorskip("torchao")
    converted = load_pretrained(checkpoint_dir("llama-gqa"))
    done = quantize_base(converted.model, Int8Settings() if bits == 8 else NF4Settings(), device=torch.device("meta"))
    assert len(done) == 2 * 7
    quantized = [p for p in converted.model.parameters() if is_quantized(p)]
    assert len(quantized) == len(done) and all(p.device.type == "meta" for p in quantized)
    assert all(p.device.type == "cpu" for p in converted.model.parameters() if not is_quantized(p))


@pytest.mark.parametrize("modules_to_save", [None, ["score"], ["norm", "classifier"]])
def test_a_classifiers_modules_to_save_are_what_peft_adds(modules_to_save):
    """task_type='SEQ_CLS': the names peft's PeftModelForSequenceClassification adds to modules_to_save (the installed
    peft's, without repeating one already there), read off peft wrapping a classifier with the same config."""
    from transformers import Qwen3Config, Qwen3ForSequenceClassification

    from hfnative.peft import lora_settings

    config = dict(r=4, target_modules=["q_proj"], task_type="SEQ_CLS", modules_to_save=modules_to_save)
    classifier = Qwen3ForSequenceClassification(Qwen3Config(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
        num_key_value_heads=1, head_dim=16, num_labels=1, pad_token_id=0))
    peft_model = get_peft_model(classifier, LoraConfig(**config))
    assert lora_settings(config).modules_to_save == list(peft_model.peft_config["default"].modules_to_save)


@pytest.mark.parametrize("installed, expected", [("0.21.2", 2), ("0.22.0", 3), ("0.23.1", 3), ("0.22.0rc1", None),
                                                 ("0.21.1.dev0", None)])
def test_the_names_a_classifier_adds_follow_peft_s_version(monkeypatch, installed, expected):
    """seq_cls_heads: a release's names from its version (peft not imported: sys.modules without it); a
    development or pre-release build's (whose version may name the previous release) from its own list."""
    import importlib.metadata
    import sys

    from peft.peft_model import CLASSIFIER_MODULE_NAMES

    from hfnative.peft.settings import SEQ_CLS_HEADS, seq_cls_heads

    monkeypatch.setattr(importlib.metadata, "version", lambda name: installed)
    if expected is not None:
        monkeypatch.delitem(sys.modules, "peft")
    seq_cls_heads.cache_clear()
    try:
        heads = seq_cls_heads()
    finally:
        seq_cls_heads.cache_clear()
    assert heads == (SEQ_CLS_HEADS[:expected] if expected is not None else tuple(CLASSIFIER_MODULE_NAMES))


def test_adapter_config_follows_the_installed_peft_s_keys(checkpoint_dir, monkeypatch):
    """adapter_config.json has the installed peft's keys: one a newer peft adds (a LoRA variant hfnative does not
    implement) is written with peft's default, one an older peft does not know is left out, hfnative's values stay."""
    import hfnative.converters.peft as peft_folders

    converted = load_pretrained(checkpoint_dir("qwen3-gqa"))
    fields = dict(r=4, lora_alpha=8, target_modules=["q_proj"])
    apply_lora(converted, fields)
    defaults = LoraConfig().to_dict()
    newer = dict(defaults, future_config=None, future_modes={"b", "a"})
    monkeypatch.setattr(peft_folders, "_peft_lora_defaults", lambda: newer)
    config = peft_folders.adapter_config(converted, fields)
    assert set(config) == set(newer) and config["future_config"] is None and config["future_modes"] == ["a", "b"]
    assert config["r"] == 4 and config["lora_alpha"] == 8 and config["target_modules"] == ["q_proj"]
    json.dumps(config)
    older = {key: value for key, value in defaults.items() if key not in ("astra_config", "kasa_config")}
    monkeypatch.setattr(peft_folders, "_peft_lora_defaults", lambda: older)
    assert set(peft_folders.adapter_config(converted, fields)) == set(older)
    monkeypatch.setattr(peft_folders, "_peft_lora_defaults", lambda: None)  # no peft: hfnative's own keys, 0.22's
    assert set(peft_folders.adapter_config(converted, fields)) == set(defaults) | {"astra_config"}
