"""`regenerate --backend openai`: the checks and the target stand-in of a regeneration on a server.

Kept apart from `recipes/regenerate.py`, which only dispatches on `--backend` (`local` or `openai`): the endpoint is
checked (reachable, the model served, chat completions answered, the API key exported) before
any data is read or any prompt is sent, each problem one line naming its fix (exit 2).
"""

from __future__ import annotations

import argparse
import logging
import os
from functools import partial
from types import SimpleNamespace
from typing import Any, Optional

from nemo_dflash.recipes._cli import fail

logger = logging.getLogger("nemo_dflash.regenerate")

BACKENDS = ("local", "openai")
RENAMED_BACKENDS = {"engine": "local"}  # old name -> new: accepted, with one warning
MAX_CONCURRENCY = 4096


def add_server_args(p: argparse.ArgumentParser) -> None:
    """The flags of the server backend (their defaults come from `RegenerateConfig`, like every flag's)."""
    p.add_argument("--backend", choices=(*BACKENDS, *RENAMED_BACKENDS), metavar="{" + ",".join(BACKENDS) + "}",
                   help="local: load --target here and answer with it (--engine picks the decoder); openai: ask an "
                        "OpenAI-compatible server (vLLM, SGLang, TensorRT-LLM, llama-server) serving the target for "
                        "the answers; --target then gives the tokenizer (templates, prompt lengths, tokens)")
    server_flag = partial(_add_server_flag, p)
    server_flag("--endpoint", "the server's OpenAI base URL, e.g. http://HOST:8000/v1", metavar="URL")
    server_flag("--model", "the name the server serves the target under (default: its only model)", metavar="NAME")
    server_flag("--api-key-env", "the environment variable holding the API key (the key is never in the recipe); "
                "default: no key", metavar="VAR")
    server_flag("--concurrency", "requests in flight (the server batches them)", type=int)
    server_flag("--request-timeout", "seconds one answer may take before it is asked again", type=float)
    server_flag("--retries", "attempts after the first for a timeout, a 429/5xx or a dropped connection, with "
                "exponential back-off; then the run stops, its journal kept", type=int)
    server_flag("--retry-backoff", "seconds before the first retry, doubled each retry (at most 30 s, jittered; a "
                "server's Retry-After is honoured)", type=float)
    server_flag("--server-extensions", "on: also send top_k/min_p/repetition_penalty (the server's defaults off) "
                "and ask for token ids (vLLM, SGLang, llama.cpp take them); off: OpenAI's fields only",
                choices=("on", "off"))


def _add_server_flag(p: argparse.ArgumentParser, flag: str, text: str, **kwargs: Any) -> None:
    """A flag that acts with --backend openai alone: its help says so first, in the same words for each."""
    p.add_argument(flag, help=f"--backend openai: {text}", **kwargs)


def validate_server_args(args: argparse.Namespace) -> None:
    """The server flags' checks that need no network (the API key's variable included)."""
    if args.backend in RENAMED_BACKENDS:  # a recipe or a command line written before the rename
        logger.warning("--backend %s is deprecated: pass --backend %s", args.backend, RENAMED_BACKENDS[args.backend])
        args.backend = RENAMED_BACKENDS[args.backend]
    if args.backend != "openai":
        return
    if not args.endpoint:
        fail("--backend openai needs --endpoint URL, the server's OpenAI base URL (e.g. http://HOST:8000/v1)")
    if not args.endpoint.startswith(("http://", "https://")):
        fail(f"--endpoint {args.endpoint!r} is not an http(s) URL: give e.g. http://HOST:8000/v1")
    if not 1 <= args.concurrency <= MAX_CONCURRENCY:
        fail(f"--concurrency must be in [1, {MAX_CONCURRENCY}] (got {args.concurrency})")
    if not args.request_timeout > 0:
        fail(f"--request-timeout must be > 0 seconds (got {args.request_timeout})")
    if args.retries < 0:
        fail(f"--retries must be >= 0 (got {args.retries})")
    if args.retry_backoff < 0:
        fail(f"--retry-backoff must be >= 0 seconds (got {args.retry_backoff})")
    if args.api_key_env is not None and not os.environ.get(args.api_key_env):
        fail(f"--api-key-env {args.api_key_env}: the variable is not set; export {args.api_key_env}=YOUR_KEY "
             "(or drop --api-key-env for a server without a key)")


def connect_server(args: argparse.Namespace) -> tuple[Any, dict[str, Any]]:
    """The checked endpoint and the served model's entry, before any data is read or any prompt sent."""
    from nemo_dflash.data.openai_backend import EndpointError, connect

    key = os.environ.get(args.api_key_env) if args.api_key_env else None
    try:
        endpoint, entry = connect(args.endpoint, args.model, key, timeout_s=args.request_timeout,
                                  retries=args.retries, extensions=args.server_extensions == "on",
                                  backoff_s=args.retry_backoff)
    except EndpointError as e:
        fail(e)
    logger.info("--backend openai: %s serves %s", endpoint.base_url, endpoint.model)
    return endpoint, entry


def server_target(args: argparse.Namespace, endpoint: Any, entry: dict[str, Any]) -> tuple[Any, Any]:
    """(the target as a server, the target's tokenizer): no weights are loaded. The context is the
    smallest of the target config's, the server's ``max_model_len`` (vLLM) and its slot's ``meta.n_ctx``
    (llama.cpp): a longer prompt is skipped at selection rather than refused by the server."""
    from nemo_dflash.data.chat_template import stop_token_ids
    from nemo_dflash.data.openai_backend import ServerTarget
    from nemo_dflash.target.loading import load_target_config, load_tokenizer, resolve_model_dir

    try:
        tokenizer = load_tokenizer(args.target)
        config = load_target_config(args.target)
    except (FileNotFoundError, OSError, ValueError) as e:
        fail(f"cannot load the tokenizer of --target {args.target} (--backend openai reads the target's tokenizer "
             f"and config, not its weights): {e}")
    generation = _generation_config(resolve_model_dir(args.target))
    try:
        stops = stop_token_ids(SimpleNamespace(generation_config=generation), tokenizer)
    except ValueError as e:
        fail(f"--target {args.target}: {e}")
    meta = entry.get("meta") if isinstance(entry.get("meta"), dict) else {}
    contexts = [c for c in (getattr(config, "max_position_embeddings", None), entry.get("max_model_len"),
                            meta.get("n_ctx")) if isinstance(c, int) and c > 0]
    server = ServerTarget(endpoint, stops, min(contexts) if contexts else None, generation)
    return server, tokenizer


def _generation_config(model_dir: str) -> Optional[Any]:
    """The target's generation_config.json (its recommended sampling, for --sampling target), or None."""
    from transformers import GenerationConfig

    if not os.path.isfile(os.path.join(model_dir, "generation_config.json")):
        return None
    try:
        return GenerationConfig.from_pretrained(model_dir, local_files_only=True)
    except (OSError, ValueError) as e:
        logger.warning("cannot read %s/generation_config.json (%s): --sampling target uses the command line's",
                       model_dir, e)
        return None
