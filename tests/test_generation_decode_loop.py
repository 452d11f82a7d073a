"""The native engine's decode loop as a GPU runs it, checked on the CPU: the fixed-length masked read of the KV cache
(one shape per batch) against the growing read; no device->host sync and no host->device copy per token; the compiled
step against the eager engine and transformers' forward; one compile per batch shape, reused across calls; rows still
going moved to a smaller batch decode what they would have in the whole one."""

from __future__ import annotations

from collections import Counter

import pytest
import torch
import torch.nn.functional as F
from hf_configs import VOCAB, make_hf_model
from torch._dynamo.utils import counters
from torch.utils._python_dispatch import TorchDispatchMode

from hfnative.converters.loading import load_pretrained
from hfnative.converters.peft import apply_lora
from hfnative.generation import NativeRolloutEngine, SamplingParams
from hfnative.generation.cached_decoder import decode_step
from hfnative.generation.decode_loop import DecodeBatch
from hfnative.models.compute_dtype import linear_weights

PROMPT_LENGTHS = [3, 9, 6, 1]  # longer than the tiny sliding windows (4..6): the rings wrap while decoding


def _prompts(seed: int = 1, lengths=PROMPT_LENGTHS) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, VOCAB, (n,), generator=g).tolist() for n in lengths]


def _transformers_logprobs(reference, prompt, completion, temperature=1.0) -> torch.Tensor:
    """log_softmax(logits / temperature) of each completion token under one uncached forward of transformers."""
    with torch.no_grad():
        logits = reference(input_ids=torch.tensor([prompt + completion])).logits[0].float()
    logits = logits[len(prompt) - 1 : len(prompt) + len(completion) - 1] / temperature
    return F.log_softmax(logits, -1).gather(-1, torch.tensor(completion)[:, None])[:, 0]


@pytest.mark.parametrize("name", ["qwen3-gqa", "gemma3-alternating", "gptoss-alternating-yarn"])
def test_fixed_length_read_equals_growing_read(name):
    """A decode step reading the whole cache under the position mask (one shape at every step, more prompt slots of
    left padding) gives the logits of the step reading only the filled slots."""
    model = load_pretrained(make_hf_model(name)).model.eval()
    prompts, steps = _prompts(), 10
    P = max(map(len, prompts))
    greedy = SamplingParams(max_new_tokens=steps, do_sample=False)
    growing = DecodeBatch(model, len(prompts), P, steps, torch.float32, torch.device("cpu"))
    fixed = DecodeBatch(model, len(prompts), P + 7, steps, torch.float32, torch.device("cpu"))
    with torch.no_grad():
        logits_growing = growing.start(model, prompts, greedy, None)
        logits_fixed = fixed.start(model, prompts, greedy, None)
        for t in range(1, steps):
            assert (logits_fixed - logits_growing).abs().max() <= 1e-5, t
            token_B = logits_growing.argmax(-1)
            slot = P + t - 1
            logits_growing = decode_step(model, token_B, torch.tensor(slot), growing.cache, growing.tables, slot + 1)
            logits_fixed = decode_step(model, token_B, torch.tensor(slot + 7), fixed.cache, fixed.tables, None)


