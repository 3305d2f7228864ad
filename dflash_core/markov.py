"""A Markov head: each drafted position's logits depend on the token drafted just before it.

A DFlash block predicts its positions independently given the context: the distribution at depth d does not know
which token the tree placed at depth d-1 on a branch. The head adds a low-rank logit bias over the draft vocabulary
that depends on that previous token::

    logits_d(prev) = base_d + W_out z,   z = E[prev]                      (kind "token")
                                         z = E[prev] * sigmoid(G h_d)     (kind "gated": h_d the drafter's state)

``E`` has one row per draft-vocabulary token plus one out-of-vocabulary bucket (a previous token the drafter cannot
draft, e.g. a root outside its vocabulary); ``W_out`` starts at zero, so a head added to a trained drafter leaves its
outputs unchanged until trained. The previous token of depth 1 is the root (the last committed token); in training it
is the target's own token before each predicted position (teacher forcing).

:class:`MarkovScorer` is the per-round inference side: it holds one block's base logits and states and returns a
node's children distribution given that node's token, for the conditioned chain and tree builders.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import torch
from torch import nn

__all__ = ["MARKOV_KINDS", "MarkovHead", "MarkovScorer", "attach_markov_head", "draft_index", "markov_scorer"]

MARKOV_KINDS = ("token", "gated")


class MarkovHead(nn.Module):
    """Logit bias ``[N, V']`` over the draft vocabulary from the previous token's draft index (``V'`` = OOV)."""

    def __init__(self, vocab: int, hidden: int, rank: int, kind: str = "token") -> None:
        super().__init__()
        if kind not in MARKOV_KINDS:
            raise ValueError(f"markov kind must be one of {MARKOV_KINDS}, got {kind!r}")
        if rank < 1:
            raise ValueError(f"markov rank must be >= 1, got {rank}")
        self.kind, self.rank, self.vocab = kind, rank, vocab
        self.embed = nn.Embedding(vocab + 1, rank)  # row `vocab`: the out-of-vocabulary bucket
        self.gate = nn.Linear(hidden, rank) if kind == "gated" else None
        self.out = nn.Linear(rank, vocab, bias=False)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        nn.init.normal_(self.embed.weight, std=1.0)
        nn.init.zeros_(self.out.weight)  # a new head changes nothing until trained
        if self.gate is not None:
            nn.init.normal_(self.gate.weight, std=0.02)
            nn.init.zeros_(self.gate.bias)

    def codes(self, prev: torch.Tensor, states: torch.Tensor | None = None) -> torch.Tensor:
        """prev [N] draft indices (``vocab`` = OOV), states [N, H] (gated only) -> z [N, rank]."""
        z = self.embed(prev)
        if self.gate is not None:
            if states is None:
                raise ValueError("a gated Markov head needs the drafter's states")
            z = z * torch.sigmoid(self.gate(states.to(self.gate.weight.dtype)))
        return z

    def forward(self, prev: torch.Tensor, states: torch.Tensor | None = None) -> torch.Tensor:
        return self.out(self.codes(prev, states))  # [N, V']

    def float_weights(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(E [V'+1, r], W_out^T [r, V']) as contiguous float32 CPU tensors, cached until the weights change."""
        key = tuple((w.data_ptr(), w._version, w.dtype) for w in (self.embed.weight, self.out.weight))
        cached = self.__dict__.get("_float")
        if cached is None or cached[0] != key:
            with torch.no_grad():
                embed = self.embed.weight.detach().float().cpu().contiguous()
                out = self.out.weight.detach().float().cpu().t().contiguous()
            cached = (key, embed, out)
            self.__dict__["_float"] = cached
        return cached[1], cached[2]


class MarkovScorer:
    """One round's conditioned drafter: the children distribution of a node given that node's token.

    ``base`` [D, V'] float32: the block's compact logits (row d-1 = depth d); ``states`` [D, H]: the drafter's output
    states; ``to_index``: target ids -> draft indices (OOV bucket for tokens outside the draft vocabulary).
    ``log_probs(depth, prev)`` is the log-softmax of ``base[depth-1] + bias(prev)``: exactly the distribution the
    head was trained to give, as a float32 numpy row (the chain calls it once per depth). Tree builders ask for
    many nodes' best children at once (:meth:`fill`, read back through :attr:`known` or :meth:`cached`); the
    sampled tree takes whole rows (:meth:`logits`). The product runs in torch, on the threads the models use: a
    numpy product would start BLAS threads of its own, which keep spinning after each call and, on two cores, slow
    the next target forward about twofold.
    """

    def __init__(self, head: MarkovHead, base: torch.Tensor, states: torch.Tensor, to_index) -> None:
        self.base = base.detach().float().cpu()  # [D, V']
        self._cache: dict[tuple[int, int], tuple[np.ndarray, np.ndarray]] = {}  # (depth, parent column) -> children
        self.depth = self.base.shape[0]
        self._to_index = to_index
        self._embed, self._out = head.float_weights()  # [V'+1, r], [r, V']
        with torch.no_grad():
            self._gate = None if head.gate is None else torch.sigmoid(
                head.gate(states.to(head.gate.weight.device, head.gate.weight.dtype))).float().cpu()  # [D, r]

    def index(self, token_ids) -> np.ndarray:
        """Target ids -> rows of the head's embedding (the OOV bucket for ids outside the draft vocabulary)."""
        return self._to_index(np.asarray(token_ids, dtype=np.int64))

    def logits(self, depth: int, prev_ids) -> torch.Tensor:
        """[m, V'] conditioned logits of ``depth`` (1-based) after the previous tokens ``prev_ids`` (target ids)."""
        z = self._embed[torch.from_numpy(self.index(prev_ids))]  # [m, r]
        if self._gate is not None:
            z = z * self._gate[depth - 1]
        return torch.addmm(self.base[depth - 1], z, self._out)

    def fill(self, keys, k: int) -> None:
        """Compute the ``k`` best children of every (depth, parent draft column) in ``keys`` (Python ints) in ONE
        batched product (one row of the head's embedding each, times the depth's gate, times ``W_out``; then one
        log-softmax and one top-k over the batch) and keep them for :meth:`cached` and :attr:`known`. Keys already
        held with ``k`` children are skipped.

        Why batched: each call costs a fixed ~0.1 ms (seven torch ops and their Python, the [r, V'] output matrix
        read again) on top of its rows (a rank-128 row over 4,096 columns is 0.5 M multiply-adds), so a tree's two
        dozen distributions cost far less in a few batches than one by one. Exact: every row is the same sum as
        :meth:`logits` computes alone (row-wise ops only); log-softmax gives the same normalisation as a separate
        log-sum-exp at a fifth of its cost here."""
        k = min(k, self.base.shape[1])
        cache = self._cache
        todo = [key for key in dict.fromkeys(keys) if key not in cache or len(cache[key][0]) < k]
        if not todo:
            return
        pairs = np.array(todo, dtype=np.int64)  # [m, 2] (depth, parent column)
        columns, depth_rows = torch.from_numpy(pairs[:, 1].copy()), torch.from_numpy(pairs[:, 0] - 1)
        with torch.no_grad():
            z = self._embed.index_select(0, columns)  # [m, r]
            if self._gate is not None:
                z.mul_(self._gate.index_select(0, depth_rows))  # each row gated by its own depth's state
            rows = torch.mm(z, self._out).add_(self.base.index_select(0, depth_rows))  # [m, V']
            values, best = torch.topk(torch.log_softmax(rows, dim=-1), k, dim=-1)
        cache.update(zip(todo, zip(values.numpy().astype(np.float64), best.numpy())))

    def likely_parents(self, width: int, floor: float = -np.inf) -> list[tuple[int, int]]:
        """Keys (children's depth, parent column) of the ``width`` most likely tokens of every depth under the
        block's unconditioned logits, where most tree nodes lie (depths 1..D-1 as parents), down to the last depth
        where the unconditioned top-1 chain still has log-probability >= ``floor`` (deeper ones are rarely in a
        tree: on the shipped drafter's rounds at 32 nodes, a depth's top token below a chain log-probability of -8
        almost never had children in the tree)."""
        width = min(width, self.base.shape[1])
        with torch.no_grad():
            log_probs = torch.log_softmax(self.base[:-1], dim=-1)  # [D-1, V'] depths 1..D-1
            top, parents = torch.topk(log_probs, width, dim=-1)  # [D-1, w]
            chain = torch.cumsum(top[:, 0], 0)  # [D-1] the top-1 chain's log-probability
            rows = int((chain >= floor).sum()) if floor > -np.inf else log_probs.shape[0]
            parents = parents[:rows].numpy()  # [rows, w]
        return [(d + 2, int(c)) for d in range(parents.shape[0]) for c in parents[d]]

    def prefetch(self, width: int, k: int) -> None:
        """:meth:`fill` the ``k`` best children of the :meth:`likely_parents`: a guess, so exact whatever it holds."""
        self.fill(self.likely_parents(width), k)

    @property
    def known(self) -> dict[tuple[int, int], tuple[np.ndarray, np.ndarray]]:
        """What :meth:`fill` computed: (depth, parent draft column) -> (float64 log-probabilities, draft columns) of
        that parent's best children, best first (read-only for callers)."""
        return self._cache

    def cached(self, depth: int, prev_id: int, k: int) -> tuple[np.ndarray, np.ndarray] | None:
        """The ``k`` best children of ``depth`` after the token ``prev_id`` (a target id) if :meth:`fill` holds
        them: (float64 log-probabilities, draft columns), best first; else None."""
        hit = self._cache.get((depth, int(self.index(prev_id))))
        if hit is None or len(hit[0]) < min(k, self.base.shape[1]):
            return None
        return hit[0][:k], hit[1][:k]

    def top_children(self, depth: int, prev_id: int, k: int) -> tuple[np.ndarray, np.ndarray]:
        """The ``k`` most probable draft-vocabulary columns of ``depth`` after the token ``prev_id`` (a target id),
        best first: (float64 log-probabilities, columns); from the batch :meth:`fill` computed, else computed (and
        kept) on its own."""
        hit = self.cached(depth, prev_id, k)
        if hit is None:
            self.fill([(depth, int(self.index(prev_id)))], k)
            hit = self.cached(depth, prev_id, k)
        return hit

    def log_probs(self, depth: int, prev_ids) -> np.ndarray:
        """[m, V'] float32 log-probabilities of ``depth`` given the previous tokens (target ids)."""
        with torch.no_grad():
            return torch.log_softmax(self.logits(depth, prev_ids), dim=-1).numpy()


def attach_markov_head(draft, rank: int, kind: str = "token") -> MarkovHead:
    """Give ``draft`` (a :class:`~dflash_core.model.DFlashDraftModel`) a new Markov head over its draft vocabulary
    (set the vocabulary first); its output weights are zero, so the drafter's outputs do not change until trained."""
    param = next(draft.parameters())
    vocab = draft.config.draft_vocab_size or draft.config.vocab_size
    draft.markov = MarkovHead(vocab, draft.config.hidden_size, rank, kind).to(param.device, param.dtype)
    draft.config = dataclasses.replace(draft.config, markov_rank=rank, markov_kind=kind)
    return draft.markov


def _index_map(draft) -> torch.Tensor:
    """[V] target id -> draft index (``V'`` for ids outside the draft vocabulary), cached on the drafter."""
    vocab = draft.draft_vocab
    key = (vocab.data_ptr(), vocab.device, len(vocab))
    cached = getattr(draft, "_markov_index", None)
    if cached is None or cached[0] != key:
        t2d = torch.full((draft.config.vocab_size,), len(vocab), dtype=torch.long, device=vocab.device)
        t2d[vocab] = torch.arange(len(vocab), device=vocab.device)
        cached = (key, t2d, t2d.cpu().numpy())
        draft._markov_index = cached
    return cached


def draft_index(draft, token_ids: torch.Tensor) -> torch.Tensor:
    """Target token ids -> the drafter's draft-vocabulary indices; ids outside it map to the OOV bucket ``V'``."""
    if draft.draft_vocab is None:
        return token_ids
    return _index_map(draft)[1].to(token_ids.device)[token_ids]


def markov_scorer(draft, base: torch.Tensor, states: torch.Tensor) -> MarkovScorer | None:
    """The round's :class:`MarkovScorer` for a drafter with a Markov head (None without one)."""
    if getattr(draft, "markov", None) is None:
        return None
    if draft.draft_vocab is None:
        return MarkovScorer(draft.markov, base, states, lambda ids: ids)
    t2d = _index_map(draft)[2]
    return MarkovScorer(draft.markov, base, states, lambda ids: t2d[ids])


def bigram_head(draft, responses, weight: float = 0.5, smoothing: float = 0.1) -> MarkovHead:
    """A count-based baseline in the head's form: bias = ``weight`` x log p(next | prev) of the token bigrams in
    ``responses`` (lists of target ids), add-``smoothing`` over the draft vocabulary; no bias after an
    out-of-vocabulary token. Exact (rank V', identity output), so for evaluation, not for shipping."""
    vocab = draft.config.draft_vocab_size or draft.config.vocab_size
    counts = torch.full((vocab + 1, vocab), float(smoothing), dtype=torch.float64)
    for seq in responses:
        idx = draft_index(draft, torch.as_tensor(seq, dtype=torch.long))
        prev, nxt = idx[:-1], idx[1:]
        keep = nxt < vocab
        counts.index_put_((prev[keep], nxt[keep]), torch.ones(int(keep.sum()), dtype=torch.float64), accumulate=True)
    table = weight * torch.log(counts / counts.sum(-1, keepdim=True))
    table[vocab] = 0.0  # after a token the drafter cannot draft: no opinion
    head = MarkovHead(vocab, draft.config.hidden_size, vocab, "token")
    with torch.no_grad():
        head.embed.weight.copy_(table.float())
        head.out.weight.copy_(torch.eye(vocab))
    return head
