"""`regenerate`'s flags: the parser (defaults from `RegenerateConfig`), the checks made before anything
loads, the files a run reads and writes, and the sampling and thinking modes it answers in.

Kept apart from `recipes/regenerate.py`, which only runs the steps; every problem here is one line naming
its fix (exit 2).
"""

from __future__ import annotations

import argparse
import logging
import math
import os
from pathlib import Path
from typing import Any, Optional

from nemo_dflash.config import RegenerateConfig
from nemo_dflash.data.journals import journal_outputs, journal_worlds
from nemo_dflash.data.regenerate import ENGINES
from nemo_dflash.engine.sampling import GREEDY, SamplingParams
from nemo_dflash.engine.sampling import check_sampling as check_sampling_values
from nemo_dflash.files import Output
from nemo_dflash.recipes._cli import (
    add_batch_size_arg, add_device_args, add_jsonl_out_arg, add_recipe_args, fail, section_defaults, user_errors,
)
from nemo_dflash.recipes._regen_server import add_server_args, validate_server_args

logger = logging.getLogger("nemo_dflash.regenerate")


def build_parser(description: str = "") -> argparse.ArgumentParser:
    """The flags, each a key of the recipe's `regenerate` section with that field's default."""
    p = argparse.ArgumentParser(prog="python -m nemo_dflash.recipes.regenerate", description=description,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--target", required=True, help="target model: local HF dir, .gguf file or pkg:smollm2")
    p.add_argument("--data", action="append", required=True, metavar="[NAME=]SOURCE[@WEIGHT]",
                   help="a prompt source, repeatable: a file of conversations (.jsonl/.json/.parquet, ShareGPT or "
                        "OpenAI layout) or a built-in: sharegpt, chitchat, gsm_symbolic[:COUNT], code[:COUNT]; "
                        "NAME (default: the built-in's name or the file's stem) is written to each record's "
                        "'dataset'; WEIGHT (default 1) repeats (2) or subsamples (0.5) the source in the pool")
    p.add_argument("--samples-per-prompt", type=int,
                   help="answers sampled per selected conversation, each with its own sampling key")
    p.add_argument("--decontaminate", choices=("on", "off"),
                   help="drop prompts sharing a 13-gram with the MT-Bench or HumanEval prompts that evaluate uses")
    p.add_argument("--eval-file", action="append", metavar="FILE",
                   help="also decontaminate against this prompt file (one you evaluate on: evaluate --datasets FILE); "
                        "repeatable")
    p.add_argument("--summary-json",
                   help="also write the run's summary (per-source counts, decontamination, speed) to this JSON file")
    add_jsonl_out_arg(p)
    p.add_argument("--num-samples", type=int,
                   help="regenerate the first N usable conversations after the seeded shuffle (default: all)")
    p.add_argument("--seed", type=int, help="shuffle (and sampling) seed")
    p.add_argument("--turns", choices=("first", "all"),
                   help="first: [system?, user, assistant] only; all: answer every user turn, feeding the "
                        "regenerated answers back as context")
    p.add_argument("--max-prompt-tokens", type=int,
                   help="skip conversations whose prompt is longer (default: the model's context minus "
                        "--max-new-tokens); with --turns all a conversation ends at the first turn over it")
    p.add_argument("--max-new-tokens", type=int, help="per assistant turn")
    p.add_argument("--sampling", choices=("target", "given", "greedy"),
                   help="target: the target's generation_config sampling settings when it has them, else "
                        "--temperature/--top-p; given: --temperature/--top-p; greedy: temperature 0")
    p.add_argument("--temperature", type=float, help="sampling temperature (see --sampling); 0 = greedy")
    p.add_argument("--top-p", type=float, help="nucleus sampling threshold (see --sampling)")
    p.add_argument("--engine", choices=(*ENGINES, "slots"), metavar="{" + ",".join(ENGINES) + "}",
                   help="continuous: the decoding engine, continuous batching, a finished answer's row refilled as "
                        "it ends (full-attention models); generate: model.generate batch after batch (any model)")
    add_batch_size_arg(p, "answers in flight (continuous: rows of the KV cache; generate: prompts per call)",
                       cpu="on a CPU or with --engine generate")
    p.add_argument("--prepare-ahead", type=int,
                   help="conversations whose first prompt is templated and tokenised ahead on a background "
                        "thread, overlapping the GPU (0: inline); the output does not depend on it")
    p.add_argument("--schedule", choices=("most_turns_first", "given"),
                   help="--turns all: the order conversations start in; starting those with the most turns "
                        "first shortens the tail where the batch empties; the output does not depend on it")
    p.add_argument("--loops", choices=("cut", "drop", "keep"),
                   help="an answer that degenerates into repetition: cut at the loop's start (the conversation "
                        "ends there), drop the turn, or keep it")
    p.add_argument("--capped", choices=("keep", "drop"),
                   help="an answer that hits --max-new-tokens without looping: keep it (the conversation ends "
                        "there) or drop the turn")
    p.add_argument("--after-cut", choices=("end", "continue"),
                   help="--turns all: an answer cut by --loops cut or by the token cap ends its conversation "
                        "(end), or the next turn is asked with the cut answer in its history (continue)")
    add_device_args(p)
    p.add_argument("--threads", type=int, help="CPU threads (default: torch's, every core)")
    p.add_argument("--reasoning", choices=("on", "off", "both"),
                   help="thinking mode of targets whose chat template has a switch (Qwen3, Qwen3.5 enable_thinking); "
                        "both: every prompt answered in each mode. Each record says its mode, and training masks "
                        "it as the template renders that mode (default: the template's default, unrecorded)")
    p.add_argument("--holdout", type=int,
                   help="also write N more conversations' prompts (no answers) to OUT_STEM.holdout.jsonl")
    p.add_argument("--max-bad-lines", type=int, help="malformed input records tolerated")
    p.add_argument("--overwrite", action="store_true", help="replace an existing output (and any partial one)")
    p.add_argument("--max-minutes", type=float,
                   help="stop generating after this long and finish OUT with the conversations done so far "
                        "(default: no limit)")
    add_server_args(p)  # --backend openai: regeneration on an OpenAI-compatible server
    add_recipe_args(p, "regenerate")  # --config RECIPE [KEY=VALUE ...]
    section_defaults(p, RegenerateConfig)  # the recipe's `regenerate` section is the source of the defaults
    return p


# --samples-per-prompt at most: each copy of a conversation is held in memory before the first answer
MAX_SAMPLES_PER_PROMPT = 1024


def validate(args: argparse.Namespace) -> None:
    """The checks of the flags alone, before any file is read."""
    from nemo_dflash.engine.plain import AUTO_ROWS_CAP

    if args.engine == "slots":  # the slot engine's name, before the decoding engine replaced it
        fail("--engine slots is now --engine continuous (the decoding engine): pass --engine continuous, or set "
             "regenerate.engine: continuous in the recipe")

    for name in ("num_samples", "max_new_tokens", "batch_size", "max_prompt_tokens", "samples_per_prompt"):
        value = getattr(args, name)
        if value is not None and value != "auto" and value < 1:
            fail(f"--{name.replace('_', '-')} must be >= 1 (got {value})")
    if args.batch_size != "auto" and args.batch_size > AUTO_ROWS_CAP:
        fail(f"--batch-size {args.batch_size} is more answers in flight than any GPU holds: give at most "
             f"{AUTO_ROWS_CAP}, or auto (what the GPU's free memory holds)")
    if args.samples_per_prompt > MAX_SAMPLES_PER_PROMPT:
        fail(f"--samples-per-prompt {args.samples_per_prompt}: give at most {MAX_SAMPLES_PER_PROMPT} (each copy is "
             "held in memory); for more data add prompts (--num-samples, more --data)")
    if args.prepare_ahead < 0:
        fail(f"--prepare-ahead must be >= 0 (got {args.prepare_ahead})")
    if args.max_minutes is not None and not (math.isfinite(args.max_minutes) and args.max_minutes > 0):  # nan too
        fail(f"--max-minutes must be a number of minutes > 0 (got {args.max_minutes})")
    if args.max_bad_lines < 0:
        fail(f"--max-bad-lines must be >= 0 (got {args.max_bad_lines})")
    if args.holdout < 0:
        fail(f"--holdout must be >= 0 (got {args.holdout})")
    check_sampling(args.temperature, args.top_p, "--temperature", "--top-p")
    if not args.out.endswith(".jsonl"):
        fail(f"--out must be a .jsonl file (got {args.out!r}); the data reader picks the format by extension")
    validate_server_args(args)


def check_launch(args: argparse.Namespace, world: int, local_rank: int) -> tuple[str, str]:
    """(device, dtype) of this rank, once the launch fits the flags: one process for a server, a GPU for
    --device cuda, the new tokens within the target's context and the KV cache within the device's memory."""
    from nemo_dflash.recipes._cli import resolve_device_dtype

    if args.backend == "openai" and world > 1:
        fail("--backend openai runs in one process (the server spreads the work): drop torchrun and raise "
             "--concurrency instead")
    with user_errors():  # --device cuda without a GPU: refused before any file is read
        device, dtype = resolve_device_dtype(args.device, args.dtype)
    with user_errors(ValueError):
        check_fits_target(args, f"cuda:{local_rank}" if device == "cuda" and world > 1 else device, dtype)
    return device, dtype


def check_fits_target(args: argparse.Namespace, device: str, dtype: str) -> None:
    """What the target's config.json (read as a file) and this machine bound, before the target loads: new tokens
    within its context, and the answers in flight's KV cache (at least --batch-size rows x --max-new-tokens
    positions) within the device's free memory: a one-line ValueError. A target whose config cannot be read here
    (a .gguf) is checked once it has loaded."""
    from types import SimpleNamespace

    import torch

    from nemo_dflash.train.device import free_memory_bytes
    from nemo_dflash.engine.batched_static import plain_cache_length
    from nemo_dflash.engine.plain import check_rows_fit, row_bytes, window_for
    from nemo_dflash.target.loading import target_text_config

    config = target_text_config(args.target)
    if config is None:
        return
    context = config.get("max_position_embeddings")
    if isinstance(context, int) and args.max_new_tokens >= context:
        raise ValueError(f"--max-new-tokens {args.max_new_tokens} leaves no room for a prompt in the model's "
                         f"context of {context} tokens: give at most {context - 1}")
    if args.backend == "openai" or args.batch_size == "auto":  # the server's memory; auto fits what is free
        return
    try:
        per_row = row_bytes(SimpleNamespace(**config), 1, getattr(torch, TORCH_DTYPES[dtype]))
    except (AttributeError, TypeError, ZeroDivisionError):
        return  # a config without the attention sizes: the engine's own check after the load
    length = plain_cache_length(1, args.max_new_tokens, window_for(torch.device(device)))
    free = free_memory_bytes(device)
    if free is not None:
        check_rows_fit(args.batch_size, length, per_row * length, free)


TORCH_DTYPES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}


