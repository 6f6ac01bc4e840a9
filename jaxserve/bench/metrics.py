"""Serving metrics with `vllm bench serve`'s definitions, and the tables and plot that show them.

  TTFT  send -> first content chunk
  TPOT  (latency - TTFT) / (output tokens - 1), per request with more than one output token
  ITL   the gap between successive content chunks, all of them pooled
  E2EL  send -> last chunk
Throughputs divide by the wall time of the whole run; token counts come from the server's usage
when it sends one (stream_options.include_usage), else from the benchmark's tokenizer.

What the server's own /metrics says of the run (its counters' differences over the timed part):
a jaxserve engine's busy fractions, and the speculative decoding figures of a server that speculates
(jaxserve's or vLLM's spec_decode counters), with vLLM's definitions:
  acceptance rate                 accepted tokens / draft tokens
  mean acceptance length          1 + accepted tokens / drafts (tokens a speculating sequence gains per step)
  acceptance rate at position i   drafts whose token i was accepted / drafts
"""

from __future__ import annotations

import dataclasses
import math

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


ENGINE_SECONDS = ("jaxserve:engine_step_seconds_total", "jaxserve:engine_model_seconds_total",
                  "jaxserve:engine_grammar_seconds_total", "jaxserve:engine_steps_total")
SPEC_DECODE_COUNTERS = ("num_drafts", "num_draft_tokens", "num_accepted_tokens")
SPEC_DECODE_PREFIXES = ("jaxserve:", "vllm:")  # the same counters under either server's prefix


def engine_seconds(samples: dict) -> tuple[float, ...] | None:
    """A jaxserve server's engine time so far (in steps, in the model, in grammar masks) and its steps;
    None elsewhere. `samples` maps (sample name, sorted label items) to value, as /metrics lists them."""
    values = {name: value for (name, _), value in samples.items() if name in ENGINE_SECONDS}
    if not all(name in values for name in ENGINE_SECONDS[:2]):
        return None
    return tuple(values.get(name, math.nan) for name in ENGINE_SECONDS)


def spec_decode_counters(samples: dict) -> dict | None:
    """The server's speculative decoding counters so far, with the keys of `LLMEngine.get_stats()["spec_decode"]`,
    summed over any other labels (vLLM's model_name, engine); None when it has none (speculation off, another
    server)."""
    for prefix in SPEC_DECODE_PREFIXES:
        totals, per_pos = {}, {}
        for (name, labels), value in samples.items():
            if not (name.startswith(prefix + "spec_decode_") and name.endswith("_total")):
                continue  # `_created` samples among them
            counter = name.removeprefix(prefix + "spec_decode_").removesuffix("_total")
            position = dict(labels).get("position", "")
            if counter in SPEC_DECODE_COUNTERS:
                totals[counter] = totals.get(counter, 0) + round(value)
            elif counter == "num_accepted_tokens_per_pos" and position.isdigit():
                per_pos[int(position)] = per_pos.get(int(position), 0) + round(value)
        if len(totals) == len(SPEC_DECODE_COUNTERS):
            num_positions = max(per_pos, default=-1) + 1
            return totals | {"num_accepted_tokens_per_pos": [per_pos.get(i, 0) for i in range(num_positions)]}
    return None


def spec_decode_summary(before: dict, after: dict) -> dict:
    """The run's speculative decoding figures from the engine's cumulative counters before and after it,
    each a dict with the keys of `LLMEngine.get_stats()["spec_decode"]`. Rates are NaN with no drafts."""
    counts = {name: int(after[name] - before[name]) for name in SPEC_DECODE_COUNTERS}
    per_pos_before = list(before["num_accepted_tokens_per_pos"])
    per_pos_after = list(after["num_accepted_tokens_per_pos"])
    per_pos_before += [0] * (len(per_pos_after) - len(per_pos_before))  # a position first counted during the run
    per_pos = [int(a - b) for a, b in zip(per_pos_after, per_pos_before)]
    num_drafts, num_draft_tokens = counts["num_drafts"], counts["num_draft_tokens"]
    return counts | {
        "num_accepted_tokens_per_pos": per_pos,
        "acceptance_rate": counts["num_accepted_tokens"] / num_draft_tokens if num_draft_tokens else math.nan,
        "mean_acceptance_length": 1 + counts["num_accepted_tokens"] / num_drafts if num_drafts else math.nan,
        "acceptance_rate_per_pos": [n / num_drafts if num_drafts else math.nan for n in per_pos],
    }


