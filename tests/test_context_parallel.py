"""Context parallelism (ring attention) on CPU processes (gloo).

Ring attention over cp=2 and cp=4 ranks against SDPA over the whole sequence (float64: output and the query, key and
value gradients within 1e-12) for causal, sliding-window, packed and padded inputs with grouped-query heads, on
each block kernel (the CUDA flash ops through CPU kernels of their schema), with keys and values passed around the
ring (send/recv) and all-gathered; the explicit softmax a run of query rows at a time equals it whole. hfnative's SFTTrainer with cp=2 (2 processes), FSDP2 x cp=2 and cp=2 x TP2 (4 processes),
with and without packing, at lengths that are not multiples of 2 x cp, against one process over the same global batches:
5 steps whose losses, grad norms and logged metrics (and cp2's evaluation) agree within 1e-5 relative (fp32: the
gradients are summed over the ranks in another order), and final weights within 2e-4 (AdamW magnifies that
round-off where gradients are near zero; see tests/test_distributed_trainer.py).
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

import _cp_worker as worker
from hfnative import SFTTrainer

HERE = Path(__file__).resolve().parent


def _launch(out: Path, nproc: int, checks: list[str]) -> None:
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(HERE))
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(nproc),
               str(HERE / "_cp_worker.py"), str(out), *checks]
    result = subprocess.run(command, env=env, capture_output=True, text=True, timeout=900)
    assert result.returncode == 0, result.stderr[-6000:]


@pytest.fixture(scope="module")
def launched(tmp_path_factory):
    out = tmp_path_factory.mktemp("context_parallel")
    _launch(out, 2, ["attention-cp2", "cp2", "cp2-packed"])
    _launch(out, 4, ["attention-cp4", "fsdp2xcp2", "fsdp2xcp2-packed", "cp2xtp2-packed"])
    return out


@pytest.mark.parametrize("case", [name for name, _, _ in worker.attention_cases()])
@pytest.mark.parametrize("kernel", ["flash_cpu", "math", "flash_cuda"])
@pytest.mark.parametrize("communication", ["ring", "all_gather"])
@pytest.mark.parametrize("cp", [2, 4])
def test_ring_attention_matches_sdpa(launched, case, kernel, communication, cp):
    errors = json.loads((launched / f"attention-cp{cp}.json").read_text())[f"{case}/{kernel}/{communication}"]
    assert errors["scale"] > 0.5
    for name in ("out", "dq", "dk", "dv"):
        assert errors[name] < 1e-12, (case, kernel, communication, name, errors[name])


@pytest.mark.parametrize("layout", list(worker.LAYOUTS))
def test_layout_trains_like_one_process(launched, layout, tmp_path):
    sizes, extra = worker.LAYOUTS[layout]
    dp = sizes.get("dp_replicate_size", 1) * sizes.get("dp_shard_size", 1)
    args = worker.config(str(tmp_path / "reference"), worker.PER_DEVICE * dp, **extra)
    reference = SFTTrainer(model=worker.MODEL, args=args, **worker.datasets(extra))
    reference.train()
    reference.save_model()
    steps = [e for e in json.loads((launched / layout / "log.json").read_text()) if "loss" in e]
    expected = [e for e in reference.state.log_history if "loss" in e]
    assert len(steps) == len(expected) == worker.STEPS
    for mine, theirs in zip(steps, expected):
        for key in ("loss", "grad_norm", "learning_rate", "mean_token_accuracy", "entropy", "num_tokens"):
            assert mine[key] == pytest.approx(theirs[key], rel=1e-5), (layout, theirs["step"], key)
    evaluations = [e for e in json.loads((launched / layout / "log.json").read_text()) if "eval_loss" in e]
    expected = [e for e in reference.state.log_history if "eval_loss" in e]
    assert len(evaluations) == len(expected) == (1 if "eval_strategy" in extra else 0)
    for mine, theirs in zip(evaluations, expected):
        for key in ("eval_loss", "eval_entropy", "eval_mean_token_accuracy"):
            assert mine[key] == pytest.approx(theirs[key], rel=1e-5), (layout, key)
    weights = load_file(str(launched / layout / "model.safetensors"))
    reference_weights = load_file(str(tmp_path / "reference" / "model.safetensors"))
    assert set(weights) == set(reference_weights)
    for key, value in reference_weights.items():
        torch.testing.assert_close(weights[key], value, rtol=0, atol=2e-4, msg=key)


def test_checkpoint_resumes_on_one_process(launched, tmp_path):
    """The CP2 run's step-3 checkpoint (training_state/ written by both cp ranks) resumed on one process: steps 4 and
    5 (and the step-5 evaluation) equal the launched run's (1e-5)."""
    import shutil

    sizes, extra = worker.LAYOUTS["cp2"]
    run = tmp_path / "cp2"
    shutil.copytree(launched / "cp2", run)
    assert (run / "checkpoint-3" / "training_state").is_dir()
    resumed = SFTTrainer(model=worker.MODEL, args=worker.config(str(run), worker.PER_DEVICE, **extra),
                         **worker.datasets(extra))
    with pytest.warns(UserWarning, match="is loaded by 1"):
        resumed.train(resume_from_checkpoint=str(run / "checkpoint-3"))
    launched_log = json.loads((launched / "cp2" / "log.json").read_text())
    for key_name, keys in (("loss", ("loss", "grad_norm", "learning_rate")), ("eval_loss", ("eval_loss",))):
        want = {e["step"]: e for e in launched_log if key_name in e and e["step"] > 3}
        got = {e["step"]: e for e in resumed.state.log_history if key_name in e and e["step"] > 3}
        assert sorted(got) == sorted(want) and want, key_name
        for step, entry in got.items():
            for key in keys:
                assert entry[key] == pytest.approx(want[step][key], rel=1e-5), (step, key)


