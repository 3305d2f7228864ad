"""DDTree best-first tree construction from one block of draft logits.

The drafter gives per-depth marginals q_d; DDTree treats them as independent, so the probability of a prefix is the
product of its tokens' marginals and the expected number of accepted draft tokens of a prefix-closed tree is the sum
of its nodes' path probabilities. The best tree with B nodes is therefore the set of the B most probable prefixes
(prefix-closed automatically: a prefix is never more probable than its parent or its better siblings). A node at depth
d with rank r among the tokens of row d needs its d-1 ancestors and r better siblings in the tree, so only ranks below
K = min(B, V) can ever appear.

``reference_build_tree`` is the textbook construction: full-vocabulary log-softmax, top-K per row, and a heap that pops
the best open prefix B times, pushing its next sibling and its first child. ``build_tree`` returns the identical tree
(same nodes, same order) much faster, in two stages that can be timed separately:

``top_candidates`` (on the logits' device): log-softmax, then only the few tokens per row that can matter. It takes
the maximum of every chunk of 64 tokens; each chunk maximum is a distinct token, so the B-th best among the prefixes
"chain of row maxima, then that token" is a lower bound tau on the score of the B-th best prefix. Any token of a tree
prefix at depth d therefore has a log-prob >= tau - (chain score above d), and only chunks whose maximum reaches that
cutoff are opened. One packed copy goes to the host.

``select_prefixes`` (host, numpy): enumerates, depth by depth, every prefix whose score reaches a bound tau (all
children of the kept prefixes of the previous depth, as one outer sum and one mask per depth), then keeps the B best in
the canonical order. It returns None if the candidate rows turn out too short for exactness (never seen in practice);
``build_tree`` then refetches complete top-K rows.

Scores and ties. A prefix's score is the float64 running sum of float32 log-probs along its path, added in the same
order by both builders, so both compute bit-identical scores. Nodes are ordered by (score descending, depth ascending,
rank path lexicographic); ranks within a row order tokens by (log-prob descending, token id ascending). The order is
total and puts every node after its parent and its better siblings, so truncating it at B always gives a valid tree,
and both builders agree even on exact ties (except where ``torch.topk`` breaks a tie at rank K differently).
"""

from __future__ import annotations

import heapq
import math
import numbers
from dataclasses import dataclass

import numpy as np
import torch

from ddtree.tree import ROOT, DraftTree

CHUNK = 64  # tokens per chunk whose maximum is taken on the device
MIN_CHUNKED_VOCAB = 16 * CHUNK  # below this the candidate search is not worth it: take complete top-K rows
COMPRESS_ABOVE = 1024  # outer sums larger than this expand only the parents that keep a child
ENUMERATION_CAP_PER_NODE = 64  # select_prefixes falls back to the heap if it would enumerate more than ~64 B prefixes


@dataclass(frozen=True)
class Candidates:
    """Per-depth candidate tokens on the host, best first, as flat row-major arrays.

    Row d (0-based; depth d+1) holds the tokens ``token_ids[row_start[d]:row_start[d+1]]``, sorted by (log-prob
    descending, token id ascending), so a token's position in its row is its rank; at most ``max_rank`` = min(B, V)
    tokens per row. ``cutoff[d]`` says what was left out: every token of row d that is missing has a log-prob strictly
    below it (-inf: the row holds the complete top ``max_rank``).
    """

    row_start: np.ndarray  # [depth + 1] int64 offsets into the flat arrays
    rows: np.ndarray  # [m] int64 row of each candidate (derived from row_start, kept for speed)
    token_ids: np.ndarray  # [m] int64
    log_probs: np.ndarray  # [m] float64 (exact float32 values)
    cutoff: np.ndarray  # [depth] float64
    max_rank: int  # K = min(budget, vocab)


@dataclass(frozen=True)
class SelectedNodes:
    """Nodes of the tree in best-first order, as numpy arrays (the fields of DraftTree)."""

    token_ids: np.ndarray  # [n] int64
    parents: np.ndarray  # [n] int64
    depths: np.ndarray  # [n] int64
    log_probs: np.ndarray  # [n] float64

    def to_tree(self) -> DraftTree:
        return DraftTree(torch.from_numpy(self.token_ids), torch.from_numpy(self.parents),
                         torch.from_numpy(self.depths), torch.from_numpy(self.log_probs))


# ---------------------------------------------------------------------------------------------- inputs


