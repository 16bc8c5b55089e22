"""Typed recipe configuration: one YAML is the single source of truth of a run.

`load_recipe("qwen3_8b.yaml", ["optim.lr=1e-4"])` composes, in order: the dataclass defaults, the
recipe's defaults list (config groups under `configs/`, e.g. `draft: paper_block16`, `cluster: fsdp2`),
the recipe body and the command-line overrides. Composition is Hydra's Compose API (defaults list,
config groups, override grammar: `key=value`, `+key=value`, `++key=value`, `~key`, `group=option`),
without `@hydra.main`: the caller (torchrun) keeps the process, its working directory and its
logging. OmegaConf's structured config (`RecipeConfig`) then types and validates the result. The
recipe is looked up in the working directory, then in the shipped `recipes/`. An unknown key is an
error that names the closest valid key.
"""

from __future__ import annotations

import difflib
import math
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional, Sequence

from omegaconf import MISSING, DictConfig, ListConfig, OmegaConf
from omegaconf.errors import (
    ConfigAttributeError,
    ConfigIndexError,
    ConfigKeyError,
    GrammarParseError,
    InterpolationResolutionError,
    MissingMandatoryValue,
    ValidationError,
)

from nemo_dflash.data.config import HOW, WHAT, DataConfig, how, output_settings, what  # noqa: F401
from nemo_dflash.data.stage_sections import PromptJobConfig, PromptsConfig, RegenerateConfig

_PACKAGE = Path(__file__).resolve().parent


def shipped_dir(name: str) -> Path:
    """The shipped `recipes/` or `configs/`: the wheel's copy (`nemo_dflash/_shipped/<name>`, made by
    setup.py) after a non-editable install, else the checkout's root folder (the source of truth)."""
    packaged = _PACKAGE / "_shipped" / name
    return packaged if packaged.is_dir() else _PACKAGE.parent / name


REPO_RECIPES = shipped_dir("recipes")
REPO_CONFIGS = shipped_dir("configs")


class ConfigError(ValueError):
    """A recipe problem the user fixes in the YAML or on the command line."""


@dataclass
class TargetConfig:
    path: str = what(MISSING)  # local HF dir, a .gguf file, or pkg:smollm2 (the bundled SmolLM2-135M-Instruct)
    dtype: str = what("bf16")  # dtype of the frozen target's weights
    attn_implementation: str = what("sdpa")
    # packed rows on a GPU: flex (a document-causal BlockMask) or varlen (one flash varlen call over the
    # documents; target/packed_attention.py)
    packed_attention: str = what("flex")
    random_init: bool = what(False)  # architecture from path/config.json, random weights (benchmarks, scaling runs)


@dataclass
class DFlash2Options:
    """The DFlash2 modules' sizes (`draft.kind: dflash2`; docs/train.md): the engines' dflash_config fields.
    A 0 kernel size turns the block convolution off, a 0 rank and top-K the candidate selector."""

    conv_kernel_size: int = what(2)  # taps of the causal block convolution (2 in the published drafts)
    conv_group_size: int = what(16)  # channels a group shares a per-token kernel offset (must divide the hidden size)
    selector_rank: int = what(256)  # rank of the predecessor / successor codebooks
    selector_top_k: int = what(16)  # candidates a slot's walk chooses among
    output_multiplier: float = what(1.0)  # unary logits = softcap(multiplier * lm_head(h))
    final_logit_softcapping: float = what(0.0)  # c * tanh(x / c) on the unary logits; 0: off


@dataclass
class DraftConfig:
    # dflash: every block slot predicted on its own (DFlash-1); dflash2: a causal conv over the block and a
    # candidate selector that walks the block left to right (coherent samples at T > 0)
    kind: str = what("dflash")
    dflash2: DFlash2Options = field(default_factory=DFlash2Options, metadata=WHAT)
    num_layers: int = what(5)
    block_size: int = what(16)
    target_layer_ids: Optional[list[int]] = what(None)  # default: build_target_layer_ids(L, num_layers)
    # Mask token: explicit id > the tokenizer's mask token > the family default in the registry
    # > the first embedding row past the tokenizer's vocabulary. Must be < the target's vocab.
    mask_token_id: Optional[int] = what(None)
    # The target mask_token_id was chosen for, "ARCH" or "ARCH/VOCAB" (e.g. LlamaForCausalLM/49152): another
    # target ignores the id and resolves its own, so a recipe reused for another target cannot carry a wrong id.
    mask_token_for: Optional[str] = what(None)
    # Training refuses a mask token that occurs in the training data (an ordinary token); true allows it.
    allow_mask_token_in_data: bool = how(False)
    intermediate_size: Optional[int] = what(None)  # default: the target's
    init_from: Optional[str] = what(None)  # a draft directory (training or exported) to start from


