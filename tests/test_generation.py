"""The native rollout engine against transformers: greedy decoding token for token (ragged prompts,
sliding-window rings, EOS), log-probs against a fresh forward, the logits processing against
transformers' processors and hand-computed distributions, seeded sampling, LoRA live weights."""

import copy
from dataclasses import replace

import pytest
import torch
import torch.nn.functional as F
from hf_configs import CONFIGS, VOCAB, make_hf_model
from transformers.generation.logits_process import (
    LogitsProcessorList,
    MinPLogitsWarper,
    RepetitionPenaltyLogitsProcessor,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

from hfnative.converters.loading import load_pretrained
from hfnative.converters.rollouts import native_model
from hfnative.generation import NativeRolloutEngine, SamplingParams, generate, sampling_distribution
from hfnative.generation.sampling import choose_tokens, mix64, mix64_int, row_keys, row_uniforms
from hfnative.peft import LoraTarget, add_lora, merge_lora

# longer than every tiny config's sliding window (4..6), so decoding runs past it and the rings wrap
PROMPT_LENGTHS = [3, 9, 6, 1]
NEW_TOKENS = 12
NEAR_TIE = 1e-4  # random tiny models: where the top two logits are this close, either is greedy's answer
PAD = 0


def _prompts(seed: int = 1) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, VOCAB, (n,), generator=g).tolist() for n in PROMPT_LENGTHS]


