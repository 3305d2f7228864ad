#!/usr/bin/env bash
# The main job: set up (first run only), run the benchmark, draw the figures, say where everything is.
#
#   bash run_benchmark.sh                  default preset: embedded SmolLM2 pair on CPU (within 15 min on 2 cores)
#   bash run_benchmark.sh --quick          smoke test within 3 minutes (same as DDTREE_QUICK=1)
#   bash run_benchmark.sh --preset paper   the DDTree paper's grid on CUDA (torchrun over all visible GPUs), sized
#                                          to an hour of decoding per model pair (--full: the whole grid)
#   bash run_benchmark.sh --preset paper --dry-run
#                                          what that would run here (datasets, models, devices, disk, time), then
#                                          exit without loading or running anything (python -m experiments.bench.plan)
#   bash run_benchmark.sh --batch 1,2,4,8  throughput mode: tokens/s per method per batch size (prompts decoded
#                                          together), plain decoding batched as the baseline, and its figure
#                                          (python -m experiments.bench.throughput; default folder runs/throughput)
#   bash run_benchmark.sh --preset baselines
#                                          tree builders side by side on the embedded pair (DDTree, EAGLE-2, Sequoia,
#                                          Medusa; at T = 1 also sampled trees, traversal verification, SpecInfer):
#                                          replayed over 63 prompts, live over 6 per dataset; table and figure
#                                          (python -m experiments.bench.tree_builders; default folder runs/baselines)
#   bash run_benchmark.sh --preset long    long contexts on the embedded pair: plain decoding's step, the prefill
#                                          rate and DDTree (B=8, auto) speedup and tokens/s at 100, 1K, 3K and 6K
#                                          tokens of context, 1,024-token answers; table and figure
#                                          (python -m experiments.studies.long_context; default folder runs/long)
#   --hub-datasets                         also the preset's hub-only datasets (paper: mbpp, livecodebench,
#                                          swe-bench, alpaca; they need the Hugging Face Hub and `datasets`)
#
# Any other argument goes to `python -m experiments.bench` (see its --help), e.g. --draft random,
# --datasets gsm8k,humaneval, --out runs/mine. Rerunning with the same --out resumes an interrupted run.
# Offline machines: DDTREE_WHEELHOUSE=DIR makes setup install from a folder of wheels (docs/gpu.md).
# On a CPU shared with other busy processes, add --threads 1: torch's two threads then wait on each other and run
# several times slower than one (measured on this 2-core machine under load).
set -euo pipefail
REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
cd "$REPO"
START=$SECONDS

PRESET=default
[ "${DDTREE_QUICK:-0}" = "1" ] && PRESET=quick
OUT=""
DRY_RUN=0
HUB=0
HAS_DATASETS=0
BATCH=""
ARGS=()
while [ $# -gt 0 ]; do
  case "$1" in
    --quick) PRESET=quick ;;
    --preset) PRESET="${2:?--preset needs a name}"; shift ;;
    --preset=*) PRESET="${1#*=}" ;;
    --out) OUT="${2:?--out needs a folder}"; shift ;;
    --out=*) OUT="${1#*=}" ;;
    --dry-run) DRY_RUN=1 ;;
    --hub-datasets) HUB=1 ;;
    --batch) BATCH="${2:?--batch needs batch sizes, e.g. 1,2,4,8}"; shift ;;
    --batch=*) BATCH="${1#*=}" ;;
    --datasets|--datasets=*) HAS_DATASETS=1; ARGS+=("$1") ;;
    *) ARGS+=("$1") ;;
  esac
  shift
done
if [ -n "$BATCH" ]; then
  OUT="${OUT:-runs/throughput}"
  source scripts/bootstrap.sh
  echo "[run_benchmark] throughput mode, batch sizes $BATCH -> $OUT"
  "$DDTREE_PYTHON" -m experiments.bench.throughput --batch "$BATCH" --out "$OUT" ${ARGS[@]+"${ARGS[@]}"}
  if "$DDTREE_PYTHON" -c "import matplotlib" >/dev/null 2>&1; then
    "$DDTREE_PYTHON" -m plots.throughput_figure "$OUT/throughput.json" --out "$OUT/throughput.png" >/dev/null
    echo "  figure:  $OUT/throughput.png"
  fi
  echo "[run_benchmark] finished in $((SECONDS - START)) s; results: $OUT/throughput.json"
  exit 0
fi
# A study preset: its module writes summary.json / summary.md into OUT, then its figure is drawn.
#   study_preset FOLDER MODULE FIGURE_MODULE FIGURE_NAME WHAT [module arguments...]
study_preset() {
  local folder="$1" module="$2" figure="$3" name="$4" what="$5"
  shift 5
  OUT="${OUT:-$folder}"
  if [ "$DRY_RUN" = "1" ] || [ "$HUB" = "1" ]; then
    echo "[run_benchmark] --preset $PRESET takes neither --dry-run nor --hub-datasets" \
      "(see python -m $module --help)" >&2
    exit 2
  fi
  source scripts/bootstrap.sh
  echo "[run_benchmark] $what -> $OUT"
  "$DDTREE_PYTHON" -m "$module" "$@" ${ARGS[@]+"${ARGS[@]}"}
  if "$DDTREE_PYTHON" -c "import matplotlib" >/dev/null 2>&1; then
    "$DDTREE_PYTHON" -m "$figure" "$OUT/summary.json" --out "$OUT/$name" >/dev/null
    echo "  figure:  $OUT/$name"
  fi
  echo "[run_benchmark] finished in $((SECONDS - START)) s; table: $OUT/summary.md"
  exit 0
}
if [ "$PRESET" = "baselines" ]; then  # tree builders side by side on one drafter: replayed and live
  OUT="${OUT:-runs/baselines}"
  study_preset runs/baselines experiments.bench.tree_builders plots.tree_builders_figure tree_builders.png \
    "tree builders (DDTree, EAGLE-2, Sequoia, Medusa; at T > 0 sampled, traversal, SpecInfer)" --out "$OUT"
