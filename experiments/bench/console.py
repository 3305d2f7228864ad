"""The benchmark's progress lines on stderr (stdout carries the summary tables only)."""

from __future__ import annotations

import sys


def log(message: str) -> None:
    print(f"[benchmark] {message}", file=sys.stderr, flush=True)
