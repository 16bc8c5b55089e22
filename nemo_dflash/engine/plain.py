"""Plain decoding of a queue of requests, for the callers that make text rather than time it: regeneration, Magpie
prompts and replay's greedy answers. It is the engine's plain runner (`batched_static.BatchedStaticPlainRunner`)
driven by `serve` with one call's settings, and how many rows fit a GPU.

The answers are the runner's (T=0: plain greedy decoding, token for token; T > 0: keyed draws, a function of the
request's key and the seed only), so a regenerated record does not depend on the rows, the batch it shared, or a
resumed run. Speed settings (none changes an answer): `window` plain steps a host read-back (GPU 12, CPU 1), and
`refill_rows` free rows before a refill's prefill (a sixteenth of the rows on a GPU, half on a CPU): a prefill is
one eager forward with a fixed cost, so refilling one row a step would spend more time prefilling than decoding.
"""

from __future__ import annotations

import collections
import logging
from typing import Any, Iterable, Iterator, Optional

import torch
from torch import nn

from nemo_dflash.engine.batched_static import (
    BatchedStaticPlainRunner, Completion, Request, plain_cache_length, top_k_cap,
)
from nemo_dflash.engine.options import DEFAULT_OPTIONS, EngineOptions
from nemo_dflash.engine.static_cache import check_static_target
from nemo_dflash.engine.sampling import GREEDY, SamplingParams

logger = logging.getLogger(__name__)

AUTO_ROWS_CAP = 2048  # `--batch-size auto` at most (the H200's 2,048 rows fill its plain step)
CPU_AUTO_ROWS = 8  # `auto` where nothing is fitted (off a GPU)
KV_MEMORY_FRACTION = 0.9  # of the GPU's free memory, the most the rows' KV cache may take
WINDOW = {"cuda": 12}  # plain steps a host read-back by device type (else 1: a CPU runs each step synchronously)
REFILL_FRACTION = {"cuda": 16}  # refill once rows // this are free (else 2)


def row_bytes(config: Any, length: int, dtype: torch.dtype) -> int:
    """Bytes of one row's K and V over every layer."""
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    heads = text.num_attention_heads
    kv_heads = getattr(text, "num_key_value_heads", None) or heads
    head_dim = getattr(text, "head_dim", None) or text.hidden_size // heads
    return 2 * text.num_hidden_layers * kv_heads * length * head_dim * torch.empty((), dtype=dtype).element_size()


def free_device_bytes(device: torch.device) -> int:
    """GPU memory a new KV cache can take: free by the driver, plus what PyTorch's allocator holds unused."""
    return torch.cuda.mem_get_info(device)[0] + torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)


def window_for(device: torch.device) -> int:
    return WINDOW.get(device.type, 1)


def max_rows(model: nn.Module, max_prompt_tokens: int, max_new_tokens: int,
             fraction: float = KV_MEMORY_FRACTION) -> Optional[int]:
    """The most answers in flight whose KV cache fits `fraction` of the GPU's free memory now (None off a GPU)."""
    param = next(model.parameters())
    if param.device.type != "cuda":
        return None
    length = plain_cache_length(max_prompt_tokens, max_new_tokens, window_for(param.device))
    return int(free_device_bytes(param.device) * fraction) // row_bytes(model.config, length, param.dtype)


def check_rows_fit(rows: int, length: int, row_bytes: int, free_bytes: int) -> None:
    """Raise a one-line ValueError naming the fix if `rows` KV rows of `row_bytes` do not fit in KV_MEMORY_FRACTION
    of `free_bytes`: caught before the cache is allocated."""
    fit = int(free_bytes * KV_MEMORY_FRACTION) // row_bytes
    if rows > fit:
        raise ValueError(f"{rows} rows x {length} positions need a {rows * row_bytes / 1e9:.1f} GB KV cache and "
                         f"{free_bytes / 1e9:.1f} GB is free: use --batch-size {max(fit, 1)} or less, or lower "
                         "--max-prompt-tokens / --max-new-tokens")


