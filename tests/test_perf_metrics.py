"""The perf/ metrics: FLOPs per token against a hand count of the matmuls (a dense, a MoE and a sliding-window config)
and TRL's compute_flops_per_token; the device peaks against TRL's table; and every trainer's logs carrying the
metrics, finite and positive, consistent with what the run trained (tokens against num_tokens, FLOPs per trained
token between the hand count's bounds, a frozen model's forward counted once, MFU against the given peak)."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from datasets import Dataset
from transformers import AutoTokenizer, Qwen3Config, Qwen3MoeConfig

import hfnative
from hfnative.allocator import heap_stats
from hfnative.metrics import forward_flops_per_token, listed_peak_flops, measured_matmul_flops, training_flops_per_token
from hfnative.models.args import ModelArgs, MoEArgs

ROOT = Path(__file__).resolve().parents[1]
MODEL = str(ROOT / "examples" / "tiny-qwen3")
TEACHER = str(ROOT / "examples" / "tiny-qwen3-teacher")
DATA = ROOT / "examples" / "data"


# --- FLOPs per token: a hand count -------------------------------------------------------------------------


def hand_count(vocab, dim, layers, heads, kv_heads, head_dim, dense_width, seq_len, moe=None, spans=None):
    """Forward FLOPs of one token, from the matmuls it goes through (2 FLOPs per multiply-add): per layer wq
    [dim -> heads*head_dim], wk and wv [dim -> kv_heads*head_dim], wo [heads*head_dim -> dim], the scores q.k and
    attention.v over the positions it attends to (``spans[layer]``, default seq_len), then either the gated MLP
    (w1, w3 [dim -> dense_width], w2 [dense_width -> dim]) or, on the layers in ``moe["layers"]``, the router
    [dim -> experts] and top_k experts (each a gated MLP of moe["width"]); then the head [dim -> vocab]."""
    total = 0
    for layer in range(layers):
        span = seq_len if spans is None else spans[layer]
        q, kv = heads * head_dim, kv_heads * head_dim
        total += 2 * (dim * q + dim * kv + dim * kv + q * dim)
        total += 2 * heads * head_dim * span + 2 * heads * head_dim * span
        if moe is not None and layer in moe["layers"]:
            total += 2 * dim * moe["experts"] + moe["top_k"] * 2 * (dim * moe["width"] * 2 + moe["width"] * dim)
        else:
            total += 2 * (dim * dense_width * 2 + dense_width * dim)
    return total + 2 * dim * vocab


def test_dense_flops_per_token_equal_the_hand_count_and_trls():
    from trl.trainer.utils import compute_flops_per_token

    config = Qwen3Config(vocab_size=64, hidden_size=16, intermediate_size=24, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, head_dim=4, tie_word_embeddings=True)
    from hfnative.converters.families.qwen3 import config_to_args

    args = config_to_args(config)
    for seq_len in (1, 10, 37):
        # 2 x (1536 + 2304 + 64 seq_len) over the layers, 2048 for the (tied) head
        expected = hand_count(64, 16, 2, 4, 2, 4, 24, seq_len)
        assert expected == 2 * (1536 + 2304 + 64 * seq_len) + 2048
        assert forward_flops_per_token(args, seq_len) == expected
        assert training_flops_per_token(args, seq_len) == 3 * expected == compute_flops_per_token(config, seq_len)


def test_moe_flops_per_token_count_the_router_and_the_active_experts_only():
    from trl.trainer.utils import compute_flops_per_token

    from hfnative.converters.families.qwen3_moe import config_to_args

    settings = dict(vocab_size=64, hidden_size=16, intermediate_size=40, moe_intermediate_size=8, num_hidden_layers=3,
                    num_attention_heads=4, num_key_value_heads=2, head_dim=4, num_experts=6, num_experts_per_tok=2)
    moe = dict(experts=6, top_k=2, width=8, layers={0, 1, 2})
    every_layer = Qwen3MoeConfig(**settings)  # TRL's count takes every layer as sparse
    expected = hand_count(64, 16, 3, 4, 2, 4, 40, 10, moe=moe)
    assert expected == 3 * (1536 + 64 * 10 + 192 + 2 * 768) + 2048
    assert forward_flops_per_token(config_to_args(every_layer), 10) == expected
    assert training_flops_per_token(config_to_args(every_layer), 10) == compute_flops_per_token(every_layer, 10)
    one_dense = Qwen3MoeConfig(**settings, mlp_only_layers=[1])  # layer 1 is a dense MLP of intermediate_size
    expected = hand_count(64, 16, 3, 4, 2, 4, 40, 10, moe={**moe, "layers": {0, 2}})
    assert expected == 3 * (1536 + 640) + 2 * (192 + 1536) + 3840 + 2048
    assert forward_flops_per_token(config_to_args(one_dense), 10) == expected


def test_sliding_window_classifier_and_mixed_moe_layers():
    args = ModelArgs(vocab_size=64, dim=16, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=4, intermediate_size=24,
                     sliding_window=4, layer_types=["sliding_attention", "full_attention"])
    assert forward_flops_per_token(args, 10) == hand_count(64, 16, 2, 4, 2, 4, 24, 10, spans=[4, 10])
    assert forward_flops_per_token(args, 3) == hand_count(64, 16, 2, 4, 2, 4, 24, 3, spans=[3, 3])
    classifier = ModelArgs(vocab_size=64, dim=16, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=4, intermediate_size=24,
                           num_labels=1)
    assert forward_flops_per_token(classifier, 10) == hand_count(64, 16, 2, 4, 2, 4, 24, 10) - 2 * 16 * 64  # no LM head
    moe_args = ModelArgs(vocab_size=64, dim=16, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=4, intermediate_size=24,
                         moe=MoEArgs(num_experts=4, top_k=1, intermediate_size=8), moe_layers=[False, True])
    assert forward_flops_per_token(moe_args, 5) == hand_count(64, 16, 2, 4, 2, 4, 24, 5,
                                                              moe=dict(experts=4, top_k=1, width=8, layers={1}))


# --- the device's peak ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["NVIDIA H100 80GB HBM3", "NVIDIA H100 PCIe", "NVIDIA H100 NVL", "NVIDIA H200",
                                  "NVIDIA H200 NVL", "NVIDIA A100-SXM4-80GB", "NVIDIA A100 80GB PCIe", "NVIDIA L40S",
                                  "NVIDIA L4", "NVIDIA B200", "NVIDIA A10G", "Tesla T4", "AMD Instinct MI300X",
                                  "NVIDIA GeForce RTX 4090"])
def test_listed_bf16_peaks_are_trls(name):
    from trl.trainer.utils import get_peak_flops

    assert listed_peak_flops(name, torch.bfloat16) == get_peak_flops(name, "bfloat16")
    assert listed_peak_flops(name, torch.float32) is None  # the table lists the 16-bit tensor-core peaks only
    if get_peak_flops(name, "float16") is not None:  # (TRL leaves float16 out for the B-series and AMD parts)
        assert listed_peak_flops(name, torch.float16) == get_peak_flops(name, "float16")


def test_the_cpu_peak_is_measured_once_per_process():
    first = measured_matmul_flops(torch.float32)
    hits = measured_matmul_flops.cache_info().hits
    assert 1e8 < first < 1e14 and measured_matmul_flops(torch.float32) == first
    assert measured_matmul_flops.cache_info().hits == hits + 1


def test_measuring_the_cpu_peak_leaves_torchs_rng_alone():
    """How many operands the measurement draws depends on the timing: from torch's global RNG it would leave each
    process in another state, and GRPO's batch shuffle (torch.randperm, as TRL's) would then order the rows of one
    batch differently on its tensor-parallel ranks."""
    measured_matmul_flops.cache_clear()
    state = torch.get_rng_state()
    measured_matmul_flops(torch.float32)
    assert torch.equal(torch.get_rng_state(), state)


def test_a_cpu_low_precision_peak_is_at_least_the_fp32_rate():
    """A CPU without bf16 kernels multiplies bf16 far below fp32; the engine's head runs in fp32 there, so the peak an
    MFU is taken against is the faster of the two (else a bf16 run could log an MFU above 100%)."""
    from hfnative.metrics import device_peak_flops

    cpu = torch.device("cpu")
    expected = max(measured_matmul_flops(torch.bfloat16), measured_matmul_flops(torch.float32))
    assert device_peak_flops(cpu, torch.bfloat16) == expected >= device_peak_flops(cpu, torch.float32)


@pytest.mark.parametrize("bf16_rate, warns", [(1e9, True), (50e9, False)])
def test_bf16_on_a_cpu_without_bf16_kernels_warns(monkeypatch, caplog, bf16_rate, warns):
    from hfnative.trainers.loop import performance

    from hfnative import metrics

    rates = {torch.bfloat16: bf16_rate, torch.float32: 80e9}
    for module in (metrics, performance):
        monkeypatch.setattr(module, "measured_matmul_flops", rates.__getitem__)
    args = hfnative.SFTConfig(output_dir="unused", use_cpu=True, bf16=True, report_to="none")
    with caplog.at_level("WARNING", logger=performance.__name__):
        assert performance.warn_if_cpu_low_precision_is_slow(args) is warns
    assert ("bf16=True on a CPU whose bfloat16 matmuls run at 1.0 GFLOP/s against 80.0 GFLOP/s" in caplog.text) is warns
    assert not performance.warn_if_cpu_low_precision_is_slow(hfnative.SFTConfig(output_dir="unused", use_cpu=True,
                                                                                bf16=False, report_to="none"))


# --- every trainer logs them ---------------------------------------------------------------------------------

ALWAYS = ("perf/step_s", "perf/trained_tok_s_wall_clock", "perf/trained_tok_s_per_rank", "perf/tflops_per_rank",
          "perf/mfu_wall_clock", "perf/max_rss_gib", "perf/fwd_bwd_s", "perf/fwd_s", "perf/optimizer_s",
          "perf/mfu_fwd_bwd")
GENERATION = ("perf/generation_share", "perf/generated_tok_s")


def _rows(name: str, n: int) -> list[dict]:
    with open(DATA / name) as f:
        return [json.loads(line) for line, _ in zip(f, range(n))]


def _quick(tmp_path, **extra) -> dict:
    return dict(output_dir=str(tmp_path), use_cpu=True, bf16=False, report_to="none", disable_tqdm=True, max_steps=2,
                logging_steps=1, save_strategy="no", gradient_checkpointing=False, learning_rate=1e-3, **extra)


def _step_logs(trainer) -> list[dict]:
    history = trainer.state.log_history
    assert not any(key.startswith("perf/") for key in history[-1])  # the run's summary has none
    logs = [entry for entry in history if "loss" in entry]
    assert len(logs) == 2
    for entry in logs:
        names = ALWAYS + (("perf/heap_in_use_gib",) if heap_stats() is not None else ())
        for name in names + (GENERATION if trainer.objective.generates() else ()):
            assert math.isfinite(entry[name]) and entry[name] > 0, (name, entry.get(name))
        assert not any(key.startswith("perf/cuda") for key in entry)  # a CPU run
        if trainer.objective.generates():
            assert entry["perf/generation_share"] < 1
        assert entry["perf/trained_tok_s_per_rank"] == entry["perf/trained_tok_s_wall_clock"]  # one process
        # TRL's time budget: the forwards inside the micro-batches' training steps, those steps, then the optimizer's,
        # all within the step
        assert entry["perf/fwd_s"] < entry["perf/fwd_bwd_s"]
        assert entry["perf/fwd_bwd_s"] + entry["perf/optimizer_s"] < entry["perf/step_s"]
        # MFU over the training steps' time alone counts only their forwards' FLOPs: at most the step's FLOPs
        assert entry["perf/mfu_fwd_bwd"] <= entry["perf/mfu_wall_clock"] * entry["perf/step_s"] / entry["perf/fwd_bwd_s"] * (1 + 1e-9)
    return logs


def _tiny_qwen3(seq_len) -> int:
    return hand_count(1024, 64, 2, 4, 2, 16, 128, seq_len)


def _tiny_teacher(seq_len) -> int:
    return hand_count(1024, 96, 3, 6, 2, 16, 128, seq_len)


def _flops_per_trained_token(entry) -> float:
    return entry["perf/tflops_per_rank"] * 1e12 / entry["perf/trained_tok_s_per_rank"]


def test_sft_logs_its_tokens_and_flops_and_mfu_against_the_given_peak(tmp_path):
    args = hfnative.SFTConfig(**_quick(tmp_path, per_device_train_batch_size=3, gradient_accumulation_steps=2,
                                       max_length=64, peak_tflops=0.002))
    trainer = hfnative.SFTTrainer(model=MODEL, args=args, train_dataset=Dataset.from_list(_rows("sft_prompt_completion.jsonl", 12)),
                                  processing_class=AutoTokenizer.from_pretrained(MODEL))
    trainer.train()
    seen = 0.0
    for entry in _step_logs(trainer):
        trained = entry["perf/trained_tok_s_wall_clock"] * entry["perf/step_s"]
        assert trained == pytest.approx(entry["num_tokens"] - seen, rel=1e-9)  # every token of the step's batches
        seen = entry["num_tokens"]
        # forward + backward of tokens in sequences of 1 to 64 tokens
        assert 3 * _tiny_qwen3(1) < _flops_per_trained_token(entry) < 3 * _tiny_qwen3(64)
        assert entry["perf/mfu_wall_clock"] == pytest.approx(100 * entry["perf/tflops_per_rank"] / 0.002, rel=1e-9)
        # every SFT forward is a training step's: the same FLOPs over the training steps' time
        assert entry["perf/mfu_fwd_bwd"] == pytest.approx(
            entry["perf/mfu_wall_clock"] * entry["perf/step_s"] / entry["perf/fwd_bwd_s"], rel=1e-9)


def test_dpo_counts_the_frozen_reference_as_one_forward(tmp_path):
    args = hfnative.DPOConfig(**_quick(tmp_path, per_device_train_batch_size=2, max_length=48))
    trainer = hfnative.DPOTrainer(model=MODEL, args=args, train_dataset=Dataset.from_list(_rows("preference.jsonl", 4)),
                                  processing_class=AutoTokenizer.from_pretrained(MODEL))
    trainer.train()
    for entry in _step_logs(trainer):
        # the policy's forward + backward and the reference's forward, on the same tokens
        assert 4 * _tiny_qwen3(1) < _flops_per_trained_token(entry) < 4 * _tiny_qwen3(48)


def test_distillation_counts_the_teacher_forward_and_the_generation(tmp_path):
    args = hfnative.DistillationConfig(**_quick(tmp_path, per_device_train_batch_size=2, max_completion_length=6))
    trainer = hfnative.DistillationTrainer(model=MODEL, teacher_model=TEACHER, args=args,
                                           train_dataset=Dataset.from_list(_rows("sft_prompt_completion.jsonl", 4)),
                                           processing_class=AutoTokenizer.from_pretrained(MODEL))
    trainer.train()
    for entry in _step_logs(trainer):
        low, high = 3 * _tiny_qwen3(1) + _tiny_teacher(1), 3 * _tiny_qwen3(64) + _tiny_teacher(64)
        assert low < _flops_per_trained_token(entry) < high


def _reward_length(completion_ids, **kwargs):
    return [float(len(ids)) for ids in completion_ids]


@pytest.mark.parametrize("algorithm", ["GRPO", "RLOO"])
def test_rl_trainers_log_the_generation_share(tmp_path, algorithm):
    config, trainer_class = getattr(hfnative, f"{algorithm}Config"), getattr(hfnative, f"{algorithm}Trainer")
    args = config(**_quick(tmp_path, per_device_train_batch_size=4, num_generations=2, max_completion_length=6,
                           beta=0.04))
    prompts = [{"prompt": f"Tell me about number {i}"} for i in range(8)]
    trainer = trainer_class(model=MODEL, reward_funcs=_reward_length, args=args, train_dataset=Dataset.from_list(prompts),
                            processing_class=AutoTokenizer.from_pretrained(MODEL))
    trainer.train()
    for entry in _step_logs(trainer):
        # the policy's training forward (3x) and its reference's forward (1x), maybe old log-probs (1x), on
        # sequences of at most prompt + 6 tokens
        assert 3 * _tiny_qwen3(1) < _flops_per_trained_token(entry) < 5 * _tiny_qwen3(64)
        # the reference's forward runs at generation time, outside the training steps: not in mfu_fwd_bwd's FLOPs
        assert entry["perf/mfu_fwd_bwd"] < entry["perf/mfu_wall_clock"] * entry["perf/step_s"] / entry["perf/fwd_bwd_s"]


def test_reward_and_kto_trainers_log_them(tmp_path):
    rows = Dataset.from_list(_rows("preference.jsonl", 8))
    tokenizer = AutoTokenizer.from_pretrained(MODEL)
    args = hfnative.RewardConfig(**_quick(tmp_path / "reward", per_device_train_batch_size=2, max_length=48))
    reward = hfnative.RewardTrainer(model=MODEL, args=args, train_dataset=rows, processing_class=tokenizer)
    reward.train()
    head = 2 * 64 * 1024  # a classifier scores one position per row: no LM head per token
    for entry in _step_logs(reward):
        assert 3 * (_tiny_qwen3(1) - head) < _flops_per_trained_token(entry) < 3 * (_tiny_qwen3(48) - head)
    args = hfnative.KTOConfig(**_quick(tmp_path / "kto", per_device_train_batch_size=4, max_length=48))
    kto = hfnative.KTOTrainer(model=MODEL, args=args, train_dataset=rows, processing_class=tokenizer)
    kto.train()
    for entry in _step_logs(kto):
        # the policy's forward + backward, the reference's forward, and both on the mismatched KL completions
        assert 3 * _tiny_qwen3(1) < _flops_per_trained_token(entry) < 6 * _tiny_qwen3(48)


def test_a_steps_time_on_cuda_is_the_device_time_between_its_events():
    """On CUDA the host returns from a step while its last kernels are queued: the step's time is read from events
    recorded as it starts and ends (stand-ins here, whose clock is the device's), not from the host's clock."""
    from hfnative.trainers.loop.performance import StepPerformance

    device_clock = iter([0.0, 250.0, 300.0, 650.0])  # ms: two steps of 250 and 350 ms on the device

    class Event:
        def record(self):
            self.ms = next(device_clock)

        def synchronize(self):
            pass

        def elapsed_time(self, end):
            return end.ms - self.ms

    performance = StepPerformance(torch.device("cpu"))
    performance._event = Event
    for _ in range(2):
        performance.step_started()
        performance.step_ended()  # the host's clock: microseconds
    logs = performance.pop(lambda values: values)
    assert logs["perf/step_s"] == pytest.approx(0.3)
