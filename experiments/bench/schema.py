"""Plain-data result records shared by the benchmark runner (writer) and ``plots`` (reader).

Pure Python on purpose: no torch, no numpy, so figures and tables can be drawn on a machine that has neither.

Files of one run folder::

    <run>/records.jsonl   one JSON object per finished (dataset, sample, turn, method variant), appended
    <run>/manifest.json   the environment of the run (:class:`Manifest`), replaced atomically

Durability: :func:`append_record` writes a whole line with one ``write`` followed by ``fsync``, so a run killed at
any moment leaves at most one truncated last line; :func:`read_records` skips such a line with a warning and the next
:func:`append_record` cuts it off before appending. Resuming a run = skip every :meth:`SampleRecord.record_key`
already in the run folder (``experiments.bench.run_folder.existing_records``).
"""

from __future__ import annotations

import dataclasses
import datetime as _dt
import importlib.metadata
import json
import os
import subprocess
import sys
import tempfile
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable

from experiments.bench.variant_spec import (  # noqa: F401 (METHODS, TREE_KINDS, ...: the record's vocabulary)
    CUSTOM_POLICY, LOOKUP_POLICY, METHOD_LABELS, METHODS, TREE_KINDS, Variant, legacy_variant,
)

# 2: one ``variant`` (a :class:`Variant` name) instead of method / budget / policy / tree (version 1, read through
# :func:`legacy_variant`).
SCHEMA_VERSION = 2
RECORDS_FILENAME = "records.jsonl"
MANIFEST_FILENAME = "manifest.json"
REPLAYED_FILENAME = "replayed.jsonl"  # replayed rounds on plain decoding's text, priced (experiments.bench.replayer)

# Conventional key in SampleRecord.extra: number of draft nodes verified in each round (tree policies).
EXTRA_TREE_SIZES = "tree_sizes"
# Conventional key in SampleRecord.extra: committed tokens that came from context-lookup nodes, summed over the rounds
# (PLD and DDTree+lookup); their share of all committed tokens is :func:`lookup_share`.
EXTRA_LOOKUP_TOKENS = "lookup_tokens"
# Where a record's greedy output first left plain decoding's, plain decoding's top-2 logit margin at that token
# (extra["ar_margin_at_mismatch"]); below NEAR_TIE_MARGIN the two top tokens are a near-tie that bf16 rounding of
# multi-token versus one-token forwards can flip (measured: up to ~0.3 logits on the embedded target).
EXTRA_AR_MARGIN = "ar_margin_at_mismatch"
NEAR_TIE_MARGIN = 0.5


def near_tie_or_equal(matches_ar: bool | None, extra: dict) -> bool | None:
    """True when the output equals plain decoding's or first leaves it at a near-tie of plain decoding."""
    if matches_ar is None:
        return None
    margin = extra.get(EXTRA_AR_MARGIN)
    return bool(matches_ar) or (margin is not None and margin < NEAR_TIE_MARGIN)

# ---- display names: the one place plots and the runner's summary take them from (colours live in plots) ----------
DATASET_LABELS = {
    "gsm8k": "GSM8K",
    "math500": "MATH-500",
    "aime24": "AIME24",
    "aime25": "AIME25",
    "humaneval": "HumanEval",
    "mbpp": "MBPP",
    "livecodebench": "LiveCodeBench",
    "swe-bench": "SWE-Bench",
    "mt-bench": "MT-Bench",
    "alpaca": "Alpaca",
    "grounded": "Grounded",
}
DATASET_ORDER = tuple(DATASET_LABELS)


def method_label(method: str, policy: str | None = None, budget: int | str | None = None,
                 tree: str | None = None) -> str:
    """The label of a variant given by the fields records had before :class:`Variant` (:func:`legacy_variant`)."""
    return legacy_variant(method, budget, policy, tree).label


