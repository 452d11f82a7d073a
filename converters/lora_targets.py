"""Which modules a LoRA config adapts, decided by peft 0.21's rules on Hub module names.

Users name modules as peft does, by their paths in the transformers model
("model.layers.0.self_attn.q_proj"): a list of names matched as suffixes, a regex fully matched,
"all-linear", or None for peft's per-architecture default; layers_to_transform, exclude_modules,
rank/alpha patterns and modules_to_save apply as in peft. The family's ``Piece`` list says which native
linear(s) each Hub module is (``hub_modules``), so the mapping is stated once. A fused Hub projection
(Phi-3's qkv_proj, gate_up_proj) becomes one ``LoraTarget`` over the native projections it splits into.

MoE experts are no modules in transformers 5 but stacked 3-D parameters, which peft adapts through
``target_parameters`` (matched as suffixes of the parameter keys): natively the stacked ``gate_up_proj`` /
``down_proj`` of GPT-OSS, Qwen3-MoE and Mixtral (``fused_expert_parameters``; hfnative.peft.expert_lora). Not
adaptable: MoE routers (not nn.Linear in transformers 5), the output head and the embedding (they can train in full
through modules_to_save).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

import torch.nn as nn

from hfnative.peft import LoraSettings, LoraTarget, lora_settings
from hfnative.peft.token_rows import check_token_indices
from hfnative.peft.settings import SEQ_CLS_HEADS

from .export import hub_state_dict_pieces
from .families import Piece
from .loading import ConvertedModel

ALL_LINEAR = "all-linear"
# peft 0.21 TRANSFORMERS_MODELS_TO_LORA_TARGET_MODULES_MAPPING, for hfnative's families (phi3,
# qwen3_moe, olmo3 and gpt_oss have no entry there: peft asks for target_modules)
DEFAULT_TARGET_MODULES = {
    "llama": ["q_proj", "v_proj"],
    "mistral": ["q_proj", "v_proj"],
    "mixtral": ["q_proj", "v_proj"],
    "qwen2": ["q_proj", "v_proj"],
    "qwen3": ["q_proj", "v_proj"],
    "gemma3_text": ["q_proj", "v_proj"],
}
# the model types whose LoRA configs transformers 5's peft integration converts for its stacked experts (target_modules
# reaching them become target_parameters)
PEFT_CONVERTED_MOE_TYPES = ("qwen3_moe", "mixtral")
# peft condenses a target list this long into distinguishing suffixes before saving it
MIN_TARGET_MODULES_FOR_OPTIMIZATION = 20


# --- Hub modules and their native counterparts ------------------------------------------------------


@dataclass(frozen=True)
class HubModule:
    """A module of the transformers model that holds a ``weight``, and the native linear(s) it is."""

    path: str  # "model.layers.0.self_attn.qkv_proj"
    native: tuple[str, ...]  # native module names, in the Hub tensor's row order
    rows: tuple[tuple[int, int] | None, ...]
    lora_ok: bool  # an nn.Linear in both models that LoRA may adapt


def _module_of(key: str) -> str:
    return key.rpartition(".")[0]


def hub_parameter_pieces(converted: ConvertedModel) -> dict[str, list[Piece]]:
    """Hub parameter key -> its native piece(s), with ``lm_head.weight`` -> ``output.weight`` for tied
    models too (their head only exists natively once modules_to_save unties it)."""
    pieces_of = hub_state_dict_pieces(converted)
    if converted.args.tie_embeddings:
        pieces_of["lm_head.weight"].append(Piece("lm_head.weight", "output.weight"))
    return dict(pieces_of)


def hub_modules(converted: ConvertedModel) -> dict[str, HubModule]:
    """Every Hub module with a weight (stacked expert slices excluded), in checkpoint order."""
    model = converted.model
    modules = {}
    for hf_key, pieces in hub_parameter_pieces(converted).items():
        if not hf_key.endswith(".weight") or any(p.native_index is not None for p in pieces):
            continue
        path = _module_of(hf_key)
        native = tuple(_module_of(p.native_key) for p in pieces)
        lora_ok = (
            path != "lm_head"
            and all(n != "output" and not n.endswith(".router") for n in native)
            and all(isinstance(model.get_submodule(n), nn.Linear) for n in native)
        )
        modules[path] = HubModule(path, native, tuple(p.hf_rows for p in pieces), lora_ok)
    return modules


def _module_paths(pieces_of: dict[str, list[Piece]], with_experts: bool = False) -> list[str]:
    """The module paths peft matches names against (named_modules(): every dotted prefix of a parameter
    key). Per-expert paths are left out unless asked for: transformers 5 has no such modules."""
    paths = {}
    for key, pieces in pieces_of.items():
        if not with_experts and any(p.native_index is not None for p in pieces):
            continue
        parts = key.split(".")[:-1]
        for end in range(1, len(parts) + 1):
            paths.setdefault(".".join(parts[:end]), None)
    return list(paths)


# --- which modules: peft's matching rules ------------------------------------------------------------


def _layer_index_allowed(settings: LoraSettings, key: str) -> bool:
    layers = settings.layers_to_transform
    pattern = settings.layers_pattern
    match = None
    if not pattern:
        match = re.match(r".*?\.[^.]*\.(?P<idx>\d+)\.", key)  # the first numbered segment
    else:
        for layer_pattern in [pattern] if isinstance(pattern, str) else pattern:
            match = re.match(rf"(?:^|.*?\.){layer_pattern}\.(?P<idx>\d+)\.", key)
            if match is not None:
                break
    if match is None:
        return False
    index = int(match.group("idx"))
    return index == layers if isinstance(layers, int) else index in layers


def _is_target(settings: LoraSettings, target_modules, key: str) -> bool:
    """peft 0.21's check_target_module_exists."""
    exclude = settings.exclude_modules
    if exclude:
        if isinstance(exclude, str):
            if re.fullmatch(exclude, key):
                return False
        elif key in exclude or any(key.endswith(f".{e}") for e in exclude):
            return False
    if settings.modules_to_save and any(re.match(rf"(^|.*\.){m}($|\..*)", key) for m in settings.modules_to_save):
        return False
    if isinstance(target_modules, str):
        return re.fullmatch(target_modules, key) is not None
    if key in target_modules:  # an exact path is taken as is (layers_to_transform does not apply)
        return True
    found = any(key.endswith(f".{t}") for t in target_modules)
    layers = settings.layers_to_transform
    if found and layers is not None and (not isinstance(layers, list) or len(layers) > 0):
        found = _layer_index_allowed(settings, key)
    return found


