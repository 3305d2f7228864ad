"""Result records: JSON round trip, crash-safe appends, atomic manifest, resume keys."""

import json
import os
import subprocess
import sys
import warnings
from pathlib import Path

import pytest

from experiments.bench.run_folder import existing_records
from experiments.bench.schema import (
    METHOD_LABELS,
    METHODS,
    Manifest,
    SampleRecord,
    Variant,
    append_record,
    method_label,
    read_records,
    record_key,
    write_json_atomic,
)
from plots.colors import METHOD_COLORS

REPO = Path(__file__).resolve().parent.parent


def make_record(**overrides) -> SampleRecord:
    fields = dict(dataset="gsm8k", sample_id="17", turn=0, method="ddtree", budget=32, policy="fixed",
                  temperature=0.0, num_input_tokens=120, num_new_tokens=64, prefill_s=0.05, decode_s=1.25,
                  acceptance_lengths=[3, 1, 5], stage_times={"draft": 0.1, "verify": 0.9}, matches_ar=True,
                  seed=0, dtype="bfloat16", extra={"tree_sizes": [32, 32, 32]})
    fields.update(overrides)
    return SampleRecord(**fields)


def test_round_trip_keeps_every_field():
    record = make_record()
    line = record.to_json()
    assert "\n" not in line
    back = SampleRecord.from_json(line)
    assert back == record
    assert back.tau == pytest.approx(3.0)
    assert SampleRecord.from_json(make_record(budget="auto", policy="auto", matches_ar=None).to_json()).budget == "auto"


def test_unknown_fields_are_kept_in_extra_and_bad_records_refused():
    data = json.loads(make_record().to_json())
    data["future_field"] = 7
    assert SampleRecord.from_dict(data).extra["future_field"] == 7
    with pytest.raises(ValueError):
        make_record(method="medusa")
    with pytest.raises(ValueError):
        SampleRecord.from_json('{"dataset": "gsm8k"}')
    with pytest.raises(TypeError):
        make_record(budget=1.5)


def test_numpy_like_scalars_are_serialised():
    class Scalar:  # stands in for numpy / torch scalars without importing them
        def __init__(self, value):
            self.value = value

        def item(self):
            return self.value

    record = make_record(budget=Scalar(16), extra={"x": Scalar(2.5)})
    assert record.budget == 16
    assert json.loads(record.to_json())["extra"]["x"] == 2.5


def test_append_and_read(tmp_path):
    path = tmp_path / "run" / "records.jsonl"
    records = [make_record(sample_id=str(i), budget=b) for i in range(3) for b in (8, 16)]
    for r in records:
        append_record(path, r)
    assert read_records(path) == records
    assert path.read_text().count("\n") == len(records)


def test_truncated_last_line_is_ignored_then_repaired(tmp_path):
    path = tmp_path / "records.jsonl"
    first, second, third = make_record(sample_id="1"), make_record(sample_id="2"), make_record(sample_id="3")
    append_record(path, first)
    append_record(path, second)
    with open(path, "a") as f:  # what a kill in the middle of a write could leave behind
        f.write(third.to_json()[:40])
    with pytest.warns(UserWarning, match="truncated"):
        assert read_records(path) == [first, second]
    with pytest.warns(UserWarning, match="truncated"):
        append_record(path, third)  # the fragment is cut off, not glued to the new line
    assert read_records(path) == [first, second, third]


def test_complete_last_line_without_newline_is_kept(tmp_path):
    path = tmp_path / "records.jsonl"
    first, second = make_record(sample_id="1"), make_record(sample_id="2")
    path.write_text(first.to_json())
    assert read_records(path) == [first]
    append_record(path, second)
    assert read_records(path) == [first, second]


def test_corrupt_line_in_the_middle_raises(tmp_path):
    path = tmp_path / "records.jsonl"
    path.write_text(make_record().to_json() + "\n{broken\n" + make_record(sample_id="9").to_json() + "\n")
    with pytest.raises(ValueError, match=":2:"):
        read_records(path)


