"""Serving metrics with `vllm bench serve`'s definitions, and the tables and plot that show them.

  TTFT  send -> first content chunk
  TPOT  (latency - TTFT) / (output tokens - 1), per request with more than one output token
  ITL   the gap between successive content chunks, all of them pooled
  E2EL  send -> last chunk
Throughputs divide by the wall time of the whole run; token counts come from the server's usage
when it sends one (stream_options.include_usage), else from the benchmark's tokenizer.
"""

from __future__ import annotations

import dataclasses

import numpy as np


@dataclasses.dataclass
class RequestResult:
    success: bool = False
    prompt_len: int = 0
    output_len: int = 0
    ttft: float = 0.0  # seconds
    latency: float = 0.0  # seconds
    itl: list[float] = dataclasses.field(default_factory=list)  # seconds
    error: str = ""


LATENCIES = ("ttft", "tpot", "itl", "e2el")


def summarize(results: list[RequestResult], duration: float) -> dict:
    done = [r for r in results if r.success]
    num_in = sum(r.prompt_len for r in done)
    num_out = sum(r.output_len for r in done)
    samples = {
        "ttft": [r.ttft for r in done],
        "tpot": [(r.latency - r.ttft) / (r.output_len - 1) for r in done if r.output_len > 1],
        "itl": [gap for r in done for gap in r.itl],
        "e2el": [r.latency for r in done],
    }
    summary = {
        "duration_s": duration,
        "completed": len(done),
        "failed": len(results) - len(done),
        "total_input_tokens": num_in,
        "total_output_tokens": num_out,
        "request_throughput": len(done) / duration,
        "output_throughput": num_out / duration,
        "total_token_throughput": (num_in + num_out) / duration,
    }
    for name, values in samples.items():
        ms = np.asarray(values or [np.nan]) * 1000
        summary |= {f"mean_{name}_ms": float(np.mean(ms)), f"median_{name}_ms": float(np.median(ms)),
                    f"p99_{name}_ms": float(np.percentile(ms, 99))}
    errors = [r.error for r in results if not r.success]
    if errors:
        summary["first_error"] = errors[0]
    return summary


def format_summary(summary: dict, title: str = "serving benchmark") -> str:
    lines = [f"| {title} | |", "|---|---|"]
    lines += [f"| successful requests | {summary['completed']} |", f"| failed requests | {summary['failed']} |",
              f"| duration (s) | {summary['duration_s']:.2f} |",
              f"| input / output tokens | {summary['total_input_tokens']} / {summary['total_output_tokens']} |",
              f"| request throughput (req/s) | {summary['request_throughput']:.3f} |",
              f"| output token throughput (tok/s) | {summary['output_throughput']:.1f} |",
              f"| total token throughput (tok/s) | {summary['total_token_throughput']:.1f} |"]
    for name in LATENCIES:
        lines.append(f"| {name.upper()} mean / median / p99 (ms) | {summary[f'mean_{name}_ms']:.1f} / "
                     f"{summary[f'median_{name}_ms']:.1f} / {summary[f'p99_{name}_ms']:.1f} |")
    if "engine_busy_fraction" in summary:
        lines.append(f"| jaxserve engine busy: in steps / in the model | {summary['engine_busy_fraction']:.0%} / "
                     f"{summary['engine_model_fraction']:.0%} |")
    if "grammar_ms_per_step" in summary:
        lines.append(f"| jaxserve grammar token masks per step (ms) | {summary['grammar_ms_per_step']:.2f} |")
    if "first_error" in summary:
        lines.append(f"| first error | {summary['first_error'][:200]} |")
    return "\n".join(lines)


SWEEP_COLUMNS = [("output tok/s", "output_throughput", "{:.1f}"), ("total tok/s", "total_token_throughput", "{:.1f}"),
                 ("req/s", "request_throughput", "{:.3f}"), ("median TTFT ms", "median_ttft_ms", "{:.0f}"),
                 ("p99 TTFT ms", "p99_ttft_ms", "{:.0f}"), ("median TPOT ms", "median_tpot_ms", "{:.1f}"),
                 ("median ITL ms", "median_itl_ms", "{:.1f}"), ("failed", "failed", "{}")]


def format_sweep(runs: dict[str, list[dict]]) -> str:
    """One row per (engine, concurrency); runs maps an engine label to its summaries."""
    head = "| engine | concurrency | " + " | ".join(c for c, _, _ in SWEEP_COLUMNS) + " |"
    lines = [head, "|" + "---|" * (len(SWEEP_COLUMNS) + 2)]
    for label, summaries in runs.items():
        for s in summaries:
            cells = " | ".join(fmt.format(s[key]) for _, key, fmt in SWEEP_COLUMNS)
            lines.append(f"| {label} | {s['max_concurrency']} | {cells} |")
    return "\n".join(lines)


def plot_sweep(runs: dict[str, list[dict]], path: str, title: str = "") -> None:
    """Output throughput, median TTFT and median TPOT against concurrency, one line per engine."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise RuntimeError("the plot needs matplotlib: pip install 'jaxserve[bench]'") from None
    panels = [("output_throughput", "output tokens/s"), ("median_ttft_ms", "median TTFT (ms)"),
              ("median_tpot_ms", "median TPOT (ms)")]
    fig, axes = plt.subplots(1, len(panels), figsize=(5 * len(panels), 4))
    for ax, (key, label) in zip(axes, panels):
        for engine, summaries in runs.items():
            xs = [s["max_concurrency"] for s in summaries]
            ax.plot(xs, [s[key] for s in summaries], marker="o", label=engine)
        ax.set_xscale("log", base=2)
        ax.set_xlabel("concurrency")
        ax.set_ylabel(label)
        ax.grid(True, alpha=0.3)
        ax.legend()
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
