"""T=0 acceptance by replay: the figures of the one-at-a-time speculative decoder, from batched work.

At temperature 0 speculative decoding outputs the target's greedy answer, token for token, and
each step's acceptance is fixed by that answer: step i drafts a block from the last verified
token (its anchor) and keeps 1 + the longest prefix of draft tokens equal to the greedy tokens
that follow. So instead of decoding one prompt at a time:

1. the greedy answers of all conversations are generated in batch (the decoding engine's plain rows,
   `engine.plain`, continuous batching; turn 2 sees the target's own turn-1 answer, built as
   `ConversationDecoder` builds it), then each answer is continued greedily for one more block
   past its end, stop tokens ignored: the sequential decoder's last step compares its drafts with
   those tokens too (its acceptance length counts tokens cut at the stop or the cap);
2. one teacher-forced target forward per (prompt + answer) captures the draft's context
   features, as training does (`target.hooks`);
3. one draft forward per chunk of anchors predicts the draft's greedy block at EVERY answer
   position (the training forward `objective.trainer_module.draft_block_hidden`: context strictly before the anchor);
4. a walk from the first anchor reads off the steps the sequential decoder takes, with its
   handling of the prefill's first token, stop tokens and the token cap (`spec_decode`).

In exact arithmetic the acceptance lengths equal the sequential decoder's; in fp32 they match in
the tests; in bf16 batched and one-prompt kernels round differently, so an answer can diverge at
a near tie (the benchmark `benchmarks/eval_speed.py` reports the difference). T > 0 has no such
identity: it keeps the sequential decoder.
"""

from __future__ import annotations

import collections
import logging
from dataclasses import dataclass
from typing import Any, Iterator, Optional, Sequence

import torch
from torch import nn

from nemo_dflash.objective.trainer_module import draft_block_hidden
from nemo_dflash.data.chat_template import stop_token_ids
from nemo_dflash.data.loops import find_loop_start
from nemo_dflash.train.device import release_device_memory
from nemo_dflash.draft.model import DFlashDraftModel
from nemo_dflash.evaluation.protocol import (
    Answer, EvalPrompt, EvalSettings, answer_text, conversation_turns, encode_chat,
)
from nemo_dflash.engine.acceptance import greedy_accepted_list
from nemo_dflash.engine.output import truncate
from nemo_dflash.target import HFDFlashTargetModel

logger = logging.getLogger(__name__)

ANCHOR_TOKENS = 8192  # block tokens per draft forward (anchors x block): bounds the dense mask's memory
MAX_ROWS = 512  # engine rows at most
KV_SHARE = 0.6  # of the free GPU memory, for the engine's KV cache (the rest: activations, the replay)
# The draft's attention over all anchors, by device: flex_attention with a BlockMask on a GPU, as training
# runs it (a dense mask with grouped KV heads falls back to SDPA's math kernel, which materialises the
# scores); the dense SDPA mask elsewhere. The benchmarks may set it.
DRAFT_ATTENTION = {"cuda": "flex", "cpu": "sdpa"}


@dataclass
class GreedyTurn:
    """One greedy answer: `output_ids` as the sequential decoder returns them (a stop token kept at
    the end), and `beyond`, the greedy tokens that follow it (stop tokens ignored)."""

    prompt_ids: list[int]
    output_ids: list[int]
    stopped: bool
    beyond: list[int]


def walk(output_ids: Sequence[int], beyond: Sequence[int], drafts: Sequence[Sequence[int]], stops: set[int],
         max_new_tokens: int) -> list[int]:
    """The acceptance lengths of the sequential T=0 decoder along one greedy answer.

    `drafts[p]`: the draft's B-1 greedy tokens from anchor p (output index of the last verified
    token). The prefill yields output token 0; each step from anchor p keeps 1 + the longest prefix
    of `drafts[p]` equal to the greedy tokens after p, cut at a stop token or the cap (the length
    recorded is before the cut, as `spec_decode` records it). Raises RuntimeError if the steps do
    not rebuild `output_ids` (the answer and its continuation disagree).
    """
    greedy = list(output_ids) + list(beyond)
    lens: list[int] = []
    n_out = 1
    stopped = output_ids[0] in stops
    while not stopped and n_out < max_new_tokens:
        p = n_out - 1
        d = drafts[p]
        n_acc = greedy_accepted_list(d, greedy[p + 1:])
        if p + n_acc + 2 > len(greedy):
            raise RuntimeError(f"replay needs greedy tokens up to output index {p + n_acc + 1}; have {len(greedy)}")
        new = greedy[p + 1: p + n_acc + 2]
        lens.append(len(new))
        kept, stopped = truncate(new, stops, max_new_tokens - n_out)
        n_out += len(kept)
    if n_out != len(output_ids) or greedy[:n_out] != list(output_ids):
        raise RuntimeError(f"replay walk ended at {n_out} tokens, the answer has {len(output_ids)}")
    return lens