def paired_speedup(pairs: Iterable[tuple["SampleRecord", "SampleRecord"]]) -> float | None:
    """AR time per token divided by the variant's, token-weighted over (AR record, variant record) pairs of the same
    prompt where both generated tokens: ``(sum ar.decode_s / sum ar.n) / (sum m.decode_s / sum m.n)``; None without
    such a pair or without measured time."""
    pairs = [(a, m) for a, m in pairs if a.num_new_tokens > 0 and m.num_new_tokens > 0]
    ar_time, m_time = sum(a.decode_s for a, _ in pairs), sum(m.decode_s for _, m in pairs)
    if not pairs or ar_time <= 0 or m_time <= 0:
        return None
    ar_tokens, m_tokens = sum(a.num_new_tokens for a, _ in pairs), sum(m.num_new_tokens for _, m in pairs)
    return (ar_time / ar_tokens) / (m_time / m_tokens)


def lookup_share(records: Iterable["SampleRecord"]) -> float | None:
    """Share of committed tokens (bonus included) that came from lookup nodes, over the records that say so
    (``extra["lookup_tokens"]``); None when none does."""
    with_lookup = [r for r in records if r.extra.get(EXTRA_LOOKUP_TOKENS) is not None]
    committed = sum(sum(r.acceptance_lengths) for r in with_lookup)
    return sum(r.extra[EXTRA_LOOKUP_TOKENS] for r in with_lookup) / committed if committed else None


def dataset_label(dataset: str) -> str:
    return DATASET_LABELS.get(dataset, dataset)


def dataset_sort_key(dataset: str) -> tuple[int, str]:
    """Known datasets in the papers' order, unknown ones after them alphabetically."""
    return (DATASET_ORDER.index(dataset), "") if dataset in DATASET_ORDER else (len(DATASET_ORDER), dataset)


# ---- records --------------------------------------------------------------------------------------------------


def _plain(obj: Any) -> Any:
    """json.dumps fallback: numpy / torch scalars and arrays (duck-typed, nothing imported)."""
    if hasattr(obj, "tolist"):
        return obj.tolist()
    if hasattr(obj, "item"):
        return obj.item()
    if isinstance(obj, (set, frozenset, tuple)):
        return list(obj)
    raise TypeError(f"not JSON serializable: {type(obj).__name__}")


_LEGACY_FIELDS = ("method", "budget", "policy", "tree")


