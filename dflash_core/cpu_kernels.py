"""Linear layers with weights packed once for oneDNN: cheaper small-row forwards on x86 CPUs.

A speculative round multiplies a few rows (1 root + 2-64 draft nodes) by every weight matrix of the target. ``F.linear``
on a CPU hands each call to MKL (fp32) or oneDNN (bf16) with the weight in its plain layout; for short inputs the
per-call preparation is a large share of the product (how much it saves per CPU and dtype: docs/results.md).
:func:`pack_linear_layers` replaces a model's ``nn.Linear`` modules by :class:`PackedLinear`, which keeps the same
parameters (state dicts, tied embeddings and dtype checks are unchanged) and multiplies with oneDNN's inner product on
a copy of the weight reordered once (``torch.ops.mkldnn``). :func:`choose_cpu_kernels` measures both on the machine
at hand; ``python -m experiments.studies.profile_round --kernels torch,packed`` the effect on whole rounds.

For inference: a module falls back to ``F.linear`` whenever autograd is recording, the input is not on the CPU or not
in the weight's dtype, or oneDNN on this CPU has no kernel for that dtype (bf16 without avx512_bf16/AMX, fp16 without
avx512_fp16/AMX-FP16). The packed copy is rebuilt when the weight is replaced or changed in place through autograd's
view of it (``weight.mul_``, ``weight.copy_``, an optimizer step: they bump its version); an edit through
``weight.data`` bypasses that counter and is not seen: call :func:`refresh_packed` after one.
"""

from __future__ import annotations

import os

import torch
import torch.nn.functional as F
from torch import nn

from .timing import cached_json, machine_key

__all__ = ["PackedLinear", "packed_kernels_available", "pack_linear_layers", "unpack_linear_layers", "refresh_packed",
           "kernels_from_env", "apply_cpu_kernels", "choose_cpu_kernels", "active_kernels", "set_packed_enabled",
           "KERNEL_CHOICES"]

KERNEL_CHOICES = ("torch", "packed", "auto")  # auto: measure both on this machine once (cached), keep the faster
_ROWS_HINT = 16  # the row count oneDNN tunes the packed layout for (verify rounds carry 2-64 rows)
def set_packed_enabled(enabled: bool, *models: nn.Module | None) -> bool:
    """Switch the :class:`PackedLinear` layers of ``models`` between their packed path and ``F.linear`` (for
    interleaved comparisons; the switch lives on each layer); returns whether they were all on before."""
    layers = [m for model in models if model is not None for m in model.modules() if isinstance(m, PackedLinear)]
    previous = all(layer.enabled for layer in layers)
    for layer in layers:
        layer.enabled = bool(enabled)
    return previous


def active_kernels(model: nn.Module | None) -> str:
    """``packed`` when ``model`` holds packed linear layers and they are switched on, else ``torch``."""
    if model is None:
        return "torch"
    return "packed" if any(isinstance(m, PackedLinear) and m.enabled for m in model.modules()) else "torch"


def packed_kernels_available(dtype: torch.dtype | None = None) -> bool:
    """Whether this torch build has oneDNN's packed linear (x86 CPU builds with MKL-DNN) and, for ``dtype``, whether
    oneDNN has a kernel for it on this CPU (fp32 always; bf16 and fp16 only with the matching instructions)."""
    ops = getattr(torch.ops, "mkldnn", None)
    try:
        if not (torch.backends.mkldnn.is_available() and hasattr(ops, "_linear_pointwise")
                and hasattr(ops, "_reorder_linear_weight")):
            return False
        if dtype == torch.bfloat16:
            return bool(ops._is_mkldnn_bf16_supported())
        if dtype == torch.float16:
            return bool(ops._is_mkldnn_fp16_supported())
        return dtype in (None, torch.float32)
    except (AttributeError, RuntimeError):
        return False


def refresh_packed(model: nn.Module) -> None:
    """Drop every packed copy in ``model`` (rebuilt at the next forward): needed after edits through ``weight.data``."""
    for m in model.modules():
        if isinstance(m, PackedLinear):
            m._packed = m._packed_version = None


