"""What makes the embedded target's forward cheaper on this CPU, priced by measurement:
``python -m experiments.studies.target_step_options``.

Every option is applied to its own copy of the embedded target (bf16 where the CPU has bf16 instructions) and timed
the same way: the one-token step (plain decoding's forward) and the verify cost curve, one forward appending
N = 1 ... 64 tokens under a tree mask to a 200-token cache (:func:`verify_curve`), medians, interleaved option by
option for each N so that drift hits them alike. Options:

* ``torch``   -- ``nn.Linear`` as transformers builds it (``F.linear``);
* ``packed``  -- the toolkit's default on x86 CPUs: weights packed once for oneDNN (:mod:`dflash_core.cpu_kernels`);
* ``fused``   -- packed, with each attention's q/k/v and each MLP's gate/up projections multiplied as one product
  (:func:`fuse_shared_inputs`; the same target, the same parameters);
* ``int8``    -- weight-only int8 (per output channel) for every decoder-layer linear, ``torch._weight_int8pack_mm``;
  the LM head stays bf16 (the drafter reads its rows);
* ``int4``    -- the GGUF's own 4-bit weights: every decoder-layer linear of the Q4_1 file (blocks of 32 values
  ``d * q + m``, q in 0..15) recovered exactly from the dequantized fp32 copy (the check is reported) and run by
  ``torch._weight_int4pack_mm_for_cpu`` with group size 32 (scale ``d``, zero ``m + 8 d``, stored in bf16);
* a static KV cache -- transformers' ``StaticCache`` against its ``DynamicCache`` for the one-token step of the
  packed model (:func:`static_cache_step_ms`);
* ``compile`` -- ``torch.compile(dynamic=True)`` of the model's forward with ``nn.Linear`` layers (CPU inductor picks
  its own kernels; it cannot lower the packed layers' oneDNN calls); its compile seconds are reported.

An option that fails to build or run is recorded with its error and left out of the timings.

Weight-only int8/int4 give a different target (its own plain decoding is the reference): they are priced here, not
adopted, unless they pay at the row counts a DDTree round verifies (9-33 tokens) as well as at one token. Prints a
table; ``--out`` writes JSON atomically.
"""

from __future__ import annotations

import argparse
import copy
import statistics
import sys
import time
from typing import Any, Callable, Sequence

import torch
from torch import nn

__all__ = ["OPTIONS", "WeightOnlyLinear", "SharedInput", "fuse_shared_inputs", "q4_1_blocks", "apply_option",
           "verify_curve", "main"]

OPTIONS = ("torch", "packed", "fused", "int8", "int4", "compile")
NODES = (1, 2, 4, 8, 16, 32, 64)
GROUP = 32  # Q4_1's block


def q4_1_blocks(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, float]:
    """Recover Q4_1 blocks from a dequantized fp32 weight [N, K]: (q [N, K] int32 in 0..15, d [N, K/32], m [N, K/32],
    the largest |d q + m - w|). Q4_1 stores m = the block's minimum and d = (max - min) / 15, so both extremes sit on
    the grid and the rest is rounding; an error near zero says the weight really is a Q4_1 tensor."""
    n, k = weight.shape
    blocks = weight.float().reshape(n, k // GROUP, GROUP)
    m = blocks.amin(-1)
    d = (blocks.amax(-1) - m) / 15
    safe = torch.where(d > 0, d, torch.ones_like(d))
    q = torch.round((blocks - m[..., None]) / safe[..., None]).clamp(0, 15)
    error = float((q * d[..., None] + m[..., None] - blocks).abs().max())
    return q.to(torch.int32).reshape(n, k), d, m, error


class WeightOnlyLinear(nn.Module):
    """A bias-free linear layer on torch's weight-only int8 or int4 CPU kernels (activations stay bf16)."""

    def __init__(self, linear: nn.Linear, bits: int) -> None:
        super().__init__()
        w = linear.weight.detach().float()
        self.bits, self.out_features = bits, w.shape[0]
        if bits == 8:
            scale = w.abs().amax(1).clamp_min(1e-12) / 127
            self.register_buffer("qweight", torch.round(w / scale[:, None]).to(torch.int8))
            self.register_buffer("scales", scale.to(torch.bfloat16))
            self.error = 0.0
        elif bits == 4:
            q, d, m, self.error = q4_1_blocks(w)
            self.register_buffer("qweight", torch.ops.aten._convert_weight_to_int4pack_for_cpu(q, 2))
            # torch's int4 kernel computes (q - 8) * scale + zero: scale d and zero m + 8 d give Q4_1's d q + m
            self.register_buffer("scales", torch.stack([d, m + 8 * d], -1).transpose(0, 1).contiguous()
                                 .to(torch.bfloat16))
        else:
            raise ValueError(f"bits must be 8 or 4, got {bits}")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, x.shape[-1]).to(torch.bfloat16)
        if self.bits == 8:
            y = torch.ops.aten._weight_int8pack_mm(rows, self.qweight, self.scales)
        else:
            y = torch.ops.aten._weight_int4pack_mm_for_cpu(rows, self.qweight, GROUP, self.scales)
        return y.reshape(*x.shape[:-1], self.out_features).to(x.dtype)


