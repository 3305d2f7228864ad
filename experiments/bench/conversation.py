"""The run's units of work: a conversation is one benchmark item at one temperature, its turns run in order.

Its own module because the session (which runs conversations) and the sizing (which decides how many of them fit)
both speak of it, and neither should import the other for it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from dflash_core.training.pools.catalog import select_items
from dflash_core.training.pools.items import BenchmarkItem, DatasetUnavailableError
from experiments.bench.console import log
from experiments.bench.presets import Preset

__all__ = ["Conversation", "conversations", "benchmark_prompts"]


@dataclass(frozen=True)
class Conversation:
    """One benchmark item at one temperature; its turns run in order (MT-Bench: 2)."""

    item: BenchmarkItem
    temperature: float
    index: int  # position in the run's global order (ranks take every world-th)
    max_turns: int | None = None  # a sized run may keep only the first turns (None: all of them)

    @property
    def num_turns(self) -> int:
        """The turns this run measures: the item's, or its first ``max_turns``."""
        n = len(self.item.turns)
        return n if self.max_turns is None else min(n, self.max_turns)


def conversations(preset: Preset, required: Sequence[str] = ()) -> tuple[list[Conversation], dict[str, str]]:
    """The run's conversations in their global order, and {dataset: why} of the datasets left out as unavailable.

    A dataset that cannot be loaded here (``DatasetUnavailableError``: a package not installed, a hub dataset on an
    offline machine) is left out with a note, unless it is in ``required`` (named by the user): then it raises.
    """
    items: dict[str, list[BenchmarkItem]] = {}
    unavailable: dict[str, str] = {}
    for dataset in preset.datasets:
        try:
            items[dataset] = select_items(dataset, preset.samples_for(dataset), preset.seed)
        except DatasetUnavailableError as err:
            if dataset in required:
                raise DatasetUnavailableError(f"dataset {dataset!r} (asked for with --datasets) is unavailable "
                                              f"here: {err}") from err
            unavailable[dataset] = str(err)
            log(f"note: dataset {dataset!r} is unavailable here and left out: {err}")
    if not items:
        raise DatasetUnavailableError(f"none of the datasets {', '.join(preset.datasets)} is available here")
    out: list[Conversation] = []
    for temperature in preset.temperatures:
        for dataset, selected in items.items():
            for item in selected:
                out.append(Conversation(item, temperature, len(out)))
    return out, unavailable


def benchmark_prompts(tokenizer, datasets: Sequence[str], max_samples: int, seed: int = 0,
                      chat_template_kwargs: dict | None = None) -> tuple[list[list[int]], list[dict]]:
    """(input id lists, labels) of the first turns of the benchmark's selection, chat template as the benchmark's:
    the prompts of the throughput mode and of the studies that compare generators side by side."""
    from dflash_core.training.pools.catalog import build_chat

    prompts, labels = [], []
    for name in datasets:
        for item in select_items(name, max_samples, seed):
            prompts.append(build_chat(tokenizer, item.turns[:1], chat_template_kwargs=chat_template_kwargs))
            labels.append({"dataset": item.dataset, "sample_id": item.sample_id})
    return prompts, labels
