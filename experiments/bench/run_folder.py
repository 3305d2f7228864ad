"""One model pair's run folder: its records file(s) and its manifest, owned by one object.

::

    records.jsonl          one SampleRecord per finished (dataset, sample, turn, method variant, temperature)
    records.rank<r>.jsonl  per-rank records while a torchrun run is in flight (rank 0 merges them at the end)
    manifest.json          environment and resolved preset (experiments.bench.schema.Manifest), replaced atomically
    replayed.jsonl         the rounds of every replayed policy on plain decoding's text, priced
    (experiments.bench.replayer)

Every record is appended and fsynced as soon as its generation ends (``experiments.bench.schema.append_record``), so an
interrupted run loses at most the generation in flight; reopening the folder finds every finished record
(:meth:`RunFolder.existing_records`) and the runner skips them. The manifest is read once, when the folder is opened,
and written once per event of a session (it starts, it is sized, it ends), atomically and by rank 0 only; the
manifest in memory is the one on disk.
"""

from __future__ import annotations

import contextlib
import dataclasses
import glob
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from experiments.bench.ranks import RANK_RECORDS_GLOB, RankInfo, device_name
from experiments.bench.schema import (
    MANIFEST_FILENAME, RECORDS_FILENAME, REPLAYED_FILENAME, Manifest, SampleRecord, append_record, read_records,
)

if TYPE_CHECKING:
    from experiments.bench.models import Models
    from experiments.bench.presets import ModelPair, Preset

__all__ = ["RunFolder", "existing_records", "merge_rank_files"]

# Settings that change what a record means: a rerun into the same folder must keep them.
_IDENTITY_FIELDS = ("max_new_tokens", "dtype", "seed")


def _record_files(folder: Path) -> list[Path]:
    return [folder / RECORDS_FILENAME] + sorted(Path(p) for p in glob.glob(str(folder / RANK_RECORDS_GLOB)))


def existing_records(folder: Path) -> dict[tuple, SampleRecord]:
    """Finished records of a run folder, from the merged file and any per-rank files, by resume key."""
    done: dict[tuple, SampleRecord] = {}
    for path in _record_files(folder):
        if path.is_file():
            for record in read_records(path):
                done.setdefault(record.record_key(), record)
    return done


def merge_rank_files(folder: Path) -> Path:
    """Fold ``records.rank*.jsonl`` into ``records.jsonl`` (atomic replace), then delete the rank files."""
    target = folder / RECORDS_FILENAME
    rank_files = _record_files(folder)[1:]
    if not rank_files:
        return target
    records = list(existing_records(folder).values())
    fd, tmp = tempfile.mkstemp(dir=folder, prefix=f".{RECORDS_FILENAME}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.writelines(record.to_json() + "\n" for record in records)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, target)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise
    for path in rank_files:
        path.unlink()
    return target


def _now() -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%S%z")


class RunFolder:
    """The run folder of one model pair as seen by one rank (see the module docstring)."""

    def __init__(self, path: str | os.PathLike, rank: RankInfo | None = None) -> None:
        self.path = Path(path)
        self.rank = rank or RankInfo()
        self.path.mkdir(parents=True, exist_ok=True)
        self.manifest_path = self.path / MANIFEST_FILENAME
        self.records_path = self.rank.records_path(self.path)  # this rank's file
        self.manifest: Manifest | None = Manifest.read(self.manifest_path) if self.manifest_path.is_file() else None
        self._session: dict[str, Any] | None = None  # this process's session entry, once started

    # -- records
    def existing_records(self) -> dict[tuple, SampleRecord]:
        return existing_records(self.path)

    def append(self, record: SampleRecord) -> None:
        """Append one record to this rank's file (one write, then fsync)."""
        append_record(self.records_path, record)

    def merge_rank_files(self) -> Path:
        return merge_rank_files(self.path)

    # -- replayed records (experiments.bench.replayer; single-process runs only)
    @property
    def replayed_path(self) -> Path:
        return self.path / REPLAYED_FILENAME

    def replayed_keys(self) -> set[tuple]:
        """Resume keys of the replayed records already written."""
        path = self.replayed_path
        return {r.record_key() for r in read_records(path)} if path.is_file() else set()

    def append_replayed(self, records: list[SampleRecord]) -> None:
        """Append one turn's replayed records (each one write, then fsync; plain decoding's row last, so a turn
        whose row is there is complete)."""
        for record in sorted(records, key=lambda r: r.method == "ar"):
            append_record(self.replayed_path, record)

    # -- manifest
    def check_resumable(self, preset: "Preset", pair: "ModelPair") -> None:
        """Raise ValueError when the folder holds a run of other models or settings."""
        if self.manifest is None:
            return
        old = self.manifest.extra.get("preset") or {}
        old_pair = self.manifest.extra.get("pair") or {}
        diffs = [f"{k}: {old.get(k)!r} -> {getattr(preset, k)!r}" for k in _IDENTITY_FIELDS
                 if k in old and old[k] != getattr(preset, k)]
        diffs += [f"{k}: {old_pair.get(k)!r} -> {getattr(pair, k)!r}" for k in ("target", "draft")
                  if k in old_pair and old_pair[k] != getattr(pair, k)]
        if diffs:
            raise ValueError(f"{self.path} holds a run with other settings ({'; '.join(diffs)}); "
                             "use a new --out folder, or the same settings to resume it")

    def start_session(self, preset: "Preset", models: "Models", session: dict[str, Any]) -> None:
        """Write the manifest of this session (rank 0): environment, resolved preset, and every session so far."""
        if not self.rank.is_main:
            return
        previous = self.manifest
        sessions = list((previous.extra.get("sessions") if previous else None) or []) + [session]
        manifest = Manifest.create(
            command_line=list(session.get("command_line") or sys.argv),
            device=device_name(models.device), dtype=str(models.dtype).removeprefix("torch."),
            attention_backend=getattr(models.target.config, "_attn_implementation", None), seed=preset.seed,
            preset=preset.name,
            extra={"preset": preset.to_dict(), "pair": dataclasses.asdict(models.pair), "models": models.describe(),
                   "world_size": self.rank.world, "sessions": sessions},
        )
        if previous is not None:  # plots orders runs by their creation time: keep the first session's
            manifest.created_at = previous.created_at
        self.manifest, self._session = manifest, session
        manifest.write(self.manifest_path)

    def update_session(self, **fields: Any) -> None:
        """Add ``fields`` to this session's entry and write the manifest (rank 0, after :meth:`start_session`)."""
        if self._session is None:
            return
        self._session.update(fields)
        self.manifest.write(self.manifest_path)

    def finish_session(self, complete: bool) -> None:
        """Stamp the end of this session (a session without it crashed or was killed)."""
        self.update_session(finished_at=_now(), complete=complete)

    @property
    def last_session(self) -> dict[str, Any]:
        """The latest session entry of the manifest ({} without one)."""
        sessions = (self.manifest.extra.get("sessions") if self.manifest else None) or [{}]
        return sessions[-1]
