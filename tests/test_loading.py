"""Loading drafters, targets and checkpoints fast and safely, and the errors named for bad prompts and files."""

from __future__ import annotations

import pytest
import torch

from conftest import make_draft, make_target
from dflash_core import autoregressive_generate, dflash_generate, load_draft
from dflash_core.config import DFlashConfig


def _inputs(config: DFlashConfig, ctx_len: int, block: int, seed: int = 0, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    ctx = torch.randn(1, ctx_len, config.num_taps * config.hidden_size, generator=g, dtype=dtype)
    blk = torch.randn(1, block, config.hidden_size, generator=g, dtype=dtype)
    return ctx, blk


def test_load_draft_builds_on_meta_and_takes_the_checkpoint_tensors(tmp_path, monkeypatch):
    draft = make_draft(make_target("qwen3"), block_size=4, layers=2, dtype=torch.float32)
    draft.save_pretrained(tmp_path)
    init_devices = []
    real = torch.nn.init.kaiming_uniform_

    def spy(tensor, *args, **kwargs):
        init_devices.append(tensor.device.type)
        return real(tensor, *args, **kwargs)

    monkeypatch.setattr(torch.nn.init, "kaiming_uniform_", spy)
    loaded = load_draft(tmp_path, dtype=torch.bfloat16)
    assert init_devices and set(init_devices) == {"meta"}  # no random initialization of real memory
    params = list(loaded.parameters())
    assert all(isinstance(p, torch.nn.Parameter) and p.requires_grad and p.dtype == torch.bfloat16 for p in params)
    assert loaded.rotary.inv_freq.dtype == torch.float32 and not loaded.rotary.inv_freq.is_meta
    ctx, blk = _inputs(draft.config, 11, 4, dtype=torch.float32)
    torch.testing.assert_close(load_draft(tmp_path)(blk, ctx, torch.arange(11, 15), torch.arange(11)),
                               draft(blk, ctx, torch.arange(11, 15), torch.arange(11)), rtol=0, atol=0)


def test_targets_are_read_straight_onto_their_device(monkeypatch):
    import transformers

    from dflash_core.loading import load_target

    calls = []

    class FakeModel:
        def eval(self):
            return self

        def to(self, device):
            calls.append(("to", str(device)))
            return self

    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained", lambda name, **kw: "tokenizer")
    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained",
                        lambda name, **kw: calls.append(("load", kw)) or FakeModel())
    load_target("org/model", torch.bfloat16, "cuda:1")
    assert calls == [("load", {"dtype": torch.bfloat16, "attn_implementation": "sdpa", "device_map": {"": "cuda:1"}})]
    calls.clear()
    load_target("org/model", torch.bfloat16, "cuda:0", device_map="auto", max_memory={0: 10, 1: 10})
    assert calls[0][1]["device_map"] == "auto" and calls[0][1]["max_memory"] == {0: 10, 1: 10}


def test_a_prompt_token_outside_the_vocabulary_is_named():
    target = make_target("llama", vocab=64)
    draft = make_draft(target)
    with pytest.raises(ValueError, match=r"token id 70, outside the target's vocabulary \(ids 0\.\.63, 64 tokens\)"):
        autoregressive_generate(target, torch.tensor([[1, 2, 70, 3]]), max_new_tokens=2)
    with pytest.raises(ValueError, match="token id -1"):
        dflash_generate(target, draft, torch.tensor([[-1, 2]]), max_new_tokens=2)


@pytest.mark.parametrize("damage", ["garbage", "truncated", "lfs-pointer"])
def test_a_damaged_safetensors_file_is_named_with_the_fix(tmp_path, damage):
    draft = make_draft(make_target("qwen3"), dtype=torch.float32)
    draft.save_pretrained(tmp_path)
    weights = tmp_path / "model.safetensors"
    data = weights.read_bytes()
    lfs_pointer = b"version https://git-lfs.github.com/spec/v1\noid sha256:ab\nsize 123\n"
    weights.write_bytes({"garbage": b"\xff" * 64, "truncated": data[: len(data) // 2], "lfs-pointer": lfs_pointer}[damage])
    with pytest.raises(ValueError, match=r"(?s)model\.safetensors is not a readable safetensors file.*download or export"):
        load_draft(tmp_path)


class _Payload:
    def __reduce__(self):
        return (print, ("this would run on load",))


def test_training_checkpoints_are_loaded_without_unpickling_code(tmp_path):
    from dflash_core.training.loop import load_checkpoint

    safe = tmp_path / "ok.pt"
    torch.save({"draft": {"w": torch.ones(2)}, "state": {"step": 3, "history": [{"loss": 1.5}]}}, safe)
    assert load_checkpoint(safe)["state"]["step"] == 3
    evil = tmp_path / "evil.pt"
    torch.save({"draft": {}, "payload": _Payload()}, evil)
    with pytest.raises(ValueError, match="arbitrary code"):
        load_checkpoint(evil)


@pytest.mark.parametrize("offline", ["1", None])
def test_an_unreachable_hub_is_a_clear_error_naming_hf_hub_offline_and_what_to_carry(monkeypatch, offline):
    import transformers

    from dflash_core.loading import load_target

    def unreachable(name, **kwargs):
        raise OSError("We couldn't connect to 'https://huggingface.co' to load the files")

    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained", unreachable)
    for var in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE"):
        monkeypatch.delenv(var, raising=False)
    if offline:
        monkeypatch.setenv("HF_HUB_OFFLINE", offline)
    with pytest.raises(FileNotFoundError) as info:
        load_target("Qwen/Qwen3-8B", torch.bfloat16, "cpu")
    text = str(info.value)
    assert "HF_HUB_OFFLINE" in text and "models--Qwen--Qwen3-8B" in text and "--local-dir" in text
    assert ("was not asked" in text) == bool(offline)  # unset: the fix is to set it
