"""The layers import one way: trainers -> converters -> hfnative (the engine).

A plain AST scan of every ``.py`` file of the three package folders (pyproject's ``package-dir`` mapping:
hfnative.converters lives in converters/, hfnative.trainers in trainers/) collects each import, at module
level and inside functions, relative ones resolved to absolute module names. The engine imports none of
the converters, the trainers, transformers or TRL; the converters import neither the trainers nor TRL;
and within each layer no modules import each other in a cycle.
"""

from __future__ import annotations

import ast
import tomllib
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
ENGINE, CONVERTERS, TRAINERS = "hfnative", "hfnative.converters", "hfnative.trainers"

# layer -> the modules (and their submodules) its files must not import
FORBIDDEN = {
    ENGINE: (CONVERTERS, TRAINERS, "transformers", "trl"),
    CONVERTERS: (TRAINERS, "trl"),
    TRAINERS: (),
}
# (file, function) whose imports may reach any layer: the package's public names, re-exported lazily (PEP 562)
EXEMPT = {("hfnative/__init__.py", "__getattr__")}


@dataclass(frozen=True)
class Import:
    """One imported module: where (file relative to the repository, line, enclosing function or None) and what
    (``module``: absolute; ``from x import y`` gives ``x.y``, which is ``x``'s attribute or submodule y)."""

    path: str
    line: int
    function: str | None
    module: str

    def __str__(self) -> str:
        return f"{self.path}:{self.line}: {self.module}"


def package_dirs(root: Path = ROOT) -> dict[str, Path]:
    """Package name -> its folder, from pyproject.toml's setuptools ``package-dir``."""
    settings = tomllib.loads((root / "pyproject.toml").read_text())["tool"]["setuptools"]
    return {name: root / folder for name, folder in settings["package-dir"].items()}


def module_files(dirs: dict[str, Path]) -> dict[str, Path]:
    """Module name -> file, for every .py file under the package folders."""
    files = {}
    for package, folder in dirs.items():
        for path in sorted(folder.rglob("*.py")):
            parts = path.relative_to(folder).with_suffix("").parts
            if parts[-1] == "__init__":
                parts = parts[:-1]
            files[".".join((package, *parts))] = path
    return files


def imports_in(source: str, module: str, *, is_package: bool, path: str = "<source>") -> list[Import]:
    """Every import in ``source``, the code of ``module`` (``is_package``: it is a package's __init__)."""
    package = module if is_package else module.rpartition(".")[0]
    found = []

    def visit(node: ast.AST, function: str | None) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.Import):
                found.extend(Import(path, child.lineno, function, alias.name) for alias in child.names)
            elif isinstance(child, ast.ImportFrom):
                base = child.module or ""
                if child.level:  # `from .x` is package.x; each further dot goes one package up
                    anchor = package.rsplit(".", child.level - 1)[0] if child.level > 1 else package
                    base = f"{anchor}.{base}" if base else anchor
                found.extend(Import(path, child.lineno, function, base if alias.name == "*" else f"{base}.{alias.name}")
                             for alias in child.names)
            name = child.name if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)) else function
            visit(child, name)

    visit(ast.parse(source, filename=path), None)
    return found


def scan(root: Path = ROOT) -> dict[str, list[Import]]:
    """Module name -> its imports, for every module of the three layers under ``root``."""
    files = module_files(package_dirs(root))
    return {
        module: imports_in(path.read_text(), module, is_package=path.name == "__init__.py",
                           path=path.relative_to(root).as_posix())
        for module, path in files.items()
    }


def _within(module: str, prefix: str) -> bool:
    return module == prefix or module.startswith(prefix + ".")


def layer_of(module: str) -> str:
    return next((layer for layer in (CONVERTERS, TRAINERS) if _within(module, layer)), ENGINE)


def upward_imports(imports_by_module: dict[str, list[Import]]) -> list[Import]:
    """The imports that break the layering (see FORBIDDEN), in file and line order."""
    bad = []
    for module, imports in imports_by_module.items():
        forbidden = FORBIDDEN[layer_of(module)]
        for imported in imports:
            if (imported.path, imported.function) in EXEMPT:
                continue
            if any(_within(imported.module, prefix) for prefix in forbidden):
                bad.append(imported)
    return sorted(bad, key=lambda i: (i.path, i.line))


