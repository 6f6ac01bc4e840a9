"""The model runner: the device side of a step.

`model_runner` (the compiled step functions, their buckets, warm-up and pool sizing), `step_inputs`
(a scheduled batch as the fixed-shape host arrays a step takes), `device_batch` (per-request sampling
state kept on the device between steps), `page_pool` (which KV pages each sequence holds; the prefix
cache) and `compilation` (counting and forbidding compilations, the persistent cache). It may import
models, weights, parallelism, ops and config; never the engine core.
"""