class ReplayEvaluator:
    """The T=0 acceptance of `draft` on whole prompt sets; answers as `ConversationDecoder.run` gives them."""

    def __init__(self, target_model: nn.Module, tokenizer: Any, draft: DFlashDraftModel, settings: EvalSettings,
                 *, num_rows: Optional[int] = None, anchor_tokens: int = ANCHOR_TOKENS,
                 cuda_graph: Optional[bool] = None) -> None:
        from nemo_dflash.draft.build import check_draft_fits_target

        if not settings.sampling.greedy:
            raise ValueError(f"replay measures T=0 only (got {settings.sampling.label}): "
                             "use the sequential decoder for T > 0")
        check_draft_fits_target(draft.config, target_model.config)
        from nemo_dflash.engine.static_cache import check_static_target

        try:
            check_static_target(target_model)
        except ValueError as e:
            reason = str(e).split(":")[0]
            raise ValueError(f"--method replay generates with the decoding engine, and {reason}: "
                             "use --method sequential for this target") from None
        self.model, self.tokenizer, self.draft, self.settings = target_model, tokenizer, draft, settings
        self.target = HFDFlashTargetModel(target_model, draft.target_layer_ids)
        self.block_size = int(settings.block_size or draft.config.block_size)
        if self.block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {self.block_size}")
        self.stops = stop_token_ids(target_model, tokenizer)
        self.num_rows, self.anchor_tokens = num_rows, anchor_tokens
        self.cuda_graph = cuda_graph  # None: the engine's default (graphs on CUDA)
        self.device = next(target_model.parameters()).device

    # ------------------------------------------------------------------ 1. greedy answers

    def _engine(self, n: int, max_prompt_tokens: int, max_new_tokens: int, stop_ids: list[int]):
        from nemo_dflash.engine.plain import PlainEngine, max_rows

        rows = min(n, self.num_rows or MAX_ROWS)
        fit = max_rows(self.model, max_prompt_tokens, max_new_tokens, fraction=KV_SHARE)
        rows = rows if fit is None else max(1, min(rows, fit))
        return PlainEngine(self.model, rows=rows, max_prompt_tokens=max_prompt_tokens, max_new_tokens=max_new_tokens,
                           stop_ids=stop_ids, use_graphs=self.cuda_graph)

    def _prompt_bound(self, prompts: Sequence[EvalPrompt]) -> int:
        """Tokens a turn's prompt can take: the whole conversation's user turns plus every earlier answer
        (re-encoded text: allowed twice its token count) and the template's turn markers."""
        s = self.settings
        bound = 1
        for p in prompts:
            turns = conversation_turns(p, s.turns)
            history = p.history() + ([] if p.messages is not None else
                                     [m for t in range(turns) for m in ({"role": "user", "content": p.turns[t]},
                                                                        {"role": "assistant", "content": ""})])
            n = len(encode_chat(self.tokenizer, history, s.use_chat_template))
            bound = max(bound, n + (turns - 1) * (2 * s.max_new_tokens + 64) + 16)
        return bound

    def greedy_answers(self, prompts: Sequence[EvalPrompt]) -> dict[tuple[int, int], GreedyTurn]:
        """{(prompt index, turn index): greedy answer} for every turn of every prompt, in batch."""
        from nemo_dflash.engine.plain import Request

        s = self.settings
        history = {i: p.history() for i, p in enumerate(prompts)}
        turns = {i: conversation_turns(p, s.turns) for i, p in enumerate(prompts)}

        def request(i: int, t: int, after: Any = None) -> Request:
            if prompts[i].messages is None:
                history[i].append({"role": "user", "content": prompts[i].turns[t]})
            ids = encode_chat(self.tokenizer, history[i], s.use_chat_template)
            return Request(key=i * 1000 + t, prompt_ids=ids, tag=(i, t), hold=t + 1 < turns[i], after=after)

        engine = self._engine(len(prompts), self._prompt_bound(prompts), s.max_new_tokens, self.stops)
        pending = collections.deque(request(i, 0) for i in range(len(prompts)))
        raw: dict[tuple[int, int], tuple[list[int], list[int], bool]] = {}
        for c in engine.generate(pending):
            i, t = c.request.tag
            stopped = c.finish == "stop"
            raw[i, t] = (list(c.request.prompt_ids), list(c.token_ids), stopped)
            if t + 1 < turns[i]:
                # the answer's text as ConversationDecoder appends it (its stop token is dropped anyway)
                history[i].append({"role": "assistant", "content": answer_text(self.tokenizer, c.token_ids,
                                                                               self.stops)})
                pending.append(request(i, t + 1, after=c))
        del engine, pending
        release_device_memory()  # the finished engine's KV cache, before the next allocation
        return self._continue(raw)

    def _continue(self, raw: dict[tuple[int, int], tuple[list[int], list[int], bool]]
                  ) -> dict[tuple[int, int], GreedyTurn]:
        """Each answer (stop token excluded) continued greedily by one block, stop tokens ignored: the
        stop token itself, then the tokens the sequential decoder's last step is compared with."""
        from nemo_dflash.engine.plain import Request

        extra = self.block_size
        keys = sorted(raw)
        longest = max(len(raw[k][0]) + len(raw[k][1]) for k in keys)
        engine = self._engine(len(keys), longest, extra, stop_ids=[-1])  # -1: no token stops
        pending = collections.deque(Request(key=n, prompt_ids=raw[k][0] + raw[k][1], tag=k) for n, k in enumerate(keys))
        out: dict[tuple[int, int], GreedyTurn] = {}
        mismatched = 0
        for c in engine.generate(pending):
            k = c.request.tag
            prompt_ids, body, stopped = raw[k]
            nxt = list(c.token_ids)
            if stopped:
                if nxt[0] not in self.stops:  # a near tie read differently by the two forwards (bf16)
                    mismatched += 1
                    nxt = [self.stops[0]] + nxt
                out[k] = GreedyTurn(prompt_ids, body + nxt[:1], True, nxt[1:])
            else:
                out[k] = GreedyTurn(prompt_ids, body, False, nxt)
        del engine, pending
        release_device_memory()  # the finished engine's KV cache, before the next allocation
        if mismatched:
            logger.warning("%d answers ended at a stop token that a re-run of their prefix did not predict "
                           "(low-precision near ties)", mismatched)
        return out

    # ------------------------------------------------------------------ 2-3. features and drafts

    @torch.no_grad()
    def draft_tokens(self, turn: GreedyTurn) -> list[list[int]]:
        """The draft's greedy B-1 tokens from every anchor p (output index 0 .. len - 2) of one answer."""
        blk, n_anchor = self.block_size, len(turn.output_ids) - 1
        if blk < 2 or n_anchor < 1:
            return [[] for _ in range(max(n_anchor, 0))]
        seq = torch.tensor([turn.prompt_ids + turn.output_ids[:-1]], dtype=torch.long, device=self.device)
        prompt_len = len(turn.prompt_ids)
        feats, _ = self.target.forward_features(seq)  # [1, S, n*H], stops after the last captured layer
        embed, head = self.target.get_input_embeddings(), self.target.get_output_embeddings()
        backend = DRAFT_ATTENTION.get(self.device.type, "sdpa")
        per = max(1, self.anchor_tokens // blk)
        out: list[list[int]] = []
        for start in range(0, n_anchor, per):
            stop = min(start + per, n_anchor)
            end = prompt_len + stop  # keys past the chunk's last anchor are never visible: left out
            anchors = torch.arange(prompt_len + start, end, device=self.device).unsqueeze(0)
            ids = seq[:, :end]
            hidden = draft_block_hidden(self.draft, embed, ids, feats[:, :end], torch.ones_like(ids), anchors,
                                        torch.ones_like(anchors, dtype=torch.bool), blk, int(self.draft.mask_token_id),
                                        backend=backend)
            hidden = hidden.view(anchors.shape[1], blk, -1)[:, 1:]
            logits = self.draft.slot_logits(hidden, head)  # the unary logits, as the decoders form them
            if self.draft.has_selector:  # DFlash2: the walk's argmax path, deterministic given the context
                out.extend(self.draft.propose_block(hidden, logits, ids[0, anchors[0]])[0].tolist())
            else:
                out.extend(logits.argmax(dim=-1).tolist())
        return out

    # ------------------------------------------------------------------ 4. the walk

    def answer(self, prompt: EvalPrompt, t: int, turn: GreedyTurn) -> Answer:
        lens = walk(turn.output_ids, turn.beyond, self.draft_tokens(turn), set(self.stops),
                    self.settings.max_new_tokens)
        body = turn.output_ids[:-1] if turn.stopped else turn.output_ids
        return Answer(id=prompt.id, turn=t + 1, output_ids=list(turn.output_ids), acceptance_lengths=lens,
                      stopped=turn.stopped, loop_start=find_loop_start(body), prompt_ids=list(turn.prompt_ids))

    def run(self, prompts: Sequence[EvalPrompt]) -> Iterator[tuple[int, list[Answer]]]:
        """(prompt index, its answers) per conversation, in prompt order, after one batched generation."""
        was_training = self.draft.training
        self.draft.eval()
        try:
            greedy = self.greedy_answers(prompts)
            for i, p in enumerate(prompts):
                yield i, [self.answer(p, t, greedy[i, t]) for t in range(conversation_turns(p, self.settings.turns))]
        finally:
            self.draft.train(was_training)


__all__ = ["GreedyTurn", "ReplayEvaluator", "walk"]
