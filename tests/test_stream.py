"""The teacher-forced training stream and its offline text corpus: soft labels, the dense loss, mixing, the cursor,
contamination filtering and resumption."""

from __future__ import annotations

import math
from collections import Counter
from pathlib import Path

import pytest
import torch

from conftest import make_draft, make_target
from dflash_core.training.train_config import TrainConfig
from dflash_core.training.loss import SequenceFeatures, sequence_loss, target_features
from dflash_core.training.stream import Cursor, SequenceStream, stream_train, teacher_forced_batch
from dflash_core.training.textcorpus import (
    TextSource, _chunks, benchmark_shingles, corpus_manifest, iter_items, shingles,
)

VOCAB = 64


class ByteTokenizer:
    """A tokenizer without a chat template: one id per character (ids 3..62), so build_chat joins the turns."""

    chat_template = None
    eos_token_id = 2

    def encode(self, text, add_special_tokens=False):
        return [3 + ord(c) % (VOCAB - 4) for c in text]


def _pair(draft_vocab: int = 40):
    target = make_target("llama", vocab=VOCAB, layers=4, hidden=32)
    draft = make_draft(target, block_size=4, layers=1, taps=2)
    draft.set_draft_vocab(torch.arange(draft_vocab))
    return target, draft


# ---------------------------------------------------------------------------------------------------- soft labels
def test_teacher_forced_batch_equals_one_sequence_at_a_time():
    """Padded batch == each sequence alone: the same tapped features, and soft labels equal to the target's full
    softmax restricted to the draft vocabulary and renormalised (the oracle computes the full logits)."""
    target, draft = _pair()
    g = torch.Generator().manual_seed(0)
    seqs = [torch.randint(0, VOCAB, (n,), generator=g) for n in (9, 17, 4)]
    got = teacher_forced_batch(target, draft, seqs, [None, 1.0, 0.25])
    vocab = draft.draft_vocab
    for s, f, w in zip(seqs, got, [None, 1.0, 0.25]):
        ref = target_features(target, s, draft.config.target_layer_ids, topk=0)
        torch.testing.assert_close(f.features, ref.features, rtol=1e-10, atol=1e-10)
        logits = target(input_ids=s[None]).logits[0]  # [T, V] full vocabulary
        want = torch.log_softmax(logits[:, vocab].float(), dim=-1)
        torch.testing.assert_close(f.soft_logp, want, rtol=1e-6, atol=1e-6)
        assert f.distill_weight == w and f.soft_logp.shape == (len(s), len(vocab))


def test_teacher_forced_batch_needs_a_draft_vocabulary():
    target = make_target("llama", vocab=VOCAB, layers=4, hidden=32)
    draft = make_draft(target, block_size=4, layers=1, taps=2)
    with pytest.raises(ValueError, match="draft vocabulary"):
        teacher_forced_batch(target, draft, [torch.arange(5)])


def _loss(draft, target, ids, feats, anchors, **kw):
    cfg = TrainConfig(loss_vocab="draft", autocast=False, gamma=7.0, **kw)
    return sequence_loss(draft, target.model.embed_tokens, target.lm_head.weight, ids, feats, anchors, cfg)


def test_dense_soft_loss_equals_brute_force_cross_entropy():
    """distill_weight 1: sum_k w_k * sum_v p_target(v) * -log q_draft(v) over the draft vocabulary, computed here
    row by row from the drafter's logits."""
    target, draft = _pair()
    draft.train()
    ids = torch.randint(0, VOCAB - 1, (20,), generator=torch.Generator().manual_seed(1))
    feats = teacher_forced_batch(target, draft, [ids], [1.0])[0]
    anchors = torch.tensor([3, 8, 15, 18])
    got, stats = _loss(draft, target, ids, feats, anchors)
    # brute force: the drafter's states per block, its softmax over the draft vocabulary, the soft label per row
    from dflash_core.blocks import block_attention_mask, block_inputs
    from dflash_core.training.anchors import position_weights

    b = draft.block_size
    tokens, positions, labels = block_inputs(ids, anchors, b, draft.mask_token_id)
    n_ctx = int(anchors.max())
    mask = block_attention_mask(anchors, b, n_ctx)[None, None]
    hidden = draft(target.model.embed_tokens(tokens)[None], feats.features[:n_ctx][None], positions,
                   torch.arange(n_ctx), attn_mask=mask)[0].view(len(anchors), b, -1)
    head = target.lm_head.weight[draft.draft_vocab]
    w = position_weights(b, 7.0)
    want = 0.0
    for j, a in enumerate(anchors.tolist()):
        for k in range(1, b):
            if a + k >= len(ids):
                continue
            logq = torch.log_softmax(hidden[j, k] @ head.t(), dim=-1)
            p = feats.soft_logp[a + k - 1].exp()  # the target's distribution of the token at a + k
            want = want + w[k - 1] * -(p * logq).sum()
    torch.testing.assert_close(got, want, rtol=1e-9, atol=1e-9)
    assert stats["n1"] == len(anchors)


