"""The policy contract: what the decode loop hands a proposal policy each round, and what it gets back.

Each round a policy receives a :class:`DraftBlock` (the drafter's output for the block about to be verified, or None
in a round without the drafter) and the history (prompt + every committed token, the root last), and returns a
:class:`~dflash_core.tree.DraftTree`. After the target's verification the loop calls ``observe(path)`` with the
indices of the accepted nodes that were committed. A policy subclasses :class:`BlockPolicy` (``name``,
``uses_draft``, ``propose``; ``observe`` and ``wants_draft`` have defaults).

Whatever a valid tree holds, the output is the target's: the loop verifies it. The loop checks every round, in
O(nodes), the invariants its positions, attention mask and cache compaction rely on (parents before children,
depth = parent's depth + 1, depth 1 under the root); see :func:`dflash_core.decoding.check_structure`.
"""

from __future__ import annotations

import inspect
import math
import warnings
from dataclasses import dataclass, field
from typing import Protocol

import torch

from .markov import MarkovScorer
from .tree import DraftTree

__all__ = ["BlockPolicy", "Chain", "DraftBlock", "LegacyPolicy", "NoDraft", "Proposal", "ProposalPolicy",
           "as_block", "as_policy", "check_proposal", "check_structure"]


@dataclass
class DraftBlock:
    """One round's drafter output.

    ``logits`` [D, V'] float32, row d-1 = depth d, over the drafter's draft vocabulary: column j is target token
    ``token_map[j]`` (``token_map`` None: the whole target vocabulary, column j is token j). ``root``: the block's
    root (the last committed token). ``states`` [D, H]: the drafter's output states. ``scorer``: for a drafter with a
    Markov head, the conditional distribution of a node's children given that node's own token
    (:class:`~dflash_core.markov.MarkovScorer`; None otherwise).
    """

    logits: torch.Tensor
    token_map: torch.Tensor | None
    root: int
    vocab_size: int
    states: torch.Tensor | None = None
    scorer: MarkovScorer | None = None
    _full: torch.Tensor | None = field(default=None, repr=False)

    @property
    def depth(self) -> int:
        return int(self.logits.shape[0])

    def full_logits(self) -> torch.Tensor:
        """[D, V] float32 over the target's whole vocabulary, -inf outside the draft vocabulary (computed once)."""
        if self.token_map is None:
            return self.logits
        if self.vocab_size < 0:
            raise ValueError("this DraftBlock was built from compact logits without the target's vocabulary size: "
                             "build it with DraftBlock(logits, token_map, root, vocab_size) to get full rows")
        if self._full is None:
            full = self.logits.new_full((self.depth, self.vocab_size), float("-inf"))
            self._full = full.index_copy_(-1, self.token_map.to(full.device), self.logits)
        return self._full

    def target_ids(self, columns: torch.Tensor) -> torch.Tensor:
        """Draft-vocabulary columns -> target token ids."""
        return columns if self.token_map is None else self.token_map.to(columns.device)[columns]


class BlockPolicy:
    """Base class of proposal policies (the contract the loop calls; see the module docstring).

    ``uses_draft``: whether the policy reads the drafter (False: ``propose`` always gets ``block=None`` and the
    drafter never runs). ``wants_draft(history)``: whether this round runs the drafter (a policy may skip it).
    """

    name: str = "policy"
    uses_draft: bool = True

    def propose(self, block: DraftBlock | None, history: list[int]) -> DraftTree:
        raise NotImplementedError

    def observe(self, path: list[int]) -> None:
        """Called after each round with the indices of the accepted nodes that were committed."""

    def wants_draft(self, history: list[int]) -> bool:
        return self.uses_draft


class Proposal(Protocol):
    """What the loop reads of a round's draft tree: node i has token ``token_ids[i]``, parent ``parents[i]`` (-1 =
    root), depth ``depths[i]``. Every built-in policy returns a :class:`~dflash_core.tree.DraftTree` (chains
    included: they are verified under the causal mask); a policy may return any object with these members."""

    token_ids: torch.Tensor  # [n] int64
    parents: torch.Tensor  # [n] int64, parents[i] < i
    depths: torch.Tensor  # [n] int64, 1-based

    def visibility(self) -> torch.Tensor | None:
        """[n+1, n+1] bool ancestor-or-self matrix (index 0 = root), or None when causal order is exact (a chain)."""

    def expected_acceptance(self) -> float:
        """Expected committed tokens per round under the drafter's factorized distribution (bonus included)."""