@dataclass(init=False)
class SampleRecord:
    """Outcome of one method variant on one turn of one benchmark sample.

    ``variant``: the method variant's canonical name (:class:`Variant`, e.g. ``"ddtree:B=32"``); ``spec`` is the
    parsed spec and ``method``, ``budget``, ``policy``, ``tree`` read off it. ``turn`` is 0-based (MT-Bench has turns
    0 and 1). ``decode_s`` is the wall time after prefill until the last token (prefill excluded); speedups compare
    ``decode_s / num_new_tokens``. ``acceptance_lengths``: tokens committed per round including the bonus token (AR:
    all ones). ``matches_ar``: at T = 0 whether the new tokens equal AR's, None where not compared. ``extra``:
    free-form per-round details (e.g. ``extra["tree_sizes"]``, ``extra["lookup_tokens"]``).

    The fields of schema version 1 (``method``, ``budget``, ``policy``, ``tree``) are still accepted as keywords
    instead of ``variant``, and in older files: :func:`legacy_variant` turns them into the spec.
    """

    dataset: str
    sample_id: str
    turn: int
    variant: str
    temperature: float
    num_input_tokens: int
    num_new_tokens: int
    prefill_s: float
    decode_s: float
    acceptance_lengths: list[int] = field(default_factory=list)
    stage_times: dict[str, float] = field(default_factory=dict)
    matches_ar: bool | None = None
    seed: int | None = None
    dtype: str | None = None
    extra: dict[str, Any] = field(default_factory=dict)
    schema_version: int = SCHEMA_VERSION

    def __init__(self, dataset: str, sample_id: Any, turn: int, variant: Variant | str | None = None,
                 temperature: float = 0.0, num_input_tokens: int = 0, num_new_tokens: int = 0,
                 prefill_s: float = 0.0, decode_s: float = 0.0, acceptance_lengths: list[int] | None = None,
                 stage_times: dict[str, float] | None = None, matches_ar: bool | None = None,
                 seed: int | None = None, dtype: str | None = None, extra: dict[str, Any] | None = None,
                 schema_version: int = SCHEMA_VERSION, **legacy: Any) -> None:
        self.extra = dict(extra or {})
        if legacy:
            if variant is not None or not set(legacy) <= set(_LEGACY_FIELDS) or "method" not in legacy:
                raise TypeError(f"give a record either variant= or the version-1 fields {_LEGACY_FIELDS} (method "
                                f"required), got variant={variant!r} and {sorted(legacy)}")
            variant = legacy_variant(legacy["method"], legacy.get("budget"), legacy.get("policy"),
                                     legacy.get("tree"), self.extra.pop("policy_class", None))
            schema_version = SCHEMA_VERSION  # migrated: from here on it is a version-2 record
        if variant is None:
            raise TypeError("a record needs its variant: variant=Variant(...) or its name, e.g. 'ddtree:B=32'")
        spec = variant if isinstance(variant, Variant) else Variant.parse(variant)
        self.dataset, self.sample_id, self.turn, self.variant = dataset, str(sample_id), int(turn), spec.name
        self.temperature, self.num_input_tokens, self.num_new_tokens = float(temperature), num_input_tokens, \
            num_new_tokens
        self.prefill_s, self.decode_s, self.matches_ar, self.seed, self.dtype = \
            prefill_s, decode_s, matches_ar, seed, dtype
        self.acceptance_lengths = list(acceptance_lengths or [])
        self.stage_times = dict(stage_times or {})
        self.schema_version = schema_version
        if self.turn < 0 or self.num_new_tokens < 0 or self.num_input_tokens < 0:
            raise ValueError("turn, num_input_tokens and num_new_tokens must be >= 0")

    # -- the variant, read off its spec
    @property
    def spec(self) -> Variant:
        return Variant.parse(self.variant)

    @property
    def method(self) -> str:
        return self.spec.method

    @property
    def budget(self) -> int | str | None:
        return self.spec.budget

    @property
    def policy(self) -> str:
        return self.spec.policy

    @property
    def tree(self) -> str | None:
        """DDTree's tree kind (``"topk"`` or ``"sampled"``); None for the other methods."""
        return self.spec.tree

    tree_kind = tree

    # -- derived values
    @property
    def tau(self) -> float | None:
        """Mean committed tokens per round of this sample (None when no rounds were recorded)."""
        return sum(self.acceptance_lengths) / len(self.acceptance_lengths) if self.acceptance_lengths else None

    def record_key(self) -> tuple:
        """Identity for resuming: (dataset, sample_id, turn, the variant's key, temperature) (:func:`record_key`)."""
        return record_key(self.dataset, self.sample_id, self.turn, self.spec, self.temperature)

    # -- serialization
    def to_dict(self) -> dict[str, Any]:
        """The fields: the variant once, by its canonical name (tools reading the raw JSON parse it with
        :meth:`Variant.parse` or load the record with :meth:`from_dict`)."""
        return dataclasses.asdict(self)

    def to_json(self) -> str:
        """One line of JSON (no newline inside; strict JSON: NaN/inf are refused)."""
        return json.dumps(self.to_dict(), default=_plain, allow_nan=False, ensure_ascii=False, separators=(",", ":"))

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "SampleRecord":
        """A record from its JSON object; version-1 objects (method / budget / policy / tree) go through
        :func:`legacy_variant`. Keys this version does not know are kept in ``extra``."""
        known = {f.name for f in dataclasses.fields(cls)} | set(_LEGACY_FIELDS)
        if "variant" in data:  # the version-1 names are derived copies (to_dict)
            data = {k: v for k, v in data.items() if k not in _LEGACY_FIELDS}
        kwargs = {k: v for k, v in data.items() if k in known}
        unknown = {k: v for k, v in data.items() if k not in known}
        if unknown:  # written by a newer version: keep the values instead of dropping them
            kwargs["extra"] = {**unknown, **dict(kwargs.get("extra") or {})}
        try:
            return cls(**kwargs)
        except TypeError as err:
            raise ValueError(f"not a SampleRecord: {err}") from None

    @classmethod
    def from_json(cls, line: str) -> "SampleRecord":
        data = json.loads(line)
        if not isinstance(data, dict):
            raise ValueError("a record line must hold a JSON object")
        return cls.from_dict(data)


