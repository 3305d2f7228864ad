"""The round of speculative decoding, written once: draft -> propose -> verify -> walk -> commit.

The pieces of a round (:func:`compile_proposal`, :func:`follow`, :func:`verify_walk`, :func:`truncate_at_stop`, the
drafter and verify steps, :func:`commit_path`), one sequence's rounds (:class:`RoundRunner`) and THE loop over a batch
of sequences (:func:`run_rounds`; one sequence is a batch of one). The target's side is injected: the live target
(:class:`LiveTarget`), a live batch (``dflash_core.batch.BatchTarget``) or replay (``dflash_core.replay``). Why the
output is exactly the target's: see :mod:`dflash_core.decoding`.
"""


from __future__ import annotations

import math
import numbers
from dataclasses import dataclass, field
from typing import Any, Protocol, Sequence

import torch

from .markov import markov_scorer
from .model import DFlashDraftModel, DraftCache
from .policy import BlockPolicy, DraftBlock, Proposal, check_proposal, check_structure
from .target import TargetAdapter
from .timing import StageTimer
from .tree import ROOT, child_index

__all__ = [
    "BatchProposer", "BatchSide", "GenerationResult", "LiveTarget", "OneSequence", "RoundRunner", "RoundTarget", "check_room",
    "check_stop_ids", "commit_path", "compile_proposal", "draft_round", "draft_states", "follow", "make_block", "make_blocks",
    "prefill", "run_rounds", "truncate_at_stop", "validate_request", "verify_proposal", "verify_walk",
]


# ---------------------------------------------------------------------------------------------------- verification
def compile_proposal(proposal: Proposal, root: int, start: int
                     ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Flatten root + nodes for one target forward.

    Returns token ids [n+1] (root first, then nodes in proposal order), position ids [n+1] (= start + depth, the root
    at depth 0) and the [n+1, n+1] ancestor-or-self visibility (None for a chain: the causal mask is then exact).
    """
    token_ids = torch.cat([torch.tensor([root]), proposal.token_ids.cpu()])
    positions = start + torch.cat([torch.zeros(1, dtype=torch.long), proposal.depths.cpu()])
    return token_ids, positions, None if getattr(proposal, "is_chain", False) else proposal.visibility()


def follow(
    token_ids: torch.Tensor,  # [n] draft tokens
    parents: torch.Tensor,  # [n]
    logits: torch.Tensor,  # [n+1, V] target logits at root + nodes
    temperature: float,
    generator: torch.Generator | None,
) -> tuple[list[int], int]:
    """Walk the verified tree from the root; return (accepted node indices, bonus token).

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


def verify_walk(
    proposal: Proposal,
    logits: torch.Tensor,  # [n+1, V] target logits at root + nodes
    temperature: float,
    generator: torch.Generator | None,
) -> tuple[list[int], int]:
    """The round's verification rule: (accepted node indices, bonus token).

    A proposal may carry its own rule as ``proposal.verify(logits, temperature, generator)`` (sampled trees verify
    their children by recursive rejection sampling, see ``ddtree.sampled``); every other proposal is walked with
    sample-and-match (:func:`follow`), which is lossless for any tree whose tokens do not depend on the target.
    """
    verify = getattr(proposal, "verify", None)
    if verify is not None:
        return verify(logits, temperature, generator)
    return follow(proposal.token_ids, proposal.parents, logits, temperature, generator)


def truncate_at_stop(tokens: list[int], stops: set[int], room: int) -> tuple[list[int], bool]:
    """(the tokens a round commits, whether generation ends): up to and including the first stop token, at most
    ``room`` tokens (what max_new_tokens leaves)."""
    for k, token in enumerate(tokens):
        if token in stops or k + 1 >= room:
            return tokens[: k + 1], True
    return tokens, False


# ---------------------------------------------------------------------------------------------------- the loop
@dataclass
class GenerationResult:
    new_token_ids: list[int]
    acceptance_lengths: list[int]  # tokens committed per round, bonus included (the prefill's token is not a round)
    timings: dict[str, float]  # seconds: prefill, draft, tree, verify, commit, decode (= whole loop after prefill)
    num_input_tokens: int
    tree_sizes: list[int] = field(default_factory=list)  # draft nodes verified per round
    expected_acceptance: list[float] = field(default_factory=list)  # drafter's own estimate per round
    trees: list[Any] | None = None  # the proposals themselves when trace=True
    lookup_tokens: list[int] | None = None  # per round, committed tokens proposed by a context lookup (lookup runs)

    @property
    def tau(self) -> float:
        """Mean committed tokens per round (acceptance length, bonus included)."""
        return sum(self.acceptance_lengths) / max(len(self.acceptance_lengths), 1)

    def add_round(self, committed: list[int], proposal: Proposal) -> None:
        """Book one round: its committed tokens, the tree's size and the drafter's own estimate (and the tree)."""
        self.new_token_ids += committed
        self.acceptance_lengths.append(len(committed))
        self.tree_sizes.append(len(proposal.token_ids))
        self.expected_acceptance.append(proposal.expected_acceptance())
        if self.trees is not None:
            self.trees.append(proposal)


def validate_request(input_ids: torch.Tensor, max_new_tokens: int, temperature: float) -> None:
    """Raise ValueError for a malformed prompt, length or temperature (before any model work)."""
    if not isinstance(input_ids, torch.Tensor) or input_ids.dim() != 2 or input_ids.shape[0] != 1:
        shape = tuple(input_ids.shape) if isinstance(input_ids, torch.Tensor) else type(input_ids).__name__
        raise ValueError(f"input_ids must be a [1, T] LongTensor (batch size 1), got {shape}")
    if input_ids.shape[1] < 1:
        raise ValueError("input_ids is empty: give at least one prompt token")
    if input_ids.dtype not in (torch.int64, torch.int32):
        raise ValueError(f"input_ids must hold integer token ids, got dtype {input_ids.dtype}")
    if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, numbers.Integral) or max_new_tokens < 0:
        raise ValueError(f"max_new_tokens must be an int >= 0, got {max_new_tokens!r}")
    if isinstance(temperature, bool) or not isinstance(temperature, numbers.Real) or not math.isfinite(temperature) \
            or temperature < 0:
        raise ValueError(f"temperature must be a finite number >= 0 (0 = greedy), got {temperature!r}")