fi
if [ "$PRESET" = "long" ]; then  # cost against context length: step, prefill, DDTree speedup; resumable per context
  OUT="${OUT:-runs/long}"
  study_preset runs/long experiments.studies.long_context plots.long_context_figure long_context.png \
    "long contexts (plain decoding, DDTree B=8 and auto; 1,024-token answers)" --contexts 100,1000,3000,6000 \
    --methods 8,auto --max-new-tokens 1024 --out "$OUT/long_context.jsonl"
fi
OUT="${OUT:-runs/$PRESET}"
if [ "$HUB" = "1" ] && [ "$HAS_DATASETS" = "1" ]; then
  echo "[run_benchmark] give either --datasets or --hub-datasets, not both" >&2
  exit 2
fi

source scripts/bootstrap.sh
SETUP_S=$((SECONDS - START))  # the first run's environment setup: not part of the main job's 15 minutes

if [ "$DRY_RUN" = "1" ]; then
  PLAN=(--preset "$PRESET" --out "$OUT")
  [ "$HUB" = "1" ] && PLAN+=(--hub-datasets)
  exec "$DDTREE_PYTHON" -m experiments.bench.plan "${PLAN[@]}" ${ARGS[@]+"${ARGS[@]}"}
fi

if [ "$HUB" = "1" ]; then  # the preset's datasets plus its hub-only ones, named (so an unreachable one is an error)
  HUB_LIST="$("$DDTREE_PYTHON" -c 'import sys
from experiments.bench.presets import get_preset, with_overrides
preset = get_preset(sys.argv[1])
print(",".join(with_overrides(preset, include_hub=True).datasets) if preset.hub_datasets else "")' "$PRESET")"
  if [ -z "$HUB_LIST" ]; then
    echo "[run_benchmark] preset $PRESET has no hub-only datasets; --hub-datasets changes nothing" >&2
  else
    ARGS+=(--datasets "$HUB_LIST")
  fi
fi

LAUNCH=("$DDTREE_PYTHON")
if [ "$PRESET" = "paper" ] && [ -z "${WORLD_SIZE:-}" ]; then
  GPUS="$("$DDTREE_PYTHON" -c 'import torch; print(torch.cuda.device_count())')"
  if [ "$GPUS" -gt 1 ]; then
    LAUNCH=("$DDTREE_PYTHON" -m torch.distributed.run --standalone --nproc_per_node="$GPUS")
  fi
fi

echo "[run_benchmark] preset $PRESET -> $OUT"
"${LAUNCH[@]}" -m experiments.bench --preset "$PRESET" --out "$OUT" ${ARGS[@]+"${ARGS[@]}"}

# One figure set per run folder (the paper preset writes one folder per target/drafter pair).
FOLDERS=()
while IFS= read -r records; do FOLDERS+=("$(dirname "$records")"); done \
  < <(find "$OUT" -name records.jsonl -not -path '*/figures/*' | sort)
if [ ${#FOLDERS[@]} -eq 0 ]; then
  echo "[run_benchmark] no records under $OUT" >&2
  exit 1
fi
FIGURES=1
if ! "$DDTREE_PYTHON" -c "import matplotlib" >/dev/null 2>&1; then
  FIGURES=0
  echo "[run_benchmark] matplotlib is not installed: figures and tables are skipped (the records and the summary" \
       "above are complete). Install the plots extra (pip install matplotlib, or DDTREE_EXTRAS=dev,plots with" \
       "its wheels in DDTREE_WHEELHOUSE), then: python plot_results.py --runs $OUT" >&2
fi
if [ "$FIGURES" = "1" ]; then
  for folder in "${FOLDERS[@]}"; do
    "$DDTREE_PYTHON" plot_results.py --runs "$folder" --out "$folder/figures" >/dev/null
  done
fi

echo
echo "[run_benchmark] finished in $((SECONDS - START)) s ($((SECONDS - START - SETUP_S)) s after the setup's $SETUP_S s)"
for folder in "${FOLDERS[@]}"; do
  echo "  results: $folder/records.jsonl (manifest: $folder/manifest.json)"
  if [ "$FIGURES" = "1" ]; then
    echo "  figures: $folder/figures/ ($(cd "$folder/figures" && ls *.png | tr '\n' ' '))"
    echo "  tables:  $folder/figures/results_table.md, $folder/figures/all_budgets.md"
  else
    echo "  figures: skipped (no matplotlib)"
  fi
done
