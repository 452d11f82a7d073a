"""What a GPU's captured decode steps rely on, checked on the CPU: a mixture of experts' grouped matmuls run in the
autocast dtype under the GPU policy (torch's grouped matmul is not an autocast op, and in float32 a GPU runs it an
expert at a time after reading the group sizes on the host, which a CUDA graph cannot capture), the decoded replica
holds the experts in that dtype, which models a graph can capture is known before trying, and a capture that fails
leaves the stream it found current and the engine's later steps uncaptured."""

from __future__ import annotations

import types
import warnings

import pytest
import torch
from hf_configs import VOCAB, make_hf_model

from hfnative.converters.loading import load_pretrained
from hfnative.device_policy import use_device_policy
from hfnative.generation import NativeRolloutEngine, SamplingParams
from hfnative.generation import decode_loop, native
from hfnative.generation.decode_loop import GraphCapture, StepRunner
from hfnative.models.moe import GroupedExperts

pytestmark = pytest.mark.usefixtures("one_torch_thread")  # tests/conftest.py


def _experts(model) -> list[GroupedExperts]:
    return [m for m in model.modules() if isinstance(m, GroupedExperts)]


def _prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(1)
    return [torch.randint(3, VOCAB, (n,), generator=g).tolist() for n in (3, 7, 5)]


def _experts_cast_at_use(engine: NativeRolloutEngine) -> NativeRolloutEngine:
    """``engine`` with a replica that copies no expert weights (its matmul weights' copies only): autocast's cast of
    the experts at every use, the oracle the replica's copies are held to."""
    make = engine._weights._make
    engine._weights._make = lambda model, weights, head, dtype, *rest: make(
        model, [w for w in weights if w.dim() == 2], head, dtype, *rest)
    return engine


def test_experts_run_in_the_autocast_dtype_under_the_gpu_policy():
    """fp32 master weights under bf16 autocast: with the GPU policy the experts compute what the same experts in bf16
    compute from bf16 inputs (casts are exact copies), to the bit, and their gradients reach the fp32 weights; the CPU
    policy keeps them in fp32 (transformers' choice: autocast off around the grouped matmul)."""
    model = load_pretrained(make_hf_model("qwen3moe-topk-norm")).model
    experts = _experts(model)[0]
    g = torch.Generator().manual_seed(0)
    x = torch.randn(12, model.args.dim, generator=g)
    counts = torch.zeros(experts.w1.shape[0], dtype=torch.long)  # the rows sorted by expert: 3, none, 5, 4 of them
    counts[:4] = torch.tensor([3, 0, 5, 4])
    with torch.autocast("cpu", dtype=torch.bfloat16):
        with use_device_policy("cpu"):
            kept = experts(x, counts)
        with use_device_policy("gpu"):
            cast = experts(x, counts)
    assert kept.dtype == torch.float32 and cast.dtype == torch.bfloat16
    bf16 = GroupedExperts(model.args.dim, model.args.moe, experts.activation)
    bf16.load_state_dict(experts.state_dict())
    with torch.no_grad():
        expected = bf16.to(torch.bfloat16)(x.to(torch.bfloat16), counts)
    assert torch.equal(cast.detach(), expected)
    assert (cast.float() - kept).abs().max() < 0.05 * kept.abs().max()  # the same function, in bf16
    cast.float().square().sum().backward()
    assert all(w.grad is not None and w.grad.dtype == torch.float32 and w.grad.abs().sum() > 0
               for w in (experts.w1, experts.w2, experts.w3))


def test_the_decoded_replica_holds_the_experts_in_the_autocast_dtype():
    """Under autocast and the GPU policy the engine decodes a replica whose stacked experts are copies in bf16, made
    once per call, not cast at every token: its rollouts equal those of the model whose experts are cast at every use
    (its matmul weights stacked alike)."""
    converted = load_pretrained(make_hf_model("qwen3moe-topk-norm"))
    model, prompts = converted.model, _prompts()
    sampling = SamplingParams(max_new_tokens=6, seed=3)
    with use_device_policy("gpu"), torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        engine = NativeRolloutEngine(converted)
        ours = engine.generate(prompts, sampling)
        replica = engine._weights.replica
        for copy_, source in zip(_experts(replica), _experts(model)):
            for name in ("w1", "w2", "w3"):
                assert getattr(copy_, name).dtype == torch.bfloat16
                assert torch.equal(getattr(copy_, name), getattr(source, name).to(torch.bfloat16))
        cast_at_use = _experts_cast_at_use(NativeRolloutEngine(converted))
        theirs = cast_at_use.generate(prompts, sampling)
        assert all(e.w1.dtype == torch.float32 for e in _experts(cast_at_use._weights.replica))
    assert ours.completion_ids == theirs.completion_ids
    for mine, their in zip(ours.logprobs, theirs.logprobs):
        assert torch.equal(torch.tensor(mine), torch.tensor(their))


