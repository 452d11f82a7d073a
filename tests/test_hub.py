"""push_to_hub against a loopback stand-in of the Hub: what each hub_strategy leaves in the repository,
the model card's metadata, and the token — sent as the Authorization header, written nowhere.

The model is loaded by Hub id from a prepared cache (offline), so the card can cite its base_model.
"""

import json
import logging
import shutil
from pathlib import Path

import huggingface_hub
import pytest
import torch
import yaml
from datasets import Dataset
from hub_standin import HubStandIn

from hfnative import SFTConfig, SFTTrainer
from hfnative.trainers.running.cli import main as cli_main

ROOT = Path(__file__).resolve().parents[1]
TINY = ROOT / "examples" / "tiny-qwen3"
DATA = ROOT / "examples" / "data"
BASE_MODEL = "hfnative-test/tiny-qwen3"
TOKEN = "hf_secret_test_token"
REPO = "org/tiny-sft"

MODEL_FOLDER = {"README.md", "config.json", "generation_config.json", "model.safetensors", "tokenizer.json",
                "tokenizer_config.json", "chat_template.jinja", "training_args.bin"}
CHECKPOINT_FOLDER = MODEL_FOLDER - {"README.md"} | {"optimizer.pt", "scheduler.pt", "rng_state.pth", "trainer_state.json"}


@pytest.fixture(scope="module")
def hub_cache(tmp_path_factory):
    """A huggingface_hub cache holding the tiny model as ``hfnative-test/tiny-qwen3``."""
    cache = tmp_path_factory.mktemp("hf-cache")
    repo = cache / f"models--{BASE_MODEL.replace('/', '--')}"
    shutil.copytree(TINY, repo / "snapshots" / ("a" * 40))
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text("a" * 40)
    return cache


@pytest.fixture
def hub(monkeypatch, tmp_path):
    with HubStandIn() as standin:
        monkeypatch.setenv("HF_ENDPOINT", standin.url)  # for anything reading the environment; the constants were read at import
        monkeypatch.setenv("HF_HUB_DISABLE_XET", "1")
        monkeypatch.setattr(huggingface_hub.constants, "ENDPOINT", standin.url)
        monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_DISABLE_XET", True)
        monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", False)
        monkeypatch.setattr(huggingface_hub.constants, "AGENT_HARNESSES_PATH", str(tmp_path / "agent_harnesses.json"))
        monkeypatch.delenv("HF_TOKEN", raising=False)
        yield standin


def _rows(n=16):
    with open(DATA / "sft_messages.jsonl") as f:
        return [json.loads(line) for line, _ in zip(f, range(n))]


def _trainer(tmp_path, hub_cache, monkeypatch, **overrides):
    settings = dict(
        output_dir=str(tmp_path / "out"), use_cpu=True, bf16=False, report_to="none", disable_tqdm=True,
        max_steps=4, per_device_train_batch_size=4, max_length=64, logging_steps=1, save_steps=2,
        model_init_kwargs={"cache_dir": str(hub_cache)},
    )
    settings.update(overrides)
    with monkeypatch.context() as offline:  # the base model comes from the cache, never the stand-in
        offline.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
        return SFTTrainer(model=BASE_MODEL, args=SFTConfig(**settings), train_dataset=Dataset.from_list(_rows()))


def _front_matter(card: bytes) -> dict:
    text = card.decode()
    assert text.startswith("---\n")
    return yaml.safe_load(text[4 : text.index("\n---\n", 4)])


def _assert_token_written_nowhere(hub, output_dir: Path, captured: str):
    assert TOKEN not in captured
    for path in output_dir.rglob("*"):
        if path.is_file():
            assert TOKEN.encode() not in path.read_bytes(), path
    for request in hub.requests:  # every uploaded file and every JSON payload
        assert TOKEN.encode() not in request.body, request.path
    for commit in hub.commits:
        for name, content in commit.files.items():
            assert TOKEN.encode() not in content, name


