"""The loop detector on hand-labelled real text (tests/data/loops_code): degenerate answers of SmolLM2 are cut after
one copy of what they repeat; legitimate code near the thresholds (CPython's own) is not cut."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from _data_fixtures import smollm2_tokenizer

from nemo_dflash.data.loops import LoopDetector

RECORDS = [json.loads(line) for line in
           (Path(__file__).parent / "data" / "loops_code" / "labelled.jsonl").read_text(encoding="utf-8").splitlines()]


@pytest.fixture(scope="module")
def tok():
    return smollm2_tokenizer()


LOOPS = [r for r in RECORDS if r["label"] == "loop"]
CODE = [r for r in RECORDS if r["label"] == "code"]


@pytest.mark.parametrize("record", LOOPS, ids=[f"loop{i}" for i in range(len(LOOPS))])
def test_a_real_loop_is_cut_after_one_copy(tok, record):
    ids = tok.encode(record["text"], add_special_tokens=False)
    start = LoopDetector().find(ids)
    assert start is not None and start > 0
    kept = tok.decode(ids[:start])
    assert record["text"].count(record["unit"]) >= 3 and kept.count(record["unit"]) <= 1
    assert record["text"].startswith(kept)


@pytest.mark.parametrize("record", CODE, ids=[f"code{i}" for i in range(len(CODE))])
def test_legitimate_code_near_the_thresholds_is_not_cut(tok, record):
    assert len(CODE) == 8 and len(LOOPS) == 8
    ids = tok.encode(record["text"], add_special_tokens=False)
    assert LoopDetector().find(ids) is None
    # the looser thresholds do cut it: these windows are what a loosened detector would wrongly cut first
    assert LoopDetector(min_ratio=0.7, min_copies=1.8).find(ids) is not None
