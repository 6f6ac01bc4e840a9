"""The engine core: what a request passes through between its arrival and its last token.

`validation` and `request` (a request checked at the edge; its state), `scheduler` (which requests
run in the next step and with how many tokens; preemption), `engine` (`LLMEngine`: one step is
schedule -> prepare -> launch -> read, each stage returning a record of `step_records`), `step_prep`
(a step's rows: drafts, sampling rows, grammar masks), `output_processor` (a step's tokens read back
into its requests), `engine_loop` (the thread that runs steps for the server, and its watchdog),
`detokenizer` (tokens to text, stop strings), `structured_output` (grammar state per request) and
`startup` (the start-up lines). It may import every layer below it: speculative decoding and
scale-out, the runner, models, weights, parallelism, ops and config.
"""