def test_killed_writer_loses_at_most_the_record_in_flight(tmp_path):
    path = tmp_path / "records.jsonl"
    script = (
        "import os, sys\n"
        "from experiments.bench.schema import SampleRecord, append_record\n"
        "for i in range(10**6):\n"
        "    append_record(sys.argv[1], SampleRecord(dataset='gsm8k', sample_id=str(i), turn=0, method='ar',\n"
        "        budget=None, policy='ar', temperature=0.0, num_input_tokens=5, num_new_tokens=8, prefill_s=0.0,\n"
        "        decode_s=0.1, acceptance_lengths=[1] * 8))\n"
        "    if i == 20: print('ready', flush=True)\n"
    )
    proc = subprocess.Popen([sys.executable, "-c", script, str(path)], cwd=REPO, stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "ready"
    proc.kill()
    proc.wait()
    proc.stdout.close()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        records = read_records(path)
    assert len(records) > 20
    assert [r.sample_id for r in records] == [str(i) for i in range(len(records))]


def test_resume_keys(tmp_path):
    path = tmp_path / "records.jsonl"
    assert existing_records(tmp_path) == {}
    done = [make_record(sample_id=s, budget=b, temperature=t) for s in ("a", "b") for b in (16, "auto") for t in (0, 1)]
    for r in done:
        append_record(path, r)
    keys = set(existing_records(tmp_path))
    assert len(keys) == len(done)
    assert record_key("gsm8k", "a", 0, Variant("ddtree", 16), 0) in keys  # int temperature normalised to float
    assert record_key("gsm8k", "a", 0, Variant("ddtree", 32), 0.0) not in keys
    assert record_key("gsm8k", "a", 1, Variant("ddtree", 16), 0.0) not in keys
    assert done[0].record_key() == ("gsm8k", "a", 0, "ddtree", 16, 0.0)


def test_manifest_written_atomically(tmp_path, monkeypatch):
    path = tmp_path / "manifest.json"
    manifest = Manifest.create(device="cpu", dtype="bfloat16", attention_backend="sdpa", seed=0, preset="default",
                               extra={"budgets": [8, 16]})
    manifest.write(path)
    back = Manifest.read(path)
    assert back == manifest
    assert back.created_at and isinstance(back.package_versions, dict) and back.command_line

    def failing_replace(src, dst):
        raise OSError("disk full")

    monkeypatch.setattr(os, "replace", failing_replace)
    with pytest.raises(OSError):
        write_json_atomic(path, {"half": "written"})
    assert Manifest.read(path) == manifest  # the old manifest is untouched
    assert sorted(p.name for p in tmp_path.iterdir()) == ["manifest.json"]  # no temp file left behind


def test_labels_and_colors_cover_every_method():
    assert set(METHOD_LABELS) == set(METHODS) == set(METHOD_COLORS)
    assert method_label("ddtree", "fixed", 64) == "DDTree (B=64)"
    assert method_label("ddtree", "auto", "auto") == "DDTree (auto)"
    assert method_label("dflash", "chain", None) == "DFlash"
    assert method_label("dflash", "chain-auto", "chain-auto") == "DFlash (auto)"
    assert method_label("pld", "lookup", None) == "PLD"
    assert method_label("ddtree", "lookup", 16, "topk") == "DDTree+lookup (B=16)"
    assert method_label("ddtree", "custom", "my-policy", "topk") == "my-policy"


def test_colors_live_in_plots_not_in_the_schema():
    import experiments.bench.schema as schema

    assert not hasattr(schema, "METHOD_COLORS") and not hasattr(schema, "VARIANT_COLORS")


def test_lookup_trees_have_their_own_resume_key_and_share():
    from experiments.bench.schema import lookup_share

    plain = make_record(budget=16, policy="fixed")
    lookup = make_record(budget=16, policy="lookup", acceptance_lengths=[3, 1, 4], extra={"lookup_tokens": 2})
    assert plain.record_key() == ("gsm8k", "17", 0, "ddtree", 16, 0.0)
    assert lookup.record_key() == plain.record_key() + ("lookup",)
    assert record_key("gsm8k", "17", 0, Variant.parse("ddtree+lookup:B=16"), 0.0) == lookup.record_key()
    assert SampleRecord.from_json(lookup.to_json()) == lookup
    assert lookup_share([plain, lookup]) == pytest.approx(2 / 8)  # records without the key do not count
    assert lookup_share([plain]) is None


def test_chain_auto_is_dflash_and_old_records_are_read_as_such():
    old = json.loads(make_record().to_json())
    del old["variant"]  # a version-1 record, written when chain-auto was filed under DDTree
    old.update(method="ddtree", budget="chain-auto", policy="chain-auto", tree="topk", schema_version=1)
    back = SampleRecord.from_dict(old)
    assert (back.method, back.budget, back.policy, back.tree) == ("dflash", "chain-auto", "chain-auto", None)
    assert back.record_key() == ("gsm8k", "17", 0, "dflash", "chain-auto", 0.0)
    assert method_label(back.method, back.policy, back.budget, back.tree) == "DFlash (auto)"


def test_schema_imports_neither_torch_nor_numpy():
    code = "import sys, experiments.bench.schema; print('torch' in sys.modules, 'numpy' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, check=True).stdout
    assert out.split() == ["False", "False"]


def test_the_torch_free_schema_names_the_library_s_tree_kinds_and_budget_words():
    """``experiments.bench.schema`` must stay importable without torch (plots read it), so it spells the tree kinds out;
    this keeps that copy equal to the library's."""
    from ddtree.generate import BUDGET_WORDS, TREE_KINDS
    from experiments.bench.presets import BUDGET_POLICIES
    from experiments.bench.schema import TREE_KINDS as SCHEMA_TREE_KINDS

    assert SCHEMA_TREE_KINDS == TREE_KINDS and set(BUDGET_POLICIES) < set(BUDGET_WORDS)


EVERY_VARIANT = [
    Variant("ar"), Variant("pld"), Variant("dflash"), Variant("dflash", "chain-auto"), Variant("ddtree", 8),
    Variant("ddtree", 32), Variant("ddtree", "auto"), Variant("ddtree", 8, "sampled"),
    Variant("ddtree", 16, lookup=True), Variant("ddtree", "auto", lookup=True),
    Variant("ddtree", "mine", policy_class="my_pkg.policies:Mine"),
]


def test_every_variant_has_one_canonical_name_that_parses_back():
    names = [v.name for v in EVERY_VARIANT]
    assert names == ["ar", "pld", "dflash", "dflash:chain-auto", "ddtree:B=8", "ddtree:B=32", "ddtree:auto",
                     "ddtree-sampled:B=8", "ddtree+lookup:B=16", "ddtree+lookup:auto",
                     "policy:mine=my_pkg.policies:Mine"]
    assert [Variant.parse(name) for name in names] == EVERY_VARIANT
    assert len({v.label for v in EVERY_VARIANT}) == len({v.key for v in EVERY_VARIANT}) == len(EVERY_VARIANT)
    assert sorted(reversed(EVERY_VARIANT), key=lambda v: v.sort_key)[:4] == EVERY_VARIANT[:1] + EVERY_VARIANT[2:4] + [
        Variant("ddtree", 8)]  # AR, DFlash (plain, then auto), then DDTree by budget


@pytest.mark.parametrize("name, fix", [("ddtree:B=x", "integer"), ("ddtree:", "empty budget"),
                                       ("tree:B=3", "unknown"), ("ddtree+lookup:chain-auto", "lookup branches"),
                                       ("ar:B=3", "no budget")])
def test_a_bad_variant_name_says_what_is_wrong(name, fix):
    with pytest.raises(ValueError, match=fix):
        Variant.parse(name)


def test_a_record_stores_its_variant_once_and_version_1_lines_still_load(tmp_path):
    """The record's one identity field is ``variant``; method / budget / policy / tree in its JSON are derived copies
    (ignored when read). Literal version-1 lines -- each kind of variant, a user policy whose class sat in ``extra``
    -- load to the spec and keep their old resume keys, so an old run folder resumes and plots."""
    record = make_record(method="ddtree", budget=16, policy="fixed", tree="sampled")  # the version-1 keywords
    assert record == SampleRecord(**{**vars(record), "variant": Variant("ddtree", 16, "sampled")})
    data = json.loads(record.to_json())
    assert data["variant"] == "ddtree-sampled:B=16" and data["schema_version"] == 2
    data.update(method="ar", budget=None)  # derived copies never override the variant
    assert SampleRecord.from_dict(data) == record
    common = ('"dataset":"gsm8k","sample_id":"1","turn":0,"temperature":0.0,"num_input_tokens":5,'
              '"num_new_tokens":4,"prefill_s":0.0,"decode_s":0.1,"schema_version":1')
    old = {
        '"method":"ar","budget":null,"policy":"ar"': ("ar", ("ar", None)),
        '"method":"ddtree","budget":32,"policy":"fixed"': ("ddtree:B=32", ("ddtree", 32)),
        '"method":"ddtree","budget":32,"policy":"fixed","tree":"sampled"': ("ddtree-sampled:B=32",
                                                                           ("ddtree", 32, "sampled")),
        '"method":"ddtree","budget":"auto","policy":"lookup","tree":"topk"': ("ddtree+lookup:auto",
                                                                             ("ddtree", "auto", "lookup")),
        '"method":"ddtree","budget":"mine","policy":"custom","extra":{"policy_class":"p:C"}': ("policy:mine=p:C",
                                                                                              ("ddtree", "mine")),
        '"method":"ddtree","budget":"mine","policy":"custom"': ("policy:mine", ("ddtree", "mine")),
    }
    path = tmp_path / "records.jsonl"
    path.write_text("".join("{" + common + "," + fields + "}\n" for fields in old))
    records = read_records(path)
    assert [(r.variant, r.record_key()[3:5] + r.record_key()[6:]) for r in records] == list(old.values())
    assert all(r.schema_version == 2 and "policy_class" not in r.extra for r in records)
    assert [r.spec.label for r in records] == ["AR", "DDTree (B=32)", "DDTree sampled (B=32)", "DDTree+lookup (auto)",
                                               "mine", "mine"]
