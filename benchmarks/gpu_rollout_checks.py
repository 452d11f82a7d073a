"""The native rollout engine on a device (``gpu_checks.py generation`` runs both checks):

generation: its decode step as each way runs it — uncaptured (eager, the cache read up to the current slot), captured in
a CUDA graph (the default on CUDA; static shapes), compiled and captured (``--compiled``: that way alone, a check of
its own, since its compiles from a cold cache take minutes) — on tiny models in fp32, called twice each (capture, then
replay): the same greedy tokens and seeded samples as the uncaptured engine, and log-probs within 1e-4 of transformers'
uncached forward on the same tokens.

unseeded sampling: torch's global generator in a captured step (``unseeded_sampling``). MoE rollouts: a mixture of
experts under bf16 autocast, captured where its grouped matmuls can be (``moe_rollouts``).

rollouts between steps: as a trainer with ``bf16=True`` uses it, under bf16 autocast over fp32 weights (the engine
decodes a bf16 replica of the matmul weights, refreshed every call; a LoRA or DoRA policy's layers folded into bf16
copies of ``W + s B A``, the engine's default on CUDA), with a fused AdamW step (the default optimizer) between calls:
each call's tokens are those of an uncaptured engine made afresh, of the plain model or, for adapters, of the model
with its adapters merged (``merge_lora``: the same bf16 weights).
"""

from __future__ import annotations

import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.nn.functional as F
import transformers

from hfnative.converters.loading import load_pretrained

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from hf_configs import save_hf_model  # noqa: E402  (the parity tests' models)


def _logprob_gap(reference, prompts: list[list[int]], rollouts, sampling, device: torch.device) -> float:
    """The largest |log-prob| difference between ``rollouts`` (the engine's, for ``prompts``) and transformers'
    ``reference`` model's uncached forward over the same tokens, at the sampling's log-prob temperature."""
    worst = 0.0
    with torch.no_grad():
        for prompt, completion, logprobs in zip(prompts, rollouts.completion_ids, rollouts.logprobs):
            logits = reference(input_ids=torch.tensor([prompt + completion], device=device)).logits[0]
            logits = logits[len(prompt) - 1 : -1].float() / sampling.logprob_temperature
            theirs = F.log_softmax(logits, -1).gather(-1, torch.tensor(completion, device=device)[:, None])
            worst = max(worst, (theirs[:, 0].cpu() - torch.tensor(logprobs)).abs().max().item())
    return worst


def generation(tally, device: torch.device, configs=("gemma3-alternating",), compiled: bool = False) -> None:
    """Each way's decode step against the uncaptured engine's tokens and transformers' log-probs: uncaptured and (on
    CUDA) captured, or with ``compiled`` the compiled (and captured) way alone, whose compiles from a cold cache take
    minutes on a fresh machine (``gpu_checks.py generation --compiled``, a check of its own)."""
    import contextlib
    import functools
    from unittest import mock

    from hfnative.generation import NativeRolloutEngine, SamplingParams, native
    from hfnative.generation.decode_loop import LiveRows

    prompts = [list(range(3, 3 + n)) for n in (3, 9, 6, 1)]
    for config in configs:
        with tempfile.TemporaryDirectory() as folder:
            save_hf_model(config, folder)
            reference = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).to(device).eval()
            converted = load_pretrained(folder, dtype=torch.float32, device=device)
        if compiled:
            ways = {"compiled" + (" + cuda graph" if device.type == "cuda" else ""): dict(compile=True)}
        else:
            ways = {"uncaptured": dict(cuda_graph=False)}
            if device.type == "cuda":
                ways["cuda graph"] = dict(cuda_graph=True)
        engines = {way: NativeRolloutEngine(converted, **kwargs) for way, kwargs in ways.items()}
        kept = NativeRolloutEngine(converted, cuda_graph=False, compact=False)
        # 16 rows that end at many lengths (stop ids: tokens rows 0, 1, 2, ... make at steps 0, 3, 6, ... without
        # them), so rows still going move to the front of the buffers while decoding; the host learns how many are
        # going at every step (on CUDA it lags by up to 32 steps, past this call's end)
        many = [list(range(3 + i, 3 + i + 1 + i % 7)) for i in range(16)]
        free = kept.generate(many, SamplingParams(max_new_tokens=24, seed=5, temperature=0.9)).completion_ids
        stops = [c[p] for c, p in zip(free, range(0, 24, 3))]
        kinds = [("greedy", prompts, SamplingParams(max_new_tokens=16, do_sample=False)),
                 ("sampled", prompts, SamplingParams(max_new_tokens=16, seed=3, temperature=0.9)),
                 ("stopping, rows compacted", many,
                  SamplingParams(max_new_tokens=24, seed=5, temperature=0.9, eos_token_id=stops))]
        # a CPU rehearsal of the compiled way: not the sampled kind (its compiles)
        for kind, rows, sampling in kinds if device.type == "cuda" or not compiled else [kinds[0], kinds[2]]:
            expected = kept.generate(rows, sampling)
            for way, engine in engines.items():
                label = f"generation {config} {kind}, {way}"
                every_step = kind.startswith("stopping")
                try:
                    start = time.perf_counter()
                    with mock.patch.object(native, "LiveRows", functools.partial(LiveRows, every=1, lead=0)) \
                            if every_step else contextlib.nullcontext():
                        results = [engine.generate(rows, sampling) for _ in range(2)]
                    seconds = time.perf_counter() - start
                except Exception as err:  # a failure of one way is reported, the others still run
                    tally("FAIL", label, f"{type(err).__name__}: {str(err).splitlines()[0][:120]}")
                    continue
                same = all(r.completion_ids == expected.completion_ids for r in results)
                fronts = sorted({rows for batch in engine._batches.values() for rows in batch._fronts})
                if every_step and not fronts:
                    tally("FAIL", label, "no rows were compacted")
                    continue
                worst = _logprob_gap(reference, rows, results[-1], sampling, device)
                tally.check(same and worst <= 1e-4, label,
                            f"tokens {'equal' if same else 'DIFFER'} to uncaptured, uncompacted; max|Δ log-prob| vs "
                            f"transformers {worst:.1e}; two calls {seconds:.2f} s"
                            + (f"; compacted to {fronts} rows" if every_step else ""))


