"""Memory of one training step: the formula for any shape, and a CPU measurement that checks it.

    python -m dflash_core.training.memory              # the qwen3 preset on Qwen3-8B (the formula, in GiB)
    python -m dflash_core.training.memory --measure    # the same shape scaled down, measured on this CPU vs the formula

A step processes its sequences one at a time (gradient accumulation), so its peak is what stays resident plus the
peak of ONE sequence's forward and backward through :func:`dflash_core.training.loss.sequence_loss`. With Q = A*b
block rows (A anchors), C context rows (up to the sequence length T), K = C + Q keys, N <= A*(b-1) predicted
positions, V' rows of the loss vocabulary (V for ``loss_vocab="full"``), D hidden, h*d / g*d query / key-value widths,
I the MLP width, L drafter layers, t taps and P the drafter's parameters (bf16 autocast, fp32 master weights, bytes):

    resident   = target weights + 16 P (fp32 weights, gradients, two AdamW moments) + T * t*D * 2 (the features)
    layers     = L * (26 Q*D + 12 Q*h*d + 6 K*g*d + 4 K*h*d + 2 Q*K + 8 Q*I + 4 C*D)   activations autograd keeps
    around     = 2 C*t*D + 6 C*D + 8 Q*D + 2 N*D + Q*K + 2 P      fc, norms, the bool mask, autocast weight copies
    loss       = 16 N*V'     log-softmax output kept, plus the two gathers' gradients and the softmax gradient
    peak       = resident + layers + around + loss

The layer term counts what each layer keeps for the backward pass: the fp32 residual stream and RMSNorm outputs, bf16
copies autocast makes for every projection, q/k normed in fp32 plus their bf16 casts, the repeated K/V and the
additive bf16 mask SDPA keeps (the masked kernel gets K/V repeated to the query heads: with ``enable_gqa`` and a mask
it would fall back to the math kernel and keep about L * 10 h*Q*K bytes of scores instead, 148 GB below), and the
MLP's four Q*I tensors. For the ``qwen3`` preset on Qwen3-8B (A=512, b=16, T=C=3072, D=4096, h*d=4096, g*d=1024,
I=12288, L=5, t=5, V=151936, P=1.05e9) that is about 33 GB resident + 12.9 GB layers + 2.7 GB around + 18.7 GB loss
= 67 GB: it fits one 141 GB H200, and the full-vocabulary loss, not attention, is the largest single term
(``loss_vocab="batch"`` divides it by V / V'). Measured on a CPU at 1/32 of the width and 1/8 of the length
(``--measure``), one sequence's forward and backward came within 6-14% of the formula (tests/test_training_devices.py).
Not measured on a GPU: the CUDA kernels' workspaces are not in the formula.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass

import torch

__all__ = ["StepShape", "step_memory", "measure_sequence_peak", "small_pair", "QWEN3_8B_PRESET", "SMALL_PRESET"]


@dataclass(frozen=True)
class StepShape:
    """Everything the memory of a step depends on."""

    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    layers: int
    taps: int
    vocab_rows: int  # V': rows of the loss softmax (the vocabulary for loss_vocab="full")
    anchors: int
    block_size: int
    seq_len: int  # T (the context C is at most T)
    target_params: int
    target_bytes: int = 2
    draft_params: int | None = None  # None: computed from the shape

    @property
    def params(self) -> int:
        if self.draft_params is not None:
            return self.draft_params
        d, q, kv, i = self.hidden, self.heads * self.head_dim, self.kv_heads * self.head_dim, self.intermediate
        per_layer = d * q * 2 + d * kv * 2 + 3 * d * i + 2 * d + 2 * self.head_dim
        return self.layers * per_layer + self.taps * d * d + 2 * d


QWEN3_8B_PRESET = StepShape(hidden=4096, heads=32, kv_heads=8, head_dim=128, intermediate=12288, layers=5, taps=5,
                            vocab_rows=151936, anchors=512, block_size=16, seq_len=3072, target_params=8_190_735_360)
# the same proportions at 1/32 of the width and 1/8 of the length (V/D, I/D, h*d = D, 4 query heads per K/V head,
# anchors per token, block, layers, taps): small enough to measure on a CPU in a second
SMALL_PRESET = StepShape(hidden=128, heads=8, kv_heads=2, head_dim=16, intermediate=384, layers=5, taps=5,
                         vocab_rows=4736, anchors=64, block_size=16, seq_len=384, target_params=0)


def step_memory(shape: StepShape, context: int | None = None, predicted: int | None = None) -> dict[str, int]:
    """Bytes of one training step by term (module docstring): resident, layers, around, loss and their total peak.

    ``context``: C (default T); ``predicted``: N (default A*(b-1)).
    """
    s = shape
    q_rows = s.anchors * s.block_size
    c = s.seq_len if context is None else context
    k = c + q_rows
    n = s.anchors * (s.block_size - 1) if predicted is None else predicted
    d, hq, hk, i = s.hidden, s.heads * s.head_dim, s.kv_heads * s.head_dim, s.intermediate
    terms = {
        "resident": s.target_params * s.target_bytes + 16 * s.params + s.seq_len * s.taps * d * s.target_bytes,
        "layers": s.layers * (26 * q_rows * d + 12 * q_rows * hq + 6 * k * hk + 4 * k * hq + 2 * q_rows * k
                              + 8 * q_rows * i + 4 * c * d),
        "around": 2 * c * s.taps * d + 6 * c * d + 8 * q_rows * d + 2 * n * d + q_rows * k + 2 * s.params,
        "loss": 16 * n * s.vocab_rows,
    }
    terms["peak"] = sum(terms.values())
    return terms


def measure_sequence_peak(target, draft, ids: torch.Tensor, anchors: torch.Tensor, cfg) -> int:
    """Peak bytes of new tensors during one sequence's loss forward and backward (gradients already allocated by a
    first sequence, as in every accumulation step after the first), tracked by torch's MemTracker on the CPU."""
    from torch.distributed._tools.mem_tracker import MemTracker

    from .loss import sequence_loss, target_features

    draft.float().train()
    feats = target_features(target, ids, draft.config.target_layer_ids, cfg.distill_topk if cfg.distill_weight else 0)
    embed, head = target.model.embed_tokens, target.lm_head.weight
    loss, _ = sequence_loss(draft, embed, head, ids, feats, anchors, cfg)
    loss.backward()  # gradients now exist, as they do for every sequence after the first of a step
    del loss
    tracker = MemTracker()
    with tracker:
        loss, _ = sequence_loss(draft, embed, head, ids, feats, anchors, cfg)
        loss.backward()
        del loss
    peak = tracker.get_tracker_snapshot("peak")
    return int(sum(v.get("Total", 0) for v in peak.values()))


