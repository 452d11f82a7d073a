"""The loop's ``perf/`` metrics: throughput, achieved FLOPs, MFU, step time, memory, and the generation share.

Every model the loop trains or runs frozen (the policy, a reference, a teacher) is watched by a forward pre-hook
while ``train()`` runs; a forward inside an optimizer step adds its tokens and FLOPs to the logging window's
sums. The counts come from host-known shapes and the attention plan made on the host (its documents' lengths), or,
for a padded batch with no such plan, from the padding mask as a device scalar: nothing is read from the device
until the logging step, where the window's sums are reduced over the ranks in one collective and read once.

A forward with autograd recording on a model with trainable parameters is trained: its tokens are the step's
trained tokens and it costs forward + backward (3× the forward's FLOPs); any other forward (a frozen reference or
teacher, the policy's own log-probs without a graph) costs its forward only. Generation (timed by the rollout
component through ``record_generation``) is not a forward of the decoder and is not in the FLOPs.
"""

from __future__ import annotations

import logging
import time
from contextlib import contextmanager

import torch

from hfnative.metrics import (
    cpu_low_precision_is_slow,
    device_peak_flops,
    forward_flops_per_token,
    measured_matmul_flops,
    memory_gib,
    mfu_percent,
)
from hfnative.models.args import ModelArgs

from .arguments import mixed_precision_dtype

logger = logging.getLogger(__name__)


def warn_if_cpu_low_precision_is_slow(args) -> bool:
    """On CPU with ``bf16``/``fp16``: warn (once per run) when that dtype's matmuls run far below fp32's on this
    CPU, as on CPUs without AVX512-BF16/AMX, where a bf16 step is several times slower than an fp32 one. Returns
    whether it warned."""
    dtype = mixed_precision_dtype(args)
    if dtype is None or not cpu_low_precision_is_slow(dtype):
        return False
    low, fp32 = measured_matmul_flops(dtype), measured_matmul_flops(torch.float32)
    flag = "bf16" if args.bf16 else "fp16"
    logger.warning(
        "%s=True on a CPU whose %s matmuls run at %.1f GFLOP/s against %.1f GFLOP/s in fp32 (no fast %s kernels): "
        "training will be several times slower than in fp32. Pass %s=False to train in fp32 on this machine.",
        flag, str(dtype).removeprefix("torch."), low / 1e9, fp32 / 1e9, flag, flag,
    )
    return True


