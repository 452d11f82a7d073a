"""The training step's per-device trades: what pays on a CPU (where the project develops) and what pays on a GPU
(where users train) differ, so the engine asks the policy of the device its tensors live on.

- ``recompute_in_backward``: remake a block's cheap elementwise activations in backward instead of keeping them
  (``hfnative.models.recompute``). On a CPU it saves a third of the activation memory for little time; on a GPU the
  ~35 extra elementwise kernels a block cost time that the memory it frees does not buy back.
- ``host_reads``: the step may read device values on the host or make tensors whose shape depends on them (a
  boolean index that keeps only the label positions, a branch on ``tensor.any()``). On a CPU the "device" is the
  host and these skip work; on a GPU each one waits for every kernel queued before it. Without them the fused losses
  project every position and mask the ignored ones, and top-1 accuracy takes one ``max`` pass.
- ``head_chunk_elements`` / ``head_gradient_block_elements``: how the fused head walks the vocabulary. None: the CPU
  rule (``hfnative.losses._chunks.chunk_size_for``: small chunks, the head's gradients added chunk by chunk). A
  number: chunks of that many logits, and the logits' gradients held, in the matmul dtype, for up to that many
  entries before one GEMM makes the weight's gradient (and one the hidden states') for them all.
- ``selective_checkpointing``: a block under activation checkpointing keeps its attention output and the query,
  value and gate projections' results and recomputes the rest (``hfnative.models.selective_checkpoint``), instead of
  running its whole forward again; as much of that as takes at most half the device's free memory for the batch
  (``affordable_keep``: the attention's alone, or nothing, when the rest would not fit). On a GPU the recomputed
  matmuls cost time the kept memory buys back; on a CPU full checkpointing stays.
- ``compile_dynamic``: ``torch.compile``'s ``dynamic`` for the blocks. True on a CPU (any batch and sequence length
  from the first call, so padding-free batches never recompile); None on a GPU (static kernels first, dynamic after
  the first new shape: fixed-shape batches, packed or padded to a multiple, keep static, faster kernels).
- ``triton_kernels``: a block run eagerly makes its RMSNorms (a per-head q/k norm with the rotary embedding after it),
  its rotary embedding and its SiLU-gated unit, and the fused head its cross-entropy, with one Triton kernel each way
  (``hfnative.models.triton_kernels``) instead of a chain of elementwise kernels, each a pass over the activation. On
  a GPU those passes are most of an eager step's device time; a CPU keeps torch's ops (Triton does not compile for
  it).
- ``experts_in_autocast_dtype``: under autocast a mixture of experts' grouped matmuls run in its dtype, inputs and
  weights cast as autocast casts a linear layer's (torch's grouped matmul is not an autocast op: left alone, float32
  master weights keep it in float32, where a GPU takes a fallback that reads the groups' sizes on the host and runs
  an expert at a time; its bfloat16 kernel runs on compute capability 9.0 and 10.x). A CPU keeps float32 there, what
  transformers computes (it turns autocast off around the grouped matmul).

``HFNATIVE_DEVICE_POLICY=cpu|gpu`` (or ``use_device_policy``) forces one policy on every device, so the CPU tests run
the GPU policy's code paths and a GPU run can try the CPU's trades.
"""

from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass

import torch

ENV_VARIABLE = "HFNATIVE_DEVICE_POLICY"


@dataclass(frozen=True)
class DevicePolicy:
    name: str
    recompute_in_backward: bool
    host_reads: bool
    head_chunk_elements: int | None
    head_gradient_block_elements: int | None
    selective_checkpointing: bool
    compile_dynamic: bool | None
    triton_kernels: bool
    experts_in_autocast_dtype: bool


CPU_POLICY = DevicePolicy("cpu", recompute_in_backward=True, host_reads=True, head_chunk_elements=None,
                          head_gradient_block_elements=None, selective_checkpointing=False, compile_dynamic=True,
                          triton_kernels=False, experts_in_autocast_dtype=False)
# 2^27 fp32 logits: 512 MiB per [C, V] buffer (883 tokens at Qwen3's 151,936 entries); 2^29 gradient entries: 1 GiB
# in bf16 (3,533 tokens), so a batch of 8,192 label tokens makes the head's weight gradient in 3 GEMMs, not 19 passes
GPU_POLICY = DevicePolicy("gpu", recompute_in_backward=False, host_reads=False, head_chunk_elements=1 << 27,
                          head_gradient_block_elements=1 << 29, selective_checkpointing=True, compile_dynamic=None,
                          triton_kernels=True, experts_in_autocast_dtype=True)
POLICIES = {policy.name: policy for policy in (CPU_POLICY, GPU_POLICY)}

_forced: list[DevicePolicy] = []


def _from_environment() -> DevicePolicy | None:
    name = os.environ.get(ENV_VARIABLE, "").strip().lower()
    if name in ("", "auto"):
        return None
    if name not in POLICIES:
        raise ValueError(f"{ENV_VARIABLE}={name!r}: expected one of {sorted(POLICIES)} or 'auto'")
    return POLICIES[name]


def device_policy(device: torch.device | str) -> DevicePolicy:
    """The policy for tensors on ``device``: a forced one (``use_device_policy``, then ``HFNATIVE_DEVICE_POLICY``),
    else the CPU's on a CPU and the GPU's on every accelerator."""
    if _forced and _forced[-1] is not None:
        return _forced[-1]
    forced = _from_environment()
    if forced is not None:
        return forced
    return CPU_POLICY if torch.device(device).type == "cpu" else GPU_POLICY


def host_to_device(tensor: torch.Tensor, device: torch.device | str) -> torch.Tensor:
    """``tensor.to(device)``; from the host to a CUDA device through pinned memory and without waiting: a copy from
    pageable memory makes the host wait for every kernel queued before it (torch synchronizes the stream after it)."""
    device = torch.device(device)
    if device.type == "cuda" and tensor.device.type == "cpu":
        return tensor.pin_memory().to(device, non_blocking=True)
    return tensor.to(device)


def forced_device_policy() -> DevicePolicy | None:
    """The policy ``use_device_policy`` forces here, None where none is (each device's own, or the environment's)."""
    return _forced[-1] if _forced else None


@contextlib.contextmanager
def use_device_policy(policy: DevicePolicy | str | None):
    """Run the block under ``policy`` (a DevicePolicy or its name) on every device; None: under none forced (each
    device's own, or ``HFNATIVE_DEVICE_POLICY``'s), whatever an enclosing block forces."""
    _forced.append(POLICIES[policy] if isinstance(policy, str) else policy)
    try:
        yield
    finally:
        _forced.pop()


__all__ = ["CPU_POLICY", "GPU_POLICY", "DevicePolicy", "device_policy", "forced_device_policy", "host_to_device",
           "use_device_policy"]
