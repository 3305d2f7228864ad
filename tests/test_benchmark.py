"""The benchmark runner end to end on the tiny preset (random tiny models, no files), presets, and the GPU check's
tiny CPU path."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from conftest import equal_or_fp32_tie
from experiments.bench import cli as benchmark
from experiments.bench.cli import run_pair
from experiments.bench.ranks import RankInfo
from experiments.bench.run_folder import existing_records, merge_rank_files
from experiments.bench.models import ByteTokenizer
from experiments.bench.variants import Variant, make_variants
from dflash_core.training.pools.catalog import build_chat, select_items
from experiments.bench.presets import PRESETS, TINY, ModelPair, Preset, get_preset, with_overrides
from experiments.bench.schema import Manifest, read_records, record_key


pytestmark = pytest.mark.usefixtures("one_thread")  # conftest: tiny models run on one thread


def expected_keys(preset: Preset) -> set[tuple]:
    variants = make_variants(preset)
    keys = set()
    for t in preset.temperatures:
        for dataset in preset.datasets:
            for item in select_items(dataset, preset.samples_for(dataset), preset.seed):
                for turn in range(len(item.turns)):
                    keys |= {record_key(dataset, item.sample_id, turn, v, t) for v in variants}
    return keys


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("runs") / "tiny"
    assert benchmark.main(["--preset", "tiny", "--out", str(out)]) == 0
    return out


# ---------------------------------------------------------------------------------------------------- presets
def test_presets_are_valid_and_match_the_issue():
    for preset in PRESETS.values():
        assert preset.problems() == []
    default, quick, paper = get_preset("default"), get_preset("quick"), get_preset("paper")
    assert set(default.datasets) == {"gsm8k", "math500", "aime24", "aime25", "humaneval", "mt-bench", "grounded"}
    assert default.methods == ("ar", "dflash", "ddtree", "pld") and default.temperatures == (0.0,)
    # live by default: plain decoding, DFlash, two fixed budgets, auto, PLD, DDTree+lookup under auto; six prompts
    labels = [v.label for v in make_variants(default)]
    assert labels == ["AR", "DFlash", "DDTree (B=8)", "DDTree (B=16)", "DDTree (auto)", "PLD",
                      "DDTree+lookup (auto)"], labels
    assert default.max_samples >= 6 and default.min_samples >= 6
    full = [v.label for v in make_variants(with_overrides(default, full=True))]
    assert {"DDTree (B=2)", "DDTree (B=64)", "DFlash (auto)", "DDTree+lookup (B=16)"} <= set(full), full
    # replayed: every budget 2..64, auto, the chain, PLD and the lookup trees
    assert {2, 4, 8, 16, 32, 64, "auto", "chain"} <= set(default.replay_budgets)
    assert set(default.replay_lookup_budgets) == {16, "auto"}
    assert default.models[0].target == "default" and default.models[0].draft == "default"
    assert len(quick.datasets) * quick.max_samples <= 2 and quick.max_new_tokens <= 64 and quick.budgets == (16,)
    paper_datasets = set(paper.datasets) | set(getattr(paper, "hub_datasets", ()))  # hub-only ones: when asked
    assert len(paper.models) == 4 and len(paper_datasets) >= 10
    hybrid = next(pair for pair in paper.models if pair.target == "Qwen/Qwen3.5-27B")  # beside Qwen3-8B
    assert hybrid.max_budget == 64 and hybrid.keeps(64) and hybrid.keeps("auto") and not hybrid.keeps(128) and paper.temperatures == (0.0, 1.0)
    assert min(b for b in paper.budgets if isinstance(b, int)) == 16 and 1024 in paper.budgets
    assert paper.device == "cuda" and any(pair.device_map == "auto" for pair in paper.models)
    assert TINY.models[0] == ModelPair("tiny", "random", name="tiny")


def test_overrides_validate_and_normalize():
    p = with_overrides(TINY, datasets=("MT_Bench",), budgets=(2, "auto"), max_samples=1, draft="random")
    assert p.datasets == ("mt-bench",) and p.budgets == (2, "auto")
    for bad in (dict(datasets=("nope",)), dict(methods=("medusa",)), dict(budgets=(-1,)), dict(dtype="int8"),
                dict(temperatures=(-0.5,))):
        with pytest.raises(ValueError):
            with_overrides(TINY, **bad)
    with pytest.raises(ValueError, match="lookup budget"):
        with_overrides(TINY, lookup_budgets=("chain",))
    with pytest.raises(ValueError, match="known presets"):
        get_preset("huge")


def test_cli_reports_bad_arguments(tmp_path, capsys):
    assert benchmark.main(["--preset", "tiny", "--datasets", "nope", "--out", str(tmp_path)]) == 2
    assert "known datasets" in capsys.readouterr().err


# ---------------------------------------------------------------------------------------------------- end to end
def test_tiny_run_writes_complete_valid_records(tiny_run):
    records = read_records(tiny_run / "records.jsonl")
    keys = [r.record_key() for r in records]
    assert len(keys) == len(set(keys)) and set(keys) == expected_keys(TINY)
    for r in records:
        out = r.extra["output_ids"]
        assert r.num_new_tokens == len(out) > 0 and r.decode_s > 0 and r.prefill_s > 0
        assert sum(r.acceptance_lengths) + 1 == r.num_new_tokens  # the prefill's token is not a round
        assert r.extra["target_forwards"] == 1 + len(r.acceptance_lengths)
        if r.method == "ar":
            assert r.matches_ar is None and r.policy == "ar" and set(r.acceptance_lengths) == {1}
        else:
            assert equal_or_fp32_tie(r), r  # fp32, T = 0: lossless up to an fp32 tie of the target
            assert len(r.extra["tree_sizes"]) == len(r.acceptance_lengths) == len(r.extra["expected_acceptance"])
            assert {"draft", "verify"} <= set(r.stage_times)
        if r.method == "ddtree":
            assert r.policy == "fixed" and max(r.extra["tree_sizes"]) <= r.budget
    manifest = Manifest.read(tiny_run / "manifest.json")
    assert manifest.preset == "tiny" and manifest.dtype == "float32" and manifest.attention_backend == "sdpa"
    assert manifest.extra["pair"]["target"] == "tiny" and manifest.extra["preset"]["max_new_tokens"] == 12
    assert not list(tiny_run.glob("records.rank*.jsonl"))
    curve = manifest.extra["sessions"][-1]["cost_curve"]  # the machine's round cost curve, and what it means
    assert curve["nodes"][0] == 0 and len(curve["verify_s"]) == len(curve["nodes"])
    assert "machine" in curve["explanation"]


def test_methods_run_interleaved_and_second_turn_continues_ar(tiny_run):
    records = read_records(tiny_run / "records.jsonl")
    by_turn: dict[tuple, list] = {}
    for r in records:
        by_turn.setdefault((r.dataset, r.sample_id, r.turn), []).append(r)
    orders = set()
    for group in by_turn.values():
        assert len({r.num_input_tokens for r in group}) == 1  # every method saw the same prompt
        assert [r.method for r in group][0] == "ar"  # AR first: the reference
        orders.add(tuple(r.budget for r in group[1:]))
    assert len(orders) > 1  # the order of the other methods rotates
    tokenizer = ByteTokenizer()
    item = next(i for i in select_items("mt-bench", 2, 0))
    ar0 = next(r for r in records
               if (r.dataset, r.sample_id, r.turn, r.method) == ("mt-bench", item.sample_id, 0, "ar"))
    answer = tokenizer.decode([t for t in ar0.extra["output_ids"] if t != tokenizer.eos_token_id], True)
    second = next(r for r in records if (r.dataset, r.sample_id, r.turn) == ("mt-bench", item.sample_id, 1))
    assert second.num_input_tokens == len(build_chat(tokenizer, item.turns, [answer]))


def test_rerun_skips_finished_work(tiny_run, monkeypatch, capsys):
    before = (tiny_run / "records.jsonl").read_bytes()

    def no_generation(*args, **kwargs):
        raise AssertionError("a finished run must not generate again")

    monkeypatch.setattr("experiments.bench.session.generate", no_generation)
    assert benchmark.main(["--preset", "tiny", "--out", str(tiny_run)]) == 0
    assert (tiny_run / "records.jsonl").read_bytes() == before
    assert "DDTree (B=16)" in capsys.readouterr().out  # the summary table is printed again
    sessions = Manifest.read(tiny_run / "manifest.json").extra["sessions"]
    assert len(sessions) == 2 and all("finished_at" in s for s in sessions)


def test_killed_run_restarts_cleanly_and_completes(tiny_run, tmp_path):
    out = tmp_path / "killed"
    assert benchmark.main(["--preset", "tiny", "--out", str(out), "--max-generations", "7"]) == 3  # incomplete
    path = out / "records.jsonl"
    assert len(read_records(path)) == 7
    data = path.read_bytes()
    path.write_bytes(data[: len(data) - 40])  # killed while writing the 7th record: a torn last line
    with pytest.warns(UserWarning, match="truncated"):
        assert len(read_records(path)) == 6
    with pytest.warns(UserWarning, match="truncated"):
        assert benchmark.main(["--preset", "tiny", "--out", str(out)]) == 0
    records = read_records(path)
    keys = [r.record_key() for r in records]
    assert len(keys) == len(set(keys)) and set(keys) == expected_keys(TINY)
    reference = {r.record_key(): r for r in read_records(tiny_run / "records.jsonl")}
    for r in records:  # greedy: resuming changes nothing about what was generated or compared
        assert r.extra["output_ids"] == reference[r.record_key()].extra["output_ids"]
        assert r.matches_ar == reference[r.record_key()].matches_ar


def test_rerun_with_other_settings_is_refused(tiny_run, tmp_path, capsys):
    out = tmp_path / "copy"
    shutil.copytree(tiny_run, out)
    assert benchmark.main(["--preset", "tiny", "--out", str(out), "--max-new-tokens", "5"]) == 1
    assert "other settings" in capsys.readouterr().err


def test_sampling_run_checks_top_k_trees_against_plain_sampling(tmp_path):
    """At T = 1 a top-K tree draws every committed token as plain decoding does (same seed): in fp32 its output
    equals AR's; a sampled tree verifies by rejection sampling (other draws), so it is not compared."""
    out = tmp_path / "t1"
    args = ["--preset", "tiny", "--out", str(out), "--temperatures", "1", "--datasets", "gsm8k", "--max-samples", "1",
            "--methods", "ar,dflash,ddtree", "--budgets", "4", "--trees", "topk,sampled"]
    assert benchmark.main(args) == 0
    records = read_records(out / "records.jsonl")
    assert {(r.method, r.tree, r.temperature) for r in records} == {
        ("ar", None, 1.0), ("dflash", None, 1.0), ("ddtree", "topk", 1.0), ("ddtree", "sampled", 1.0)}
    for r in records:  # sampled draws do not tie: an fp32 logit difference of ~1e-5 moves a draw with odds ~1e-5
        assert r.matches_ar is (None if r.method == "ar" or r.tree == "sampled" else True), r