class _HostRoundTrips(TorchDispatchMode):
    """Counts the ops that read a device value on the host (on a GPU each waits for the device) and the tensors made
    from host values (on a GPU each a host->device copy)."""

    SYNCS = ("_local_scalar_dense", "item", "is_nonzero", "nonzero", "equal", "masked_select", "unique")

    def __init__(self):
        super().__init__()
        self.counts = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        if name in self.SYNCS or name == "lift_fresh":
            self.counts[name] += 1
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("compile", [False, True], ids=["eager-growing-read", "static-shape-step"])
def test_no_host_round_trip_per_token(compile):
    """A generation of 32 tokens makes the same syncs and host->device copies as one of 8 (those of the prefill and of
    reading the results once): none per token. Sampled, seeded, with a repetition penalty and a stop id. With
    compile=True the step has static shapes; under a dispatch mode torch.compile runs its Python as written, so the
    ops counted are those of the step a CUDA graph captures."""
    engine = NativeRolloutEngine(load_pretrained(make_hf_model("qwen3-gqa")), compile=compile)
    prompts = _prompts()
    counts = {}
    for new_tokens in (8, 32):
        # a stop id past the vocabulary: checked at every step, never produced
        sampling = SamplingParams(max_new_tokens=new_tokens, seed=5, repetition_penalty=1.3, eos_token_id=VOCAB)
        engine.generate(prompts, sampling)  # the first call of a shape makes its buffers (and compiles)
        with _HostRoundTrips() as seen:
            rollouts = engine.generate(prompts, sampling)
        assert all(len(c) == new_tokens for c in rollouts.completion_ids)
        counts[new_tokens] = seen.counts
    assert counts[8] == counts[32], counts
    assert sum(counts[32].values()) <= 12, counts[32]


def test_compiled_step_matches_eager_and_transformers():
    """The compiled step (the whole cache read under the mask, prompts left-padded to 64 slots) gives the eager
    engine's greedy tokens, and seeded samples whose log-probs are transformers' forward's on the same tokens; rows
    that stop early stop at the same token, their outputs cut after it. The second and third calls of a batch shape
    (other prompts, seeds and rows of the same shape) compile nothing, and the step has no graph break."""
    counters.clear()  # dynamo's counters are the process's: only this test's compiles are counted
    reference = make_hf_model("gemma3-alternating")  # sliding rings, local RoPE, soft norms, embedding scale
    converted = load_pretrained(reference)
    eager, compiled = NativeRolloutEngine(converted), NativeRolloutEngine(converted, compile=True)
    prompts = _prompts(seed=2)
    greedy = SamplingParams(max_new_tokens=12, do_sample=False)
    assert compiled.generate(prompts, greedy).completion_ids == eager.generate(prompts, greedy).completion_ids

    sampled = SamplingParams(max_new_tokens=12, temperature=0.8, top_k=40, seed=7)
    plain = eager.generate(prompts, sampled)
    stop = plain.completion_ids[0][3]  # a token row 0 samples fourth: that row stops there, and maybe others earlier
    sampled = SamplingParams(max_new_tokens=12, temperature=0.8, top_k=40, seed=7, eos_token_id=stop)
    ours, theirs = compiled.generate(prompts, sampled), eager.generate(prompts, sampled)
    assert ours.completion_ids == theirs.completion_ids and ours.finish_reason == theirs.finish_reason
    assert ours.finish_reason[0] == "stop" and len(ours.completion_ids[0]) <= 4
    for prompt, completion, logprobs, reason in zip(prompts, ours.completion_ids, ours.logprobs, ours.finish_reason):
        assert stop not in completion[:-1] and (reason == "stop") == (completion[-1] == stop)
        expected = _transformers_logprobs(reference, prompt, completion, temperature=0.8)
        assert (torch.tensor(logprobs) - expected).abs().max() <= 1e-5

    frames, breaks = counters["frames"]["total"], sum(counters["graph_break"].values())
    for seed, lengths in ((8, [4, 2, 7, 5]), (9, [1, 1, 30, 2])):
        compiled.generate(_prompts(seed, lengths), SamplingParams(max_new_tokens=12, temperature=0.8, top_k=40,
                                                                 seed=seed, first_row=seed, eos_token_id=stop))
    assert counters["frames"]["total"] == frames, "a call of a shape already compiled compiled again"
    assert sum(counters["graph_break"].values()) == breaks == 0, dict(counters["graph_break"])


