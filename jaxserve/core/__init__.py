"""The engine core: what a request passes through between its arrival and its last token.

`request` (a request's state), `scheduler` (which requests run in the next step and with how many
tokens; preemption), `engine` (`LLMEngine`: one step is schedule, prepare, launch, read),
`engine_loop` (the thread that runs steps for the server and its watchdog), `detokenizer` (tokens to
text, stop strings) and `structured_output` (grammar state per request). It may import every layer
below it: speculative decoding and scale-out, the runner, models, weights, parallelism, ops and config.
"""