class SharedInput:
    """Packed layers that read the same input one after the other (q/k/v, gate/up) multiplied as ONE product: the
    first layer's call multiplies the input by all their weights at once and returns its own columns; each later layer
    called with that very tensor in its turn takes its columns of that product. Any other input or order gives None
    and the layer computes its own product, so a call never depends on whether the sharing applied."""

    def __init__(self, layers: list[nn.Module]) -> None:
        self.layers, self.sizes = layers, [m.out_features for m in layers]
        self._packed = self._version = None
        self._held: torch.Tensor | None = None
        self._slices: tuple[torch.Tensor, ...] = ()
        self._next = 0

    def output(self, slot: int, x: torch.Tensor) -> torch.Tensor | None:
        if slot == 0:
            version = tuple((m.weight.data_ptr(), m.weight._version) for m in self.layers)
            if self._packed is None or self._version != version:
                weight = torch.cat([m.weight.detach() for m in self.layers])
                self._packed, self._version = torch.ops.mkldnn._reorder_linear_weight(weight, 16), version
            y = torch.ops.mkldnn._linear_pointwise(x.reshape(-1, x.shape[-1]), self._packed, None, "none", [], "")
            self._slices = y.view(*x.shape[:-1], -1).split(self.sizes, dim=-1)
            self._held, self._next = x, 1
            return self._slices[0]
        if self._held is not x or slot != self._next:
            return None
        self._next += 1
        out = self._slices[slot]
        if self._next == len(self.sizes):
            self._held, self._slices = None, ()
        return out


