"""DraftTree: the one proposal type of the toolkit (DFlash's chain, DDTree's trees, lookup continuations).

A draft tree is a set of draft-token prefixes hanging below a *root*: the last committed token, which is not a node
itself. A tree stores exactly four per-node arrays and derives everything else (visibility mask, children, Medusa
paths) from them, so there is one source of truth:

    token_ids  [n] int64    draft token of each node
    parents    [n] int64    index of the parent node; -1 (``ROOT``) for children of the root; parents[i] < i
    depths     [n] int64    1-based depth; depth d was drawn from row d-1 of the draft logits
    log_probs  [n] float    path log-probability under the draft's factorized distribution (NaN: unknown)

Nodes are stored best first (``log_probs`` non-increasing), which is the order ``ddtree.build.build_tree`` produces.
Because parents come first, per-node quantities can be computed level by level with a handful of tensor operations.
A chain (node i the child of node i-1) is verified under the plain causal mask: :attr:`DraftTree.is_chain`.

The policy contract lives here too, since a policy's one job is to make a tree: each round the loop hands a
:class:`BlockPolicy` the drafter's :class:`DraftBlock` and gets a :class:`DraftTree` back (:class:`NoDraft` and
:class:`Chain` are the two built into the loop: plain decoding and DFlash).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from functools import cached_property

import torch

ROOT = -1  # parent index of the root's children, and the node index that stands for the root in lookups


def child_index(parents: torch.Tensor, token_ids: torch.Tensor) -> dict[tuple[int, int], int]:
    """{(parent node, token): child node} (the root is ``ROOT``): the one child lookup, used by the walk that
    follows the target's choices down a tree and by :meth:`DraftTree.child_with_token`."""
    return {(parent, token): node for node, (parent, token) in enumerate(zip(parents.tolist(), token_ids.tolist()))}


