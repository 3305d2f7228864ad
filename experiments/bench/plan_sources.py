"""What the dry run (:mod:`experiments.bench.plan`) finds here without loading anything: the datasets of a preset
(offline ones loaded from their installed packages, hub ones checked without contacting the hub) and the devices.

A hub dataset is checked on its own: the package its loader needs (``huggingface_hub`` for livecodebench's JSONL files,
``datasets`` for the others; see :mod:`dflash_core.training.pools.catalog`) and, when an offline switch is set,
whether its repository has a folder in the local Hugging Face cache. Cheap: no network, no download, only a folder
looked up.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from importlib.util import find_spec
from pathlib import Path
from typing import Any

# Each hub dataset's repository and the package its loader in dflash_core/training/pools/catalog.py reads it with.
_HUB_SOURCES = {"mbpp": ("google-research-datasets/mbpp", "datasets"),
                "livecodebench": ("livecodebench/code_generation_lite", "huggingface_hub"),
                "swe-bench": ("princeton-nlp/SWE-bench_Lite", "datasets"),
                "alpaca": ("tatsu-lab/alpaca", "datasets")}
# Any of these keeps the loaders off the network (huggingface_hub reads TRANSFORMERS_OFFLINE as HF_HUB_OFFLINE).
_OFFLINE_SWITCHES = ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE", "TRANSFORMERS_OFFLINE")
_HUB_NOTE = ("not contacted by the dry run (the run leaves it out with a note if unreachable, or stops when named "
             "with --datasets / --hub-datasets)")


@dataclass
class DatasetPlan:
    name: str
    source: str  # "offline" or "hub"
    status: str  # "available", "unavailable", "skipped" (hub-only, not asked for)
    detail: str = ""
    prompts: int = 0
    turns: int = 0
    longest_prompt_chars: int = 0
    items: list | None = None


def dataset_plans(preset, seed: int | None = None) -> list[DatasetPlan]:
    """Every dataset of the preset's grid: the ones it runs (loaded offline, or checked for the hub without
    contacting it) and its hub-only ones it leaves out."""
    from dflash_core.training.pools.catalog import HUB_DATASETS, select_items
    from dflash_core.training.pools.items import DatasetUnavailableError

    out = []
    for name in preset.datasets:
        if name in HUB_DATASETS:  # loading it would ask the hub: say so, do not ask
            out.append(_hub_plan(name))
            continue
        try:
            items = select_items(name, preset.samples_for(name), preset.seed if seed is None else seed)
        except DatasetUnavailableError as err:
            out.append(DatasetPlan(name, "offline", "unavailable", str(err)))
            continue
        out.append(DatasetPlan(name, "offline", "available", "installed", len(items),
                               sum(len(i.turns) for i in items),
                               max((sum(len(t) for t in i.turns) for i in items), default=0), items))
    for name in preset.hub_datasets:
        out.append(DatasetPlan(name, "hub", "skipped", "needs the Hugging Face Hub: left out (ask with "
                               "--hub-datasets)"))
    return out


def _hub_plan(name: str) -> DatasetPlan:
    """A hub dataset the preset runs: unavailable when :func:`_hub_blocked` says why, else what it would read."""
    blocked = _hub_blocked(name)
    if blocked:
        return DatasetPlan(name, "hub", "unavailable", blocked)
    cached = _hub_cached(name)
    if cached is None:
        return DatasetPlan(name, "hub", "available", f"needs the Hugging Face Hub; {_HUB_NOTE}")
    switch = _offline_switch()
    where = f"{switch} is set: read from its copy in the local Hugging Face cache" if switch else (
        "needs the Hugging Face Hub (a copy is in the local Hugging Face cache)")
    return DatasetPlan(name, "hub", "available", f"{where} ({cached}); {_HUB_NOTE}")


def _offline_switch() -> str | None:
    """The first offline switch that is set, else None."""
    return next((v for v in _OFFLINE_SWITCHES
                 if os.environ.get(v, "").strip().lower() in ("1", "true", "yes", "on")), None)


def _hub_cached(name: str) -> Path | None:
    """The folder of the dataset's repository in the local Hugging Face cache, when there is one (its files are
    not read: a folder means the loader may find what it needs there)."""
    from experiments.bench.models import hub_cache_dir

    repo = _HUB_SOURCES.get(name, (None, None))[0]
    if repo is None:
        return None
    folder = hub_cache_dir() / ("datasets--" + repo.replace("/", "--"))
    return folder if folder.is_dir() else None


def _hub_blocked(name: str) -> str:
    """Why hub dataset ``name`` cannot load here ('' when it might): the package its loader needs is not
    installed, or an offline switch is set and its repository is not in the local Hugging Face cache."""
    from experiments.bench.models import hub_cache_dir

    package = _HUB_SOURCES.get(name, (None, "datasets"))[1]
    if find_spec(package) is None:
        extra = " (the hub extra)" if package == "datasets" else ""
        return f"needs the Hugging Face Hub and the `{package}` package{extra}, which is not installed"
    switch = _offline_switch()
    if switch and _hub_cached(name) is None:
        return (f"needs the Hugging Face Hub, and {switch} is set (it is not in the local Hugging Face cache "
                f"{hub_cache_dir()})")
    return ""


def _devices(preset) -> dict[str, Any]:
    import torch

    info: dict[str, Any] = {"cuda": torch.cuda.is_available(), "gpus": []}
    if info["cuda"]:
        for i in range(torch.cuda.device_count()):
            props = torch.cuda.get_device_properties(i)
            info["gpus"].append({"index": i, "name": props.name, "memory": int(props.total_memory)})
    world = int(os.environ.get("WORLD_SIZE") or 0)
    if not world:  # what run_benchmark.sh would launch
        world = len(info["gpus"]) if preset.name == "paper" and len(info["gpus"]) > 1 else 1
    info["world"] = world
    wants_cuda = preset.device == "cuda" or (preset.device == "auto" and info["cuda"])
    info["kind"] = "cuda" if wants_cuda else "cpu"
    return info
