"""The engine's environment switches: each is on unless its variable is set to 0, false, no or off."""

from __future__ import annotations

import os


def switched_off(name: str) -> bool:
    """Whether the environment variable ``name`` turns its switch off (0, false, no, off; any case, spaces ignored)."""
    return os.environ.get(name, "1").strip().lower() in ("0", "false", "no", "off")
