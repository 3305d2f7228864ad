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
cutoff are opened. On the CPU this runs a block of rows at a time (a row's log-softmax does not depend on the other
rows: bit-identical values) and stops at the first row whose chain score is below tau, since every prefix through
it scores at most that chain (log-probs are <= 0): the log-softmax, most of the builder's time, skips that row and
all deeper ones (a flat draft's tree is only a few levels deep). On CUDA all rows go at once: one sync, one packed copy.

``select_prefixes`` (host, numpy; the "pop loop"): enumerates, depth by depth, every prefix whose score reaches a
bound tau (all children of the kept prefixes of the previous depth, as one outer sum and one mask per depth), then
keeps the B best in the canonical order; for small budgets it runs the heap on the candidate rows instead, which is
faster there. It returns None if the candidate rows turn out too short for exactness (never seen in
practice); ``build_tree`` then refetches complete top-K rows.

Scores and ties. A prefix's score is the float64 running sum of float32 log-probs along its path, added in the same
order by both builders, so both compute bit-identical scores. Ranks within a row order tokens by (log-prob
descending, token id ascending). Nodes are ordered by (score descending, depth ascending, rank path read from the
node up: its own rank first, then its parent's, and so on). The order is total and puts every node after its parent
(smaller depth) and after its better siblings (smaller own rank), so truncating it at B always gives a valid tree,
and both builders agree even on exact ties. (Reading the path from the node up is what the vectorized enumeration
produces for free: it lays out each depth rank by rank, every rank over all parents.)

## Trees for a drafter with a Markov head (each depth drafted after its parent's token)

A DFlash drafter with a Markov head (:mod:`dflash_core.model`) gives, for a node u at depth d carrying token t, its
children's distribution q(. | t) at depth d+1: the block's logits of that depth plus a bias from t. Under this model
the probability that the target accepts a node's whole path is the product of the conditional probabilities along
it, and the expected number of accepted draft tokens of a tree is the sum of its nodes' path probabilities, as for
DDTree's factorized drafter. Only now a node's children depend on which token it carries.

Why best-first with lazy expansion gives the best tree of B nodes. A path's value (the sum of its conditional
log-probabilities) never increases down the path (every term is <= 0), so the B most valuable paths are prefix-closed:
with ties broken by depth, a node's parent always ranks before it, and so does every better sibling. The builder
keeps a heap of open candidates: for each node already in the tree, its best child not yet taken, and the next
sibling of each taken node. Every path outside the tree has an ancestor-or-self whose candidate (the parent's next
untaken child, which is at least as good as it) sits in the heap, and that candidate's value is >= the path's value.
So each pop takes the best path not yet in the tree, and after B pops the tree holds the B best paths. A popped node's
children distribution is computed when it is popped ("lazy expansion": at most B distributions, each over the
draft vocabulary), and only its ``budget - size`` best children are kept (a child ranked lower can never be reached:
its better siblings alone would fill the budget).

``build_conditioned_tree(logits, budget, bias, root)`` takes the per-depth logits and a function giving a node's
bias; :func:`build_markov_tree` takes a round's :class:`~dflash_core.model.MarkovScorer`. Both return a
:class:`DraftTree` in best-first order (path log-probabilities non-increasing, parents before children). With a zero
bias the tree equals :func:`ddtree.build_tree`'s (same nodes; the order can differ only among exact ties).
"""

from __future__ import annotations

import dataclasses
import heapq
import math
import numbers
from dataclasses import dataclass
from typing import Callable

import numpy as np
import torch

from dflash_core.tree import ROOT, Chain, DraftBlock, DraftTree


CHUNK = 64  # tokens per chunk whose maximum is taken on the device
MIN_CHUNKED_VOCAB = 16 * CHUNK  # below this the candidate search is not worth it: take complete top-K rows
HEAP_BELOW_FIXED, HEAP_BELOW_PER_ROW = 30, 5  # select_prefixes runs the heap for budgets below 30 + 5 x rows
COMPRESS_ABOVE = 4096  # outer sums larger than this expand only the parents that keep a child
ENUMERATION_CAP_PER_NODE = 64  # select_prefixes falls back to the heap if it would enumerate more than ~64 B prefixes
ROW_BLOCK = 4  # CPU: rows of the first log-softmax block; later blocks 1 to 2 x ROW_BLOCK, predicted from the chain
OUTER_SUM_LIMIT = 1 << 24  # entries of one depth's outer sum (128 MiB of float64) above which the heap runs instead
# (a huge budget, say 10**6 over a 49K vocabulary, would ask for a [V, V] array; the heap grows with its nodes only)


@dataclass(frozen=True)
class CandidateRows:
    """Per-depth candidate tokens on the host, best first, as flat row-major arrays.

    Row d (0-based; depth d+1) holds the tokens ``token_ids[row_start[d]:row_start[d+1]]``, sorted by (log-prob
    descending, token id ascending), so a token's position in its row is its rank; at most ``max_rank`` = min(B, V)
    tokens per row. ``cutoff[d]`` says what was left out: every token of row d that is missing has a log-prob strictly
    below it (-inf: the row holds the complete top ``max_rank``), or at most it for a row never looked at (cutoff 0,
    as log-probs never exceed 0; the exactness checks compare strictly, which covers both).
    """

    row_start: np.ndarray  # [depth + 1] int64 offsets into the flat arrays
    rows: np.ndarray  # [m] int64 row of each candidate (derived from row_start, kept for speed)
    token_ids: np.ndarray  # [m] int64
    log_probs: np.ndarray  # [m] float64 (exact float32 values)
    cutoff: np.ndarray  # [depth] float64
    max_rank: int  # K = min(budget, vocab)
    reachable_rows: int  # rows before the first empty one (no prefix can pass an empty row)


@dataclass(frozen=True)
class SelectedNodes:
    """Nodes of the tree in best-first order, as numpy arrays (the fields of DraftTree)."""

    token_ids: np.ndarray  # [n] int64
    parents: np.ndarray  # [n] int64
    depths: np.ndarray  # [n] int64
    log_probs: np.ndarray  # [n] float64

    def to_tree(self, token_map: torch.Tensor | None = None) -> DraftTree:
        """The DraftTree; ``token_map`` ([V] column -> token id) turns logit columns into token ids."""
        tokens = torch.from_numpy(self.token_ids)
        if token_map is not None:
            tokens = token_map.cpu()[tokens]
        return DraftTree(tokens, torch.from_numpy(self.parents), torch.from_numpy(self.depths),
                         torch.from_numpy(self.log_probs))


# ---------------------------------------------------------------------------------------------- inputs


def _check_inputs(draft_logits: torch.Tensor, budget: int, token_map: torch.Tensor | None = None
                  ) -> tuple[int, int, int]:
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
    if token_map is not None and tuple(token_map.shape) != (draft_logits.shape[1],):
        raise ValueError(f"token_map must give one token id per logit column ({draft_logits.shape[1]}), got shape "
                         f"{tuple(token_map.shape)}")
    return int(draft_logits.shape[0]), int(draft_logits.shape[1]), int(budget)


def _check_row_maxima(row_max: np.ndarray, first_row: int = 0) -> None:
    """Each row's best log-prob must be finite: NaN or +inf logits (or a row of -inf) make the draft meaningless."""
    bad = np.flatnonzero(~np.isfinite(row_max))
    if bad.size:
        raise ValueError(f"draft_logits row {first_row + int(bad[0])} has no finite log-probabilities (NaN or +/-inf "
                         f"logits); cannot rank its tokens")


def _log_softmax(draft_logits: torch.Tensor) -> torch.Tensor:
    """[depth, vocab] float32 log-probs; the same call in both builders, so both see bit-identical values."""
    return torch.log_softmax(draft_logits, dim=-1, dtype=torch.float32)


def _top_k_rows(log_probs: torch.Tensor, k: int) -> tuple[np.ndarray, np.ndarray]:
    """[depth, k] float64 log-probs and int64 tokens of each row's top k, sorted by (log-prob desc, token id asc).

    ``torch.topk`` may pick any of the tokens tied at the k-th value. That choice only matters in row 0: a node at
    depth d with rank r needs d - 1 ancestors and r better siblings, so rank k - 1 = B - 1 is reachable at depth 1
    only. Row 0's boundary ties are therefore resolved toward the smallest token ids, making the result canonical.
    """
    values, tokens = torch.topk(log_probs, k, dim=-1)  # [depth, k] each
    values, tokens = values.double().cpu().numpy(), tokens.cpu().numpy()
    _check_row_maxima(values[:, 0])
    order = np.lexsort((tokens, -values), axis=-1)
    values, tokens = np.take_along_axis(values, order, axis=-1), np.take_along_axis(tokens, order, axis=-1)
    if k < log_probs.shape[1]:
        boundary = values[0, -1]
        tied = torch.nonzero(log_probs[0] == float(boundary)).flatten().cpu().numpy()  # ascending token ids
        above = int(np.count_nonzero(values[0] > boundary))
        tokens[0, above:] = tied[: k - above]
    return values, tokens


# ---------------------------------------------------------------------------------------------- reference


def _best_first_heap(values: list[list[float]], tokens: list[list[int]], budget: int) -> SelectedNodes:
    """Best-first construction with a heap over per-row rank lists (row d sorted best first, all ranks allowed).

    Each pop adds the best open prefix to the tree and opens its next sibling (same parent, rank + 1) and its first
    child (rank 0 one row down); both are no more probable than it, so pops come out best first. The heap key
    (-score, depth, rank path from the node up) is the builders' canonical total order.
    """
    out_tokens, out_parents, out_depths, out_scores = [], [], [], []  # the fields of the nodes popped so far
    heap: list[tuple[float, int, tuple[int, ...], int]] = []  # (-score, depth, ranks from the node up, parent)
    if budget > 0 and values and values[0]:
        heap.append((-values[0][0], 1, (0,), ROOT))
    while heap and len(out_scores) < budget:
        neg_score, depth, ranks, parent = heapq.heappop(heap)
        node, rank, score = len(out_scores), ranks[0], -neg_score
        out_tokens.append(tokens[depth - 1][rank])
        out_parents.append(parent)
        out_depths.append(depth)
        out_scores.append(score)
        row = values[depth - 1]
        if rank + 1 < len(row):
            parent_score = out_scores[parent] if parent != ROOT else 0.0
            heapq.heappush(heap, (-(parent_score + row[rank + 1]), depth, (rank + 1,) + ranks[1:], parent))
        if depth < len(values) and values[depth]:
            heapq.heappush(heap, (-(score + values[depth][0]), depth + 1, (0,) + ranks, node))
    return SelectedNodes(np.array(out_tokens, dtype=np.int64), np.array(out_parents, dtype=np.int64),
                         np.array(out_depths, dtype=np.int64), np.array(out_scores, dtype=np.float64))


def reference_build_tree(draft_logits: torch.Tensor, budget: int, token_map: torch.Tensor | None = None) -> DraftTree:
    """Plain DDTree construction: full-vocabulary log-softmax, top-K per row (K = min(budget, vocab)), heap loop.

    Readable and obviously right; the oracle for ``build_tree``.
    """
    depth, vocab, budget = _check_inputs(draft_logits, budget, token_map)
    if budget == 0 or depth == 0:
        return DraftTree.empty()
    log_probs = _log_softmax(draft_logits.detach())  # [depth, vocab]
    top_values, top_tokens = _top_k_rows(log_probs, min(budget, vocab))  # [depth, K] each, best first
    return _best_first_heap(top_values.tolist(), top_tokens.tolist(), budget).to_tree(token_map)


# ---------------------------------------------------------------------------------------------- stage 1: candidates


def top_candidates(draft_logits: torch.Tensor, budget: int, complete: bool = False) -> CandidateRows:
    """Stage 1 of ``build_tree``: the tokens per row that the tree can use, on the host.

    With ``complete`` (or a small vocabulary) every row holds its complete top K = min(budget, vocab) tokens;
    otherwise only the tokens that can reach the best-B prefixes (see the module docstring), usually a few per row:
    found by row blocks on the CPU, all rows at once on an accelerator. Requires budget >= 1 and depth >= 1.
    """
    draft_logits = draft_logits.detach()
    depth, vocab = draft_logits.shape
    max_rank = min(budget, vocab)
    num_chunks = vocab // CHUNK
    if not (complete or vocab < MIN_CHUNKED_VOCAB or depth * num_chunks < budget):
        if draft_logits.device.type == "cpu":
            found = _candidates_by_row_blocks(draft_logits, budget, max_rank)
        else:
            found = _candidates_on_device(_log_softmax(draft_logits), budget, max_rank)
        if found is not None:
            return found
    values, tokens = _top_k_rows(_log_softmax(draft_logits), max_rank)  # [depth, K] each, canonical
    rows = np.repeat(np.arange(depth), max_rank)
    return _sorted_candidates(rows, tokens.ravel(), values.ravel(), values[:, 0], np.full(depth, -math.inf), max_rank)


def _margin(bound: float) -> float:
    """Slack below a float32 bound that absorbs the rounding of float32 chain sums (exactness is re-checked)."""
    return 1e-3 * (1.0 + abs(bound))


def _candidates_by_row_blocks(draft_logits: torch.Tensor, budget: int, max_rank: int) -> CandidateRows | None:
    """CPU stage 1 by blocks of rows (module docstring): ROW_BLOCK rows first (more if needed for B entries), then as
    many as the chain, falling at its mean rate so far, needs to drop below tau (1 to 2 ROW_BLOCK). tau only grows as
    rows add prefixes, so entries below it never matter again: ``pool`` keeps the rest. Returns None when tau is not
    finite (fewer than B finite entries): the caller then takes complete rows."""
    depth, vocab = draft_logits.shape
    num_chunks, width = vocab // CHUNK, vocab // CHUNK * CHUNK
    log_probs = torch.empty(depth, vocab)  # rows [0, done) filled
    distinct = torch.empty(depth, num_chunks + vocab - width)  # [depth, G + T]: chunk maxima, then the tail tokens
    log_probs_host, distinct_host = log_probs.numpy(), distinct.numpy()
    chain, row_max = [0.0], []  # chain[d]: float64 score of the all-rank-0 prefix above row d (a running sum)
    pool, bound, done = np.zeros(0, dtype=np.float32), -math.inf, 0
    step = max(ROW_BLOCK, -(-budget // distinct.shape[1]))  # the first block alone holds >= B entries
    while done < depth and not chain[done] < bound - _margin(bound):
        stop = min(depth, done + step)
        torch.log_softmax(draft_logits[done:stop], dim=-1, dtype=torch.float32, out=log_probs[done:stop])
        torch.amax(log_probs[done:stop, :width].unflatten(1, (num_chunks, CHUNK)), dim=-1,
                   out=distinct[done:stop, :num_chunks])
        distinct_host[done:stop, num_chunks:] = log_probs_host[done:stop, width:]  # the tail (often empty)
        row_max += distinct_host[done:stop].max(axis=1).tolist()
        for row in range(done, stop):
            chain.append(chain[row] + row_max[row])
        if not math.isfinite(chain[stop]):
            _check_row_maxima(np.array(row_max[done:]), first_row=done)
        family = distinct_host[done:stop] + np.array(chain[done:stop], dtype=np.float32)[:, None]  # [rows, G + T]
        pool = np.concatenate((pool[pool >= bound], family[family >= bound])) if done else family.ravel()
        if pool.size >= budget:
            bound = float(torch.kthvalue(torch.from_numpy(pool), pool.size - budget + 1).values)
        rate = -chain[stop] / stop  # mean descent per row so far
        ahead = (chain[stop] - bound) / rate if rate > 0 and math.isfinite(bound) else math.inf  # rows to go
        done, step = stop, max(1, math.ceil(ahead)) if ahead < 2 * ROW_BLOCK else 2 * ROW_BLOCK
    if not math.isfinite(bound):
        return None
    if done < depth:  # rows never log-softmaxed must still be valid drafts, as the reference requires
        _check_row_maxima(draft_logits[done:].amax(dim=-1).float().numpy(), first_row=done)
    cutoff = (bound - _margin(bound) - np.array(chain[:done])).astype(np.float32)  # [done]
    body = log_probs[:done, :width].unflatten(1, (num_chunks, CHUNK))  # [done, G, CHUNK], a view
    found = _open_chunks_in_place(body, distinct[:done, num_chunks:], distinct[:done, :num_chunks],
                                  torch.tensor(row_max), torch.from_numpy(cutoff))
    return _candidates_from_chunks(*found, num_chunks, max_rank, depth)


def _candidates_on_device(log_probs: torch.Tensor, budget: int, max_rank: int) -> CandidateRows | None:
    """Accelerator stage 1: all rows at once, one scalar sync for tau, one packed copy of the opened chunks."""
    depth, vocab = log_probs.shape
    num_chunks = vocab // CHUNK
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
        return None
    cutoff = bound - _margin(bound_value) - chain_above  # [depth] log-prob a token must reach in row d
    found = _open_chunks_and_copy(body, tail, chunk_max, row_max, cutoff)
    return _candidates_from_chunks(*found, num_chunks, max_rank, depth)


def _open_chunks_in_place(body: torch.Tensor, tail: torch.Tensor, chunk_max: torch.Tensor, row_max: torch.Tensor,
                          cutoff: torch.Tensor) -> tuple[np.ndarray, ...]:
    """CPU: numpy reads the chunks whose maximum reaches the cutoff straight from the log-prob tensor (any strides)."""
    opened = np.flatnonzero(chunk_max.numpy() >= cutoff.numpy()[:, None])  # [s] flat (row, chunk) ids
    blocks = body.numpy()[np.divmod(opened, chunk_max.shape[1])]  # [s, CHUNK]
    return row_max.numpy(), cutoff.numpy(), opened, blocks, tail.numpy()


def _open_chunks_and_copy(body: torch.Tensor, tail: torch.Tensor, chunk_max: torch.Tensor, row_max: torch.Tensor,
                          cutoff: torch.Tensor) -> tuple[np.ndarray, ...]:
    """Accelerators: gather the opened chunks on the device, then ONE copy of [row_max | cutoff | chunk ids | tail |
    chunks] to the host (float32 holds chunk ids exactly); a few times B values, never the full logits."""
    depth = row_max.shape[0]
    opened = torch.nonzero((chunk_max >= cutoff[:, None]).flatten()).squeeze(1)  # [s]
    blocks = body.reshape(-1, CHUNK).index_select(0, opened)  # [s, CHUNK]
    host = torch.cat([row_max, cutoff, opened.float(), tail.flatten(), blocks.flatten()]).cpu().numpy()
    row_max_host, cutoff_host, opened_host, tail_host, blocks_host = np.split(
        host, np.cumsum([depth, depth, opened.shape[0], tail.numel()]))
    return (row_max_host, cutoff_host, opened_host.astype(np.int64), blocks_host.reshape(-1, CHUNK),
            tail_host.reshape(depth, -1))


def _candidates_from_chunks(row_max: np.ndarray, cutoff: np.ndarray, opened: np.ndarray, blocks: np.ndarray,
                            tail: np.ndarray, num_chunks: int, max_rank: int, depth: int) -> CandidateRows:
    """Keep the tokens of the opened chunks (and of the tail) that reach their row's cutoff; rows from
    ``cutoff.size`` to ``depth`` were never looked at and get cutoff 0 (log-probs never exceed 0)."""
    opened_rows = opened // num_chunks  # [s]
    hit = np.flatnonzero(blocks >= cutoff[opened_rows, None])  # [h] flat (block, offset)
    block, offset = np.divmod(hit, CHUNK)
    rows = opened_rows[block]
    tokens = (opened[block] - opened_rows[block] * num_chunks) * CHUNK + offset
    values = blocks.ravel()[hit]
    if tail.shape[1]:
        tail_hit = np.flatnonzero(tail >= cutoff[:, None])  # [t] flat (row, offset)
        tail_rows, tail_offset = np.divmod(tail_hit, tail.shape[1])
        rows = np.concatenate([rows, tail_rows])
        tokens = np.concatenate([tokens, num_chunks * CHUNK + tail_offset])
        values = np.concatenate([values, tail.ravel()[tail_hit]])
    # entries of a row arrive in token order (chunks, then the tail), so a stable sort keeps ties token-sorted
    cutoff = np.concatenate((cutoff.astype(np.float64), np.zeros(depth - cutoff.size)))
    return _sorted_candidates(rows, tokens, values, row_max, cutoff, max_rank, token_sorted=True)


def _sorted_candidates(rows: np.ndarray, tokens: np.ndarray, values: np.ndarray, row_max: np.ndarray,
                       cutoff: np.ndarray, max_rank: int, token_sorted: bool = False) -> CandidateRows:
    """Sort candidates by (row, log-prob desc, token id asc) and keep ranks < max_rank."""
    _check_row_maxima(row_max)
    depth = cutoff.size
    order = np.lexsort((-values, rows) if token_sorted else (tokens, -values, rows))
    rows, tokens, values = rows[order], tokens[order], values[order].astype(np.float64)
    counts = np.bincount(rows, minlength=depth)  # [depth]
    row_start = np.zeros(depth + 1, dtype=np.int64)
    np.cumsum(counts, out=row_start[1:])
    if counts.max(initial=0) > max_rank:  # ranks >= K can never be in the tree
        keep = np.arange(rows.size) - row_start[rows] < max_rank
        rows, tokens, values = rows[keep], tokens[keep], values[keep]
        np.cumsum(np.minimum(counts, max_rank), out=row_start[1:])
    cutoff = cutoff.copy()
    cutoff[counts >= max_rank] = -math.inf  # these rows hold their complete top K
    empty = np.flatnonzero(counts == 0)
    reachable_rows = int(empty[0]) if empty.size else depth
    return CandidateRows(row_start, rows, tokens, values, cutoff, max_rank, reachable_rows)


# ---------------------------------------------------------------------------------------------- stage 2: selection


def select_prefixes(candidates: CandidateRows, budget: int) -> SelectedNodes | None:
    """Stage 2 of ``build_tree`` (its "pop loop"): the best ``budget`` prefixes over the candidate rows, best first.

    The heap on the candidate rows costs a Python step per node, the depth-by-depth enumeration
    (``_select_by_levels``) a fixed overhead plus a few array operations per depth, so small budgets over many rows
    run the heap and the rest the enumeration. Both are exact and give the same canonical order. Returns
    None when the candidate rows are too short to prove the result exact (the caller then asks for complete rows).
    """
    if budget < HEAP_BELOW_FIXED + HEAP_BELOW_PER_ROW * candidates.reachable_rows:
        return _select_by_heap(candidates, budget)
    return _select_by_levels(candidates, budget)


def _select_by_levels(candidates: CandidateRows, budget: int) -> SelectedNodes | None:
    """Vectorized selection: enumerate every prefix scoring at least a lower bound on the B-th best score.

    One depth at a time: the children of all kept prefixes of the previous depth are one outer sum of the row's
    log-probs with their scores, and one comparison keeps those that reach the bound (rows are sorted, so each parent
    keeps a run of ranks). The B best enumerated prefixes, in canonical order, are the answer. Scores are float64
    running sums along the path, added in the same order as the reference heap.
    """
    row_start, values, tokens = candidates.row_start, candidates.log_probs, candidates.token_ids
    usable = candidates.reachable_rows
    if usable == 0:
        return None if candidates.cutoff[0] > -math.inf else _best_first_heap([], [], budget)  # no node
    chain_above = np.concatenate(([0.0], np.cumsum(values[row_start[:usable]])))  # [usable + 1] all-rank-0 scores
    in_usable = row_start[usable]
    rows = candidates.rows[:in_usable]
    family = chain_above[rows] + values[:in_usable]  # [m] score of "chain above the row, then this token"
    # these m prefixes are distinct, so the B-th best of them is <= the B-th best prefix overall
    bound = np.partition(family, family.size - budget)[family.size - budget] if family.size >= budget else -math.inf
    kept_per_row = np.bincount(rows[family >= bound], minlength=usable).tolist()  # children of the chain parent

    # depth by depth; a depth's prefixes are laid out rank by rank, each rank over all kept parents in their order
    starts = row_start.tolist()
    parents = values[: kept_per_row[0]]  # [n_d] scores of the kept prefixes of the current depth
    scores = [parents]  # per depth
    masks = [np.ones(parents.size, dtype=bool)]  # per depth: flattened [k_d, parents] mask of kept children
    layout = [(0, 1, ROOT, 0)]  # per depth: first mask position, parents (columns), previous first prefix, row start
    parent_maps = []  # (depth index, the parents that were expanded) where only some of them were
    total = mask_total = parents.size
    previous_first = 0
    cap = ENUMERATION_CAP_PER_NODE * budget + 4096
    for row in range(1, usable):
        width = kept_per_row[row]
        if width == 0:
            break
        row_values = values[starts[row]: starts[row] + width]  # [k_d]
        if parents.size * width > COMPRESS_ABOVE:  # expand only the parents that keep at least one child
            expanded = np.flatnonzero(parents + row_values[0] >= bound)
            parent_maps.append((len(scores), expanded))
            parents = parents[expanded]
        if parents.size * width > OUTER_SUM_LIMIT:
            return _select_by_heap(candidates, budget)
        layout.append((mask_total, parents.size, previous_first, starts[row]))
        previous_first = total
        children = row_values[:, None] + parents  # [k_d, parents]: a long inner axis is what numpy is fast at
        keep = children >= bound
        parents = children[keep]
        scores.append(parents)
        masks.append(keep.ravel())
        total += parents.size
        mask_total += keep.size
        if total > cap:  # a pathological draft; the heap is O(B log B) whatever the shape
            return _select_by_heap(candidates, budget)

    # the best `budget` in canonical order: score descending, ties in enumeration order (the canonical tie order)
    score = np.concatenate(scores)  # [N]
    if score.size <= 8 * budget:
        order = np.argsort(-score, kind="stable")[:budget]
    else:  # cut to the contenders first
        threshold = np.partition(score, score.size - budget)[score.size - budget]
        contenders = np.flatnonzero(score >= threshold)
        order = contenders[np.argsort(-score[contenders], kind="stable")[:budget]]
    worst = score[order[-1]] if order.size == budget else math.nan
    checked = min(len(scores) + 1, usable + 1, candidates.cutoff.size)
    reach = np.max(chain_above[:checked] + candidates.cutoff[:checked])  # best score through a missing token
    if not (reach == -math.inf or reach < worst):  # (NaN worst: fewer than B found, so rows must be complete)
        return None

    # decode depth, parent and rank of every enumerated prefix from the per-depth masks, then pick the chosen ones
    per_level = [s.size for s in scores]
    level = np.repeat(np.arange(len(scores)), per_level)  # [N] depth index
    mask_start, columns, previous_first, row_first = np.repeat(np.array(layout), per_level, axis=0).T  # [N] each
    rank, parent = np.divmod(np.flatnonzero(np.concatenate(masks)) - mask_start, columns)  # [N] each
    for level_index, expanded in parent_maps:  # those parents were numbered among the expanded ones only
        first = sum(per_level[:level_index])
        parent[first: first + per_level[level_index]] = expanded[parent[first: first + per_level[level_index]]]
    parent += previous_first  # [N] enumeration index of the parent; depth 0: 0 + ROOT
    position = np.full(score.size + 1, ROOT, dtype=np.int64)  # enumeration index -> output index; [-1] -> ROOT
    position[order] = np.arange(order.size)
    return SelectedNodes(tokens[row_first[order] + rank[order]], position[parent[order]], level[order] + 1,
                         score[order])


def _select_by_heap(candidates: CandidateRows, budget: int) -> SelectedNodes | None:
    """The reference heap on the candidate rows: for small budgets, and for drafts whose enumeration would explode
    (for example rows of -inf logits, where every zero-probability prefix ties)."""
    starts, usable = candidates.row_start.tolist(), candidates.reachable_rows
    all_values, all_tokens = candidates.log_probs.tolist(), candidates.token_ids.tolist()
    values = [all_values[starts[d]: starts[d + 1]] for d in range(usable)]
    tokens = [all_tokens[starts[d]: starts[d + 1]] for d in range(usable)]
    selected = _best_first_heap(values, tokens, budget)
    # exactness: no prefix through a missing token may beat the worst selected node (see _select_by_levels)
    chain_above, reach = 0.0, -math.inf
    for row in range(min(int(selected.depths.max(initial=0)) + 1, usable + 1, candidates.cutoff.size)):
        reach = max(reach, chain_above + candidates.cutoff[row])
        chain_above = chain_above + values[row][0] if row < usable else chain_above
    worst = selected.log_probs[-1] if selected.log_probs.size == budget else math.nan
    return selected if reach == -math.inf or reach < worst else None


# ---------------------------------------------------------------------------------------------- entry point


def build_tree(draft_logits: torch.Tensor, budget: int, token_map: torch.Tensor | None = None) -> DraftTree:
    """The DDTree draft tree: the ``budget`` most probable prefixes under the draft's factorized distribution.

    Args:
        draft_logits: [depth, vocab] float tensor (any float dtype, CPU or CUDA); row d gives the draft's logits for
            the token at depth d+1 below the root. Log-probs are computed in float32.
        budget: maximum number of tree nodes, an int >= 0. The tree has min(budget, number of prefixes) nodes.
        token_map: optional [vocab] int64 tensor, the token id of each logit column (compact logits over a
            drafter's reduced draft vocabulary); the tree's ``token_ids`` are then ``token_map[column]``. Ties
            between equal log-probs are broken by column, so the tree equals the one built from full-vocabulary
            logits (-inf outside the subset) up to the order of exactly tied tokens.

    Returns:
        A CPU DraftTree in best-first order, identical to ``reference_build_tree(draft_logits, budget)``.
    """
    depth, _, budget = _check_inputs(draft_logits, budget, token_map)
    if budget == 0 or depth == 0:
        return DraftTree.empty()
    draft_logits = draft_logits.detach()
    selected = select_prefixes(top_candidates(draft_logits, budget), budget)
    if selected is None:  # candidate rows too short to be sure: redo with complete top-K rows
        selected = select_prefixes(top_candidates(draft_logits, budget, complete=True), budget)
    return selected.to_tree(token_map)


def best_tree(block: DraftBlock, budget: int, chain: bool = False) -> DraftTree:
    """The best tree of at most ``budget`` nodes from a round's drafter ``block``: for a drafter with a Markov head
    (``block.scorer``) the conditioned one, each node's children drawn from the distribution given its own token
    (:func:`build_markov_tree`), else the factorized one (:func:`build_tree`). ``chain``: the
    drafter's top-1 chain of at most ``budget`` tokens instead (DFlash's block, conditioned too with a head)."""
    if chain:
        return Chain().propose(dataclasses.replace(block, logits=block.logits[:budget], _full=None), [block.root])
    if block.scorer is not None:
        return build_markov_tree(block.scorer, budget, block.root, block.token_map)
    return build_tree(block.logits, budget, token_map=block.token_map)


# ---------------------------------------------------------------------------------------------------- Markov-head trees
# expand(depth, parent_token, k) -> (log-probs [<= k] float64, descending; their target token ids [<= k] int64)
Expander = Callable[[int, int, int], tuple[np.ndarray, np.ndarray]]


def top_children(row: np.ndarray, k: int, token_map: np.ndarray | None) -> tuple[np.ndarray, np.ndarray]:
    """The ``k`` best columns of a log-prob row, best first (ties: lower column first), as (log-probs, token ids);
    columns at -inf (outside the draft vocabulary) are dropped."""
    k = min(k, row.shape[0])
    cols = np.argpartition(-row, k - 1)[:k] if k < row.shape[0] else np.arange(row.shape[0])
    cols = cols[np.lexsort((cols, -row[cols]))]
    cols = cols[np.isfinite(row[cols])]
    return row[cols].astype(np.float64), (cols if token_map is None else token_map[cols])


def best_first_conditioned(expand: Expander, max_depth: int, budget: int, root: int) -> DraftTree:
    """The best tree of at most ``budget`` nodes and depth ``max_depth`` under a conditioned drafter (see the module
    docstring); ``expand(depth, parent_token, k)`` gives the k best children of a node carrying ``parent_token``
    (the root for depth 1)."""
    if budget <= 0 or max_depth <= 0:
        return DraftTree.empty()
    tokens: list[int] = []
    parents: list[int] = []
    depths: list[int] = []
    scores: list[float] = []
    kids = {ROOT: expand(1, root, budget)}
    heap: list[tuple[float, int, int, int, int]] = []  # (-value, depth, counter, parent, rank among its children)
    if len(kids[ROOT][0]):
        heap.append((-float(kids[ROOT][0][0]), 1, 0, ROOT, 0))
    counter = 1
    while heap and len(tokens) < budget:
        neg, depth, _, parent, rank = heapq.heappop(heap)
        log_probs, ids = kids[parent]
        node = len(tokens)
        tokens.append(int(ids[rank]))
        parents.append(parent)
        depths.append(depth)
        scores.append(-neg)
        above = scores[parent] if parent != ROOT else 0.0
        if rank + 1 < len(log_probs):  # the next sibling
            heapq.heappush(heap, (-(above + float(log_probs[rank + 1])), depth, counter, parent, rank + 1))
            counter += 1
        if depth < max_depth and len(tokens) < budget:  # the node's own best child
            kids[node] = expand(depth + 1, tokens[node], budget - len(tokens))
            if len(kids[node][0]):
                heapq.heappush(heap, (neg - float(kids[node][0][0]), depth + 1, counter, node, 0))
                counter += 1
    return DraftTree(torch.tensor(tokens, dtype=torch.int64), torch.tensor(parents, dtype=torch.int64),
                     torch.tensor(depths, dtype=torch.int64), torch.tensor(scores, dtype=torch.float64))


def _log_softmax_np(x: np.ndarray) -> np.ndarray:
    x = x - x.max(axis=-1, keepdims=True)
    return x - np.log(np.exp(x).sum(axis=-1, keepdims=True))


def build_conditioned_tree(logits: torch.Tensor, budget: int, bias: Callable[[int, int], object], root: int,
                           token_map: torch.Tensor | None = None) -> DraftTree:
    """The best ``budget``-node tree when depth d's distribution is ``softmax(logits[d-1] + bias(d, parent_token))``.

    ``logits`` [D, V'] (row d-1 = depth d; over the target vocabulary, or over a draft vocabulary whose column j is
    target token ``token_map[j]``); ``bias(depth, parent_token)`` returns a [V'] array or tensor for the children of
    a node carrying ``parent_token`` (a target id; the root ``root`` for depth 1).
    """
    base = logits.detach().float().cpu().numpy()
    ids = None if token_map is None else token_map.detach().cpu().numpy().astype(np.int64)

    def expand(depth: int, parent_token: int, k: int):
        b = bias(depth, parent_token)
        b = b.detach().float().cpu().numpy() if isinstance(b, torch.Tensor) else np.asarray(b, dtype=np.float32)
        return top_children(_log_softmax_np(base[depth - 1] + b), k, ids)

    return best_first_conditioned(expand, base.shape[0], int(budget), int(root))


PREFETCH_BELOW = 8  # budgets from here on batch the likely parents' children up front (MarkovScorer.prefetch)
PREFETCH_WIDTH = 1  # the guess: children of each depth's most likely token under the unconditioned logits,
PREFETCH_FLOOR = -8.0  # down to where that chain's log-probability falls below this (MarkovScorer.likely_parents)
WAVE = 8  # unknown distributions gathered per batched product


class _ResumableBuild:
    """The state of a best-first build over draft columns, resumable: nodes so far, the children rows of the nodes
    that have them, and the heap of open children (the next untaken child of a node: -value, depth, counter, parent,
    rank). ``grow`` pops best-first; ``fork`` copies the state for a look-ahead (rows are shared, never written).
    ``need``: how many children a known row must hold to be used (min(budget, draft vocabulary)); a shorter one,
    left by an earlier, smaller build of the round, counts as unknown, so it is computed again."""

    def __init__(self, root_row, budget: int, max_depth: int, need: int) -> None:
        self.tokens: list[int] = []
        self.parents: list[int] = []
        self.depths: list[int] = []
        self.scores: list[float] = []
        self.kids = {ROOT: root_row}
        self.heap = [(-float(root_row[0][0]), 1, 0, ROOT, 0)] if len(root_row[0]) and root_row[0][0] > -np.inf \
            else []
        self.counter, self.budget, self.max_depth, self.need = 1, budget, max_depth, need

    def fork(self) -> _ResumableBuild:
        other = object.__new__(_ResumableBuild)
        other.__dict__.update(self.__dict__)
        for name in ("tokens", "parents", "depths", "scores", "heap"):
            setattr(other, name, list(getattr(self, name)))
        other.kids = dict(self.kids)
        return other

    def grow(self, known: dict, wanted: list | None = None, wave: int = 0):
        """Pop best-first until the budget is spent. Exact (``wanted`` None): stop BEFORE taking a node whose
        children are not in ``known`` and return its key (depth, column). Look-ahead: take such a node as childless,
        note its key in ``wanted`` and stop at the ``wave``-th."""
        heap, kids, tokens, scores = self.heap, self.kids, self.tokens, self.scores
        while heap and len(tokens) < self.budget:
            neg, depth, _, parent, rank = heap[0]
            log_probs, columns = kids[parent]
            column = int(columns[rank])
            row = None
            if depth < self.max_depth and len(tokens) + 1 < self.budget:  # the node will want its children
                row = known.get((depth + 1, column))
                if row is None or len(row[0]) < self.need:
                    row = None
                    if wanted is None:
                        return depth + 1, column
                    wanted.append((depth + 1, column))
                    if len(wanted) >= wave:
                        return None
            heapq.heappop(heap)
            node = len(tokens)
            tokens.append(column)
            self.parents.append(parent)
            self.depths.append(depth)
            scores.append(-neg)
            if rank + 1 < len(log_probs) and log_probs[rank + 1] > -np.inf:  # the next sibling
                above = scores[parent] if parent != ROOT else 0.0
                heapq.heappush(heap, (-(above + float(log_probs[rank + 1])), depth, self.counter, parent, rank + 1))
                self.counter += 1
            if row is not None:
                kids[node] = row
                if len(row[0]) and row[0][0] > -np.inf:  # the node's own best child
                    heapq.heappush(heap, (neg - float(row[0][0]), depth + 1, self.counter, node, 0))
                    self.counter += 1
        return None


def build_markov_tree(scorer, budget: int, root: int, token_map: torch.Tensor | None = None) -> DraftTree:
    """The best ``budget``-node tree of a round's :class:`~dflash_core.model.MarkovScorer` (the loop's path).

    The lazy best-first builder of the module docstring, with the head's products batched instead of one per node
    (each product call has a fixed cost of a few rows; see :meth:`~dflash_core.model.MarkovScorer.fill`). The
    build runs exactly until the next node to take needs children that are not known yet; from there a look-ahead
    on a copy of the state takes unknown nodes as childless and notes the first ``WAVE`` of them (in pop order, so
    the most valuable: the ones the exact build is about to want); all are computed in ONE batched product and the
    exact build resumes. The look-ahead only chooses what to compute, never what is taken, so the tree is exactly
    the lazy builder's (a node keeps all ``budget`` best children computed, not ``budget - size``: the extra ones
    could only be taken after their better siblings, which alone would overrun the budget). From ``PREFETCH_BELOW``
    nodes on, the first batch also holds the children of each depth's most likely token under the unconditioned
    logits, down to where that chain's log-probability falls below ``PREFETCH_FLOOR``
    (:meth:`~dflash_core.model.MarkovScorer.likely_parents`): the chain most trees grow along, so that most
    distributions the tree needs come in the first batch. The builder works on draft columns (the head's keys) and
    maps them to target ids once, at the end.

    The scorer keeps every row it computed for the round; a row held with fewer than min(``budget``, draft
    vocabulary) children (left by an earlier, smaller build of the same round) is computed again: it could cut a
    node's children short."""
    budget = int(budget)
    if budget <= 0 or scorer.depth <= 0:
        return DraftTree.empty()
    first = (1, int(scorer.index(root)))
    guess = scorer.likely_parents(PREFETCH_WIDTH, PREFETCH_FLOOR) if budget >= PREFETCH_BELOW and scorer.depth > 1 \
        else []
    need = min(budget, scorer.base.shape[1])
    known = scorer.known
    scorer.fill([key for key in [first] + guess if key not in known or len(known[key][0]) < need], budget)
    build = _ResumableBuild(known[first], budget, scorer.depth, need)
    while build.grow(known) is not None:
        wanted: list[tuple[int, int]] = []  # the look-ahead's first pop is the node the exact build stopped at
        build.fork().grow(known, wanted, WAVE)
        scorer.fill(wanted, budget)  # unknown, or too short for this budget
    columns = torch.tensor(build.tokens, dtype=torch.int64)
    return DraftTree(columns if token_map is None else token_map.detach().cpu().to(torch.int64)[columns],
                     torch.tensor(build.parents, dtype=torch.int64), torch.tensor(build.depths, dtype=torch.int64),
                     torch.tensor(build.scores, dtype=torch.float64))


def reference_conditioned_tree(logits: torch.Tensor, budget: int, bias: Callable[[int, int], object],
                               root: int) -> dict[tuple[int, ...], float]:
    """Brute force for tiny cases: every token sequence of every depth scored under the conditioned model, the
    ``budget`` best kept (ties by depth). Returns {path (token ids from depth 1): path log-probability}."""
    base = logits.detach().double().cpu().numpy()
    paths: dict[tuple[int, ...], float] = {}
    frontier = {(): (0.0, root)}
    for depth in range(1, base.shape[0] + 1):
        grown = {}
        for path, (value, last) in frontier.items():
            b = bias(depth, last)
            b = b.detach().double().cpu().numpy() if isinstance(b, torch.Tensor) else np.asarray(b, dtype=np.float64)
            row = _log_softmax_np(base[depth - 1] + b)
            for token in range(row.shape[0]):
                grown[path + (token,)] = (value + float(row[token]), token)
        paths.update({p: v for p, (v, _) in grown.items()})
        frontier = grown
    best = sorted(paths.items(), key=lambda kv: (-kv[1], len(kv[0])))[:budget]
    return dict(best)
