"""The device work of one training step's forward and backward, counted on a CPU: how many kernels a GPU would run
outside the matmuls and attention, and how many bytes they read and write (each op's tensors, inputs and outputs).
At the Qwen3-0.6B shape these kernels are bound by memory bandwidth and took most of a GPU step's device time
(benchmarks/gpu_results/2026-12-04-prof-*.txt): fewer of them, moving fewer bytes, is what the GPU policy's Triton
kernels buy. A count, not a timing: the GPU measures the time (``gpu_checks.py kernels``, ``bench_sft.py`` on CUDA).

    TRITON_INTERPRET=1 PYTHONPATH=.triton-cpu python benchmarks/bench_kernel_traffic.py

Runners, each on the same blocks (Qwen3-0.6B's width: hidden 1,024, 16 query and 8 key/value heads of 128, MLP
3,072) under CPU bf16 autocast (as ``bf16=True``), batch x seq tokens, a small vocabulary so the blocks dominate:
- ``transformers``: transformers' Qwen3ForCausalLM (TRL's model), its loss on materialized logits;
- ``ours:torch_kernels``: hfnative's model under the GPU policy with ``HFNATIVE_TRITON_KERNELS=0``;
- ``ours``: the same with the Triton kernels (run by Triton's interpreter here; needs Triton importable and
  ``TRITON_INTERPRET=1``, else the runner is skipped, saying why).
Each op is counted by a dispatch mode: views and allocations launch no kernel and are not counted; a Triton launch
counts once with the bytes of its tensor arguments. With ``--checkpointing`` every block is checkpointed (the GPU
policy's selective checkpointing; transformers' full checkpointing, TRL's default). With ``--lora`` every linear layer
of the blocks carries a LoRA adapter (``harness.LORA``: peft's ``get_peft_model`` on transformers' model, hfnative's
``apply_lora`` on ours) and only the adapters train; ``--weights bf16`` loads the frozen weights in bf16, as a Hub
checkpoint stored in bf16 loads (the adapters stay float32, as peft makes them); ``--quantize int8|nf4`` stores the
frozen base as ``load_in_8bit`` / ``load_in_4bit`` do (NF4 computed in ``--weights``' dtype; hfnative's runners only:
transformers' quantized base is bitsandbytes', whose kernels are CUDA's), and adds ``ours:torch_dequantize``: the
Triton kernels except the quantized weights', made whole by torch's ops. "kept MB" is what a forward
leaves allocated for its backward (the activations, a step's memory beyond the weights and optimizer), per block
(the head's included), from glibc's allocation counters in a step run without the counting mode.

``--decode``: instead of a training step, one greedy decode step of the native rollout engine (``ours:torch_kernels``
and ``ours``; the kernels of a call of 12 new tokens minus those of a call of 4, over 8), batch ``--batch``: every
kernel it launches (a CUDA graph replays them all; at batch 64 a GPU spends a few microseconds on each whatever its
size, so their count, not their bytes, sets the step's time). ``--weights bf16``: a model loaded in bf16 (its norms and
rotary tables too); ``fp32``: fp32 weights decoded under bf16 autocast, as the trainers' rollouts run.
``--stack_projections``: bf16 weights decoded as a CUDA device with the memory decodes them by default (the q/k/v and
gate/up weights copied into one stack each, one matmul each). ``--fold_adapters`` (with ``--lora``): the LoRA layers
decoded over their folded weights (``W + s B A`` made once a call), what the engine does by default on a GPU with the
memory (with fp32 weights at no memory cost).

    TRITON_INTERPRET=1 PYTHONPATH=.triton-cpu python benchmarks/bench_kernel_traffic.py --decode --weights bf16 --batch 8
"""

from __future__ import annotations

import argparse
import os
import tempfile
from collections import Counter

import torch
from torch.utils._python_dispatch import TorchDispatchMode, _disable_current_modes

aten = torch.ops.aten
MATMUL = {"mm", "addmm", "bmm", "baddbmm", "_grouped_mm"}
ATTENTION_PREFIXES = ("_scaled_dot_product", "_flash_attention", "_efficient_attention")
NO_KERNEL = {"empty", "empty_like", "empty_strided", "new_empty", "new_empty_strided", "detach", "alias", "lift_fresh",
             "set_", "resize_", "_unsafe_view", "promote_types", "result_type", "_local_scalar_dense"}


def _tensors(tree):
    return [t for t in torch.utils._pytree.tree_leaves(tree) if isinstance(t, torch.Tensor)]


