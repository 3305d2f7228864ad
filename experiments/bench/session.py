"""One session of one model pair: the conversations to run, and the loop that measures every variant on them.

For every (temperature, dataset, sample, turn) the session generates with every method variant back to back on the
same prompt: AR first (the reference for ``matches_ar`` and, for MT-Bench, the shared conversation history), then
the others in an order that rotates from turn to turn, so drift and noise hit all methods alike. Each variant gets
an untimed warm-up before anything is timed (:meth:`Session.warm_up`).
"""

from __future__ import annotations

import math
import time
import zlib
from typing import TYPE_CHECKING, Any, Sequence

import torch

from dflash_core.training.pools.catalog import build_chat
from experiments.bench.console import log
from experiments.bench.conversation import Conversation
from experiments.bench.models import Models
from experiments.bench.presets import Preset
from experiments.bench.run_folder import RunFolder
from experiments.bench.schema import EXTRA_AR_MARGIN, EXTRA_LOOKUP_TOKENS, EXTRA_TREE_SIZES, SampleRecord, record_key
from experiments.bench.sizing import TurnCosts
from experiments.bench.variants import Variant, generate

if TYPE_CHECKING:
    from experiments.bench.replayer import Replayer

__all__ = ["Session", "StopRun", "first_mismatch", "generation_seed", "top2_margin"]

WARMUP_PROMPT = "Count from one to ten."


def generation_seed(seed: int, dataset: str, sample_id: str, turn: int) -> int:
    """The sampling seed of one turn, shared by every method variant (stable across runs and ranks)."""
    return zlib.crc32(f"{seed}:{dataset}:{sample_id}:{turn}".encode()) & 0x7FFFFFFF


def _answer_text(tokenizer, token_ids: Sequence[int], stops: Sequence[int]) -> str:
    ids = list(token_ids)
    while ids and ids[-1] in stops:
        ids.pop()
    return tokenizer.decode(ids, skip_special_tokens=True)


def first_mismatch(output: Sequence[int], reference: Sequence[int]) -> int | None:
    """Index of the first token where ``output`` leaves ``reference`` (None when equal)."""
    if list(output) == list(reference):
        return None
    return next((i for i, (a, b) in enumerate(zip(output, reference)) if a != b), min(len(output), len(reference)))


@torch.inference_mode()
def top2_margin(target, prompt_ids: torch.Tensor, continuation: Sequence[int], index: int) -> float:
    """Top-1 minus top-2 logit of the target's next-token distribution after ``prompt_ids`` [1, T] followed by
    ``continuation[:index]`` (one teacher-forced forward, in the target's dtype)."""
    device = target.lm_head.weight.device
    ids = torch.cat([prompt_ids[0], torch.tensor(list(continuation[:index]), dtype=torch.long)])[None].to(device)
    top = target(input_ids=ids, use_cache=False, logits_to_keep=1).logits[0, -1].float().topk(2).values
    return float(top[0] - top[1])


def _record(variant: Variant, conv: Conversation, turn: int, result, seed: int, models: Models, wall_s: float,
            reference: list[int] | None, order: int, input_ids: torch.Tensor | None = None) -> SampleRecord:
    """``reference``: AR's output to compare with (greedy only), or None; ``input_ids``: the prompt, to price where
    an output first leaves the reference (plain decoding's top-2 margin there, after the timed generation)."""
    timings = dict(result.timings)
    out = list(result.new_token_ids)
    extra: dict[str, Any] = {"output_ids": out, "wall_s": round(wall_s, 6), "order": order,
                             "stopped": bool(out) and out[-1] in models.stop_token_ids}
    matches_ar = None
    if reference is not None and variant.method != "ar":
        extra["first_mismatch"] = first_mismatch(out, reference)  # where a bf16 near-tie flipped the argmax
        matches_ar = extra["first_mismatch"] is None
        at = extra["first_mismatch"]
        if at is not None and input_ids is not None and at < len(reference) and conv.temperature == 0:
            extra[EXTRA_AR_MARGIN] = round(top2_margin(models.target, input_ids, reference, at), 4)
    extra["target_forwards"] = 1 + len(result.acceptance_lengths)  # the prefill, then one verify per round
    if variant.method != "ar":
        extra[EXTRA_TREE_SIZES] = list(result.tree_sizes)
        # the drafter's own estimate per round; None where a proposal has none (PLD's lookups: NaN)
        extra["expected_acceptance"] = [round(float(x), 4) if math.isfinite(x) else None
                                        for x in result.expected_acceptance]
    if getattr(result, "lookup_tokens", None) is not None:  # committed tokens that came from lookup nodes
        extra[EXTRA_LOOKUP_TOKENS] = int(sum(result.lookup_tokens))
    return SampleRecord(
        dataset=conv.item.dataset, sample_id=conv.item.sample_id, turn=turn, variant=variant,
        temperature=conv.temperature,
        num_input_tokens=result.num_input_tokens, num_new_tokens=len(result.new_token_ids),
        prefill_s=float(timings.pop("prefill", 0.0)), decode_s=float(timings.pop("decode", 0.0)),
        acceptance_lengths=list(result.acceptance_lengths), stage_times={k: float(v) for k, v in timings.items()},
        matches_ar=matches_ar, seed=seed, dtype=str(models.dtype).removeprefix("torch."), extra=extra,
    )


