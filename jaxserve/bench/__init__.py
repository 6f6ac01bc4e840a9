"""`jaxserve bench`: serving (`serve`, any OpenAI-compatible server) and offline (`throughput`) benchmarks."""