def import_cycles(imports_by_module: dict[str, list[Import]], layer: str) -> list[list[Import]]:
    """Cycles among the modules of one layer: each a strongly connected component of the import graph (function
    -level imports included), given as the imports that join its modules."""
    modules = {m for m in imports_by_module if layer_of(m) == layer}
    edges: dict[str, list[Import]] = {m: [] for m in modules}
    for module in modules:
        for imported in imports_by_module[module]:
            target = imported.module if imported.module in modules else imported.module.rpartition(".")[0]
            edge = Import(imported.path, imported.line, imported.function, target)
            if target in modules and target != module and edge not in edges[module]:  # `from x import a, b`: one edge
                edges[module].append(edge)

    # Tarjan's strongly connected components
    index, low, stack, on_stack, components = {}, {}, [], set(), []

    def connect(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for edge in edges[node]:
            if edge.module not in index:
                connect(edge.module)
                low[node] = min(low[node], low[edge.module])
            elif edge.module in on_stack:
                low[node] = min(low[node], index[edge.module])
        if low[node] == index[node]:
            component = set()
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.add(member)
                if member == node:
                    break
            if len(component) > 1:
                components.append(component)

    for node in sorted(modules):
        if node not in index:
            connect(node)
    return [sorted((e for m in component for e in edges[m] if e.module in component), key=lambda e: (e.path, e.line))
            for component in components]


def _report(title: str, imports: list[Import]) -> str:
    return title + "\n  " + "\n  ".join(map(str, imports))


# --- the real tree -----------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tree() -> dict[str, list[Import]]:
    return scan()


def test_the_scan_sees_the_whole_tree(tree):
    """Every layer is scanned, and imports inside functions are seen (the trainers import the engine lazily)."""
    assert {layer_of(m) for m in tree} == {ENGINE, CONVERTERS, TRAINERS}
    assert "hfnative.converters.loading" in tree and "hfnative.trainers.loop.trainer" in tree
    assert any(i.function is not None for imports in tree.values() for i in imports)


def test_imports_go_one_way(tree):
    bad = upward_imports(tree)
    assert not bad, _report("imports against the layering (trainers -> converters -> hfnative):", bad)


@pytest.mark.parametrize("layer", [ENGINE, CONVERTERS, TRAINERS])
def test_no_import_cycles(tree, layer):
    cycles = import_cycles(tree, layer)
    assert not cycles, "\n".join(_report(f"import cycle in {layer}:", cycle) for cycle in cycles)


# --- the scan itself, on a tree made to break the rules --------------------------------------------------------


def _write(root: Path, files: dict[str, str]) -> None:
    for name, text in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(text)


def test_the_scan_reports_every_upward_import(tmp_path):
    _write(tmp_path, {
        "pyproject.toml": '[tool.setuptools]\npackage-dir = { "hfnative" = "hfnative", '
                          '"hfnative.converters" = "converters", "hfnative.trainers" = "trainers" }\n',
        "hfnative/__init__.py": "def __getattr__(name):\n    from hfnative.trainers import Trainer\n    return Trainer\n",
        "hfnative/generation/__init__.py": "",
        "hfnative/generation/engine.py": (
            "import torch\n"
            "from hfnative.converters.export import export_hf\n"
            "def build():\n"
            "    import transformers\n"
            "    from trl import GRPOConfig\n"
            "    return transformers, GRPOConfig\n"
        ),
        "hfnative/generation/relative.py": "from ..trainers import Trainer\nfrom .. import converters\n",
        "converters/__init__.py": "",
        "converters/loading.py": "from hfnative.models import Transformer\nfrom transformers import AutoConfig\n",
        "converters/families/__init__.py": "",
        "converters/families/llama.py": "def f():\n    from ...trainers.trainer import Trainer\n",
        "converters/export.py": "from .loading import load\nfrom . import trl_bridge\n",
        "trainers/__init__.py": "import trl\nfrom hfnative.converters import loading\n",
    })
    reported = {(i.path, i.line, i.module) for i in upward_imports(scan(tmp_path))}
    assert reported == {
        ("hfnative/generation/engine.py", 2, "hfnative.converters.export.export_hf"),  # module level
        ("hfnative/generation/engine.py", 4, "transformers"),  # inside a function
        ("hfnative/generation/engine.py", 5, "trl.GRPOConfig"),
        ("hfnative/generation/relative.py", 1, "hfnative.trainers.Trainer"),  # relative
        ("hfnative/generation/relative.py", 2, "hfnative.converters"),
        ("converters/families/llama.py", 2, "hfnative.trainers.trainer.Trainer"),  # relative, two levels up
    }  # hfnative/__init__.py's __getattr__ is the exemption; the trainers may import anything


def test_the_scan_reports_cycles_with_function_level_imports(tmp_path):
    _write(tmp_path, {
        "pyproject.toml": '[tool.setuptools]\npackage-dir = { "hfnative" = "hfnative", '
                          '"hfnative.converters" = "converters", "hfnative.trainers" = "trainers" }\n',
        "hfnative/__init__.py": "",
        "hfnative/a.py": "import torch\n",
        "converters/__init__.py": "",
        "converters/fallback.py": "def save():\n    from .fallback_loading import save_hub_folder\n",
        "converters/fallback_loading.py": "from .fallback import TransformersCausalLM\n",
        "converters/export.py": "from .fallback import save\n",
        "trainers/__init__.py": "",
    })
    tree = scan(tmp_path)
    assert import_cycles(tree, ENGINE) == []
    (cycle,) = import_cycles(tree, CONVERTERS)
    assert [(i.path, i.line, i.function, i.module) for i in cycle] == [
        ("converters/fallback.py", 2, "save", "hfnative.converters.fallback_loading"),
        ("converters/fallback_loading.py", 1, None, "hfnative.converters.fallback"),
    ]
