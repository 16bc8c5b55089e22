"""nemo_dflash.engine.compiled: one torch.compile wrapper per (function, options), shared by every caller."""

import torch

from nemo_dflash.engine.compiled import compiled


def _double(x: torch.Tensor) -> torch.Tensor:
    return x * 2


def _square(x: torch.Tensor) -> torch.Tensor:
    return x * x


def test_one_wrapper_per_function_and_options():
    a = compiled(_double, backend="eager")
    assert compiled(_double, backend="eager") is a  # the second caller gets the first one's wrapper
    assert compiled(_double, backend="eager", dynamic=False) is not a  # other options: another wrapper
    assert compiled(_square, backend="eager") is not a
    x = torch.arange(5.0)
    assert torch.equal(a(x), x * 2) and torch.equal(compiled(_square, backend="eager")(x), x * x)


def test_the_package_keeps_no_compile_cache_of_its_own():
    """Every module compiles plain functions through `compiled` (module-level torch.compile caches were
    four; a bound method or a model's layers compiled for one object stay with it)."""
    import re
    from pathlib import Path

    root = Path(__file__).resolve().parent.parent / "nemo_dflash"
    offenders = []
    for path in sorted(root.rglob("*.py")):
        if path.name == "compiled.py":
            continue
        for n, line in enumerate(path.read_text().splitlines(), 1):
            call = re.search(r"torch\.compile\((\w[\w.]*)", line)
            if call and not call.group(1).startswith(("self.", "layer.")):
                offenders.append(f"{path.relative_to(root)}:{n}: {line.strip()}")
    assert not offenders, offenders
