"""The convention every command (`train`, `evaluate`, `export`, `regenerate`, `demo`) follows.

- `setup_logging`: one format, and only rank 0 logs below WARNING under torchrun.
- A mistake the user can fix (a flag, a path, a recipe key, a draft for another target) is one
  line on stderr, `error: ...`, and exit status 2, never a traceback: `fail`, or `user_errors`
  around the code that may raise one. Anything else is a bug and keeps its traceback.
- `--device` / `--dtype` mean the same everywhere: `add_device_args` declares them and
  `resolve_device_dtype` decides "auto" (GPU if visible; bf16 on a GPU, fp32 on a CPU).
- `--threads N` (`set_threads`) for the CPU commands.
- A command's flags are its recipe section's keys (`--max-new-tokens` is `regenerate.max_new_tokens`) and
  take their defaults from that section's dataclass (`section_defaults`): a flag and a recipe key cannot
  mean two things. `section_argv` turns a section back into the command line (the pipeline's stages).
- Every stand-alone command takes `--config RECIPE [KEY=VALUE ...]` (`add_recipe_args`, `parse_with_recipe`):
  the recipe's section becomes the flags the pipeline would pass, and a flag given on the command line wins.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from contextlib import contextmanager
from dataclasses import fields
from typing import Any, Callable, Iterator, NoReturn, Optional, Sequence

DEVICES = ("auto", "cpu", "cuda")
DTYPES = ("auto", "bf16", "fp16", "fp32")


class UsageError(ValueError):
    """A mistake in a command's flags or inputs: reported in one line with exit status 2."""


def setup_logging(level: str | None = None) -> None:
    rank = int(os.environ.get("RANK", "0"))
    level = level or os.environ.get("NEMO_DFLASH_LOG", "INFO")
    logging.basicConfig(
        level=getattr(logging, level.upper(), logging.INFO) if rank == 0 else logging.WARNING,
        format=f"%(asctime)s [rank{rank}] %(levelname)s %(name)s: %(message)s",
        datefmt="%H:%M:%S",
    )
    for noisy in ("httpx", "urllib3", "filelock"):
        logging.getLogger(noisy).setLevel(logging.WARNING)


def one_line(msg: object) -> str:
    """A (possibly multi-line) message folded onto one line; the exception's name if it is empty."""
    text = " ".join(part.strip() for part in str(msg).splitlines() if part.strip())
    return text or type(msg).__name__


def fail(msg: object, code: int = 2) -> NoReturn:
    sys.stderr.write(f"error: {one_line(msg)}\n")
    raise SystemExit(code)


@contextmanager
def user_errors(*types: type[BaseException]) -> Iterator[None]:
    """Turn the listed exceptions (default: `UsageError`) into `fail`: one line, exit 2."""
    try:
        yield
    except types or (UsageError,) as e:
        fail(e)


def count_or_auto(text: str) -> "int | str":
    """argparse type of a --batch-size that takes `auto` (fitted once the model is loaded)."""
    if text == "auto":
        return text
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"give a number or auto, got {text!r}") from None


def add_batch_size_arg(p: argparse.ArgumentParser, in_flight: str, cpu: str = "on a CPU") -> None:
    """`--batch-size N | auto` of a command whose rows `engine.plain.auto_rows` fits to the GPU: what auto means is
    said once, in the same words for each (its numbers are that module's AUTO_ROWS_CAP and CPU_AUTO_ROWS, held
    to them by tests/test_cli.py; importing it here would load torch for `--help`)."""
    p.add_argument("--batch-size", type=count_or_auto,
                   help=f"{in_flight}; auto: as many as the GPU's free memory holds, at most 2,048 ({cpu}: 8)")


def add_jsonl_out_arg(p: argparse.ArgumentParser) -> None:
    """`--out FILE.jsonl` of a command that writes records for `regenerate --data` or training (regenerate,
    prompts): one name and help for the file the next stage reads."""
    p.add_argument("--out", required=True, help="output FILE.jsonl")


def add_device_args(p: argparse.ArgumentParser, device: str = "auto", dtype: str = "auto") -> None:
    p.add_argument("--device", default=device, choices=DEVICES, help=f"default {device}: cuda if visible, else cpu")
    p.add_argument("--dtype", default=dtype, choices=DTYPES, help=f"default {dtype}: bf16 on cuda, fp32 on cpu")


