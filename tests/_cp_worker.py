"""Context parallelism as ranks of a torchrun launch, for tests/test_context_parallel.py.

usage: torchrun --standalone --nproc_per_node N _cp_worker.py OUTPUT_DIR CHECK [CHECK ...]
CHECK "attention-cpN" (groups of N ranks): ring attention against SDPA over the whole sequence for causal,
sliding-window, packed and padded inputs, with each block kernel ("flash_cuda" through CPU kernels of the CUDA flash
ops' schema); rank 0 writes OUTPUT_DIR/attention-cpN.json. Any other CHECK is a
key of LAYOUTS: the SFTTrainer with that parallelism_config; rank 0 writes OUTPUT_DIR/LAYOUT/log.json and the
saved model in OUTPUT_DIR/LAYOUT/.
"""

import json
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from datasets import Dataset

ROOT = Path(__file__).resolve().parents[1]
MODEL = str(ROOT / "examples" / "tiny-qwen3")
STEPS = 5
PER_DEVICE = 2

# name -> (ParallelismConfig sizes, SFTConfig settings). max_length 61 / 45: not multiples of 2 x cp
LAYOUTS = {
    "cp2": (dict(cp_size=2, dp_shard_size=1), dict(max_length=61, eval_strategy="steps", eval_steps=5,
                                                   save_strategy="steps", save_steps=3)),
    "cp2-packed": (dict(cp_size=2, dp_shard_size=1), dict(packing=True, max_length=45)),
    "fsdp2xcp2": (dict(cp_size=2, dp_shard_size=2), dict(max_length=61)),
    "fsdp2xcp2-packed": (dict(cp_size=2, dp_shard_size=2), dict(packing=True, max_length=45)),
    "cp2xtp2-packed": (dict(cp_size=2, tp_size=2, dp_shard_size=1), dict(packing=True, max_length=45)),
}

# (name, batch of host tensors, sliding window)
def attention_cases():
    B, S = 2, 13
    packed = torch.tensor([[0, 1, 2, 3, 4, 0, 1, 2, 0, 1, 2, 3, 4], [0, 1, 2, 3, 4, 5, 6, 7, 8, 0, 1, 2, 3]])
    padded = torch.ones(B, S, dtype=torch.long)
    padded[1, 9:] = 0
    ids = torch.zeros(B, S, dtype=torch.long)
    return [
        ("causal", dict(input_ids=ids), None),
        ("sliding", dict(input_ids=ids), 4),
        ("packed", dict(input_ids=ids, position_ids=packed), None),
        ("packed-sliding", dict(input_ids=ids, position_ids=packed), 3),
        ("padded", dict(input_ids=ids, attention_mask=padded), None),
    ]


def reference_mask(batch: dict, S: int, window):
    """True = attend, [B, 1, S, S], written out here from the definitions (causal, window, documents, padding)."""
    i = torch.arange(S)
    allowed = (i[None, :] <= i[:, None])[None, None]
    if window is not None:
        allowed = allowed & (i[None, :] > i[:, None] - window)
    if "position_ids" in batch:
        pos = batch["position_ids"]
        doc = torch.cumsum(torch.cat([torch.ones_like(pos[:, :1]), (pos[:, 1:] != pos[:, :-1] + 1).long()], 1), 1)
        allowed = allowed & (doc[:, None, :, None] == doc[:, None, None, :])
    if "attention_mask" in batch:
        allowed = allowed & batch["attention_mask"].bool()[:, None, None, :]
    return allowed | torch.eye(S, dtype=torch.bool)


