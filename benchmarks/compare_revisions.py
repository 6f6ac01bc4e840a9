"""jaxserve at two git revisions on the same serving workload, alternating in one run: the check that a
change did not make the engine slower (run-to-run and day-to-day variation on a shared machine is
larger than most changes, so before and after must come from the same run).

    python benchmarks/compare_revisions.py BASE [HEAD] [--rounds 3] [--concurrency 1 8 32]
                                           [--base-flags "..."] [--head-flags "..."] [--client vllm]
                                           [--temperature T [--top-p P] [--top-k K]]

Each revision is checked out in its own worktree under --work-dir and served from there (`python -m
jaxserve.cli serve` run in the worktree imports that worktree's jaxserve; both use this virtualenv's
packages). Both servers start before any load and get the same limits as compare_vllm.py's; this
checkout's `jaxserve bench serve` drives both, on the same fresh random prompts per round and
concurrency (256 in / 128 out, --ignore-eos), base then head, round after round; medians (--client vllm:
`vllm bench serve` instead, from compare_vllm.py's virtualenv, which it sets up if missing). BASE and
HEAD may be the same revision with different serve flags (--base-flags, --head-flags), to measure a
setting the same way.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import shlex
import subprocess
import sys
from pathlib import Path

from compare_vllm import REPO, bench, export_model, log, median_run, server, setup_vllm


def worktree(rev: str, work_dir: Path) -> tuple[str, Path]:
    sha = subprocess.check_output(["git", "-C", str(REPO), "rev-parse", "--short=12", rev], text=True).strip()
    path = work_dir / f"rev-{sha}"
    if not path.exists():
        subprocess.run(["git", "-C", str(REPO), "worktree", "add", "--detach", str(path), sha], check=True,
                       stdout=subprocess.DEVNULL)
    return sha, path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("base")
    parser.add_argument("head", nargs="?", default="HEAD")
    parser.add_argument("--base-flags", default="", help="extra `jaxserve serve` flags for BASE")
    parser.add_argument("--head-flags", default="", help="extra `jaxserve serve` flags for HEAD")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 8, 32])
    parser.add_argument("--prompts-per-concurrency", type=int, default=2)
    parser.add_argument("--input-len", type=int, default=256)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--temperature", type=float, default=0.0,
                        help="every request's (0: greedy); with --top-p / --top-k, sent by either client")
    parser.add_argument("--top-p", type=float, default=None)
    parser.add_argument("--top-k", type=int, default=None)
    parser.add_argument("--work-dir", type=Path, default=REPO / ".bench")
    parser.add_argument("--out", type=Path, default=REPO / "benchmarks" / "results" / "revisions.json")
    parser.add_argument("--client", choices=["jaxserve", "vllm"], default="jaxserve",
                        help="compare_vllm.bench's client for both: this checkout's `jaxserve bench serve`, or "
                             "`vllm bench serve`")
    args = parser.parse_args()
    if args.client == "vllm":
        args.vllm_python = setup_vllm(args.work_dir / "vllm-venv")
    raw = args.work_dir / "runs"
    raw.mkdir(parents=True, exist_ok=True)
    args.hf_dir = export_model(args.work_dir / "smollm2-135m-instruct-hf")  # the client's tokenizer
    revisions = {}
    for role, rev, flags in (("base", args.base, args.base_flags), ("head", args.head, args.head_flags)):
        sha, path = worktree(rev, args.work_dir)
        revisions[" ".join([role, sha, *shlex.split(flags)])] = (path, 8300 + len(revisions), shlex.split(flags))
    limits = ["--max-model-len", "2048", "--max-num-seqs", "32", "--max-num-batched-tokens", "512",
              "--kv-cache-memory-gib", "1"]
    runs = {name: {c: [] for c in args.concurrency} for name in revisions}
    with contextlib.ExitStack() as stack:
        startup = {name: stack.enter_context(server(
            name, [sys.executable, "-m", "jaxserve.cli", "serve", "--port", str(port), *limits, *flags], port,
            raw / f"{name.replace(' ', '-')}.log", cwd=path)) for name, (path, port, flags) in revisions.items()}
        for round_no in range(args.rounds):
            for concurrency in args.concurrency:
                seed = args.seed + 1000 * (round_no + 1) + concurrency
                for name, (_, port, _) in revisions.items():
                    summary = bench(name, port, concurrency, max(6, args.prompts_per_concurrency * concurrency),
                                    seed, args, raw / f"{name.replace(' ', '-')}-c{concurrency}-r{round_no}.json")
                    runs[name][concurrency].append(summary)
                    log(f"round {round_no + 1}/{args.rounds} {name} concurrency {concurrency}: "
                        f"{summary['output_throughput']:.1f} output tok/s, median TTFT {summary['median_ttft_ms']:.0f} ms")
    base, head = revisions
    lines = [f"| concurrency | {base} output tok/s | {head} output tok/s | head / base | "
             f"median TTFT base / head (ms) | every round, head / base |", "|---" * 6 + "|"]
    for c in args.concurrency:
        b, h = median_run(runs[base][c]), median_run(runs[head][c])
        each = " ".join(f"{y['output_throughput'] / x['output_throughput']:.2f}"
                        for x, y in zip(runs[base][c], runs[head][c]))
        lines.append(f"| {c} | {b['output_throughput']:.1f} | {h['output_throughput']:.1f} | "
                     f"**{h['output_throughput'] / b['output_throughput']:.2f}x** | "
                     f"{b['median_ttft_ms']:.0f} / {h['median_ttft_ms']:.0f} | {each} |")
    text = "\n".join([f"SmolLM2-135M-Instruct, {args.input_len} in / {args.output_len} out, --ignore-eos, "
                      f"client {args.client} bench serve; "
                      f"median of {args.rounds} alternating rounds; limits {' '.join(limits)}", *lines,
                      "start-up: " + ", ".join(f"{name} {s:.1f} s" for name, s in startup.items())])
    print("\n" + text)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"revisions": list(revisions), "table": text, "runs": runs}, indent=2))
    log(f"wrote {args.out}")


if __name__ == "__main__":
    main()
