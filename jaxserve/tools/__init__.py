"""Developer tools behind `jaxserve` subcommands: `check_lowering` (lower every step for a platform and
report its kernels) and `export` (write a model back as a Hugging Face directory)."""
