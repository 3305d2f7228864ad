"""The DFlash training recipe: block construction, position weights, learning, checkpoints, DDP, data hygiene."""

from __future__ import annotations

import math
import os

import pytest
import torch

from conftest import make_draft, make_target
from dflash_core import autoregressive_generate, dflash_generate, load_draft
from dflash_core.blocks import block_attention_mask, block_inputs
from dflash_core.training.anchors import position_weights, sample_anchors
from dflash_core.training.train_config import TrainConfig
from dflash_core.training.loop import train
from dflash_core.training.loss import draft_loss, sequence_loss, target_features


# ---------------------------------------------------------------------------------------------------- blocks
def _dense_mask(anchors: list[int], b: int, n_ctx: int) -> torch.Tensor:
    """The rule written out cell by cell: block j sees context < anchor_j and its own block, nothing else."""
    a = len(anchors)
    mask = torch.zeros(a * b, n_ctx + a * b, dtype=torch.bool)
    for j, anchor in enumerate(anchors):
        for i in range(b):
            row = j * b + i
            for c in range(n_ctx):
                mask[row, c] = c < anchor
            for jj in range(a):
                for ii in range(b):
                    mask[row, n_ctx + jj * b + ii] = jj == j
    return mask


@pytest.mark.parametrize("anchors,b,n_ctx", [([3], 4, 3), ([2, 5, 9], 4, 9), ([0, 1, 7, 8], 3, 8), ([4, 6], 16, 6)])
def test_block_attention_mask_matches_dense_reference(anchors, b, n_ctx):
    got = block_attention_mask(torch.tensor(anchors), b, n_ctx)
    assert torch.equal(got, _dense_mask(anchors, b, n_ctx))


def test_concatenated_blocks_equal_each_block_drafted_alone():
    """One forward over all blocks with the mask == drafting each block separately from the context before it
    (what the decode loop does); so every block sees exactly the context features strictly before its anchor."""
    target = make_target("qwen3", vocab=64, layers=4, hidden=32)
    draft = make_draft(target, block_size=4, layers=2, taps=2)
    ids = torch.randint(0, 63, (30,), generator=torch.Generator().manual_seed(0))
    feats = target_features(target, ids, draft.config.target_layer_ids, topk=0).features  # [T, taps*H]
    anchors = torch.tensor([5, 6, 11, 20, 27])
    b = draft.block_size
    tokens, positions, _ = block_inputs(ids, anchors, b, draft.mask_token_id)
    n_ctx = int(anchors.max())
    embeds = target.model.embed_tokens(tokens)[None]
    mask = block_attention_mask(anchors, b, n_ctx)[None, None]
    together = draft(embeds, feats[:n_ctx][None], positions, torch.arange(n_ctx), attn_mask=mask)[0]
    for j, anchor in enumerate(anchors.tolist()):
        rows = slice(j * b, (j + 1) * b)
        alone = draft(embeds[:, rows], feats[:anchor][None], positions[rows], torch.arange(anchor))[0]
        torch.testing.assert_close(together[rows], alone, rtol=1e-9, atol=1e-9)


def test_block_inputs_and_labels():
    ids = torch.arange(100, 112)  # T = 12
    tokens, positions, labels = block_inputs(ids, torch.tensor([2, 9]), 4, mask_token_id=7)
    assert tokens.tolist() == [102, 7, 7, 7, 109, 7, 7, 7]
    assert positions.tolist() == [2, 3, 4, 5, 9, 10, 11, 12]
    assert labels.tolist() == [[103, 104, 105], [110, 111, -100]]  # past the end: ignored


def test_sample_anchors_lie_in_the_response():
    g = torch.Generator().manual_seed(0)
    for prompt_len, seq_len, n in [(5, 40, 8), (5, 8, 8), (10, 11, 4), (3, 50, 100)]:
        a = sample_anchors(prompt_len, seq_len, n, g)
        assert a.tolist() == sorted(set(a.tolist()))
        assert len(a) == min(n, max(0, seq_len - 1 - prompt_len))
        assert all(prompt_len <= x <= seq_len - 2 for x in a.tolist())


def test_position_weights():
    w = position_weights(16, 7.0)
    assert w.shape == (15,)
    assert w[0] == 1.0
    for k in range(1, 16):
        assert math.isclose(float(w[k - 1]), math.exp(-(k - 1) / 7.0), rel_tol=1e-6)


