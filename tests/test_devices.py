"""Rank-to-GPU placement (rank_gpus, pick_device) and CUDA events recorded on the stream of the model's device."""

import pytest
import torch


@pytest.mark.parametrize("local_rank,local_world,gpus,expected", [
    (0, 1, 1, [0]), (0, 1, 8, list(range(8))), (0, 2, 8, [0, 1, 2, 3]), (1, 2, 8, [4, 5, 6, 7]),
    (3, 4, 8, [6, 7]), (1, 3, 8, [2, 3]), (2, 3, 8, [4, 5]), (5, 8, 8, [5]), (9, 16, 8, [1]),
])
def test_each_rank_gets_its_own_share_of_the_gpus(local_rank, local_world, gpus, expected):
    from experiments.models import rank_gpus

    assert rank_gpus(local_rank, local_world, gpus) == expected


def test_pick_device_makes_only_the_ranks_own_gpu_current(monkeypatch):
    from experiments import benchmark
    from experiments.models import pick_device

    current = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 8)
    monkeypatch.setattr(torch.cuda, "set_device", lambda d: current.append(torch.device(d)))
    assert pick_device("cuda", local_rank=1, local_world=2) == torch.device("cuda", 4)
    assert pick_device("cuda:6", local_rank=0, local_world=2) == torch.device("cuda", 6)  # explicit: made current too
    assert benchmark.pick_device("auto", benchmark.RankInfo(3, 4, 3, 4)) == torch.device("cuda", 6)
    assert current == [torch.device("cuda", 4), torch.device("cuda", 6), torch.device("cuda", 6)]


class _FakeEvent:
    log: list = []

    def __init__(self, enable_timing=False):
        pass

    def record(self, stream=None):
        _FakeEvent.log.append(stream)

    def elapsed_time(self, other):
        return 2.0


def test_cuda_events_record_on_the_stream_of_the_models_device(monkeypatch):
    from dflash_core.timing import median_seconds
    from dflash_core.timing import StageTimer

    synced = []
    _FakeEvent.log = []
    monkeypatch.setattr(torch.cuda, "Event", _FakeEvent)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: f"stream of {torch.device(device)}")
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: synced.append(torch.device(device)))
    timer = StageTimer("cuda:1")
    with timer.stage("verify"):
        pass
    assert timer.totals() == {"verify": 0.002} and synced == [torch.device("cuda", 1)]
    assert median_seconds(lambda: None, 2, torch.device("cuda", 1)) == 0.002
    assert _FakeEvent.log == ["stream of cuda:1"] * 6
