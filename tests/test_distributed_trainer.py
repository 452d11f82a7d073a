"""hfnative's trainer launched with torchrun on 4 CPU processes (gloo): FSDP2, HSDP 2x2, FSDP2 x TP2 and
replication (DDP) train the same model as one process over the same global batches — per-step losses and grad
norms within 1e-5 relative (fp32), final weights within the fp32 round-off that summing a step's gradient
in another order gives (AdamW magnifies it where gradients are near zero; see tests/test_parallel.py).
One launch runs every layout (one of them reading its rows as a stream); the single-process references run here."""

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from datasets import Dataset
from safetensors.torch import load_file

import _distributed_train_worker as worker
from hfnative import SFTTrainer

pytestmark = pytest.mark.usefixtures("one_torch_thread")  # tests/conftest.py

HERE = Path(__file__).resolve().parent


@pytest.fixture(scope="module")
def fallback_model(tmp_path_factory) -> str:
    """A GPT-NeoX-shaped tiny checkpoint: no native implementation, trained through transformers' module."""
    from transformers import AutoModelForCausalLM, AutoTokenizer, GPTNeoXConfig

    tokenizer = AutoTokenizer.from_pretrained(worker.MODEL)
    config = GPTNeoXConfig(vocab_size=len(tokenizer), hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                           num_attention_heads=4, max_position_embeddings=256, rotary_pct=0.5, initializer_range=0.2,
                           pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id, bos_token_id=None)
    directory = tmp_path_factory.mktemp("neox")
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).save_pretrained(str(directory))
    tokenizer.save_pretrained(str(directory))
    return str(directory)


@pytest.fixture(scope="module")
def cloned_adapter(tmp_path_factory) -> str:
    """A LoRA adapter folder from one step of SFT whose chat template (a tokenizer folder) added a token: the
    vocabulary resized, the new rows trained (trainable_token_indices), the embedding saved whole."""
    from peft import LoraConfig
    from test_clone_chat_template import _source

    root = tmp_path_factory.mktemp("cloned")
    args = worker.config(str(root / "adapter"), 2, max_steps=1, chat_template_path=_source(root / "template", True))
    trainer = SFTTrainer(model=worker.MODEL, args=args, train_dataset=Dataset.from_list(worker.rows(8)),
                         peft_config=LoraConfig(r=4, target_modules=["q_proj", "v_proj"]))
    trainer.train()
    trainer.save_model()
    return str(root / "adapter")


@pytest.fixture(scope="module")
def template_folder(tmp_path_factory) -> str:
    """A tokenizer folder whose chat template writes a token the tiny model's tokenizer lacks."""
    from test_clone_chat_template import _source

    return _source(tmp_path_factory.mktemp("template"), new_token=True)


@pytest.fixture(scope="module")
def launched(tmp_path_factory, fallback_model, cloned_adapter, template_folder):
    out = tmp_path_factory.mktemp("distributed")
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(HERE), FALLBACK_MODEL=fallback_model,
               CLONED_ADAPTER=cloned_adapter, TEMPLATE_FOLDER=template_folder)
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "4",
               str(HERE / "_distributed_train_worker.py"), str(out), *worker.LAYOUTS]
    result = subprocess.run(command, env=env, capture_output=True, text=True, timeout=900)
    assert result.returncode == 0, result.stderr[-6000:]
    return out


def _reference(tmp_path, sizes: dict, extra: dict):
    """One process over the same global batches: per_device x the data-parallel ranks."""
    layout_extra = extra
    dp = sizes.get("dp_replicate_size", 1) * sizes.get("dp_shard_size", 1) if sizes else 4  # fsdp: all 4 shard
    model, trainer_kwargs, extra = worker.model_of(extra)
    extra.pop("fsdp", None)
    extra.pop("deepspeed", None)  # the one process runs plain
    per_device = extra.pop("per_device_train_batch_size", worker.PER_DEVICE)
    args = worker.config(str(tmp_path / "reference"), per_device * dp, **extra)
    trainer = SFTTrainer(model=model, args=args, train_dataset=worker.train_dataset(layout_extra),
                         eval_dataset=worker.eval_dataset(layout_extra), **trainer_kwargs)
    trainer.train()
    trainer.save_model()
    names = worker.surface_names(trainer) if "peft_config" in trainer_kwargs else None
    return (trainer.state.log_history, load_file(str(tmp_path / "reference" / _weights_file(trainer_kwargs, layout_extra))),
            names)


