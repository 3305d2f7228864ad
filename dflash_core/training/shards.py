"""Training data that accumulates over runs: token shards with manifests, and a local feature cache per shard.

A shard is what one generation batch produced. In a data folder, shard ``<name>`` is:

* ``<name>.tokens.npz`` -- token ids of the responses (uint16 when the vocabulary fits, else int32, concatenated, with
  offsets) and, per sample, a prompt reference (``prompt_key``: source, item id and pass, e.g.
  ``gsm8k:1234#p0``), the decoding mode and the prompt length. Never the prompt text: prompts are rebuilt from their
  sources at load time (:mod:`dflash_core.training.prompts`). Small and compressed: these may be committed.
* ``<name>.json`` -- the manifest: target hash, generation settings, seed, batch size, dtype, CPU, threads, wall time.
* ``<name>.feat.npy`` / ``<name>.top.npz`` -- local cache (not committed): the tapped target hidden states of every
  position (bf16 bits as int16) and the target's top-k next-token ids / log-probabilities, captured during
  generation. A shard without them is still usable: training recomputes features with one teacher-forced pass.

Every file is written to a temporary name and renamed, manifest last, so an interrupted run leaves only whole shards.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

import numpy as np
import torch

from ..files import atomic_write as _atomic

__all__ = ["ShardSample", "write_shard", "read_shard_tokens", "read_shard_features", "list_shards",
           "done_prompt_keys", "target_fingerprint"]


@dataclass
class ShardSample:
    prompt_key: str  # "<source>:<item id>#p<pass>"
    source: str
    mode: str  # "greedy" or "sampled"
    prompt_len: int
    response_ids: list[int]


def target_fingerprint(target) -> str:
    """A short hash of the target's config and a sample of its weights (which target wrote a shard)."""
    h = hashlib.sha256(json.dumps(target.config.to_dict(), sort_keys=True, default=str).encode())
    w = target.lm_head.weight
    h.update(w.detach()[:: max(1, w.shape[0] // 64), :64].float().cpu().numpy().tobytes())
    return h.hexdigest()[:16]


def write_shard(folder: str | Path, name: str, samples: Sequence[ShardSample], manifest: dict,
                features: Sequence[torch.Tensor] | None = None, top_ids: Sequence[torch.Tensor] | None = None,
                top_logp: Sequence[torch.Tensor] | None = None) -> None:
    """Write shard ``name``: tokens (+ features and top-k when given), then its manifest."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    resp = [np.asarray(s.response_ids, dtype=np.int64) for s in samples]
    flat = np.concatenate(resp) if resp else np.zeros(0, dtype=np.int64)
    dtype = np.uint16 if flat.size == 0 or flat.max() < 65536 else np.int32
    offsets = np.cumsum([0] + [len(r) for r in resp]).astype(np.int64)
    arrays = dict(response=flat.astype(dtype), offsets=offsets,
                  prompt_len=np.asarray([s.prompt_len for s in samples], dtype=np.int32),
                  meta=np.asarray(json.dumps([[s.prompt_key, s.source, s.mode] for s in samples])))

    def save_tokens(tmp):
        with open(tmp, "wb") as f:
            np.savez_compressed(f, **arrays)

    _atomic(folder / f"{name}.tokens.npz", save_tokens)
    if features is not None:
        feats = torch.cat(list(features)).contiguous()
        bits = feats.view(torch.int16) if feats.dtype in (torch.bfloat16, torch.float16) else feats
        info = {"dtype": str(feats.dtype).replace("torch.", ""), "lengths": [int(f.shape[0]) for f in features]}

        def save_feats(tmp):
            with open(tmp, "wb") as f:
                np.save(f, bits.numpy())

        _atomic(folder / f"{name}.feat.npy", save_feats)
        if top_ids is not None:
            def save_top(tmp):
                with open(tmp, "wb") as f:
                    np.savez(f, ids=torch.cat(list(top_ids)).to(torch.int32).numpy(),
                             logp=torch.cat(list(top_logp)).to(torch.float16).numpy(), info=json.dumps(info))

            _atomic(folder / f"{name}.top.npz", save_top)
        manifest = {**manifest, "features": info}
    manifest = {**manifest, "samples": len(samples), "response_tokens": int(flat.size)}
    _atomic(folder / f"{name}.json", lambda tmp: Path(tmp).write_text(json.dumps(manifest, indent=1) + "\n"))


def list_shards(folder: str | Path) -> list[str]:
    """Names of the complete shards (manifest and tokens present), sorted."""
    folder = Path(folder)
    if not folder.is_dir():
        return []
    return sorted(p.name[:-5] for p in folder.glob("*.json")
                  if (folder / (p.name[:-5] + ".tokens.npz")).is_file())


def read_shard_tokens(folder: str | Path, name: str) -> list[ShardSample]:
    with np.load(Path(folder) / f"{name}.tokens.npz") as z:
        resp, offsets, plen = z["response"].astype(np.int64), z["offsets"], z["prompt_len"]
        meta = json.loads(str(z["meta"]))
    return [ShardSample(key, src, mode, int(plen[i]), resp[offsets[i]:offsets[i + 1]].tolist())
            for i, (key, src, mode) in enumerate(meta)]


def read_shard_features(folder: str | Path, name: str, mmap: bool = True):
    """(features [sum T, F] tensor, top_ids [sum T, k] | None, top_logp | None, lengths) or None when not cached."""
    folder = Path(folder)
    fpath = folder / f"{name}.feat.npy"
    if not fpath.is_file():
        return None
    manifest = json.loads((folder / f"{name}.json").read_text())
    info = manifest.get("features") or {}
    bits = np.load(fpath, mmap_mode="r" if mmap else None)
    feats = torch.from_numpy(np.ascontiguousarray(bits) if not mmap else bits)
    if info.get("dtype") in ("bfloat16", "float16"):
        feats = feats.view(getattr(torch, info["dtype"]))
    top_ids = top_logp = None
    tpath = folder / f"{name}.top.npz"
    if tpath.is_file():
        with np.load(tpath) as z:
            top_ids = torch.from_numpy(z["ids"]).long()
            top_logp = torch.from_numpy(z["logp"]).float()
    return feats, top_ids, top_logp, info.get("lengths")


def done_prompt_keys(folder: str | Path) -> set[str]:
    """Prompt keys already generated in ``folder`` (a rerun skips them)."""
    return {s.prompt_key for name in list_shards(folder) for s in read_shard_tokens(folder, name)}
