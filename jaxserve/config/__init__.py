"""Configuration: the settings every layer reads, and nothing that runs a model.

`model_config` (a model's architecture), `engine_config` (`EngineConfig`, vLLM's flags), `device_defaults`
(what `auto` means on this device: dtype, limits, pool size) and `cache_dirs` (where compiled kernels and
converted weights are kept). The bottom layer: it imports no other part of jaxserve except `errors`.
"""
