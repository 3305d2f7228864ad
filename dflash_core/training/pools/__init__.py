"""The prompt pools: the benchmark's datasets and the training recipe's prompts, with the split that keeps them apart.

Not part of the inference core (nothing in the decode path imports it). It lives with the training recipe, not in the
benchmark (``experiments``), because the recipe needs the split at run time (its prompts come only from the part the
benchmark can never select, and its text corpus drops anything that overlaps a benchmark prompt), and ``dflash_core``
never imports ``experiments``; the benchmark imports the pools from here. :mod:`.items` holds the shared pieces,
:mod:`.grounded` builds the input-grounded set, :mod:`.catalog` loads, splits and selects every pool.
"""
