"""`jaxserve bench`: serving (`serve`, any OpenAI-compatible server) and offline (`throughput`) benchmarks,
and what a setting costs in quality (`quality`: perplexity and greedy agreement against float32)."""