def test_visible_entries_say_what_the_mask_says():
    """``KVCache.visible_entries`` (what the decode attention kernel reads instead of a mask: each row's entries from
    its padding to the slot written, a ring's by the slot each entry holds) gives the position mask at every decode
    step of full-length and ring buffers (Gemma 3's sliding layers wrap here); a step started without masks makes
    them when asked, the same."""
    model = load_pretrained(make_hf_model("gemma3-alternating")).model.eval()
    prompts, steps = _prompts(), 12
    P = max(map(len, prompts)) + 5
    batch = DecodeBatch(model, len(prompts), P, steps, torch.float32, torch.device("cpu"))
    cache = batch.cache
    lengths = {cache.lengths[layer] for layer in range(len(model.layers))}
    assert len(lengths) == 2, lengths  # full-length and ring buffers
    with torch.no_grad():
        logits = batch.start(model, prompts, SamplingParams(max_new_tokens=steps, do_sample=False), None)
        for t in range(1, steps):
            slot = torch.tensor(P + t - 1)
            logits = decode_step(model, logits.argmax(-1), slot, cache, batch.tables, None)
            masks = [cache.mask(layer) for layer in range(len(model.layers))]
            biases = [cache.attention_bias(layer) for layer in range(len(model.layers))]
            for layer, mask in enumerate(masks):
                pad_B, slot_1, entry_slot = cache.visible_entries(layer)
                assert slot_1.tolist() == [P + t - 1]
                if entry_slot is None:
                    entries = torch.arange(cache.num_slots)
                    seen = (entries[None] >= pad_B[:, None]) & (entries[None] <= slot_1)
                else:
                    seen = entry_slot[None] >= pad_B[:, None]
                assert torch.equal(seen[:, None, None, :], mask), (t, layer)
            cache.start(slot.reshape(1), None, masks=False)  # the same slot claimed again: no mask made
            assert not cache.visible and not cache.bias
            for layer in range(len(model.layers)):
                assert torch.equal(cache.attention_bias(layer), biases[layer])
                assert torch.equal(cache.mask(layer), masks[layer])


def test_captured_steps_read_the_cache_in_lengths(monkeypatch):
    """A captured step (``bucketed_reads``, the default on CUDA without compile; run uncaptured here) reads the cache up
    to the next multiple of READ_SLOT_MULTIPLE slots past the one it writes, a step (graph) per length: the tokens and
    log-probs of the eager engine reading exactly the filled part, rows stopping early included."""
    from hfnative.generation import native

    monkeypatch.setattr(native, "READ_SLOT_MULTIPLE", 8)
    converted = load_pretrained(make_hf_model("gemma3-alternating"))  # rings too: read whole, as before
    eager = NativeRolloutEngine(converted, cuda_graph=False)
    bucketed = NativeRolloutEngine(converted, cuda_graph=False)
    bucketed.bucketed_reads = True
    prompts = _prompts(seed=2)
    for sampling in (SamplingParams(max_new_tokens=20, do_sample=False),
                     SamplingParams(max_new_tokens=20, temperature=0.8, seed=7, eos_token_id=5)):
        ours, theirs = bucketed.generate(prompts, sampling), eager.generate(prompts, sampling)
        assert ours.completion_ids == theirs.completion_ids and ours.finish_reason == theirs.finish_reason
        diff = max(abs(a - b) for x, y in zip(ours.logprobs, theirs.logprobs) for a, b in zip(x, y))
        assert diff <= 1e-5
    [batch] = bucketed._batches.values()
    assert batch.P == 64  # static shapes: prompts left-padded to 64 slots, 84 in all
    # the read lengths of the steps made (on CUDA, each captured): the read_upto each step is bound to (no kernel here)
    assert all(runner.step.args[-1] is False for runner in batch.runners.values())
    lengths = {runner.step.args[-2] for runner in batch.runners.values()}
    assert lengths == {72, 80, 84}, lengths


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU")
def test_cuda_graph_step_matches_eager_on_gpu():
    """On a GPU the step (eager kernels by default, compiled with compile=True) is captured in a CUDA graph at its
    third call and replayed: the uncaptured engine's greedy tokens and seeded samples, call after call."""
    converted = load_pretrained(make_hf_model("qwen3-gqa"), device="cuda")
    eager = NativeRolloutEngine(converted, cuda_graph=False)
    graphed = [NativeRolloutEngine(converted), NativeRolloutEngine(converted, compile=True)]
    prompts = _prompts()
    for sampling in (SamplingParams(max_new_tokens=16, do_sample=False), SamplingParams(max_new_tokens=16, seed=3)):
        expected = eager.generate(prompts, sampling)
        for engine in graphed:
            for _ in range(2):
                got = engine.generate(prompts, sampling)
                assert got.completion_ids == expected.completion_ids
                diff = max(abs(a - b) for x, y in zip(got.logprobs, expected.logprobs) for a, b in zip(x, y))
                assert diff <= 1e-4
            runners = [runner for batch in engine._batches.values() for runner in batch.runners.values()]
            assert runners and all(runner.graph is not None for runner in runners)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU")