def record_key(dataset: str, sample_id: Any, turn: int, variant: Variant, temperature: float) -> tuple:
    """The resume key of a record, also of one about to be produced: (dataset, sample_id, turn, *variant.key,
    temperature), normalised as SampleRecord normalises them (the same shape as before the spec, older run folders
    resume)."""
    method, budget, *kind = variant.key
    return (dataset, str(sample_id), int(turn), method, budget, float(temperature), *kind)


def append_record(path: str | os.PathLike, record: SampleRecord) -> None:
    """Append one record as one complete line: a single write, then flush and fsync.

    One writer per file. If the file ends in a partial line (a run killed mid-write on a file system that does not
    write atomically), that fragment is cut off first, so it can never be glued to the new record.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    data = (record.to_json() + "\n").encode("utf-8")
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_APPEND, 0o644)
    try:
        _repair_tail(fd, path)
        view = memoryview(data)
        while view:  # os.write on a regular file writes everything in one go; loop only for exotic file systems
            view = view[os.write(fd, view):]
        os.fsync(fd)
    finally:
        os.close(fd)


def _repair_tail(fd: int, path: Path) -> None:
    size = os.fstat(fd).st_size
    if size == 0 or os.pread(fd, 1, size - 1) == b"\n":
        return
    chunk = 1 << 16
    start = size
    while start > 0:
        lo = max(0, start - chunk)
        cut = os.pread(fd, start - lo, lo).rfind(b"\n")
        if cut >= 0:
            start = lo + cut + 1
            break
        start = lo
    tail = os.pread(fd, size - start, start)
    try:
        SampleRecord.from_json(tail.decode("utf-8"))
        os.write(fd, b"\n")  # complete record that only lost its newline: keep it
    except (ValueError, TypeError, UnicodeDecodeError):
        warnings.warn(f"{path}: dropping a truncated last line ({len(tail)} bytes) before appending", stacklevel=3)
        os.ftruncate(fd, start)


def read_records(path: str | os.PathLike) -> list[SampleRecord]:
    """All records of a JSONL file. A truncated last line is skipped with a warning; a bad line elsewhere raises."""
    path = Path(path)
    lines = path.read_text(encoding="utf-8").split("\n")
    last = max((i for i, line in enumerate(lines) if line.strip()), default=-1)
    records = []
    for i, line in enumerate(lines):
        if not line.strip():
            continue
        try:
            records.append(SampleRecord.from_json(line))
        except (ValueError, TypeError) as err:
            if i == last:
                warnings.warn(f"{path}:{i + 1}: ignoring a truncated last line ({err})", stacklevel=2)
                continue
            raise ValueError(f"{path}:{i + 1}: corrupt record: {err}") from None
    return records


def bootstrap_ci(values: list[float], statistic=None, level: float = 0.95, resamples: int = 2000,
                 seed: int = 0) -> tuple[float, float] | tuple[None, None]:
    """Percentile-bootstrap interval of ``statistic`` (default: the mean) of ``values``, with a fixed seed (the same
    values give the same interval). One value gives a zero-width interval; none gives (None, None)."""
    import random
    import statistics

    statistic = statistic or statistics.fmean
    if not values:
        return None, None
    if len(values) == 1:
        point = statistic(values)
        return point, point
    rng = random.Random(seed)
    stats = sorted(statistic(rng.choices(values, k=len(values))) for _ in range(resamples))
    tail = (1 - level) / 2
    return stats[int(tail * (resamples - 1))], stats[int(round((1 - tail) * (resamples - 1)))]


def write_json_atomic(path: str | os.PathLike, obj: Any) -> None:
    """Write JSON atomically (:func:`write_text_atomic`)."""
    write_text_atomic(path, json.dumps(obj, indent=2, default=_plain, allow_nan=False, ensure_ascii=False) + "\n")


def write_text_atomic(path: str | os.PathLike, text: str) -> None:
    """Write text to a temporary file in the same folder, fsync it, os.replace it over ``path``, then fsync the
    folder (best effort) so the rename itself is durable. Plain standard library: ``plots`` writes through it too."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass
        raise
    try:  # make the rename itself durable; not possible everywhere (e.g. Windows), hence best effort
        dir_fd = os.open(path.parent, os.O_RDONLY)
        try:
            os.fsync(dir_fd)
        finally:
            os.close(dir_fd)
    except OSError:
        pass


