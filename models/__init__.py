"""ssd_jax.models: what a transformer is and how weights get in (config, params, the backend
table of ops, the forward, KV cache, quantized drafts, loaders, tokenizer, registry). Installed
from the repository's models/ folder; never imports the rest of ssd_jax."""