def test_compacted_rows_in_cuda_graphs_on_gpu():
    """On a GPU, rows moved to the front of the buffers decode in CUDA graphs of their own (captured per front, holding
    the views' addresses): the uncaptured, uncompacted engine's tokens, call after call."""
    import functools

    from hfnative.generation import native
    from hfnative.generation.decode_loop import LiveRows

    converted = load_pretrained(make_hf_model("qwen3-gqa"), device="cuda")
    whole = NativeRolloutEngine(converted, cuda_graph=False, compact=False)
    prompts = [list(range(3 + i, 4 + i + i % 7)) for i in range(16)]
    settings = _stopping_call(whole, prompts, 48, seed=5, temperature=0.9)
    expected = whole.generate(prompts, settings)
    lengths = sorted(map(len, expected.completion_ids))
    assert lengths[11] + 3 < lengths[-1], lengths  # the front of 4 runs 3 steps or more: its graph is captured
    with pytest.MonkeyPatch.context() as patch:  # the host learns the count at every step, as on a CPU
        patch.setattr(native, "LiveRows", functools.partial(LiveRows, every=1, lead=0))
        for engine in (NativeRolloutEngine(converted), NativeRolloutEngine(converted, compile=True)):
            for _ in range(2):
                got = engine.generate(prompts, settings)
                assert got.completion_ids == expected.completion_ids and got.finish_reason == expected.finish_reason
            [batch] = engine._batches.values()
            assert sorted(batch._fronts) == [4, 8]
            assert batch._fronts[4].runners and all(r.graph is not None for r in batch._fronts[4].runners.values())


def _same_rollouts(ours, theirs, atol: float = 0.0) -> bool:
    """The same completions and finish reasons, log-probs within ``atol``."""
    return (ours.completion_ids == theirs.completion_ids and ours.finish_reason == theirs.finish_reason
            and all(abs(a - b) <= atol for x, y in zip(ours.logprobs, theirs.logprobs) for a, b in zip(x, y)))


# bf16 products of the same operands summed in another order (one matmul for the stacked query, key and value weights
# instead of three): a few bf16 round-offs of a log-prob
STACKED_MATMUL_ATOL = 5e-3