def _bytes(tensors) -> int:
    seen, total = set(), 0
    for tensor in tensors:
        key = (tensor.untyped_storage().data_ptr(), tensor.storage_offset(), tuple(tensor.shape), tensor.dtype)
        if key in seen:
            continue
        seen.add(key)
        # a broadcast view (stride 0) reads its storage, not its numel
        total += min(tensor.numel() * tensor.element_size(), tensor.untyped_storage().nbytes())
    return total


class Traffic(TorchDispatchMode):
    """Counts kernels and their bytes by kind: matmul, attention, other (elementwise, reductions, copies)."""

    def __init__(self):
        super().__init__()
        self.kernels, self.bytes, self.names = Counter(), Counter(), Counter()

    def add(self, kind: str, name: str, tensors) -> None:
        self.kernels[kind] += 1
        self.bytes[kind] += _bytes(tensors)
        if kind == "other":
            self.names[name] += 1

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        name = func.overloadpacket.__name__
        if func.is_view or name in NO_KERNEL:
            return out
        kind = "matmul" if name in MATMUL else ("attention" if name.startswith(ATTENTION_PREFIXES) else "other")
        self.add(kind, name, _tensors((args, kwargs)) + _tensors(out))
        return out


class _CountedLaunch:
    """A Triton kernel whose launches a Traffic counts (kind "other", its tensor arguments' bytes)."""

    def __init__(self, kernel, name: str, traffic: list):
        self.kernel, self.name, self.traffic = kernel, name, traffic

    def __getitem__(self, grid):
        launch = self.kernel[grid]

        def counted(*args, **kwargs):
            if self.traffic:
                self.traffic[-1].add("other", f"triton:{self.name}", _tensors((args, kwargs)))
            with _disable_current_modes():  # the interpreter's own copies are not the kernel's work
                return launch(*args, **kwargs)

        return counted


def _shape_config(cli):
    from transformers import Qwen3Config

    return Qwen3Config(vocab_size=cli.vocab, hidden_size=1024, intermediate_size=3072, num_hidden_layers=cli.layers,
                       num_attention_heads=16, num_key_value_heads=8, head_dim=128, max_position_embeddings=4096,
                       tie_word_embeddings=True)


def _count(model_step, traffic_stack: list) -> Traffic:
    model_step()  # a first step: lazy work (kernels built, buffers made) is not counted
    traffic = Traffic()
    traffic_stack.append(traffic)
    try:
        with traffic:
            model_step()
    finally:
        traffic_stack.pop()
    return traffic


def traffic_stack_for_kernels() -> list:
    """The stack of counting modes the Triton kernels' launches report to (each launch counts in the innermost)."""
    from hfnative.models import triton_kernels

    traffic_stack: list[Traffic] = []
    kernels = triton_kernels._kernels()
    if kernels is not None and not isinstance(kernels.rms_norm_forward, _CountedLaunch):  # count each launch
        counted = kernels._replace(**{name: _CountedLaunch(getattr(kernels, name), name, traffic_stack)
                                      for name in triton_kernels.KERNEL_NAMES})
        triton_kernels._kernels = lambda: counted  # noqa: E731 (this process only)
    return traffic_stack


