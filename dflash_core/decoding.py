"""The one speculative decode loop: draft -> propose -> verify -> commit.

Plain decoding, DFlash (a chain) and DDTree (a tree) all run through :func:`speculative_generate`; they differ only in
the *proposal policy*, which turns the drafter's per-position logits into a tree of draft tokens:

* :class:`NoDraft`  proposes nothing: every round verifies just the root, i.e. autoregressive decoding;
* :class:`Chain`    proposes the drafter's top-1 token at every depth: DFlash;
* ``ddtree`` policies propose a best-first tree under a node budget.

Why the output is exactly the target's (lossless), greedy and sampled alike: each committed token is the target's own
choice at a position whose prefix is already committed. The verify pass computes the target's distribution at every
draft node; walking from the root we draw the target's token (argmax, or a sample from softmax(logits / T)) at the
current node and move into the child carrying that token if there is one. Drafting only decides at which positions the
target's distribution was computed in advance; it never changes which token is drawn there ("sample-and-match").
"""

from __future__ import annotations

import inspect
import math
import numbers
import time
from dataclasses import dataclass, field
from typing import Any, Protocol, Sequence

import torch

from .model import DFlashDraftModel, DraftCache
from .target import TargetAdapter, check_compatibility
from .timing import StageTimer
from .tree import ROOT, DraftTree, child_index

__all__ = [
    "GenerationResult", "Proposal", "ProposalPolicy", "NoDraft", "Chain", "check_proposal", "compile_proposal",
    "follow", "speculative_generate", "autoregressive_generate", "dflash_generate", "draft_states", "draft_block",
    "verify_proposal", "commit_path", "truncate_at_stop", "validate_request", "prefill", "proposer", "drafter_wanted",
]


# ---------------------------------------------------------------------------------------------------- proposals
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


class NoDraft:
    """Propose nothing: each round commits exactly the target's own next token (plain decoding)."""

    name, uses_draft = "ar", False

    def propose(self, draft_logits: torch.Tensor | None, history: list[int], token_map=None) -> DraftTree:
        return DraftTree.empty()


class Chain:
    """DFlash: the drafter's top-1 token at every depth, as one branch."""

    name, uses_draft = "chain", True

    def propose(self, draft_logits: torch.Tensor, history: list[int], token_map: torch.Tensor | None = None
                ) -> DraftTree:
        logp = torch.log_softmax(draft_logits.float(), dim=-1)  # [b-1, V]
        best, tokens = logp.max(dim=-1)
        if token_map is not None:  # draft columns -> target ids
            tokens = token_map.to(tokens.device)[tokens]
        return DraftTree.chain(tokens.cpu(), best.cpu())


# ---------------------------------------------------------------------------------------------------- verification
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


def observer(policy):
    """The policy's feedback hook as ``f(path)`` (None when it has none): ``observe(len(path), path)`` when its
    ``observe`` takes the accepted nodes too, else ``observe(len(path))``."""
    observe = getattr(policy, "observe", None)
    if observe is None:
        return None
    try:
        params = list(inspect.signature(observe).parameters.values())
        takes_path = len(params) >= 2 or any(p.kind is p.VAR_POSITIONAL for p in params)
    except (TypeError, ValueError):  # a builtin without a signature
        takes_path = False
    if takes_path:
        return lambda path: observe(len(path), path)
    return lambda path: observe(len(path))


def drafter_wanted(policy):
    """``f(history) -> bool``: whether this round runs the drafter. True every round for a policy that uses it,
    unless it has ``wants_draft(history)`` (a lookup policy may skip the pass when the context is reliable enough:
    it then gets ``draft_logits=None``); False for policies that never use it."""
    if not policy.uses_draft:
        return lambda history: False
    return getattr(policy, "wants_draft", None) or (lambda history: True)


def proposer(policy):
    """(``f(drafted, history) -> proposal``, whether the policy takes compact logits): ``drafted`` is what
    :func:`draft_block` returned (None when the policy does not use the drafter). A policy whose ``propose`` takes
    ``token_map`` gets the compact logits and their id map; any other gets full-vocabulary rows."""
    try:
        compact = "token_map" in inspect.signature(policy.propose).parameters
    except (TypeError, ValueError):  # a builtin without a signature
        compact = False
    if not compact:
        return policy.propose, False

    def propose(drafted, history):
        logits, token_map = (None, None) if drafted is None else drafted
        return policy.propose(logits, history, token_map=token_map)

    return propose, True


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


def _check_room(adapter: TargetAdapter, prompt_len: int, max_new_tokens: int) -> None:
    """The prompt and the answer must fit the target's positions: past them its outputs are meaningless."""
    limit = getattr(adapter.model.config, "max_position_embeddings", None)
    if limit is not None and prompt_len + max_new_tokens > limit:
        room = max(0, limit - prompt_len)
        raise ValueError(
            f"the prompt ({prompt_len} tokens) plus max_new_tokens ({max_new_tokens}) exceed the target's "
            f"{limit} positions (config.max_position_embeddings): "
            + (f"lower max_new_tokens to at most {room}" if room else "shorten the prompt")
            + " (past its trained length the target's outputs are not meaningful)")


def _check_stop_ids(adapter: TargetAdapter, stop_token_ids) -> set[int]:
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


def draft_block(draft: DFlashDraftModel, adapter: TargetAdapter, root: int, pending: torch.Tensor, start: int,
                draft_cache: DraftCache, block_size: int | None = None, compact: bool = False):
    """Step 1, draft: float32 logits from one drafter pass; row d-1 drafts the token at depth d.

    Default: [b-1, V] over the target vocabulary (tokens outside a reduced draft vocabulary get -inf). With
    ``compact``: the pair (logits [b-1, V'] over the draft vocabulary, its id map [V'] or None), what the loop hands
    to policies that take ``token_map`` (no log-softmax over the ~90% of columns that are -inf).
    """
    states = draft_states(draft, adapter, root, pending, start, draft_cache, block_size)[1:]  # [b-1, H]
    return adapter.draft_logits(states, draft) if compact else adapter.lm_head(states, draft)


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


