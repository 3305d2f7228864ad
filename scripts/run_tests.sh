#!/usr/bin/env bash
# The test command: sets up .venv on first use, then runs the CPU test suite (extra arguments go to pytest).
set -euo pipefail
REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
source "$REPO/scripts/bootstrap.sh"
cd "$REPO"
# Two workers, one test file each at a time (tests pin torch to one thread: 2 cores run two files side by side);
# DDTREE_TEST_WORKERS=0 runs in one process. Without pytest-xdist (an env that lacks the dev extra) it runs serially.
WORKERS=(-n "${DDTREE_TEST_WORKERS:-2}" --dist loadfile)
if [ "${DDTREE_TEST_WORKERS:-2}" = "0" ] || ! "$DDTREE_PYTHON" -c "import xdist" >/dev/null 2>&1; then WORKERS=(); fi
exec "$DDTREE_PYTHON" -m pytest tests ${WORKERS[@]+"${WORKERS[@]}"} "$@"
