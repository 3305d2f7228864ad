"""The prepared GPU run (``python -m experiments.studies.gpu_run --out DIR``): see
:mod:`experiments.studies.gpu_run.runner`.

``runner`` launches the steps one process each and writes their results; ``steps`` holds what each step measures;
``summary`` turns the result files into the one-screen summary.
"""

from experiments.studies.gpu_run.runner import STEPS, main

__all__ = ["STEPS", "main"]
