"""The auto-budget study's bookkeeping: projected rates, the per-dataset oracle and the ratios to it."""

from __future__ import annotations

import pytest

from ddtree.cost import CostModel
from experiments.studies.auto_budget_study import FIXED, markdown, summarize


def test_summary_prices_rounds_with_the_curve_and_picks_the_oracle_per_dataset():
    cost = CostModel((0, 64), (0.010, 0.074), fixed_s=0.002)  # 1 ms per node: round(N) = 12 ms + N ms
    rows = []
    for dataset, best in (("gsm8k", 8), ("mt-bench", 2)):
        for b in FIXED:  # one round per budget; the best budget commits the most tokens per second
            tokens = 4 if b == best else 1
            rows.append({"dataset": dataset, "policy": f"B={b}", "curve": None, "tokens": [tokens], "sizes": [b]})
        rows.append({"dataset": dataset, "policy": "auto", "curve": "c", "tokens": [3, 1], "sizes": [4, 0]})
        rows.append({"dataset": dataset, "policy": "auto", "curve": "other", "tokens": [100], "sizes": [0]})
    out = summarize(rows, {"c": (cost, 128)})["c"]
    assert out["oracle_budget"] == {"gsm8k": 8, "mt-bench": 2}
    auto = out["policies"]["auto"]
    rate = 4 / (0.016 + 0.012)  # tokens over the two rounds' seconds (the "other" curve's rows are ignored)
    assert auto["vs_oracle"]["gsm8k"] == pytest.approx(rate / (4 / 0.020))
    assert auto["vs_oracle"]["mt-bench"] == pytest.approx(rate / (4 / 0.014))
    assert auto["vs_oracle_min"] == pytest.approx(rate / (4 / 0.014))
    assert auto["tau"] == pytest.approx(2.0) and auto["mean_nodes"] == pytest.approx(2.0)
    assert out["policies"]["B=8"]["vs_oracle"]["gsm8k"] == pytest.approx(1.0)
    text = markdown({"temperatures": {"0": {"c": out}}, "setup": {"cpu": "x", "dtype": "bf16", "samples": 1,
                                                                  "seed": 1, "max_new_tokens": 8}})
    assert "| auto |" in text and "gsm8k 8" in text


def test_user_policies_are_loaded_by_name_and_refused_clearly(tmp_path, monkeypatch, capsys):
    from experiments.studies.auto_budget_study import main, user_policies
    from experiments.bench.policies import PolicyError

    (tmp_path / "study_policy.py").write_text(
        "from ddtree import FixedBudget\n\n"
        "class Three(FixedBudget):\n"
        "    def __init__(self):\n"
        "        super().__init__(3)\n"
        "        self.name = 'three nodes'\n\n"
        "class Clash(Three):\n"
        "    def __init__(self):\n"
        "        super().__init__()\n"
        "        self.name = 'B=8'\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    assert user_policies(["study_policy:Three"]) == {"three nodes": "study_policy:Three"}
    with pytest.raises(PolicyError, match="already a policy"):
        user_policies(["study_policy:Clash"])
    with pytest.raises(PolicyError, match="already a policy"):
        user_policies(["study_policy:Three", "study_policy:Three"])
    with pytest.raises(SystemExit) as exit_info:  # before any model is loaded
        main(["--out", str(tmp_path / "out"), "--policy", "study_policy:Nope"])
    assert exit_info.value.code == 2 and "has no 'Nope'" in capsys.readouterr().err
