"""Typed data configuration (OmegaConf structured-config compatible)."""

from __future__ import annotations

import dataclasses
import math
import os
import typing
from dataclasses import dataclass, field
from typing import Any, Optional

from omegaconf import MISSING, DictConfig, OmegaConf

BATCHING_MODES = ("random", "length_grouped")
MAX_TOKENS = 1 << 20  # data.max_length, data.pack_length, data.pad_to_multiple_of: a million tokens a row


def available_cpus() -> int:
    """The CPUs this process may run on (its affinity, else the machine's): the bound of every worker count."""
    try:
        return len(os.sched_getaffinity(0)) or 1
    except (AttributeError, OSError):
        return os.cpu_count() or 1


# ---- One rule for a run's identity: every field of the recipe's dataclasses says whether it changes what a stage
# writes (WHAT: the pipeline's stage markers compare it, and a change is refused or makes the later stages stale)
# or only how it runs (HOW: threads, workers, logging, job limits; a change never makes a result stale).
IDENTITY = "changes_outputs"  # the field metadata key
WHAT = {IDENTITY: True}
HOW = {IDENTITY: False}


def what(default: Any) -> Any:
    """A field whose value changes a stage's outputs."""
    return field(default=default, metadata=WHAT)


def how(default: Any) -> Any:
    """A field that changes how a stage runs, never what it writes."""
    return field(default=default, metadata=HOW)


def _hints(cls: type) -> dict[str, Any]:
    import sys

    return typing.get_type_hints(cls, vars(sys.modules[cls.__module__]))


def _schema_of(hint: Any) -> tuple[Optional[type], bool]:
    """The dataclass a field's type holds, and whether it is a list of them."""
    args = typing.get_args(hint)
    if typing.get_origin(hint) is list and args and dataclasses.is_dataclass(args[0]):
        return args[0], True
    if typing.get_origin(hint) is typing.Union:
        hint = next((a for a in args if a is not type(None)), hint)
    return (hint, False) if isinstance(hint, type) and dataclasses.is_dataclass(hint) else (None, False)


def changes_outputs(f: dataclasses.Field) -> Optional[bool]:
    """What a field says: True (WHAT), False (HOW), None (not classified: a defect tests/test_config.py finds)."""
    return f.metadata.get(IDENTITY)


def output_settings(schema: type, values: Any) -> Any:
    """``values`` (a dataclass of ``schema``, or its plain dict as a marker or config.yaml holds it) without the
    HOW fields, at every depth: what a stage's identity compares. A key the schema does not know is kept."""
    if dataclasses.is_dataclass(values) and not isinstance(values, type):
        values = dataclasses.asdict(values)
    if not isinstance(values, dict):
        return values
    fields, hints = {f.name: f for f in dataclasses.fields(schema)}, _hints(schema)
    out = {}
    for k, v in values.items():
        f = fields.get(k)
        if f is not None and changes_outputs(f) is False:
            continue
        sub, listed = _schema_of(hints[k]) if f is not None else (None, False)
        if sub is not None and listed and isinstance(v, list):
            v = [output_settings(sub, x) for x in v]
        elif sub is not None:
            v = output_settings(sub, v)
        out[k] = v
    return out


def all_fields(schema: type, prefix: str = "") -> dict[str, dataclasses.Field]:
    """Every field of ``schema`` and of the dataclasses it holds (list items as ``key[]``), by dotted key."""
    out: dict[str, dataclasses.Field] = {}
    hints = _hints(schema)
    for f in dataclasses.fields(schema):
        key = f"{prefix}{f.name}"
        out[key] = f
        sub, listed = _schema_of(hints[f.name])
        if sub is not None:
            out.update(all_fields(sub, f"{key}[]." if listed else f"{key}."))
    return out


@dataclass
class DataSourceConfig:
    """One local conversation file and how much of it goes into the mix."""

    path: str = what(MISSING)  # .jsonl, .json or .parquet (local file)
    weight: float = what(1.0)  # mixing weight: 2.0 = every sample twice, 0.5 = a seeded half
    max_samples: Optional[int] = what(None)  # read at most this many valid conversations

    def __post_init__(self) -> None:
        # `${run.dir}/../a/data/regen.jsonl` (an arm training on another arm's answers) passes through a run directory
        # that does not exist before the run: the OS follows `..` only through existing folders, so normalise lexically
        if isinstance(self.path, str) and self.path:
            self.path = os.path.normpath(self.path)


@dataclass
class DataConfig:
    sources: list[DataSourceConfig] = field(default_factory=list, metadata=WHAT)
    max_length: int = what(3072)  # truncate tokenised conversations to this many tokens
    max_bad_lines: int = how(100)  # more malformed records than this across the run -> error
    holdout_fraction: float = what(0.0)  # seeded split of held-out conversations for evaluation
    batching: str = what("length_grouped")  # "random" or "length_grouped" (groups similar lengths to cut padding)
    pad_to_multiple_of: int = what(64)
    num_workers: int = how(0)
    tokenize_workers: Optional[int] = how(None)  # processes that tokenise the data; null: the CPUs, shared by the host's ranks
    seed: int = what(0)
    # drop training conversations sharing a 13-gram with the MT-Bench / HumanEval prompts evaluate uses
    decontaminate: bool = what(True)
    # > 0: pack whole conversations into rows of this many tokens (fixed shapes; each conversation
    # still attends only to itself); train.micro_batch_size then counts packed rows. 0 = padded rows.
    pack_length: int = what(0)