# ---------------------------------------------------------------------------------------------------- learning
def _greedy_sequences(target, n: int, prompt_len: int = 6, new: int = 26, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    seqs = []
    for _ in range(n):
        p = torch.randint(0, target.config.vocab_size, (1, prompt_len), generator=g)
        out = autoregressive_generate(target, p, max_new_tokens=new).new_token_ids
        seqs.append((torch.cat([p[0], torch.tensor(out)]), prompt_len))
    return seqs


_TINY = dict(anchors=6, seqs_per_step=4, lr=3e-3, warmup_frac=0.1, autocast=False, distill_topk=4, eval_every=10**9,
             ckpt_every=10**9)


def test_restricted_vocabulary_loss_equals_full_when_every_token_is_a_candidate():
    target = make_target("llama", vocab=64)
    draft = make_draft(target, block_size=4)
    ids = _greedy_sequences(target, 1)[0][0]
    feats = target_features(target, ids, draft.config.target_layer_ids, topk=4)
    anchors = torch.tensor([7, 12, 20])
    full, _ = sequence_loss(draft, target.model.embed_tokens, target.lm_head.weight, ids, feats, anchors,
                            TrainConfig(**{**_TINY, "loss_vocab": "full"}))
    cfg = TrainConfig(**{**_TINY, "loss_vocab": "batch", "negatives": 4096})  # draws every id of the 64
    batch, _ = sequence_loss(draft, target.model.embed_tokens, target.lm_head.weight, ids, feats, anchors, cfg,
                             torch.Generator().manual_seed(0))
    torch.testing.assert_close(batch, full)


@pytest.mark.parametrize("loss_vocab", ["full", "batch"])
def test_loss_goes_down_on_a_tiny_target(loss_vocab):
    target = make_target("llama", vocab=64, dtype=torch.float32)
    draft = make_draft(target, block_size=4, dtype=torch.float32)
    seqs = _greedy_sequences(target, 8)
    state = train(target, draft, seqs, TrainConfig(**_TINY, steps=30, loss_vocab=loss_vocab, negatives=16))
    losses = [h["loss"] for h in state.history]
    assert sum(losses[-5:]) / 5 < 0.7 * sum(losses[:5]) / 5


def test_saved_then_loaded_drafter_reproduces_its_logits(tmp_path):
    target = make_target("qwen3", vocab=64, dtype=torch.float32)
    draft = make_draft(target, block_size=4, dtype=torch.float32)
    seqs = _greedy_sequences(target, 4)
    train(target, draft, seqs, TrainConfig(**_TINY, steps=5), out=tmp_path / "run")
    assert (tmp_path / "run" / "checkpoint.pt").is_file()
    draft.save_pretrained(tmp_path / "drafter")
    loaded = load_draft(tmp_path / "drafter")
    ids = seqs[0][0]
    feats = target_features(target, ids, draft.config.target_layer_ids, topk=0).features
    tokens, positions, _ = block_inputs(ids, torch.tensor([10]), 4, draft.mask_token_id)
    embeds = target.model.embed_tokens(tokens)[None]
    args = (embeds, feats[:10][None], positions, torch.arange(10))
    with torch.no_grad():
        torch.testing.assert_close(target.lm_head(loaded(*args)), target.lm_head(draft(*args)), rtol=0, atol=0)
    p = seqs[1][0][None, :6]
    assert (dflash_generate(target, loaded, p, max_new_tokens=20).new_token_ids
            == dflash_generate(target, draft, p, max_new_tokens=20).new_token_ids)


def test_training_resumes_from_its_checkpoint(tmp_path):
    target = make_target("llama", vocab=64, dtype=torch.float32)
    seqs = _greedy_sequences(target, 8)
    cfg = TrainConfig(**{**_TINY, "ckpt_every": 10**9}, steps=6)
    straight = train(target, make_draft(target, block_size=4, dtype=torch.float32), seqs, cfg)
    first = train(target, make_draft(target, block_size=4, dtype=torch.float32), seqs, cfg, out=tmp_path,
                  stop_after=3)  # interrupted after 3 steps
    assert first.step == 3
    resumed = train(target, make_draft(target, block_size=4, dtype=torch.float32), seqs, cfg, out=tmp_path)
    assert resumed.step == 6
    for a, b in zip(straight.history, resumed.history):
        assert math.isclose(a["loss"], b["loss"], rel_tol=1e-5)


# ---------------------------------------------------------------------------------------------------- DDP
def _ddp_worker(rank: int, world: int, init_file: str, out_file: str) -> None:
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    try:
        history, params = _ddp_run()
        if rank == 0:
            torch.save({"history": history, "params": params}, out_file)
        dist.barrier()  # both ranks done before teardown (a rank tearing down mid-collective once aborted the other)
    finally:
        dist.destroy_process_group()


def _ddp_run():
    """Sequences of unequal lengths (ranks then hold unequal weight sums) under plain SGD without clipping: a wrong
    gradient normalisation changes the step (AdamW's scale invariance and clipping would hide it)."""
    from dflash_core.training import loop

    target = make_target("llama", vocab=64, dtype=torch.float32)
    draft = make_draft(target, block_size=4, dtype=torch.float32)
    seqs = [(ids[: len(ids) - 3 * i], p) for i, (ids, p) in enumerate(_greedy_sequences(target, 8, new=26))]
    adamw = loop.make_optimizer
    loop.make_optimizer = lambda model, cfg: torch.optim.SGD(model.parameters(), lr=0.5)
    try:
        state = train(target, draft, seqs, TrainConfig(**{**_TINY, "grad_clip": 1e9}, steps=4))
    finally:
        loop.make_optimizer = adamw
    return [h["loss"] for h in state.history], {k: v.detach().clone() for k, v in draft.state_dict().items()}


def test_ddp_two_gloo_processes_match_one_process(tmp_path):
    import torch.multiprocessing as mp

    single_history, single_params = _ddp_run()
    out_file = str(tmp_path / "ddp.pt")
    mp.spawn(_ddp_worker, args=(2, str(tmp_path / "init"), out_file), nprocs=2, join=True)
    ddp = torch.load(out_file, weights_only=False)
    assert len(ddp["history"]) == len(single_history) == 4
    for a, b in zip(ddp["history"], single_history):
        assert math.isclose(a, b, rel_tol=1e-5)
    for k, v in single_params.items():
        torch.testing.assert_close(ddp["params"][k], v, rtol=1e-4, atol=1e-5)


# ---------------------------------------------------------------------------------------------------- data hygiene
def test_no_training_prompt_is_benchmark_eligible():
    from dflash_core.training.pools.catalog import OFFLINE_DATASETS, benchmark_pool_ids, benchmark_split
    from dflash_core.training.pools.items import DatasetUnavailableError
    from dflash_core.training.prompts import build_prompts

    prompts = build_prompts()
    texts = {p.text.strip() for p in prompts}
    checked = 0
    for name in OFFLINE_DATASETS:
        try:
            eligible = benchmark_pool_ids(name)
            eligible_texts = {t.strip() for item in benchmark_split(name) for t in item.turns}
        except DatasetUnavailableError:
            continue
        used = {p.prompt_id.split(":", 1)[1] for p in prompts if p.source == name}
        assert not used & eligible, f"{name}: training prompts overlap the benchmark pool"
        assert not texts & eligible_texts, f"{name}: a training prompt text equals a benchmark-eligible item"
        checked += 1
    if checked == 0:
        pytest.skip("no offline benchmark package is installed")
    sources = {p.source for p in prompts}
    assert {"stdlib", "code-tasks", "math-templates", "chat"} <= sources


def test_fit_presets_set_defaults_that_explicit_options_override():
    from dflash_core.training.fit import parse_args

    base = ["--data", "d", "--out", "o"]
    assert parse_args(base).layers == 2 and parse_args(base).max_len == 768
    qwen3 = parse_args(base + ["--preset", "qwen3"])
    assert (qwen3.layers, qwen3.anchors, qwen3.max_len, qwen3.loss_vocab) == (5, 512, 3072, "full")
    assert parse_args(base + ["--preset", "qwen3", "--layers", "3"]).layers == 3


def test_the_generation_kv_buffer_is_sized_once_for_the_longest_sequence():
    """GrowingCache(capacity): one allocation of exactly prompt + max_new_tokens positions, no doubling; without a
    capacity (or past it) it still grows, and either way it returns what DynamicCache returns."""
    from transformers import DynamicCache

    from dflash_core.training.responses import GrowingCache

    g = torch.Generator().manual_seed(0)
    steps = [torch.randn(2, 2, n, 4, generator=g) for n in (5, 1, 1, 1)]  # a prefill of 5, then 3 tokens
    for capacity in (8, None, 6):
        sized, plain = GrowingCache(capacity=capacity), DynamicCache()
        for x in steps:
            k, v = sized.update(x, -x, 0)
            k_ref, v_ref = plain.update(x, -x, 0)
            assert torch.equal(k, k_ref) and torch.equal(v, v_ref)
        allocated = sized.layers[0]._k.shape[-2]
        assert allocated == {8: 8, None: 64, 6: 64}[capacity]  # 6 < 8 needed: grows (at least 64) past it
