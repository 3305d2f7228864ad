"""The dry run (experiments.bench.plan, ``run_benchmark.sh --dry-run``), the paper preset's sizing and datasets, and
where a pair's weights come from (experiments.bench.models: local folders, the hub cache, the disk check, chat
settings). Everything offline on the CPU: no model is downloaded, the paper's models are never loaded."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from experiments.bench import models as models_mod
from experiments.bench.models import (
    KNOWN_SHAPES, InsufficientDiskError, ModelPair, check_weights, load_models, locate_weights, parameter_count,
)
from experiments.bench.presets import PAPER, get_preset, matching_pair, with_overrides

REPO = Path(__file__).resolve().parent.parent
QWEN3_TEMPLATE = (
    "{%- for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{%- endfor %}"
    "{%- if add_generation_prompt %}<|im_start|>assistant\n"
    "{%- if enable_thinking is defined and enable_thinking is false %}<think>\n\n</think>\n\n{%- endif %}"
    "{%- endif %}"
)


@pytest.fixture()
def offline_hub(tmp_path, monkeypatch):
    """An empty Hugging Face cache, the hub switched off, no GPU visible."""
    cache = tmp_path / "hf-cache"
    cache.mkdir()
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 0)
    return cache


@pytest.fixture()
def no_loading(monkeypatch):
    """Any attempt to load weights fails the test."""
    import transformers

    import dflash_core.loading

    def refuse(*args, **kwargs):
        raise AssertionError("weights were loaded")

    monkeypatch.setattr(dflash_core.loading, "load_target", refuse)
    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", refuse)
    monkeypatch.setattr(models_mod, "load_models", refuse)


def save_tiny_qwen3(folder: Path, template: str | None = QWEN3_TEMPLATE) -> Path:
    """A random tiny Qwen3 with a word-level tokenizer (and a Qwen3-style chat template) saved to ``folder``."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import AutoModelForCausalLM, PreTrainedTokenizerFast, Qwen3Config

    words = ["<unk>", "<|im_start|>", "<|im_end|>", "<think>", "</think>", "user", "assistant", "hi"]
    vocab = {w: i for i, w in enumerate(words + [f"w{i}" for i in range(64 - len(words))])}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", eos_token="<|im_end|>")
    if template:
        fast.chat_template = template
    config = Qwen3Config(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=4,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=8, max_position_embeddings=512,
                         tie_word_embeddings=False)
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).save_pretrained(folder)
    fast.save_pretrained(folder)
    return folder


# ---------------------------------------------------------------------------------------------------- the paper preset
def test_the_paper_preset_runs_the_offline_datasets_sized_per_pair():
    assert PAPER.datasets == ("gsm8k", "math500", "aime24", "aime25", "humaneval", "mt-bench")
    assert set(PAPER.hub_datasets) == {"mbpp", "livecodebench", "swe-bench", "alpaca"}
    assert PAPER.time_budget_s == 3600.0
    every = with_overrides(PAPER, include_hub=True)
    assert len(every.datasets) == 10 and every.hub_datasets == () and every.datasets[0] == "gsm8k"
    named = with_overrides(PAPER, datasets=("gsm8k", "mbpp"))
    assert named.datasets == ("gsm8k", "mbpp") and "mbpp" not in named.hub_datasets
    with pytest.raises(ValueError, match="not both"):
        with_overrides(PAPER, datasets=("gsm8k",), include_hub=True)


def test_a_local_folder_or_cache_snapshot_keeps_its_pairs_settings(tmp_path):
    eight = with_overrides(PAPER, target=str(tmp_path / "Qwen3-8B")).models
    assert len(eight) == 1 and eight[0].name == "qwen3-8b" and eight[0].draft == "z-lab/Qwen3-8B-DFlash-b16"
    assert eight[0].chat_template_kwargs == (("enable_thinking", False),) and eight[0].target.endswith("Qwen3-8B")
    snapshot = tmp_path / "hub" / "models--Qwen--Qwen3-Coder-30B-A3B-Instruct" / "snapshots" / "0123abc"
    coder = with_overrides(PAPER, target=str(snapshot), draft=str(tmp_path / "drafter")).models[0]
    assert coder.device_map == "auto" and coder.name == "qwen3-coder-30b-a3b" and coder.draft.endswith("drafter")
    assert with_overrides(PAPER, target="Qwen/Qwen3-4B").models[0].name == "qwen3-4b"  # not only the first pair
    assert matching_pair(PAPER, str(tmp_path / "my-model")) is None
    other = with_overrides(PAPER, target=str(tmp_path / "my-model")).models[0]
    assert other.chat_template_kwargs == () and other.device_map is None


