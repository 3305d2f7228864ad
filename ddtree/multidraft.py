"""Two lossless alternatives at T > 0 to the sampled tree's token-level walk: SpecInfer's multi-draft chains and
traversal verification.

* :class:`SpecInferTree` -- SpecInfer-style multi-sequence drafts: k chains drawn independently (WITH replacement)
  token by token from the drafter, merged on their common prefixes into one token tree, and verified by the
  multi-draft rule for i.i.d. draws (:class:`SpecInferRule`). The tree it returns is a :class:`MultiDraftTree`, which
  remembers which chain passed through which node: the rule needs every chain's draw at a node, duplicates included.
* :class:`TraversalVerified` -- traversal verification (Weng et al., "Traversal Verification for Speculative Tree
  Decoding", arXiv 2505.12398, NeurIPS 2025) of the project's sampled trees (children drawn WITHOUT replacement,
  :class:`~ddtree.sampled.SampledTreePolicy`): the tree is walked leaf to root and a whole root path is accepted at
  once with a sequence-level probability (:class:`TraversalVerification`); the tree it returns is a
  :class:`TraversalDraftTree`.

Both only change what a round's tree is and how it is verified, so the one decode loop runs them:
``ddtree_generate(target, draft, ids, policy=SpecInferTree(4, budget=16), temperature=1.0)``. At T = 0 every tree
here is walked greedily (:func:`~dflash_core.decoding.follow`), which is lossless for any tree.

:func:`outcomes` gives, for one tree and the target's logits at its nodes, the exact probability that the round's
accepted path ends at each node (and the law of the bonus token there) under the tree's own rule;
:func:`expected_accepted_length` sums it into the exact expected number of accepted draft tokens, so two rules can be
compared on the same trees without sampling noise.

Draft vocabularies (a ``token_map`` on the block) and Markov heads (a ``scorer`` on the block) are handled as in
:mod:`ddtree.sampled`: chains are drawn over draft columns and stored as target ids, and with a head each token of a
chain is drawn from the head's distribution given the chain's previous token (the root for the first).
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from functools import cached_property

import numpy as np
import torch

from dflash_core.decoding import follow
from dflash_core.tree import ROOT, BlockPolicy, DraftBlock

from .sampled import RESIDUAL_FLOOR, RecursiveRejection, SampledDraftTree, _Rows

__all__ = ["MultiDraftTree", "SpecInferRule", "SpecInferTree", "TraversalDraftTree", "TraversalVerification",
           "TraversalVerified", "expected_accepted_length", "merge_chains", "outcomes"]

Outcome = tuple[int, float, torch.Tensor]  # (node where the accepted path ends, ROOT = -1; probability; [V] bonus law)


def _count(value, name: str, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < minimum:
        raise ValueError(f"{name} must be an int >= {minimum}, got {value!r}")
    return int(value)


# ---------------------------------------------------------------------------------------------------- SpecInfer's rule
class SpecInferRule(RecursiveRejection):
    """SpecInfer's multi-draft rule for i.i.d. draws: the recursive rejection of :class:`RecursiveRejection` with the
    proposal left as it is after a rejection.

    At a node the target's distribution is p and the drafts x_1, ..., x_m are independent draws from one proposal q
    (the next tokens of the m chains that pass through the node, in chain order, duplicates included). With p_1 = p:

        accept x_i with probability min(1, p_i(x_i) / q(x_i))   -> the walk moves into the child carrying x_i;
        else  p_{i+1} = normalise(max(p_i - q, 0))              (what the target still owes)

    and q stays q; if every draw is rejected (or there is none), the bonus token is drawn from p_{m+1}.

    Why this is lossless. Step i is one speculative-sampling step: a fresh draw from q accepted with min(1, p_i / q)
    delivers min(p_i, q) and leaves the rest, max(p_i - q, 0), to what follows a rejection; when what follows is
    distributed as p_{i+1}, the step's outcome is exactly p_i. What follows is step i+1, again a fresh draw from q:
    the draws are i.i.d. and independent of the coins and of the draws before them, so a rejection tells nothing
    about x_{i+1}, and step i+1 is another exact step with target p_{i+1} and the same q. By induction from the last
    step (p_{m+1} sampled directly) the committed token is distributed as p. A duplicate x_j = x_i after x_i was
    rejected is rejected for sure (p_i(x) < q(x) made p_{i+1}(x) = 0), but it still counts: its rejection takes q
    off the residual once more. Skipping it, or renormalising q without a rejected token, breaks the lemma (the tests
    show both). At the child the walk enters, the draws are the next tokens of the chains that carry its token
    there: i.i.d. from that child's proposal, and independent of every decision taken above it, so the lemma holds
    at every node of the accepted path, and each committed token follows the target given the committed prefix.

    How it differs from :class:`RecursiveRejection`, the project's rule for siblings drawn WITHOUT replacement: there
    the next sibling's law is q with the drawn tokens removed and renormalised, and the rule must use that law (its
    ``without``). Here the draws are with replacement, so ``without`` returns q unchanged; the drafts may repeat, and
    the rule walks the repeats. With as many drafts, drawing without replacement offers more distinct tokens and so
    usually accepts more; drawing with replacement is what independent chains give, each a whole sequence drawn
    without looking at the others.
    """

    def without(self, q: torch.Tensor, token: int) -> torch.Tensor:
        """[V] the law of the next draw with replacement: q itself."""
        return q


# ---------------------------------------------------------------------------------------------------- merged chains
def merge_chains(chains: Sequence[Sequence[int]] | torch.Tensor
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Merge k token chains of one length L on their common prefixes: (token_ids [n], parents [n], chain_nodes
    [k, L]), where ``chain_nodes[j, d]`` is the node that carries chain j's token at depth d+1.

    Two chains share a node exactly when they agree on every token up to and including it. Nodes are numbered in the
    order the chains first reach them (chain 0 from depth 1 down, then chain 1's new nodes, ...), so parents come
    first and siblings are in the order of the first chain that drew them. n <= k * L."""
    rows = torch.as_tensor(chains, dtype=torch.int64)
    if rows.dim() != 2:
        raise ValueError(f"chains must be a [k, L] table of token ids (one row per chain), got shape "
                         f"{tuple(rows.shape)}")
    if rows.numel() and int(rows.min()) < 0:
        raise ValueError(f"chains hold token ids >= 0, got {int(rows.min())}")
    tokens: list[int] = []
    parents: list[int] = []
    index: dict[tuple[int, int], int] = {}  # (parent node, token) -> node
    nodes = torch.empty(rows.shape, dtype=torch.int64)
    for j, chain in enumerate(rows.tolist()):
        parent = ROOT
        for d, token in enumerate(chain):
            node = index.get((parent, token))
            if node is None:
                node = index[(parent, token)] = len(tokens)
                tokens.append(token)
                parents.append(parent)
            nodes[j, d] = node
            parent = node
    return torch.tensor(tokens, dtype=torch.int64), torch.tensor(parents, dtype=torch.int64), nodes


