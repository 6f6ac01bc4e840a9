"""The multiply instructions' own peak rate on this CPU: what a matmul kernel's GFLOP/s is a share of.

    python benchmarks/instruction_peak.py [--threads 1 2] [--seconds 1.0] [--out FILE]

For each multiply-add instruction the CPU has (among AVX2's vfmadd231ps on 256 bits, AVX-512's on 512 bits,
AVX512-BF16's vdpbf16ps and AVX512-VNNI's vpdpbusd), a loop of 24 independent register accumulators, two
dozen instructions a pass and nothing else (inline assembly: no loads, no stores, no spills), runs on 1 and
on every core at once. It prints GFLOP/s (a multiply-add is 2 FLOP: vfmadd231ps 16 or 32 a 256- or 512-bit
instruction, vdpbf16ps 64, vpdpbusd 128 (64 byte products)) and instructions a second per thread. The loop
is compiled here with the C++ compiler the kernels use (g++ by default; CXX overrides), -O2 -march=native.
A kernel's rate over this is its efficiency; benchmarks/bench_cpu_matmul.py gives the kernels' rates.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_quantization import cpu_flags  # noqa: E402

# name: (the CPU flag it needs, the instruction with its operands, FLOP an instruction)
INSTRUCTIONS = {
    "vfmadd231ps ymm": ("avx2", "vfmadd231ps %%ymm14, %%ymm15, %%ymm{i}", 16),
    "vfmadd231ps zmm": ("avx512f", "vfmadd231ps %%zmm30, %%zmm31, %%zmm{i}", 32),
    "vdpbf16ps zmm": ("avx512_bf16", "vdpbf16ps %%zmm30, %%zmm31, %%zmm{i}", 64),
    "vpdpbusd zmm": ("avx512_vnni", "vpdpbusd %%zmm30, %%zmm31, %%zmm{i}", 128),
}
ACCUMULATORS = 12  # registers 0-11, each updated twice a pass: 24 instructions, none waiting on another's result

SOURCE = r"""
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <thread>
#include <vector>

static void Loop(long passes) {
  for (long i = 0; i < passes; ++i) asm volatile(BODY ::: CLOBBERS);
}

int main(int argc, char** argv) {
  const int threads = std::atoi(argv[1]);
  const long passes = std::atol(argv[2]);
  const auto start = std::chrono::steady_clock::now();
  std::vector<std::thread> pool;
  for (int t = 0; t < threads; ++t) pool.emplace_back(Loop, passes);
  for (auto& t : pool) t.join();
  std::printf("%.9f\n", std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count());
}
"""


def build(instruction: str, directory: Path) -> Path:
    """The loop's executable for `instruction` (an INSTRUCTIONS key)."""
    _, operands, _ = INSTRUCTIONS[instruction]
    lines = [operands.format(i=i) for i in range(ACCUMULATORS)] * 2
    body = " ".join(f'"{line}\\n"' for line in lines)
    clobbers = ", ".join(f'"xmm{i}"' for i in range(ACCUMULATORS))
    source = directory / "peak.cc"
    source.write_text(f"#define BODY {body}\n#define CLOBBERS {clobbers}\n{SOURCE}")
    binary = directory / instruction.replace(" ", "_")
    compiler = os.environ.get("CXX", "g++")
    subprocess.run([compiler, "-O2", "-march=native", "-pthread", str(source), "-o", str(binary)], check=True)
    return binary


def rate(binary: Path, threads: int, seconds: float) -> float:
    """Instructions a second per thread: a short run sizes a run of about `seconds`, whose time is taken."""
    passes = 100_000
    while True:
        took = float(subprocess.run([str(binary), str(threads), str(passes)], check=True, capture_output=True,
                                    text=True).stdout)
        if took >= seconds / 4:
            break
        passes *= 4
    passes = int(passes * seconds / took)
    took = float(subprocess.run([str(binary), str(threads), str(passes)], check=True, capture_output=True,
                                text=True).stdout)
    return passes * 2 * ACCUMULATORS / took


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--threads", type=int, nargs="+", default=sorted({1, os.cpu_count() or 1}))
    parser.add_argument("--seconds", type=float, default=1.0, help="about how long each measurement runs")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args(argv)
    flags = cpu_flags()
    if platform.machine() not in ("x86_64", "AMD64"):
        raise SystemExit(f"the loops are x86 assembly; this machine is {platform.machine()}")
    present = [name for name, (flag, _, _) in INSTRUCTIONS.items() if flag in flags.split()]
    print(f"CPU flags: {flags}; {os.cpu_count()} cores", flush=True)
    print("| instruction | threads | GFLOP/s | G instructions/s a thread |\n|---|---|---|---|", flush=True)
    results = []
    with tempfile.TemporaryDirectory() as directory:
        for name in present:
            binary = build(name, Path(directory))
            for threads in args.threads:
                per_thread = rate(binary, threads, args.seconds)
                gflops = per_thread * threads * INSTRUCTIONS[name][2] / 1e9
                results.append({"instruction": name, "threads": threads, "gflops": gflops,
                                "instructions_per_s_per_thread": per_thread})
                print(f"| {name} | {threads} | {gflops:.0f} | {per_thread / 1e9:.2f} |", flush=True)
    result = {"cpu_flags": flags, "cores": os.cpu_count(), "results": results}
    if args.out:
        args.out.write_text(json.dumps(result, indent=1))
    return result


if __name__ == "__main__":
    main()
