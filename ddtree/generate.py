"""``ddtree_generate``: DDTree on dflash_core's one decode loop, with a pluggable tree policy.

Each round the drafter's per-position logits become a best-first draft tree (:func:`ddtree.build_tree`), the target
verifies every branch in one forward under an ancestor mask, and the walk keeps the longest path the target agrees
with plus the target's own next token. Policies:

* ``budget="chain"`` -- the drafter's top-1 token per depth, i.e. exactly DFlash;
* ``budget=<int>``  -- a fixed node budget per round (the DDTree paper's setting);
* ``budget="auto"`` -- per-round tree size chosen from a measured round-cost curve (see :mod:`ddtree.budget`);
* ``budget="chain-auto"`` -- DFlash with a per-round chain length chosen the same way.

Tree kinds (``tree=``), for a fixed budget:

* ``"topk"``    -- (default) the deterministic best-first tree of the drafter's most probable prefixes, verified by
  sample-and-match (at T > 0 the target samples at each node and the walk moves into the child with that token);
* ``"sampled"`` -- children drawn without replacement from the drafter's distribution and verified by recursive
  rejection sampling (:mod:`ddtree.sampled`); lossless at T > 0 and usually accepting more there. At T = 0 there is
  nothing to sample, so ``tree="sampled"`` falls back to the top-K tree and the greedy walk.
"""

from __future__ import annotations

import math
import numbers
import time
from typing import Sequence

import numpy as np
import torch

from dflash_core.decoding import GenerationResult, Request, decode, policies_for
from dflash_core.tree import BlockPolicy, Chain, DraftBlock, DraftTree

from .budget import AutoBudget, RoundMemory, SharedBudget
from .build import best_tree
from .lookup import LookupTreePolicy
from .sampled import SampledTreePolicy

__all__ = ["BUDGET_WORDS", "FixedBudget", "TREE_KINDS", "check_verifiable", "ddtree_generate",
           "make_policy",
           "parse_budget"]

TREE_KINDS = ("topk", "sampled")
BUDGET_WORDS = ("chain", "auto", "chain-auto")  # the policies a string budget names


def parse_budget(budget) -> int | str:
    """The one check of a ``budget`` argument: an int >= 0 (numpy ints too) or one of :data:`BUDGET_WORDS`."""
    if isinstance(budget, str):
        if budget not in BUDGET_WORDS:
            raise ValueError(f"unknown budget policy {budget!r}: use an int >= 0 or one of {', '.join(BUDGET_WORDS)}")
        return budget
    if isinstance(budget, bool) or not isinstance(budget, numbers.Integral) or budget < 0:
        raise ValueError(f"budget must be an int >= 0 or one of {', '.join(BUDGET_WORDS)}, got {budget!r}")
    return int(budget)


class FixedBudget(BlockPolicy):
    """The best tree of at most ``budget`` nodes under the drafter's distribution, every round
    (:func:`ddtree.build.best_tree`: conditioned on each node's own token for a drafter with a Markov head)."""

    uses_draft = True

    def __init__(self, budget: int) -> None:
        self.budget = parse_budget(budget)
        if not isinstance(self.budget, int):
            raise ValueError(f"FixedBudget needs an int budget >= 0, got {budget!r}")
        self.name = f"fixed-{budget}"

    def propose(self, block: DraftBlock, history: list[int]) -> DraftTree:
        return best_tree(block, self.budget)


def make_policy(budget, target=None, draft=None, tree: str = "topk", temperature: float = 0.0, seed: int = 0,
                lookup: bool = False, batch: int = 1, **auto_options):
    """Turn ``ddtree_generate``'s ``budget``, ``tree`` and ``lookup`` arguments into the policy of one sequence.

    ``tree="sampled"`` needs an int budget; at ``temperature`` 0 it gives the top-K tree (nothing to sample). The
    sampled tree draws from the drafter at the decoding temperature with a generator seeded by ``seed``.
    ``lookup=True`` (an int budget or ``"auto"``, top-K trees) merges the context's continuation into each tree
    (:class:`~ddtree.lookup.LookupTreePolicy`, timing its rounds to skip the drafter where the continuation alone
    pays more; in a batch, ``batch`` > 1, every round drafts: one sequence's clock times the whole batch's round,
    and only a round where every sequence skipped would save the pass). ``batch``: the number of sequences decoded
    together (``auto`` prices rounds with that batch's curve). ``auto_options`` go to
    :meth:`AutoBudget.for_models` for ``"auto"`` and ``"chain-auto"``, e.g. ``context`` (the prompt length),
    ``memory`` (a :class:`~ddtree.budget.RoundMemory` that carries what ``auto`` learnt over to this call; default:
    start fresh), ``online=False`` (read no clock).
    """
    budget = parse_budget(budget)
    if tree not in TREE_KINDS:
        raise ValueError(f"unknown tree kind {tree!r}: use one of {TREE_KINDS}")
    if lookup and (budget in ("chain", "chain-auto") or tree != "topk"):
        raise ValueError("lookup=True merges the context's continuation into top-K trees: pass an int budget or "
                         "'auto', and tree='topk'")
    if tree == "sampled":
        if isinstance(budget, str):
            raise ValueError(f"tree='sampled' needs an int budget >= 0, got {budget!r}")
        if temperature > 0:
            return SampledTreePolicy(budget, temperature, seed=seed)
    if budget == "chain":
        return Chain()
    clock = time.perf_counter if batch == 1 else None  # lookup's skip clock (see above)
    if budget in ("auto", "chain-auto"):
        policy = AutoBudget.for_models(target, draft, chain=budget == "chain-auto", batch=batch, **auto_options)
        return LookupTreePolicy(policy, clock=clock) if lookup else policy
    return LookupTreePolicy(budget, clock=clock) if lookup else FixedBudget(budget)


