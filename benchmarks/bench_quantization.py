"""Offline decode (and prefill) throughput of the default model under each weight and KV setting, same run.

The settings (`SETTINGS`): float32 (the C++ float32 matmul), cpu-bf16 (bfloat16 weights and KV pages),
int8 (int8 weights, W8A8, its default bfloat16 KV pages; on a CPU with AVX512-BF16 its attention's products in
bfloat16), int8 with fp8 KV pages, int8 with float32 ones, and int8 with float32 attention products
(`attention_backend="cpu"`, the default before 2026-12-03), and fp8 (float8 e4m3 weights with bfloat16
activations in the C++ matmul, W8A16, since 2026-12-04). For each batch size B, every
setting runs the same B random prompts of P tokens, then N greedy decode steps, through its own
`ModelRunner` (bench_steps.JaxserveBench: inputs built, the device call, on-device sampling, the host copy
of the ids), the settings alternating within each round so load from elsewhere lands on all alike;
figures are the median of --repeats timed rounds after an untimed one. The table gives tokens/s and each
setting's ratio to the fastest unquantized one (float32 or cpu-bf16).

    python benchmarks/bench_quantization.py [--batch-sizes 1 32] [--prompt-len 128] [--decode-steps 32]
                                            [--repeats 3] [--settings float32 cpu-bf16 int8] [--out FILE]
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).parent))
from bench_steps import JaxserveBench, log, run_rounds, summarize  # noqa: E402

SETTINGS = {
    "float32": {},
    "cpu-bf16": {"matmul_backend": "cpu-bf16"},
    "int8": {"quantization": "int8"},
    "int8 fp8-kv": {"quantization": "int8", "kv_cache_dtype": "fp8"},
    "int8 f32-kv": {"quantization": "int8", "kv_cache_dtype": "float32"},
    "int8 f32-attn": {"quantization": "int8", "attention_backend": "cpu"},
    "fp8": {"quantization": "fp8"},
}
UNQUANTIZED = ("float32", "cpu-bf16")


def cpu_flags() -> str:
    from jaxserve.ops.cpu_ffi import cpu_features

    wanted = ("avx2", "avx512f", "avx512_bf16", "avx512_vnni", "avx_vnni", "amx_bf16", "amx_int8")
    return " ".join(flag for flag in wanted if flag in cpu_features().split())


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 32])
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--decode-steps", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--settings", nargs="+", default=list(SETTINGS), choices=list(SETTINGS))
    parser.add_argument("--out", type=Path)
    args = parser.parse_args(argv)
    max_batch = max(args.batch_sizes)
    benches = {name: JaxserveBench(max_batch, args.prompt_len, args.decode_steps, **SETTINGS[name])
               for name in args.settings}
    for name, bench in benches.items():
        log(f"{name}: warm-up")
        bench.warmup()
    rng = np.random.default_rng(0)
    results = []
    for batch in args.batch_sizes:
        prompts = rng.integers(0, next(iter(benches.values())).vocab_size, (batch, args.prompt_len), dtype=np.int32)
        times = run_rounds({name: bench.cases(prompts) for name, bench in benches.items()}, args.repeats,
                           f"B={batch}")
        row = {"batch": batch} | {name: summarize(t, batch, args.prompt_len, args.decode_steps)
                                  for name, t in times.items()}
        results.append(row)
    cpu = f"{platform.processor() or platform.machine()}, flags: {cpu_flags()}"
    lines = [f"CPU: {cpu}; P={args.prompt_len}, N={args.decode_steps}, median of {args.repeats}", "",
             "| B | setting | decode tok/s | vs best unquantized | prefill tok/s |", "|---|---|---|---|---|"]
    for row in results:
        best = max((row[n]["decode_tok_s"] for n in UNQUANTIZED if n in row), default=None)
        for name in args.settings:
            r = row[name]
            vs = f"{r['decode_tok_s'] / best:.2f}x" if best else "-"
            lines.append(f"| {row['batch']} | {name} | {r['decode_tok_s']:,.0f} | {vs} | {r['prefill_tok_s']:,.0f} |")
    print("\n".join(lines))
    out = {"cpu": cpu, "args": vars(args) | {"out": str(args.out)}, "results": results}
    if args.out:
        args.out.write_text(json.dumps(out, indent=1))
    return out


if __name__ == "__main__":
    main()
