"""Torchrun ranks and devices: this process's place in a launch, the end-of-run barrier, its device and its name.

Under ``torchrun --nproc_per_node=G`` the conversations are dealt round-robin to the ranks; each rank uses its own
GPU (or, for a ``device_map="auto"`` target, its share of the GPUs, see ``dflash_core.default.rank_gpus``) and
writes its own records file (:meth:`RankInfo.records_path`). Nothing is collective but one barrier at the end of a pair.
"""

from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass
from pathlib import Path

import torch

from dflash_core.default import resolve_device
from experiments.bench.schema import RECORDS_FILENAME

__all__ = ["RANK_RECORDS_GLOB", "RankInfo", "device_name", "pick_device", "process_group"]

RANK_RECORDS_GLOB = "records.rank*.jsonl"


@dataclass(frozen=True)
class RankInfo:
    """This process's place in a torchrun launch (rank 0 of 1 otherwise)."""

    rank: int = 0
    world: int = 1
    local_rank: int = 0
    local_world: int | None = None  # ranks on this machine (LOCAL_WORLD_SIZE); None = world

    @classmethod
    def from_env(cls) -> "RankInfo":
        env = os.environ
        local_world = env.get("LOCAL_WORLD_SIZE")
        return cls(int(env.get("RANK", 0)), int(env.get("WORLD_SIZE", 1)), int(env.get("LOCAL_RANK", 0)),
                   int(local_world) if local_world else None)

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    def records_path(self, folder: Path) -> Path:
        return folder / (RECORDS_FILENAME if self.world == 1 else f"records.rank{self.rank}.jsonl")

    def barrier(self) -> None:
        if self.world > 1:
            import torch.distributed as dist

            dist.barrier()


@contextlib.contextmanager
def process_group(rank: RankInfo):
    """A gloo group (CPU tensors only, long timeout) just for the end-of-run barrier; nothing else is collective."""
    if rank.world == 1:
        yield
        return
    import datetime

    import torch.distributed as dist

    dist.init_process_group("gloo", timeout=datetime.timedelta(hours=48))
    try:
        yield
    finally:
        dist.destroy_process_group()


def pick_device(name: str, rank: RankInfo) -> torch.device:
    """This rank's device (made current on CUDA): ``cuda`` without an index is the first GPU of its share, ``cuda:N``
    is taken as given (:func:`dflash_core.default.resolve_device`)."""
    if name != "auto" and torch.device(name).type == "cuda" and not torch.cuda.is_available():
        raise ValueError("this run needs CUDA (the paper preset's models do not fit a CPU run), and no GPU is "
                         "visible; use --preset default or quick on a machine without a GPU")
    return resolve_device(name, local_rank=rank.local_rank, local_world=rank.local_world or rank.world)


def device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    from dflash_core.timing import cpu_model

    return f"cpu ({cpu_model()}, {torch.get_num_threads()} threads)"
