"""The C++ packed matmul beside XLA's dot on one transformer layer's matmul shapes, for each row count.

    python benchmarks/bench_cpu_matmul.py [--rows 1 32 512] [--dtype float32|bfloat16|int8] [--repeats 11]
                                          [--lm-head] [--out FILE]

The layer is the default model's (SmolLM2-135M): qkv 576 -> 960, o 576 -> 576, the gated MLP's
576 -> 2 x 1536 (`silu_gated_matmul`, XLA's side computing the same silu(gate) * up) and down 1536 -> 576.
M rows of random float32 activations per call: 1 is a batch-1 decode step, 32 a batch-32 one, 512 a
full prompt step. With --lm-head, the model's tied LM head too (576 -> 49,152: 113 MB of float32 weights, which
no cache holds, so every call streams them from memory, as a decode step streams every layer's), on a line of
its own, outside the layer's total. Each call is jitted once and timed `--repeats` times after a warm-up; the median is
kept. The kernel gets its weights packed in --dtype (bfloat16 and int8 as `cpu-bf16` and `--quantization
int8` pack them), XLA's dot the float32 matrix. Prints a line per shape and per row count, the layer's
total GFLOP/s for both, and the CPU's flags; comparisons mean something within one run only.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from jaxserve.ops import cpu_ffi  # noqa: E402
from jaxserve.ops.packed_matmul import PackedWeight, matmul, silu_gated_matmul  # noqa: E402

SHAPES = (("qkv", 576, 960), ("o", 576, 576), ("gate_up", 576, 3072), ("down", 1536, 576))
LM_HEAD = ("lm_head", 576, 49152)
DTYPES = {"float32": np.float32, "bfloat16": jnp.bfloat16, "int8": np.int8}


def median_seconds(fn, *args, repeats: int) -> float:
    fn(*args).block_until_ready()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn(*args).block_until_ready()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def xla_gated(x, w):
    gate, up = jnp.split(x @ w, 2, axis=-1)
    return jax.nn.silu(gate) * up


def main(argv: list[str] | None = None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 32, 512])
    parser.add_argument("--dtype", choices=list(DTYPES), default="float32", help="the packed weights' type")
    parser.add_argument("--repeats", type=int, default=11)
    parser.add_argument("--lm-head", action="store_true", help="also the tied LM head, outside the layer's total")
    parser.add_argument("--out", type=Path, help="write the results as JSON here")
    args = parser.parse_args(argv)
    if cpu_ffi.kernel_error() is not None:
        raise SystemExit(f"the CPU kernels are unavailable: {cpu_ffi.kernel_error()}")
    from jaxserve.ops.cpu_ffi import cpu_features

    flags = " ".join(f for f in ("avx2", "avx512f", "avx512_bf16", "avx512_vnni", "amx_bf16", "amx_int8")
                     if f in cpu_features().split())
    print(f"CPU flags: {flags}; packed weights: {args.dtype}; median of {args.repeats}", flush=True)
    rng = np.random.default_rng(0)
    results = []
    for m in args.rows:
        total = {"packed": 0.0, "xla": 0.0, "flop": 0}
        for name, k, n in SHAPES + ((LM_HEAD,) if args.lm_head else ()):
            x = jnp.asarray(rng.standard_normal((m, k), np.float32))
            w = rng.standard_normal((k, n), np.float32) * 0.05
            packed = jax.device_put(PackedWeight.pack(w, dtype=DTYPES[args.dtype]))
            kernel, xla = (silu_gated_matmul, xla_gated) if name == "gate_up" else (matmul, jnp.matmul)
            packed_s = median_seconds(jax.jit(kernel), x, packed, repeats=args.repeats)
            xla_s = median_seconds(jax.jit(xla), x, jnp.asarray(w), repeats=args.repeats)
            flop = 2 * m * k * n
            if name != LM_HEAD[0]:
                total["packed"] += packed_s
                total["xla"] += xla_s
                total["flop"] += flop
            results.append({"rows": m, "shape": name, "k": k, "n": n, "packed_ms": packed_s * 1e3, "xla_ms": xla_s * 1e3})
            print(f"M={m:4d} {name:8s} {k:5d} x {n:5d}: packed {packed_s * 1e3:8.3f} ms {flop / packed_s / 1e9:6.1f} "
                  f"GFLOP/s | XLA {xla_s * 1e3:8.3f} ms {flop / xla_s / 1e9:6.1f} GFLOP/s", flush=True)
        print(f"M={m:4d} layer: packed {total['packed'] * 1e3:.3f} ms {total['flop'] / total['packed'] / 1e9:.1f} "
              f"GFLOP/s | XLA {total['xla'] * 1e3:.3f} ms {total['flop'] / total['xla'] / 1e9:.1f} GFLOP/s", flush=True)
    if args.out:
        args.out.write_text(json.dumps({"cpu_flags": flags, "dtype": args.dtype, "results": results}, indent=1))
    return results


if __name__ == "__main__":
    main()