def test_dense_one_hot_soft_labels_equal_the_hard_label_loss():
    """A soft label that puts all mass on the hard label is the hard-label cross-entropy (labels inside the vocab)."""
    target, draft = _pair(draft_vocab=VOCAB)
    ids = torch.randint(0, VOCAB, (24,), generator=torch.Generator().manual_seed(2))
    base = teacher_forced_batch(target, draft, [ids])[0]
    one_hot = torch.full((len(ids), VOCAB), -1e30, dtype=torch.float64)
    one_hot[torch.arange(len(ids) - 1), ids[1:]] = 0.0  # position i labels the token at i + 1
    anchors = torch.tensor([2, 7, 12, 19])
    soft, _ = _loss(draft, target, ids, SequenceFeatures(base.features, None, None, one_hot, 1.0), anchors)
    hard, _ = _loss(draft, target, ids, SequenceFeatures(base.features, None, None), anchors, distill_weight=0.0)
    torch.testing.assert_close(soft, hard, rtol=1e-9, atol=1e-9)


def test_dense_soft_labels_need_the_draft_vocabulary_loss():
    target, draft = _pair()
    ids = torch.arange(12)
    feats = teacher_forced_batch(target, draft, [ids], [1.0])[0]
    cfg = TrainConfig(loss_vocab="full", autocast=False)
    with pytest.raises(ValueError, match="loss_vocab='draft'"):
        sequence_loss(draft, target.model.embed_tokens, target.lm_head.weight, ids, feats, torch.tensor([2]), cfg)


# ---------------------------------------------------------------------------------------------------- corpus
def _fake_sources(tmp_path: Path) -> list[TextSource]:
    root = tmp_path / "src"
    files = []
    for i in range(30):
        body = "".join(f"def f{i}_{j}(x):\n    return x + {j}  # step {j} of module {i}\n\n\n" for j in range(60))
        (root / f"m{i}").mkdir(parents=True, exist_ok=True)
        (root / f"m{i}" / "mod.py").write_text(body)
        files.append(Path(f"m{i}") / "mod.py")
    (root / "banned.py").write_text("def leak():\n    '''Janet ducks lay sixteen eggs per day and she eats three "
                                    "for breakfast every morning'''\n" + "x = 1\n" * 60)
    files.append(Path("banned.py"))
    return [TextSource("fake-code", "code", root, tuple(sorted(files)), (("fake", "1.0", "MIT"),))]


def test_chunks_keep_every_line_in_order_within_the_size_bounds():
    text = "".join(f"def g{j}():\n" + "    pass\n" * (j % 7 + 1) + "\n\n" for j in range(300))
    pieces = _chunks(text)
    assert all(len(p) <= 2800 + 200 for p in pieces) and len(pieces) > 3
    assert "".join(p.replace("\n", "") for p in pieces) == text.replace("\n", "")


def test_items_sharing_a_benchmark_shingle_are_dropped(tmp_path):
    sources = _fake_sources(tmp_path)
    banned = shingles("Janet ducks lay sixteen eggs per day and she eats three for breakfast every morning")
    stats = {}
    items = [it for _, it in iter_items("code", 0, 0, sources, banned, stats)]
    assert [it.item_id for _, it in iter_items("code", (3, 1), 0, sources, banned)] == \
        [it.item_id for (pos, k), it in iter_items("code", 0, 0, sources, banned) if (pos, k) >= (3, 1)]
    assert stats["dropped"] == 1 and not any("Janet" in it.response for it in items)
    assert len({it.item_id for it in items}) == len(items) > 6
    assert all(it.response.startswith("```python\n") for it in items)