def check_room(adapter: TargetAdapter, prompt_len: int, max_new_tokens: int) -> None:
    """The prompt and the answer must fit the target's positions: past them its outputs are meaningless."""
    limit = getattr(adapter.model.config, "max_position_embeddings", None)
    if limit is not None and prompt_len + max_new_tokens > limit:
        room = max(0, limit - prompt_len)
        raise ValueError(
            f"the prompt ({prompt_len} tokens) plus max_new_tokens ({max_new_tokens}) exceed the target's "
            f"{limit} positions (config.max_position_embeddings): "
            + (f"lower max_new_tokens to at most {room}" if room else "shorten the prompt")
            + " (past its trained length the target's outputs are not meaningful)")


def check_stop_ids(adapter: TargetAdapter, stop_token_ids) -> set[int]:
    stops = set()
    for t in stop_token_ids or ():
        if isinstance(t, bool) or not isinstance(t, numbers.Integral) or not 0 <= int(t) < adapter.vocab_size:
            raise ValueError(f"stop token id {t!r} is not a token of the target (ids 0..{adapter.vocab_size - 1}): "
                             "pass ids from the tokenizer, e.g. [tokenizer.eos_token_id]")
        stops.add(int(t))
    return stops


def prefill(adapter: TargetAdapter, input_ids: torch.Tensor, temperature: float, generator: torch.Generator | None,
            with_features: bool):
    """The prompt enters a new target cache; returns (cache, the first generated token, the prompt's features)."""
    prompt, cache = input_ids[0].to(adapter.device), adapter.new_cache()
    out = adapter.forward(prompt, torch.arange(len(prompt), device=adapter.device), cache, last_only=True,
                          with_features=with_features)
    no_nodes = torch.zeros(0, dtype=torch.long)
    return cache, follow(no_nodes, no_nodes, out.logits, temperature, generator)[1], out.features


