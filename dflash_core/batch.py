"""A batch of sequences through the one decode loop: ragged prompts, one drafter pass and one target forward per round.

:func:`dflash_core.rounds.run_rounds` is the loop; this module is its live target side for a batch
(:class:`BatchTarget`) and the entry point the ``*_generate`` functions call for several prompts
(:func:`batch_generate`).

How a batch shares one target cache: every layer holds ``[B, kv_heads, S, head_dim]``. Sequence b's committed tokens
occupy slots ``[0, L_b)``; slots from ``L_b`` to ``S`` hold leftovers that every attention mask hides. A round pads
the sequences' trees to the largest one (a padded row sees only the committed prefix and itself, and its logits are
never computed), gives every node its own sequence's position (``L_b + depth``) and its own tree's ancestor mask, and
after the walk copies each sequence's root and accepted path to ``[L_b, L_b + 1 + accepted)`` (only those entries
move). The drafter keeps
one small cache per sequence; a round stacks the caches of the sequences that want a draft, right-padded, and masks
the padding. A sequence that stops leaves the batch (its cache rows are dropped).

Each sequence has its own policy, generator, stop test and length limit, so it commits exactly the tokens it would
commit alone: every choice is its target's distribution at a position whose prefix is its own committed text (the
module docstring of :mod:`dflash_core.decoding`); batching changes only the arithmetic's grouping.
"""

from __future__ import annotations

import copy
import time
from typing import Sequence

import torch

from .rounds import (
    GenerationResult, RoundRunner, check_room, check_stop_ids, compile_proposal, draft_states, follow, make_block,
    make_blocks, run_rounds, validate_request,
)
from .model import DFlashDraftModel, DraftCache
from .policy import DraftBlock, Proposal, as_policy
from .target import IncompatibleModelError, TREE_MASK_BACKENDS, TargetAdapter, check_compatibility

__all__ = ["BatchTarget", "as_prompts", "batch_generate", "is_batch", "prefill_batch"]


def is_batch(input_ids, attention_mask=None) -> bool:
    """Whether ``input_ids`` asks for a batch: a list/tuple of prompts, a [B, T] tensor with B > 1, or any ids with
    an attention mask."""
    return isinstance(input_ids, (list, tuple)) or attention_mask is not None or (
        isinstance(input_ids, torch.Tensor) and input_ids.dim() == 2 and input_ids.shape[0] > 1)


def as_prompts(input_ids, attention_mask: torch.Tensor | None = None) -> list[torch.Tensor]:
    """The prompts of a batch request as ``[1, T_b]`` tensors: a list of ``[T]`` or ``[1, T]`` id tensors, or
    padded ``[B, T]`` ids with an ``attention_mask`` (1 = token, 0 = padding, left or right; each row's tokens
    contiguous). A [B, T] tensor without a mask is B prompts of equal length."""
    if isinstance(input_ids, (list, tuple)):
        if attention_mask is not None:
            raise ValueError("attention_mask goes with padded [B, T] ids; a list of prompts needs none")
        if not input_ids:
            raise ValueError("the batch is empty: pass at least one prompt")
        prompts = []
        for b, ids in enumerate(input_ids):
            if not isinstance(ids, torch.Tensor) or ids.dim() not in (1, 2) or (ids.dim() == 2 and ids.shape[0] != 1):
                shape = tuple(ids.shape) if isinstance(ids, torch.Tensor) else type(ids).__name__
                raise ValueError(f"prompt {b} of the batch must be a [T] or [1, T] LongTensor, got {shape}")
            prompts.append(ids.reshape(1, -1))
        return prompts
    if not isinstance(input_ids, torch.Tensor) or input_ids.dim() != 2:
        shape = tuple(input_ids.shape) if isinstance(input_ids, torch.Tensor) else type(input_ids).__name__
        raise ValueError(f"a batch is a list of [T] prompts or padded [B, T] ids with an attention mask, got {shape}")
    if attention_mask is None:
        return [row[None] for row in input_ids]
    if not isinstance(attention_mask, torch.Tensor) or attention_mask.shape != input_ids.shape:
        shape = tuple(attention_mask.shape) if isinstance(attention_mask, torch.Tensor) else type(attention_mask)
        raise ValueError(f"attention_mask must have the ids' shape {tuple(input_ids.shape)}, got {shape}")
    prompts = []
    for b, (row, keep) in enumerate(zip(input_ids, attention_mask.bool())):
        where = keep.nonzero().flatten()
        if where.numel() == 0 or int(where[-1] - where[0]) + 1 != where.numel():
            raise ValueError(f"row {b} of attention_mask must mark one contiguous run of prompt tokens (left or right "
                             f"padding), got {keep.int().tolist()}")
        prompts.append(row[where][None])
    return prompts