def test_benchmark_shingles_cover_benchmark_prompts():
    from dflash_core.training.pools.catalog import benchmark_split
    from dflash_core.training.pools.items import DatasetUnavailableError

    try:
        item = benchmark_split("gsm8k")[0]
    except DatasetUnavailableError:
        pytest.skip("gsm8k data package not installed")
    assert shingles(item.turns[0]) <= benchmark_shingles()


# SWE-bench Lite's tasks are issues of these repositories (owner/name: import names of the code they hold)
SWE_BENCH_LITE = {"astropy/astropy": ("astropy",), "django/django": ("django",),
                  "matplotlib/matplotlib": ("matplotlib", "mpl_toolkits", "pylab"), "mwaskom/seaborn": ("seaborn",),
                  "pallets/flask": ("flask",), "psf/requests": ("requests",), "pydata/xarray": ("xarray",),
                  "pylint-dev/pylint": ("pylint",), "pytest-dev/pytest": ("pytest", "_pytest"),
                  "scikit-learn/scikit-learn": ("sklearn",), "sphinx-doc/sphinx": ("sphinx",),
                  "sympy/sympy": ("sympy",)}


def test_corpus_never_reads_the_repositories_a_hub_benchmark_draws_from():
    """The corpus reads installed packages' source; SWE-bench Lite's tasks edit the source of twelve repositories
    (matplotlib, requests, pytest and sympy are installed here, and pip vendors requests): none of it is read."""
    from dflash_core.training.textcorpus import corpus_sources

    names = {n for found in SWE_BENCH_LITE.values() for n in found}
    dists = {n.split("/")[1] for n in SWE_BENCH_LITE}
    read = [(s.name, f) for s in corpus_sources() for f in s.files
            if any(part in names for part in f.parts[:-1]) or f.parts[0].removesuffix(".py") in names]
    assert read == []
    assert not any(d[0].lower() in dists for s in corpus_sources() for d in s.distributions)
    assert dists <= set(corpus_manifest([])["excluded_distributions"])


def test_corpus_manifest_is_deterministic_and_tracks_file_changes(tmp_path):
    sources = _fake_sources(tmp_path)
    first, again = corpus_manifest(sources), corpus_manifest(sources)
    assert first == again and first["sources"]["fake-code"]["files"] == 31
    (sources[0].root / "m0" / "mod.py").write_text("changed = True\n" * 100)
    assert corpus_manifest(sources)["fingerprint"] != first["fingerprint"]


# ---------------------------------------------------------------------------------------------------- the stream
def _stream(tmp_path, mix, cursor=None, generated=None, seed=0):
    gen = generated if generated is not None else [
        (f"g{i}", torch.randint(3, VOCAB, (30 + i % 5,), generator=torch.Generator().manual_seed(i)), 10)
        for i in range(40)]
    return SequenceStream(ByteTokenizer(), mix, cursor or Cursor(), seqs_per_step=4, max_len=120, end_ids=[2],
                          generated=gen, seed=seed, window_steps=4, sources=_fake_sources(tmp_path), banned=set())


def test_stream_mixes_sources_by_weight_and_is_reproducible(tmp_path):
    draws = []
    for _ in range(2):
        s = _stream(tmp_path, {"generated": 0.25, "code": 0.75})
        draws.append([seq.key for _ in range(10) for seq in s.next_step()])
    assert draws[0] == draws[1]
    kinds = Counter("code" if k.startswith("fake-code") else "generated" for k in draws[0])
    n = sum(kinds.values())
    # binomial(40, 0.25): 5 standard deviations either side is a failure probability below 1e-6
    assert abs(kinds["generated"] - 0.25 * n) < 5 * math.sqrt(n * 0.25 * 0.75)


def test_stream_continues_from_its_cursor_without_repeating_generated_sequences(tmp_path):
    gen = [(f"g{i}", torch.randint(3, VOCAB, (20 + i % 7,), generator=torch.Generator().manual_seed(i)), 5)
           for i in range(80)]
    s = _stream(tmp_path, {"generated": 1.0}, generated=gen)
    first = [q.key for _ in range(8) for q in s.next_step()]  # two whole windows: 32 of the 80 sequences
    assert s.cursor.generated == 32
    resumed = _stream(tmp_path, {"generated": 1.0}, cursor=Cursor(**vars(s.cursor)), generated=gen)
    later = [q.key for _ in range(8) for q in resumed.next_step()]
    assert len(set(first + later)) == 64 and all(k.endswith("@e0") for k in first + later)  # no repeat in epoch 0


