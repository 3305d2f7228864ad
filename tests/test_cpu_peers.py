"""The CPU peers study: its summary by hand, the bytes a step reads, the floor part on a tiny pair, the llama.cpp
probe's refusal without the package, our methods through the shared runner (lossless in fp32), and on a tiny random
Llama in fp64 the rows' fields, the rotation, and every generator's output (transformers' greedy and prompt lookup,
our lookup and plain decoding) equal to plain greedy, stop or not."""

from __future__ import annotations

import json

import pytest
import torch

from conftest import make_target, prompt
from experiments.studies import cpu_peers

VOCAB = 64
GENERATORS = ("hf_greedy", "hf_pld", "pld", "ar")
PAIRS = (("hf_pld", "hf_greedy"), ("pld", "ar"), ("pld", "hf_greedy"), ("ar", "hf_greedy"))


def _row(tok_s: dict[str, float], equal: dict[str, bool], tau: dict[str, float] | None = None) -> dict:
    methods = {m: {"tokens": 10, "seconds": 10 / v, "tok_s": v, **({"tau": tau[m]} if tau and m in tau else {}),
                   **({"prefill_s": 0.05} if m != "llama_cpp" else {})}
               for m, v in tok_s.items()}
    return {"methods": methods, "equal": {f"{m}~ar": e for m, e in equal.items()}}


def test_summary_by_hand():
    rows = [_row({"ar": 20.0, "llama_cpp": 100.0, "ddtree_auto": 40.0}, {"llama_cpp": False, "ddtree_auto": True},
                 {"ddtree_auto": 2.0}),
            _row({"ar": 25.0, "llama_cpp": 125.0, "ddtree_auto": 25.0}, {"llama_cpp": True, "ddtree_auto": True},
                 {"ddtree_auto": 3.0})]
    s = cpu_peers.summarize(rows)
    assert s["ar"]["tok_s"] == pytest.approx(20 / (0.5 + 0.4))  # token-weighted: total tokens over total seconds
    assert s["ar"]["ms_per_token"] == pytest.approx(0.9 / 20 * 1e3)
    assert s["ddtree_auto"]["over_ar"] == pytest.approx(1.5)  # median of 2.0 and 1.0
    assert s["ddtree_auto"]["over_llama_cpp"] == pytest.approx((0.4 + 0.2) / 2)
    assert s["llama_cpp"]["over_ar"] == pytest.approx(5.0)
    assert s["ddtree_auto"]["tau"] == pytest.approx(2.5) and "tau" not in s["ar"]
    assert s["ar"]["decode_ms_per_token"] == pytest.approx((0.9 - 0.1) / 18 * 1e3)  # 2 x 9 tokens after the first
    assert s["ar"]["prefill_s"] == pytest.approx(0.1) and "decode_ms_per_token" not in s["llama_cpp"]
    assert s["llama_cpp"]["equal_to_ar"] == 1 and s["ddtree_auto"]["equal_to_ar"] == 2 and "equal_to_ar" not in s["ar"]
    table = cpu_peers.format_tables(s, None, 2)
    assert "1/2" in table and "2/2" in table


def test_weight_bytes_count_a_shared_storage_once():
    from torch import nn

    emb = nn.Embedding(100, 8)
    head = nn.Linear(8, 100, bias=False)
    head.weight = emb.weight  # tied, as SmolLM2's embeddings and LM head
    model = nn.ModuleDict({"emb": emb, "head": head, "proj": nn.Linear(8, 8)})
    assert cpu_peers._weight_bytes(model) == (100 * 8 + 8 * 8 + 8) * 4


