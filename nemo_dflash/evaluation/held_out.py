"""The T=0 acceptance of a draft on held-out prompts, by replay (`evaluation.replay`): the figures of the
one-at-a-time speculative decoder, from batched work. The demo's before/after figure; any caller that measures one
draft at several points of its training (the target's greedy answers do not change, so they are made once)."""

from __future__ import annotations

import contextlib
import time
from typing import Optional


class HeldOutAcceptance:
    """The demo's before/after figure: the T=0 acceptance of the draft on held-out prompts, by replay
    (`evaluation.replay`: the figures of the one-at-a-time speculative decoder, from batched work).

    At T=0 the answers are the target's greedy answers, which the draft does not change: they are
    generated once, in one batch for every prompt set, and each evaluation only replays the draft
    along them (one target forward and one draft forward per answer).
    """

    def __init__(self, prompt_sets: dict[str, list], max_new_tokens: int, eager: bool = False) -> None:
        from nemo_dflash.evaluation.protocol import EvalSettings

        self.prompt_sets = prompt_sets
        # under `eager_modules` flex_attention runs uncompiled, which a CUDA graph cannot capture
        self.cuda_graph = False if eager else None
        self.settings = EvalSettings(max_new_tokens=max_new_tokens, turns=1, warmup=False)  # T=0: replay
        self.greedy: Optional[dict[str, list]] = None
        self.greedy_s = 0.0  # seconds the greedy answers took (the first call only)

    def __call__(self, target, tokenizer, draft) -> dict[str, float]:
        from nemo_dflash.evaluation.protocol import dataset_result
        from nemo_dflash.evaluation.replay import ReplayEvaluator

        evaluator = ReplayEvaluator(target, tokenizer, draft, self.settings, cuda_graph=self.cuda_graph)
        if self.greedy is None:
            t0 = time.perf_counter()
            everything = [p for prompts in self.prompt_sets.values() for p in prompts]
            turns = evaluator.greedy_answers(everything)  # {(prompt index, turn): answer}, one batch
            self.greedy, first = {}, 0
            for name, prompts in self.prompt_sets.items():
                self.greedy[name] = [turns[first + i, 0] for i in range(len(prompts))]
                first += len(prompts)
            self.greedy_s = time.perf_counter() - t0
        was_training = draft.training
        draft.eval()
        try:
            answers = {name: [evaluator.answer(p, 0, g) for p, g in zip(prompts, self.greedy[name])]
                       for name, prompts in self.prompt_sets.items()}
        finally:
            draft.train(was_training)
        return {name: dataset_result(a, block_size=evaluator.block_size, sampling=self.settings.sampling,
                                     max_new_tokens=self.settings.max_new_tokens,
                                     num_prompts=len(a))["mean_acceptance_length"]
                for name, a in answers.items()}


def eager_modules(device: str):
    """Evaluate with the modules as written, not as compiled for training.

    The GPU recipe compiles the draft and the target's layers for the packed training shape; an
    evaluation feeds other shapes, and recompiling for each one took minutes (and fell inside the
    timed plain and speculative decodes, which made their ratio meaningless).
    """
    import torch

    return torch.compiler.set_stance("force_eager") if device == "cuda" else contextlib.nullcontext()
