"""The native rollout backend: batched KV-cache decoding on the training model itself.

Shapes: B batch, P prompt slots (the longest prompt, left-padding the others), T new tokens, V vocabulary.

The engine holds a reference to the model, not a copy: every rollout runs the parameters as they are
now (LoRA adapters included), so ``load_weights`` has nothing to do when it is handed the model's own
tensors; tensors from elsewhere are copied in by native name.
"""

from __future__ import annotations

import contextlib
import functools
from collections import OrderedDict
from collections.abc import Iterable

import torch

from hfnative.models.compute_dtype import autocast_for_weights
from hfnative.models.decoder import Transformer
from hfnative.models.moe import GroupedExperts, adapted_experts, adapters_folded, experts_compute_dtype, folded_copy_bytes
from hfnative.precision import autocast_dtype

from .cached_decoder import attends_by_kernel
from .compute_weights import DecodingWeights, fold_copy_bytes, foldable_adapters, stacked_copy_bytes
from .decode_loop import DecodeBatch, GraphCapture, LiveRows, StepRunner, advance, choose, compact_rows
from .rollouts import RolloutEngine, Rollouts, check_prompts
from .sampling import SamplingParams, call_row_keys

# with static shapes (compile, CUDA graphs) prompts are left-padded to a multiple of this, so batches of similar lengths
# share one compiled or captured decode step (its cache shape) instead of making one per prompt length
COMPILE_SLOT_MULTIPLE = 64
# a captured (uncompiled) step reads the cache up to the next multiple of this many slots past the last one written: a
# graph per such length, so a step reads about the filled part of the cache, not all of it (at batch 64 x 256 new
# tokens of Qwen3-0.6B the whole cache is two thirds of the bytes a step reads)
READ_SLOT_MULTIPLE = 64
# the batch shapes (rows, prompt slots, new tokens) whose buffers an engine keeps for its next calls
MAX_BATCH_SHAPES = 4
# the smallest front rows still going move to (a smaller batch would cost a GPU about as much a step)
SMALLEST_COMPACTED_BATCH = 4
# the most of a CUDA device's free memory a second copy of the stacked projections' weights may take by default
# (Qwen3-0.6B in bf16: 0.58 GB)
STACK_FREE_MEMORY_SHARE = 0.125


@contextlib.contextmanager
def _autocast_cache_off(off: bool):
    """Autocast's cast cache off while ``off``: a captured step must run the casts it reads (a DoRA layer's fp32 adapter
    weights, left out of the decoded replica), not read the cache's copies, which are freed when the trainer's
    autocast region ends while the graph keeps their addresses for the next call."""
    enabled = torch.is_autocast_cache_enabled()
    if off:
        torch.set_autocast_cache_enabled(False)
    try:
        yield
    finally:
        torch.set_autocast_cache_enabled(enabled)


# the compute capabilities whose bfloat16 grouped matmul (a mixture of experts') runs without reading the groups'
# sizes on the host (torch's CUTLASS kernel: Hopper and Blackwell); elsewhere, or in another dtype, torch runs it an
# expert at a time after copying the sizes to the host, which a CUDA graph cannot capture
GROUPED_MM_CAPTURABLE_MAJORS = (9, 10)


def graph_capturable(model: Transformer, device: torch.device) -> bool:
    """Whether a decode step of ``model`` can be captured in a CUDA graph on ``device``, as far as is known before
    trying: a model without a mixture of experts; with one, where its grouped matmuls run in bfloat16 (autocast's
    dtype where the device policy casts them, else the decoded weights') on a GPU whose kernel for them reads nothing
    on the host (``GROUPED_MM_CAPTURABLE_MAJORS``). Asked under the decoding's autocast."""
    experts = [m for m in model.modules() if isinstance(m, GroupedExperts)]
    if not experts:
        return True
    if torch.version.hip is not None or torch.cuda.get_device_capability(device)[0] not in GROUPED_MM_CAPTURABLE_MAJORS:
        return False  # (ROCm's capabilities are not NVIDIA's)
    cast = experts_compute_dtype(device)
    return all((cast or w.dtype) == torch.bfloat16 for m in experts for w in (m.w1, m.w2, m.w3))