def test_memory_floor_on_a_tiny_pair():
    from experiments.bench.models import random_draft, tiny_target

    target = tiny_target()
    draft = random_draft(target, layers=1, taps=2, block_size=8)
    got = cpu_peers.memory_floor(target, draft, repeats=2, context=16)
    params = sum(p.numel() * p.element_size() for p in target.parameters())  # the tiny target ties nothing
    assert got["weight_bytes"] == params
    assert got["bandwidth_gb_s"] > 0.1 and got["floor_ms"] == pytest.approx(params / got["bandwidth_gb_s"] / 1e6)
    assert list(got["verify_ms"]) == [str(n) for n in cpu_peers.VERIFY_NODES]
    assert got["verify_over_step"]["1"] == pytest.approx(1.0) and got["step_ms"] == got["verify_ms"]["1"]
    assert all(v > 0 for v in got["verify_ms"].values())


def test_llama_cpp_probe_says_why_without_the_package(monkeypatch):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "llama_cpp" else real(name, *a))
    got = cpu_peers.probe_llama_cpp("/nowhere.gguf", 1)
    assert got["usable"] is False and "llama-cpp-python" in got["why"] and got["tries"] == []


def test_our_methods_run_through_the_study_runner():
    from experiments.bench.models import random_draft, tiny_target

    target = tiny_target()
    draft = random_draft(target, layers=1, taps=2, block_size=8)
    runners = {"ar": cpu_peers.make_generator("ar", target, [], 0),
               "dflash": cpu_peers.make_ours("dflash", target, draft, []),
               "ddtree_auto": cpu_peers.make_ours("ddtree_auto", target, draft, [])}
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, target.config.vocab_size, (12,), generator=g).tolist() for _ in range(2)]
    rows = cpu_peers.compare_prompts(target, prompts, runners, max_new_tokens=8,
                                     pairs=[("dflash", "ar"), ("ddtree_auto", "ar")])
    s = cpu_peers.summarize(rows)
    assert s["dflash"]["equal_to_ar"] == 2 and s["ddtree_auto"]["equal_to_ar"] == 2  # fp32: lossless
    assert [r["order"] for r in rows] == [["ar", "dflash", "ddtree_auto"], ["dflash", "ddtree_auto", "ar"]]
    assert all(r["methods"]["ar"]["tokens"] == 8 for r in rows)
    assert all(0 < r["methods"][m]["prefill_s"] < r["methods"][m]["seconds"] for r in rows for m in runners)


def test_llama_cpp_runner_greedy_on_the_shipped_gguf():
    pytest.importorskip("llama_cpp", reason="llama-cpp-python is not installed (the study then skips llama.cpp)")
    from dflash_core.default import gguf_path

    run = cpu_peers.make_llama_cpp(str(gguf_path()), threads=1, extra_bufts=False, stop_token_ids=[2], n_ctx=256)
    ids = torch.tensor([[1, 4093, 198, 1780, 359, 1296, 5608, 327, 9286, 2458, 47, 2, 198, 1, 520, 9531, 198]])
    first, extra = run(ids, 12)
    again, _ = run(ids, 12)
    assert len(first) == 12 and first == again  # greedy: the same text twice, no state left from the first call
    assert 0 < extra["prefill_s"]
    short, _ = run(ids, 3)
    assert short == first[:3]


def test_command_line_lists_and_a_bad_method():
    args = cpu_peers.parse_args(["--methods", "ar, llama_cpp", "--datasets", "gsm8k,grounded"])
    assert args.methods == ["ar", "llama_cpp"] and args.datasets == ["gsm8k", "grounded"] and args.floor
    assert cpu_peers.parse_args([]).methods == list(cpu_peers.DEFAULT_METHODS)
    assert cpu_peers.parse_args(["--methods", "pld,hf_pld"]).methods == ["pld", "hf_pld"]
    with pytest.raises(SystemExit):
        cpu_peers.parse_args(["--methods", "ar,vllm"])
    with pytest.raises(SystemExit):
        cpu_peers.parse_args(["--methods", "pld,nope"])
    with pytest.raises(ValueError, match="unknown method"):
        cpu_peers.make_generator("hf_beam", None)


