"""Times the Pallas paged-attention kernels on a GPU against the device's peak (and the XLA path).

Shapes: Llama-3-8B-like attention (32 query heads over 8 KV heads, head_dim 128, bf16 pages of 16
tokens, one layer's page array, randomly permuted pages, random data).

  decode   one row per sequence, batch 1..256, context 512..32k: time, and achieved HBM bandwidth
           (bytes of K and V each sequence must read, plus q and the output) against the peak
  prefill  per sequence a chunk of min(context, 2048) new tokens on top of the rest cached, batch
           1..16: time, and achieved TFLOP/s (QK^T and PV over the causal key ranges) against the peak

Peaks are datasheet figures (H100 SXM 3.35 TB/s, 989 dense bf16 TFLOP/s; H200 4.8 TB/s, same
TFLOP/s); --measure-ceilings also times a device-to-device copy and a bf16 matmul as measured
ceilings. Each time is the median of --repeats calls after --warmup calls, each call synchronized.
Shapes whose K/V would exceed --max-kv-gib are skipped and listed. Without a GPU the script says so
and exits 0; --dry-run prints the plan with its byte and FLOP counts, and --smoke runs one tiny shape
per kernel in interpret mode, both on any machine.

    python benchmarks/bench_kernels.py [--kernels decode prefill] [--repeats 20] [--no-xla]
                                       [--measure-ceilings] [--dry-run] [--smoke] [--out results.json]
"""

from __future__ import annotations

import argparse
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

NUM_HEADS, NUM_KV_HEADS, HEAD_DIM, PAGE_SIZE, DTYPE = 32, 8, 128, 16, jnp.bfloat16
CONTEXTS = (512, 2048, 8192, 32768)
DECODE_BATCHES = (1, 8, 32, 128, 256)
PREFILL_BATCHES = (1, 4, 16)
PREFILL_CHUNK = 2048
PEAKS = {  # device_kind substring -> (HBM bytes/s, dense bf16 FLOP/s), datasheet
    "H200": (4.8e12, 989e12),
    "H100 PCIe": (2.0e12, 756e12),
    "H100": (3.35e12, 989e12),
}


def plan(kernels, max_kv_gib):
    """[(kind, batch, context, q_lens, kv_lens)], and the skipped shapes."""
    cases, skipped = [], []
    itemsize = jnp.dtype(DTYPE).itemsize
    for kind in kernels:
        for context in CONTEXTS:
            for batch in DECODE_BATCHES if kind == "decode" else PREFILL_BATCHES:
                kv_bytes = 2 * batch * context * NUM_KV_HEADS * HEAD_DIM * itemsize
                if kv_bytes > max_kv_gib * 2**30:
                    skipped.append((kind, batch, context))
                    continue
                q_len = 1 if kind == "decode" else min(context, PREFILL_CHUNK)
                cases.append((kind, batch, context, [q_len] * batch, [context] * batch))
    return cases, skipped


def work(q_lens, kv_lens):
    """(bytes the kernel must move at least, FLOPs of QK^T and PV over the causal key ranges)."""
    itemsize = jnp.dtype(DTYPE).itemsize
    kv_bytes = sum(2 * n * NUM_KV_HEADS * HEAD_DIM * itemsize for n in kv_lens)
    qo_bytes = 2 * sum(q_lens) * NUM_HEADS * HEAD_DIM * itemsize
    keys = sum(sum(kv - q + i + 1 for i in range(q)) for q, kv in zip(q_lens, kv_lens))
    return kv_bytes + qo_bytes, 4 * NUM_HEADS * HEAD_DIM * keys