def _check_inputs(draft_logits: torch.Tensor, budget: int) -> tuple[int, int, int]:
    """Validate the arguments of the builders; returns (depth, vocab, budget as int)."""
    if not isinstance(draft_logits, torch.Tensor):
        raise TypeError(f"draft_logits must be a torch.Tensor, got {type(draft_logits).__name__}")
    if not draft_logits.is_floating_point():
        raise TypeError(f"draft_logits must be a float tensor, got dtype {draft_logits.dtype}")
    if draft_logits.dim() != 2:
        raise ValueError(f"draft_logits must have shape [depth, vocab], got shape {tuple(draft_logits.shape)}")
    if draft_logits.shape[1] == 0:
        raise ValueError("draft_logits has an empty vocabulary (shape [depth, 0])")
    if isinstance(budget, bool) or not isinstance(budget, numbers.Integral):
        raise TypeError(f"budget must be an int, got {type(budget).__name__}")
    if budget < 0:
        raise ValueError(f"budget must be >= 0, got {budget}")
    return int(draft_logits.shape[0]), int(draft_logits.shape[1]), int(budget)


def _check_row_maxima(row_max: np.ndarray) -> None:
    """Each row's best log-prob must be finite: NaN or +inf logits (or a row of -inf) make the draft meaningless."""
    bad = np.flatnonzero(~np.isfinite(row_max))
    if bad.size:
        raise ValueError(f"draft_logits row {int(bad[0])} has no finite log-probabilities (NaN or +/-inf logits); "
                         f"cannot rank its tokens")


def _log_softmax(draft_logits: torch.Tensor) -> torch.Tensor:
    """[depth, vocab] float32 log-probs; the same call in both builders, so both see bit-identical values."""
    return torch.log_softmax(draft_logits, dim=-1, dtype=torch.float32)


# ---------------------------------------------------------------------------------------------- reference


def _best_first_heap(values: list[list[float]], tokens: list[list[int]], budget: int) -> SelectedNodes:
    """Best-first construction with a heap over per-row rank lists (row d sorted best first, all ranks allowed).

    Each pop adds the best open prefix to the tree and opens its next sibling (same parent, rank + 1) and its first
    child (rank 0 one row down); both are no more probable than it, so pops come out best first. The heap key
    (-score, depth, rank path) is the builders' canonical total order.
    """
    out_tokens: list[int] = []
    out_parents: list[int] = []
    out_depths: list[int] = []
    out_scores: list[float] = []
    heap: list[tuple[float, int, tuple[int, ...], int]] = []
    if budget > 0 and values and values[0]:
        heap.append((-values[0][0], 1, (0,), ROOT))
    while heap and len(out_scores) < budget:
        neg_score, depth, ranks, parent = heapq.heappop(heap)
        node, rank, score = len(out_scores), ranks[-1], -neg_score
        out_tokens.append(tokens[depth - 1][rank])
        out_parents.append(parent)
        out_depths.append(depth)
        out_scores.append(score)
        row = values[depth - 1]
        if rank + 1 < len(row):
            parent_score = out_scores[parent] if parent != ROOT else 0.0
            heapq.heappush(heap, (-(parent_score + row[rank + 1]), depth, ranks[:-1] + (rank + 1,), parent))
        if depth < len(values) and values[depth]:
            heapq.heappush(heap, (-(score + values[depth][0]), depth + 1, ranks + (0,), node))
    return SelectedNodes(np.array(out_tokens, dtype=np.int64), np.array(out_parents, dtype=np.int64),
                         np.array(out_depths, dtype=np.int64), np.array(out_scores, dtype=np.float64))


def reference_build_tree(draft_logits: torch.Tensor, budget: int) -> DraftTree:
    """Plain DDTree construction: full-vocabulary log-softmax, top-K per row (K = min(budget, vocab)), heap loop.

    Readable and obviously right; the oracle for ``build_tree`` and the baseline of ``experiments.bench_tree``.
    """
    depth, vocab, budget = _check_inputs(draft_logits, budget)
    if budget == 0 or depth == 0:
        return DraftTree.empty()
    log_probs = _log_softmax(draft_logits)  # [depth, vocab]
    top_values, top_tokens = torch.topk(log_probs, min(budget, vocab), dim=-1)  # [depth, K] each
    top_values, top_tokens = top_values.double().cpu().numpy(), top_tokens.cpu().numpy()
    _check_row_maxima(top_values[:, 0])
    order = np.lexsort((top_tokens, -top_values), axis=-1)  # canonical ranks: log-prob desc, then token id asc
    top_values = np.take_along_axis(top_values, order, axis=-1)
    top_tokens = np.take_along_axis(top_tokens, order, axis=-1)
    return _best_first_heap(top_values.tolist(), top_tokens.tolist(), budget).to_tree()


