"""Pallas paged-attention kernels for Hopper GPUs (Mosaic GPU), each with its pure-jnp reference.

- `ragged_paged_attention`: prefill chunks and decode rows of many sequences on one token axis.
- `decode_attention`: one row per sequence, keys split across programs (flash-decoding).

Both run on CPU in JAX's GPU interpret mode (`interpret=True`) and lower for CUDA on any machine.
`check_supported` says which shapes they take; docs/kernels.md says what has been observed.
"""

from pallas_kernels.common import SUPPORTED_HEAD_DIMS, UnsupportedShapeError, check_supported
from pallas_kernels.decode_attention import decode_attention, decode_attention_reference
from pallas_kernels.ragged_paged_attention import ragged_paged_attention, ragged_paged_attention_reference

__all__ = [
    "SUPPORTED_HEAD_DIMS",
    "UnsupportedShapeError",
    "check_supported",
    "decode_attention",
    "decode_attention_reference",
    "ragged_paged_attention",
    "ragged_paged_attention_reference",
]