def _check_batch_backend(target) -> None:
    backend = getattr(getattr(target, "config", None), "_attn_implementation", None)
    if backend is not None and backend not in TREE_MASK_BACKENDS:
        raise IncompatibleModelError(
            f"a batch of prompts is verified under a 4D padding-and-tree mask, which the attention backend {backend!r} "
            f"does not apply (it works with {', '.join(TREE_MASK_BACKENDS)}): load the target with "
            "attn_implementation='sdpa' or decode the prompts one at a time")


@torch.inference_mode()
def prefill_batch(adapter: TargetAdapter, prompts: list[torch.Tensor], with_features: bool
                  ) -> tuple[object, torch.Tensor, list[torch.Tensor | None]]:
    """Ragged prompts ([1, T_b] each) enter one batch cache, right-padded. Returns (cache, the logits after each
    prompt [B, V], each prompt's features [T_b, F] or None)."""
    lengths = [int(p.shape[1]) for p in prompts]
    width = max(lengths)
    ids = torch.zeros(len(prompts), width, dtype=torch.long)
    for b, p in enumerate(prompts):
        ids[b, : lengths[b]] = p[0].cpu()
    length = torch.tensor(lengths)
    q, k = torch.arange(width)[:, None], torch.arange(width)[None, :]
    # a prompt token sees the prompt's tokens before it; a padding row sees that prompt and itself (never read)
    visible = (k <= q)[None] & ((k[None] < length[:, None, None]) | (k == q)[None])
    rows = torch.tensor([b * width + n - 1 for b, n in enumerate(lengths)])
    cache = adapter.new_cache()
    out = adapter.forward_batch(ids, torch.arange(width).expand(len(prompts), -1), cache, visible, rows,
                                with_features)
    features = [None if out.features is None else out.features[b, :n] for b, n in enumerate(lengths)]
    return cache, out.logits, features


