"""The GGUF conversion cache under several processes (torchrun ranks convert at the same time)."""

from __future__ import annotations

from pathlib import Path

import pytest
from _torchrun import scaled

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
    monkeypatch.setattr(loading, "_save_dense", lambda model, out: model.save_pretrained(out))


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
    assert [p.name for p in (tmp_path / "cache").iterdir() if not p.name.endswith(".lock")] == [out.name]  # no temp dir


def _counting_conversion(monkeypatch, log: Path, pause: float = 0.0):
    """A fake conversion that records each run in `log` (one line a run, any process) and takes `pause` s."""
    import time

    def save():
        with open(log, "a") as f:
            f.write("converted\n")
        time.sleep(pause)

    _fake_conversion(monkeypatch, on_save=save)


def _convert_in_child(gguf, cache, queue):
    queue.put(str(loading.convert_gguf(gguf, cache_dir=cache)))


def test_two_processes_converting_at_once_convert_once_and_both_read_a_complete_cache(tmp_path, monkeypatch):
    """Two ranks of a fresh machine start together: one converts while the other waits on the lock, then
    reuses the finished cache (before, both converted and one could delete the other's copy mid-read)."""
    import multiprocessing as mp

    log, cache, gguf = tmp_path / "runs.log", tmp_path / "cache", _gguf(tmp_path)
    _counting_conversion(monkeypatch, log, pause=0.5)
    ctx = mp.get_context("fork")  # the children keep this test's stand-in conversion
    queue = ctx.Queue()
    procs = [ctx.Process(target=_convert_in_child, args=(gguf, cache, queue)) for _ in range(2)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(scaled(30))
        if p.exitcode is None:
            p.kill()
            pytest.fail(f"a conversion had not finished after {scaled(30):.0f} s", pytrace=False)
        assert p.exitcode == 0
    outs = {queue.get(timeout=scaled(5)), queue.get(timeout=scaled(5))}
    assert len(outs) == 1 and log.read_text().count("converted") == 1
    out = Path(outs.pop())
    assert loading.cache_complete(out) and (out / "config.json").read_text() == "config.json"


@pytest.mark.parametrize("damage", ["truncated", "missing", "old_marker"])
def test_a_damaged_cache_is_rebuilt_not_trusted(tmp_path, monkeypatch, damage):
    log, cache, gguf = tmp_path / "runs.log", tmp_path / "cache", _gguf(tmp_path)
    _counting_conversion(monkeypatch, log)
    out = loading.convert_gguf(gguf, cache_dir=cache)
    if damage == "truncated":
        (out / "config.json").write_text("conf")  # shorter than the marker says
    elif damage == "missing":
        (out / "tok.txt").unlink()
    else:  # a marker written before it listed the files
        (out / ".complete").write_text("ok\n")
    assert not loading.cache_complete(out)
    assert loading.convert_gguf(gguf, cache_dir=cache) == out
    assert log.read_text().count("converted") == 2 and loading.cache_complete(out)
    assert (out / "tok.txt").read_text() == "tok.txt"


def test_a_damaged_cache_is_replaced_whole_and_its_reason_logged(tmp_path, monkeypatch, caplog):
    """The rebuild happens beside the damaged cache: while it converts, the old directory (and a file a
    reader opened from it) is still there; afterwards the path holds the new conversion, nothing stale is left,
    and the warning names the file that was wrong."""
    cache, gguf = tmp_path / "cache", _gguf(tmp_path)
    _fake_conversion(monkeypatch)
    out = loading.convert_gguf(gguf, cache_dir=cache)
    (out / "config.json").write_text("conf")  # truncated: the marker says 11 bytes
    assert loading.cache_problem(out) == "config.json has 4 bytes, the marker says 11"
    reader = open(out / "tok.txt")  # a process that resolved the cache earlier and is reading it
    seen = []
    _fake_conversion(monkeypatch, on_save=lambda: seen.append((out / "tok.txt").exists()))
    with caplog.at_level("WARNING"):
        assert loading.convert_gguf(gguf, cache_dir=cache) == out
    assert seen == [True]  # the old cache stayed in place during the conversion
    assert reader.read() == "tok.txt"
    reader.close()
    assert loading.cache_complete(out) and (out / "config.json").read_text() == "config.json"
    assert sorted(p.name for p in cache.iterdir()) == [f".{out.name}.lock", out.name]
    assert "config.json has 4 bytes" in caplog.text


def test_a_rank_other_than_0_writes_the_whole_conversion(tmp_path, monkeypatch):
    """Whichever torchrun rank takes the lock converts. transformers' save_pretrained writes nothing on a
    torch.distributed rank other than 0, which left a cache without config.json or weights on a fresh two-GPU
    machine: the conversion's own save writes every file on any rank, the tied lm_head once, and the
    directory loads back with the same weights."""
    import torch
    import transformers

    cfg = transformers.LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                                   num_attention_heads=2, num_key_value_heads=1, tie_word_embeddings=True)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(cfg).eval()
    monkeypatch.setattr(torch.distributed, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.distributed, "get_rank", lambda *a, **k: 1)
    out = tmp_path / "conv"
    out.mkdir()
    loading._save_dense(model, out)
    monkeypatch.undo()
    from safetensors.torch import load_file

    saved = load_file(str(out / "model.safetensors"))
    assert (out / "config.json").is_file() and "lm_head.weight" not in saved  # the tied copy is written once
    assert set(saved) == set(model.state_dict()) - {"lm_head.weight"}
    import json

    assert json.loads((out / "config.json").read_text())["architectures"] == ["LlamaForCausalLM"]  # the registry key
    back = transformers.AutoModelForCausalLM.from_pretrained(str(out)).eval()
    want = model.state_dict()
    for name, t in back.state_dict().items():
        assert torch.equal(t, want[name]), name
    ids = torch.tensor([[1, 5, 9, 3]])
    assert torch.equal(back(ids).logits, model(ids).logits)


def test_a_config_without_architectures_names_its_causal_lm_class():
    """A target config saved without `architectures` still finds its draft family (by its model type)."""
    import transformers

    from nemo_dflash.draft.build import _architectures

    cfg = transformers.LlamaConfig()
    cfg.architectures = None
    assert _architectures(cfg, "LlamaConfig") == ["LlamaForCausalLM"]
    cfg.architectures = ["MistralForCausalLM"]
    assert _architectures(cfg, "LlamaConfig") == ["MistralForCausalLM"]