class PackedLinear(nn.Module):
    """``nn.Linear`` whose inference forward uses a oneDNN-packed copy of the weight (same parameters)."""

    def __init__(self, linear: nn.Linear, rows_hint: int = _ROWS_HINT) -> None:
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.weight = linear.weight  # the same Parameter object: ties and state dicts are untouched
        self.bias = linear.bias
        self.rows_hint = rows_hint
        self.enabled = True  # False: run F.linear (set_packed_enabled)
        self._packed: torch.Tensor | None = None
        self._packed_version: tuple | None = None

    def _pack(self) -> torch.Tensor:
        version = (self.weight.dtype, self.weight.data_ptr(), self.weight._version)
        if self._packed is None or self._packed_version != version:
            with torch.no_grad():
                self._packed = torch.ops.mkldnn._reorder_linear_weight(self.weight.detach(), self.rows_hint)
            self._packed_version = version
        return self._packed

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w = self.weight
        if (not self.enabled or x.device.type != "cpu" or w.device.type != "cpu" or x.dtype != w.dtype
                or (torch.is_grad_enabled() and (x.requires_grad or w.requires_grad)) or x.numel() == 0):
            return F.linear(x, w, self.bias)
        bias = None if self.bias is None else self.bias.detach()
        y = torch.ops.mkldnn._linear_pointwise(x.reshape(-1, self.in_features), self._pack(), bias, "none", [], "")
        return y.view(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, packed"


def pack_linear_layers(model: nn.Module, rows_hint: int = _ROWS_HINT) -> int:
    """Replace every ``nn.Linear`` of ``model`` (on the CPU) by a :class:`PackedLinear`; returns how many.

    Nothing is replaced (0) when the torch build lacks oneDNN's packed linear, and no layer whose dtype oneDNN cannot
    multiply on this CPU (bf16 on a CPU without bf16 instructions) is replaced."""
    if not packed_kernels_available():
        return 0
    count = 0
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if (type(child) is nn.Linear and child.weight.device.type == "cpu"
                    and packed_kernels_available(child.weight.dtype)):
                setattr(parent, name, PackedLinear(child, rows_hint))
                count += 1
    return count


def unpack_linear_layers(model: nn.Module) -> int:
    """Undo :func:`pack_linear_layers` (plain ``nn.Linear`` modules on the same parameters); returns how many."""
    count = 0
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if isinstance(child, PackedLinear):
                linear = nn.Linear(child.in_features, child.out_features, bias=child.bias is not None,
                                   device="meta")
                linear.weight, linear.bias = child.weight, child.bias
                setattr(parent, name, linear)
                count += 1
    return count


def kernels_from_env(default: str = "torch") -> str:
    """The CPU kernel choice: ``$DDTREE_CPU_KERNELS`` (``torch``, ``packed`` or ``auto``), else ``default``."""
    choice = os.environ.get("DDTREE_CPU_KERNELS", "").strip().lower() or default
    if choice not in KERNEL_CHOICES:
        raise ValueError(f"DDTREE_CPU_KERNELS={choice!r}: use one of {KERNEL_CHOICES}")
    return choice


def _kernel_key(target) -> str:
    """The cache name of the kernel choice for ``target`` on this machine (dtype, model type and shape)."""
    cfg = target.config
    return machine_key({"dtype": str(target.dtype), "type": cfg.model_type,
                        "shape": [cfg.hidden_size, cfg.num_hidden_layers, cfg.vocab_size, cfg.intermediate_size]})


@torch.inference_mode()
def measure_kernels(target, rows: tuple[int, ...] = (1, 8, 32), context: int = 128, repeats: int = 7) -> dict:
    """{kernel: {rows: median ms}} of the target's forward over ``rows`` new tokens on a ``context``-token cache,
    with ``F.linear`` and with packed layers (switched per call, interleaved, so load hits both alike)."""
    import statistics
    import time

    from .target import TargetAdapter

    pack_linear_layers(target)
    adapter = TargetAdapter(target, ())
    gen = torch.Generator().manual_seed(0)
    cache = adapter.new_cache()
    adapter.forward(torch.randint(0, adapter.vocab_size, (1, context), generator=gen), torch.arange(context)[None],
                    cache, rows=torch.tensor([context - 1]), with_features=False)
    times: dict[str, dict[int, list[float]]] = {"torch": {r: [] for r in rows}, "packed": {r: [] for r in rows}}
    previous = set_packed_enabled(True, target)
    try:
        for rep in range(repeats + 1):
            for r in rows:
                ids = torch.randint(0, adapter.vocab_size, (1, r), generator=gen)
                for kernel in ("torch", "packed"):
                    set_packed_enabled(kernel == "packed", target)
                    t0 = time.perf_counter()
                    adapter.forward(ids, torch.arange(context, context + r)[None], cache, with_features=False)
                    elapsed = time.perf_counter() - t0
                    adapter.crop(cache, context)
                    if rep:  # the first pass warms both paths up
                        times[kernel][r].append(elapsed)
    finally:
        set_packed_enabled(previous, target)
    return {k: {r: 1000 * statistics.median(v) for r, v in per.items()} for k, per in times.items()}


def choose_cpu_kernels(target, use_cache: bool = True, margin: float = 0.03) -> str:
    """``packed`` when packed layers make the target's 1-, 8- and 32-token forwards faster in total by at least
    ``margin`` on this machine, else ``torch``. Measured once per machine, thread count, dtype, torch and model
    shape (about a second), then read from ``$XDG_CACHE_HOME/ddtree/kernels``. The target is left unpacked."""
    if not packed_kernels_available(target.lm_head.weight.dtype) or target.lm_head.weight.device.type != "cpu":
        return "torch"

    def measure() -> dict:
        try:
            ms = measure_kernels(target)
        finally:
            unpack_linear_layers(target)
        total = {k: sum(v.values()) for k, v in ms.items()}
        return {"choice": "packed" if total["packed"] < (1 - margin) * total["torch"] else "torch", "ms": ms}

    def load(raw: dict) -> dict | None:
        return raw if raw["choice"] in ("torch", "packed") else None

    return cached_json("kernels", _kernel_key(target), measure, load, use_cache=use_cache)["choice"]


def apply_cpu_kernels(*models: nn.Module | None, kernels: str | None = None) -> str:
    """Route the models' linear layers through ``kernels`` (None: :func:`kernels_from_env`, default ``torch``;
    ``auto``: :func:`choose_cpu_kernels` on the first model, the target); returns the choice in effect (``torch``
    when packing is unavailable or the models are not on the CPU)."""
    choice = kernels or kernels_from_env()
    if choice not in KERNEL_CHOICES:
        raise ValueError(f"kernels={choice!r}: use one of {KERNEL_CHOICES}")
    present = [m for m in models if m is not None]
    if choice == "auto":
        choice = choose_cpu_kernels(present[0]) if present else "torch"
    if choice == "packed":
        packed = sum(pack_linear_layers(m) for m in present)
        return "packed" if packed else "torch"
    for m in present:
        unpack_linear_layers(m)
    return "torch"