@dataclass
class LossConfig:
    num_anchors: int = what(512)
    gamma: Optional[float] = what(7.0)  # loss decay exp(-(k-1)/gamma); null = no decay
    attn_backend: str = what("auto")  # auto = flex on GPU, sdpa (dense mask) on CPU; or sdpa/eager/flex
    distill_weight: float = what(0.0)  # > 0 mixes in soft CE against the target's distribution
    # > 0 mixes in a loss on the speculative-sampling accept probability a = sum_x min(p_T, q) (accept_loss.py):
    # loss = (1 - distill_weight - accept_weight) hard CE + distill_weight soft CE + accept_weight term
    accept_weight: float = what(0.0)
    accept_temperature: float = what(1.0)  # T of the target's p_T in that term (the sampling temperature served)
    accept_form: str = what("log")  # log: -log a (LK's direct acceptance loss) | tv: 1 - a (total variation)
    ce_chunk_size: int = what(4096)  # rows of [tokens, vocab] logits alive at once
    fused_ce: bool = what(True)  # lm_head gradient formed in the forward pass (no recompute); off = checkpointed chunks
    # training loss kernel: chunked (PyTorch, chunk by chunk; the fastest measured) | cce (cut-cross-entropy)
    # | liger (liger-kernel); cce/liger fall back to chunked, with a warning, where they cannot run
    impl: str = what("chunked")
    # DFlash2: loss = unary + selector_weight * the selector's K-way cross-entropy (predecessor teacher-forced).
    selector_weight: float = what(1.0)
    # a true token outside the slot's top-K: skip the slot (default: higher held-out walk tau and top-K recall at
    # equal tokens, docs/train.md "DFlash2"), or inject it in place of the K-th candidate (loss only)
    selector_outside: str = what("skip")
    # per-slot weights of both terms: decay (exp(-(k-1)/gamma)) | dpace (D-PACE: survival-weighted, from the CE)
    position_weights: str = what("decay")
    dpace_alpha: float = what(0.5)  # D-PACE's floor on the per-slot survival estimate, q~ = (1 - a) exp(-CE) + a


@dataclass
class OptimConfig:
    lr: float = what(6e-4)
    weight_decay: float = what(0.0)
    betas: list[float] = field(default_factory=lambda: [0.9, 0.95], metadata=WHAT)
    eps: float = what(1e-8)
    scheduler: str = what("cosine")  # cosine | linear | constant (all with warmup; from transformers)
    warmup_ratio: float = what(0.04)
    grad_clip: float = what(1.0)
    fused: Optional[bool] = what(None)  # default: fused AdamW on CUDA


@dataclass
class TrainConfig:
    epochs: float = what(1.0)
    max_steps: Optional[int] = what(None)  # overrides epochs when set
    max_minutes: Optional[float] = how(None)  # stop (and save) after this much training time
    micro_batch_size: int = what(1)
    grad_accum: int = what(1)
    seed: int = what(0)
    precision: str = what("bf16")  # bf16 autocast (GPU, and CPUs with bf16 matmul units) or fp32
    device: str = what("auto")  # auto | cpu | cuda
    log_every: int = how(10)
    eval_every: Optional[int] = what(None)  # held-out simulated acceptance every N steps
    eval_batches: int = what(8)
    # the held-out expected acceptance under speculative sampling (eval_sampled_accept_len): the sampling it
    # assumes for both target and draft; eval_temperature 0 turns it off
    eval_temperature: float = what(1.0)
    eval_top_p: float = what(1.0)
    eval_top_k: int = what(0)
    max_bad_steps: int = how(20)  # consecutive non-finite steps before training stops
    compile: bool = what(False)  # torch.compile the draft layers (GPU)
    compile_target: bool = what(False)  # torch.compile the frozen target's decoder layers (GPU; launch-bound small targets)


@dataclass
class CheckpointConfig:
    every_steps: Optional[int] = how(None)
    keep_last: int = how(3)
    resume: str = what("auto")  # auto (newest complete checkpoint in output_dir) | none | a checkpoint path


@dataclass
class DistributedConfig:
    strategy: str = what("auto")  # auto (ddp when WORLD_SIZE > 1) | none | ddp | fsdp2
    backend: Optional[str] = how(None)  # default: nccl on GPU, gloo on CPU
    shard_target: bool = what(False)  # fsdp2 only: also shard the frozen target's decoder layers
    timeout_minutes: int = how(30)


@dataclass
class WandbConfig:
    mode: str = how("offline")  # online | offline | disabled
    project: str = how("nemo_dflash")
    name: Optional[str] = how(None)


# ---- The pipeline's stages (`nemo_dflash.recipes.pipeline`): one section per command. Each field is the
# command's flag of the same name (`max_new_tokens` is `--max-new-tokens`) and its default is the flag's default:
# the commands take their defaults from these classes (`recipes._cli.section_defaults`). What the pipeline
# fills in itself (the target, the output paths, --overwrite) has no field. The data stages' sections (`prompts`,
# `regenerate`) are in `data/stage_sections.py`.