def make_inputs(q_lens, kv_lens, seed=0):
    from jaxserve.attention import AttentionMetadata

    rng = np.random.default_rng(seed)
    pages_needed = [-(-n // PAGE_SIZE) for n in kv_lens]
    num_pages = sum(pages_needed) + 1
    pool = rng.permutation(num_pages - 1) + 1  # page 0 stays the dummy page
    pages_per_seq = max(pages_needed)
    tables = np.zeros((len(kv_lens), pages_per_seq), np.int32)
    start = 0
    for s, n in enumerate(pages_needed):
        tables[s, :n] = pool[start:start + n]
        start += n
    cu_q_lens = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)
    key = jax.random.key(seed)
    kq, kk, kv = jax.random.split(key, 3)
    shape = (1, num_pages, PAGE_SIZE, NUM_KV_HEADS, HEAD_DIM)
    q = jax.random.normal(kq, (int(cu_q_lens[-1]), NUM_HEADS, HEAD_DIM), DTYPE)
    k_pages = jax.random.normal(kk, shape, DTYPE)
    v_pages = jax.random.normal(kv, shape, DTYPE)
    slot_mapping = jnp.zeros(q.shape[0], jnp.int32)  # unused by attention
    md = AttentionMetadata(slot_mapping, jnp.asarray(cu_q_lens), jnp.asarray(kv_lens, jnp.int32), jnp.asarray(tables))
    return q, k_pages, v_pages, md


def time_it(fn, args, warmup, repeats):
    for _ in range(warmup):
        jax.block_until_ready(fn(*args))
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def attention_fns(kind, interpret=False):
    import pallas_kernels as pk
    from jaxserve.attention import ragged_paged_attention

    kernel = pk.decode_attention if kind == "decode" else pk.ragged_paged_attention
    scale = HEAD_DIM**-0.5
    pallas = jax.jit(lambda q, k, v, md: kernel(q, k, v, 0, md.cu_q_lens, md.kv_lens, md.block_tables, scale=scale,
                                                interpret=interpret))
    xla = jax.jit(functools.partial(ragged_paged_attention, layer=0, scale=scale, q_block=1 if kind == "decode" else 16))
    return pallas, lambda q, k, v, md: xla(q, k, v, md=md)


def measure_ceilings():
    x = jnp.ones((2**30 // 2,), DTYPE)  # 1 GiB
    copy = time_it(jax.jit(lambda a: a + 1), (x,), 3, 10)
    a = jax.random.normal(jax.random.key(0), (8192, 8192), DTYPE)
    matmul = time_it(jax.jit(lambda a: a @ a), (a,), 3, 10)
    return 2 * x.nbytes / copy, 2 * 8192**3 / matmul


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--kernels", nargs="+", default=["decode", "prefill"], choices=["decode", "prefill"])
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--max-kv-gib", type=float, default=16.0)
    parser.add_argument("--no-xla", action="store_true", help="skip timing the XLA attention path")
    parser.add_argument("--measure-ceilings", action="store_true")
    parser.add_argument("--dry-run", action="store_true", help="print the plan only (any machine)")
    parser.add_argument("--smoke", action="store_true",
                        help="no GPU needed: one tiny decode and prefill shape, kernels in interpret mode, "
                             "to check this script; the times mean nothing")
    parser.add_argument("--out", type=Path, default=None, help="write the results as JSON")
    args = parser.parse_args(argv)

    cases, skipped = plan(args.kernels, args.max_kv_gib)
    if args.dry_run:
        for kind, batch, context, q_lens, kv_lens in cases:
            nbytes, flops = work(q_lens, kv_lens)
            print(f"{kind:8s} batch={batch:4d} context={context:6d}  {nbytes / 1e9:8.3f} GB  {flops / 1e12:8.3f} TFLOP")
        print(f"skipped (K/V over {args.max_kv_gib} GiB): {skipped}")
        return 0
    if args.smoke:
        cases, skipped = [(kind, 2, 40, [1 if kind == "decode" else 8] * 2, [40, 17]) for kind in args.kernels], []
    elif jax.default_backend() != "gpu":
        print(f"no GPU here (JAX backend: {jax.default_backend()}): nothing to time. The kernels need an NVIDIA "
              f"Hopper GPU; `jaxserve check-lowering --platform cuda` checks them without one.")
        return 0

    interpret = jax.default_backend() != "gpu"
    device = jax.devices()[0]
    kind_name = device.device_kind
    peak_bw, peak_flops = next((p for name, p in PEAKS.items() if name in kind_name), (None, None))
    print(f"device: {kind_name}; datasheet peaks: "
          + (f"{peak_bw / 1e12:.2f} TB/s, {peak_flops / 1e12:.0f} bf16 TFLOP/s" if peak_bw else "unknown"))
    results = {"device": kind_name, "peak_bytes_per_s": peak_bw, "peak_flops": peak_flops, "cases": [],
               "skipped": skipped}
    if args.measure_ceilings:
        bw, flops = measure_ceilings()
        results |= {"measured_copy_bytes_per_s": bw, "measured_matmul_flops": flops}
        print(f"measured ceilings: copy {bw / 1e12:.2f} TB/s (read + write), bf16 matmul {flops / 1e12:.0f} TFLOP/s")

    print(f"{'kernel':8s} {'batch':>5s} {'context':>7s} {'pallas ms':>10s} {'xla ms':>9s}  achieved (of peak)")
    for kind, batch, context, q_lens, kv_lens in cases:
        pallas, xla = attention_fns(kind, interpret=interpret)
        inputs = make_inputs(q_lens, kv_lens)
        nbytes, flops = work(q_lens, kv_lens)
        t_pallas = time_it(pallas, inputs, args.warmup, args.repeats)
        t_xla = None if args.no_xla else time_it(xla, inputs, args.warmup, args.repeats)
        if kind == "decode":
            achieved, peak, unit = nbytes / t_pallas, peak_bw, "TB/s"
        else:
            achieved, peak, unit = flops / t_pallas, peak_flops, "TFLOP/s"
        share = f" ({100 * achieved / peak:.0f}%)" if peak else ""
        xla_ms = f"{1e3 * t_xla:9.3f}" if t_xla is not None else f"{'-':>9s}"
        print(f"{kind:8s} {batch:5d} {context:7d} {1e3 * t_pallas:10.3f} {xla_ms}  {achieved / 1e12:.4f} {unit}{share}",
              flush=True)
        results["cases"].append(dict(kernel=kind, batch=batch, context=context, pallas_s=t_pallas, xla_s=t_xla,
                                     bytes=nbytes, flops=flops))
        del inputs
    if interpret:
        print("(smoke run: kernels interpreted on CPU; these times mean nothing)")
    if skipped:
        print(f"skipped (K/V over {args.max_kv_gib} GiB): {skipped}")
    if args.out:
        args.out.write_text(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
