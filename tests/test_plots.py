"""Figures and tables from a small fixture of records, with hand-computed speedups and τ."""

import math
import subprocess
import sys
import warnings
from pathlib import Path

import pytest

import plot_results
from experiments.bench.schema import Manifest, SampleRecord, append_record
from plots import compute_stats, load_records, make_report, oracle_stats, summary_table
from plots.metrics import find

REPO = Path(__file__).resolve().parent.parent


def record(dataset, sample_id, method, budget, decode_s, tokens, acceptance, *, turn=0, temperature=0.0,
           matches_ar=None, extra=None):
    policy = {"ar": "ar", "dflash": "chain"}.get(method) or ("fixed" if isinstance(budget, int) else budget)
    return SampleRecord(dataset=dataset, sample_id=sample_id, turn=turn, method=method, budget=budget, policy=policy,
                        temperature=temperature, num_input_tokens=40, num_new_tokens=tokens, prefill_s=0.01,
                        decode_s=decode_s, acceptance_lengths=acceptance, stage_times={"verify": decode_s / 2},
                        matches_ar=matches_ar, seed=0, dtype="float32", extra=extra or {})


def hand_records():
    """gsm8k, T = 0, two samples: every number below is checked by hand in the tests."""
    return [
        record("gsm8k", "0", "ar", None, 2.0, 100, [1] * 100),
        record("gsm8k", "1", "ar", None, 1.5, 50, [1] * 50),
        record("gsm8k", "0", "dflash", None, 0.8, 100, [3, 5, 2], matches_ar=True),
        record("gsm8k", "1", "dflash", None, 0.5, 50, [4, 1], matches_ar=False),
        record("gsm8k", "0", "ddtree", 16, 0.5, 100, [4, 4], matches_ar=True),
        record("gsm8k", "1", "ddtree", 16, 0.4, 50, [5], matches_ar=True),
        record("gsm8k", "0", "ddtree", 32, 0.4, 100, [6, 4], matches_ar=True),
        record("gsm8k", "1", "ddtree", 32, 0.35, 50, [5], matches_ar=True),
        record("gsm8k", "0", "ddtree", 64, 0.6, 100, [7, 6], matches_ar=True),
        record("gsm8k", "1", "ddtree", 64, 0.5, 50, [6], matches_ar=True),
        record("gsm8k", "0", "ddtree", "auto", 0.45, 100, [5, 4], matches_ar=True, extra={"tree_sizes": [20, 28]}),
        record("gsm8k", "1", "ddtree", "auto", 0.3, 50, [5], matches_ar=True, extra={"tree_sizes": [24]}),
    ]


def lengths(tau, salt, rounds=30):
    """Acceptance lengths with mean close to ``tau`` and some spread."""
    return [max(1, min(16, round(tau + (k * 3 + salt) % 7 - 3))) for k in range(rounds)]


def synthetic_records(dataset, temperature, *, samples=6, turns=1, with_ar=True):
    """Plausible-looking numbers for the other panels (acceptance grows, then cost wins, with the budget)."""
    rows = []
    quality = {"humaneval": 0.8, "math500": 1.1, "mt-bench": 0.6, "aime24": 0.9}.get(dataset, 1.0)
    for s in range(samples):
        for turn in range(turns):
            tokens = 120 + 17 * s + 5 * turn
            wobble = 1 + 0.08 * ((s * 7 + turn) % 5 - 2)

            def jitter(s, salt):  # per-method timing noise, so per-sample speedups spread
                return wobble * (1 + 0.05 * ((s * 5 + salt * 3 + turn) % 7 - 3))

            if with_ar:
                rows.append(record(dataset, str(s), "ar", None, 0.02 * tokens * wobble, tokens, [1] * tokens,
                                   turn=turn, temperature=temperature))
            chain_tau = 2.0 + quality
            rows.append(record(dataset, str(s), "dflash", None, 0.02 * tokens * 1.3 / chain_tau * jitter(s, 0), tokens,
                               lengths(chain_tau, s), turn=turn,
                               temperature=temperature, matches_ar=True if temperature == 0 else None))
            for b in (8, 16, 32, 64, 128):
                tau = chain_tau + quality * 1.6 * (1 - 8 / (b + 8)) * 2
                cost = 1.3 + b / 60
                rows.append(record(dataset, str(s), "ddtree", b, 0.02 * tokens * cost / tau * jitter(s, b), tokens,
                                   lengths(tau, s + b), turn=turn, temperature=temperature,
                                   matches_ar=(s + b) % 11 != 0 if temperature == 0 else None))
            auto_s = 0.02 * tokens * 1.8 / (chain_tau + 1.9) * jitter(s, 3)
            rows.append(record(dataset, str(s), "ddtree", "auto", auto_s, tokens, lengths(chain_tau + 1.4, s),
                               turn=turn, temperature=temperature, matches_ar=True if temperature == 0 else None,
                               extra={"tree_sizes": [20 + (k * 13 + s) % 30 for k in range(30)]}))
    return rows


