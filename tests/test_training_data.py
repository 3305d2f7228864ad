"""Training data v2: batched generation with kept features, shards, corpus, draft vocabulary, rotary precision."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from conftest import make_draft, make_target, prompt
from dflash_core import autoregressive_generate, dflash_generate, load_draft
from dflash_core.training.train_config import TrainConfig
from dflash_core.training.loss import sequence_loss, target_features
from dflash_core.training.corpus import build_draft_vocab, vocab_coverage
from dflash_core.training.responses import fast_decoding, generate_batch, sample_next
from dflash_core.training.shards import (
    ShardSample, done_prompt_keys, list_shards, read_shard_features, read_shard_tokens, write_shard,
)


# ---------------------------------------------------------------------------------------------------- generation
def _prompts(vocab: int) -> list[list[int]]:
    return [prompt(s, n, vocab)[0].tolist() for s, n in ((3, 5), (4, 9), (5, 2), (6, 7))]


@pytest.mark.parametrize("fast", [False, True])
def test_generate_batch_matches_sequential_decoding_and_teacher_forced_features(fast):
    """Left-padded batched generation == per-prompt greedy decoding; kept features == one teacher-forced pass."""
    target = make_target("llama", vocab=64, dtype=torch.float32)
    prompts = _prompts(64)
    layer_ids = [0, 2]
    # a stop token that row 0 emits early, so rows finish at different steps and the batch shrinks
    free = autoregressive_generate(target, torch.tensor([prompts[0]]), 12).new_token_ids
    stop = free[3]
    ctx = fast_decoding(target) if fast else torch.inference_mode()
    with ctx:
        out = generate_batch(target, prompts, layer_ids, 12, [stop], pad_id=0, topk=4, shrink_fraction=0.2)
    for p, res in zip(prompts, out):
        ref = autoregressive_generate(target, torch.tensor([p]), 12, stop_token_ids=[stop]).new_token_ids
        assert res.response_ids == ref
        ids = torch.tensor(p + res.response_ids)
        tf = target_features(target, ids, layer_ids, topk=4)
        t = len(ids)
        assert res.features.shape == (t, tf.features.shape[1])
        assert torch.allclose(res.features[: t - 1], tf.features[: t - 1], atol=1e-4)
        assert torch.all(res.features[t - 1] == 0)
        # top-k from position P-1 on (the rows training reads)
        P = len(p)
        assert torch.equal(res.top_ids[P - 1: t - 1], tf.top_ids[P - 1: t - 1])
        assert torch.allclose(res.top_logp[P - 1: t - 1], tf.top_logp[P - 1: t - 1], atol=1e-4)
    assert any(len(r.response_ids) < 12 for r in out) and any(len(r.response_ids) == 12 for r in out)


def test_fast_decoding_restores_the_attention_backend():
    target = make_target("llama", vocab=64, dtype=torch.float32)
    before = target.config._attn_implementation
    with fast_decoding(target):
        assert target.config._attn_implementation != before
    assert target.config._attn_implementation == before


def test_sample_next_top_p_is_exact_nucleus_sampling():
    """The shortcut (top-k first) draws from exactly the nucleus distribution, rows that need a full sort included."""
    # row 0: peaked, nucleus inside the top-k shortcut; row 1: flat over 1000 tokens, needs the full sort
    logits = torch.full((2, 1000), -30.0)
    logits[0, :5] = torch.tensor([3.0, 2.0, 1.0, 0.0, -1.0])
    logits[1] = 0.0
    g = torch.Generator().manual_seed(1)
    draws = torch.stack([sample_next(logits, 1.0, 0.8, g) for _ in range(4000)])  # [n, 2]
    p = torch.softmax(logits[0], -1)
    cut = (p.cumsum(0) - p) < 0.8  # nucleus of row 0
    expect = p * cut / (p * cut).sum()
    freq = torch.bincount(draws[:, 0], minlength=1000).float() / len(draws)
    assert torch.allclose(freq, expect, atol=0.03)
    # flat row: the nucleus holds 800 tokens (which ones is a tie-break), more than the shortcut's 256
    assert 256 < len(set(draws[:, 1].tolist())) <= 800
    assert torch.equal(sample_next(logits, 0.0, 0.8, g), torch.tensor([0, 0]))


# ---------------------------------------------------------------------------------------------------- shards
def test_shard_round_trip_and_resume_keys(tmp_path):
    samples = [ShardSample("gsm8k:7#p0", "gsm8k", "greedy", 5, [1, 2, 60000]),
               ShardSample("chat:1:2#p1", "chat", "sampled", 3, [9])]
    feats = [torch.randn(8, 6).to(torch.bfloat16), torch.randn(4, 6).to(torch.bfloat16)]
    top_ids = [torch.randint(0, 9, (8, 2)), torch.randint(0, 9, (4, 2))]
    top_logp = [-torch.rand(8, 2), -torch.rand(4, 2)]
    write_shard(tmp_path, "shard-a", samples, {"seed": 3}, feats, top_ids, top_logp)
    write_shard(tmp_path, "shard-b", samples[:1], {"seed": 4})  # tokens only
    assert list_shards(tmp_path) == ["shard-a", "shard-b"]
    assert read_shard_tokens(tmp_path, "shard-a") == samples
    with np.load(tmp_path / "shard-a.tokens.npz") as z:
        assert z["response"].dtype == np.uint16  # a 49K vocabulary packs into 16 bits
    got = read_shard_features(tmp_path, "shard-a")
    assert torch.equal(got[0], torch.cat(feats)) and got[3] == [8, 4]
    assert torch.equal(got[1], torch.cat(top_ids))
    assert read_shard_features(tmp_path, "shard-b") is None
    manifest = json.loads((tmp_path / "shard-a.json").read_text())
    assert manifest["seed"] == 3 and manifest["samples"] == 2 and manifest["response_tokens"] == 4
    assert done_prompt_keys(tmp_path) == {"gsm8k:7#p0", "chat:1:2#p1"}
    # a shard without its manifest (interrupted write) does not count
    (tmp_path / "shard-b.json").unlink()
    assert list_shards(tmp_path) == ["shard-a"]


def test_build_draft_vocab_ranks_by_frequency():
    vocab = build_draft_vocab([[5, 5, 5, 2, 2, 9], [2, 7, 5]], size=3, always=[1])
    assert vocab.tolist() == [1, 5, 2]
    assert vocab_coverage([[5, 2, 9, 1]], vocab) == 0.75


# ---------------------------------------------------------------------------------------------------- draft vocabulary
def _vocab_pair():
    target = make_target("llama", vocab=64, dtype=torch.float32)
    draft = make_draft(target, block_size=4, dtype=torch.float32)
    return target, draft


def test_draft_vocab_logits_are_the_full_logits_on_the_subset():
    target, draft = _vocab_pair()
    hidden = torch.randn(3, target.config.hidden_size)
    full = draft.vocab_logits(hidden, target.lm_head.weight)
    ids = torch.tensor([40, 3, 17, 5])
    draft.set_draft_vocab(ids)
    sub = draft.vocab_logits(hidden, target.lm_head.weight)
    inside = torch.zeros(64, dtype=torch.bool)
    inside[ids] = True
    assert torch.allclose(sub[:, inside], full[:, inside])
    assert torch.all(sub[:, ~inside] == float("-inf"))
    assert draft.draft_vocab.tolist() == [40, 3, 17, 5]  # the given (frequency) order is kept


def test_draft_vocab_round_trips_and_decoding_stays_lossless(tmp_path):
    target, draft = _vocab_pair()
    # a vocabulary that misses some of the target's own greedy tokens: the bonus token covers them
    x = prompt(11, 6, 64)
    ref = autoregressive_generate(target, x, 24).new_token_ids
    ids = list(dict.fromkeys(ref[:6] + list(range(0, 64, 2))))
    draft.set_draft_vocab(torch.tensor(ids))
    draft.save_pretrained(tmp_path / "d")
    loaded = load_draft(tmp_path / "d", dtype=torch.float32)
    assert loaded.config.draft_vocab_size == len(ids)
    assert loaded.draft_vocab.tolist() == ids
    from ddtree import ddtree_generate

    assert dflash_generate(target, loaded, x, 24).new_token_ids == ref
    res = ddtree_generate(target, loaded, x, budget=8, max_new_tokens=24, trace=True)
    assert res.new_token_ids == ref
    assert all(set(t.token_ids.tolist()) <= set(ids) for t in res.trees)  # trees only hold draft-vocabulary tokens


def test_draft_vocab_ids_survive_a_bf16_export(tmp_path):
    """The zoo ships bf16 weights; token ids above 256 are not representable in bf16 and must stay integers."""
    target = make_target("llama", vocab=600, dtype=torch.float32)
    draft = make_draft(target, block_size=4, dtype=torch.float32)
    ids = [599, 257, 301, 2, 513]
    draft.set_draft_vocab(torch.tensor(ids))
    draft.save_pretrained(tmp_path / "d", dtype=torch.bfloat16)
    loaded = load_draft(tmp_path / "d")
    assert loaded.draft_vocab.tolist() == ids and loaded.draft_vocab.dtype == torch.long
    assert next(loaded.parameters()).dtype == torch.bfloat16


def test_draft_vocab_loss_is_the_exact_softmax_over_the_subset():
    target, draft = _vocab_pair()
    ids = torch.arange(0, 64, 3)
    draft.set_draft_vocab(ids)
    seq = prompt(2, 20, 64)[0]
    feats = target_features(target, seq, draft.config.target_layer_ids, topk=0)
    anchors = torch.tensor([6, 11])
    cfg = TrainConfig(loss_vocab="draft", distill_weight=0.0, autocast=False)
    loss, stats = sequence_loss(draft, target.model.embed_tokens, target.lm_head.weight, seq, feats, anchors, cfg)
    # reference: full drafter forward, log-softmax over the subset's logits, labels outside the subset ignored
    from dflash_core.blocks import block_attention_mask, block_inputs
    from dflash_core.training.anchors import position_weights

    b = draft.block_size
    tokens, positions, labels = block_inputs(seq, anchors, b, draft.mask_token_id)
    mask = block_attention_mask(anchors, b, int(anchors.max()))[None, None]
    hidden = draft(target.model.embed_tokens(tokens)[None], feats.features[: int(anchors.max())][None], positions,
                   torch.arange(int(anchors.max())), attn_mask=mask)[0].view(2, b, -1)[:, 1:]
    logp = torch.log_softmax(hidden @ target.lm_head.weight[ids].t(), -1)
    w = position_weights(b, cfg.gamma).expand(2, -1)
    expect = 0.0
    for j in range(2):
        for k in range(b - 1):
            lab = int(labels[j, k])
            if lab >= 0 and lab in ids.tolist():
                expect += float(w[j, k]) * -float(logp[j, k, ids.tolist().index(lab)])
    assert float(loss) == pytest.approx(expect, rel=1e-5)


# ---------------------------------------------------------------------------------------------------- rotary
def test_rotary_frequencies_stay_float32_under_a_half_precision_cast():
    target, draft = _vocab_pair()
    ref = draft.rotary.inv_freq.clone()
    draft.to(torch.bfloat16)
    assert draft.rotary.inv_freq.dtype == torch.float32
    assert torch.equal(draft.rotary.inv_freq, ref)
    assert next(draft.parameters()).dtype == torch.bfloat16
    # and a drafter loaded straight into bf16 as well
    cos, _ = draft.rotary(torch.tensor([[2048]]), torch.float32)
    exact = torch.cos(2048 * ref.double())
    assert torch.allclose(cos[0, 0, 0, : len(ref)].double(), exact, atol=1e-3)


# ---------------------------------------------------------------------------------------------------- shipped data
def test_shipped_response_shards_reference_only_training_prompts():
    """The committed shards of the shipped drafter: token ids and prompt keys only, every key a training prompt that
    the benchmark can never select, and no feature cache."""
    from pathlib import Path

    from dflash_core.default import DEFAULT_DRAFT_DIR
    from dflash_core.training.prompts import build_prompts
    from dflash_core.training.pools.catalog import OFFLINE_DATASETS, benchmark_pool_ids
    from dflash_core.training.pools.items import DatasetUnavailableError

    folder = Path(DEFAULT_DRAFT_DIR) / "data"
    names = list_shards(folder)
    if not names:
        pytest.skip("no committed shards")
    assert not list(folder.glob("*.feat.npy")) and not list(folder.glob("*.top.npz"))
    known = {p.prompt_id: p.source for p in build_prompts()}
    eligible = {}
    for name in OFFLINE_DATASETS:
        try:
            eligible[name] = benchmark_pool_ids(name)
        except DatasetUnavailableError:
            pass
    total = rebuilt = 0
    for name in names:
        for s in read_shard_tokens(folder, name):
            prompt_id = s.prompt_key.split("#")[0]
            assert prompt_id.startswith(f"{s.source}:"), s.prompt_key  # the key names its source
            if s.source == "package-docs":  # follows the installed package versions: rebuilt where they match
                continue
            total += 1
            rebuilt += known.get(prompt_id) == s.source
            if s.source in eligible:  # benchmark pools: rebuilt exactly, and never an eligible item
                assert known.get(prompt_id) == s.source, s.prompt_key
                assert prompt_id.split(":", 1)[1] not in eligible[s.source], s.prompt_key
    # stdlib prompts follow the running interpreter (pytest swaps a few hooks such as sys.unraisablehook), so a
    # handful may not rebuild here; the loader skips and counts those
    assert rebuilt >= 0.99 * total, (rebuilt, total)


def test_corpus_selects_the_drafters_taps_from_the_kept_features():
    from dflash_core.training.corpus import Corpus

    t, hidden, kept = 5, 3, [1, 8, 14, 20, 27]
    # tap j's block of columns holds the value 10 * j + column, so every selected column is identifiable
    feats = torch.tensor([[10.0 * j + c for j in range(len(kept)) for c in range(hidden)]] * (t + 2))
    corpus = Corpus([(torch.zeros(t, dtype=torch.long), 2)], ["k"], ["s"], [[0, 0, 0]],
                    [((feats, None, None), 1, kept)])
    full = corpus.feature_source(0)
    assert torch.equal(full.features, feats[1:1 + t]) and full.top_ids is None
    assert torch.equal(corpus.feature_source(0, kept).features, feats[1:1 + t])
    sub = corpus.feature_source(0, [1, 14, 27]).features
    assert sub.shape == (t, 3 * hidden)
    assert sub[0].tolist() == [0.0, 1.0, 2.0, 20.0, 21.0, 22.0, 40.0, 41.0, 42.0]
    with pytest.raises(ValueError, match="kept only"):
        corpus.feature_source(0, [1, 2])


def test_recipe_command_generates_then_trains_and_resumes(tmp_path):
    """The one-command recipe at toy size on the embedded target (CPU): shards, a drafter, and a rerun that adds data."""
    from dflash_core.training import recipe
    from dflash_core.training.shards import list_shards

    args = ["--out", str(tmp_path), "--device", "cpu", "--gen-batches", "1", "--gen-batch", "3", "--gen-workers", "1",
            "--max-new-tokens", "8", "--draft-vocab", "64", "--", "--steps", "2", "--eval-prompts", "0", "--threads", "1"]
    recipe.main(args)
    assert len(list_shards(tmp_path / "data")) == 1
    summary = json.loads((tmp_path / "fit" / "summary.json").read_text())
    assert summary["steps"] == 2 and summary["response_tokens"] > 0
    draft = load_draft(tmp_path / "fit" / "drafter")
    assert draft.draft_vocab is not None and len(draft.draft_vocab) <= 64 + 4
    recipe.main(args)  # a rerun answers new prompts and resumes training from the checkpoint (already done)
    assert len(list_shards(tmp_path / "data")) == 2
    assert json.loads((tmp_path / "fit" / "summary.json").read_text())["steps"] == 2
    # a fit from --init keeps the drafter's own vocabulary (its rows of the head), even on other data
    from dflash_core.training import fit

    fit.main(["--data", str(tmp_path / "data"), "--out", str(tmp_path / "fit2"), "--init", str(tmp_path / "fit" / "drafter"),
              "--steps", "1", "--eval-prompts", "0", "--threads", "1", "--device", "cpu"])
    again = load_draft(tmp_path / "fit2" / "drafter")
    assert torch.equal(again.draft_vocab, draft.draft_vocab)


def test_corpus_rebuilds_prompts_with_each_shards_generation_seed(tmp_path):
    """A training run's own --seed must not change which samples load: prompts are rebuilt with the seed the
    shard's manifest records (a seed-1 fit once dropped 43% of a seed-0 corpus this way)."""
    from dflash_core.training.corpus import load_corpus
    from dflash_core.training.prompts import build_prompts
    from experiments.bench.models import ByteTokenizer

    tok = ByteTokenizer()
    pool0 = {p.prompt_id: p for p in build_prompts(0)}
    pool1 = {p.prompt_id for p in build_prompts(1)}
    only0 = sorted(set(pool0) - pool1)[:3]  # prompts that exist only in the seed-0 pools
    assert only0
    samples = []
    for pid in only0:
        n = len(tok.encode(pool0[pid].text + "\n\n"))
        samples.append(ShardSample(f"{pid}#p0", pool0[pid].source, "greedy", n, [5, 6, 7]))
    write_shard(tmp_path, "shard-a", samples, {"seed": 0})
    for fit_seed in (0, 1):
        corpus = load_corpus(tmp_path, tok, seed=fit_seed)
        assert len(corpus.sequences) == 3 and corpus.skipped == 0, fit_seed