@dataclass(frozen=True, eq=False, repr=False)
class DraftTree:
    """A draft tree in best-first node order (see the module docstring for the four fields).

    The dataclass is frozen and compares by identity; use :meth:`equals` for an exact comparison of contents.
    Construction only checks shapes and dtypes (cheap); :meth:`validate` checks every structural invariant.
    """

    token_ids: torch.Tensor  # [n] int64
    parents: torch.Tensor  # [n] int64, -1 for children of the root
    depths: torch.Tensor  # [n] int64, 1-based
    log_probs: torch.Tensor  # [n] float32 or float64, non-increasing

    def __post_init__(self) -> None:
        fields = {"token_ids": self.token_ids, "parents": self.parents, "depths": self.depths,
                  "log_probs": self.log_probs}
        for name, value in fields.items():
            if not isinstance(value, torch.Tensor):
                raise TypeError(f"DraftTree.{name} must be a torch.Tensor, got {type(value).__name__}")
            if value.dim() != 1:
                raise ValueError(f"DraftTree.{name} must be 1-D, got shape {tuple(value.shape)}")
        lengths = {name: value.shape[0] for name, value in fields.items()}
        if len(set(lengths.values())) != 1:
            raise ValueError(f"DraftTree fields must have equal lengths, got {lengths}")
        for name in ("token_ids", "parents", "depths"):
            if fields[name].dtype != torch.int64:
                raise TypeError(f"DraftTree.{name} must be int64, got {fields[name].dtype}")
        if not self.log_probs.is_floating_point():
            raise TypeError(f"DraftTree.log_probs must be a float tensor, got {self.log_probs.dtype}")

    # ------------------------------------------------------------------ constructors

    @classmethod
    def empty(cls) -> DraftTree:
        """The tree without nodes (budget 0): verification then only yields the target's own next token."""
        no_ids = torch.zeros(0, dtype=torch.int64)
        return cls(no_ids, no_ids.clone(), no_ids.clone(), torch.zeros(0, dtype=torch.float64))

    @classmethod
    def chain(cls, token_ids: Sequence[int] | torch.Tensor,
              token_log_probs: Sequence[float] | torch.Tensor | None = None) -> DraftTree:
        """A tree without branches (what DFlash drafts): node i is the child of node i-1.

        ``token_log_probs`` are the per-position log-probabilities of the tokens; the stored path log-probabilities
        are their running sums. Without them the log-probabilities are NaN (unknown; ``expected_acceptance`` NaN).
        """
        ids = torch.as_tensor(token_ids, dtype=torch.int64).reshape(-1).cpu()
        n = ids.shape[0]
        if token_log_probs is None:
            path_log_probs = torch.full((n,), math.nan, dtype=torch.float64)
        else:
            step = torch.as_tensor(token_log_probs, dtype=torch.float64).reshape(-1).cpu()
            if step.shape[0] != n:
                raise ValueError(f"chain: {n} tokens but {step.shape[0]} log-probabilities")
            path_log_probs = torch.cumsum(step, 0)
        return cls(ids, torch.arange(n, dtype=torch.int64) - 1, torch.arange(1, n + 1, dtype=torch.int64),
                   path_log_probs)

    @classmethod
    def from_nodes(cls, token_ids: Sequence[int] | torch.Tensor, parents: Sequence[int] | torch.Tensor,
                   log_probs: Sequence[float] | torch.Tensor | None = None, sort: bool = True) -> DraftTree:
        """A tree from nodes in any order: ``parents[i]`` is the index (in the given order) of node i's parent, -1
        for the root's children; depths follow from the parents. ``log_probs`` (path log-probabilities) are
        optional (NaN: unknown). With ``sort`` the nodes are reordered best first (log-probability descending, then
        depth, then given order) with every node after its ancestors, and the parent indices remapped: what the
        loop and :meth:`validate` expect. Raises ValueError for a parent index out of range or a cycle."""
        ids = torch.as_tensor(token_ids, dtype=torch.int64).reshape(-1).cpu()
        par = torch.as_tensor(parents, dtype=torch.int64).reshape(-1).cpu().tolist()
        n = len(par)
        lp = (torch.full((n,), math.nan, dtype=torch.float64) if log_probs is None
              else torch.as_tensor(log_probs, dtype=torch.float64).reshape(-1).cpu())
        if ids.shape[0] != n or lp.shape[0] != n:
            raise ValueError(f"from_nodes: {ids.shape[0]} tokens, {n} parents, {lp.shape[0]} log-probabilities")
        depth = [0] * n
        for i in range(n):  # walk up to a node of known depth; a walk longer than n has met a cycle
            chain, j = [], i
            while j != ROOT and depth[j] == 0:
                if not -1 <= par[j] < n or par[j] == j or len(chain) > n:
                    raise ValueError(f"from_nodes: node {j} has parent {par[j]} (an index in 0..{n - 1}, -1 = the "
                                     "root, and no cycles)")
                chain.append(j)
                j = par[j]
            for k in reversed(chain):
                depth[k] = 1 if par[k] == ROOT else depth[par[k]] + 1
        order = list(range(n))
        if sort:
            key = [(-lp[i].item() if not math.isnan(lp[i].item()) else 0.0, depth[i], i) for i in range(n)]
            placed, order = set(), []
            for i in sorted(range(n), key=key.__getitem__):  # each node after its ancestors
                pending = []
                while i != ROOT and i not in placed:
                    pending.append(i)
                    i = par[i]
                for k in reversed(pending):
                    placed.add(k)
                    order.append(k)
        where = {old: new for new, old in enumerate(order)}
        return cls(ids[order], torch.tensor([where.get(par[i], ROOT) for i in order], dtype=torch.int64),
                   torch.tensor([depth[i] for i in order], dtype=torch.int64), lp[order])

    def prefix(self, n: int) -> DraftTree:
        """The first ``n`` nodes: a valid tree (parents come first), in best-first order the best ``n``-node one."""
        return DraftTree(self.token_ids[:n], self.parents[:n], self.depths[:n], self.log_probs[:n])

    @classmethod
    def from_paths(cls, paths: Sequence[Sequence[int]],
                   token_ids: Sequence[int] | torch.Tensor | None = None,
                   log_probs: Sequence[float] | torch.Tensor | None = None) -> DraftTree:
        """Import Medusa / vLLM style paths, e.g. ``[(0,), (0, 0), (1,)]``.

        Each path lists child indices from the root: ``(0, 1)`` is the second child of the first child of the root.
        The paths must be prefix-closed (every proper prefix is listed), free of duplicates, and sibling indices must
        be contiguous from 0. ``token_ids`` / ``log_probs`` are given per path (same order as ``paths``); without
        them the token of a node is its child index (a placeholder to fill in later) and the log-probabilities are
        NaN (unknown: ``expected_acceptance`` is then NaN, not a number made up from zeros).

        Node order: the given order is kept when it lists parents before children and siblings in child-index order
        (``to_paths`` output always does, so ``from_paths(t.to_paths(), t.token_ids, t.log_probs)`` rebuilds ``t``);
        otherwise nodes are put in breadth-first order (by path length, then lexicographically). Either way the child
        index of a node equals its position among its siblings, the convention ``to_paths`` uses.
        """
        tuples = [tuple(int(step) for step in path) for path in paths]
        n = len(tuples)
        index_of: dict[tuple[int, ...], int] = {}
        for i, path in enumerate(tuples):
            if not path:
                raise ValueError(f"from_paths: path {i} is empty (the root is implicit and must not be listed)")
            if min(path) < 0:
                raise ValueError(f"from_paths: path {path} has a negative child index")
            if path in index_of:
                raise ValueError(f"from_paths: path {path} is listed twice")
            index_of[path] = i
        for path in tuples:
            if len(path) > 1 and path[:-1] not in index_of:
                raise ValueError(f"from_paths: path {path} is listed but its parent {path[:-1]} is not")
            if path[-1] > 0 and path[:-1] + (path[-1] - 1,) not in index_of:
                raise ValueError(f"from_paths: path {path} is listed but its previous sibling "
                                 f"{path[:-1] + (path[-1] - 1,)} is not (child indices must be contiguous from 0)")
        order = list(range(n))
        consistent = all(index_of.get(path[:-1], -1) < i and
                         (path[-1] == 0 or index_of[path[:-1] + (path[-1] - 1,)] < i) for i, path in enumerate(tuples))
        if not consistent:
            order.sort(key=lambda i: (len(tuples[i]), tuples[i]))
        position = {tuples[i]: pos for pos, i in enumerate(order)}
        parents = [position[tuples[i][:-1]] if len(tuples[i]) > 1 else ROOT for i in order]
        depths = [len(tuples[i]) for i in order]
        if token_ids is None:
            ids = [tuples[i][-1] for i in order]
        else:
            given_ids = torch.as_tensor(token_ids, dtype=torch.int64).reshape(-1).tolist()
            if len(given_ids) != n:
                raise ValueError(f"from_paths: {n} paths but {len(given_ids)} token ids")
            ids = [given_ids[i] for i in order]
        if log_probs is None:
            lps = torch.full((n,), math.nan, dtype=torch.float64)
        else:
            given_lps = torch.as_tensor(log_probs).reshape(-1).cpu()
            if given_lps.shape[0] != n:
                raise ValueError(f"from_paths: {n} paths but {given_lps.shape[0]} log-probabilities")
            if not given_lps.is_floating_point():
                given_lps = given_lps.to(torch.float64)
            lps = given_lps[torch.as_tensor(order, dtype=torch.int64)]
        return cls(torch.as_tensor(ids, dtype=torch.int64), torch.as_tensor(parents, dtype=torch.int64),
                   torch.as_tensor(depths, dtype=torch.int64), lps)

    # ------------------------------------------------------------------ derived quantities

    @property
    def num_nodes(self) -> int:
        return int(self.token_ids.shape[0])

    def __len__(self) -> int:
        return self.num_nodes

    @property
    def max_depth(self) -> int:
        """Depth of the deepest node (0 for the empty tree)."""
        return int(self.depths.max()) if self.num_nodes else 0

    @property
    def has_log_probs(self) -> bool:
        """False when the log-probabilities are unknown (NaN: a tree imported from paths, a lookup continuation)."""
        return not bool(torch.isnan(self.log_probs).any())

    @cached_property
    def is_chain(self) -> bool:
        """Node i is the child of node i-1 (or the tree is empty): the plain causal mask verifies it exactly."""
        return bool(torch.equal(self.parents.cpu(), torch.arange(-1, self.num_nodes - 1)))

    def expected_acceptance(self) -> float:
        """Expected tokens committed per round under the draft's factorized distribution (NaN when unknown).

        A node is accepted exactly when its whole path matches, so the expected number of accepted draft tokens is
        the sum of the nodes' path probabilities; the target's own bonus token adds 1.
        """
        return 1.0 + float(torch.exp(self.log_probs.to(torch.float64)).sum())

    def visibility(self) -> torch.Tensor:
        """[n+1, n+1] bool ancestor-or-self matrix; index 0 is the root, index i+1 is node i.

        ``vis[a, b]`` is True when b is a or one of a's ancestors: the attention mask of tree verification (each node
        attends to its root path only). Built level by level: a node's row is its parent's row plus itself, so the
        cost is one vectorized update per depth rather than a Python loop per node.
        """
        n = self.num_nodes
        rows = torch.eye(n + 1, dtype=torch.bool)  # [n+1, n+1]: everyone sees itself
        rows[:, 0] = True  # ... and the root
        depths = self.depths.cpu()
        parent_rows = self.parents.cpu() + 1  # [n]: row index of each node's parent (0 = root)
        for depth in range(2, self.max_depth + 1):  # depth-1 rows are already complete (root + self)
            at_depth = torch.nonzero(depths == depth).squeeze(1)  # [m] node indices
            rows[at_depth + 1] |= rows[parent_rows[at_depth]]
        return rows

    @cached_property
    def _child_lists(self) -> dict[int, list[int]]:
        table: dict[int, list[int]] = {ROOT: []}
        for node, parent in enumerate(self.parents.tolist()):
            table.setdefault(parent, []).append(node)
        return table

    @cached_property
    def _child_by_token(self) -> dict[tuple[int, int], int]:
        return child_index(self.parents, self.token_ids)

    def children(self, node: int) -> list[int]:
        """Indices of the children of ``node`` (``ROOT`` = -1 for the root), in node order = rank order."""
        if not ROOT <= node < self.num_nodes:
            raise IndexError(f"node {node} out of range for a tree of {self.num_nodes} nodes (use -1 for the root)")
        return list(self._child_lists.get(node, ()))

    def child_with_token(self, node: int, token: int) -> int | None:
        """The child of ``node`` (``ROOT`` = -1 for the root) that carries ``token``, or None: one step of the walk
        that follows the target's choices down the tree."""
        if not ROOT <= node < self.num_nodes:
            raise IndexError(f"node {node} out of range for a tree of {self.num_nodes} nodes (use -1 for the root)")
        return self._child_by_token.get((node, int(token)))

    def to_paths(self) -> list[tuple[int, ...]]:
        """Medusa / vLLM paths in node order: each node's child indices from the root.

        A node's child index is its position among its siblings in node order; in a best-first tree that is the rank
        of its token among the siblings' tokens. Example: ``[(0,), (0, 0), (1,)]``.
        """
        paths: list[tuple[int, ...]] = []
        child_count: dict[int, int] = {}
        for parent in self.parents.tolist():
            index = child_count.get(parent, 0)
            child_count[parent] = index + 1
            paths.append((paths[parent] if parent != ROOT else ()) + (index,))
        return paths

    # ------------------------------------------------------------------ checks

    def equals(self, other: DraftTree) -> bool:
        """Exact equality of the four fields (values and dtypes)."""
        return all(a.dtype == b.dtype and torch.equal(a.cpu(), b.cpu()) for a, b in (
            (self.token_ids, other.token_ids), (self.parents, other.parents), (self.depths, other.depths),
            (self.log_probs, other.log_probs)))

    def validate(self, best_first: bool = True, structure_only: bool = False) -> DraftTree:
        """Check every invariant and raise ValueError naming the first broken one; returns self.

        Layout: four 1-D CPU tensors of equal length, int64 except the float log-probs. Structure: parents come first
        (-1 <= parents[i] < i), depth = parent depth + 1 (1 below the root), token ids are non-negative and distinct
        among siblings (the walk down the tree needs an unambiguous child per token).
        Probabilities (unless all are unknown, NaN): no NaN, a child is never more probable than its parent (path
        probabilities only shrink), and with ``best_first`` the nodes are in non-increasing log-probability order.
        ``structure_only``: only what positions, masks and cache compaction rely on (layout, parents first, depths,
        ids >= 0): one pass over the nodes, which the decode loop makes every round.
        """
        try:  # shapes and dtypes, as at construction (tensors can be resized in place since)
            self.__post_init__()
        except TypeError as error:
            raise ValueError(str(error)) from error
        n = self.num_nodes
        for name in ("token_ids", "parents", "depths", "log_probs"):
            if getattr(self, name).device.type != "cpu":
                raise ValueError(f"DraftTree.{name} must live on the CPU, found {getattr(self, name).device}")
        if n == 0:
            return self
        parents, depths, tokens = self.parents.tolist(), self.depths.tolist(), self.token_ids.tolist()
        for i, (parent, depth, token) in enumerate(zip(parents, depths, tokens)):  # lists: cheap for every round
            if not ROOT <= parent < i:
                raise ValueError(f"node {i} has parent {parent}; parents must satisfy -1 <= parents[i] < i")
            above = depths[parent] if parent >= 0 else 0
            if depth != above + 1:
                raise ValueError(f"node {i} has depth {depth} but its parent {parent} has depth {above}; depth must "
                                 "be parent depth + 1")
            if token < 0:
                raise ValueError(f"node {i} has negative token id {token}")
        if structure_only:
            return self
        has_parent = self.parents >= 0
        pairs = torch.stack([self.parents, self.token_ids], dim=1)  # [n, 2] (parent, token)
        if torch.unique(pairs, dim=0).shape[0] != n:
            seen: dict[tuple[int, int], int] = {}
            for i, pair in enumerate(map(tuple, pairs.tolist())):
                if pair in seen:
                    raise ValueError(f"nodes {seen[pair]} and {i} are siblings (parent {pair[0]}) with the same "
                                     f"token {pair[1]}")
                seen[pair] = i
        lp = self.log_probs
        if bool(torch.isnan(lp).all()):  # unknown probabilities: only the structure can be checked
            return self
        if bool(torch.isnan(lp).any()):
            raise ValueError(f"log_probs contain NaN at node {int(torch.nonzero(torch.isnan(lp)).flatten()[0])}")
        bad = torch.nonzero(has_parent & (lp > lp[self.parents.clamp(min=0)])).flatten()
        if bad.numel():
            i = int(bad[0])
            raise ValueError(f"node {i} has log_prob {float(lp[i])} above its parent's "
                             f"{float(lp[int(self.parents[i])])}; path probabilities cannot grow")
        if best_first:
            bad = torch.nonzero(lp[1:] > lp[:-1]).flatten()
            if bad.numel():
                i = int(bad[0]) + 1
                raise ValueError(f"nodes are not best first: log_probs[{i}] = {float(lp[i])} > "
                                 f"log_probs[{i - 1}] = {float(lp[i - 1])}")
        return self

    def __repr__(self) -> str:
        if not self.num_nodes:
            return "DraftTree(num_nodes=0)"
        return (f"DraftTree(num_nodes={self.num_nodes}, max_depth={self.max_depth}, "
                f"expected_acceptance={self.expected_acceptance():.3f})")


