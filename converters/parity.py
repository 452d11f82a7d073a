"""Logits parity between the native model and transformers on the same checkpoint.

``hfnative-parity --model_name_or_path DIR`` runs both on the same random tokens (a plain batch,
a left- and right-padded batch and a packed row) and prints max/mean absolute logit difference,
KL(transformers || native) and argmax agreement; it exits with status 1 past tolerance.
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass
class ParityReport:
    case: str
    max_abs_diff: float
    mean_abs_diff: float
    kl: float
    argmax_agreement: float

    def line(self) -> str:
        return (
            f"{self.case:<14} max|Δ|={self.max_abs_diff:.3e}  mean|Δ|={self.mean_abs_diff:.3e}  "
            f"KL={self.kl:.3e}  argmax agree={self.argmax_agreement:.4f}"
        )


def compare_logits(case: str, reference: torch.Tensor, native: torch.Tensor, valid: torch.Tensor) -> ParityReport:
    """Compare [B, S, V] logits at the positions where ``valid`` [B, S] is true."""
    ref, nat = reference[valid].double(), native[valid].double()
    diff = (ref - nat).abs()
    kl = F.kl_div(F.log_softmax(nat, -1), F.log_softmax(ref, -1), log_target=True, reduction="batchmean")
    agree = (ref.argmax(-1) == nat.argmax(-1)).double().mean()
    return ParityReport(case, diff.max().item(), diff.mean().item(), kl.item(), agree.item())


def parity_batches(vocab_size: int, batch: int, seq_len: int, seed: int = 0):
    """(case name, kwargs for both models, valid positions) for each input layout checked."""
    generator = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab_size, (batch, seq_len), generator=generator)
    yield "plain", dict(input_ids=ids), torch.ones_like(ids, dtype=torch.bool)
    lengths = torch.randint(seq_len // 2, seq_len + 1, (batch,), generator=generator)
    lengths[0] = seq_len
    right = (torch.arange(seq_len)[None] < lengths[:, None]).long()
    yield "right-padded", dict(input_ids=ids, attention_mask=right), right.bool()
    left = right.flip(-1)
    yield "left-padded", dict(input_ids=ids, attention_mask=left), left.bool()
    cut = [seq_len // 3, seq_len // 2, seq_len - seq_len // 3 - seq_len // 2]
    position_ids = torch.cat([torch.arange(n) for n in cut])[None]
    yield "packed", dict(input_ids=ids[:1], position_ids=position_ids), torch.ones_like(ids[:1], dtype=torch.bool)


def _reference_attention(config) -> str:
    """SDPA where transformers' model has it, else its eager attention (e.g. GPT-OSS's sinks)."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING

    model_class = MODEL_FOR_CAUSAL_LM_MAPPING.get(type(config), None)
    return "sdpa" if model_class is None or getattr(model_class, "_supports_sdpa", False) else "eager"


def _per_document_logits(reference, inputs) -> torch.Tensor:
    """Logits of a packed row [1, S], each document (positions restarting at 0) run separately."""
    positions = inputs["position_ids"][0]
    starts = [i for i in range(len(positions)) if positions[i] == 0] + [len(positions)]
    pieces = [
        reference(input_ids=inputs["input_ids"][:, a:b], use_cache=False).logits for a, b in zip(starts, starts[1:])
    ]
    return torch.cat(pieces, dim=1)


def run_parity(model_name_or_path: str, *, batch: int = 2, seq_len: int = 32, dtype: str = "float32", seed: int = 0):
    from transformers import AutoModelForCausalLM

    from .loading import load_pretrained

    torch_dtype = getattr(torch, dtype)
    converted = load_pretrained(model_name_or_path, dtype=torch_dtype)
    reference = AutoModelForCausalLM.from_pretrained(
        str(converted.source_dir), dtype=torch_dtype, attn_implementation=_reference_attention(converted.config)
    ).eval()
    native = converted.model.eval()
    reports = []
    with torch.no_grad():
        for case, inputs, valid in parity_batches(converted.args.vocab_size, batch, seq_len, seed):
            if case == "packed":  # the reference runs each document on its own: some transformers
                ref_logits = _per_document_logits(reference, inputs)  # models attend across them
            else:
                ref_logits = reference(**inputs, use_cache=False).logits
            nat_logits = native(inputs["input_ids"], inputs.get("attention_mask"), inputs.get("position_ids")).logits
            reports.append(compare_logits(case, ref_logits, nat_logits, valid))
    return reports


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="hfnative-parity",
        description="Compare hfnative's native model with transformers on the same checkpoint.",
    )
    parser.add_argument("--model_name_or_path", required=True, help="a model folder or a Hub repository id")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    parser.add_argument("--batch_size", type=int, default=2)
    parser.add_argument("--seq_len", type=int, default=32)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--atol", type=float, default=None, help="max |Δlogit| allowed (default 1e-4 fp32, 5e-2 otherwise)")
    args = parser.parse_args(argv)
    atol = args.atol if args.atol is not None else (1e-4 if args.dtype == "float32" else 5e-2)
    try:
        reports = run_parity(args.model_name_or_path, batch=args.batch_size, seq_len=args.seq_len, dtype=args.dtype, seed=args.seed)
    except (ValueError, FileNotFoundError) as err:
        print(f"hfnative-parity: {err}", file=sys.stderr)
        return 2
    for report in reports:
        print(report.line())
    worst = max(r.max_abs_diff for r in reports)
    ok = worst <= atol
    print(f"{'PASS' if ok else 'FAIL'}: worst max|Δ|={worst:.3e}, tolerance {atol:.1e}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
