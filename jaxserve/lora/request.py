"""`LoRARequest`: which adapter a request runs with (vLLM's name and fields).

It names the adapter and where its PEFT directory is; loading it is `peft_loader.py`, keeping it in a
device slot `residency.py`. Also the `lora_modules` setting's entries, parsed into LoRARequests.
"""

from __future__ import annotations

import dataclasses
import json


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


_MODULE_FIELDS = ("name", "path", "base_model_name")


def parse_lora_modules(entries) -> tuple[LoRARequest, ...]:
    """The `lora_modules` setting as LoRARequests, ids 1, 2, ... in order. Each entry is "name=path", a JSON
    object or dict {"name": ..., "path": ..., "base_model_name": ...} (vLLM's two forms), or a LoRARequest
    (kept as it is), also as the dict `dataclasses.asdict` makes of one (the command line hands the offline
    LLM its settings so). A bad entry, or two adapters with one name or id, is a ValueError naming it."""
    if entries is None:
        return ()
    if isinstance(entries, (str, dict, LoRARequest)):
        entries = [entries]
    loras = tuple(entry if isinstance(entry, LoRARequest) else _lora_module(entry, i + 1)
                  for i, entry in enumerate(entries))
    for field, values in (("name", [lora.name for lora in loras]), ("lora_int_id", [lora.id for lora in loras])):
        twice = sorted({value for value in values if values.count(value) > 1}, key=str)
        if twice:
            raise ValueError(f"lora_modules: two adapters have the {field} {twice[0]!r}")
    return loras


def _lora_module(entry, lora_int_id: int) -> LoRARequest:
    form = "must be name=path or a JSON object {\"name\": ..., \"path\": ...}"
    if isinstance(entry, str) and entry.lstrip().startswith("{"):
        try:
            entry = json.loads(entry)
        except json.JSONDecodeError as e:
            raise ValueError(f"lora_modules entry {entry!r} is not valid JSON: {e}") from None
    if isinstance(entry, str):
        name, equals, path = entry.partition("=")
        if not (equals and name.strip() and path.strip()):
            raise ValueError(f"lora_modules entry {entry!r} {form}")
        return LoRARequest(name.strip(), lora_int_id, path.strip())
    if not isinstance(entry, dict):
        raise ValueError(f"lora_modules entry {entry!r} {form}")
    if set(entry) == {f.name for f in dataclasses.fields(LoRARequest)}:
        return LoRARequest(**entry)
    unknown = sorted(set(entry) - set(_MODULE_FIELDS))
    if unknown or not isinstance(entry.get("name"), str) or not isinstance(entry.get("path"), str):
        why = f"has unknown fields {unknown}" if unknown else "needs a string name and path"
        raise ValueError(f"lora_modules entry {entry!r} {why} (fields: {', '.join(_MODULE_FIELDS)})")
    return LoRARequest(entry["name"], lora_int_id, entry["path"], entry.get("base_model_name"))
