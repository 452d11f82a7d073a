"""Distributed training on CPU with gloo, in real processes: FSDP2, HSDP, TP + sequence parallel with loss
parallel, FSDP2 x TP, each against the single-process run over the same global batches.

Two launches run side by side (tests/_parallel_worker.py: one of 4 processes, one of 2); every check below
reads what they measured. The oracle is always the single-process run (built and loaded by the ordinary
single-process path, trained by the same loop), computed inside the launch (each
reference run by one rank, written to disk and read by every rank).

Tolerances (fp32): losses and gradient norms 1e-5 relative (measured <= ~1e-6); weights loaded rank by rank
exactly equal. Final weights after 5 AdamW steps: AdamW divides each gradient entry by its own running
magnitude, so entries whose gradient is near zero turn fp32 round-off into visible differences; the
single-process run itself, with each step's gradient merely summed in another order (micro-batches), moves
its worst entry by up to ~1.5e-4 of the tensor's largest weight. Each layout's weights must stay within 10x
that measured round-off (and never need to be closer than 1e-5); a wrong reduction or a shard left
unchanged moves them by ~1e-1.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from _parallel_worker import LAYOUTS, PADDING_ID, VOCAB
from hf_configs import CONFIGS, save_hf_model
from transformers import AutoModelForCausalLM

from hfnative.models.args import ModelArgs
from hfnative.models.decoder import Transformer

ROOT = Path(__file__).resolve().parents[1]
WORKER = Path(__file__).with_name("_parallel_worker.py")
# one thread per process: 6 processes share the machine's cores; and the compiled layout compiles in its own process
# (no pool of compile workers, each another process importing torch)
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "TORCHINDUCTOR_COMPILE_THREADS": "1", "HF_HUB_OFFLINE": "1",
       "HF_DATASETS_OFFLINE": "1", "HF_HUB_DISABLE_TELEMETRY": "1", "TOKENIZERS_PARALLELISM": "false"}

TOLERANCE = 1e-5
WEIGHTS_OVER_ROUND_OFF = 10.0


def _save_models(models_dir: Path) -> None:
    save_hf_model("qwen3-gqa", models_dir / "untied")  # GQA, q/k norms, untied head
    save_hf_model("qwen3moe-topk-norm", models_dir / "moe")
    # tied head, q/k/v/o biases, a vocabulary that splits unevenly (95 rows) and a padding_idx the embedding honours
    config = CONFIGS["qwen3-mha-tied-bias"]()
    config.vocab_size, config.pad_token_id = VOCAB, PADDING_ID
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config, dtype=torch.float32).save_pretrained(str(models_dir / "tied"))


@pytest.fixture(scope="module")
def measured(tmp_path_factory) -> dict:
    """{world size: [each rank's results]} from one 4-process and one 2-process launch, run side by side."""
    base = tmp_path_factory.mktemp("parallel")
    _save_models(base / "models")
    started = time.perf_counter()
    launches = {
        world: subprocess.Popen(
            [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={world}", str(WORKER),
             str(base), str(base / "models")],
            cwd=ROOT, env=ENV, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        )
        for world in (4, 2)
    }
    for world, launch in launches.items():
        output, _ = launch.communicate(timeout=300)
        assert launch.returncode == 0, f"the {world}-process launch failed:\n{output[-6000:]}"
    print(f"\nparallel launches: {time.perf_counter() - started:.1f} s")
    return {
        world: [json.loads((base / f"world{world}-rank{rank}.json").read_text()) for rank in range(world)]
        for world in launches
    }


def _per_rank(measured, world: int, name: str) -> list[dict]:
    per_rank = [results[name] for results in measured[world]]
    for rank, result in enumerate(per_rank):
        assert "error" not in result, f"rank {rank}: {result['error']}"
    return per_rank


def _result(measured, world: int, name: str) -> dict:
    per_rank = _per_rank(measured, world, name)
    # every rank reports the same global numbers
    assert all(r["losses"] == per_rank[0]["losses"] for r in per_rank), [r["losses"] for r in per_rank]
    return per_rank[0]


LAYOUT_CASES = [(world, name) for world, layouts in LAYOUTS.items() for name, *_ in layouts if "bf16" not in name]


@pytest.mark.parametrize("world, name", LAYOUT_CASES, ids=[name for _, name in LAYOUT_CASES])
def test_layout_matches_single_process(measured, world, name):
    result = _result(measured, world, name)
    print(f"\n{name}: loss {result['loss']:.1e}, grad norm {result['grad_norm']:.1e}, weights {result['weights']:.1e} "
          f"(round-off {result['weights_round_off']:.1e}; worst {result['worst_weight']}), {result['seconds']} s")
    assert result["load_max_abs_diff"] == 0.0, "the sharded load differs from the single-process load"
    assert result["compute_dtype"] == "torch.float32"
    assert result["loss"] <= TOLERANCE, (result["losses"], result["reference_losses"])
    assert result["grad_norm"] <= TOLERANCE
    weights_tolerance = max(TOLERANCE, WEIGHTS_OVER_ROUND_OFF * result["weights_round_off"])
    assert result["weights"] <= weights_tolerance, result["worst_weight"]


def test_mixed_precision_computes_in_bf16(measured):
    """bf16 parameters for compute and fp32 gradient reduction: the forward runs in bf16, the losses stay
    close to the fp32 run's (bf16 keeps ~3 significant digits)."""
    result = _result(measured, 2, "FSDP2, bf16 parameters, fp32 reduction")
    assert result["compute_dtype"] == "torch.bfloat16"
    assert result["load_max_abs_diff"] == 0.0
    assert result["loss"] <= 1e-2, (result["losses"], result["reference_losses"])
    assert result["grad_norm"] <= 1e-1


def _assert_matches(rank: int, case: str, numbers: dict) -> None:
    """Pairs [got, expected] equal, flags true, every other number (a relative difference) within TOLERANCE."""
    for metric, value in numbers.items():
        if isinstance(value, list):
            assert value[0] == value[1], (rank, case, metric, value)
        elif isinstance(value, bool):
            assert value, (rank, case, metric)
        else:
            assert value <= TOLERANCE, (rank, case, metric, value)


def test_vocab_parallel_losses_match_the_fused_losses(measured):
    """Cross-entropy (on the label positions, and masked over every position), per-token log-probs with every token
    statistic, and the generalized JSD (beta 0, 0.5, 1) with the head split unevenly (95 rows over 4 ranks), with and without soft-caps and temperature: values, entropy, top-1
    hits (a tie across two ranks' rows included), statistics, and the gradients of the hidden states and weight."""
    per_rank = _per_rank(measured, 4, "vocab-parallel losses over 4 ranks")
    for rank, result in enumerate(per_rank):
        for case, numbers in result.items():
            if case != "seconds":
                _assert_matches(rank, case, numbers)
    cases = per_rank[0]
    assert sum(case.startswith("jsd beta=") for case in cases) == 6, list(cases)
    assert sum(case.startswith("ce masked") for case in cases) == 2, list(cases)  # the GPU policy's way under TP
    for case, numbers in cases.items():
        if case.startswith("logprobs"):
            # the tie is real: row 7 (rank 0) is the argmax of token 0, not row 60 (rank 2) of token 1
            assert numbers["is_top1_tie"][0] == [True, False], (case, numbers["is_top1_tie"])


def test_tensor_parallel_refuses_what_it_cannot_do_yet(measured):
    messages = _per_rank(measured, 2, "refusals under TP2")[0]
    assert "sequence length 15 is not divisible by tp=2" in messages["odd sequence length"]
    assert "OwnLoss is not a loss spec the tensor-parallel head can run" in messages["unknown loss spec"]


def test_head_losses_through_the_tensor_parallel_head_match_one_process(measured):
    """A TP2 model's head runs TokenLogprobs (every statistic, compact=True) and GeneralizedJSD (a tensor-parallel
    teacher, and a one-process teacher whose head rows are sliced) as one process does: outputs, zeros at ignored
    targets, and every parameter's gradient; the teacher gets none."""
    per_rank = _per_rank(measured, 2, "head losses through the TP2 head")
    for rank, result in enumerate(per_rank):
        assert {"TokenLogprobs statistics compact", "GeneralizedJSD, tensor-parallel teacher",
                "GeneralizedJSD, one-process teacher"} <= result.keys()
        for case, numbers in result.items():
            if case != "seconds":
                _assert_matches(rank, case, numbers)


def test_the_kept_bytes_estimate_is_what_a_tensor_parallel_lora_block_keeps(measured):
    """Selectively checkpointed under TP2 with LoRA on the query and value projections: each LoRA layer's base product
    (its up-projection ``addmm``'s addend only, a DTensor) is let go, and ``kept_bytes_per_token`` (which the GPU
    policy's default weighs against the free memory) equals the bytes a rank keeps, the adapter products whole on
    every rank; that default, given just enough memory beside the rank's own gradients (the split parameters' local
    shares) and the blocks' inputs, keeps the attention and projections."""
    for rank, result in enumerate(_per_rank(measured, 2, "kept bytes under TP2 with LoRA")):
        assert result["finite_loss"], rank
        assert result["let_go"] == result["lora_layers"] == 4, (rank, result)
        assert result["bytes"] == result["estimate"], (rank, result)
        assert result["default_keeps"] == ["attention_and_projections"], (rank, result)


# --- without processes: sizes and refusals ---------------------------------------------------------


def test_parallel_dims_sizes_and_errors():
    from hfnative.parallel import ParallelDims

    dims = ParallelDims(dp_replicate=2, tp=2, world_size=8)
    assert (dims.dp_replicate, dims.dp_shard, dims.tp) == (2, 2, 2)
    assert dims.dp_size == 4 and dims.fsdp_enabled and dims.hsdp_enabled and dims.tp_enabled and dims.dp_enabled
    only_tp = ParallelDims(tp=2, world_size=2)
    assert only_tp.dp_size == 1 and not only_tp.dp_enabled and not only_tp.fsdp_enabled
    with pytest.raises(ValueError, match=r"dp_replicate=2 x dp_shard=3 x tp=1 = 6, but the world size is 4"):
        ParallelDims(dp_replicate=2, dp_shard=3, world_size=4)
    with pytest.raises(ValueError, match=r"tp=3 = 3 does not divide the world size 4"):
        ParallelDims(tp=3, world_size=4)
    with pytest.raises(ValueError, match=r"tp=0"):
        ParallelDims(tp=0, world_size=2)


def _meta_model(**overrides) -> Transformer:
    args = dict(vocab_size=96, dim=32, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=8, intermediate_size=48)
    with torch.device("meta"):
        return Transformer(ModelArgs(**{**args, **overrides}))


def test_tensor_parallel_refuses_what_it_cannot_split():
    from hfnative.models.args import MoEArgs
    from hfnative.parallel import check_tensor_parallel

    check_tensor_parallel(_meta_model(), 2)
    with pytest.raises(ValueError, match=r"n_kv_heads=2 is not divisible by tp=4"):
        check_tensor_parallel(_meta_model(), 4)
    # mixture-of-experts layers route each rank's tokens (tests/test_expert_parallel.py trains them under TP2)
    check_tensor_parallel(_meta_model(moe=MoEArgs(num_experts=4, top_k=2, intermediate_size=16)), 2)
    with pytest.raises(ValueError, match=r"qk_norm_scope='projection'"):
        check_tensor_parallel(_meta_model(qk_norm=True, qk_norm_scope="projection"), 2)


@pytest.mark.parametrize("adapter, message", [
    (dict(), None),  # LoRA is split with its weights (tests/_distributed_train_worker.py's fsdp2xtp2-lora)
    (dict(use_dora=True), "a DoRA layer"),
    (dict(quantized=True), "a LoRA layer over a quantized base"),
    (dict(shared=True), "whose lora_A other layers share"),
    (dict(copy=True), r"modules_to_save \['embed_tokens'\]"),
])
def test_tensor_parallel_splits_lora_and_refuses_what_it_cannot(adapter, message):
    from hfnative.parallel import check_tensor_parallel
    from hfnative.peft import Int8Settings, quantize_base
    from hfnative.peft.adapters import LoraTarget, add_lora
    from hfnative.peft.settings import LoraSettings

    model = Transformer(ModelArgs(**{**dict(vars(_meta_model().args))}))  # on the host: DoRA's norm reads the weight
    if adapter.get("quantized"):
        quantize_base(model, Int8Settings(), ["layers.0.attention.wq"])
    add_lora(model, [LoraTarget(("layers.0.attention.wq",), 2, 4), LoraTarget(("layers.0.attention.wo",), 2, 4)],
             LoraSettings(r=2, lora_alpha=4, use_dora=adapter.get("use_dora", False)))
    if adapter.get("shared"):
        model.layers[0].attention.wo.lora_A = model.layers[0].attention.wq.lora_A
    if adapter.get("copy"):
        from hfnative.peft.adapters import add_trainable_copies

        add_trainable_copies(model, ["tok_embeddings.weight"])
    if message is None:
        check_tensor_parallel(model, 2)
        return
    with pytest.raises(ValueError, match=message):
        check_tensor_parallel(model, 2)
