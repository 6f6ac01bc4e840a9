"""LoRA adapters on the host: which adapter a request asks for (`request.py`), reading a PEFT adapter
directory into stacked float32 A and B matrices (`peft_loader.py`), and which adapters sit in which
device slots and in the host cache (`residency.py`). No JAX here: the device arrays and the math are the
model runner's and the model's."""

from jaxserve.lora.errors import LoRAError
from jaxserve.lora.request import LoRARequest

__all__ = ["LoRAError", "LoRARequest"]
