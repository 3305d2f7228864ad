"""top_k / top_p / min_p: the filter against transformers' own warpers, the loop's samples against the exact joint
of plain sampling from the filtered target (plain decoding, chains, top-K trees, sampled trees; each with a control
that drops the filter and fails at the same N), and chains / top-K trees / prompt lookup reproducing plain sampling
token for token with the same seed."""

from __future__ import annotations

import pytest
import torch

import dflash_core.decoding as decoding
from conftest import answer_counts, make_draft, make_target, prompt, sampled_answers
from ddtree import ddtree_generate
from dflash_core import autoregressive_generate, dflash_generate, speculative_generate
from dflash_core.prompt_lookup import lookup_generate
from dflash_core.sampling import Sampling
from dflash_core.tree import Chain, NoDraft
from greedy_reference import exact_joint
from test_decoding import chi_square_p
from test_ddtree_generate import PeakedTree
from test_sampling_temperature import FixedSampled

pytestmark = pytest.mark.usefixtures("one_thread")
PASS, FAIL = 1e-3, 1e-6


def transformers_probs(logits: torch.Tensor, temperature: float, top_k=None, top_p=None, min_p=None) -> torch.Tensor:
    """The distribution transformers' generate() samples from: its own warpers, in its order."""
    from transformers.generation.logits_process import (
        LogitsProcessorList, MinPLogitsWarper, TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper,
    )

    warpers = LogitsProcessorList([TemperatureLogitsWarper(temperature)])
    if top_k:
        warpers.append(TopKLogitsWarper(top_k))
    if top_p is not None and top_p < 1:
        warpers.append(TopPLogitsWarper(top_p))
    if min_p:
        warpers.append(MinPLogitsWarper(min_p))
    rows = logits.reshape(-1, logits.shape[-1]).double()
    return torch.softmax(warpers(torch.zeros(rows.shape[0], 1, dtype=torch.long), rows), dim=-1).reshape(logits.shape)


SETTINGS = [dict(top_k=1), dict(top_k=5), dict(top_k=500), dict(top_p=0.3), dict(top_p=0.9), dict(min_p=0.2),
            dict(min_p=0.02), dict(top_k=8, top_p=0.7), dict(top_k=20, top_p=0.95, min_p=0.05), dict(top_p=1.0),
            dict(top_k=0, min_p=0.0)]


@pytest.mark.parametrize("temperature", [0.5, 1.0, 1.6])
@pytest.mark.parametrize("setting", SETTINGS, ids=lambda s: ",".join(f"{k}={v}" for k, v in s.items()))
def test_the_filter_is_transformers_warpers(setting, temperature):
    g = torch.Generator().manual_seed(3)
    logits = torch.randn(6, 64, generator=g) * 2
    logits[0, :4] = logits[0, 4]  # ties at the top
    logits[1, 10:20] = logits[1].max()
    ours = Sampling.check(temperature, **setting).probs(logits).double()
    assert torch.allclose(ours, transformers_probs(logits, temperature, **setting), atol=1e-6)
    assert torch.equal(ours > 0, transformers_probs(logits, temperature, **setting) > 0)  # the same support


def test_bad_settings_say_what_is_allowed():
    for kwargs, words in ((dict(top_k=-1), "top_k must be an int >= 0"), (dict(top_k=2.5), "top_k"),
                          (dict(top_p=0.0), r"top_p must be a number in \(0, 1\]"), (dict(top_p=1.5), "top_p"),
                          (dict(min_p=-0.1), r"min_p must be a number in \[0, 1\]"),
                          (dict(min_p=float("nan")), "min_p")):
        with pytest.raises(ValueError, match=words):
            Sampling.check(1.0, **kwargs)
    target = make_target("llama", vocab=16, layers=1, dtype=torch.float32)
    with pytest.raises(ValueError, match="top_p"):
        ddtree_generate(target, make_draft(target), prompt(0, 4, 16), budget=4, temperature=1.0, top_p=2.0)
    with pytest.raises(ValueError, match="min_p"):
        autoregressive_generate(target, prompt(0, 4, 16), 4, temperature=1.0, min_p=3)
    assert not Sampling.check(0.0, top_k=3).filters  # greedy: nothing to filter (the argmax survives every filter)
    assert Sampling.check(1.0, top_k=0, top_p=1.0, min_p=0.0) == Sampling(1.0)  # transformers' "off" values


@pytest.fixture(scope="module")
def pair():
    target = make_target("llama", vocab=6, layers=2, init=0.3, dtype=torch.float32, seed=5)
    return target, make_draft(target, block_size=4, dtype=torch.float32), prompt(1, 4, 6)