def resolve_device_dtype(device: Optional[str] = "auto", dtype: Optional[str] = "auto") -> tuple[str, str]:
    """The one decision of `--device` and `--dtype` ("auto" or None: decided here); `UsageError`
    when a GPU is asked for and none is visible. Plain strings, so a spawned worker can take them."""
    import torch

    device = device or "auto"
    if device not in DEVICES:
        raise UsageError(f"--device {device!r} is unknown: use one of {', '.join(DEVICES)}")
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    elif device == "cuda" and not torch.cuda.is_available():
        raise UsageError("--device cuda but torch sees no GPU: pass --device cpu (or auto)")
    dtype = dtype or "auto"
    if dtype not in DTYPES:
        raise UsageError(f"--dtype {dtype!r} is unknown: use one of {', '.join(DTYPES)}")
    if dtype == "auto":
        dtype = "bf16" if device == "cuda" else "fp32"
    return device, dtype


def _actions(parser: argparse.ArgumentParser) -> dict[str, argparse.Action]:
    return {a.dest: a for a in parser._actions if a.option_strings and a.dest != "help"}


def section_defaults(parser: argparse.ArgumentParser, section: type, pipeline_only: Sequence[str] = ()) -> None:
    """Set ``parser``'s defaults from the recipe section dataclass ``section``: each field (but the
    ``pipeline_only`` ones) is the dest of the flag of the same name, and the field is the one source of its
    default (a flag declares none, or the same one). A field without a flag is a bug."""
    values = {f.name: getattr(section(), f.name) for f in fields(section) if f.name not in pipeline_only}
    actions = _actions(parser)
    missing = sorted(set(values) - set(actions))
    drifted = sorted(k for k, v in values.items() if k in actions and not actions[k].required
                     and actions[k].default is not None and actions[k].default != v)
    if missing or drifted:  # a programming error, caught by any test that builds the parser
        raise AssertionError(f"{section.__name__} in {parser.prog}: fields without a flag {missing}, flags whose "
                             f"written default differs from the field's {drifted}")
    parser.set_defaults(**values)


def section_argv(parser: argparse.ArgumentParser, section: Any, pipeline_only: Sequence[str] = ()) -> list[str]:
    """The command line meaning ``section`` (a section dataclass instance) to ``parser``: each field
    given as its flag; a null field (the flag's default) and a false switch are left out."""
    actions = _actions(parser)
    argv: list[str] = []
    for f in fields(section):
        value = getattr(section, f.name)
        if f.name in pipeline_only or value is None:
            continue
        action = actions[f.name]
        flag = next(o for o in action.option_strings if o.startswith("--"))
        if isinstance(action, argparse._StoreTrueAction):
            argv += [flag] if value else []
        elif isinstance(action, argparse._AppendAction):
            for item in value:
                argv += [flag, str(item)]
        else:
            argv += [flag, str(value)]
    return argv


class _DeprecatedFlag(argparse.Action):
    """An old flag's name: sets the new flag's value and logs one warning naming the new one."""

    def __init__(self, *args: Any, new: str = "", **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.new = new

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace, values: Any,
                 option_string: Optional[str] = None) -> None:
        logging.getLogger("nemo_dflash").warning("%s is deprecated: pass %s", option_string, self.new)
        setattr(namespace, self.dest, values)


def add_deprecated_flag(parser: argparse.ArgumentParser, old: str, new: str, dest: str, **kwargs: Any) -> None:
    """Accept ``old`` as ``new`` (same ``dest``, type and choices), hidden from --help. Declare it before
    ``new``, so `section_defaults` and `section_argv` find the flag of ``dest`` under its new name."""
    parser.add_argument(old, dest=dest, action=_DeprecatedFlag, new=new, help=argparse.SUPPRESS, **kwargs)


def add_recipe_args(parser: argparse.ArgumentParser, section: str,
                    pick: Optional[Callable[[Any, argparse.Namespace, Sequence[str]], tuple[Any, bool]]] = None,
                    example: Optional[str] = None) -> None:
    """``--config RECIPE`` and ``KEY=VALUE`` overrides: the recipe's ``section`` (and ``target.path``) give the
    flags' values, the way the pipeline passes them (`section_argv`); a flag given on the command line wins.
    ``pick(cfg, args, argv)``: for a section that is a list (``prompts.jobs``), the item these flags mean and
    whether ``target.path`` gives ``--target`` for it."""
    parser.add_argument("--config", metavar="RECIPE", default=None,
                        help=f"a recipe YAML (the working directory, then the shipped recipes/): its `{section}` "
                             "section and target.path give this command's flags; a flag given here overrides it")
    parser.add_argument("overrides", nargs="*", default=[], metavar="KEY=VALUE",
                        help=f"with --config, after the flags: recipe keys overridden in Hydra's grammar, e.g. "
                             f"{example or section + '.seed=1'}")
    parser.recipe_section = section  # type: ignore[attr-defined]  # read by parse_with_recipe
    parser.recipe_pick = pick  # type: ignore[attr-defined]


