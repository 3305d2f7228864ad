"""The benchmark's newer variants on the tiny preset: chain-auto filed under DFlash, prompt lookup and lookup
trees with their lookup share, and a user's policy class (valid ones run, bad ones are refused before any work).
Greedy fp32 records must equal plain decoding up to an fp32 tie of the target (``conftest.equal_or_fp32_tie``)."""

from __future__ import annotations

import pytest
import torch

from conftest import equal_or_fp32_tie
from experiments.bench import cli as benchmark
from experiments.bench.schema import Manifest, read_records, record_key
from experiments.bench.variants import Variant


pytestmark = pytest.mark.usefixtures("one_thread")  # conftest: tiny models run on one thread


def test_chain_auto_is_recorded_as_dflash(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("DDTREE_CACHE", str(tmp_path / "cache"))
    out = tmp_path / "chain-auto"
    args = ["--preset", "tiny", "--out", str(out), "--datasets", "gsm8k", "--max-samples", "1",
            "--methods", "ar,dflash,ddtree", "--budgets", "4,chain-auto"]
    assert benchmark.main(args) == 0
    records = read_records(out / "records.jsonl")
    auto = [r for r in records if r.budget == "chain-auto"]
    assert len(auto) == 1 and (auto[0].method, auto[0].policy, auto[0].tree) == ("dflash", "chain-auto", None)
    assert equal_or_fp32_tie(auto[0])
    assert {(r.method, r.budget) for r in records} == {("ar", None), ("dflash", None), ("dflash", "chain-auto"),
                                                       ("ddtree", 4)}
    assert "| DFlash (auto) |" in capsys.readouterr().out


def test_prompt_lookup_and_lookup_trees_record_their_lookup_share(tmp_path, capsys):
    out = tmp_path / "lookup"
    args = ["--preset", "tiny", "--out", str(out), "--datasets", "gsm8k", "--max-samples", "1",
            "--methods", "ar,pld", "--lookup-budgets", "4"]
    assert benchmark.main(args) == 0
    records = read_records(out / "records.jsonl")
    by_label = {r.spec.label: r for r in records}
    assert set(by_label) == {"AR", "PLD", "DDTree+lookup (B=4)"}
    pld, tree = by_label["PLD"], by_label["DDTree+lookup (B=4)"]
    assert (pld.method, pld.policy, pld.budget) == ("pld", "lookup", None)
    assert (tree.method, tree.policy, tree.budget, tree.tree) == ("ddtree", "lookup", 4, "topk")
    for r in (pld, tree):
        assert equal_or_fp32_tie(r)  # fp32, T = 0: lossless up to an fp32 tie
        assert 0 <= r.extra["lookup_tokens"] <= sum(r.acceptance_lengths)
    assert "lookup_tokens" not in by_label["AR"].extra
    assert tree.variant == "ddtree+lookup:B=4" and tree.spec == Variant("ddtree", 4, lookup=True)
    assert tree.record_key() == record_key("gsm8k", tree.sample_id, 0, tree.spec, 0.0)
    printed = capsys.readouterr().out
    assert "| PLD |" in printed and "| DDTree+lookup (B=4) |" in printed and "Lookup" in printed
    assert benchmark.main(args) == 0  # resuming finds both lookup variants
    assert len(read_records(out / "records.jsonl")) == 3
    assert Variant("ddtree", "auto", lookup=True).label == "DDTree+lookup (auto)"
    with pytest.raises(ValueError, match="lookup"):
        Variant("ddtree", "chain-auto", lookup=True)


POLICY_MODULE = '''
import torch

from ddtree import DraftTree
from dflash_core import BlockPolicy


class ShortChain(BlockPolicy):
    """The drafter's top-1 token at the first two depths: a chain of at most two nodes."""

    name, uses_draft = "short-chain", True

    def propose(self, block, history):
        logp = torch.log_softmax(block.full_logits()[:2].float(), dim=-1)  # [2, V]
        best, tokens = logp.max(dim=-1)
        n = len(tokens)
        return DraftTree(tokens.cpu(), torch.arange(-1, n - 1), torch.arange(1, n + 1), best.cumsum(0).cpu())


class NoPropose:
    name, uses_draft = "broken", True


class StringFlag(ShortChain):
    uses_draft = "yes"


class NeedsArguments(ShortChain):
    def __init__(self, depth):
        self.depth = depth


NOT_A_CLASS = 3
'''


@pytest.fixture
def policy_module(tmp_path, monkeypatch):
    """A user's policy file, importable as ``tiny_user_policy`` (as from the working directory)."""
    folder = tmp_path / "user"
    folder.mkdir()
    (folder / "tiny_user_policy.py").write_text(POLICY_MODULE)
    monkeypatch.syspath_prepend(str(folder))
    return "tiny_user_policy"


def test_user_policy_class_is_a_variant_named_by_its_name(tmp_path, policy_module, capsys):
    out = tmp_path / "custom"
    args = ["--preset", "tiny", "--out", str(out), "--datasets", "gsm8k", "--max-samples", "1", "--methods", "ar",
            "--policy", f"{policy_module}:ShortChain"]
    assert benchmark.main(args) == 0
    records = read_records(out / "records.jsonl")
    (mine,) = [r for r in records if r.method != "ar"]
    assert (mine.method, mine.budget, mine.policy) == ("ddtree", "short-chain", "custom")
    assert equal_or_fp32_tie(mine) and max(mine.extra["tree_sizes"]) <= 2
    assert mine.variant == f"policy:short-chain={policy_module}:ShortChain"  # the class, recorded in the spec
    assert "| short-chain |" in capsys.readouterr().out
    session = Manifest.read(out / "manifest.json").extra["sessions"][-1]
    assert session["extra_variants"][0]["variant"] == mine.variant


@pytest.mark.parametrize("spec, message", [
    ("no_such_module_xyz:Policy", "cannot import module"),
    ("{module}:Missing", "has no 'Missing'"),
    ("{module}:NoPropose", "needs to subclass dflash_core.BlockPolicy"),
    ("{module}:StringFlag", "a bool attribute uses_draft"),
    ("{module}:NeedsArguments", "no arguments"),
    ("{module}:NOT_A_CLASS", "not a class"),
    ("{module}", "expected module:Class"),
])
def test_bad_policy_classes_are_refused_clearly(tmp_path, policy_module, capsys, spec, message):
    args = ["--preset", "tiny", "--out", str(tmp_path / "bad"), "--policy", spec.format(module=policy_module)]
    assert benchmark.main(args) == 2
    assert message in capsys.readouterr().err
    assert not (tmp_path / "bad").exists()  # refused before any work


def test_fp32_ties_are_admitted_only_where_the_record_measured_one():
    """The rule every fp32 benchmark test applies: equal, or (greedy) first leaving plain decoding at a logit margin
    of at most FP32_TIE that the record measured; a clear margin, no margin, or a sampled record is a difference."""
    from conftest import FP32_TIE
    from experiments.bench.schema import EXTRA_AR_MARGIN
    from test_schema import make_record

    def rec(match, margin=None, temperature=0.0):
        return make_record(matches_ar=match, temperature=temperature,
                           extra={} if margin is None else {EXTRA_AR_MARGIN: margin})

    assert equal_or_fp32_tie(rec(True)) and equal_or_fp32_tie(rec(False, 0.0))
    assert equal_or_fp32_tie(rec(False, FP32_TIE)) and not equal_or_fp32_tie(rec(False, 10 * FP32_TIE))
    assert not equal_or_fp32_tie(rec(False, 3.0)) and not equal_or_fp32_tie(rec(False))
    assert not equal_or_fp32_tie(rec(False, 0.0, temperature=1.0)) and not equal_or_fp32_tie(rec(None))
