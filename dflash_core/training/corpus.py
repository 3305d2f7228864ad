"""A training corpus from data shards: sequences, their kept target features, and a draft vocabulary.

Prompts are not stored in shards (only references), so they are rebuilt here from their sources: the prompt key
``<prompt_id>#p<pass>`` names a :class:`dflash_core.training.prompts.PromptItem`, whose text goes through the target's
chat template again. A rebuilt prompt whose length differs from the shard's record (a changed source or tokenizer) is
skipped and counted, never silently misaligned.
"""

from __future__ import annotations

import json
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterable, Sequence

import torch

from .shards import list_shards, read_shard_features, read_shard_tokens

__all__ = ["Corpus", "load_corpus", "build_draft_vocab", "vocab_coverage"]


@dataclass
class Corpus:
    sequences: list[tuple[torch.Tensor, int]]  # (prompt + response ids [T], prompt length)
    keys: list[str]
    sources: list[str]
    responses: list[list[int]]
    _features: list[tuple | None] = field(default_factory=list, repr=False)  # (shard features, offset) per sequence
    skipped: int = 0

    def feature_source(self, i: int, layer_ids: Sequence[int] | None = None):
        """SequenceFeatures of sequence i from the shard cache (None when its shard kept no features).

        ``layer_ids``: the drafter's taps, when they are a subset of (or ordered differently from) the taps the
        shard kept; their columns are selected. A tap the shard did not keep is an error."""
        from .loss import SequenceFeatures

        entry = self._features[i]
        if entry is None:
            return None
        (feats, top_ids, top_logp), off, kept = entry
        t = len(self.sequences[i][0])
        rows = feats[off:off + t]
        if layer_ids is not None and kept is not None and list(layer_ids) != list(kept):
            missing = [x for x in layer_ids if x not in kept]
            if missing:
                raise ValueError(f"the drafter reads target layers {list(layer_ids)}, but the data shards kept only "
                                 f"{list(kept)}: regenerate the data with --taps covering {missing}")
            cols = [list(kept).index(x) for x in layer_ids]
            rows = rows.reshape(t, len(kept), -1)[:, cols].reshape(t, -1)
        return SequenceFeatures(rows, None if top_ids is None else top_ids[off:off + t],
                                None if top_logp is None else top_logp[off:off + t])

    @property
    def has_features(self) -> bool:
        return bool(self._features) and all(f is not None for f in self._features)

    @property
    def response_tokens(self) -> int:
        return sum(len(r) for r in self.responses)


def load_corpus(folder: str | Path, tokenizer, seed: int = 0, exclude: Iterable[str] = ()) -> Corpus:
    """Every sample of every complete shard in ``folder`` (keys in ``exclude`` left out).

    Prompts are rebuilt from the pools with the seed each shard's manifest records (the generation's seed; ``seed``
    only for shards that do not say), so a training run's own seed never changes which samples load."""
    from .pools.catalog import build_chat

    from .prompts import build_prompts

    pools: dict[int, dict] = {}
    exclude = set(exclude)
    corpus = Corpus([], [], [], [])
    for name in list_shards(folder):
        samples = read_shard_tokens(folder, name)
        cached = read_shard_features(folder, name)
        manifest = json.loads((Path(folder) / f"{name}.json").read_text())
        kept = manifest.get("taps") if cached is not None else None
        shard_seed = int(manifest.get("seed", seed))
        if shard_seed not in pools:
            pools[shard_seed] = {it.prompt_id: it for it in build_prompts(shard_seed)}
        prompts = pools[shard_seed]
        offsets = None
        if cached is not None:
            lengths = cached[3]
            offsets = [0]
            for n in lengths[:-1]:
                offsets.append(offsets[-1] + n)
        for k, s in enumerate(samples):
            item = prompts.get(s.prompt_key.split("#")[0])
            if item is None or s.prompt_key in exclude:
                corpus.skipped += item is None
                continue
            ids = build_chat(tokenizer, [item.text])
            if len(ids) != s.prompt_len or (cached is not None and cached[3][k] != s.prompt_len + len(s.response_ids)):
                corpus.skipped += 1
                continue
            corpus.sequences.append((torch.tensor(ids + s.response_ids), s.prompt_len))
            corpus.keys.append(s.prompt_key)
            corpus.sources.append(s.source)
            corpus.responses.append(s.response_ids)
            corpus._features.append(None if cached is None else (cached[:3], offsets[k], kept))
    return corpus


def build_draft_vocab(responses: Iterable[Sequence[int]], size: int, always: Iterable[int] = ()) -> torch.Tensor:
    """The ``size`` most frequent token ids of the target's own responses (ties: lower id first), plus ``always``.

    Returned in frequency order (most frequent first), the order ``DFlashDraftModel.set_draft_vocab`` keeps.
    """
    counts = Counter()
    for r in responses:
        counts.update(r)
    ranked = sorted(counts, key=lambda t: (-counts[t], t))
    forced = [int(t) for t in always]
    chosen = forced + [t for t in ranked if t not in set(forced)]
    return torch.tensor(chosen[:max(size, len(forced))], dtype=torch.long)


def vocab_coverage(responses: Iterable[Sequence[int]], vocab: torch.Tensor) -> float:
    """Share of response tokens that lie inside ``vocab``."""
    inside = set(vocab.tolist())
    total = hit = 0
    for r in responses:
        total += len(r)
        hit += sum(1 for t in r if t in inside)
    return hit / max(1, total)
