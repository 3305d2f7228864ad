"""Direct tests of public helpers that other tests only ran through larger paths: the optimizer step and the LR
schedule, target_fingerprint, check_mask_backend and the timing cache helpers."""

from __future__ import annotations

import math

import pytest
import torch

from conftest import make_draft, make_target, prompt
from dflash_core import IncompatibleModelError
from dflash_core.target import check_mask_backend
from dflash_core.timing import cache_path, cached_json, machine_key, read_cached_json, write_cached_json
from dflash_core.training.train_config import TrainConfig
from dflash_core.training.loop import _lr_factor, optimizer_step
from dflash_core.training.loss import draft_loss, target_features
from dflash_core.training.shards import target_fingerprint


def test_lr_schedule_warms_up_linearly_then_decays_by_cosine_to_the_floor():
    warm, floor = 0.1, 0.05
    for progress in (0.01, 0.05, 0.099):
        assert _lr_factor(progress, warm, floor) == pytest.approx(progress / warm)
    for progress in (0.1, 0.3, 0.55, 0.8, 1.0):
        rest = (progress - warm) / (1 - warm)
        assert _lr_factor(progress, warm, floor) == pytest.approx(floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * rest)))
    assert _lr_factor(0.0, warm, floor) > 0  # the first step moves


@pytest.mark.parametrize("clip", [1e6, 0.05])
def test_optimizer_step_is_the_mean_gradient_clipped_then_one_plain_step(clip):
    """With plain SGD the step is visible: p - lr * g * min(1, clip / |g|), g the gradient of the batch's weighted
    loss sum divided by the GLOBAL weight sum (here twice this batch's: half the gradient of its mean)."""
    target = make_target("llama", vocab=32)
    draft = make_draft(target, block_size=4)
    cfg = TrainConfig(autocast=False, distill_topk=4, grad_clip=clip)
    batch = []
    for seed, anchors in ((0, [6, 9]), (1, [5, 8, 12])):  # unequal lengths and block counts
        ids = prompt(seed, 12 + 4 * seed, 32)[0]
        batch.append((ids, target_features(target, ids, draft.config.target_layer_ids, 4), torch.tensor(anchors)))
    mean, stats = draft_loss(draft, target.model.embed_tokens, target.lm_head.weight, batch, cfg)
    mean.backward()
    grads = [p.grad.clone() / 2 for p in draft.parameters()]  # global weight sum = 2 x this batch's
    norm = float(torch.sqrt(sum((g ** 2).sum() for g in grads)))
    before = [p.detach().clone() for p in draft.parameters()]
    sgd = torch.optim.SGD(draft.parameters(), lr=0.1)
    out = optimizer_step(draft, sgd, target.model.embed_tokens, target.lm_head.weight, batch, 2 * stats["weight"],
                         cfg, lr=0.5)
    assert out["grad_norm"] == pytest.approx(norm, rel=1e-9) and sgd.param_groups[0]["lr"] == 0.5
    scale = min(1.0, clip / (norm + 1e-6))  # torch.nn.utils.clip_grad_norm_'s rule
    assert scale < 1.0 or clip > 1e5
    for p, p0, g in zip(draft.parameters(), before, grads):
        torch.testing.assert_close(p.detach(), p0 - 0.5 * scale * g, rtol=1e-9, atol=1e-12)
    assert out["loss"] == pytest.approx(float(mean) / 2, rel=1e-9)


def test_target_fingerprint_names_the_config_and_the_weights():
    a, same = make_target("llama", vocab=32), make_target("llama", vocab=32)
    assert target_fingerprint(a) == target_fingerprint(same) and len(target_fingerprint(a)) == 16
    assert target_fingerprint(make_target("llama", vocab=32, seed=3)) != target_fingerprint(a)  # other weights
    assert target_fingerprint(make_target("qwen3", vocab=32)) != target_fingerprint(a)  # another config
    with torch.no_grad():
        same.lm_head.weight[0, 0] += 1.0  # a sampled row of the head changed
    assert target_fingerprint(same) != target_fingerprint(a)


