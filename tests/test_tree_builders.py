"""The tree-builder comparison (python -m experiments.bench.tree_builders): its summary against hand counts, and the
whole command on the tiny random pair (replay and live, resumable, lossless at T = 0, its figure)."""

from __future__ import annotations

import json
import math

import pytest

from experiments.bench import tree_builders as baselines


def _row(method, budget, sample, lengths, sizes, seconds, ar_seconds, form="replay", temperature=0.0):
    return baselines._row(form, temperature, {"dataset": "d", "sample_id": sample}, method, budget, lengths, sizes,
                          seconds, ar_seconds, sum(lengths))


def test_the_summary_pools_tau_and_pairs_each_prompt_with_ddtree_at_its_budget():
    rows = [_row("ddtree", 8, "a", [2, 2], [8, 8], 1.0, 2.0), _row("ddtree", 8, "b", [1, 3], [8, 8], 2.0, 2.0),
            _row("eagle2", 8, "a", [1, 1], [8, 8], 2.0, 2.0), _row("eagle2", 8, "b", [4], [8], 1.0, 2.0),
            _row("dflash", None, "a", [3], [15], 1.0, 2.0)]
    got = {(e["method"], e["budget"]): e for e in baselines.summarize(rows)}
    eagle = got[("eagle2", 8)]
    assert eagle["prompts"] == 2 and eagle["tau"] == pytest.approx(6 / 3)  # pooled: 6 tokens over 3 rounds
    assert eagle["nodes_per_round"] == pytest.approx(8) and eagle["tau_per_node"] == pytest.approx(2 / 8)
    assert eagle["speedup"] == pytest.approx(math.sqrt(1.0 * 2.0))  # geometric mean of 2/2 and 2/1
    ratios = [1.0 / 2.0, 4.0 / 2.0]  # per prompt tau against DDTree's (a: 1 vs 2, b: 4 vs 2)
    assert eagle["tau_vs_ddtree"][0] == pytest.approx(math.sqrt(ratios[0] * ratios[1]))
    assert eagle["speedup_vs_ddtree"][0] == pytest.approx(math.sqrt((1.0 / 2.0) * (2.0 / 1.0)))
    lo, hi = eagle["tau_vs_ddtree"][1:]
    assert lo <= eagle["tau_vs_ddtree"][0] <= hi
    assert "tau_vs_ddtree" not in got[("ddtree", 8)] and "tau_vs_ddtree" not in got[("dflash", None)]
    assert "| 8 | eagle2 | 2 |" in baselines.markdown(baselines.summarize(rows), "test machine")


def test_bad_arguments_say_what_is_wrong():
    for argv, words in ((["--budgets", "0,8"], "budgets must be >= 1"), (["--temperatures", "-1"], ">= 0"),
                        (["--live-methods", "ddtree,nope"], "unknown ['nope']"),
                        (["--calibration-samples", "0"], "calibration")):
        with pytest.raises(SystemExit, match=r"(?s).*" + words.replace("[", r"\[").replace("]", r"\]")):
            baselines.parse_args(argv)
    with pytest.raises(ValueError, match="fitted acceptance table"):
        baselines.make_method("sequoia", 8, 0.0)
    with pytest.raises(ValueError, match="temperature > 0"):
        baselines.make_method("specinfer", 8, 0.0)


@pytest.mark.parametrize("temperature", ["0", "1"])
def test_the_command_replays_and_runs_live_on_the_tiny_pair_and_resumes(tmp_path, monkeypatch, temperature):
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    out = tmp_path / "run"
    argv = ["--pair", "tiny", "--out", str(out), "--datasets", "gsm8k", "--replay-samples", "2",
            "--calibration-samples", "1", "--live-samples", "1", "--budgets", "4,16", "--max-new-tokens", "10",
            "--live-max-new-tokens", "6", "--temperatures", temperature, "--threads", "1"]
    assert baselines.main(argv) == 0
    record = json.loads((out / "summary.json").read_text())
    rows = [json.loads(line) for line in (out / "rows.jsonl").read_text().splitlines()]
    replayed = {(r["method"], r["budget"]) for r in rows if r["form"] == "replay"}
    assert replayed == {("dflash", None)} | {(m, b) for m in baselines.TREE_METHODS for b in (4, 16)}
    assert sum(r["form"] == "replay" for r in rows) == 2 * len(replayed)  # every evaluation prompt
    live = [r for r in rows if r["form"] == "live"]
    expected = set(baselines.TREE_METHODS) | {"dflash"} | (set(baselines.SAMPLED_METHODS) if temperature == "1"
                                                           else set())
    assert {r["method"] for r in live} == expected
    assert all(r["budget"] is None or r["nodes"] <= r["budget"] * r["rounds"] for r in rows)
    if temperature == "0":  # lossless: every builder's output is plain decoding's
        assert all(r["same_as_ar"] is True for r in live)
    assert json.loads((out / "calibration.json").read_text())[f"{float(temperature):g}"]["rounds"] > 0
    assert {e["form"] for e in record["summary"]} == {"replay", "live"}
    before = (out / "rows.jsonl").read_text()
    assert baselines.main(argv) == 0  # a rerun finds everything done
    assert (out / "rows.jsonl").read_text() == before
    pytest.importorskip("matplotlib")
    from plots.tree_builders_figure import plot_tree_builders

    assert plot_tree_builders(record, tmp_path / "fig.png").is_file()
