"""What every source loads to (`LoadedModel`), and the model config as jaxserve saves it beside params.

Both of jaxserve's own formats, the orbax checkpoint (`orbax.py`) and the converted-GGUF model cache
(`cache.py`), keep the `ModelConfig` as JSON in a `CHECKPOINT_MARKER` file; reading it back lives here.
"""

from __future__ import annotations

import dataclasses
from typing import Callable

from jaxserve.config.model_config import ModelConfig, RopeConfig

CHECKPOINT_MARKER = "jaxserve_model.json"


@dataclasses.dataclass
class LoadedModel:
    config: ModelConfig
    params: dict  # the pytree of `models/params.py` (ShapeDtypeStructs when `draw` makes them)
    tokenizer: object
    source: str
    # Random weights not made yet (load_format="dummy"): a traceable () -> params, which the model runner
    # calls inside its own conversion to the serving layout, so the device holds one copy of the weights
    draw: Callable[[], dict] | None = None


def config_from_dict(fields: dict) -> ModelConfig:
    """The inverse of `dataclasses.asdict(cfg)` after a JSON round trip (tuples came back as lists)."""
    fields = dict(fields)
    fields["rope"] = RopeConfig(**fields["rope"])
    if fields.get("local_rope"):
        fields["local_rope"] = RopeConfig(**fields["local_rope"])
    for key in ("sliding_layers", "eos_token_ids"):
        fields[key] = tuple(fields[key])
    return ModelConfig(**fields)
