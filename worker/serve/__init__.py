"""The built-in model server (vLLM's HTTP API over a JAX/Tunix engine)."""
