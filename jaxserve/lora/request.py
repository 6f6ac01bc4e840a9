"""`LoRARequest`: which adapter a request runs with (vLLM's name and fields).

It names the adapter and where its PEFT directory is; loading it is `peft_loader.py`, keeping it in a
device slot `residency.py`.
"""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class LoRARequest:
    """One LoRA adapter: a unique name (the server's model name for it), a unique id >= 1 (0 is the base
    model) and the PEFT directory it is read from. base_model_name: the model it was trained on, shown
    as the adapter's parent in /v1/models (None: the served model)."""

    lora_name: str
    lora_int_id: int
    lora_path: str = ""
    base_model_name: str | None = None

    def __post_init__(self):
        if not isinstance(self.lora_name, str) or not self.lora_name:
            raise ValueError(f"{self.lora_name=} must be a non-empty string")
        if isinstance(self.lora_int_id, bool) or not isinstance(self.lora_int_id, int) or self.lora_int_id < 1:
            raise ValueError(f"{self.lora_int_id=} must be an integer >= 1 (0 is the base model)")
        object.__setattr__(self, "lora_path", str(self.lora_path))

    @property
    def name(self) -> str:
        return self.lora_name

    @property
    def id(self) -> int:
        return self.lora_int_id

    @property
    def adapter_id(self) -> int:
        return self.lora_int_id

    @property
    def path(self) -> str:
        return self.lora_path
