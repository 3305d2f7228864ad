"""The target-step options study: Q4_1 blocks recovered exactly, the weight-only layers against a float reference,
and every option applied to a tiny target giving that option's forward."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from experiments.studies import target_step_options as tso


def _q4_1_weight(n: int, k: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    q = torch.randint(0, 16, (n, k // 32, 32), generator=g).float()
    q[..., 0], q[..., 1] = 0, 15  # Q4_1 puts a block's minimum at 0 and its maximum at 15
    d = torch.rand(n, k // 32, 1, generator=g) * 0.01 + 1e-3
    m = torch.randn(n, k // 32, 1, generator=g) * 0.05
    return (q * d + m).reshape(n, k)


def test_q4_1_blocks_recover_a_q4_1_weight_exactly_and_not_a_float_one():
    w = _q4_1_weight(64, 128)
    q, d, m, error = tso.q4_1_blocks(w)
    assert error < 1e-6 and int(q.min()) == 0 and int(q.max()) == 15
    rebuilt = (q.reshape(64, 4, 32).float() * d[..., None] + m[..., None]).reshape(64, 128)
    assert torch.allclose(rebuilt, w, atol=1e-6)
    assert tso.q4_1_blocks(torch.randn(64, 128))[3] > 1e-3  # a float weight is not on a 16-level grid


@pytest.mark.parametrize("bits", [8, 4])
def test_weight_only_linear_matches_its_dequantized_weight(bits):
    torch.manual_seed(0)
    lin = nn.Linear(128, 64, bias=False)
    with torch.no_grad():
        lin.weight.copy_(_q4_1_weight(64, 128))
    layer = tso.WeightOnlyLinear(lin, bits)
    x = torch.randn(3, 5, 128).to(torch.bfloat16)
    ref = x.float() @ lin.weight.t()
    got = layer(x)
    assert got.shape == (3, 5, 64) and got.dtype == torch.bfloat16
    rel = (got.float() - ref).abs().max() / ref.abs().max()
    assert rel < 2e-2  # bf16 activations and scales; the int4 grid is the weight's own, so no extra rounding
    if bits == 4:
        assert layer.error < 1e-6
    wrong = tso.WeightOnlyLinear(nn.Linear(128, 64, bias=False), bits)(x)  # another weight: far off
    assert (wrong.float() - ref).abs().max() / ref.abs().max() > 0.2


def test_options_on_a_tiny_target_keep_the_forward_close():
    from experiments.bench.models import tiny_target

    target = tiny_target(hidden=64, layers=2)
    x = torch.randint(0, target.config.vocab_size, (1, 12))
    with torch.no_grad():
        ref = target(x).logits.float()
    for option in ("torch", "packed", "fused", "int8"):
        model, notes = tso.apply_option(option, target, torch.bfloat16)
        with torch.no_grad():
            got = model(x).logits.float()
        assert (got - ref).abs().max() / ref.abs().max() < 0.1, option
        kinds = {type(m).__name__ for m in model.model.layers[0].mlp.children()}
        assert ("WeightOnlyLinear" in kinds) == (option == "int8"), (option, kinds)
    calls = tso.verify_curve(target, (0, 1), nodes=(1, 4), context=8)
    for fn in calls.values():
        fn()  # the cache is cropped back each call: a second round runs on the same context
        fn()


def test_shared_input_serves_only_the_same_input_in_turn_and_equals_separate_products():
    import torch.nn.functional as F

    from dflash_core.cpu_kernels import PackedLinear, packed_kernels_available

    if not packed_kernels_available():
        pytest.skip("torch build without oneDNN packed linear")
    parent = nn.Module()
    parent.q_proj, parent.k_proj, parent.v_proj = (PackedLinear(nn.Linear(8, n, bias=False)) for n in (6, 4, 4))
    weights = [parent.q_proj.weight, parent.k_proj.weight, parent.v_proj.weight]
    assert tso.fuse_shared_inputs(parent) == 1
    assert [parent.q_proj.weight, parent.k_proj.weight, parent.v_proj.weight] == weights  # same Parameters
    assert sorted(parent.state_dict()) == ["k_proj.weight", "q_proj.weight", "v_proj.weight"]
    qp, kp, vp = parent.q_proj, parent.k_proj, parent.v_proj
    x, other = torch.randn(2, 3, 8), torch.randn(2, 3, 8)
    served = []
    real = tso.SharedInput.output

    def spy(self, slot, inp):
        y = real(self, slot, inp)
        served.append(y is not None)
        return y
    with torch.inference_mode():
        tso.SharedInput.output = spy
        try:
            assert torch.allclose(qp(x), F.linear(x, qp.weight), atol=1e-6)
            assert torch.allclose(kp(x), F.linear(x, kp.weight), atol=1e-6)
            assert torch.allclose(vp(x), F.linear(x, vp.weight), atol=1e-6)
            assert served == [True, True, True]  # k and v came from q's product
            qp(x)
            assert torch.allclose(kp(other), F.linear(other, kp.weight), atol=1e-6)  # another input: its own
        finally:
            tso.SharedInput.output = real
    with torch.no_grad():
        kp.weight.mul_(-2.0)  # an in-place update: the shared product is packed again
        assert torch.allclose(qp(x), F.linear(x, qp.weight), atol=1e-6)
        assert torch.allclose(kp(x), F.linear(x, kp.weight), atol=1e-6)


def test_static_cache_step_runs_both_caches_on_the_same_context():
    from experiments.bench.models import tiny_target

    got = tso.static_cache_step_ms(tiny_target(), context=16, max_len=64, repeats=2)
    assert got["dynamic"] > 0 and got["static"] > 0 and got["context"] == 16 and got["max_cache_len"] == 64
