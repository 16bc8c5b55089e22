r"""Regenerate chat data with the target model's own answers: the data a DFlash draft trains on.

    python -m nemo_dflash.recipes.regenerate --target /models/Qwen3-8B --data sharegpt \
        --out data/regen.jsonl --num-samples 20000 --max-new-tokens 2048 --batch-size 64 --holdout 200
    python -m nemo_dflash.recipes.regenerate --target pkg:smollm2 --data sharegpt \
        --out regen.jsonl --num-samples 32 --max-new-tokens 96 --batch-size 16

    torchrun --nproc-per-node 8 -m nemo_dflash.recipes.regenerate --target /models/Qwen3-8B \
        --data sharegpt --data magpie=data/magpie.jsonl@2 --data code --out data/regen.jsonl --samples-per-prompt 2
    python -m nemo_dflash.recipes.regenerate --config qwen3_8b.yaml --out data/regen.jsonl regenerate.seed=1

Reads prompt sources (--data [NAME=]SOURCE[@WEIGHT], repeatable: ShareGPT/OpenAI files or the
built-ins sharegpt, chitchat, gsm_symbolic, code; docs/data.md), drops prompts that share a 13-gram
with the evaluation prompts, shuffles them with --seed, takes the first --num-samples usable ones
(each --samples-per-prompt times) and replaces their assistant turns with the target's answers.
Writes OpenAI-layout JSONL, one conversation a line:
    {"messages": [{"role": ..., "content": ...}, ...], "finish_reason": "stop"|"length", "source": "file:line",
     "dataset": NAME}
Under torchrun the ranks take conversations from one shared queue (the longest first) into
their own journals, and rank 0 merges them into the file a single process writes.
The output is written to OUT.partial and renamed when complete; rerunning the same command
after an interruption continues the partial file. --holdout N writes the prompts (no answers) of
N further conversations to OUT_STEM.holdout.jsonl, for evaluation (`evaluate --datasets`).
"""

from __future__ import annotations

import logging
import os
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any, Optional, Sequence

from nemo_dflash.data.journals import check_world, clear_journals, rank_files
from nemo_dflash.data.sources import DataError
from nemo_dflash.files import OutputError, WriteFailed, guard_outputs, write_jsonl_atomic
from nemo_dflash.recipes import _regen_args as flags
from nemo_dflash.recipes._cli import dist_env, parse_with_recipe, set_threads, setup_logging, user_errors

logger = logging.getLogger("nemo_dflash.regenerate")


def build_parser() -> Any:
    """The command's flags (`recipes/_regen_args.py`), each a key of the recipe's `regenerate` section."""
    return flags.build_parser(__doc__ or "")


def main(argv: Optional[Sequence[str]] = None) -> dict[str, Any]:
    args = parse_with_recipe(build_parser(), argv)  # --config RECIPE: its `regenerate` section, flags winning
    setup_logging()
    flags.validate(args)
    set_threads(args.threads)
    rank, world, local_rank = dist_env()
    device, dtype = flags.check_launch(args, world, local_rank)
    from nemo_dflash.data.selection import holdout_path

    wall0 = time.perf_counter()
    out = Path(args.out)
    files = rank_files(out, rank, world)
    held = holdout_path(out) if args.holdout else None
    # every file this run writes, checked at once: never an input, replaced only with --overwrite, writable
    with user_errors(OutputError, DataError, OSError):
        guard_outputs(flags.output_places(args, files, held, world), flags.input_places(args), args.overwrite)
    lock = flags.lock_output(files["lock"], out)
    try:
        with user_errors(DataError, WriteFailed):  # a journal that cannot continue, a full disk: one line
            return _run(args, out, files, held, rank, world, local_rank, device, dtype, wall0)
    finally:
        lock.release(remove=True)