def _prompts() -> list[list[int]]:
    repetitive = [5, 6, 7, 8, 9, 10, 11] * 4  # a context that repeats: the lookups find matches
    return [repetitive, prompt(3, 20, VOCAB)[0].tolist() + repetitive[:10], prompt(4, 12, VOCAB)[0].tolist()]


@pytest.fixture(scope="module")
def llama():
    return make_target("llama", vocab=VOCAB)


def _generators(target, methods=GENERATORS, stops=()):
    return {m: cpu_peers.make_generator(m, target, stops, 0) for m in methods}


def _check_rows(rows, prompts, max_new_tokens):
    assert len(rows) == len(prompts)
    for i, row in enumerate(rows):
        assert row["index"] == i and row["prompt_tokens"] == len(prompts[i])
        assert row["order"] == list(GENERATORS[i % 4:] + GENERATORS[:i % 4])  # rotated by one per prompt
        assert set(row["methods"]) == set(GENERATORS) == set(row["outputs"])
        for m, stats in row["methods"].items():
            assert stats["tokens"] == len(row["outputs"][m]) <= max_new_tokens
            assert stats["seconds"] > 0 and stats["tok_s"] > 0
        assert {"rounds", "tau"} <= set(row["methods"]["pld"]) and {"rounds", "tau"} <= set(row["methods"]["ar"])
        reference = row["outputs"]["hf_greedy"]
        for m in GENERATORS:  # fp64: every generator reproduces plain greedy exactly
            assert row["outputs"][m] == reference, (i, m)
        assert all(row["equal"].values()) and set(row["equal"]) == {"hf_pld~hf_greedy", "pld~ar", "pld~hf_greedy",
                                                                    "ar~hf_greedy"}
        assert all(v is None for v in row["first_difference"].values())


def test_lookup_and_greedy_generators_equal_plain_greedy(llama):
    prompts = _prompts()
    labels = [{"dataset": "a", "sample_id": "0"}, {"dataset": "a", "sample_id": "1"},
              {"dataset": "b", "sample_id": "2"}]
    rows = cpu_peers.compare_prompts(llama, prompts, _generators(llama), max_new_tokens=24, pairs=PAIRS,
                                     warmup=[1, 2, 3], labels=labels)
    _check_rows(rows, prompts, 24)
    assert all(r["methods"][m]["tokens"] == 24 for r in rows for m in GENERATORS)  # no stop: full length
    assert rows[0]["dataset"] == "a" and rows[2]["sample_id"] == "2"
    assert rows[0]["methods"]["pld"]["rounds"] < 24  # the repetitive prompt: lookup committed several per round
    assert rows[0]["methods"]["ar"]["rounds"] == 23  # plain decoding: one per round after the prefill's token
    summary = cpu_peers.summarize(rows)
    assert summary["pld"]["equal_to_ar"] == 3 and summary["pld"]["over_ar"] > 0
    json.dumps({"summary": summary, "rows": rows})  # the record is JSON as it stands


def test_a_stop_token_ends_every_generator_at_the_same_place(llama):
    prompts = _prompts()[:2]
    free = cpu_peers.compare_prompts(llama, prompts[:1], _generators(llama, ("ar",)), max_new_tokens=24)
    stop = free[0]["outputs"]["ar"][6]  # a token greedy emits: every generator must stop right after its first one
    rows = cpu_peers.compare_prompts(llama, prompts, _generators(llama, stops=[stop]), max_new_tokens=24, pairs=PAIRS)
    _check_rows(rows, prompts, 24)
    out = rows[0]["outputs"]["pld"]
    assert out[-1] == stop and stop not in out[:-1] and len(out) <= 7


def test_a_subset_of_generators():
    target = make_target("llama", vocab=VOCAB, layers=2)
    rows = cpu_peers.compare_prompts(target, [_prompts()[0]], _generators(target, ("pld", "ar")), max_new_tokens=8,
                                     pairs=PAIRS)
    assert set(rows[0]["methods"]) == {"pld", "ar"} and set(rows[0]["equal"]) == {"pld~ar"}
