"""The multiply instructions' own peak rate on this CPU: what a matmul kernel's GFLOP/s is a share of.

    python benchmarks/instruction_peak.py [--threads 1 2] [--seconds 1.0] [--out FILE]

For each multiply-add instruction the CPU has (among AVX2's vfmadd231ps on 256 bits, AVX-512's on 512 bits,
AVX512-BF16's vdpbf16ps and AVX512-VNNI's vpdpbusd), a loop of two dozen instructions a pass and nothing else
(inline assembly: no loads, no stores, no spills) runs on 1 and on every core at once. On 512 bits each
instruction of a pass adds into its own register; on 256 bits, whose 16 registers also hold the operands, 12
registers take two each. It prints GFLOP/s (a multiply-add is 2 FLOP: vfmadd231ps 16 or 32 a 256- or 512-bit
instruction, vdpbf16ps 64, vpdpbusd 128 (64 byte products)) and instructions a second per thread. The loop
is compiled here with the C++ compiler the kernels use (g++ by default; CXX overrides), -O2 -march=native.
A kernel's rate over this is its efficiency; benchmarks/bench_cpu_matmul.py gives the kernels' rates.

Then the C++ matmul's AVX-512 tile loop alone (`TILE_LOOPS`; packed_matmul.cc: 8 rows x 3 accumulator vectors):
each step loads a panel row's three weight vectors, broadcasts eight x values and issues 24 multiply-adds,
four row tiles passing over each 144-step panel (27 KiB: int8 at K = 576) as a 32-row call's do, in inline
assembly. Its int8 form with the kernel's group epilogue every G steps (each of the 24 int sums converted to
float, multiplied by the group's x scale and added to a float sum kept in memory, then zeroed: what
`Accumulate` does at the end of each activation group) says what those epilogues cost. It prints each loop's
instructions a second per thread and its share of the instruction's own peak.
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
PER_PASS = 24  # instructions a pass


def accumulators(instruction: str) -> int:
    """Accumulator registers: 0-23 on 512 bits (twelve chains of vdpbf16ps held a Zen 5 to 7.8 G instructions
    a second, its latency, against 8.7 with 24); 0-11 on 256 bits, whose 16 registers hold the operands too."""
    return 24 if "zmm" in instruction else 12

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


# name: (the instruction of INSTRUCTIONS it issues, the int8 group epilogue every this many steps or 0: none)
TILE_LOOPS = {
    "vpdpbusd tile": ("vpdpbusd zmm", 0),
    "vpdpbusd tile, groups of 24 steps (K = 576's groups of 96)": ("vpdpbusd zmm", 24),
    "vpdpbusd tile, groups of 32 steps (groups of 128)": ("vpdpbusd zmm", 32),
    "vdpbf16ps tile": ("vdpbf16ps zmm", 0),
}
TILE_STEPS, TILE_PASSES = 144, 4  # a panel's steps; row tiles over each panel
TILE_ROWS = 8

TILE_SOURCE = r"""
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <thread>
#include <vector>