def _prepare(args: Any, out: Path, files: dict[str, Path], rank: int, world: int, local_rank: int, device: str,
             dtype: str) -> SimpleNamespace:
    """The server checked, the sources read, the target loaded and fitted, the conversations chosen."""
    from nemo_dflash.data.selection import check_shares, choose_conversations, read_sources
    from nemo_dflash.data.workers import default_workers
    from nemo_dflash.recipes import _regen_target as target

    check_world(out, world, rank, args.overwrite)
    server = None
    if args.backend == "openai":  # the endpoint checked before anything is read, removed or sent
        from nemo_dflash.recipes._regen_server import connect_server

        server = connect_server(args)
    if args.overwrite:
        clear_journals(files, world)
    workers = default_workers(int(os.environ.get("LOCAL_WORLD_SIZE", "1")))  # every rank on the host reads
    with user_errors(FileNotFoundError):  # ... or `--data sharegpt` without its package
        pool, dataset, report = read_sources(args.data, args.max_bad_lines, decontaminate=args.decontaminate == "on",
                                             seed=args.seed, eval_files=args.eval_file, workers=workers)
    capped = args.max_minutes is not None
    if args.batch_size != "auto":  # before the target loads (auto is known once it has)
        check_shares(report, args.batch_size, capped=capped)
    modes = flags.reasoning_modes(args.reasoning, args.target)
    group = world > 1 and "MASTER_ADDR" in os.environ
    device = target.join_ranks(device, local_rank, world, group)
    model, tokenizer = target.load_model(args, server, device, dtype)
    max_prompt = target.fit_model(args, model, served=server is not None)
    check_shares(report, args.batch_size, capped=capped)
    train, holdout, skipped = choose_conversations(
        pool, tokenizer, dataset, modes, num_samples=args.num_samples, holdout=args.holdout,
        samples_per_prompt=args.samples_per_prompt, seed=args.seed, turns=args.turns, max_prompt_tokens=max_prompt,
        workers=workers, target=args.target)
    weights = {r["name"]: r["weight"] for r in report} if capped and len(report) > 1 else None
    return SimpleNamespace(server=server, dataset=dataset, report=report, modes=modes, group=group, model=model,
                           tokenizer=tokenizer, max_prompt=max_prompt, train=train, holdout=holdout, skipped=skipped,
                           weights=weights)


def _run(args: Any, out: Path, files: dict[str, Path], held: Optional[Path], rank: int, world: int,
         local_rank: int, device: str, dtype: str, wall0: float) -> dict[str, Any]:
    """The run, once its outputs are checked and locked."""
    from nemo_dflash.data import regen_run, regen_stats
    from nemo_dflash.data.regenerate import RegenStats, regenerate_conversations

    job = _prepare(args, out, files, rank, world, local_rank, device, dtype)
    sampling, sampling_from = flags.resolve_sampling(args, job.model)
    logger.info("sampling: %s (%s)", sampling.label, sampling_from)
    settings = flags.resume_settings(args, job.report, job.max_prompt, sampling,
                                     job.model.endpoint.model if job.server is not None else None)
    order = {c.location: i for i, c in enumerate(job.train)}
    done = regen_run.open_journals(out, files, settings, job.train, rank=rank, world=world,
                                   overwrite=args.overwrite, group=job.group)
    plan = regen_run.plan_ranks(job.train, done, job.modes, schedule=args.schedule, turns=args.turns,
                                batch_size=args.batch_size, prepare_ahead=args.prepare_ahead,
                                mix_weights=job.weights, dataset=job.dataset, rank=rank, world=world, group=job.group)
    stats = RegenStats()
    bar, progress = regen_run.progress_bar(stats, None if plan.queues else len(plan.todo), rank)
    t0 = time.perf_counter()
    budget_s = None if args.max_minutes is None else args.max_minutes * 60.0
    mix = regen_run.engine_mix(job.weights, job.dataset, max_new_tokens=args.max_new_tokens,
                               queued=bool(plan.queues), world=world)
    generate: Any = regenerate_conversations
    if job.server is not None:  # the same arguments, the answers from the server
        from nemo_dflash.data.openai_backend import regenerate_on_server as generate
    with user_errors(ValueError):  # the engine cannot run this target (checked at the call)
        records = regen_run.regenerate_in_modes(
            generate, job.modes, job.model, job.tokenizer, plan.todo, max_new_tokens=args.max_new_tokens,
            sampling=sampling, batch_size=args.batch_size, turns=args.turns, seed=args.seed,
            max_prompt_tokens=job.max_prompt, engine=args.engine, loops=args.loops, capped=args.capped,
            after_cut=args.after_cut, prepare_ahead=args.prepare_ahead, schedule=plan.schedule, stats=stats,
            progress=progress, **({"mix": mix} if mix is not None else {}),
            # once the budget is spent no new conversation or turn starts; the complete ones are written
            should_stop=lambda: budget_s is not None and time.perf_counter() - wall0 >= budget_s)
    regen_run.append_records(records, files["partial"], job.dataset, on_error=bar.close)
    bar.close()
    if stats.halted:
        logger.warning("--max-minutes %.1f reached: finishing %s with the conversations done (%d this run)",
                       args.max_minutes, files["done"], stats.written)
    mine = regen_stats.rank_stats(stats, todo=plan.claimed(), rank=rank, regenerate_seconds=time.perf_counter() - t0)
    parts, idle = regen_run.finish_journals(out, files, order, mine, rank=rank, world=world, group=job.group)
    if parts is None:
        logger.warning("rank %d: %d conversations written to %s; rank 0 merges", rank, stats.written, files["done"])
        return {"shard": str(files["done"]), **mine, "idle_seconds": idle[rank]}
    sampled = {"temperature": sampling.temperature, "top_p": sampling.top_p, "from": sampling_from}
    return _summarise(args, out, held, job, parts, idle, sampled, wall0, interleaved=mix is not None, stats=stats)


