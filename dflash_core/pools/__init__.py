"""The prompt pools: the benchmark's datasets and the training recipe's prompts, with the split that keeps them apart.

Not part of the inference core (nothing in the decode path imports it); it lives under ``dflash_core`` because the
training recipe (:mod:`dflash_core.training`) and the benchmark (:mod:`experiments.bench`) must draw from the same
split, and imports flow from ``experiments`` to ``dflash_core``, never back. :mod:`.items` holds the shared pieces,
:mod:`.grounded` builds the input-grounded set, :mod:`.catalog` loads, splits and selects every pool.
"""
