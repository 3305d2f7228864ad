"""What travels to the GPU and back: the packed training data, the protocol prompts, and drafters split into parts.

:func:`pack` (on this machine) writes ``train.npz`` (every committed response shard's sequence with its prompt
rebuilt here, minus the samples ``fit`` holds out; token ids as uint16 where the vocabulary allows) and
``protocol.json`` (the fixed protocol's prompt ids). :func:`split_drafter` (on the GPU) writes a drafter's weights as
safetensors parts no bigger than the transfer limit; :func:`join` (back here) rebuilds the drafter folder from them
and the config that ``results.json`` carries.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import torch

__all__ = ["pack", "load_sequences", "load_protocol", "split_drafter", "join", "PART_BYTES"]

PART_BYTES = 15 * 2**20  # one file back from the device may hold 16 MiB


def pack(out: str | Path, eval_prompts: int = 6, seed: int = 0, log=print) -> dict:
    """Write ``train.npz`` and ``protocol.json`` into ``out``; returns their summary."""
    from dflash_core.default import DEFAULT_DRAFT_DIR
    from dflash_core.files import atomic_write
    from dflash_core.loading import load_target
    from dflash_core.training.corpus import build_draft_vocab
    from dflash_core.training.fit import load_training_data
    from experiments.bench.schema import write_json_atomic
    from experiments.studies.drafter_eval import protocol_prompts

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    _, tokenizer, stops = load_target("default", torch.float32, "cpu")
    data = load_training_data([DEFAULT_DRAFT_DIR / "data"], tokenizer, seed, eval_prompts, log)
    width = np.uint16 if tokenizer.vocab_size <= 2**16 and len(tokenizer) <= 2**16 else np.uint32
    ids = [s.numpy().astype(width) for s, _ in data.sequences]
    ranked = build_draft_vocab(data.responses, 16384, always=stops)
    arrays = dict(tokens=np.concatenate(ids), lengths=np.array([len(x) for x in ids], dtype=np.int64),
                  prompt_lens=np.array([p for _, p in data.sequences], dtype=np.int64), ranked_vocab=ranked.numpy())

    def save(tmp: Path) -> None:
        with open(tmp, "wb") as f:  # a file object: numpy would add ".npz" to the temporary name
            np.savez_compressed(f, **arrays)
    atomic_write(out / "train.npz", save)
    prompts = [{"group": g, "dataset": d, "sample_id": s, "ids": p} for g, d, s, p in protocol_prompts(tokenizer)]
    summary = {"sequences": len(ids), "tokens": int(sum(len(x) for x in ids)),
               "response_tokens": data.response_tokens, "held_out": eval_prompts, "seed": seed,
               "protocol_prompts": len(prompts), "stops": stops}
    write_json_atomic(out / "protocol.json", {"prompts": prompts, "summary": summary})
    log(f"packed {summary} into {out}")
    return summary


def load_sequences(folder: str | Path) -> tuple[list[tuple[torch.Tensor, int]], torch.Tensor]:
    """(sequences [(ids, prompt length)], ranked response token ids) from ``train.npz``."""
    blob = np.load(Path(folder) / "train.npz")
    tokens = torch.from_numpy(blob["tokens"].astype(np.int64))
    ends = np.cumsum(blob["lengths"])
    starts = ends - blob["lengths"]
    seqs = [(tokens[a:b], int(p)) for a, b, p in zip(starts, ends, blob["prompt_lens"])]
    return seqs, torch.from_numpy(blob["ranked_vocab"].astype(np.int64))


def load_protocol(folder: str | Path) -> tuple[list[tuple[str, str, str, list[int]]], list[int]]:
    """([(group, dataset, sample id, prompt ids)], stop ids) from ``protocol.json``."""
    blob = json.loads((Path(folder) / "protocol.json").read_text())
    return ([(p["group"], p["dataset"], p["sample_id"], p["ids"]) for p in blob["prompts"]],
            blob["summary"]["stops"])


def split_drafter(folder: str | Path, dest: str | Path, name: str, part_bytes: int = PART_BYTES) -> list[Path]:
    """Write ``folder``'s weights as ``{name}.partK.safetensors`` (each at most ``part_bytes`` of tensor data,
    tensors never cut) into ``dest``; its config travels inside ``results.json`` (the device returns few files)."""
    from safetensors.torch import load_file, save_file

    dest = Path(dest)
    state = load_file(str(Path(folder) / "model.safetensors"))
    parts: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for key in sorted(state):
        n = state[key].numel() * state[key].element_size()
        if n > part_bytes:
            raise ValueError(f"tensor {key} ({n} bytes) alone exceeds a part of {part_bytes} bytes")
        if size + n > part_bytes:
            parts.append({})
            size = 0
        parts[-1][key] = state[key]
        size += n
    written = []
    for k, part in enumerate(parts):
        path = dest / f"{name}.part{k}.safetensors"
        save_file(part, str(path), metadata={"format": "pt"})
        written.append(path)
    return written


def join(results: str | Path, name: str, out: str | Path) -> Path:
    """Rebuild the drafter ``name`` from the parts :func:`split_drafter` wrote into ``results`` and its config in
    ``results/results.json``; returns its folder."""
    from safetensors.torch import load_file, save_file

    results, out = Path(results), Path(out)
    parts = sorted(results.glob(f"{name}.part*.safetensors"), key=lambda p: int(p.stem.rsplit("part", 1)[1]))
    configs = json.loads((results / "results.json").read_text()).get("configs", {})
    if not parts or name not in configs:
        raise FileNotFoundError(f"no drafter {name!r} in {results}: expected {name}.part0.safetensors ... and its "
                                f"config in results.json (it holds {sorted(configs)})")
    state: dict[str, torch.Tensor] = {}
    for p in parts:
        state.update(load_file(str(p)))
    out.mkdir(parents=True, exist_ok=True)
    save_file(state, str(out / "model.safetensors"), metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(configs[name], indent=2) + "\n")
    return out
