"""The Pallas attention kernels compiled for the GPU: parity with the float32 references, and speed
beside XLA's paged attention (the engine's other backend) on the same device.

    python benchmarks/bench_kernels.py [--repeats 20] [--out results.json]

Needs a Hopper GPU (the kernels use wgmma and TMA); without one it says so and exits 0, and `--smoke`
runs two tiny cases with the kernels interpreted on the CPU, to check this script (times meaningless).
Every case draws fresh random bfloat16 queries,
keys and values over shuffled pages, checks the kernel against its reference (max |error| and the
relative Frobenius error over real rows), then times the kernel and XLA's path: median of 20 timed
calls after a warm-up, each call waited for. Two ceilings are measured first in the same process: a
device-to-device copy (bytes read + written) and a large bfloat16 matmul. A decode case reads every
key and value of its sequences once, so its floor is KV bytes / copy bandwidth; a prefill case is
compute-bound, so it is compared with the matmul rate (causal FLOPs only: masked keys not counted).
Each result records the tiles the kernel chose (prefill: two consumer warpgroups of 64 query rows and a
producer, `kv_tile` keys per ring stage); the prefill target is 40% of the matmul rate on the 4x1024 and
2x4096 cases.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import statistics
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import pallas_kernels as pk  # noqa: E402
from pallas_kernels.common import COMPUTE_WARPGROUPS, ROWS, choose_prefill_config  # noqa: E402
from jaxserve.ops.attention import AttentionMetadata, ragged_paged_attention as xla_attention  # noqa: E402

PAGE_SIZE = 16


@dataclasses.dataclass(frozen=True)
class Case:
    kind: str  # "decode" (one new row per sequence) or "prefill" (a chunk of new rows per sequence)
    num_seqs: int
    q_len: int  # new rows per sequence
    context: int  # keys per sequence, the new rows included
    num_heads: int
    num_kv_heads: int
    head_dim: int

    @property
    def name(self) -> str:
        return (f"{self.kind} {self.num_seqs}x{self.q_len} ctx {self.context} "
                f"H{self.num_heads}/{self.num_kv_heads} D{self.head_dim}")

    def kv_bytes(self) -> int:
        return 2 * self.num_seqs * self.context * self.num_kv_heads * self.head_dim * 2  # K and V, bf16

    def flops(self) -> float:
        """QK^T and PV over the keys each row attends to (causal)."""
        cached = self.context - self.q_len
        keys = sum(cached + i + 1 for i in range(self.q_len))
        return 4.0 * self.num_seqs * keys * self.num_heads * self.head_dim


CASES = [  # SmolLM2-135M's attention (9 heads over 3, head_dim 64), then a Llama-3-8B-like one (32 over 8, 128)
    Case("decode", 32, 1, 512, 9, 3, 64),
    Case("decode", 256, 1, 512, 9, 3, 64),
    Case("decode", 64, 1, 4096, 9, 3, 64),
    Case("decode", 64, 1, 2048, 32, 8, 128),
    Case("decode", 256, 1, 2048, 32, 8, 128),
    Case("decode", 8, 1, 32768, 32, 8, 128),
    Case("prefill", 8, 512, 512, 9, 3, 64),
    Case("prefill", 4, 1024, 2048, 32, 8, 128),
    Case("prefill", 2, 4096, 4096, 32, 8, 128),
]
SMOKE_CASES = [Case("decode", 3, 1, 40, 4, 2, 64), Case("prefill", 2, 20, 50, 4, 2, 64)]


def _median_seconds(fn, *args, repeats: int) -> float:
    jax.block_until_ready(fn(*args))
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def copy_bandwidth(size: int = 2**29, repeats: int = 20) -> float:
    x = jnp.ones((size,), jnp.bfloat16)  # 1 GiB by default
    seconds = _median_seconds(jax.jit(lambda a: a + 1), x, repeats=repeats)
    return 2 * x.nbytes / seconds


def matmul_rate(size: int = 8192, repeats: int = 20) -> float:
    a = jax.random.normal(jax.random.key(0), (size, size), jnp.bfloat16)
    seconds = _median_seconds(jax.jit(lambda x: x @ x), a, repeats=repeats)
    return 2 * size**3 / seconds


def build(case: Case, seed: int):
    """Random bf16 q/k/v and the metadata of one call, pages shuffled over a pool with spare pages."""
    rng = np.random.default_rng(seed)
    pages_per_seq = -(-case.context // PAGE_SIZE)
    num_pages = case.num_seqs * pages_per_seq + 1  # page 0 stays the engine's dummy page
    tables = (rng.permutation(num_pages - 1) + 1).reshape(case.num_seqs, pages_per_seq)
    num_tokens = case.num_seqs * case.q_len
    cached = case.context - case.q_len
    md = AttentionMetadata(
        slot_mapping=jnp.zeros((num_tokens,), jnp.int32),  # unused: the kernels only read pages
        cu_q_lens=jnp.arange(case.num_seqs + 1, dtype=jnp.int32) * case.q_len,
        kv_lens=jnp.full((case.num_seqs,), case.context, jnp.int32),
        block_tables=jnp.asarray(tables, jnp.int32),
    )
    key = jax.random.key(seed)
    kq, kk, kv = jax.random.split(key, 3)
    shape = (1, num_pages, PAGE_SIZE, case.num_kv_heads, case.head_dim)
    k = jax.random.normal(kk, shape, jnp.bfloat16)
    v = jax.random.normal(kv, shape, jnp.bfloat16)
    q = jax.random.normal(kq, (num_tokens, case.num_heads, case.head_dim), jnp.bfloat16)
    assert cached >= 0
    return q, k, v, md


def run_case(case: Case, seed: int, repeats: int, interpret: bool) -> dict:
    q, k, v, md = build(case, seed)
    scale = case.head_dim**-0.5
    pallas_fn = pk.decode_attention if case.kind == "decode" else pk.ragged_paged_attention
    pallas_fn = functools.partial(pallas_fn, interpret=interpret)
    reference_fn = pk.decode_attention_reference if case.kind == "decode" else pk.ragged_paged_attention_reference
    args = (q, k, v, 0, md.cu_q_lens, md.kv_lens, md.block_tables)
    pallas = jax.jit(functools.partial(pallas_fn, scale=scale))
    xla = jax.jit(functools.partial(xla_attention, scale=scale, decode_only=case.kind == "decode"))

    out = np.asarray(pallas(*args).astype(jnp.float32))
    result = {"case": case.name, **dataclasses.asdict(case)}
    if case.kind == "prefill":
        cfg = choose_prefill_config(case.head_dim, PAGE_SIZE)
        result["tiles"] = (f"{COMPUTE_WARPGROUPS}x{ROWS} rows + producer, kv_tile {cfg.kv_tile}, "
                           f"{cfg.num_stages} stages")
    if case.num_seqs * case.q_len * case.context <= 2**24:  # the dense reference's memory stays small
        ref = np.asarray(jax.jit(functools.partial(reference_fn, scale=scale))(*args).astype(jnp.float32))
        result["max_abs_error"] = float(np.abs(out - ref).max())
        result["rel_error"] = float(np.linalg.norm(out - ref) / np.linalg.norm(ref))
    result["finite"] = bool(np.isfinite(out).all())
    result["pallas_ms"] = 1e3 * _median_seconds(pallas, *args, repeats=repeats)
    result["xla_ms"] = 1e3 * _median_seconds(xla, q, k, v, 0, md, repeats=repeats)
    return result


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=20, help="timed calls per measurement (the median is kept)")
    parser.add_argument("--smoke", action="store_true",
                        help="no GPU needed: two tiny cases, kernels interpreted, to check this script")
    parser.add_argument("--out", default=None, help="write the results as JSON here")
    args = parser.parse_args(argv)
    if not args.smoke and jax.default_backend() != "gpu":
        print(f"no GPU here (JAX backend: {jax.default_backend()}): nothing to time. The kernels need an NVIDIA "
              f"Hopper GPU; `jaxserve check-lowering --platform cuda` checks them without one, --smoke runs "
              f"this script's code on tiny cases.")
        return 0
    interpret = jax.default_backend() != "gpu"
    cases = SMOKE_CASES if args.smoke else CASES
    device = jax.devices()[0]
    print(f"device: {device.device_kind} (JAX {jax.__version__})", flush=True)
    if args.smoke:
        bandwidth, flops = copy_bandwidth(2**20, args.repeats), matmul_rate(256, args.repeats)
    else:
        bandwidth, flops = copy_bandwidth(repeats=args.repeats), matmul_rate(repeats=args.repeats)
    print(f"measured ceilings: copy {bandwidth / 1e12:.2f} TB/s (read + write), "
          f"bf16 matmul {flops / 1e12:.0f} TFLOP/s", flush=True)
    results = []
    for i, case in enumerate(cases):
        r = run_case(case, seed=i, repeats=args.repeats, interpret=interpret)
        floor = case.kv_bytes() / bandwidth if case.kind == "decode" else case.flops() / flops
        r["floor_ms"] = 1e3 * floor
        results.append(r)
        print(f"[{i + 1}/{len(cases)}] {case.name}: pallas {r['pallas_ms']:.3f} ms, xla {r['xla_ms']:.3f} ms, "
              f"error {r.get('max_abs_error', float('nan')):.1e}" + (f" ({r['tiles']})" if "tiles" in r else ""),
              flush=True)

    print("\n| case | Pallas ms | XLA ms | XLA / Pallas | floor ms | Pallas vs floor | max abs err | rel err |")
    print("|---|---|---|---|---|---|---|---|")
    for r in results:
        err = f"{r['max_abs_error']:.1e} | {r['rel_error']:.1e}" if "max_abs_error" in r else "- | -"
        print(f"| {r['case']} | {r['pallas_ms']:.3f} | {r['xla_ms']:.3f} | {r['xla_ms'] / r['pallas_ms']:.2f}x | "
              f"{r['floor_ms']:.3f} | {r['floor_ms'] / r['pallas_ms']:.0%} | {err} |")
    bad = [r["case"] for r in results if not r["finite"] or r.get("rel_error", 0.0) > 1e-2]
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"device": device.device_kind, "jax": jax.__version__, "copy_bytes_per_s": bandwidth,
                       "matmul_flops_per_s": flops, "cases": results}, f, indent=2)
    if interpret:
        print("(smoke run: kernels interpreted on the CPU; these times mean nothing)")
    if bad:
        print(f"kernel output off its reference in: {bad}")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