def cuda_flash_ops_on_cpu():
    """aten's CUDA flash attention ops (``_scaled_dot_product_flash_attention`` and its backward) given CPU kernels of
    their schema, the CPU flash kernel inside: the ring's "flash_cuda" blocks then call the very ops, with the very
    arguments, a GPU runs (its kernel itself is checked by benchmarks/gpu_checks.py attention)."""
    library = torch.library.Library("aten", "IMPL")

    def forward(q, k, v, dropout_p=0.0, is_causal=False, return_debug_mask=False, *, scale=None):
        assert dropout_p == 0.0 and not return_debug_mask
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, is_causal, scale=scale)
        empty = q.new_empty(0)
        return out, lse, empty, empty, q.shape[2], k.shape[2], torch.tensor([7, 0]), empty, empty

    def backward(grad_out, q, k, v, out, lse, cum_q, cum_k, max_q, max_k, dropout_p, is_causal, philox_seed,
                 philox_offset, *, scale=None):
        assert (max_q, max_k, dropout_p) == (q.shape[2], k.shape[2], 0.0) and philox_seed.tolist() == [7, 0]
        assert lse.dtype == torch.float32 or lse.dtype == q.dtype == torch.float64
        return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
            grad_out, q, k, v, out, lse, 0.0, is_causal, scale=scale)

    library.impl("_scaled_dot_product_flash_attention", forward, "CPU")
    library.impl("_scaled_dot_product_flash_attention_backward", backward, "CPU")
    return library


def check_attention(out_dir: Path, cp: int):
    rank, world = dist.get_rank(), dist.get_world_size()
    groups = [dist.new_group(list(range(r, r + cp))) for r in range(0, world, cp)]
    group, cp_rank = groups[rank // cp], rank % cp
    results = {}
    library = cuda_flash_ops_on_cpu()  # noqa: F841 (the kernels stay registered while it lives)
    for communication in ("ring", "all_gather"):
        for kernel in ("flash_cpu", "math", "flash_cuda"):
            for name, batch, window in attention_cases():
                key = f"{name}/{kernel}/{communication}"
                results[key] = attention_errors(batch, window, kernel, communication, group, cp, cp_rank)
    if rank == 0:
        (out_dir / f"attention-cp{cp}.json").write_text(json.dumps(results))


def attention_errors(batch, window, kernel, communication, group, cp, cp_rank) -> dict:
    """Largest differences of ring attention (this group of cp ranks) from SDPA over the whole sequence: output and the
    gradients of queries, keys and values, float64."""
    from hfnative.parallel.context_parallel import local_positions, split_batch

    B, S = batch["input_ids"].shape
    H, K, d, scale = 4, 2, 8, 0.3
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(B, n, S, d, generator=gen, dtype=torch.float64) for n in (H, K, K))
    grad = torch.randn(B, H, S, d, generator=gen, dtype=torch.float64)
    # reference: SDPA over the whole sequence, keys and values expanded for the query heads
    q_ref, k_ref, v_ref = (x.clone().requires_grad_() for x in (q, k, v))
    out_ref = F.scaled_dot_product_attention(q_ref, k_ref.repeat_interleave(2, 1), v_ref.repeat_interleave(2, 1),
                                             attn_mask=reference_mask(batch, S, window), scale=scale)
    real = batch["attention_mask"].bool() if "attention_mask" in batch else torch.ones(B, S, dtype=torch.bool)
    (out_ref * grad * real[:, None, :, None]).sum().backward()

    local = split_batch(batch, cp, cp_rank, group, sliding_window=window)
    seq_len = local["input_ids"].shape[1] * cp
    index = local_positions(seq_len, cp, cp_rank)

    def padded_local(x):
        full = torch.cat([x, torch.zeros(*x.shape[:2], seq_len - S, x.shape[3], dtype=x.dtype)], dim=2)
        return full[:, :, index]

    q_l, k_l, v_l = (padded_local(x).requires_grad_() for x in (q, k, v))
    plan = local["attention_plan"].context_parallel
    plan.kernel, plan.communication = kernel, communication
    out_l = plan.attend(q_l, k_l, v_l, window is not None, scale)
    real_l = torch.cat([real, torch.zeros(B, seq_len - S, dtype=torch.bool)], 1)[:, index]
    (out_l * padded_local(grad) * real_l[:, None, :, None]).sum().backward()

    def whole(x_local):  # every rank's positions put back in sequence order
        parts = [torch.empty_like(x_local) for _ in range(cp)]
        dist.all_gather(parts, x_local.contiguous(), group=group)
        full = torch.zeros(*x_local.shape[:2], seq_len, x_local.shape[3], dtype=x_local.dtype)
        for r, part in enumerate(parts):
            full[:, :, local_positions(seq_len, cp, r)] = part
        return full[:, :, :S]

    keep = real[:, None, :, None]
    return {
        "out": (whole(out_l.detach()) - out_ref.detach()).mul(keep).abs().max().item(),
        "dq": (whole(q_l.grad) - q_ref.grad).abs().max().item(),
        "dk": (whole(k_l.grad) - k_ref.grad).abs().max().item(),
        "dv": (whole(v_l.grad) - v_ref.grad).abs().max().item(),
        "scale": out_ref.abs().max().item(),
    }