def test_autocast_decodes_matmul_weights_copied_once_per_call():
    """fp32 weights under bf16 autocast (a trainer's bf16=True): the engine decodes a replica whose matmul weights are
    bf16 copies, exactly what autocast's own casts at every use make (the rollouts equal those of the model cast at
    every use, but for the stacked projections' round-off); each call copies the weights again into the same tensors,
    so the rollouts after an optimizer step follow the new weights: torch's fused AdamW (the default optimizer) moves
    no weight's version counter."""
    converted = load_pretrained(make_hf_model("llama-mha-tied-llama3"))  # tied head: the embedding stays fp32
    model, prompts = converted.model, _prompts()
    sampling = SamplingParams(max_new_tokens=10, seed=4)
    engine = NativeRolloutEngine(converted)
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        ours = engine.generate(prompts, sampling)
        replica = engine._weights.replica
        for copy_, weight in zip(linear_weights(replica), linear_weights(model)):
            assert copy_.dtype == torch.bfloat16 and torch.equal(copy_, weight.to(torch.bfloat16))
        assert replica.tok_embeddings.weight is model.tok_embeddings.weight
        assert replica.output.projection().dtype == torch.bfloat16
        cast_as_used = NativeRolloutEngine(converted)
        cast_as_used._weights.model_for = lambda model, *_: model  # autocast casts every weight at every use
        theirs = cast_as_used.generate(prompts, sampling)
        assert _same_rollouts(ours, theirs, STACKED_MATMUL_ATOL)

    addresses = [copy.data_ptr() for _, copy in engine._weights.pairs]
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.05, fused=True)
    for parameter in model.parameters():
        parameter.grad = torch.randn_like(parameter)
    optimizer.step()
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):  # a new region: autocast casts afresh
        updated = engine.generate(prompts, sampling)
        assert engine._weights.replica is replica
        assert [copy.data_ptr() for _, copy in engine._weights.pairs] == addresses  # in place: a CUDA graph's
        assert _same_rollouts(updated, cast_as_used.generate(prompts, sampling), STACKED_MATMUL_ATOL)
        assert updated != ours


def test_the_decoded_replica_stacks_the_projections_reading_one_input():
    """Under autocast the replica's query, key and value weights (and the MLP's gate and up weights) are rows of one
    bf16 tensor each, refreshed in place by every call, and a decode step multiplies each stack once: 4 matmuls a block
    (stacked q/k/v, output, stacked gate/up, down) where the model runs 7. A LoRA projection keeps its own."""
    converted = load_pretrained(make_hf_model("qwen3-gqa"))
    model = converted.model
    engine = NativeRolloutEngine(converted)
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        replica = engine._weights.model_for(model, torch.bfloat16)
    for layer, source in zip(replica.layers, model.layers):
        for name, linears in (("attention", ("wq", "wk", "wv")), ("feed_forward", ("w1", "w3"))):
            module, original = getattr(layer, name), getattr(source, name)
            parts = module.fused_weight.split([getattr(module, n).out_features for n in linears])
            for n, part in zip(linears, parts):
                assert getattr(module, n).weight.data_ptr() == part.data_ptr()
                assert torch.equal(part, getattr(original, n).weight.to(torch.bfloat16))
    with torch.no_grad():  # an update reaches the stacked rows at the next call
        model.layers[0].attention.wk.weight.add_(1.0)
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        assert engine._weights.model_for(model, torch.bfloat16) is replica
    wq, wk = model.layers[0].attention.wq, model.layers[0].attention.wk
    assert torch.equal(replica.layers[0].attention.fused_weight[wq.out_features:][: wk.out_features],
                       wk.weight.to(torch.bfloat16))

    matmuls = _decode_step_matmuls(engine)
    assert matmuls == 4 * len(model.layers) + 1, matmuls  # and the head's
    lora = load_pretrained(make_hf_model("qwen3-gqa"))
    apply_lora(lora, {"r": 4, "lora_alpha": 8, "target_modules": ["q_proj"]})
    replica = NativeRolloutEngine(lora)._weights.model_for(lora.model, torch.bfloat16)
    assert not hasattr(replica.layers[0].attention, "fused_weight") and hasattr(replica.layers[0].feed_forward,
                                                                                "fused_weight")