class BatchTarget:
    """The live target side of :func:`~dflash_core.rounds.run_rounds` for a batch (see the module docstring).

    Rows of the shared target cache follow ``self.seqs`` (the active sequences, in order); ``lengths[b]`` counts the
    committed tokens of row b. Per sequence: ``pending`` (features of committed positions its drafter has not
    consumed yet) and its own :class:`DraftCache`.
    """

    def __init__(self, adapter: TargetAdapter, draft: DFlashDraftModel | None, cache, lengths: list[int],
                 pending: list[torch.Tensor | None], block_size: int | None = None, with_features: bool = True) -> None:
        self.adapter, self.drafter, self.cache, self.block_size = adapter, draft, cache, block_size
        self.with_features = with_features
        self.seqs = list(range(len(lengths)))
        self.lengths = list(lengths)
        self.pending = dict(enumerate(pending))
        self.draft_caches = {b: DraftCache() for b in self.seqs}
        self.width = max(lengths)  # slots per row in the shared cache
        self._features: torch.Tensor | None = None
        self.batched_drafter = draft is not None and not any(
            layer.self_attn.causal or layer.self_attn.window is not None for layer in draft.layers)

    # ------------------------------------------------------------------ draft
    def draft(self, seqs: list[int], roots: list[int]) -> list[DraftBlock]:
        if not self.batched_drafter or len(seqs) == 1:
            # a drafter with causal or sliding-window layers counts distances in cache slots, which padding would
            # shift: it drafts each sequence in its own pass
            return [self._draft_one(s, root) for s, root in zip(seqs, roots)]
        draft, adapter = self.drafter, self.adapter
        param = next(draft.parameters())
        b = self.block_size or draft.block_size
        rows = [self.seqs.index(s) for s in seqs]
        starts = [self.lengths[r] for r in rows]
        news = [self.pending[s] for s in seqs]
        olds = [self.draft_caches[s].length for s in seqs]
        width_new, width_old = max(len(x) for x in news), max(olds)
        n = len(seqs)
        context = news[0].new_zeros(n, width_new, news[0].shape[-1])
        context_pos = torch.zeros(n, width_new, dtype=torch.long)
        visible = torch.ones(n, 1, b, width_old + width_new + b, dtype=torch.bool)
        for j, (new, old, start) in enumerate(zip(news, olds, starts)):
            context[j, : len(new)] = new
            context_pos[j, : len(new)] = torch.arange(old, start)
            visible[j, :, :, old:width_old] = False  # another sequence's longer past
            visible[j, :, :, width_old + len(new): width_old + width_new] = False  # padding of the new context
        cache = DraftCache()
        if width_old:
            for layer in range(len(draft.layers)):
                cache.keys.append(_stack([self.draft_caches[s].keys[layer] for s in seqs], width_old))
                cache.values.append(_stack([self.draft_caches[s].values[layer] for s in seqs], width_old))
        block_ids = torch.full((n, b), draft.mask_token_id, dtype=torch.long, device=adapter.device)
        block_ids[:, 0] = torch.tensor(roots, device=adapter.device)
        block_pos = torch.tensor(starts)[:, None] + torch.arange(b)
        hidden = draft(adapter.embed(block_ids).to(param.device, param.dtype), context.to(param.device),
                       block_pos.to(param.device), context_pos.to(param.device), cache=cache,
                       attn_mask=visible.to(param.device))  # [n, b, H]
        for j, s in enumerate(seqs):  # each sequence's drafter cache: its old context and its new one, no padding
            keep = list(range(olds[j])) + list(range(width_old, width_old + len(news[j])))
            index = torch.tensor(keep, device=param.device)
            own = self.draft_caches[s]
            own.keys = [k[j: j + 1].index_select(2, index) for k in cache.keys]
            own.values = [v[j: j + 1].index_select(2, index) for v in cache.values]
            self.pending[s] = None
        return make_blocks(draft, adapter, hidden[:, 1:], roots)  # states [n, b-1, H]

    def _draft_one(self, s: int, root: int) -> DraftBlock:
        start = self.lengths[self.seqs.index(s)]
        states = draft_states(self.drafter, self.adapter, root, self.pending[s], start, self.draft_caches[s],
                              self.block_size)[1:]
        self.pending[s] = None
        return make_block(self.drafter, self.adapter, states, root)

    # ------------------------------------------------------------------ verify
    def verify(self, seqs: list[int], proposals: list[Proposal], roots: list[int]) -> list[torch.Tensor]:
        if seqs != self.seqs:
            raise RuntimeError(f"the batch verifies every active sequence together: got {seqs}, active {self.seqs}")
        flat = [compile_proposal(p, root, start) for p, root, start in zip(proposals, roots, self.lengths)]
        sizes = [len(ids) for ids, _, _ in flat]
        n, width, batch = max(sizes), self.width, len(seqs)
        ids = torch.zeros(batch, n, dtype=torch.long)
        positions = torch.zeros(batch, n, dtype=torch.long)
        visible = torch.zeros(batch, n, width + n, dtype=torch.bool)
        for b, ((tokens, pos, tree), size, start) in enumerate(zip(flat, sizes, self.lengths)):
            ids[b, :size], positions[b, :size], positions[b, size:] = tokens, pos, start
            visible[b, :, :start] = True  # the sequence's own committed tokens; never the slots past them
            visible[b, :size, width: width + size] = torch.ones(size, size, dtype=torch.bool).tril() \
                if tree is None else tree
            visible[b, torch.arange(size, n), width + torch.arange(size, n)] = True  # a padding row sees itself
        rows = torch.cat([b * n + torch.arange(size) for b, size in enumerate(sizes)])
        out = self.adapter.forward_batch(ids, positions, self.cache, visible, rows, self.with_features)
        self._features = out.features
        return list(out.logits.split(sizes))

    # ------------------------------------------------------------------ commit
    def commit(self, seqs: list[int], paths: list[list[int]], committed: list[list[int]], drafted: list[bool]
               ) -> None:
        width = self.width
        sources, dests, lengths = [], [], []
        for b, (s, path, was_drafted) in enumerate(zip(seqs, paths, drafted)):
            start = self.lengths[b]
            keep = [0] + [i + 1 for i in path]  # the root and the accepted nodes, as rows of this round's tree
            sources.append([width + k for k in keep])  # where this round put them
            dests.append(list(range(start, start + len(keep))))  # right after the sequence's committed tokens
            lengths.append(start + len(keep))
            if self._features is not None:
                kept = self._features[b, torch.tensor(keep, device=self._features.device)]
                carried = None if was_drafted else self.pending[s]  # a round without the drafter consumed nothing
                self.pending[s] = kept if carried is None else torch.cat([carried, kept])
        most = max(len(row) for row in sources)
        pad = [row + [row[-1]] * (most - len(row)) for row in sources]  # a repeated pair rewrites the same entry
        self.adapter.move_slots(self.cache, torch.tensor(pad),
                                torch.tensor([row + [row[-1]] * (most - len(row)) for row in dests]), max(lengths))
        self.lengths, self.width, self._features = lengths, max(lengths), None

    def finish(self, seqs: list[int]) -> None:
        stay = [b for b, s in enumerate(self.seqs) if s not in seqs]
        for s in seqs:
            self.pending.pop(s, None)
            self.draft_caches.pop(s, None)
        self.seqs = [self.seqs[b] for b in stay]
        self.lengths = [self.lengths[b] for b in stay]
        if stay:
            self.adapter.select_sequences(self.cache, torch.tensor(stay))
            self.width = max(self.lengths)
            self.adapter.crop(self.cache, self.width)