@dataclass
class ExportConfig:
    """`nemo_dflash.recipes.export`: the trained draft in the serving format, checked against the target."""

    serving_engine: str = what("any")  # any | vllm | sglang: the engine served with (its limits refuse)
    parity_prompts: int = how(0)
    any_target: bool = how(False)  # a --target other than the one the draft records it was trained on


@dataclass
class EvaluateConfig:
    """`nemo_dflash.recipes.evaluate` on the exported draft."""

    protocol: str = what("paper")  # paper | quick; the keys below override it
    datasets: Optional[str] = what(None)  # comma list: mtbench, humaneval, math500, aime, FILE.jsonl
    max_new_tokens: Optional[int] = what(None)
    turns: Optional[int] = what(None)
    multi_turn: bool = what(False)
    temperatures: Optional[str] = what(None)  # e.g. "0" or "0,1"
    top_p: float = what(1.0)
    top_k: int = what(0)
    draft_proposals: str = what("sample")
    sampling: Optional[str] = what(None)  # target | none
    block_size: Optional[int] = what(None)
    num_prompts: Optional[int] = what(None)
    first_prompt: Optional[int] = what(None)
    speedup_prompts: Optional[int] = what(None)
    no_speedup: bool = what(False)
    speedup_only: bool = what(False)  # time the speedup prompts and stop (no acceptance phase)
    method: Optional[str] = what(None)  # sequential | replay | batched
    batch_size: str = what("auto")
    decode: Optional[str] = what(None)  # eager | graphs
    workers: int = how(1)
    gpus: int = what(1)  # processes (one a GPU) the conversations are dealt over (prompt j to process j % gpus)
    max_minutes: Optional[float] = how(None)
    no_chat_template: bool = what(False)
    reasoning: Optional[str] = what(None)
    device: str = what("auto")
    dtype: str = what("auto")
    threads: Optional[int] = how(None)
    seed: int = what(0)
    any_target: bool = how(False)  # a --target other than the one the draft records it was trained on
    allow_nonfinite: bool = how(False)  # measure a draft whose weights hold NaN or inf (refused by default)


@dataclass
class RunConfig:
    # the pipeline's run directory: prompts/, data/, export/, eval/, stages/ and the resolved recipe.yaml
    # (null: the folder holding output_dir); training writes to output_dir, as `train` does
    dir: Optional[str] = how(None)


@dataclass
class RecipeConfig:
    output_dir: str = what("outputs/run")
    target: TargetConfig = field(default_factory=TargetConfig, metadata=WHAT)
    draft: DraftConfig = field(default_factory=DraftConfig, metadata=WHAT)
    data: DataConfig = field(default_factory=DataConfig, metadata=WHAT)
    loss: LossConfig = field(default_factory=LossConfig, metadata=WHAT)
    optim: OptimConfig = field(default_factory=OptimConfig, metadata=WHAT)
    train: TrainConfig = field(default_factory=TrainConfig, metadata=WHAT)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig, metadata=WHAT)
    distributed: DistributedConfig = field(default_factory=DistributedConfig, metadata=WHAT)
    wandb: WandbConfig = field(default_factory=WandbConfig, metadata=HOW)
    run: RunConfig = field(default_factory=RunConfig, metadata=HOW)
    prompts: PromptsConfig = field(default_factory=PromptsConfig, metadata=WHAT)
    regenerate: RegenerateConfig = field(default_factory=RegenerateConfig, metadata=WHAT)
    export: ExportConfig = field(default_factory=ExportConfig, metadata=WHAT)
    evaluate: EvaluateConfig = field(default_factory=EvaluateConfig, metadata=WHAT)


_CHOICES = {
    "draft.kind": ("dflash", "dflash2"),
    "loss.selector_outside": ("inject", "skip"),
    "loss.position_weights": ("decay", "dpace"),
    "loss.attn_backend": ("auto", "sdpa", "eager", "flex"),
    "loss.impl": ("chunked", "cce", "liger"),
    "loss.accept_form": ("log", "tv"),
    "optim.scheduler": ("cosine", "linear", "constant"),
    "train.precision": ("bf16", "fp32"),
    "train.device": ("auto", "cpu", "cuda"),
    "distributed.strategy": ("auto", "none", "ddp", "fsdp2"),
    "wandb.mode": ("online", "offline", "disabled"),
    "target.dtype": ("bf16", "fp16", "fp32"),
    "target.packed_attention": ("flex", "varlen"),
}


def resolve_recipe_path(name: str | Path) -> Path:
    """`--config NAME.yaml`: the working directory first, then the shipped recipes/."""
    p = Path(name)
    candidates = [p] if p.is_absolute() else [Path.cwd() / p, REPO_RECIPES / p, REPO_RECIPES / f"{p}.yaml"]
    for c in candidates:
        if c.is_file():
            return c
    shipped = sorted(x.name for x in REPO_RECIPES.glob("*.yaml")) if REPO_RECIPES.is_dir() else []
    raise ConfigError(f"Recipe {str(name)!r} not found in {Path.cwd()} or {REPO_RECIPES}. Shipped recipes: {shipped}")


