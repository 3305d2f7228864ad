"""The long-context study on a tiny random pair: one record per context, equal output to plain decoding, and a rerun
that measures only the contexts the file lacks."""

from __future__ import annotations

import json

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