# ---------------------------------------------------------------------------------------------------- weights
def test_parameter_counts_from_configs():
    from transformers import AutoModelForCausalLM, Qwen3Config, Qwen3MoeConfig

    assert round(parameter_count(KNOWN_SHAPES["Qwen/Qwen3-4B"]) / 1e9, 2) == 4.02  # published sizes
    assert round(parameter_count(KNOWN_SHAPES["Qwen/Qwen3-8B"]) / 1e9, 2) == 8.19
    assert round(parameter_count(KNOWN_SHAPES["Qwen/Qwen3-Coder-30B-A3B-Instruct"]) / 1e9, 1) == 30.5
    dense = Qwen3Config(vocab_size=96, hidden_size=32, intermediate_size=48, num_hidden_layers=3,
                        num_attention_heads=4, num_key_value_heads=2, head_dim=8, tie_word_embeddings=False)
    moe = Qwen3MoeConfig(vocab_size=96, hidden_size=32, intermediate_size=48, moe_intermediate_size=16,
                         num_experts=4, num_experts_per_tok=2, num_hidden_layers=3, num_attention_heads=4,
                         num_key_value_heads=2, head_dim=8, tie_word_embeddings=False)
    for config in (dense, moe):
        model = AutoModelForCausalLM.from_config(config)
        assert parameter_count(config.to_dict()) == sum(p.numel() for p in model.parameters()), config.model_type
    draft = json.loads((REPO / "dflash_core" / "zoo" / "smollm2-135m-dflash" / "config.json").read_text())
    from dflash_core import load_draft

    shipped = load_draft(REPO / "dflash_core" / "zoo" / "smollm2-135m-dflash")
    assert parameter_count(draft) == sum(p.numel() for p in shipped.parameters())


def test_weights_are_found_in_folders_and_the_hub_cache(tmp_path, offline_hub):
    assert locate_weights("default").kind == "built-in"
    assert locate_weights("Qwen/Qwen3-8B").kind == "download"
    assert locate_weights("Qwen/Qwen3-8B").download_bytes == 2 * parameter_count(KNOWN_SHAPES["Qwen/Qwen3-8B"])
    root = offline_hub / "models--Qwen--Qwen3-8B"
    snap = root / "snapshots" / "abc"
    snap.mkdir(parents=True)
    (root / "refs").mkdir()
    (root / "refs" / "main").write_text("abc")
    (snap / "config.json").write_text(json.dumps(KNOWN_SHAPES["Qwen/Qwen3-8B"]))
    (snap / "model.safetensors.index.json").write_text(json.dumps(
        {"weight_map": {"a": "model-00001-of-00002.safetensors", "b": "model-00002-of-00002.safetensors"}}))
    (snap / "model-00001-of-00002.safetensors").write_bytes(b"x" * 1000)
    partial = locate_weights("Qwen/Qwen3-8B")  # one shard of two: still a download, less what is there
    assert partial.kind == "download" and partial.config_from == "config.json"
    assert partial.download_bytes == 2 * parameter_count(KNOWN_SHAPES["Qwen/Qwen3-8B"]) - 1000
    (snap / "model-00002-of-00002.safetensors").write_bytes(b"x" * 500)
    cached = locate_weights("Qwen/Qwen3-8B")
    assert cached.kind == "cached" and cached.path == snap and cached.disk_bytes == 1500
    check_weights(ModelPair("Qwen/Qwen3-8B", "random"))  # cached: nothing to download, nothing to refuse


def test_downloads_are_refused_before_loading_when_offline_or_out_of_disk(tmp_path, offline_hub, no_loading,
                                                                          monkeypatch):
    pair = ModelPair("Qwen/Qwen3-8B", "z-lab/Qwen3-8B-DFlash-b16")
    with pytest.raises(FileNotFoundError, match="not in the Hugging Face cache"):
        models_mod.check_weights(pair)
    monkeypatch.delenv("HF_HUB_OFFLINE")
    monkeypatch.setattr(models_mod, "_free_bytes", lambda folder: 3 * 2**30)
    with pytest.raises(InsufficientDiskError, match=r"need ~17\.\d GiB, but only 3\.0 GiB are free") as err:
        models_mod.check_weights(pair)
    assert "8.19 B parameters x 2 bytes" in str(err.value) and "HF_HUB_CACHE" in str(err.value)
    # the runner's loader checks first: the refusal comes before any weights are read (no_loading would fail)
    with pytest.raises(InsufficientDiskError):
        load_models(pair, "bf16", torch.device("cpu"))


