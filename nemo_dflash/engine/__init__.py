"""The generation engine: rows of a static KV cache decoded together, plain or speculative, at any temperature,
each step a captured CUDA graph on a GPU (`batched_static`); what its steps share (`static_decode`, `graphs`),
its caches and attention (`static_cache`), its speed settings (`options`) and the answer type (`output`).
Regeneration (`data/`) and evaluation (`inference/`) both run on it, so it sits below both."""
