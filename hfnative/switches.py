"""The engine's environment switches: most are on unless their variable is set to 0, false, no or off; an opt-in one
is off unless its variable is set to 1, true, yes or on."""

from __future__ import annotations

import os


def switched_off(name: str) -> bool:
    """Whether the environment variable ``name`` turns its switch off (0, false, no, off; any case, spaces ignored)."""
    return os.environ.get(name, "1").strip().lower() in ("0", "false", "no", "off")


def switched_on(name: str) -> bool:
    """Whether the environment variable ``name`` turns an opt-in switch on (1, true, yes, on; any case, spaces
    ignored)."""
    return os.environ.get(name, "0").strip().lower() in ("1", "true", "yes", "on")