def test_checkpoint_resumes_under_fsdp2(launched, tmp_path):
    """The CP2 run's step-3 checkpoint resumed under FSDP2 on 2 processes (sequences whole, rows split): steps 4 and 5
    and the step-5 evaluation equal the launched run's (1e-5)."""
    import shutil

    run = tmp_path / "cp2"
    shutil.copytree(launched / "cp2", run)
    _launch(run, 2, ["resume-cp2-under-fsdp2"])
    launched_log = json.loads((launched / "cp2" / "log.json").read_text())
    resumed_log = json.loads((run / "resumed-log.json").read_text())
    for key_name, keys in (("loss", ("loss", "grad_norm", "learning_rate")), ("eval_loss", ("eval_loss",))):
        want = {e["step"]: e for e in launched_log if key_name in e and e["step"] > 3}
        got = {e["step"]: e for e in resumed_log if key_name in e and e["step"] > 3}
        assert sorted(got) == sorted(want) and want, key_name
        for step, entry in got.items():
            for key in keys:
                assert entry[key] == pytest.approx(want[step][key], rel=1e-5), (step, key)


# --- pieces, in one process ----------------------------------------------------------------------------


def test_split_is_load_balanced_and_padding_carries_no_label():
    from hfnative.losses import IGNORE_INDEX, shift_labels
    from hfnative.parallel.context_parallel import local_positions, split_batch

    ids = torch.arange(2 * 11).view(2, 11)
    labels = ids.clone()
    labels[0, :3] = IGNORE_INDEX
    batch = dict(input_ids=ids, labels=labels)
    parts = [split_batch(batch, 2, rank, group=None) for rank in range(2)]
    assert [p["input_ids"].shape for p in parts] == [(2, 6), (2, 6)]  # 11 padded to 12, 2 chunks of 3 per rank
    assert local_positions(12, 2, 0).tolist() == [0, 1, 2, 9, 10, 11]
    assert local_positions(12, 2, 1).tolist() == [3, 4, 5, 6, 7, 8]
    whole = {key: torch.zeros(2, 12, dtype=torch.long) for key in ("shift_labels", "position_ids", "attention_mask")}
    for rank, part in enumerate(parts):
        for key in whole:
            whole[key][:, local_positions(12, 2, rank)] = part[key]
    expected = torch.cat([shift_labels(labels), torch.full((2, 1), IGNORE_INDEX)], 1)
    assert torch.equal(whole["shift_labels"], expected)  # shifted over the whole sequence; the padding has no label
    assert torch.equal(whole["position_ids"], torch.arange(12).expand(2, 12))  # rotary sees unsplit positions
    assert whole["attention_mask"][:, :11].all() and not whole["attention_mask"][:, 11].any()


