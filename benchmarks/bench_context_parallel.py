"""Long sequences under context parallelism: one training step's tokens/s and per-rank memory, cp=1 against
cp=2 (ring attention), on the reference model (a Qwen3-shaped model, harness.PRESETS["reference"]).

Each (sequence length, cp) runs in its own torchrun launch of cp processes: one sequence of the given length
per step (batch 1), random token ids, the fused linear-cross-entropy loss (no [S, V] logits), AdamW. With cp=2
the sequence is split over the two ranks (load-balanced chunks, ``hfnative.parallel.context_parallel``) and
the parameters are sharded over them (FSDP2 over the cp ranks). Printed per run: tokens/s of the whole
sequence (timed steps after warm-up), and per rank the peak live heap during a step (glibc mallinfo2; on CUDA
torch.cuda.max_memory_allocated), the heap held before the step (weights, gradients, optimizer state) and
their difference, the step's activation memory; plus the loss of the first step (cp=2 must equal cp=1).

On CPU: fp32, gloo, the cores split between a run's processes (OMP_NUM_THREADS). On CUDA: bf16, NCCL, one
GPU per rank (the ring's blocks run the explicit-softmax kernel there).

    python benchmarks/bench_context_parallel.py                       # seq 4096 and 8192, cp 1 and 2
    python benchmarks/bench_context_parallel.py --seqs 1024 --steps 1 --warmup 1
    python benchmarks/bench_context_parallel.py --device cuda
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent


def build_model(folder: Path, seed: int = 0) -> None:
    import torch
    from transformers import AutoModelForCausalLM, Qwen3Config

    sys.path.insert(0, str(HERE))
    from harness import PRESETS

    shape = PRESETS["reference"]
    config = Qwen3Config(vocab_size=shape.vocab, hidden_size=shape.hidden, intermediate_size=shape.intermediate,
                         num_hidden_layers=shape.layers, num_attention_heads=shape.heads,
                         num_key_value_heads=shape.kv_heads, head_dim=shape.head_dim, max_position_embeddings=16384,
                         tie_word_embeddings=False)
    torch.manual_seed(seed)
    AutoModelForCausalLM.from_config(config).save_pretrained(str(folder))


def child(cli) -> None:
    """One rank: load, (parallelize), train ``warmup + steps`` steps on one sequence, write rank 0's result."""
    import torch
    import torch.distributed as dist

    sys.path.insert(0, str(HERE))
    from harness import HeapPeak, peak_rss_mib

    from hfnative.converters.loading import load_pretrained
    from hfnative.losses import shift_labels
    from hfnative.models.head import TokenCrossEntropy
    from hfnative.parallel import end_process_group

    cuda = cli.device == "cuda"
    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    device = torch.device(f"cuda:{int(os.environ.get('LOCAL_RANK', 0))}" if cuda else "cpu")
    if cuda:
        torch.cuda.set_device(device)
    model = load_pretrained(cli.model, dtype=torch.bfloat16 if cuda else torch.float32, device=device).model
    ids = torch.randint(0, model.args.vocab_size, (1, cli.seq), generator=torch.Generator().manual_seed(0))
    batch = dict(input_ids=ids, labels=ids.clone())
    if world > 1:
        from hfnative.parallel import parallelize
        from hfnative.parallel.context_parallel import split_batch
        from hfnative.parallel.dims import ParallelDims

        dist.init_process_group("nccl" if cuda else "gloo")
        dims = ParallelDims(dp_shard=1, cp=world, world_size=world)
        mesh = dims.build_mesh(device.type)
        parallelize(model, dims, mesh)
        batch = split_batch(batch, world, mesh["cp"].get_local_rank(), mesh["cp"].get_group())
    else:
        batch["shift_labels"] = shift_labels(batch["labels"])
        batch["position_ids"] = torch.arange(cli.seq)[None]
        batch["attention_plan"] = model.plan_attention(ids, None, batch["position_ids"], device=device)
    inputs = {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in batch.items()}
    label_tokens = cli.seq - 1
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)

    def step() -> float:
        out = model(inputs["input_ids"], position_ids=inputs["position_ids"], attention_plan=inputs["attention_plan"],
                    head_loss=TokenCrossEntropy(inputs["shift_labels"], fused=True))
        loss = out.head_output.loss_sum / label_tokens
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        value = loss.detach()
        if world > 1:
            dist.all_reduce(value)
        return value.item()

    first_loss = step()  # warm-up; also creates the optimizer state
    for _ in range(cli.warmup - 1):
        step()
    held = HeapPeak()
    held._sample() if held.available else None
    before_mib = held.peak_bytes / 2**20 if held.available else float("nan")
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats(device)
        before_mib = torch.cuda.memory_allocated(device) / 2**20
    times = []
    with HeapPeak() as heap:
        for _ in range(cli.steps):
            start = time.perf_counter()
            step()
            if cuda:
                torch.cuda.synchronize()
            times.append(time.perf_counter() - start)
    peak_mib = torch.cuda.max_memory_allocated(device) / 2**20 if cuda else (heap.peak_mib or float("nan"))
    mine = dict(rank=rank, peak_mib=peak_mib, before_mib=before_mib, activation_mib=peak_mib - before_mib,
                vmhwm_mib=peak_rss_mib(), step_seconds=times, threads=torch.get_num_threads())
    ranks = [mine]
    if world > 1:
        ranks = [None] * world
        dist.all_gather_object(ranks, mine)
    if rank == 0:
        seconds = sum(times) / len(times)
        Path(cli.out).write_text(json.dumps(dict(seq=cli.seq, cp=world, tokens_per_second=cli.seq / seconds,
                                                 step_seconds=seconds, first_loss=first_loss, ranks=ranks)))
    if world > 1:
        end_process_group()