# ---------------------------------------------------------------------------------------------------- the loop
@torch.inference_mode()
def speculative_generate(
    target,
    draft: DFlashDraftModel | None,
    input_ids: torch.Tensor,
    policy: ProposalPolicy,
    max_new_tokens: int = 128,
    temperature: float = 0.0,
    stop_token_ids: Sequence[int] | None = None,
    seed: int = 0,
    block_size: int | None = None,
    trace: bool = False,
    check_trees: bool = False,
) -> GenerationResult:
    """Generate with ``policy`` deciding each round's draft tree. See the module docstring for why it is lossless.

    ``check_trees``: validate every proposed tree (:func:`check_proposal`) before it is verified; for developing a
    policy (a tree with 0-based depths, say, would otherwise run and merely accept less)."""
    adapter, stops = _prepare(target, draft, input_ids, policy, max_new_tokens, temperature, stop_token_ids,
                              block_size)
    device, uses_draft = adapter.device, policy.uses_draft
    generator, timer = torch.Generator(device=device).manual_seed(seed), StageTimer(device)
    result = GenerationResult([], [], {}, int(input_ids.shape[1]), trees=[] if trace else None)
    if max_new_tokens == 0:
        result.timings = {"prefill": 0.0, "decode": 0.0}
        return result
    with timer.stage("prefill"):  # the prompt enters the target cache; its features are the drafter's first context
        cache, root, pending = prefill(adapter, input_ids, temperature, generator, uses_draft)
    start, draft_cache = int(input_ids.shape[1]), DraftCache()  # start: committed tokens in the target cache
    result.new_token_ids.append(root)
    history = input_ids[0].tolist() + [root]
    done = root in stops or max_new_tokens <= 1
    observe = observer(policy)  # optional feedback hook: the nodes accepted this round
    propose, compact = proposer(policy)  # compact: draft logits over the draft vocabulary plus their id map
    wanted, t_loop = drafter_wanted(policy), time.perf_counter()
    while not done:
        drafted = None
        if wanted(history):
            with timer.stage("draft"):  # [b-1, V] logits, or ([b-1, V'] logits, [V'] id map) when compact
                drafted = draft_block(draft, adapter, root, pending, start, draft_cache, block_size, compact)
        with timer.stage("tree"):
            proposal = propose(drafted, history)
            if check_trees:
                check_proposal(proposal)
        with timer.stage("verify"):
            out = verify_proposal(adapter, cache, proposal, root, start, with_features=uses_draft)
        with timer.stage("commit"):
            path, bonus = verify_walk(proposal, out.logits, temperature, generator)
            committed, done = truncate_at_stop([int(proposal.token_ids[i]) for i in path] + [bonus], stops,
                                               max_new_tokens - len(result.new_token_ids))
            if observe is not None:
                observe(path[: len(committed)])  # the accepted nodes that were committed (a stop cuts the rest)
            carried = pending if drafted is None else None  # a round without the drafter consumed no features
            start, pending = commit_path(adapter, cache, start, path, out.features, carried)
            result.add_round(committed, proposal)
            history += committed
            root = bonus
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    result.timings = {**timer.totals(), "decode": time.perf_counter() - t_loop}
    return result


def _prepare(target, draft, input_ids, policy, max_new_tokens, temperature, stop_token_ids, block_size):
    """Validate a generation request; returns the target adapter and the set of stop ids."""
    validate_request(input_ids, max_new_tokens, temperature)
    if not callable(getattr(policy, "propose", None)) or not isinstance(getattr(policy, "uses_draft", None), bool):
        raise TypeError(f"{type(policy).__name__} is not a proposal policy: it needs propose(draft_logits, history) "
                        "and a bool uses_draft (True when it reads the drafter's logits); see ProposalPolicy")
    if policy.uses_draft:
        if draft is None:
            raise ValueError(f"policy {policy.name!r} needs a drafter; pass draft=...")
        check_compatibility(target, draft)
        if not 2 <= (block_size or draft.block_size):
            raise ValueError(f"block_size must be >= 2, got {block_size}")
    adapter = TargetAdapter(target, draft.config.target_layer_ids if policy.uses_draft else ())
    adapter.check_token_ids(input_ids)
    _check_room(adapter, int(input_ids.shape[1]), max_new_tokens)
    return adapter, _check_stop_ids(adapter, stop_token_ids)


def autoregressive_generate(target, input_ids: torch.Tensor, max_new_tokens: int = 128, temperature: float = 0.0,
                            stop_token_ids: Sequence[int] | None = None, seed: int = 0) -> GenerationResult:
    """Plain decoding: one target forward per token (the reference every speculative method must reproduce)."""
    return speculative_generate(target, None, input_ids, NoDraft(), max_new_tokens, temperature, stop_token_ids, seed)


def dflash_generate(target, draft: DFlashDraftModel, input_ids: torch.Tensor, max_new_tokens: int = 128,
                    temperature: float = 0.0, stop_token_ids: Sequence[int] | None = None, seed: int = 0,
                    block_size: int | None = None) -> GenerationResult:
    """DFlash: draft a block in one drafter pass, verify it as a chain in one target pass."""
    return speculative_generate(target, draft, input_ids, Chain(), max_new_tokens, temperature, stop_token_ids, seed,
                                block_size=block_size)