def _given(argv: Sequence[str], action: argparse.Action) -> bool:
    """Whether ``argv`` gives ``action``'s flag (``--flag VALUE`` or ``--flag=VALUE``)."""
    return any(a == o or a.startswith(o + "=") for a in argv for o in action.option_strings)


def parse_with_recipe(parser: argparse.ArgumentParser, argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    """Parse ``argv``; with ``--config RECIPE`` the recipe's section comes first as flags (`section_argv`), so a
    recipe value is typed and checked as the flag's, and a flag given in ``argv`` replaces it (a repeatable
    flag given replaces the recipe's list). Required flags may come from the recipe (``--target``)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    required = [a for a in parser._actions if a.required and a.option_strings]
    for a in required:
        a.required = False
    try:
        args = parser.parse_args(argv)
        if args.config is None and args.overrides:
            fail(f"{args.overrides[0]}: KEY=VALUE overrides change a recipe: give --config RECIPE, or pass the flag")
        if args.config is not None:
            from nemo_dflash.config import ConfigError, load_recipe

            with user_errors(ConfigError):
                cfg = load_recipe(args.config, args.overrides, data_optional=True)
            actions = _actions(parser)
            pick = getattr(parser, "recipe_pick", None)
            section, with_target = (pick(cfg, args, argv) if pick is not None
                                    else (getattr(cfg, parser.recipe_section), True))  # type: ignore[attr-defined]
            recipe = section_argv(parser, section, pipeline_only=[
                f.name for f in fields(section)
                if f.name not in actions or (isinstance(actions[f.name], argparse._AppendAction)
                                             and _given(argv, actions[f.name]))])
            if with_target and "target" in actions and not _given(argv, actions["target"]):
                recipe = ["--target", cfg.target.path, *recipe]
            args = parser.parse_args(recipe + argv)
    finally:
        for a in required:
            a.required = True
    missing = [a.option_strings[0] for a in required if getattr(args, a.dest) in (None, [])]
    if missing:
        parser.error("the following arguments are required: " + ", ".join(missing)
                     + (" (the recipe does not set them)" if args.config is not None else ""))
    return args


def set_threads(threads: int | None) -> None:
    """``--threads N``: torch's default (every core) can run many times slower on a machine whose cores are
    shared with another process (docs/performance.md). Recorded as ``OMP_NUM_THREADS`` too, so GPU training
    (`device.limit_host_threads`) and the processes this one starts keep the choice."""
    if threads is None:
        return
    from nemo_dflash.data.config import available_cpus

    cpus = available_cpus()
    if not 1 <= threads <= cpus:  # each thread a stack: 100,000 of them exhaust the machine
        fail(f"--threads must be 1 to {cpus} (this machine's CPUs; got {threads})")
    import torch

    os.environ["OMP_NUM_THREADS"] = str(threads)
    torch.set_num_threads(threads)


def dist_env() -> tuple[int, int, int]:
    """(rank, world size, local rank) from torchrun's environment; (0, 1, 0) without it."""
    try:
        rank, world = int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))
        local = int(os.environ.get("LOCAL_RANK", str(rank)))
    except ValueError:
        fail("RANK, WORLD_SIZE and LOCAL_RANK must be integers; launch several ranks with torchrun")
    if world < 1 or not 0 <= rank < world:
        fail(f"RANK {rank} is not in [0, WORLD_SIZE {world}); launch several ranks with torchrun")
    return rank, world, local


__all__ = ["DEVICES", "DTYPES", "UsageError", "add_batch_size_arg", "add_deprecated_flag", "add_device_args",
           "add_jsonl_out_arg", "add_recipe_args", "dist_env", "fail", "one_line", "parse_with_recipe",
           "resolve_device_dtype", "section_argv", "section_defaults", "set_threads", "setup_logging", "user_errors"]
