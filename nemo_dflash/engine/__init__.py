"""The decoding engine: everything that turns a target and a draft into tokens. Rows of a static KV cache
decoded together, plain or speculative, at any temperature, each step a captured CUDA graph on a GPU
(`batched_static`, `plain`); what its steps share (`static_decode`, `graphs`); its caches (`static_cache`) and
the hybrid targets' recurrent-state rollback (`recurrent_cache`); the one-prompt eager decoder that is the
tests' oracle (`spec_decode`); the acceptance rule (`acceptance`), keyed sampling (`sampling`), the attention
kernels (`attention`), the torch.compile cache (`compiled`), its speed settings (`options`) and the answer type
(`output`). Regeneration (`data/`) and evaluation both run on it, so all but `spec_decode` sit below both.
"""