def fuse_shared_inputs(model: nn.Module) -> int:
    """Give each attention's q/k/v and each MLP's gate/up packed projections one shared product (bias-free packed
    layers only); returns the number of groups. Parameters and state dicts are untouched."""
    from dflash_core.cpu_kernels import PackedLinear

    class SharedPacked(PackedLinear):
        def __init__(self, layer: PackedLinear, shared: SharedInput, slot: int) -> None:
            nn.Module.__init__(self)
            self.__dict__.update({k: v for k, v in layer.__dict__.items() if k not in ("_modules", "_parameters")})
            self._parameters, self._modules = dict(layer._parameters), {}
            self.shared, self.slot = shared, slot

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            y = self.shared.output(self.slot, x) if not torch.is_grad_enabled() else None
            return super().forward(x) if y is None else y

    count = 0
    for parent in list(model.modules()):
        for names in (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj")):
            layers = [getattr(parent, n, None) for n in names]
            if all(type(m) is PackedLinear and m.bias is None for m in layers):
                shared = SharedInput(layers)
                for slot, (name, layer) in enumerate(zip(names, layers)):
                    setattr(parent, name, SharedPacked(layer, shared, slot))
                count += 1
    return count


def _replace_layer_linears(model: nn.Module, make: Callable[[nn.Linear], nn.Module]) -> list[float]:
    errors = []
    for layer in model.model.layers:
        for parent in (layer.self_attn, layer.mlp):
            for name, child in list(parent.named_children()):
                if isinstance(child, nn.Linear):
                    new = make(child)
                    errors.append(getattr(new, "error", 0.0))
                    setattr(parent, name, new)
    return errors


def apply_option(option: str, fp32_target: nn.Module, dtype: torch.dtype) -> tuple[nn.Module, dict[str, Any]]:
    """A copy of ``fp32_target`` in ``dtype`` with ``option`` applied; returns (model, notes)."""
    from dflash_core.cpu_kernels import pack_linear_layers

    model = copy.deepcopy(fp32_target)
    notes: dict[str, Any] = {}
    if option in ("int8", "int4"):
        errors = _replace_layer_linears(model, lambda lin: WeightOnlyLinear(lin, 8 if option == "int8" else 4))
        if option == "int4":
            notes["q4_1_recovery_max_error"] = max(errors)
    model = model.to(dtype)
    if option in ("packed", "fused"):
        notes["packed_layers"] = pack_linear_layers(model)
    if option == "fused":
        notes["shared_groups"] = fuse_shared_inputs(model)
    if option == "compile":
        model.model.forward = torch.compile(model.model.forward, dynamic=True)
    return model.eval(), notes


def verify_curve(target: nn.Module, layer_ids: Sequence[int], nodes: Sequence[int] = NODES, context: int = 200,
                 repeats: int = 15) -> dict[int, Callable[[], None]]:
    """One timing function per N: a target forward appending N tokens (a chain-shaped tree under the 4D mask for
    N > 1, the one-token step for N = 1) to a ``context``-token cache, cropped back after each call."""
    from dflash_core.target import TargetAdapter

    adapter = TargetAdapter(target, layer_ids)
    cache = adapter.new_cache()
    ids = torch.randint(0, adapter.vocab_size, (context + max(nodes),), generator=torch.Generator().manual_seed(0))
    adapter.forward(ids[:context], torch.arange(context), cache, last_only=True)
    calls = {}
    for n in nodes:
        tree = torch.tril(torch.ones(n, n, dtype=torch.bool))

        def call(n=n, tree=tree):
            adapter.forward(ids[context:context + n], torch.arange(context, context + n), cache,
                            visibility=None if n == 1 else tree, last_only=n == 1)
            adapter.crop(cache, context)
        calls[n] = call
    return calls


@torch.inference_mode()
def static_cache_step_ms(target: nn.Module, context: int = 200, max_len: int = 1024, repeats: int = 15) -> dict:
    """The one-token step with transformers' ``StaticCache`` (preallocated to ``max_len``, written in place) against
    its ``DynamicCache`` (grown by concatenation), same model, same context, interleaved: the price of a static
    cache for plain decoding (the tree path's cache compaction is not ported to it, so only the step is priced)."""
    from transformers import DynamicCache, StaticCache

    from dflash_core.timing import median_seconds

    ids = torch.randint(0, target.config.vocab_size, (1, context + 1), generator=torch.Generator().manual_seed(0))
    caches = {"dynamic": DynamicCache(), "static": StaticCache(config=target.config, max_cache_len=max_len)}
    for cache in caches.values():
        target(input_ids=ids[:, :context], past_key_values=cache, use_cache=True,
               cache_position=torch.arange(context), logits_to_keep=1)

    def step(kind: str) -> None:
        cache = caches[kind]
        target(input_ids=ids[:, context:], past_key_values=cache, use_cache=True,
               cache_position=torch.tensor([context]), logits_to_keep=1)
        if kind == "dynamic":
            for layer in cache.layers:  # back to `context` entries: every call appends to the same context
                layer.keys, layer.values = layer.keys[..., :context, :], layer.values[..., :context, :]
    out = {k: [] for k in caches}
    for _ in range(3):
        for kind in caches:
            out[kind].append(median_seconds(lambda kind=kind: step(kind), repeats=repeats, warmup=2) * 1e3)
    return {k: statistics.median(v) for k, v in out.items()} | {"context": context, "max_cache_len": max_len}


def measure(options: Sequence[str], repeats: int, log: Callable[[str], None]) -> dict[str, Any]:
    from dflash_core.default import DEFAULT_DRAFT_DIR, default_dtype, load_default_target
    from dflash_core.model import load_draft
    from dflash_core.timing import median_seconds

    fp32_target, _ = load_default_target(torch.float32, "cpu")
    layer_ids = load_draft(DEFAULT_DRAFT_DIR).config.target_layer_ids
    dtype = default_dtype("cpu")
    models, notes, calls = {}, {}, {}
    for option in options:
        t0 = time.perf_counter()
        try:
            models[option], notes[option] = apply_option(option, fp32_target, dtype)
            calls[option] = verify_curve(models[option], layer_ids)
            for fn in calls[option].values():  # warm-up: compiles every shape once for `compile`
                fn()
        except Exception as err:  # noqa: BLE001 -- an option that cannot run is a result, not the end of the study
            notes[option] = {"failed": f"{type(err).__name__}: {str(err).splitlines()[0][:300]}"}
            calls.pop(option, None)
            log(f"{option}: FAILED ({notes[option]['failed']})")
            continue
        notes[option]["setup_s"] = time.perf_counter() - t0
        log(f"{option}: ready in {notes[option]['setup_s']:.1f} s")
    options = [o for o in options if o in calls]
    curves: dict[str, dict[str, float]] = {o: {} for o in options}
    for n in NODES:
        for option in options:
            curves[option][str(n)] = median_seconds(calls[option][n], repeats=repeats, warmup=1) * 1e3
        log(f"N={n}: " + "  ".join(f"{o} {curves[o][str(n)]:.1f}" for o in options))
    static = static_cache_step_ms(models["packed"]) if "packed" in models else None
    if static:
        log(f"one-token step, packed: DynamicCache {static['dynamic']:.1f} ms, StaticCache {static['static']:.1f} ms")
    return {"dtype": str(dtype).removeprefix("torch."), "curves_ms": curves, "notes": notes, "static_cache": static}


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m experiments.studies.target_step_options",
                                description=__doc__.split("\n\n")[0])
    p.add_argument("--options", default=",".join(OPTIONS), help=f"comma-separated subset of {','.join(OPTIONS)}")
    p.add_argument("--repeats", type=int, default=15)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--out", default="runs/target_step_options.json")
    args = p.parse_args(argv)
    options = [o.strip() for o in args.options.split(",") if o.strip()]
    bad = [o for o in options if o not in OPTIONS]
    if bad:
        p.error(f"--options: unknown {bad}; use a subset of {','.join(OPTIONS)}")
    torch.set_num_threads(args.threads)
    from dflash_core.timing import machine_identity
    from experiments.bench.schema import write_json_atomic

    result = measure(options, args.repeats, lambda m: print(f"[target_step_options] {m}", file=sys.stderr, flush=True))
    base = result["curves_ms"].get("packed") or next(iter(result["curves_ms"].values()))
    print(f"{'option':<9}" + "".join(f"{'N=' + str(n):>9}" for n in NODES) + "   (ms; ratio to packed at N=1 / N=16)")
    for option, curve in result["curves_ms"].items():
        print(f"{option:<9}" + "".join(f"{curve[str(n)]:>9.1f}" for n in NODES)
              + f"   {curve['1'] / base['1']:.2f} / {curve['16'] / base['16']:.2f}")
    write_json_atomic(args.out, {"schema": "target_step_options/1", "machine": machine_identity(),
                                 "threads": args.threads, "versions": {"torch": torch.__version__},
                                 "command_line": [sys.executable, "-m", "experiments.studies.target_step_options",
                                                  *(sys.argv[1:] if argv is None else argv)],
                                 "median_of": args.repeats, **result})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
