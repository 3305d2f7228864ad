"""Old import path of :mod:`dflash_core.training.memory` (``python -m dflash_core.train_memory`` still runs it)."""

from __future__ import annotations

from .training.memory import (
    QWEN3_8B_PRESET, SMALL_PRESET, StepShape, main, measure_sequence_peak, measure_small, small_pair, step_memory,
)

__all__ = ["StepShape", "step_memory", "measure_sequence_peak", "small_pair", "QWEN3_8B_PRESET", "SMALL_PRESET",
           "measure_small", "main"]

if __name__ == "__main__":
    main()