class ProposalPolicy(Protocol):
    """The OLDER policy contract, still accepted through :class:`LegacyPolicy` (with a DeprecationWarning); new
    policies subclass :class:`BlockPolicy`."""

    name: str
    uses_draft: bool

    # Optional: ``observe(accepted: int[, path: list[int]])`` is called after each round with the number of draft
    # tokens accepted and, when it takes a second argument, the accepted nodes' indices (adaptive policies learn).

    def propose(self, draft_logits: torch.Tensor | None, history: list[int], token_map: torch.Tensor | None = None
                ) -> Proposal:
        """draft_logits: [b-1, V] float32, row d-1 = the drafter's logits for depth d (None when uses_draft is
        False); history: prompt + generated tokens so far, the root (last committed token) last.

        ``token_map`` is optional in a policy's signature. A policy whose ``propose`` takes it gets COMPACT logits
        [b-1, V'] over the drafter's draft vocabulary, column j being target token ``token_map[j]`` (None: the
        drafter drafts over the whole vocabulary, column j is token j); the proposal's token ids are target ids.
        A policy without it gets rows over the whole target vocabulary, -inf outside the draft vocabulary.
        """


class NoDraft(BlockPolicy):
    """Propose nothing: each round commits exactly the target's own next token (plain decoding)."""

    name, uses_draft = "ar", False

    def propose(self, block: DraftBlock | None, history: list[int]) -> DraftTree:
        return DraftTree.empty()


class Chain(BlockPolicy):
    """DFlash: the drafter's top-1 token at every depth, as one branch. With a Markov head each depth is drafted
    after the token chosen at the depth above (the root for depth 1): the greedy chain of the conditioned drafter."""

    name, uses_draft = "chain", True

    def propose(self, block: DraftBlock, history: list[int], token_map: torch.Tensor | None = None) -> DraftTree:
        block = as_block(block, history, token_map)
        if block.scorer is not None:
            tokens, logps, prev = [], [], block.root
            for depth in range(1, block.depth + 1):
                row = block.scorer.log_probs(depth, [prev])[0]  # [V'] children of the previous chain token
                j = int(row.argmax())
                prev = int(block.target_ids(torch.tensor(j)))
                tokens.append(prev)
                logps.append(float(row[j]))
            return DraftTree.chain(tokens, logps)
        logp = torch.log_softmax(block.logits.float(), dim=-1)  # [b-1, V']
        best, columns = logp.max(dim=-1)
        return DraftTree.chain(block.target_ids(columns).cpu(), best.cpu())


def check_proposal(proposal: Proposal) -> None:
    """Raise ValueError naming what is wrong with a policy's tree: the structure of :meth:`DraftTree.validate`
    (parents first, 1-based depths that follow the parents, distinct sibling tokens; best-first order is not
    required). Nodes may lie deeper than the drafted block (a lookup continuation does)."""
    tree = proposal if isinstance(proposal, DraftTree) else DraftTree(
        proposal.token_ids.cpu().long(), proposal.parents.cpu().long(), proposal.depths.cpu().long(),
        torch.full((len(proposal.token_ids),), math.nan, dtype=torch.float64))
    try:
        tree.validate(best_first=False)
    except ValueError as error:
        raise ValueError(f"the policy proposed an invalid tree: {error}") from None


def check_structure(proposal: Proposal, policy_name: str) -> None:
    """The invariants the round relies on, checked every round in O(nodes): equal lengths, token ids >= 0, parents
    before their children (``-1 <= parents[i] < i``: the cache compaction keeps nodes by index), depth 1 under the
    root and depth = parent's depth + 1 (positions and the attention mask come from the depths). A tree that breaks
    one would make the target's cache hold wrong positions or tokens, so it is refused with the policy's name."""
    tokens, parents, depths = proposal.token_ids, proposal.parents, proposal.depths
    n = len(tokens)
    if len(parents) != n or len(depths) != n:
        raise ValueError(f"policy {policy_name!r} proposed a tree with {n} tokens, {len(parents)} parents and "
                         f"{len(depths)} depths: one entry per node in each")
    if n == 0:
        return
    parents, depths = parents.cpu().long(), depths.cpu().long()
    index = torch.arange(n)
    above = torch.where(parents >= 0, depths[parents.clamp(min=0)], torch.zeros_like(depths))  # the parent's depth
    bad = (parents < -1) | (parents >= index) | (depths != above + 1)
    if bool(bad.any()) or int(tokens.min()) < 0:
        i = int(bad.nonzero()[0, 0]) if bool(bad.any()) else int(tokens.argmin())
        raise ValueError(
            f"policy {policy_name!r} proposed an invalid tree at node {i} (token {int(tokens[i])}, parent "
            f"{int(parents[i])}, depth {int(depths[i])}): nodes must come after their parents (-1 = the root), "
            "depths are 1-based with depth = parent's depth + 1, token ids >= 0. DraftTree.from_nodes(..., sort=True) "
            "orders nodes given in any order")