def decode_main(cli, native, traffic_stack: list) -> None:
    """``--decode``: the kernels of one decode step of ``NativeRolloutEngine``, with and without the Triton kernels."""
    from hfnative.device_policy import use_device_policy
    from hfnative.generation.native import NativeRolloutEngine
    from hfnative.generation.sampling import SamplingParams
    from hfnative.models import triton_kernels

    generator = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, cli.vocab, (16 + 3 * row,), generator=generator).tolist() for row in range(cli.batch)]
    short, long = 4, 12
    runners = {"ours:torch_kernels": "0"}
    if os.environ.get("TRITON_INTERPRET") == "1" and triton_kernels.available():
        runners["ours"] = "1"
    else:
        print("ours: skipped (Triton's kernels run on a CPU only under its interpreter: set TRITON_INTERPRET=1)")
    autocast = cli.weights == "fp32"
    print(f"# one greedy decode step of the native engine, {cli.layers} Qwen3-0.6B-wide blocks, batch {cli.batch}, "
          f"vocab {cli.vocab}, {cli.weights} weights{', bf16 autocast' if autocast else ''} (the kernels of "
          f"{long} new tokens minus those of {short}, over {long - short})")
    print(f"{'runner':<20} {'kernels':>8} {'matmul':>7} {'attention':>10} {'other':>6} {'other MB':>9}")
    for name, switch in [(n, s) for n, s in runners.items() if n in cli.runners.split(",")]:
        os.environ[triton_kernels.ENV_SWITCH] = switch
        engine = NativeRolloutEngine(native, stack_projections=cli.stack_projections or None,
                                     fold_adapters=cli.fold_adapters or None)

        def generate(tokens: int, engine=engine):
            with use_device_policy("gpu"), torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
                engine.generate(prompts, SamplingParams(max_new_tokens=tokens, do_sample=False))

        counts = {tokens: _count(lambda tokens=tokens: generate(tokens), traffic_stack) for tokens in (short, long)}
        step = {kind: (counts[long].kernels[kind] - counts[short].kernels[kind]) / (long - short)
                for kind in ("matmul", "attention", "other")}
        total = sum(step.values())
        other_mb = (counts[long].bytes["other"] - counts[short].bytes["other"]) / (long - short) / 2**20
        # (a block's share: the difference between runs with two --layers, over their difference)
        print(f"{name:<20} {total:>8.0f} {step['matmul']:>7.0f} {step['attention']:>10.0f} {step['other']:>6.0f} "
              f"{other_mb:>9.2f}")
        names = counts[long].names - counts[short].names
        top = ", ".join(f"{op} {count / (long - short):g}" for op, count in names.most_common(cli.top))
        print(f"{name} most frequent other kernels a step: {top}")


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--seq", type=int, default=512)
    parser.add_argument("--vocab", type=int, default=1024)
    parser.add_argument("--checkpointing", action="store_true", help="every block checkpointed")
    parser.add_argument("--lora", action="store_true",
                        help="LoRA adapters on every linear layer (harness.LORA), the rest frozen")
    parser.add_argument("--weights", choices=("fp32", "bf16"), default="fp32", help="the dtype the weights load in")
    parser.add_argument("--quantize", choices=("int8", "nf4"), default=None,
                        help="with --lora: the frozen base quantized as load_in_8bit / load_in_4bit quantize it "
                             "(NF4 in --weights' dtype, bnb_4bit_compute_dtype); hfnative's runners only")
    parser.add_argument("--top", type=int, default=8, help="the most frequent other kernels of each runner")
    parser.add_argument("--runners", default="transformers,ours:torch_kernels,ours:torch_dequantize,ours",
                        help="comma-separated from transformers, ours:torch_kernels, ours:torch_dequantize (with --quantize), ours")
    parser.add_argument("--decode", action="store_true", help="one decode step of the native engine (see above)")
    parser.add_argument("--stack_projections", action="store_true",
                        help="--decode: the engine's stack_projections=True, what it does by default on a GPU with "
                             "the memory (bf16 weights: q/k/v and gate/up stacked into one matmul each)")
    parser.add_argument("--fold_adapters", action="store_true",
                        help="--decode --lora: the engine's fold_adapters=True, what it does by default on a GPU with "
                             "the memory (each LoRA layer one matmul over W + s B A)")
    cli = parser.parse_args(argv)
    if cli.fold_adapters and not (cli.decode and cli.lora):
        parser.error("--fold_adapters needs --decode and --lora")
    torch.manual_seed(0)

    import transformers

    from hfnative.allocator import heap_stats
    from hfnative.converters.loading import load_pretrained
    from hfnative.device_policy import use_device_policy
    from hfnative.models import triton_dequant, triton_kernels
    from hfnative.parallel.activation_checkpoint import apply_activation_checkpointing

    reference = transformers.AutoModelForCausalLM.from_config(_shape_config(cli), attn_implementation="sdpa")
    dtype = torch.bfloat16 if cli.weights == "bf16" else torch.float32
    with tempfile.TemporaryDirectory() as folder:
        reference.save_pretrained(folder)
        converted = load_pretrained(folder, dtype=dtype)
        reference = reference.to(dtype)
    if cli.lora:
        import peft
        from harness import LORA

        from hfnative.converters.peft import apply_lora

        reference = peft.get_peft_model(reference, peft.LoraConfig(**LORA))
        quantized = {"int8": {"load_in_8bit": True},
                     "nf4": {"load_in_4bit": True, "quantization_config": {"bnb_4bit_compute_dtype": dtype}}}
        apply_lora(converted, LORA, **quantized.get(cli.quantize, {}))
    elif cli.quantize:
        parser.error("--quantize needs --lora (a quantized base trains through its adapters)")
    native = converted.model
    if cli.decode:
        return decode_main(cli, native, traffic_stack_for_kernels())
    reference.train()
    if cli.checkpointing:
        # as TRL turns it on (transformers 5.25 also names it activation_checkpointing_enable, with other keywords)
        reference.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        apply_activation_checkpointing(native, "full")
    input_ids = torch.randint(0, cli.vocab, (cli.batch, cli.seq))

    traffic_stack = traffic_stack_for_kernels()
    kernels = triton_kernels._kernels()
    supported = triton_dequant.int8_supported, triton_dequant.nf4_supported

    def step(model, triton: bool = False, dequantize_kernels: bool = True):
        def run(kept: list | None = None):
            """One step; with ``kept``, appends the bytes the forward left allocated for backward."""
            os.environ[triton_kernels.ENV_SWITCH] = "1" if triton else "0"
            triton_dequant.int8_supported, triton_dequant.nf4_supported = (
                supported if dequantize_kernels else (lambda *args: False,) * 2)
            model.zero_grad(set_to_none=True)
            before = heap_stats() if kept is not None else None
            with use_device_policy("gpu"):
                with torch.autocast("cpu", dtype=torch.bfloat16):
                    loss = model(input_ids, labels=input_ids).loss
                if before is not None:
                    kept.append(heap_stats().in_use - before.in_use)
                loss.backward()
        return run

    # transformers' quantized base is bitsandbytes', whose kernels are CUDA's: with --quantize only hfnative's run
    runners = {"transformers": step(reference), "ours:torch_kernels": step(native)}
    if cli.quantize:
        del runners["transformers"]
    skipped = None
    if kernels is None:
        skipped = "Triton cannot be imported here"
    elif os.environ.get("TRITON_INTERPRET") != "1":
        skipped = "Triton's kernels run on a CPU only under its interpreter: set TRITON_INTERPRET=1"
    else:
        if cli.quantize:  # the block's kernels, the quantized weights made whole by torch's ops
            runners["ours:torch_dequantize"] = step(native, triton=True, dequantize_kernels=False)
        runners["ours"] = step(native, triton=True)

    chosen = cli.runners.split(",")
    runners = {name: run for name, run in runners.items() if name in chosen}
    tokens = cli.batch * cli.seq
    print(f"# one forward + backward, {cli.layers} Qwen3-0.6B-wide blocks, {cli.batch} x {cli.seq} tokens, vocab "
          f"{cli.vocab}, {cli.weights} weights, bf16 autocast{', LoRA on every linear layer' if cli.lora else ''}"
          f"{f', the base in {cli.quantize}' if cli.quantize else ''}"
          f"{', every block checkpointed' if cli.checkpointing else ''}")
    print(f"{'runner':<20} {'other kernels':>13} {'other MB':>10} {'matmul kernels':>14} {'matmul MB':>10} "
          f"{'attention':>9}  per block: other kernels, MB; kept MB")
    results, kept_bytes = {}, {}
    for name, run in runners.items():
        traffic = _count(run, traffic_stack)
        results[name] = traffic
        kept: list[int] = []
        if heap_stats() is not None:  # what the forward leaves allocated for backward (glibc's counters)
            run(kept)
        kept_bytes[name] = kept[0] if kept else None
        per_block = (traffic.kernels["other"] / cli.layers, traffic.bytes["other"] / cli.layers / 2**20)
        kept_text = "n/a" if not kept else f"{kept[0] / cli.layers / 2**20:.1f}"
        print(f"{name:<20} {traffic.kernels['other']:>13} {traffic.bytes['other'] / 2**20:>10.1f} "
              f"{traffic.kernels['matmul']:>14} {traffic.bytes['matmul'] / 2**20:>10.1f} "
              f"{traffic.kernels['attention']:>9}  {per_block[0]:.0f}, {per_block[1]:.1f}; {kept_text}")
    if skipped:
        print(f"ours: skipped ({skipped})")
    base = results.get("transformers")
    for name, traffic in results.items():
        if base is not None and name != "transformers":
            kept = ""
            if kept_bytes[name] and kept_bytes.get("transformers"):
                kept = f", kept for backward x{kept_bytes[name] / kept_bytes['transformers']:.2f}"
            print(f"{name} / transformers: other kernels x{traffic.kernels['other'] / base.kernels['other']:.2f}, "
                  f"other bytes x{traffic.bytes['other'] / base.bytes['other']:.2f}{kept} ({tokens} tokens)")
    for name, traffic in results.items():
        top = ", ".join(f"{op} {count}" for op, count in traffic.names.most_common(cli.top))
        print(f"{name} most frequent: {top}")


if __name__ == "__main__":
    main()
