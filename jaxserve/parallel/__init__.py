"""Parallelism inside one engine: tensor parallelism over a JAX `Mesh`.

`tensor_parallel` (the mesh, shard_map'd steps and device requests) and `tp_layout` (how each weight and
KV head is split across devices). Serving-level scale-out (several hosts, replicas) is `distributed`.
It may import models, ops and config.
"""
