"""What structured output costs a server: the same load with none and with a share of the requests held
to a JSON schema, against one jaxserve server, in alternating rounds.

    python benchmarks/bench_structured.py [--ratio 0.5] [--concurrency 8] [--rounds 3]

Each round runs `jaxserve bench serve --structured-output-ratio 0` and then `--structured-output-ratio
RATIO`, each with prompts of its own (random, 256 in / 128 out, --ignore-eos; the same server's prefix
cache would serve repeated prompts). The constrained requests ask for
an array of integers longer than max_tokens lets them write, so every request generates 128 tokens and
the two runs' output throughputs compare like for like. The server reports the grammar's share of its
steps (`engine_grammar_seconds`): the host time spent filling the token masks, per step.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import subprocess
import sys
from pathlib import Path

from compare_vllm import REPO, export_model, log, median_run, server

LIMITS = ["--max-model-len", "2048", "--max-num-seqs", "32", "--max-num-batched-tokens", "512",
          "--kv-cache-memory-gib", "1"]


def bench(port: int, ratio: float, concurrency: int, num_prompts: int, seed: int, args, out: Path) -> dict:
    subprocess.run([sys.executable, "-m", "jaxserve.cli", "bench", "serve", "--port", str(port),
                    "--tokenizer", str(args.hf_dir), "--num-prompts", str(num_prompts), "--input-len",
                    str(args.input_len), "--output-len", str(args.output_len), "--ignore-eos", "--max-concurrency",
                    str(concurrency), "--num-warmups", str(min(concurrency, 4)), "--seed", str(seed),
                    "--structured-output-ratio", str(ratio), "--out", str(out), "--no-progress"],
                   check=True, stdout=subprocess.DEVNULL)
    summary = json.loads(out.read_text())["runs"][0]
    assert summary["failed"] == 0, summary
    return summary


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ratio", type=float, default=0.5)
    parser.add_argument("--concurrency", type=int, nargs="+", default=[8])
    parser.add_argument("--prompts-per-concurrency", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--input-len", type=int, default=256)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--port", type=int, default=8310)
    parser.add_argument("--work-dir", type=Path, default=REPO / ".bench")
    parser.add_argument("--out", type=Path, default=REPO / "benchmarks" / "results" / "structured_output_cpu.json")
    args = parser.parse_args()
    raw = args.work_dir / "runs"
    raw.mkdir(parents=True, exist_ok=True)
    args.hf_dir = export_model(args.work_dir / "smollm2-135m-instruct-hf")  # the client's tokenizer
    ratios = [0.0, args.ratio]
    runs = {ratio: {c: [] for c in args.concurrency} for ratio in ratios}
    cmd = [sys.executable, "-m", "jaxserve.cli", "serve", "--port", str(args.port), *LIMITS]
    with contextlib.ExitStack() as stack:
        startup = stack.enter_context(server("jaxserve", cmd, args.port, raw / "structured-server.log"))
        for round_no in range(args.rounds):
            for concurrency in args.concurrency:
                for i, ratio in enumerate(ratios):
                    # Prompts of their own for every run: one server's prefix cache would serve a repeat
                    seed = args.seed + 1000 * (round_no + 1) + 100 * i + concurrency
                    summary = bench(args.port, ratio, concurrency, args.prompts_per_concurrency * concurrency, seed,
                                    args, raw / f"structured-{ratio}-c{concurrency}-r{round_no}.json")
                    runs[ratio][concurrency].append(summary)
                    log(f"round {round_no + 1}/{args.rounds} ratio {ratio} concurrency {concurrency}: "
                        f"{summary['output_throughput']:.1f} output tok/s, grammar "
                        f"{summary.get('grammar_ms_per_step', float('nan')):.2f} ms/step")
    free, mixed = ratios
    lines = [f"| concurrency | no constrained requests, output tok/s | {mixed:.0%} constrained | constrained / none "
             "| median TPOT none / constrained (ms) | grammar masks, ms per step | every round |", "|---" * 7 + "|"]
    for c in args.concurrency:
        a, b = median_run(runs[free][c]), median_run(runs[mixed][c])
        each = " ".join(f"{y['output_throughput'] / x['output_throughput']:.2f}"
                        for x, y in zip(runs[free][c], runs[mixed][c]))
        lines.append(f"| {c} | {a['output_throughput']:.1f} | {b['output_throughput']:.1f} | "
                     f"**{b['output_throughput'] / a['output_throughput']:.2f}x** | "
                     f"{a['median_tpot_ms']:.1f} / {b['median_tpot_ms']:.1f} | {b['grammar_ms_per_step']:.2f} | {each} |")
    text = "\n".join([f"SmolLM2-135M-Instruct, float32, {args.input_len} in / {args.output_len} out, --ignore-eos; "
                      f"median of {args.rounds} alternating rounds; limits {' '.join(LIMITS)}", *lines,
                      f"start-up {startup:.1f} s"])
    print("\n" + text)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"table": text, "runs": {str(k): v for k, v in runs.items()}}, indent=2))
    log(f"wrote {args.out}")


if __name__ == "__main__":
    main()
