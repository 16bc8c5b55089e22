"""`model.generate` batch after batch: regeneration's fallback engine (`engine="generate"`) for the models the
decoding engine cannot run, with the explicit generation settings the draft's data is sampled under.

Batched generation left-pads the prompts (decoder-only models continue from the last position); results come
back in input order."""

from __future__ import annotations

import collections
from collections.abc import Iterator, Sequence
from typing import Any, Optional

import torch

from nemo_dflash.data.loops import LoopDetector
from nemo_dflash.engine.plain import Completion
from nemo_dflash.engine.sampling import SamplingParams


def _pad_id(tokenizer: Any, stop_ids: Sequence[int]) -> int:
    pad = getattr(tokenizer, "pad_token_id", None)
    return pad if pad is not None else stop_ids[0]


def _generation_kwargs(
    *, max_new_tokens: int, sampling: SamplingParams, stop_ids: list[int], pad_id: int
) -> dict[str, Any]:
    """Explicit settings, so defaults in the checkpoint's generation_config (top_k=20, a repetition
    penalty, ...) do not silently reshape the distribution the draft is trained on."""
    kwargs: dict[str, Any] = dict(
        max_new_tokens=max_new_tokens, eos_token_id=stop_ids, pad_token_id=pad_id, num_beams=1,
        repetition_penalty=1.0, min_new_tokens=0,
    )
    kwargs.update(sampling.hf_generate_kwargs())
    return kwargs


@torch.inference_mode()
def generate_batch(
    model: Any, prompts: Sequence[Sequence[int]], *, pad_id: int, stop_ids: Sequence[int], **gen_kwargs: Any
) -> list[tuple[list[int], str, int]]:
    """Generate for left-padded ``prompts``; per prompt (answer ids without the stop token,
    finish reason ``"stop"``/``"length"``, number of generated tokens including the stop token)."""
    width = max(len(p) for p in prompts)
    device = next(model.parameters()).device
    input_ids = torch.full((len(prompts), width), pad_id, dtype=torch.long)
    attention_mask = torch.zeros((len(prompts), width), dtype=torch.long)
    for i, p in enumerate(prompts):
        input_ids[i, width - len(p):] = torch.tensor(list(p), dtype=torch.long)
        attention_mask[i, width - len(p):] = 1
    out = model.generate(input_ids=input_ids.to(device), attention_mask=attention_mask.to(device), **gen_kwargs)
    stops = set(stop_ids)
    results = []
    for row in out[:, width:].tolist():
        end = next((k for k, t in enumerate(row) if t in stops), None)
        if end is None:
            results.append((row, "length", len(row)))
        else:  # rows that stopped early are padded after the stop token
            results.append((row[:end], "stop", end + 1))
    return results


class BatchedGenerateEngine:
    """``model.generate`` on successive batches of the pending requests: the fallback for models the
    decoding engine cannot run (recurrent or sliding-window layers). Finished rows idle until the
    longest answer of their batch ends, and sampling follows torch's global RNG, so samples
    depend on the batch composition (the engine's do not)."""

    def __init__(self, model: Any, *, batch_size: int, max_new_tokens: int, stop_ids: list[int], pad_id: int,
                 sampling: SamplingParams, seed: int, loop_detector: Optional[LoopDetector]) -> None:
        self.model, self.batch_size, self.stop_ids, self.pad_id = model, batch_size, stop_ids, pad_id
        self.gen_kwargs = _generation_kwargs(max_new_tokens=max_new_tokens, sampling=sampling, stop_ids=stop_ids,
                                             pad_id=pad_id)
        self.loop_detector = loop_detector
        self.generated_tokens = 0
        if not sampling.greedy:
            torch.manual_seed(seed)

    def generate(self, pending: collections.deque) -> Iterator[Completion]:
        while pending:
            batch = [pending.popleft() for _ in range(min(self.batch_size, len(pending)))]
            results = generate_batch(self.model, [r.prompt_ids for r in batch], pad_id=self.pad_id,
                                     stop_ids=self.stop_ids, **self.gen_kwargs)
            for req, (ids, reason, n_new) in zip(batch, results):
                self.generated_tokens += n_new
                start = self.loop_detector.find(ids) if self.loop_detector is not None else None
                yield Completion(req, ids, reason, n_new, loop_start=start)