def _weights_file(trainer_kwargs: dict, layout_extra: dict | None = None) -> str:
    adapter = "peft_config" in trainer_kwargs or (layout_extra or {}).get("model") == "CLONED_ADAPTER"
    return "adapter_model.safetensors" if adapter else "model.safetensors"


@pytest.mark.parametrize("layout", list(worker.LAYOUTS))
def test_layout_trains_like_one_process(launched, layout, tmp_path, fallback_model, cloned_adapter, template_folder,
                                        monkeypatch):
    monkeypatch.setenv("FALLBACK_MODEL", fallback_model)
    monkeypatch.setenv("CLONED_ADAPTER", cloned_adapter)
    monkeypatch.setenv("TEMPLATE_FOLDER", template_folder)
    sizes, extra = worker.LAYOUTS[layout]
    reference_logs, reference_weights, reference_names = _reference(tmp_path, sizes, extra)
    logs = json.loads((launched / layout / "log.json").read_text())
    steps = [entry for entry in logs if "loss" in entry]
    reference_steps = [entry for entry in reference_logs if "loss" in entry]
    assert len(steps) == len(reference_steps) == worker.STEPS
    for mine, reference in zip(steps, reference_steps):
        for key in ("loss", "grad_norm", "learning_rate", "mean_token_accuracy", "entropy", "num_tokens"):
            assert mine[key] == pytest.approx(reference[key], rel=1e-5), (layout, reference["step"], key)
        # perf/: the whole job's trained tokens and model FLOPs in the step are one process's on the same batch
        for key, per_rank in (("perf/trained_tok_s_wall_clock", 1), ("perf/tflops_per_rank", 4)):
            if key in reference:  # no FLOPs for a model on the transformers fallback
                assert mine[key] * per_rank * mine["perf/step_s"] == pytest.approx(
                    reference[key] * reference["perf/step_s"], rel=1e-9), (layout, reference["step"], key)
        assert mine["perf/trained_tok_s_per_rank"] == pytest.approx(mine["perf/trained_tok_s_wall_clock"] / 4, rel=1e-12)
    weights = load_file(str(launched / layout / _weights_file(worker.model_of(extra)[1], extra)))
    assert set(weights) == set(reference_weights)
    for key, value in reference_weights.items():
        torch.testing.assert_close(weights[key], value, rtol=0, atol=2e-4, msg=key)
    if reference_names is not None:  # trainer.model under LoRA: peft's names over the sharded tensors
        names = json.loads((launched / layout / "peft_names.json").read_text())
        assert [n for n in names] == [n for n in reference_names]
        for name, (shape, requires_grad, total) in reference_names.items():
            assert names[name][:2] == [shape, requires_grad], name
            assert names[name][2] == pytest.approx(total, rel=1e-4, abs=2e-4 * math.prod(shape)), name


@pytest.mark.parametrize("layout", [name for name, (_, extra) in worker.LAYOUTS.items() if "model" not in extra])
def test_sharded_save_equals_single_process_export(launched, layout, tmp_path, template_folder, monkeypatch):
    """Saved from the shards before training: tensor for tensor what one process exports from the checkpoint (with
    LoRA: the adapter one process saves with the same seed; with a cloned template: the model one process resizes
    with the same seed)."""
    monkeypatch.setenv("TEMPLATE_FOLDER", template_folder)
    sizes, extra = worker.LAYOUTS[layout]
    model, trainer_kwargs, settings = worker.model_of(extra)
    settings.pop("fsdp", None)
    name = _weights_file(trainer_kwargs)
    if trainer_kwargs or "chat_template_path" in settings:
        one = SFTTrainer(model=model, args=worker.config(str(tmp_path / "one"), worker.PER_DEVICE, **settings),
                         train_dataset=Dataset.from_list(worker.rows()), eval_dataset=worker.eval_dataset(extra),
                         **trainer_kwargs)
        one.save_model()
        expected = load_file(str(tmp_path / "one" / name))
    else:
        expected = load_file(str(Path(worker.MODEL) / name))
    saved = load_file(str(launched / layout / "before-training" / name))
    assert set(saved) == set(expected)
    for key, value in expected.items():
        assert torch.equal(saved[key], value), key


# --- pieces the launch relies on, in one process --------------------------------------------------


