"""The tiny random target made to end its Magpie turns (a random model never writes its end-of-turn token),
for the Magpie tests; run as torchrun's script it is `python -m nemo_dflash.recipes.prompts ARGS` with the
engine so forced on every rank (the target's tokenizer read from --target)."""

from __future__ import annotations

import sys
from typing import Any, Optional


def forced_engine(monkeypatch: Any, tok: Any, *, degenerate_marker: Optional[str] = None) -> list[str]:
    """Make the tiny random target end its turns: a quarter of the requests at once (empty), one in
    seven writes <|im_start|> (a template marker) at its third token, the rest after 6-10 tokens;
    requests whose prompt holds ``degenerate_marker`` always end at once. Returns the prompts seen."""
    from nemo_dflash.data.generation import SlotEngine

    eot, im_start = tok.convert_tokens_to_ids("<|im_end|>"), tok.convert_tokens_to_ids("<|im_start|>")
    real_pick, real_prefill = SlotEngine._pick, SlotEngine._prefill_logits
    seen: list[str] = []
    dead: set[int] = set()

    def pick(self, logits, keys, positions):
        out, _ = real_pick(self, logits, keys, positions)
        for row, (key, pos) in enumerate(zip(keys.tolist(), positions.tolist())):
            if key in dead or key % 4 == 0 or pos >= 6 + key % 5:
                out[row] = eot
            elif key % 7 == 1 and pos == 2:
                out[row] = im_start
        return out, None

    def prefill(self, slots, requests, starts=None):
        for r in requests:
            text = tok.decode(r.prompt_ids)
            seen.append(text)
            if degenerate_marker is not None and degenerate_marker in text:
                dead.add(r.key)
        return real_prefill(self, slots, requests, starts)

    monkeypatch.setattr(SlotEngine, "_pick", pick)
    monkeypatch.setattr(SlotEngine, "_prefill_logits", prefill)
    return seen


if __name__ == "__main__":
    import os

    import pytest
    from transformers import AutoTokenizer

    from nemo_dflash.recipes import prompts

    argv = sys.argv[1:]
    if "MAGPIE_PIPELINE" in os.environ:  # the pipeline command, its target's tokenizer named by the variable
        from nemo_dflash.recipes import pipeline

        forced_engine(pytest.MonkeyPatch(), AutoTokenizer.from_pretrained(os.environ["MAGPIE_PIPELINE"]))
        pipeline.main(argv)
        sys.exit(0)
    forced_engine(pytest.MonkeyPatch(), AutoTokenizer.from_pretrained(argv[argv.index("--target") + 1]))
    summary = prompts.main(argv)
    if summary.get("topic_report") is not None:  # rank 0: what the test compares with one process
        import json

        with open(os.environ["MAGPIE_SUMMARY"], "w", encoding="utf-8") as f:
            json.dump(summary, f)
