"""Benchmark presets: frozen configurations for ``python -m experiments.bench --preset NAME``.

* ``default`` -- the embedded offline pair (SmolLM2-135M-Instruct + the shipped drafter) on this kind of 2-core CPU:
  all seven offline datasets (the six of the papers and the input-grounded set), six prompts each, greedy. Live: AR,
  DFlash, DDTree at B=8 and B=16, ``auto``, prompt lookup (PLD) and DDTree with lookup branches under ``auto``
  (``--full`` adds B=2/4/32/64, ``chain-auto`` and DDTree+lookup at B=16). Replayed on plain decoding's own text
  (:mod:`experiments.bench.replayer`): every budget 2..64, ``auto``, the chain, PLD and the lookup trees, priced by the
  machine's cost curve. Sized so that ``bash run_benchmark.sh`` on a fresh clone ends within 15 minutes, setup
  excluded.
* ``quick``   -- a smoke test of the same path in well under 3 minutes.
* ``sampling``-- the same pair at T = 1: the deterministic top-K tree (sample-and-match) next to the sampled tree
  (recursive rejection sampling) at budgets 16 and 32, ``auto`` (top-K), AR and DFlash, on the seven offline datasets,
  six prompts each; the top-K budgets 2..64, ``auto`` and the chain replayed on plain decoding's sampled text.
* ``paper``   -- the DDTree paper's grid on CUDA (Qwen3-4B/8B, Qwen3-Coder-30B-A3B with the z-lab drafters,
  budgets 16..1024, T in {0, 1}; beside them the hybrid Qwen3.5-27B with its z-lab drafter, trees up to 64 nodes): the six offline datasets by default, the four hub-only ones when asked
  (``with_overrides(..., include_hub=True)``, ``bash run_benchmark.sh --hub-datasets``); sized to an hour of
  decoding per model pair (``--full``: the whole grid); ``bash run_benchmark.sh --preset paper --dry-run`` prints
  the plan (:mod:`experiments.bench.plan`). ``run_benchmark.sh`` launches it under torchrun over all visible GPUs.
* ``tiny``    -- random tiny models built from configs (no files at all); what the tests run.

Command-line flags override single fields (:func:`with_overrides`); the resolved preset is stored in the run's
manifest so a run folder says exactly what was measured. A ``--target`` that names one of the preset's targets --
its hub id, a local folder of that name (``/weights/Qwen3-8B``) or its Hugging Face cache snapshot
(``.../models--Qwen--Qwen3-8B/snapshots/<rev>``) -- keeps that pair's drafter, name, device map and chat settings
(:func:`matching_pair`).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from ddtree.generate import BUDGET_WORDS
from dflash_core.cpu_kernels import KERNEL_CHOICES
from dflash_core.sampling import Sampling
from dflash_core.training.pools.catalog import HUB_DATASETS, KNOWN_DATASETS, OFFLINE_DATASETS, canonical_name
from experiments.bench.schema import METHODS, TREE_KINDS

__all__ = ["ModelPair", "Preset", "PRESETS", "DTYPES", "BUDGET_POLICIES", "TREE_KINDS", "get_preset",
           "hub_repo_of", "matching_pair", "with_overrides"]

DTYPES = ("auto", "bf16", "fp16", "fp32", "fp64")
# string budgets the runner measures besides integer node budgets ("chain" is DFlash itself: method "dflash")
BUDGET_POLICIES = tuple(word for word in BUDGET_WORDS if word != "chain")


@dataclass(frozen=True)
class ModelPair:
    """One target and its drafter.

    ``target``: ``"default"`` (embedded SmolLM2-135M-Instruct), ``"tiny"`` (a random tiny Llama with a byte
    tokenizer, built from a config), or a Hugging Face id / local folder. ``draft``: ``"default"`` (the shipped
    drafter), ``"random"`` (a random DFlash drafter shaped for the target: checks the code path, no speedup), or a
    DFlash checkpoint folder / hub id. ``name`` is the run's subfolder when a preset holds several pairs.
    ``device_map="auto"`` spreads a target that does not fit one GPU over several (under torchrun: over the GPUs
    of the rank's share). ``chat_template_kwargs`` go to the tokenizer's chat template (Qwen3: no thinking).
    ``max_budget``: int node budgets above it are left out for this pair (a hybrid target keeps one recurrent state
    per tree node and linear layer, which bounds the tree a GPU can verify).
    """

    target: str
    draft: str
    name: str = ""
    device_map: str | None = None
    chat_template_kwargs: tuple[tuple[str, Any], ...] = ()
    max_budget: int | None = None

    def keeps(self, budget) -> bool:
        """Whether this pair runs a variant of node budget ``budget`` (an int, or a policy name: always)."""
        fixed = isinstance(budget, int) and not isinstance(budget, bool)
        return not (fixed and self.max_budget is not None and budget > self.max_budget)

    @property
    def slug(self) -> str:
        return self.name or self.target.rstrip("/").split("/")[-1].lower()


@dataclass(frozen=True)
class Preset:
    """Everything a benchmark run measures. ``budgets`` are DDTree node budgets (ints) or policies (``"auto"``,
    ``"chain-auto"``).
    ``trees``: DDTree tree kinds measured at every budget (``"sampled"`` at the int budgets only).
    ``samples_per_dataset`` overrides ``max_samples`` for single datasets; ``warmup_tokens`` is the length of the
    untimed warm-up generation each method variant gets before anything is timed. ``time_budget_s``: after the
    warm-up the runner projects the decoding time on this machine and, when it exceeds the budget, leaves work out by
    a fixed rule (``experiments.bench.sizing.size_run``) and says what; ``--full`` runs everything. ``cpu_kernels``:
    how the models' linear layers multiply on a CPU (``auto``: the faster of ``torch`` and oneDNN-``packed`` on this
    machine, measured once; see ``dflash_core.cpu_kernels``). ``hub_datasets``: datasets of the preset's grid that
    need the Hugging Face Hub; they run only when asked (``with_overrides(preset, include_hub=True)``), ``datasets``
    is what runs."""

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
    warmup_tokens: int = 16
    device: str = "auto"  # "auto" = CUDA when available, else CPU
    time_budget_s: float | None = None  # decoding time the run is sized to on the machine at hand (None: run all)
    cpu_kernels: str = "torch"  # linear kernels on a CPU: torch, packed or auto (dflash_core.cpu_kernels)
    hub_datasets: tuple[str, ...] = ()  # the grid's hub-only datasets, left out unless asked for (include_hub)
    lookup_budgets: tuple[int | str, ...] = ()  # DDTree+lookup variants: int node budgets and/or "auto"
    full_budgets: tuple[int | str, ...] = ()  # measured live only with --full (:func:`with_overrides`, full=True)
    full_lookup_budgets: tuple[int | str, ...] = ()  # likewise for DDTree+lookup
    min_samples: int = 1  # sizing never leaves out samples below this many per dataset before anything else
    min_budgets: int = 1  # sizing keeps at least this many DDTree fixed budgets live
    replay_budgets: tuple[int | str, ...] = ()  # replayed on plain decoding's text: ints, "auto", "chain"
    replay_lookup_budgets: tuple[int | str, ...] = ()  # DDTree+lookup replayed (ints, "auto"); PLD with any
    top_k: int | None = None  # transformers' sampling filters at T > 0 (dflash_core.sampling); None = off
    top_p: float | None = None
    min_p: float | None = None
    enable_thinking: bool | None = None  # the chat template's thinking switch for every pair (None: the pair's)

    def __post_init__(self) -> None:
        problems = self.problems()
        if problems:
            raise ValueError(f"preset {self.name!r}: " + "; ".join(problems))
        object.__setattr__(self, "datasets", tuple(canonical_name(d) for d in self.datasets))
        object.__setattr__(self, "hub_datasets", tuple(canonical_name(d) for d in self.hub_datasets))
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
        for name in self.hub_datasets:
            try:
                if canonical_name(name) in [canonical_name(d) for d in self.datasets]:
                    out.append(f"dataset {name!r} is listed both as run and as hub-only")
            except ValueError as err:
                out.append(str(err))
        bad = [m for m in self.methods if m not in METHODS]
        if bad or not self.methods:
            out.append(f"methods must be a non-empty subset of {METHODS}, got {list(self.methods)}")
        for b in self.budgets:
            if isinstance(b, bool) or not (isinstance(b, int) and b >= 0 or b in BUDGET_POLICIES):
                out.append(f"budget {b!r} is neither an int >= 0 nor one of {BUDGET_POLICIES}")
        for b in self.lookup_budgets:
            if isinstance(b, bool) or not (isinstance(b, int) and b >= 0 or b == "auto"):
                out.append(f"lookup budget {b!r} is neither an int >= 0 nor 'auto'")
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
        if self.cpu_kernels not in KERNEL_CHOICES:
            out.append(f"cpu_kernels must be one of {', '.join(KERNEL_CHOICES)}, got {self.cpu_kernels!r}")
        if self.time_budget_s is not None and self.time_budget_s <= 0:
            out.append("time_budget_s must be > 0 (or None: no sizing)")
        if any(n < 1 for _, n in self.samples_per_dataset):
            out.append("samples_per_dataset entries must be >= 1")
        if self.min_samples < 1 or self.min_budgets < 1:
            out.append("min_samples and min_budgets must be >= 1")
        for b in self.full_budgets:
            if isinstance(b, bool) or not (isinstance(b, int) and b >= 0 or b in BUDGET_POLICIES):
                out.append(f"full budget {b!r} is neither an int >= 0 nor one of {BUDGET_POLICIES}")
        for b in (*self.full_lookup_budgets, *self.replay_lookup_budgets):
            if isinstance(b, bool) or not (isinstance(b, int) and b >= 0 or b == "auto"):
                out.append(f"lookup budget {b!r} is neither an int >= 0 nor 'auto'")
        try:
            Sampling.check(1.0, self.top_k, self.top_p, self.min_p)
        except ValueError as err:
            out.append(str(err))
        for b in self.replay_budgets:
            if isinstance(b, bool) or not (isinstance(b, int) and b >= 0 or b in ("auto", "chain")):
                out.append(f"replay budget {b!r} is neither an int >= 0 nor 'auto' or 'chain'")
        return out

    def samples_for(self, dataset: str) -> int:
        return dict(self.samples_per_dataset).get(dataset, self.max_samples)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


_SMOLLM2 = ModelPair("default", "default", name="smollm2-135m")

# Time budget on the slowest 2-core bf16 CPU seen (AMD EPYC Zen 4: plain decoding ~22 tokens/s, 45 ms a token; the
# Intel AMX machine is twice as fast). Per first turn at 48 new tokens (experiments.bench.sizing counts every part): the
# 7 live variants decode 48 tokens at 1 + 0.52 (DFlash) + 0.45 (B=8) + 0.44 (B=16) + 0.45 (auto) + 0.59 (PLD) + 0.40
# (lookup-auto) = 3.85 plain-decoding equivalents (the cost curve's round over the replayed tau), 8.4 s; 7 prefills
# ~1.4 s; 6 check forwards where an output left plain decoding's ~1.5 s; the replay of 11 policies ~1.8 s: ~13 s, so
# 7 datasets x 6 prompts = 42 first turns are ~9.2 min of the 12-minute budget, and the second turns of MT-Bench and
# grounded run where the rest allows (they go before any of the six prompts). 48 tokens leave room for a machine 25%
# slower than this one before a prompt goes; at 64 the first turns take ~11.4 min and at 96 ~15 min (the fresh-clone
# run at 96 tokens measured ~10% more per turn than this count). The sizing never drops below the 7 live variants
# (min_budgets=2 keeps B=8 and B=16). The main
# job's other ~3 minutes: loading, the drafter's cost curves (measured once per machine), the warm-up and the
# figures. What the live run no longer measures (budgets 2, 4, 32, 64, chain-auto, lookup B=16) is replayed on plain
# decoding's own text and priced by the measured curve: every budget on the same text, `auto` among them, so `auto`
# against the oracle is judged on equal terms (`--full` measures them live too).
DEFAULT = Preset(
    name="default",
    description="embedded SmolLM2-135M pair on CPU: 7 offline datasets x 6 prompts, 48 tokens, T=0, 7 live "
                "variants, every budget 2..64 replayed",
    models=(_SMOLLM2,),
    datasets=OFFLINE_DATASETS,
    max_samples=6,
    min_samples=6,
    min_budgets=2,
    warmup_tokens=32,
    max_new_tokens=48,
    methods=("ar", "dflash", "ddtree", "pld"),
    budgets=(8, 16, "auto"),
    lookup_budgets=("auto",),
    full_budgets=(2, 4, 32, 64, "chain-auto"),
    full_lookup_budgets=(16,),
    replay_budgets=("chain", 2, 4, 8, 16, 32, 64, "auto"),
    replay_lookup_budgets=(16, "auto"),
    time_budget_s=720.0,  # 12 min of decoding and replay; with the cost curves, warm-up and figures: 15 min
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
    replay_budgets=("chain", 4, 8, 16, 32, "auto"),
    time_budget_s=120.0,
    cpu_kernels="auto",
)

_QWEN3_CHAT = (("enable_thinking", False),)
# The DDTree paper's grid: 3 pairs x 10 datasets x T in {0, 1}, 2048 new tokens. Sample counts follow the reference
# harness, capped by each dataset's benchmark split (dflash_core.training.pools.catalog.BENCHMARK_POOL_SIZE). The six
# offline datasets run by default; mbpp, livecodebench, swe-bench and alpaca need the hub and run only when asked.
# The whole grid is far more than a session: ~560 turns per temperature x 10 variants x 2048 tokens is ~11 M tokens
# per pair (days on one H200), so like the CPU presets it is sized to the machine: after each pair's warm-up the
# runner projects the decoding time from measured seconds per token and keeps what fits one hour per pair by the
# stated rule (samples, then outer budgets, then trailing datasets; experiments.bench.sizing.size_run). `--full` runs
# everything; `--time-budget MIN` sets another budget. Note: the runner does not size a torchrun launch (world > 1).
_PAPER_OFFLINE = ("gsm8k", "math500", "aime24", "aime25", "humaneval", "mt-bench")  # the paper's offline six
PAPER = Preset(
    name="paper",
    description="DDTree paper grid on CUDA: Qwen3-4B/8B + Qwen3-Coder-30B-A3B, and the hybrid Qwen3.5-27B (B <= 64), "
                "6 offline datasets (+4 hub ones when asked), B=16..1024, T in {0,1}, 1 h of decoding per pair",
    models=(
        ModelPair("Qwen/Qwen3-4B", "z-lab/Qwen3-4B-DFlash-b16", name="qwen3-4b", chat_template_kwargs=_QWEN3_CHAT),
        ModelPair("Qwen/Qwen3-8B", "z-lab/Qwen3-8B-DFlash-b16", name="qwen3-8b", chat_template_kwargs=_QWEN3_CHAT),
        # a hybrid target (48 Gated DeltaNet + 16 gated full-attention layers): each tree node keeps ~149 MiB of
        # recurrent states, so trees stop at 64 nodes (9.7 GiB beside 54 GiB of bf16 weights on one 80 GB GPU)
        ModelPair("Qwen/Qwen3.5-27B", "z-lab/Qwen3.5-27B-DFlash", name="qwen3.5-27b", chat_template_kwargs=_QWEN3_CHAT,
                  max_budget=64),
        ModelPair("Qwen/Qwen3-Coder-30B-A3B-Instruct", "z-lab/Qwen3-Coder-30B-A3B-DFlash", name="qwen3-coder-30b-a3b",
                  device_map="auto"),
    ),
    datasets=_PAPER_OFFLINE,
    hub_datasets=HUB_DATASETS,
    max_samples=128,
    samples_per_dataset=(("aime24", 30), ("aime25", 30), ("humaneval", 164), ("mt-bench", 80)),
    max_new_tokens=2048,
    budgets=(16, 32, 64, 128, 256, 512, 1024, "auto"),
    temperatures=(0.0, 1.0),
    dtype="bf16",
    warmup_tokens=32,
    device="cuda",
    time_budget_s=3600.0,  # per model pair
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
    replay_budgets=("chain", 4, 16),
    dtype="fp32",
    warmup_tokens=4,
)

# T = 1 on the default pair: is a sampled tree (children drawn from the drafter, recursive rejection sampling) better
# than the deterministic top-K tree (sample-and-match) at the same budget, and what does `auto` choose at T = 1? Seven
# live variants (AR, DFlash, top-K and sampled at B = 16 and 32, auto) on 6 prompts per dataset; the run sizes itself
# to the 12-minute budget (second turns first). Replayed on plain decoding's sampled text (the rounds of
# sample-and-match: top-K trees, chains and lookups commit exactly plain decoding's draws): the chain, budgets 2..64
# and auto. Sampled trees verify by rejection sampling and are not replayed.
SAMPLING = Preset(
    name="sampling",
    description="embedded SmolLM2-135M pair on CPU, T=1: top-K vs sampled trees at B=16/32, 7 datasets x 6 prompts",
    models=(_SMOLLM2,),
    datasets=OFFLINE_DATASETS,
    max_samples=6,
    min_samples=6,
    min_budgets=2,
    warmup_tokens=32,
    max_new_tokens=48,
    budgets=(16, 32, "auto"),
    trees=("topk", "sampled"),
    temperatures=(1.0,),
    replay_budgets=("chain", 2, 4, 8, 16, 32, 64, "auto"),
    time_budget_s=720.0,
    cpu_kernels="auto",
)

PRESETS: dict[str, Preset] = {p.name: p for p in (DEFAULT, QUICK, SAMPLING, PAPER, TINY)}


def _by_size(budgets) -> list:
    """Int budgets in increasing order, then the policies in their given order."""
    ints = sorted(b for b in budgets if isinstance(b, int) and not isinstance(b, bool))
    return ints + [b for b in budgets if not (isinstance(b, int) and not isinstance(b, bool))]


def get_preset(name: str) -> Preset:
    try:
        return PRESETS[name]
    except KeyError:
        raise ValueError(f"unknown preset {name!r}; known presets: {', '.join(PRESETS)}") from None


def hub_repo_of(name: str) -> str | None:
    """The hub repo id a Hugging Face cache snapshot path stands for (``.../models--Qwen--Qwen3-8B/snapshots/<rev>``
    -> ``Qwen/Qwen3-8B``), else None."""
    parts = str(name).replace("\\", "/").rstrip("/").split("/")
    for i, part in enumerate(parts):
        if part.startswith("models--") and i + 2 < len(parts) and parts[i + 1] == "snapshots":
            return part.removeprefix("models--").replace("--", "/")
    return None


def matching_pair(preset: Preset, target: str) -> ModelPair | None:
    """The pair of ``preset`` that ``target`` stands for: its hub id, a cache snapshot of that repo, or a local
    folder named like the repo (``/weights/Qwen3-8B`` for ``Qwen/Qwen3-8B``; case-insensitive); None otherwise."""
    text = str(target).rstrip("/")
    for pair in preset.models:
        if text == pair.target:
            return pair
    repo = hub_repo_of(text)
    if repo is not None:
        return next((p for p in preset.models if p.target.lower() == repo.lower()), None)
    if "/" not in text and "\\" not in text:
        return None  # a bare word ("default", "tiny") or an unknown id
    last = text.replace("\\", "/").split("/")[-1].lower()
    found = [p for p in preset.models if "/" in p.target and p.target.split("/")[-1].lower() == last]
    return found[0] if len(found) == 1 else None


def with_overrides(preset: Preset, *, target: str | None = None, draft: str | None = None, include_hub: bool = False,
                   full: bool = False, **fields: Any) -> Preset:
    """A copy of ``preset`` with the given fields replaced (None = keep). ``target``/``draft`` replace the model
    pairs by one pair: the preset's pair that ``target`` stands for (:func:`matching_pair`: its drafter, name, device
    map and chat settings are kept), else a new pair with the first pair's drafter. ``include_hub`` adds the
    preset's hub-only datasets (in the order of ``KNOWN_DATASETS``). Explicitly given budgets are never optional.
    ``full``: the preset's whole grid live (``--full``): its ``full_budgets`` and ``full_lookup_budgets`` join the
    budgets that were not given explicitly. ``enable_thinking`` sets the chat template's thinking switch of every
    pair."""
    changes = {k: v for k, v in fields.items() if v is not None}
    if full:
        if "budgets" not in changes:
            changes["budgets"] = tuple(dict.fromkeys(_by_size(preset.budgets + preset.full_budgets)))
        if "lookup_budgets" not in changes:
            changes["lookup_budgets"] = tuple(dict.fromkeys(_by_size(preset.lookup_budgets
                                                                     + preset.full_lookup_budgets)))
    if target is not None or draft is not None:
        first = preset.models[0]
        base = first if target is None else matching_pair(preset, target)
        if base is None:
            pair = ModelPair(target, draft if draft is not None else first.draft)
        else:
            pair = dataclasses.replace(base, target=target if target is not None else base.target,
                                       draft=draft if draft is not None else base.draft)
        changes["models"] = (pair,)
    if "datasets" in changes:
        if include_hub:
            raise ValueError("give either the datasets to run or include_hub (--hub-datasets), not both")
        changes["datasets"] = tuple(canonical_name(d) for d in changes["datasets"])
        changes.setdefault("hub_datasets", tuple(d for d in preset.hub_datasets if d not in changes["datasets"]))
    elif include_hub and preset.hub_datasets:
        chosen = set(preset.datasets) | set(preset.hub_datasets)
        order = [d for d in KNOWN_DATASETS if d in chosen] + [d for d in preset.datasets if d not in KNOWN_DATASETS]
        changes["datasets"], changes["hub_datasets"] = tuple(order), ()
    if "enable_thinking" in changes:  # the switch goes into every pair's chat template settings
        switch = bool(changes["enable_thinking"])
        changes["models"] = tuple(dataclasses.replace(
            pair, chat_template_kwargs=tuple({**dict(pair.chat_template_kwargs), "enable_thinking": switch}.items()))
            for pair in changes.get("models", preset.models))
    if "max_samples" in changes:  # an explicit sample count applies to every dataset
        changes.setdefault("samples_per_dataset", ())
        changes.setdefault("min_samples", min(preset.min_samples, changes["max_samples"]))
    return dataclasses.replace(preset, **changes)
