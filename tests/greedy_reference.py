"""Independent references for the decode loop's outputs, sharing no code with it.

:func:`greedy_reference` is greedy decoding written the slow, obvious way: no KV cache, no adapter, no tree mask --
one full forward of the target over the whole growing sequence per token, then its argmax. A prefill, cache,
compaction or position bug in the loop cannot cancel out of a comparison with it, as it would with the loop's own
plain decoding (``autoregressive_generate`` is the loop with a zero-node policy).

:func:`exact_joint` is the exact distribution of the first tokens under plain sampling at temperature T, again from
full forwards, for the chi-square tests of the loop.
"""

from __future__ import annotations

from typing import Iterable

import torch


@torch.no_grad()
def greedy_reference(target, input_ids: torch.Tensor, max_new_tokens: int,
                     stop_token_ids: Iterable[int] = ()) -> list[int]:
    """The target's greedy continuation of ``input_ids`` [1, T]: argmax of a cache-free full forward over the
    sequence so far, up to and including the first stop token, at most ``max_new_tokens`` tokens."""
    stops = set(int(t) for t in stop_token_ids)
    seq = input_ids[0].tolist()
    out: list[int] = []
    while len(out) < max_new_tokens:
        logits = target(input_ids=torch.tensor([seq + out]), use_cache=False).logits[0, -1]
        out.append(int(logits.argmax()))
        if out[-1] in stops:
            break
    return out


@torch.no_grad()
def exact_joint(target, input_ids: torch.Tensor, steps: int, temperature: float = 1.0,
                stop_token_ids: Iterable[int] = (), distribution=None) -> dict[tuple[int, ...], float]:
    """Exact probability of every sequence of the first ``steps`` new tokens under plain sampling from
    softmax(logits / temperature) (or ``distribution(logits)`` [V] -> [V] probabilities, e.g. transformers' own
    top-k / top-p / min-p warpers); a sequence ends early at a stop token (it is then shorter)."""
    stops = set(int(t) for t in stop_token_ids)
    vocab = target.config.vocab_size
    done: dict[tuple[int, ...], float] = {}
    probs = {(): 1.0}
    for _ in range(steps):
        nxt = {}
        for seq, pr in probs.items():
            ids = torch.tensor([input_ids[0].tolist() + list(seq)])
            logits = target(input_ids=ids, use_cache=False).logits[0, -1].double()
            dist = torch.softmax(logits / temperature, -1) if distribution is None else distribution(logits)
            for t in range(vocab):
                (done if t in stops else nxt)[seq + (t,)] = pr * float(dist[t])
        probs = nxt
    return {**done, **probs}