@dataclass(frozen=True, eq=False, repr=False)
class MultiDraftTree(SampledDraftTree):
    """A token tree merged from k chains drawn independently, with the chains it came from.

    Besides the :class:`SampledDraftTree` fields (``proposals``/``proposal_rows``: the proposal each node's next
    tokens were drawn from; ``log_probs``: path log-probabilities under the proposals):

        chain_nodes  [k, L] int64   node of chain j at depth d+1 (see :func:`merge_chains`)

    :meth:`draws` lists, for a node, the child reached by each chain's draw there, in chain order and with repeats;
    :meth:`verify` walks them with :attr:`rule` (:class:`SpecInferRule` by default).
    """

    chain_nodes: torch.Tensor = field(default_factory=lambda: torch.zeros(0, 0, dtype=torch.int64))
    rule: RecursiveRejection = field(default_factory=SpecInferRule)

    def __post_init__(self) -> None:
        super().__post_init__()
        nodes = self.chain_nodes
        if nodes.dim() != 2 or nodes.dtype != torch.int64:
            raise ValueError(f"chain_nodes must be a [k, L] int64 tensor, got {tuple(nodes.shape)} {nodes.dtype}")
        if nodes.numel() and not (0 <= int(nodes.min()) and int(nodes.max()) < self.num_nodes):
            raise ValueError(f"chain_nodes must name nodes 0..{self.num_nodes - 1}")

    @cached_property
    def _draws(self) -> dict[int, list[int]]:
        table: dict[int, list[int]] = {}
        for chain in self.chain_nodes.tolist():
            above = ROOT
            for node in chain:
                table.setdefault(above, []).append(node)
                above = node
        return table

    def draws(self, node: int) -> list[int]:
        """The child reached by each chain's draw at ``node`` (ROOT = -1), in chain order, repeats included."""
        if not ROOT <= node < self.num_nodes:
            raise IndexError(f"node {node} out of range for a tree of {self.num_nodes} nodes (use -1 for the root)")
        return list(self._draws.get(node, ()))

    def verify(self, logits: torch.Tensor, temperature: float,
               generator: torch.Generator | None) -> tuple[list[int], int]:
        """Walk the tree with :attr:`rule` over each node's draws; return (accepted node indices, bonus token). At
        T = 0 the greedy walk (follow the target's argmax), lossless for any tree."""
        if temperature <= 0:
            return follow(self.token_ids, self.parents, logits, temperature, generator)
        return _token_walk(self, logits, temperature, generator)

    def __repr__(self) -> str:
        return f"MultiDraftTree{super().__repr__()[len('SampledDraftTree'):]}"


