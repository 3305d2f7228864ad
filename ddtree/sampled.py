"""Sampled draft trees at T > 0, verified losslessly by recursive rejection sampling.

A deterministic top-K tree verified by sample-and-match profits only when the target's own sample happens to be one of
the drafter's top tokens. Here the children of every node are instead DRAWN from the drafter's distribution (without
replacement), and the target accepts or rejects them with rejection sampling against residual distributions. When the
drafter's distribution q is close to the target's p, the first child alone is accepted with probability
sum_x min(p(x), q(x)) = 1 - TV(p, q), which at T = 1 is often well above the mass p puts on the drafter's top token.

Three pieces, one idea each:

* :class:`RecursiveRejection` -- the verification rule at one node (exact; see its docstring for why);
* :class:`SampledTreePolicy` -- the proposal policy: children sampled without replacement from
  q_d = softmax(draft_logits[d-1] / T_draft) (with a Markov head: from the parent's own conditioned distribution),
  tree grown best-first under the node budget;
* :class:`SampledDraftTree` -- the tree it returns: a :class:`DraftTree` that also records, for every node, the
  proposal its children were drawn from, and carries its own ``verify`` (the decode loop calls it instead of
  sample-and-match).

Draft vocabularies: a drafter may score only a subset of V' target tokens. Handed logits over the whole target
vocabulary with -inf outside the subset, the sampled tree needs nothing more (those tokens get q = 0). Handed logits
over the V' subset columns, the block's ``token_map`` ([V'] draft index -> target token id, a drafter's
``draft_vocab``) maps them: the tree then stores target token ids, and the proposal rows stay over draft indices
until verification spreads them over the target vocabulary. Either way tokens outside the subset have q = 0 and
reach the output through the residual.

At T = 0 there is nothing to sample: ``ddtree_generate(..., tree="sampled", temperature=0)`` builds the deterministic
top-K tree and walks it greedily, and a sampled tree verified at T = 0 falls back to the greedy walk too.
"""

from __future__ import annotations

import heapq
import math
import numbers
from dataclasses import dataclass, field

import numpy as np
import torch

from dflash_core.decoding import follow
from dflash_core.tree import BlockPolicy, DraftBlock

from dflash_core.tree import ROOT, DraftTree

__all__ = ["RecursiveRejection", "SampledDraftTree", "SampledTreePolicy", "sample_tree"]

# A residual whose total mass is below this is rounding noise: the rejection that leads to it has probability equal to
# that mass (sum_x max(q(x) - p(x), 0) = sum_x max(p(x) - q(x), 0)), so what is sampled there cannot matter.
RESIDUAL_FLOOR = 1e-12
# Rejection draws from q before the exact masked draw, when sampling a further child without replacement.
REDRAWS = 32