# ---------------------------------------------------------------------------------------------- stage 1: candidates


def top_candidates(draft_logits: torch.Tensor, budget: int, complete: bool = False) -> Candidates:
    """Stage 1 of ``build_tree``: the tokens per row that the tree can use, copied once to the host.

    With ``complete`` (or a small vocabulary) every row holds its complete top K = min(budget, vocab) tokens;
    otherwise only the tokens that can reach the best-B prefixes (see the module docstring), usually a few per row.
    Requires budget >= 1 and depth >= 1.
    """
    depth, vocab = draft_logits.shape
    max_rank = min(budget, vocab)
    log_probs = _log_softmax(draft_logits)  # [depth, vocab]
    num_chunks = vocab // CHUNK
    if complete or vocab < MIN_CHUNKED_VOCAB or depth * num_chunks < budget:
        values, tokens = torch.topk(log_probs, max_rank, dim=-1)  # [depth, K] each
        rows = torch.arange(depth, device=values.device).repeat_interleave(max_rank)
        packed = torch.cat([values[:, 0].double(), torch.full((depth,), -math.inf, dtype=torch.float64,
                                                              device=values.device),
                            rows.double(), tokens.flatten().double(), values.flatten().double()])
        return _candidates_on_host(packed.cpu().numpy(), depth, max_rank)

    body = log_probs[:, :num_chunks * CHUNK].reshape(depth, num_chunks, CHUNK)  # [depth, G, CHUNK]
    tail = log_probs[:, num_chunks * CHUNK:]  # [depth, T], T < CHUNK
    chunk_max = body.amax(dim=-1)  # [depth, G]: each entry is the log-prob of a distinct token
    distinct = torch.cat([chunk_max, tail], dim=1) if tail.shape[1] else chunk_max  # [depth, G + T]
    row_max = distinct.amax(dim=-1)  # [depth]
    chain_above = torch.cumsum(row_max, 0) - row_max  # [depth]: score of the all-rank-0 prefix above each row
    family = (distinct + chain_above[:, None]).flatten()  # [depth * (G + T)] scores of "chain, then that token"
    bound = torch.kthvalue(family, family.numel() - budget + 1).values  # B-th best: <= score of the B-th best prefix
    bound_value = float(bound)  # the one scalar sync: decides whether the candidate search applies
    if not math.isfinite(bound_value):  # fewer than B finite-probability prefixes of that kind (or NaN logits)
        return top_candidates(draft_logits, budget, complete=True)
    # float32 rounding of chain_above is absorbed by the margin; exactness is re-checked on the host anyway
    cutoff = bound - 1e-3 * (1.0 + abs(bound_value)) - chain_above  # [depth] log-prob a token must reach in row d
    opened = torch.nonzero(chunk_max >= cutoff[:, None])  # [s, 2] (row, chunk) of the chunks worth opening
    blocks = body[opened[:, 0], opened[:, 1]]  # [s, CHUNK]
    hits = torch.nonzero(blocks >= cutoff[opened[:, 0], None])  # [h, 2] (block, offset)
    rows = opened[hits[:, 0], 0]  # [h]
    tokens = opened[hits[:, 0], 1] * CHUNK + hits[:, 1]  # [h]
    values = blocks[hits[:, 0], hits[:, 1]]  # [h]
    if tail.shape[1]:
        tail_hits = torch.nonzero(tail >= cutoff[:, None])  # [t, 2] (row, offset)
        rows = torch.cat([rows, tail_hits[:, 0]])
        tokens = torch.cat([tokens, num_chunks * CHUNK + tail_hits[:, 1]])
        values = torch.cat([values, tail[tail_hits[:, 0], tail_hits[:, 1]]])
    packed = torch.cat([row_max.double(), cutoff.double(), rows.double(), tokens.double(), values.double()])
    return _candidates_on_host(packed.cpu().numpy(), depth, max_rank)