def test_sampled_trees_are_not_measured_twice_at_temperature_zero(tmp_path):
    """At T = 0 tree='sampled' is the top-K tree: one record, labelled topk, not a second one labelled sampled."""
    out = tmp_path / "t0"
    args = ["--preset", "tiny", "--out", str(out), "--temperatures", "0", "--datasets", "gsm8k", "--max-samples", "1",
            "--methods", "ar,ddtree", "--budgets", "4", "--trees", "topk,sampled"]
    assert benchmark.main(args) == 0
    records = read_records(out / "records.jsonl")
    assert sorted((r.method, str(r.tree)) for r in records) == [("ar", "None"), ("ddtree", "topk")]
    assert benchmark.main(args) == 0  # a rerun finds nothing left to do
    assert len(read_records(out / "records.jsonl")) == 2


def test_auto_budget_is_a_method_variant(tmp_path, monkeypatch):
    monkeypatch.setenv("DDTREE_CACHE", str(tmp_path / "cache"))
    out = tmp_path / "auto"
    args = ["--preset", "tiny", "--out", str(out), "--datasets", "gsm8k", "--max-samples", "1",
            "--methods", "ar,ddtree", "--budgets", "4,auto"]
    assert benchmark.main(args) == 0
    auto = [r for r in read_records(out / "records.jsonl") if r.budget == "auto"]
    assert len(auto) == 1 and auto[0].policy == "auto" and equal_or_fp32_tie(auto[0])
    assert len(auto[0].extra["tree_sizes"]) == len(auto[0].acceptance_lengths)


