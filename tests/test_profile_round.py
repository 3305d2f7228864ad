"""The round profiler runs end to end on a random tiny pair and reports consistent numbers."""

from __future__ import annotations

import json
import math

from experiments.studies.profile_round import main


def test_profile_round_tiny_pair(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("DDTREE_CACHE", str(tmp_path / "cache"))  # ``auto`` measures its cost curve once, here
    out = tmp_path / "profile.json"
    main(["--pair", "tiny", "--methods", "ar,chain,4,auto", "--prompts", "2", "--max-new-tokens", "12",
          "--out", str(out)])
    result = json.loads(out.read_text())
    rows = result["methods"]
    assert set(rows) == {"ar", "chain", "4", "auto"}
    assert rows["ar"]["tau"] == 1.0 and rows["ar"]["speedup"] == 1.0 and rows["ar"]["mean_nodes"] == 0
    assert rows["4"]["mean_nodes"] <= 4 and rows["chain"]["mean_nodes"] == 7  # block 8: 7 drafted positions
    for r in rows.values():  # the stages are parts of the round
        assert r["draft_ms"] + r["tree_ms"] + r["verify_ms"] + r["commit_ms"] <= r["ms_per_round"] * 1.05 + 0.5
    assert result["hf_generate_tokens_per_s"] > 0 and list(result["verify_curve_ms"])[0] == "0"
    error = result["auto_online_curve_error"]  # the online curve against the measured one, per tree size
    # one finite relative error per size of auto's measured grid, ascending from 0 (a curve that lost sizes or went
    # NaN fails)
    sizes = [int(n) for n in error]
    assert sizes[:4] == [0, 1, 2, 4] and sizes == sorted(set(sizes))
    assert all(math.isfinite(e) and e > -1.0 for e in error.values())
    captured = capsys.readouterr()
    assert "online cost curve vs measured" in captured.out and "speed" not in captured.err