def _all_keys(node: Any, prefix: str = "") -> list[str]:
    keys = []
    if isinstance(node, DictConfig):
        for k in node.keys():
            full = f"{prefix}{k}"
            keys.append(full)
            keys.extend(_all_keys(node._get_node(k), full + "."))
    return keys


_ITEM_FIELD = re.compile(r"(.+?)\[(\d+)\]\.([^.\[\]]+)")  # OmegaConf's name of a list item's field: `a.b[0].c`


def _list_item_error(schema: DictConfig, key: str) -> Optional[ConfigError]:
    """``a.b[0].c``: suggest among the keys of the list item's own schema (not the whole recipe's)."""
    m = _ITEM_FIELD.fullmatch(key)
    if m is None:
        return None
    node = OmegaConf.select(schema, m.group(1))
    element = getattr(getattr(node, "_metadata", None), "element_type", None)
    if not isinstance(node, ListConfig) or element is None or not hasattr(element, "__dataclass_fields__"):
        return None
    fields = list(element.__dataclass_fields__)
    if m.group(3) in fields:
        return None  # a known field: not an unknown key
    close = difflib.get_close_matches(m.group(3), fields, n=1, cutoff=0.5)
    hint = f" Did you mean '{m.group(1)}[{m.group(2)}].{close[0]}'?" if close else ""
    return ConfigError(f"Unknown config key '{key}'.{hint} The keys of an item are: {', '.join(fields)}")


def _unknown_key_error(schema: DictConfig, key: str) -> ConfigError:
    item = _list_item_error(schema, key)
    if item is not None:
        return item
    valid = _all_keys(schema)
    close = difflib.get_close_matches(key, valid, n=1, cutoff=0.5)
    if not close:  # try the last component against the same level
        leaf = key.rsplit(".", 1)[-1]
        close = difflib.get_close_matches(leaf, [v.rsplit(".", 1)[-1] for v in valid], n=1, cutoff=0.5)
        close = [v for v in valid if v.endswith("." + close[0]) or v == close[0]][:1] if close else []
    hint = f" Did you mean '{close[0]}'?" if close else ""
    return ConfigError(f"Unknown config key '{key}'.{hint}")


def _walk_unknown(schema: DictConfig, data: Any, prefix: str = "") -> None:
    """Check user keys against the schema before merging, for a better message than OmegaConf's."""
    if not isinstance(data, dict):
        return
    for k, v in data.items():
        full = f"{prefix}{k}"
        if k not in schema.keys():
            raise _unknown_key_error(OmegaConf.structured(RecipeConfig), full)
        child = schema._get_node(k)
        if isinstance(child, DictConfig) and isinstance(v, dict):
            _walk_unknown(child, v, full + ".")
        element = getattr(getattr(child, "_metadata", None), "element_type", None)
        if isinstance(child, ListConfig) and hasattr(element, "__dataclass_fields__") and isinstance(v, list):
            for i, item in enumerate(v):  # list items (data.sources): checked against the item's own schema
                for name in item if isinstance(item, dict) else ():
                    if name not in element.__dataclass_fields__:
                        raise _unknown_key_error(OmegaConf.structured(RecipeConfig), f"{full}[{i}].{name}")


_SCHEMA_NODE = "_nemo_dflash_defaults"  # ConfigStore names: the dataclass defaults, and the run's primary config
_RUN_NODE = "_nemo_dflash_run"


def _groups(dirs: Sequence[Path]) -> set[str]:
    """Config group names (sub-folders holding YAMLs) in the composition's search path."""
    return {d.name for base in dirs if base.is_dir() for d in base.iterdir() if d.is_dir() and any(d.glob("*.yaml"))}


def _parse_override(ov: str) -> Any:
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from hydra.errors import OverrideParseException

    try:
        return OverridesParser.create().parse_overrides([ov])[0]
    except OverrideParseException as e:
        # Hydra's message: the parser's complaint, maybe a caret line, a link; keep the complaint.
        lines = [ln.strip() for ln in str(e).splitlines()
                 if ln.strip() and not ln.startswith(("See https", "Error parsing override")) and ln.strip() != "^"]
        reason = lines[0].replace(f": {ov}", "") if lines else "bad syntax"
        raise ConfigError(f"Override {ov!r} cannot be parsed ({reason}): write key=value, ++key=value, ~key, "
                          "group=option or +group=option (e.g. optim.lr=1e-4)") from None


_PLAIN_SET = re.compile(r"([A-Za-z_][\w.]*)=(.*)", re.S)
_LIST_ITEM_KEY = re.compile(r"(.+?)\.(\d+)(?:\.([^.]+))?")  # `prompts.jobs.3` or `prompts.jobs.3.source`