def test_ranks_split_the_samples_and_rank0_merges(tmp_path):
    preset = with_overrides(TINY, datasets=("gsm8k",), max_samples=3, methods=("ar", "dflash"))
    out = tmp_path / "ranks"
    for rank in (RankInfo(1, 2, 1), RankInfo(0, 2, 0)):  # the ranks run independently; a barrier, then a merge
        assert run_pair(preset, preset.models[0], out, device=torch.device("cpu"), rank=rank)
    shares = [{r.sample_id for r in read_records(out / f"records.rank{k}.jsonl")} for k in (0, 1)]
    assert shares[0] and shares[1] and not shares[0] & shares[1]
    assert len(existing_records(out)) == 6
    merge_rank_files(out)
    assert not list(out.glob("records.rank*.jsonl"))
    assert {r.record_key() for r in read_records(out / "records.jsonl")} == expected_keys(preset)


# ---------------------------------------------------------------------------------------------------- gpu check
def test_gpu_check_tiny_cpu_path_writes_a_profile(tmp_path):
    from experiments.studies import gpu_check
    path = tmp_path / "profile.json"
    assert gpu_check.main(["--device", "cpu", "--tiny", "--out", str(path)]) == 0
    profile = json.loads(path.read_text())
    tiny = profile["models"]["tiny"]
    assert tiny["oracle"]["max_abs_diff"] < 1e-4 and tiny["oracle"]["argmax_agreement"] == 1.0
    assert tiny["lossless"]["exact_match"] == tiny["lossless"]["runs_total"] > 0
    curve = tiny["verify_cost"]
    assert curve["appended_tokens"] == [1, 2, 4, 8, 16, 32, 64]
    assert len(curve["tree_median_ms"]) == len(curve["causal_median_ms"]) == 7
    assert all(ms > 0 for ms in curve["tree_median_ms"]) and tiny["draft_cost"]["pass_ms"] > 0
    cost = tiny["cost_model"]
    assert cost["nodes"][0] == 0 and cost["nodes"] == sorted(cost["nodes"]) and cost["fixed_s"] > 0
    # verify curves and round costs at both context lengths; budget="auto" reads the profile
    assert [c["context"] for c in tiny["cost_models"]] == [64, 128]
    assert len(tiny["verify_cost_128"]["tree_median_ms"]) == 7
    from ddtree.cost import CostModel

    assert CostModel.from_profile(path, context=100).context == 128
    assert profile["schema"] == "ddtree-gpu-profile/1" and profile["device"].startswith("cpu")