def small_pair(shape: StepShape, seed: int = 0):
    """A random Qwen3 target (bf16, 8 layers) and a drafter of ``shape`` (fp32 master weights) for a measurement."""
    from transformers import AutoModelForCausalLM, Qwen3Config

    from ..model import DFlashDraftModel
    from .train_config import DraftSpec, make_draft_config

    config = Qwen3Config(vocab_size=shape.vocab_rows, hidden_size=shape.hidden, intermediate_size=shape.intermediate,
                         num_hidden_layers=8, num_attention_heads=shape.heads, num_key_value_heads=shape.kv_heads,
                         head_dim=shape.head_dim, max_position_embeddings=4 * shape.seq_len, tie_word_embeddings=False)
    config._attn_implementation = "sdpa"
    torch.manual_seed(seed)
    target = AutoModelForCausalLM.from_config(config).to(torch.bfloat16).eval()
    spec = DraftSpec(layers=shape.layers, taps=shape.taps, block_size=shape.block_size, mask_token_id=0,
                     intermediate_size=shape.intermediate)
    return target, DFlashDraftModel(make_draft_config(target.config, spec))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m dflash_core.training.memory", description=__doc__.split("\n\n")[0])
    parser.add_argument("--measure", action="store_true", help="also measure the scaled-down shape on this CPU")
    args = parser.parse_args(argv)
    gib = 2 ** 30
    terms = step_memory(QWEN3_8B_PRESET)
    print("qwen3 preset on Qwen3-8B, one step: " + ", ".join(f"{k} {v / gib:.1f} GiB" for k, v in terms.items()))
    if args.measure:
        measured, formula = measure_small()
        print(f"{SMALL_PRESET}: measured {measured / 2**20:.1f} MiB per sequence above resident, "
              f"formula {formula / 2**20:.1f} MiB ({measured / formula:.2f}x)")


def measure_small(shape: StepShape = SMALL_PRESET, seed: int = 0) -> tuple[int, int]:
    """(measured, formula) bytes of one sequence's forward and backward above resident, for ``shape`` on the CPU."""
    from .train_config import TrainConfig

    target, draft = small_pair(shape, seed)
    shape = StepShape(**{**shape.__dict__, "draft_params": sum(p.numel() for p in draft.parameters())})
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, shape.vocab_rows, (shape.seq_len,), generator=g)
    prompt = shape.seq_len // 8
    anchors = (prompt + torch.randperm(shape.seq_len - 1 - prompt, generator=g)[: shape.anchors]).sort().values
    cfg = TrainConfig(anchors=shape.anchors, loss_vocab="full", autocast=True, distill_weight=0.5, distill_topk=8)
    measured = measure_sequence_peak(target, draft, ids, anchors, cfg)
    n = int(((anchors[:, None] + torch.arange(1, shape.block_size)) < shape.seq_len).sum())
    terms = step_memory(shape, context=int(anchors.max()), predicted=n)
    return measured, terms["peak"] - terms["resident"]

if __name__ == "__main__":
    main()
