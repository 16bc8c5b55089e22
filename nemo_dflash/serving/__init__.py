"""Serving: the contract between a trained draft and the engines that run it. `export` writes a draft in the
serving format (config, safetensors, the marks a loader checks) and `engine_limits` holds the known limits of
vLLM and SGLang that an export is checked against before anything is written.
"""