def rollouts_between_steps(tally, device: torch.device, config: str = "qwen3-gqa", steps: int = 2) -> None:
    import copy

    from hfnative.generation import NativeRolloutEngine, SamplingParams
    from hfnative.peft.adapters import add_lora, merge_lora

    prompts = [list(range(3, 3 + n)) for n in (3, 9, 6, 1)]
    sampling = SamplingParams(max_new_tokens=12, do_sample=False)
    for adapters in (None, "LoRA", "DoRA"):
        with tempfile.TemporaryDirectory() as folder:
            save_hf_model(config, folder)
            model = load_pretrained(folder, dtype=torch.float32, device=device).model
        if adapters:
            _add_adapters(model, add_lora, dora=adapters == "DoRA")
        trained = [p for p in model.parameters() if p.requires_grad]
        engine = NativeRolloutEngine(model)  # on CUDA: captured, its replica refreshed in place at every call
        if device.type != "cuda":
            engine.fold_adapters = True  # the default on CUDA where the copies fit (a tiny model's do)
        optimizer = torch.optim.AdamW(trained, lr=0.05, fused=True)
        label = f"rollouts between fused AdamW steps, bf16 autocast, {config}{f' + {adapters}' if adapters else ''}"
        detail, ok, previous = [], True, None
        try:
            for step in range(steps + 1):
                with torch.autocast(device.type, dtype=torch.bfloat16):  # a trainer's bf16=True, one region a step
                    ours = engine.generate(prompts, sampling).completion_ids
                    # an uncaptured engine of its own: a replica made afresh from the weights as they are now
                    decoded = model
                    if adapters:
                        with torch.autocast(device.type, enabled=False):  # merged in float32, as the engine folds
                            decoded = merge_lora(copy.deepcopy(model))
                    theirs = NativeRolloutEngine(decoded, cuda_graph=False).generate(prompts, sampling).completion_ids
                same = ours == theirs
                moved = previous is None or ours != previous
                ok &= same and moved
                detail.append(f"step {step}: {'same' if same else 'DIFFERENT'} tokens"
                              + ("" if moved else ", NOT moved by the step"))
                previous = ours
                for parameter in trained:
                    parameter.grad = torch.randn_like(parameter)
                optimizer.step()
        except Exception as err:  # reported; the other model still runs
            tally("FAIL", label, f"{type(err).__name__}: {str(err).splitlines()[0][:120]}")
            continue
        if adapters:
            folded = len(engine._weights.folds)
            ok &= folded > 0
            detail.append(f"{folded} layers folded")
        tally.check(ok, label, "; ".join(detail))