def rows(n: int = 200) -> list[dict]:
    with open(ROOT / "examples" / "data" / "sft_prompt_completion.jsonl") as f:
        return [json.loads(line) for line, _ in zip(f, range(n))]


def datasets(extra: dict) -> dict:
    """The train dataset, and an eval dataset when the layout evaluates."""
    evaluation = {"eval_dataset": Dataset.from_list(rows(8))} if extra.get("eval_strategy") else {}
    return dict(train_dataset=Dataset.from_list(rows()), **evaluation)


def config(output_dir: str, per_device: int, **extra):
    from hfnative import SFTConfig

    settings = dict(
        output_dir=output_dir, use_cpu=True, bf16=False, report_to="none", disable_tqdm=True, max_steps=STEPS,
        logging_steps=1, save_strategy="no", per_device_train_batch_size=per_device, learning_rate=3e-3,
        lr_scheduler_type="cosine", warmup_steps=1, weight_decay=0.01, seed=7,
    )
    settings.update(extra)
    return SFTConfig(**settings)


def train_layout(out_dir: Path, name: str):
    from accelerate.parallelism_config import ParallelismConfig

    from hfnative import SFTTrainer

    sizes, extra = LAYOUTS[name]
    out = out_dir / name
    args = config(str(out), PER_DEVICE, parallelism_config=ParallelismConfig(**sizes), **extra)
    trainer = SFTTrainer(model=MODEL, args=args, **datasets(extra))
    trainer.train()
    trainer.save_model()
    if dist.get_rank() == 0:
        (out / "log.json").write_text(json.dumps(trainer.state.log_history))


def resume_cp2_under_fsdp2(run: Path) -> None:
    """The CP2 run in ``run`` (a copy of the launched one) resumed from its step-3 checkpoint under FSDP2 over 2
    ranks (each sequence whole, half the rows per rank: the same global batch); rank 0 writes resumed-log.json."""
    from accelerate.parallelism_config import ParallelismConfig

    from hfnative import SFTTrainer

    _, extra = LAYOUTS["cp2"]
    args = config(str(run), PER_DEVICE // 2, parallelism_config=ParallelismConfig(dp_shard_size=2), **extra)
    trainer = SFTTrainer(model=MODEL, args=args, **datasets(extra))
    trainer.train(resume_from_checkpoint=str(run / "checkpoint-3"))
    if dist.get_rank() == 0:
        (run / "resumed-log.json").write_text(json.dumps(trainer.state.log_history))


def main(out_dir: str, checks: list[str]) -> None:
    out = Path(out_dir)
    if checks == ["resume-cp2-under-fsdp2"]:
        resume_cp2_under_fsdp2(out)
        checks = []
    for check in checks:
        if check.startswith("attention-cp"):  # attention-cpN: groups of N ranks
            if not dist.is_initialized():
                dist.init_process_group("gloo")
            check_attention(out, int(check.removeprefix("attention-cp")))
        else:
            train_layout(out, check)
    from hfnative.parallel import end_process_group

    end_process_group()


if __name__ == "__main__":
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    main(sys.argv[1], sys.argv[2:])
