"""LoRA and quantized-base settings under the names peft and transformers users already pass.

``lora_settings`` accepts a ``peft.LoraConfig`` (read field by field, so peft stays optional), a dict of
the same fields (e.g. a loaded ``adapter_config.json``) or a ``LoraSettings``. ``quantization_settings`` reads
``load_in_4bit=True``, ``load_in_8bit=True`` or a ``quantization_config`` shaped like transformers'
``BitsAndBytesConfig``.
"""

from __future__ import annotations

import dataclasses
import functools
import sys
from dataclasses import dataclass, field

import torch

BIAS_MODES = ("none", "all", "lora_only")
INIT_MODES = (True, False, "gaussian")


@dataclass
class LoraSettings:
    """The LoraConfig fields hfnative implements, with peft 0.21's defaults."""

    r: int = 8
    lora_alpha: float = 8
    lora_dropout: float = 0.0
    # HF module names (["q_proj", "v_proj"]), a regex fully matched against HF module paths,
    # "all-linear", or None for peft's per-architecture default
    target_modules: list[str] | str | None = None
    exclude_modules: list[str] | str | None = None
    bias: str = "none"  # none | all | lora_only: which base biases train alongside the adapter
    use_rslora: bool = False  # scaling lora_alpha / sqrt(r) instead of lora_alpha / r
    use_dora: bool = False
    modules_to_save: list[str] | None = None  # HF module names trained in full (e.g. lm_head)
    layers_to_transform: list[int] | int | None = None
    # Hub parameter names (suffixes, as peft matches them) of stacked MoE expert tensors adapted directly
    # ("mlp.experts.gate_up_proj", "7.mlp.experts.down_proj"): hfnative.peft.expert_lora
    target_parameters: list[str] | None = None
    layers_pattern: list[str] | str | None = None
    # token rows trained on their own (peft's trainable tokens): ids of the input embedding's rows, or a dict of
    # layer name ("embed_tokens", "lm_head") -> ids (hfnative.peft.token_rows)
    trainable_token_indices: list[int] | dict[str, list[int]] | None = None
    rank_pattern: dict[str, int] = field(default_factory=dict)
    alpha_pattern: dict[str, float] = field(default_factory=dict)
    init_lora_weights: bool | str = True  # True: A kaiming-uniform(a=sqrt 5), B zeros; "gaussian"; False
    task_type: str | None = "CAUSAL_LM"
    inference_mode: bool = False
    # peft's get_peft_model(autocast_adapter_dtype=True): bf16/fp16 adapters are kept in float32
    autocast_adapter_dtype: bool = True

    def __post_init__(self):
        if isinstance(self.target_modules, (set, tuple)):
            self.target_modules = sorted(self.target_modules)
        if isinstance(self.exclude_modules, (set, tuple)):
            self.exclude_modules = sorted(self.exclude_modules)
        if isinstance(self.modules_to_save, (set, tuple)):
            self.modules_to_save = list(self.modules_to_save)
        if isinstance(self.target_parameters, str):
            self.target_parameters = [self.target_parameters]
        elif isinstance(self.target_parameters, (set, tuple)):
            self.target_parameters = list(self.target_parameters)
        if isinstance(self.trainable_token_indices, (tuple, set)):
            self.trainable_token_indices = list(self.trainable_token_indices)
        if isinstance(self.trainable_token_indices, dict):
            self.trainable_token_indices = {name: list(ids) for name, ids in self.trainable_token_indices.items()}
        elif self.trainable_token_indices is not None and not isinstance(self.trainable_token_indices, list):
            raise ValueError(f"trainable_token_indices={self.trainable_token_indices!r}: expected a list of token ids "
                             "or a dict of layer name -> token ids")
        if self.target_parameters:  # peft's ParamWrapper refuses these
            for name, value, unset in (("lora_dropout", self.lora_dropout, 0.0), ("use_dora", self.use_dora, False)):
                if value != unset:
                    raise ValueError(f"LoRA target_parameters={self.target_parameters!r} with {name}={value!r}: peft's "
                                     f"adapters on parameters do not work with {name}; set {name}={unset!r}")
        if not isinstance(self.r, int) or self.r <= 0:
            raise ValueError(f"LoRA r={self.r!r}: expected a positive integer")
        if self.bias not in BIAS_MODES:
            raise ValueError(f"LoRA bias={self.bias!r}: expected one of {BIAS_MODES}")
        if not 0.0 <= self.lora_dropout < 1.0:
            raise ValueError(f"lora_dropout={self.lora_dropout!r}: expected a probability in [0, 1)")
        if self.init_lora_weights not in INIT_MODES:
            raise ValueError(
                f"init_lora_weights={self.init_lora_weights!r} is not supported by hfnative; use one of {INIT_MODES}"
            )
        if self.task_type not in (None, "CAUSAL_LM", "SEQ_CLS"):
            raise ValueError(f"task_type={self.task_type!r}: hfnative trains causal LMs ('CAUSAL_LM') and sequence "
                             "classifiers ('SEQ_CLS')")

    def scaling(self, r: int | None = None, lora_alpha: float | None = None) -> float:
        r = self.r if r is None else r
        lora_alpha = self.lora_alpha if lora_alpha is None else lora_alpha
        return lora_alpha / r**0.5 if self.use_rslora else lora_alpha / r


