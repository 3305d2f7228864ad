"""The replay of every budget on plain decoding's text (experiments.bench.replayer) and what plots make of it."""

from __future__ import annotations

import statistics
from pathlib import Path

import pytest

from conftest import equal_or_fp32_tie
from experiments.bench import cli as benchmark
from experiments.bench.replayer import Replayer, round_seconds
from experiments.bench.schema import REPLAYED_FILENAME, SampleRecord, read_records
from experiments.bench.variants import Variant


@pytest.fixture(scope="module")
def replayed_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("runs") / "tiny"
    args = ["--preset", "tiny", "--out", str(out), "--datasets", "gsm8k,mt-bench", "--max-samples", "1"]
    assert benchmark.main(args) == 0
    return out


def test_replay_reproduces_the_live_rounds_in_fp32(replayed_run):
    """Oracle: in fp32 the live loop outputs plain decoding's text, so each replayed variant's rounds must equal
    the live ones on every turn (MT-Bench's second turn included: its prompt carries the first answer). Replaying
    on the wrong text, the wrong turn's prompt or with another max_new_tokens breaks this."""
    live = {r.record_key(): r for r in read_records(replayed_run / "records.jsonl")}
    replayed = read_records(replayed_run / REPLAYED_FILENAME)
    assert {r.extra.get("replayed") for r in replayed} == {True}
    compared = tied = 0
    for r in replayed:
        partner = live.get(r.record_key())
        assert partner is not None, r.record_key()
        if r.method != "ar":
            assert equal_or_fp32_tie(partner), "fp32: the live output should equal plain decoding's"
            if not partner.matches_ar:  # an fp32 tie of the target: the live text left the replayed one there
                tied += 1
                continue
            assert r.acceptance_lengths == partner.acceptance_lengths, r.record_key()
            compared += 1
        assert partner.num_new_tokens == r.num_new_tokens
    turns = {(r.dataset, r.sample_id, r.turn) for r in replayed}
    assert ("mt-bench", next(r.sample_id for r in replayed if r.dataset == "mt-bench"), 1) in turns
    assert compared + tied == 3 * len(turns) and compared >= 2 * len(turns)  # DFlash, B=4, B=16 on each turn


def test_replayed_records_are_priced_by_the_cost_curve(replayed_run):
    """Plain decoding's replayed row costs verify(0) per token after the first; every round with the drafter costs
    fixed_s + verify(N): the projected seconds of each record follow from its rounds and the curve."""
    from ddtree.cost import CostModel

    cost = CostModel(nodes=(0, 8, 32), verify_s=(0.02, 0.03, 0.05), fixed_s=0.01)
    assert round_seconds(cost, [8, 32], drafted=True) == pytest.approx(0.01 + 0.03 + 0.01 + 0.05)
    assert round_seconds(cost, [8, 32], drafted=False) == pytest.approx(0.03 + 0.05)  # PLD: no drafter pass
    assert round_seconds(cost, [], drafted=True) == 0.0
    replayed = read_records(replayed_run / REPLAYED_FILENAME)
    ar = {(r.dataset, r.sample_id, r.turn): r for r in replayed if r.method == "ar"}
    for r in replayed:
        plain = ar[(r.dataset, r.sample_id, r.turn)]
        assert sum(r.acceptance_lengths) == r.num_new_tokens - 1  # the rounds commit every token after the first
        if r.method != "ar":  # a round verifies its tree: never cheaper than plain decoding's one-token step
            assert r.decode_s / len(r.acceptance_lengths) >= plain.decode_s / len(plain.acceptance_lengths)


