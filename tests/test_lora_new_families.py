"""LoRA on the OLMo 3 and GPT-OSS native models with peft 0.21 as the oracle: the modules peft adapts,
and the logits with the same (perturbed) adapter weights."""

import pytest
import torch

peft = pytest.importorskip("peft")
from hf_configs import VOCAB, save_hf_model  # noqa: E402
from peft import LoraConfig, get_peft_model  # noqa: E402
from transformers import AutoModelForCausalLM  # noqa: E402

from hfnative.converters.loading import load_pretrained  # noqa: E402
from hfnative.converters.peft import apply_lora, load_adapter_weights  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning:peft")

CASES = [
    ("olmo3-sliding-gqa", "all-linear"),
    ("gptoss-alternating-yarn", "all-linear"),  # attention only: GPT-OSS's experts and router are not nn.Linear
    ("gptoss-tied-top1-clamped", ["q_proj", "o_proj"]),
]


@pytest.mark.parametrize(("checkpoint", "target_modules"), CASES)
def test_lora_matches_peft(checkpoint, target_modules, tmp_path):
    save_hf_model(checkpoint, tmp_path / "base")
    fields = dict(r=2, lora_alpha=4, target_modules=target_modules)
    peft_model = get_peft_model(AutoModelForCausalLM.from_pretrained(str(tmp_path / "base")), LoraConfig(**fields))
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():  # lora_B starts at zero: perturb every adapter tensor
        for _, param in sorted(peft_model.named_parameters()):
            if param.requires_grad:
                param.add_(torch.randn(param.shape, generator=generator) * 0.1)
    peft_model.save_pretrained(str(tmp_path / "adapter"))

    converted = load_pretrained(tmp_path / "base")
    adapted = apply_lora(converted, fields)
    theirs = sorted({name.split(".lora_")[0].removeprefix("base_model.model.") for name, _ in peft_model.named_parameters() if ".lora_" in name})
    assert sorted(adapted) == theirs
    load_adapter_weights(converted, tmp_path / "adapter")
    ids = torch.randint(0, VOCAB, (2, 9), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        expected = peft_model.eval()(input_ids=ids).logits
        got = converted.model.eval()(ids).logits
    assert (got - expected).abs().max().item() <= 1e-5