# ---------------------------------------------------------------------------------------------------- the rule
class RecursiveRejection:
    """Recursive rejection sampling: lossless verification of children drawn without replacement.

    At a node the target's distribution is p (at the decoding temperature) and the children c_1, ..., c_k were drawn
    one after the other without replacement from the proposal q. With p_1 = p and q_1 = q, for i = 1..k:

        accept c_i with probability a_i(c_i) = min(1, p_i(c_i) / q_i(c_i))   -> the walk moves into child c_i;
        else  p_{i+1} = normalise(max(p_i - q_i, 0))                         (what the target still owes)
              q_{i+1} = q_i with c_i removed, renormalised                   (the law of the next draw)

    and if every child is rejected, the committed (bonus) token is drawn from p_{k+1}.

    Why the committed token is exactly distributed as p. One step is ordinary speculative sampling: a token x drawn
    from q_i and accepted with probability a_i(x) delivers q_i(x) a_i(x) = min(p_i(x), q_i(x)) to x, and rejection
    happens with the complementary mass sum_x max(p_i(x) - q_i(x), 0); if the outcome after a rejection is distributed
    as p_{i+1} = max(p_i - q_i, 0) / that mass, the step's outcome is min(p_i, q_i) + max(p_i - q_i, 0) = p_i
    exactly. That premise holds by induction from the last step backwards: after rejecting c_i, the next child is a
    fresh draw from q_{i+1} (sampling without replacement: given c_1..c_i, the next draw is q with those removed,
    renormalised), so step i+1 is again one exact speculative-sampling step, now with target p_{i+1} and proposal
    q_{i+1}; with no child left, p_{k+1} is sampled directly. Whether a further child exists may depend on anything
    drawn before it (the tree builder decides it from earlier draws only), never on the child's own value, so the
    premise holds whatever the tree's shape. Applied at every node of the accepted path, each committed token is a
    sample from the target's distribution given the committed prefix: the output is the target's.

    Arithmetic: float64 throughout. ``acceptance`` uses x/0 = inf for x > 0 and 0/0 = 0 (a token with q = 0 is never
    a correctly drawn child; its ratio only keeps the formulas defined). A residual of total mass below
    ``RESIDUAL_FLOOR`` is rounding noise (p_i == q_i up to rounding, where rejecting has that tiny probability);
    p_i is kept instead. A proposal whose whole support was drawn becomes all zeros (no child can follow).

    The three helpers are the whole rule; :meth:`sample` walks them with coin flips and :meth:`outcomes` gives the
    same procedure's exact outcome probabilities (for tests and analysis).
    """

    def acceptance(self, p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
        """[V] probability of accepting token x when it is the drawn child: min(1, p(x) / q(x))."""
        ratio = torch.where(q > 0, p / torch.where(q > 0, q, torch.ones_like(q)),
                            torch.where(p > 0, torch.full_like(p, math.inf), torch.zeros_like(p)))
        return ratio.clamp(max=1.0)

    def residual(self, p: torch.Tensor, q: torch.Tensor, accept: torch.Tensor) -> torch.Tensor:
        """[V] the target after a rejection: accepting delivered q * accept = min(p, q), the rest is still owed."""
        owed = (p - q * accept).clamp(min=0.0)  # = max(p - q, 0) for the clipped acceptance
        return _normalise(owed, fallback=p)

    def without(self, q: torch.Tensor, token: int) -> torch.Tensor:
        """[V] the law of the next draw without replacement: q with ``token`` removed, renormalised."""
        rest = q.clone()
        rest[token] = 0.0
        total = float(rest.sum())
        return rest / total if total > 0 else rest

    def sample(self, p: torch.Tensor, q: torch.Tensor | None, children: list[int],
               generator: torch.Generator | None) -> tuple[int | None, int]:
        """Verify ``children`` (their tokens in draw order) at one node: (index of the accepted child, its token) or
        (None, bonus token drawn from the last residual). ``p``, ``q``: [V] float64 on one device (``q`` is unused,
        may be None, without children)."""
        for index, token in enumerate(children):
            accept = self.acceptance(p, q)
            u = torch.rand((), generator=generator, device=p.device, dtype=p.dtype)
            if bool(u < accept[token]):
                return index, token
            p = self.residual(p, q, accept)
            q = self.without(q, token)
        return None, int(torch.multinomial(p, 1, generator=generator))

    def outcomes(self, p: torch.Tensor, q: torch.Tensor | None,
                 children: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """Exact probabilities of what :meth:`sample` does: ([k] move into child i, [V] stop with bonus token x).

        For children drawn as the rule assumes, ``move[i]`` summed into their tokens plus ``bonus``, averaged over the
        draws, equals ``p`` (the tests enumerate this)."""
        move = []
        reach = 1.0  # probability that every earlier child was rejected
        for token in children:
            accept = self.acceptance(p, q)
            chance = min(max(float(accept[token]), 0.0), 1.0)  # the coin flip u < a clips whatever a is
            move.append(reach * chance)
            reach *= 1.0 - chance
            p = self.residual(p, q, accept)
            q = self.without(q, token)
        return torch.tensor(move, dtype=torch.float64), reach * p


def _normalise(weights: torch.Tensor, fallback: torch.Tensor) -> torch.Tensor:
    total = float(weights.sum())
    return weights / total if total > RESIDUAL_FLOOR else fallback


# ---------------------------------------------------------------------------------------------------- the tree
@dataclass(frozen=True, eq=False, repr=False)
class SampledDraftTree(DraftTree):
    """A draft tree with sampled children and the proposals they were drawn from.

    Besides the four DraftTree fields (``log_probs``: path log-probability under the proposals, NOT best-first):

        proposals      [R, V'] float64  proposal distributions (over draft indices when ``token_map`` is given)
        proposal_rows  [n+1] int64      row of ``proposals`` that the children of the root (index 0) and of node i
                                        (index i+1) were drawn from; -1 for a node without children
        token_map      [V'] int64 or None   draft index -> target token id (None: draft index == token id)

    Siblings are stored in the order they were drawn (node order), which is the order the verifier takes them in.
    """

    proposals: torch.Tensor = field(default_factory=lambda: torch.zeros(0, 0, dtype=torch.float64))
    proposal_rows: torch.Tensor = field(default_factory=lambda: torch.zeros(1, dtype=torch.int64))
    token_map: torch.Tensor | None = None
    rule: RecursiveRejection = field(default_factory=RecursiveRejection)

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.proposals.dim() != 2 or self.proposals.dtype != torch.float64:
            raise ValueError(f"proposals must be a [R, V'] float64 tensor, got {tuple(self.proposals.shape)} "
                             f"{self.proposals.dtype}")
        if tuple(self.proposal_rows.shape) != (self.num_nodes + 1,):
            raise ValueError(f"proposal_rows must have n+1 = {self.num_nodes + 1} entries (root first), "
                             f"got {tuple(self.proposal_rows.shape)}")
        if self.token_map is not None and tuple(self.token_map.shape) != (self.proposals.shape[1],):
            raise ValueError(f"token_map must have one target id per proposal column ({self.proposals.shape[1]}), "
                             f"got {tuple(self.token_map.shape)}")

    @classmethod
    def empty(cls) -> SampledDraftTree:
        no_ids = torch.zeros(0, dtype=torch.int64)
        return cls(no_ids, no_ids.clone(), no_ids.clone(), torch.zeros(0, dtype=torch.float64))

    def proposal(self, node: int, vocab_size: int, device: torch.device | str = "cpu") -> torch.Tensor:
        """[vocab_size] float64: the distribution the children of ``node`` (ROOT = -1) were drawn from, over target
        token ids (zero for tokens outside a draft vocabulary)."""
        index = int(self.proposal_rows[node + 1])
        if index < 0:
            raise ValueError(f"node {node} has no children, so no proposal was drawn from")
        row = self.proposals[index]  # [V']
        q = torch.zeros(vocab_size, dtype=torch.float64)
        if self.token_map is None:
            if row.shape[0] > vocab_size:
                raise ValueError(f"proposal over {row.shape[0]} tokens but the target scores {vocab_size}")
            q[: row.shape[0]] = row
        else:
            q[self.token_map] = row
        return (q / q.sum()).to(device)

    def verify(self, logits: torch.Tensor, temperature: float,
               generator: torch.Generator | None) -> tuple[list[int], int]:
        """Walk the verified tree with :attr:`rule`; return (accepted node indices, bonus token).

        ``logits``: [n+1, V] target logits at the root and every node (one verify forward). At T = 0 this is the
        greedy walk (follow the target's argmax), which is lossless for any tree.
        """
        if temperature <= 0:
            return follow(self.token_ids, self.parents, logits, temperature, generator)
        path: list[int] = []
        node = ROOT
        tokens = self.token_ids.tolist()
        while True:
            p = torch.softmax(logits[node + 1].double() / temperature, dim=-1)  # [V] target at this node
            kids = self.children(node)
            q = self.proposal(node, logits.shape[-1], logits.device) if kids else None
            choice, token = self.rule.sample(p, q, [tokens[k] for k in kids], generator)
            if choice is None:
                return path, token
            node = kids[choice]
            path.append(node)

    def __repr__(self) -> str:
        return f"Sampled{super().__repr__()}"


# ---------------------------------------------------------------------------------------------------- the policy
class _Rows:
    """One round's proposal rows, computed lazily and keyed by what decides them.

    Without a Markov scorer a row is a depth's distribution, keyed by the parent's depth (0 = the root): every node
    of a depth draws its children from the same q. With a scorer (:class:`~dflash_core.model.MarkovScorer`) a row
    is keyed by (children's depth, parent's target token): the children of a node come from softmax((base[d-1] +
    bias(token)) / T), and two nodes of one depth carrying one token share it exactly (the head sees only the token
    and, when gated, the depth's drafter state)."""

    def __init__(self, draft_logits: torch.Tensor, temperature: float, max_rank: int, scorer=None) -> None:
        self.logits = draft_logits.detach().to("cpu", torch.float64)  # [depth, V']
        self.temperature, self.max_rank, self.scorer = temperature, max_rank, scorer
        self.probs: dict = {}
        self.cdf: dict = {}
        self.top_log: dict = {}

    def _row_logits(self, key) -> torch.Tensor:
        if self.scorer is None:
            return self.logits[key]
        depth, prev = key
        with torch.no_grad():
            return self.scorer.logits(depth, [prev])[0].double()  # [V'] base + the head's bias after `prev`

    def prob(self, key) -> np.ndarray:
        if key not in self.probs:
            q = torch.softmax(self._row_logits(key) / self.temperature, dim=-1)  # [V'] float64
            self.probs[key] = q.numpy()
            self.cdf[key] = np.cumsum(self.probs[key])
            top = torch.topk(q, min(self.max_rank, q.shape[0])).values.numpy()
            with np.errstate(divide="ignore"):
                self.top_log[key] = np.log(top[top > 0])  # [<= K] log-probs of the row's best ranks
        return self.probs[key]


class SampledTreePolicy(BlockPolicy):
    """Proposal policy: a tree of at most ``budget`` nodes whose children are sampled from the drafter.

    The children of a node at depth d are draws WITHOUT replacement from q_{d+1} = softmax(draft_logits[d] / T_draft)
    (``draft_temperature``; default: the decoding ``temperature``), each node with its own independent draws. The
    tree grows best-first: a candidate "next child of node u" is scored by u's sampled path log-probability plus the
    log-probability of the corresponding rank of q_{d+1} (the k-th child of u is scored with the k-th largest
    probability), and the best candidate is drawn and added until the budget is spent. The score of a candidate
    never looks at the token it will draw, only at earlier draws: that is what keeps the verification exact (see
    :class:`RecursiveRejection`). Draws use a numpy generator seeded with ``seed``, so trees are reproducible.

    A drafter with a Markov head (the block's ``scorer``): the children of a node u at depth d carrying token t are
    drawn from u's own conditioned distribution q(. | t) = softmax((base[d] + bias(t)) / T_draft) (the root's
    children after the root token), and the k-th child of u is scored with the k-th largest probability of that row.
    The row depends on t, which was drawn before any child of u, so the shape still never looks at a child's own
    value, and the tree records for each node the very row its children came from: the rule at that node runs with
    exactly that q, which is all its proof asks for (the rule is per node; nothing assumes siblings of different
    parents share a proposal). Without a head the draws, the random stream and the tree are the same as before.

    A node's own row costs a head product, so with a head a new node's first child enters the heap ranked by an
    upper bound, the node's own path log-probability (its child's is that plus a log-probability <= 0), and the row
    is computed only when that entry reaches the top; then the child is re-ranked exactly. Candidates are therefore
    drawn in the same order as if every row were computed at once (a bound above the exact rank surfaces no later),
    and a node whose children could never be drawn within the budget never costs a product.

    A block over a draft vocabulary (``block.token_map``, the drafter's ``draft_vocab``): columns are draft indices
    and sampled tokens are mapped to target ids. ``rule`` is the verification rule the trees carry.
    """

    uses_draft = True

    def __init__(self, budget: int, temperature: float = 1.0, seed: int = 0, draft_temperature: float | None = None,
                 rule: RecursiveRejection | None = None) -> None:
        if isinstance(budget, bool) or not isinstance(budget, numbers.Integral) or budget < 0:
            raise ValueError(f"a sampled tree needs an int budget >= 0, got {budget!r}")
        draft_temperature = temperature if draft_temperature is None else draft_temperature
        if not draft_temperature > 0:
            raise ValueError(f"a sampled tree needs a draft temperature > 0, got {draft_temperature!r} "
                             "(at T = 0 use the deterministic top-K tree)")
        self.budget, self.draft_temperature = int(budget), float(draft_temperature)
        self.rule = rule or RecursiveRejection()
        self.rng = np.random.default_rng(seed)
        self.name = f"sampled-{budget}"

    def draw_child(self, rows: _Rows, row: int, taken: list[int]) -> int | None:
        """One more draw without replacement from proposal ``row``, given the tokens already drawn for this node
        (draft indices); None when the row's support is used up.

        Draws from q are redrawn while they hit a taken token (exactly q restricted to the rest, renormalised); after
        ``REDRAWS`` misses the restricted distribution is built and sampled directly.
        """
        probs, cdf = rows.prob(row), rows.cdf[row]
        for _ in range(REDRAWS if taken else 1):
            token = min(int(np.searchsorted(cdf, self.rng.random() * cdf[-1], side="right")), len(cdf) - 1)
            if token not in taken and probs[token] > 0:
                return token
        rest = probs.copy()
        rest[taken] = 0.0
        rest_cdf = np.cumsum(rest)
        if not rest_cdf[-1] > 0:
            return None
        token = int(np.searchsorted(rest_cdf, self.rng.random() * rest_cdf[-1], side="right"))
        if token >= len(rest) or rest[token] <= 0:  # u rounded up to the total: the last token still allowed
            token = int(np.flatnonzero(rest)[-1])
        return token

    def propose(self, block: DraftBlock, history: list[int]) -> SampledDraftTree:
        """A SampledDraftTree of <= budget nodes from the round's :class:`DraftBlock`. With the block's Markov scorer
        each node's children are drawn from that node's own conditioned distribution, and the tree records that row
        for verification."""
        draft_logits, scorer, root = block.logits, block.scorer, block.root
        depth, width = draft_logits.shape
        token_map = None if block.token_map is None else block.token_map.to(torch.int64).cpu()
        mapped = token_map is not None and width == token_map.shape[0]
        if self.budget == 0 or depth == 0:
            return SampledDraftTree.empty()
        rows = _Rows(draft_logits, self.draft_temperature, self.budget, scorer)
        tokens: list[int] = []  # draft indices
        parents: list[int] = []
        depths: list[int] = []
        scores: list[float] = []
        taken: dict[int, list[int]] = {ROOT: []}

        target_of = token_map.tolist() if mapped and scorer is not None else None

        def key(node: int):
            """The row the children of ``node`` are drawn from (see :class:`_Rows`)."""
            if scorer is None:
                return 0 if node == ROOT else depths[node]  # children of a depth-d node come from row d
            if node == ROOT:
                return 1, int(root)
            return depths[node] + 1, target_of[tokens[node]] if mapped else tokens[node]

        first = key(ROOT)
        if not np.isfinite(rows.prob(first)).all() or rows.top_log[first].size == 0:
            raise ValueError("draft_logits row 0 has no finite probabilities (NaN or +/-inf logits, or a row of -inf; "
                             "with a Markov head: after its bias for the root): cannot sample the root's children")
        # heap of "the next child of a node": (-priority, tie order, parent node, rank of that child)
        heap = [(-float(rows.top_log[first][0]), 0, ROOT, 0)]
        pushes = 1
        while heap and len(tokens) < self.budget:
            _, _, parent, rank = heapq.heappop(heap)
            if rank < 0:  # a node's first child, until now ranked by its upper bound (see below): score it
                below = key(parent)
                rows.prob(below)
                if len(rows.top_log[below]):
                    heapq.heappush(heap, (-(scores[parent] + float(rows.top_log[below][0])), pushes, parent, 0))
                    pushes += 1
                continue
            row = key(parent)
            token = self.draw_child(rows, row, taken[parent])
            if token is None:
                continue
            node = len(tokens)
            base = 0.0 if parent == ROOT else scores[parent]
            tokens.append(token)
            parents.append(parent)
            depths.append(1 if parent == ROOT else depths[parent] + 1)
            scores.append(base + math.log(rows.probs[row][token]))
            taken[parent].append(token)
            taken[node] = []
            if rank + 1 < len(rows.top_log[row]):  # its next sibling
                heapq.heappush(heap, (-(base + float(rows.top_log[row][rank + 1])), pushes, parent, rank + 1))
                pushes += 1
            if depths[node] < depth and scorer is not None:  # its first child, ranked by an upper bound for now
                heapq.heappush(heap, (-scores[node], pushes, node, -1))
                pushes += 1
            elif depths[node] < depth:  # its first child: scored from its row
                below = key(node)
                rows.prob(below)
                if len(rows.top_log[below]):
                    heapq.heappush(heap, (-(scores[node] + float(rows.top_log[below][0])), pushes, node, 0))
                    pushes += 1
        return self._tree(tokens, parents, depths, scores, rows, key, token_map if mapped else None)

    def _tree(self, tokens: list[int], parents: list[int], depths: list[int], scores: list[float], rows: _Rows,
              key, token_map: torch.Tensor | None) -> SampledDraftTree:
        """Pack the drawn nodes with one proposal row per distinct row their parents drew from, in the order the
        nodes first used it (without a scorer: rows 0..max depth - 1, row d for the children of depth d)."""
        has_children = torch.zeros(len(tokens) + 1, dtype=torch.bool)
        has_children[torch.tensor(parents, dtype=torch.int64) + 1] = True
        order: dict = {}
        proposal_rows = torch.full((len(tokens) + 1,), -1, dtype=torch.int64)  # [n+1] root first
        for node in range(-1, len(tokens)):
            if has_children[node + 1]:
                proposal_rows[node + 1] = order.setdefault(key(node), len(order))
        width = rows.logits.shape[1]
        proposals = torch.from_numpy(np.stack([rows.prob(k) for k in order])) if order else \
            torch.zeros(0, width, dtype=torch.float64)  # [R, V']
        ids = torch.tensor(tokens, dtype=torch.int64)
        return SampledDraftTree(
            ids if token_map is None else token_map[ids], torch.tensor(parents, dtype=torch.int64),
            torch.tensor(depths, dtype=torch.int64), torch.tensor(scores, dtype=torch.float64),
            proposals=proposals, proposal_rows=proposal_rows, token_map=token_map, rule=self.rule)


def sample_tree(draft_logits: torch.Tensor, budget: int, temperature: float = 1.0, seed: int = 0,
                token_map: torch.Tensor | None = None) -> SampledDraftTree:
    """One sampled tree (see :class:`SampledTreePolicy`) from draft logits [depth, V'] (row d-1 drafting depth d;
    ``token_map``: the target id of each column of logits over a draft vocabulary): the counterpart of
    :func:`ddtree.build_tree` at T > 0."""
    block = DraftBlock(draft_logits, token_map, ROOT, int(draft_logits.shape[-1]) if token_map is None else -1)
    return SampledTreePolicy(budget, temperature, seed=seed).propose(block, [])