def _minimal_target_modules(targets: set[str], others: set[str]) -> set[str]:
    """peft's _find_minimal_target_modules: the shortest suffixes that single out ``targets``."""

    def suffixes(name):
        parts = name.split(".")
        return [".".join(parts[i:]) for i in range(len(parts))][::-1]

    other_suffixes = {s for name in others for s in suffixes(name)}
    required: set[str] = set()
    for item, item_suffixes in sorted(((t, suffixes(t)) for t in targets), key=lambda pair: pair[1]):
        for suffix in item_suffixes:  # shortest first
            if suffix in required or suffix in other_suffixes:
                continue
            if not any(item.endswith("." + req) for req in required):
                required.add(suffix)
                break
    return required or set(targets)


def resolved_target_modules(converted: ConvertedModel, settings: LoraSettings):
    """target_modules as peft stores it after resolving: a regex string, or a set of names/paths."""
    target_modules = settings.target_modules
    model_type = getattr(converted.config, "model_type", None)
    if target_modules is None and settings.target_parameters:  # peft adapts the parameters alone; transformers 5's
        # peft integration rewrites target_modules (to an empty set) for the MoE types it converts
        return set() if model_type in PEFT_CONVERTED_MOE_TYPES else None
    if target_modules is None:
        if model_type not in DEFAULT_TARGET_MODULES:
            raise ValueError(
                f"LoRA target_modules=None: peft has no default target modules for model_type={model_type!r}; "
                "pass target_modules, e.g. ['q_proj', 'v_proj'] or 'all-linear'"
            )
        return set(DEFAULT_TARGET_MODULES[model_type])
    if isinstance(target_modules, str):
        if target_modules.lower() != ALL_LINEAR:
            return target_modules
        target_modules = {m.path for m in hub_modules(converted).values() if m.lora_ok}
    target_modules = set(target_modules)
    if len(target_modules) >= MIN_TARGET_MODULES_FOR_OPTIMIZATION:
        paths = _module_paths(hub_parameter_pieces(converted))
        endings = tuple("." + t for t in target_modules)
        others = {p for p in paths if p not in target_modules and not p.endswith(endings)}
        minimal = _minimal_target_modules(target_modules, others)
        if len(minimal) < len(target_modules):
            target_modules = minimal
    return target_modules


