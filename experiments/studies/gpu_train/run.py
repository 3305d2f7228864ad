"""The GPU run's orchestrator and the CLI: ``pack`` | ``smoke`` | ``run`` | ``join`` (see the package docstring).

``run`` keeps to a wall-clock budget (``--seconds``, the device call's limit less a margin): it builds the target's
cache once, starts every arm's worker and the reference decoding side by side, gives the workers the minutes left
after the evaluation's reserve, replays the protocol for every finished drafter (plus the initial drafter and the
same without its Markov head) in parallel, and writes ``results.json`` (summaries, per-prompt rows, configs, log
tails) and the chosen drafters' weight parts into ``--out``. A worker that fails or overruns is recorded with its
log tail and the rest carry on.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import torch

__all__ = ["main", "summarise"]

HERE = "experiments.studies.gpu_train"


def _spawn(module: str, args: list[str], log: Path) -> subprocess.Popen:
    log.parent.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    return subprocess.Popen([sys.executable, "-m", f"{HERE}.{module}", *args], stdout=log.open("w"),
                            stderr=subprocess.STDOUT, env=env)


def _wait(procs: dict[str, subprocess.Popen], deadline: float) -> dict[str, int | None]:
    """Wait for every process until ``deadline`` (time.time()); kill the rest. {name: return code, None if killed}."""
    codes: dict[str, int | None] = {}
    for name, p in procs.items():
        try:
            codes[name] = p.wait(timeout=max(1.0, deadline - time.time()))
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()
            codes[name] = None
    return codes


def _tail(path: Path, lines: int = 25) -> list[str]:
    return path.read_text(errors="replace").splitlines()[-lines:] if path.is_file() else []


def summarise(rows: list[dict], base: str) -> dict:
    """Per drafter and budget: tau (tokens / rounds over all prompts) and the per-prompt paired change against
    ``base`` (mean of the per-prompt tau differences with a seeded bootstrap 95% interval)."""
    import numpy as np

    per: dict[tuple[str, str], dict[str, float]] = {}
    totals: dict[tuple[str, str], list[int]] = {}
    for r in rows:
        key = (r["draft"], str(r["budget"]))
        per.setdefault(key, {})[f"{r['dataset']}/{r['sample_id']}"] = r["tokens"] / max(1, r["rounds"])
        t = totals.setdefault(key, [0, 0])
        t[0], t[1] = t[0] + r["tokens"], t[1] + r["rounds"]
    out: dict[str, dict] = {}
    rng = np.random.default_rng(0)
    for (draft, budget), taus in per.items():
        entry = {"tau": totals[(draft, budget)][0] / max(1, totals[(draft, budget)][1]), "prompts": len(taus)}
        ref = per.get((base, budget))
        if ref is not None and draft != base:
            common = sorted(set(taus) & set(ref))
            d = np.array([taus[k] - ref[k] for k in common])
            if len(d):
                boot = rng.choice(d, size=(2000, len(d))).mean(1)
                entry["paired_vs_" + base] = [float(d.mean()), float(np.quantile(boot, 0.025)),
                                              float(np.quantile(boot, 0.975))]
        out.setdefault(draft, {})[budget] = entry
    return out


def _choose(summary: dict, labels: list[str], keep: int = 2) -> list[str]:
    """The drafters to bring back: the best of the 2-layer arm's (the shipped shape; final or half-time snapshot)
    and the best others, by replayed B=32 tau (then chain tau)."""
    trained = [a for a in labels if a in summary]
    score = lambda a: (summary[a].get("32", {}).get("tau", 0.0), summary[a].get("chain", {}).get("tau", 0.0))  # noqa: E731
    ranked = sorted(trained, key=score, reverse=True)
    chosen = [a for a in ranked if a in ("l2", "l2-half")][:1]
    for a in ranked:
        if len(chosen) < keep and a not in chosen:
            chosen.append(a)
    return chosen


def run(a: argparse.Namespace) -> dict:
    from dflash_core.default import DEFAULT_DRAFT_DIR
    from dflash_core.default import resolve_device
    from dflash_core.model import load_draft
    from experiments.bench.schema import write_json_atomic

    from .arms import strip_markov
    from .pack import split_drafter
    from .worker import _target

    t0 = time.time()
    deadline = t0 + a.seconds
    work, out = Path(a.work), Path(a.out)
    work.mkdir(parents=True, exist_ok=True)
    out.mkdir(parents=True, exist_ok=True)
    device = str(resolve_device(a.device))
    _target(a.target, torch.device(device))  # builds the dequantized cache once, before the workers race for it
    init = Path(a.init or DEFAULT_DRAFT_DIR)
    strip_markov(load_draft(init, dtype=torch.float32)).save_pretrained(work / "v4", dtype=torch.bfloat16)
    setup_s = time.time() - t0
    arms = [x for x in a.arms.split(",") if x]
    until = deadline - a.eval_reserve  # the workers' own deadline: they train until then, however long setup takes
    minutes = (until - time.time() - a.worker_setup) / 60  # what a worker should get (recorded)
    common = ["--pack", a.pack, "--device", device, "--target", a.target]
    procs = {arm: _spawn("worker", ["--arm", arm, "--init", str(init), "--out", str(work / arm),
                                    "--until", f"{until:.1f}", *common, *a.worker_args.split()],
                         work / f"{arm}.log") for arm in arms}
    refs = work / "references.json"
    ref_args = ["references", "--refs", str(refs), "--max-new-tokens", str(a.max_new_tokens), *common]
    procs["references"] = _spawn("protocol_replay", ref_args + (["--limit", str(a.limit)] if a.limit else []),
                                 work / "references.log")
    codes = _wait(procs, until + 20)
    drafters = {"v6": init, "v4": work / "v4"}
    for arm in arms:  # the final drafter and the snapshot at half time, where they were saved
        for label, sub in ((arm, "drafter"), (f"{arm}-half", "drafter-half")):
            if (work / arm / sub / "model.safetensors").is_file():
                drafters[label] = work / arm / sub
    evals = {label: _spawn("protocol_replay", ["replay", "--refs", str(refs), "--draft", str(path), "--label", label,
                                        "--out", str(work / f"eval-{label}.json"), *common],
                           work / f"eval-{label}.log") for label, path in drafters.items()} if refs.is_file() else {}
    eval_codes = _wait(evals, deadline - 10)
    rows = [r for label in evals if (work / f"eval-{label}.json").is_file()
            for r in json.loads((work / f"eval-{label}.json").read_text())["rows"]]
    summary = summarise(rows, "v6")
    chosen = _choose(summary, [label for label in drafters if label not in ("v4", "v6")], a.keep)
    configs = {}
    for label in chosen:
        split_drafter(drafters[label], out, label)
        configs[label] = json.loads((drafters[label] / "config.json").read_text())
    results = {"device": torch.cuda.get_device_name(0) if device.startswith("cuda") else "cpu",
               "torch": torch.__version__, "setup_s": setup_s, "worker_minutes": minutes,
               "codes": codes, "eval_codes": eval_codes, "summary": summary, "chosen": chosen, "configs": configs,
               "workers": {arm: json.loads((work / arm / "summary.json").read_text())
                           if (work / arm / "summary.json").is_file() else None for arm in arms},
               "logs": {p.stem: _tail(p) for p in sorted(work.glob("*.log"))}, "rows": rows,
               "wall_s": time.time() - t0}
    write_json_atomic(out / "results.json", results)
    print(json.dumps({k: results[k] for k in ("device", "codes", "eval_codes", "chosen", "wall_s")}), flush=True)
    for label, budgets in summary.items():
        print(label, {b: round(e["tau"], 3) for b, e in budgets.items()}, flush=True)
    return results


def smoke(a: argparse.Namespace) -> dict:
    """The whole run on a random target of the embedded target's shape, from the shipped drafter, every arm: the
    processes, the CUDA paths, the outputs, and each arm's steps per second at the real shapes (for sizing a run)."""
    import numpy as np

    from experiments.bench.schema import write_json_atomic

    work = Path(a.work)
    pack_dir = work / "pack"
    pack_dir.mkdir(parents=True, exist_ok=True)
    g = np.random.default_rng(0)
    vocab, n = 49152, 256
    lengths = g.integers(150, 450, size=n)
    np.savez_compressed(pack_dir / "train.npz", tokens=g.integers(0, vocab, size=int(lengths.sum())).astype(np.uint16),
                        lengths=lengths, prompt_lens=g.integers(30, 100, size=n), ranked_vocab=g.permutation(vocab))
    prompts = [{"group": "math", "dataset": "random", "sample_id": str(i), "ids": g.integers(0, vocab, 40).tolist()}
               for i in range(3)]
    write_json_atomic(pack_dir / "protocol.json", {"prompts": prompts, "summary": {"stops": []}})
    args = argparse.Namespace(**{**vars(a), "pack": str(pack_dir), "init": None, "target": "smollm2-random",
                                 "max_new_tokens": 24, "limit": None, "keep": 2})
    return run(args)


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog=f"python -m {HERE}", description=__doc__.split("\n")[0])
    p.add_argument("what", choices=["pack", "smoke", "run", "join"])
    p.add_argument("--pack", default=".gpu/pack", help="the packed data folder (pack writes it, run reads it)")
    p.add_argument("--out", default=os.environ.get("OUT", "runs/gpu-train"),
                   help="run/smoke: results and weight parts; join: the drafter folder to write")
    p.add_argument("--work", default="/tmp/gpu-train", help="workers' folders")
    p.add_argument("--init", default=None, help="the drafter the arms start from (default: the shipped one)")
    p.add_argument("--arms", default="l2,l3,l4,l2-v8k")
    p.add_argument("--seconds", type=float, default=540.0, help="wall-clock budget of the whole run")
    p.add_argument("--eval-reserve", type=float, default=110.0, help="seconds kept for the protocol replay")
    p.add_argument("--worker-setup", type=float, default=25.0,
                   help="seconds a worker is expected to need before training (recorded only)")
    p.add_argument("--worker-args", default="", help="extra worker options, e.g. '--anchors 128 --lr 3e-4'")
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--limit", type=int, default=None, help="only the first N protocol prompts")
    p.add_argument("--keep", type=int, default=2, help="drafters whose weights come back")
    p.add_argument("--target", default="smollm2")
    p.add_argument("--device", default="auto")
    p.add_argument("--results", help="join: the folder results.json and the parts lie in")
    p.add_argument("--arm", help="join: which drafter")
    return p.parse_args(argv)


def main(argv=None) -> None:
    a = parse_args(argv)
    if a.what == "pack":
        from .pack import pack

        pack(a.pack)
    elif a.what == "smoke":
        smoke(a)
    elif a.what == "run":
        run(a)
    else:
        from .pack import join

        if not (a.results and a.arm):
            raise SystemExit("join needs --results and --arm")
        print(join(a.results, a.arm, a.out))
