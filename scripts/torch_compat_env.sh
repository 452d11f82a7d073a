#!/usr/bin/env bash
# A second virtualenv with another torch release (default 2.11.0, the GPU machines' release) and this checkout's
# tested Hugging Face stack (the versions in .venv), hfnative installed from this tree: to run the suite or the GPU
# script's CPU rehearsal against that torch before a GPU run meets it.
#
#   bash scripts/torch_compat_env.sh [VERSION] [DIR]     # DIR defaults to /tmp/venv-torch-VERSION
#   DIR/bin/python -m pytest -n 2                          # the suite on that torch
#   PYTHON=DIR/bin/python bash benchmarks/gpu_check.sh --device cpu
#
# The package registry serves other torch releases as CUDA builds (about 5 GB with their CUDA libraries); they run on
# a CPU. Not part of CI, which tests the torch of the README's first command.
set -euo pipefail

cd "$(dirname "$0")/.."
VERSION=${1:-2.11.0}
DIR=${2:-/tmp/venv-torch-$VERSION}
[[ -x .venv/bin/python ]] || { echo "torch_compat_env.sh: no .venv/bin/python; make the virtualenv first (README)" >&2; exit 2; }

python3 -m venv "$DIR"
"$DIR/bin/python" -m pip install --quiet --upgrade pip
"$DIR/bin/python" -m pip install --quiet "torch==$VERSION"
# the stack as tested here, without torch, its CUDA libraries, triton (torch's own pin) or hfnative itself
.venv/bin/python -m pip freeze --exclude-editable \
  | grep -viE '^(torch|triton|hfnative)==|^(nvidia-|cuda-)' > "$DIR/tested-stack.txt"
"$DIR/bin/python" -m pip install --quiet -r "$DIR/tested-stack.txt"
"$DIR/bin/python" -m pip install --quiet --no-deps -e .
"$DIR/bin/python" -c "import torch, transformers, trl, hfnative; print('torch', torch.__version__, '| transformers', \
transformers.__version__, '| trl', trl.__version__, '| in', '$DIR')"