def _pattern_value(patterns: dict, key: str, default):
    """peft's get_pattern_key: the first pattern that matches the end of the module path."""
    for pattern in patterns:
        if re.match(rf"(.*\.)?({pattern})$", key):
            return patterns[pattern]
    return default


def expert_targets_refusal(converted: ConvertedModel, settings) -> str | None:
    """Why hfnative's native LoRA cannot carry ``settings`` on this MoE model (None: it can). peft 0.21 turns
    target_modules that reach the experts of transformers 5's stacked expert tensors (and, for all-linear, the router)
    into target_parameters of its own choosing (a Qwen3-MoE gate_up_proj at twice the rank, say); hfnative follows
    explicit target_parameters only, so such a config trains through peft on transformers' module rather than
    adapting other tensors than peft would."""
    if converted.args.moe is None:
        return None
    settings = lora_settings(settings)
    target_modules = settings.target_modules
    if target_modules is None:  # peft's per-architecture default, or no module when parameters are targeted
        if settings.target_parameters:
            return None
        target_modules = DEFAULT_TARGET_MODULES.get(getattr(converted.config, "model_type", None))
        if target_modules is None:
            return None
    expert_paths = [p for p in _module_paths(hub_parameter_pieces(converted), with_experts=True) if ".experts." in p]
    if isinstance(target_modules, str) and target_modules.lower() == ALL_LINEAR:
        hit = expert_paths[:1]
    else:
        hit = [p for p in expert_paths if _is_target(settings, target_modules, p)][:3]
    if not hit:
        return None
    return (f"LoRA target_modules={target_modules!r} reaches the MoE experts of this {converted.family.name} model "
            f"(e.g. {hit[0]}), which peft turns into target_parameters on the stacked expert tensors by rules of its "
            "own; hfnative's native LoRA follows target_parameters given explicitly")


# --- stacked expert tensors: peft's target_parameters ------------------------------------------------------------

# how transformers 5 holds each family's gate and up projections in one stacked gate_up_proj: as its output features'
# first and second halves, or interleaved feature by feature (gate, up, gate, up, ...)
GATE_UP_LAYOUT = {"qwen3_moe": "halves", "mixtral": "halves", "gpt_oss": "interleaved"}


@dataclass
class ExpertParameter:
    """A stacked expert tensor of the transformers model and the native weights it is."""

    key: str  # "model.layers.0.mlp.experts.gate_up_proj"
    module: str  # the native GroupedExperts: "layers.0.moe.experts"
    in_features: int
    out_features: int
    parts: dict[str, slice]  # native weight ("w1") -> its output features (rows of the adapter's B)


@dataclass
class ExpertTarget:
    parameter: ExpertParameter
    r: int
    lora_alpha: float


