"""The benchmark harness: ``python -m experiments.bench`` runs a preset, ``python -m experiments.bench.plan`` says
what a preset would run here without running it.

What each module holds, in the order a run meets them: :mod:`.cli` (flags, pairs, the run's outline), :mod:`.presets`
(the grids), :mod:`.models` (loading a pair), :mod:`.ranks` (devices and torchrun ranks), :mod:`.variant_spec`
(a method variant as one named spec, e.g. ``ddtree:B=32``), :mod:`.variants` and :mod:`.policies` (running them,
user policies), :mod:`.session` (one conversation turn by turn, every variant on the same prompt), :mod:`.sizing`
(fitting the run to its time budget), :mod:`.cost_curve` and :mod:`.replayer` (the machine's round costs; every
variant replayed on plain decoding's text), :mod:`.run_folder` and :mod:`.schema` (the records on disk, which
``plots`` reads; each names its variant once), :mod:`.summary_table` and :mod:`.console` (what is printed),
:mod:`.plan`, :mod:`.plan_sources`, :mod:`.plan_estimates`, :mod:`.plan_render` (the dry run).

The harness imports ``ddtree`` and ``dflash_core``; nothing there imports it, and it never imports ``plots`` (the
figures read the records it writes, through :mod:`.schema`).
"""
