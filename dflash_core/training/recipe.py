"""The drafter recipe in one command: generate data shards, then train on every shard of the folder.

    python -m dflash_core.training.recipe --out runs/recipe --gen-minutes 30 --train-minutes 60

Stage 1 is :mod:`.datagen` (into ``OUT/data``: shards accumulate, prompts already answered are skipped), stage 2 is
:mod:`.fit` (into ``OUT/fit``: resumable from its checkpoint). The same command runs on a CPU (single-thread worker
processes) and on a GPU (large batches; ``--device cuda``); under ``torchrun`` every rank generates its share of the
prompts on its own GPU and then trains data-parallel. ``--data`` adds shard folders to train on (e.g. the committed
shards of the shipped drafter, ``dflash_core/zoo/smollm2-135m-dflash/data``; features are then recomputed by a
teacher-forced pass). Everything after ``--`` goes to :mod:`.fit` unchanged (``-- --lr 3e-4 --layers 3``).

A smoke run at toy size: ``--gen-batches 1 --gen-batch 4 --max-new-tokens 16 -- --steps 2 --eval-prompts 0``.
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path

__all__ = ["main"]


def main(argv=None) -> None:
    import sys

    argv = list(sys.argv[1:] if argv is None else argv)
    extra = argv[argv.index("--") + 1:] if "--" in argv else []
    argv = argv[: argv.index("--")] if "--" in argv else argv
    p = argparse.ArgumentParser(prog="python -m dflash_core.training.recipe", description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True)
    p.add_argument("--target", default="smollm2")
    p.add_argument("--device", default="auto")
    p.add_argument("--gen-minutes", type=float, default=None, help="data generation budget (default: all prompts)")
    p.add_argument("--gen-batch", type=int, default=None, help="default: 96 on a CPU, 256 on a GPU")
    p.add_argument("--gen-batches", type=int, default=None, help="stop generating after N batches per worker")
    p.add_argument("--gen-workers", type=int, default=None, help="CPU: processes (default: one per core, at most 2)")
    p.add_argument("--max-new-tokens", type=int, default=256)
    p.add_argument("--passes", type=int, default=2)
    p.add_argument("--skip-data", action="store_true", help="train on the shards already in OUT/data")
    p.add_argument("--data", action="append", default=[], help="more shard folders to train on (repeatable)")
    p.add_argument("--train-minutes", type=float, default=None)
    p.add_argument("--init", help="start from this drafter folder")
    p.add_argument("--draft-vocab", type=int, default=4096, help="0: the full vocabulary")
    p.add_argument("--export", help="copy the trained drafter here (e.g. the package zoo)")
    a = p.parse_args(argv)
    from . import datagen, fit

    out = Path(a.out)
    data = out / "data"
    if not a.skip_data:
        gen = ["--out", str(data), "--target", a.target, "--device", a.device, "--max-new-tokens",
               str(a.max_new_tokens), "--passes", str(a.passes)]
        gen += ["--minutes", str(a.gen_minutes)] if a.gen_minutes else []
        gen += ["--batch", str(a.gen_batch)] if a.gen_batch else []
        gen += ["--max-batches", str(a.gen_batches)] if a.gen_batches else []
        gen += ["--workers", str(a.gen_workers)] if a.gen_workers else []
        datagen.main(gen)
    train = ["--data", str(data), "--out", str(out / "fit"), "--target", a.target, "--device", a.device,
             "--draft-vocab", str(a.draft_vocab)]
    for folder in a.data:
        train += ["--data", folder]
    train += ["--minutes", str(a.train_minutes)] if a.train_minutes else []
    train += ["--init", a.init] if a.init else []
    train += ["--export", a.export] if a.export and int(os.environ.get("RANK", "0")) == 0 else []
    fit.main(train + extra)


if __name__ == "__main__":
    main()
