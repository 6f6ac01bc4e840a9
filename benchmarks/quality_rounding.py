"""What rounding each operand of the model's matmuls costs in `jaxserve bench quality`'s two measures.

Issue 37 asks an 8-bit setting for perplexity within 2% of float32's and for 9 of 12 greedy continuations
(32 tokens) equal to float32's. This separates the two operands' rounding and the grain of their scales,
with nothing else changed: every engine here is float32 with float32 KV pages on XLA's dot, and only the
layer matmuls' weights and inputs (and the LM head's) are rounded, each in one of these ways:

  none        left as they are (float32)
  bf16        rounded to bfloat16 (round to nearest even): 16-bit rounding, for scale
  int8        symmetric int8 with one scale per output column (weights) or per token (inputs)
  int8/G      symmetric int8 with a scale per group of G consecutive k (weights: per column and group;
              inputs: per token and group). The C++ kernel's W8A8 takes its inputs in groups of
              packed_matmul.int8_group(K): 96 and 128 for this model's 576 and 1,536 (64 and 128 on a
              CPU with AMX); a checkpoint's blocks (GGUF's 32) are weight groups.

Each rounded value is put back as float32 (fake quantization): what is measured is the rounding, not a
kernel's sums. A scheme is WEIGHTS:INPUTS, e.g. `int8:none` (weights only, per column), `none:int8/64`
(the inputs alone, the weights untouched). --matrices rounds only the named matrices (a layer's w_qkv, wo,
w_gate_up, w_down, and lm_head); the others stay float32, inputs included. It is an analysis; jaxserve
serves none of these as such.

    python benchmarks/quality_rounding.py [--schemes none:bf16 int8:none none:int8/64 ...]
                                          [--matrices w_gate_up w_down] [--out FILE.json]
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, str(Path(__file__).parent))
from bench_quantization import cpu_flags  # noqa: E402

MATRICES = ("w_qkv", "wo", "w_gate_up", "w_down", "lm_head")  # transformer.MATRICES and the LM head
DEFAULT_SCHEMES = ("bf16:bf16", "int8:none", "int8/32:none", "int8/64:none", "none:int8/64", "none:int8/32",
                   "none:int8/16", "int8/32:int8/32")


def parse_rounding(text: str) -> tuple[str, int] | None:
    """'none' -> None, 'bf16' -> ('bf16', 0), 'int8' -> ('int8', 0), 'int8/G' -> ('int8', G)."""
    if text == "none":
        return None
    if text == "bf16":
        return ("bf16", 0)
    kind, _, group = text.partition("/")
    if kind != "int8" or (group and not (group.isdigit() and int(group) > 0)):
        raise ValueError(f"rounding {text!r}: want none, bf16, int8 or int8/G")
    return ("int8", int(group or 0))


def rounded(a, rounding: tuple[str, int] | None, axis: int):
    """a (float, numpy or jax) rounded as `rounding` says along `axis` (the contraction axis), as float32."""
    xp = np if isinstance(a, np.ndarray) else jnp
    a = a.astype(xp.float32)
    if rounding is None:
        return a
    kind, group = rounding
    if kind == "bf16":
        return a.astype(jnp.bfloat16).astype(xp.float32)
    a = xp.moveaxis(a, axis, -1)
    shape, k = a.shape, a.shape[-1]
    group = group or k
    if k % group:
        raise ValueError(f"int8/{group}: the contraction's {k} is not a multiple of the group")
    grouped = a.reshape(*shape[:-1], k // group, group)
    absmax = xp.max(xp.abs(grouped), axis=-1, keepdims=True)
    scale = xp.where(absmax > 0, absmax / 127.0, 1.0)
    q = xp.clip(xp.round(grouped / scale), -127, 127) * scale
    return xp.moveaxis(q.reshape(shape), -1, axis)


def evaluate_schemes(model, schemes: list[str], max_tokens: int = 4096, base: dict | None = None,
                     matrices: tuple[str, ...] = MATRICES) -> list:
    """[float32, then one `quality.Evaluation` per scheme] of `model` (None: the default model), each engine
    built with `base` settings (LLM's keyword arguments) too. The quantized-weight path (ops/quantized.py, which
    `quantization="int8"` under `matmul_backend="xla"` puts every layer matmul and the LM head on) is
    patched for the run: a weight keeps its rounded float32 values with unit scales, and the matmul
    rounds its input and takes a float32 dot. Only `matrices` take that path; the rest keep XLA's float32 dot."""
    from jaxserve.bench import quality
    from jaxserve.models import transformer
    from jaxserve.ops import quantized

    unknown = set(matrices) - set(MATRICES)
    if unknown:
        raise ValueError(f"unknown matrices {sorted(unknown)}: choose from {', '.join(MATRICES)}")

    base = {**(base or {}), "dtype": "float32", "kv_cache_dtype": "float32"}
    evaluations = [quality.evaluate(model, base, label="float32", max_tokens=max_tokens)]
    current = {}

    def quantize(cls, w, kind):
        data = rounded(w, current["weights"], axis=-2)
        xp = np if isinstance(data, np.ndarray) else jnp
        return cls(data, xp.ones(data.shape[-1], xp.float32))

    def matmul(x, w):
        y = jnp.dot(rounded(x, current["inputs"], axis=-1), w.data, preferred_element_type=jnp.float32)
        return y.astype(x.dtype)

    saved = (quantized.QuantizedWeight.__dict__["quantize"], quantized.matmul, transformer.MATRICES,
             transformer.QUANTIZED_LM_HEADS)
    quantized.QuantizedWeight.quantize, quantized.matmul = classmethod(quantize), matmul
    transformer.MATRICES = tuple(m for m in transformer.MATRICES if m in matrices)
    transformer.QUANTIZED_LM_HEADS = ("int8",) if "lm_head" in matrices else ()
    try:
        for scheme in schemes:
            weights, _, inputs = scheme.partition(":")
            current.update(weights=parse_rounding(weights), inputs=parse_rounding(inputs or "none"))
            jax.clear_caches()  # executables traced with the last scheme's rounding must not be reused
            evaluations.append(quality.evaluate(model, {**base, "quantization": "int8", "matmul_backend": "xla"},
                                                label=scheme, max_tokens=evaluations[0].num_tokens))
    finally:
        (quantized.QuantizedWeight.quantize, quantized.matmul, transformer.MATRICES,
         transformer.QUANTIZED_LM_HEADS) = saved
        jax.clear_caches()
    return evaluations


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None, help="a model directory or GGUF file (default: the default model)")
    parser.add_argument("--schemes", nargs="+", default=list(DEFAULT_SCHEMES),
                        help="WEIGHTS:INPUTS, each none, bf16, int8 or int8/G")
    parser.add_argument("--matrices", nargs="+", default=list(MATRICES), choices=MATRICES,
                        help="round only these (default: all)")
    parser.add_argument("--max-tokens", type=int, default=4096)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args(argv)
    for scheme in args.schemes:  # a typo fails here, before the first engine loads
        for part in scheme.split(":"):
            parse_rounding(part)

    from jaxserve.bench import quality

    evaluations = evaluate_schemes(args.model, args.schemes, args.max_tokens, matrices=tuple(args.matrices))
    reference = evaluations[0]
    cpu = f"{platform.machine()}, flags: {cpu_flags()}"
    rows, result = [], {"cpu": cpu, "num_tokens": reference.num_tokens, "matrices": args.matrices, "schemes": {}}
    for evaluation in evaluations[1:]:
        _, report = quality.report(reference, evaluation)
        ratio, equal = report["perplexity_ratio"], report["greedy"]["num_equal"]
        weights, _, inputs = evaluation.label.partition(":")
        rows.append(f"| {weights} | {inputs} | {evaluation.perplexity:.4f} | {100 * (ratio - 1):+.2f}% | "
                    f"{equal}/{report['greedy']['num_prompts']} |")
        result["schemes"][evaluation.label] = {"perplexity": evaluation.perplexity, "perplexity_ratio": ratio,
                                               "greedy_equal": equal, "differences": report["greedy"]["differences"]}
    print(f"\n{cpu}. Rounded: {', '.join(args.matrices)}. Perplexity over the first {reference.num_tokens} tokens "
          f"of {quality.TEXT_PATH.name} (float32: {reference.perplexity:.4f}); greedy: {quality.NUM_GREEDY_TOKENS} tokens on "
          f"{len(reference.greedy)} prompts equal to float32's.\n")
    print("| weights | matmul inputs | perplexity | vs float32 | greedy = float32 |\n|---|---|---|---|---|")
    print("\n".join(rows))
    if args.out:
        args.out.write_text(json.dumps(result, indent=2))
    return result


if __name__ == "__main__":
    main()