def auto_rows(fit: Optional[int]) -> int:
    """`--batch-size auto`: 97% of the rows that fit (`max_rows`; a margin for what the engine allocates besides
    its cache), capped at AUTO_ROWS_CAP; CPU_AUTO_ROWS where nothing was fitted (off a GPU)."""
    return CPU_AUTO_ROWS if fit is None else max(1, min(fit - fit // 32, AUTO_ROWS_CAP))


class PlainEngine:
    """`generate(pending)` answers a queue of `Request`s with `rows` rows, yielding `Completion`s as they end
    (the caller may append a conversation's next turn meanwhile; it continues in its row). `loop_detector`
    fills each completion's `loop_start`; with `stop_on_loop` a looping answer ends at a loop check, cut.
    `sampling`: how its tokens are chosen (greedy, or keyed draws of the request's key and `seed`).
    `reuse_rows=False`: a conversation's next turn is prefilled whole, for comparison. `options`: the engine's
    speed settings (answers unchanged)."""

    def __init__(self, model: nn.Module, *, rows: int, max_prompt_tokens: int, max_new_tokens: int,
                 stop_ids: Iterable[int], sampling: SamplingParams = GREEDY, seed: int = 0,
                 loop_detector: Any = None, stop_on_loop: bool = False, loop_check_every: int = 128,
                 refill_rows: Optional[int] = None, window: Optional[int] = None,
                 use_graphs: Optional[bool] = None, reuse_rows: bool = True,
                 options: EngineOptions = DEFAULT_OPTIONS) -> None:
        if rows < 1 or max_prompt_tokens < 1 or max_new_tokens < 1:
            raise ValueError("rows, max_prompt_tokens and max_new_tokens must be >= 1")
        check_static_target(model)
        device = next(model.parameters()).device
        self.sampling = sampling
        self.window = window or window_for(device)
        self.use_graphs = device.type == "cuda" if use_graphs is None else use_graphs
        if self.use_graphs and device.type != "cuda":
            raise ValueError(f"CUDA graphs need a CUDA device (the model is on {device.type}): leave use_graphs unset")
        length = plain_cache_length(max_prompt_tokens, max_new_tokens, self.window)
        if device.type == "cuda":
            check_rows_fit(rows, length, row_bytes(model.config, length, next(model.parameters()).dtype),
                           free_device_bytes(device))
        # its own runner (not the cached ones evaluation reuses): its KV cache goes with this engine
        self.runner = BatchedStaticPlainRunner(model, rows, length, self.use_graphs, not self.sampling.greedy,
                                               self.sampling.filtered, top_k_cap(self.sampling), options)
        self.runner.window = self.window
        self.rows, self.max_new_tokens, self.seed = rows, max_new_tokens, seed
        self.stop_ids = {int(t) for t in stop_ids}
        self.loop_detector, self.stop_on_loop, self.loop_check_every = loop_detector, stop_on_loop, loop_check_every
        self.refill_rows = refill_rows or max(1, rows // REFILL_FRACTION.get(device.type, 2))
        self.reuse_rows = reuse_rows  # False: a conversation's next turn is prefilled whole (for comparison)
        logger.info("engine: %d rows x %d positions, %s, window %d", rows, length,
                    "CUDA graphs" if self.use_graphs else "eager", self.window)

    def generate(self, pending: "collections.deque[Request]") -> Iterator[Completion]:
        return self.runner.serve(pending, self.max_new_tokens, self.stop_ids,
                                 None if self.sampling.greedy else self.sampling, self.seed, self.loop_detector,
                                 self.stop_on_loop, self.loop_check_every, self.refill_rows, self.reuse_rows)

    # what the runner did, summed over its calls: tokens generated, prompt tokens prefilled and kept from a held row,
    # follow-ups that continued in their row (of them, those whose row was not all a prefix), seconds by phase
    STATS = ("generated_tokens", "prefill_tokens", "reused_tokens", "continued", "prefix_short", "seconds")

    def __getattr__(self, name: str) -> Any:
        if name in PlainEngine.STATS and "runner" in self.__dict__:
            return getattr(self.runner, name)
        raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")


__all__ = ["AUTO_ROWS_CAP", "Completion", "PlainEngine", "Request", "auto_rows", "check_rows_fit", "max_rows",
           "row_bytes"]