def test_a_model_needing_no_cast_stacks_its_projections_when_asked():
    """A model already in the decoding dtype (bf16 weights, no autocast) decodes itself by default off CUDA; with
    stack_projections=True a replica whose stacked projections are copies (the rest shared), refreshed at every call:
    the unstacked engine's completions, log-probs within the stacked matmuls' round-off, 4 matmuls a block."""
    converted = load_pretrained(make_hf_model("qwen3-gqa"), dtype=torch.bfloat16)
    model, prompts = converted.model, _prompts()
    plain, stacked = NativeRolloutEngine(converted), NativeRolloutEngine(converted, stack_projections=True)
    sampling = SamplingParams(max_new_tokens=10, seed=4)
    want = plain.generate(prompts, sampling)
    assert plain._weights.replica is None
    assert _same_rollouts(stacked.generate(prompts, sampling), want, STACKED_MATMUL_ATOL)
    replica = stacked._weights.replica
    attention = replica.layers[1].attention
    assert attention.fused_weight.dtype == torch.bfloat16 and attention.wq.weight.data_ptr() == \
        attention.fused_weight.data_ptr()
    assert attention.wo.weight is model.layers[1].attention.wo.weight  # only the stacked ones are copies
    assert replica.output.projection() is model.output.projection()
    with torch.no_grad():
        model.layers[1].feed_forward.w3.weight.mul_(2)
    assert _same_rollouts(stacked.generate(prompts, sampling), plain.generate(prompts, sampling), STACKED_MATMUL_ATOL)
    assert stacked._weights.replica is replica
    assert _decode_step_matmuls(stacked, autocast=False) == 4 * len(model.layers) + 1
    assert _decode_step_matmuls(plain, autocast=False) == 7 * len(model.layers) + 1


def _decode_step_matmuls(engine, autocast: bool = True) -> int:
    """The matmuls one greedy decode step runs (under bf16 autocast; a call of 6 new tokens minus one of 5)."""
    class Matmuls(TorchDispatchMode):
        count = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func.overloadpacket in (torch.ops.aten.mm, torch.ops.aten.addmm, torch.ops.aten.bmm):
                Matmuls.count += 1
            return func(*args, **(kwargs or {}))

    counts = []
    for tokens in (5, 6):
        Matmuls.count = 0
        with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast), Matmuls():
            engine.generate([[3, 4, 5]], SamplingParams(max_new_tokens=tokens, do_sample=False))
        counts.append(Matmuls.count)
    return counts[1] - counts[0]


def test_trainers_compile_their_rollouts_with_torch_compile(tmp_path):
    """torch_compile=True compiles the rollout engines a trainer decodes with (the policy's, and a teacher's), and the
    rollouts through the trainer's own path (tokenized prompts, its sampling settings and row streams, its autocast)
    are the eager trainer's."""
    from pathlib import Path

    from datasets import Dataset

    import hfnative

    tiny = str(Path(__file__).resolve().parents[1] / "examples" / "tiny-qwen3")
    prompts = [{"prompt": f"Tell me about the sea number {i}"} for i in range(4)]
    rollouts = {}
    for compile in (False, True):
        args = hfnative.GRPOConfig(
            output_dir=str(tmp_path / str(compile)), use_cpu=True, bf16=False, report_to="none", max_steps=1,
            num_generations=2, per_device_train_batch_size=4, max_completion_length=12, seed=0, torch_compile=compile,
        )
        trainer = hfnative.GRPOTrainer(model=tiny, reward_funcs=lambda completions, **kw: [0.0] * len(completions),
                                       args=args, train_dataset=Dataset.from_list(prompts))
        rollout = trainer.objective.rollout
        assert rollout.engine.compile is compile
        teacher = load_pretrained(tiny).model
        assert rollout.engine_for(teacher).compile is compile
        prompt_ids = rollout.tokenize([p["prompt"] for p in prompts])
        rollouts[compile] = rollout.generate(prompt_ids, seed=11, first_row=4)
    assert rollouts[True].completion_ids == rollouts[False].completion_ids
    diff = max(abs(a - b) for x, y in zip(rollouts[True].logprobs, rollouts[False].logprobs) for a, b in zip(x, y))
    assert diff <= 1e-5


def _stopping_call(engine, prompts, new_tokens, **sampling):
    """Stop ids that end the rows at different steps: the tokens rows 0, 1, 2, ... make at steps 0, 3, 6, ... of a call
    without them (a row stops at the first of any of them it makes); the settings with them."""
    plain = engine.generate(prompts, SamplingParams(max_new_tokens=new_tokens, **sampling)).completion_ids
    stops = [c[p] for c, p in zip(plain, range(0, new_tokens, 3))]
    return SamplingParams(max_new_tokens=new_tokens, eos_token_id=stops, **sampling)


