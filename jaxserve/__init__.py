"""jaxserve: a JAX/XLA LLM inference engine."""
