"""No library module unpickles: every ``torch.load`` passes ``weights_only=True``, and nothing calls ``pickle.load`` /
``pickle.loads`` / ``pickle.Unpickler`` (or cloudpickle's, dill's), ``torch.load(weights_only=False)`` or
``numpy.load(allow_pickle=True)`` — read by AST over every module of hfnative/, converters/ and trainers/.

Nothing is allow-listed: a module that needs an exception must name it here, with the reason (data it made itself
in the same process)."""

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
LIBRARY = ("hfnative", "converters", "trainers")
PICKLE_MODULES = {"pickle", "cPickle", "_pickle", "cloudpickle", "dill", "joblib"}
UNPICKLING_NAMES = {"load", "loads", "Unpickler"}
ALLOWED: dict[tuple[str, int], str] = {}  # (path, line) -> why it only reads back what the same process made


def _dotted(node: ast.AST) -> str | None:
    """``a.b.c`` for a Name / Attribute chain, else None."""
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if isinstance(node, ast.Name):
        return ".".join([node.id, *reversed(parts)])
    return None


def _keyword(call: ast.Call, name: str):
    """The constant value of keyword ``name`` (``...`` when it is not a constant), or None when absent."""
    for keyword in call.keywords:
        if keyword.arg == name:
            return keyword.value.value if isinstance(keyword.value, ast.Constant) else ...
    return None


def unpickling_calls(source: str) -> list[tuple[int, str]]:
    """(line, what) of each call in ``source`` that may unpickle."""
    tree = ast.parse(source)
    aliases = {}  # local name -> dotted origin, from `import x as y` / `from x import y as z`
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                aliases[alias.asname or alias.name.split(".")[0]] = alias.name if alias.asname else alias.name.split(".")[0]
        elif isinstance(node, ast.ImportFrom) and node.module:
            for alias in node.names:
                aliases[alias.asname or alias.name] = f"{node.module}.{alias.name}"
    found = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.Call):
            continue
        name = _dotted(node.func)
        if name is None:
            continue
        head, _, rest = name.partition(".")
        name = f"{aliases.get(head, head)}.{rest}" if rest else aliases.get(head, head)
        module, _, function = name.rpartition(".")
        if name == "torch.load":
            if _keyword(node, "weights_only") is not True:
                found.append((node.lineno, "torch.load without weights_only=True"))
        elif module.split(".")[-1] in PICKLE_MODULES and function in UNPICKLING_NAMES:
            found.append((node.lineno, f"{name}"))
        elif name in ("numpy.load", "np.load") and _keyword(node, "allow_pickle") not in (None, False):
            found.append((node.lineno, "numpy.load with allow_pickle"))
    return found


def library_modules() -> list[Path]:
    return sorted(path for folder in LIBRARY for path in (ROOT / folder).rglob("*.py"))


def test_no_library_module_unpickles():
    modules = library_modules()
    assert len(modules) > 100  # the scan sees the whole library
    offenders = []
    for path in modules:
        relative = str(path.relative_to(ROOT))
        for line, what in unpickling_calls(path.read_text()):
            if (relative, line) not in ALLOWED:
                offenders.append(f"{relative}:{line}: {what}")
    assert not offenders, "library code that may unpickle:\n" + "\n".join(offenders)


@pytest.mark.parametrize("source", [
    "import torch\ntorch.load(path)",
    "import torch\ntorch.load(path, weights_only=False)",
    "import torch\ntorch.load(path, weights_only=flag)",
    "import torch as t\nt.load(buffer, map_location='cpu')",
    "from torch import load\nload(path)",
    "import pickle\npickle.loads(data)",
    "import pickle\npickle.Unpickler(handle).load()",
    "from pickle import loads as read\nread(data)",
    "from ray import cloudpickle\ncloudpickle.loads(data)",
    "import numpy as np\nnp.load(path, allow_pickle=True)",
])
def test_the_scan_finds_each_way_of_unpickling(source):
    assert unpickling_calls(source), source


@pytest.mark.parametrize("source", [
    "import torch\ntorch.load(path, weights_only=True, map_location='cpu')",
    "import pickle\nraise pickle.UnpicklingError('refused')",
    "from safetensors.torch import load\nload(data)",
    "import json\njson.loads(text)",
    "import numpy as np\nnp.load(path)",
])
def test_the_scan_lets_safe_loading_through(source):
    assert not unpickling_calls(source), source