def write_run(folder: Path, records, *, created_at: str) -> Path:
    Manifest(device="cpu", dtype="float32", attention_backend="sdpa", seed=0, preset="test",
             command_line=["test"], created_at=created_at).write(folder / "manifest.json")
    for r in records:
        append_record(folder / "records.jsonl", r)
    return folder


@pytest.fixture
def runs(tmp_path):
    root = tmp_path / "runs"
    t0 = hand_records()
    for dataset, turns in (("math500", 1), ("humaneval", 1), ("mt-bench", 2)):
        t0 += synthetic_records(dataset, 0.0, turns=turns)
    t0 += synthetic_records("aime24", 0.0, with_ar=False)  # a dataset whose AR baseline is missing
    write_run(root / "2024-01-01_default", t0, created_at="2024-01-01T00:00:00+00:00")
    t1 = synthetic_records("gsm8k", 1.0) + synthetic_records("humaneval", 1.0)
    write_run(root / "nested" / "2024-01-02_t1", t1, created_at="2024-01-02T00:00:00+00:00")
    return root


def test_hand_computed_metrics(runs):
    stats = compute_stats(load_records(runs))
    by_label = {s.label: s for s in stats if s.dataset == "gsm8k" and s.temperature == 0.0}
    ar, dflash = by_label["AR"], by_label["DFlash"]
    assert ar.speedup == pytest.approx(1.0) and ar.tau == pytest.approx(1.0) and ar.exact_match is None
    # AR: 3.5 s / 150 tokens; DFlash: 1.3 s / 150 tokens
    assert dflash.speedup == pytest.approx(3.5 / 1.3)
    assert (dflash.speedup_median, dflash.speedup_q25, dflash.speedup_q75) == pytest.approx((2.75, 2.625, 2.875))
    assert dflash.tau == pytest.approx(15 / 5)
    # per-prompt speedups 2.5 and 3.0: a bootstrap median of two values lies between them
    assert (dflash.speedup_ci_low, dflash.speedup_ci_high) == pytest.approx((2.5, 3.0)) and not dflash.within_noise
    # rounds [3, 5, 2] and [4, 1]: depth 1 reached in 4 of 5 rounds, depth 2 in 4, depth 3 in 2, depth 4 in 1
    assert dflash.acceptance_by_depth == pytest.approx((0.8, 0.6, 0.4, 0.2))
    assert dflash.target_forwards == (1 + 3) + (1 + 2)
    assert dflash.exact_match == pytest.approx(0.5)
    assert by_label["DDTree (B=16)"].speedup == pytest.approx(3.5 / 0.9)
    assert by_label["DDTree (B=32)"].speedup == pytest.approx(3.5 / 0.75)
    assert by_label["DDTree (B=32)"].tau == pytest.approx(15 / 3)
    assert by_label["DDTree (B=64)"].speedup == pytest.approx(3.5 / 1.1)
    auto = by_label["DDTree (auto)"]
    assert auto.speedup == pytest.approx(3.5 / 0.75) and auto.mean_tree_size == pytest.approx(24.0)
    oracle = oracle_stats(stats, "gsm8k", 0.0)
    assert oracle.budget == 32 and oracle.oracle and "oracle budget" in oracle.label
    # no AR baseline: no speedup, still a τ
    aime = find(stats, "aime24", 0.0, "dflash")[0]
    assert aime.speedup is None and aime.tau is not None
    assert oracle_stats(stats, "aime24", 0.0) is None


def table_row(table: str, dataset: str, temperature: str, method: str) -> list[str]:
    for line in table.splitlines():
        cells = [c.strip() for c in line.strip("|").split("|")]
        if cells[:3] == [dataset, temperature, method]:
            return cells
    raise AssertionError(f"no row {dataset} {temperature} {method} in\n{table}")


