"""Atomic file writes: a temporary file in the same folder, flushed to disk, then renamed over the target.

A reader (or a run resumed after an interruption) sees either the old file or the whole new one, never a part.
Every file the core writes for later (checkpoints, collected positions, drafter weights, configs, timings) goes
through :func:`atomic_write`, so a run killed mid-write leaves no file that loads as truncated.

Standard library only (torch is imported inside :func:`save_atomic`). The benchmark's record schema keeps a
torch-free copy of :func:`write_text_atomic` (``experiments.bench.schema``): ``plots`` must draw without torch, and
importing ``dflash_core.files`` runs ``dflash_core/__init__.py``, which imports torch.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Callable

__all__ = ["atomic_write", "save_atomic", "write_text_atomic"]


def atomic_write(path: str | os.PathLike, write: Callable[[Path], None]) -> None:
    """``write(tmp)`` fills a temporary path next to ``path``; it is then fsynced and renamed over ``path``."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        write(tmp)
        with open(tmp, "rb+") as f:
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def write_text_atomic(path: str | os.PathLike, text: str) -> None:
    atomic_write(path, lambda tmp: tmp.write_text(text, encoding="utf-8"))


def save_atomic(obj, path: str | os.PathLike) -> None:
    """``torch.save(obj, path)``, atomically (:func:`atomic_write`)."""
    import torch

    atomic_write(path, lambda tmp: torch.save(obj, tmp))
