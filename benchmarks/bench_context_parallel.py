"""Long sequences under context parallelism: one training step's tokens/s and per-rank memory, cp=1 against
cp=2 (ring attention), on the reference model (a Qwen3-shaped model, harness.PRESETS["reference"]), for SFT,
DPO and GRPO (``--algorithm``).

Each (sequence length, cp) runs in its own torchrun launch of cp processes. Printed per run: tokens/s of the
whole sequence (timed steps after warm-up), and per rank the peak live heap during a step (glibc mallinfo2; on
CUDA torch.cuda.max_memory_allocated), the heap held before the step and their difference, the step's
activation memory; plus the loss of the first step (cp=2 must equal cp=1).

``--algorithm sft`` (default) measures a raw training step: one sequence of the given length per step (batch
1), random token ids, the fused linear-cross-entropy loss (no [S, V] logits), AdamW. With cp=2 the sequence is
split over the two ranks (load-balanced chunks, ``hfnative.parallel.context_parallel``) and the parameters are
sharded over them (FSDP2 over the cp ranks).

``--algorithm dpo`` and ``--algorithm grpo`` run the real trainers (hfnative.DPOTrainer, hfnative.GRPOTrainer,
``parallelism_config=dict(cp_size=cp)`` for cp > 1), AdamW, no activation checkpointing, fp32 on CPU:
  dpo:  one preference pair per step whose prompt + chosen and prompt + rejected are each exactly ``seq``
        tokens (text rows longer than that, cut by ``max_length=seq``); the reference model is a second
        reference-shaped model with other weights (``ref_model``), so the first step's loss is not log 2.
  grpo: one prompt of about ``seq - completion`` tokens per step, num_generations=2 sampled completions of at
        most ``--completion`` tokens (default 4: generation is kept cheap, a prefill and a few decode steps, and
        is not what is measured), a reward that differs between the two (the mean completion token id),
        beta=0.04 (the reference model's log-probs are computed too).
The step is measured by a callback from on_step_begin to on_step_end: the micro-batches are made by then (for
GRPO: generation, rewards and the reference log-probs), so the window is the forward / backward of the long
sequences and the optimizer step. For GRPO the peak of the whole step (from the objective's micro_batches call,
so generation and the reference forward included) is printed too. The first step's loss and grad norm are
the trainer's log (cp=2 must equal cp=1).

``--documents N`` (SFT) packs the sequence from N documents (position ids restarting at each): attention stays
within a document, and under cp > 1 the ring's blocks that a document boundary cuts are masked blocks.

On CPU: fp32, gloo, the cores split between a run's processes (OMP_NUM_THREADS). On CUDA: bf16, NCCL, one
GPU per rank (the ring's causal and full blocks run the CUDA flash kernel there, masked blocks the explicit
softmax; ``--algorithm sft`` only).

    python benchmarks/bench_context_parallel.py                       # SFT, seq 4096 and 8192, cp 1 and 2
    python benchmarks/bench_context_parallel.py --seqs 1024 --steps 1 --warmup 1
    python benchmarks/bench_context_parallel.py --algorithm dpo --seqs 8192 --steps 1 --warmup 1
    python benchmarks/bench_context_parallel.py --algorithm grpo --seqs 8192 --steps 1 --warmup 1
    python benchmarks/bench_context_parallel.py --seqs 16384 --documents 5  # packed: masked ring blocks
    python benchmarks/bench_context_parallel.py --device cuda
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
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
    from harness import TOKENIZER_DIR

    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):  # the trainers' processing_class
        shutil.copy(TOKENIZER_DIR / name, folder / name)


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
    positions = torch.arange(cli.seq)[None]
    if cli.documents > 1:  # packed: the position ids restart at each document (lengths 1, 2, 3, ... parts of seq)
        weights = torch.arange(1, cli.documents + 1, dtype=torch.float64)
        lengths = (weights / weights.sum() * cli.seq).long()
        lengths[-1] += cli.seq - lengths.sum()
        positions = torch.cat([torch.arange(n) for n in lengths.tolist()])[None]
        batch["position_ids"] = positions
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
        batch["position_ids"] = positions
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


def long_text(tokenizer, tokens: int, offset: int) -> str:
    """Text of at least ``tokens`` tokens: the corpus's documents (examples/data/sft_text.jsonl) from the
    ``offset``-th on, cycled."""
    from harness import CORPUS

    with open(CORPUS) as f:
        documents = [json.loads(line)["text"] for line in f]
    parts, count, index = [], 0, offset
    while count < tokens:
        text = documents[index % len(documents)]
        parts.append(text)
        count += len(tokenizer(text, add_special_tokens=False)["input_ids"]) + 1
        index += 1
    return "\n".join(parts)


def preference_rows(tokenizer, seq: int, count: int) -> list[dict]:
    """``count`` text pairs: a prompt of about 3/4 ``seq`` tokens, chosen and rejected of about ``seq / 2`` each
    (other texts), so prompt + either completion is longer than ``seq`` and DPO's ``max_length=seq`` cuts both to
    ``seq``."""
    return [dict(prompt=long_text(tokenizer, seq * 3 // 4, 7 * i), chosen=" " + long_text(tokenizer, seq // 2, 7 * i + 3),
                 rejected=" " + long_text(tokenizer, seq // 2, 7 * i + 5)) for i in range(count)]


def grpo_prompts(tokenizer, tokens: int, count: int) -> list[dict]:
    """``count`` text prompts, each the first ``tokens`` tokens of a long text (decoded, so about that many)."""
    rows = []
    for i in range(count):
        ids = tokenizer(long_text(tokenizer, tokens + 64, 7 * i), add_special_tokens=False)["input_ids"][:tokens]
        rows.append(dict(prompt=tokenizer.decode(ids)))
    return rows


def mean_token_id(completion_ids, **kwargs) -> list[float]:
    """A reward that tells two sampled completions apart (so the advantages are not zero)."""
    return [sum(ids) / max(len(ids), 1) / 32000 for ids in completion_ids]


def trainer_child(cli) -> None:
    """One rank of a DPO or GRPO run: the trainer for ``warmup + steps`` steps, the timed steps measured by a
    callback; rank 0 writes the result."""
    import torch
    import torch.distributed as dist
    from datasets import Dataset
    from transformers import AutoTokenizer, TrainerCallback

    sys.path.insert(0, str(HERE))
    from harness import heap_stats, peak_rss_mib

    import hfnative
    from hfnative.parallel import end_process_group

    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    tokenizer = AutoTokenizer.from_pretrained(cli.model)
    steps = cli.warmup + cli.steps
    common = dict(output_dir=str(Path(cli.out).with_suffix("")), use_cpu=True, bf16=False, report_to="none",
                  disable_tqdm=True, max_steps=steps, logging_steps=1, save_strategy="no", learning_rate=1e-4,
                  gradient_checkpointing=False, seed=0)
    if world > 1:
        common["parallelism_config"] = dict(cp_size=world)

    if cli.algorithm == "dpo":
        args = hfnative.DPOConfig(**common, per_device_train_batch_size=1, max_length=cli.seq, beta=0.1)
        trainer = hfnative.DPOTrainer(model=cli.model, ref_model=cli.ref_model, args=args, processing_class=tokenizer,
                                      train_dataset=Dataset.from_list(preference_rows(tokenizer, cli.seq, steps)))
    else:
        args = hfnative.GRPOConfig(**common, per_device_train_batch_size=2, num_generations=2,
                                   max_completion_length=cli.completion, beta=0.04)
        prompts = grpo_prompts(tokenizer, cli.seq - cli.completion, steps)
        trainer = hfnative.GRPOTrainer(model=cli.model, reward_funcs=[mean_token_id], args=args,
                                       processing_class=tokenizer, train_dataset=Dataset.from_list(prompts))

    class StepMemory(TrainerCallback):
        """Per timed step: the heap held at on_step_begin, the peak up to on_step_end (sampled on a thread), the
        peak from the objective's micro_batches call (the whole step), the step's seconds and token count."""

        def __init__(self):
            self.steps, self.peak, self.whole_peak, self.stop, self.thread = [], 0, 0, None, None

        def start_whole_step(self):
            import threading

            self.whole_peak = self.peak = heap_stats().in_use
            self.stop = threading.Event()
            self.thread = threading.Thread(target=self._sample, daemon=True)
            self.thread.start()

        def _sample(self):
            while not self.stop.wait(0.002):
                used = heap_stats().in_use
                self.whole_peak, self.peak = max(self.whole_peak, used), max(self.peak, used)

        def on_step_begin(self, args, state, control, **kwargs):
            self.held = self.peak = heap_stats().in_use
            self.started = time.perf_counter()

        def on_step_end(self, args, state, control, **kwargs):
            seconds = time.perf_counter() - self.started
            self.stop.set()
            self.thread.join()
            used = heap_stats().in_use
            self.whole_peak, self.peak = max(self.whole_peak, used), max(self.peak, used)
            self.steps.append(dict(held=self.held, peak=self.peak, whole_peak=self.whole_peak, seconds=seconds))

    memory = StepMemory()
    trainer.add_callback(memory)
    micro_batches = trainer.objective.micro_batches

    def measured_micro_batches(epoch_iterator, count):
        memory.start_whole_step()
        return micro_batches(epoch_iterator, count)

    trainer.objective.micro_batches = measured_micro_batches
    trainer.train()
    logs = [e for e in trainer.state.log_history if "loss" in e and "train_loss" not in e]
    timed = memory.steps[cli.warmup :]
    mib = 2**20
    peak = max(s["peak"] for s in timed) / mib
    held = timed[0]["held"] / mib
    mine = dict(rank=rank, peak_mib=peak, before_mib=held, activation_mib=peak - held,
                whole_step_peak_mib=max(s["whole_peak"] for s in timed) / mib, vmhwm_mib=peak_rss_mib(),
                step_seconds=[s["seconds"] for s in timed], threads=torch.get_num_threads())
    ranks = [mine]
    if world > 1:
        ranks = [None] * world
        dist.all_gather_object(ranks, mine)
    if rank == 0:
        seconds = sum(mine["step_seconds"]) / len(mine["step_seconds"])
        tokens = 2 * cli.seq  # two sequences per step: chosen + rejected, or the two completions of the prompt
        Path(cli.out).write_text(json.dumps(dict(
            algorithm=cli.algorithm, seq=cli.seq, cp=world, tokens_per_second=tokens / seconds, step_seconds=seconds,
            first_loss=logs[0]["loss"], first_grad_norm=logs[0].get("grad_norm"), first_log=logs[0], ranks=ranks)))
    end_process_group()


def parent(cli) -> None:
    cores = len(os.sched_getaffinity(0))
    work = Path(tempfile.mkdtemp(prefix="bench_cp_"))
    model = work / "model"
    build_model(model)
    extra = []
    if cli.algorithm == "dpo":  # a reference with other weights than the policy's
        build_model(work / "ref-model", seed=1)
        extra = ["--ref-model", str(work / "ref-model")]
    if cli.algorithm == "grpo":
        extra = ["--completion", str(cli.completion)]
    packed = f", {cli.documents} documents a sequence" if cli.documents > 1 else ""
    print(f"{cli.algorithm}: reference model, fp32, {cli.warmup} warm-up + {cli.steps} timed steps, {cores} cores"
          f"{packed}", flush=True)
    results = []
    for seq in cli.seqs:
        for cp in cli.cps:
            out = work / f"{cli.algorithm}-seq{seq}-cp{cp}.json"
            threads = cli.threads or max(1, cores // cp)
            env = dict(os.environ, OMP_NUM_THREADS=str(threads))
            command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(cp),
                       __file__, "--child", "--algorithm", cli.algorithm, "--model", str(model), "--seq", str(seq),
                       "--out", str(out), "--steps", str(cli.steps), "--warmup", str(cli.warmup), "--device",
                       cli.device, "--documents", str(cli.documents), *extra]
            load = " ".join(f"{x:.2f}" for x in os.getloadavg())
            print(f"seq {seq} cp {cp}: start {time.strftime('%H:%M:%S', time.gmtime())} UTC, load average {load}",
                  flush=True)
            run = subprocess.run(command, env=env, capture_output=True, text=True, timeout=cli.timeout)
            if run.returncode != 0:
                print(f"seq {seq} cp {cp}: failed\n{run.stderr[-3000:]}")
                continue
            results.append(json.loads(out.read_text()))
            report(results[-1])
    summary(results)


def report(r: dict) -> None:
    per_rank = "; ".join(f"rank {x['rank']}: peak {x['peak_mib']:.0f} MiB, held {x['before_mib']:.0f}, "
                         f"activations {x['activation_mib']:.0f}"
                         + (f", whole-step peak {x['whole_step_peak_mib']:.0f}" if "whole_step_peak_mib" in x else "")
                         + f", VmHWM {x['vmhwm_mib']:.0f}" for x in r["ranks"])
    grad = f", grad norm {r['first_grad_norm']:.6g}" if r.get("first_grad_norm") is not None else ""
    print(f"seq {r['seq']:>5} cp {r['cp']}: {r['tokens_per_second']:8.1f} tokens/s ({r['step_seconds']:.2f} s/step, "
          f"{r['ranks'][0]['threads']} threads/rank), first loss {r['first_loss']:.8g}{grad} | {per_rank}", flush=True)


def summary(results: list[dict]) -> None:
    by = {(r["seq"], r["cp"]): r for r in results}
    for (seq, cp), r in sorted(by.items()):
        base = by.get((seq, 1))
        if cp == 1 or base is None:
            continue
        activations = max(x["activation_mib"] for x in r["ranks"]) / base["ranks"][0]["activation_mib"]
        peak = max(x["peak_mib"] for x in r["ranks"]) / base["ranks"][0]["peak_mib"]
        loss = abs(r["first_loss"] - base["first_loss"])
        line = (f"seq {seq}: cp {cp} / cp 1 — tokens/s x{r['tokens_per_second'] / base['tokens_per_second']:.2f}, "
                f"per-rank activation memory x{activations:.2f}, per-rank peak heap x{peak:.2f}")
        if "whole_step_peak_mib" in base["ranks"][0]:
            whole = max(x["whole_step_peak_mib"] for x in r["ranks"]) / base["ranks"][0]["whole_step_peak_mib"]
            line += f", per-rank whole-step peak heap x{whole:.2f}"
        line += f", first-step loss difference {loss:.1e} absolute, {loss / abs(base['first_loss']):.1e} relative"
        if base.get("first_grad_norm") is not None and r.get("first_grad_norm") is not None:
            grad = abs(r["first_grad_norm"] - base["first_grad_norm"]) / abs(base["first_grad_norm"])
            line += f", grad norm {grad:.1e} relative"
        print(line, flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--algorithm", choices=("sft", "dpo", "grpo"), default="sft")
    parser.add_argument("--seqs", type=int, nargs="+", default=[4096, 8192])
    parser.add_argument("--cps", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--steps", type=int, default=2, help="timed steps")
    parser.add_argument("--warmup", type=int, default=1, help="untimed steps first (at least 1)")
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--threads", type=int, default=0, help="OMP threads per rank (default: cores / cp)")
    parser.add_argument("--completion", type=int, default=4, help="grpo: max_completion_length")
    parser.add_argument("--documents", type=int, default=1,
                        help="sft: the sequence packed from this many documents (lengths in the ratio 1 : 2 : ...)")
    parser.add_argument("--timeout", type=float, default=1800)
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--model", help=argparse.SUPPRESS)
    parser.add_argument("--seq", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    parser.add_argument("--ref-model", help=argparse.SUPPRESS)
    cli = parser.parse_args()
    if cli.warmup < 1:
        parser.error("--warmup must be at least 1 (the first step also builds the optimizer state)")
    if cli.algorithm != "sft" and cli.device != "cpu":
        parser.error("--algorithm dpo / grpo run on CPU only (--device cpu)")
    if not cli.child:
        parent(cli)
    elif cli.algorithm == "sft":
        child(cli)
    else:
        trainer_child(cli)


if __name__ == "__main__":
    main()
