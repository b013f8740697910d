"""Prefill/decode disaggregation: prefill workers run prompts, decode workers the rest, each a
process with its own devices; KV moves between them through ``jax.experimental.transfer``."""