@pytest.mark.parametrize("num_samples,batch_size,ranks", [(10, 2, 3), (12, 3, 2), (7, 4, 4)])
def test_rank_batches_are_accelerates(num_samples, batch_size, ranks):
    """Each rank's batches are what accelerate's BatchSamplerShard gives transformers' Trainer; a resumed
    epoch skips this rank's first batches."""
    from accelerate.data_loader import BatchSamplerShard
    from torch.utils.data import BatchSampler

    from hfnative.trainers.loop.data_loading import EpochBatchSampler, ShardedEpochBatchSampler

    order = EpochBatchSampler(num_samples, batch_size, seed=3).order()
    base = BatchSampler(order, batch_size, drop_last=False)
    for rank in range(ranks):
        ours = ShardedEpochBatchSampler(EpochBatchSampler(num_samples, batch_size, seed=3), ranks, rank)
        expected = list(BatchSamplerShard(base, ranks, rank, split_batches=False, even_batches=True))
        assert list(ours) == expected and len(ours) == len(expected)
        ours.skip_batches = 1
        assert list(ours) == expected[1:]


def test_padding_to_a_multiple_changes_no_loss():
    from hfnative.converters.loading import load_pretrained
    from hfnative.losses import shift_labels
    from hfnative.trainers.running.distributed import pad_sequence_to_multiple

    model = load_pretrained(worker.MODEL).model.eval()
    ids = torch.randint(0, 1000, (2, 7), generator=torch.Generator().manual_seed(0))
    labels = ids.clone()
    labels[:, :2] = -100
    cases = [dict(attention_mask=torch.tensor([[1] * 7, [1] * 5 + [0] * 2])),
             dict(position_ids=torch.tensor([[0, 1, 2, 0, 1, 2, 3]] * 2)), {}]
    for extra in cases:
        batch = dict(input_ids=ids, labels=labels, shift_labels=shift_labels(labels), **extra)
        padded = pad_sequence_to_multiple(batch, 4)
        assert all(v.shape[1] == 8 for v in padded.values())
        with torch.no_grad():
            plain = model(**{k: v for k, v in batch.items() if k != "labels"}).loss
            longer = model(**{k: v for k, v in padded.items() if k != "labels"}).loss
        torch.testing.assert_close(longer, plain, rtol=1e-6, atol=0)


# --- a rank killed mid-run; the run resumed under another layout and on one process ----------------


def _torchrun(nproc: int, *arguments, check=True):
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(HERE))
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(nproc),
               str(HERE / "_distributed_resume_worker.py"), *map(str, arguments)]
    result = subprocess.run(command, env=env, capture_output=True, text=True, timeout=600)
    if check:
        assert result.returncode == 0, result.stderr[-6000:]
    return result


@pytest.mark.parametrize("mode", ["oib", "sf"])
def test_optimizer_in_backward_checkpoints_resume_on_one_process(tmp_path, mode):
    """optimizer_in_backward under FSDP2 writes distributed checkpoints (each parameter's optimizer state under its
    name, through torch's get_state_dict over the per-parameter optimizers): the 2-process run equals one process
    step by step, and its checkpoint-4 resumed on one process (optimizer_in_backward too) trains steps 5 and 6 as the
    uninterrupted run did, with the scheduled learning rate restored. "sf": the schedule-free AdamW, whose fresh
    optimizers torch's loader steps (in train mode) before the saved state replaces theirs."""
    import _distributed_resume_worker as resume

    if mode == "sf":
        pytest.importorskip("schedulefree")
    settings = resume.MODES[mode]
    out = tmp_path / mode
    _torchrun(2, out, "fsdp2", mode)
    logged = {e["step"]: e for e in json.loads((out / f"{mode}-fsdp2.json").read_text()) if "loss" in e}
    assert (out / "checkpoint-4" / "training_state").is_dir()
    args = resume.run_config(str(tmp_path / "one"), 2 * resume.PER_DEVICE, **settings)
    one = SFTTrainer(model=worker.MODEL, args=args, train_dataset=Dataset.from_list(worker.rows()))
    one.train()
    expected = {e["step"]: e for e in one.state.log_history if "loss" in e}
    for step in range(1, resume.STEPS + 1):
        for key in ("loss", "grad_norm", "learning_rate"):
            assert logged[step][key] == pytest.approx(expected[step][key], rel=1e-5), (step, key)
    resumed = SFTTrainer(model=worker.MODEL, args=resume.run_config(str(out), 2 * resume.PER_DEVICE, **settings),
                         train_dataset=Dataset.from_list(worker.rows()))
    with pytest.warns(UserWarning, match="saved by 2 ranks and is loaded by 1"):
        resumed.train(resume_from_checkpoint=str(out / "checkpoint-4"))
    steps = {e["step"]: e for e in resumed.state.log_history if "loss" in e and e["step"] > 4}
    assert sorted(steps) == [5, 6]
    for step, entry in steps.items():
        for key in ("loss", "grad_norm", "learning_rate"):
            assert entry[key] == pytest.approx(logged[step][key], rel=1e-5), (step, key)


