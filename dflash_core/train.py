"""``python -m dflash_core.train``: the first DFlash training recipe's command line (:mod:`dflash_core.training.cli`).

The recipe lives in :mod:`dflash_core.training`, one idea per module; this module keeps the old import path working
by re-exporting its public names.
"""

from __future__ import annotations

from .training.blocks import block_attention_mask, block_inputs, position_weights, sample_anchors
from .training.cli import main, shipped_drafter
from .training.config import PRESETS, DataConfig, DraftSpec, TrainConfig, make_draft_config
from .training.evaluate import benchmark_tau, tau_evaluator
from .training.loop import TrainState, export_drafter, init_distributed, load_checkpoint, setup_logging, train
from .training.loss import SequenceFeatures, draft_loss, sequence_loss, target_features

__all__ = [
    "DraftSpec", "TrainConfig", "DataConfig", "PRESETS", "make_draft_config", "position_weights", "sample_anchors",
    "block_inputs", "block_attention_mask", "target_features", "SequenceFeatures", "sequence_loss", "draft_loss", "train",
    "init_distributed", "load_checkpoint", "shipped_drafter", "main",
    "TrainState", "setup_logging", "export_drafter", "tau_evaluator", "benchmark_tau",
]


if __name__ == "__main__":
    main()
