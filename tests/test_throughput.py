"""The benchmark's throughput mode: a cell runs every group of a batch size, the summary's ratios and best budget,
resuming a finished cell, the command line, and the figure."""

from __future__ import annotations

import json

import pytest
import torch

from conftest import make_draft, make_target, prompt
from experiments.bench import throughput
from plots.throughput_figure import plot_throughput, throughput_lines

pytestmark = pytest.mark.usefixtures("one_thread")


def test_a_cell_decodes_every_group_and_counts_its_tokens():
    target = make_target("llama", vocab=64, dtype=torch.float32)
    draft = make_draft(target, block_size=4, dtype=torch.float32)
    prompts = [prompt(b, 4 + 3 * b, 64) for b in range(4)]
    plain = throughput.run_cell(throughput.make_runner("ar", target, draft, []), prompts, 2, 10)
    tree = throughput.run_cell(throughput.make_runner("ddtree-8", target, draft, []), prompts, 2, 10)
    assert plain["tokens"] == tree["tokens"] == 40 and len(plain["outputs"]) == 4
    assert plain["outputs"] == tree["outputs"]  # fp32: the same text
    assert plain["rounds"] == 36 and tree["tree_nodes"] == 8 * tree["rounds"]  # 9 rounds after each prefill token
    with pytest.raises(ValueError, match="unknown method"):
        throughput.make_runner("ddtree", target, draft, [])


def _cell(tokens, wall, rounds, nodes, outputs):
    return {"tokens": tokens, "wall_s": wall, "prefill_s": 0.1 * wall, "rounds": rounds, "tree_nodes": nodes,
            "outputs": outputs, "calibration_s": 0.0}


def test_the_summary_divides_by_plain_at_each_batch_size_and_names_the_best_budget():
    same, other = [[1, 2, 3]], [[1, 2, 4]]
    cells = {"1": {"ar": _cell(100, 4.0, 99, 0, same), "ddtree-4": _cell(100, 2.0, 40, 160, same),
                   "ddtree-8": _cell(100, 2.5, 35, 280, other), "auto": _cell(100, 2.1, 38, 200, same)},
             "4": {"ar": _cell(400, 4.0, 396, 0, same), "ddtree-4": _cell(400, 5.0, 160, 640, same),
                   "ddtree-8": _cell(400, 4.4, 150, 1200, same), "auto": _cell(400, 4.0, 150, 900, same)}}
    summary = throughput.summarize(cells, [4, 8])
    one, four = summary["1"], summary["4"]
    assert one["methods"]["ddtree-4"]["over_plain"] == pytest.approx(2.0)
    assert one["best_fixed"]["method"] == "ddtree-4" and four["best_fixed"]["method"] == "ddtree-8"
    assert one["auto_over_best_fixed"] == pytest.approx(2.0 / 2.1)
    assert four["methods"]["ddtree-8"]["over_plain"] == pytest.approx(4.0 / 4.4)  # below 1: stops paying
    assert one["methods"]["ddtree-8"]["equal_to_plain"] == 0 and one["methods"]["auto"]["equal_to_plain"] == 1
    assert one["methods"]["ddtree-4"]["tau"] == pytest.approx(99 / 40)  # the prefill's token is no round
    table = throughput.format_table(summary)
    assert "batch 4: best fixed budget ddtree-8" in table and "| 4 | ddtree-8 |" in table
    lines = throughput_lines({"summary": summary})
    assert [p[0] for p in lines["auto"]] == [1, 4] and lines["ar"][1][2] == pytest.approx(1.0)


def test_the_figure_is_drawn_from_a_record(tmp_path):
    pytest.importorskip("matplotlib")
    cells = {"1": {"ar": _cell(10, 1.0, 9, 0, [[1]]), "ddtree-8": _cell(10, 0.5, 4, 32, [[1]])},
             "2": {"ar": _cell(20, 1.2, 18, 0, [[1]]), "ddtree-8": _cell(20, 1.0, 8, 64, [[1]])}}
    record = {"summary": throughput.summarize(cells, [8]), "settings": {"dtype": "float32"}}
    out = plot_throughput(record, tmp_path / "figure.png")
    assert out.is_file() and out.stat().st_size > 1000


def test_the_command_line_checks_its_lists_and_always_runs_plain_decoding():
    args = throughput.parse_args(["--batch", "4,1,2", "--methods", "dflash,ddtree", "--budgets", "8,16"])
    assert args.batch == [1, 2, 4] and args.methods == ["ar", "dflash", "ddtree"]
    assert throughput.method_names(args.methods, args.budgets) == ["ar", "dflash", "ddtree-8", "ddtree-16"]
    for bad in (["--batch", "0"], ["--batch", "two"], ["--methods", "medusa"]):
        with pytest.raises(SystemExit):
            throughput.parse_args(bad)


def test_a_rerun_with_the_same_settings_resumes_and_other_settings_start_over(tmp_path):
    path = tmp_path / "throughput.json"
    settings = {"batch": [1, 2], "methods": ["ar"]}
    record = throughput._resume(path, settings)
    record["cells"]["1"] = {"ar": _cell(10, 1.0, 9, 0, [[1]])}
    path.write_text(json.dumps(record))
    assert throughput._resume(path, settings)["cells"] == record["cells"]
    assert throughput._resume(path, {**settings, "batch": [1]})["cells"] == {}
