"""`LoRAError`: an adapter jaxserve refuses, with the adapter's name and the reason (the server's 400)."""

from __future__ import annotations


class LoRAError(ValueError):
    """An adapter that cannot be served: a missing directory or file, a config jaxserve does not support
    (DoRA, biases, modules_to_save, targets outside the attention and MLP projections), a rank above
    max_lora_rank, or weights whose shapes do not fit the model (an adapter made for another base)."""