def check_sampling(temperature: Any, top_p: Any, t_name: str, p_name: str) -> None:
    """Refuse a sampling configuration that makes no sense: `engine.sampling.check_sampling`'s line, exit 2."""
    with user_errors(ValueError):
        check_sampling_values(temperature, top_p, names=(t_name, p_name, "top-k"))


def resolve_sampling(args: argparse.Namespace, model: Any) -> tuple[SamplingParams, str]:
    """(the sampling, where it came from): the target's recommended sampling when it has
    one (``generation_config`` with ``do_sample``), else the command line's."""
    if args.sampling == "greedy":
        return GREEDY, "greedy"
    gen = getattr(model, "generation_config", None)
    if args.sampling == "target" and gen is not None and getattr(gen, "do_sample", False):
        temperature = getattr(gen, "temperature", None)
        top_p = getattr(gen, "top_p", None)
        temperature = 1.0 if temperature is None else temperature
        top_p = 1.0 if top_p is None else top_p
        check_sampling(temperature, top_p, "the target's generation_config temperature",
                       "the target's generation_config top_p")
        return SamplingParams(float(temperature), top_p=float(top_p)), "target generation_config"
    check_sampling(args.temperature, args.top_p, "--temperature", "--top-p")
    return SamplingParams(float(args.temperature), top_p=float(args.top_p)), "command line"


