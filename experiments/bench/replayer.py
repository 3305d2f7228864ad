"""Every budget on the same text: each turn's rounds replayed on plain decoding's own output, priced by the machine's
measured round cost curve.

Live, every method decodes its own text: in bf16 a speculative method leaves plain decoding's output at its first
near-tie and then decodes something else, so two budgets are compared on different texts, and a handful of prompts
carry more noise than the differences between budgets. Replayed (:func:`dflash_core.replay.replay`), every policy
runs its rounds on the SAME text, plain decoding's, with the acceptance lengths the decode loop would see in exact
arithmetic: at T = 0 the greedy continuation; at T > 0 plain decoding's sampled continuation, whose replay gives the
rounds of sample-and-match decoding with top-K trees, chains and lookups (they commit exactly plain decoding's draws
under the shared seed; sampled trees verify by rejection sampling and are not replayed).

Pricing (:mod:`ddtree.cost`, the curve of the prompt's context bucket, measured once per machine): a round with the
drafter costs ``fixed_s + verify(N)`` for N verified nodes, a round without it (prompt lookup) ``verify(N)``; plain
decoding costs ``verify(0)`` per token after the prefill's. The projected speedup of a policy is plain decoding's
projected seconds over its own on the same text. The chain is priced on the tree curve (a chain verifies causally,
slightly cheaper: a small bias against DFlash). Adaptive policies run without a clock (``auto`` cannot correct its
curve online, DDTree+lookup never skips the drafter) and keep one round memory per policy configuration and
temperature across the run's turns, as the live policies share theirs in one benchmark process.

Each replayed generation is a :class:`~experiments.bench.schema.SampleRecord` in ``replayed.jsonl`` next to the run's
``records.jsonl`` (``decode_s`` holds the projected seconds, ``extra["replayed"]`` is True, plain decoding's row
included), so every table of live records reads the replayed ones alike.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Sequence

import numpy as np
import torch

from experiments.bench.schema import EXTRA_TREE_SIZES, SampleRecord
from experiments.bench.variant_spec import Variant

if TYPE_CHECKING:
    from experiments.bench.models import Models
    from experiments.bench.presets import Preset

__all__ = ["EXTRA_REPLAYED", "Replayer", "replay_variants", "round_seconds"]

EXTRA_REPLAYED = "replayed"


def replay_variants(preset: "Preset", temperature: float = 0.0) -> list[Variant]:
    """The variants the preset replays: its ``replay_budgets`` (``"chain"``: DFlash; ints and ``"auto"``: top-K
    DDTree) and, with ``replay_lookup_budgets``, PLD and DDTree+lookup at those budgets."""
    out = [Variant("dflash") if b == "chain" else Variant("ddtree", b) for b in preset.replay_budgets]
    if preset.replay_lookup_budgets:
        out.append(Variant("pld"))
        out += [Variant("ddtree", b, lookup=True) for b in preset.replay_lookup_budgets]
    return out


def round_seconds(cost, sizes: Sequence[int], drafted: bool) -> float:
    """Projected seconds of rounds verifying ``sizes`` nodes each under ``cost`` (a ``ddtree.cost.CostModel``):
    ``fixed_s + verify(N)`` per round with the drafter pass, ``verify(N)`` without it."""
    n = np.asarray(list(sizes), dtype=float)
    if not len(n):
        return 0.0
    return float(cost.verify(n).sum() + (cost.fixed_s * len(n) if drafted else 0.0))


class Replayer:
    """Replays one turn for every variant of ``variants`` on plain decoding's output and returns priced records."""

    def __init__(self, models: "Models", variants: Sequence[Variant], max_new_tokens: int) -> None:
        from ddtree.cost import default_cap

        bad = [v.label for v in variants if v.method == "ar" or v.tree == "sampled" or v.policy_class
               or v.budget == "chain-auto"]
        if bad:
            raise ValueError(f"these variants cannot be replayed: {', '.join(bad)} (replay covers the chain, top-K "
                             "budgets, auto, PLD and DDTree+lookup)")
        self.models, self.variants, self.max_new_tokens = models, list(variants), max_new_tokens
        self.cap = default_cap(models.device)
        self.memories: dict[tuple, object] = {}  # (temperature, label) -> RoundMemory shared across turns

    def _cost(self, prompt_len: int):
        from ddtree.cost import context_bucket, measure_cost_model

        return measure_cost_model(self.models.target, self.models.draft, context=context_bucket(prompt_len),
                                  cap=self.cap, extrapolate=True)

    def _policy(self, variant: Variant, cost, temperature: float):
        from ddtree.budget import AutoBudget, RoundMemory
        from ddtree.generate import make_policy
        from ddtree.lookup import LookupTreePolicy
        from dflash_core.prompt_lookup import PromptLookup

        if variant.method == "pld":
            return PromptLookup()
        if variant.method == "dflash":
            return make_policy("chain")
        if variant.budget == "auto":  # no clock: replayable; one memory per configuration, as in one live process
            memory = self.memories.setdefault((temperature, variant.label), RoundMemory())
            auto = AutoBudget(cost, cap=self.cap, memory=memory)
            return LookupTreePolicy(auto) if variant.lookup else auto
        return LookupTreePolicy(variant.budget) if variant.lookup else make_policy(variant.budget)

    def replay_turn(self, base: SampleRecord, input_ids: torch.Tensor, output_ids: Sequence[int],
                    max_new_tokens: int | None = None) -> list[SampleRecord]:
        """Priced records of plain decoding and every variant on ``output_ids`` (plain decoding's output after
        ``input_ids`` [1, T], generated with ``max_new_tokens``, default the run's); ``base`` gives the record fields
        of the turn (dataset, sample, turn, temperature, seed, dtype). Empty when the output leaves no round to
        replay (one token)."""
        from dflash_core.replay import draft_hidden_all_rounds, replay

        output_ids = list(output_ids)
        if len(output_ids) < 2:
            return []
        target, draft = self.models.target, self.models.draft
        prompt_len = int(input_ids.shape[1])
        full = torch.cat([input_ids[0].cpu(), torch.tensor(output_ids, dtype=torch.long)])
        cost = self._cost(prompt_len)
        hidden = draft_hidden_all_rounds(target, draft, full, prompt_len)
        steps = len(output_ids) - 1  # tokens after the prefill's: one plain step each
        out = [self._record(base, Variant("ar"), [1] * steps, [0] * steps, steps * float(cost.verify(0)), cost)]
        for variant in self.variants:
            policy = self._policy(variant, cost, base.temperature)
            got = replay(target, draft, policy, full, prompt_len, max_new_tokens or self.max_new_tokens,
                         self.models.stop_token_ids, hidden)
            seconds = round_seconds(cost, got.tree_sizes, drafted=bool(getattr(policy, "uses_draft", True)))
            out.append(self._record(base, variant, got.acceptance_lengths, got.tree_sizes, seconds, cost))
        return out

    def _record(self, base: SampleRecord, variant: Variant, lengths: list[int], sizes: list[int], seconds: float,
                cost) -> SampleRecord:
        extra = {EXTRA_REPLAYED: True, EXTRA_TREE_SIZES: [int(s) for s in sizes], "cost_context": cost.context}
        return SampleRecord(
            dataset=base.dataset, sample_id=base.sample_id, turn=base.turn, variant=variant,
            temperature=base.temperature,
            num_input_tokens=base.num_input_tokens, num_new_tokens=base.num_new_tokens, prefill_s=0.0,
            decode_s=round(seconds, 6), acceptance_lengths=[int(n) for n in lengths], stage_times={},
            matches_ar=None, seed=base.seed, dtype=base.dtype, extra=extra)

    def estimate_turn_s(self, input_ids: torch.Tensor, output_ids: Sequence[int], temperature: float,
                        generated_with: int) -> float:
        """Seconds one replayed turn of the run's ``max_new_tokens`` is projected to take here: one turn on the
        (short) ``output_ids`` (plain decoding's with ``generated_with`` new tokens at most) timed, the part that
        grows with the tokens (the rounds) scaled to ``max_new_tokens``. The round memories are left as they were."""
        from dflash_core.replay import draft_hidden_all_rounds

        output_ids = list(output_ids)
        if len(output_ids) < 2:
            return 0.0
        saved = dict(self.memories)
        full = torch.cat([input_ids[0].cpu(), torch.tensor(output_ids, dtype=torch.long)])
        t0 = time.perf_counter()
        draft_hidden_all_rounds(self.models.target, self.models.draft, full, int(input_ids.shape[1]))
        t1 = time.perf_counter()
        base = SampleRecord(dataset="warmup", sample_id="warmup", turn=0, method="ar", budget=None, policy="ar",
                            temperature=temperature, num_input_tokens=int(input_ids.shape[1]),
                            num_new_tokens=len(output_ids), prefill_s=0.0, decode_s=0.0, acceptance_lengths=[])
        self.memories = {}
        self.replay_turn(base, input_ids, output_ids, generated_with)
        t2 = time.perf_counter()
        self.memories = saved
        rounds_s = max(0.0, (t2 - t1) - (t1 - t0))  # replay_turn drafts once more: take that pass off
        return (t1 - t0) + rounds_s * self.max_new_tokens / len(output_ids)
