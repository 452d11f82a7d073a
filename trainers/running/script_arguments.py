"""TRL's script and model arguments (``ScriptArguments``, ``ModelConfig``), and what they turn into:
the train / eval datasets, the model's ``model_init_kwargs`` and a LoRA ``peft_config``.

Field names, defaults and help follow TRL 1.16 so ``trl sft`` command lines and YAML configs work
unchanged. Errors a user can cause are ValueError / FileNotFoundError naming the argument.
"""

from __future__ import annotations

import json
import logging
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

from hfnative.converters.hub import HUB_ID

logger = logging.getLogger(__name__)

# file suffix -> the datasets builder that reads it
DATA_FILE_BUILDERS = {".json": "json", ".jsonl": "json", ".parquet": "parquet", ".csv": "csv"}


@dataclass
class ScriptArguments:
    """TRL's ScriptArguments: which dataset, and which of its splits train and evaluate."""

    dataset_name: str | None = field(
        default=None,
        metadata={"help": "A local .json/.jsonl/.parquet/.csv file, a folder of such files or one written by "
                          "save_to_disk, or a Hub dataset id."},
    )
    dataset_config: str | None = field(
        default=None, metadata={"help": "Dataset configuration name (the `name` argument of datasets.load_dataset)."}
    )
    dataset_train_split: str = field(default="train", metadata={"help": "Dataset split to train on."})
    dataset_test_split: str = field(
        default="test", metadata={"help": "Dataset split to evaluate on (used when eval_strategy is not 'no')."}
    )
    dataset_streaming: bool = field(
        default=False, metadata={"help": "Stream the dataset instead of loading it (needs max_steps)."}
    )


@dataclass
class ModelArguments:
    """TRL's ModelConfig: the model to load, and LoRA / 4-bit options."""

    model_name_or_path: str | None = field(
        default=None, metadata={"help": "Model checkpoint: a local folder or a Hub model id."}
    )
    model_revision: str = field(default="main", metadata={"help": "Hub revision (branch, tag or commit) of the model."})
    dtype: str | None = field(
        default="float32",
        metadata={"help": "dtype to load the weights in.", "choices": ["auto", "bfloat16", "float16", "float32"]},
    )
    attn_implementation: str | None = field(
        default=None, metadata={"help": "Accepted for TRL compatibility and ignored: hfnative uses its own attention."}
    )
    use_peft: bool = field(default=False, metadata={"help": "Train a LoRA adapter instead of all weights."})
    lora_r: int = field(default=16, metadata={"help": "LoRA rank."})
    lora_alpha: int = field(default=32, metadata={"help": "LoRA alpha (the update is scaled by alpha / r)."})
    lora_dropout: float = field(default=0.05, metadata={"help": "LoRA dropout."})
    lora_target_modules: list[str] | None = field(
        default=None, metadata={"help": "Modules to adapt, e.g. q_proj v_proj, or all-linear."}
    )
    lora_target_parameters: list[str] | None = field(
        default=None, metadata={"help": "Parameters to adapt (PEFT's target_parameters, e.g. MoE experts)."}
    )
    lora_modules_to_save: list[str] | None = field(
        default=None, metadata={"help": "Modules trained in full and saved beside the adapter."}
    )
    lora_task_type: str = field(default="CAUSAL_LM", metadata={"help": "PEFT task type."})
    use_rslora: bool = field(default=False, metadata={"help": "Rank-stabilised LoRA: scale by alpha / sqrt(r)."})
    use_dora: bool = field(default=False, metadata={"help": "Weight-decomposed LoRA (DoRA)."})
    load_in_8bit: bool = field(default=False, metadata={"help": "Keep the frozen base in 8 bits (int8 rows, as "
                                                                "bitsandbytes' LLM.int8 stores them) under LoRA."})
    load_in_4bit: bool = field(default=False, metadata={"help": "Keep the frozen base in 4 bits (QLoRA)."})
    bnb_4bit_quant_type: str = field(
        default="nf4", metadata={"help": "4-bit quantization type.", "choices": ["fp4", "nf4"]}
    )
    use_bnb_nested_quant: bool = field(default=False, metadata={"help": "Accepted for TRL compatibility and ignored."})
    bnb_4bit_quant_storage: str | None = field(
        default=None, metadata={"help": "Accepted for TRL compatibility and ignored."}
    )

    def __post_init__(self):
        if self.load_in_8bit and self.load_in_4bit:
            raise ValueError("load_in_8bit and load_in_4bit cannot both be set")
        if self.load_in_4bit and self.bnb_4bit_quant_type != "nf4":
            raise ValueError(f"bnb_4bit_quant_type={self.bnb_4bit_quant_type!r}: hfnative's 4-bit base is NF4; use 'nf4'")
        # as TRL: one module name (e.g. "all-linear") is passed on as a string
        if self.lora_target_modules is not None and len(self.lora_target_modules) == 1:
            self.lora_target_modules = self.lora_target_modules[0]


