"""The GGUF conversion cache under several processes (torchrun ranks convert at the same time)."""

from __future__ import annotations

from pathlib import Path

import pytest

from nemo_dflash.target import loading


class _Saved:
    """Stands in for the dequantised model and tokenizer: writes one file per save."""

    def __init__(self, name: str, on_save=None):
        self.name, self.on_save = name, on_save

    def save_pretrained(self, path, **_):
        Path(path, self.name).write_text(self.name)
        if self.on_save is not None:
            self.on_save()


def _fake_conversion(monkeypatch, on_save=None):
    import transformers
    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained", staticmethod(lambda *a, **k: _Saved("tok.txt")))
    monkeypatch.setattr(loading, "_load_gguf_dense", lambda path, dtype: _Saved("config.json", on_save))


def _gguf(tmp_path: Path) -> Path:
    f = tmp_path / "model.gguf"
    f.write_bytes(b"GGUF")
    return f


def test_conversion_writes_a_complete_cache_and_reuses_it(tmp_path, monkeypatch):
    _fake_conversion(monkeypatch)
    out = loading.convert_gguf(_gguf(tmp_path), cache_dir=tmp_path / "cache")
    assert (out / ".complete").exists() and (out / "config.json").exists()
    monkeypatch.setattr(loading, "_load_gguf_dense", lambda *a: pytest.fail("converted twice"))
    assert loading.convert_gguf(_gguf(tmp_path), cache_dir=tmp_path / "cache") == out
    assert [p.name for p in (tmp_path / "cache").iterdir()] == [out.name]  # no temp dir left


def test_a_rank_that_finishes_second_keeps_the_first_ranks_copy(tmp_path, monkeypatch):
    """Another process completes the same cache while this one converts: its copy (which it may be
    reading) must stay in place, and this process's temp copy goes."""
    cache, gguf = tmp_path / "cache", _gguf(tmp_path)
    first: dict[str, Path] = {}

    def other_rank_finishes():
        if not first:  # the other rank's whole conversion, run while ours is saving
            _fake_conversion(monkeypatch)
            first["out"] = loading.convert_gguf(gguf, cache_dir=cache)
            (first["out"] / "in_use").write_text("being read")

    _fake_conversion(monkeypatch, on_save=other_rank_finishes)
    out = loading.convert_gguf(gguf, cache_dir=cache)
    assert out == first["out"]
    assert (out / "in_use").read_text() == "being read"  # not deleted nor replaced under the other rank
    assert [p.name for p in cache.iterdir()] == [out.name]
