"""The one decode loop: draft -> propose -> verify -> walk -> commit, for one prompt or a batch of them.

Plain decoding, DFlash (a chain) and DDTree (a tree) differ only in the *policy* that turns the drafter's output into
each round's draft tree (:class:`~dflash_core.tree.NoDraft`, :class:`~dflash_core.tree.Chain`, ``ddtree``'s trees).
A single prompt is a batch of one: the same prefill, the same verify forward and the same commit serve any number of
sequences, and a sequence in a batch commits exactly what it would commit alone.

Why the output is exactly the target's (lossless), greedy and sampled alike: each committed token is the target's
own choice at a position whose prefix is already committed. The verify pass computes the target's distribution at
every draft node; walking from the root we draw the target's token (argmax, or a sample from softmax(logits / T)) at
the current node and move into the child carrying that token if there is one. Drafting only decides at which
positions the target's distribution was computed in advance; it never changes which token is drawn there
("sample-and-match"). A tree may carry its own rule instead (sampled trees verify by recursive rejection).

Reading order: the request checks, the walk, :class:`GenerationResult`, :class:`SequenceDecoder` (one sequence's
policy, generator, stop tokens and length limit), :class:`ModelSide` (what the loop asks of the models: the live
drafter and target, :class:`LiveModels`, or replay's known continuation), :func:`run_rounds` (THE loop) and the
entry points (:func:`speculative_generate`, :func:`autoregressive_generate`, :func:`dflash_generate`).

How a batch shares one target cache: every layer holds ``[B, kv_heads, S, head_dim]``. Sequence b's committed tokens
occupy slots ``[0, L_b)``; slots from ``L_b`` to ``S`` hold leftovers that every attention mask hides. A round pads
the sequences' trees to the largest one (a padded row sees only the committed prefix and itself; its logits are never
computed), gives every node its own sequence's position (``L_b + depth``) and its own tree's ancestor mask, and after
the walk copies each sequence's root and accepted path to ``[L_b, L_b + 1 + accepted)``. A batch of one needs no
padding, and its chains need no mask at all (the causal order is exact). The drafter keeps one small cache per
sequence; a round stacks the caches of the sequences that want a draft, right-padded, and masks the padding.
"""

from __future__ import annotations

import copy
import math
import numbers
import time
from collections import defaultdict
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Iterator, Protocol, Sequence

import torch

from .model import DFlashDraftModel, DraftCache, markov_scorer
from .sampling import Sampling
from .target import TargetAdapter, check_compatibility, check_mask_backend
from .tree import ROOT, BlockPolicy, Chain, DraftBlock, DraftTree, NoDraft, child_index

__all__ = [
    "GenerationResult", "LiveModels", "ModelSide", "Request", "SequenceDecoder", "StageTimer", "TreeProposer",
    "autoregressive_generate", "decode", "dflash_generate", "follow", "make_blocks", "policies_for",
    "run_rounds", "speculative_generate", "tree_inputs", "truncate_at_stop", "verify_walk",
]


# ---------------------------------------------------------------------------------------------------- the request
@dataclass(frozen=True)
class Request:
    """A checked generation request: the prompts ``[1, T_b]`` (one per sequence) and the decoding settings.
    ``single``: the caller passed one prompt and gets one result back (else a list, one per prompt)."""

    prompts: list[torch.Tensor]
    max_new_tokens: int
    temperature: float
    stop_token_ids: tuple = ()
    seed: int = 0
    single: bool = True
    sampling: Sampling = field(default_factory=Sampling)

    @classmethod
    def check(cls, input_ids, max_new_tokens: int, temperature: float, stop_token_ids=None, seed: int = 0,
              attention_mask: torch.Tensor | None = None, top_k: int | None = None, top_p: float | None = None,
              min_p: float | None = None) -> Request:
        """Raise ValueError for a malformed prompt, length or sampling setting, before any model work. ``input_ids``:
        a ``[1, T]`` prompt, a list of ``[T]`` / ``[1, T]`` prompts, or padded ``[B, T]`` ids (with an
        ``attention_mask`` marking each row's tokens, left or right padding). ``top_k`` / ``top_p`` / ``min_p``:
        transformers' filters of the target's distribution (:class:`~dflash_core.sampling.Sampling`)."""
        if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, numbers.Integral) or max_new_tokens < 0:
            raise ValueError(f"max_new_tokens must be an int >= 0, got {max_new_tokens!r}")
        sampling = Sampling.check(temperature, top_k, top_p, min_p)
        single = not _is_batch(input_ids, attention_mask)
        prompts = [input_ids] if single else _as_prompts(input_ids, attention_mask)
        for b, ids in enumerate(prompts):
            problem = _prompt_problem(ids)
            if problem:
                raise ValueError(problem if single else f"prompt {b} of the batch: {problem}")
        return cls(prompts, int(max_new_tokens), float(temperature), tuple(stop_token_ids or ()), seed, single,
                   sampling)

    @property
    def longest(self) -> int:
        return max(int(p.shape[1]) for p in self.prompts)