# LoraConfig fields hfnative does not implement, with the value that means "not used"
UNSUPPORTED_DEFAULTS = {
    "fan_in_fan_out": False,
    "lora_bias": False,
    "use_qalora": False,
    "layer_replication": None,
    "alora_invocation_tokens": None,
    "arrow_config": None,
    "use_bdlora": None,
    "velora_config": None,
    "monteclora_config": None,
    "kasa_config": None,
    "megatron_config": None,
    "ensure_weight_tying": False,
}
_FIELDS = [f.name for f in dataclasses.fields(LoraSettings)]


def _enum_value(value):
    return getattr(value, "value", value)  # peft's TaskType / PeftType are str enums


def lora_settings(config) -> LoraSettings:
    """A peft LoraConfig, a dict of its fields, or LoraSettings -> LoraSettings.

    Raises ValueError for another PEFT method or a LoRA option hfnative does not implement.
    """
    if isinstance(config, LoraSettings):
        return config
    if config is None:
        raise ValueError("no LoRA config given: pass a peft.LoraConfig, a dict of its fields or a LoraSettings")
    get = config.get if isinstance(config, dict) else (lambda name, default=None: getattr(config, name, default))
    peft_type = _enum_value(get("peft_type", "LORA"))
    if peft_type not in (None, "LORA"):
        raise ValueError(f"peft_type={peft_type!r}: hfnative implements LoRA (and DoRA) adapters only")
    used = []
    for name, default in UNSUPPORTED_DEFAULTS.items():
        value = get(name, default)
        if value not in (default, None) and not (isinstance(value, (dict, list)) and not value):
            used.append(f"{name}={value!r}")
    if used:
        raise ValueError(f"LoRA options not supported by hfnative: {', '.join(used)}; remove them from the LoraConfig")
    defaults = LoraSettings()
    values = {}
    for name in _FIELDS:
        value = get(name, getattr(defaults, name))
        values[name] = _enum_value(value)
    for name in ("rank_pattern", "alpha_pattern"):
        values[name] = dict(values[name] or {})
    if values["task_type"] == "SEQ_CLS":  # peft trains a classifier's head in full: it adds these to modules_to_save
        existing = list(values["modules_to_save"] or [])
        values["modules_to_save"] = existing + [name for name in seq_cls_heads() if name not in existing]
    return LoraSettings(**values)


# the module names peft's PeftModelForSequenceClassification adds to modules_to_save (peft 0.22 on)
SEQ_CLS_HEADS = ("classifier", "score", "pre_classifier")


@functools.cache
def seq_cls_heads() -> tuple[str, ...]:
    """The names the installed peft adds to a classifier's modules_to_save: SEQ_CLS_HEADS from peft 0.22 on,
    ('classifier', 'score') before; SEQ_CLS_HEADS without peft. A release is told by its version (peft is not
    imported for it); a development or pre-release build, or a peft already imported, by its own list."""
    from importlib.metadata import PackageNotFoundError, version

    from packaging.version import InvalidVersion, Version

    try:
        installed = Version(version("peft"))
    except (PackageNotFoundError, InvalidVersion):
        return SEQ_CLS_HEADS
    if installed.is_devrelease or installed.is_prerelease or "peft" in sys.modules:
        try:
            from peft.peft_model import CLASSIFIER_MODULE_NAMES
        except ImportError:  # a peft before the list was named: the two names it added
            return SEQ_CLS_HEADS[:2]
        return tuple(CLASSIFIER_MODULE_NAMES)
    return SEQ_CLS_HEADS if installed >= Version("0.22.0") else SEQ_CLS_HEADS[:2]