class StepPerformance:
    """Per-step performance sums for one run, logged as ``perf/*`` (see the README's table).

    ``world_size``: the run's processes (devices); ``sequence_ranks``: the context-parallel ranks each sequence is
    split over (a forward sees 1/cp of each sequence, which attends over all of it); ``peak_tflops``: the user's
    peak per device (None: the device's, listed or measured). The loop sets ``dtype``, the matmuls' dtype (bf16/fp16
    autocast, else the policy's parameters'), which the device's peak is for.
    """

    def __init__(self, device: torch.device, world_size: int = 1, sequence_ranks: int = 1,
                 peak_tflops: float | None = None):
        self.device = device
        self.world_size = world_size
        self.sequence_ranks = sequence_ranks
        self.peak_tflops = peak_tflops
        self.dtype: torch.dtype | None = None
        self._peak: float | None = None
        self._handles: list = []
        self._in_step = False
        self._step_started = 0.0
        # on CUDA a step's time is the device's, between an event recorded as it starts and one as it ends: the host
        # returns from a step while its last kernels are still queued, and its own clock would leave them out
        self._event = (lambda: torch.cuda.Event(enable_timing=True)) if device.type == "cuda" else None
        self._started_event = None
        self._flops_of: dict[tuple[int, int], int] = {}  # (id of a model's ModelArgs, span) -> forward FLOPs/token
        self._clear()

    def _clear(self) -> None:
        self._steps = 0
        self._step_seconds = 0.0
        self._step_events: list = []  # (start, end) events of the window's steps, on CUDA
        # floats, or device scalars once a padded batch without a host plan was counted
        self._trained_tokens: float | torch.Tensor = 0.0
        self._flops: float | torch.Tensor = 0.0
        self._flops_known = True  # every forward's model had ModelArgs
        self._generation_seconds = 0.0
        self._generated_tokens = 0.0
        self._phase_seconds: dict[str, float] = {}  # fwd_bwd, fwd, optimizer: seconds in the window's steps
        self._phase = None  # the phase being timed now
        self._fwd_bwd_flops: float | torch.Tensor = 0.0  # the FLOPs of the forwards inside the fwd_bwd phase

    # --- what is watched ------------------------------------------------------------------------------------
    def watch(self, models) -> None:
        """Count the forwards of ``models`` (until ``unwatch``), from an empty window: a run starts here."""
        self.unwatch()
        self._clear()
        self._in_step = False
        self._flops_of.clear()  # the models (and their ModelArgs) may be new ones
        for model in models:
            if not isinstance(model, torch.nn.Module):
                continue
            trainable = any(p.requires_grad for p in model.parameters())
            args = getattr(model, "args", None)
            hook = self._hook(args if isinstance(args, ModelArgs) else None, trainable)
            self._handles.append(model.register_forward_pre_hook(hook, with_kwargs=True))
        # the peak the MFU is taken against, found now: on a CPU it is timed (about half a second), which inside the
        # first logged step would be counted as that step's time
        self.peak_flops()

    def unwatch(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []

    def _hook(self, model_args: ModelArgs | None, trainable: bool):
        def count(module, args, kwargs):
            if not self._in_step:
                return
            input_ids = args[0] if args else kwargs.get("input_ids")
            if not isinstance(input_ids, torch.Tensor):
                return
            mask = args[1] if len(args) > 1 else kwargs.get("attention_mask")
            trains = trainable and torch.is_grad_enabled()
            tokens, flops = self._forward_cost(model_args, input_ids, mask, kwargs.get("attention_plan"))
            if trains:
                self._trained_tokens = self._trained_tokens + tokens
            if flops is None:
                self._flops_known = False
            else:
                cost = flops * (3 if trains else 1)  # forward + backward, or the forward alone
                self._flops = self._flops + cost
                if self._phase is not None:  # a forward of the micro-batches' forward + backward
                    self._fwd_bwd_flops = self._fwd_bwd_flops + cost

        return count

    def _per_token(self, model_args: ModelArgs, span: int) -> int:
        key = (id(model_args), span)
        flops = self._flops_of.get(key)
        if flops is None:
            flops = self._flops_of[key] = forward_flops_per_token(model_args, span)
        return flops

    def _forward_cost(self, model_args, input_ids, mask, plan):
        """(real tokens, forward FLOPs) of one forward: host numbers, or device scalars for a padded batch whose
        plan holds no document lengths; FLOPs None without ModelArgs."""
        S = input_ids.shape[-1]
        B = input_ids.numel() // max(S, 1)
        kind = getattr(plan, "kind", None)
        if kind == "varlen" and plan.spans:
            lengths = [end - start for row in plan.spans for start, end in row]
            tokens = sum(lengths)
            flops = None if model_args is None else sum(n * self._per_token(model_args, n) for n in lengths)
            return tokens, flops
        span = S * self.sequence_ranks if kind == "context_parallel" else S  # a cp chunk attends over the sequence
        if kind != "causal" and isinstance(mask, torch.Tensor):  # "causal": no padding
            tokens = mask.detach().sum(dtype=torch.float64)
        else:
            tokens = B * S
        return tokens, None if model_args is None else tokens * self._per_token(model_args, span)

    # --- the step -------------------------------------------------------------------------------------------
    def step_started(self) -> None:
        self._in_step = True
        self._step_started = time.perf_counter()
        if self._event is not None:
            self._started_event = self._event()
            self._started_event.record()

    def step_ended(self) -> None:
        if not self._in_step:
            return
        self._in_step = False
        self._step_seconds += time.perf_counter() - self._step_started
        if self._event is not None:
            ended = self._event()
            ended.record()
            self._step_events.append((self._started_event, ended))
        self._steps += 1

    @contextmanager
    def timed(self, phase: str):
        """Add the wall time of the block to the step's ``phase`` seconds (TRL's perf/fwd_bwd_s: a micro-batch's
        training step; perf/fwd_s: its forward and loss; perf/optimizer_s: the optimizer's step). Host time, no
        device sync (as TRL's)."""
        if not self._in_step:
            yield
            return
        outer, start = self._phase, time.perf_counter()
        self._phase = outer or phase
        try:
            yield
        finally:
            self._phase = outer
            self._phase_seconds[phase] = self._phase_seconds.get(phase, 0.0) + time.perf_counter() - start

    def step_cancelled(self) -> None:
        """The step found no micro-batches (the data ran out): nothing to count."""
        self._in_step = False

    def record_generation(self, seconds: float, tokens: int) -> None:
        """One generation call of this rank inside a step: its wall time and the tokens it generated."""
        if self._in_step:
            self._generation_seconds += seconds
            self._generated_tokens += tokens

    # --- the log ----------------------------------------------------------------------------------------------
    def peak_flops(self) -> float | None:
        """The peak FLOP/s of one device (the user's ``peak_tflops``, else the device's), found once."""
        if self.peak_tflops is not None:
            return self.peak_tflops * 1e12
        if self._peak is None:
            self._peak = device_peak_flops(self.device, self.dtype or torch.float32) or 0.0
        return self._peak or None

    def pop(self, sum_over_ranks) -> dict[str, float]:
        """The window's perf/ metrics (cleared): ``sum_over_ranks(values)`` sums a 1-D float64 tensor over the ranks
        holding different tokens (a collective every rank joins); {} when no step ended since the last pop."""
        if self._steps == 0:
            self._clear()
            return {}
        # generated tokens: the cp ranks of a sequence generate the same completions
        sums = (self._trained_tokens, self._flops, self._generated_tokens / self.sequence_ranks, self._fwd_bwd_flops)
        values = torch.stack([torch.as_tensor(value, dtype=torch.float64).to(self.device) for value in sums])
        trained, flops, generated, fwd_bwd_flops = sum_over_ranks(values).tolist()
        seconds, ranks = self._step_seconds, self.world_size
        if self._step_events:  # the device's time (the read above waited for the device already)
            self._step_events[-1][1].synchronize()
            seconds = sum(start.elapsed_time(end) for start, end in self._step_events) / 1e3
        logs = {
            "perf/step_s": seconds / self._steps,
            "perf/trained_tok_s_wall_clock": trained / seconds,
            "perf/trained_tok_s_per_rank": trained / seconds / ranks,
        }
        if self._flops_known and flops > 0:
            logs["perf/tflops_per_rank"] = flops / seconds / ranks / 1e12
            peak = self.peak_flops()
            if peak:
                logs["perf/mfu_wall_clock"] = mfu_percent(flops / seconds, ranks, peak)
        for phase in ("fwd_bwd", "fwd", "optimizer"):
            if phase in self._phase_seconds:
                logs[f"perf/{phase}_s"] = self._phase_seconds[phase] / self._steps
        fwd_bwd_seconds = self._phase_seconds.get("fwd_bwd", 0.0)
        if self._flops_known and fwd_bwd_flops > 0 and fwd_bwd_seconds > 0:
            peak = self.peak_flops()
            if peak:
                logs["perf/mfu_fwd_bwd"] = mfu_percent(fwd_bwd_flops / fwd_bwd_seconds, ranks, peak)
        if self._generation_seconds > 0:
            logs["perf/generation_share"] = self._generation_seconds / seconds
            logs["perf/generated_tok_s"] = generated / self._generation_seconds
        logs.update({f"perf/{name}_gib": value for name, value in memory_gib(self.device).items()})
        self._clear()
        return logs


__all__ = ["StepPerformance"]
