"""What LoRA adapters cost a server: the base model without --enable-lora, and on a server with it the
base model, one adapter, and two adapters mixed, in alternating rounds of the same run.

    python benchmarks/bench_lora.py [--concurrency 8] [--rounds 3] [--rank 16] [--model DIR]

Two adapters are made on the fly into a temporary directory: random PEFT adapters (adapter_config.json +
adapter_model.safetensors, as `peft` saves them) of rank --rank on all seven projections of the model
(default: the default model, exported as a Hugging Face directory). Two servers run side by side with the
same limits, one plain and one with `--enable-lora --max-loras 2 --lora-modules` of both adapters; only one
is under load at a time. Each round runs `jaxserve bench serve` (random prompts, --input-len in /
--output-len out, --ignore-eos, prompts of their own per run: a server's prefix cache would serve a
repeat) against: the plain server; the LoRA server's base model; one adapter (`--model lora1`); both
adapters, each request one of them at random (`--lora-modules lora1 lora2`). The table gives each
configuration's median output throughput and its ratio to the plain server's.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np
from safetensors.numpy import save_file

from compare_vllm import REPO, export_model, log, median_run, server

LIMITS = ["--max-model-len", "2048", "--max-num-seqs", "32", "--max-num-batched-tokens", "512",
          "--kv-cache-memory-gib", "1"]
TARGETS = {"q_proj": "self_attn", "k_proj": "self_attn", "v_proj": "self_attn", "o_proj": "self_attn",
           "gate_proj": "mlp", "up_proj": "mlp", "down_proj": "mlp"}
# name -> (server, extra flags of `jaxserve bench serve`)
CONFIGS = {"no LoRA": ("plain", []), "LoRA server, base model": ("lora", []),
           "one adapter": ("lora", ["--model", "lora1"]), "two adapters mixed": ("lora", ["--lora-modules", "lora1",
                                                                                      "lora2"])}


def make_adapter(model_dir: Path, out_dir: Path, rank: int, seed: int) -> Path:
    """A random PEFT LoRA adapter of the Hugging Face model at `model_dir` on all seven projections, saved as
    peft saves one (lora_A [r, in], lora_B [out, r] per layer and module), with B not zero."""
    config = json.loads((model_dir / "config.json").read_text())
    hidden, heads = config["hidden_size"], config["num_attention_heads"]
    head_dim = config.get("head_dim") or hidden // heads
    q, kv, ffn = heads * head_dim, config.get("num_key_value_heads", heads) * head_dim, config["intermediate_size"]
    shapes = {"q_proj": (hidden, q), "k_proj": (hidden, kv), "v_proj": (hidden, kv), "o_proj": (q, hidden),
              "gate_proj": (hidden, ffn), "up_proj": (hidden, ffn), "down_proj": (ffn, hidden)}  # (in, out)
    rng = np.random.default_rng(seed)
    tensors = {}
    for layer in range(config["num_hidden_layers"]):
        for module, (fan_in, fan_out) in shapes.items():
            prefix = f"base_model.model.model.layers.{layer}.{TARGETS[module]}.{module}"
            tensors[f"{prefix}.lora_A.weight"] = (rng.standard_normal((rank, fan_in)) / fan_in ** 0.5).astype(np.float32)
            tensors[f"{prefix}.lora_B.weight"] = (rng.standard_normal((fan_out, rank)) * 0.02).astype(np.float32)
    out_dir.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(out_dir / "adapter_model.safetensors"), metadata={"format": "pt"})
    (out_dir / "adapter_config.json").write_text(json.dumps({
        "peft_type": "LORA", "task_type": "CAUSAL_LM", "base_model_name_or_path": str(model_dir), "r": rank,
        "lora_alpha": 2 * rank, "lora_dropout": 0.0, "target_modules": list(TARGETS), "bias": "none",
        "use_rslora": False, "use_dora": False, "modules_to_save": None, "layers_to_transform": None,
        "fan_in_fan_out": False, "init_lora_weights": True}, indent=2))
    return out_dir


def bench(port: int, flags: list[str], concurrency: int, num_prompts: int, seed: int, args, out: Path) -> dict:
    subprocess.run([sys.executable, "-m", "jaxserve.cli", "bench", "serve", "--port", str(port),
                    "--tokenizer", str(args.model), "--num-prompts", str(num_prompts), "--input-len",
                    str(args.input_len), "--output-len", str(args.output_len), "--ignore-eos", "--max-concurrency",
                    str(concurrency), "--num-warmups", str(min(concurrency, 4)), "--seed", str(seed),
                    "--out", str(out), "--no-progress", *flags], check=True, stdout=subprocess.DEVNULL)
    summary = json.loads(out.read_text())["runs"][0]
    assert summary["failed"] == 0, summary
    return summary


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", type=Path, default=None,
                        help="a Hugging Face model directory (default: the default model, exported)")
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--dtype", default="auto", help="both servers' --dtype (auto: what users get)")
    parser.add_argument("--concurrency", type=int, nargs="+", default=[8])
    parser.add_argument("--prompts-per-concurrency", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--input-len", type=int, default=256)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--port", type=int, default=8320, help="the plain server's; the LoRA server's is the next")
    parser.add_argument("--limits", nargs=argparse.REMAINDER, default=LIMITS,
                        help="the servers' limits (last: every argument after it is one)")
    parser.add_argument("--work-dir", type=Path, default=REPO / ".bench")
    parser.add_argument("--out", type=Path, default=REPO / "benchmarks" / "results" / "lora_cpu.json")
    args = parser.parse_args()
    raw = args.work_dir / "runs"
    raw.mkdir(parents=True, exist_ok=True)
    args.model = args.model or export_model(args.work_dir / "smollm2-135m-instruct-hf")
    runs = {name: {c: [] for c in args.concurrency} for name in CONFIGS}
    ports = {"plain": args.port, "lora": args.port + 1}
    with tempfile.TemporaryDirectory(prefix="lora-adapters-") as adapters, contextlib.ExitStack() as stack:
        modules = [f"lora{i}={make_adapter(args.model, Path(adapters) / f'lora{i}', args.rank, seed=i)}"
                   for i in (1, 2)]
        common = [sys.executable, "-m", "jaxserve.cli", "serve", str(args.model), "--served-model-name", "base",
                  "--dtype", args.dtype, *args.limits]
        startup = {
            "plain": stack.enter_context(server("plain", [*common, "--port", str(ports["plain"])], ports["plain"],
                                                raw / "lora-plain-server.log")),
            "lora": stack.enter_context(server("lora", [*common, "--port", str(ports["lora"]), "--enable-lora",
                                                        "--max-loras", "2", "--max-lora-rank", str(args.rank),
                                                        "--lora-modules", *modules],
                                               ports["lora"], raw / "lora-server.log")),
        }
        for round_no in range(args.rounds):
            for concurrency in args.concurrency:
                for i, (name, (which, flags)) in enumerate(CONFIGS.items()):
                    seed = args.seed + 1000 * (round_no + 1) + 100 * i + concurrency
                    summary = bench(ports[which], flags, concurrency, args.prompts_per_concurrency * concurrency,
                                    seed, args, raw / f"lora-{i}-c{concurrency}-r{round_no}.json")
                    runs[name][concurrency].append(summary)
                    log(f"round {round_no + 1}/{args.rounds} {name} concurrency {concurrency}: "
                        f"{summary['output_throughput']:.1f} output tok/s")
    names = list(CONFIGS)
    lines = ["| concurrency | " + " | ".join(f"{name}, output tok/s" for name in names) + " | "
             + " | ".join(f"{name} / no LoRA" for name in names[1:]) + " |", "|---" * (2 * len(names)) + "|"]
    for c in args.concurrency:
        medians = [median_run(runs[name][c])["output_throughput"] for name in names]
        lines.append(f"| {c} | " + " | ".join(f"{m:.1f}" for m in medians) + " | "
                     + " | ".join(f"**{m / medians[0]:.2f}x**" for m in medians[1:]) + " |")
    from jaxserve.ops.cpu_ffi import cpu_features

    flags = " ".join(f for f in ("avx2", "avx512f", "avx512_bf16", "avx512_vnni", "amx_bf16", "amx_int8")
                     if f in cpu_features().split())
    text = "\n".join([f"{args.model.name}, --dtype {args.dtype}, rank-{args.rank} adapters on all seven projections, "
                      f"{args.input_len} in / {args.output_len} out, --ignore-eos; median of {args.rounds} "
                      f"alternating rounds; limits {' '.join(args.limits)}", *lines,
                      f"start-up: plain {startup['plain']:.1f} s, LoRA {startup['lora']:.1f} s",
                      f"{os.cpu_count()} cores, CPU flags: {flags}"])
    print("\n" + text)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"table": text, "runs": runs}, indent=2))
    log(f"wrote {args.out}")


if __name__ == "__main__":
    main()
