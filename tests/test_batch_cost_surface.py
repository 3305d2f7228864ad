"""The batch cost surface: one forward per (B, N) on a tiny target, cropped back each time, and the projection by
hand."""

from __future__ import annotations

import pytest

from experiments.studies import batch_cost_surface as bcs


def test_projection_by_hand():
    surface = {1: {1: 20.0, 9: 30.0}, 4: {1: 25.0, 9: 60.0}}
    got = bcs.project(surface, {8: 2.5, 32: 3.0}, draft_ms=5.0)
    assert got[1]["plain_tok_s"] == pytest.approx(50.0) and got[4]["plain_tok_s"] == pytest.approx(160.0)
    assert got[1]["spec_tok_s"][8] == pytest.approx(2.5 / 35.0 * 1e3)
    assert got[4]["spec_tok_s"][8] == pytest.approx(4 * 2.5 / 80.0 * 1e3)  # the drafter priced once per sequence
    assert 32 not in got[1]["spec_tok_s"]  # 33 tokens were not measured: no projection
    assert got[4]["spec_over_plain"][8] == pytest.approx(125.0 / 160.0)


def test_forward_surface_on_a_tiny_target():
    from experiments.bench.models import tiny_target

    target = tiny_target()
    got = bcs.forward_surface(target, (0, 1), batches=(1, 3), nodes=(1, 4), context=8, repeats=2)
    assert set(got) == {1, 3} and all(set(row) == {1, 4} for row in got.values())
    assert all(v > 0 for row in got.values() for v in row.values())