def _memory_bytes(device: torch.device) -> int:
    """What one forward may use: free memory of a CUDA device, else the machine's physical memory."""
    if device.type == "cuda":
        return int(torch.cuda.mem_get_info(device)[0])
    import os

    return int(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))


def check_verifiable(target, draft, budget: int, max_context: int, batch: int = 1) -> None:
    """Raise ValueError when ``batch`` trees of ``budget`` nodes cannot be verified in one target forward on this
    machine.

    The tree has at most min(budget, V + V^2 + ... + V^(b-1)) nodes (V: the drafter's vocabulary); its verify forward
    attends from every node to up to ``max_context`` + nodes positions, which costs about 4 bytes per head and
    position pair where the kernel materialises the scores, plus the mask, for each of the ``batch`` sequences
    verified together. Above a quarter of the memory at hand that forward would exhaust it; the error names the
    largest budget that fits (the DDTree paper sweeps 16-1024; a smaller batch fits a larger one).
    """
    budget = parse_budget(budget)
    if isinstance(budget, str):
        return  # a policy word: its trees are sized per round (``auto``) or are chains
    depth = (draft.block_size - 1) if draft is not None else 15
    vocab = (draft.config.draft_vocab_size or draft.config.vocab_size) if draft is not None else budget
    nodes, level = 0, 1
    for _ in range(depth):  # prefixes of length 1..depth: V + V^2 + ... (a tree holds at most that many)
        level *= int(vocab)
        nodes += level
        if nodes >= budget:
            break
    nodes = min(int(budget), nodes)
    heads = int(getattr(target.config, "num_attention_heads", 32))
    per_pair = 4 * heads + 5  # fp32 scores per head, the additive mask and the boolean visibility
    allowed = _memory_bytes(target.lm_head.weight.device) // 4
    per_pair *= batch  # one forward verifies every sequence's tree
    need = (nodes + 1) * (max_context + nodes + 1) * per_pair
    if need > allowed:
        # largest n with (n + 1) * (max_context + n + 1) * per_pair <= allowed
        c = max_context + 1
        largest = int((-(c + 1) + math.sqrt((c + 1) ** 2 - 4 * (c - allowed / per_pair))) / 2)
        trees = f"a tree of {nodes} nodes" if batch == 1 else f"{batch} trees of {nodes} nodes"
        raise ValueError(f"budget={budget}: {trees} cannot be verified in one target forward here "
                         f"(about {need / 2**30:.1f} GiB of attention, more than a quarter of the "
                         f"{4 * allowed / 2**30:.0f} GiB at hand); use a budget of at most {max(0, largest)} "
                         + ("" if batch == 1 else "or a smaller batch ") + "(the DDTree paper sweeps 16-1024)")


def _single_seconds(target, draft, policy: AutoBudget, context: int) -> np.ndarray:
    """One sequence's round seconds at 0..``policy.cap`` nodes (the batch-1 curve at this context, cached on disk
    like the batch's): what :class:`SharedBudget` prices rounds with once the batch has shrunk."""
    single = AutoBudget.for_models(target, draft, context=context, chain=policy.chain, online=False)
    return np.asarray(single.cost.round_seconds(np.arange(policy.cap + 1)), dtype=float)


