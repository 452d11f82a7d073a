"""Resolve ``model_name_or_path``: a local folder, or a Hub repository id through huggingface_hub."""

from __future__ import annotations

import os
import re
from pathlib import Path

# what a model folder needs for training and export; weights load only from safetensors
MODEL_FILE_PATTERNS = [
    "*.json",
    "*.safetensors",
    "*.jinja",
    "tokenizer*",
    "*.model",
    "*.txt",
    "*.tiktoken",
]


# a Hub repository id: "name" or "namespace/name"
HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*(/[\w.-]+)?$")


def resolve_model_dir(
    name_or_path: str | os.PathLike,
    revision: str | None = None,
    cache_dir: str | None = None,
    token: str | bool | None = None,
) -> Path:
    """The local folder holding the checkpoint: ``name_or_path`` itself, or a Hub snapshot.

    Hub downloads honour ``revision``, ``cache_dir`` and HF_HUB_OFFLINE (then only the cache is used).
    """
    path = Path(name_or_path).expanduser()
    if path.is_dir():
        return path
    name = str(name_or_path)
    if path.exists() or not HUB_ID.match(name):
        raise FileNotFoundError(
            f"model_name_or_path={name!r} is not a folder; pass a folder holding config.json and "
            f"*.safetensors, or a Hub repository id such as 'Qwen/Qwen3-0.6B'"
        )
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import HfHubHTTPError, LocalEntryNotFoundError, RepositoryNotFoundError

    try:
        return Path(
            snapshot_download(
                repo_id=name,
                revision=revision,
                cache_dir=cache_dir,
                token=token,
                allow_patterns=MODEL_FILE_PATTERNS,
            )
        )
    except LocalEntryNotFoundError as err:
        raise FileNotFoundError(
            f"model_name_or_path={name!r} is neither a local folder nor in the Hub cache, and the Hub "
            f"cannot be reached (HF_HUB_OFFLINE={os.environ.get('HF_HUB_OFFLINE', '0')}): {err}"
        ) from err
    except RepositoryNotFoundError as err:
        raise FileNotFoundError(
            f"model_name_or_path={name!r}: no such local folder and no such Hub repository "
            f"(or it is private: pass a token)"
        ) from err
    except HfHubHTTPError as err:
        raise FileNotFoundError(f"model_name_or_path={name!r}: the Hub answered {err}") from err