class StopRun(Exception):
    """Raised when the generation limit of this session (``--max-generations``) is reached."""


class Session:
    """Runs conversations for one model pair, appending a record per finished generation to ``folder``."""

    def __init__(self, preset: Preset, models: Models, variants: list[Variant], folder: RunFolder,
                 done: dict[tuple, SampleRecord], progress, max_generations: int | None = None,
                 replayer: "Replayer | None" = None) -> None:
        self.preset, self.models, self.variants = preset, models, variants
        self.folder, self.done, self.progress = folder, done, progress
        self.remaining = max_generations
        self.replayer = replayer  # replays every turn on plain decoding's text (experiments.bench.replayer), or None
        self.replayed = folder.replayed_keys() if replayer is not None else set()
        self.replay_turn_s = 0.0  # projected seconds of one replayed turn (measured in the warm-up)
        self.turn_costs = TurnCosts()  # what a turn costs besides decoding (measured in the warm-up)
        self.ar = Variant("ar") if Variant("ar") in variants else None
        self.others = [v for v in variants if v.method != "ar"]
        self.chat_kwargs = dict(models.pair.chat_template_kwargs) or None
        self.filters = {"top_k": preset.top_k, "top_p": preset.top_p, "min_p": preset.min_p}
        self.memories: dict[tuple[float, str], Any] = {}  # (temperature, label) -> auto's RoundMemory

    def at(self, temperature: float) -> list[Variant]:
        """The variants measured at ``temperature``: at T = 0 a sampled tree IS the top-K tree (nothing to sample;
        ``make_policy`` returns it), so it is measured once, as ``topk``, not recorded twice under two labels."""
        return [v for v in self.variants if temperature > 0 or v.tree != "sampled"]

    def pending(self, conv: Conversation) -> int:
        item = conv.item
        return sum(record_key(item.dataset, item.sample_id, turn, v, conv.temperature) not in self.done
                   for turn in range(conv.num_turns) for v in self.at(conv.temperature))

    def memory(self, variant: Variant, temperature: float):
        """``auto``'s round memory for ``variant`` at ``temperature``, None for other methods: one per model pair
        (this session), method and temperature, kept across the run's prompts and warm-ups, so that what ``auto``
        learnt carries over from one generation to the next, as it would in a serving process."""
        if variant.budget not in ("auto", "chain-auto"):
            return None
        from ddtree import RoundMemory

        return self.memories.setdefault((temperature, variant.label), RoundMemory())

    def _generate(self, variant: Variant, input_ids: torch.Tensor, temperature: float, seed: int):
        t0 = time.perf_counter()
        result = generate(variant, self.models, input_ids, self.preset.max_new_tokens, temperature, seed,
                          self.memory(variant, temperature), self.filters)
        return result, time.perf_counter() - t0

    def _write(self, record: SampleRecord) -> None:
        self.folder.append(record)
        self.done[record.record_key()] = record
        self.progress.update(1)
        self.progress.set_postfix_str(f"{record.dataset} {record.spec.label} τ={record.tau or 0:.2f}", refresh=False)
        if self.remaining is not None:
            self.remaining -= 1
            if self.remaining <= 0:
                raise StopRun

    def _reference(self, conv: Conversation, turn: int, input_ids: torch.Tensor, seed: int) -> list[int] | None:
        """AR's output for this turn: from its record, freshly generated (and recorded), or None when AR is not
        measured and nothing needs it."""
        item, t = conv.item, conv.temperature
        if self.ar is not None:
            record = self.done.get(record_key(item.dataset, item.sample_id, turn, self.ar, t))
            if record is not None and "output_ids" in record.extra:
                return list(record.extra["output_ids"])
            result, wall = self._generate(self.ar, input_ids, t, seed)
            if record is None:
                self._write(_record(self.ar, conv, turn, result, seed, self.models, wall, None, order=0))
            return result.new_token_ids
        if turn + 1 < conv.num_turns:  # not measured, but the next turn continues AR's answer
            return self._generate(Variant("ar"), input_ids, t, seed)[0].new_token_ids
        return None

    def run(self, conv: Conversation) -> None:
        item, t = conv.item, conv.temperature
        answers: list[str] = []
        for turn in range(conv.num_turns):
            keys = {v: record_key(item.dataset, item.sample_id, turn, v, t) for v in self.at(t)}
            later_pending = any(record_key(item.dataset, item.sample_id, later, v, t) not in self.done
                                for later in range(turn + 1, conv.num_turns) for v in self.at(t))
            if not later_pending and all(k in self.done for k in keys.values()) and not self._replay_pending(
                    conv, turn):
                continue  # nothing left in this turn, and no later turn needs its answer
            ids = build_chat(self.models.tokenizer, item.turns[: turn + 1], answers,
                             chat_template_kwargs=self.chat_kwargs)
            input_ids = torch.tensor([ids], dtype=torch.long)
            seed = generation_seed(self.preset.seed, item.dataset, item.sample_id, turn)
            reference = self._reference(conv, turn, input_ids, seed)
            shift = (conv.index + turn) % max(len(self.others), 1)
            for order, variant in enumerate(self.others[shift:] + self.others[:shift], start=1):
                if variant not in keys or keys[variant] in self.done:
                    continue
                result, wall = self._generate(variant, input_ids, t, seed)
                # at T > 0 sample-and-match draws each committed token exactly as plain decoding does (one draw per
                # token from the same seeded generator), so top-K trees, chains and lookups should reproduce AR's
                # sampled output too (exactly in fp32); sampled trees verify by rejection sampling: other draws
                compare_with = reference if t == 0 or variant.tree != "sampled" else None
                self._write(_record(variant, conv, turn, result, seed, self.models, wall, compare_with, order,
                                    input_ids))
            self._replay(conv, turn, input_ids, reference)
            if turn + 1 < conv.num_turns:
                answers.append(_answer_text(self.models.tokenizer, reference or [], self.models.stop_token_ids))

    def _replay_pending(self, conv: Conversation, turn: int) -> bool:
        """Whether this turn still waits for its replay (plain decoding's replayed row is written last)."""
        if self.replayer is None or self.ar is None:
            return False
        return record_key(conv.item.dataset, conv.item.sample_id, turn, self.ar, conv.temperature) not in self.replayed

    def _replay(self, conv: Conversation, turn: int, input_ids: torch.Tensor, reference: list[int] | None) -> None:
        """Replay this turn's rounds for every replayed policy on plain decoding's output (once per turn)."""
        if reference is None or not self._replay_pending(conv, turn):
            return
        base = self.done.get(record_key(conv.item.dataset, conv.item.sample_id, turn, self.ar, conv.temperature))
        if base is None:
            return
        records = self.replayer.replay_turn(base, input_ids, reference)
        self.folder.append_replayed(records)
        self.replayed.update(r.record_key() for r in records)

    def calibrate(self, todo: Sequence[Conversation]) -> dict[str, Any] | None:
        """Measure ``auto``'s cost curves for every context bucket the run's prompts can reach, before anything is
        timed (cached per machine: a later run pays nothing); None when no variant sizes its trees."""
        adaptive = {v.budget for v in self.variants if v.budget in ("auto", "chain-auto")}
        adaptive = sorted(adaptive | ({"auto"} if self.replayer is not None else set()))  # replay prices rounds
        if not adaptive or self.models.draft is None:
            return None
        from ddtree.cost import calibrate

        lengths = [len(build_chat(self.models.tokenizer, c.item.turns[:1], chat_template_kwargs=self.chat_kwargs))
                   for c in todo]
        turns = max(c.num_turns for c in todo)  # a later turn adds the answer and the next question
        longest = max(lengths) * turns + (turns - 1) * self.preset.max_new_tokens + self.preset.max_new_tokens
        contexts = [1 << k for k in range(max(min(lengths), 1).bit_length() - 1, longest.bit_length() + 1)]
        t0 = time.perf_counter()
        for budget in adaptive:
            calibrate(self.models.target, self.models.draft, contexts=contexts, chain=budget == "chain-auto")
        seconds = round(time.perf_counter() - t0, 3)
        log(f"{self.models.pair.slug}: cost curves for {', '.join(adaptive)} at contexts up to {contexts[-1]} ready "
            f"in {seconds:.1f} s, before any timed generation (cached per machine)")
        return {"policies": adaptive, "contexts": contexts, "seconds": seconds}

    def warm_up(self, todo: Sequence[Conversation] = ()) -> tuple[dict[Variant, float], dict[Variant, float]]:
        """One short untimed generation per variant (kernels, allocator), twice, on the run's median-length first
        turn (a fixed short prompt without ``todo``): the second one's decoding seconds per token and its prefill
        seconds, per variant, size the run (``experiments.bench.sizing.size_run``) at the context the run will see."""
        chats = sorted((build_chat(self.models.tokenizer, c.item.turns[:1], chat_template_kwargs=self.chat_kwargs)
                        for c in todo), key=len)
        ids = chats[len(chats) // 2] if chats else build_chat(self.models.tokenizer, [WARMUP_PROMPT],
                                                               chat_template_kwargs=self.chat_kwargs)
        input_ids = torch.tensor([ids], dtype=torch.long)
        t = max((c.temperature for c in todo), default=0.0)  # sampling accepts less: size for the slowest
        per_token, per_call = {}, {}
        for variant in self.variants:
            generate(variant, self.models, input_ids, self.preset.warmup_tokens, t, 0, self.memory(variant, t),
                     self.filters)
            result = generate(variant, self.models, input_ids, self.preset.warmup_tokens, t, 0,
                              self.memory(variant, t), self.filters)
            per_token[variant] = result.timings.get("decode", 0.0) / max(1, len(result.new_token_ids) - 1)
            per_call[variant] = result.timings.get("prefill", 0.0)
            if variant.method == "ar" and self.replayer is not None:  # one replayed turn, scaled to the run's
                self.replay_turn_s = self.replayer.estimate_turn_s(input_ids, result.new_token_ids, t,
                                                                   self.preset.warmup_tokens)
        ar_prefill = next((per_call[v] for v in self.variants if v.method == "ar"), max(per_call.values(), default=0))
        check = ar_prefill * (len(ids) + self.preset.max_new_tokens) / max(len(ids), 1)  # prompt + the answer
        self.turn_costs = TurnCosts(self.replay_turn_s, check, self._context_scale(todo, len(ids)))
        return per_token, per_call

    def _turn_length(self, conv: Conversation, turn: int) -> int:
        """Tokens before a turn's answer: its chat (earlier answers empty) plus the earlier answers' tokens."""
        ids = build_chat(self.models.tokenizer, conv.item.turns[: turn + 1], [""] * turn,
                         chat_template_kwargs=self.chat_kwargs)
        return len(ids) + turn * self.preset.max_new_tokens

    def _context_scale(self, todo: Sequence[Conversation], warm_length: int) -> dict[tuple[int, int], float]:
        """{(conversation, turn): how much slower a step is at the turn's context than at ``warm_length``}: the
        measured cost curves' one-token step at the two context buckets (none when :meth:`calibrate` measured no
        curve: 1.0), within [0.5, 4] (a curve disturbed while it was measured must not size the run alone)."""
        priced = self.replayer is not None or any(v.budget in ("auto", "chain-auto") for v in self.variants)
        if self.models.draft is None or not priced:  # no curves measured by :meth:`calibrate`: measure none here
            return {}
        from ddtree.cost import context_bucket, default_cap, measure_cost_model

        cap = default_cap(self.models.device)
        steps: dict[int, float] = {}

        def step(length: int) -> float:
            bucket = context_bucket(length)
            if bucket not in steps:
                curve = measure_cost_model(self.models.target, self.models.draft, context=bucket, cap=cap,
                                           extrapolate=True)
                steps[bucket] = float(curve.verify(0))
            return steps[bucket]

        base = step(warm_length + self.preset.max_new_tokens // 2)
        return {(c.index, turn): min(4.0, max(0.5, step(self._turn_length(c, turn) + self.preset.max_new_tokens // 2)
                                               / base))
                for c in todo for turn in range(c.num_turns)}

    def restrict(self, variants: list[Variant]) -> None:
        """Measure only ``variants`` in this session (a sized run)."""
        self.variants = [v for v in self.variants if v in variants]
        self.others = [v for v in self.others if v in variants]
