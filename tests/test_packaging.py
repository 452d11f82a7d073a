"""The wheel holds every package of the source tree: pyproject's explicit package list names each folder with an
``__init__.py`` under the three mapped roots (a package left out imports in an editable install and fails in a
built one)."""

import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_every_package_is_listed():
    settings = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    roots = settings["package-dir"]  # package name -> folder
    on_disk = set()
    for name, folder in roots.items():
        for init in (ROOT / folder).rglob("__init__.py"):
            relative = init.parent.relative_to(ROOT / folder)
            on_disk.add(".".join([name, *relative.parts]))
    assert set(settings["packages"]) == on_disk