def test_load_training_data_holds_out_prompts_spread_over_sources(tmp_path):
    """Every sequence of every folder is either trained on or held out, never both; the held-out samples come from
    distinct sources while there are sources left; their prompt and response are the shards' own."""
    from dflash_core.training.fit import load_training_data
    from dflash_core.training.prompts import build_prompts
    from experiments.bench.models import ByteTokenizer

    tok = ByteTokenizer()
    by_source: dict[str, list] = {}
    for p in build_prompts(0):
        by_source.setdefault(p.source, []).append(p)
    sources = sorted(by_source)[:3]
    for k, folder in enumerate(("a", "b")):
        samples = []
        for j, src in enumerate(sources):
            for p in by_source[src][4 * k: 4 * k + 2]:
                n = len(tok.encode(p.text + "\n\n"))
                samples.append(ShardSample(f"{p.prompt_id}#p0", src, "greedy", n, [10 + j, 20, 30 + k]))
        write_shard(tmp_path / folder, "shard-x", samples, {"seed": 0})
    data = load_training_data([tmp_path / "a", tmp_path / "b"], tok, seed=0, eval_prompts=3, log=lambda *_: None)
    assert len(data.sequences) == 12 - 3 and len(data.eval_prompts) == 3 and not data.has_features
    assert sorted(r[0] for r in data.held_responses) == [10, 11, 12]  # one per source (first token = source)
    trained = {(tuple(ids.tolist()), p) for ids, p in data.sequences}
    for prompt, response in zip(data.eval_prompts, data.held_responses):
        assert (tuple(prompt + response), len(prompt)) not in trained
    assert data.response_tokens == 3 * len(data.sequences)
    again = load_training_data([tmp_path / "a", tmp_path / "b"], tok, seed=0, eval_prompts=3, log=lambda *_: None)
    assert again.eval_prompts == data.eval_prompts  # the hold-out is seeded