def _transformers_greedy(reference, prompts, eos: int | None) -> list[list[int]]:
    """transformers' generate (KV cache) on the left-padded batch; completions cut after the first EOS."""
    P = max(map(len, prompts))
    ids = torch.full((len(prompts), P), PAD, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for row, prompt in enumerate(prompts):
        ids[row, P - len(prompt):], mask[row, P - len(prompt):] = torch.tensor(prompt), 1
    reference.generation_config.eos_token_id = eos  # otherwise the config's own EOS would stop it
    out = reference.generate(input_ids=ids, attention_mask=mask, max_new_tokens=NEW_TOKENS, do_sample=False,
                             eos_token_id=eos, pad_token_id=PAD, use_cache=True)
    completions = out[:, P:].tolist()
    return [c[: c.index(eos) + 1] if eos in c else c for c in completions]


def _fresh_logits(model, prompt, completion) -> torch.Tensor:
    """Logits [len(completion), V] predicting each completion token, from one uncached forward."""
    out = model(input_ids=torch.tensor([prompt + completion]))
    return out.logits[0, len(prompt) - 1 : len(prompt) + len(completion) - 1].float()


def _compare_greedy(reference, prompts, ours, theirs, stats):
    """Token for token, except at a near-tie of the fresh forward (there the sequences may part)."""
    for prompt, mine, other in zip(prompts, ours, theirs):
        for j, (a, b) in enumerate(zip(mine, other)):
            if a == b:
                continue
            logits = _fresh_logits(reference, prompt, mine[:j] + [a])[-1]
            top = logits.max()
            assert top - logits[a] <= NEAR_TIE and top - logits[b] <= NEAR_TIE, (
                f"token {j}: ours {a} ({logits[a]:.6f}), transformers {b} ({logits[b]:.6f}), max {top:.6f}"
            )
            stats["near_ties"] += 1
            break
        else:
            assert len(mine) == len(other), f"lengths differ: {mine} vs {other}"
            stats["exact"] += 1


def _check_logprobs(model, prompts, rollouts, temperature=1.0) -> float:
    worst = 0.0
    for prompt, completion, logprobs in zip(prompts, rollouts.completion_ids, rollouts.logprobs):
        logits = _fresh_logits(model, prompt, completion)
        expected = F.log_softmax(logits / temperature, -1).gather(-1, torch.tensor(completion)[:, None])[:, 0]
        worst = max(worst, (expected - torch.tensor(logprobs)).abs().max().item())
    return worst


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_greedy_matches_transformers(name):
    reference = make_hf_model(name)
    converted = load_pretrained(reference)
    prompts = _prompts()
    stats = {"exact": 0, "near_ties": 0}
    with torch.no_grad():
        theirs = _transformers_greedy(reference, prompts, eos=None)
        ours = generate(converted, prompts, max_new_tokens=NEW_TOKENS, do_sample=False)
        assert ours.finish_reason == ["length"] * len(prompts)
        _compare_greedy(reference, prompts, ours.completion_ids, theirs, stats)
        # every greedy token is the fresh forward's argmax; log-probs are its log_softmax
        for prompt, completion in zip(prompts, ours.completion_ids):
            logits = _fresh_logits(converted.model, prompt, completion)
            chosen = logits.gather(-1, torch.tensor(completion)[:, None])[:, 0]
            assert (logits.max(-1).values - chosen).max() <= NEAR_TIE
        assert _check_logprobs(converted.model, prompts, ours) <= 1e-5

        # an early EOS: a token transformers emits third in the first row
        eos = theirs[0][2]
        theirs_eos = _transformers_greedy(reference, prompts, eos=eos)
        ours_eos = generate(converted, prompts, max_new_tokens=NEW_TOKENS, do_sample=False, eos_token_id=[eos])
        _compare_greedy(reference, prompts, ours_eos.completion_ids, theirs_eos, stats)
        assert ours_eos.finish_reason[0] == "stop" and len(ours_eos.completion_ids[0]) <= 3
        for completion, reason in zip(ours_eos.completion_ids, ours_eos.finish_reason):
            assert eos not in completion[:-1]
            assert reason == ("stop" if completion[-1] == eos else "length")
            assert reason == "stop" or len(completion) == NEW_TOKENS
        assert _check_logprobs(converted.model, prompts, ours_eos) <= 1e-5
    assert stats["exact"] >= len(prompts), stats  # near-ties are rare: most rows agree throughout
    print(f"{name}: {stats}")


@pytest.mark.parametrize("name", ["qwen3-gqa", "gemma3-alternating", "gptoss-alternating-yarn"])
def test_generation_under_bf16_autocast(name):
    """fp32 weights under bf16 autocast (a trainer's bf16=True): the cache holds what attention reads, and each
    sampled token's log-prob is transformers' uncached forward's under the same autocast, to bf16 rounding."""
    reference = make_hf_model(name)
    converted = load_pretrained(reference)
    prompts = _prompts(seed=3)
    sampling = SamplingParams(max_new_tokens=NEW_TOKENS, do_sample=True, seed=0)
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        rollouts = NativeRolloutEngine(converted).generate(prompts, sampling)
        assert rollouts.finish_reason == ["length"] * len(prompts)
        worst = _check_logprobs(reference, prompts, rollouts)
    # measured 5e-4 to 2e-3 (the two differ only in bf16 rounding); before the fix, the prefill's cache write failed
    assert worst <= 0.02, f"{name}: max |Δ log-prob| {worst:.3f} against transformers under the same autocast"


def test_stop_token_ids_and_compiled_decode_step():
    """stop_token_ids stop like an EOS; the compiled decode step gives the eager engine's tokens."""
    converted = load_pretrained(make_hf_model("gemma3-alternating"))  # sliding rings, local RoPE, soft norms
    prompts = _prompts(seed=2)
    eager = NativeRolloutEngine(converted)
    greedy = SamplingParams(max_new_tokens=NEW_TOKENS, do_sample=False)
    plain = eager.generate(prompts, greedy)
    stop = plain.completion_ids[1][4]
    by_eos = eager.generate(prompts, SamplingParams(max_new_tokens=NEW_TOKENS, do_sample=False, eos_token_id=stop))
    by_stop = eager.generate(prompts, SamplingParams(max_new_tokens=NEW_TOKENS, do_sample=False, stop_token_ids=[stop]))
    assert by_eos == by_stop and by_eos.finish_reason[1] == "stop"
    assert by_eos.completion_ids[1] == plain.completion_ids[1][: plain.completion_ids[1].index(stop) + 1]

    compiled = NativeRolloutEngine(converted, compile=True).generate(prompts, greedy)
    assert compiled.completion_ids == plain.completion_ids
    diff = max(abs(a - b) for x, y in zip(compiled.logprobs, plain.logprobs) for a, b in zip(x, y))
    assert diff <= 1e-5


# --- logits processing ---------------------------------------------------------------------------


def _distribution(logits, **settings):
    sampling = SamplingParams(max_new_tokens=1, **settings)
    return sampling_distribution(torch.as_tensor(logits, dtype=torch.float32)[None], sampling)[0]


PROBS = torch.tensor([0.5, 0.2, 0.15, 0.1, 0.05])


@pytest.mark.parametrize(
    "settings, expected",
    [
        (dict(), PROBS),
        (dict(top_k=2), torch.tensor([0.5, 0.2, 0, 0, 0]) / 0.7),
        (dict(top_p=0.8), torch.tensor([0.5, 0.2, 0.15, 0, 0]) / 0.85),  # smallest set reaching 0.8
        (dict(top_p=0.3), torch.tensor([1.0, 0, 0, 0, 0])),
        (dict(min_p=0.35), torch.tensor([0.5, 0.2, 0, 0, 0]) / 0.7),  # p >= 0.35 * 0.5
        (dict(temperature=2.0), PROBS.sqrt() / PROBS.sqrt().sum()),
        (dict(temperature=0.5), PROBS**2 / (PROBS**2).sum()),
        # temperature first, then top-k, top-p over the renormalized survivors, then min-p
        (dict(temperature=0.5, top_k=4, top_p=0.95), torch.tensor([0.25, 0.04, 0.0225, 0, 0]) / 0.3125),
        (dict(do_sample=False, top_k=3, temperature=0.1), torch.tensor([1.0, 0, 0, 0, 0])),
    ],
)
def test_sampling_distribution_hand_computed(settings, expected):
    got = _distribution(PROBS.log() + 3.0, **settings)
    assert torch.allclose(got, expected.float(), atol=1e-6), (got, expected)


def test_repetition_penalty_hand_computed():
    logits = torch.tensor([[2.0, -1.0, 0.5, 0.0, 1.2]])
    seen = torch.tensor([[True, True, False, True, False]])
    sampling = SamplingParams(max_new_tokens=1, repetition_penalty=2.0)
    expected = torch.softmax(torch.tensor([1.0, -2.0, 0.5, 0.0, 1.2]), -1)  # seen: / 2 when > 0, * 2 when < 0
    assert torch.allclose(sampling_distribution(logits, sampling, seen)[0], expected, atol=1e-6)
    greedy = SamplingParams(max_new_tokens=1, do_sample=False, repetition_penalty=2.0)
    assert sampling_distribution(logits, greedy, seen)[0].argmax().item() == 4  # 2.0 -> 1.0 falls below 1.2
    assert sampling_distribution(logits, SamplingParams(max_new_tokens=1, do_sample=False), seen)[0].argmax().item() == 0


@pytest.mark.parametrize(
    "settings",
    [
        dict(temperature=0.7, top_k=10, top_p=0.9, min_p=0.05, repetition_penalty=1.3),
        dict(temperature=1.5, top_p=0.5),
        dict(top_k=1),
        dict(min_p=0.2, repetition_penalty=0.8),
    ],
)
def test_processing_matches_transformers_processors(settings):
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(6, VOCAB, generator=g) * 3
    history = torch.randint(0, VOCAB, (6, 20), generator=g)
    seen = torch.zeros(6, VOCAB, dtype=torch.bool).scatter_(1, history, True)
    processors = LogitsProcessorList()
    if "repetition_penalty" in settings:
        processors.append(RepetitionPenaltyLogitsProcessor(settings["repetition_penalty"]))
    if "temperature" in settings:
        processors.append(TemperatureLogitsWarper(settings["temperature"]))
    if "top_k" in settings:
        processors.append(TopKLogitsWarper(settings["top_k"]))
    if "top_p" in settings:
        processors.append(TopPLogitsWarper(settings["top_p"]))
    if "min_p" in settings:
        processors.append(MinPLogitsWarper(settings["min_p"]))
    expected = torch.softmax(processors(history, logits.clone()), -1)
    got = sampling_distribution(logits, SamplingParams(max_new_tokens=1, **settings), seen)
    assert torch.equal(got > 0, expected > 0)  # exactly the same tokens kept
    assert torch.allclose(got, expected, atol=1e-6)


@pytest.mark.parametrize("streams", ["global RNG", "per-row streams"])
def test_sampling_draws_from_the_processed_distribution(streams):
    """20,000 draws through choose_tokens (torch's RNG, or one stream per row at two decode steps): filtered tokens
    never come up, the rest at their weights; log-probs are log_softmax(logits / temperature) before the filtering."""
    logits = (PROBS.log() + 1.0).expand(20_000, 5)
    sampling = SamplingParams(max_new_tokens=1, temperature=0.5, top_k=4, top_p=0.95)
    expected = torch.tensor([0.25, 0.04, 0.0225, 0, 0]) / 0.3125
    torch.manual_seed(0)
    keys = row_keys(7, 0, 20_000) if streams == "per-row streams" else None
    for step in (0, 1):
        tokens, logprobs = choose_tokens(logits, sampling, row_keys_B=keys, step=step)
        frequencies = torch.bincount(tokens, minlength=5).float() / len(tokens)
        assert frequencies[3:].sum() == 0 and (frequencies - expected).abs().max() < 0.01
        assert torch.allclose(logprobs, F.log_softmax(logits / 0.5, -1).gather(-1, tokens[:, None])[:, 0])


def test_row_streams_are_splitmix64_and_independent_of_the_batch():
    """The tensor hash equals the exact integer one (int64 wrap-around and logical shifts hold on this platform);
    a row's uniforms depend on (seed, row, step) only, and differ between rows, steps and seeds."""
    values = torch.tensor([0, 1, -1, 2**62 + 12345, -(2**63), 2**63 - 1, 987654321987654321], dtype=torch.int64)
    assert mix64(values).tolist() == [mix64_int(v) for v in values.tolist()]
    whole = row_uniforms(row_keys(5, 0, 12), step=3)
    assert torch.equal(torch.cat([row_uniforms(row_keys(5, 0, 4), 3), row_uniforms(row_keys(5, 4, 8), 3)]), whole)
    assert len(set(whole.tolist())) == 12 and ((whole >= 0) & (whole < 1)).all()
    assert not torch.equal(row_uniforms(row_keys(5, 0, 12), 4), whole)
    assert not torch.equal(row_uniforms(row_keys(6, 0, 12), 3), whole)


def test_seeded_rows_sample_alike_however_the_batch_is_cut():
    """With a seed, a row's completion depends on its place in the whole batch, not on the rows beside it: the
    batch in one call, in calls of 2 rows with their first_row (as data-parallel ranks complete their shares), and
    with max_batch_size=1 give the same samples."""
    converted = load_pretrained(make_hf_model("qwen3-gqa"))
    prompts = _prompts(seed=5)
    sampling = SamplingParams(max_new_tokens=NEW_TOKENS, temperature=1.0, seed=11)
    whole = NativeRolloutEngine(converted).generate(prompts, sampling)
    parts = [NativeRolloutEngine(converted).generate(prompts[i : i + 2], replace(sampling, first_row=i))
             for i in range(0, len(prompts), 2)]
    assert [c for part in parts for c in part.completion_ids] == whole.completion_ids
    assert NativeRolloutEngine(converted, max_batch_size=1).generate(prompts, sampling).completion_ids == whole.completion_ids
    assert len({tuple(c) for c in whole.completion_ids}) > 1
    # rows that are not consecutive (a later turn of a multi-turn rollout) keep their streams by row_indices
    rows = [3, 0, len(prompts) - 1]
    subset = NativeRolloutEngine(converted, max_batch_size=2).generate(
        [prompts[r] for r in rows], replace(sampling, row_indices=tuple(rows)))
    assert subset.completion_ids == [whole.completion_ids[r] for r in rows]
    with pytest.raises(ValueError, match="first_row"):
        SamplingParams(max_new_tokens=1, first_row=-1)
    with pytest.raises(ValueError, match="row_indices"):
        SamplingParams(max_new_tokens=1, row_indices=(1, -2))


def test_seeded_sampling_is_reproducible_and_filtered():
    converted = load_pretrained(make_hf_model("qwen3-gqa"))
    engine, prompts = NativeRolloutEngine(converted), _prompts(seed=3)
    sampling = SamplingParams(max_new_tokens=NEW_TOKENS, temperature=0.7, top_k=5, top_p=0.9, seed=123)
    first, again = engine.generate(prompts, sampling), engine.generate(prompts, sampling)
    assert first == again
    other = engine.generate(prompts, SamplingParams(max_new_tokens=NEW_TOKENS, temperature=0.7, top_k=5, top_p=0.9, seed=124))
    assert other.completion_ids != first.completion_ids
    with torch.no_grad():
        assert _check_logprobs(converted.model, prompts, first, temperature=0.7) <= 1e-5
        for prompt, completion in zip(prompts, first.completion_ids):  # every draw is among the top 5
            logits = _fresh_logits(converted.model, prompt, completion)
            fifth = logits.topk(5, -1).values[:, -1]
            assert (logits.gather(-1, torch.tensor(completion)[:, None])[:, 0] >= fifth - NEAR_TIE).all()


# --- live weights: LoRA, load_weights ---------------------------------------------------------------


def _check_live(model, parameters, scale: float, steps: int):
    """Perturb ``parameters`` in place ``steps`` times (as optimizer steps do); after each, the engine made before on
    ``model`` gives the merged model's greedy output and log-probs. Returns the engine, the last merged model and the
    prompts."""
    engine, prompts = NativeRolloutEngine(model), _prompts(seed=4)
    greedy = SamplingParams(max_new_tokens=NEW_TOKENS, do_sample=False)
    base = engine.generate(prompts, greedy)
    stats = {"exact": 0, "near_ties": 0}
    with torch.no_grad():
        for _ in range(steps):
            for p in parameters:
                p.add_(torch.randn_like(p) * scale)
            merged = merge_lora(copy.deepcopy(model)).eval()
            ours = engine.generate(prompts, greedy)
            assert ours.completion_ids != base.completion_ids
            expected = NativeRolloutEngine(merged).generate(prompts, greedy)
            _compare_greedy(merged, prompts, ours.completion_ids, expected.completion_ids, stats)
            assert _check_logprobs(merged, prompts, ours) <= 1e-5
    assert stats["exact"] >= len(prompts), stats
    return engine, merged, prompts


def test_lora_adapters_are_live():
    """The engine runs the model's adapters as they are now: the merged model's greedy output, before
    and after an in-place update (as an optimizer step makes it)."""
    converted = load_pretrained(make_hf_model("llama-gqa"))
    model = converted.model
    names = [f"layers.{i}.{m}" for i in range(model.args.n_layers)
             for m in ("attention.wq", "attention.wv", "feed_forward.w1", "feed_forward.w2")]
    add_lora(model, [LoraTarget((name,), r=4, lora_alpha=8) for name in names], {"r": 4, "lora_alpha": 8})
    _check_live(model, [p for n, p in model.named_parameters() if n.endswith("lora_B")], scale=0.5, steps=2)


@pytest.mark.parametrize("checkpoint, indices", [
    ("qwen3-mha-tied-bias", list(range(0, 96, 2))),  # tied: the head applies the embedding's rows
    ("llama-gqa", {"embed_tokens": list(range(0, 96, 2)), "lm_head": list(range(1, 96, 3))}),
])
def test_trained_token_rows_are_live(checkpoint, indices):
    """trainable_token_indices: the engine embeds and projects with the trained rows as they are now, the model's own
    and (under bf16 autocast) its decoded replica's: the merged model's greedy output and log-probs."""
    from hfnative.converters.peft import apply_lora

    converted = load_pretrained(make_hf_model(checkpoint))
    model = converted.model
    apply_lora(converted, {"r": 4, "lora_alpha": 8, "target_modules": ["q_proj"], "trainable_token_indices": indices})
    rows = [p for n, p in model.named_parameters() if ".token_rows." in n]
    engine, merged, prompts = _check_live(model, rows, scale=2.0, steps=1)
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):  # the replica's bf16 head copy, rows applied
        replica = engine._weights.model_for(model, torch.bfloat16)
        merged_replica = NativeRolloutEngine(merged)._weights.model_for(merged, torch.bfloat16)
        ids = torch.tensor([prompts[0]])
        torch.testing.assert_close(replica(ids).logits, merged_replica(ids).logits, rtol=0, atol=1e-5)


