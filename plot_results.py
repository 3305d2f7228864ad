"""Draw the figures and tables of benchmark runs: ``python plot_results.py [--runs runs/] [--out DIR]``."""

from __future__ import annotations

import argparse
import sys

from plots import make_report


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--runs", default="runs", help="folder searched recursively for records.jsonl (default: runs/)")
    parser.add_argument("--out", default=None, help="output folder (default: <runs>/figures)")
    parser.add_argument("--formats", nargs="+", default=["png", "pdf"], help="figure formats (default: png pdf)")
    parser.add_argument("--fixed-budget", type=int, default=None,
                        help="a DDTree budget fixed before the run, shown next to the oracle budget")
    args = parser.parse_args(argv)
    try:
        paths = make_report(args.runs, args.out, formats=args.formats, fixed_budget=args.fixed_budget)
    except FileNotFoundError as err:
        print(f"plot_results: {err}", file=sys.stderr)
        return 1
    for path in paths:
        print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