def as_block(drafted, history: list[int], token_map: torch.Tensor | None = None) -> DraftBlock | None:
    """A round's draft as a :class:`DraftBlock`: the loop's own, or logits (with their ``token_map``, or as a
    ``(logits, token_map)`` pair) from a caller written to the older contract (policies that wrap a built-in one)."""
    if drafted is None or isinstance(drafted, DraftBlock):
        return drafted
    logits, token_map = drafted if isinstance(drafted, tuple) else (drafted, token_map)
    root = history[-1] if history else -1  # a caller that drafts outside a decode (a cost measurement) has none
    return DraftBlock(logits, token_map, root, int(logits.shape[-1] if token_map is None else -1))


class LegacyPolicy(BlockPolicy):
    """A policy written to the older contract (``propose(draft_logits, history[, token_map])``, ``observe(accepted
    [, path])``), run through the new one: how it is called is read once from its signatures, here, and never in
    the decode loop. Its other attributes (``lookup_committed``, ``calibration_s``, ...) read through."""

    def __init__(self, policy) -> None:
        if not callable(getattr(policy, "propose", None)) or not isinstance(getattr(policy, "uses_draft", None), bool):
            raise TypeError(f"{type(policy).__name__} is not a proposal policy: it needs propose(block, history) "
                            "and a bool uses_draft (True when it reads the drafter); subclass dflash_core.BlockPolicy, "
                            "see dflash_core.policy")
        warnings.warn(f"{type(policy).__name__} is written to the older policy contract (propose(draft_logits, "
                      "history)); subclass dflash_core.BlockPolicy and take the round's DraftBlock instead",
                      DeprecationWarning, stacklevel=3)
        self.inner, self.uses_draft = policy, policy.uses_draft
        self.name = getattr(policy, "name", type(policy).__name__)
        self._compact = _takes(policy.propose, "token_map")
        self._observe = getattr(policy, "observe", None)
        self._observe_path = self._observe is not None and _positional(self._observe) >= 2
        self._wants = getattr(policy, "wants_draft", None)

    def __getattr__(self, name):
        return getattr(self.__dict__["inner"], name)

    def propose(self, block: DraftBlock | None, history: list[int]):
        if block is None:
            return self.inner.propose(None, history, token_map=None) if self._compact else \
                self.inner.propose(None, history)
        if self._compact:
            return self.inner.propose(block.logits, history, token_map=block.token_map)
        return self.inner.propose(block.full_logits(), history)

    def observe(self, path: list[int]) -> None:
        if self._observe is not None:
            self._observe(len(path), path) if self._observe_path else self._observe(len(path))

    def wants_draft(self, history: list[int]) -> bool:
        return self.uses_draft and (self._wants is None or bool(self._wants(history)))


def _takes(fn, name: str) -> bool:
    try:
        return name in inspect.signature(fn).parameters
    except (TypeError, ValueError):  # a builtin without a signature
        return False


def _positional(fn) -> int:
    """How many positional arguments ``fn`` takes (a large number for ``*args``)."""
    try:
        params = list(inspect.signature(fn).parameters.values())
    except (TypeError, ValueError):
        return 1
    if any(p.kind is p.VAR_POSITIONAL for p in params):
        return 1 << 30
    return sum(p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD) for p in params)


def as_policy(policy) -> BlockPolicy:
    """``policy`` itself when it is a :class:`BlockPolicy`, else its :class:`LegacyPolicy` adapter (with a
    DeprecationWarning); a TypeError for an object that is no policy."""
    return policy if isinstance(policy, BlockPolicy) else LegacyPolicy(policy)