def _plain_values_quoted(overrides: Sequence[str], groups: set[str]) -> list[str]:
    """`key=value` whose value Hydra's grammar reads as a sweep or cannot read (`output_dir=runs/a,b`,
    `wandb.name=a=b`, a path with parentheses) is taken as the plain string it was before Hydra, quoted
    for Hydra. Everything Hydra parses keeps Hydra's meaning; a group choice is never quoted."""
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from hydra.errors import OverrideParseException

    parser = OverridesParser.create()
    out = []
    for ov in overrides:
        try:
            keep = not parser.parse_overrides([ov])[0].is_sweep_override()
        except OverrideParseException:
            keep = False
        m = _PLAIN_SET.fullmatch(ov)
        if keep or m is None or m.group(1) in groups:
            out.append(ov)
            continue
        quote = next((q for q in ("'", '"') if q not in m.group(2)), None)
        out.append(ov if quote is None else f"{m.group(1)}={quote}{m.group(2)}{quote}")
    return out


def _check_override_keys(schema: DictConfig, overrides: Sequence[str], groups: set[str]) -> None:
    """Each override names a schema key (or a config group): a typo is refused with the nearest valid key."""
    for ov in overrides:
        parsed = _parse_override(ov)
        key = parsed.key_or_group
        if not key:
            raise ConfigError(f"Override {ov!r} names no key: write key=value (e.g. optim.lr=1e-4)")
        if "." not in key and key in groups:
            continue  # a config group choice (`cluster=fsdp2`, `~cluster`), resolved by Hydra
        item = _LIST_ITEM_KEY.fullmatch(key)
        listed = OmegaConf.select(schema, item.group(1)) if item is not None else None
        if isinstance(listed, ListConfig):
            # one item of a list, or one field of it (`prompts.jobs.3.source=...`): the field is checked
            # against the item's schema here, the index against the recipe's list when Hydra applies it
            element = getattr(listed._metadata, "element_type", None)
            field = item.group(3)
            if field is None or field in getattr(element, "__dataclass_fields__", ()):
                continue
            raise _unknown_key_error(schema, f"{item.group(1)}[{item.group(2)}].{field}")
        parent, _, leaf = key.rpartition(".")
        node = OmegaConf.select(schema, parent) if parent else schema
        if not isinstance(node, DictConfig) or leaf not in node.keys():
            raise _unknown_key_error(schema, key)


def _missing_option_error(e: Exception, recipe: Optional[Path]) -> ConfigError:
    """Hydra's 'Could not find group/option' in one line, with the nearest option."""
    missing = getattr(e, "missing_cfg_file", None) or ""
    options = list(getattr(e, "options", None) or [])
    where = f"{recipe}: " if recipe is not None else ""
    if missing.endswith(".yaml") or (not options and "/" not in missing):
        stem = Path(missing).stem  # a file name from before config groups (`paper_block16.yaml`): name its group
        groups = sorted(g.parent.name for g in REPO_CONFIGS.glob(f"*/{stem}.yaml")) if REPO_CONFIGS.is_dir() else []
        example = f"{{{groups[0]}: {stem}}}" if groups else "{draft: paper_block16}, {cluster: fsdp2}"
        return ConfigError(f"{where}defaults entry {missing!r} not found: name a config group option from {REPO_CONFIGS} "
                           f"or a config next to the recipe, e.g. `defaults: [{example}, _self_]`")
    group, _, option = missing.rpartition("/")
    close = difflib.get_close_matches(option, options, n=1, cutoff=0.5)
    hint = f" Did you mean '{group}={close[0]}'?" if close else ""
    return ConfigError(f"{where}config group option '{missing}' not found.{hint} Options in '{group}': {', '.join(options)}")


def _one_line(text: str) -> str:
    return " ".join(part.strip() for part in text.splitlines() if part.strip())