def test_which_models_a_cuda_graph_can_capture_is_known_before_trying(monkeypatch):
    """A dense model always; a mixture of experts only where its grouped matmuls run in bf16 on a GPU whose kernel for
    them reads nothing on the host (compute capability 9.x or 10.x)."""
    dense = load_pretrained(make_hf_model("qwen3-gqa")).model
    moe = load_pretrained(make_hf_model("qwen3moe-topk-norm")).model
    device = torch.device("cpu")
    for major, expected in ((9, True), (10, True), (8, False), (12, False)):
        monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None, major=major: (major, 0))
        assert native.graph_capturable(dense, device)
        with use_device_policy("gpu"), torch.autocast("cpu", dtype=torch.bfloat16):
            assert native.graph_capturable(moe, device) is expected  # cast to bf16
        with use_device_policy("cpu"), torch.autocast("cpu", dtype=torch.bfloat16):
            assert not native.graph_capturable(moe, device)  # fp32 under autocast: the host reads the sizes
        assert not native.graph_capturable(moe, device)  # fp32 weights, no autocast
        assert native.graph_capturable(moe.to(torch.bfloat16), device) is expected
        moe.float()


class _FakeCuda:
    """Enough of torch.cuda for a StepRunner: streams are names, a capture runs the step (whose capture may fail)."""

    def __init__(self):
        self.current, self.made, self.set_to, self.synchronized = "default", 0, [], 0

    def Stream(self):  # noqa: N802 - torch's name
        self.made += 1
        return types.SimpleNamespace(wait_stream=lambda other: None, name=f"side{self.made}")

    def current_stream(self):
        return types.SimpleNamespace(wait_stream=lambda other: None, name=self.current)

    def stream(self, stream):
        fake = self

        class Switch:
            def __enter__(self):
                self.saved, fake.current = fake.current, stream.name

            def __exit__(self, *exc):
                fake.current = self.saved

        return Switch()

    def set_stream(self, stream):
        self.set_to.append(stream.name)
        self.current = stream.name

    def synchronize(self):
        self.synchronized += 1

    def graph_pool_handle(self):
        return "pool"

    def CUDAGraph(self):  # noqa: N802
        return types.SimpleNamespace(replay=lambda: None)

    def graph(self, graph, pool=None, capture_error_mode="global"):
        fake = self
        self.modes = getattr(self, "modes", []) + [capture_error_mode]

        class Capture:  # as torch.cuda.graph: a capture stream made current; ending a failed capture raises again,
            # before the stream is restored
            def __enter__(self):
                fake.current = "capture"

            def __exit__(self, kind, error, trace):
                if kind is not None:
                    raise RuntimeError("operation failed due to a previous error during capture")
                fake.current = "default"
                return False

        return Capture()


def test_a_failed_capture_restores_the_stream_and_stops_the_engine_capturing(monkeypatch):
    fake = _FakeCuda()
    monkeypatch.setattr(decode_loop.torch, "cuda", fake)
    runs = []

    def step():
        runs.append(fake.current)
        if fake.current == "capture":
            raise RuntimeError("operation not permitted when stream is capturing")

    capture = GraphCapture()
    runner = StepRunner(step, capture)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(4):
            runner()
        other = StepRunner(step, capture)  # another shape's step of the same engine
        other()
    # two warm-ups on side streams, the failed capture, then every step as it is on the stream found current
    assert runs == ["side1", "side2", "capture", "default", "default", "default"]
    assert fake.set_to == ["default"] and fake.current == "default" and fake.made == 2
    assert fake.modes == ["thread_local"]  # another thread's CUDA calls do not fail while a step is captured
    assert capture.failed and "capturing" in capture.failed  # the op that broke the capture, not its ending
    assert len([w for w in caught if "could not be captured" in str(w.message)]) == 1