def test_sizes_are_validated(tmp_path):
    from accelerate.parallelism_config import ParallelismConfig

    from hfnative.parallel.dims import ParallelDims
    from hfnative.trainers.running.parallel_plan import resolve_parallel_plan

    dims = ParallelDims(dp_shard=-1, cp=2, world_size=8)
    assert (dims.dp_shard, dims.shape) == (4, (1, 4, 2, 1))
    assert dims.mesh_dim_names == ("dp_replicate", "dp_shard", "cp", "tp")
    with pytest.raises(ValueError, match=r"dp_replicate=1 x dp_shard=1 x cp=2 x tp=1 = 2, but the world size is 4"):
        ParallelDims(dp_shard=1, cp=2, world_size=4)
    args = worker.config(str(tmp_path), 1, parallelism_config=ParallelismConfig(dp_shard_size=2, cp_size=2))
    plan = resolve_parallel_plan(args, 4)
    assert (plan.dims.dp_shard, plan.dims.cp) == (2, 2) and "2-way context parallel" in plan.describe()
    with pytest.raises(ValueError, match=r"cp_size=2 = 4, but 2 processes were launched"):
        resolve_parallel_plan(args, 2)


@pytest.mark.parametrize("kind", ["causal", "full", "masked"])
def test_the_explicit_softmax_takes_query_rows_a_run_at_a_time(monkeypatch, kind):
    """A block's explicit softmax (masked blocks on CUDA, float32) with its scores made a few query rows at a time
    (here 5 of 12 per run, as a long chunk would be) equals the CPU flash kernel on the whole block: output,
    log-sum-exp and the q, k, v gradients (float64)."""
    from hfnative.parallel import ring_blocks as cp

    B, H, c, d, scale = 2, 3, 12, 8, 0.4
    generator = torch.Generator().manual_seed(3)
    q, k, v, grad = (torch.randn(B, H, c, d, generator=generator, dtype=torch.float64) for _ in range(4))
    mask = has_key = None
    if kind == "masked":  # query chunk 1 over key chunk 0: documents, padding and a window cut in
        doc_q, doc_k = (torch.randint(0, 3, (B, c), generator=generator) for _ in range(2))
        doc_q[0, 4] = 7  # a query whose document has no key in this block
        real_k = torch.rand(B, c, generator=generator) < 0.8
        mask = cp.BlockMask(1, 0, c, window=16, doc_q=doc_q, doc_k=doc_k, real_k=real_k)
        has_key = mask.allowed().any(-1)
        assert not has_key[0, 0, 4] and has_key.sum() > B * c // 2
    whole = cp.block_forward(q, k, v, kind, mask, has_key, scale, "flash_cpu")
    monkeypatch.setattr(cp, "_MATH_SCORE_ELEMENTS", B * H * c * 5)
    assert len(cp._row_chunks(q, k)) == 3
    runs = cp.block_forward(q, k, v, kind, mask, has_key, scale, "math")
    torch.testing.assert_close(runs[0], whole[0], rtol=0, atol=1e-12)
    torch.testing.assert_close(runs[1], whole[1], rtol=0, atol=1e-12)  # -inf where a row sees no key, in both
    # backward gets the merged rows' log-sum-exp, finite (every query sees itself in its diagonal block): here as if
    # another block held as much probability mass as this one's largest row
    out, lse = whole[0], torch.logaddexp(whole[1], whole[1].max())
    expected = cp.block_backward(grad, q, k, v, out, lse, kind, mask, scale, "flash_cpu")
    got = cp.block_backward(grad, q, k, v, out, lse, kind, mask, scale, "math")
    for mine, theirs in zip(got, expected):
        torch.testing.assert_close(mine, theirs, rtol=0, atol=1e-12)