def test_load_weights_copies_by_native_name():
    reference = load_pretrained(make_hf_model("qwen3-gqa", seed=5)).model
    engine = NativeRolloutEngine(load_pretrained(make_hf_model("qwen3-gqa", seed=6)))
    engine.load_weights(reference.state_dict().items())
    engine.load_weights(engine.model.state_dict().items())  # its own tensors: nothing to copy
    greedy = SamplingParams(max_new_tokens=NEW_TOKENS, do_sample=False)
    assert engine.generate(_prompts(), greedy) == NativeRolloutEngine(reference).generate(_prompts(), greedy)
    with pytest.raises(ValueError, match="no tensor named 'layers.0.attention.q_proj.weight'"):
        engine.load_weights([("layers.0.attention.q_proj.weight", torch.zeros(1))])
    with pytest.raises(ValueError, match="shape"):
        engine.load_weights([("norm.weight", torch.zeros(3))])


def test_bad_input_is_named():
    converted = load_pretrained(make_hf_model("llama-gqa"))
    with pytest.raises(ValueError, match="prompt 1 is empty"):
        generate(converted, [[1, 2], []], max_new_tokens=2)
    with pytest.raises(ValueError, match=rf"prompt 0 holds {VOCAB}"):
        generate(converted, [[1, VOCAB]], max_new_tokens=2)
    with pytest.raises(ValueError, match="top_p"):
        generate(converted, [[1]], max_new_tokens=2, top_p=0.0)
    with pytest.raises(ValueError, match="temperature"):
        generate(converted, [[1]], max_new_tokens=2, temperature=0.0)
    with pytest.raises(ValueError, match="needs an hfnative Transformer.*load_pretrained"):
        generate(object(), [[1]], max_new_tokens=2)
    with pytest.raises(ValueError, match="expected a checkpoint folder"):
        native_model(object())


def test_native_model_of_a_folder_an_object_or_a_native_model(tmp_path):
    """``native_model`` (the trainers' way to any model's decoder) converts a checkpoint folder or a transformers
    model, and passes a native model (or the one a ConvertedModel holds) through as it is."""
    reference = make_hf_model("llama-gqa")
    reference.save_pretrained(tmp_path)
    converted = load_pretrained(reference)
    assert native_model(converted) is converted.model and native_model(converted.model) is converted.model
    prompts, greedy = _prompts(), SamplingParams(max_new_tokens=NEW_TOKENS, do_sample=False)
    expected = NativeRolloutEngine(converted).generate(prompts, greedy)
    for given in (reference, str(tmp_path)):
        assert NativeRolloutEngine(native_model(given)).generate(prompts, greedy) == expected