def as_data_config(config: Any) -> DataConfig:
    """Accept a DataConfig, an OmegaConf node or a plain dict and return a validated DataConfig.

    Going through ``OmegaConf.structured`` gives type checking for free (e.g. a string weight
    fails here with the offending key named, not deep inside the pipeline).
    """
    if isinstance(config, DataConfig):
        cfg = config
    else:
        if isinstance(config, DictConfig):
            config = OmegaConf.to_container(config, resolve=True)
        if not isinstance(config, dict):
            raise TypeError(f"expected a DataConfig, DictConfig or dict, got {type(config).__name__}")
        from omegaconf.errors import MissingMandatoryValue, ValidationError

        from nemo_dflash.data.sources import DataError

        try:
            merged = OmegaConf.merge(OmegaConf.structured(DataConfig), config)
            cfg = OmegaConf.to_object(merged)  # type: ignore[assignment]
        except MissingMandatoryValue as e:
            raise DataError(f"data.{e.full_key} is not set") from None
        except ValidationError as e:
            raise DataError(f"invalid data config at '{e.full_key}': {str(e.msg).splitlines()[0]}") from None
    validate_data_config(cfg)
    return cfg


def validate_data_config(cfg: DataConfig) -> None:
    """Fail early with a message naming the key to fix."""
    # Imported here: sources imports nothing from config, keep the module graph one-way.
    from nemo_dflash.data.sources import MAX_SOURCE_WEIGHT, DataError

    if not cfg.sources:
        raise DataError(
            "data.sources is empty: add at least one source, e.g. "
            "data.sources=[{path: /path/to/chats.jsonl}] (see docs/data.md); "
            "nemo_dflash.loading.package_file(*nemo_dflash.data.SHAREGPT_FILE) gives the bundled ShareGPT file"
        )
    for i, src in enumerate(cfg.sources):
        if not isinstance(src.path, str) or not src.path or src.path == MISSING:
            raise DataError(f"data.sources[{i}].path is not set")
        if not src.weight > 0:
            raise DataError(
                f"data.sources[{i}].weight must be > 0 (got {src.weight}); remove the source to disable it"
            )
        if not (math.isfinite(src.weight) and src.weight <= MAX_SOURCE_WEIGHT):
            raise DataError(f"data.sources[{i}].weight must be at most {MAX_SOURCE_WEIGHT:g} (got {src.weight}): "
                            "each unit repeats the whole file once")
        if src.max_samples is not None and src.max_samples <= 0:
            raise DataError(f"data.sources[{i}].max_samples must be positive or null (got {src.max_samples})")
    if not 0 < cfg.max_length <= MAX_TOKENS:
        raise DataError(f"data.max_length must be in [1, {MAX_TOKENS}] (got {cfg.max_length})")
    if cfg.max_bad_lines < 0:
        raise DataError(f"data.max_bad_lines must be >= 0 (got {cfg.max_bad_lines})")
    if not 0.0 <= cfg.holdout_fraction < 1.0:
        raise DataError(f"data.holdout_fraction must be in [0, 1) (got {cfg.holdout_fraction})")
    if cfg.batching not in BATCHING_MODES:
        raise DataError(f"data.batching must be one of {BATCHING_MODES} (got {cfg.batching!r})")
    if not 0 < cfg.pad_to_multiple_of <= MAX_TOKENS:
        raise DataError(f"data.pad_to_multiple_of must be in [1, {MAX_TOKENS}] (got {cfg.pad_to_multiple_of})")
    if not 0 <= cfg.pack_length <= MAX_TOKENS:
        raise DataError(f"data.pack_length must be in [0, {MAX_TOKENS}] (got {cfg.pack_length}); 0 turns packing off")
    if cfg.pack_length and cfg.max_length > cfg.pack_length:
        raise DataError(
            f"data.max_length ({cfg.max_length}) exceeds data.pack_length ({cfg.pack_length}): a conversation must fit "
            "one packed row; raise data.pack_length or lower data.max_length"
        )
    cpus = available_cpus()
    if not 0 <= cfg.num_workers <= cpus:
        raise DataError(f"data.num_workers must be in [0, {cpus}] (this machine's CPUs; got {cfg.num_workers})")
    if cfg.tokenize_workers is not None and not 1 <= cfg.tokenize_workers <= cpus:
        raise DataError(f"data.tokenize_workers must be in [1, {cpus}] (this machine's CPUs), or null for them "
                        f"(got {cfg.tokenize_workers})")
