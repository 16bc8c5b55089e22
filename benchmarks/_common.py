"""What the benchmarks share: the measurement files' rows, a tiny stand-in target, the Qwen3-8B shape.

Rows. The measurement files under docs/bench/ hold one JSON list of rows per measured thing.
Every row is {"date", "commit", "device", "command", ...figures}; a tool appends its rows, so the
last row is the current figure and older rows stay as they were measured. The file is replaced
atomically (temp file, then os.replace): a failed run never leaves half a file or loses old rows.
A file whose rows are keyed (drafter_summary.json: one row per draft and protocol) is written with
`upsert_rows`: a second measurement of the same thing updates its row instead of adding a duplicate.

A tiny target. A random-weight Llama with a real tokenizer: a stand-in target to rehearse GPU
commands in seconds. The model is SmolLM2's architecture at toy size; its answers are noise, which
is all a rehearsal needs:

    python benchmarks/_common.py tiny-target OUT_DIR --tokenizer DIR [--layers 8 --hidden 128]

DIR holds the tokenizer files (tokenizer.json, tokenizer_config.json, chat template).

The Qwen3-8B shape (`QWEN3_8B_CONFIG`, Qwen3-8B's config.json): what `decode.py speed` and
`drafter.py scaling` build random-weight targets from (no checkpoint download);
`python benchmarks/_common.py qwen3-8b-config OUT_DIR` writes it as OUT_DIR/config.json.

`python benchmarks/_common.py dedupe FILE` drops the rows of a measurement file that repeat an earlier row exactly.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
from pathlib import Path
from typing import Any, Optional

REPO = Path(__file__).resolve().parent.parent


# The rows' code lives in the library (nemo_dflash.evaluation.rows); the benchmarks import it from here too.
from nemo_dflash.evaluation.rows import (  # noqa: E402,F401
    HEAD_KEYS, append_rows, fold_rows, git_commit, provenance, read_rows, same_row, this_command, upsert_rows,
    write_rows,
)


# Qwen3-8B's config.json (random-weight targets of its shape need no checkpoint).
QWEN3_8B_CONFIG: dict[str, Any] = {
    "architectures": [
        "Qwen3ForCausalLM"
    ],
    "model_type": "qwen3",
    "attention_bias": False,
    "attention_dropout": 0.0,
    "bos_token_id": 151643,
    "eos_token_id": 151645,
    "head_dim": 128,
    "hidden_act": "silu",
    "hidden_size": 4096,
    "initializer_range": 0.02,
    "intermediate_size": 12288,
    "max_position_embeddings": 40960,
    "max_window_layers": 36,
    "num_attention_heads": 32,
    "num_hidden_layers": 36,
    "num_key_value_heads": 8,
    "rms_norm_eps": 1e-06,
    "rope_scaling": None,
    "rope_theta": 1000000,
    "sliding_window": None,
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
    "use_cache": True,
    "use_sliding_window": False,
    "vocab_size": 151936
}


def add_engine_attention_flags(p: argparse.ArgumentParser, scope: str = "") -> None:
    """--fold-gqa and --filled-blocks: the decoding engine's target attention (`EngineOptions.fold_gqa`,
    `EngineOptions.filled_blocks`), for A/B runs; `scope` prefixes their help (which modes they affect)."""
    p.add_argument("--fold-gqa", type=int, default=None, choices=[0, 1],
                   help=f"{scope}the engine's target attention with grouped-query heads folded (1) or HF's SDPA (0); "
                        "default: EngineOptions.fold_gqa (1)")
    p.add_argument("--filled-blocks", type=int, default=None, choices=[0, 1],
                   help=f"{scope}the engine's captured target steps read each row's filled KV blocks only (1: flex) or "
                        "attend over the bucketed view (0: SDPA); default: EngineOptions.filled_blocks (on a GPU)")


def engine_attention_options(args: argparse.Namespace, device: Any, base: Any = None) -> tuple[Any, dict[str, bool]]:
    """The engine options --fold-gqa / --filled-blocks give (over `base`, default `EngineOptions()`), and the
    settings in force on `device`, for the rows."""
    import torch

    from nemo_dflash.engine.options import EngineOptions
    from nemo_dflash.engine.static_cache import filled_blocks_on

    options = base if base is not None else EngineOptions()
    if args.fold_gqa is not None:
        options = options.but(fold_gqa=bool(args.fold_gqa))
    if args.filled_blocks is not None:
        options = options.but(filled_blocks=bool(args.filled_blocks))
    return options, {"fold_gqa": options.fold_gqa,
                     "filled_blocks": filled_blocks_on(torch.device(device), setting=options.filled_blocks)}


def variant_options(text: str) -> dict:
    """"k=v,k=v" -> {k: number}: a draft variant's options (`draft.dflash2.*`), e.g. "selector_rank=0,selector_top_k=0"
    (a part off, to time the rest)."""
    out = {}
    for item in filter(None, text.split(",")):
        key, _, value = item.partition("=")
        out[key.strip()] = float(value) if "." in value else int(value)
    return out


def write_qwen3_8b_config(out: Path) -> Path:
    """Write `QWEN3_8B_CONFIG` as ``out``/config.json; returns ``out``."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(QWEN3_8B_CONFIG, indent=2) + "\n")
    return out