def fused_expert_parameters(converted: ConvertedModel) -> dict[str, ExpertParameter]:
    """transformers 5's stacked expert tensors of the model (``model.layers.{i}.mlp.experts.gate_up_proj`` /
    ``.down_proj``, in that order, as transformers registers them), by Hub key; empty for a family without them."""
    args = converted.args
    layout = GATE_UP_LAYOUT.get(converted.family.name)
    if args.moe is None or layout is None:
        return {}
    dim, hidden = args.dim, args.moe.intermediate_size
    if layout == "halves":
        gate_up = {"w1": slice(0, hidden), "w3": slice(hidden, 2 * hidden)}
    else:
        gate_up = {"w1": slice(0, None, 2), "w3": slice(1, None, 2)}
    found = {}
    for layer_id in range(args.n_layers):
        if not args.is_moe_layer(layer_id):
            continue
        hub, native = f"model.layers.{layer_id}.mlp.experts", f"layers.{layer_id}.moe.experts"
        found[f"{hub}.gate_up_proj"] = ExpertParameter(f"{hub}.gate_up_proj", native, dim, 2 * hidden, gate_up)
        found[f"{hub}.down_proj"] = ExpertParameter(f"{hub}.down_proj", native, hidden, dim, {"w2": slice(None)})
    return found


def target_parameters_refusal(converted: ConvertedModel, settings) -> str | None:
    """Why hfnative's native LoRA cannot carry ``settings``' target_parameters on this model (None: it can, or there
    are none). It adapts the stacked expert tensors of its MoE families (``fused_expert_parameters``), and each entry
    must name some of them (by their own name, ``gate_up_proj`` / ``down_proj``, as the last part); peft adapts any
    2-D or 3-D parameter (a router's weight, an expert bias), and warns where an entry matches nothing."""
    settings = lora_settings(settings)
    if not settings.target_parameters:
        return None
    experts = fused_expert_parameters(converted)
    names = sorted({key.rpartition(".")[2] for key in experts})
    for target in settings.target_parameters:
        if target.rpartition(".")[2] not in names or not any(_parameter_matches(target, key) for key in experts):
            return (f"LoRA target_parameters entry {target!r} names no stacked MoE expert tensor of this "
                    f"{converted.family.name} model that hfnative adapts (" + (f"its {names}" if names else "it has none")
                    + "; hfnative adapts the stacked expert tensors of GPT-OSS, Qwen3-MoE and Mixtral)")
    return None


def _parameter_matches(target: str, key: str) -> bool:
    """peft 0.21's target_parameters rule: the key itself or a dotted suffix of it."""
    return key == target or key.endswith(f".{target}")


def _expert_targets(converted: ConvertedModel, settings: LoraSettings) -> list[ExpertTarget]:
    targets = []
    for key, parameter in fused_expert_parameters(converted).items():
        if any(_parameter_matches(target, key) for target in settings.target_parameters or ()):
            r = _pattern_value(settings.rank_pattern, key, settings.r)
            alpha = _pattern_value(settings.alpha_pattern, key, settings.lora_alpha)
            targets.append(ExpertTarget(parameter, r, alpha))
    return targets


@dataclass
class LoraPlan:
    """What ``apply_lora`` will do, in both namings."""

    adapted: list[str]  # Hub module paths that get an adapter
    targets: list[LoraTarget]  # the same, natively
    copies: list[str]  # native parameter names trained in full (modules_to_save)
    untie: bool  # a tied head/embedding is among modules_to_save
    expert_targets: list[ExpertTarget] = field(default_factory=list)  # target_parameters, in Hub order
    token_rows: TokenRowsPlan | None = None  # trainable_token_indices


@dataclass
class TokenRowsPlan:
    """peft's trainable_token_indices resolved against the model: the embedding's trained rows, the head's own, and
    whether the head applies the embedding's (a tied model, when the two are not given different rows: peft then
    ties the head's adapter to the embedding's)."""

    embedding: list[int] | None
    head: list[int] | None
    head_shares: bool
    embedding_path: str  # the Hub module paths ("model.embed_tokens", "lm_head")
    head_path: str


def token_layer_paths(converted: ConvertedModel) -> tuple[str, str]:
    """The Hub module paths of the token embedding and the output head ("model.embed_tokens", "lm_head")."""
    pieces_of = hub_parameter_pieces(converted)
    embedding = next(k for k, pieces in pieces_of.items() if any(p.native_key == "tok_embeddings.weight" for p in pieces))
    head = next((k for k, pieces in pieces_of.items()
                 if k != embedding and any(p.native_key == "output.weight" for p in pieces)), "lm_head.weight")
    return embedding.rpartition(".")[0], head.rpartition(".")[0]


