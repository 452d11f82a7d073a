"""The supported model families, looked up by the ``architectures`` entry of a config.

Each family's causal LM (``*ForCausalLM``) and its sequence classifier (transformers' ``*ForSequenceClassification``
of the same model_type: the same decoder with a score head) are native.
"""

from transformers.models.auto.modeling_auto import MODEL_FOR_SEQUENCE_CLASSIFICATION_MAPPING_NAMES

from . import gemma3, gpt_oss, llama, mistral, mixtral, olmo3, phi3, qwen2, qwen3, qwen3_moe
from .common import Family, Piece, UnsupportedModelError, model_pieces

FAMILIES = [m.FAMILY for m in (llama, mistral, qwen2, qwen3, qwen3_moe, mixtral, phi3, gemma3, olmo3, gpt_oss)]
# the sequence-classification architecture of each family (transformers' name for its model_type)
CLASSIFIER_ARCHITECTURES = {
    family.name: MODEL_FOR_SEQUENCE_CLASSIFICATION_MAPPING_NAMES[family.name]
    for family in FAMILIES if family.name in MODEL_FOR_SEQUENCE_CLASSIFICATION_MAPPING_NAMES
}
_BY_ARCHITECTURE = {arch: family for family in FAMILIES for arch in family.architectures}
_BY_ARCHITECTURE.update({arch: family for family in FAMILIES for arch in [CLASSIFIER_ARCHITECTURES.get(family.name)] if arch})
SUPPORTED_ARCHITECTURES = sorted(_BY_ARCHITECTURE)


def is_sequence_classifier(config) -> bool:
    """Whether a config names a sequence-classification architecture (a ``*ForSequenceClassification``)."""
    return any(str(arch).endswith("ForSequenceClassification") for arch in getattr(config, "architectures", None) or [])


def family_for_config(config) -> Family:
    """The family of a transformers config, from its ``architectures`` (or model_type) entry."""
    architectures = list(getattr(config, "architectures", None) or [])
    for arch in architectures:
        if arch in _BY_ARCHITECTURE:
            return _BY_ARCHITECTURE[arch]
    if not architectures:
        model_type = getattr(config, "model_type", None)
        for family in FAMILIES:
            if model_type == family.name:
                return family
    raise UnsupportedModelError(
        f"architectures={architectures or None} (model_type={getattr(config, 'model_type', None)!r}) is not "
        f"supported by hfnative's native models; supported architectures: {', '.join(SUPPORTED_ARCHITECTURES)}"
    )


__all__ = ["CLASSIFIER_ARCHITECTURES", "FAMILIES", "Family", "Piece", "SUPPORTED_ARCHITECTURES", "UnsupportedModelError", "family_for_config",
           "is_sequence_classifier", "model_pieces"]
