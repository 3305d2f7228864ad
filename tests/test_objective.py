"""The acceptance-aimed loss weights against brute-force references (dflash_core.training.objective)."""

import pytest
import torch

from dflash_core.training.train_config import TrainConfig
from dflash_core.training.objective import objective_weights


def _case(seed=0, blocks=5, positions=6, vocab=7):
    g = torch.Generator().manual_seed(seed)
    valid = torch.ones(blocks, positions, dtype=torch.bool)
    valid[1, 4:] = False  # blocks cut by the sequence's end keep a prefix of positions
    valid[3, 1:] = False
    n = int(valid.sum())
    logits = torch.randn(n, vocab, generator=g, dtype=torch.float64) * 2
    columns = torch.randint(0, vocab, (n,), generator=g)
    columns[::3] = logits[::3].argmax(-1)  # some hits, so that prefixes run past the first position
    drafted = torch.rand(n, generator=g) > 0.15
    weights = torch.exp(-torch.arange(positions, dtype=torch.float64) / 7).expand(blocks, -1)[valid]
    return valid, logits, columns, drafted, weights


def _rows_by_block(valid):
    """[(block, [row indices in order])] for the row-major flattening of ``valid``."""
    out, row = [], 0
    for a in range(valid.shape[0]):
        idx = list(range(row, row + int(valid[a].sum())))
        out.append((a, idx))
        row += len(idx)
    return out


def test_ce_is_the_decay():
    valid, logits, columns, drafted, weights = _case()
    got = objective_weights("ce", weights, logits.log_softmax(-1), columns, drafted, valid)
    assert torch.equal(got, weights)


def test_cutoff_against_a_loop():
    for seed in range(5):
        valid, logits, columns, drafted, weights = _case(seed)
        got = objective_weights("cutoff", weights, logits.log_softmax(-1), columns, drafted, valid)
        want = weights.clone()
        for _, rows in _rows_by_block(valid):
            missed = False
            for r in rows:
                if missed:
                    want[r] = 0
                missed = missed or bool(logits[r].argmax() != columns[r]) or not bool(drafted[r])
        assert torch.equal(got, want)
        assert (got == 0).any() and (got > 0).any()  # the case exercises both branches


def test_credit_is_the_gradient_of_expected_acceptance():
    """-sum_k c_k log p_k with the weights detached has exactly the gradient of -E, E = sum_m prod_{j<=m} p_j."""
    for seed in range(5):
        valid, logits, columns, drafted, _ = _case(seed)
        leaf = logits.clone().requires_grad_(True)
        logp = leaf.log_softmax(-1)
        p = logp.gather(1, columns[:, None])[:, 0].exp() * drafted
        expected = sum(torch.cumprod(p[rows], 0).sum() for _, rows in _rows_by_block(valid) if rows)
        (grad_e,) = torch.autograd.grad(expected, leaf)
        leaf2 = logits.clone().requires_grad_(True)
        logp2 = leaf2.log_softmax(-1)
        c = objective_weights("credit", torch.ones(len(p), dtype=torch.float64), logp2, columns, drafted, valid)
        ce = -logp2.gather(1, columns[:, None])[:, 0]
        (grad_w,) = torch.autograd.grad((c * ce).sum(), leaf2)
        torch.testing.assert_close(grad_w, -grad_e, rtol=1e-10, atol=1e-12)


def test_credit_values_by_hand():
    valid = torch.ones(1, 3, dtype=torch.bool)
    probs = torch.tensor([[0.5, 0.5], [0.8, 0.2], [0.25, 0.75]], dtype=torch.float64)
    cols = torch.tensor([0, 0, 1])
    got = objective_weights("credit", torch.ones(3, dtype=torch.float64), probs.log(), cols,
                            torch.tensor([True, True, True]), valid)
    r = [0.5, 0.4, 0.3]  # 0.5, 0.5*0.8, 0.5*0.8*0.75
    torch.testing.assert_close(got, torch.tensor([sum(r), r[1] + r[2], r[2]], dtype=torch.float64))


def test_unknown_objective_is_refused():
    valid, logits, columns, drafted, weights = _case()
    with pytest.raises(ValueError, match="objective must be one of"):
        objective_weights("rényi", weights, logits, columns, drafted, valid)
    with pytest.raises(ValueError, match="objective must be one of"):
        TrainConfig(objective="lk")