def parent(cli) -> None:
    cores = len(os.sched_getaffinity(0))
    work = Path(tempfile.mkdtemp(prefix="bench_cp_"))
    model = work / "model"
    build_model(model)
    results = []
    for seq in cli.seqs:
        for cp in cli.cps:
            out = work / f"seq{seq}-cp{cp}.json"
            threads = cli.threads or max(1, cores // cp)
            env = dict(os.environ, OMP_NUM_THREADS=str(threads))
            command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(cp),
                       __file__, "--child", "--model", str(model), "--seq", str(seq), "--out", str(out),
                       "--steps", str(cli.steps), "--warmup", str(cli.warmup), "--device", cli.device]
            run = subprocess.run(command, env=env, capture_output=True, text=True, timeout=cli.timeout)
            if run.returncode != 0:
                print(f"seq {seq} cp {cp}: failed\n{run.stderr[-3000:]}")
                continue
            results.append(json.loads(out.read_text()))
            report(results[-1])
    summary(results)


def report(r: dict) -> None:
    per_rank = "; ".join(f"rank {x['rank']}: peak {x['peak_mib']:.0f} MiB, held {x['before_mib']:.0f}, "
                         f"activations {x['activation_mib']:.0f}, VmHWM {x['vmhwm_mib']:.0f}" for x in r["ranks"])
    print(f"seq {r['seq']:>5} cp {r['cp']}: {r['tokens_per_second']:8.1f} tokens/s ({r['step_seconds']:.2f} s/step, "
          f"{r['ranks'][0]['threads']} threads/rank), first loss {r['first_loss']:.6f} | {per_rank}", flush=True)


def summary(results: list[dict]) -> None:
    by = {(r["seq"], r["cp"]): r for r in results}
    for (seq, cp), r in sorted(by.items()):
        base = by.get((seq, 1))
        if cp == 1 or base is None:
            continue
        activations = max(x["activation_mib"] for x in r["ranks"]) / base["ranks"][0]["activation_mib"]
        peak = max(x["peak_mib"] for x in r["ranks"]) / base["ranks"][0]["peak_mib"]
        loss = abs(r["first_loss"] - base["first_loss"]) / abs(base["first_loss"])
        print(f"seq {seq}: cp {cp} / cp 1 — tokens/s x{r['tokens_per_second'] / base['tokens_per_second']:.2f}, "
              f"per-rank activation memory x{activations:.2f}, per-rank peak heap x{peak:.2f}, "
              f"first-step loss relative difference {loss:.1e}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seqs", type=int, nargs="+", default=[4096, 8192])
    parser.add_argument("--cps", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--steps", type=int, default=2, help="timed steps")
    parser.add_argument("--warmup", type=int, default=1, help="untimed steps first (at least 1)")
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--threads", type=int, default=0, help="OMP threads per rank (default: cores / cp)")
    parser.add_argument("--timeout", type=float, default=1800)
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--model", help=argparse.SUPPRESS)
    parser.add_argument("--seq", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    cli = parser.parse_args()
    if cli.warmup < 1:
        parser.error("--warmup must be at least 1 (the first step also builds the optimizer state)")
    child(cli) if cli.child else parent(cli)


if __name__ == "__main__":
    main()
