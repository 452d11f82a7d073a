"""Expert parallelism on CPU processes (gloo): Qwen3-MoE and Mixtral with their experts split over ep=2 ranks
(2 processes), and on 4 processes FSDP2 x EP2 (experts split over 2 ranks and sharded over the other 2), HSDP
(dp_replicate=2) x EP2, CP2 x EP2 and TP2 x EP2, trained by hfnative's SFTTrainer with the router's load-balancing
loss on (coefficient 0.5); a dense Qwen3 trained by SFT under ep_size=2 (sharded over the whole dp_shard group), and
GKD of a Qwen3-MoE student under EP2 from the shipped dense teacher. Each against one process over the same global
batches: 5 steps whose losses, grad norms and logged metrics agree within 1e-5 relative, and final weights, saved
under the Hub's per-expert keys, within 1e-5 (fp32: gradients summed in another order).
"""

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, AutoTokenizer, MixtralConfig, Qwen3Config, Qwen3MoeConfig

import _ep_worker as worker
from _launch import torchrun


pytestmark = pytest.mark.usefixtures("one_torch_thread")  # tests/conftest.py


def _configs(vocab: int) -> dict:
    common = dict(vocab_size=vocab, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                  head_dim=8, max_position_embeddings=256, router_aux_loss_coef=0.5)
    return {
        "qwen3moe": Qwen3MoeConfig(**common, intermediate_size=48, moe_intermediate_size=24, num_experts=4,
                                   num_experts_per_tok=2, norm_topk_prob=True),
        "mixtral": MixtralConfig(**common, intermediate_size=24, num_local_experts=4, num_experts_per_tok=2),
        "qwen3": Qwen3Config(**common, intermediate_size=48),
    }


@pytest.fixture(scope="module")
def models_dir(tmp_path_factory) -> Path:
    directory = tmp_path_factory.mktemp("moe_models")
    tokenizer = AutoTokenizer.from_pretrained(worker.TOKENIZER)
    for name, config in _configs(len(tokenizer)).items():
        torch.manual_seed(0)
        AutoModelForCausalLM.from_config(config).save_pretrained(str(directory / name))
        tokenizer.save_pretrained(str(directory / name))
    return directory


def _resumed_under_fsdp2() -> list[str]:
    """The layouts whose step-3 checkpoints are resumed under plain FSDP2: EP2 and CP2 x EP2."""
    return [name for name, (_, _, extra, _) in worker.LAYOUTS.items() if extra.get("save_steps") == 3]


@pytest.fixture(scope="module")
def launched(tmp_path_factory, models_dir):
    out = tmp_path_factory.mktemp("expert_parallel")
    # the 4-process launch first: the 2-process one then also resumes the step-3 checkpoints of both under
    # plain FSDP2 (test_checkpoints_resume_under_another_layout), without a launch of its own
    for nproc in sorted({layout[3] for layout in worker.LAYOUTS.values()}, reverse=True):
        names = [name for name, layout in worker.LAYOUTS.items() if layout[3] == nproc]
        if nproc == 2:
            names += ["--resume-under-fsdp2", *_resumed_under_fsdp2()]
        torchrun("_ep_worker.py", [str(out), str(models_dir), *names], nproc, timeout=900)
    return out


@pytest.fixture(scope="module")
def one_process(tmp_path_factory, models_dir):
    """layout -> (the one-process run's log history, its saved model's folder): one run per model, trainer settings
    and global batch, shared by the layouts that have them in common."""
    runs = {}

    def run(layout: str):
        model, sizes, extra, _ = worker.LAYOUTS[layout]
        ranks = worker.data_ranks(sizes)
        key = (model, ranks, sorted((k, v) for k, v in extra.items() if not k.startswith("save_")))
        key = json.dumps(key)
        if key not in runs:
            folder = tmp_path_factory.mktemp("one_process")
            reference = worker.trainer_for(layout, str(folder), str(models_dir), worker.PER_DEVICE * ranks)
            reference.train()
            reference.save_model()
            runs[key] = (reference.state.log_history, folder)
        return runs[key]

    return run


@pytest.mark.parametrize("layout", list(worker.LAYOUTS))
def test_layout_trains_like_one_process(launched, one_process, layout):
    model, sizes, extra, _ = worker.LAYOUTS[layout]
    log_history, reference_folder = one_process(layout)
    steps = [e for e in json.loads((launched / layout / "log.json").read_text()) if "loss" in e]
    expected = [e for e in log_history if "loss" in e]
    assert len(steps) == len(expected) == worker.STEPS
    keys = [key for key in ("loss", "grad_norm", "learning_rate", "mean_token_accuracy", "entropy", "num_tokens",
                            "aux_loss") if key in expected[0]]
    if "trainer" not in extra:  # SFT on an MoE model logs the router's loss (each rank's share, logged whole)
        assert ("aux_loss" in keys) == (model != "qwen3"), sorted(expected[0])
    for mine, theirs in zip(steps, expected):
        for key in keys:
            assert mine[key] == pytest.approx(theirs[key], rel=1e-5), (layout, theirs["step"], key)
    weights = load_file(str(launched / layout / "model.safetensors"))
    reference_weights = load_file(str(reference_folder / "model.safetensors"))
    assert set(weights) == set(reference_weights)  # the Hub layout: one key per expert and projection
    assert model == "qwen3" or any(".experts.3." in key for key in weights)
    for key, value in reference_weights.items():
        torch.testing.assert_close(weights[key], value, rtol=0, atol=1e-5, msg=key)
    if extra.get("save_steps") == worker.STEPS:  # a distributed checkpoint: the training state and the Hub model
        checkpoint = launched / layout / f"checkpoint-{worker.STEPS}"
        assert (checkpoint / "training_state").is_dir()
        saved = load_file(str(checkpoint / "model.safetensors"))
        assert set(saved) == set(weights) and all(torch.equal(saved[k], weights[k]) for k in weights)