def plan_token_rows(converted: ConvertedModel, settings: LoraSettings, check_ids: bool = True) -> TokenRowsPlan | None:
    """trainable_token_indices as peft reads it: a list names rows of the input embedding, a dict names layers by
    the end of their path; a layer also in modules_to_save is an error; on a tied model the head follows the
    embedding's rows unless the dict gives it others. ``check_ids``: refuse ids past the vocabulary (False before a
    cloned template has resized it)."""
    indices = settings.trainable_token_indices
    if indices is None:
        return None
    embedding_path, head_path = token_layer_paths(converted)
    if not isinstance(indices, dict):
        indices = {embedding_path.rpartition(".")[2]: indices}
    embedding = head = None
    for name, ids in indices.items():
        if name in (settings.modules_to_save or []):
            raise ValueError(
                "The embedding layer is already marked to be trained fully, either specify "
                f'`modules_to_save=[..., "{name}", ...]` or `trainable_tokens={{\'{name}\': x}}` but not both.')
        if embedding_path.endswith(name):
            embedding = list(ids)
        elif head_path.endswith(name) and converted.args.num_labels is None:
            head = list(ids)
        else:
            raise ValueError(f"trainable_token_indices: {name!r} is not the {converted.family.name} model's token "
                             f"embedding ({embedding_path!r}) or output head ({head_path!r}), the layers whose rows "
                             "hfnative trains on their own")
    for name, ids in (("embed_tokens", embedding), ("lm_head", head)):
        if ids is not None and check_ids:
            check_token_indices(ids, converted.args.vocab_size, name)
    tied = bool(converted.args.tie_embeddings)
    head_shares = tied and embedding is not None and (head is None or head == embedding)
    if head_shares and any(head_path.endswith(name) for name in settings.modules_to_save or []):
        raise ValueError(
            f"trainable_token_indices with modules_to_save={settings.modules_to_save!r} on a model whose output head is "
            "tied to its embedding: peft cannot run that adapter (its tied token adapter would wrap the head's trained "
            f"copy). Leave {head_path!r} out of modules_to_save (the head's rows for those tokens train with the "
            "embedding's, as the two are tied), or load the model with tie_word_embeddings=False")
    return TokenRowsPlan(embedding, None if head_shares else head, head_shares, embedding_path, head_path)


