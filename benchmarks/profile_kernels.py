"""Where an offline serving workload's CPU time goes, kernel by kernel, and what the matmuls' rate in it leaves.

    python benchmarks/profile_kernels.py [--input-len 256] [--output-len 128] [--num-prompts 64]
                                         [--frequency 499] [--out FILE] [engine flags, e.g. --max-num-seqs 32]

Runs `LLM.generate` at the engine's defaults (or the engine flags given) on --num-prompts random prompts of
--input-len tokens, --output-len greedy tokens each (`ignore_eos`): once untimed (warm-up, compiles), then once
timed with `perf record -e cpu-clock` attached to this process, so each sample is 1/--frequency s of one
core's time. Prints each group's share of the samples (the C++ matmul, the C++ attention, XLA's thread pool,
memset/memcpy, the kernel, Python, the rest) and, from the model's FLOPs (`jaxserve.bench.hardware.model_flops`:
2 x params per token, the LM head per output token) over the matmul's core-seconds, the rate the matmuls
ran at in the workload, beside the fastest large matmul measured here in the same dtype (XLA's dot,
PyTorch's, the packed kernel) and the output tok/s the run would reach if its matmuls ran at that rate and
everything else took what it took; and, where a C++ compiler is found, the multiply-add instruction's own peak
(a register-only loop built here, on every core) and the same bound at it. Needs Linux perf
(`perf_event_paranoid` <= 1, or root).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

# Symbol patterns -> group, the first that matches wins. The C++ kernels' names are those of
# jaxserve/ops/cpu_kernels/*.cc (their anonymous namespace included).
GROUPS = (
    # a decode row attends alone, one KV head at a time (paged_row_attention.cc)
    ("attention, decode rows", r"AttendGrouped|AttendOne|Grouped(Scores|Values|For)|FoldLane"),
    ("attention, prompt tiles and page writes", r"Attend|PagedRowAttention|WritePages|TileScores|WeightedSumByD|"
                                                r"DotPairs"),
    ("matmul", r"Tile<|AmxBlock|AmxPair|AmxRows|AmxStep|SignedQuadSteps|BlockTile|QuantizeRows|ScaleRows|"
               r"StoreGated|RunMatmul<|Panel<"),
    ("XLA thread pool", r"Eigen::|tsl::|ThreadPool|ParallelFor"),
    ("memset, memcpy", r"__mem(set|cpy|move)"),
    ("kernel", r"^\[k\]"),
    ("Python", r"_PyEval|Py[A-Z]\w+|_Py\w+"),
)


def group_shares(report: str) -> dict[str, float]:
    """`perf report --no-children --sort symbol -g none --stdio` text -> group -> percent of the samples."""
    shares = {name: 0.0 for name, _ in GROUPS} | {"rest": 0.0}
    for line in report.splitlines():
        found = re.match(r"\s*([\d.]+)%\s+(\[[.k]\])\s+(.*)", line)
        if not found:
            continue
        percent, kind, symbol = float(found.group(1)), found.group(2), found.group(3).strip()
        text = f"{kind} {symbol}" if kind == "[k]" else symbol
        name = next((name for name, pattern in GROUPS if re.search(pattern, text)), "rest")
        shares[name] += percent
    total = sum(shares.values())  # perf rounds each line: the sum is 100 only to within a percent
    return {name: 100 * percent / total for name, percent in shares.items()} if total else shares


def sampled_seconds(report: str) -> float:
    """Core-seconds the samples stand for, from the report's header ("Samples: 16K of event ..." is rounded,
    so the event count, in nanoseconds of cpu-clock, is read instead)."""
    found = re.search(r"Event count \(approx\.\): (\d+)", report)
    if not found:
        raise ValueError("perf report gave no event count")
    return int(found.group(1)) / 1e9


# A register-only loop of the multiply-add the matmuls are made of, on every core: the instruction's peak
# here (vdpbf16ps: 64 FLOP per instruction; float32 FMA on AVX-512: 32, on AVX2: 16). 24 independent sums
# (12 on AVX2's 16 registers) keep both FMA pipes busy through the instruction's latency.
PEAK_LOOP = r"""
#include <immintrin.h>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <thread>
#include <vector>
#if defined(JAXSERVE_PEAK_BF16)
using Acc = __m512; using In = __m512bh; constexpr int kSums = 24, kFlops = 64;
static inline Acc Step(Acc a, In x, In y) { return _mm512_dpbf16_ps(a, x, y); }
static inline In Input() { return (In)_mm512_set1_epi32(0x3f803f80); }
#elif defined(__AVX512F__)
using Acc = __m512; using In = __m512; constexpr int kSums = 24, kFlops = 32;
static inline Acc Step(Acc a, In x, In y) { return _mm512_fmadd_ps(x, y, a); }
static inline In Input() { return _mm512_set1_ps(1.0f); }
#else
using Acc = __m256; using In = __m256; constexpr int kSums = 12, kFlops = 16;
static inline Acc Step(Acc a, In x, In y) { return _mm256_fmadd_ps(x, y, a); }
static inline In Input() { return _mm256_set1_ps(1.0f); }
#endif
static float Run(long iterations) {
  Acc sums[kSums];
  for (int j = 0; j < kSums; ++j) {  // distinct sums: equal ones would be computed once
    sums[j] = Acc{};
    ((float*)&sums[j])[0] = float(j);
  }
  In x = Input(), y = Input();
  for (long i = 0; i < iterations; ++i) {
    asm volatile("" : "+v"(x));  // x unknown to the compiler each time round: nothing is folded away
#pragma GCC unroll 24
    for (int j = 0; j < kSums; ++j) sums[j] = Step(sums[j], x, y);
  }
  float total = 0;
  for (int j = 0; j < kSums; ++j) total += ((float*)&sums[j])[0];
  return total;
}
int main(int argc, char** argv) {
  const int threads = std::atoi(argv[1]);
  const long iterations = std::atol(argv[2]);
  std::vector<float> out(threads);
  const auto start = std::chrono::steady_clock::now();
  std::vector<std::thread> pool;
  for (int t = 0; t < threads; ++t) pool.emplace_back([&, t] { out[t] = Run(iterations); });
  for (auto& t : pool) t.join();
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  std::printf("%.6e %g\n", threads * double(iterations) * kSums * kFlops / seconds, out[0]);
}
"""


def decode_kv_bytes(model_cfg, kv_dtype: str, num_prompts: int, input_len: int, output_len: int) -> int:
    """Bytes of KV pages the decode rows read: the row at position p attends to p + 1 keys and values in
    every layer, for positions input_len .. input_len + output_len - 2 of each request."""
    tokens = sum(position + 1 for position in range(input_len, input_len + output_len - 1))
    return num_prompts * tokens * model_cfg.kv_bytes_per_token(kv_dtype)


def measure_read_bandwidth(num_bytes: int = 512 * 2**20, repeats: int = 5) -> float:
    """Bytes/s XLA reads a bfloat16 array of num_bytes at (a sum, on its intra-op threads), best of repeats."""
    import jax
    import jax.numpy as jnp

    array = jnp.ones((num_bytes // 2,), jnp.bfloat16)
    total = jax.jit(lambda a: jnp.sum(a.astype(jnp.float32)))
    total(array).block_until_ready()
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        total(array).block_until_ready()
        best = min(best, time.perf_counter() - start)
    return num_bytes / best


def instruction_peak(dtype: str, cores: int) -> float | None:
    """FLOP/s of PEAK_LOOP on `cores` threads (best of three), built here for this CPU with the compiler the
    kernels use ($CXX, else c++); None without a compiler, or for bfloat16 where the CPU lacks AVX512-BF16."""
    import shutil

    from jaxserve.ops.cpu_ffi import bf16_dot_instructions

    compiler = os.environ.get("CXX", "c++")
    if shutil.which(compiler) is None or (dtype == "bfloat16" and not bf16_dot_instructions()):
        return None
    with tempfile.TemporaryDirectory() as tmp:
        source, binary = Path(tmp) / "peak.cc", Path(tmp) / "peak"
        source.write_text(PEAK_LOOP)
        subprocess.run([compiler, "-O2", "-march=native", "-std=c++17", "-pthread",
                        *(["-DJAXSERVE_PEAK_BF16"] if dtype == "bfloat16" else []), str(source), "-o", str(binary)],
                       check=True, capture_output=True)
        runs = [subprocess.run([str(binary), str(cores), "20000000"], check=True, capture_output=True, text=True)
                for _ in range(3)]
    return max(float(run.stdout.split()[0]) for run in runs)


def main(argv: list[str] | None = None) -> dict:
    from jaxserve.config.engine_config import add_engine_flags, engine_config_from_args

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_engine_flags(parser)
    parser.add_argument("--input-len", type=int, default=256)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--num-prompts", type=int, default=64)
    parser.add_argument("--frequency", type=int, default=499, help="perf's samples per second per core")
    parser.add_argument("--out", type=Path, help="write the results as JSON here")
    args = parser.parse_args(argv)
    import shutil

    if shutil.which("perf") is None:
        raise SystemExit("profile_kernels.py needs Linux perf (`perf record`) on the PATH")

    import dataclasses

    import numpy as np

    from jaxserve.bench.hardware import CEILING_DTYPES, cpu_matmul_ceiling, model_flops
    from jaxserve.config.sampling_params import SamplingParams
    from jaxserve.llm import LLM
    from jaxserve.ops.cpu_ffi import cpu_features

    llm = LLM(args.model, **dataclasses.asdict(engine_config_from_args(args)))
    vocab = llm.engine.model_cfg.vocab_size
    rng = np.random.default_rng(args.seed or 0)  # the engine's --seed

    def prompts():
        return [{"prompt_token_ids": rng.integers(100, vocab - 100, args.input_len).tolist()}
                for _ in range(args.num_prompts)]

    params = SamplingParams(temperature=0.0, max_tokens=args.output_len, ignore_eos=True)
    print("warm-up round (untimed)", flush=True)
    llm.generate(prompts(), params, use_tqdm=False)
    timed = prompts()
    with tempfile.TemporaryDirectory() as tmp:
        data = Path(tmp) / "perf.data"
        perf = subprocess.Popen(["perf", "record", "-e", "cpu-clock", "-F", str(args.frequency), "-p",
                                 str(os.getpid()), "-o", str(data)], stdout=subprocess.DEVNULL,
                                stderr=subprocess.PIPE, text=True)
        time.sleep(1.0)  # perf attached before the round starts
        if perf.poll() is not None:
            raise SystemExit(f"perf record exited: {perf.stderr.read().strip()}")
        print(f"timed round under perf: {args.num_prompts} prompts of {args.input_len} tokens, "
              f"{args.output_len} out", flush=True)
        start = time.perf_counter()
        llm.generate(timed, params, use_tqdm=False)
        seconds = time.perf_counter() - start
        perf.send_signal(signal.SIGINT)
        perf.wait(timeout=120)
        report = subprocess.run(["perf", "report", "-i", str(data), "--no-children", "--sort", "symbol", "-g", "none",
                                 "--stdio"], capture_output=True, text=True, check=True).stdout
    shares = group_shares(report)
    core_seconds = sampled_seconds(report)
    runner = llm.engine.runner
    # what the matmuls multiply in: 8-bit weights (the quantization's name) have no ceiling measured here
    dtype = llm.engine.cfg.quantization or ("bfloat16" if runner.matmul_backend == "cpu-bf16" else llm.engine.cfg.dtype)
    flops = model_flops(llm.engine.model_cfg, args.input_len, args.output_len) * args.num_prompts
    matmul_core_seconds = core_seconds * shares["matmul"] / 100
    cores = len(os.sched_getaffinity(0))
    rate = flops / matmul_core_seconds * cores  # FLOP/s of the whole machine while the matmuls ran
    ceiling = cpu_matmul_ceiling(dtype, with_torch=True) if dtype in CEILING_DTYPES else None
    peak = instruction_peak(dtype, cores) if dtype in CEILING_DTYPES else None
    output_tokens = args.num_prompts * args.output_len
    kv_bytes = decode_kv_bytes(llm.engine.model_cfg, llm.engine.cfg.kv_cache_dtype, args.num_prompts, args.input_len,
                               args.output_len)
    decode_attention_seconds = core_seconds * shares["attention, decode rows"] / 100 / cores
    bandwidth = measure_read_bandwidth()

    def seconds_at(limit: float) -> float:
        """The round's wall time with the matmuls at `limit` FLOP/s (never slower than they ran), the rest
        as it was (the samples cover the round; perf's attaching second is idle)."""
        return seconds - matmul_core_seconds / cores * (1 - min(rate / limit, 1.0))

    flags = " ".join(f for f in ("avx2", "avx512f", "avx512_bf16", "avx512_vnni", "amx_bf16", "amx_int8")
                     if f in cpu_features().split())
    result = {"cpu_flags": flags, "cores": cores, "dtype": dtype, "matmul_backend": runner.matmul_backend,
              "attention_backend": runner.attention_backend, "seconds": seconds,
              "output_tok_s": output_tokens / seconds, "sampled_core_seconds": core_seconds, "shares": shares,
              "model_gflop": flops / 1e9, "matmul_gflop_s": rate / 1e9, "ceiling_gflop_s": ceiling and ceiling / 1e9,
              "instruction_peak_gflop_s": peak and peak / 1e9, "decode_kv_gb": kv_bytes / 1e9,
              "decode_attention_gb_s": decode_attention_seconds and kv_bytes / decode_attention_seconds / 1e9,
              "read_bandwidth_gb_s": bandwidth / 1e9}
    print(f"\nCPU flags: {flags}; {cores} cores; matmuls in {dtype} ({runner.matmul_backend}), attention "
          f"{runner.attention_backend}")
    print(f"timed round: {seconds:.2f} s, {output_tokens / seconds:.1f} output tok/s; perf sampled "
          f"{core_seconds:.1f} core-seconds (of {seconds * cores:.1f})")
    print("\n| where | share of the samples |\n|---|---|")
    for name, percent in shares.items():
        print(f"| {name} | {percent:.1f}% |")
    print(f"\nmatmuls: {flops / 1e9:.0f} GFLOP of the model in {matmul_core_seconds:.1f} core-seconds = "
          f"{rate / 1e9:.0f} GFLOP/s on {cores} cores")
    limits = [(ceiling, "output_tok_s_at_ceiling", f"the fastest large {dtype} matmul measured here"),
              (peak, "output_tok_s_at_instruction_peak",
               f"the multiply-add's own peak here (a register-only loop on {cores} cores)")]
    for limit, key, what in limits:
        if limit:
            at_limit = seconds_at(limit)
            result[key] = output_tokens / at_limit
            print(f"{what}: {limit / 1e9:.0f} GFLOP/s, the matmuls ran at {rate / limit:.0%} of it; with them at it and "
                  f"the rest as it was: {output_tokens / at_limit:.1f} output tok/s ({seconds / at_limit:.2f}x)")
    if decode_attention_seconds:
        print(f"decode rows' attention: {kv_bytes / 1e9:.1f} GB of {llm.engine.cfg.kv_cache_dtype} KV pages in "
              f"{decode_attention_seconds:.2f} s of {cores} cores = {kv_bytes / decode_attention_seconds / 1e9:.1f} "
              f"GB/s, against {bandwidth / 1e9:.1f} GB/s for XLA's sum over a 512 MiB bfloat16 array here")
    if args.out:
        args.out.write_text(json.dumps(result, indent=2))
    return result


if __name__ == "__main__":
    main()