@dataclass(frozen=True)
class NF4Settings:
    """QLoRA base weights: NF4 with torchao; matmuls run in ``compute_dtype``.

    torchao always quantizes the per-block scales a second time (bitsandbytes' double quantization),
    so ``bnb_4bit_use_double_quant=False`` cannot be honoured; it is accepted and has no effect.
    ``skip_modules``: transformers' module names (or patterns) left unquantized instead of the default (the output
    head), ``llm_int8_skip_modules``.
    """

    compute_dtype: torch.dtype = torch.float32
    skip_modules: tuple[str, ...] | None = None


@dataclass(frozen=True)
class Int8Settings:
    """LLM.int8 base weights (``hfnative.peft.quantize.Int8Weight``): int8 rows and their absolute maxima, as
    bitsandbytes stores them; matmuls run in the activations' dtype on the dequantized rows. bitsandbytes' outlier
    threshold (``llm_int8_threshold``) chooses which input columns it computes from unquantized activations; here
    every column is, so the threshold has no effect. ``skip_modules`` as in ``NF4Settings``."""

    skip_modules: tuple[str, ...] | None = None


def _dtype(value) -> torch.dtype:
    if isinstance(value, torch.dtype):
        return value
    if isinstance(value, str) and isinstance(getattr(torch, value.removeprefix("torch."), None), torch.dtype):
        return getattr(torch, value.removeprefix("torch."))
    raise ValueError(f"bnb_4bit_compute_dtype={value!r}: expected a torch dtype or its name, e.g. 'bfloat16'")


QUANTIZATION_KWARGS = ("load_in_4bit", "load_in_8bit", "quantization_config")


def quantization_request(kwargs: dict) -> dict:
    """The quantization keys of ``model_init_kwargs`` (``QUANTIZATION_KWARGS``), as ``quantization_settings``
    takes them."""
    return dict(load_in_4bit=bool(kwargs.get("load_in_4bit", False)), load_in_8bit=bool(kwargs.get("load_in_8bit", False)),
                quantization_config=kwargs.get("quantization_config"))


def is_quantization_requested(kwargs: dict) -> bool:
    """Whether ``model_init_kwargs`` ask for a quantized base (``quantization_settings`` not None; a bad request
    raises its error)."""
    return quantization_settings(**quantization_request(kwargs)) is not None


def quantization_settings(load_in_4bit: bool = False, quantization_config=None,
                          load_in_8bit: bool = False) -> NF4Settings | Int8Settings | None:
    """``load_in_4bit`` / ``load_in_8bit`` / a BitsAndBytesConfig (or a dict of its fields) -> NF4Settings (4 bits),
    Int8Settings (8 bits), or None for no quantization."""
    get = (
        (lambda name, default=None: default) if quantization_config is None
        else quantization_config.get if isinstance(quantization_config, dict)
        else (lambda name, default=None: getattr(quantization_config, name, default))
    )
    method = str(getattr(get("quant_method", "bitsandbytes"), "value", get("quant_method", "bitsandbytes")))
    if method == "mxfp4":  # GPT-OSS's recipe: Mxfp4Config(dequantize=True), what loading an MXFP4 checkpoint does here
        if not get("dequantize", False):
            raise ValueError("quantization_config Mxfp4Config(dequantize=False) keeps MXFP4 weights for inference; "
                             "training reads them dequantized (as hfnative loads an MXFP4 checkpoint): set "
                             "dequantize=True, or drop the quantization_config")
        return None
    if method != "bitsandbytes":
        raise ValueError(f"quantization_config with quant_method={method!r}: hfnative quantizes a frozen base with "
                         "BitsAndBytesConfig's settings only (load_in_4bit or load_in_8bit)")
    four = bool(get("load_in_4bit", False) or load_in_4bit)
    eight = bool(get("load_in_8bit", False) or load_in_8bit)
    if four and eight:
        raise ValueError("load_in_4bit and load_in_8bit are both set: choose one")
    skip = get("llm_int8_skip_modules", None)
    skip = None if skip is None else (tuple([skip] if isinstance(skip, str) else skip))
    if eight:
        if get("llm_int8_has_fp16_weight", False):
            raise ValueError("llm_int8_has_fp16_weight=True trains the 8-bit base's weights in fp16; hfnative's 8-bit "
                             "base is frozen (LoRA trains beside it): leave it False")
        return Int8Settings(skip)
    if not four:
        return None
    quant_type = get("bnb_4bit_quant_type", "nf4")
    if quant_type != "nf4":
        raise ValueError(f"bnb_4bit_quant_type={quant_type!r}: hfnative quantizes with torchao's NF4 only; use 'nf4'")
    compute_dtype = get("bnb_4bit_compute_dtype", None)
    return NF4Settings(torch.float32 if compute_dtype is None else _dtype(compute_dtype), skip)
