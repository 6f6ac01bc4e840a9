"""Speculative decoding: proposers of draft tokens the target model verifies in one step.

`speculative` (n-gram proposals, acceptance, statistics) and `draft_model` (a smaller model with its own
runner and pages proposes). It may import the runner and everything below it, never the engine core or
scale-out.
"""