def _addresses(tensor: torch.Tensor) -> tuple[int, ...]:
    """The addresses a kernel reads ``tensor`` at: its own, or a wrapper subclass's inner tensors' (an int8 or NF4
    base's rows and scales; the wrapper itself has no storage)."""
    if type(tensor.data) is torch.Tensor or not hasattr(tensor, "__tensor_flatten__"):
        return (tensor.data_ptr(),)
    names, _ = tensor.__tensor_flatten__()
    return tuple(address for name in names for address in _addresses(getattr(tensor, name)))


class NativeRolloutEngine(RolloutEngine):
    """Rollouts from a native ``Transformer`` (or a model holding one as ``.model``, e.g. a ConvertedModel).

    Each step of the decode loop runs on the device with nothing read back on the host (``decode_loop``); a batch
    shape's buffers (KV cache, RoPE tables, outputs) are made at its first call and reused. Under autocast the model
    decoded is a replica whose matmul weights are in the autocast dtype, refreshed once per call
    (``compute_weights``); its query, key and value weights are rows of one tensor, and so are its gate and up
    weights, each stack multiplied once. stack_projections: whether a model that needs no cast (its weights already
    in the decoding dtype) decodes such a replica too, at the cost of a second copy of those weights; default: on a
    CUDA device when the copy takes at most STACK_FREE_MEMORY_SHARE of its free memory (decided at the model's first
    call), elsewhere not.

    cuda_graph (default: on CUDA): the whole decode step (decode, sampling, stop bookkeeping) is captured in a CUDA
    graph per batch shape (rows, prompt slots, new tokens) and sampling kind, and replayed at every token: one launch
    a token, whatever the model's depth. compile: that step goes through ``torch.compile`` (fused kernels; the first
    call of a shape compiles). Either gives the step static shapes: prompts are left-padded to a multiple of
    COMPILE_SLOT_MULTIPLE slots. Where the Triton kernels run (a GPU of compute capability 8.0 on, no attention
    sinks), a captured or compiled step's attention is one kernel a layer that reads each row's entries from its first
    token to the slot written (``decode_attention``), with no mask: one graph for every step. Otherwise the cache is read
    under its position mask: a compiled step reads it whole (one shape, one compile), a captured one up to the next
    multiple of READ_SLOT_MULTIPLE slots past the last filled one (``bucketed_reads``: a graph per read length,
    captured as the cache fills). Prefill stays eager (packed, the training attention kernels). max_batch_size: at
    most this many prompts decode together.
    compact (default on): once the rows still going fit in a power of two rows (at least SMALLEST_COMPACTED_BATCH) at
    most half of a batch, they move (cache and all) to the front of its buffers, and the later steps decode only that
    front, in the same memory. A call whose completions end at different lengths costs the tokens it makes, not its
    batch times its longest completion; a row decodes what it would have in the whole batch (its own sampling stream
    when seeded). Each front is a batch shape of its own: compiled (compile=True) and captured at its first use, then
    reused by later calls.
    The model is put in eval mode while generating (no dropout, e.g. LoRA's) and restored after.
    fold_expert_adapters: whether LoRA adapters on stacked MoE experts (peft's target_parameters) are folded into
    copies of the expert weights once per call (a copy of every adapted expert weight, kept between calls) instead of
    at every token's forward; default: on a CUDA device when the copies take at most STACK_FREE_MEMORY_SHARE of its
    free memory (decided at the model's first call), elsewhere not.
    fold_adapters: whether the LoRA layers decode as plain linear layers over their folded weights (``W + s B A``,
    made once per call, as a merged model decodes and as TRL merges adapters for vLLM; ``compute_weights``): a decode
    step multiplies each weight once instead of the base's and the adapter's A and B. Where the replica copies the base
    weights anyway (float32 under autocast, not DoRA's) that costs no memory, else a copy of every adapted weight
    (``fold_copy_bytes``); without autocast a quantized layer computing in another dtype stays unfolded; default: on a
    CUDA device when that copy takes at most STACK_FREE_MEMORY_SHARE of its free memory (decided at the model's first
    call), elsewhere not.
    """

    reads_live_weights = True
    samples_row_streams = True

    def __init__(self, model: Transformer, *, compile: bool = False, cuda_graph: bool | None = None,
                 max_batch_size: int | None = None, compact: bool = True, stack_projections: bool | None = None,
                 fold_expert_adapters: bool | None = None, fold_adapters: bool | None = None):
        model = getattr(model, "model", model) if not isinstance(model, Transformer) else model
        if not isinstance(model, Transformer):
            raise ValueError(
                f"NativeRolloutEngine needs an hfnative Transformer (or a ConvertedModel), got {type(model).__name__}; "
                "load a checkpoint folder, Hub id or transformers model with hfnative.load_pretrained first"
            )
        if max_batch_size is not None and max_batch_size < 1:
            raise ValueError(f"max_batch_size={max_batch_size}: expected an int >= 1 or None")
        device_type = model.tok_embeddings.weight.device.type
        if cuda_graph and device_type != "cuda":
            raise ValueError(f"cuda_graph=True: the model is on {device_type}, CUDA graphs need it on a CUDA device")
        self.model, self.compile, self.max_batch_size, self.compact = model, compile, max_batch_size, compact
        self.cuda_graph = device_type == "cuda" if cuda_graph is None else cuda_graph
        # a captured step reads the cache in lengths of READ_SLOT_MULTIPLE slots (see above); a compiled one whole
        self.bucketed_reads = self.cuda_graph and not compile
        self._batches: OrderedDict[tuple, DecodeBatch] = OrderedDict()
        self._weights = DecodingWeights()
        self.stack_projections = stack_projections
        self._stacks: tuple[tuple[int, ...], bool] | None = None  # the default's answer, for the model's parameters
        self.fold_expert_adapters = fold_expert_adapters
        self._folds: tuple[tuple[int, ...], bool] | None = None  # likewise for fold_expert_adapters
        self._folded: dict[tuple[int, str], torch.Tensor] = {}  # the folded expert weights (adapters_folded)
        self._folded_for: tuple[int, ...] = ()  # the decoded model's adapted experts they were made for
        self.fold_adapters = fold_adapters
        self._adapter_folds: dict[torch.dtype | None, tuple[tuple[int, ...], bool]] = {}  # likewise, per dtype
        self._capture = GraphCapture()  # the memory pool this engine's CUDA graphs share, and a failed capture

    def load_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy tensors into the model by native state-dict name (``layers.0.attention.wq.weight``,
        ``...lora_B``); a tensor that already is the model's own is skipped."""
        own = self.model.state_dict(keep_vars=True)
        with torch.no_grad():
            for name, tensor in named_tensors:
                target = own.get(name)
                if target is None:
                    raise ValueError(
                        f"load_weights: the model has no tensor named {name!r} "
                        "(native names are expected, e.g. 'layers.0.attention.wq.weight')"
                    )
                if tuple(target.shape) != tuple(tensor.shape):
                    raise ValueError(
                        f"load_weights: {name} has shape {list(tensor.shape)}, the model's is {list(target.shape)}"
                    )
                if target.data_ptr() != tensor.data_ptr():
                    target.copy_(tensor)

    @torch.no_grad()
    def generate(self, prompts: list[list[int]], sampling: SamplingParams) -> Rollouts:
        if sampling.regex is not None:
            raise ValueError("SamplingParams.regex (vllm_structured_outputs_regex): completions constrained to a regex "
                             "are decoded by the vLLM backends only; generate with vLLM (use_vllm=True), or drop it")
        prompts = check_prompts(prompts, self.model.args.vocab_size)
        step = self.max_batch_size or len(prompts)
        was_training = self.model.training
        self.model.eval()
        # (the model's GPU current while decoding: the streams a captured step is warmed up and captured on are the
        # current device's)
        on_device = torch.cuda.device(self._device) if self._device.type == "cuda" else contextlib.nullcontext()
        try:
            # a frozen model whose linear weights are kept in the autocast dtype decodes under autocast to it
            with on_device, autocast_for_weights(self.model, self._device.type), _autocast_cache_off(self.cuda_graph):
                dtype = autocast_dtype(self._device.type)
                model = self._weights.model_for(self.model, dtype, self._stacked(), self._fold(dtype))
                with self._experts_folded(model):
                    parts = [self._generate_batch(model, prompts[i : i + step], sampling, i)
                             for i in range(0, len(prompts), step)]
        finally:
            self.model.train(was_training)
        return Rollouts(
            [c for part in parts for c in part.completion_ids],
            [lp for part in parts for lp in part.logprobs],
            [r for part in parts for r in part.finish_reason],
        )

    def _stacked(self) -> bool:
        """Whether a model needing no cast decodes a replica with stacked projections (``stack_projections``)."""
        if self.stack_projections is not None:
            return self.stack_projections
        if self._device.type != "cuda":
            return False
        # decided once per set of parameters: a new answer would make a new replica
        self._stacks = self._fits_in_free_memory(self._stacks, stacked_copy_bytes)
        return self._stacks[1]

    def _fold(self, dtype: torch.dtype | None) -> bool:
        """Whether the LoRA layers decode over their folded weights (``fold_adapters``)."""
        if self.fold_adapters is not None:
            return self.fold_adapters
        if self._device.type != "cuda" or not foldable_adapters(self.model, dtype):
            return False
        # decided per autocast dtype (what the fold costs depends on it)
        self._adapter_folds[dtype] = self._fits_in_free_memory(self._adapter_folds.get(dtype),
                                                               lambda m: fold_copy_bytes(m, dtype))
        return self._adapter_folds[dtype][1]

    def _fits_in_free_memory(self, decided: tuple[tuple[int, ...], bool] | None, copy_bytes):
        """(the model's parameters, whether ``copy_bytes(model)`` takes at most STACK_FREE_MEMORY_SHARE of the device's
        free memory): ``decided`` where it was made for these parameters, else decided now."""
        source = tuple(id(p) for p in self.model.parameters())
        if decided is None or decided[0] != source:
            free, _ = torch.cuda.mem_get_info(self._device)
            decided = (source, copy_bytes(self.model) <= STACK_FREE_MEMORY_SHARE * free)
        return decided

    def _experts_folded(self, model: Transformer):
        """``adapters_folded`` over ``model`` (the model decoded) where fold_expert_adapters says so; else nothing."""
        experts = adapted_experts(model)
        if not experts:
            return contextlib.nullcontext()
        fold = self.fold_expert_adapters
        if fold is None:
            fold = False
            if self._device.type == "cuda":
                self._folds = self._fits_in_free_memory(self._folds, folded_copy_bytes)
                fold = self._folds[1]
        if not fold:
            return contextlib.nullcontext()
        owners = tuple(id(m) for m in experts.values())
        if owners != self._folded_for:  # another model decoded (a new replica): its own copies
            self._folded, self._folded_for = {}, owners
        return adapters_folded(model, self._folded)

    @property
    def _device(self) -> torch.device:
        return self.model.tok_embeddings.weight.device

    def _batch(self, model: Transformer, batch_size: int, prompt_slots: int, new_tokens: int) -> DecodeBatch:
        """The buffers of this batch shape, made at its first call and kept (the last MAX_BATCH_SHAPES shapes)."""
        device = self._device
        # under autocast (fp32 master weights, bf16=True) the projections give keys and values in the autocast dtype,
        # and attention reads them in it
        cache_dtype = autocast_dtype(device.type) or self.model.tok_embeddings.weight.dtype
        key = (batch_size, prompt_slots, new_tokens, cache_dtype, device)
        batch = self._batches.pop(key, None)
        if batch is None:
            while len(self._batches) >= MAX_BATCH_SHAPES:
                self._batches.popitem(last=False)
            batch = DecodeBatch(model, batch_size, prompt_slots, new_tokens, cache_dtype, device)
        self._batches[key] = batch
        return batch

    @property
    def static_shapes(self) -> bool:
        """Whether a step has static shapes (compiled or captured): prompts left-padded to a multiple of
        COMPILE_SLOT_MULTIPLE slots; the cache read by the attention kernel row by row (``attends_by_kernel``), or
        under its mask, whole or (``bucketed_reads``) in lengths of READ_SLOT_MULTIPLE slots."""
        return self.compile or self.cuda_graph or self.bucketed_reads

    @staticmethod
    def _read_upto(batch: DecodeBatch, t: int, bucketed: bool) -> int | None:
        """What the static-shape step choosing token t reads of the cache: up to the multiple of READ_SLOT_MULTIPLE
        slots past the slot it writes (P + t - 1) when ``bucketed`` (``bucketed_reads`` where the attention is not the
        Triton kernel, which reads each row's entries from a step of any read length), else all of it (None)."""
        if not bucketed:
            return None
        return min(batch.P + batch.T, -(-(batch.P + t) // READ_SLOT_MULTIPLE) * READ_SLOT_MULTIPLE)

    def _runner(self, model: Transformer, batch: DecodeBatch, sampling: SamplingParams, read_upto: int | None,
                by_kernel: bool) -> StepRunner:
        """The step of ``batch`` for this sampling kind: eager, its attention reading the filled part of the cache,
        or (static shapes) compiled or not and captured in a CUDA graph, which holds the parameters' addresses; its
        attention the Triton kernel reading each row's entries (``by_kernel``: ``attends_by_kernel``, asked outside
        the step: compiled code cannot ask it) or SDPA reading the cache up to ``read_upto`` (None: all of it) under
        its mask."""
        seeded = sampling.seed is not None
        key = (seeded, sampling.do_sample, sampling.temperature, sampling.top_k, sampling.top_p, sampling.min_p,
               sampling.repetition_penalty, len(sampling.stop_ids), torch.is_autocast_enabled(self._device.type),
               id(model), read_upto, by_kernel)
        if self.cuda_graph:
            # what a graph bakes in: the weights' addresses (every runner kept has the batch's: the graphs of other
            # addresses are let go, and their memory, the fronts' too), the adapters switched on or off, the folded
            # experts' copies
            weights = tuple(address for p in model.parameters() for address in _addresses(p))
            root = batch.root
            if root.graph_weights != weights:
                for each in (root, *root._fronts.values()):
                    each.runners.clear()
                root.graph_weights = weights
            key += tuple(bool(m.adapter_enabled) for m in model.modules() if hasattr(m, "adapter_enabled"))
            key += tuple(w.data_ptr() for m in model.modules() if isinstance(m, GroupedExperts)
                         and m.decode_weights is not None for w in m.decode_weights)
        if key not in batch.runners:
            if self.static_shapes:
                step = functools.partial(_compiled_advance if self.compile else advance, model, batch, sampling, seeded,
                                         read_upto, by_kernel)
                capture = self._capture if self.cuda_graph and graph_capturable(model, self._device) else None
                batch.runners[key] = StepRunner(step, capture)
            else:
                batch.runners[key] = StepRunner(functools.partial(advance, model, batch, sampling, seeded,
                                                                  by_kernel=by_kernel))
        return batch.runners[key]

    def _generate_batch(self, model: Transformer, prompts: list[list[int]], sampling: SamplingParams,
                        offset: int) -> Rollouts:
        """Completions of ``prompts``, rows ``offset`` onwards of the call."""
        device, T = self._device, sampling.max_new_tokens
        B, longest = len(prompts), max(len(p) for p in prompts)
        P = -(-longest // COMPILE_SLOT_MULTIPLE) * COMPILE_SLOT_MULTIPLE if self.static_shapes else longest
        batch = self._batch(model, B, P, T)
        seeded = sampling.seed is not None
        keys_B = call_row_keys(sampling, offset, B, device=device) if seeded else None
        choose(batch, batch.start(model, prompts, sampling, keys_B), sampling, seeded)
        by_kernel = attends_by_kernel(model, batch.cache)
        bucketed = self.bucketed_reads and not by_kernel
        read_upto = self._read_upto(batch, 1, bucketed)
        step = self._runner(model, batch, sampling, read_upto, by_kernel)
        live = LiveRows(device) if sampling.stop_ids else None
        moved = False
        for t in range(1, T):  # tokens 0 .. t-1 are chosen
            going = live.count(t - 1, batch.finished_B) if live is not None else None
            if going == 0:
                break
            rows = compact_rows(going, batch.B, SMALLEST_COMPACTED_BATCH) if self.compact and going else None
            if rows is not None:
                batch, moved = batch.move_going_first(rows), True
                step = self._runner(model, batch, sampling, read_upto, by_kernel)
            if self.static_shapes:
                upto = self._read_upto(batch, t, bucketed)
                if upto != read_upto:  # the cache filled past the length read so far
                    read_upto, step = upto, self._runner(model, batch, sampling, upto, by_kernel)
                step()
            else:
                step(P + t)  # the eager step reads the cache up to the slot it writes, P + t - 1
        tokens, logprobs, finished = batch.root.outputs(moved)
        return Rollouts(tokens, logprobs, ["stop" if done else "length" for done in finished])


# with compile=True the decode step is compiled with static shapes, one graph per batch shape and sampling kind; a
# trainer meets a few (prompt-slot multiples, a teacher's shapes), more than torch's default limit of 8 per function
COMPILED_SHAPES_LIMIT = 64


@functools.cache
def _advance_compiled():
    """``advance`` through torch.compile, made at first use (importing the compiler takes seconds); aten's random ops
    (fallback_random), so an unseeded compiled step samples as the eager one does."""
    return torch.compile(advance, dynamic=False, options={"fallback_random": True})


def _compiled_advance(*args) -> None:
    with torch._dynamo.config.patch(recompile_limit=COMPILED_SHAPES_LIMIT):
        _advance_compiled()(*args)