def test_size_run_keeps_the_minimum_samples_before_later_turns_and_budgets():
    from types import SimpleNamespace

    from experiments.bench.sizing import Unit, size_run

    variants = [Variant("ar"), Variant("dflash"), Variant("ddtree", 8), Variant("ddtree", 16),
                Variant("ddtree", "auto")]
    datasets = ("gsm8k", "mt-bench", "grounded")
    units, index = [], 0
    for d in datasets:
        for k in range(8):
            conv = SimpleNamespace(index=index, item=SimpleNamespace(dataset=d, sample_id=f"{d}{k}"))
            index += 1
            units += [Unit(conv, t, v) for t in range(1 if d == "gsm8k" else 2) for v in variants]
    per_token = {v: 0.01 for v in variants}  # 1.28 s per generation; 6.4 s per turn; replay 1 s per turn
    full = 6.4 * (8 + 16 + 16) + 1.0 * (8 + 16 + 16)
    # room for six prompts per dataset and three later turns: samples 7-8 go, then later turns from the last
    budget = 7.4 * (6 * 3 + 3) + 0.01
    kept, report = size_run(units, per_token, 128, budget, min_samples=6, per_turn=1.0)
    assert report["projected_full_s"] == pytest.approx(full, abs=0.1)
    out = report["left_out"]
    assert sorted(out[:6]) == sorted(f"{d} sample {d}{k}" for d in datasets for k in (6, 7))
    assert out[6:] == ([f"grounded sample grounded{k} later turns" for k in (5, 4, 3, 2, 1, 0)]
                       + [f"mt-bench sample mt-bench{k} later turns" for k in (5, 4, 3)])
    prompts = {d: {u.conv.item.sample_id for u in kept if u.conv.item.dataset == d} for d in datasets}
    assert all(len(p) == 6 for p in prompts.values())
    assert {u.variant for u in kept} == set(variants)  # both fixed budgets stay
    assert report["projected_s"] <= budget and report["replay_s_per_turn"] == 1.0


def test_replayer_refuses_what_it_cannot_replay():
    models = type("M", (), {"device": __import__("torch").device("cpu")})()
    for variant in (Variant("ddtree", 16, "sampled"), Variant("dflash", "chain-auto"), Variant("ar")):
        with pytest.raises(ValueError, match="cannot be replayed"):
            Replayer(models, [variant], 16)


def test_run_output_says_what_ran_live_and_how_many_prompts(replayed_run):
    from experiments.bench.schema import Manifest

    live = Manifest.read(replayed_run / "manifest.json").extra["sessions"][-1]["sizing"]["live"]
    assert live["variants"] == ["AR", "DFlash", "DDTree (B=4)", "DDTree (B=16)"]
    assert live["prompts"] == {"gsm8k T=0": {"prompts": 1, "later_turns": 0},
                               "mt-bench T=0": {"prompts": 1, "later_turns": 1}}
    assert live["replayed"] == ["DFlash", "DDTree (B=4)", "DDTree (B=16)"]


# ---------------------------------------------------------------------------------------------------- plots
def _synthetic(tmp_path: Path) -> Path:
    from synthetic_runs import write_synthetic_run

    return write_synthetic_run(tmp_path / "synthetic")


def _stats(rows: dict[str, dict[int | str, float]]):
    """Replayed-like records whose speedups over AR are exactly ``rows[dataset][budget]`` (one prompt each)."""
    from plots.metrics import compute_stats

    records = []
    for dataset, by in rows.items():
        records.append(SampleRecord(dataset, "0", 0, "ar", 0.0, 0, 101, 0.0, 1.0, [1] * 100))
        for budget, speedup in by.items():
            records.append(SampleRecord(dataset, "0", 0, Variant("ddtree", budget), 0.0, 0, 101, 0.0, 1.0 / speedup,
                                        [2] * 50))
    return compute_stats(records)


