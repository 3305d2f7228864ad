"""The long-context study on a tiny random pair: one record per context, equal output to plain decoding, and a rerun
that measures only the contexts the file lacks."""

from __future__ import annotations

import json

import pytest

import experiments.studies.long_context as study


def test_records_every_context_and_a_rerun_measures_only_the_missing(tmp_path, monkeypatch):
    out = tmp_path / "long.jsonl"
    args = ["--pair", "tiny", "--text", "random", "--methods", "4", "--max-new-tokens", "5", "--out", str(out)]
    study.main(args + ["--contexts", "20,60"])
    first = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["asked_context"] for r in first] == [20, 60] and [r["context"] for r in first] == [20, 60]
    for r in first:
        assert r["plain_step_ms"] > 0 and r["prefill_tok_s"] > 0 and r["ddtree_4"]["same_as_plain"]
        assert r["ddtree_4"]["tau"] >= 1 and r["dtype"] == "torch.float32"
    measured = []
    real = study.measure
    monkeypatch.setattr(study, "measure", lambda target, draft, ids, *a: measured.append(ids.shape[1]) or
                        real(target, draft, ids, *a))
    study.main(args + ["--contexts", "20,60,90"])
    assert measured == [90]
    assert [json.loads(line)["asked_context"] for line in out.read_text().splitlines()] == [20, 60, 90]
    before = out.read_text()
    other = {"--max-new-tokens": ("5", "7", "max_new_tokens 5 there, 7 now"),
             "--methods": ("4", "4,8", "no DDTree budget 8 there")}
    for flag, (old, new, why) in other.items():  # a rerun with other settings must not mix its records in
        changed = [new if a == old and args[i - 1] == flag else a for i, a in enumerate(args)]
        with pytest.raises(ValueError, match=why):
            study.main(changed + ["--contexts", "20,60,90,120"])
    assert out.read_text() == before and measured == [90]


def test_the_summary_table_and_figure(tmp_path, monkeypatch):
    """After the last context: summary.json / summary.md with one row per context (ascending) and every method, and
    the figure drawn from the JSON. ``auto``'s curves and the prefill rates of every context are measured before the
    first timed call."""
    out = tmp_path / "long" / "long_context.jsonl"
    events, real_calibrate, real_measure, real_rates = [], study.calibrate, study.measure, study.prefill_rates
    monkeypatch.setattr(study, "prefill_rates", lambda target, prompts, repeats: events.append(
        ("prefill", list(prompts), repeats)) or real_rates(target, prompts, repeats))
    monkeypatch.setattr(study, "calibrate", lambda *a, **k: events.append(("calibrate", k["contexts"])) or
                        real_calibrate(*a, **k))
    monkeypatch.setattr(study, "measure", lambda target, draft, ids, *a: events.append(("timed", ids.shape[1])) or
                        real_measure(target, draft, ids, *a))
    study.main(["--pair", "tiny", "--text", "random", "--methods", "4,auto", "--max-new-tokens", "4", "--out",
                str(out), "--contexts", "40,16"])
    summary = json.loads((out.parent / "summary.json").read_text())
    assert [r["context"] for r in summary["rows"]] == [16, 40]
    assert events == [("calibrate", [40, 16]), ("prefill", [40, 16], 3), ("timed", 40), ("timed", 16)]
    assert all(set(r["methods"]) == {"ddtree_4", "ddtree_auto"} and r["plain_step_ms"] > 0 for r in summary["rows"])
    table = (out.parent / "summary.md").read_text().splitlines()
    assert table[2].startswith("| context | plain step (ms)") and len(table) == 6 and "4: tok/s" in table[2]
    from plots.long_context_figure import context_lines, main

    lines = context_lines(summary)
    assert set(lines) == {"ar", "ddtree_4", "ddtree_auto"} and [p[0] for p in lines["ar"]] == [16, 40]
    assert main([str(out.parent / "summary.json")]) == 0
    assert (out.parent / "long_context.png").stat().st_size > 10_000


def test_prefill_rates_are_medians_of_prefills_taken_in_turn(monkeypatch):
    """Each context's rate is its tokens over the median of its prefills; the contexts take turns, forwards then
    backwards, so a slow phase of the machine (here the 9 s prefill) moves no context's rate."""
    import torch

    calls, seconds = [], iter([1.0, 2.0, 9.0, 4.0, 3.0, 1.0])

    class Result:
        def __init__(self):
            self.timings = {"prefill": next(seconds)}

    monkeypatch.setattr(study, "autoregressive_generate", lambda target, ids, max_new_tokens: calls.append(
        (ids.shape[1], max_new_tokens)) or Result())
    rates = study.prefill_rates(None, {10: torch.zeros(1, 10), 20: torch.zeros(1, 20)}, 3)
    assert calls == [(10, 1), (20, 1), (20, 1), (10, 1), (10, 1), (20, 1)]
    assert rates == {10: 10 / 3.0, 20: 20 / 2.0}  # 10: 1, 4, 3 s; 20: 2, 9, 1 s


def test_the_study_presets_refuse_a_dry_run_with_the_command_to_read():
    import subprocess
    from pathlib import Path

    script = Path(__file__).resolve().parents[1] / "run_benchmark.sh"
    studies = (("long", "experiments.studies.long_context"), ("baselines", "experiments.bench.tree_builders"))
    for preset, module in studies:
        out = subprocess.run(["bash", str(script), "--preset", preset, "--dry-run"], capture_output=True, text=True,
                             timeout=60)
        assert out.returncode == 2 and f"--preset {preset} takes neither --dry-run" in out.stderr
        assert f"python -m {module} --help" in out.stderr
