"""What a training step costs and achieves: model FLOPs per token, the device's peak, MFU, memory.

FLOPs follow the usual model-FLOPs convention (PaLM, Megatron, TRL's ``compute_flops_per_token``): the
matmuls of one token's forward pass, 2 FLOPs per multiply-add, the embedding lookup free, norms and
activations left out; the attention scores (Q·Kᵀ and attention·V) counted as if the token attended to
the whole ``seq_len`` (the non-causal convention); training costs 3× the forward (backward is 2×). A
MoE layer counts its router and the ``top_k`` experts a token is sent to. A sliding-window layer's
token attends to at most ``sliding_window`` positions. Tied embeddings are one parameter but the head
matmul is still done, so it is counted; a sequence classifier's score head, applied at one position
per row, is left out.
"""

from __future__ import annotations

import functools
import re
import resource
import sys
import time

import torch

from .allocator import heap_stats
from .models.args import ModelArgs

GIB = float(1 << 30)


def forward_flops_per_token(args: ModelArgs, seq_len: int) -> int:
    """FLOPs of one token's forward pass through the decoder built from ``args`` (embedding to logits), the
    token's attention spanning ``seq_len`` positions (``sliding_window`` at most on sliding layers)."""
    D, d = args.dim, args.head_dim
    q_width, kv_width = args.n_heads * d, args.n_kv_heads * d
    projections = 2 * D * (q_width + 2 * kv_width) + 2 * q_width * D  # wq, wk, wv, wo
    total = 0
    for layer_id in range(args.n_layers):
        span = seq_len
        if args.layer_type(layer_id) == "sliding_attention" and args.sliding_window is not None:
            span = min(seq_len, args.sliding_window)
        scores = 2 * 2 * q_width * span  # q·kᵀ and attention·v over the span, every query head
        if args.is_moe_layer(layer_id):
            moe = args.moe
            feed_forward = 2 * D * moe.num_experts + moe.top_k * 2 * 3 * D * moe.intermediate_size  # router, experts
        else:
            feed_forward = 2 * 3 * D * args.intermediate_size  # gate, up, down
        total += projections + scores + feed_forward
    if args.num_labels is not None:  # a sequence classifier scores one position per row: no per-token head
        return total
    return total + 2 * D * args.vocab_size  # the head


def training_flops_per_token(args: ModelArgs, seq_len: int) -> int:
    """Forward + backward: 3 × ``forward_flops_per_token``."""
    return 3 * forward_flops_per_token(args, seq_len)


# dense (no sparsity) peak FLOP/s of known accelerators by the words of their device name, per matmul dtype, from
# the vendors' datasheets (SXM parts where a name covers several); a more specific name comes before its prefix
PEAK_FLOPS = (
    ("GB300", {"bfloat16": 2.5e15, "float16": 2.5e15}),
    ("GB200", {"bfloat16": 2.5e15, "float16": 2.5e15}),
    ("B300", {"bfloat16": 2.25e15, "float16": 2.25e15}),
    ("B200", {"bfloat16": 2.25e15, "float16": 2.25e15}),
    ("H100 NVL", {"bfloat16": 835e12, "float16": 835e12}),
    ("H100 PCIe", {"bfloat16": 756e12, "float16": 756e12}),
    ("H100", {"bfloat16": 989e12, "float16": 989e12}),
    ("H200 NVL", {"bfloat16": 835e12, "float16": 835e12}),
    ("H200", {"bfloat16": 989e12, "float16": 989e12}),
    ("H20", {"bfloat16": 148e12, "float16": 148e12}),
    ("RTX PRO 6000", {"bfloat16": 500e12, "float16": 500e12}),
    ("A100", {"bfloat16": 312e12, "float16": 312e12}),
    ("A6000", {"bfloat16": 154.85e12, "float16": 154.85e12}),
    ("A10G", {"bfloat16": 125e12, "float16": 125e12}),
    ("A10", {"bfloat16": 125e12, "float16": 125e12}),
    ("L40S", {"bfloat16": 362e12, "float16": 362e12}),
    ("L4", {"bfloat16": 121e12, "float16": 121e12}),
    ("T4", {"float16": 65e12}),
    ("MI355X", {"bfloat16": 2.5e15, "float16": 2.5e15}),
    ("MI325X", {"bfloat16": 1.3e15, "float16": 1.3e15}),
    ("MI300X", {"bfloat16": 1.3e15, "float16": 1.3e15}),
    ("MI250X", {"bfloat16": 191.5e12, "float16": 191.5e12}),
)