def peft_config_from(model_args: ModelArguments) -> dict | None:
    """The LoRA settings as a LoraConfig-style dict (None without ``use_peft``)."""
    if not model_args.use_peft:
        return None
    config = {
        "r": model_args.lora_r,
        "lora_alpha": model_args.lora_alpha,
        "lora_dropout": model_args.lora_dropout,
        "target_modules": model_args.lora_target_modules,
        "modules_to_save": model_args.lora_modules_to_save,
        "bias": "none",
        "task_type": model_args.lora_task_type,
    }
    if model_args.lora_target_parameters is not None:
        config["target_parameters"] = model_args.lora_target_parameters
    if model_args.use_rslora:
        config["use_rslora"] = True
    if model_args.use_dora:
        config["use_dora"] = True
    return config


def model_init_kwargs_from(model_args: ModelArguments, training_args) -> dict:
    """What the trainer loads the model with; the config's own ``model_init_kwargs`` win, as in TRL."""
    ignored = {"attn_implementation": "hfnative uses its own attention", "use_bnb_nested_quant": "",
               "bnb_4bit_quant_storage": ""}
    for name, why in ignored.items():
        if getattr(model_args, name):
            logger.warning("%s=%r is ignored%s", name, getattr(model_args, name), f": {why}" if why else "")
    if getattr(training_args, "trust_remote_code", False):
        logger.warning("trust_remote_code is ignored: hfnative runs no remote code, it builds supported architectures natively")
    kwargs = {"revision": model_args.model_revision, "dtype": model_args.dtype}
    if model_args.load_in_4bit:
        kwargs["load_in_4bit"] = True
    if model_args.load_in_8bit:
        kwargs["load_in_8bit"] = True
    own = training_args.model_init_kwargs
    if isinstance(own, dict):
        kwargs.update(own)
    return kwargs


def load_dataset_dict(name: str, config: str | None = None, streaming: bool = False, default_split: str = "train"):
    """``--dataset_name``: a data file, a folder (data files, or save_to_disk output) or a Hub id,
    as a DatasetDict (an IterableDatasetDict when streaming). A single saved Dataset becomes ``default_split``."""
    import datasets

    path = Path(name).expanduser()
    builder = DATA_FILE_BUILDERS.get(path.suffix.lower()) if path.is_file() else None
    if path.is_file():
        if builder is None:
            raise ValueError(f"dataset_name={name!r} is a {path.suffix or 'suffix-less'} file; expected one of "
                             f"{', '.join(DATA_FILE_BUILDERS)}")
        if path.stat().st_size == 0:
            raise ValueError(f"dataset_name={name!r} is an empty file: it holds no rows to train on")
    elif not path.is_dir() and (path.exists() or not HUB_ID.match(name)):
        raise FileNotFoundError(f"dataset_name={name!r}: no such file or folder, and not a Hub dataset id")
    try:
        with _file_reader_errors_raised_only():
            if builder is not None:
                return datasets.load_dataset(builder, data_files=str(path), streaming=streaming)
            if path.is_dir() and ((path / "dataset_dict.json").exists() or (path / "state.json").exists()):
                saved = datasets.load_from_disk(str(path))
                return saved if isinstance(saved, datasets.DatasetDict) else datasets.DatasetDict({default_split: saved})
            return datasets.load_dataset(str(path) if path.is_dir() else name, name=config, streaming=streaming)
    except Exception as err:  # datasets' own errors (offline Hub, unreadable files, ...) named with the input
        problem = _json_file_problem(path) if builder == "json" else None
        raise ValueError(f"dataset_name={name!r} could not be loaded: {problem or _error_and_cause(err)}") from err