def _stack(parts: list[torch.Tensor], width: int) -> torch.Tensor:
    """[1, h, len_j, d] per sequence -> [n, h, width, d], right-padded with zeros (masked by the caller)."""
    out = parts[0].new_zeros(len(parts), parts[0].shape[1], width, parts[0].shape[-1])
    for j, part in enumerate(parts):
        out[j, :, : part.shape[2]] = part[0]
    return out


@torch.inference_mode()
def batch_generate(target, draft: DFlashDraftModel | None, prompts: list[torch.Tensor], policies: Sequence,
                   max_new_tokens: int = 128, temperature: float = 0.0, stop_token_ids: Sequence[int] | None = None,
                   seed: int = 0, block_size: int | None = None, trace: bool = False, check_trees: bool = False,
                   proposer=None) -> list[GenerationResult]:
    """Decode ``prompts`` ([1, T_b] each) together, sequence b with ``policies[b]`` and a generator seeded
    ``seed + b`` (so it reproduces a single-prompt call with that seed). Returns one result per prompt; their
    ``timings`` are the batch's (shared stages) plus ``"batch"``: the batch size. ``proposer``: proposes every
    round's trees for the whole batch (:class:`~dflash_core.rounds.BatchProposer`) in place of the policies'
    ``propose`` (they still observe their rounds)."""
    for b, p in enumerate(prompts):
        try:
            validate_request(p, max_new_tokens, temperature)
        except ValueError as error:
            raise ValueError(f"prompt {b} of the batch: {error}") from None
    policies = [as_policy(p) for p in policies]
    if len(policies) != len(prompts):
        raise ValueError(f"{len(prompts)} prompts but {len(policies)} policies: one policy per prompt")
    uses_draft = any(p.uses_draft for p in policies)
    if uses_draft:
        if draft is None:
            raise ValueError(f"policy {next(p.name for p in policies if p.uses_draft)!r} needs a drafter; pass draft=...")
        check_compatibility(target, draft)
        if not 2 <= (block_size or draft.block_size):
            raise ValueError(f"block_size must be >= 2, got {block_size}")
    _check_batch_backend(target)
    adapter = TargetAdapter(target, draft.config.target_layer_ids if uses_draft else ())
    for p in prompts:
        adapter.check_token_ids(p)
        check_room(adapter, int(p.shape[1]), max_new_tokens)
    stops = check_stop_ids(adapter, stop_token_ids)
    device = adapter.device
    generators = [torch.Generator(device=device).manual_seed(seed + b) for b in range(len(prompts))]
    results = [GenerationResult([], [], {}, int(p.shape[1]), trees=[] if trace else None) for p in prompts]
    if max_new_tokens == 0:
        for r in results:
            r.timings = {"prefill": 0.0, "decode": 0.0, "batch": float(len(prompts))}
        return results
    from .timing import StageTimer

    timer = StageTimer(device)
    with timer.stage("prefill"):
        cache, logits, features = prefill_batch(adapter, prompts, uses_draft)
    no_nodes = torch.zeros(0, dtype=torch.long)
    histories = []
    for b, p in enumerate(prompts):
        root = follow(no_nodes, no_nodes, logits[b: b + 1], temperature, generators[b])[1]
        results[b].new_token_ids.append(root)
        histories.append(p[0].tolist() + [root])
    side = BatchTarget(adapter, draft, cache, [int(p.shape[1]) for p in prompts], features, block_size,
                       with_features=uses_draft)
    runners = [RoundRunner(policy, None, stops, max_new_tokens, temperature, gen, timer, check_trees)
               for policy, gen in zip(policies, generators)]
    t_loop = time.perf_counter()
    run_rounds(runners, side, histories, results, timer, proposer)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    timings = {**timer.totals(), "decode": time.perf_counter() - t_loop, "batch": float(len(prompts))}
    for r in results:
        r.timings = dict(timings)
    return results


def policies_for(policy, count: int) -> list:
    """One policy per sequence: a list is taken as given (its length must be ``count``); a single policy is copied
    (``copy.deepcopy``), so a policy that learns from its rounds learns each sequence's own."""
    if isinstance(policy, (list, tuple)):
        if len(policy) != count:
            raise ValueError(f"{count} prompts but {len(policy)} policies: pass one policy per prompt, or one policy")
        return list(policy)
    return [policy] + [copy.deepcopy(policy) for _ in range(count - 1)]
