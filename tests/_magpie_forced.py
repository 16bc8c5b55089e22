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
    from _spec_fixtures import force_answers, watch_prefills

    eot, im_start = tok.convert_tokens_to_ids("<|im_end|>"), tok.convert_tokens_to_ids("<|im_start|>")
    seen: list[str] = []
    dead: set[int] = set()

    def rule(req, pos, t):
        key = req.key
        if key in dead or key % 4 == 0 or pos >= 6 + key % 5:
            return eot
        if key % 7 == 1 and pos == 2:
            return im_start
        return t

    def prefill(req):
        text = tok.decode(req.prompt_ids)
        seen.append(text)
        if degenerate_marker is not None and degenerate_marker in text:
            dead.add(req.key)

    force_answers(monkeypatch, rule)
    watch_prefills(monkeypatch, prefill)
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
