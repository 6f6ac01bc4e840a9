"""Configuration: the settings every layer reads, and nothing that runs a model.

`model_config` (a model's architecture), `engine_config` (`EngineConfig`, vLLM's flags),
`sampling_params` (`SamplingParams`, `StructuredOutputsParams`), `speculative` (`speculative_config`),
`device_defaults` (what `auto` means on this device: dtype, limits, pool size), `buckets` (the shape
buckets steps compile for) and `cache_dirs` (where compiled kernels and converted weights are kept).
The bottom layer, with `errors` and `log`: it imports no other part of jaxserve.
"""