def test_check_mask_backend_accepts_mask_backends_and_names_the_fix_otherwise():
    target = make_target("llama", vocab=16)
    for backend in ("sdpa", "eager"):
        target.config._attn_implementation = backend
        assert check_mask_backend(target, batch=4) is True
    target.config._attn_implementation = "flash_attention_2"
    with pytest.raises(IncompatibleModelError, match="attn_implementation='sdpa'.*budget='chain'"):
        check_mask_backend(target)
    with pytest.raises(IncompatibleModelError, match="a batch of prompts"):
        check_mask_backend(target, batch=2, chains_only=True)
    assert check_mask_backend(target, batch=1, chains_only=True) is False


def test_timing_cache_helpers_round_trip_and_recover_from_damage(tmp_path, monkeypatch):
    monkeypatch.setenv("DDTREE_CACHE", str(tmp_path))
    key = machine_key({"model": "m"})
    assert len(key) == 16 and key == machine_key({"model": "m"}) and key != machine_key({"model": "n"})
    path = cache_path("costs", f"{key}-x")
    assert path == tmp_path / "costs" / f"{key}-x.json" and read_cached_json(path) is None
    calls = []
    measure = lambda: calls.append(1) or {"v": len(calls)}  # noqa: E731
    assert cached_json("costs", f"{key}-x", measure, lambda raw: raw) == {"v": 1}
    assert cached_json("costs", f"{key}-x", measure, lambda raw: raw) == {"v": 1} and len(calls) == 1  # a hit
    assert cached_json("costs", f"{key}-x", measure, lambda raw: None) == {"v": 2}  # does not answer: again
    assert cached_json("costs", f"{key}-y", measure, lambda raw: raw, use_cache=False) == {"v": 3}
    assert not cache_path("costs", f"{key}-y").exists()  # use_cache=False writes nothing
    write_cached_json(path, [1, 2])
    assert read_cached_json(path) == [1, 2] and not list(path.parent.glob("*.tmp*"))
    path.write_text('{"v": ')
    with pytest.warns(UserWarning, match="damaged cache file"):
        assert read_cached_json(path) is None
    assert not path.exists()  # removed, to be measured again


def test_teacher_forced_ceiling_is_tokens_over_the_median_forward_time(monkeypatch):
    from dflash_core.training import responses as generate

    ticks = iter([0.0, 0.5, 10.0, 10.25, 20.0, 21.0])  # three timed forwards: 0.5 s, 0.25 s, 1.0 s
    monkeypatch.setattr(generate.time, "perf_counter", lambda: next(ticks))
    seen = []
    target = make_target("llama", vocab=200, dtype=torch.float32)
    original = target.forward

    def forward(*args, **kwargs):
        seen.append((tuple(kwargs["input_ids"].shape), kwargs.get("output_hidden_states", False)))
        return original(*args, **kwargs)

    monkeypatch.setattr(target, "forward", forward)
    assert generate.teacher_forced_ceiling(target, 2, 24, repeats=3) == pytest.approx(2 * 24 / 0.5)  # the median
    assert seen[0] == ((2, 16), False) and seen[1:] == [((2, 24), True)] * 3  # warm-up, then full passes


def test_export_drafter_copies_a_loadable_checkpoint(tmp_path):
    from dflash_core import load_draft
    from dflash_core.training.loop import export_drafter

    draft = make_draft(make_target("llama", vocab=64, dtype=torch.float32), dtype=torch.float32)
    draft.save_pretrained(tmp_path / "run")
    logged = []
    export_drafter(tmp_path / "run", tmp_path / "zoo" / "mine", log=logged.append)
    copy = load_draft(tmp_path / "zoo" / "mine")
    for name, value in draft.state_dict().items():
        assert torch.equal(copy.state_dict()[name], value), name
    assert logged and "zoo" in logged[0]