@pytest.mark.parametrize("compile", [False, True], ids=["eager", "compiled"])
@pytest.mark.parametrize("name", ["qwen3-gqa", "gemma3-alternating"])
def test_rows_still_going_move_to_a_smaller_batch(name, compile):
    """Once at most half of a call's rows are going they move to the front of the buffers, and the steps decode the
    power of two rows that holds them (16 -> 8 -> 4 here), views into the same cache: every row gives the tokens and log-probs it gives decoded in the whole batch (greedy, and seeded with
    a repetition penalty: its stream, seen tokens, sliding rings and padding move with it), and transformers' forward's
    log-probs on those tokens; the later steps decode fewer rows, and moving them reads nothing on the host."""
    from hfnative.generation import native

    reference = make_hf_model(name)
    converted = load_pretrained(reference)
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(3, VOCAB, (int(n),), generator=g).tolist() for n in torch.randint(1, 12, (16,), generator=g)]
    whole = NativeRolloutEngine(converted, compact=False, compile=compile)
    rows_decoded = []
    stepped = "_compiled_advance" if compile else "advance"  # what each step runs (through torch.compile or not)
    real_step = getattr(native, stepped)

    def counted_step(model, batch, *args, **kwargs):
        rows_decoded.append(batch.B)
        return real_step(model, batch, *args, **kwargs)

    for sampling in ({"do_sample": False}, {"seed": 3, "temperature": 0.9, "repetition_penalty": 1.2}):
        settings = _stopping_call(whole, prompts, 24, **sampling)
        expected = whole.generate(prompts, settings)
        lengths = sorted(map(len, expected.completion_ids))
        assert lengths[7] < lengths[11] < lengths[-1] == 24, lengths  # rows end at many steps: 16 -> 8 -> 4
        engine = NativeRolloutEngine(converted, compile=compile)
        rows_decoded.clear()
        counters.clear()
        with pytest.MonkeyPatch.context() as patch:  # a batch's steps are made at its first call, with this
            patch.setattr(native, stepped, counted_step)
            got = engine.generate(prompts, settings)
        decoded = list(rows_decoded)
        if compile and not sampling.get("seed"):  # before any call under a dispatch mode (below), which compiles
            # the step's functions one by one: one graph per front (8, 4), compiled once, not once per step's guards
            # (the 16 rows' step was compiled for the uncompacted engine; shapes this process compiled before: none)
            assert counters["stats"]["unique_graphs"] <= 2, dict(counters["stats"])
        with _HostRoundTrips() as compacting:  # both engines' buffers made: the round trips of a call
            engine.generate(prompts, settings)
        with _HostRoundTrips() as kept:
            whole.generate(prompts, settings)
        assert compacting.counts == kept.counts  # moving rows reads nothing back on the host
        assert got.completion_ids == expected.completion_ids and got.finish_reason == expected.finish_reason
        diff = max(abs(a - b) for x, y in zip(got.logprobs, expected.logprobs) for a, b in zip(x, y))
        assert diff <= 1e-5
        temperature = settings.logprob_temperature
        for prompt, completion, logprobs in zip(prompts, got.completion_ids, got.logprobs):
            theirs = _transformers_logprobs(reference, prompt, completion, temperature)
            assert (torch.tensor(logprobs) - theirs).abs().max() <= 1e-4
        going = [sum(len(c) > t for c in expected.completion_ids) for t in range(1, 24)]
        assert decoded == [next(r for r in (16, 8, 4) if r == 4 or n > r // 2) for n in going]
        [batch] = engine._batches.values()  # the smaller batches are views: no second cache
        assert sorted(batch._fronts) == [4, 8]
        for front in batch._fronts.values():
            for mine, root in zip(front.cache.keys + front.cache.values, batch.cache.keys + batch.cache.values):
                assert mine.data_ptr() == root.data_ptr() and mine.shape[0] == front.B


def test_compact_rows_rule():
    from hfnative.generation.decode_loop import compact_rows

    assert [compact_rows(n, 64, 4) for n in (33, 32, 17, 16, 5, 1, 0)] == [None, 32, 32, 16, 8, 4, 4]
    assert [compact_rows(n, 8, 4) for n in (5, 4, 1)] == [None, 4, 4]
    assert compact_rows(3, 6, 4) is None and compact_rows(2, 6, 1) == 2


def test_trainer_rollouts_compact_finished_rows(tmp_path):
    """A GRPO trainer's rollouts (its tokenized prompts, EOS, sampling settings and row streams) through its own
    engine: with a policy whose completions end at many lengths, rows still going move to the front of the batch, and
    the completions and log-probs are those of the same engine keeping every row."""
    from datasets import Dataset

    import hfnative
    from _ppo_layouts_worker import save_stopping_policy

    save_stopping_policy(tmp_path / "policy")
    prompts = [{"prompt": f"Tell me about the sea number {i}"} for i in range(8)]
    args = hfnative.GRPOConfig(output_dir=str(tmp_path / "out"), use_cpu=True, bf16=False, report_to="none",
                               max_steps=1, num_generations=8, per_device_train_batch_size=16,
                               max_completion_length=48, seed=0)
    trainer = hfnative.GRPOTrainer(model=str(tmp_path / "policy"), args=args, train_dataset=Dataset.from_list(prompts),
                                   reward_funcs=lambda completions, **kw: [0.0] * len(completions))
    rollout = trainer.objective.rollout
    prompt_ids = [ids for ids in rollout.tokenize([p["prompt"] for p in prompts]) for _ in range(2)]  # 16 rows
    rollouts = {}
    for compact in (True, False):
        rollout.engine.compact = compact
        rollouts[compact] = rollout.generate(prompt_ids, seed=3, first_row=0)
    lengths = sorted(map(len, rollouts[True].completion_ids))
    assert lengths[7] < lengths[-1], lengths  # more than half the rows end before the longest
    assert rollouts[True].completion_ids == rollouts[False].completion_ids
    diff = max(abs(a - b) for x, y in zip(rollouts[True].logprobs, rollouts[False].logprobs) for a, b in zip(x, y))
    assert diff <= 1e-5
    assert any(batch._fronts for batch in rollout.engine._batches.values())


def test_expert_counts_equal_bincount():
    from hfnative.models.moe import expert_counts

    ids = torch.randint(0, 6, (50,), generator=torch.Generator().manual_seed(0))
    assert torch.equal(expert_counts(ids, 8), torch.bincount(ids, minlength=8))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
def test_moe_decode_step_compiles(dtype):
    """A mixture-of-experts model's compiled decode step gives the eager engine's greedy tokens. In bf16 it is one
    graph with no break, as a CUDA graph captures it (the experts' token counts have a static shape, where bincount's
    length depended on the largest id read back on the host); in fp32, which the compiler's grouped_mm does not take,
    the experts' matmuls run eagerly between graphs instead of failing."""
    hf = make_hf_model("qwen3moe-topk-norm")
    greedy = SamplingParams(max_new_tokens=8, do_sample=False)
    eager = NativeRolloutEngine(load_pretrained(hf).model.to(dtype)).generate(_prompts(), greedy).completion_ids
    engine = NativeRolloutEngine(load_pretrained(hf).model.to(dtype), compile=True)
    counters.clear()  # the process's: only this generation's compiles counted
    assert engine.generate(_prompts(), greedy).completion_ids == eager
    breaks = sum(counters["graph_break"].values())
    if dtype == torch.bfloat16:
        assert breaks == 0 and counters["stats"]["unique_graphs"] == 1, dict(counters["graph_break"])
    else:
        assert breaks > 0 and all("grouped_mm" in reason for reason in counters["graph_break"])