def test_corpus_cursor_resumes_at_the_next_item_even_inside_one_file(tmp_path):
    s = _stream(tmp_path, {"code": 1.0})
    first = [q.key for _ in range(4) for q in s.next_step()]  # one window: 16 items
    resumed = _stream(tmp_path, {"code": 1.0}, cursor=Cursor(**vars(s.cursor)))
    later = [q.key for _ in range(4) for q in resumed.next_step()]
    assert not set(first) & set(later)
    whole = _stream(tmp_path, {"code": 1.0})
    assert sorted(first + later) == sorted(q.key for _ in range(8) for q in whole.next_step())


def test_corpus_answers_are_chat_turns_that_end_the_turn(tmp_path):
    s = _stream(tmp_path, {"code": 1.0})
    seqs = s.next_step()
    assert all(q.kind == "code" and q.ids[-1] == 2 or len(q.ids) == 120 for q in seqs)
    assert all(q.prompt_len > 0 and q.response_tokens >= 16 for q in seqs)


def test_stream_stops_when_every_source_is_used_up(tmp_path):
    s = _stream(tmp_path, {"code": 1.0})
    total = sum(len(s.next_step()) for _ in range(200))
    assert s.next_step() == [] and total > 6


def test_stream_train_resumes_and_logs_tau(tmp_path):
    target, draft = _pair()
    cfg = TrainConfig(anchors=6, seqs_per_step=4, lr=3e-3, warmup_frac=0.0, loss_vocab="draft", autocast=False,
                      ckpt_every=5)
    calls = []

    def evaluate(d):
        calls.append(d.training)
        return {"tau_chain": 1.0 + len(calls), "tau_b32": 2.0}

    stream = _stream(tmp_path, {"generated": 0.5, "code": 0.5})
    out = tmp_path / "run"
    state = stream_train(target, draft, stream, cfg, out, lambda m: None, evaluate, tokens=3000,
                         eval_every_tokens=1000, log_every=1)
    losses = [h["loss"] for h in state.history if "loss" in h]
    assert state.tokens >= 3000 and (out / "checkpoint.pt").is_file()
    assert calls and not any(calls)  # evaluated in eval mode: at the start, every 1000 tokens, at the end
    evals = [h for h in state.history if "tau_chain" in h]
    assert evals[0]["tokens"] == 0 and len(evals) >= 4 and evals[-1]["tokens"] == state.tokens
    assert set(state.by_kind) == {"generated", "code"} and sum(state.by_kind.values()) == state.tokens
    assert state.target_tokens > state.tokens and state.cursor.slots == stream.cursor.slots > 0
    # a second call on the same folder resumes: nothing left to do for the same plan
    again = stream_train(target, _pair()[1], _stream(tmp_path, {"code": 1.0}), cfg, out, lambda m: None, None,
                         tokens=3000)
    assert again.step == state.step and again.tokens == state.tokens
    assert len(losses) == state.step and losses == [h["loss"] for h in again.history if "loss" in h]


def _with_bad_lengths(n: int = 24) -> list:
    """Good generated sequences (prompt 10, response 20) and three the stream cannot train on at max_len 120: a
    1-token response, a prompt of max_len - 1 tokens (one response token left), a prompt longer than max_len."""
    g = torch.Generator().manual_seed(5)
    good = [(f"g{i}", torch.randint(3, VOCAB, (30,), generator=g), 10) for i in range(n)]
    bad = [("short", torch.randint(3, VOCAB, (11,), generator=g), 10),
           ("long-prompt", torch.randint(3, VOCAB, (130,), generator=g), 119),
           ("over-prompt", torch.randint(3, VOCAB, (140,), generator=g), 130)]
    return good[:5] + bad[:1] + good[5:12] + bad[1:] + good[12:]


def test_stream_leaves_out_generated_sequences_without_two_response_tokens_within_max_len(tmp_path):
    """As the epoch trainer does: a generated sequence needs min(len, max_len) - prompt >= 2 (an anchor and a label)."""
    s = _stream(tmp_path, {"generated": 1.0}, generated=_with_bad_lengths())
    drawn = [q for _ in range(12) for q in s.next_step()]
    assert len(drawn) == 48  # two epochs of the 24 good ones
    assert all(q.key.split("@")[0].startswith("g") for q in drawn)
    assert all(q.response_tokens >= 2 and len(q.ids) <= 120 for q in drawn)
    assert s.stats["generated_too_short"] == 3