def test_auto_against_the_oracle_and_the_single_best_budget():
    from plots.replayed import auto_vs_oracle, best_single_budget

    stats = _stats({"gsm8k": {8: 2.0, 16: 2.2, "auto": 2.1}, "math500": {8: 1.8, 16: 1.5, "auto": 1.8}})
    assert best_single_budget(stats, 0.0) == 8  # mean 1.9 against 1.85
    text = auto_vs_oracle(stats, "title")
    row_oracle = next(line for line in text.splitlines() if "| oracle |" in line)
    row_single = next(line for line in text.splitlines() if "| B=8 |" in line)
    # over the oracle: 2.1 / 2.2 on GSM8K (B=16), 1.8 / 1.8 on MATH-500 (B=8)
    assert "0.955 (B=16)" in row_oracle and "1.000 (B=8)" in row_oracle
    assert row_oracle.endswith(f"| {statistics.fmean([2.1 / 2.2, 1.0]):.3f} | 0.955 |")
    assert "1.050" in row_single and row_single.endswith(f"| {statistics.fmean([1.05, 1.0]):.3f} | 1.000 |")
    gain = statistics.fmean([2.2 / 2.0, 1.0])  # per dataset after the fact over the single best budget
    assert f"gains {gain:.3f}x" in text


def test_tau_check_reports_live_against_replayed(tmp_path):
    from plots.replayed import tau_check

    run = _synthetic(tmp_path)
    live, replayed = read_records(run / "records.jsonl"), read_records(run / REPLAYED_FILENAME)
    text = tau_check(live, replayed)
    assert "DDTree (B=8)" in text and "DDTree (auto)" in text and "median abs. diff" in text
    assert "DDTree (B=32)" not in text  # replayed only: nothing live to compare with
    # identical live and replayed records: every difference is zero
    assert "(+0.0%)" in tau_check(replayed, replayed) and "(+0.1%)" not in tau_check(replayed, replayed)


def test_report_writes_the_projected_tables_and_live_intervals(tmp_path):
    from plots import make_report

    run = _synthetic(tmp_path)
    paths = {p.name for p in make_report(run, tmp_path / "fig", formats=("png",))}
    assert {"replayed.md", "auto_live.md", "speedup_T0.png", "budget_tradeoff_T0.png"} <= paths
    text = (tmp_path / "fig" / "replayed.md").read_text()
    assert "PROJECTED, not timed" in text and "DDTree (B=64)" in text and "Bias of the oracle" in text
    live = (tmp_path / "fig" / "auto_live.md").read_text()
    assert "(best single)" in live and "(42)" in live  # 7 datasets x 6 prompts, paired


def test_speedup_figure_labels_never_overlap_and_families_differ(tmp_path, monkeypatch):
    """The value labels of the speedup figure, as rendered, do not overlap; variants of one family get distinct
    shades, and DDTree (auto) and DDTree+lookup (auto) come from different colour families."""
    import matplotlib.colors as mcolors

    from plots.load import load_records
    from plots.metrics import compute_stats
    from plots.speedup import FAMILY_SHADES, speedup_families

    run = _synthetic(tmp_path)
    stats = compute_stats(load_records(run))
    families = speedup_families(stats, 0.0)
    colors = {label: color for members in families.values() for label, color, _ in members}
    assert colors["DDTree (auto)"] in FAMILY_SHADES["DDTree"]
    assert colors["DDTree+lookup (auto)"] in FAMILY_SHADES["Lookup"]
    for members in families.values():
        shades = [color for _, color, _ in members]
        assert len(set(shades)) == len(shades)
        assert len(members) <= 7
    rgb = [mcolors.to_rgb(c) for c in (colors["DDTree (auto)"], colors["DDTree+lookup (auto)"])]
    assert sum(abs(a - b) for a, b in zip(*rgb)) > 0.5

    import plots.speedup as speedup
    from plots.speedup import plot_speedup

    drawn = {}
    monkeypatch.setattr(speedup, "save_figure", lambda fig, out_dir, stem, formats: drawn.setdefault("fig", fig) and [])
    plot_speedup(stats, 0.0, tmp_path)
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    fig = drawn["fig"]
    renderer = FigureCanvasAgg(fig).get_renderer()
    fig.draw(renderer)
    for ax in fig.axes:
        boxes = [t.get_window_extent(renderer) for t in ax.texts]
        assert len(boxes) >= 8
        for i, a in enumerate(boxes):
            for b in boxes[i + 1:]:
                assert not a.overlaps(b), "two value labels overlap"