# ---------------------------------------------------------------------------------------------------- one round
# The three steps of a round, shared by the decode loop, the cost measurement of ``budget="auto"``, the round profiler
# and the GPU check, so that what they time is what the loop runs.
def draft_states(draft: DFlashDraftModel, adapter: TargetAdapter, root: int, pending: torch.Tensor, start: int,
                 draft_cache: DraftCache, block_size: int | None = None) -> torch.Tensor:
    """[b, hidden] drafter output states for the block [root, MASK x (b-1)] at positions start..start+b-1
    (b: ``block_size``, default the drafter's own; a drafter trained on blocks of 16 also drafts shorter ones).

    ``pending`` [m, taps*hidden]: target features of the committed positions the draft cache does not hold yet
    (``draft_cache.length`` .. start-1); they join it. The block's own keys are dropped again by the draft cache.
    """
    device = adapter.device
    param = next(draft.parameters())  # the drafter may sit on another GPU than the target's head
    b = block_size or draft.block_size
    block_ids = torch.full((b,), draft.mask_token_id, dtype=torch.long, device=device)
    block_ids[0] = root
    hidden = draft(adapter.embed(block_ids)[None].to(param.device, param.dtype), pending[None].to(param.device),
                   torch.arange(start, start + b, device=param.device),
                   torch.arange(draft_cache.length, start, device=param.device), cache=draft_cache)  # [1, b, H]
    return hidden[0]


def make_block(draft: DFlashDraftModel, adapter: TargetAdapter, states: torch.Tensor, root: int) -> DraftBlock:
    """A :class:`DraftBlock` from the drafter's output states [b-1, H] of a block rooted at ``root``: compact logits
    over the draft vocabulary and, for a drafter with a Markov head, its conditional scorer."""
    return make_blocks(draft, adapter, states[None], [root])[0]


def make_blocks(draft: DFlashDraftModel, adapter: TargetAdapter, states: torch.Tensor, roots: list[int]
                ) -> list[DraftBlock]:
    """:func:`make_block` for several blocks at once (states [n, b-1, H], one root each): one head product for all."""
    logits, token_map = adapter.draft_logits(states, draft)
    return [DraftBlock(rows, token_map, root, adapter.vocab_size, own, markov_scorer(draft, rows, own))
            for rows, own, root in zip(logits, states, roots)]


def draft_round(draft: DFlashDraftModel, adapter: TargetAdapter, root: int, pending: torch.Tensor, start: int,
                draft_cache: DraftCache, block_size: int | None = None) -> DraftBlock:
    """Step 1, draft, as the loop runs it: one drafter pass, returned as the round's :class:`DraftBlock`."""
    states = draft_states(draft, adapter, root, pending, start, draft_cache, block_size)[1:]  # [b-1, H]
    return make_block(draft, adapter, states, root)


def verify_proposal(adapter: TargetAdapter, cache, proposal: Proposal, root: int, start: int,
                    with_features: bool):
    """Step 2, verify: one target forward over root + the proposal's nodes on top of the ``start`` cached tokens,
    each node seeing only its ancestors. Returns the adapter's output (logits [n+1, V], features when asked)."""
    ids, positions, visibility = compile_proposal(proposal, root, start)
    return adapter.forward(ids, positions, cache, visibility=visibility, with_features=with_features)


def commit_path(adapter: TargetAdapter, cache, start: int, path: list[int], features: torch.Tensor | None,
                carried: torch.Tensor | None = None) -> tuple[int, torch.Tensor | None]:
    """Step 3, commit: keep the root and the accepted nodes in the target cache (compaction); returns the new cache
    length and the kept positions' features (the drafter's next context, None without features), after
    ``carried``: features the drafter has not consumed yet (a round that skipped the drafter)."""
    keep = torch.tensor([0] + [i + 1 for i in path], dtype=torch.long)  # root + accepted nodes
    adapter.compact(cache, start, keep)
    if features is None:
        return start + len(keep), None
    kept = features[keep.to(features.device)]
    return start + len(keep), kept if carried is None else torch.cat([carried, kept])


# ---------------------------------------------------------------------------------------------------- the round runner
class RoundTarget(Protocol):
    """The target's side of a round, what :class:`RoundRunner` injects: the live loop runs the models
    (:class:`LiveTarget`), replay reads a known continuation (``dflash_core.replay``)."""

    def draft(self, root: int) -> DraftBlock:
        """The drafter's block for the round rooted at ``root`` (called only when the policy wants it)."""

    def verify(self, proposal: Proposal, root: int) -> torch.Tensor:
        """[n+1, V] the target's logits after the root and after each of the proposal's n nodes."""

    def commit(self, path: list[int], committed: list[int], drafted: bool) -> None:
        """The round accepted the nodes ``path`` and committed ``committed`` (the accepted tokens and the bonus, cut
        at a stop token or the length limit); ``drafted``: whether :meth:`draft` ran this round."""