def _prompt_problem(ids) -> str | None:
    if not isinstance(ids, torch.Tensor) or ids.dim() != 2 or ids.shape[0] != 1:
        shape = tuple(ids.shape) if isinstance(ids, torch.Tensor) else type(ids).__name__
        return f"input_ids must be a [1, T] LongTensor (batch size 1), got {shape}"
    if ids.shape[1] < 1:
        return "input_ids is empty: give at least one prompt token"
    if ids.dtype not in (torch.int64, torch.int32):
        return f"input_ids must hold integer token ids, got dtype {ids.dtype}"
    return None


def _is_batch(input_ids, attention_mask=None) -> bool:
    """A list/tuple of prompts, a [B, T] tensor with B > 1, or any ids with an attention mask ask for a batch."""
    return isinstance(input_ids, (list, tuple)) or attention_mask is not None or (
        isinstance(input_ids, torch.Tensor) and input_ids.dim() == 2 and input_ids.shape[0] > 1)


def _as_prompts(input_ids, attention_mask: torch.Tensor | None = None) -> list[torch.Tensor]:
    """The prompts of a batch request as ``[1, T_b]`` tensors (a [B, T] tensor without a mask: B equal lengths)."""
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


def policies_for(policy, count: int) -> list[BlockPolicy]:
    """One policy per sequence: a list is taken as given (its length must be ``count``); a single policy is copied
    (``copy.deepcopy``), so a policy that learns from its rounds learns each sequence's own."""
    policies = list(policy) if isinstance(policy, (list, tuple)) else \
        [policy] + [copy.deepcopy(policy) for _ in range(count - 1)]
    if len(policies) != count:
        raise ValueError(f"{count} prompts but {len(policies)} policies: pass one policy per prompt, or one policy")
    for p in policies:
        if not isinstance(p, BlockPolicy):
            raise TypeError(f"{type(p).__name__} is not a policy: subclass dflash_core.BlockPolicy and implement "
                            "propose(block, history) -> DraftTree (see dflash_core.tree)")
    return policies


def _check_models(adapter: TargetAdapter, request: Request, uses_draft: bool, draft, block_size) -> set[int]:
    """What depends on the models: token ids inside the vocabulary, room for the answer, the drafter's fit and block
    size. Returns the stop ids as a set."""
    if uses_draft and not 2 <= (block_size or draft.block_size):
        raise ValueError(f"block_size must be >= 2, got {block_size}")
    limit = getattr(adapter.model.config, "max_position_embeddings", None)
    for prompt in request.prompts:
        adapter.check_token_ids(prompt)
        length = int(prompt.shape[1])
        if limit is not None and length + request.max_new_tokens > limit:
            room = max(0, limit - length)
            raise ValueError(
                f"the prompt ({length} tokens) plus max_new_tokens ({request.max_new_tokens}) exceed the target's "
                f"{limit} positions (config.max_position_embeddings): "
                + (f"lower max_new_tokens to at most {room}" if room else "shorten the prompt")
                + " (past its trained length the target's outputs are not meaningful)")
    stops = set()
    for t in request.stop_token_ids:
        if isinstance(t, bool) or not isinstance(t, numbers.Integral) or not 0 <= int(t) < adapter.vocab_size:
            raise ValueError(f"stop token id {t!r} is not a token of the target (ids 0..{adapter.vocab_size - 1}): "
                             "pass ids from the tokenizer, e.g. [tokenizer.eos_token_id]")
        stops.add(int(t))
    return stops


