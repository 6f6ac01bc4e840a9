"""The C++ paged attention on the CPU (`paged_row_attention`) for one layer of the default model, by case.

    python benchmarks/bench_cpu_attention.py [--cases prompt:512:0 prompt:512:1024 decode:32:384]
                                             [--page-dtype float32|bfloat16|fp8] [--bf16-products]
                                             [--layers 1] [--repeats 11] [--out FILE]

The heads are the default model's (SmolLM2-135M: 9 query heads over 3 KV heads of 64), pages of 16
tokens scattered at random over a pool. A case `prompt:N:START` is one prompt chunk of N rows at positions
START..START+N-1 (each row attending causally to the keys up to its own), `decode:B:CTX` is B decode rows
each at context CTX. Each call is jitted once and timed `--repeats` times after a warm-up; the median is
kept. `--bf16-products` gives the kernel bfloat16 operands for its prompt tiles' products (and a decode
row's scores over bfloat16 pages), as the engine does under `cpu-bf16` on a CPU with AVX512-BF16 or AMX;
without it the products are float32, as under `--dtype float32`. GFLOP/s counts the causal products only
(2 x 2 x heads x head_dim per query row and key it attends to), so it is comparable with a matmul's rate on
the same CPU (benchmarks/bench_cpu_matmul.py). `--layers N` gives the pages N layers and times one call a
layer, one after another in one jitted function, reporting the time a layer: past the CPU's last-level cache
(30 layers of 32 rows at context 160 hold 117 MB of bfloat16 pages) each layer's pages come from memory, as in
the engine's step, where one layer alone, called again and again, finds them in the cache. Prints the CPU's
flags; comparisons mean something within one run only.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_cpu_matmul import median_seconds  # noqa: E402
from jaxserve.ops import cpu_ffi  # noqa: E402

HEADS, KV_HEADS, HEAD_DIM, PAGE = 9, 3, 64, 16
PAGE_DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16, "fp8": jnp.float8_e4m3fn}


def build(kind: str, n: int, where: int, page_dtype, rng: np.random.Generator, layers: int = 1):
    """(q, k_pages, v_pages, kv_lens, row_seqs, block_tables, causal FLOPs) of one case."""
    if kind == "prompt":
        kv_lens = np.arange(where + 1, where + n + 1, dtype=np.int32)
        row_seqs = np.zeros(n, np.int32)
        seqs, context = 1, where + n
    else:
        kv_lens = np.full(n, where, np.int32)
        row_seqs = np.arange(n, dtype=np.int32)
        seqs, context = n, where
    width = -(-context // PAGE)
    pool = seqs * width + 1
    tables = rng.permutation(pool)[: seqs * width].reshape(seqs, width).astype(np.int32)
    shape = (layers, pool, PAGE, KV_HEADS, HEAD_DIM)
    k = jnp.asarray(rng.standard_normal(shape, np.float32), page_dtype)
    v = jnp.asarray(rng.standard_normal(shape, np.float32), page_dtype)
    q = jnp.asarray(rng.standard_normal((n, HEADS, HEAD_DIM), np.float32))
    flop = 4 * HEADS * HEAD_DIM * int(kv_lens.sum())
    return q, k, v, jnp.asarray(kv_lens), jnp.asarray(row_seqs), jnp.asarray(tables), flop


def main(argv: list[str] | None = None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cases", nargs="+", default=["prompt:512:0", "prompt:512:512", "prompt:512:1024",
                                                       "decode:1:1024", "decode:32:384"])
    parser.add_argument("--page-dtype", choices=list(PAGE_DTYPES), default="float32",
                        help="the KV pages' dtype (fp8: float8 e4m3, kv_cache_dtype fp8)")
    parser.add_argument("--bf16-products", action="store_true",
                        help="bfloat16 operands for the products, as the engine's cpu-bf16 attention backend")
    parser.add_argument("--layers", type=int, default=1,
                        help="layers of pages, each called once a timing (pages past the cache: as in a step)")
    parser.add_argument("--repeats", type=int, default=11)
    parser.add_argument("--out", type=Path, help="write the results as JSON here")
    args = parser.parse_args(argv)
    if cpu_ffi.kernel_error() is not None:
        raise SystemExit(f"the CPU kernels are unavailable: {cpu_ffi.kernel_error()}")
    flags = " ".join(f for f in ("avx2", "fma", "avx512f", "avx512_bf16", "avx512_vnni", "amx_bf16")
                     if f in cpu_ffi.cpu_features().split())
    products = "bfloat16" if args.bf16_products else "float32"
    if args.layers < 1:
        raise SystemExit(f"--layers must be at least 1, not {args.layers}")
    print(f"CPU flags: {flags}; pages: {args.page_dtype}; products: {products}; layers: {args.layers}; "
          f"median of {args.repeats}", flush=True)
    rng = np.random.default_rng(0)

    @jax.jit
    def attend(q, k, v, lens, seqs, tables):
        out = q
        for layer in range(args.layers):  # each layer's output is the next one's queries: the calls run in order
            out = cpu_ffi.paged_row_attention(out, k, v, layer, lens, seqs, tables, scale=HEAD_DIM ** -0.5,
                                              bf16_products=args.bf16_products)
        return out

    results = []
    for case in args.cases:
        kind, n, where = case.split(":")
        if kind not in ("prompt", "decode"):
            raise SystemExit(f"unknown case kind {kind!r} in {case!r}: prompt or decode")
        *operands, flop = build(kind, int(n), int(where), PAGE_DTYPES[args.page_dtype], rng, args.layers)
        seconds = median_seconds(attend, *operands, repeats=args.repeats) / args.layers
        results.append({"case": case, "ms": seconds * 1e3, "gflops": flop / seconds / 1e9})
        print(f"{case:18s} {seconds * 1e3:9.3f} ms {flop / seconds / 1e9:7.1f} GFLOP/s", flush=True)
    if args.out:
        args.out.write_text(json.dumps({"cpu_flags": flags, "page_dtype": args.page_dtype, "products": products,
                                        "layers": args.layers, "results": results},
                                       indent=1))
    return results


if __name__ == "__main__":
    main()