def server_figures(before: dict, after: dict, duration: float) -> dict:
    """What two /metrics scrapes `duration` seconds apart say: the engine's busy fractions (jaxserve),
    grammar mask time per step, and speculative decoding's figures ("spec_decode"); only those the server has."""
    figures = {}
    busy_before, busy_after = engine_seconds(before), engine_seconds(after)
    if busy_before and busy_after:
        figures = {"engine_busy_fraction": (busy_after[0] - busy_before[0]) / duration,
                   "engine_model_fraction": (busy_after[1] - busy_before[1]) / duration}
        steps = busy_after[3] - busy_before[3]
        if steps > 0 and math.isfinite(busy_after[2]):
            figures["grammar_ms_per_step"] = 1000 * (busy_after[2] - busy_before[2]) / steps
    spec_before, spec_after = spec_decode_counters(before), spec_decode_counters(after)
    if spec_before and spec_after:
        figures["spec_decode"] = spec_decode_summary(spec_before, spec_after)
    return figures


def _figure(value: float, fmt: str = "{:.1%}") -> str:
    return "n/a" if math.isnan(value) else fmt.format(value)


def format_spec_decode(spec: dict) -> list[str]:
    """Table rows of `spec_decode_summary`'s figures."""
    per_pos = " / ".join(map(_figure, spec["acceptance_rate_per_pos"])) or "n/a"
    return [f"| speculative decoding: acceptance rate | {_figure(spec['acceptance_rate'])} |",
            f"| speculative decoding: mean acceptance length | {_figure(spec['mean_acceptance_length'], '{:.2f}')} |",
            f"| speculative decoding: acceptance rate per position | {per_pos} |",
            f"| speculative decoding: drafts / draft tokens / accepted tokens | {spec['num_drafts']} / "
            f"{spec['num_draft_tokens']} / {spec['num_accepted_tokens']} |"]


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
    if "spec_decode" in summary:
        lines += format_spec_decode(summary["spec_decode"])
    if "first_error" in summary:
        lines.append(f"| first error | {summary['first_error'][:200]} |")
    return "\n".join(lines)


SWEEP_COLUMNS = [("output tok/s", "output_throughput", "{:.1f}"), ("total tok/s", "total_token_throughput", "{:.1f}"),
                 ("req/s", "request_throughput", "{:.3f}"), ("median TTFT ms", "median_ttft_ms", "{:.0f}"),
                 ("p99 TTFT ms", "p99_ttft_ms", "{:.0f}"), ("median TPOT ms", "median_tpot_ms", "{:.1f}"),
                 ("median ITL ms", "median_itl_ms", "{:.1f}"), ("failed", "failed", "{}")]


def format_sweep(runs: dict[str, list[dict]]) -> str:
    """One row per (engine, concurrency); runs maps an engine label to its summaries. Runs with speculative
    decoding add its acceptance rate and mean acceptance length ("-" for the runs without)."""
    has_spec = any("spec_decode" in s for summaries in runs.values() for s in summaries)
    names = [c for c, _, _ in SWEEP_COLUMNS] + (["acceptance rate", "mean acceptance length"] if has_spec else [])
    lines = ["| engine | concurrency | " + " | ".join(names) + " |", "|" + "---|" * (len(names) + 2)]
    for label, summaries in runs.items():
        for s in summaries:
            cells = [fmt.format(s[key]) for _, key, fmt in SWEEP_COLUMNS]
            if has_spec:
                spec = s.get("spec_decode")
                cells += ([_figure(spec["acceptance_rate"]), _figure(spec["mean_acceptance_length"], "{:.2f}")]
                          if spec else ["-", "-"])
            lines.append(f"| {label} | {s['max_concurrency']} | {' | '.join(cells)} |")
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