def _compose(recipe: Optional[Path], overrides: Sequence[str]) -> DictConfig:
    """Hydra's Compose API: the schema's defaults, then the recipe (its defaults list, then its body),
    then the overrides. The recipe's folder comes first in the search path, then the shipped configs/."""
    import yaml
    from hydra import compose, initialize_config_dir
    from hydra.core.config_store import ConfigStore
    from hydra.core.global_hydra import GlobalHydra
    from hydra.errors import ConfigCompositionException, MissingConfigException

    store = ConfigStore.instance()
    # Untyped defaults (so `~key` can drop a value back to its default); RecipeConfig types the result.
    store.store(name=_SCHEMA_NODE, node=OmegaConf.to_container(OmegaConf.structured(RecipeConfig)))
    store.store(name=_RUN_NODE, node={"defaults": [_SCHEMA_NODE, *([recipe.stem] if recipe else []), "_self_"]})
    config_dir = recipe.parent if recipe is not None else (REPO_CONFIGS if REPO_CONFIGS.is_dir() else _PACKAGE)
    search = [f"file://{REPO_CONFIGS}"] if REPO_CONFIGS.is_dir() and config_dir != REPO_CONFIGS else []
    GlobalHydra.instance().clear()  # a caller's own Hydra context would otherwise refuse a second initialize
    try:
        with initialize_config_dir(config_dir=str(config_dir), version_base="1.3", job_name="nemo_dflash"):
            return compose(_RUN_NODE, overrides=[f"hydra.searchpath={search}", *overrides])
    except MissingConfigException as e:
        raise _missing_option_error(e, recipe) from None
    except yaml.YAMLError as e:  # a recipe or config group file that is not YAML
        mark = getattr(e, "problem_mark", None)
        where = f"{mark.name}, line {mark.line + 1}, column {mark.column + 1}" if mark is not None else str(recipe)
        what = getattr(e, "problem", None) or _one_line(str(e))
        raise ConfigError(f"{where}: not valid YAML ({what}): fix the syntax there (a bracket or quote left open, "
                          "a tab for indentation)") from None
    except ConfigCompositionException as e:
        cause = e.__cause__
        merging = re.match(r"Error merging override (\S+?)=", str(e))
        item = _LIST_ITEM_KEY.fullmatch(merging.group(1)) if merging else None
        if isinstance(cause, ConfigIndexError) and item is not None:  # an index past the recipe's list
            raise ConfigError(f"Override {merging.group(1)!r}: '{item.group(1)}' has no item {item.group(2)} in this "
                              f"recipe (items count from 0): add the item to the recipe, or give the whole list, "
                              f"e.g. '{item.group(1)}=[...]'") from None
        if isinstance(cause, (ConfigKeyError, ConfigAttributeError)) and cause.full_key:
            field = _ITEM_FIELD.fullmatch(str(cause.full_key))
            if field is not None and _list_item_error(OmegaConf.structured(RecipeConfig), str(cause.full_key)) is None:
                key = f"{field.group(1)}.{field.group(2)}.{field.group(3)}"  # a valid field the recipe's item lacks
                raise ConfigError(f"Override {key!r}: item {field.group(2)} of '{field.group(1)}' does not set "
                                  f"'{field.group(3)}' in this recipe: add it with '++{key}=...'") from None
            raise _unknown_key_error(OmegaConf.structured(RecipeConfig), str(cause.full_key)) from None
        raise ConfigError(" ".join(part.strip() for part in str(e).splitlines() if part.strip())) from None


def load_recipe(path: Optional[str | Path], overrides: Sequence[str] = (), data_optional: bool = False) -> RecipeConfig:
    """The typed recipe. ``data_optional``: an empty data.sources is allowed (the pipeline trains on the data its
    regenerate stage writes)."""
    schema = OmegaConf.structured(RecipeConfig)
    recipe = resolve_recipe_path(path).resolve() if path is not None else None
    groups = _groups([recipe.parent] if recipe else []) | _groups([REPO_CONFIGS])
    overrides = _plain_values_quoted(overrides, groups)
    _check_override_keys(schema, overrides, groups)
    composed = _compose(recipe, overrides)
    data = OmegaConf.to_container(composed, resolve=False)
    _walk_unknown(schema, data)
    try:
        merged = OmegaConf.merge(schema, OmegaConf.create(data))
        cfg: RecipeConfig = OmegaConf.to_object(merged)  # type: ignore[assignment]
    except (ConfigKeyError, ConfigAttributeError) as e:
        raise _unknown_key_error(schema, str(e.full_key)) from None
    except MissingMandatoryValue as e:
        raise ConfigError(f"'{e.full_key}' must be set (in the recipe or as {e.full_key}=...)") from None
    except (InterpolationResolutionError, GrammarParseError) as e:
        raise ConfigError(f"'{e.full_key}' is an interpolation that does not resolve ({str(e.msg).splitlines()[0]}): "
                          f"define what it names (e.g. export the environment variable), or write the value itself"
                          ) from None
    except ValidationError as e:
        value = OmegaConf.select(OmegaConf.create(data), str(e.full_key), default=None)
        if isinstance(value, str) and value.lstrip()[:1] in ("[", "{"):  # a list or dict the override grammar could not read
            raise ConfigError(f"'{e.full_key}': {value!r} is not a complete list or mapping: write it whole, e.g. "
                              f"'{e.full_key}=[0.9,0.95]' (quoted for the shell)") from None
        raise ConfigError(f"Invalid value for '{e.full_key}': {str(e.msg).splitlines()[0]}") from None
    validate(cfg, data_optional)
    return cfg


def _finite(x: Optional[float]) -> bool:
    return x is not None and math.isfinite(x)


def _in(x: Optional[float], lo: float, hi: float) -> bool:
    """lo <= x <= hi for a finite x (NaN and +-inf are out of every range)."""
    return _finite(x) and lo <= x <= hi  # type: ignore[operator]


