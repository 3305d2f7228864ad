#!/usr/bin/env bash
# The test command: sets up .venv on first use, then runs the CPU test suite (extra arguments go to pytest).
set -euo pipefail
REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
source "$REPO/scripts/bootstrap.sh"
cd "$REPO"
exec "$DDTREE_PYTHON" -m pytest tests "$@"