def test_a_local_qwen3_folder_keeps_the_chat_settings_of_its_family(tmp_path):
    folder = save_tiny_qwen3(tmp_path / "my-qwen3")
    loaded = load_models(ModelPair(str(folder), "random"), "fp32", torch.device("cpu"))
    assert loaded.pair.chat_template_kwargs == (("enable_thinking", False),)
    text = loaded.tokenizer.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False,
                                                add_generation_prompt=True, **dict(loaded.pair.chat_template_kwargs))
    assert text.endswith("assistant<think>\n\n</think>")  # the empty thinking block the Session renders
    # the paper pair it stands for keeps its own settings (and drafter, name) through --target <folder>
    eight = save_tiny_qwen3(tmp_path / "Qwen3-8B", template=QWEN3_TEMPLATE.replace("enable_thinking", "thinking"))
    pair = with_overrides(PAPER, target=str(eight), draft="random").models[0]
    loaded = load_models(pair, "fp32", torch.device("cpu"))
    assert loaded.pair.name == "qwen3-8b" and loaded.pair.chat_template_kwargs == (("enable_thinking", False),)
    plain = load_models(ModelPair(str(save_tiny_qwen3(tmp_path / "no-template", template=None)), "random"), "fp32",
                        torch.device("cpu"))
    assert plain.pair.chat_template_kwargs == ()


# ---------------------------------------------------------------------------------------------------- the dry run
def test_paper_dry_run_on_a_cpu_offline(tmp_path, offline_hub, no_loading, capsys):
    from experiments.bench import plan
    out_json = tmp_path / "plan.json"
    assert plan.main(["--preset", "paper", "--out", str(tmp_path / "runs"), "--json", str(out_json)]) == 0
    text = capsys.readouterr().out
    data = json.loads(out_json.read_text())
    for name in ("gsm8k", "math500", "aime24", "aime25", "humaneval", "mt-bench"):
        assert any(d["name"] == name and d["status"] == "available" and d["prompts"] > 0 for d in data["datasets"])
    for name in ("mbpp", "livecodebench", "swe-bench", "alpaca"):
        assert any(d["name"] == name and d["status"] == "skipped" for d in data["datasets"]), name
    assert "no CUDA here: this preset would run on CUDA" in text and "needs download" in text
    assert "HF_HUB_OFFLINE" in text and "dry run only: nothing was loaded or run." in text
    assert len(data["pairs"]) == 4
    hybrid = next(p for p in data["pairs"] if p["target"] == "Qwen/Qwen3.5-27B")
    assert 26e9 < hybrid["target_params"] < 28e9  # its Gated DeltaNet layers counted as such
    per_node = 48 * (4 * 48 * 128 * 128 + 2 * (2 * 16 * 128 + 48 * 128) * 4)  # 48 linear layers, bf16 conv windows
    assert hybrid["memory"]["node_states"] == 65 * per_node  # trees stop at its max_budget, 64 nodes + the root
    assert "qwen3.5-27b" in text and "node budgets above 64 are left out for this pair" in text
    assert "DDTree (B=128)" not in text.split("runs/qwen3.5-27b:")[1].split("\n")[0]
    for p in data["pairs"]:
        assert p["sized"] and p["budget_s"] == 3600.0
        assert 0 < p["projected_s"] <= p["budget_s"] < p["projected_full_s"]  # the printed plan is the sized plan
        assert p["generations"] > 0 and p["left_out"] and p["target_params"] > 3e9
        assert p["memory"]["kv_target"] > 0 and p["memory"]["total"] > p["memory"]["weights"]
    assert data["context"] > 2 * PAPER.max_new_tokens  # MT-Bench's second turn carries the first answer
    assert not (tmp_path / "runs").exists()


def test_dry_run_with_a_local_target_folder_and_the_hub_datasets(tmp_path, offline_hub, capsys):
    from experiments.bench import plan
    folder = save_tiny_qwen3(tmp_path / "Qwen3-8B")
    assert plan.main(["--preset", "paper", "--target", str(folder), "--draft", "random", "--max-samples", "2",
                      "--hub-datasets", "--check", "--out", str(tmp_path / "runs")]) == 1
    text = capsys.readouterr().out
    assert f"local folder {folder}" in text and "(from its config.json)" in text
    assert "[chat: {'enable_thinking': False}]" in text and "qwen3-8b:" in text
    assert "dataset mbpp was asked for and is unavailable here" in text  # named, so the run would stop
    assert "nothing to download" in text


