"""Per-stage wall time of the decode loop: perf_counter on CPU, CUDA events on CUDA (no sync until the end)."""

from __future__ import annotations

import os
import time
from collections import defaultdict
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

import torch

__all__ = ["StageTimer", "cpu_model", "cache_root", "machine_identity", "read_cached_json", "write_cached_json"]


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


def read_cached_json(path: Path, check=None):
    """A cache file's JSON (or ``check(raw)``'s result), or None when it is missing or damaged: a damaged file (cut
    off, edited, an older format) is removed with a warning, and the caller measures again."""
    import json
    import warnings

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
    import json

    from .files import write_text_atomic

    write_text_atomic(path, json.dumps(obj, indent=1))


class StageTimer:
    """Accumulates seconds per named stage.

    On CUDA each stage records a pair of events on the current stream of ``device`` (not of whichever GPU happens to
    be current: with the model on ``cuda:1`` and ``cuda:0`` current, events on ``cuda:0`` would read ~0); nothing
    waits for the device until :meth:`totals` is called once at the end, so timing does not serialize the loop.
    """

    def __init__(self, device: torch.device | str = "cpu", enabled: bool = True) -> None:
        self.enabled = enabled
        self.device = torch.device(device)
        self.cuda = self.device.type == "cuda"
        self._seconds: dict[str, float] = defaultdict(float)
        self._events: list[tuple[str, torch.cuda.Event, torch.cuda.Event]] = []

    @contextmanager
    def stage(self, name: str) -> Iterator[None]:
        if not self.enabled:
            yield
            return
        if self.cuda:
            stream = torch.cuda.current_stream(self.device)
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record(stream)
            yield
            end.record(stream)
            self._events.append((name, start, end))
        else:
            t0 = time.perf_counter()
            yield
            self._seconds[name] += time.perf_counter() - t0

    def totals(self) -> dict[str, float]:
        """Seconds per stage (synchronizes the device once on CUDA)."""
        if self._events:
            torch.cuda.synchronize(self.device)
            for name, start, end in self._events:
                self._seconds[name] += start.elapsed_time(end) / 1000.0
            self._events.clear()
        return dict(self._seconds)


def cpu_model() -> str:
    """The CPU's model name (``/proc/cpuinfo``), or the platform's processor string; every speed figure names it."""
    import platform
    from pathlib import Path

    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"