@pytest.mark.skipif(torch.cuda.is_available(), reason="the refusal is for machines without CUDA")
def test_gpu_check_refuses_cpu_without_flags(tmp_path, capsys):
    from experiments.studies import gpu_check
    assert gpu_check.main(["--out", str(tmp_path / "p.json")]) == 2
    err = capsys.readouterr().err
    assert "no CUDA device" in err and "--tiny" in err
    assert not (tmp_path / "p.json").exists()


def test_torchrun_ranks_write_their_own_files_and_rank0_merges(tmp_path):
    import os
    import subprocess
    import sys

    out = tmp_path / "torchrun"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
           "-m", "experiments.bench", "--preset", "tiny", "--out", str(out), "--datasets", "gsm8k,mt-bench",
           "--max-samples", "2", "--methods", "ar,ddtree", "--budgets", "4"]
    done = subprocess.run(cmd, cwd=Path(__file__).resolve().parent.parent, env=env, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert not list(out.glob("records.rank*.jsonl"))
    preset = with_overrides(TINY, datasets=("gsm8k", "mt-bench"), max_samples=2, methods=("ar", "ddtree"), budgets=(4,))
    records = read_records(out / "records.jsonl")
    assert {r.record_key() for r in records} == expected_keys(preset) and len(records) == len(expected_keys(preset))
    assert all(equal_or_fp32_tie(r) for r in records if r.method == "ddtree")
    assert Manifest.read(out / "manifest.json").extra["world_size"] == 2
    assert "DDTree (B=4)" in done.stdout


def test_cost_curve_explanation_names_the_regime():
    from experiments.bench.cost_curve import explain_cost_curve

    flat = {0: 1.0, 8: 1.05, 32: 1.3}
    steep = {0: 1.0, 8: 2.0, 32: 4.0}
    middle = {0: 1.0, 8: 1.3, 32: 2.2}
    assert "large budgets win" in explain_cost_curve(flat, 0.2)
    assert "small trees win" in explain_cost_curve(steep, 0.2) and "2.00x" in explain_cost_curve(steep, 0.2)
    assert "mid-size" in explain_cost_curve(middle, 0.5) and "0.50 of a plain step" in explain_cost_curve(middle, 0.5)


def _units(datasets, samples, variants, turns=None):
    from types import SimpleNamespace

    from experiments.bench.sizing import Unit

    units, index = [], 0
    for d in datasets:
        for k in range(samples):
            conv = SimpleNamespace(index=index, item=SimpleNamespace(dataset=d, sample_id=f"{d}{k}"))
            index += 1
            units += [Unit(conv, t, v) for t in range((turns or {}).get(d, 1)) for v in variants]
    return units


def test_size_run_follows_the_stated_rule():
    from experiments.bench.sizing import size_run

    variants = [Variant("ar"), Variant("dflash")] + [Variant("ddtree", b) for b in (4, 8, 16, 32, 64, 128)] + [
        Variant("ddtree", "auto")]
    datasets = ("gsm8k", "math500", "aime24", "aime25", "humaneval", "mt-bench")
    units = _units(datasets, 2, variants, {"mt-bench": 2})
    per_token = {v: 0.01 for v in variants}  # 1.28 s per 128-token generation, 126 generations: 161 s
    kept, report = size_run(units, per_token, 128, 1000.0)
    assert kept == units and report["left_out"] == [] and report["projected_full_s"] == pytest.approx(161.28, abs=0.1)
    # an AVX2-like machine: 0.3 s per token, a 12-minute budget
    per_token = {v: 0.3 for v in variants}
    kept, report = size_run(units, per_token, 128, 720.0)
    out = report["left_out"]
    # 1. one sample per dataset first (the second of each), 2. later turns, 3. budgets from the outside in,
    # 4. trailing datasets
    assert out[:6] == [f"{d} sample {d}1" for d in sorted(datasets, reverse=True)]
    assert out[6] == "mt-bench sample mt-bench0 later turns"
    assert out[7:12] == [f"DDTree budget {b}" for b in (128, 4, 64, 8, 32)]
    assert all(x.startswith("dataset ") for x in out[12:]) and out[12:][0] == "dataset mt-bench"
    assert report["projected_s"] <= 720.0 < report["projected_full_s"]
    left = {(u.variant.method, u.variant.budget) for u in kept}
    assert left == {("ar", None), ("dflash", None), ("ddtree", 16), ("ddtree", "auto")}
    assert sum(0.3 * 128 for _ in kept) == pytest.approx(report["projected_s"])


def test_sized_run_records_what_it_left_out(tmp_path, capsys):
    out = tmp_path / "sized"
    # a budget no run can meet: everything that the rule may leave out is left out, and the run still completes
    assert benchmark.main(["--preset", "tiny", "--out", str(out), "--time-budget", "0.0001"]) == 0
    records = read_records(out / "records.jsonl")
    sizing = Manifest.read(out / "manifest.json").extra["sessions"][-1]["sizing"]
    assert sizing["left_out"] and sizing["projected_s"] < sizing["projected_full_s"]
    assert {r.dataset for r in records} == {"gsm8k"} and {r.budget for r in records if r.method == "ddtree"} == {4}
    assert {r.method for r in records} == {"ar", "dflash", "ddtree"}
    assert "left out by the stated rule" in capsys.readouterr().err


def test_top2_margin_is_the_gap_between_the_two_best_logits():
    from conftest import make_target
    from experiments.bench.session import top2_margin

    target = make_target("llama", vocab=32, layers=2, hidden=16)
    prompt_ids, continuation = torch.tensor([[3, 5, 7]]), [9, 11, 13]
    logits = target(input_ids=torch.tensor([[3, 5, 7, 9, 11]])).logits[0, -1]
    top = logits.topk(2).values
    assert top2_margin(target, prompt_ids, continuation, 2) == pytest.approx(float(top[0] - top[1]))


def test_exact_match_column_separates_near_ties_from_real_differences():
    """Two records equal to plain decoding, one leaving it at a near-tie (margin 0.1), one at a clear choice
    (margin 3.0): 50% equal, 75% up to near-ties."""
    from experiments.bench.schema import EXTRA_AR_MARGIN, SampleRecord
    from plots.metrics import compute_stats
    from plots.tables import markdown_table

    def rec(method, match, margin=None):
        extra = {} if margin is None else {EXTRA_AR_MARGIN: margin}
        return SampleRecord(dataset="gsm8k", sample_id=str(len(extra)) + str(match) + str(margin), turn=0,
                            method=method, budget=8 if method == "ddtree" else None, policy="fixed", temperature=0.0,
                            num_input_tokens=5, num_new_tokens=10, prefill_s=0.01, decode_s=0.1,
                            acceptance_lengths=[2] * 5, stage_times={}, matches_ar=match, extra=extra)

    records = [rec("ddtree", True), rec("ddtree", True), rec("ddtree", False, 0.1), rec("ddtree", False, 3.0)]
    (stats,) = [s for s in compute_stats(records) if s.method == "ddtree"]
    assert stats.exact_match == 0.5 and stats.near_tie_match == 0.75
    assert "50% / 75% (4)" in markdown_table([stats])


# ---------------------------------------------------------------------------------------------------- datasets
def test_unavailable_dataset_is_left_out_unless_named(tmp_path, monkeypatch, capsys):
    from dflash_core.training.pools.items import DatasetUnavailableError
    from experiments.bench import conversation

    real = conversation.select_items

    def offline(name, n, seed=0):
        if name == "mt-bench":
            raise DatasetUnavailableError("mt-bench needs the hub here")
        return real(name, n, seed)

    monkeypatch.setattr(conversation, "select_items", offline)
    out = tmp_path / "offline"
    args = ["--preset", "tiny", "--out", str(out), "--max-samples", "1", "--methods", "ar,dflash"]
    assert benchmark.main(args) == 0  # the tiny preset's datasets: gsm8k and mt-bench
    assert {r.dataset for r in read_records(out / "records.jsonl")} == {"gsm8k"}
    assert "mt-bench" in capsys.readouterr().err
    unavailable = Manifest.read(out / "manifest.json").extra["sessions"][-1]["datasets_unavailable"]
    assert "needs the hub" in unavailable["mt-bench"]
    named = ["--preset", "tiny", "--out", str(tmp_path / "named"), "--datasets", "gsm8k,mt-bench", "--max-samples",
             "1", "--methods", "ar,dflash"]
    assert benchmark.main(named) == 1
    err = capsys.readouterr().err
    assert "DatasetUnavailableError" in err and "'mt-bench' (asked for with --datasets)" in err


# ---------------------------------------------------------------------------------------------------- run folder
def test_manifest_is_read_once_and_written_once_per_event(tmp_path, monkeypatch):
    reads, writes = [], []
    real_read, real_write = Manifest.read.__func__, Manifest.write

    monkeypatch.setattr(Manifest, "read", classmethod(lambda cls, path: reads.append(path) or real_read(cls, path)))
    monkeypatch.setattr(Manifest, "write", lambda self, path: writes.append(path) or real_write(self, path))
    out = tmp_path / "events"
    args = ["--preset", "tiny", "--out", str(out), "--datasets", "gsm8k", "--max-samples", "1",
            "--methods", "ar,dflash"]
    assert benchmark.main(args) == 0
    # a new folder: session start, the cost curves the replay prices with, sizing, session end
    assert reads == [] and len(writes) == 4
    reads.clear(), writes.clear()
    assert benchmark.main(args) == 0  # resumed with nothing to do: one read, start and end
    assert len(reads) == 1 and len(writes) == 2
    monkeypatch.undo()
    sessions = Manifest.read(out / "manifest.json").extra["sessions"]
    assert len(sessions) == 2 and all(s["complete"] for s in sessions) and "sizing" in sessions[0]