def make_tiny_target(out: Path, tokenizer: Path, layers: int = 8, hidden: int = 128) -> Path:
    """Save a random-weight Llama of ``layers`` x ``hidden`` with the tokenizer in ``tokenizer`` to ``out``."""
    import torch
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    tok = AutoTokenizer.from_pretrained(tokenizer, local_files_only=True)
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=len(tok), hidden_size=hidden, intermediate_size=3 * hidden,
                      num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2,
                      max_position_embeddings=2048, tie_word_embeddings=True,
                      bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    model = LlamaForCausalLM(cfg).to(torch.bfloat16)
    out = Path(out)
    model.save_pretrained(out)
    tok.save_pretrained(out)
    for extra in ("chat_template.jinja", "generation_config.json"):
        if (Path(tokenizer) / extra).exists() and not (out / extra).exists():
            shutil.copy(Path(tokenizer) / extra, out / extra)
    return out


def run_subcommands(tool: str, doc: str, subcommands: dict[str, tuple[Any, str]],
                    argv: Optional[list[str]] = None) -> Any:
    """`TOOL SUBCOMMAND [flags]`: the subcommand's own parser reads the flags (`TOOL SUBCOMMAND --help`).
    `subcommands` maps a name to (its main(argv), its docstring); an unknown name is one line and exit 2."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(f"usage: {tool} {{{','.join(subcommands)}}} [flags]\n\n" + doc.strip() + "\n\nsubcommands:")
        for name, (_, text) in subcommands.items():
            print(f"  {name:<12} {text.strip().splitlines()[0]}")
        return 0 if argv else 2
    if argv[0] not in subcommands:
        print(f"{tool}: unknown subcommand {argv[0]!r} (choose from {', '.join(subcommands)})", file=sys.stderr)
        return 2
    result = subcommands[argv[0]][0](argv[1:])
    return result if isinstance(result, int) else 0


def main(argv: Optional[list[str]] = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="cmd", required=True)
    t = sub.add_parser("tiny-target", help="write a random-weight tiny Llama with a real tokenizer")
    t.add_argument("out")
    t.add_argument("--tokenizer", required=True)
    t.add_argument("--layers", type=int, default=8)
    t.add_argument("--hidden", type=int, default=128)
    q = sub.add_parser("qwen3-8b-config", help="write Qwen3-8B's config.json into a directory")
    q.add_argument("out")
    d = sub.add_parser("dedupe", help="drop the rows of a measurement file that repeat an earlier row exactly")
    d.add_argument("path")
    args = p.parse_args(argv)
    if args.cmd == "tiny-target":
        make_tiny_target(Path(args.out), Path(args.tokenizer), args.layers, args.hidden)
    elif args.cmd == "dedupe":
        rows = read_rows(Path(args.path))
        kept = fold_rows(rows, same_row)
        if len(kept) != len(rows):
            write_rows(Path(args.path), kept)
        print(f"{args.path}: {len(rows)} rows -> {len(kept)}")
    else:
        write_qwen3_8b_config(Path(args.out))


if __name__ == "__main__":
    main()