def unseeded_sampling(tally, device: torch.device, config: str = "qwen3-gqa") -> None:
    """Sampling from torch's global generator (no seed: ``torch.multinomial``) in the engine's default way (on CUDA
    captured: the default CUDA generator's offsets advance at every replay, and multinomial's checks must not read the
    device on the host): the step is captured with no failed capture, two calls draw different completions, and the
    log-probs equal transformers' on the tokens drawn (fp32, within 1e-4)."""
    from hfnative.generation import NativeRolloutEngine, SamplingParams

    prompts = [list(range(3, 3 + n)) for n in (3, 9, 6, 1)]
    sampling = SamplingParams(max_new_tokens=16, temperature=0.9)
    label = f"unseeded sampling, {config}"
    try:
        with tempfile.TemporaryDirectory() as folder:
            save_hf_model(config, folder)
            reference = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).to(device).eval()
            converted = load_pretrained(folder, dtype=torch.float32, device=device)
        engine = NativeRolloutEngine(converted)
        results = [engine.generate(prompts, sampling) for _ in range(3)]
    except Exception as err:  # reported; the other checks still run
        tally("FAIL", label, f"{type(err).__name__}: {str(err).splitlines()[0][:120]}")
        return
    captured = any(runner.graph is not None for batch in engine._batches.values() for runner in batch.runners.values())
    failed = engine._capture.failed
    differ = results[1].completion_ids != results[2].completion_ids  # replays draw afresh
    worst = _logprob_gap(reference, prompts, results[-1], sampling, device)
    tally.check(failed is None and captured == (device.type == "cuda") and differ and worst <= 1e-4, label,
                f"captured {captured}; calls {'differ' if differ else 'REPEAT'}; max|Δ log-prob| vs transformers "
                f"{worst:.1e}" + (f"; capture FAILED: {failed[:120]}" if failed else ""))


def moe_rollouts(tally, device: torch.device, config: str = "qwen3moe-topk-norm") -> None:
    """A mixture of experts decoded as a trainer with ``bf16=True`` decodes it (fp32 weights, bf16 autocast): the
    replica's experts in bf16, their grouped matmuls in bf16; on a GPU whose bf16 grouped matmul reads nothing on the
    host (compute capability 9.x, 10.x) the step is captured in a CUDA graph, elsewhere it runs uncaptured (known
    before trying). The same greedy tokens as an uncaptured engine, over two calls; a capture that was tried and
    failed is a FAIL (the engine's prediction was wrong)."""
    from hfnative.generation import NativeRolloutEngine, SamplingParams, native

    prompts = [list(range(3, 3 + n)) for n in (3, 9, 6, 1)]
    sampling = SamplingParams(max_new_tokens=16, do_sample=False)
    label = f"MoE rollouts, bf16 autocast, {config}"
    try:
        with tempfile.TemporaryDirectory() as folder:
            save_hf_model(config, folder)
            model = load_pretrained(folder, dtype=torch.float32, device=device).model
        engine = NativeRolloutEngine(model)
        with torch.autocast(device.type, dtype=torch.bfloat16):
            ours = [engine.generate(prompts, sampling).completion_ids for _ in range(2)]
            theirs = NativeRolloutEngine(model, cuda_graph=False).generate(prompts, sampling).completion_ids
            expected = device.type == "cuda" and native.graph_capturable(engine._weights.replica or model, device)
    except Exception as err:  # reported; the other checks still run
        tally("FAIL", label, f"{type(err).__name__}: {str(err).splitlines()[0][:120]}")
        return
    captured = any(runner.graph is not None for batch in engine._batches.values() for runner in batch.runners.values())
    failed = engine._capture.failed
    same = all(tokens == theirs for tokens in ours)
    capability = torch.cuda.get_device_capability(device) if device.type == "cuda" else None
    tally.check(same and failed is None and captured == expected, label,
                f"tokens {'equal' if same else 'DIFFER'} to uncaptured; captured {captured} (expected {expected}, "
                f"compute capability {capability})" + (f"; capture FAILED: {failed[:120]}" if failed else ""))


def _add_adapters(model, add_lora, dora: bool) -> None:
    """LoRA (DoRA) adapters on every block's projections, trainable, the base frozen (B starts at zero: the steps move
    it)."""
    from torch import nn

    from hfnative.peft.adapters import LoraTarget

    for parameter in model.parameters():
        parameter.requires_grad_(False)
    names = [name for name, module in model.named_modules() if name.startswith("layers.") and isinstance(module, nn.Linear)]
    add_lora(model, [LoraTarget((name,), r=4, lora_alpha=8) for name in names], {"r": 4, "lora_alpha": 8, "use_dora": dora})
