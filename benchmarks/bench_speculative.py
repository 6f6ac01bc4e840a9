"""What speculative decoding buys a server: jaxserve without it and with prompt lookup, in alternating rounds.

    python benchmarks/bench_speculative.py [--rounds 2] [--draft-model DIR]

Servers, all started at once (an idle one takes no CPU) and measured one at a time:
  off:        no speculation
  ngram:      --speculative-config '{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 2,
              "prompt_lookup_max": 5}' (disable_by_batch_size left at its default)
  ngram-all:  the same, speculating at every batch size (disable_by_batch_size 1000): where it stops paying
  draft:      with --draft-layers N, {"method": "draft_model", "model": DIR, "num_speculative_tokens": 4}, DIR
              the default model cut to its first N of 30 layers (no smaller model shares its vocabulary here)

Workloads (`jaxserve bench serve`, greedy; each round's prompts are new, so no prefix cache helps, and the
same on every server):
  grounded at concurrency 1, 2, 4 and 8: `--dataset-name grounded`, ~256-token texts the model is asked to
  repeat, up to 256 tokens out (ended by EOS: greedy outputs are the same on every server);
  random at concurrency 32: 256 in / 128 out, --ignore-eos (vLLM's serving shape).
The table gives each server's output tokens/s, its ratio to `off`, and the acceptance figures.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import shutil
import subprocess
import sys
from pathlib import Path

from compare_vllm import REPO, export_model, log, median_run, server

LIMITS = ["--max-model-len", "2048", "--kv-cache-memory-gib", "1"]
NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 2, "prompt_lookup_max": 5}
# (name, dataset, concurrency, input_len, output_len, ignore_eos, prompts per concurrency)
WORKLOADS = [("grounded", "grounded", c, 256, 256, False, 4 if c < 8 else 2) for c in (1, 2, 4, 8)] + [
    ("random", "random", 32, 256, 128, True, 2)]


def first_layers(hf_dir: Path, num_layers: int, dst: Path) -> Path:
    """A copy of the Hugging Face model in hf_dir keeping its first num_layers decoder layers."""
    from safetensors.numpy import load_file, save_file

    dst.mkdir(parents=True, exist_ok=True)
    for f in hf_dir.iterdir():
        if f.name not in ("config.json", "model.safetensors"):
            shutil.copy(f, dst / f.name)
    config = json.loads((hf_dir / "config.json").read_text())
    config["num_hidden_layers"] = num_layers
    (dst / "config.json").write_text(json.dumps(config, indent=2))
    tensors = load_file(hf_dir / "model.safetensors")
    keep = {name: t for name, t in tensors.items()
            if not name.startswith("model.layers.") or int(name.split(".")[2]) < num_layers}
    save_file(keep, dst / "model.safetensors", metadata={"format": "pt"})
    return dst


def bench(port: int, workload: tuple, seed: int, hf_dir: Path, out: Path) -> dict:
    _, dataset, concurrency, input_len, output_len, ignore_eos, per = workload
    subprocess.run([sys.executable, "-m", "jaxserve.cli", "bench", "serve", "--port", str(port),
                    "--tokenizer", str(hf_dir), "--dataset-name", dataset, "--endpoint", "chat",
                    "--num-prompts", str(per * concurrency), "--input-len", str(input_len), "--output-len",
                    str(output_len), "--max-concurrency", str(concurrency), "--num-warmups", str(min(concurrency, 2)),
                    "--seed", str(seed), "--out", str(out), "--no-progress", *(["--ignore-eos"] if ignore_eos else [])],
                   check=True, stdout=subprocess.DEVNULL)
    summary = json.loads(out.read_text())["runs"][0]
    assert summary["failed"] == 0, summary
    return summary


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--draft-layers", type=int, default=None,
                        help="serve `draft` too, with the default model's first N layers as the draft model")
    parser.add_argument("--configs", nargs="+", default=["off", "ngram", "ngram-all"],
                        help="servers to run, of off, ngram, ngram-all (draft comes with --draft-layers)")
    parser.add_argument("--workloads", nargs="+", default=None, help="e.g. grounded-c1 random-c32 (default: all)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--port", type=int, default=8320)
    parser.add_argument("--work-dir", type=Path, default=REPO / ".bench")
    parser.add_argument("--out", type=Path, default=REPO / "benchmarks" / "results" / "speculative_cpu.json")
    args = parser.parse_args()
    raw = args.work_dir / "runs"
    raw.mkdir(parents=True, exist_ok=True)
    hf_dir = export_model(args.work_dir / "smollm2-135m-instruct-hf")  # the client's tokenizer
    configs = {"off": None, "ngram": NGRAM, "ngram-all": dict(NGRAM, disable_by_batch_size=1000)}
    configs = {name: spec for name, spec in configs.items() if name in args.configs}
    if args.draft_layers:
        draft_dir = first_layers(hf_dir, args.draft_layers, args.work_dir / f"smollm2-first-{args.draft_layers}-layers")
        configs["draft"] = {"method": "draft_model", "model": str(draft_dir), "num_speculative_tokens": 4}
    workloads = [w for w in WORKLOADS if args.workloads is None or f"{w[0]}-c{w[2]}" in args.workloads]
    runs = {name: {w: [] for w in workloads} for name in configs}
    ports = {name: args.port + i for i, name in enumerate(configs)}
    with contextlib.ExitStack() as stack:
        for name, spec in configs.items():
            cmd = [sys.executable, "-m", "jaxserve.cli", "serve", "--port", str(ports[name]), *LIMITS,
                   *(["--speculative-config", json.dumps(spec)] if spec else [])]
            stack.enter_context(server(name, cmd, ports[name], raw / f"spec-{name}-server.log"))
        for round_no in range(args.rounds):
            for w in workloads:
                for i, name in enumerate(configs):
                    seed = args.seed + 1000 * (round_no + 1) + w[2]  # the round's prompts, the same on every server
                    summary = bench(ports[name], w, seed, hf_dir, raw / f"spec-{name}-{w[0]}-c{w[2]}-r{round_no}.json")
                    runs[name][w].append(summary)
                    spec = summary.get("spec_decode") or {}
                    log(f"round {round_no + 1}/{args.rounds} {w[0]} c{w[2]} {name}: "
                        f"{summary['output_throughput']:.1f} output tok/s, acceptance "
                        f"{spec.get('acceptance_rate', float('nan')):.2f}, mean length "
                        f"{spec.get('mean_acceptance_length', float('nan')):.2f}")
    names = list(configs)
    header = "| workload | concurrency | " + " | ".join(f"{n} tok/s" for n in names) + " | " + " | ".join(
        f"{n} / off" for n in names[1:]) + " | acceptance rate (mean length), " + ", ".join(names[1:]) + " |"
    lines = [header, "|---" * (2 + 2 * len(names) - 1 + 1) + "|"]
    for w in workloads:
        best = {n: median_run(runs[n][w]) for n in names}
        ratios = " | ".join(f"**{best[n]['output_throughput'] / best['off']['output_throughput']:.2f}x**"
                            for n in names[1:])
        acceptance = ", ".join(
            f"{(best[n].get('spec_decode') or {}).get('acceptance_rate', float('nan')):.0%} "
            f"({(best[n].get('spec_decode') or {}).get('mean_acceptance_length', float('nan')):.2f})" for n in names[1:])
        lines.append(f"| {w[0]} {w[3]} in / {w[4]} out | {w[2]} | "
                     + " | ".join(f"{best[n]['output_throughput']:.1f}" for n in names) + f" | {ratios} | {acceptance} |")
    text = "\n".join([f"SmolLM2-135M-Instruct, float32, greedy, chat endpoint; median of {args.rounds} alternating "
                      f"rounds; limits {' '.join(LIMITS)}; ngram = {json.dumps(NGRAM)}", *lines])
    print("\n" + text)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"table": text, "runs": {n: {f"{w[0]}-c{w[2]}": v for w, v in r.items()}
                                                            for n, r in runs.items()}}, indent=2))
    log(f"wrote {args.out}")


if __name__ == "__main__":
    main()