def output_places(args: argparse.Namespace, files: dict[str, Path], held: Optional[Path], world: int) -> list[Output]:
    """What a run writes: --out, the holdout file and --summary-json (each replaced only with --overwrite;
    the holdout file of a partial output being continued is kept), and its journal (continued)."""
    resuming = world in journal_worlds(Path(args.out))
    places = [Output(Path(args.out), "--out")]
    if held is not None:
        places.append(Output(held, "--holdout's file", may_exist=resuming))
    if args.summary_json:
        places.append(Output(Path(args.summary_json), "--summary-json"))
    places += [Output(p, "--out's journal", may_exist=True) for p in journal_outputs(files, world)]
    return places


def input_places(args: argparse.Namespace) -> list[tuple[str, str]]:
    """What a run reads, as files: each --data entry's file (its NAME= and @WEIGHT taken off) and a local
    --target."""
    from nemo_dflash.data.prompts import parse_source

    found = [("--target", args.target)] if os.path.exists(args.target) else []
    for entry in args.data:
        spec = parse_source(entry)
        if spec.builtin is None:
            found.append(("--data", spec.what))
    return found


def reasoning_modes(reasoning: Optional[str], target: str) -> list[Optional[str]]:
    """The thinking modes to answer in; refuses ``--reasoning`` for a template without a switch
    (checked on the tokenizer alone, before the model loads)."""
    if reasoning is None:
        return [None]
    from nemo_dflash.data.chat_template import has_thinking_switch
    from nemo_dflash.target.loading import load_tokenizer

    try:
        tokenizer = load_tokenizer(target)
    except (OSError, ValueError) as e:
        fail(f"cannot load the tokenizer of --target {target}: {e}")
    if not has_thinking_switch(tokenizer):
        fail(f"--reasoning {reasoning}: the chat template of {target} has no thinking switch (enable_thinking); "
             "drop --reasoning")
    return ["on", "off"] if reasoning == "both" else [reasoning]


