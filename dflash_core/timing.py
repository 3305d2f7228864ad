"""Measuring and per-machine caches: one median-of-repeats timer for measurements, and the one JSON cache keyed by
the machine that measured speeds are kept in (the decode loop's own stage timer is ``dflash_core.decoding.StageTimer``).

* :func:`time_samples` / :func:`median_seconds` -- seconds of repeated calls (several functions interleaved, so
  machine noise hits all alike): CUDA events on the device's current stream on CUDA, perf_counter elsewhere;
* :func:`machine_key` / :func:`cached_json` -- a measurement stored under ``cache_root()/<kind>/<name>.json``, its
  name keyed by :func:`machine_identity` plus what the caller says it depends on; a damaged file is measured again.
"""

from __future__ import annotations

import hashlib
import json
import os
import platform
import statistics
import time
import warnings
from pathlib import Path
from typing import Any, Callable, Sequence, TypeVar

import torch

from .files import write_text_atomic

__all__ = ["cpu_model", "cache_root", "machine_identity", "machine_key", "cache_path", "cached_json",
           "read_cached_json", "write_cached_json", "time_samples", "median_seconds"]

T = TypeVar("T")


# ---------------------------------------------------------------------------------------------------- caches
def cache_root() -> Path:
    """Where the toolkit keeps per-machine caches: ``$DDTREE_CACHE``, else ``$XDG_CACHE_HOME/ddtree`` (default
    ``~/.cache/ddtree``)."""
    base = os.environ.get("DDTREE_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "ddtree")
    return Path(base)


# environment variables that change which CPU kernels run, hence every measured speed
SPEED_ENVIRONMENT = ("MKL_CBWR", "MKL_ENABLE_INSTRUCTIONS", "ONEDNN_MAX_CPU_ISA", "DNNL_MAX_CPU_ISA",
                     "ONEDNN_DEFAULT_FPMATH_MODE", "DDTREE_CPU_KERNELS")


def machine_identity() -> dict:
    """What a measured speed depends on besides the model: CPU model, threads, torch version and the kernel-selecting
    environment variables (a cache keyed by it is never reused under another ``MKL_CBWR``, say)."""
    return {"cpu": cpu_model(), "threads": torch.get_num_threads(), "torch": torch.__version__,
            "env": {k: os.environ[k] for k in SPEED_ENVIRONMENT if k in os.environ}}


def machine_key(identity: dict) -> str:
    """16 hex digits naming ``identity`` (what a measurement depends on: models, dtype, device ...) on this machine
    (:func:`machine_identity` is folded in)."""
    blob = json.dumps({**machine_identity(), **identity}, sort_keys=True, default=str)
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


def cache_path(kind: str, name: str) -> Path:
    """The cache file of measurement ``name`` (usually starting with a :func:`machine_key`) of ``kind``."""
    return cache_root() / kind / f"{name}.json"


def cached_json(kind: str, name: str, measure: Callable[[], T], load: Callable[[Any], T | None],
                dump: Callable[[T], Any] | None = None, use_cache: bool = True) -> T:
    """``load(raw)`` of the cached measurement, else ``measure()`` (written whole as ``dump(value)``; default: the
    value itself).

    ``load`` returns None for an entry that does not answer the question (another grid, say): it is measured again
    and replaced. ``use_cache=False`` measures and writes nothing."""
    path = cache_path(kind, name)
    if use_cache:
        hit = read_cached_json(path, load)
        if hit is not None:
            return hit
    value = measure()
    if use_cache:
        write_cached_json(path, value if dump is None else dump(value))
    return value


def read_cached_json(path: Path, check=None):
    """A cache file's JSON (or ``check(raw)``'s result), or None when it is missing or damaged: a damaged file (cut
    off, edited, an older format) is removed with a warning, and the caller measures again."""
    if not path.is_file():
        return None
    try:
        raw = json.loads(path.read_text())
        return check(raw) if check is not None else raw
    except (ValueError, KeyError, TypeError, IndexError, UnicodeDecodeError) as err:
        warnings.warn(f"ignoring the damaged cache file {path} ({type(err).__name__}: {err}); measuring again",
                      stacklevel=2)
        path.unlink(missing_ok=True)
        return None


def write_cached_json(path: Path, obj) -> None:
    """Write a cache file atomically (a concurrent reader sees the old file or the whole new one)."""
    write_text_atomic(path, json.dumps(obj, indent=1))


# ---------------------------------------------------------------------------------------------------- measuring
def time_samples(functions: Sequence[Callable[[], Any]], repeats: int, device: torch.device | str = "cpu",
                 warmup: int = 0) -> list[list[float]]:
    """Seconds of each of ``repeats`` calls of every function, after ``warmup`` untimed rounds; the functions are
    called in turn, forwards in even repeats and backwards in odd ones, so machine noise hits all of them alike and
    a steady drift in the machine's speed cancels over each pair of repeats. On CUDA each call is timed by a pair of
    events on the current stream of ``device`` (not of whichever GPU is current: the model may run on another), and
    the device is synchronised once per repeat; elsewhere by perf_counter."""
    device = torch.device(device)
    for _ in range(warmup):
        for fn in functions:
            fn()
    samples: list[list[float]] = [[] for _ in functions]
    for repeat in range(repeats):
        order = range(len(functions)) if repeat % 2 == 0 else range(len(functions) - 1, -1, -1)
        if device.type == "cuda":
            stream = torch.cuda.current_stream(device)
            events = []
            for i in order:
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record(stream)
                functions[i]()
                end.record(stream)
                events.append((i, start, end))
            torch.cuda.synchronize(device)
            for i, start, end in events:
                samples[i].append(start.elapsed_time(end) / 1000.0)
        else:
            for i in order:
                t0 = time.perf_counter()
                functions[i]()
                samples[i].append(time.perf_counter() - t0)
    return samples


def median_seconds(fn: Callable[[], Any], repeats: int, device: torch.device | str = "cpu", warmup: int = 0) -> float:
    """Median seconds of ``repeats`` calls of ``fn`` after ``warmup`` untimed ones (see :func:`time_samples`)."""
    return statistics.median(time_samples([fn], repeats, device, warmup)[0])


def cpu_model() -> str:
    """The CPU's model name (``/proc/cpuinfo``), or the platform's processor string; every speed figure names it."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"