# ---------------------------------------------------------------------------------------------------- the policy contract
@dataclass
class DraftBlock:
    """One round's drafter output, what a policy builds its tree from.

    ``logits`` [D, V'] float32, row d-1 = depth d, over the drafter's draft vocabulary: column j is target token
    ``token_map[j]`` (``token_map`` None: the whole target vocabulary, column j is token j). ``root``: the block's
    root (the last committed token). ``states`` [D, H]: the drafter's output states. ``scorer``: for a drafter with a
    Markov head, the conditional distribution of a node's children given that node's own token
    (:class:`~dflash_core.model.MarkovScorer`; None otherwise).
    """

    logits: torch.Tensor
    token_map: torch.Tensor | None
    root: int
    vocab_size: int
    states: torch.Tensor | None = None
    scorer: object | None = None
    _full: torch.Tensor | None = field(default=None, repr=False)

    @property
    def depth(self) -> int:
        return int(self.logits.shape[0])

    def full_logits(self) -> torch.Tensor:
        """[D, V] float32 over the target's whole vocabulary, -inf outside the draft vocabulary (computed once)."""
        if self.token_map is None:
            return self.logits
        if self._full is None:
            full = self.logits.new_full((self.depth, self.vocab_size), float("-inf"))
            self._full = full.index_copy_(-1, self.token_map.to(full.device), self.logits)
        return self._full

    def target_ids(self, columns: torch.Tensor) -> torch.Tensor:
        """Draft-vocabulary columns -> target token ids."""
        return columns if self.token_map is None else self.token_map.to(columns.device)[columns]