def plan_lora(converted: ConvertedModel, settings, check_token_ids: bool = True) -> LoraPlan:
    """Resolve target_modules / layers_to_transform / modules_to_save / trainable_token_indices against the model,
    as peft does (``check_token_ids``: see ``plan_token_rows``)."""
    settings = lora_settings(settings)
    modules = hub_modules(converted)
    pieces_of = hub_parameter_pieces(converted)
    target_modules = resolved_target_modules(converted, settings)
    refusal = expert_targets_refusal(converted, settings) or target_parameters_refusal(converted, settings)
    if refusal is not None:  # the trainers route such a config to peft (fallback_loading.peft_route_reason)
        raise ValueError(f"{refusal}: train it through peft (a peft_config given to a trainer does), or target the "
                         "attention projections, e.g. ['q_proj', 'k_proj', 'v_proj', 'o_proj']")
    expert_targets = _expert_targets(converted, settings)
    adapted, targets, unsupported = [], [], []
    for path in _module_paths(pieces_of):
        if target_modules is None or not _is_target(settings, target_modules, path):
            continue
        module = modules.get(path)
        if module is None or not module.lora_ok:
            unsupported.append(path)
            continue
        r = _pattern_value(settings.rank_pattern, path, settings.r)
        alpha = _pattern_value(settings.alpha_pattern, path, settings.lora_alpha)
        adapted.append(path)
        targets.append(LoraTarget(module.native, r, alpha))
    if unsupported:
        raise ValueError(
            f"LoRA target_modules={settings.target_modules!r} matches modules hfnative cannot adapt: {unsupported[:8]}. "
            "LoRA applies to the nn.Linear projections of attention and dense MLPs; the output head and the "
            "embedding can train in full with modules_to_save=['lm_head'] / ['embed_tokens']"
        )
    if not adapted and not expert_targets:
        note = f" (layers_to_transform={settings.layers_to_transform})" if settings.layers_to_transform is not None else ""
        linear = sorted({m.path.rpartition(".")[2] for m in modules.values() if m.lora_ok})
        raise ValueError(
            f"LoRA target_modules={settings.target_modules!r} not found in the {converted.family.name} model{note}; "
            f"its adaptable modules are {linear}"
        )

    if settings.task_type == "SEQ_CLS" and converted.args.num_labels is None:
        raise ValueError(f"LoRA task_type='SEQ_CLS' on the {converted.family.name} causal LM: use task_type='CAUSAL_LM' "
                         "(or load the model as a sequence classifier)")
    copies = []
    for name in settings.modules_to_save or []:
        matched = [p for p in _module_paths(pieces_of, with_experts=True) if p.endswith(name)]  # peft: key.endswith(name)
        if not matched and settings.task_type == "SEQ_CLS" and name in SEQ_CLS_HEADS:
            continue  # peft's own additions for a classifier (one of them names its head)
        if not matched and name == "lm_head" and converted.args.num_labels is not None:
            continue  # what TRL's reward trainer adds for a cloned template's new tokens: a classifier has no LM head
            # (peft matches nothing)
        if not matched:
            raise ValueError(f"modules_to_save: {name!r} matches no module of the {converted.family.name} model")
        for path in matched:
            for hf_key, pieces in pieces_of.items():
                if not hf_key.startswith(path + "."):
                    continue
                if any(p.native_index is not None or ".moe.experts." in p.native_key for p in pieces):
                    raise ValueError(f"modules_to_save: {hf_key} is a stacked MoE expert weight, which hfnative cannot copy")
                for piece in pieces:
                    if piece.native_key not in copies:
                        copies.append(piece.native_key)
    untie = converted.args.tie_embeddings and any(k in copies for k in ("tok_embeddings.weight", "output.weight"))
    return LoraPlan(adapted, targets, copies, untie, expert_targets, plan_token_rows(converted, settings, check_token_ids))


__all__ = ["DEFAULT_TARGET_MODULES", "ExpertParameter", "ExpertTarget", "HubModule", "LoraPlan", "TokenRowsPlan",
           "fused_expert_parameters", "hub_modules", "hub_parameter_pieces", "plan_lora", "plan_token_rows",
           "resolved_target_modules", "target_parameters_refusal", "token_layer_paths"]


# --- GaLore / APOLLO targets: transformers' rule -------------------------------------------------------------------


def optim_target_parameters(converted: ConvertedModel, optim_target_modules) -> tuple[list[str], list[str]]:
    """What transformers' Trainer projects for GaLore / APOLLO (``_setup_low_rank_optimizer``), as native parameter
    names: the weights of the Hub model's ``nn.Linear`` modules whose path ``optim_target_modules`` names (its
    ``check_target_module_exists``: list entries as exact paths, substrings or full-match regexes; a string as a
    full-match regex; "all-linear" every linear, the output head too unless tied to the embedding), in the Hub
    model's order. Also returns the Hub paths among them that are one fused projection here split in several
    (each piece is projected on its own)."""
    from transformers.trainer_utils import check_target_module_exists

    all_linear = isinstance(optim_target_modules, str) and optim_target_modules.replace("_", "-") == ALL_LINEAR
    names, fused = [], []
    for path, module in hub_modules(converted).items():
        linear = module.lora_ok or (path == "lm_head" and not converted.args.tie_embeddings)
        if not linear or not (all_linear or check_target_module_exists(optim_target_modules, path)):
            continue
        names.extend(f"{native}.weight" for native in module.native)
        if len(module.native) > 1:
            fused.append(path)
    return names, fused
