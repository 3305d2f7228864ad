"""Colours of methods and variants in every figure (display only: records never carry them)."""

from __future__ import annotations

METHOD_COLORS = {"ar": "#4d4d4d", "dflash": "#1f77b4", "ddtree": "#d62728", "pld": "#bcbd22"}
# Extra colours for variants drawn side by side (oracle budget, policies, preset fixed budget, DFlash's chosen chain).
VARIANT_COLORS = {"oracle": "#d62728", "auto": "#ff7f0e", "fixed": "#9467bd", "other": "#8c564b",
                  "chain-auto": "#6baed6"}