def test_stream_train_runs_on_generated_data_with_bad_lengths(tmp_path):
    target, draft = _pair()
    cfg = TrainConfig(anchors=4, seqs_per_step=4, lr=1e-3, warmup_frac=0.0, loss_vocab="draft", autocast=False)
    stream = _stream(tmp_path, {"generated": 1.0}, generated=_with_bad_lengths())
    state = stream_train(target, draft, stream, cfg, tmp_path / "run", lambda m: None, None, tokens=600)
    assert state.tokens >= 600 and state.by_kind == {"generated": state.tokens}


def test_generated_cursor_stays_valid_when_shards_are_added(tmp_path):
    """A cursor carried over to a larger generated set (new shards, listed between the old ones) continues the epoch:
    no old sequence is drawn twice in it, none is skipped, and the added ones join it."""
    g = torch.Generator().manual_seed(7)
    old = [(f"a{i}", torch.randint(3, VOCAB, (25,), generator=g), 8) for i in range(60)]
    new = [(f"b{i}", torch.randint(3, VOCAB, (25,), generator=g), 8) for i in range(30)]
    grown = [x for pair in zip(old[:30], new) for x in pair] + old[30:]  # new shards sort between the old ones
    s = _stream(tmp_path, {"generated": 1.0}, generated=old)
    first = [q.key for _ in range(8) for q in s.next_step()]  # two whole windows: 32 of the 60
    resumed = _stream(tmp_path, {"generated": 1.0}, cursor=Cursor(**vars(s.cursor)), generated=grown)
    later = [q.key for _ in range(40) for q in resumed.next_step()]
    epoch0 = [k[: -len("@e0")] for k in first + later if k.endswith("@e0")]
    olds = [k for k in epoch0 if k.startswith("a")]
    assert sorted(olds) == sorted(k for k, _, _ in old)  # every old sequence exactly once in the epoch
    assert len(set(epoch0)) == len(epoch0) and any(k.startswith("b") for k in epoch0)
    epoch1 = [k[: -len("@e1")] for k in later if k.endswith("@e1")]
    assert sorted(epoch1) == sorted(k for k, _, _ in grown)  # the next epoch: all 90 once (160 draws reach it)


def _steps(stream, n):
    return [[q.key for q in stream.next_step()] for _ in range(n)]


@pytest.mark.parametrize("stop_after", [1, 6, 7])
def test_stream_resumed_from_a_cursor_taken_mid_window_continues_with_the_untrained_steps(tmp_path, stop_after):
    """A checkpoint may fall inside a window (4 steps here): the cursor saved then must give back the window's steps
    not trained yet, so the run continues exactly as one without the interruption."""
    import copy

    mix = {"generated": 0.5, "code": 0.5}
    whole = _steps(_stream(tmp_path, mix), 12)
    first = _stream(tmp_path, mix)
    before = _steps(first, stop_after)
    resumed = _stream(tmp_path, mix, cursor=copy.deepcopy(first.cursor))
    assert before + _steps(resumed, 12 - stop_after) == whole


class _Recording(SequenceStream):
    def next_step(self):
        step = super().next_step()
        self.record.append([q.key for q in step])
        return step


def test_stream_train_checkpointed_mid_window_resumes_where_it_stopped(tmp_path):
    target, _ = _pair()
    cfg = TrainConfig(anchors=4, seqs_per_step=4, lr=1e-3, warmup_frac=0.0, loss_vocab="draft", autocast=False,
                      ckpt_every=3)

    def stream():
        s = _stream(tmp_path, {"generated": 0.5, "code": 0.5})
        recording = _Recording.__new__(_Recording)
        recording.__dict__.update(s.__dict__)
        recording.record = []
        return recording

    def train(out, tokens, s):
        return stream_train(target, _pair()[1], s, cfg, out, lambda m: None, None, tokens=tokens, log_every=1)

    full = stream()
    tokens = [h["tokens"] for h in train(tmp_path / "full", 4000, full).history]  # after each step
    part, rest = stream(), stream()
    stopped = train(tmp_path / "cut", tokens[5], part)  # stops after step 6, inside the second window
    assert stopped.step == 6 and len(full.record) > 9
    train(tmp_path / "cut", 4000, rest)
    assert part.record + rest.record == full.record
