"""Packed oneDNN linear layers: same logits as F.linear, lossless decoding, a switch, and a clean fallback."""

from __future__ import annotations

import pytest
import torch

from conftest import make_draft, make_target, prompt
from ddtree import ddtree_generate
from dflash_core import autoregressive_generate
from dflash_core.cpu_kernels import (
    PackedLinear, active_kernels, apply_cpu_kernels, kernels_from_env, pack_linear_layers, packed_kernels_available,
    set_packed_enabled, unpack_linear_layers,
)

needs_packed = pytest.mark.skipif(not packed_kernels_available(), reason="torch build without oneDNN packed linear")


@needs_packed
@pytest.mark.parametrize("dtype", [torch.float32, pytest.param(torch.bfloat16, marks=pytest.mark.skipif(
    not packed_kernels_available(torch.bfloat16), reason="oneDNN has no bf16 kernel on this CPU"))])
def test_packed_model_matches_and_decodes_losslessly(family, dtype):
    target = make_target(family, vocab=64, dtype=dtype)
    draft = make_draft(target, block_size=5)
    p = prompt(3, 7, 64)
    with torch.inference_mode():
        ref = target(input_ids=p).logits
    n_linear = sum(type(m) is torch.nn.Linear for m in target.modules())
    assert pack_linear_layers(target) == n_linear and pack_linear_layers(draft) > 0
    assert active_kernels(target) == "packed"
    with torch.inference_mode():
        got = target(input_ids=p).logits
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    assert torch.allclose(got.float(), ref.float(), atol=tol * max(1.0, ref.abs().max().item()))
    for seed in range(2 if dtype == torch.float32 else 0):  # bf16 multi-token forwards round differently: fp32 only
        q = prompt(20 + seed, 5, 64)
        plain = autoregressive_generate(target, q, max_new_tokens=24).new_token_ids
        for budget in ("chain", 6):
            assert ddtree_generate(target, draft, q, budget=budget, max_new_tokens=24).new_token_ids == plain
    assert unpack_linear_layers(target) == n_linear and active_kernels(target) == "torch"


@needs_packed
def test_switch_fallbacks_and_repacking():
    lin = torch.nn.Linear(8, 5)
    packed = PackedLinear(lin)
    x = torch.randn(3, 2, 8)
    with torch.no_grad():
        assert torch.allclose(packed(x), lin(x), atol=1e-6)
        lin.weight.mul_(2.0)  # an in-place update is seen (the packed copy is rebuilt)
        assert torch.allclose(packed(x), lin(x), atol=1e-6)
    y = packed(x.requires_grad_())  # autograd recording: F.linear, gradients flow
    y.sum().backward()
    assert x.grad is not None and lin.weight.grad is not None
    model = torch.nn.Sequential(packed)
    assert set_packed_enabled(False, model) is True and active_kernels(model) == "torch"
    with torch.no_grad():
        assert torch.equal(packed(x.detach()), torch.nn.functional.linear(x.detach(), lin.weight, lin.bias))
    assert set_packed_enabled(True, model) is False and active_kernels(model) == "packed"


def test_kernel_choice_errors(monkeypatch):
    monkeypatch.setenv("DDTREE_CPU_KERNELS", "fast")
    with pytest.raises(ValueError, match="DDTREE_CPU_KERNELS"):
        kernels_from_env()
    monkeypatch.setenv("DDTREE_CPU_KERNELS", "torch")
    assert kernels_from_env() == "torch" and apply_cpu_kernels(None) == "torch"
    with pytest.raises(ValueError, match="kernels"):
        apply_cpu_kernels(None, kernels="mkl")


@needs_packed
def test_auto_choice_is_measured_once_and_cached(monkeypatch, tmp_path):
    from dflash_core.cpu_kernels import choose_cpu_kernels, measure_kernels

    monkeypatch.setenv("DDTREE_CACHE", str(tmp_path))
    target = make_target("llama", vocab=64, dtype=torch.float32)
    ms = measure_kernels(target, rows=(1, 4), context=8, repeats=2)
    assert set(ms) == {"torch", "packed"} and all(v > 0 for per in ms.values() for v in per.values())
    unpack_linear_layers(target)
    choice = choose_cpu_kernels(target)
    assert choice in ("torch", "packed") and active_kernels(target) == "torch"  # measured, left unpacked
    assert len(list((tmp_path / "kernels").glob("*.json"))) == 1
    monkeypatch.setattr("dflash_core.cpu_kernels.measure_kernels", lambda *a, **k: pytest.fail("not cached"))
    assert choose_cpu_kernels(target) == choice
    assert apply_cpu_kernels(target, None, kernels="auto") == choice == active_kernels(target)


@needs_packed
def test_an_edit_through_weight_data_needs_refresh_packed():
    from dflash_core.cpu_kernels import refresh_packed

    lin = torch.nn.Linear(8, 5)
    model = torch.nn.Sequential(lin)
    pack_linear_layers(model)
    x = torch.randn(3, 8)
    with torch.no_grad():
        before = model(x)
        lin.weight.data.mul_(3.0)  # bypasses the version counter the packed copy is keyed by
        assert torch.allclose(model(x), before)  # stale: documented
        refresh_packed(model)
        assert torch.allclose(model(x), torch.nn.functional.linear(x, lin.weight, lin.bias), atol=1e-5)


def test_a_cpu_without_bf16_kernels_keeps_bf16_layers_plain(monkeypatch):
    """On a CPU where oneDNN has no bf16 kernel, bf16 layers are never packed and ``auto`` picks torch without
    measuring (a packed bf16 forward would raise there)."""
    from dflash_core import cpu_kernels

    monkeypatch.setattr(cpu_kernels, "packed_kernels_available", lambda dtype=None: dtype in (None, torch.float32))
    monkeypatch.setattr(cpu_kernels, "measure_kernels", lambda *a, **k: pytest.fail("measured"))
    target = make_target("llama", vocab=64, dtype=torch.bfloat16)
    assert cpu_kernels.pack_linear_layers(target) == 0
    assert cpu_kernels.apply_cpu_kernels(target, kernels="auto") == "torch" == active_kernels(target)


@needs_packed
def test_kernel_cache_is_keyed_by_the_speed_environment_and_survives_damage(monkeypatch, tmp_path):
    from dflash_core import cpu_kernels
    from dflash_core.timing import cache_path

    monkeypatch.setenv("DDTREE_CACHE", str(tmp_path))
    monkeypatch.delenv("MKL_CBWR", raising=False)
    target = make_target("llama", vocab=64, dtype=torch.float32)
    plain = cpu_kernels._kernel_key(target)
    monkeypatch.setenv("MKL_CBWR", "AVX2")
    assert cpu_kernels._kernel_key(target) != plain  # another kernel choice: another cache entry
    path = cache_path("kernels", cpu_kernels._kernel_key(target))
    path.parent.mkdir(parents=True)
    path.write_text('{"choice": "pa')  # cut off
    monkeypatch.setattr(cpu_kernels, "measure_kernels", lambda *a, **k: {"torch": {1: 1.0}, "packed": {1: 2.0}})
    with pytest.warns(UserWarning, match="damaged cache file"):
        assert cpu_kernels.choose_cpu_kernels(target) == "torch"
    assert cpu_kernels.choose_cpu_kernels(target) == "torch"  # rewritten whole
