#!/usr/bin/env bash
# Download, on a machine with network, the wheels benchmarks/gpu_check.sh installs on a GPU machine that has
# none: the Hugging Face stack (transformers, trl, datasets, accelerate, peft, safetensors, huggingface_hub),
# torchao (float8 training and stochastically rounded bf16 AdamW: the low_precision section) and everything they
# need, at the versions installed in this checkout's .venv (the tested ones). Never torch, triton or nvidia-*
# (the GPU image brings its own build).
#
#   bash benchmarks/fetch_gpu_wheels.sh                  # wheels for the GPU image's python (default: 3.11)
#   bash benchmarks/fetch_gpu_wheels.sh --python 3.12    # another python on the GPU machine
#   bash benchmarks/fetch_gpu_wheels.sh --with-data-stack   # also numpy, pandas, pyarrow (~70 MB)
#
# Pure-python and abi3 wheels fit any python; the few compiled ones are fetched for --python on
# manylinux x86_64. numpy, pandas and pyarrow are left out unless --with-data-stack: torch images usually
# carry them, and with them the folder passes the 64 MiB a device run carries. The folder,
# benchmarks/wheels/, ignores itself in git; carry it to the GPU machine with the tree.
set -euo pipefail

cd "$(dirname "$0")/.."
PYTHON_FOR_GPU=3.11
DATA_STACK=0
while [[ $# -gt 0 ]]; do
  case "$1" in
    --python) PYTHON_FOR_GPU="$2"; shift 2 ;;
    --with-data-stack) DATA_STACK=1; shift ;;
    -h|--help) sed -n '2,15p' "$0"; exit 0 ;;
    *) echo "fetch_gpu_wheels.sh: unknown argument $1 (see --help)" >&2; exit 2 ;;
  esac
done

VENV_PYTHON=.venv/bin/python
[[ -x $VENV_PYTHON ]] || { echo "fetch_gpu_wheels.sh: no $VENV_PYTHON; make the virtualenv first" >&2; exit 2; }
WHEELS=benchmarks/wheels
mkdir -p "$WHEELS"
echo '*' > "$WHEELS/.gitignore"

# name==version of every distribution the stack needs, read from the venv's metadata
REQUIREMENTS=$("$VENV_PYTHON" - "$DATA_STACK" <<'EOF'
import importlib.metadata as metadata
import re
import sys

from packaging.requirements import Requirement

ROOTS = ["transformers", "trl", "datasets", "accelerate", "peft", "safetensors", "huggingface_hub", "pyyaml", "tqdm",
         "torchao"]
NEVER = re.compile(r"^(torch|triton|nvidia-.*|pip|setuptools|wheel)$")
DATA_STACK = {"numpy", "pandas", "pyarrow"}
with_data_stack = sys.argv[1] == "1"
found, todo = {}, list(ROOTS)
while todo:
    name = re.sub(r"[-_.]+", "-", todo.pop()).lower()
    if name in found or NEVER.match(name) or (name in DATA_STACK and not with_data_stack):
        continue
    try:
        distribution = metadata.distribution(name)
    except metadata.PackageNotFoundError:
        continue  # an optional dependency this venv does not have
    found[name] = distribution.version
    for line in distribution.requires or []:
        requirement = Requirement(line)
        if requirement.marker is None or requirement.marker.evaluate({"extra": ""}):
            todo.append(requirement.name)
print("\n".join(f"{name}=={version}" for name, version in sorted(found.items())))
EOF
)

ABI="cp${PYTHON_FOR_GPU/./}"
failed=()
for requirement in $REQUIREMENTS; do
  if ! pip download --quiet --no-deps --only-binary=:all: --dest "$WHEELS" \
      --python-version "$PYTHON_FOR_GPU" --implementation cp --abi "$ABI" --abi abi3 --abi none \
      --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
      "$requirement" >/dev/null 2>&1; then
    failed+=("$requirement")
  fi
done

echo "$(ls "$WHEELS"/*.whl | wc -l) wheels, $(du -sh "$WHEELS" | cut -f1), in $WHEELS (for python $PYTHON_FOR_GPU)"
if [[ ${#failed[@]} -gt 0 ]]; then
  echo "no wheel found for: ${failed[*]}" >&2
  exit 1
fi
