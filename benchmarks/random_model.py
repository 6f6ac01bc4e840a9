"""Writes a Hugging Face model directory with random weights in a real model's shape, for speed runs
where the weights themselves do not matter (every token costs the same) and cannot be shipped.

    python benchmarks/random_model.py SRC DST [--set hidden_size=2048 --set num_hidden_layers=24 ...]

SRC is a Hugging Face directory whose config.json and tokenizer files are copied (its weights are not
read); `--set` overrides config fields, so one tokenizer can go with another model size of its family
(`--preset smollm2-1.7b` sets SmolLM2-1.7B's published shape). Weights are bfloat16, drawn by
transformers' own initialization. Needs torch.
"""

from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path

PRESETS = {
    "smollm2-1.7b": dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=24, num_attention_heads=32,
                         num_key_value_heads=32, head_dim=64, rope_theta=130000.0, max_position_embeddings=8192),
}
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja",
                   "generation_config.json")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("src")
    parser.add_argument("dst")
    parser.add_argument("--preset", choices=sorted(PRESETS), default=None)
    parser.add_argument("--set", action="append", default=[], metavar="FIELD=VALUE",
                        help="override a config field (JSON value)")
    args = parser.parse_args()

    import torch
    import transformers

    src, dst = Path(args.src), Path(args.dst)
    config = json.loads((src / "config.json").read_text())
    config.update(PRESETS.get(args.preset, {}))
    for item in args.set:
        field, _, value = item.partition("=")
        config[field] = json.loads(value)
    hf_config = transformers.AutoConfig.for_model(**config)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(hf_config, dtype=torch.bfloat16)
    count = sum(p.numel() for p in model.parameters())
    dst.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(dst)
    for name in TOKENIZER_FILES:
        if (src / name).exists():
            shutil.copy(src / name, dst / name)
    print(f"wrote {dst}: {count / 1e6:.0f}M random bfloat16 parameters ({config['model_type']})")


if __name__ == "__main__":
    main()