N = 300
FILTERS = {"top_k=3,top_p=0.8": dict(top_k=3, top_p=0.8), "min_p=0.25": dict(min_p=0.25)}
POLICIES = {"plain": lambda seed: NoDraft(), "chain": lambda seed: Chain(), "topk-tree": lambda seed: PeakedTree(),
            "sampled-tree": lambda seed: FixedSampled(6, 1.0, seed=seed)}


def loop_p_value(pair, make_policy, setting: dict) -> float:
    target, draft, p = pair
    counts = answer_counts(sampled_answers(lambda seeds: speculative_generate(
        target, draft, [p] * len(seeds), [make_policy(seed) for seed in seeds], max_new_tokens=3, temperature=1.0,
        seed=seeds[0], **setting), N))
    joint = exact_joint(target, p, 3, distribution=lambda logits: transformers_probs(logits, 1.0, **setting))
    return chi_square_p(counts, joint, N)


@pytest.mark.parametrize("setting", list(FILTERS), ids=list(FILTERS))
@pytest.mark.parametrize("kind", list(POLICIES))
def test_the_loop_samples_the_filtered_target(pair, kind, setting, monkeypatch):
    assert loop_p_value(pair, POLICIES[kind], FILTERS[setting]) > PASS
    monkeypatch.setattr(decoding.Sampling, "filter", lambda self, logits: logits)  # control: the filter dropped
    assert loop_p_value(pair, POLICIES[kind], FILTERS[setting]) < FAIL


@pytest.mark.parametrize("setting", [dict(top_k=8, top_p=0.9), dict(min_p=0.05), dict(top_k=4, min_p=0.1)],
                         ids=["top_k+top_p", "min_p", "top_k+min_p"])
def test_chains_trees_and_lookup_reproduce_plain_sampling_token_for_token(setting):
    target = make_target("llama", vocab=48, layers=2, init=0.25, dtype=torch.float32, seed=2)
    draft = make_draft(target, block_size=6, dtype=torch.float32)
    ids = torch.cat([prompt(4, 10, 48)] * 2, dim=1)  # a repeated prompt: lookup finds continuations
    changed = 0
    for seed in range(4):
        plain = autoregressive_generate(target, ids, 16, temperature=0.8, seed=seed, **setting).new_token_ids
        assert dflash_generate(target, draft, ids, 16, temperature=0.8, seed=seed, **setting).new_token_ids == plain
        assert ddtree_generate(target, draft, ids, budget=8, max_new_tokens=16, temperature=0.8, seed=seed,
                               **setting).new_token_ids == plain
        assert lookup_generate(target, ids, 16, temperature=0.8, seed=seed, **setting).new_token_ids == plain
        unfiltered = autoregressive_generate(target, ids, 16, temperature=0.8, seed=seed).new_token_ids
        assert ddtree_generate(target, draft, ids, budget=8, max_new_tokens=16, temperature=0.8,
                               seed=seed).new_token_ids == unfiltered
        changed += unfiltered != plain
    assert changed  # the filters changed what was sampled: the equalities above compare filtered runs


def test_the_benchmark_takes_the_filters_and_the_thinking_switch_and_records_them(capsys):
    from experiments.bench.cli import main, parse_args, preset_from_args

    preset = preset_from_args(parse_args(["--preset", "tiny", "--temperatures", "1", "--top-k", "20", "--top-p",
                                          "0.95", "--min-p", "0.05", "--enable-thinking"]))
    assert (preset.top_k, preset.top_p, preset.min_p) == (20, 0.95, 0.05)
    assert all(dict(pair.chat_template_kwargs)["enable_thinking"] is True for pair in preset.models)
    assert preset.to_dict()["top_p"] == 0.95  # the manifest stores the resolved preset
    default = preset_from_args(parse_args(["--preset", "tiny"]))
    assert (default.top_k, default.top_p, default.min_p, default.enable_thinking) == (None, None, None, None)
    assert main(["--preset", "tiny", "--top-p", "1.5"]) == 2
    assert "top_p must be a number in (0, 1]" in capsys.readouterr().err


def test_a_benchmark_generation_samples_with_the_presets_filters():
    from experiments.bench.models import ByteTokenizer, Models, random_draft, tiny_target
    from experiments.bench.presets import TINY
    from experiments.bench.variants import Variant, generate

    target = tiny_target().float()
    models = Models(target, random_draft(target), ByteTokenizer(), [ByteTokenizer.eos_token_id], TINY.models[0],
                    torch.float32, torch.device("cpu"))
    ids = prompt(3, 12, 200)
    filters = {"top_k": 3, "top_p": 0.9, "min_p": None}
    for name in ("ar", "dflash", "ddtree:B=4", "pld"):
        got = generate(Variant.parse(name), models, ids, 10, 1.0, 7, filters=filters).new_token_ids
        assert got == autoregressive_generate(target, ids, 10, 1.0, stop_token_ids=models.stop_token_ids, seed=7,
                                              **filters).new_token_ids
