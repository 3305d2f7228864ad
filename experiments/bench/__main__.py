"""``python -m experiments.bench``: the benchmark runner (:mod:`experiments.bench.cli`)."""

import sys

from experiments.bench.cli import main

sys.exit(main())
