#!/usr/bin/env bash
# The CPU test suite against the OLDEST transformers that pyproject.toml allows, in its own venv (.venv-oldest), so
# the lower bound is tested rather than assumed. Extra arguments go to pytest.
#   DDTREE_OLDEST_TRANSFORMERS  the version to test (default: the lower bound in pyproject.toml)
#   DDTREE_OLDEST_VENV          where that venv lives (default: <repo>/.venv-oldest)
# torch is the project's default (DDTREE_TORCH_SPEC, see bootstrap.sh). Needs the package index (or pip's cache).
set -euo pipefail
REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
LOWEST="$(sed -n 's/^ *"transformers>=\([0-9.]*\).*/\1/p' "$REPO/pyproject.toml" | head -n 1)"
VERSION="${DDTREE_OLDEST_TRANSFORMERS:-$LOWEST}"
if [ -z "$VERSION" ]; then
  echo "test_oldest: no 'transformers>=X' lower bound found in pyproject.toml" >&2
  exit 2
fi
export DDTREE_VENV="${DDTREE_OLDEST_VENV:-$REPO/.venv-oldest}"
export DDTREE_PINS="transformers==$VERSION"
source "$REPO/scripts/bootstrap.sh"
cd "$REPO"
echo "[oldest] transformers $("$DDTREE_PYTHON" -c 'import transformers; print(transformers.__version__)'), torch $("$DDTREE_PYTHON" -c 'import torch; print(torch.__version__)')"
exec "$DDTREE_PYTHON" -m pytest tests "$@"