class BlockPolicy:
    """A proposal policy: each round it turns the :class:`DraftBlock` (None in a round without the drafter) and the
    history (prompt + every committed token, the root last) into a :class:`DraftTree`.

    ``uses_draft``: whether the policy reads the drafter (False: ``propose`` always gets ``block=None`` and the
    drafter never runs). ``proposes_chains``: whether every tree is a chain (verified under the causal mask, so any
    attention backend serves it). ``wants_draft(history)``: whether this round runs the drafter (a policy may skip
    it). ``observe(path)``: after each round, the indices of the accepted nodes that were committed. Whatever a valid
    tree holds, the output is the target's: the loop verifies it.
    """

    name: str = "policy"
    uses_draft: bool = True
    proposes_chains: bool = False

    def propose(self, block: DraftBlock | None, history: list[int]) -> DraftTree:
        raise NotImplementedError

    def observe(self, path: list[int]) -> None:
        """Called after each round with the indices of the accepted nodes that were committed."""

    def wants_draft(self, history: list[int]) -> bool:
        return self.uses_draft


class NoDraft(BlockPolicy):
    """Propose nothing: each round commits exactly the target's own next token (plain decoding)."""

    name, uses_draft, proposes_chains = "ar", False, True

    def propose(self, block: DraftBlock | None, history: list[int]) -> DraftTree:
        return DraftTree.empty()


class Chain(BlockPolicy):
    """DFlash: the drafter's top-1 token at every depth, as one branch. With a Markov head each depth is drafted
    after the token chosen at the depth above (the root for depth 1): the greedy chain of the conditioned drafter."""

    name, uses_draft, proposes_chains = "chain", True, True

    def propose(self, block: DraftBlock, history: list[int]) -> DraftTree:
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
