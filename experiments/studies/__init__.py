"""One-off studies and tools, each a command of its own (``python -m experiments.studies.<name> --help``).

They measure one question each (a builder's speed, a round's profile, the budget rule against the oracle, a drafter
on the fixed protocol, the GPU check) and print or write their own result files; the benchmark never runs them. They
may import the harness (:mod:`experiments.bench`) for its models and record helpers; the harness never imports them.
``gpu_run`` is here too: the prepared run for a GPU machine lent for minutes, a sequence of these checks plus the
quick benchmark, each step in its own process.
"""
