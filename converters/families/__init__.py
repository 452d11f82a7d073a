"""The supported model families, looked up by the ``architectures`` entry of a config."""

from . import gemma3, gpt_oss, llama, mistral, mixtral, olmo3, phi3, qwen2, qwen3, qwen3_moe
from .common import Family, Piece, UnsupportedModelError, model_pieces

FAMILIES = [m.FAMILY for m in (llama, mistral, qwen2, qwen3, qwen3_moe, mixtral, phi3, gemma3, olmo3, gpt_oss)]
_BY_ARCHITECTURE = {arch: family for family in FAMILIES for arch in family.architectures}
SUPPORTED_ARCHITECTURES = sorted(_BY_ARCHITECTURE)


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


__all__ = ["FAMILIES", "Family", "Piece", "SUPPORTED_ARCHITECTURES", "UnsupportedModelError", "family_for_config", "model_pieces"]
