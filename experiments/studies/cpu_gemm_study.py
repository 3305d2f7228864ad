"""Which CPU kernel makes the small-row products of verification and drafting cheap on this machine?

A verify round multiplies 2-64 rows by every weight matrix of the target; plain decoding multiplies one. On some CPUs
the default BLAS is slow for such short inputs (torch/MKL fp32 on a 2-core AMD EPYC was measured at 4x the time
of numpy/OpenBLAS for one [8, 576] x [576, 49152] product). This script times, for the embedded target's shapes
(SmolLM2-135M: attention 576 -> 576 / 192, MLP 576 -> 1536 -> 576, LM head 576 -> 49152) and 1..64 rows:

* ``torch``      -- ``F.linear`` as the models run it (MKL sgemm for fp32, oneDNN for bf16 on x86);
* ``onednn``     -- oneDNN's inner product on weights packed once (``torch.ops.mkldnn._linear_pointwise``);
* ``openblas``   -- numpy's BLAS (OpenBLAS in the PyPI wheels), fp32 only;

and, in child processes started with each setting before torch loads, ``torch`` fp32 under ``MKL_CBWR=AVX2`` and
``MKL_ENABLE_INSTRUCTIONS=AVX2`` (MKL's code path for AVX2 machines). Medians of ``--repeats`` calls after warm-up;
``--out`` writes JSON. Sums per row count over the shapes of one target forward (30 layers x 7 products + the head)
give each kernel's projected forward time, the number that decides whether routing the models' linear layers pays.

    python -m experiments.studies.cpu_gemm_study --out runs/cpu-gemm.json [--threads 2]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import torch

from dflash_core.timing import cpu_model, median_seconds
from experiments.bench.models import resolve_dtype
from experiments.bench.schema import write_json_atomic

ROWS = (1, 2, 4, 8, 16, 32, 64)
# (name, in, out, times per forward) for SmolLM2-135M: 30 layers of q, k, v, o, gate, up, down, then the LM head
SHAPES = (("q/o", 576, 576, 60), ("k/v", 576, 192, 60), ("gate/up", 576, 1536, 60), ("down", 1536, 576, 30),
          ("head", 576, 49152, 1))


def time_kernels(kernels: list[str], dtype_name: str, repeats: int) -> dict:
    """{kernel: {shape: {rows: ms}}} for the kernels that run on this machine in ``dtype_name``."""
    dtype = resolve_dtype(dtype_name, torch.device("cpu"))
    g = torch.Generator().manual_seed(0)
    out: dict = {}
    for kernel in kernels:
        if kernel == "openblas" and dtype != torch.float32:
            continue
        table = out.setdefault(kernel, {})
        for name, fan_in, fan_out, _ in SHAPES:
            w = (torch.randn(fan_out, fan_in, generator=g) / fan_in ** 0.5).to(dtype)
            if kernel == "onednn":
                try:
                    packed = torch.ops.mkldnn._reorder_linear_weight(w, 64)
                except (RuntimeError, AttributeError) as err:
                    print(f"onednn unavailable: {err}", file=sys.stderr)
                    out.pop(kernel)
                    break
            if kernel == "openblas":
                w_np = w.numpy()
            row_ms = {}
            for rows in ROWS:
                x = torch.randn(rows, fan_in, generator=g).to(dtype)
                if kernel == "torch":
                    fn = lambda: torch.nn.functional.linear(x, w)  # noqa: E731
                elif kernel == "onednn":
                    fn = lambda: torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], "")  # noqa: E731
                else:
                    x_np = x.numpy()
                    fn = lambda: np.matmul(x_np, w_np.T)  # noqa: E731
                row_ms[rows] = 1000 * median_seconds(fn, repeats, warmup=1)
            table[name] = row_ms
    return out


def forward_ms(table: dict) -> dict:
    """{rows: projected ms of the linear products of one target forward} from one kernel's table."""
    return {rows: sum(table[name][rows] * count for name, _, _, count in SHAPES) for rows in ROWS}


def _child(env_name: str, env: dict, threads: int, repeats: int) -> dict | None:
    code = ("import json, torch; torch.set_num_threads(%d); "
            "from experiments.studies.cpu_gemm_study import time_kernels; "
            "print(json.dumps(time_kernels(['torch'], 'fp32', %d)))" % (threads, repeats))
    proc = subprocess.run([sys.executable, "-c", code], env={**os.environ, **env}, capture_output=True, text=True,
                          timeout=1800)
    if proc.returncode != 0:
        print(f"{env_name}: failed: {proc.stderr[-400:]}", file=sys.stderr)
        return None
    table = json.loads(proc.stdout.strip().splitlines()[-1])["torch"]
    return {name: {int(rows): ms for rows, ms in per.items()} for name, per in table.items()}


def main(argv=None) -> None:
    p = argparse.ArgumentParser(prog="python -m experiments.studies.cpu_gemm_study",
                                description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default=None, help="write the tables as JSON")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--repeats", type=int, default=15)
    p.add_argument("--no-env", action="store_true", help="skip the MKL environment settings (child processes)")
    a = p.parse_args(argv)
    torch.set_num_threads(a.threads)
    results = {"cpu": cpu_model(), "threads": a.threads, "torch": torch.__version__, "rows": list(ROWS),
               "fp32": time_kernels(["torch", "onednn", "openblas"], "fp32", a.repeats),
               "bf16": time_kernels(["torch", "onednn"], "bf16", a.repeats)}
    if not a.no_env:
        for name, env in (("MKL_CBWR=AVX2", {"MKL_CBWR": "AVX2"}),
                          ("MKL_ENABLE_INSTRUCTIONS=AVX2", {"MKL_ENABLE_INSTRUCTIONS": "AVX2"})):
            table = _child(name, env, a.threads, a.repeats)
            if table is not None:
                results["fp32"][f"torch {name}"] = table
    print(f"projected ms of the linear products of one SmolLM2-135M forward ({results['cpu']}, {a.threads} threads)")
    print("| dtype | kernel | " + " | ".join(f"{r} rows" for r in ROWS) + " |")
    print("|---|---|" + "---:|" * len(ROWS))
    for dtype in ("fp32", "bf16"):
        for kernel, table in results[dtype].items():
            ms = forward_ms(table)
            print(f"| {dtype} | {kernel} | " + " | ".join(f"{ms[r]:.1f}" for r in ROWS) + " |")
    results["forward_ms"] = {d: {k: forward_ms(t) for k, t in results[d].items()} for d in ("fp32", "bf16")}
    if a.out:
        write_json_atomic(Path(a.out), results)
        print(f"wrote {a.out}")


if __name__ == "__main__":
    main()