def test_each_hub_dataset_is_checked_for_its_own_package_and_cache(tmp_path, monkeypatch):
    import inspect

    from dflash_core.training.pools import catalog
    from experiments.bench import plan_sources
    cache = tmp_path / "hf-cache"
    cache.mkdir()
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    for var in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE", "TRANSFORMERS_OFFLINE"):
        monkeypatch.delenv(var, raising=False)
    installed = {"huggingface_hub"}  # no `datasets` package
    monkeypatch.setattr(plan_sources, "find_spec", lambda name: object() if name in installed else None)
    blocked = plan_sources._hub_blocked
    assert blocked("livecodebench") == ""  # its JSONL files need only huggingface_hub
    assert "`datasets` package" in blocked("mbpp") and "`datasets` package" in blocked("alpaca")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")  # offline: what the local cache holds, each on its own
    assert "HF_HUB_OFFLINE is set" in blocked("livecodebench")
    (cache / "datasets--livecodebench--code_generation_lite").mkdir()
    assert blocked("livecodebench") == ""
    installed.add("datasets")
    monkeypatch.delenv("HF_HUB_OFFLINE")
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    assert "HF_DATASETS_OFFLINE is set" in blocked("alpaca")
    (cache / "datasets--tatsu-lab--alpaca").mkdir()
    assert blocked("alpaca") == "" and "HF_DATASETS_OFFLINE is set" in blocked("swe-bench")
    preset = with_overrides(PAPER, datasets=("livecodebench", "alpaca", "mbpp"))
    plans = {d.name: d for d in plan_sources.dataset_plans(preset)}
    assert plans["livecodebench"].status == plans["alpaca"].status == "available"
    assert "local Hugging Face cache" in plans["alpaca"].detail and plans["mbpp"].status == "unavailable"
    # the repositories and packages follow the loaders in dflash_core/training/pools/catalog.py
    assert set(plan_sources._HUB_SOURCES) == set(catalog.HUB_DATASETS)
    for name, (repo, package) in plan_sources._HUB_SOURCES.items():
        source = inspect.getsource(catalog._LOADERS[name])
        assert repo in source and ("_hub_files" in source) == (package == "huggingface_hub"), name


def _ready_venv(tmp_path: Path) -> dict[str, str]:
    """A venv folder whose python is this test's and whose stamp matches: bootstrap then does nothing."""
    venv = tmp_path / "venv"
    (venv / "bin").mkdir(parents=True)
    py = venv / "bin" / "python"
    py.write_text(f'#!/bin/sh\nexec "{sys.executable}" "$@"\n')
    py.chmod(0o755)
    env = {"PATH": f"{Path(sys.executable).parent}:/usr/bin:/bin", "HOME": str(tmp_path), "DDTREE_VENV": str(venv),
           "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "HF_HUB_CACHE": str(tmp_path / "hf-cache"),
           "CUDA_VISIBLE_DEVICES": ""}
    stamp = subprocess.run(["bash", str(REPO / "scripts" / "bootstrap.sh")], env={**env, "DDTREE_STAMP_ONLY": "1"},
                           capture_output=True, text=True, timeout=60, check=True).stdout.strip()
    (venv / ".ddtree-stamp").write_text(stamp + "\n")
    return env


def test_run_benchmark_dry_run_prints_the_plan_and_runs_nothing(tmp_path):
    env = _ready_venv(tmp_path)
    out = subprocess.run(["bash", str(REPO / "run_benchmark.sh"), "--preset", "paper", "--dry-run", "--max-samples",
                          "2", "--out", str(tmp_path / "runs")], env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "[setup] installing" not in out.stdout + out.stderr
    assert "dry run: preset paper" in out.stdout and "dry run only: nothing was loaded or run." in out.stdout
    assert "[run_benchmark] preset" not in out.stdout and not (tmp_path / "runs").exists()
    both = subprocess.run(["bash", str(REPO / "run_benchmark.sh"), "--hub-datasets", "--datasets", "gsm8k"],
                          env=env, capture_output=True, text=True, timeout=60)
    assert both.returncode == 2 and "not both" in both.stderr


def test_run_benchmark_skips_the_figures_without_matplotlib(tmp_path):
    env = _ready_venv(tmp_path)
    blocker = tmp_path / "no-matplotlib" / "matplotlib"
    blocker.mkdir(parents=True)
    (blocker / "__init__.py").write_text("raise ImportError('matplotlib is blocked for this test')\n")
    env["PYTHONPATH"] = f"{blocker.parent}:{REPO}"
    runs = tmp_path / "runs"
    out = subprocess.run(["bash", str(REPO / "run_benchmark.sh"), "--preset", "tiny", "--datasets", "gsm8k",
                          "--max-samples", "1", "--budgets", "4", "--out", str(runs), "--threads", "1"],
                         env=env, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, (out.stdout + out.stderr)[-3000:]
    assert "matplotlib is not installed: figures and tables are skipped" in out.stderr
    assert (runs / "records.jsonl").is_file() and not (runs / "figures").exists()
    assert "figures: skipped (no matplotlib)" in out.stdout