@pytest.mark.parametrize(
    "strategy, commits, extra",
    [
        ("end", ["End of training"], set()),
        ("every_save", ["Training in progress, step 2", "Training in progress, step 4", "End of training"], set()),
        (
            "checkpoint",
            ["Training in progress, step 2", "Training in progress, step 2, checkpoint",
             "Training in progress, step 4", "Training in progress, step 4, checkpoint", "End of training"],
            {f"last-checkpoint/{name}" for name in CHECKPOINT_FOLDER},
        ),
        (
            "all_checkpoints",
            ["Training in progress, step 2", "Training in progress, step 2, checkpoint",
             "Training in progress, step 4", "Training in progress, step 4, checkpoint", "End of training"],
            {f"checkpoint-{step}/{name}" for step in (2, 4) for name in CHECKPOINT_FOLDER},
        ),
    ],
)
def test_hub_strategy_leaves_exactly_the_expected_files(strategy, commits, extra, hub, hub_cache, tmp_path, monkeypatch,
                                                        capfd, caplog):
    caplog.set_level(logging.DEBUG)
    trainer = _trainer(tmp_path, hub_cache, monkeypatch, push_to_hub=True, hub_model_id=REPO, hub_token=TOKEN,
                       hub_strategy=strategy, hub_always_push=True)  # always_push: every save is pushed, in order
    trainer.train()
    trainer.push_to_hub(dataset_name="hfnative-test/sft-data")

    assert trainer.hub_model_id == REPO
    assert hub.unserved() == []
    assert [c.summary for c in hub.commits] == commits
    files = hub.files(REPO)
    assert set(files) == MODEL_FOLDER | extra
    output_dir = tmp_path / "out"
    for name in MODEL_FOLDER:
        assert files[name] == (output_dir / name).read_bytes(), name
    if strategy == "checkpoint":  # the latest checkpoint, resumable from the Hub
        assert json.loads(files["last-checkpoint/trainer_state.json"])["global_step"] == 4
    card = _front_matter(files["README.md"])
    assert card["base_model"] == BASE_MODEL and card["library_name"] == "transformers"
    assert {"sft", "trl", "hfnative"} <= set(card["tags"]) and card["datasets"] == ["hfnative-test/sft-data"]
    assert card["model_name"] == "tiny-sft"
    assert f'model="{REPO}"' in files["README.md"].decode()
    uploaded_args = torch.load(output_dir / "training_args.bin", weights_only=False)
    assert uploaded_args.hub_token is None and trainer.args.hub_token == TOKEN

    # the token was sent to the Hub on every API call, and written nowhere
    api_calls = [r for r in hub.requests if r.path != "/api/agent-harnesses"]
    assert api_calls and all(r.headers.get("authorization") == f"Bearer {TOKEN}" for r in api_calls)
    out, err = capfd.readouterr()
    _assert_token_written_nowhere(hub, output_dir, out + err + caplog.text)


def test_push_to_hub_defaults_repo_name_private_flag_and_revision(hub, hub_cache, tmp_path, monkeypatch):
    trainer = _trainer(tmp_path, hub_cache, monkeypatch, max_steps=1, save_strategy="no", hub_private_repo=True,
                       hub_revision="dev")
    trainer.train()
    commit = trainer.push_to_hub(token=TOKEN, commit_message="by hand")

    repo = "standin-user/out"  # output_dir's name, under the token's user
    assert trainer.hub_model_id == repo and hub.repos[repo].private is True
    assert commit.oid == hub.commits[-1].oid and hub.commits[-1].summary == "by hand"
    assert set(hub.files(repo, "dev")) == MODEL_FOLDER and hub.files(repo, "main") == {}
    card = _front_matter(hub.files(repo, "dev")["README.md"])
    assert "datasets" not in card  # no dataset named