static void Loop(long passes) {
  std::vector<uint32_t> w(STEPS * 48 + 16), x(STEPS * 8 + 16);  // the timings do not depend on the values
  alignas(64) static thread_local float sums[24 * 16];
  const float scale = 1.0f;
  for (long i = 0; i < passes; ++i)
    for (int tile = 0; tile < TILES; ++tile) {
      const uint32_t* wp = w.data();
      const uint32_t* xp = x.data();
      for (long k = 0; k < STEPS; ++k, wp += 48, xp += 8) {
        asm volatile(STEP ::"r"(wp), "r"(xp) : CLOBBERS);
        if (GROUP > 0 && (k + 1) % GROUP == 0) asm volatile(EPILOGUE ::"r"(sums), "r"(&scale) : CLOBBERS, "memory");
      }
    }
}
""" + SOURCE[SOURCE.index("int main"):]


def tile_assembly(instruction: str) -> tuple[str, str, str]:
    """The tile loop's step and group epilogue (C string literals) and clobbers for `instruction`: zmm0-23 the
    sums, 28-30 the panel row's weight vectors, 31 the broadcast x (30 and 31 the epilogue's scale and temporary)."""
    mnemonic = instruction.split()[0]
    step = ["vmovdqu32 (%0), %%zmm28", "vmovdqu32 64(%0), %%zmm29", "vmovdqu32 128(%0), %%zmm30"]
    for row in range(TILE_ROWS):
        step.append(f"vpbroadcastd {4 * row}(%1), %%zmm31")
        step += [f"{mnemonic} %%zmm31, %%zmm{28 + j}, %%zmm{3 * row + j}" for j in range(3)]
    epilogue = ["vbroadcastss (%1), %%zmm30"]
    for i in range(3 * TILE_ROWS):
        epilogue += [f"vcvtdq2ps %%zmm{i}, %%zmm31", f"vfmadd213ps {64 * i}(%0), %%zmm30, %%zmm31",
                     f"vmovaps %%zmm31, {64 * i}(%0)", f"vpxord %%zmm{i}, %%zmm{i}, %%zmm{i}"]
    literal = lambda lines: " ".join(f'"{line}\\n"' for line in lines)  # noqa: E731
    clobbers = ", ".join(f'"xmm{i}"' for i in list(range(3 * TILE_ROWS)) + [28, 29, 30, 31])
    return literal(step), literal(epilogue), clobbers


def compile_loop(source_text: str, name: str, directory: Path) -> Path:
    source = directory / f"{name}.cc"
    source.write_text(source_text)
    binary = directory / name
    compiler = os.environ.get("CXX", "g++")
    subprocess.run([compiler, "-O2", "-march=native", "-pthread", str(source), "-o", str(binary)], check=True)
    return binary


def build(instruction: str, directory: Path) -> Path:
    """The loop's executable for `instruction` (an INSTRUCTIONS key)."""
    _, operands, _ = INSTRUCTIONS[instruction]
    count = accumulators(instruction)
    lines = [operands.format(i=i) for i in range(count)] * (PER_PASS // count)
    body = " ".join(f'"{line}\\n"' for line in lines)
    clobbers = ", ".join(f'"xmm{i}"' for i in range(count))
    return compile_loop(f"#define BODY {body}\n#define CLOBBERS {clobbers}\n{SOURCE}",
                        instruction.replace(" ", "_"), directory)


def build_tile(name: str, directory: Path) -> Path:
    """The tile loop's executable for `name` (a TILE_LOOPS key)."""
    instruction, group = TILE_LOOPS[name]
    step, epilogue, clobbers = tile_assembly(instruction)
    defines = {"STEP": step, "EPILOGUE": epilogue, "CLOBBERS": clobbers, "STEPS": TILE_STEPS,
               "TILES": TILE_PASSES, "GROUP": group}
    header = "".join(f"#define {key} {value}\n" for key, value in defines.items())
    return compile_loop(header + TILE_SOURCE, f"tile_{instruction.split()[0]}_{group}", directory)


def rate(binary: Path, threads: int, seconds: float, per_pass: int = PER_PASS) -> float:
    """Instructions a second per thread (`per_pass` multiply-adds a pass): a short run sizes a run of about
    `seconds`, whose time is taken."""
    passes = 100_000 if per_pass <= PER_PASS else 100
    while True:
        took = float(subprocess.run([str(binary), str(threads), str(passes)], check=True, capture_output=True,
                                    text=True).stdout)
        if took >= seconds / 4:
            break
        passes *= 4
    passes = int(passes * seconds / took)
    took = float(subprocess.run([str(binary), str(threads), str(passes)], check=True, capture_output=True,
                                text=True).stdout)
    return passes * per_pass / took


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
    results, tile_results = [], []
    with tempfile.TemporaryDirectory() as directory:
        for name in present:
            binary = build(name, Path(directory))
            for threads in args.threads:
                per_thread = rate(binary, threads, args.seconds)
                gflops = per_thread * threads * INSTRUCTIONS[name][2] / 1e9
                results.append({"instruction": name, "threads": threads, "gflops": gflops,
                                "instructions_per_s_per_thread": per_thread})
                print(f"| {name} | {threads} | {gflops:.0f} | {per_thread / 1e9:.2f} |", flush=True)
        peaks = {(r["instruction"], r["threads"]): r["instructions_per_s_per_thread"] for r in results}
        tiles = [name for name, (instruction, _) in TILE_LOOPS.items() if instruction in present]
        if tiles:
            print("\n| tile loop | threads | G instructions/s a thread | share of the instruction's peak |\n"
                  "|---|---|---|---|", flush=True)
        for name in tiles:
            binary = build_tile(name, Path(directory))
            for threads in args.threads:
                per_thread = rate(binary, threads, args.seconds, TILE_PASSES * TILE_STEPS * 3 * TILE_ROWS)
                share = per_thread / peaks[TILE_LOOPS[name][0], threads]
                tile_results.append({"loop": name, "threads": threads, "instructions_per_s_per_thread": per_thread,
                                     "share_of_peak": share})
                print(f"| {name} | {threads} | {per_thread / 1e9:.2f} | {share:.0%} |", flush=True)
    result = {"cpu_flags": flags, "cores": os.cpu_count(), "results": results, "tile_loops": tile_results}
    if args.out:
        args.out.write_text(json.dumps(result, indent=1))
    return result


if __name__ == "__main__":
    main()
