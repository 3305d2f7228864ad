#!/usr/bin/env bash
# The main job: set up (first run only), run the benchmark, draw the figures, say where everything is.
#
#   bash run_benchmark.sh                  default preset: embedded SmolLM2 pair on CPU (within 15 min on 2 cores)
#   bash run_benchmark.sh --quick          smoke test within 3 minutes (same as DDTREE_QUICK=1)
#   bash run_benchmark.sh --preset paper   the DDTree paper's grid on CUDA (torchrun over all visible GPUs)
#
# Any other argument goes to `python -m experiments.benchmark` (see its --help), e.g. --draft random,
# --datasets gsm8k,humaneval, --out runs/mine. Rerunning with the same --out resumes an interrupted run.
# On a CPU shared with other busy processes, add --threads 1: torch's two threads then wait on each other and run
# several times slower than one (measured on this 2-core machine under load).
set -euo pipefail
REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
cd "$REPO"
START=$SECONDS
source scripts/bootstrap.sh

PRESET=default
[ "${DDTREE_QUICK:-0}" = "1" ] && PRESET=quick
OUT=""
ARGS=()
while [ $# -gt 0 ]; do
  case "$1" in
    --quick) PRESET=quick ;;
    --preset) PRESET="${2:?--preset needs a name}"; shift ;;
    --preset=*) PRESET="${1#*=}" ;;
    --out) OUT="${2:?--out needs a folder}"; shift ;;
    --out=*) OUT="${1#*=}" ;;
    *) ARGS+=("$1") ;;
  esac
  shift
done
OUT="${OUT:-runs/$PRESET}"

LAUNCH=("$DDTREE_PYTHON")
if [ "$PRESET" = "paper" ] && [ -z "${WORLD_SIZE:-}" ]; then
  GPUS="$("$DDTREE_PYTHON" -c 'import torch; print(torch.cuda.device_count())')"
  if [ "$GPUS" -gt 1 ]; then
    LAUNCH=("$DDTREE_PYTHON" -m torch.distributed.run --standalone --nproc_per_node="$GPUS")
  fi
fi

echo "[run_benchmark] preset $PRESET -> $OUT"
"${LAUNCH[@]}" -m experiments.benchmark --preset "$PRESET" --out "$OUT" ${ARGS[@]+"${ARGS[@]}"}

# One figure set per run folder (the paper preset writes one folder per target/drafter pair).
FOLDERS=()
while IFS= read -r records; do FOLDERS+=("$(dirname "$records")"); done \
  < <(find "$OUT" -name records.jsonl -not -path '*/figures/*' | sort)
if [ ${#FOLDERS[@]} -eq 0 ]; then
  echo "[run_benchmark] no records under $OUT" >&2
  exit 1
fi
for folder in "${FOLDERS[@]}"; do
  "$DDTREE_PYTHON" plot_results.py --runs "$folder" --out "$folder/figures" >/dev/null
done

echo
echo "[run_benchmark] finished in $((SECONDS - START)) s"
for folder in "${FOLDERS[@]}"; do
  echo "  results: $folder/records.jsonl (manifest: $folder/manifest.json)"
  echo "  figures: $folder/figures/ ($(cd "$folder/figures" && ls *.png | tr '\n' ' '))"
  echo "  tables:  $folder/figures/results_table.md, $folder/figures/all_budgets.md"
done
