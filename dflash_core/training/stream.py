"""A training stream at the machine's teacher-forced ceiling: every step reads fresh sequences, one batched target pass
gives their features and soft labels, and the drafter trains on them straight away.

Where :mod:`.fit` trains on features kept from generation (and so on the few tokens generation could afford), the
stream draws each step's sequences from a mix of sources (``mix``): ``generated`` (the target's own answers, the
committed token shards: on-policy) and the offline text corpus (:mod:`.textcorpus`: ``code``, ``math``, ``docs``).
One teacher-forced target forward over the step's padded batch gives

* the tapped hidden states (the drafter's context features), and
* the target's log-distribution over the drafter's draft vocabulary at every position: dense soft labels (the final
  normed hidden state times the draft vocabulary's rows of the LM head, so the full 49K-row head is never computed).

Corpus text is not the target's writing, so its hard labels are not what the target would say: its sequences train on
the soft labels alone (``distill_weight`` 1); generated sequences keep the recipe's mix of hard and soft labels.

The stream's position (:class:`Cursor`: files read per corpus kind, generated sequences used, steps) travels with the
checkpoint and, through the committed training log, to the next run on a fresh machine, which continues with
sequences no earlier run has seen. The learning-rate schedule follows the TOKENS planned for this run (fixed after
the first steps from the measured rate and the time budget), so a paused or shared CPU delays the run but never
shortens its schedule.
"""

from __future__ import annotations

import bisect
import copy
import dataclasses
import hashlib
import json
import math
import random
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterator

import torch

from ..files import atomic_write
from ..model import DFlashDraftModel
from ..target import tapped_forward
from .anchors import sample_anchors
from .train_config import TrainConfig
from .loop import _lr_factor, batch_weight, load_checkpoint, make_optimizer, optimizer_step
from .loss import SequenceFeatures

__all__ = ["Cursor", "StreamSequence", "SequenceStream", "teacher_forced_batch", "StreamState", "stream_train"]

KINDS = ("generated", "code", "math", "docs")
_RANKS = 16 ** 15  # ranks of generated sequences in an epoch's order: 60-bit hashes


@dataclass
class Cursor:
    """Where a stream stands: per corpus kind the next item ([file position, item index in that file]; a bare file
    position means its first item), generated sequences drawn, sequences drawn in all.

    ``generated_at``: the place of the last generated sequence drawn, [epoch, rank, key] in the epoch's order (see
    :meth:`SequenceStream.generated_order`); None: the start of epoch 0, or, for a cursor written before it existed,
    the share ``generated`` mod n of that epoch. The place names a sequence, not an offset into n sequences, so a
    cursor stays valid when shards are added: no sequence is drawn twice or skipped in the epoch, and an added one
    joins the epoch when its rank lies ahead (else it is first drawn in the next epoch).

    Inside a window (see :class:`SequenceStream`) the cursor stays at the window's start and ``taken`` counts its
    steps handed out (trained on), ``window`` = [sequences per step, steps] its shape: a checkpoint saved mid-window
    resumes with exactly the window's remaining steps (the window is drawn again from its start, keyed by the same
    cursor, and the steps taken are left out); at a window's end the cursor moves past it (``taken`` 0)."""

    files: dict[str, list[int] | int] = field(default_factory=dict)
    generated: int = 0
    slots: int = 0  # sequences drawn in all (the mixing draw is keyed by it)
    generated_at: list | None = None
    taken: int = 0  # steps of the window starting here already handed out
    window: list[int] | None = None  # [seqs_per_step, window_steps] of that window (None: no window begun)


@dataclass
class StreamSequence:
    key: str
    kind: str
    ids: torch.Tensor  # [T] prompt + response
    prompt_len: int

    @property
    def response_tokens(self) -> int:
        return len(self.ids) - self.prompt_len


