"""Benchmark presets: frozen configurations for ``python -m experiments.benchmark --preset NAME``.

* ``default`` -- the embedded offline pair (SmolLM2-135M-Instruct + the shipped drafter) on this kind of 2-core CPU:
  all six offline datasets, a few samples each, AR + DFlash + DDTree at budgets 2/4/8/16/32/64 (+ ``auto`` and
  ``chain-auto``), greedy.
  Sized so that ``bash run_benchmark.sh`` on a fresh clone, setup included, ends within 15 minutes.
* ``quick``   -- a smoke test of the same path in well under 3 minutes.
* ``sampling``-- the same pair at T = 1: the deterministic top-K tree (sample-and-match) next to the sampled tree
  (recursive rejection sampling) at budgets 16 and 32, ``auto`` (top-K), AR and DFlash, on the six offline datasets;
  ~15 minutes.
* ``paper``   -- the DDTree paper's grid on CUDA (Qwen3-4B/8B, Qwen3-Coder-30B-A3B with the z-lab drafters,
  10 datasets, budgets 16..1024, T in {0, 1}); launch with ``torchrun --nproc_per_node=<gpus>``.
* ``tiny``    -- random tiny models built from configs (no files at all); what the tests run.

Command-line flags override single fields (:func:`with_overrides`); the resolved preset is stored in the run's
manifest so a run folder says exactly what was measured.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from experiments.datasets import KNOWN_DATASETS, OFFLINE_DATASETS, canonical_name
from experiments.schema import METHODS, TREE_KINDS

__all__ = ["ModelPair", "Preset", "PRESETS", "DTYPES", "BUDGET_POLICIES", "TREE_KINDS", "get_preset",
           "with_overrides"]

DTYPES = ("auto", "bf16", "fp16", "fp32", "fp64")
BUDGET_POLICIES = ("auto", "chain-auto")  # string budgets the runner knows, besides integer node budgets


@dataclass(frozen=True)
class ModelPair:
    """One target and its drafter.

    ``target``: ``"default"`` (embedded SmolLM2-135M-Instruct), ``"tiny"`` (a random tiny Llama with a byte
    tokenizer, built from a config), or a Hugging Face id / local folder. ``draft``: ``"default"`` (the shipped
    drafter), ``"random"`` (a random DFlash drafter shaped for the target: checks the code path, no speedup), or a
    DFlash checkpoint folder / hub id. ``name`` is the run's subfolder when a preset holds several pairs.
    ``device_map="auto"`` spreads a target that does not fit one GPU over several (under torchrun: over the GPUs
    of the rank's share). ``chat_template_kwargs`` go to the tokenizer's chat template (Qwen3: no thinking).
    """

    target: str
    draft: str
    name: str = ""
    device_map: str | None = None
    chat_template_kwargs: tuple[tuple[str, Any], ...] = ()

    @property
    def slug(self) -> str:
        return self.name or self.target.rstrip("/").split("/")[-1].lower()


@dataclass(frozen=True)
class Preset:
    """Everything a benchmark run measures. ``budgets`` are DDTree node budgets (ints) or policies (``"auto"``);
    budgets listed in ``optional_budgets`` are dropped with a note when the installed ``ddtree`` lacks them.
    ``trees``: DDTree tree kinds measured at every budget (``"sampled"`` at the int budgets only).
    ``samples_per_dataset`` overrides ``max_samples`` for single datasets; ``warmup_tokens`` is the length of the
    untimed warm-up generation each method variant gets before anything is timed. ``time_budget_s``: after the
    warm-up the runner projects the decoding time on this machine and, when it exceeds the budget, leaves work out by
    a fixed rule (``experiments.benchmark.size_run``) and says what; ``--full`` runs everything. ``cpu_kernels``:
    how the models' linear layers multiply on a CPU (``auto``: the faster of ``torch`` and oneDNN-``packed`` on this
    machine, measured once; see ``dflash_core.cpu_kernels``)."""

    name: str
    description: str
    models: tuple[ModelPair, ...]
    datasets: tuple[str, ...]
    max_samples: int
    max_new_tokens: int
    methods: tuple[str, ...] = ("ar", "dflash", "ddtree")
    budgets: tuple[int | str, ...] = (8, 16, 32, 64)
    trees: tuple[str, ...] = ("topk",)
    temperatures: tuple[float, ...] = (0.0,)
    dtype: str = "auto"
    seed: int = 0
    samples_per_dataset: tuple[tuple[str, int], ...] = ()
    optional_budgets: tuple[str, ...] = ()
    warmup_tokens: int = 16
    device: str = "auto"  # "auto" = CUDA when available, else CPU
    time_budget_s: float | None = None  # decoding time the run is sized to on the machine at hand (None: run all)
    cpu_kernels: str = "torch"  # linear kernels on a CPU: torch, packed or auto (dflash_core.cpu_kernels)

    def __post_init__(self) -> None:
        problems = self.problems()
        if problems:
            raise ValueError(f"preset {self.name!r}: " + "; ".join(problems))
        object.__setattr__(self, "datasets", tuple(canonical_name(d) for d in self.datasets))
        object.__setattr__(self, "temperatures", tuple(float(t) for t in self.temperatures))

    def problems(self) -> list[str]:
        """What is wrong with this preset (empty when valid)."""
        out = []
        if not self.models:
            out.append("no target/draft pair")
        if len({pair.slug for pair in self.models}) != len(self.models):
            out.append("model pairs need distinct names")
        for name in self.datasets:
            try:
                canonical_name(name)
            except ValueError as err:
                out.append(str(err))
        if not self.datasets:
            out.append("no datasets")
        bad = [m for m in self.methods if m not in METHODS]
        if bad or not self.methods:
            out.append(f"methods must be a non-empty subset of {METHODS}, got {list(self.methods)}")
        for b in self.budgets:
            if isinstance(b, bool) or not (isinstance(b, int) and b >= 0 or b in BUDGET_POLICIES):
                out.append(f"budget {b!r} is neither an int >= 0 nor one of {BUDGET_POLICIES}")
        if len(set(self.budgets)) != len(self.budgets):
            out.append(f"repeated budgets in {list(self.budgets)}")
        if "ddtree" in self.methods and not self.budgets:
            out.append("method ddtree needs at least one budget")
        if not self.trees or any(t not in TREE_KINDS for t in self.trees) or len(set(self.trees)) != len(self.trees):
            out.append(f"trees must be distinct entries of {TREE_KINDS}, got {list(self.trees)}")
        if "sampled" in self.trees and not any(isinstance(b, int) and not isinstance(b, bool) for b in self.budgets):
            out.append("the sampled tree needs at least one int budget")
        if any(t < 0 for t in self.temperatures) or not self.temperatures:
            out.append(f"temperatures must be >= 0 (0 = greedy), got {list(self.temperatures)}")
        if self.dtype not in DTYPES:
            out.append(f"dtype {self.dtype!r} is not one of {DTYPES}")
        if self.max_samples < 1 or self.max_new_tokens < 1 or self.warmup_tokens < 1:
            out.append("max_samples, max_new_tokens and warmup_tokens must be >= 1")
        if self.cpu_kernels not in ("torch", "packed", "auto"):
            out.append(f"cpu_kernels must be torch, packed or auto, got {self.cpu_kernels!r}")
        if self.time_budget_s is not None and self.time_budget_s <= 0:
            out.append("time_budget_s must be > 0 (or None: no sizing)")
        if any(n < 1 for _, n in self.samples_per_dataset):
            out.append("samples_per_dataset entries must be >= 1")
        return out

    def samples_for(self, dataset: str) -> int:
        return dict(self.samples_per_dataset).get(dataset, self.max_samples)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


_SMOLLM2 = ModelPair("default", "default", name="smollm2-135m")

# Time budget on this 2-core CPU in bf16, from the verify costs in FACTS §3 (one forward: 22 ms for 1 token, 28 ms
# for 16, 37 ms for 32, 52 ms for 64) plus ~5-10 ms of drafter and bookkeeping per round. 6 datasets x 2 samples + 2
# MT-Bench second turns = 14 turns x 10 variants x 128 tokens at ~4-5 s per generation with the shipped drafter is
# ~10-12 min of decoding, plus prefill, warm-up and the cost measurement of `auto` (~1 min), first-time setup and the
# figures; where the machine is slower the run sizes itself (`time_budget_s`, experiments.benchmark.size_run).
# The fixed budgets 2..64 are the set issue 11 scores `auto` against: the best of them per dataset, chosen after the
# fact (the oracle), interleaved in one run with `auto` and `chain-auto` (DFlash with a chosen chain length).
DEFAULT = Preset(
    name="default",
    description="embedded SmolLM2-135M pair on CPU: 6 offline datasets x 2 samples, 128 tokens, T=0",
    models=(_SMOLLM2,),
    datasets=OFFLINE_DATASETS,
    max_samples=2,
    max_new_tokens=128,
    budgets=(2, 4, 8, 16, 32, 64, "auto", "chain-auto"),
    optional_budgets=("auto", "chain-auto"),
    time_budget_s=720.0,  # 12 min of decoding; with setup, warm-up and the figures: 15 min
    cpu_kernels="auto",
)

QUICK = Preset(
    name="quick",
    description="smoke test: gsm8k + mt-bench (two turns) x 1 sample, 64 tokens, AR / DFlash / DDTree B=16",
    models=(_SMOLLM2,),
    datasets=("gsm8k", "mt-bench"),
    max_samples=1,
    max_new_tokens=64,
    budgets=(16,),
    warmup_tokens=8,
    time_budget_s=120.0,
    cpu_kernels="auto",
)

_QWEN3_CHAT = (("enable_thinking", False),)
# The DDTree paper's grid: 3 pairs x 10 datasets x T in {0, 1}, 2048 new tokens. Sample counts follow the reference
# harness, capped by each dataset's benchmark split (experiments.datasets.BENCHMARK_POOL_SIZE).
PAPER = Preset(
    name="paper",
    description="DDTree paper grid on CUDA: Qwen3-4B/8B + Qwen3-Coder-30B-A3B, 10 datasets, B=16..1024, T in {0,1}",
    models=(
        ModelPair("Qwen/Qwen3-4B", "z-lab/Qwen3-4B-DFlash-b16", name="qwen3-4b", chat_template_kwargs=_QWEN3_CHAT),
        ModelPair("Qwen/Qwen3-8B", "z-lab/Qwen3-8B-DFlash-b16", name="qwen3-8b", chat_template_kwargs=_QWEN3_CHAT),
        ModelPair("Qwen/Qwen3-Coder-30B-A3B-Instruct", "z-lab/Qwen3-Coder-30B-A3B-DFlash", name="qwen3-coder-30b-a3b",
                  device_map="auto"),
    ),
    datasets=KNOWN_DATASETS,
    max_samples=128,
    samples_per_dataset=(("aime24", 30), ("aime25", 30), ("humaneval", 164), ("mt-bench", 80)),
    max_new_tokens=2048,
    budgets=(16, 32, 64, 128, 256, 512, 1024, "auto"),
    optional_budgets=("auto",),
    temperatures=(0.0, 1.0),
    dtype="bf16",
    warmup_tokens=32,
    device="cuda",
)

# Tests: random tiny models from configs, fp32 so greedy speculative outputs must equal AR's exactly.
TINY = Preset(
    name="tiny",
    description="random tiny Llama + random drafter built from configs (tests; no files)",
    models=(ModelPair("tiny", "random", name="tiny"),),
    datasets=("gsm8k", "mt-bench"),
    max_samples=2,
    max_new_tokens=12,
    budgets=(4, 16),
    dtype="fp32",
    warmup_tokens=4,
)

# T = 1 on the default pair: is a sampled tree (children drawn from the drafter, recursive rejection sampling) better
# than the deterministic top-K tree (sample-and-match) at the same budget, and what does `auto` choose at T = 1? Seven
# variants (AR, DFlash, top-K and sampled at B = 16 and 32, auto) x 14 turns (6 datasets x 2 samples + 2 MT-Bench
# second turns) x 128 tokens = 98 generations at ~5-6 s each (at T = 1 acceptance is lower than at T = 0): ~9 min of
# decoding; the run sizes itself to the 12-minute budget on slower machines.
SAMPLING = Preset(
    name="sampling",
    description="embedded SmolLM2-135M pair on CPU, T=1: top-K vs sampled trees at B=16/32, 6 datasets x 2 samples",
    models=(_SMOLLM2,),
    datasets=OFFLINE_DATASETS,
    max_samples=2,
    max_new_tokens=128,
    budgets=(16, 32, "auto"),
    optional_budgets=("auto",),
    trees=("topk", "sampled"),
    temperatures=(1.0,),
    time_budget_s=720.0,
    cpu_kernels="auto",
)

PRESETS: dict[str, Preset] = {p.name: p for p in (DEFAULT, QUICK, SAMPLING, PAPER, TINY)}


def get_preset(name: str) -> Preset:
    try:
        return PRESETS[name]
    except KeyError:
        raise ValueError(f"unknown preset {name!r}; known presets: {', '.join(PRESETS)}") from None


def with_overrides(preset: Preset, *, target: str | None = None, draft: str | None = None,
                   **fields: Any) -> Preset:
    """A copy of ``preset`` with the given fields replaced (None = keep). ``target``/``draft`` replace the model
    pairs by one pair (the other half taken from the preset's first pair); explicitly given budgets are never
    optional."""
    changes = {k: v for k, v in fields.items() if v is not None}
    if target is not None or draft is not None:
        first = preset.models[0]
        same_target = target is None or target == first.target
        pair = ModelPair(target if target is not None else first.target, draft if draft is not None else first.draft,
                         name=first.name if same_target else "",
                         device_map=first.device_map if same_target else None,
                         chat_template_kwargs=first.chat_template_kwargs if same_target else ())
        changes["models"] = (pair,)
    if "budgets" in changes:
        changes.setdefault("optional_budgets", ())
    if "datasets" in changes:
        changes["datasets"] = tuple(canonical_name(d) for d in changes["datasets"])
    if "max_samples" in changes:  # an explicit sample count applies to every dataset
        changes.setdefault("samples_per_dataset", ())
    return dataclasses.replace(preset, **changes)