def test_summary_table_numbers(runs):
    table = summary_table(load_records(runs))
    assert table_row(table, "GSM8K", "0", "DFlash")[3:8] == ["2.69×", "2.75 [2.50, 3.00]", "3.00", "50% / 50% (2)",
                                                             "2"]
    assert table_row(table, "GSM8K", "0", "DDTree (oracle budget), B=32")[3] == "4.67×"
    assert table_row(table, "GSM8K", "0", "DDTree (B=32)")[5] == "5.00"
    assert table_row(table, "GSM8K", "0", "AR")[3:6] == ["1.00×", "1.00 [1.00, 1.00]", "1.00"]
    assert table_row(table, "AIME24", "0", "DFlash")[3] == "–"
    assert table_row(table, "MT-Bench", "0", "DFlash")[7] == "12"  # 6 samples × 2 turns
    assert table_row(table, "GSM8K", "1", "DFlash")[6] == "–"  # not compared at T = 1
    compact = summary_table(load_records(runs), all_budgets=False, fixed_budget=16)
    assert "DDTree (B=16)" in compact and "DDTree (B=64)" not in compact and "DDTree (auto)" in compact


def test_report_writes_every_figure_and_table(runs, tmp_path):
    out = tmp_path / "figures"
    paths = make_report(runs, out)
    names = {p.name for p in paths}
    for t in ("T0", "T1"):
        for stem in ("speedup", "budget_tradeoff", "acceptance_hist"):
            assert {f"{stem}_{t}.png", f"{stem}_{t}.pdf"} <= names
    assert {"results_table.md", "results_table.tex", "all_budgets.md", "all_budgets.tex"} <= names
    for path in paths:
        assert path.parent == out and path.stat().st_size > 0
    assert (out / "speedup_T0.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert (out / "speedup_T0.pdf").read_bytes()[:5] == b"%PDF-"
    latex = (out / "results_table.tex").read_text()
    assert r"\begin{tabular}" in latex and r"2.69$\times$" in latex and r"4.67$\times$" in latex
    assert "oracle budget" in (out / "results_table.md").read_text()


def test_truncated_last_line_is_tolerated(runs, tmp_path):
    records_file = runs / "2024-01-01_default" / "records.jsonl"
    with open(records_file, "a") as f:
        f.write('{"dataset": "gsm8k", "sample_id": "2", "tu')
    with pytest.warns(UserWarning, match="truncated"):
        paths = make_report(runs, tmp_path / "out", formats=["png"])
    assert any(p.name == "speedup_T0.png" for p in paths)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        table = summary_table(load_records(runs))
    assert table_row(table, "GSM8K", "0", "DFlash")[3] == "2.69×"


def test_newest_run_wins_for_duplicate_records(runs):
    rerun = record("gsm8k", "0", "dflash", None, 0.4, 100, [3, 5, 2], matches_ar=True)
    write_run(runs / "2024-01-03_rerun", [rerun], created_at="2024-01-03T00:00:00+00:00")
    with pytest.warns(UserWarning, match="more than one run"):
        records = load_records(runs)
    dflash = [s for s in compute_stats(records) if s.dataset == "gsm8k" and s.temperature == 0 and s.label == "DFlash"]
    assert dflash[0].speedup == pytest.approx(3.5 / 0.9)


def test_missing_methods_are_handled(tmp_path):
    run = write_run(tmp_path / "runs" / "ar_only", [r for r in hand_records() if r.method == "ar"],
                    created_at="2024-01-01T00:00:00+00:00")
    paths = make_report(run, tmp_path / "out", formats=["png"])
    assert {p.name for p in paths} == {"results_table.md", "results_table.tex", "all_budgets.md", "all_budgets.tex"}


def test_plot_results_entry_point(runs, tmp_path, capsys):
    assert plot_results.main(["--runs", str(runs), "--formats", "png", "--fixed-budget", "32"]) == 0
    assert (runs / "figures" / "speedup_T0.png").stat().st_size > 0
    assert "speedup_T0.png" in capsys.readouterr().out
    assert plot_results.main(["--runs", str(tmp_path / "nothing_here")]) == 1


def test_plots_do_not_import_torch():
    code = ("import sys, plots, plot_results, plots.figures\n"
            "print(sorted(m for m in ('torch', 'transformers') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


def test_bootstrap_ci_of_one_value_is_its_statistic():
    from experiments.bench.schema import bootstrap_ci

    def ratio(pairs):  # a statistic over tuples: one value's interval is that statistic, not the tuple itself
        return sum(a for a, _ in pairs) / sum(b for _, b in pairs)

    assert bootstrap_ci([(3, 2)], statistic=ratio) == (1.5, 1.5)
    assert bootstrap_ci([2.5]) == (2.5, 2.5) and bootstrap_ci([]) == (None, None)


def test_bootstrap_interval_of_the_median():
    import random
    import statistics

    from plots.metrics import bootstrap_median_ci

    assert bootstrap_median_ci([]) == (None, None) and bootstrap_median_ci([1.3]) == (1.3, 1.3)
    rng = random.Random(1)
    values = [rng.gauss(1.2, 0.1) for _ in range(40)]
    lo, hi = bootstrap_median_ci(values)
    assert lo < statistics.median(values) < hi and hi - lo < 0.15  # about 2 x 1.25 sigma / sqrt(n) wide
    assert bootstrap_median_ci(values) == (lo, hi)  # fixed seed: reproducible
    # coverage: the interval holds the true median in about 95% of repeated draws
    hits = 0
    for trial in range(200):
        sample = [rng.gauss(1.0, 0.2) for _ in range(25)]
        a, b = bootstrap_median_ci(sample, resamples=400, seed=trial)
        hits += a <= 1.0 <= b
    assert 0.88 <= hits / 200 <= 0.995


def test_within_noise_and_stage_table(runs):
    from plots.tables import stage_table

    records = [record("gsm8k", str(i), "ar", None, 1.0, 10, [1] * 10) for i in range(4)]
    records += [record("gsm8k", str(i), "dflash", None, d, 10, [2] * 5) for i, d in enumerate([0.9, 1.1, 0.95, 1.05])]
    dflash = find(compute_stats(records), "gsm8k", 0.0, "dflash")[0]
    assert dflash.within_noise and table_row(summary_table(records), "GSM8K", "0", "DFlash")[4].startswith("≈")
    table = stage_table(records)
    row = next(line for line in table.splitlines() if "DFlash" in line)
    cells = [c.strip() for c in row.strip("|").split("|")]
    # 4 records x 5 rounds, 4.0 s of decoding: 200 ms per round, half of it verify (the fixture's stage_times)
    assert cells[2] == "200.0" and cells[5] == "100.0" and cells[7] == "100.0" and cells[8] == "2.00"
    assert cells[9] == f"{4 * 6 / 40:.2f}"  # (prefill + 5 rounds) x 4 records / 40 tokens
    assert len(table.splitlines()[0].split("|")) == len(table.splitlines()[1].split("|"))


def test_policy_table_against_the_oracle():
    from plots.tables import policy_table

    recs = hand_records()  # AR 3.5 s / 150 tokens; B=32 0.75 s (the oracle); auto 0.75 s; B=16 0.9 s
    recs += [record("math500", "0", "ar", None, 1.0, 50, [1] * 50),
             record("math500", "0", "ddtree", 8, 0.5, 50, [2] * 25),
             record("math500", "0", "ddtree", "auto", 0.625, 50, [2] * 25)]
    table = policy_table(recs)
    row = next(line for line in table.splitlines() if "auto" in line)
    cells = [c.strip() for c in row.strip("|").split("|")]
    assert cells[2] == "1.00 (B=32)" and cells[3] == "0.80 (B=8)"  # gsm8k, then math500 (the papers' order)
    assert cells[4] == "0.900" and cells[5] == "0.80"
    assert policy_table([r for r in recs if r.budget != "auto"]) == ""


def test_scaling_fit_recovers_a_log_linear_curve_and_projects_the_goal(tmp_path):
    from plots.scaling import fit_log_linear, plot_scaling, scaling_summary, tokens_for

    tokens = [1e6, 3e6, 1e7, 3e7]
    taus = [1.5 + 0.4 * math.log10(t / 1e6) for t in tokens]
    a, b = fit_log_linear(tokens, taus)
    assert b == pytest.approx(0.4) and a == pytest.approx(1.5 - 0.4 * 6)
    assert tokens_for((a, b), 2.3) == pytest.approx(1e8)
    assert tokens_for((a, -0.1), 9.0) is None and fit_log_linear([5e6, 5e6], [1.0, 2.0]) is None
    log = {"curve": [{"tokens": t, "tau_chain": y, "tau_b32": y + 0.7} for t, y in zip(tokens, taus)],
           "runs": [{"end_to_end_response_tokens_per_s": 500.0}]}
    summary = scaling_summary(log, {"tau_chain": 2.3})
    assert summary["tau_chain"]["more_tokens"] == pytest.approx(1e8 - 3e7)
    assert summary["tau_chain"]["cpu_hours"] == pytest.approx((1e8 - 3e7) / 500 / 3600)
    assert plot_scaling(log, tmp_path / "s.png").stat().st_size > 1000


def test_gpu_projection_fits_one_series_and_prices_gpu_minutes():
    from plots.scaling import gpu_projection

    log = {"curve": [{"tokens": 1e6, "tau_chain": 1.0, "tau_b32": 2.0},  # the base design: not in the fit
                     {"series": "markov", "tokens": 1e7, "tau_chain": 2.0, "tau_b32": 3.0},
                     {"series": "markov", "tokens": 2e7, "tau_chain": 2.0 + 0.5 * math.log10(2), "tau_b32": 3.0}],
           "runs": [{"gpu": "H200", "response_tokens_seen_est": 2e6, "train_minutes": 4.0},
                    {"cpu": "EPYC", "tokens": 9e9, "train_minutes": 1.0}]}  # a CPU run: not a GPU rate
    got = gpu_projection(log, {"tau_chain": 2.5, "tau_b32": 3.5})
    assert got["points"] == 2 and got["tokens_per_gpu_minute"] == pytest.approx(5e5)
    assert got["tau_chain"]["tokens_needed"] == pytest.approx(1e8)  # 2.0 at 1e7, +0.5 per decade
    assert got["tau_chain"]["gpu_minutes"] == pytest.approx((1e8 - 2e7) / 5e5)
    assert got["tau_b32"]["tokens_needed"] is None and got["tau_b32"]["gpu_minutes"] is None  # flat: no projection


def test_paired_tau_change_between_two_evaluations():
    from experiments.studies.drafter_stream import paired_change

    before = {"per_prompt": {"a/1/chain": [10, 5], "b/2/chain": [12, 6], "c/3/chain": [9, 9], "a/1/32": [10, 4]}}
    after = {"per_prompt": {"a/1/chain": [10, 4], "b/2/chain": [12, 6], "c/3/chain": [9, 8], "a/1/32": [10, 4]}}
    got = paired_change(before, after, "chain")
    assert got["prompts"] == 3 and got["better"] == 2 and got["worse"] == 0
    assert got["mean"] == pytest.approx(((2.5 - 2.0) + 0 + (9 / 8 - 1)) / 3)
    assert got["ci95"][0] <= got["mean"] <= got["ci95"][1]
    assert paired_change(before, after, "32")["mean"] == 0


def test_lookup_variants_and_dflash_auto_in_tables_and_figures(tmp_path):
    """PLD, DDTree+lookup, DFlash (auto) and a user policy: their own rows and labels, a Lookup column, never the
    oracle, the policies in the policy table, and every figure still drawn."""
    from plots.tables import policy_table

    def variant(sample, method, budget, policy, decode_s, acceptance, lookup_tokens=None, tree=None):
        extra = {} if lookup_tokens is None else {"lookup_tokens": lookup_tokens}
        return SampleRecord(dataset="gsm8k", sample_id=sample, turn=0, method=method, budget=budget, policy=policy,
                            temperature=0.0, num_input_tokens=40, num_new_tokens=sum(acceptance) + 1, prefill_s=0.01,
                            decode_s=decode_s, acceptance_lengths=acceptance, stage_times={"verify": decode_s / 2},
                            matches_ar=True, tree=tree, extra=extra)

    recs = [r for r in hand_records() if r.sample_id == "0"]  # AR 2.0 s / 100 tokens; the oracle: B=32, 0.4 s
    recs += [variant("0", "pld", None, "lookup", 1.0, [2] * 49 + [1], lookup_tokens=49),
             variant("0", "ddtree", 32, "lookup", 0.2, [9] * 11, lookup_tokens=33, tree="topk"),
             variant("0", "dflash", "chain-auto", "chain-auto", 0.5, [3] * 33, tree=None),
             variant("0", "ddtree", "my-policy", "custom", 0.8, [4] * 25, tree="topk")]
    stats = compute_stats(recs)
    by_label = {s.label: s for s in stats}
    assert {"PLD", "DDTree+lookup (B=32)", "DFlash (auto)", "my-policy"} <= set(by_label)
    assert by_label["PLD"].lookup_share == pytest.approx(49 / 99)
    assert by_label["DDTree+lookup (B=32)"].lookup_share == pytest.approx(33 / 99)
    assert by_label["DDTree (B=32)"].lookup_share is None
    oracle = oracle_stats(stats, "gsm8k", 0.0)
    assert oracle.budget == 32 and oracle.policy == "fixed"  # the faster lookup tree is not a fixed budget
    table = summary_table(recs)
    header = table.splitlines()[0]
    assert "Lookup" in header and table_row(table, "GSM8K", "0", "PLD")[7] == "49%"
    assert table_row(table, "GSM8K", "0", "DDTree (B=32)")[7] == "–"
    assert table_row(table, "GSM8K", "0", "DFlash (auto)")[3] == "4.00×"
    assert "prompt lookup" in table and "chosen from the machine's cost curve" in table
    labels = [c.strip() for line in table.splitlines()[2:] if line.startswith("|") for c in [line.split("|")[3]]]
    assert labels.index("DFlash") < labels.index("DFlash (auto)")  # the plain chain first
    assert labels.index("DDTree (B=32)") + 1 == labels.index("DDTree+lookup (B=32)")  # side by side
    policies = policy_table(recs)
    assert "| DFlash (auto) |" in policies and "| my-policy |" in policies and "DDTree+lookup" not in policies
    assert "Lookup" not in summary_table(hand_records()).splitlines()[0]  # no lookup variant: no column
    run = write_run(tmp_path / "runs" / "lookup", recs, created_at="2024-01-01T00:00:00+00:00")
    paths = make_report(run, tmp_path / "figures", formats=["png"])
    names = {p.name for p in paths}
    assert {"speedup_T0.png", "budget_tradeoff_T0.png", "acceptance_hist_T0.png", "stage_times.md"} <= names
    assert r"Lookup" in (tmp_path / "figures" / "results_table.tex").read_text()
    assert "DDTree+lookup (B=32)" in (tmp_path / "figures" / "results_table.md").read_text()


def test_plot_colors_live_in_plots():
    from plots.colors import METHOD_COLORS, VARIANT_COLORS
    from experiments.bench.schema import METHODS

    assert set(METHOD_COLORS) == set(METHODS) and "chain-auto" in VARIANT_COLORS


def test_a_version_1_run_folder_plots_like_its_version_2_copy(tmp_path):
    """Records written before the variant spec (method / budget / policy / tree, chain-auto filed under DDTree) are
    read through the one migration: the tables of the old file equal those of the same records written today."""
    base = ('"dataset":"gsm8k","sample_id":"%s","turn":0,"temperature":0.0,"num_input_tokens":9,"num_new_tokens":%d,'
            '"prefill_s":0.0,"decode_s":%s,"acceptance_lengths":%s,"matches_ar":%s,"schema_version":1')
    variants = [('"method":"ar","budget":null,"policy":"ar"', 12, "1.2", "[1,1,1,1,1,1,1,1,1,1,1,1]", "null"),
                ('"method":"ddtree","budget":16,"policy":"fixed"', 12, "0.5", "[4,4,4]", "true"),
                ('"method":"ddtree","budget":16,"policy":"lookup","tree":"topk"', 12, "0.4", "[6,6]", "true"),
                ('"method":"ddtree","budget":"chain-auto","policy":"chain-auto"', 12, "0.6", "[3,3,3,3]", "true")]
    old = tmp_path / "old"
    old.mkdir()
    (old / "records.jsonl").write_text("".join(
        "{" + fields + "," + base % (sample, n, seconds, lengths, match) + "}\n"
        for sample in ("0", "1") for fields, n, seconds, lengths, match in variants))
    records = load_records(old)
    assert sorted(r.variant for r in records) == sorted(
        ["ar", "ddtree:B=16", "ddtree+lookup:B=16", "dflash:chain-auto"] * 2)
    new = write_run(tmp_path / "new", records, created_at="2026-01-01T00:00:00+00:00")
    table = summary_table(load_records(old))
    assert table == summary_table(load_records(new))
    for label in ("DDTree (B=16)", "DDTree+lookup (B=16)", "DFlash (auto)"):
        assert table_row(table, "GSM8K", "0", label)[3] == {"DDTree (B=16)": "2.40×", "DDTree+lookup (B=16)": "3.00×",
                                                            "DFlash (auto)": "2.00×"}[label]