# ---------------------------------------------------------------------------------------------------- the walk
def tree_inputs(tree: DraftTree, root: int, start: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Root + nodes flattened for one target forward: token ids [n+1] (root first, then the nodes in order), positions
    [n+1] (= start + depth) and the [n+1, n+1] ancestor-or-self visibility (None for a chain: causal is exact)."""
    token_ids = torch.cat([torch.tensor([root]), tree.token_ids.cpu()])
    positions = start + torch.cat([torch.zeros(1, dtype=torch.long), tree.depths.cpu()])
    return token_ids, positions, None if tree.is_chain else tree.visibility()


def follow(
    token_ids: torch.Tensor,  # [n] draft tokens
    parents: torch.Tensor,  # [n]
    logits: torch.Tensor,  # [n+1, V] target logits at root + nodes
    temperature: float,
    generator: torch.Generator | None,
) -> tuple[list[int], int]:
    """Sample-and-match: walk the verified tree from the root; return (accepted node indices, bonus token).

    At each node draw the target's token: argmax at T = 0, a sample from softmax(logits / T) otherwise. If a child
    carries that token, accept it and continue there; else that token is the bonus and the round ends.
    """
    children = child_index(parents, token_ids)  # (parent node, token) -> node; the root is ROOT = -1
    greedy = temperature <= 0
    choices = logits.argmax(dim=-1).tolist() if greedy else None
    path: list[int] = []
    node = ROOT
    while True:  # logits row node + 1 is the target's distribution after ``node`` (row 0: after the root)
        if greedy:
            token = choices[node + 1]
        else:
            probs = torch.softmax(logits[node + 1].float() / temperature, dim=-1)
            token = int(torch.multinomial(probs, 1, generator=generator))
        child = children.get((node, token))
        if child is None:
            return path, token
        path.append(child)
        node = child


def verify_walk(tree: DraftTree, logits: torch.Tensor, temperature: float, generator: torch.Generator | None
                ) -> tuple[list[int], int]:
    """The round's verification rule: (accepted node indices, bonus token). A tree may carry its own rule as
    ``tree.verify(logits, temperature, generator)`` (sampled trees: recursive rejection, see ``ddtree.sampled``);
    every other tree is walked by :func:`follow`, lossless for any tree whose tokens do not depend on the target."""
    verify = getattr(tree, "verify", None)
    if verify is not None:
        return verify(logits, temperature, generator)
    return follow(tree.token_ids, tree.parents, logits, temperature, generator)


def truncate_at_stop(tokens: list[int], stops: set[int], room: int) -> tuple[list[int], bool]:
    """(the tokens a round commits, whether generation ends): up to and including the first stop token, at most
    ``room`` tokens (what max_new_tokens leaves)."""
    for k, token in enumerate(tokens):
        if token in stops or k + 1 >= room:
            return tokens[: k + 1], True
    return tokens, False


@dataclass
class GenerationResult:
    new_token_ids: list[int]
    acceptance_lengths: list[int]  # tokens committed per round, bonus included (the prefill's token is not a round)
    timings: dict[str, float]  # seconds: prefill, draft, tree, verify, commit, decode (= whole loop after prefill)
    num_input_tokens: int
    tree_sizes: list[int] = field(default_factory=list)  # draft nodes verified per round
    expected_acceptance: list[float] = field(default_factory=list)  # drafter's own estimate per round
    trees: list[Any] | None = None  # the trees themselves when trace=True
    lookup_tokens: list[int] | None = None  # per round, committed tokens proposed by a context lookup (lookup runs)

    @property
    def tau(self) -> float:
        """Mean committed tokens per round (acceptance length, bonus included)."""
        return sum(self.acceptance_lengths) / max(len(self.acceptance_lengths), 1)

    def add_round(self, committed: list[int], tree: DraftTree) -> None:
        """One round: its committed tokens, the tree's size and the drafter's own estimate (and the tree)."""
        self.new_token_ids += committed
        self.acceptance_lengths.append(len(committed))
        self.tree_sizes.append(len(tree.token_ids))
        self.expected_acceptance.append(tree.expected_acceptance())
        if self.trees is not None:
            self.trees.append(tree)


# ---------------------------------------------------------------------------------------------------- one sequence
@dataclass
class SequenceDecoder:
    """How one sequence decodes: its policy, generator, stop tokens and length limit, and the per-sequence steps of
    a round (ask for the drafter, propose a checked tree, walk the verified tree). The live loop, batches and replay
    all use it, so a replay cannot drift from the loop's policy handling."""

    policy: BlockPolicy
    stops: set[int]
    max_new_tokens: int
    temperature: float = 0.0
    generator: torch.Generator | None = None
    check_trees: bool = False
    sampling: Sampling | None = None  # top-k / top-p / min-p: the verified logits are filtered before the walk

    def finished(self, history: list[int], result: GenerationResult) -> bool:
        return history[-1] in self.stops or len(result.new_token_ids) >= self.max_new_tokens

    def wants_draft(self, history: list[int]) -> bool:
        return self.policy.uses_draft and self.policy.wants_draft(history)

    def propose(self, block: DraftBlock | None, history: list[int]) -> DraftTree:
        return self.check(self.policy.propose(block, history))

    def check(self, tree: DraftTree) -> DraftTree:
        """The invariants positions, mask and cache rely on, every round in O(nodes) (parents first, depth = parent's
        depth + 1, ids >= 0); with ``check_trees`` every invariant of :meth:`DraftTree.validate` but best-first order."""
        name = self.policy.name
        if not isinstance(tree, DraftTree):
            raise TypeError(f"policy {name!r} returned {type(tree).__name__}: propose must return a DraftTree "
                            "(DraftTree.from_nodes builds one from nodes in any order)")
        try:
            tree.validate(best_first=False, structure_only=not self.check_trees)
        except ValueError as error:
            raise ValueError(f"policy {name!r} proposed an invalid tree: {error}. DraftTree.from_nodes(..., "
                             "sort=True) orders nodes given in any order") from None
        return tree

    def walk(self, tree: DraftTree, logits: torch.Tensor, result: GenerationResult
             ) -> tuple[list[int], list[int], bool]:
        """(accepted nodes, committed tokens, whether generation ends): the verification rule's walk, cut at a stop
        token or the length limit; the policy observes the accepted nodes that were committed."""
        if self.sampling is not None:
            logits = self.sampling.filter(logits)
        path, bonus = verify_walk(tree, logits, self.temperature, self.generator)
        committed, done = truncate_at_stop([int(tree.token_ids[i]) for i in path] + [bonus], self.stops,
                                           self.max_new_tokens - len(result.new_token_ids))
        self.policy.observe(path[: len(committed)])  # the accepted nodes that were committed (a stop cuts the rest)
        return path, committed, done


# ---------------------------------------------------------------------------------------------------- the models
class ModelSide(Protocol):
    """What the loop asks of the models for a batch of sequences, named by their index in the batch (every call
    lists the sequences it concerns in increasing order): the live drafter and target (:class:`LiveModels`), or
    replay's known continuation (``dflash_core.replay``)."""

    def draft(self, seqs: list[int], roots: list[int]) -> list[DraftBlock]:
        """One drafter pass for the sequences ``seqs`` (those whose policy wants the drafter this round)."""

    def verify(self, seqs: list[int], trees: list[DraftTree], roots: list[int]) -> list[torch.Tensor]:
        """One target forward verifying every active sequence's tree: per sequence [n+1, V] logits."""

    def commit(self, seqs: list[int], paths: list[list[int]], committed: list[list[int]]) -> None:
        """Each sequence keeps its root and accepted nodes ``paths`` and committed ``committed`` (the accepted
        tokens and the bonus, cut at a stop token or the length limit)."""

    def finish(self, seqs: list[int]) -> None:
        """These sequences are done and leave the batch."""


def make_blocks(draft: DFlashDraftModel, adapter: TargetAdapter, states: torch.Tensor, roots: list[int]
                ) -> list[DraftBlock]:
    """The rounds' :class:`DraftBlock` from the drafter's output states [n, b-1, H] (one root each): compact logits
    over the draft vocabulary from one head product and, for a drafter with a Markov head, its scorer."""
    logits, token_map = adapter.draft_logits(states, draft)
    return [DraftBlock(rows, token_map, root, adapter.vocab_size, own, markov_scorer(draft, rows, own))
            for rows, own, root in zip(logits, states, roots)]


class LiveModels:
    """The live drafter and target behind :func:`run_rounds`, for a batch of any size (see the module docstring).

    Rows of the shared target cache follow ``self.seqs`` (the active sequences, in order); ``lengths[r]`` counts the
    committed tokens of row r. Per sequence: ``unread`` (target features of committed positions its drafter has not
    read yet, in chunks of ``[m, taps * hidden]``, joined once when the drafter reads them) and its own
    :class:`DraftCache`. ``readers[b]``: whether sequence b's policy ever drafts (default: all); a sequence that
    never drafts keeps no features.
    """

    def __init__(self, adapter: TargetAdapter, draft: DFlashDraftModel | None, cache, lengths: list[int],
                 unread: list[torch.Tensor | None], block_size: int | None = None, with_features: bool = True,
                 masks: bool = True, readers: list[bool] | None = None) -> None:
        self.adapter, self.drafter, self.cache, self.block_size = adapter, draft, cache, block_size
        self.with_features, self.masks = with_features, masks  # masks: the backend applies 4D attention masks
        self.seqs = list(range(len(lengths)))
        self.lengths = list(lengths)
        self.readers = dict(enumerate(readers if readers is not None else [True] * len(lengths)))
        self.unread = {b: [f] if f is not None and self.readers[b] else [] for b, f in enumerate(unread)}
        self.draft_caches = {b: DraftCache() for b in self.seqs}
        self.width = max(lengths)  # slots per row in the shared cache
        self._features: torch.Tensor | None = None  # the last verify's features, until its commit
        # a drafter with causal or sliding-window layers counts distances in cache slots, which padding would shift
        self.stack_drafts = draft is not None and not any(
            layer.self_attn.causal or layer.self_attn.window is not None for layer in draft.layers)

    @classmethod
    @torch.inference_mode()
    def prefilled(cls, adapter: TargetAdapter, draft: DFlashDraftModel | None, prompts: list[torch.Tensor],
                  with_features: bool = True, block_size: int | None = None, masks: bool = True,
                  readers: list[bool] | None = None) -> tuple[LiveModels, torch.Tensor]:
        """The prefill: ragged prompts ([1, T_b] each) enter one new target cache, right-padded, in one forward
        under the model's own causal mask (no mask is built): right padding comes after a prompt's tokens, so the
        causal order shows each prompt token exactly its prompt's tokens before it; a padding slot sees its row's
        earlier slots, but its logits are never read and every later mask hides it. Returns (the models holding the
        prompts, the logits after each prompt [B, V])."""
        lengths = [int(p.shape[1]) for p in prompts]
        cache = adapter.new_cache()
        out = adapter.prefill(prompts, cache, with_features)
        features = [None if out.features is None else out.features[b, :n] for b, n in enumerate(lengths)]
        return cls(adapter, draft, cache, lengths, features, block_size, with_features, masks, readers), out.logits

    def rewind(self, lengths: list[int]) -> None:
        """Every sequence back to its first ``lengths[r]`` committed tokens (measurements repeat one round)."""
        self.lengths, self.width = list(lengths), max(lengths)
        self.adapter.crop(self.cache, self.width)

    # ------------------------------------------------------------------ draft
    def draft(self, seqs: list[int], roots: list[int]) -> list[DraftBlock]:
        if len(seqs) > 1 and not self.stack_drafts:
            return [block for s, root in zip(seqs, roots) for block in self.draft([s], [root])]
        return make_blocks(self.drafter, self.adapter, self.draft_states(seqs, roots)[:, 1:], roots)

    def draft_states(self, seqs: list[int], roots: list[int]) -> torch.Tensor:
        """[n, b, H] the drafter's output states for the blocks [root, MASK x (b-1)] of ``seqs``, after their unread
        features joined their drafter caches (one pass; the head is :func:`make_blocks`')."""
        draft, adapter = self.drafter, self.adapter
        param = next(draft.parameters())  # the drafter may sit on another GPU than the target's head
        b = self.block_size or draft.block_size
        starts = [self.lengths[self.seqs.index(s)] for s in seqs]
        news = [torch.cat(self.unread[s]) if len(self.unread[s]) > 1 else self.unread[s][0]
                for s in seqs]  # [m_j, taps * hidden] each
        olds = [self.draft_caches[s].length for s in seqs]
        if len(seqs) == 1:  # nothing to pad: the sequence's own cache, no mask
            cache, visible = self.draft_caches[seqs[0]], None
            context, context_pos = news[0][None], torch.arange(olds[0], starts[0])[None]
        else:
            cache, context, context_pos, visible = self._stacked_inputs(seqs, news, olds, starts, b)
        block_ids = torch.full((len(seqs), b), draft.mask_token_id, dtype=torch.long, device=adapter.device)
        block_ids[:, 0] = torch.tensor(roots, device=adapter.device)
        block_pos = torch.tensor(starts)[:, None] + torch.arange(b)
        hidden = draft(adapter.embed(block_ids).to(param.device, param.dtype), context.to(param.device),
                       block_pos.to(param.device), context_pos.to(param.device), cache=cache,
                       attn_mask=None if visible is None else visible.to(param.device))  # [n, b, H]
        if len(seqs) > 1:  # each sequence's drafter cache: its old context and its new one, without the padding
            width_old = max(olds)
            for j, s in enumerate(seqs):
                keep = list(range(olds[j])) + list(range(width_old, width_old + len(news[j])))
                index = torch.tensor(keep, device=param.device)
                own = self.draft_caches[s]
                own.keys = [k[j: j + 1].index_select(2, index) for k in cache.keys]
                own.values = [v[j: j + 1].index_select(2, index) for v in cache.values]
        for s in seqs:
            self.unread[s] = []
        return hidden

    def _stacked_inputs(self, seqs, news, olds, starts, b):
        """The drafter caches of ``seqs`` stacked and right-padded, their new context padded, and the [n, 1, b, K]
        mask that hides every padding slot."""
        width_new, width_old, n = max(len(x) for x in news), max(olds), len(seqs)
        context = news[0].new_zeros(n, width_new, news[0].shape[-1])
        context_pos = torch.zeros(n, width_new, dtype=torch.long)
        visible = torch.ones(n, 1, b, width_old + width_new + b, dtype=torch.bool)
        for j, (new, old, start) in enumerate(zip(news, olds, starts)):
            context[j, : len(new)] = new
            context_pos[j, : len(new)] = torch.arange(old, start)
            visible[j, :, :, old:width_old] = False  # another sequence's longer past
            visible[j, :, :, width_old + len(new): width_old + width_new] = False  # padding of the new context
        cache = DraftCache()
        if width_old:  # a sequence drafting for the first time has no cache yet: its rows stay padding
            caches = [self.draft_caches[s] for s in seqs]
            for layer in range(len(self.drafter.layers)):
                cache.keys.append(_stack([c.keys[layer] if c.length else None for c in caches], width_old))
                cache.values.append(_stack([c.values[layer] if c.length else None for c in caches], width_old))
        return cache, context, context_pos, visible

    # ------------------------------------------------------------------ verify
    def verify(self, seqs: list[int], trees: list[DraftTree], roots: list[int]) -> list[torch.Tensor]:
        if seqs != self.seqs:
            raise RuntimeError(f"the batch verifies every active sequence together: got {seqs}, active {self.seqs}")
        flat = [tree_inputs(t, root, start) for t, root, start in zip(trees, roots, self.lengths)]
        sizes = [len(ids) for ids, _, _ in flat]
        n, batch = max(sizes), len(seqs)
        ids = torch.zeros(batch, n, dtype=torch.long)
        positions = torch.zeros(batch, n, dtype=torch.long)
        for b, ((tokens, pos, _), size, start) in enumerate(zip(flat, sizes, self.lengths)):
            ids[b, :size], positions[b, :size], positions[b, size:] = tokens, pos, start
        visible = None  # one sequence verifying a chain: the causal order is exact
        if batch > 1 or flat[0][2] is not None:
            if not self.masks:
                raise RuntimeError("a tree or a batch needs a 4D attention mask, which this target's attention "
                                   "backend ignores (check_mask_backend should have refused the call)")
            visible = self._verify_mask([tree for _, _, tree in flat], sizes, n)
        rows = torch.cat([b * n + torch.arange(size) for b, size in enumerate(sizes)])
        out = self.adapter.forward(ids, positions, self.cache, visible, rows, self.with_features)
        self._features = out.features
        return list(out.logits.split(sizes))

    def _verify_mask(self, trees: list[torch.Tensor | None], sizes: list[int], n: int) -> torch.Tensor:
        """[B, n, width + n] on the target's device: row b sees its sequence's committed slots ``[0, L_b)`` (never
        the leftovers past them), then its own tree's ancestor-or-self mask (causal for a chain); a padding row sees
        only itself. Only the tree part ([B, n, n]) is filled on the host; the committed part is one comparison on
        the device."""
        device = self.adapter.device
        lengths = torch.tensor(self.lengths, device=device)
        committed = torch.arange(self.width, device=device)[None, None, :] < lengths[:, None, None]
        own = torch.eye(n, dtype=torch.bool).repeat(len(sizes), 1, 1)  # padding rows: themselves
        for b, (tree, size) in enumerate(zip(trees, sizes)):
            own[b, :size, :size] = torch.ones(size, size, dtype=torch.bool).tril() if tree is None else tree
        return torch.cat([committed.expand(len(sizes), n, self.width), own.to(device)], dim=-1)

    # ------------------------------------------------------------------ commit
    def commit(self, seqs: list[int], paths: list[list[int]], committed: list[list[int]]) -> None:
        width = self.width
        sources, dests, lengths = [], [], []
        for b, (s, path) in enumerate(zip(seqs, paths)):
            start = self.lengths[b]
            keep = [0] + [i + 1 for i in path]  # the root and the accepted nodes, as rows of this round's tree
            sources.append([width + k for k in keep])  # where this round put them
            dests.append(list(range(start, start + len(keep))))  # right after the sequence's committed tokens
            lengths.append(start + len(keep))
            if self._features is not None and self.readers[s]:  # joined when the drafter next reads them
                self.unread[s].append(self._features[b, torch.tensor(keep, device=self._features.device)])
        most = max(len(row) for row in sources)  # shorter rows repeat their last pair (it rewrites the same entry)
        sources, dests = ([row + [row[-1]] * (most - len(row)) for row in rows] for rows in (sources, dests))
        self.adapter.move_slots(self.cache, torch.tensor(sources), torch.tensor(dests), max(lengths))
        self.lengths, self.width, self._features = lengths, max(lengths), None

    def finish(self, seqs: list[int]) -> None:
        stay = [b for b, s in enumerate(self.seqs) if s not in seqs]
        for s in seqs:
            self.unread.pop(s, None)
            self.draft_caches.pop(s, None)
        self.seqs = [self.seqs[b] for b in stay]
        self.lengths = [self.lengths[b] for b in stay]
        if stay:
            self.adapter.select_sequences(self.cache, torch.tensor(stay))
            self.width = max(self.lengths)
            self.adapter.crop(self.cache, self.width)


def _stack(parts: list[torch.Tensor | None], width: int) -> torch.Tensor:
    """[1, h, len_j, d] per sequence (None: nothing yet) -> [n, h, width, d], right-padded with zeros (masked by the
    caller)."""
    like = next(part for part in parts if part is not None)
    out = like.new_zeros(len(parts), like.shape[1], width, like.shape[-1])
    for j, part in enumerate(parts):
        if part is not None:
            out[j, :, : part.shape[2]] = part[0]
    return out


# ---------------------------------------------------------------------------------------------------- the loop
class TreeProposer(Protocol):
    """Proposes the trees of a whole batch at once (e.g. one tree size shared by every sequence, sized for the
    batch's throughput), in place of each sequence's ``policy.propose``; every tree is still checked."""

    def propose(self, seqs: list[int], blocks: list[DraftBlock | None], histories: list[list[int]]
                ) -> list[DraftTree]:
        """The trees of the sequences ``seqs`` (their blocks and histories in the same order)."""


def run_rounds(decoders: Sequence[SequenceDecoder], models: ModelSide, histories: list[list[int]],
               results: list[GenerationResult], timer: StageTimer, proposer: TreeProposer | None = None) -> None:
    """THE decode loop: rounds for a batch of sequences (one sequence is a batch of one) until each has stopped.

    Every round: one drafter pass for the sequences whose policy wants it, each policy's tree, one target forward
    verifying all trees together, each sequence's walk, one commit; sequences that end leave the batch.
    ``histories[b]``: the prompt and the tokens generated so far (the next root last); it grows in place.
    """
    active = [i for i, d in enumerate(decoders) if not d.finished(histories[i], results[i])]
    if len(active) < len(decoders):
        models.finish([i for i in range(len(decoders)) if i not in active])
    while active:
        roots = [histories[i][-1] for i in active]
        asking = [i for i in active if decoders[i].wants_draft(histories[i])]
        blocks: dict[int, DraftBlock] = {}
        if asking:
            with timer.stage("draft"):  # per sequence a DraftBlock: [b-1, V'] logits, id map, states, Markov scorer
                blocks = dict(zip(asking, models.draft(asking, [histories[i][-1] for i in asking])))
        with timer.stage("tree"):
            if proposer is None:
                trees = [decoders[i].propose(blocks.get(i), histories[i]) for i in active]
            else:
                proposed = proposer.propose(active, [blocks.get(i) for i in active], [histories[i] for i in active])
                trees = [decoders[i].check(tree) for i, tree in zip(active, proposed)]
        with timer.stage("verify"):
            logits = models.verify(active, trees, roots)
        with timer.stage("commit"):
            walks = [decoders[i].walk(t, rows, results[i]) for i, t, rows in zip(active, trees, logits)]
            models.commit(active, [w[0] for w in walks], [w[1] for w in walks])
            for i, tree, (_, committed, _) in zip(active, trees, walks):
                results[i].add_round(committed, tree)
                histories[i] += committed
            ended = [i for i, w in zip(active, walks) if w[2]]
            if ended:
                models.finish(ended)
                active = [i for i in active if i not in ended]


@torch.inference_mode()
def decode(target, draft: DFlashDraftModel | None, request: Request, policies: list[BlockPolicy],
           block_size: int | None = None, trace: bool = False, check_trees: bool = False,
           proposer: TreeProposer | None = None) -> list[GenerationResult]:
    """Decode a checked :class:`Request`, sequence b with ``policies[b]`` and a generator seeded ``seed + b``; one
    result per prompt. The models are checked here, once per call."""
    uses_draft = any(p.uses_draft for p in policies)
    if uses_draft:
        if draft is None:
            raise ValueError(f"policy {next(p.name for p in policies if p.uses_draft)!r} needs a drafter; "
                             "pass draft=...")
        check_compatibility(target, draft)
    masks = check_mask_backend(target, len(request.prompts), all(p.proposes_chains for p in policies))
    adapter = TargetAdapter(target, draft.config.target_layer_ids if uses_draft else ())
    stops = _check_models(adapter, request, uses_draft, draft, block_size)
    device = adapter.device
    generators = [torch.Generator(device=device).manual_seed(request.seed + b) for b in range(len(policies))]
    results = [GenerationResult([], [], {}, int(p.shape[1]), trees=[] if trace else None) for p in request.prompts]
    timings: dict[str, float] = {"prefill": 0.0, "decode": 0.0}
    if request.max_new_tokens > 0:
        timer = StageTimer(device)
        with timer.stage("prefill"):  # the prompts enter the target cache; their features are the drafter's context
            models, logits = LiveModels.prefilled(adapter, draft, request.prompts, uses_draft, block_size, masks,
                                                  [p.uses_draft for p in policies])
        histories = []
        for b, (prompt, result) in enumerate(zip(request.prompts, results)):
            root = follow(torch.zeros(0, dtype=torch.long), torch.zeros(0, dtype=torch.long),
                          request.sampling.filter(logits[b: b + 1]), request.temperature, generators[b])[1]
            result.new_token_ids.append(root)
            histories.append(prompt[0].tolist() + [root])
        sampling = request.sampling if request.sampling.filters else None
        decoders = [SequenceDecoder(policy, stops, request.max_new_tokens, request.temperature, gen, check_trees,
                                    sampling) for policy, gen in zip(policies, generators)]
        t_loop = time.perf_counter()
        run_rounds(decoders, models, histories, results, timer, proposer)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        timings = {**timer.totals(), "decode": time.perf_counter() - t_loop}
    if not request.single:
        timings["batch"] = float(len(request.prompts))
    for r in results:
        r.timings = dict(timings)
    return results


# ---------------------------------------------------------------------------------------------------- entry points
def speculative_generate(target, draft: DFlashDraftModel | None, input_ids, policy, max_new_tokens: int = 128,
                         temperature: float = 0.0, stop_token_ids: Sequence[int] | None = None, seed: int = 0,
                         block_size: int | None = None, trace: bool = False, check_trees: bool = False,
                         attention_mask: torch.Tensor | None = None, proposer: TreeProposer | None = None,
                         top_k: int | None = None, top_p: float | None = None, min_p: float | None = None
                         ) -> GenerationResult | list[GenerationResult]:
    """Generate with ``policy`` deciding each round's draft tree (see the module docstring for why it is lossless).

    ``input_ids``: one ``[1, T]`` prompt (one result back), or a batch: a list of prompts ([T] or [1, T] each, any
    lengths) or padded [B, T] ids with an ``attention_mask`` (one result per prompt, decoded together). Sequence b
    uses its own copy of ``policy`` (or ``policy[b]`` from a list) and a generator seeded ``seed + b``, so it commits
    what a single-prompt call with that seed commits. ``check_trees`` checks every invariant of each tree (for
    developing a policy); ``proposer`` proposes each round's trees for the whole batch (:class:`TreeProposer`).
    ``top_k`` / ``top_p`` / ``min_p`` (T > 0): transformers' filters of the target's distribution; every round
    samples from the filtered distribution, so the output is distributed as plain decoding's with the same filters
    (:mod:`dflash_core.sampling`).
    """
    request = Request.check(input_ids, max_new_tokens, temperature, stop_token_ids, seed, attention_mask, top_k,
                            top_p, min_p)
    results = decode(target, draft, request, policies_for(policy, len(request.prompts)), block_size, trace,
                     check_trees, proposer)
    return results[0] if request.single else results


def autoregressive_generate(target, input_ids, max_new_tokens: int = 128, temperature: float = 0.0,
                            stop_token_ids: Sequence[int] | None = None, seed: int = 0,
                            attention_mask: torch.Tensor | None = None, top_k: int | None = None,
                            top_p: float | None = None, min_p: float | None = None
                            ) -> GenerationResult | list[GenerationResult]:
    """Plain decoding: one target forward per token (the reference every speculative method must reproduce). A list
    of prompts (or padded ids with ``attention_mask``) decodes as a batch: one forward per token for all.
    ``top_k`` / ``top_p`` / ``min_p``: transformers' sampling filters (T > 0)."""
    return speculative_generate(target, None, input_ids, NoDraft(), max_new_tokens, temperature, stop_token_ids, seed,
                                attention_mask=attention_mask, top_k=top_k, top_p=top_p, min_p=min_p)


def dflash_generate(target, draft: DFlashDraftModel, input_ids, max_new_tokens: int = 128, temperature: float = 0.0,
                    stop_token_ids: Sequence[int] | None = None, seed: int = 0, block_size: int | None = None,
                    attention_mask: torch.Tensor | None = None, top_k: int | None = None,
                    top_p: float | None = None, min_p: float | None = None
                    ) -> GenerationResult | list[GenerationResult]:
    """DFlash: draft a block in one drafter pass, verify it as a chain in one target pass (a batch and the sampling
    filters as for :func:`speculative_generate`)."""
    return speculative_generate(target, draft, input_ids, Chain(), max_new_tokens, temperature, stop_token_ids, seed,
                                block_size=block_size, attention_mask=attention_mask, top_k=top_k, top_p=top_p,
                                min_p=min_p)


def spec_generate(self: DFlashDraftModel, target, input_ids: torch.Tensor, max_new_tokens: int = 2048,
                  stop_token_ids: Sequence[int] | None = None, temperature: float = 0.0, seed: int = 0,
                  block_size: int | None = None) -> torch.Tensor:
    """z-lab's transformers entry point as a drop-in: ``draft.spec_generate(input_ids=..., max_new_tokens=...,
    temperature=..., target=..., stop_token_ids=...)`` returns the prompt followed by the new tokens, ``[1, T]`` on
    the prompt's device, generated by :func:`dflash_generate` (one chain per round)."""
    if not isinstance(input_ids, torch.Tensor) or input_ids.dim() != 2 or input_ids.shape[0] != 1:
        raise ValueError("spec_generate decodes one [1, T] prompt, as z-lab's does; for a batch call "
                         "dflash_generate(target, draft, [prompt, ...]), which returns one result per prompt")
    result = dflash_generate(target, self, input_ids, max_new_tokens, temperature, stop_token_ids, seed,
                             block_size=block_size)
    new = torch.tensor([result.new_token_ids], dtype=input_ids.dtype, device=input_ids.device)
    return torch.cat([input_ids, new], dim=1)


# The method is bound here, not written in model.py: the network sits below the loop (this module imports it), and a
# method there that called the loop would make the two modules import each other. Every import of dflash_core runs
# this module (the package root imports it), so every drafter has the method.
DFlashDraftModel.spec_generate = spec_generate


# ---------------------------------------------------------------------------------------------------- timing
class StageTimer:
    """Seconds per named stage of the loop: perf_counter on CPU; on CUDA a pair of events per stage on the current
    stream of ``device`` (not of whichever GPU is current), read once by :meth:`totals`, so timing does not serialize
    the loop."""

    def __init__(self, device: torch.device | str = "cpu", enabled: bool = True) -> None:
        self.enabled = enabled
        self.device = torch.device(device)
        self.cuda = self.device.type == "cuda"
        self._seconds: dict[str, float] = defaultdict(float)
        self._events: list[tuple[str, torch.cuda.Event, torch.cuda.Event]] = []

    @contextmanager
    def stage(self, name: str) -> Iterator[None]:
        if not self.enabled:
            yield
            return
        if self.cuda:
            stream = torch.cuda.current_stream(self.device)
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record(stream)
            yield
            end.record(stream)
            self._events.append((name, start, end))
        else:
            t0 = time.perf_counter()
            yield
            self._seconds[name] += time.perf_counter() - t0

    def totals(self) -> dict[str, float]:
        """Seconds per stage (synchronizes the device once on CUDA)."""
        if self._events:
            torch.cuda.synchronize(self.device)
            for name, start, end in self._events:
                self._seconds[name] += start.elapsed_time(end) / 1000.0
            self._events.clear()
        return dict(self._seconds)