# ---- manifest -------------------------------------------------------------------------------------------------

DEFAULT_PACKAGES = ("torch", "transformers", "numpy", "accelerate", "gguf", "safetensors", "matplotlib")


def package_versions(names: Iterable[str] = DEFAULT_PACKAGES) -> dict[str, str | None]:
    """Installed versions (None when missing), read from package metadata without importing anything."""
    versions: dict[str, str | None] = {}
    for name in names:
        try:
            versions[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            versions[name] = None
    return versions


def git_commit(repo_dir: str | os.PathLike | None = None) -> str | None:
    """Commit hash of the checkout (suffixed ``-dirty`` with uncommitted changes); None outside git."""
    repo_dir = Path(repo_dir) if repo_dir is not None else Path(__file__).resolve().parent.parent
    try:
        def git(*args: str) -> str:
            return subprocess.run(["git", "-C", str(repo_dir), *args], capture_output=True, text=True,
                                  check=True, timeout=10).stdout.strip()
        commit = git("rev-parse", "HEAD")
        return commit + ("-dirty" if git("status", "--porcelain", "--untracked-files=no") else "")
    except (OSError, subprocess.SubprocessError):
        return None


@dataclass
class Manifest:
    """Environment of one benchmark run (``manifest.json``)."""

    git_commit: str | None = None
    package_versions: dict[str, str | None] = field(default_factory=dict)
    device: str | None = None
    dtype: str | None = None
    attention_backend: str | None = None
    seed: int | None = None
    preset: str | None = None
    command_line: list[str] = field(default_factory=list)
    created_at: str = field(default_factory=lambda: _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"))
    extra: dict[str, Any] = field(default_factory=dict)
    schema_version: int = SCHEMA_VERSION

    @classmethod
    def create(cls, **kwargs: Any) -> "Manifest":
        """A manifest with git commit, package versions and command line filled in from this process."""
        kwargs.setdefault("git_commit", git_commit())
        kwargs.setdefault("package_versions", package_versions())
        kwargs.setdefault("command_line", list(sys.argv))
        return cls(**kwargs)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "Manifest":
        known = {f.name for f in dataclasses.fields(cls)}
        kwargs = {k: v for k, v in data.items() if k in known}
        unknown = {k: v for k, v in data.items() if k not in known}
        if unknown:
            kwargs["extra"] = {**unknown, **dict(kwargs.get("extra") or {})}
        return cls(**kwargs)

    def write(self, path: str | os.PathLike) -> None:
        write_json_atomic(path, self.to_dict())

    @classmethod
    def read(cls, path: str | os.PathLike) -> "Manifest":
        return cls.from_dict(json.loads(Path(path).read_text(encoding="utf-8")))
