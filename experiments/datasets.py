"""Benchmark prompts: the pools, the benchmark/training split and chat prompts.

The code lives in :mod:`dflash_core.data`, which the training recipe shares (so that it never imports
``experiments``); this module keeps the benchmark's import path. See that module for the offline packages, the hub
datasets and how the split is drawn, and :mod:`dflash_core.grounded` for the input-grounded set (``grounded``).
"""

from __future__ import annotations

import importlib.util  # noqa: F401  (kept as an attribute: tests patch importlib.util.find_spec through it)

from dflash_core.data import (  # noqa: F401
    BENCHMARK_POOL_SIZE, HUB_DATASETS, HUMANEVAL_PROMPT, KNOWN_DATASETS, LIVECODEBENCH_FILES, MATH_PROMPT,
    OFFLINE_DATASETS, SWE_BENCH_PROMPT, BenchmarkItem, DatasetUnavailableError, _pool, benchmark_pool_ids,
    benchmark_split, build_chat, canonical_name, format_alpaca, format_humaneval, format_livecodebench, format_math,
    load_dataset, select_items, training_split,
)

__all__ = [
    "BENCHMARK_POOL_SIZE", "HUB_DATASETS", "KNOWN_DATASETS", "LIVECODEBENCH_FILES", "OFFLINE_DATASETS",
    "SWE_BENCH_PROMPT", "BenchmarkItem", "DatasetUnavailableError", "benchmark_pool_ids", "benchmark_split",
    "build_chat", "canonical_name", "format_alpaca", "format_humaneval", "format_livecodebench", "format_math",
    "load_dataset", "select_items", "training_split",
]