def _candidates_on_host(packed: np.ndarray, depth: int, max_rank: int) -> Candidates:
    """Unpack [row_max | cutoff | rows | tokens | values], sort rows canonically and keep ranks < max_rank."""
    row_max, cutoff = packed[:depth], packed[depth:2 * depth].copy()
    _check_row_maxima(row_max)
    rows, tokens, values = packed[2 * depth:].reshape(3, -1)
    rows, tokens = rows.astype(np.int64), tokens.astype(np.int64)
    order = np.lexsort((tokens, -values, rows))  # by row, then log-prob descending, then token id
    rows, tokens, values = rows[order], tokens[order], values[order]
    counts = np.bincount(rows, minlength=depth)  # [depth]
    row_start = np.zeros(depth + 1, dtype=np.int64)
    np.cumsum(counts, out=row_start[1:])
    if counts.max(initial=0) > max_rank:  # ranks >= K can never be in the tree
        keep = np.arange(rows.size) - row_start[rows] < max_rank
        rows, tokens, values = rows[keep], tokens[keep], values[keep]
        np.cumsum(np.minimum(counts, max_rank), out=row_start[1:])
    cutoff[counts >= max_rank] = -math.inf  # these rows hold their complete top K
    return Candidates(row_start, rows, tokens, values, cutoff, max_rank)


# ---------------------------------------------------------------------------------------------- stage 2: selection


def select_prefixes(candidates: Candidates, budget: int) -> SelectedNodes | None:
    """Stage 2 of ``build_tree`` (its "pop loop"): the best ``budget`` prefixes over the candidate rows, best first.

    Returns None when the candidate rows are too short to prove the result exact (the caller then asks for complete
    rows). Scores are float64 running sums along the path, added in the same order as the reference heap.
    """
    row_start, values, tokens = candidates.row_start, candidates.log_probs, candidates.token_ids
    counts = np.diff(row_start)  # [depth]
    empty = np.flatnonzero(counts == 0)
    usable = int(empty[0]) if empty.size else counts.size  # rows below an empty row are unreachable
    if usable == 0:
        return None if candidates.cutoff[0] > -math.inf else _selected_empty()
    chain = np.cumsum(values[row_start[:usable]])  # [usable] score of the all-rank-0 prefix at each depth
    chain_above = np.zeros(usable + 1)  # [usable + 1] score of the all-rank-0 parent of row d (0 for row 0)
    chain_above[1:] = chain
    in_usable = row_start[usable]
    rows = candidates.rows[:in_usable]
    family = chain_above[rows] + values[:in_usable]  # [m] score of "chain above the row, then this token"
    # bound: the B-th best of these distinct prefixes is <= the B-th best prefix overall
    bound = np.partition(family, family.size - budget)[family.size - budget] if family.size >= budget else -math.inf
    kept_per_row = np.bincount(rows[family >= bound], minlength=usable)  # [usable] children of the chain parent

    # enumerate every prefix with score >= bound, depth by depth; prefixes of a depth stay in rank-path order
    scores = [values[: kept_per_row[0]]]  # per depth: [n_d] scores
    masks = [np.ones(kept_per_row[0], dtype=bool)]  # per depth: flattened [parents x k_d] mask of kept children
    widths = [int(kept_per_row[0])]  # per depth: k_d, children columns per parent
    parent_maps = []  # (depth index, rows of the previous depth that were expanded) where not all of them were
    total, tightened = int(kept_per_row[0]), False
    cap = ENUMERATION_CAP_PER_NODE * budget + 4096
    for row in range(1, usable):
        width = int(kept_per_row[row])
        if width == 0:
            break
        parents = scores[-1]  # [n_{d-1}]
        row_values = values[row_start[row]: row_start[row] + width]  # [k_d]
        if parents.size * width > COMPRESS_ABOVE:  # expand only the parents that keep at least one child
            expanded = np.flatnonzero(parents + row_values[0] >= bound)
            parent_maps.append((len(scores), expanded))
            parents = parents[expanded]
        children = np.add.outer(parents, row_values)  # [parents, k_d]
        keep = children >= bound
        scores.append(children[keep])
        masks.append(keep.ravel())
        widths.append(width)
        total += scores[-1].size
        if total > cap:  # a pathological draft; the heap is O(B log B) whatever the shape
            return _select_by_heap(candidates, budget)
        if not tightened and total >= budget and row + 1 < usable:
            # the prefixes found so far are distinct: the B-th best of them is a tighter bound for what follows
            tightened = True
            found = np.concatenate(scores)
            better = np.partition(found, total - budget)[total - budget]
            if better > bound:
                bound = better
                kept_per_row = np.bincount(rows[family >= bound], minlength=usable)
    levels = len(scores)

    # decode (depth, parent, rank) of every enumerated prefix, all depths at once
    per_level = np.array([s.size for s in scores])  # [levels]
    level = np.repeat(np.arange(levels), per_level)  # [N]
    mask_start = np.cumsum([0] + [m.size for m in masks[:-1]])  # [levels]
    flat = np.flatnonzero(np.concatenate(masks)) - mask_start[level]  # [N] position in the level's mask
    parent_in_level, rank = np.divmod(flat, np.array(widths)[level])  # [N] each
    first_node = np.cumsum(per_level) - per_level  # [levels] index of each level's first prefix
    for depth_index, expanded in parent_maps:
        at_level = slice(first_node[depth_index], first_node[depth_index] + per_level[depth_index])
        parent_in_level[at_level] = expanded[parent_in_level[at_level]]
    parent_offset = np.concatenate([[ROOT], first_node[:-1]])  # level 0: parent_in_level is 0 -> ROOT
    parent = parent_in_level + parent_offset[level]  # [N] index into the enumeration
    score = np.concatenate(scores)  # [N]

    # keep the best `budget` in canonical order: score desc; ties keep enumeration order = (depth, rank path)
    if score.size > budget:
        threshold = np.partition(score, score.size - budget)[score.size - budget]
        contenders = np.flatnonzero(score >= threshold)
        order = contenders[np.argsort(-score[contenders], kind="stable")[:budget]]
    else:
        order = np.argsort(-score, kind="stable")
    if not _rows_suffice(candidates, chain_above, levels, score[order], budget):
        return None
    position = np.full(score.size + 1, ROOT, dtype=np.int64)  # enumeration index -> output index; [-1] -> ROOT
    position[order] = np.arange(order.size)
    out_level = level[order]
    return SelectedNodes(tokens[row_start[out_level] + rank[order]], position[parent[order]], out_level + 1,
                         score[order])


