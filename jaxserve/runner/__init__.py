"""The model runner: the device side of a step.

`resolve` (every setting decided once, before anything is built: a frozen `ResolvedConfig`),
`model_runner` (the compiled step functions, warm-up, the KV pages, sizing the pool from memory),
`step_inputs` (a scheduled batch as the fixed-shape host arrays a step takes), `device_batch`
(per-request sampling state kept on the device between steps), `page_pool` (which KV pages each
sequence holds; the prefix cache) and `compilation` (counting and forbidding compilations, the
persistent cache). It may import models, weights, parallelism, ops and config; never the engine core.
"""