def _draws_of(tree: SampledDraftTree, node: int) -> list[int]:
    """The draws at ``node`` the token-level rule walks: the chains' draws of a merged tree, else the children."""
    return tree.draws(node) if isinstance(tree, MultiDraftTree) else tree.children(node)


def _target(logits: torch.Tensor, temperature: float) -> Callable[[int], torch.Tensor]:
    return lambda node: torch.softmax(logits[node + 1].double() / temperature, dim=-1)  # [V] after ``node``


def _token_walk(tree: SampledDraftTree, logits: torch.Tensor, temperature: float,
                generator: torch.Generator | None) -> tuple[list[int], int]:
    target, tokens = _target(logits, temperature), tree.token_ids.tolist()
    path: list[int] = []
    node = ROOT
    while True:
        draws = _draws_of(tree, node)
        q = tree.proposal(node, logits.shape[-1], logits.device) if draws else None
        choice, token = tree.rule.sample(target(node), q, [tokens[c] for c in draws], generator)
        if choice is None:
            return path, token
        node = draws[choice]
        path.append(node)


class SpecInferTree(BlockPolicy):
    """Proposal policy: SpecInfer-style multi-sequence drafts, ``chains`` chains drawn independently from the drafter
    and merged into one token tree.

    Each chain is drawn token by token: the token at depth d from q_d = softmax(draft_logits[d-1] / T_draft)
    (``draft_temperature``; default: the decoding ``temperature``), or with a Markov head on the block from the
    head's distribution given the chain's previous token (the block's root before depth 1). The chains are drawn
    independently of each other, so two chains may repeat a token or a whole prefix: WITH replacement. Common prefixes
    are merged (:func:`merge_chains`) and the tree records every chain's draw at every node (a
    :class:`MultiDraftTree`), which the multi-draft rule (:class:`SpecInferRule`) walks. Draws use a numpy generator
    seeded with ``seed``, so trees are reproducible.

    Chain length: the block's depth, at most ``depth`` when given. ``budget`` (verified nodes): k chains of length L
    merge into at most k * L nodes, so with a budget L is also at most ``budget // chains`` (and when the budget is
    below ``chains``, ``budget`` chains of length 1 are drawn); a merged tree under the budget is kept as it is
    (nothing is drawn to fill it, which would make a chain's length depend on what the other chains drew).

    What this version keeps from SpecInfer (Miao et al., 2024) and what it changes. Kept: independent draft
    sequences merged into one token tree, verified in one target forward, and the node-wise multi-step rule that is
    lossless for i.i.d. drafts. Changed: the sequences come from one DFlash drafter (one forward gives every depth's
    distribution; without a head every chain draws depth d from the same q_d) rather than from small models run
    token by token, and the rule walks each node's draws in chain order with repeats (the form whose proof needs
    nothing but i.i.d. draws) rather than once per distinct child of the merged tree.
    """

    uses_draft = True

    def __init__(self, chains: int, depth: int | None = None, budget: int | None = None, temperature: float = 1.0,
                 seed: int = 0, draft_temperature: float | None = None, rule: RecursiveRejection | None = None) -> None:
        self.chains = _count(chains, "chains", 1)
        self.depth = None if depth is None else _count(depth, "depth", 1)
        self.budget = None if budget is None else _count(budget, "budget", 0)
        draft_temperature = temperature if draft_temperature is None else draft_temperature
        if isinstance(draft_temperature, bool) or not isinstance(draft_temperature, numbers.Real) \
                or not draft_temperature > 0:
            raise ValueError(f"SpecInfer chains need a draft temperature > 0, got {draft_temperature!r} (at T = 0 "
                             "there is nothing to sample: use the deterministic top-K tree)")
        self.draft_temperature = float(draft_temperature)
        self.rule = rule or SpecInferRule()
        self.rng = np.random.default_rng(seed)
        self.name = f"specinfer-{self.chains}" + (f"x{self.depth}" if self.depth else "") + \
            (f"-b{self.budget}" if self.budget is not None else "")

    def shape(self, block_depth: int) -> tuple[int, int]:
        """(chains, chain length) for a block of ``block_depth`` depths (see the class docstring)."""
        chains = self.chains
        length = block_depth if self.depth is None else min(self.depth, block_depth)
        if self.budget is not None:
            chains = min(chains, self.budget)
            length = min(length, self.budget // chains) if chains else 0
        return chains, max(length, 0)

    def draw(self, rows: _Rows, key) -> int:
        """One draw (a draft column) from proposal row ``key``: inverse-CDF sampling with the policy's generator."""
        probs, cdf = rows.prob(key), rows.cdf[key]
        token = min(int(np.searchsorted(cdf, self.rng.random() * cdf[-1], side="right")), len(cdf) - 1)
        if probs[token] <= 0:  # u rounded up to the total: the last token with mass
            token = int(np.flatnonzero(probs)[-1])
        return token

    def propose(self, block: DraftBlock, history: list[int]) -> MultiDraftTree:
        """A MultiDraftTree of ``chains`` merged chains from the round's :class:`DraftBlock`."""
        chains, length = self.shape(block.depth)
        if chains == 0 or length == 0:
            return MultiDraftTree.empty()
        rows, key, token_map = self._rows(block)
        first = rows.prob(key(1, block.root))
        if not np.isfinite(first).all() or not first.sum() > 0:
            raise ValueError("draft_logits row 0 has no finite probabilities (NaN or +/-inf logits, or a row of -inf; "
                             "with a Markov head: after its bias for the root): cannot draw the chains")
        to_id = (lambda column: column) if token_map is None else token_map.tolist().__getitem__
        drawn = []
        for _ in range(chains):  # chain by chain, depth by depth: one stream, reproducible from the seed
            chain, prev = [], block.root
            for d in range(1, length + 1):
                column = self.draw(rows, key(d, prev))
                chain.append(column)
                prev = to_id(column)
            drawn.append(chain)
        return self.tree_from_chains(block, drawn, rows)

    def _rows(self, block: DraftBlock):
        """(the round's proposal rows, key(depth, previous target id) -> the row a token at that depth is drawn
        from, the token map when the block's columns are draft indices else None)."""
        token_map = None if block.token_map is None else block.token_map.to(torch.int64).cpu()
        if token_map is not None and block.logits.shape[1] != token_map.shape[0]:
            token_map = None  # logits over the whole target vocabulary: columns are target ids
        rows = _Rows(block.logits, self.draft_temperature, 1, block.scorer)
        if block.scorer is None:
            return rows, (lambda depth, prev: depth - 1), token_map  # (the depth's row, whatever came before)
        return rows, (lambda depth, prev: (depth, int(prev))), token_map

    def tree_from_chains(self, block: DraftBlock, chains: Sequence[Sequence[int]],
                         rows: _Rows | None = None) -> MultiDraftTree:
        """The MultiDraftTree of given chains (draft columns of ``block``, one row per chain, equal lengths): what
        :meth:`propose` returns for those draws. Path log-probabilities and proposal rows come from the block."""
        fresh, key, token_map = self._rows(block)
        rows = fresh if rows is None else rows
        columns = torch.as_tensor(chains, dtype=torch.int64)
        if columns.dim() != 2 or columns.shape[1] > block.depth:
            raise ValueError(f"chains must be a [k, L] table with L <= the block's depth {block.depth}, got shape "
                             f"{tuple(columns.shape)}")
        token_ids, parents, chain_nodes = merge_chains(columns if token_map is None else token_map[columns])
        n = token_ids.shape[0]
        column_of, depth_of = [0] * n, [0] * n
        for chain, nodes in zip(columns.tolist(), chain_nodes.tolist()):
            for d, (column, node) in enumerate(zip(chain, nodes)):
                column_of[node], depth_of[node] = column, d + 1
        ids, above = token_ids.tolist(), parents.tolist()
        node_key = [key(1, block.root)] + [key(depth_of[i] + 1, ids[i]) for i in range(n)]  # root first
        scores: list[float] = []
        for i in range(n):
            base = 0.0 if above[i] == ROOT else scores[above[i]]
            scores.append(base + math.log(rows.prob(node_key[above[i] + 1])[column_of[i]]))
        has_draws = torch.zeros(n + 1, dtype=torch.bool)  # root first: chains draw at every node above their end
        has_draws[0] = n > 0
        has_draws[chain_nodes[:, :-1].flatten() + 1] = True
        depths = torch.tensor(depth_of, dtype=torch.int64)
        order: dict = {}
        proposal_rows = torch.full((n + 1,), -1, dtype=torch.int64)
        for slot in range(n + 1):
            if has_draws[slot]:
                proposal_rows[slot] = order.setdefault(node_key[slot], len(order))
        width = rows.logits.shape[1]
        proposals = torch.from_numpy(np.stack([rows.prob(k) for k in order])) if order else \
            torch.zeros(0, width, dtype=torch.float64)
        return MultiDraftTree(token_ids, parents, depths, torch.tensor(scores, dtype=torch.float64),
                              proposals=proposals, proposal_rows=proposal_rows, token_map=token_map, rule=self.rule,
                              chain_nodes=chain_nodes)


# ---------------------------------------------------------------------------------------------------- traversal
class TraversalVerification:
    """Traversal verification (Weng et al., 2025): lossless verification of a tree whose siblings were drawn one
    after the other WITHOUT replacement, deciding whole root paths from the leaves up.

    State. Every node u carries a weight w(u) in [0, 1] (the paper's p_alpha), the target's distribution after it
    P(. | u) (the paper's M_b) and the proposal its remaining children are drawn from Q(. | u) (M_s). At the start
    w(root) = 1, P is the target's distribution at each node and Q the proposal each node's children were drawn from;
    a child c of u carrying token x gets

        w(c) = min(1, w(u) P(x | u) / Q(x | u))          (the path's sequence-level acceptance so far)

    Walk. The candidate is always the first leaf of what is left of the tree (from the root, follow the first
    remaining child), so the nodes are visited in post-order: a node only after all its children were deleted,
    siblings in the order they were drawn. The candidate a is accepted with probability w(a): the round commits the
    root path down to a, then a bonus token drawn from P(. | a). Otherwise a is deleted and its parent u updated
    with S = sum_y max(w(u) P(y | u) - Q(y | u), 0):

        P(. | u) <- max(w(u) P(. | u) - Q(. | u), 0) / S      (the residual, as in token-level rejection)
        w(u)     <- S / (S + 1 - w(u))                        (u's own sequence-level acceptance)
        Q(. | u) <- Q(. | u) without a's token, renormalised  (the law of u's next child: without replacement)

    and the walk goes on with the next candidate (a's next sibling's first leaf, or u itself when a was its last
    child). The root keeps w = 1 (S / S), so the walk always ends: at worst at the root, with a bonus from its
    residual. On a single chain this is block verification (Sun et al., 2024): w(u) after its child's deletion is
    that rule's probability of stopping at u. The walk ends inside the root's first child's subtree with probability
    min(1, p/q), as often as token-level rejection enters it; what differs is where in it: a node is judged with the
    ratio of its whole path and after its descendants, so a descendant whose ratio exceeds 1 can carry a path whose
    first tokens token-level rejection would have turned down, discarding everything below them.

    Why it is lossless (the paper's theorem; the argument, in the form this code follows). Claim, for any node u with
    state (w, P, Q) whose remaining children are sequential draws from Q without replacement: the walk of u's
    remaining subtree accepts some node in it with probability w, its first committed token after u is distributed
    as P given acceptance (with probability w P(x) for x), and every later committed token follows the target given
    the tokens before it. A leaf: accept with w, bonus from P. Otherwise the first remaining child c ~ Q has, by
    induction, its subtree accepted with probability w(c) = min(1, w P(c) / Q(c)), which delivers
    Q(x) w(c) = min(w P(x), Q(x)) to the first token x, and is rejected with probability
    sum_x max(Q(x) - w P(x), 0) = S + 1 - w. After that the rest of u's subtree is, by induction again, accepted with
    first token x with probability w' P'(x) = max(w P(x) - Q(x), 0) / (S + 1 - w): in total min(w P(x), Q(x)) +
    max(w P(x) - Q(x), 0) = w P(x). The induction uses that the rest of u's children are fresh draws from Q without
    c, whatever c's subtree did, and holds for any number of remaining children (none included): so the tree's
    shape may depend on anything drawn before a child, never on the child's own value -- as for the token-level rule
    (the tests enumerate every best-first sampled tree of a tiny drafter and check the joint exactly). At the root
    w = 1, so the round commits tokens from the target.

    Which trees. The update of Q removes the deleted token: siblings drawn WITHOUT replacement, as
    :class:`~ddtree.sampled.SampledTreePolicy` draws them (the setting the paper's update of M_s encodes). SpecInfer's
    merged chains (:class:`SpecInferTree`) are not such trees: their children are the distinct tokens of independent
    draws, and a chain's later tokens are shared by whichever chains merged, so :class:`TraversalVerified` refuses
    them.

    What this version changes. The rule is the paper's; the trees are this project's: grown best-first from one
    DFlash block (with a Markov head, each node's children from its own conditioned row), so their shape depends on
    earlier draws, which the induction above allows. A subtree of weight 0 is deleted without visiting it (the same
    outcome, fewer steps). Tokens outside a draft vocabulary have Q = 0 and reach the output through residuals.

    Arithmetic: float64. x/0 = inf for x > 0 and 0/0 = 0 in the ratios (a drawn child has Q > 0; these only keep
    the formulas defined). A residual of mass S below ``RESIDUAL_FLOOR`` keeps P (its weight S / (S + 1 - w) is then
    that negligible mass, or w stays 1 where S + 1 - w = 0). A subtree whose root has weight 0 is deleted at once:
    every weight inside it is 0 and its deletion leaves the parent's state the same either way.

    The helpers are the whole rule; :meth:`steps` walks them, :meth:`sample` flips the coins and :meth:`outcomes`
    gives the exact probabilities of the same walk.
    """

    def weight(self, w: float, p: torch.Tensor, q: torch.Tensor, token: int) -> float:
        """The child's weight min(1, w p(x) / q(x)) for the child carrying token x below a node of weight w."""
        owed, drawn = w * float(p[token]), float(q[token])
        if drawn > 0:
            return min(1.0, owed / drawn)
        return 1.0 if owed > 0 else 0.0

    def rejected(self, w: float, p: torch.Tensor, q: torch.Tensor,
                 token: int) -> tuple[float, torch.Tensor, torch.Tensor]:
        """The parent's state after its child carrying ``token`` was deleted: (weight, target, proposal)."""
        owed = (w * p - q).clamp(min=0.0)
        mass = float(owed.sum())
        lost = mass + (1.0 - w)  # the probability that a child subtree drawn from q is rejected (= mass at w = 1)
        w_new = mass / lost if lost > 0 else w
        p_new = owed / mass if mass > RESIDUAL_FLOOR else p
        return min(max(w_new, 0.0), 1.0), p_new, self.without(q, token)

    def without(self, q: torch.Tensor, token: int) -> torch.Tensor:
        """[V] the law of the parent's next child: ``q`` without ``token``, renormalised (without replacement)."""
        return RecursiveRejection().without(q, token)

    def steps(self, tree: SampledDraftTree, target: Callable[[int], torch.Tensor],
              proposal: Callable[[int], torch.Tensor]) -> Iterator[tuple[int, float, torch.Tensor]]:
        """The walk's candidates in order: (node, probability of accepting it, [V] bonus law there). Each candidate
        the caller does not stop at counts as rejected. ``target(node)``: [V] float64 target after ``node``;
        ``proposal(node)``: [V] float64 law of its children (ROOT = -1 for the root)."""
        tokens, parents = tree.token_ids.tolist(), tree.parents.tolist()
        kids = {node: tree.children(node) for node in range(ROOT, tree.num_nodes)}
        following = dict.fromkeys(kids, 0)  # index of each node's first remaining child
        weight, p, q = {ROOT: 1.0}, {}, {}
        node = ROOT
        while True:
            while following[node] < len(kids[node]):  # down to the first leaf of what is left
                if node not in q:
                    p[node], q[node] = target(node), proposal(node)
                child = kids[node][following[node]]
                weight[child] = self.weight(weight[node], p[node], q[node], tokens[child])
                if weight[child] > 0:
                    node = child
                    continue
                weight[node], p[node], q[node] = self.rejected(weight[node], p[node], q[node], tokens[child])
                following[node] += 1
            if node not in p:
                p[node] = target(node)
            yield node, weight[node], p[node]
            if node == ROOT:
                return
            parent = parents[node]
            weight[parent], p[parent], q[parent] = self.rejected(weight[parent], p[parent], q[parent], tokens[node])
            following[parent] += 1
            node = parent

    def sample(self, tree: SampledDraftTree, target, proposal,
               generator: torch.Generator | None) -> tuple[list[int], int]:
        """Walk ``tree`` with coin flips: (accepted node indices, root first; bonus token)."""
        for node, accept, bonus in self.steps(tree, target, proposal):
            if node != ROOT:  # (the root is accepted: its weight stays 1)
                u = torch.rand((), generator=generator, device=bonus.device, dtype=torch.float64)
                if not bool(u < accept):
                    continue
            return _root_path(tree, node), int(torch.multinomial(bonus, 1, generator=generator))
        raise AssertionError("the walk ends at the root")

    def outcomes(self, tree: SampledDraftTree, target, proposal) -> list[Outcome]:
        """Exact probabilities of what :meth:`sample` does: [(node where the accepted path ends, probability, [V]
        bonus law)] for every candidate the walk can stop at."""
        out: list[Outcome] = []
        reach = 1.0  # probability that every earlier candidate was rejected
        for node, accept, bonus in self.steps(tree, target, proposal):
            chance = 1.0 if node == ROOT else min(max(float(accept), 0.0), 1.0)
            if chance > 0:
                out.append((node, reach * chance, bonus))
            reach *= 1.0 - chance
            if reach <= 0:
                break
        return out


def _root_path(tree, node: int) -> list[int]:
    path = []
    while node != ROOT:
        path.append(node)
        node = int(tree.parents[node])
    return path[::-1]


@dataclass(frozen=True, eq=False, repr=False)
class TraversalDraftTree(SampledDraftTree):
    """A sampled tree (siblings drawn without replacement) verified by traversal verification: :meth:`verify` runs
    :attr:`traversal` over the whole tree instead of the token-level walk (``rule`` is kept only to say what the tree
    was drawn for)."""

    traversal: TraversalVerification = field(default_factory=TraversalVerification)

    @classmethod
    def of(cls, tree: SampledDraftTree, traversal: TraversalVerification | None = None) -> TraversalDraftTree:
        """The same tree (same nodes, proposals, token map), verified by ``traversal``. Refuses a tree whose
        siblings are not draws without replacement (a :class:`MultiDraftTree`)."""
        if isinstance(tree, MultiDraftTree) or not isinstance(tree, SampledDraftTree):
            raise TypeError(f"traversal verification needs a SampledDraftTree whose siblings were drawn without "
                            f"replacement (ddtree.sampled.SampledTreePolicy), got {type(tree).__name__}: "
                            "SpecInfer's merged chains are drawn with replacement and verified by SpecInferRule")
        return cls(tree.token_ids, tree.parents, tree.depths, tree.log_probs, proposals=tree.proposals,
                   proposal_rows=tree.proposal_rows, token_map=tree.token_map, rule=tree.rule,
                   traversal=traversal or TraversalVerification())

    @classmethod
    def empty(cls) -> TraversalDraftTree:
        return cls.of(SampledDraftTree.empty())

    def verify(self, logits: torch.Tensor, temperature: float,
               generator: torch.Generator | None) -> tuple[list[int], int]:
        """Traversal verification at T > 0; the greedy walk (lossless for any tree) at T = 0."""
        if temperature <= 0:
            return follow(self.token_ids, self.parents, logits, temperature, generator)
        return self.traversal.sample(self, _target(logits, temperature),
                                     lambda node: self.proposal(node, logits.shape[-1], logits.device), generator)

    def __repr__(self) -> str:
        return f"TraversalDraftTree{super().__repr__()[len('SampledDraftTree'):]}"


class TraversalVerified(BlockPolicy):
    """Proposal policy: ``policy``'s sampled trees, verified by traversal verification.

    ``policy`` must propose :class:`~ddtree.sampled.SampledDraftTree` whose siblings were drawn without replacement
    (:class:`~ddtree.sampled.SampledTreePolicy`, with or without a Markov head, over a draft vocabulary or not): the
    setting :class:`TraversalVerification`'s proof covers. Each tree is handed on as a :class:`TraversalDraftTree`
    (same nodes and proposals), so the trees drawn are exactly the wrapped policy's and only the verification
    changes: a like-for-like comparison of the two rules. ``rule``: the traversal rule the trees carry.
    """

    def __init__(self, policy: BlockPolicy, rule: TraversalVerification | None = None) -> None:
        if not isinstance(policy, BlockPolicy):
            raise TypeError(f"TraversalVerified wraps a BlockPolicy (e.g. SampledTreePolicy), got "
                            f"{type(policy).__name__}")
        if isinstance(policy, SpecInferTree):
            raise ValueError("traversal verification assumes siblings drawn without replacement; SpecInferTree draws "
                             "its chains with replacement and merges them (verify those with SpecInferRule, its "
                             "default): wrap a SampledTreePolicy instead")
        self.policy, self.rule = policy, rule or TraversalVerification()
        self.name = f"traversal-{policy.name}"
        self.uses_draft, self.proposes_chains = policy.uses_draft, policy.proposes_chains

    def propose(self, block: DraftBlock | None, history: list[int]) -> TraversalDraftTree:
        return TraversalDraftTree.of(self.policy.propose(block, history), self.rule)

    def observe(self, path: list[int]) -> None:
        self.policy.observe(path)

    def wants_draft(self, history: list[int]) -> bool:
        return self.policy.wants_draft(history)


# ---------------------------------------------------------------------------------------------------- exact outcomes
def outcomes(tree: SampledDraftTree, logits: torch.Tensor, temperature: float) -> list[Outcome]:
    """Exact outcome of verifying ``tree`` against the target's ``logits`` [n+1, V] (root first) under the tree's
    own rule: [(node where the accepted path ends (ROOT = -1), probability, [V] float64 law of the bonus token)],
    probabilities summing to 1.

    A :class:`TraversalDraftTree`: the traversal walk (deterministic but for its coins, so one outcome per
    candidate). Any other sampled tree: the token-level walk with its ``rule`` over each node's draws (a
    :class:`MultiDraftTree`'s chains, else the children). At T = 0: the greedy walk, one outcome."""
    if temperature <= 0:
        path, bonus = follow(tree.token_ids, tree.parents, logits, 0.0, None)
        law = torch.zeros(logits.shape[-1], dtype=torch.float64, device=logits.device)
        law[bonus] = 1.0
        return [(path[-1] if path else ROOT, 1.0, law)]
    target = _target(logits, temperature)
    if isinstance(tree, TraversalDraftTree):
        return tree.traversal.outcomes(tree, target,
                                       lambda node: tree.proposal(node, logits.shape[-1], logits.device))
    if not isinstance(tree, SampledDraftTree):
        raise TypeError(f"outcomes needs a sampled tree (SampledDraftTree, MultiDraftTree, TraversalDraftTree), "
                        f"got {type(tree).__name__}: a deterministic tree is walked by follow")
    out: list[Outcome] = []
    tokens = tree.token_ids.tolist()
    stack = [(ROOT, 1.0)]
    while stack:
        node, reach = stack.pop()
        draws = _draws_of(tree, node)
        q = tree.proposal(node, logits.shape[-1], logits.device) if draws else None
        move, bonus = tree.rule.outcomes(target(node), q, [tokens[c] for c in draws])
        stop = float(bonus.sum())
        if stop > 0:
            out.append((node, reach * stop, bonus / stop))
        moved: dict[int, float] = {}
        for child, chance in zip(draws, move.tolist()):
            moved[child] = moved.get(child, 0.0) + chance
        stack += [(child, reach * chance) for child, chance in moved.items() if chance > 0]
    return out


def expected_accepted_length(tree: SampledDraftTree, logits: torch.Tensor, temperature: float) -> float:
    """Exact expected number of draft tokens the round accepts under the tree's own rule (the bonus token not
    counted: a round commits one more), from :func:`outcomes`."""
    depth = [0] + tree.depths.tolist()
    return sum(prob * depth[node + 1] for node, prob, _ in outcomes(tree, logits, temperature))