def ddtree_generate(
    target, draft, input_ids: torch.Tensor, budget: int | str | None = None, max_new_tokens: int = 128,
    temperature: float = 0.0, stop_token_ids: Sequence[int] | None = None, seed: int = 0,
    block_size: int | None = None, trace: bool = False, policy=None, tree: str = "topk", lookup: bool = False,
    check_trees: bool = False, attention_mask: torch.Tensor | None = None, memory: RoundMemory | None = None,
    top_k: int | None = None, top_p: float | None = None, min_p: float | None = None,
) -> GenerationResult | list[GenerationResult]:
    """Speculative decoding with a DDTree draft tree per round; the output is exactly the target's.

    ``budget``: an int (a fixed node budget, 32 when omitted), ``"chain"`` (DFlash), ``"auto"`` or ``"chain-auto"``
    (a tree size / chain length per round, priced with this machine's round-cost curve at the prompt's length, cached
    per machine and model; :func:`ddtree.cost.calibrate` measures every context bucket up front; a call that had to
    measure says so in ``result.timings["calibration"]``). ``tree``: ``"topk"`` (default, deterministic best-first
    tree) or ``"sampled"`` (sampled children verified by recursive rejection sampling; an int budget; at T = 0 the
    top-K tree). ``lookup=True`` (an int budget or ``"auto"``, top-K trees) merges the context's n-gram continuation
    into each round's tree under the same budget (:mod:`ddtree.lookup`; ``result.lookup_tokens`` gives per round the
    committed tokens that lay on it). ``policy``: any :class:`~dflash_core.tree.BlockPolicy` instead of
    ``budget``/``tree``/``lookup`` (passing both is refused). ``check_trees=True`` validates every proposed tree.

    ``result.tree_sizes`` / ``result.expected_acceptance`` / ``result.acceptance_lengths`` give per round the tree
    size, the drafter's expected and the actual committed tokens; ``trace=True`` keeps every tree in
    ``result.trees``. Trees need a target whose attention backend applies a 4D mask (SDPA, eager, flex): anything
    else raises ``IncompatibleModelError``; ``budget="chain"`` and ``"chain-auto"`` on one prompt run on any backend.

    A batch: ``input_ids`` a list of prompts ([T] or [1, T], any lengths) or padded [B, T] ids with an
    ``attention_mask``; returns one result per prompt. Each sequence has its own policy (``policy=`` is copied per
    sequence) and a generator seeded ``seed + b``; all trees of a round are verified in one target forward, and
    ``auto`` picks one tree size per round for the whole batch (:class:`~ddtree.budget.SharedBudget`).

    ``memory`` (``"auto"`` / ``"chain-auto"``): what ``auto`` learnt from earlier rounds (the drafter's calibration
    against what the target accepted, online corrections of the cost curve), a :class:`~ddtree.budget.RoundMemory`
    the caller holds and passes to later calls to carry it over; None starts fresh from the cost curve cached on
    disk, the same every time. In a batch each sequence learns in its own fork of it (its calibration and rate are
    its own prompt's) and the memory takes every sequence's rounds back after the call.
    ``top_k`` / ``top_p`` / ``min_p`` (T > 0): transformers' filters of the target's distribution, which every tree
    kind then samples from (:mod:`dflash_core.sampling`); the drafter's proposals are not filtered.
    """
    request = Request.check(input_ids, max_new_tokens, temperature, stop_token_ids, seed, attention_mask, top_k,
                            top_p, min_p)
    count = len(request.prompts)
    if policy is not None:
        if budget is not None or tree != "topk" or lookup or memory is not None:
            raise ValueError("policy= decides the trees itself: pass either policy= or budget=/tree=/lookup=/memory=, "
                             "not both")
        policies = policies_for(policy, count)
    else:
        budget = parse_budget(32 if budget is None else budget)
        check_verifiable(target, draft, budget, request.longest + max_new_tokens, count)
        auto = [{}] * count  # ``auto``: the batch's curve at the longest prompt, a fork of the memory per sequence
        if budget in ("auto", "chain-auto"):
            memory = RoundMemory() if memory is None else memory  # (an empty memory is falsy: test for None)
            forks = [memory] if count == 1 else [memory.fork() for _ in range(count)]
            auto = [{"context": request.longest, "memory": fork} for fork in forks]
        elif memory is not None:
            raise ValueError(f"memory= is what budget='auto' learns; budget={budget!r} keeps none")
        policies = [make_policy(budget, target, draft, tree=tree, temperature=temperature, seed=seed + b,
                                lookup=lookup, batch=count, **auto[b]) for b in range(count)]
    proposer = None
    if count > 1 and all(isinstance(p, AutoBudget) for p in policies):
        proposer = SharedBudget(policies, None if policy is not None else
                                _single_seconds(target, draft, policies[0], request.longest))
    results = decode(target, draft, request, policies, block_size, trace, check_trees, proposer)
    if memory is not None and count > 1:
        memory.absorb(fork for fork in (a.get("memory") for a in auto) if fork is not None)
    for r, pol in zip(results, policies):
        if getattr(pol, "calibration_s", 0.0):  # ``auto`` measured its cost curve inside this call
            r.timings["calibration"] = pol.calibration_s
        if lookup:
            r.lookup_tokens = pol.lookup_committed
    return results[0] if request.single else results
