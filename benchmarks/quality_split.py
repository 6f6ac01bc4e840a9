"""Where a weight quantization's perplexity goes: the weights' rounding, or the activations'.

`jaxserve bench quality --quantization Q` measures the setting as served (W8A8: the weights and each
matmul's input both 8-bit; fp8 on a CPU since 2026-12-04 W8A16, its inputs in bfloat16, so its split shows
little between the two). This runs the same measure three times, each engine built and freed in turn:
float32 (the reference), Q as served, and Q through XLA's dot with its weights widened to float32 before
the dot and its activations left as they are (weight-only: the weights' rounding alone). It is an analysis,
not a setting jaxserve serves. The weight-only engine runs `matmul_backend="xla"`, the path that holds
`QuantizedWeight`s (ops/quantized.py), so int8 and fp8 are measured alike there.

    python benchmarks/quality_split.py [--model M] [--quantization fp8] [--max-tokens 4096] [--out FILE.json]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import jax
import jax.numpy as jnp


def weight_only_matmul(x, w):
    """x @ (w's data widened to float32, times its column scales), x not quantized."""
    y = jnp.dot(x.astype(jnp.float32), w.data.astype(jnp.float32), preferred_element_type=jnp.float32)
    return (y * w.scale).astype(x.dtype)


def split(model, quantization: str, max_tokens: int = 4096, base: dict | None = None) -> list:
    """[float32, the quantization as served, its weights only]: `quality.Evaluation`s of `model` (None: the
    default model), each engine built with `base` settings (LLM's keyword arguments) too."""
    from jaxserve.bench import quality
    from jaxserve.ops import quantized

    base = {**(base or {}), "dtype": "float32"}

    def evaluate(label: str, **settings):
        return quality.evaluate(model, {**base, **settings}, label=label, max_tokens=max_tokens)

    reference = evaluate("float32")
    served = evaluate(f"{quantization} as served (W8A8)", quantization=quantization)
    # ops/linear.py calls it through the module; JAX's caches go too, or an engine of the served one's shapes
    # would run the executables traced with the served product
    w8a8 = quantized.matmul
    quantized.matmul = weight_only_matmul
    jax.clear_caches()
    try:
        weights = evaluate(f"{quantization} weights only", quantization=quantization, matmul_backend="xla")
    finally:
        quantized.matmul = w8a8
        jax.clear_caches()
    return [reference, served, weights]


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None, help="a model directory or GGUF file (default: the default model)")
    parser.add_argument("--quantization", choices=["int8", "fp8"], default="fp8")
    parser.add_argument("--max-tokens", type=int, default=4096)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args(argv)

    from jaxserve.bench import quality

    evaluations = split(args.model, args.quantization, args.max_tokens)
    reference = evaluations[0]
    rows, result = [], {"quantization": args.quantization, "num_tokens": reference.num_tokens, "settings": {}}
    for evaluation in evaluations:
        _, report = quality.report(reference, evaluation)
        ratio, equal = report["perplexity_ratio"], report["greedy"]["num_equal"]
        rows.append(f"| {evaluation.label} | {evaluation.resolved} | {evaluation.perplexity:.4f} | "
                    f"{100 * (ratio - 1):+.2f}% | {equal}/{report['greedy']['num_prompts']} |")
        result["settings"][evaluation.label] = {"resolved": evaluation.resolved, "perplexity": evaluation.perplexity,
                                                "perplexity_ratio": ratio, "greedy_equal": equal}
    print(f"\nPerplexity over the first {reference.num_tokens} tokens of {quality.TEXT_PATH.name}; greedy: "
          f"{quality.NUM_GREEDY_TOKENS} tokens on {len(reference.greedy)} prompts equal to float32's.\n")
    print("| setting | resolved | perplexity | vs float32 | greedy = float32 |\n|---|---|---|---|---|")
    print("\n".join(rows))
    if args.out:
        args.out.write_text(json.dumps(result, indent=2))
    return result


if __name__ == "__main__":
    main()
