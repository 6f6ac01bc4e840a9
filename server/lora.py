"""LoRA adapters on the server, as vLLM serves them: each adapter is a model of its own.

With `--enable-lora`, every adapter (those of `--lora-modules`, and those loaded at run time) is listed
in /v1/models with its `parent` (the base model) and `root` (its directory), and a request whose
`model` names an adapter runs with it; any other name than the base model's or an adapter's is a 404
naming it. `POST /v1/load_lora_adapter` {lora_name, lora_path} and `POST /v1/unload_lora_adapter`
{lora_name} (vLLM's bodies, and its plain-text replies) change the set at run time; they exist only
with `--enable-lora` (vLLM's exist only with VLLM_ALLOW_RUNTIME_LORA_UPDATING) and, as every /v1
route, need the API key. A directory jaxserve cannot serve is a 400 with the loader's reason
(`jaxserve.lora.LoRAError`); a name already loaded is a 400.

`ServedLoRAs` is the server's own list of adapter names, read by the event loop without calling into
the engine: the engine is touched only on its thread (`EngineLoop.call`), to add or remove an adapter.
An adapter unloaded while requests run with it keeps serving them; new requests cannot name it.
"""

from __future__ import annotations

import asyncio
import logging

from fastapi import APIRouter
from fastapi.responses import PlainTextResponse

from jaxserve.lora import LoRARequest
from server.errors import APIError
from server.protocol import Strict

logger = logging.getLogger(__name__)


class LoadLoRAAdapterRequest(Strict):
    lora_name: str
    lora_path: str


class UnloadLoRAAdapterRequest(Strict):
    lora_name: str | None = None
    lora_int_id: int | None = None


class ServedLoRAs:
    """The adapters this server serves, by name, and the base model's name (`base_name`)."""

    def __init__(self, engine_loop, base_name: str, enabled: bool):
        self.engine_loop, self.base_name, self.enabled = engine_loop, base_name, enabled
        self.adapters: dict[str, LoRARequest] = {}
        self.next_id = 1
        self.lock = asyncio.Lock()  # one load or unload at a time: a name is checked and taken in one go

    def start(self) -> None:
        """Reads the adapters the engine loaded at start (`--lora-modules`), on the engine's thread."""
        if self.enabled:
            for lora in self.engine_loop.call(self.engine_loop.engine.list_loras).result():
                self.adapters[lora.lora_name] = lora
            self.next_id = max((lora.lora_int_id for lora in self.adapters.values()), default=0) + 1

    def resolve(self, model: str | None) -> LoRARequest | None:
        """The adapter a request's `model` names; None for the base model (or no model given)."""
        if model is None or model == self.base_name:
            return None
        if model in self.adapters:
            return self.adapters[model]
        served = repr(self.base_name)
        if self.adapters:
            served += f" and the LoRA adapters {', '.join(map(repr, sorted(self.adapters)))}"
        raise APIError(404, f"the model {model!r} does not exist; this server serves {served}", "model")

    def model_name(self, lora: LoRARequest | None) -> str:
        """The `model` a response names: the adapter's, or the base model's."""
        return self.base_name if lora is None else lora.lora_name

    def cards(self, created: int, max_model_len: int) -> list[dict]:
        """/v1/models' entries: the base model, then every adapter (vLLM's ModelCard fields)."""
        base = {"id": self.base_name, "object": "model", "created": created, "owned_by": "jaxserve",
                "root": self.engine_loop.engine.model.source, "parent": None, "max_model_len": max_model_len}
        return [base, *({"id": lora.lora_name, "object": "model", "created": created, "owned_by": "jaxserve",
                         "root": lora.lora_path, "parent": lora.base_model_name or self.base_name,
                         "max_model_len": max_model_len} for lora in self.adapters.values())]

    async def load(self, body: LoadLoRAAdapterRequest) -> str:
        if not body.lora_name or not body.lora_path:
            raise APIError(400, "Both 'lora_name' and 'lora_path' must be provided.",
                           "lora_path" if body.lora_name else "lora_name")
        async with self.lock:
            if body.lora_name in self.adapters or body.lora_name == self.base_name:
                what = "the base model's name" if body.lora_name == self.base_name else "has already been loaded"
                raise APIError(400, f"The lora adapter '{body.lora_name}' {what}.", "lora_name")
            lora = LoRARequest(body.lora_name, self.next_id, body.lora_path)
            try:
                await asyncio.wrap_future(self.engine_loop.call(self.engine_loop.engine.add_lora, lora))
            except ValueError as e:  # LoRAError: the directory's problem, named
                raise APIError(400, str(e), "lora_path") from None
            except RuntimeError:
                raise APIError(503, "the engine is not running") from None
            self.adapters[lora.lora_name] = lora
            self.next_id += 1
        logger.info("loaded the LoRA adapter %r from %s", lora.lora_name, lora.lora_path)
        return f"Success: LoRA adapter '{lora.lora_name}' added successfully."

    async def unload(self, body: UnloadLoRAAdapterRequest) -> str:
        if not body.lora_name and body.lora_int_id is None:
            raise APIError(400, "either 'lora_name' or 'lora_int_id' needs to be provided.", "lora_name")
        async with self.lock:
            name = body.lora_name or next((lora.lora_name for lora in self.adapters.values()
                                           if lora.lora_int_id == body.lora_int_id), None)
            if name not in self.adapters:
                given = repr(body.lora_name) if body.lora_name else f"with id {body.lora_int_id}"
                raise APIError(404, f"The lora adapter {given} cannot be found.",
                               "lora_name" if body.lora_name else "lora_int_id")
            del self.adapters[name]  # new requests cannot name it from here on
            try:
                await asyncio.wrap_future(self.engine_loop.call(self.engine_loop.engine.remove_lora, name))
            except RuntimeError:
                raise APIError(503, "the engine is not running") from None
        logger.info("unloaded the LoRA adapter %r", name)
        return f"Success: LoRA adapter '{name}' removed successfully."


def lora_router(loras: ServedLoRAs) -> APIRouter:
    """The runtime loading routes (mounted only with --enable-lora)."""
    router = APIRouter()

    @router.post("/v1/load_lora_adapter")
    async def load_lora_adapter(body: LoadLoRAAdapterRequest):
        return PlainTextResponse(await loras.load(body))

    @router.post("/v1/unload_lora_adapter")
    async def unload_lora_adapter(body: UnloadLoRAAdapterRequest):
        return PlainTextResponse(await loras.unload(body))

    return router