def listed_peak_flops(device_name: str, dtype: torch.dtype) -> float | None:
    """The datasheet peak FLOP/s of the device named ``device_name`` for ``dtype`` matmuls; None when the device
    or the dtype is not in ``PEAK_FLOPS``."""
    name = device_name.casefold()
    dtype_name = str(dtype).removeprefix("torch.")
    for words, by_dtype in PEAK_FLOPS:
        if re.search(rf"\b{re.escape(words.casefold())}\b", name):
            return by_dtype.get(dtype_name)
    return None


@functools.cache
def measured_matmul_flops(dtype: torch.dtype = torch.float32, largest: int = 1024, repeats: int = 4) -> float:
    """FLOP/s of the fastest of ``repeats`` [n, n] @ [n, n] CPU matmuls in ``dtype`` on torch's threads: the CPU's
    peak as the training sees it. n doubles from 256 until one matmul takes 20 ms or n is ``largest`` (a dtype
    without fast CPU kernels, e.g. bf16 on many CPUs, is measured small). Measured once per process (cached).

    The operands come from a generator of their own: how many are drawn depends on the timing, and drawing them from
    torch's global RNG would leave each process in another state (GRPO's batch shuffle reads that RNG, and the
    tensor-parallel ranks of one batch must shuffle it alike)."""
    generator = torch.Generator().manual_seed(0)
    n = 256
    while True:
        a = torch.randn(n, n, generator=generator).to(dtype)
        b = torch.randn(n, n, generator=generator).to(dtype)
        start = time.perf_counter()
        torch.mm(a, b)  # also the warm-up
        if n >= largest or time.perf_counter() - start >= 0.02:
            break
        n *= 2
    fastest = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        torch.mm(a, b)
        fastest = min(fastest, time.perf_counter() - start)
    return 2.0 * n**3 / fastest


# a CPU whose bf16/fp16 matmuls run this many times below its fp32 rate has no fast kernels for them
SLOW_LOW_PRECISION_FACTOR = 4.0


def cpu_low_precision_is_slow(dtype: torch.dtype) -> bool:
    """Whether this CPU multiplies ``dtype`` (bf16/fp16) matrices ``SLOW_LOW_PRECISION_FACTOR`` times or more below
    its fp32 rate, as CPUs without AVX512-BF16/AMX do (measured once per process, ``measured_matmul_flops``)."""
    if dtype == torch.float32:
        return False
    return measured_matmul_flops(torch.float32) >= SLOW_LOW_PRECISION_FACTOR * measured_matmul_flops(dtype)


def device_peak_flops(device: torch.device, dtype: torch.dtype) -> float | None:
    """Peak FLOP/s of one ``device`` for ``dtype`` matmuls: a GPU's from ``PEAK_FLOPS`` (None when unlisted), a
    CPU's measured (``measured_matmul_flops``): the faster of ``dtype`` and fp32, since a CPU without bf16/fp16
    kernels runs those matmuls far below its fp32 rate and the engine then multiplies in fp32 where it can (the
    fused losses' head products), so a bf16 run measured against the bf16 rate alone could show an MFU above 100%."""
    if device.type == "cpu":
        return max(measured_matmul_flops(dtype), measured_matmul_flops(torch.float32))
    if device.type == "cuda":
        return listed_peak_flops(torch.cuda.get_device_name(device), dtype)
    return None


def mfu_percent(flops_per_second: float, devices: int, peak_flops_per_device: float) -> float:
    """Model FLOPs utilization in percent: the job's achieved FLOP/s over the peak of its ``devices``."""
    return 100.0 * flops_per_second / (devices * peak_flops_per_device)


def memory_gib(device: torch.device) -> dict[str, float]:
    """This process's memory, in GiB: ``max_rss`` (the peak resident set since it started); on CUDA the
    allocator's peaks since it started, ``cuda_max_allocated`` and ``cuda_max_reserved``; on CPU ``heap_in_use``
    (the C heap's live bytes now, where glibc reports them)."""
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    out = {"max_rss": rss / GIB * (1 if sys.platform == "darwin" else 1024)}  # bytes on macOS, KiB on Linux
    if device.type == "cuda":
        out["cuda_max_allocated"] = torch.cuda.max_memory_allocated(device) / GIB
        out["cuda_max_reserved"] = torch.cuda.max_memory_reserved(device) / GIB
    elif device.type == "cpu":
        heap = heap_stats()
        if heap is not None:
            out["heap_in_use"] = heap.in_use / GIB
    return out


__all__ = [
    "PEAK_FLOPS",
    "cpu_low_precision_is_slow",
    "device_peak_flops",
    "forward_flops_per_token",
    "listed_peak_flops",
    "measured_matmul_flops",
    "memory_gib",
    "mfu_percent",
    "training_flops_per_token",
]