def test_cli_pushes_the_trained_model_once(hub, tmp_path, capfd):
    cli_main([
        "--model_name_or_path", str(TINY), "--dataset_name", str(DATA / "sft_prompt_completion.jsonl"),
        "--output_dir", str(tmp_path / "cli-out"), "--use_cpu", "--bf16", "false", "--report_to", "none",
        "--max_steps", "2", "--max_length", "64", "--per_device_train_batch_size", "4", "--save_strategy", "no",
        "--push_to_hub", "--hub_model_id", "org/cli-sft", "--hub_token", TOKEN,
    ])
    assert [c.summary for c in hub.commits] == ["End of training"]  # push_to_hub saves; no second "Model save" push
    assert set(hub.files("org/cli-sft")) == MODEL_FOLDER
    card = _front_matter(hub.files("org/cli-sft")["README.md"])
    assert "base_model" not in card and "datasets" not in card  # a local model and data file are not Hub ids
    out, err = capfd.readouterr()
    assert f"{hub.url}/org/cli-sft" in out
    _assert_token_written_nowhere(hub, tmp_path / "cli-out", out + err)


def test_model_push_to_hub_uploads_a_loadable_folder(hub, tmp_path):
    """``trainer.model.push_to_hub`` (transformers' model method) uploads what save_pretrained writes."""
    trainer = SFTTrainer(model=str(TINY), args=SFTConfig(str(tmp_path / "run"), max_steps=1, report_to="none",
                                                        use_cpu=True), train_dataset=Dataset.from_list(_rows()))
    trainer.model.push_to_hub(REPO, token=TOKEN)
    files = hub.files(REPO)
    assert {"config.json", "generation_config.json", "model.safetensors"} <= set(files)
    from safetensors.torch import load as load_safetensors

    weights = load_safetensors(files["model.safetensors"])
    assert torch.equal(weights["model.embed_tokens.weight"], trainer.model.get_input_embeddings().weight.detach())


def test_grpo_pushes_its_completions_tables_to_a_dataset_repository(hub, tmp_path):
    """log_completions_hub_repo (with log_completions): a dataset repository made (private as hub_private_repo asks)
    with a card, and every log's completions table uploaded by the time train() returns, byte for byte the local
    file; the token goes as the Authorization header."""
    from hfnative import GRPOConfig, GRPOTrainer

    out = tmp_path / "grpo"
    args = GRPOConfig(output_dir=str(out), use_cpu=True, bf16=False, report_to="none", disable_tqdm=True, max_steps=2,
                      logging_steps=1, save_strategy="no", per_device_train_batch_size=4, num_generations=4,
                      max_completion_length=4, log_completions=True, log_completions_hub_repo="org/completions",
                      hub_private_repo=True, hub_token=TOKEN)
    trainer = GRPOTrainer(model=str(TINY), reward_funcs=lambda completions, **kw: [float(len(c)) for c in completions],
                          args=args, train_dataset=Dataset.from_list([{"prompt": f"Say {i}"} for i in range(4)]))
    trainer.train()
    repo = hub.repos["org/completions"]
    assert (repo.kind, repo.private) == ("dataset", True)
    files = hub.files("org/completions")
    tables = sorted(name for name in files if name.endswith(".parquet"))
    assert tables == ["completions_00001.parquet", "completions_00002.parquet"]
    assert all(files[name] == (out / "completions" / name).read_bytes() for name in tables)
    assert "tags:" in files["README.md"].decode() and "# Completion logs" in files["README.md"].decode()
    assert not hub.unserved()
    posts = [(r.path, r.headers.get("authorization")) for r in hub.requests if r.method == "POST"]
    assert all(auth == f"Bearer {TOKEN}" for _, auth in posts), posts


def test_a_failed_last_completions_push_is_logged_not_raised(caplog):
    """The push when training ends waits a bounded time and never raises: a Hub error (or a timeout) is logged, and
    training's own result or error stands."""
    from concurrent.futures import Future

    from hfnative.trainers.rollout.completion_log import CompletionsUpload

    class Scheduler:
        repo_id = "org/completions"

        def trigger(self):
            future = Future()
            future.set_exception(ConnectionError("the Hub is unreachable"))
            return future

    upload = object.__new__(CompletionsUpload)
    upload.scheduler = Scheduler()
    with caplog.at_level(logging.WARNING):
        upload.finish()
    assert "not pushed to the Hub dataset org/completions: ConnectionError: the Hub is unreachable" in caplog.text