def test_checkpoints_with_an_8bit_base_resume_under_fsdp2(tmp_path):
    """LoRA on a quantized base under FSDP2 (the base kept whole on every rank) saves distributed checkpoints without
    the frozen base (loaded again with the model), and checkpoint-4 resumed on 2 processes trains steps 5 and 6 as
    the uninterrupted run did."""
    import _distributed_resume_worker as resume

    out = tmp_path / "int8"
    _torchrun(2, out, "fsdp2", "int8")
    logged = {e["step"]: e for e in json.loads((out / "int8-fsdp2.json").read_text()) if "loss" in e}
    state = out / "checkpoint-4" / "training_state"
    assert state.is_dir() and (out / "checkpoint-4" / "adapter_model.safetensors").is_file()
    _torchrun(2, out, "fsdp2", "int8-resume")
    resumed = json.loads((out / "int8-resume-fsdp2.json").read_text())
    steps = {e["step"]: e for e in resumed if "loss" in e and e["step"] > 4}
    assert sorted(steps) == [5, 6]
    for step, entry in steps.items():
        for key in ("loss", "grad_norm", "learning_rate"):
            assert entry[key] == pytest.approx(logged[step][key], rel=1e-5), (step, key)


def test_killed_rank_run_resumes_under_other_layouts(tmp_path):
    import shutil

    import _distributed_resume_worker as resume

    killed = tmp_path / "killed"
    result = _torchrun(2, killed, "fsdp2", "kill", check=False)
    assert result.returncode != 0  # the launcher tore the job down when rank 1 died
    assert sorted(p.name for p in killed.glob("checkpoint-*")) == ["checkpoint-2", "checkpoint-4"]
    checkpoint = killed / "checkpoint-4"
    assert (checkpoint / "training_state").is_dir() and (checkpoint / "model.safetensors").is_file()
    assert not list(checkpoint.rglob("*.pt")) and not list(checkpoint.rglob("*.pth"))

    # the uninterrupted run, on one process over the same global batches
    reference = SFTTrainer(model=worker.MODEL, args=resume.run_config(str(tmp_path / "reference"), 2 * resume.PER_DEVICE),
                           train_dataset=Dataset.from_list(worker.rows()))
    reference.train()
    expected = {e["step"]: e for e in reference.state.log_history if "loss" in e}

    resumed = {}
    other = tmp_path / "fsdp2xtp2"
    shutil.copytree(killed, other)
    _torchrun(4, other, "fsdp2xtp2", "resume")
    resumed["fsdp2xtp2"] = json.loads((other / "resumed-fsdp2xtp2.json").read_text())
    one = SFTTrainer(model=worker.MODEL, args=resume.run_config(str(killed), 2 * resume.PER_DEVICE),
                     train_dataset=Dataset.from_list(worker.rows()))
    one.train(resume_from_checkpoint=True)
    resumed["one process"] = one.state.log_history
    for layout, logs in resumed.items():
        steps = {e["step"]: e for e in logs if "loss" in e and e["step"] > 4}
        assert sorted(steps) == [5, 6], layout
        for step, entry in steps.items():
            for key in ("loss", "grad_norm", "learning_rate"):
                assert entry[key] == pytest.approx(expected[step][key], rel=1e-5), (layout, step, key)


def test_metrics_are_reduced_on_the_runs_device():
    """A logging window's metrics can all be host values (GRPO's rollout metrics): they are moved to the run's device
    before the data-parallel reduction, which NCCL does only on the GPU (the meta device stands in for it here)."""
    from types import SimpleNamespace

    from hfnative.trainers.running.distributed import DistributedMixin

    reduced = []

    def sum_over_dp(values):
        reduced.append(values.device)
        return values

    trainer = SimpleNamespace(device=torch.device("meta"),
                              distributed=SimpleNamespace(sum_over_dp=sum_over_dp, loss_ranks=2))
    out = DistributedMixin._reduce_metrics(trainer, torch.tensor([4.0, 2.0]), [True, False])
    assert reduced == [torch.device("meta")] and out.device.type == "meta" and out.shape == (2,)
