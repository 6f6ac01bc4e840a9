"""Scale-out: one engine over several hosts, and replicas of a server behind a router.

`multihost` (rank 0 leads, followers replay its steps), `step_channel` (the authenticated binary wire
format between them; no pickle) and `data_parallel` (the `--data-parallel-size` launcher: replicas behind
sglang-router, restarted when unhealthy). It may import the runner and everything below it, never the
engine core or speculative decoding.
"""
