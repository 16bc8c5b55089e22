"""Deterministic export bytes: two exports of one draft are byte-identical (safetensors writes its header's maps in
hash order, `export.canonical_header` sorts them), and the sorted header reads back as the same file."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from nemo_dflash.serving.export import EXPORT_MARK, canonical_header


def header(path: Path) -> bytes:
    data = path.read_bytes()
    return data[8:8 + int.from_bytes(data[:8], "little")]


def test_a_canonical_header_is_sorted_and_reads_back_the_same(tmp_path):
    tensors = {f"layers.{i}.w": torch.arange(6, dtype=torch.float32).reshape(2, 3) * i for i in range(5)}
    meta = {"written_by": "x", "format": "pt", "a": "1", "z": "2", "m": "3"}
    p = tmp_path / "m.safetensors"
    save_file(tensors, str(p), metadata=meta)
    before = p.read_bytes()
    canonical_header(p)
    after = p.read_bytes()
    assert len(after) == len(before) and after[8 + len(header(p)):] == before[8 + len(header(p)):]  # data untouched
    text = header(p).rstrip(b" ")
    parsed = json.loads(text)
    assert text == json.dumps(parsed, sort_keys=True, separators=(",", ":")).encode()  # sorted, compact
    assert list(parsed["__metadata__"]) == sorted(meta)
    with safe_open(str(p), framework="pt") as f:
        assert f.metadata() == meta
    got = load_file(str(p))
    assert got.keys() == tensors.keys() and all(got[k].equal(tensors[k]) for k in tensors)


def test_two_exports_of_one_draft_are_byte_identical(tmp_path):
    """Saved six times (the hash order changes from one map to the next): one set of bytes."""
    tensors = {f"t{i}": torch.full((3,), float(i), dtype=torch.bfloat16) for i in range(4)}
    meta = {"format": "pt", EXPORT_MARK[0]: EXPORT_MARK[1], "b": "1", "c": "2", "d": "3"}
    outs = []
    for i in range(6):
        p = tmp_path / f"{i}.safetensors"
        save_file(tensors, str(p), metadata=dict(meta))
        canonical_header(p)
        outs.append(p.read_bytes())
    assert len(set(outs)) == 1