class LiveTarget:
    """The live round's target side: the drafter reads the committed positions' features, the target verifies the
    proposal in one tree forward on its KV cache, and the cache keeps the root and the accepted path.

    ``start`` counts the committed tokens in the target cache; ``pending`` holds the features of committed positions
    the draft cache has not consumed yet (the prompt's after the prefill).
    """

    def __init__(self, adapter: TargetAdapter, draft: DFlashDraftModel | None, cache, start: int,
                 pending: torch.Tensor | None, block_size: int | None = None, with_features: bool = True) -> None:
        self.adapter, self.drafter, self.cache, self.block_size = adapter, draft, cache, block_size
        self.start, self.pending, self.with_features = start, pending, with_features
        self.draft_cache = DraftCache()
        self._features: torch.Tensor | None = None  # the last verify's features, until its commit

    def draft(self, root: int) -> DraftBlock:
        return draft_round(self.drafter, self.adapter, root, self.pending, self.start, self.draft_cache,
                           self.block_size)

    def verify(self, proposal: Proposal, root: int) -> torch.Tensor:
        out = verify_proposal(self.adapter, self.cache, proposal, root, self.start, self.with_features)
        self._features = out.features
        return out.logits

    def commit(self, path: list[int], committed: list[int], drafted: bool) -> None:
        carried = None if drafted else self.pending  # a round without the drafter consumed no features
        self.start, self.pending = commit_path(self.adapter, self.cache, self.start, path, self._features, carried)


class BatchSide(Protocol):
    """The target's side of the rounds of a BATCH of sequences, what :func:`run_rounds` drives. Sequences are named
    by their index in the batch; every call lists the sequences it concerns in increasing order. The live batch is
    ``dflash_core.batch.BatchTarget``; :class:`OneSequence` makes any :class:`RoundTarget` a batch of one."""

    def draft(self, seqs: list[int], roots: list[int]) -> list[DraftBlock]:
        """One drafter pass for the sequences ``seqs`` (those whose policy wants the drafter this round)."""

    def verify(self, seqs: list[int], proposals: list[Proposal], roots: list[int]) -> list[torch.Tensor]:
        """One target forward verifying every active sequence's proposal: per sequence [n+1, V] logits."""

    def commit(self, seqs: list[int], paths: list[list[int]], committed: list[list[int]],
               drafted: list[bool]) -> None:
        """Each sequence keeps its root and accepted path (see :meth:`RoundTarget.commit`)."""

    def finish(self, seqs: list[int]) -> None:
        """These sequences are done and leave the batch."""


class OneSequence:
    """A :class:`RoundTarget` (one sequence: the live :class:`LiveTarget`, replay's) as a :class:`BatchSide` of one."""

    def __init__(self, target: RoundTarget) -> None:
        self.target = target

    def draft(self, seqs: list[int], roots: list[int]) -> list[DraftBlock]:
        return [self.target.draft(roots[0])]

    def verify(self, seqs: list[int], proposals: list[Proposal], roots: list[int]) -> list[torch.Tensor]:
        return [self.target.verify(proposals[0], roots[0])]

    def commit(self, seqs, paths, committed, drafted) -> None:
        self.target.commit(paths[0], committed[0], drafted[0])

    def finish(self, seqs: list[int]) -> None:
        pass


