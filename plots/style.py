"""What every figure shares: the rc style, the temperature tag in file names, the title with its subtitle, saving
in every format. Its own module so that the figure modules (:mod:`plots.figures`, :mod:`plots.speedup`) import it and
not each other.
"""

from __future__ import annotations

from pathlib import Path
from typing import Sequence

from matplotlib.figure import Figure

STYLE = {
    "font.size": 11,
    "axes.titlesize": 12,
    "axes.labelsize": 11,
    "xtick.labelsize": 10,
    "ytick.labelsize": 10,
    "legend.fontsize": 9.5,
    "axes.grid": True,
    "grid.alpha": 0.3,
    "axes.spines.top": False,
    "axes.spines.right": False,
    "savefig.dpi": 150,
}


def temperature_tag(t: float) -> str:
    """File-name tag of a temperature: 0 -> ``T0``, 0.7 -> ``T0p7``."""
    return "T" + f"{t:g}".replace(".", "p").replace("-", "m")


def save_figure(fig: Figure, out_dir: Path, stem: str, formats: Sequence[str]) -> list[Path]:
    """``fig`` as ``out_dir/stem.<fmt>`` for every format, trimmed to its content; the paths written."""
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = []
    for fmt in formats:
        path = out_dir / f"{stem}.{fmt}"
        fig.savefig(path, bbox_inches="tight", pad_inches=0.1)
        paths.append(path)
    return paths


def figure_title(text: str, subtitle: str | None) -> str:
    """A figure's title, with the run's subtitle (e.g. the model pair) on a second line when there is one."""
    return f"{text}\n{subtitle}" if subtitle else text


def save_to(fig: Figure, out: str | Path) -> Path:
    """Lay out ``fig``, save it at ``out`` (its suffix is the format, png when none) and close it; the path."""
    import matplotlib.pyplot as plt

    fig.tight_layout()
    out = Path(out)
    path = save_figure(fig, out.parent, out.stem, [out.suffix.lstrip(".") or "png"])[0]
    plt.close(fig)
    return path


def record_figure_main(argv, prog: str, doc: str, record_help: str, default_name: str, plot) -> int:
    """The command line of a figure drawn from one JSON record: ``prog RECORD [--out PATH]`` (default: next to the
    record, ``default_name``); prints the figure's path."""
    import argparse
    import json

    p = argparse.ArgumentParser(prog=prog, description=doc.split("\n\n")[0])
    p.add_argument("record", help=record_help)
    p.add_argument("--out", default=None, help=f"figure path (default: next to the record, {default_name})")
    args = p.parse_args(argv)
    record = json.loads(Path(args.record).read_text())
    print(plot(record, args.out or Path(args.record).with_name(default_name)))
    return 0