def _rows_suffice(candidates: Candidates, chain_above: np.ndarray, levels: int, selected_scores: np.ndarray,
                  budget: int) -> bool:
    """Are the candidate rows long enough for the selection to be exact?

    A prefix through a token missing from row d scores at most (chain above d) + cutoff[d], so it cannot beat the
    worst selected node if that is lower. Rows below depth levels + 1 are unreachable: their parents scored too low.
    """
    checked = min(levels + 1, candidates.cutoff.size, chain_above.size)
    cutoff = candidates.cutoff[:checked]
    if not np.isfinite(cutoff).any():
        return True
    if selected_scores.size < budget:  # everything reachable was taken: only complete rows make that exact
        return False
    return bool(np.all(chain_above[:checked] + cutoff < selected_scores[-1]))


def _select_by_heap(candidates: Candidates, budget: int) -> SelectedNodes | None:
    """Fallback for drafts whose enumeration would explode (for example many -inf logits): the reference heap."""
    row_start, counts = candidates.row_start, np.diff(candidates.row_start)
    empty = np.flatnonzero(counts == 0)
    usable = int(empty[0]) if empty.size else counts.size
    values = [candidates.log_probs[row_start[d]: row_start[d + 1]].tolist() for d in range(usable)]
    tokens = [candidates.token_ids[row_start[d]: row_start[d + 1]].tolist() for d in range(usable)]
    selected = _best_first_heap(values, tokens, budget)
    chain_above = np.zeros(usable + 1)
    chain_above[1:] = np.cumsum([row[0] for row in values])
    levels = int(selected.depths.max(initial=0))
    if not _rows_suffice(candidates, chain_above, levels, selected.log_probs, budget):
        return None
    return selected


def _selected_empty() -> SelectedNodes:
    no_ids = np.zeros(0, dtype=np.int64)
    return SelectedNodes(no_ids, no_ids, no_ids, np.zeros(0, dtype=np.float64))


# ---------------------------------------------------------------------------------------------- entry point


def build_tree(draft_logits: torch.Tensor, budget: int) -> DraftTree:
    """The DDTree draft tree: the ``budget`` most probable prefixes under the draft's factorized distribution.

    Args:
        draft_logits: [depth, vocab] float tensor (any float dtype, CPU or CUDA); row d gives the draft's logits for
            the token at depth d+1 below the root. Log-probs are computed in float32.
        budget: maximum number of tree nodes, an int >= 0. The tree has min(budget, number of prefixes) nodes.

    Returns:
        A CPU DraftTree in best-first order, identical to ``reference_build_tree(draft_logits, budget)``.
    """
    depth, _, budget = _check_inputs(draft_logits, budget)
    if budget == 0 or depth == 0:
        return DraftTree.empty()
    selected = select_prefixes(top_candidates(draft_logits, budget), budget)
    if selected is None:  # candidate rows too short to be sure: redo with complete top-K rows
        selected = select_prefixes(top_candidates(draft_logits, budget, complete=True), budget)
    return selected.to_tree()
