"""What a GPU machine's Python has, and filling in what it lacks from wheels carried with the tree.

    python benchmarks/gpu_env.py report                       # versions, importability, torch features
    python benchmarks/gpu_env.py install --wheels benchmarks/wheels --target /tmp/site

``install`` picks, among the wheels in ``--wheels`` (fetched by fetch_gpu_wheels.sh), those that fit this
interpreter and whose distribution is missing here or older than the wheel, and installs them with
``pip install --no-index --no-deps --target``: nothing is downloaded and the image's own site-packages are
left as they are (put ``--target`` first on PYTHONPATH to use them). numpy, pandas and pyarrow are only
installed where missing: the image's builds match its torch.

Only the standard library at import time: this runs before anything is known to be importable.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.metadata
import platform
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("torch", "transformers", "trl", "datasets", "accelerate", "peft", "safetensors", "huggingface_hub",
            "tokenizers", "torchao", "triton", "numpy", "pyarrow", "pandas", "pyyaml")
IMPORT_NAMES = {"pyyaml": "yaml", "huggingface_hub": "huggingface_hub"}
KEEP_IMAGE_BUILD = ("numpy", "pandas", "pyarrow")  # installed from the wheels only where missing


def normalized(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def installed_version(name: str) -> str | None:
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None


def importable(module: str) -> str:
    try:
        importlib.import_module(module)
    except Exception as error:  # noqa: BLE001  (the report names whatever stops an import)
        return f"no ({type(error).__name__}: {str(error).splitlines()[0][:120] if str(error) else ''})"
    return "yes"


def requirement_problems() -> list[str]:
    """pyproject's core dependency ranges that the installed versions do not meet."""
    from pip._vendor.packaging.requirements import Requirement

    text = (ROOT / "pyproject.toml").read_text()
    block = re.search(r"^dependencies = \[(.*?)^\]", text, re.S | re.M).group(1)
    problems = []
    for line in re.findall(r'"([^"]+)"', block):
        requirement = Requirement(line)
        version = installed_version(requirement.name)
        if version is None:
            problems.append(f"{line}: not installed")
        elif not requirement.specifier.contains(version, prereleases=True):
            problems.append(f"{line}: found {version}")
    return problems


def report() -> int:
    print(f"python {platform.python_version()} ({sys.executable}), {platform.platform()}")
    importable("hfnative")  # first where it imports: it quiets torchao's import-time lines that transformers triggers
    for name in PACKAGES:
        version = installed_version(name)
        module = IMPORT_NAMES.get(name, name)
        shown = importable(module) if version else "-"
        print(f"  {name:<16}{version or 'not installed':<24}importable: {shown}")
    problems = requirement_problems()
    print("pyproject dependencies: " + ("all met" if not problems else "NOT MET: " + "; ".join(problems)))
    try:
        import torch
    except Exception as error:  # noqa: BLE001
        print(f"torch does not import: {error}")
        return 1
    print(f"torch {torch.__version__}, CUDA build {torch.version.cuda}, cuDNN {torch.backends.cudnn.version()}, "
          f"CUDA available {torch.cuda.is_available()}")
    if torch.cuda.is_available():
        for index in range(torch.cuda.device_count()):
            properties = torch.cuda.get_device_properties(index)
            print(f"  cuda:{index} {properties.name}, capability {properties.major}.{properties.minor}, "
                  f"{properties.total_memory / 2**30:.1f} GiB, bf16 {torch.cuda.is_bf16_supported()}")
    features = {
        "torch.nn.attention.varlen (varlen_attn)": "torch.nn.attention.varlen",
        "torch.nn.attention.flex_attention": "torch.nn.attention.flex_attention",
        "hfnative": "hfnative",
        "hfnative.trainers": "hfnative.trainers",
        "hfnative.models.attention (variable-length path)": "hfnative.models.attention",
    }
    for label, module in features.items():
        print(f"  {label:<52}{importable(module)}")
    from torch.nn.attention import SDPBackend

    print("  SDPA backends: " + ", ".join(name for name in SDPBackend.__members__ if name not in ("ERROR", "OVERRIDEABLE")))
    return 0


def wheels_to_install(wheels: Path) -> tuple[list[Path], list[str]]:
    """The wheels to install here, and a line for each wheel left out, with why."""
    from pip._vendor.packaging.tags import sys_tags
    from pip._vendor.packaging.utils import parse_wheel_filename
    from pip._vendor.packaging.version import Version

    supported = set(sys_tags())
    chosen, skipped = {}, []
    for wheel in sorted(wheels.glob("*.whl")):
        name, version, _, tags = parse_wheel_filename(wheel.name)
        present = installed_version(name)
        if not supported & set(tags):
            skipped.append(f"{wheel.name}: not built for this interpreter/platform")
        elif present is not None and normalized(name) in KEEP_IMAGE_BUILD:
            skipped.append(f"{wheel.name}: keeping the image's {name} {present}")
        elif present is not None and Version(present) >= version:
            skipped.append(f"{wheel.name}: {name} {present} already here")
        elif normalized(name) not in chosen or parse_wheel_filename(chosen[normalized(name)].name)[1] < version:
            chosen[normalized(name)] = wheel
    return sorted(chosen.values()), skipped


def install(wheels: Path, target: Path) -> int:
    if not wheels.is_dir() or not any(wheels.glob("*.whl")):
        print(f"no wheels in {wheels}: nothing installed (run benchmarks/fetch_gpu_wheels.sh on a networked machine "
              f"and carry {wheels.relative_to(ROOT) if wheels.is_relative_to(ROOT) else wheels} with the tree)")
        return 0
    chosen, skipped = wheels_to_install(wheels)
    for line in skipped:
        print(f"  skip    {line}")
    for wheel in chosen:
        print(f"  install {wheel.name}")
    if not chosen:
        return 0
    command = [sys.executable, "-m", "pip", "install", "--no-index", "--no-deps", "--no-compile",
               "--disable-pip-version-check", "--target", str(target), *map(str, chosen)]
    done = subprocess.run(command, capture_output=True, text=True)
    print(done.stdout.strip().splitlines()[-1] if done.stdout.strip() else "")
    if done.returncode:
        print(done.stderr.strip())
    return done.returncode


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    commands = parser.add_subparsers(dest="command", required=True)
    commands.add_parser("report", help="versions, importability, GPU and torch attention features")
    installer = commands.add_parser("install", help="install the missing or older packages from local wheels")
    installer.add_argument("--wheels", type=Path, default=ROOT / "benchmarks" / "wheels")
    installer.add_argument("--target", type=Path, required=True)
    args = parser.parse_args(argv)
    return report() if args.command == "report" else install(args.wheels.resolve(), args.target)


if __name__ == "__main__":
    sys.exit(main())