@pytest.mark.parametrize("diagonal", [True, False], ids=["diagonal", "earlier-keys"])
def test_a_packed_block_runs_the_cuda_flash_kernel_a_document_at_a_time(diagonal):
    """A masked block of packed documents (no window, no padding key) under the CUDA flash kernel: one kernel call per
    document's segment (causal on the diagonal, whole on earlier keys), through CPU kernels of the CUDA ops' schema;
    equal to the CPU flash kernel on the whole masked block (float64): output, log-sum-exp (-inf where a query's
    document has no key in the block) and the q, k, v gradients. A padding key leaves the block to the explicit
    softmax."""
    from _cp_worker import cuda_flash_ops_on_cpu

    from hfnative.parallel import ring_blocks as cp

    B, H, c, d, scale = 2, 3, 12, 8, 0.4
    generator = torch.Generator().manual_seed(4)
    q, k, v, grad = (torch.randn(B, H, c, d, generator=generator, dtype=torch.float64) for _ in range(4))
    # packed rows: documents are runs of positions; off the diagonal the keys' chunk comes earlier in the row
    doc_q = torch.tensor([[0] * 5 + [1] * 4 + [2] * 3, [3] * 12])
    doc_k = doc_q if diagonal else torch.tensor([[7] * 4 + [0] * 8, [2] * 6 + [3] * 6])
    mask = cp.BlockMask(1, 1 if diagonal else 0, c, doc_q=doc_q, doc_k=doc_k, real_k=torch.ones(B, c, dtype=torch.bool))
    mask.segments = mask.document_segments()
    assert mask.segments == ((((0, 0, 5, 0, 5), (0, 5, 9, 5, 9), (0, 9, 12, 9, 12), (1, 0, 12, 0, 12))) if diagonal
                             else ((0, 0, 5, 4, 12), (1, 0, 12, 6, 12)))
    has_key = mask.allowed().any(-1)
    assert cp.block_kernel(q, "masked", "flash_cuda", mask) == "flash_cuda_segments"
    library = cuda_flash_ops_on_cpu()
    try:
        got = cp.block_forward(q, k, v, "masked", mask, has_key, scale, "flash_cuda")
        want = cp.block_forward(q, k, v, "masked", mask, has_key, scale, "flash_cpu")
        assert torch.isinf(want[1]).any() != diagonal  # rows with no key off the diagonal (documents 1 and 2)
        torch.testing.assert_close(got[0], want[0], rtol=0, atol=1e-12)
        torch.testing.assert_close(got[1], want[1], rtol=0, atol=1e-12)
        lse = torch.logaddexp(want[1], want[1][torch.isfinite(want[1])].max())  # merged rows: finite
        mine = cp.block_backward(grad, q, k, v, want[0], lse, "masked", mask, scale, "flash_cuda", got[2])
        theirs = cp.block_backward(grad, q, k, v, want[0], lse, "masked", mask, scale, "flash_cpu")
        for a, b in zip(mine, theirs):
            torch.testing.assert_close(a, b, rtol=0, atol=1e-12)
    finally:
        library._destroy()
    padded = cp.BlockMask(1, 0, c, doc_q=doc_q, doc_k=doc_k, real_k=torch.arange(c).expand(B, c) < 10)
    padded.segments = padded.document_segments()
    assert padded.segments is None and cp.block_kernel(q, "masked", "flash_cuda", padded) == "math"
