"""experiments.studies.auto_live: its runner on a tiny pair (fixed budget, auto without the clock, auto with a memory
carried from prompt to prompt: the same greedy text, the memory really carried) and its summary by hand."""

from __future__ import annotations

import math

import pytest

from conftest import make_draft, make_target, prompt
from experiments.studies.auto_live import STAGES, make_runner, summarize

pytestmark = pytest.mark.usefixtures("one_thread")


def test_runner_variants_decode_the_same_text_and_auto_mem_carries_its_memory(monkeypatch):
    import ddtree.budget

    monkeypatch.setattr(ddtree.budget, "SKIP_AFTER", 10**9)  # every round drafts and is remembered (the subject)
    target = make_target("llama", vocab=32, init=0.4)
    draft = make_draft(target, block_size=4)
    run = make_runner(target, draft, [])
    first = {v: run(v, prompt(1, 10, 32), 12) for v in ("B4", "auto_off", "auto_mem")}
    assert first["B4"]["ids"] == first["auto_off"]["ids"] == first["auto_mem"]["ids"]
    assert "chosen" in first["auto_mem"] and "chosen" not in first["B4"]
    assert set(first["B4"]["ms_per_round"]) == set(STAGES)
    again = run("auto_mem", prompt(2, 10, 32), 12)  # the second prompt's policy starts from the first's rounds
    fresh = run("auto_off", prompt(2, 10, 32), 12)
    assert again["ids"] == fresh["ids"]
    assert again["memory_rounds"] == first["auto_mem"]["rounds"] + again["rounds"]
    assert fresh["memory_rounds"] == fresh["rounds"]
    # a repeated pass starts from the memory before the prompt's first pass, and what it learns is not carried
    repeated = run("auto_mem", prompt(2, 10, 32), 12, again=True)
    assert repeated["memory_rounds"] == first["auto_mem"]["rounds"] + repeated["rounds"]
    third = run("auto_mem", prompt(3, 10, 32), 12)
    assert third["memory_rounds"] == first["auto_mem"]["rounds"] + again["rounds"] + third["rounds"]
    with pytest.raises(ValueError, match="unknown variant"):
        run("auto_sometimes", prompt(1, 10, 32), 4)


def test_lookup_and_pld_variants_decode_the_same_text_and_report_the_lookup_share(monkeypatch):
    from conftest import steady_clocks

    steady_clocks(monkeypatch)
    target = make_target("llama", vocab=8, init=0.3)  # a small vocabulary: the output repeats, lookups hit
    draft = make_draft(target, block_size=4)
    run = make_runner(target, draft, [])
    first = {v: run(v, prompt(3, 12, 8), 16) for v in ("B4", "pld", "lookup", "lookup_mem", "lookup_flat")}
    assert all(first[v]["ids"] == first["B4"]["ids"] for v in first)
    assert "lookup_share" in first["lookup_flat"]
    assert first["lookup_mem"]["lookup_share"] > 0 and "lookup_share" not in first["pld"]
    again = run("lookup_mem", prompt(4, 12, 8), 16)
    assert again["ids"] == run("lookup", prompt(4, 12, 8), 16)["ids"]


def test_summary_by_hand():
    def rec(tok_s, tau, **extra):
        return {"tok_s": tok_s, "tau": tau, "ms_per_round": {s: 1.0 for s in STAGES}, **extra}
    rows = [{"B8": rec(10.0, 2.0), "auto": rec(12.0, 2.5, chosen=8.0, built=12.0, modeled_over_real=1.0)},
            {"B8": rec(20.0, 3.0), "auto": rec(15.0, 2.5, chosen=6.0, built=10.0, modeled_over_real=0.9)}]
    s = summarize(rows, ["B8", "auto"])
    assert s["auto"]["over_first_geomean"] == pytest.approx(math.sqrt(1.2 * 0.75))
    assert s["auto"]["over_first"] == pytest.approx([1.2, 0.75])
    assert s["auto"]["chosen"] == 7.0 and s["auto"]["modeled_over_real"] == pytest.approx(0.95)
    assert s["B8"]["over_first_geomean"] == 1.0 and "chosen" not in s["B8"]


def test_merge_pools_decode_time_over_a_variants_calls():
    """Tokens/s over repeated calls is total tokens over total seconds (a slow pass weighs as long as it lasted),
    not the mean of the rates; the other numbers are means and the first call's ids are kept."""
    from experiments.studies.auto_live import merge

    def rec(tokens, seconds, tau, ids):
        return {"tok_s": tokens / seconds, "tau": tau, "rounds": 4, "tokens": tokens, "decode_s": seconds,
                "ms_per_round": {s: seconds for s in STAGES}, "ids": ids}
    merged = merge([rec(96, 2.0, 3.0, [1, 2]), rec(96, 6.0, 2.0, [1, 3])])
    assert merged["tok_s"] == pytest.approx(192 / 8.0)  # the mean of the rates would be 32
    assert merged["tau"] == 2.5 and merged["ids"] == [1, 2] and merged["calls"] == 2
    assert merged["ms_per_round"]["verify"] == 4.0
