"""experiments.studies.pld_compare on a tiny random Llama in fp64: the rows' fields, the rotation, and every method's
output (transformers' greedy and prompt lookup, our lookup and plain decoding) equal to plain greedy, stop or not."""

from __future__ import annotations

import json

import pytest

from conftest import make_target, prompt
from experiments.studies import pld_compare
from experiments.studies.pld_compare import METHODS, compare_prompts, format_table, summarize

VOCAB = 64


def _prompts() -> list[list[int]]:
    repetitive = [5, 6, 7, 8, 9, 10, 11] * 4  # a context that repeats: the lookups find matches
    return [repetitive, prompt(3, 20, VOCAB)[0].tolist() + repetitive[:10], prompt(4, 12, VOCAB)[0].tolist()]


@pytest.fixture(scope="module")
def target():
    return make_target("llama", vocab=VOCAB)


def _check_rows(rows, prompts, max_new_tokens):
    assert len(rows) == len(prompts)
    for i, row in enumerate(rows):
        assert row["index"] == i and row["prompt_tokens"] == len(prompts[i])
        assert row["order"] == list(METHODS[i % 4:] + METHODS[:i % 4])  # rotated by one per prompt
        assert set(row["methods"]) == set(METHODS) == set(row["outputs"])
        for m, stats in row["methods"].items():
            assert stats["tokens"] == len(row["outputs"][m]) <= max_new_tokens
            assert stats["seconds"] > 0 and stats["tok_s"] > 0
        assert {"rounds", "tau"} <= set(row["methods"]["pld"]) and {"rounds", "tau"} <= set(row["methods"]["ar"])
        reference = row["outputs"]["hf_greedy"]
        for m in METHODS:  # fp64: every method reproduces plain greedy exactly
            assert row["outputs"][m] == reference, (i, m)
        assert all(row["equal"].values()) and set(row["equal"]) == {"hf_pld~hf_greedy", "pld~ar", "pld~hf_greedy",
                                                                    "ar~hf_greedy"}
        assert all(v is None for v in row["first_difference"].values())


def test_rows_and_outputs_equal_plain_greedy(target):
    prompts = _prompts()
    labels = [{"dataset": "a", "sample_id": "0"}, {"dataset": "a", "sample_id": "1"},
              {"dataset": "b", "sample_id": "2"}]
    rows = compare_prompts(target, prompts, METHODS, max_new_tokens=24, stop_token_ids=(), pad_token_id=0,
                           warmup=[1, 2, 3], labels=labels)
    _check_rows(rows, prompts, 24)
    assert all(r["methods"][m]["tokens"] == 24 for r in rows for m in METHODS)  # no stop: full length
    assert rows[0]["dataset"] == "a" and rows[2]["sample_id"] == "2"
    assert rows[0]["methods"]["pld"]["rounds"] < 24  # the repetitive prompt: lookup committed several per round
    assert rows[0]["methods"]["ar"]["rounds"] == 23  # plain decoding: one per round after the prefill's token

    summary = summarize(rows)
    assert set(summary) == {"a", "b", "overall"} and summary["overall"]["prompts"] == 3
    ratio = summary["overall"]["ratios"]["pld/hf_pld"]
    assert {"median", "weighted", "min", "max"} <= set(ratio) and ratio["weighted"] > 0
    assert summary["overall"]["equal"]["pld~hf_greedy"] == 3
    table = format_table(summary)
    assert "overall" in table and "pld/hf_pld" in table
    json.dumps({"summary": summary, "rows": rows})  # the record is JSON as it stands


def test_a_stop_token_ends_every_method_at_the_same_place(target):
    prompts = _prompts()[:2]
    free = compare_prompts(target, prompts[:1], ("ar",), max_new_tokens=24)[0]["outputs"]["ar"]
    stop = free[6]  # a token greedy emits: every method must stop right after its first occurrence
    rows = compare_prompts(target, prompts, METHODS, max_new_tokens=24, stop_token_ids=[stop], pad_token_id=0)
    _check_rows(rows, prompts, 24)
    out = rows[0]["outputs"]["pld"]
    assert out[-1] == stop and stop not in out[:-1] and len(out) <= 7


def test_subset_of_methods_and_bad_method():
    rows = compare_prompts(make_target("llama", vocab=VOCAB, layers=2), [_prompts()[0]], ("pld", "ar"),
                           max_new_tokens=8)
    assert set(rows[0]["methods"]) == {"pld", "ar"} and set(rows[0]["equal"]) == {"pld~ar"}
    assert set(summarize(rows)["overall"]["ratios"]) == set()  # nothing against HF without HF
    with pytest.raises(ValueError, match="unknown method"):
        pld_compare.make_generator("hf_beam", None)
    with pytest.raises(SystemExit):
        pld_compare.parse_args(["--methods", "pld,nope"])
