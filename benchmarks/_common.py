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
import datetime
import json
import os
import shutil
import shlex
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any, Callable, Iterable, Optional

REPO = Path(__file__).resolve().parent.parent


def git_commit(repo: Path = REPO) -> Optional[str]:
    """Short hash of the checkout that ran, with '+dirty' when tracked files differ from it. A tree copied to
    another machine names its commit in a `.commit` file, which wins: the copy's own git state (absent, or
    the state the copy was made from) does not know the commit the tree holds."""
    marker = repo / ".commit"
    if marker.is_file():
        return marker.read_text().strip() + " (copied tree)"
    try:
        head = subprocess.run(["git", "-C", str(repo), "rev-parse", "--short", "HEAD"], capture_output=True,
                              text=True, check=True).stdout.strip()
        dirty = subprocess.run(["git", "-C", str(repo), "status", "--porcelain", "--untracked-files=no"],
                               capture_output=True, text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return None
    return head + ("+dirty" if dirty else "")


def this_command() -> str:
    """The command line that is running, as a user would type it (under torchrun, as torchrun)."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    launcher = ["torchrun", "--nproc-per-node", str(world)] if world > 1 else ["python"]
    return " ".join(shlex.quote(a) for a in [*launcher, *sys.argv])


def provenance(device: str, command: Optional[str] = None) -> dict[str, Any]:
    """The four keys every row starts with."""
    return {"date": datetime.datetime.now(datetime.timezone.utc).date().isoformat(), "commit": git_commit(),
            "device": device, "command": command or this_command()}


def read_rows(path: Path) -> list[dict[str, Any]]:
    """The rows already in `path` ([] when it does not exist); anything but a list of rows is refused."""
    if not path.is_file():
        return []
    rows = json.loads(path.read_text())
    if not isinstance(rows, list) or not all(isinstance(r, dict) for r in rows):
        print(f"{path} is not a list of rows: give another path, or convert it to rows first", file=sys.stderr)
        raise SystemExit(2)
    return rows


def _check_heads(rows: list[dict[str, Any]]) -> None:
    for r in rows:
        missing = [k for k in ("date", "commit", "device", "command") if k not in r]
        if missing:
            raise ValueError(f"row without {missing}")


def write_rows(path: Path, rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Replace `path` with `rows`, atomically (temp file, then os.replace); returns `rows`."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w") as f:
            f.write(json.dumps(rows, indent=1, default=str) + "\n")
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return rows


def append_rows(path: Path, rows: Iterable[dict[str, Any]]) -> list[dict[str, Any]]:
    """Append `rows` to the list in `path`; returns the whole list as written."""
    new = list(rows)
    _check_heads(new)
    return write_rows(path, read_rows(Path(path)) + new)


HEAD_KEYS = ("date", "commit", "device", "command")


def fold_rows(rows: Iterable[dict[str, Any]], key: Callable[[dict[str, Any]], Any]) -> list[dict[str, Any]]:
    """One row per key: a later row of a key already seen is merged into it (its measured values win, a value it
    left null keeps the earlier one) and the merged row takes the later row's place, so dates still never go back.
    The earlier rows' provenance is kept under `merged_rows`; a later row that only repeats the earlier one is
    dropped. Rows whose key is None are never merged."""
    out: list[Optional[dict[str, Any]]] = []
    at: dict[Any, int] = {}
    for row in rows:
        k = key(row)
        if k is not None and k in at:
            old = out[at[k]]
            if all(old.get(f) == v for f, v in row.items() if v is not None):
                continue  # it repeats the earlier row: nothing to merge, the earlier row stays where it is
            out[at[k]] = None
            earlier = [*old.get("merged_rows", []), {h: old.get(h) for h in HEAD_KEYS}]
            row = {**{f: v for f, v in old.items() if f != "merged_rows"},
                   **{f: v for f, v in row.items() if v is not None}, "merged_rows": earlier}
        if k is not None:
            at[k] = len(out)
        out.append(row)
    return [r for r in out if r is not None]


def same_row(row: dict[str, Any]) -> str:
    """The key under which two rows are one: every key and value (a row repeated exactly folds into one)."""
    return json.dumps(row, sort_keys=True, default=str)


def upsert_rows(path: Path, rows: Iterable[dict[str, Any]], key: Callable[[dict[str, Any]], Any]) -> list[dict[str, Any]]:
    """Append `rows` to `path`, a row of a key already there merged into that row (`fold_rows`): a second
    measurement of one thing updates its row instead of adding a duplicate."""
    new = list(rows)
    _check_heads(new)
    return write_rows(path, fold_rows(read_rows(Path(path)) + new, key))


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