def test_a_captured_steps_key_holds_what_its_graph_bakes_in():
    """A graph replays the parameters' addresses and the adapters' switches it was captured with: switching the
    adapters off gives another step (a graph of its own); weights at new addresses give another, and the steps of the
    old addresses are let go, the batch's fronts' too (their graphs would never replay)."""
    from hfnative.converters.peft import apply_lora

    converted = load_pretrained(make_hf_model("qwen3-gqa"))
    apply_lora(converted, dict(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]))
    model = converted.model
    engine = NativeRolloutEngine(model)
    engine.cuda_graph = True  # the key a GPU's engine makes (nothing below captures: the steps are not called)
    batch = engine._batch(model, 2, 8, 4)
    sampling = SamplingParams(max_new_tokens=4, do_sample=False)
    first = engine._runner(model, batch, sampling, None, False)
    assert first.capture is engine._capture  # a dense model: captured on a GPU
    front = batch.front(1)  # the batch's first row alone (rows moved to the front): steps of its own
    in_front = engine._runner(model, front, sampling, None, False)
    assert in_front is not first and front.runners == {next(iter(front.runners)): in_front}
    assert engine._runner(model, batch, sampling, None, False) is first
    layers = [m for m in model.modules() if hasattr(m, "adapter_enabled")]
    for layer in layers:
        layer.adapter_enabled = False
    off = engine._runner(model, batch, sampling, None, False)
    assert off is not first and len(batch.runners) == 2
    for layer in layers:
        layer.adapter_enabled = True
    assert engine._runner(model, batch, sampling, None, False) is first
    weight = model.layers[0].attention.wo.weight
    weight.data = weight.data.clone()  # the same values at a new address
    moved = engine._runner(model, batch, sampling, None, False)
    assert moved is not first and list(batch.runners.values()) == [moved]
    assert not front.runners  # the front's graph of the old addresses let go too


def test_a_checkpointed_recompute_runs_under_the_policy_its_forward_forced():
    """A forward forced onto the GPU policy (``use_device_policy``) whose backward runs outside that block: the
    checkpointed blocks' recompute computes what the forward did (the experts in bf16 under autocast), and the
    gradients equal those of the same forward kept whole."""
    from hfnative.parallel import apply_activation_checkpointing

    ids = torch.randint(3, VOCAB, (2, 24), generator=torch.Generator().manual_seed(2))
    grads = []
    for checkpointed in (False, True):
        model = load_pretrained(make_hf_model("qwen3moe-topk-norm")).model.train()
        if checkpointed:
            apply_activation_checkpointing(model, "full")
        with torch.autocast("cpu", dtype=torch.bfloat16):
            with use_device_policy("gpu"):
                loss = model(input_ids=ids, labels=ids).loss
            with use_device_policy("cpu"):  # backward (and the recompute) under another policy than the forward's
                loss.backward()
        grads.append({name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None})
    assert grads[0].keys() == grads[1].keys() and grads[0]
    for name, grad in grads[0].items():
        assert torch.equal(grad, grads[1][name]), name


def test_experts_with_adapters_decode_from_their_float32_weights():
    """LoRA on the stacked experts (peft's target_parameters), under autocast and the GPU policy: the replica keeps
    those experts' float32 weights (the adapters folded in float32, then cast, as training computes them), so the
    rollouts equal those of the model itself decoded with autocast's casts at every use."""
    from hfnative.converters.peft import apply_lora

    converted = load_pretrained(make_hf_model("qwen3moe-topk-norm"))
    apply_lora(converted, dict(r=4, lora_alpha=8, target_modules=["q_proj"],
                               target_parameters=["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]))
    model = converted.model
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name or "lora_b" in name.lower():
                p.normal_(0, 0.05, generator=torch.Generator().manual_seed(7))
    sampling = SamplingParams(max_new_tokens=6, seed=3)
    with use_device_policy("gpu"), torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        engine = NativeRolloutEngine(model, fold_expert_adapters=False)
        ours = engine.generate(_prompts(), sampling)
        assert all(e.w1.dtype == torch.float32 for e in _experts(engine._weights.replica))
        theirs = _experts_cast_at_use(NativeRolloutEngine(model, fold_expert_adapters=False)).generate(_prompts(), sampling)
    assert ours.completion_ids == theirs.completion_ids
    assert all(torch.equal(torch.tensor(a), torch.tensor(b)) for a, b in zip(ours.logprobs, theirs.logprobs))


def test_a_captured_steps_key_reads_a_quantized_bases_rows():
    """An int8 base's weight is a wrapper without storage (its data_ptr is 0): the key holds its rows' and scales'
    addresses, so rows replaced at new addresses give another step."""
    from hfnative.converters.peft import apply_lora

    converted = load_pretrained(make_hf_model("qwen3-gqa"))
    apply_lora(converted, dict(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]), load_in_8bit=True)
    model = converted.model
    engine = NativeRolloutEngine(model)
    engine.cuda_graph = True
    batch = engine._batch(model, 2, 8, 4)
    sampling = SamplingParams(max_new_tokens=4, do_sample=False)
    first = engine._runner(model, batch, sampling, None, False)
    weight = model.layers[0].attention.wq.weight
    assert weight.data_ptr() == 0 and native._addresses(weight) == (weight.data_int8.data_ptr(), weight.absmax.data_ptr())
    weight.data_int8 = weight.data_int8.clone()  # the same rows at a new address
    assert engine._runner(model, batch, sampling, None, False) is not first
