"""Find run folders and read their records (through experiments.bench.schema only)."""

from __future__ import annotations

import dataclasses
import warnings
from dataclasses import dataclass
from pathlib import Path

from experiments.bench.schema import (
    MANIFEST_FILENAME, RECORDS_FILENAME, REPLAYED_FILENAME, Manifest, SampleRecord, read_records,
)


@dataclass
class Run:
    """One run folder: its records file, its manifest (None when missing or unreadable), its records and its
    replayed records (``replayed.jsonl``: every policy's rounds on plain decoding's text, priced; may be empty)."""

    path: Path
    manifest: Manifest | None
    records: list[SampleRecord]
    replayed: list[SampleRecord] = dataclasses.field(default_factory=list)


def find_runs(root: str | Path) -> list[Run]:
    """Every ``records.jsonl`` at or below ``root`` (or ``root`` itself when it is a records file).

    Runs are ordered by their manifest's ``created_at`` (then path), oldest first.
    """
    root = Path(root)
    if root.is_file():
        files = [root]
    elif root.is_dir():
        files = sorted(root.rglob(RECORDS_FILENAME))
    else:
        raise FileNotFoundError(f"no such runs folder: {root}")
    runs = []
    for file in files:
        manifest = None
        manifest_path = file.parent / MANIFEST_FILENAME
        if manifest_path.is_file():
            try:
                manifest = Manifest.read(manifest_path)
            except (ValueError, TypeError) as err:
                warnings.warn(f"{manifest_path}: unreadable manifest ignored ({err})", stacklevel=2)
        replayed = file.parent / REPLAYED_FILENAME
        runs.append(Run(file.parent, manifest, read_records(file),
                        read_records(replayed) if replayed.is_file() else []))
    runs.sort(key=lambda run: ((run.manifest.created_at if run.manifest else "") or "", str(run.path)))
    return runs


def merge_replayed(runs: list[Run]) -> list[SampleRecord]:
    """All replayed records of the runs (the newest run's copy of a repeated key)."""
    merged: dict[tuple, SampleRecord] = {}
    for run in runs:
        merged.update((r.record_key(), r) for r in run.replayed)
    return list(merged.values())


def merge_records(runs: list[Run]) -> list[SampleRecord]:
    """All records of the runs; when a record key occurs in several runs the newest run's record wins."""
    setups = {(run.manifest.device, run.manifest.dtype) for run in runs if run.manifest}
    if len(setups) > 1:
        warnings.warn(f"runs from different setups (device, dtype) are merged: {sorted(map(str, setups))}; "
                      "point --runs at one run folder to compare like with like", stacklevel=2)
    merged: dict[tuple, SampleRecord] = {}
    replaced = 0
    for run in runs:
        for record in run.records:
            key = record.record_key()
            replaced += key in merged
            merged[key] = record
    if replaced:
        warnings.warn(f"{replaced} records occur in more than one run; the newest run's copy is used", stacklevel=2)
    return list(merged.values())


def load_records(root: str | Path) -> list[SampleRecord]:
    """Records of every run under ``root``, merged (see :func:`merge_records`)."""
    return merge_records(find_runs(root))