@dataclass
class RoundRunner:
    """One sequence's rounds of speculative decoding, written once: the live loop, batches and replay all run them.

    A round asks the policy whether it wants the drafter, gets the drafter's block from the target side, lets the
    policy propose a tree (its structure checked every round), has the target side verify it, walks it (the
    proposal's own rule or sample-and-match), cuts the committed tokens at a stop token or the length limit, feeds
    the accepted-and-committed nodes back to the policy, and books the round. Only verification differs between a
    live run and a replay (:class:`RoundTarget`), so a replay cannot drift from the loop's policy handling. The
    steps are the methods below; :func:`run_rounds` calls them for every sequence of a batch.
    """

    policy: BlockPolicy
    target: RoundTarget | None
    stops: set[int]
    max_new_tokens: int
    temperature: float = 0.0
    generator: torch.Generator | None = None
    timer: StageTimer = field(default_factory=lambda: StageTimer(enabled=False))
    check_trees: bool = False

    def run(self, history: list[int], result: GenerationResult) -> GenerationResult:
        """Rounds until a stop token or ``max_new_tokens``. ``history``: the prompt and the first generated token
        (the root of the first round), which ``result.new_token_ids`` already holds; both grow in place."""
        run_rounds([self], OneSequence(self.target), [history], [result], self.timer)
        return result

    def finished(self, history: list[int], result: GenerationResult) -> bool:
        return history[-1] in self.stops or len(result.new_token_ids) >= self.max_new_tokens

    def wants_draft(self, history: list[int]) -> bool:
        return self.policy.uses_draft and self.policy.wants_draft(history)

    def propose(self, drafted: DraftBlock | None, history: list[int]) -> Proposal:
        """The policy's tree for this round, its structure checked (and every check with ``check_trees``)."""
        return self.check(self.policy.propose(drafted, history))

    def check(self, proposal: Proposal) -> Proposal:
        check_structure(proposal, self.policy.name)
        if self.check_trees:
            check_proposal(proposal)
        return proposal

    def walk(self, proposal: Proposal, logits: torch.Tensor, result: GenerationResult
             ) -> tuple[list[int], list[int], bool]:
        """(accepted nodes, committed tokens, whether generation ends): the verification rule's walk, cut at a stop
        token or the length limit; the policy observes the accepted nodes that were committed."""
        path, bonus = verify_walk(proposal, logits, self.temperature, self.generator)
        committed, done = truncate_at_stop([int(proposal.token_ids[i]) for i in path] + [bonus], self.stops,
                                           self.max_new_tokens - len(result.new_token_ids))
        self.policy.observe(path[: len(committed)])  # the accepted nodes that were committed (a stop cuts the rest)
        return path, committed, done

    @staticmethod
    def book(proposal: Proposal, committed: list[int], history: list[int], result: GenerationResult) -> None:
        result.add_round(committed, proposal)
        history += committed


class BatchProposer(Protocol):
    """Proposes the trees of a whole batch at once (e.g. one tree size shared by every sequence, sized for the
    batch's throughput): in place of each sequence's ``policy.propose``; every tree is still checked."""

    def propose(self, seqs: list[int], blocks: list[DraftBlock | None], histories: list[list[int]]
                ) -> list[Proposal]:
        """The trees of the sequences ``seqs`` (their blocks and histories in the same order)."""


def run_rounds(runners: Sequence[RoundRunner], side: BatchSide, histories: list[list[int]],
               results: list[GenerationResult], timer: StageTimer, proposer: BatchProposer | None = None) -> None:
    """THE decode loop: rounds for a batch of sequences (one sequence is a batch of one) until each has stopped.

    Every round: one drafter pass for the sequences whose policy wants it, each policy's tree, one target forward
    verifying all trees together, each sequence's walk, one commit; sequences that end leave the batch. Each
    sequence's round is its :class:`RoundRunner`'s, so a sequence in a batch commits exactly what it would alone.
    ``proposer``: proposes all trees of a round together instead of each sequence's policy (:class:`BatchProposer`).
    """
    active = [i for i, runner in enumerate(runners) if not runner.finished(histories[i], results[i])]
    if len(active) < len(runners):
        side.finish([i for i in range(len(runners)) if i not in active])
    while active:
        roots = [histories[i][-1] for i in active]
        asking = [i for i in active if runners[i].wants_draft(histories[i])]
        blocks: dict[int, DraftBlock] = {}
        if asking:
            with timer.stage("draft"):  # per sequence a DraftBlock: [b-1, V'] logits, id map, states, Markov scorer
                blocks = dict(zip(asking, side.draft(asking, [histories[i][-1] for i in asking])))
        with timer.stage("tree"):
            if proposer is None:
                proposals = [runners[i].propose(blocks.get(i), histories[i]) for i in active]
            else:
                trees = proposer.propose(active, [blocks.get(i) for i in active], [histories[i] for i in active])
                proposals = [runners[i].check(tree) for i, tree in zip(active, trees)]
        with timer.stage("verify"):
            logits = side.verify(active, proposals, roots)
        with timer.stage("commit"):
            walks = [runners[i].walk(p, rows, results[i]) for i, p, rows in zip(active, proposals, logits)]
            side.commit(active, [w[0] for w in walks], [w[1] for w in walks], [i in blocks for i in active])
            for i, proposal, (_, committed, _) in zip(active, proposals, walks):
                RoundRunner.book(proposal, committed, histories[i], results[i])
            ended = [i for i, w in zip(active, walks) if w[2]]
            if ended:
                side.finish(ended)
                active = [i for i in active if i not in ended]