def lock_output(lock_path: Path, out: Path) -> Any:
    """The held lock of ``out`` (one writer per output): a second regenerate of it is one line."""
    from nemo_dflash.files import FileLock, LockBusyError, LockReplacedError

    lock = FileLock(lock_path)
    with user_errors(OSError):  # an --out folder that cannot be made (permissions, a file in the way)
        out.parent.mkdir(parents=True, exist_ok=True)
        try:
            lock.acquire()
        except (LockBusyError, LockReplacedError) as e:
            holder = f" (pid {e.holder})" if isinstance(e, LockBusyError) else ""
            raise OSError(f"--out {out} is being written by another regenerate{holder}: wait for it to end, or "
                          "choose another --out") from None
    return lock


def resume_settings(args: argparse.Namespace, report: list[dict[str, Any]], max_prompt: Optional[int],
                    sampling: SamplingParams, served_model: Optional[str]) -> dict[str, Any]:
    """The settings a journal records and is continued only with (`data.journals.RESUME_KEYS`): the sources
    as resolved paths, the prompt cap and the sampling in force, the served model's name."""
    from nemo_dflash.data.journals import RESUME_KEYS

    settings = {k: getattr(args, k) for k in RESUME_KEYS}
    settings.update(data=[[r["name"], os.path.realpath(r["source"]) if os.path.exists(r["source"]) else r["source"],
                           r["weight"]] for r in report],
                    max_prompt_tokens=max_prompt, temperature=sampling.temperature, top_p=sampling.top_p)
    if served_model is not None:
        settings["model"] = served_model  # the served name, also when --model left it to the server
    return settings