class SequenceStream:
    """Sequences in a seeded mix of sources, grouped into steps of similar length.

    ``generated``: [(key, ids [T], prompt length)] (the on-policy data; drawn in a seeded order, epoch after epoch;
    as in the epoch trainer, a sequence with fewer than 2 response tokens within ``max_len`` -- no anchor with a label
    after it -- is left out and counted in ``stats["generated_too_short"]``);
    ``end_ids``: the token(s) that end an assistant turn, appended to every corpus answer;
    the corpus kinds are read lazily through :func:`.textcorpus.iter_items` from the cursor's file positions. Each
    window of ``window_steps`` steps is drawn first, sorted by length and cut into steps (less padding in the batched
    target pass), and the steps of a window come in a seeded order. ``cursor`` is where a resumed stream continues
    (:class:`Cursor`: inside a window, its start and the steps taken); setting it restarts the stream there.
    """

    def __init__(self, tokenizer, mix: dict[str, float], cursor: Cursor, seqs_per_step: int, max_len: int,
                 end_ids: list[int], generated: list[tuple[str, torch.Tensor, int]] = (), seed: int = 0,
                 window_steps: int = 8, sources=None, banned: set[int] | None = None) -> None:
        unknown = set(mix) - set(KINDS)
        if unknown or not mix or min(mix.values()) < 0 or sum(mix.values()) <= 0:
            raise ValueError(f"mix must give non-negative weights to some of {KINDS}, got {mix}")
        if mix.get("generated", 0) > 0 and not generated:
            raise ValueError("the mix asks for generated sequences but none were given (pass --generated-data)")
        self.tokenizer, self.seed = tokenizer, seed
        self.mix = {k: v for k, v in mix.items() if v > 0}
        self.seqs_per_step, self.max_len, self.window_steps = seqs_per_step, max_len, window_steps
        self.generated = [g for g in generated if min(len(g[1]), max_len) - g[2] >= 2]
        self.sources, self.banned = sources, banned
        self.stats: dict = {"dropped": 0, "generated_too_short": len(generated) - len(self.generated)}
        if mix.get("generated", 0) > 0 and not self.generated:
            raise ValueError(f"none of the {len(generated)} generated sequences has 2 response tokens within max_len "
                             f"{max_len}: raise max_len or regenerate the data with shorter prompts")
        self._end = list(end_ids)  # appended to every corpus answer: the end of an assistant turn
        self._order: tuple[int, list] | None = None  # (epoch, its order of the generated sequences)
        self.cursor = cursor

    @property
    def cursor(self) -> Cursor:
        return self._cursor

    @cursor.setter
    def cursor(self, cursor: Cursor) -> None:
        self._cursor = cursor
        self._head = copy.deepcopy(cursor)  # where drawing stands (ahead of the cursor inside a window)
        self._iters: dict[str, Iterator] = {}  # per corpus kind, reading from the head's file position
        self._pending: list[list[StreamSequence]] = []

    def _corpus_next(self, kind: str) -> StreamSequence | None:
        from .pools.catalog import build_chat
        from .textcorpus import iter_items

        while True:
            if kind not in self._iters:
                self._iters[kind] = iter_items(kind, self._head.files.get(kind, 0), self.seed, self.sources,
                                               self.banned, self.stats)
            try:
                (pos, k), item = next(self._iters[kind])
            except StopIteration:
                return None  # this kind is used up
            self._head.files[kind] = [pos, k + 1]  # the next item to read
            prompt = build_chat(self.tokenizer, [item.request])
            response = list(self.tokenizer.encode(item.response, add_special_tokens=False)) + self._end
            ids = (prompt + response)[: self.max_len]
            if len(ids) - len(prompt) >= 16:
                return StreamSequence(item.item_id, kind, torch.tensor(ids), len(prompt))

    def generated_order(self, epoch: int) -> list[tuple[int, str, int]]:
        """Epoch ``epoch``'s order of the generated sequences: sorted [(rank, name, index)], the rank a seeded hash
        of the sequence's key (a repeated key is named ``key~2``, ``key~3``, ...), so that it does not depend on
        how many sequences there are."""
        if self._order is None or self._order[0] != epoch:
            seen: dict[str, int] = {}
            ranked = []
            for i, (key, _, _) in enumerate(self.generated):
                seen[key] = seen.get(key, 0) + 1
                name = key if seen[key] == 1 else f"{key}~{seen[key]}"
                digest = hashlib.sha256(f"stream-generated:{self.seed}:{epoch}:{name}".encode()).hexdigest()
                ranked.append((int(digest[:15], 16), name, i))
            self._order = (epoch, sorted(ranked))
        return self._order[1]

    def _generated_place(self) -> tuple[int, tuple]:
        """(epoch, the place in its order after which the next generated sequence comes)."""
        at = self._head.generated_at
        if at is not None:
            return int(at[0]), (int(at[1]), str(at[2]), math.inf)
        epoch, offset = divmod(self._head.generated, len(self.generated))  # a cursor from before: a share of it
        return epoch, (offset * _RANKS // len(self.generated) - 1, "", math.inf)

    def _generated_next(self) -> StreamSequence:
        epoch, after = self._generated_place()
        order = self.generated_order(epoch)
        j = bisect.bisect_right(order, after)
        if j == len(order):  # the epoch is done
            epoch, order, j = epoch + 1, self.generated_order(epoch + 1), 0
        rank, name, i = order[j]
        key, ids, p = self.generated[i]
        self._head.generated += 1
        self._head.generated_at = [epoch, rank, name]
        return StreamSequence(f"{key}@e{epoch}", "generated", ids[: self.max_len], p)

    def _draw(self) -> StreamSequence | None:
        kinds = sorted(self.mix)
        while kinds:
            rng = random.Random(f"stream-mix:{self.seed}:{self._head.slots}")
            kind = rng.choices(kinds, weights=[self.mix[k] for k in kinds])[0]
            seq = self._generated_next() if kind == "generated" else self._corpus_next(kind)
            if seq is not None:
                self._head.slots += 1
                return seq
            kinds.remove(kind)  # used up: the others share its weight from now on
            self.mix.pop(kind)
        return None

    def next_step(self) -> list[StreamSequence]:
        """The sequences of the next step (fewer than ``seqs_per_step`` only when every source is used up); the
        caller trains on it before asking for the next (the cursor counts it as taken)."""
        if not self._pending:
            self._pending = self._window()
        step = self._pending.pop() if self._pending else []
        if self._pending:
            self._cursor.taken += 1
        else:  # the window is done: the cursor moves past it
            for f in dataclasses.fields(Cursor):
                setattr(self._cursor, f.name, copy.deepcopy(getattr(self._head, f.name)))
        return step

    def _window(self) -> list[list[StreamSequence]]:
        """The steps of the window starting at the cursor, in the order :meth:`next_step` pops them, less the
        ``cursor.taken`` steps already handed out (a stream resumed mid-window; drawn in the shape recorded)."""
        start = self._cursor
        per_step, steps = start.window or (self.seqs_per_step, self.window_steps)
        self._head = dataclasses.replace(copy.deepcopy(start), taken=0, window=None)
        window = []
        for _ in range(per_step * steps):
            seq = self._draw()
            if seq is None:
                break
            window.append(seq)
        window.sort(key=lambda s: len(s.ids))
        cut = [window[i:i + per_step] for i in range(0, len(window), per_step)]
        random.Random(f"stream-window:{self.seed}:{self._head.slots}").shuffle(cut)
        start.window = [per_step, steps]
        return cut[: max(0, len(cut) - start.taken)]


@torch.no_grad()
def teacher_forced_batch(target, draft: DFlashDraftModel, seqs: list[torch.Tensor],
                         distill_weights: list[float | None] | None = None) -> list[SequenceFeatures]:
    """One target forward over the right-padded batch of ``seqs`` (each [T_i]): per sequence its tapped features
    [T_i, taps*H] and the target's log-distribution over the drafter's draft vocabulary [T_i, V'].

    Right padding needs no attention mask: under causal attention a real position never sees the pads after it.
    """
    if draft.draft_vocab is None:
        raise ValueError("the stream's soft labels are over a draft vocabulary: give the drafter one (set_draft_vocab)")
    device = target.lm_head.weight.device
    lengths = [len(s) for s in seqs]
    x = torch.zeros((len(seqs), max(lengths)), dtype=torch.long)
    for i, s in enumerate(seqs):
        x[i, : len(s)] = s
    out = tapped_forward(target, x.to(device), draft.config.target_layer_ids, head=False, use_cache=False)
    feats = out.features  # [B, T, taps*H]
    head = draft.head_rows(target.lm_head.weight)  # [V', H] the draft vocabulary's rows of the target's head
    logp = torch.log_softmax((out.last_hidden @ head.t()).float(), dim=-1)  # [B, T, V']
    weights = distill_weights or [None] * len(seqs)
    return [SequenceFeatures(feats[i, :n], None, None, soft_logp=logp[i, :n], distill_weight=weights[i])
            for i, n in enumerate(lengths)]


@dataclass
class StreamState:
    step: int = 0
    tokens: int = 0  # response tokens trained on in this run (sequences' anchorable part)
    planned_tokens: int | None = None  # the schedule's length, fixed after the first steps
    target_seconds: float = 0.0  # in the teacher-forced target passes
    target_tokens: int = 0  # real (unpadded) tokens through them
    train_seconds: float = 0.0  # whole steps (target pass + drafter step)
    cursor: Cursor = field(default_factory=Cursor)
    history: list[dict] = field(default_factory=list)
    by_kind: dict[str, int] = field(default_factory=dict)  # response tokens per source kind

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> "StreamState":
        return cls(**{**d, "cursor": Cursor(**d["cursor"])})


def _resume_stream(ckpt: Path, draft, optimizer, dev, state: StreamState, log) -> StreamState:
    """The run's state: from ``checkpoint.pt`` when there is one (weights and optimizer restored), else ``state``."""
    if not ckpt.is_file():
        return state
    blob = load_checkpoint(ckpt, dev)
    draft.load_state_dict(blob["draft"])
    optimizer.load_state_dict(blob["optimizer"])
    state = StreamState.from_dict(json.loads(blob["stream_state"]))
    log(f"stream: resumed from {ckpt} at step {state.step}, {state.tokens} tokens")
    return state


def _save_stream_checkpoint(ckpt: Path, draft, optimizer, state: StreamState) -> None:
    """Write drafter, optimizer and the stream state (as JSON, cursor included) to ``ckpt`` atomically."""
    blob = {"draft": draft.state_dict(), "optimizer": optimizer.state_dict(),
            "stream_state": json.dumps(state.to_dict()), "config": draft.config.to_dict()}
    atomic_write(ckpt, lambda tmp: torch.save(blob, tmp))


def _stream_eval(draft, evaluate, state: StreamState, log) -> None:
    """Evaluate the drafter (when there is an ``evaluate``) and add the result, with the token count, to the history."""
    if evaluate is None:
        return
    t0 = time.perf_counter()
    draft.eval()
    ev = evaluate(draft)
    draft.train()
    entry = {"step": state.step, "tokens": state.tokens, **ev, "eval_seconds": time.perf_counter() - t0}
    state.history.append(entry)
    brief = {k: v for k, v in ev.items() if not isinstance(v, (dict, list))}
    log(f"stream: eval at {state.tokens} tokens (step {state.step}, {entry['eval_seconds']:.0f} s): {brief}")


def _train_step(target, draft, optimizer, seqs: list[StreamSequence], state: StreamState, cfg: TrainConfig,
                gen: torch.Generator) -> tuple[dict, float, float]:
    """One step on ``seqs``: the batched target pass, anchors keyed by (seed, step, slot), one optimizer step at the
    learning rate of the token schedule. Returns (the step's stats, its learning rate, seconds in the target pass)."""
    t0 = time.perf_counter()
    feats = teacher_forced_batch(target, draft, [s.ids for s in seqs],
                                 [None if s.kind == "generated" else 1.0 for s in seqs])
    t_target = time.perf_counter() - t0
    anchors = [sample_anchors(s.prompt_len, len(s.ids), cfg.anchors,
                              torch.Generator().manual_seed(hash((cfg.seed, state.step, j)) % 2**62))
               for j, s in enumerate(seqs)]
    wsum = sum(batch_weight(s.ids, a, draft.block_size, draft.mask_token_id, cfg.gamma)
               for s, a in zip(seqs, anchors))
    progress = 0.0 if state.planned_tokens is None else state.tokens / state.planned_tokens
    lr = cfg.lr * _lr_factor(progress, cfg.warmup_frac, cfg.min_lr_ratio)
    stats = optimizer_step(draft, optimizer, target.model.embed_tokens, target.lm_head.weight,
                           [(s.ids, f, a) for s, f, a in zip(seqs, feats, anchors)], wsum, cfg, lr, gen)
    return stats, lr, t_target


def _count_step(state: StreamState, seqs: list[StreamSequence], t_target: float, t_step: float) -> None:
    """Count the finished step in ``state``: its response tokens (in all and per source kind) and its times."""
    state.step += 1
    new = sum(s.response_tokens for s in seqs)
    state.tokens += new
    for s in seqs:
        state.by_kind[s.kind] = state.by_kind.get(s.kind, 0) + s.response_tokens
    state.target_seconds += t_target
    state.target_tokens += sum(len(s.ids) for s in seqs)
    state.train_seconds += time.perf_counter() - t_step


def _log_step(state: StreamState, stats: dict, lr: float, log_every: int, log) -> None:
    """Every ``log_every`` steps: the step's record joins the history, and a line with the throughput is logged."""
    record = {"step": state.step, "tokens": state.tokens, "loss": stats["loss"], "acc1": stats["acc1"],
              "lr": lr, "grad_norm": stats["grad_norm"]}
    if state.step % log_every == 0:
        state.history.append(record)
        log(f"stream: step {state.step} tokens {state.tokens} loss {stats['loss']:.4f} acc1 {stats['acc1']:.3f} "
            f"lr {lr:.2e} | target pass {state.target_tokens / state.target_seconds:.0f} tok/s, end to end "
            f"{state.tokens / state.train_seconds:.0f} response tok/s ({state.train_seconds / 60:.1f} min)")


def _plan_tokens(state: StreamState, minutes: float | None, plan_after_steps: int, log) -> None:
    """Fix the run's token plan once ``plan_after_steps`` steps have measured the rate (when none is set yet)."""
    if state.planned_tokens is None and state.step >= plan_after_steps:
        rate = state.tokens / state.train_seconds
        state.planned_tokens = int(rate * minutes * 60)
        log(f"stream: {rate:.0f} response tokens/s over the first {state.step} steps: this run plans "
            f"{state.planned_tokens} tokens ({minutes} min)")


def stream_train(target, draft: DFlashDraftModel, stream: SequenceStream, cfg: TrainConfig, out: Path,
                 log: Callable[[str], None] = print, evaluate: Callable[[DFlashDraftModel], dict] | None = None,
                 minutes: float | None = None, tokens: int | None = None, eval_every_tokens: int = 500_000,
                 state: StreamState | None = None, plan_after_steps: int = 10, log_every: int = 25) -> StreamState:
    """Train ``draft`` from ``stream`` until this run's token plan is used (``tokens``, or what ``minutes`` of
    steps at the rate of the first ``plan_after_steps`` steps give) or the stream runs dry.

    ``out/checkpoint.pt`` (drafter, optimizer, :class:`StreamState` with the cursor) is written every
    ``cfg.ckpt_every`` steps and at the end; a call on a folder holding one resumes it. Every ``log_every`` steps
    the step's loss, accuracy and learning rate join ``state.history``. ``evaluate(draft)`` runs at
    the start, every ``eval_every_tokens`` and at the end; its results land in the history with the token count.
    """
    if (minutes is None) == (tokens is None):
        raise ValueError("give exactly one of minutes and tokens")
    dev = target.lm_head.weight.device
    draft.to(dev).float().train()
    for p in target.parameters():
        p.requires_grad_(False)
    optimizer = make_optimizer(draft, cfg)
    out.mkdir(parents=True, exist_ok=True)
    ckpt = out / "checkpoint.pt"
    state = _resume_stream(ckpt, draft, optimizer, dev, state or StreamState(cursor=stream.cursor), log)
    stream.cursor = state.cursor
    if tokens is not None:
        state.planned_tokens = tokens
    if not state.history or all("tau_chain" not in h for h in state.history):
        _stream_eval(draft, evaluate, state, log)
    next_eval = (state.tokens // eval_every_tokens + 1) * eval_every_tokens
    gen = torch.Generator().manual_seed(cfg.seed)
    while state.planned_tokens is None or state.tokens < state.planned_tokens:
        t_step = time.perf_counter()
        seqs = stream.next_step()
        if not seqs:
            log("stream: every source is used up")
            break
        stats, lr, t_target = _train_step(target, draft, optimizer, seqs, state, cfg, gen)
        _count_step(state, seqs, t_target, t_step)
        _log_step(state, stats, lr, log_every, log)
        _plan_tokens(state, minutes, plan_after_steps, log)
        if state.tokens >= next_eval:
            _stream_eval(draft, evaluate, state, log)
            next_eval += eval_every_tokens
        if state.step % cfg.ckpt_every == 0:
            _save_stream_checkpoint(ckpt, draft, optimizer, state)
    if not state.history or state.history[-1].get("tokens") != state.tokens or "tau_chain" not in state.history[-1]:
        _stream_eval(draft, evaluate, state, log)
    _save_stream_checkpoint(ckpt, draft, optimizer, state)
    draft.eval()
    return state