# Upper bounds of the counts and sizes: far above any real run, far below what takes a machine down.
MAX_TOKENS = 1 << 20  # data.max_length, data.pack_length: a million tokens a row
MAX_ROWS = 1 << 16  # train.micro_batch_size, train.grad_accum, train.eval_batches


def _ranges(cfg: RecipeConfig) -> list[tuple[bool, str]]:
    """Every count, rate and size of the recipe with its range, checked before anything loads."""
    t, o, d, lo, ck = cfg.train, cfg.optim, cfg.draft, cfg.loss, cfg.checkpoint
    return [
        (1 <= d.num_layers <= 1024, "draft.num_layers must be in [1, 1024]"),
        (2 <= d.block_size <= 4096, "draft.block_size must be in [2, 4096] (slot 0 is the anchor)"),
        (d.intermediate_size is None or 1 <= d.intermediate_size <= 1 << 24,
         "draft.intermediate_size must be >= 1 or null (null: the target's)"),
        (d.mask_token_id is None or d.mask_token_id >= 0, "draft.mask_token_id must be >= 0 or null"),
        (0 <= d.dflash2.conv_kernel_size <= d.block_size,
         "draft.dflash2.conv_kernel_size must be in [0, draft.block_size] (0: no block convolution)"),
        (1 <= d.dflash2.conv_group_size <= 1 << 16, "draft.dflash2.conv_group_size must be >= 1 (it must divide the "
         "target's hidden size; 16 in the published drafts)"),
        ((d.dflash2.selector_rank == 0) == (d.dflash2.selector_top_k == 0) and d.dflash2.selector_rank >= 0
         and d.dflash2.selector_top_k >= 0 and d.dflash2.selector_rank <= 1 << 16,
         "draft.dflash2.selector_rank and selector_top_k must both be > 0, or both 0 (no selector)"),
        (_finite(d.dflash2.output_multiplier) and d.dflash2.output_multiplier > 0,
         "draft.dflash2.output_multiplier must be a finite number > 0 (1: plain logits)"),
        (_in(d.dflash2.final_logit_softcapping, 0.0, 1e6),
         "draft.dflash2.final_logit_softcapping must be a finite number >= 0 (0: off)"),
        (_in(lo.selector_weight, 0.0, 1e3), "loss.selector_weight must be a finite number >= 0"),
        (_in(lo.dpace_alpha, 0.0, 1.0), "loss.dpace_alpha must be in [0, 1] (D-PACE is stable in [0.3, 0.7])"),
        (1 <= lo.num_anchors <= MAX_TOKENS, f"loss.num_anchors must be in [1, {MAX_TOKENS}]"),
        (lo.gamma is None or (_finite(lo.gamma) and lo.gamma > 0), "loss.gamma must be a finite number > 0 or null"),
        (_in(lo.distill_weight, 0.0, 1.0), "loss.distill_weight must be in [0, 1]"),
        (_in(lo.accept_weight, 0.0, 1.0), "loss.accept_weight must be in [0, 1]"),
        (_finite(lo.accept_temperature) and lo.accept_temperature > 0,
         "loss.accept_temperature must be a finite number > 0"),
        (not (_finite(lo.distill_weight) and _finite(lo.accept_weight))
         or lo.distill_weight + lo.accept_weight <= 1 + 1e-9,
         "loss.distill_weight + loss.accept_weight must be <= 1 (hard CE weighs the rest)"),
        (1 <= lo.ce_chunk_size <= MAX_TOKENS, f"loss.ce_chunk_size must be in [1, {MAX_TOKENS}]"),
        (_finite(o.lr) and 0 < o.lr <= 1, "optim.lr must be a finite number in (0, 1] (the recipes use 6e-4)"),
        (_in(o.weight_decay, 0.0, 1e3), "optim.weight_decay must be a finite number >= 0"),
        (len(o.betas) == 2 and all(_finite(b) and 0 <= b < 1 for b in o.betas),
         "optim.betas must be two numbers in [0, 1), e.g. [0.9, 0.95]"),
        (_finite(o.eps) and 0 < o.eps <= 1, "optim.eps must be a finite number in (0, 1], e.g. 1e-8"),
        (_finite(o.warmup_ratio) and 0.0 <= o.warmup_ratio < 1.0, "optim.warmup_ratio must be in [0, 1)"),
        (o.grad_clip > 0, "optim.grad_clip must be > 0 (the norm gradients are clipped to; inf: no clipping)"),
        (_finite(t.epochs) and t.epochs > 0, "train.epochs must be a finite number > 0 (or set train.max_steps)"),
        (t.max_steps is None or t.max_steps >= 1, "train.max_steps must be >= 1 or null"),
        (t.max_minutes is None or (_finite(t.max_minutes) and t.max_minutes >= 0),
         "train.max_minutes must be a finite number >= 0 or null (0: stop after the first step)"),
        (1 <= t.micro_batch_size <= MAX_ROWS and 1 <= t.grad_accum <= MAX_ROWS,
         f"train.micro_batch_size and train.grad_accum must be in [1, {MAX_ROWS}]"),
        (t.log_every >= 1, "train.log_every must be >= 1 (steps between two logged rows)"),
        (t.eval_every is None or t.eval_every >= 0, "train.eval_every must be >= 0 or null (0 or null: no evaluation)"),
        (1 <= t.eval_batches <= MAX_ROWS, f"train.eval_batches must be in [1, {MAX_ROWS}]"),
        (t.max_bad_steps >= 0, "train.max_bad_steps must be >= 0"),
        (0 <= t.seed < 2**63, "train.seed must be in [0, 2**63)"),
        (ck.every_steps is None or ck.every_steps >= 0,
         "checkpoint.every_steps must be >= 0 or null (0 or null: only at the end when stopped early)"),
        (ck.keep_last >= 1, "checkpoint.keep_last must be >= 1"),
        (1 <= cfg.distributed.timeout_minutes <= 7 * 24 * 60, "distributed.timeout_minutes must be in [1, 10080]"),
    ]