@pytest.mark.parametrize("layout", [name for name, (_, _, extra, _) in worker.LAYOUTS.items()
                                    if extra.get("save_steps", worker.STEPS) < worker.STEPS])
def test_checkpoint_resumes_on_one_process(launched, models_dir, tmp_path, layout):
    """An expert-parallel run's checkpoint (EP2; CP2 x EP2: each sequence split too), written at step 3, resumed on
    one process over the same global batches: steps 4 and 5 train as the launched run did."""
    import shutil

    _, sizes, extra, _ = worker.LAYOUTS[layout]
    run = tmp_path / layout
    shutil.copytree(launched / layout, run)
    trainer = worker.trainer_for(layout, str(run), str(models_dir), worker.PER_DEVICE * worker.data_ranks(sizes))
    with pytest.warns(UserWarning, match="is loaded by 1"):
        trainer.train(resume_from_checkpoint=str(run / f"checkpoint-{extra['save_steps']}"))
    resumed = {e["step"]: e for e in trainer.state.log_history if "loss" in e and e["step"] > extra["save_steps"]}
    launched_steps = {e["step"]: e for e in json.loads((launched / layout / "log.json").read_text()) if "loss" in e}
    assert sorted(resumed) == list(range(extra["save_steps"] + 1, worker.STEPS + 1))
    for step, entry in resumed.items():
        for key in ("loss", "grad_norm", "learning_rate", "aux_loss"):
            assert entry[key] == pytest.approx(launched_steps[step][key], rel=1e-5), (layout, step, key)


def test_checkpoints_resume_under_another_layout(launched):
    """The EP2 and CP2 x EP2 runs' step-3 checkpoints resumed under plain FSDP2 on 2 processes (the experts and the
    sequences no longer split; by the 2-process launch, on copies of the runs): steps 4 and 5 equal the launched
    runs' (1e-5)."""
    layouts = _resumed_under_fsdp2()
    for name in layouts:
        launched_steps = {e["step"]: e for e in json.loads((launched / name / "log.json").read_text()) if "loss" in e}
        resumed = {e["step"]: e for e in json.loads((launched / worker.RESUMED / name / "resumed-log.json").read_text())
                   if "loss" in e and e["step"] > 3}
        assert sorted(resumed) == [4, 5], name
        for step, entry in resumed.items():
            for key in ("loss", "grad_norm", "learning_rate", "aux_loss"):
                assert entry[key] == pytest.approx(launched_steps[step][key], rel=1e-5), (name, step, key)


def test_sizes_are_validated(tmp_path):
    from hfnative.parallel.dims import ParallelDims
    from hfnative.parallel.expert_parallel import ExpertParallel
    from hfnative.trainers.running.parallel_plan import resolve_parallel_plan

    dims = ParallelDims(dp_shard=4, ep=2, world_size=4)
    assert (dims.shape, dims.mesh_dim_names) == ((1, 2, 2, 1), ("dp_replicate", "dp_shard_mod_ep", "ep", "tp"))
    with pytest.raises(ValueError, match="ep=3 must divide dp_shard=4"):
        ParallelDims(dp_shard=4, ep=3, world_size=4)
    dims = ParallelDims(dp_shard=2, tp=2, ep=2, world_size=4)
    assert (dims.shape, dims.mesh_dim_names) == ((1, 1, 2, 2), ("dp_replicate", "dp_shard_mod_ep", "ep", "tp"))
    dims = ParallelDims(dp_replicate=2, dp_shard=2, cp=2, ep=2, world_size=8)
    assert (dims.shape, dims.mesh_dim_names) == ((2, 1, 2, 2, 1), ("dp_replicate", "dp_shard_mod_ep", "cp", "ep", "tp"))
    with pytest.raises(ValueError, match="must divide the number of experts"):
        ExpertParallel(None, 2, 0, 3)
    args = worker.config(str(tmp_path), 1, parallelism_config='{"dp_shard_size": 4, "ep_size": 2}')
    plan = resolve_parallel_plan(args, 4)
    assert plan.dims.ep == 2 and "2-way expert parallel" in plan.describe()
    with pytest.raises(ValueError, match=r"ep_size=0: expected a positive integer"):
        resolve_parallel_plan(worker.config(str(tmp_path), 1, parallelism_config={"dp_shard_size": 4, "ep_size": 0}), 4)