@contextmanager
def _file_reader_errors_raised_only():
    """datasets' JSON and CSV readers log a failure before raising it; the error raised here carries it."""
    readers = [logging.getLogger(f"datasets.packaged_modules.{kind}.{kind}") for kind in ("json", "csv")]
    for reader in readers:
        reader.addFilter(_below_error)
    try:
        yield
    finally:
        for reader in readers:
            reader.removeFilter(_below_error)


def _below_error(record: logging.LogRecord) -> bool:
    return record.levelno < logging.ERROR


def _one_line(text) -> str:
    return " ".join(str(text).split())


def _error_and_cause(err: BaseException) -> str:
    """"DatasetGenerationError: ... (caused by ArrowInvalid: ... in row 3)": the root cause holds the detail."""
    root = err
    while root.__cause__ is not None or root.__context__ is not None:
        root = root.__cause__ or root.__context__
    text = f"{type(err).__name__}: {_one_line(err)}"
    return text if root is err else f"{text} (caused by {type(root).__name__}: {_one_line(root)})"


def _json_file_problem(path: Path) -> str | None:
    """Where a .json / .jsonl file stops being JSON, read by us (datasets' reader counts rows per block)."""
    text = path.read_text(encoding="utf-8", errors="replace")
    if not text.strip():
        return "the file holds no rows (only blank lines)"
    try:
        json.loads(text)
        return None  # one JSON document: what datasets rejects is its content, not its syntax
    except json.JSONDecodeError as err:
        if text.lstrip().startswith("["):
            return f"not valid JSON at line {err.lineno}, column {err.colno} ({err.msg})"
    row = 0
    for number, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            json.loads(line)
        except json.JSONDecodeError as err:
            return (f"line {number} (row {row}) is not valid JSON ({err.msg}, column {err.colno}); "
                    "each line of a JSON Lines file must be one complete JSON object")
        row += 1
    return None


def dataset_split(splits, split: str, name: str, argument: str):
    """``splits[split]``, or a ValueError naming the available splits and the argument to change."""
    if split not in splits:
        raise ValueError(f"dataset_name={name!r} has no split {split!r} (available: {', '.join(splits)}); "
                         f"set {argument} to one of them")
    rows = splits[split]
    if getattr(rows, "num_rows", None) == 0:
        raise ValueError(f"dataset_name={name!r}: split {split!r} has no rows")
    return rows


def train_and_eval_datasets(script_args: ScriptArguments, training_args):
    """The train split, and the test split when evaluation is on (else None)."""
    if not script_args.dataset_name:
        raise ValueError("dataset_name is required: a local data file or folder, or a Hub dataset id")
    splits = load_dataset_dict(script_args.dataset_name, script_args.dataset_config, script_args.dataset_streaming,
                               script_args.dataset_train_split)
    name = script_args.dataset_name
    train = dataset_split(splits, script_args.dataset_train_split, name, "dataset_train_split")
    evaluate = str(getattr(training_args.eval_strategy, "value", training_args.eval_strategy)) != "no"
    test = dataset_split(splits, script_args.dataset_test_split, name, "dataset_test_split") if evaluate else None
    return train, test