# YAML 1.1 reads a bare on/off as a boolean, which a string field then holds as 'True'/'False'.
_ON_OFF = {"True": "on", "False": "off"}


def validate(cfg: RecipeConfig, data_optional: bool = False) -> None:
    """Choices and ranges of the training sections; the stage sections are checked by their commands' own
    parsers (`recipes.pipeline`), before anything loads."""
    regen = cfg.regenerate
    regen.decontaminate = _ON_OFF.get(regen.decontaminate, regen.decontaminate)
    node = OmegaConf.structured(cfg)  # built once: each build walks every section's dataclass
    for key, choices in _CHOICES.items():
        value = OmegaConf.select(node, key)
        if value not in choices:
            raise ConfigError(f"'{key}' must be one of {list(choices)}, got {value!r}")
    for ok, msg in _ranges(cfg):
        if not ok:
            raise ConfigError(msg)
    from nemo_dflash.engine.sampling import check_sampling

    try:
        check_sampling(cfg.train.eval_temperature, cfg.train.eval_top_p, cfg.train.eval_top_k,
                       names=("train.eval_temperature", "train.eval_top_p", "train.eval_top_k"))
    except ValueError as e:
        raise ConfigError(str(e)) from None
    if cfg.draft.target_layer_ids is not None:  # the target's depth is checked once it is loaded
        from nemo_dflash.target import check_target_layer_ids

        try:
            check_target_layer_ids(cfg.draft.target_layer_ids, key="draft.target_layer_ids")
        except ValueError as e:
            raise ConfigError(str(e)) from None
    from nemo_dflash.data.config import validate_data_config

    try:
        if cfg.data.sources or not data_optional:
            validate_data_config(cfg.data)
    except ValueError as e:
        raise ConfigError(str(e)) from None


def to_yaml(cfg: RecipeConfig) -> str:
    return OmegaConf.to_yaml(OmegaConf.structured(cfg))


# What a training's resume does not compare: the other stages' sections, where the run lives and what it resumes
# from, the paths of the target and the data (their contents are compared, so a moved copy resumes), and the run's
# length (a resume may extend a run: its schedule follows the new length from the step it resumes at).
NOT_RESUME_SETTINGS = ("prompts", "regenerate", "export", "evaluate", "output_dir", "checkpoint.resume",
                       "target.path", "data.sources[].path", "train.max_steps", "train.epochs")


def resume_settings(cfg: RecipeConfig) -> dict[str, Any]:
    """A training's settings as a checkpoint records them, by dotted key: its WHAT fields (`what`/`how`, the rule
    the pipeline's markers follow) but `NOT_RESUME_SETTINGS`. A resume under other values is refused."""
    import json

    flat: dict[str, Any] = {}

    def walk(node: Any, prefix: str) -> None:
        for k, v in node.items():
            key = f"{prefix}{k}"
            if key in NOT_RESUME_SETTINGS:
                continue
            if isinstance(v, dict):
                walk(v, key + ".")
            elif isinstance(v, list) and v and all(isinstance(x, dict) for x in v):
                flat[key] = [{i: x for i, x in item.items() if f"{key}[].{i}" not in NOT_RESUME_SETTINGS}
                             for item in v]
            else:
                flat[key] = v

    walk(output_settings(RecipeConfig, cfg), "")
    return json.loads(json.dumps(flat))  # as meta.json gives it back (tuples as lists)


__all__ = [
    "CheckpointConfig", "ConfigError", "DFlash2Options", "DistributedConfig", "DraftConfig", "EvaluateConfig", "ExportConfig",
    "LossConfig", "OptimConfig", "PromptJobConfig", "PromptsConfig", "RecipeConfig", "RegenerateConfig", "RunConfig",
    "TargetConfig", "TrainConfig", "WandbConfig", "load_recipe", "resolve_recipe_path", "resume_settings",
    "shipped_dir", "to_yaml",
]