def _summarise(args: Any, out: Path, held: Optional[Path], job: SimpleNamespace, parts: list[dict[str, Any]],
               idle: list[Optional[float]], sampling: dict[str, Any], wall0: float, *, interleaved: bool,
               stats: Any) -> dict[str, Any]:
    """The holdout file, the run's summary (and its data report) and the closing log lines."""
    from nemo_dflash.data import regen_stats
    from nemo_dflash.data.selection import holdout_record

    if held is not None:
        write_jsonl_atomic(held, [holdout_record(c, args.turns) for c in job.holdout])
    total = regen_stats.combine(parts)
    ranks_detail, imbalance = regen_stats.rank_balance(parts, idle)
    for d in ranks_detail:
        logger.info("rank %d: %d conversations, %d turns, %d generated tokens, %.1fs generating, %s idle at the "
                    "final barrier", d["rank"], d["conversations"], d["turns"], d["generated_tokens"],
                    d["generate_seconds"], "-" if d["idle_seconds"] is None else f"{d['idle_seconds']:.1f}s")
    with open(out, encoding="utf-8") as f:
        written = sum(1 for _ in f)
    wall = time.perf_counter() - wall0
    summary = regen_stats.run_summary(
        total, written=written, report=job.report, select_skipped=job.skipped, wall=wall,
        ranks_detail=ranks_detail, imbalance=imbalance, sampling=sampling,
        flags={"out": str(out), "ranks": len(idle), "holdout": str(held) if held is not None else None,
               "holdout_written": len(job.holdout), "samples_per_prompt": args.samples_per_prompt,
               "decontaminate": args.decontaminate, "engine": args.engine, "backend": args.backend,
               "server": job.model.summary() if job.server is not None else None, "loops": args.loops,
               "capped": args.capped, "after_cut": args.after_cut, "reasoning": args.reasoning})
    regen_stats.add_data_report(summary, out, job.report, job.tokenizer, interleaved=interleaved)
    if args.summary_json:
        write_jsonl_atomic(Path(args.summary_json), [summary])
    logger.info("%s", stats.summary())
    logger.info("wrote %d conversations to %s%s in %.1fs (regeneration %.1fs: %.2f conv/s, %.1f tokens/s; "
                "%.1f tokens/s end to end)", written, out, f" and {len(job.holdout)} held-out prompts to {held}"
                if held else "", wall, total["regenerate_seconds"], summary["conversations_per_s"],
                summary["tokens_per_s"], summary["end_to_end_tokens_per_s"])
    return summary


if __name__ == "__main__":
    main()
