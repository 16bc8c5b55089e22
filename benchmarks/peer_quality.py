"""Drafter quality side by side with a peer trainer (SpecForge's DFlash), at equal data and steps.

    python benchmarks/peer_quality.py --stage train --peer-src /path/to/SpecForge --target SmolLM2.gguf \
        --data regen.jsonl --out OUT [--json docs/bench/peer_quality.json] [--steps 800] [--minutes 7]
    python benchmarks/peer_quality.py --stage eval --target SmolLM2.gguf --out OUT [--json ...] \
        [--eval-protocol paper] [--eval-args "--num-prompts 10 --decode graphs --workers 8 --no-speedup"]
    (--stage all, the default, does both in one process)
    python benchmarks/peer_quality.py stage SPECFORGE_CHECKOUT [DEST]

`stage` copies the peer's python package (specforge/, version.txt, LICENSE; 2 MB) and its commit into DEST
(default outputs/peer_src/SpecForge, an ignored path: never committed), so that it can travel to a GPU machine
that cannot clone it. A train/eval/all run installs the wheels in .whl/ first when omegaconf or torchdata is
missing (the peer itself needs no extra package), and writes its output to OUT/peer_quality_STAGE.log as well.

Two drafts of the same shape are trained on the same regenerated data (a JSONL written by
`python -m nemo_dflash.recipes.regenerate`), then scored the same way:

* **ours**: `python -m nemo_dflash.recipes.train --config RECIPE key=value ...` (a subprocess, the
  public entry point), with `train.max_steps=N`, held-out evaluation and a checkpoint every
  `--eval-every` steps.
* **the peer**: SpecForge's own DFlash training step, imported from `--peer-src` (never copied into
  this repository): its draft class (`specforge.modeling.draft.dflash.DFlashDraftModel`, built from a
  draft config JSON in SpecForge's `configs/*.json` layout through its own
  `load_draft_config_source` + `AutoDraftModel.from_config`), its training wrapper
  (`OnlineDFlashModel`: anchor sampling, mask construction, labels, loss with decay, chunked
  logits), its step (`TrainerCore.train_step` -> `DFlashTrainStrategy.forward_loss` ->
  gradient normalisation by the global loss denominator -> `FSDPTrainingBackend.step`), its
  optimizer (`BF16Optimizer`: bf16 parameters, fp32 master copies, AdamW betas (0.9, 0.999),
  weight decay 0, clipping, `CosineAnnealingWarmupLR`) and its dtypes (`model.torch_dtype:
  bfloat16` for the draft and the target's embedding/lm_head, as in its example recipes).
  The peer needs nothing beyond torch, transformers, accelerate (psutil) and PyYAML: its
  pydantic/SGLang/wandb/datasets/yunchang imports are not on this path.

What is the same for both: the recipe's draft shape (layers, block size, target layers, mask token,
hidden/intermediate/heads from the target), anchors per sequence (`loss.num_anchors`), loss decay
gamma, sequence length, the global batch (the same loader, `nemo_dflash.data.build_dataloader` with
the recipe's seed: the same rows in the same order, each micro-batch trimmed to its longest row),
the number of steps N and the schedule (lr, 4% warmup, cosine to 0 over N steps, clip). The peer
keeps its own defaults where they are part of its recipe (see "peer recipe" in the JSON).

What is substituted in the peer, and why (also written to the JSON under peer.substitutions):

1. Target features. SpecForge's online mode captures them in an SGLang server (or its offline
   capture); neither runs here. The peer gets `hidden_states` [B, S, 5*H] from our hook wrapper
   `nemo_dflash.target.HFDFlashTargetModel` (output of target layer i == `hidden_states[i + 1]`, the
   same capture semantics, the layers concatenated in `target_layer_ids` order, as SpecForge's
   `extract_context_feature` does), run on the same frozen target (compiled when the recipe says
   `train.compile_target`, so both trainers pay the same target cost).
2. Target embedding and lm_head. `TargetEmbeddingsAndHead.from_pretrained` reads safetensors from
   an HF directory or the hub; the target here may be a .gguf. The peer's own class
   `TargetEmbeddingsAndHead(target_config)` is built and its two tables are copied from the loaded
   target, then cast to bf16 and frozen as `from_pretrained` does.
3. Tokenisation / loss mask / data loader. SpecForge's template-driven preprocessing and its
   FeatureDataLoader are replaced by our tokenised batches (input_ids, loss_mask on assistant
   tokens), so that both trainers see exactly the same tokens and supervision in the same order.
4. Distribution. SpecForge's `Trainer` wraps the model in FSDP1 (SHARD_GRAD_OP, bf16
   MixedPrecision) even at world size 1; here `FSDPTrainingBackend.prepare_model(wrap=False)` is used
   (no process group). With one rank and parameters already in bf16, FSDP's sharding and
   mixed precision are identities: same forward, same bf16 gradients, same BF16Optimizer step.
5. Attention backend: SpecForge's default `flex_attention` on GPU. flex_attention has no backward
   on CPU, so a CPU run uses SpecForge's `sdpa` path (`--peer-attn` to choose).
Nothing in the peer checkout is edited and no peer code is monkeypatched (none was needed).

Scoring (one implementation for both):

* held-out simulated acceptance (tau): the very method our trainer logs as `eval_accept_len`,
  `nemo_dflash.train.trainer.Trainer.evaluate`, on one evaluator `Trainer` built from the same recipe
  (same held-out conversations, same batches, same fixed anchor seeds). Each draft's weights are
  loaded into the evaluator's draft and `evaluate(train.eval_batches)` is called. Curves: every
  `--eval-every` steps, from our checkpoints (`checkpoints/step_N/draft`) and from in-memory
  snapshots of the peer's draft (taken outside the timed step).
* real tau: `python -m nemo_dflash.recipes.evaluate` on the two exported drafts, same flags.

Export / conversion: ours with `python -m nemo_dflash.recipes.export`. The peer's draft is written
with SpecForge's own writer (`DFlashDraftModel.save_pretrained`, what its `specforge.export.to_hf`
ends with; a DFlash draft owns no embedding), which is already the z-lab DFlash layout (unprefixed
`fc.weight`, `layers.{i}...`; config `DFlashDraftModel` / `dflash_config`); our
`python -m nemo_dflash.recipes.export` then reads it (config keys it does not know are dropped, the
weight names and shapes are checked against the serving contract) and writes config.json + bf16
model.safetensors. If our loader ever refuses SpecForge's config.json, the script falls back to our
serving config.json (same shape, mask, layers) next to SpecForge's weights, and says so in the JSON.

Steps and time: `--steps N` for both (the same cosine schedule over N). `--minutes M` caps the train
stage's wall time from its start to the end of the peer's training (default 7, so that the stage,
with its start-up, curve evaluations and exports, fits one 10-minute GPU command): ours runs with
`train.max_minutes = M * --ours-share`; the peer trains for as many steps as ours did and, if it
would pass the cap, stops at a curve point. If either stops early, both are compared at the common
step (ours from its checkpoint at that step; both schedules were planned for N, so both are cut the
same way) and the JSON says so (checks.peer_stopped / checks.ours_stopped); re-run with a smaller
--steps for complete schedules. steps/s: the median of `--log-every`-step windows after the first
(compile) window, for each trainer; the peer's step includes its target forward through our hook
wrapper, as ours does.

Output: `--json` (default OUT/peer_quality.json, the working file both stages update): {"peer": {name, version (commit), steps, tau_t0,
tau_t1, sim_tau, steps_per_s, recipe, substitutions, conversion, real_tau}, "ours": {...}, "device",
"protocol", "curves": [{step, ours, peer, ours_in_trainer}], "checks"}, a printed table,
OUT/curves.png, and every log under OUT/logs. tau_tX is the mean over datasets of evaluate's
mean_acceptance_length at temperature X; if an evaluation is partial, `tau_common_answers` compares
the two drafts on the answers both produced. The eval stage can be re-run to continue (evaluate
resumes from its answers.jsonl), also one draft at a time (`--which ours|peer`). `--bench-json
docs/bench/peer_quality.json` appends the result there as a row {date, commit, device, command, ...}.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import os
import platform
import shlex
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Optional

logger = logging.getLogger("peer_quality")
REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # nemo_dflash from this checkout, as the other benchmarks do


# ----------------------------------------------------------------------------- small helpers


def _git(path: Path, *args: str) -> Optional[str]:
    try:
        out = subprocess.run(["git", "-C", str(path), *args], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip() if out.returncode == 0 else None


def _git_commit(path: Path, dirty_mark: bool = False) -> Optional[str]:
    """HEAD of the repository whose top level is `path` (not of an enclosing repository)."""
    top = _git(path, "rev-parse", "--show-toplevel")
    if not top or Path(top).resolve() != path.resolve():
        return None
    commit = _git(path, "rev-parse", "HEAD")
    if commit and dirty_mark and _git(path, "status", "--porcelain", "--untracked-files=no"):
        commit += "+dirty"  # the tracked files differ from the commit
    return commit


def peer_version(peer_src: Path) -> dict[str, Optional[str]]:
    """The peer's commit: a COMMIT file (`peer_quality.py stage` writes one), else the checkout's HEAD."""
    commit = None
    if (peer_src / "COMMIT").is_file():
        commit = (peer_src / "COMMIT").read_text().strip() or None
    commit = commit or _git_commit(peer_src)
    vt = peer_src / "version.txt"
    return {"commit": commit, "version_txt": vt.read_text().strip() if vt.is_file() else None}


def _median_rate(step_times: list[float]) -> Optional[float]:
    return 1.0 / statistics.median(step_times) if step_times else None


def _run(cmd: list[str], log: Path, env: Optional[dict] = None, append: bool = False) -> tuple[int, float]:
    """Run a subprocess with its output in `log`; (return code, wall seconds)."""
    log.parent.mkdir(parents=True, exist_ok=True)
    logger.info("$ %s  (log: %s)", " ".join(shlex.quote(c) for c in cmd), log)
    t0 = time.perf_counter()
    with open(log, "a" if append else "w") as f:
        rc = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, env=env, cwd=str(REPO)).returncode
    wall = time.perf_counter() - t0
    if rc != 0:
        tail = log.read_text().splitlines()[-30:]
        logger.error("command failed (rc %d); last lines of %s:\n%s", rc, log, "\n".join(tail))
    return rc, wall


def _read_jsonl(path: Path) -> list[dict]:
    if not path.is_file():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


# ----------------------------------------------------------------------------- the evaluator


class SharedEvaluator:
    """One `nemo_dflash.train.trainer.Trainer` built from the benchmark's recipe, never trained.

    It holds the frozen target (hook wrapper), the training loader (the order ours trains in), the
    held-out set, and a draft whose weights are swapped in before each call of its own `evaluate()`,
    the method that logs `eval_accept_len` during training.
    """

    def __init__(self, cfg) -> None:
        from nemo_dflash.train.trainer import Trainer

        self.cfg = cfg
        self.trainer = Trainer(cfg)
        t = self.trainer
        self.device = getattr(t, "device", None) or t.state.device
        self.draft = t.draft
        self.target = t.target
        self.loader = t.loader
        self.init_state = {k: v.detach().to("cpu", copy=True) for k, v in self.draft.state_dict().items()}

    def keys(self) -> set[str]:
        return set(self.draft.state_dict().keys())

    def sim_tau(self, state: dict[str, Any]) -> dict[str, float]:
        import torch

        own = self.draft.state_dict()
        extra, missing = set(state) - set(own), set(own) - set(state)
        if extra or missing:
            raise KeyError(f"weights do not match our draft: unexpected {sorted(extra)[:5]}, missing {sorted(missing)[:5]}")
        with torch.no_grad():
            for k, p in own.items():
                p.copy_(state[k].to(device=p.device, dtype=p.dtype))
        return self.trainer.evaluate(self.cfg.train.eval_batches)


# ----------------------------------------------------------------------------- the peer


def peer_draft_config_dict(our_draft_config, attn: str) -> dict[str, Any]:
    """A draft config in SpecForge's configs/*-dflash.json layout with our draft's exact shape."""
    from nemo_dflash.serving.export import serving_config_dict

    s = serving_config_dict(our_draft_config)
    n = int(s["num_hidden_layers"])
    return {
        "architectures": ["DFlashDraftModel"],
        "attention_bias": s["attention_bias"],
        "attention_dropout": 0.0,
        "auto_map": {"AutoModel": "dflash.DFlashDraftModel"},
        "block_size": s["block_size"],
        "dflash_config": dict(s["dflash_config"]),
        "dtype": "bfloat16",
        "head_dim": s["head_dim"],
        "hidden_act": s["hidden_act"],
        "hidden_size": s["hidden_size"],
        "initializer_range": 0.02,  # every SpecForge DFlash config ships 0.02
        "intermediate_size": s["intermediate_size"],
        "layer_types": ["full_attention"] * n,
        "max_position_embeddings": s["max_position_embeddings"],
        "max_window_layers": n,
        "model_type": "qwen3",
        "num_attention_heads": s["num_attention_heads"],
        "num_hidden_layers": n,
        "num_key_value_heads": s["num_key_value_heads"],
        "num_target_layers": s["num_target_layers"],
        "rms_norm_eps": s["rms_norm_eps"],
        "rope_scaling": s.get("rope_scaling"),
        "rope_theta": s["rope_theta"],
        "sliding_window": None,
        "tie_word_embeddings": False,
        "use_cache": True,
        "use_sliding_window": False,
        "vocab_size": s["vocab_size"],
    }


class PeerTrainer:
    """SpecForge's DFlash training step, driven batch by batch."""

    def __init__(self, ev: SharedEvaluator, cfg, out: Path, attn: str, total_steps: int, micro_batch: int) -> None:
        import torch

        from specforge.algorithms.common.dflash_family_model import OnlineDFlashModel
        from specforge.algorithms.dflash.providers import build_step
        from specforge.modeling.auto import AutoDraftModel
        from specforge.modeling.target.target_utils import TargetEmbeddingsAndHead
        from specforge.optimizer import BF16Optimizer
        from specforge.training.backend import FSDPTrainingBackend, ParallelConfig
        from specforge.training.model_loading import load_draft_config_source

        self.torch = torch
        self.cfg, self.ev, self.device = cfg, ev, ev.device
        self.dtype = torch.bfloat16  # SpecForge's model.torch_dtype default and its DFlash examples
        self.total_steps = total_steps
        self.attn = attn
        ours = ev.draft.config
        # the draft config file, as a SpecForge user writes it (configs/*-dflash.json)
        out.mkdir(parents=True, exist_ok=True)
        self.config_path = out / "draft_config.json"
        self.config_path.write_text(json.dumps(peer_draft_config_dict(ours, attn), indent=2) + "\n")
        draft_config = load_draft_config_source(str(self.config_path))
        # == specforge.algorithms.model_providers.build_dflash_draft, without a Config object
        draft_config._attn_implementation = attn
        torch.manual_seed(cfg.train.seed)
        draft = AutoDraftModel.from_config(draft_config, torch_dtype=self.dtype)
        self.draft = draft.to(device=self.device, dtype=self.dtype)
        self._check_shape()
        # target embedding + lm_head: SpecForge's class, tables copied from the loaded target
        target_model = ev.target.model
        heads = TargetEmbeddingsAndHead(target_model.config)
        with torch.no_grad():
            heads.embed_tokens.weight.copy_(ev.target.get_input_embeddings().weight)
            heads.lm_head.weight.copy_(ev.target.get_output_embeddings().weight)
        heads.to(device=self.device, dtype=self.dtype).eval().requires_grad_(False)
        self.heads = heads
        mask_id = int(ours.mask_token_id)
        # == specforge.algorithms.model_providers._build_dflash_family_model (its defaults:
        # objective_chunk_blocks 128, loss_type dflash)
        self.model = OnlineDFlashModel(
            draft_model=self.draft, target_lm_head=heads.lm_head, target_embed_tokens=heads.embed_tokens,
            mask_token_id=mask_id, block_size=int(self.draft.block_size), attention_backend=attn,
            num_anchors=int(cfg.loss.num_anchors), loss_decay_gamma=cfg.loss.gamma, objective_chunk_blocks=128,
            loss_type="dflash",
        ).to(device=self.device, dtype=self.dtype)
        self.draft.mask_token_id = mask_id
        # == specforge.training.assembly._ConfiguredOptimizerFactory
        if cfg.optim.scheduler not in ("cosine", "constant"):
            raise ValueError(f"SpecForge has cosine and constant schedules, not {cfg.optim.scheduler!r}")
        self.optimizer_settings = dict(lr=float(cfg.optim.lr), max_grad_norm=float(cfg.optim.grad_clip),
                                       warmup_ratio=float(cfg.optim.warmup_ratio), lr_scheduler=cfg.optim.scheduler,
                                       total_steps=int(total_steps), offload_master=False)

        def optimizer_factory(module):
            return BF16Optimizer(module, **self.optimizer_settings)

        self.backend = FSDPTrainingBackend(ParallelConfig(), optimizer_factory=optimizer_factory)
        wrapped = self.backend.prepare_model(self.model, wrap=False, optimizer_target=self.model.draft_model)
        self.strategy = build_step(wrapped)  # SpecForge's DFlash provider: DFlashTrainStrategy
        self.global_rows = int(cfg.train.micro_batch_size) * int(cfg.train.grad_accum)
        self.set_micro_batch(micro_batch)

    def set_micro_batch(self, micro_batch: int) -> None:
        from specforge.training.controller import TrainerCore

        if self.global_rows % micro_batch:
            raise ValueError(f"the peer's micro-batch {micro_batch} must divide the global batch {self.global_rows}")
        self.micro_batch = micro_batch
        self.core = TrainerCore(self.strategy, self.backend, accumulation_steps=self.global_rows // micro_batch)

    def _check_shape(self) -> None:
        ours = {k: tuple(v.shape) for k, v in self.ev.draft.state_dict().items()}
        peer = {k: tuple(v.shape) for k, v in self.draft.state_dict().items()}
        if ours != peer:
            diff = sorted(set(ours.items()) ^ set(peer.items()))[:6]
            raise ValueError(f"the peer's draft does not have our draft's shape: {diff}")
        rope = getattr(self.draft.rotary_emb, "inv_freq", None)
        self.peer_inv_freq0 = float(rope.flatten()[1]) if rope is not None and rope.numel() > 1 else None

    def state(self) -> dict[str, Any]:
        return {k: v.detach().to("cpu", copy=True) for k, v in self.draft.state_dict().items()}

    def step(self, step: int, step_batch: dict) -> dict[str, float]:
        """One optimizer step over the loader's global batch, in micro-batches of `self.micro_batch`."""
        from specforge.runtime.contracts import TrainBatch
        from specforge.training.strategies.base import StepContext

        torch = self.torch
        rows = step_batch["input_ids"].shape[0]
        result = None
        n_micro = -(-rows // self.micro_batch)
        if n_micro != self.core.accumulation_steps:  # a short last batch (not with the recipe's loader)
            raise ValueError(f"batch of {rows} rows at step {step}; expected {self.global_rows}")
        for m in range(n_micro):
            part = {k: v[m * self.micro_batch:(m + 1) * self.micro_batch] for k, v in step_batch.items()}
            length = max(int(part["attention_mask"].sum(dim=1).max()), 1)  # as our trainer trims
            part = {k: v[:, :length].contiguous() for k, v in part.items()}
            am = part["attention_mask"].bool()
            right_padded = bool((am[:, 1:] <= am[:, :-1]).all()) if am.shape[1] > 1 else True
            ids = part["input_ids"].to(self.device, non_blocking=True)
            with torch.no_grad():
                hidden, _ = self.ev.target.forward_features(
                    ids, attention_mask=None if right_padded else am.to(self.device).long()
                )
            batch = TrainBatch(
                sample_ids=[f"{step}:{m}:{i}" for i in range(ids.shape[0])], strategy="dflash",
                tensors={"input_ids": ids, "hidden_states": hidden.to(self.dtype),
                         "loss_mask": part["loss_mask"].to(self.device, dtype=torch.float32)},
            )
            result = self.core.train_step(batch, StepContext(global_step=step, total_steps=self.total_steps))
        assert result is not None and result.optimizer_stepped
        lr = self.backend.optimizer.get_learning_rate()
        return {"loss": float(result.loss if "loss" not in result.metrics else result.metrics["loss"]),
                "accuracy": float(result.metrics.get("acc", float("nan"))),
                "grad_norm": float(result.grad_norm) if result.grad_norm is not None else float("nan"),
                "lr": float(lr)}


# ----------------------------------------------------------------------------- real tau


def tau_from_results(path: Path) -> dict[str, Any]:
    """tau per temperature and dataset from evaluate's results.json; tau_tX = the mean over datasets."""
    if not path.is_file():
        return {}
    r = json.loads(path.read_text())
    out: dict[str, Any] = {"complete": r.get("complete"), "by_dataset": {}}
    for temp, per_ds in (r.get("results") or {}).items():
        t = f"t{float(temp):g}" if "," not in temp else "t" + temp.replace(",", "_")  # "0.2,p0.9": filtered
        taus = {}
        for ds, res in per_ds.items():
            taus[ds] = {"tau": res.get("mean_acceptance_length"), "answers": res.get("answers"),
                        "tau_first256": res.get("mean_acceptance_length_first256"), "loop_share": res.get("loop_share")}
        out["by_dataset"][t] = taus
        vals = [v["tau"] for v in taus.values() if v["tau"] is not None]
        out[f"tau_{t}"] = sum(vals) / len(vals) if vals else None
    out["protocol"] = r.get("protocol")
    return out


def common_answer_taus(a: Path, b: Path) -> dict[str, Any]:
    """Per temperature and dataset: mean per-answer tau of each draft over the answers both produced."""
    if not (a.is_file() and b.is_file()):
        return {}
    ra, rb = json.loads(a.read_text()), json.loads(b.read_text())
    out: dict[str, Any] = {"ours": {}, "peer": {}}
    for temp, per_ds in (ra.get("results") or {}).items():
        for ds, res in per_ds.items():
            other = ((rb.get("results") or {}).get(temp) or {}).get(ds) or {}
            pa = {(x["id"], x.get("turn")): x.get("acceptance_length") for x in res.get("per_answer") or []}
            pb = {(x["id"], x.get("turn")): x.get("acceptance_length") for x in other.get("per_answer") or []}
            keys = [k for k in pa if k in pb and pa[k] is not None and pb[k] is not None]
            if not keys:
                continue
            tag = (f"t{float(temp):g}" if "," not in temp else "t" + temp.replace(",", "_")) + f"/{ds}"
            out["ours"][tag] = {"tau": sum(pa[k] for k in keys) / len(keys), "answers": len(keys)}
            out["peer"][tag] = {"tau": sum(pb[k] for k in keys) / len(keys), "answers": len(keys)}
    return out


# ----------------------------------------------------------------------------- main


def stage_peer(argv: list[str]) -> int:
    """`stage CHECKOUT [DEST]`: copy the peer's package, version, licence and commit into DEST."""
    import shutil

    p = argparse.ArgumentParser(prog="peer_quality.py stage", description="copy SpecForge's python package and "
                                "its commit into DEST, to travel to a machine that cannot clone it")
    p.add_argument("checkout", type=Path, help="a SpecForge checkout")
    p.add_argument("dest", type=Path, nargs="?", default=Path("outputs/peer_src/SpecForge"))
    args = p.parse_args(argv)
    src, dest = args.checkout, args.dest
    if not (src / "specforge" / "algorithms" / "common" / "dflash_family_model.py").is_file():
        print(f"{src} is not a SpecForge checkout", file=sys.stderr)
        return 2
    try:
        commit = subprocess.run(["git", "-C", str(src), "rev-parse", "HEAD"], capture_output=True, text=True,
                                check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError) as e:
        print(f"{src}: no git commit to record ({type(e).__name__})", file=sys.stderr)
        return 2
    shutil.rmtree(dest, ignore_errors=True)
    dest.mkdir(parents=True)
    shutil.copytree(src / "specforge", dest / "specforge", ignore=shutil.ignore_patterns("__pycache__"))
    for name in ("version.txt", "LICENSE"):
        if (src / name).is_file():
            shutil.copy(src / name, dest / name)
    (dest / "COMMIT").write_text(commit + "\n")
    size = sum(f.stat().st_size for f in dest.rglob("*") if f.is_file())
    print(f"staged SpecForge {commit} in {dest} ({size / 2**20:.1f} MB)")
    return 0


class _Tee:
    """A stream that writes to the console and to a log file (what `| tee -a LOG` did)."""

    def __init__(self, stream, log):
        self.stream, self.log = stream, log

    def write(self, text):
        self.log.write(text)
        self.log.flush()
        return self.stream.write(text)

    def flush(self):
        self.stream.flush()
        self.log.flush()

    def __getattr__(self, name):
        return getattr(self.stream, name)


def prepare_machine(stage: str, out: Path) -> None:
    """Wheels in .whl/ installed when omegaconf or torchdata is missing; quiet, offline subprocesses
    (no progress bar, no wandb, 4 OpenMP threads unless set); this process's output copied to
    OUT/peer_quality_STAGE.log."""
    import importlib.util

    wheels = sorted(str(w) for w in (REPO / ".whl").glob("*.whl"))
    if wheels and not all(importlib.util.find_spec(m) for m in ("omegaconf", "torchdata")):
        subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", *wheels], check=True)
    os.environ.setdefault("OMP_NUM_THREADS", "4")
    os.environ.setdefault("NEMO_DFLASH_NO_BAR", "1")
    os.environ.setdefault("WANDB_MODE", "disabled")
    out.mkdir(parents=True, exist_ok=True)
    log = open(out / f"peer_quality_{stage}.log", "a")
    sys.stdout, sys.stderr = _Tee(sys.stdout, log), _Tee(sys.stderr, log)


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--peer-src", type=Path, default=Path("outputs/peer_src/SpecForge"),
                   help="a checkout of github.com/sgl-project/SpecForge, or the copy `peer_quality.py stage` made "
                        "(train stage; default outputs/peer_src/SpecForge)")
    p.add_argument("--target", required=True, help="target: .gguf, local HF dir or pkg:smollm2")
    p.add_argument("--data", help="regenerated JSONL (python -m nemo_dflash.recipes.regenerate) (train stage)")
    p.add_argument("--out", required=True, type=Path, help="work directory (runs, exports, evaluations, logs)")
    p.add_argument("--json", type=Path, default=None, help="where to write the result JSON (default OUT/peer_quality.json)")
    p.add_argument("--bench-json", type=Path, default=None,
                   help="also append the result as one row {date, commit, device, command, ...} to this list of rows "
                        "(docs/bench/peer_quality.json) once the eval stage has run")
    p.add_argument("--stage", default="all", choices=["all", "train", "eval"],
                   help="train: both trainings, curves, exports (fits one 10-minute slot); eval: our evaluate on the "
                        "two exports, added to the JSON (re-run continues an incomplete evaluation); all: both")
    p.add_argument("--recipe", default="smollm2_135m_gpu.yaml")
    p.add_argument("--steps", type=int, default=800, help="optimizer steps for both trainers (schedule length)")
    p.add_argument("--minutes", type=float, default=7.0,
                   help="wall-time cap from the start of the script to the end of the peer's training")
    p.add_argument("--ours-share", type=float, default=0.45, help="fraction of --minutes that caps our training")
    p.add_argument("--eval-every", type=int, default=100, help="curve points (held-out simulated tau) every N steps")
    p.add_argument("--log-every", type=int, default=10, help="timing windows (steps/s: median window)")
    p.add_argument("--override", "-o", action="append", default=[], metavar="KEY=VALUE",
                   help="recipe override for both trainers and the evaluator (repeatable)")
    p.add_argument("--peer-attn", default="auto", choices=["auto", "flex_attention", "sdpa", "eager"],
                   help="SpecForge attention backend (auto: flex_attention on GPU, its default; sdpa on CPU)")
    p.add_argument("--peer-micro-batch", type=int, default=None,
                   help="rows per peer micro-step (default: the recipe's micro_batch_size; the global batch is kept "
                        "through SpecForge's gradient accumulation). Halved automatically on a CUDA OOM.")
    p.add_argument("--eval-protocol", default="paper", help="evaluate --protocol (paper|quick), or 'none' to skip")
    p.add_argument("--eval-args", default="--num-prompts 10 --decode graphs --workers 8 --no-speedup",
                   help="extra evaluate flags, the same for both drafts")
    p.add_argument("--eval-minutes", type=float, default=6.0,
                   help="evaluate --max-minutes for each draft (an incomplete run continues when the stage is re-run)")
    p.add_argument("--which", default="both", choices=["both", "ours", "peer"],
                   help="eval stage: evaluate only this draft (each evaluate run is resumable)")
    p.add_argument("--device-label", default=None, help="device description for the JSON (default: detected)")
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--skip-ours", action="store_true", help="reuse OUT/ours from an earlier run (debugging)")
    return p.parse_args(argv)


def main(argv=None) -> Any:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["stage"]:
        return stage_peer(argv[1:])
    args = parse_args(argv)
    t_script = time.perf_counter()
    prepare_machine(args.stage, args.out.resolve())
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s", datefmt="%H:%M:%S")
    out: Path = args.out.resolve()
    out.mkdir(parents=True, exist_ok=True)
    json_path = (args.json or out / "peer_quality.json").resolve()
    os.environ.setdefault("WANDB_MODE", "disabled")
    os.environ.setdefault("NEMO_DFLASH_NO_BAR", "1")
    if args.stage in ("all", "train"):
        if args.data is None:
            print("the train stage needs --data (the regenerated JSONL)", file=sys.stderr)
            sys.exit(2)
        result = train_stage(args, out, t_script)
        json_path.parent.mkdir(parents=True, exist_ok=True)
        json_path.write_text(json.dumps(result, indent=1, default=str) + "\n")
        logger.info("wrote %s", json_path)
    else:
        if not json_path.is_file():
            sys.exit(f"{json_path} does not exist: run --stage train first")
        result = json.loads(json_path.read_text())
    if args.stage in ("all", "eval") and args.eval_protocol != "none":
        eval_stage(args, out, result)
        json_path.write_text(json.dumps(result, indent=1, default=str) + "\n")
        logger.info("wrote %s", json_path)
        if args.bench_json is not None:
            from _common import append_rows, provenance
            row = {**provenance(str(result.get("device"))), **{k: v for k, v in result.items() if k != "device"}}
            append_rows(args.bench_json, [row])
            logger.info("appended a row to %s", args.bench_json)
    print_table(result)
    return result


def train_stage(args, out: Path, t_script: float) -> dict[str, Any]:
    peer_src = args.peer_src.resolve()
    if not (peer_src / "specforge" / "algorithms" / "common" / "dflash_family_model.py").is_file():
        sys.exit(f"--peer-src {peer_src} is not a SpecForge checkout (no specforge/algorithms/common/dflash_family_model.py)")
    sys.path.insert(0, str(peer_src))

    import torch
    import transformers

    if args.threads:
        torch.set_num_threads(args.threads)
    from nemo_dflash.config import load_recipe
    from nemo_dflash.serving.export import load_draft

    n_steps, every = int(args.steps), max(1, int(args.eval_every))
    deadline = t_script + args.minutes * 60.0
    common = [f"target.path={args.target}", f"data.sources=[{{path: {os.path.abspath(args.data)}}}]",
              f"train.max_steps={n_steps}", "wandb.mode=disabled", "checkpoint.resume=none", *args.override]

    # 1. the evaluator (target, loader, held-out set) and the peer, before anything long runs
    ev_cfg = load_recipe(args.recipe, [*common, f"output_dir={out / 'evaluator'}"])
    logger.info("building the shared evaluator (%s)", args.recipe)
    ev = SharedEvaluator(ev_cfg)
    cfg = ev_cfg
    cuda = ev.device.type == "cuda"
    attn = args.peer_attn if args.peer_attn != "auto" else ("flex_attention" if cuda else "sdpa")
    if cfg.loss.distill_weight > 0:
        sys.exit("loss.distill_weight > 0: SpecForge's DFlash loss has no distillation term; compare without it")
    # step 0 of our curve now: on GPU this also compiles the evaluator (outside the trainings' timing)
    ours_init_sim = ev.sim_tau(ev.init_state)["eval_accept_len"]
    version = peer_version(peer_src)
    logger.info("peer: SpecForge %s at %s (%s)", version["version_txt"], version["commit"], peer_src)
    peer_dir = out / "peer"
    peer = PeerTrainer(ev, cfg, peer_dir, attn, n_steps, args.peer_micro_batch or int(cfg.train.micro_batch_size))
    keys_ok = set(peer.state()) == ev.keys()
    if not keys_ok:
        sys.exit("the peer's draft weight names differ from ours; the shared evaluator cannot load them")
    for stale in ("eval", "export"):  # results of an earlier training would not describe this one
        if (out / stale).exists():
            import shutil

            shutil.rmtree(out / stale)

    ours_dir = out / "ours"
    # 2. ours, through the public command
    ours_minutes = args.minutes * args.ours_share
    ours_overrides = [*common, f"output_dir={ours_dir}", f"train.max_minutes={ours_minutes:g}",
                      f"train.eval_every={every}", f"train.log_every={args.log_every}",
                      f"checkpoint.every_steps={every}", f"checkpoint.keep_last={n_steps // every + 3}"]
    cmd = [sys.executable, "-m", "nemo_dflash.recipes.train", "--config", args.recipe, *ours_overrides]
    if args.threads:
        cmd += ["--threads", str(args.threads)]
    if not args.skip_ours:
        if ours_dir.exists():
            import shutil

            shutil.rmtree(ours_dir)
        rc, ours_wall = _run(cmd, out / "logs" / "train_ours.log")
        if rc != 0:
            sys.exit("our training failed (see the log above)")
    else:
        ours_wall = float("nan")
    summary = json.loads((ours_dir / "summary.json").read_text())
    ours_metrics = _read_jsonl(ours_dir / "metrics.jsonl")
    ours_steps = int(summary["steps"])
    ours_train_s = float(summary.get("train_seconds") or ours_wall)
    windows = [r["step_s"] for r in ours_metrics if "step_s" in r][1:]  # the first window holds the compile
    ours_rate = _median_rate(windows) or (ours_steps / ours_train_s if ours_train_s else None)
    logger.info("ours: %d steps in %.0f s (%.2f steps/s median window)", ours_steps, ours_train_s, ours_rate or 0)

    # 3. the peer: the same loader (same rows, same order), the same number of steps
    if cuda:
        torch.cuda.empty_cache()
    torch.manual_seed(cfg.train.seed)
    target_steps = ours_steps
    snapshots: dict[int, dict[str, Any]] = {0: peer.state()}
    peer_log = []
    step_times: list[float] = []
    from nemo_dflash.train.trainer import endless_batches  # epoch after epoch, as our trainer iterates

    data = endless_batches(ev.loader)
    t_start = time.perf_counter()
    peer_cap_s = max(deadline - t_start, 60.0)
    logger.info("peer: %d steps, time cap %.0f s", target_steps, peer_cap_s)
    snap_s = 0.0
    stopped = None
    step = 0
    oom_retries = []
    window_t, window_n = time.perf_counter(), 0
    while step < target_steps:
        batch = next(data)
        while True:
            try:
                res = peer.step(step, batch)
                break
            except torch.cuda.OutOfMemoryError:
                if peer.micro_batch == 1:
                    raise
                # nothing was applied yet (the optimizer steps after the last micro-batch): drop this step's
                # gradients and redo it in smaller micro-batches; accumulation keeps the global batch
                peer.model.zero_grad(set_to_none=True)
                torch.cuda.empty_cache()
                logger.warning("peer OOM at step %d with micro-batch %d: redoing the step with %d", step,
                               peer.micro_batch, peer.micro_batch // 2)
                oom_retries.append({"step": step, "micro_batch": peer.micro_batch})
                peer.set_micro_batch(peer.micro_batch // 2)
        if cuda:
            torch.cuda.synchronize()
        step += 1
        window_n += 1
        if step % args.log_every == 0 or step == target_steps:
            dt = time.perf_counter() - window_t
            step_times.append(dt / window_n)
            peer_log.append({"step": step, **res, "step_s": dt / window_n})
            logger.info("peer step %d/%d loss=%.4g acc=%.4g gnorm=%.3g lr=%.3g step_s=%.3f", step, target_steps,
                        res["loss"], res["accuracy"], res["grad_norm"], res["lr"], dt / window_n)
        if step % every == 0 or step == target_steps:
            ts = time.perf_counter()
            snapshots[step] = peer.state()
            snap_s += time.perf_counter() - ts
            elapsed = time.perf_counter() - t_start
            if step < target_steps and elapsed * (step + every) / step > peer_cap_s:
                stopped = f"time cap ({peer_cap_s:.0f} s): stopped at curve point {step}"
                logger.warning("peer: %s; both drafts are compared at step %d (for complete schedules re-run "
                               "with --steps about %d)", stopped, step, step)
                break
        if step % args.log_every == 0:
            window_t, window_n = time.perf_counter(), 0
    peer_train_s = time.perf_counter() - t_start - snap_s
    peer_steps = step
    if oom_retries:  # windows before the last micro-batch change timed another configuration
        step_times = [r["step_s"] for r in peer_log if r["step"] > oom_retries[-1]["step"] + 1] or step_times
    peer_rate = _median_rate(step_times[1:]) or _median_rate(step_times)
    (peer_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in peer_log))
    logger.info("peer: %d steps in %.0f s (%.2f steps/s median window)", peer_steps, peer_train_s, peer_rate or 0)
    del data

    # 4. curves: the same evaluate() on both, at the same steps
    ours_ckpts = _our_checkpoints(ours_dir)
    curve = []
    for s in sorted(set(snapshots) | set(ours_ckpts)):
        row: dict[str, Any] = {"step": s}
        if s == 0:
            row["ours"] = ours_init_sim
        elif s in ours_ckpts:
            row["ours"] = ev.sim_tau(load_draft(ours_ckpts[s]).state_dict())["eval_accept_len"]
        if s in snapshots:
            row["peer"] = ev.sim_tau(snapshots[s])["eval_accept_len"]
        in_trainer = [r["eval_accept_len"] for r in ours_metrics if r.get("step") == s and "eval_accept_len" in r]
        if in_trainer:
            row["ours_in_trainer"] = in_trainer[0]
        curve.append(row)
        logger.info("curve step %d: %s", s, {k: round(v, 4) for k, v in row.items() if k != "step"})

    # 5. the compared drafts, both at the common step, exported to the serving format
    common_step = min(ours_steps, peer_steps)
    ours_src = ours_dir / "final" / "draft" if common_step == ours_steps else ours_ckpts.get(common_step)
    if ours_src is None:
        sys.exit(f"no checkpoint of ours at the common step {common_step}")
    peer_state = snapshots[common_step]
    exports = out / "export"
    rc, _ = _run([sys.executable, "-m", "nemo_dflash.recipes.export", "--checkpoint", str(ours_src), "--out",
                  str(exports / "ours"), "--overwrite", "--target", args.target], out / "logs" / "export_ours.log")
    if rc != 0:
        sys.exit("exporting our draft failed")
    conversion = _export_peer(peer, peer_state, ev, peer_dir / "hf_draft", exports / "peer", args.target, out)
    sim_ours = ev.sim_tau(load_draft(exports / "ours").state_dict())
    sim_peer = ev.sim_tau(load_draft(exports / "peer").state_dict())
    final_row = next((r for r in curve if r["step"] == common_step), {})
    checks = {
        "data_identical": _data_check(summary, ev),
        "peer_weight_names_match_ours": keys_ok,
        "rope_inv_freq_1": {"peer_draft_buffer": peer.peer_inv_freq0, "ours": _our_inv_freq(ev.draft),
                            "note": "SpecForge casts its whole draft, RoPE inv_freq buffer included, to bf16 "
                                    "(AutoDraftModel.from_config(torch_dtype=bf16)); serving engines and the shared "
                                    "evaluator use fp32 RoPE"},
        "sim_tau_exported_vs_curve": {"ours": [sim_ours["eval_accept_len"], final_row.get("ours")],
                                      "peer": [sim_peer["eval_accept_len"], final_row.get("peer")]},
        "ours_in_trainer_vs_shared": [[r["step"], r.get("ours_in_trainer"), r.get("ours")] for r in curve
                                      if "ours_in_trainer" in r and "ours" in r],
        "peer_oom_retries": oom_retries,
        "peer_stopped": stopped,
        "ours_stopped": summary.get("stopped_early"),
        "train_stage_wall_s": time.perf_counter() - t_script,
    }
    return {
        "peer": {
            "name": "SpecForge DFlash (github.com/sgl-project/SpecForge)", "version": version["commit"],
            "version_txt": version["version_txt"], "steps": common_step, "steps_trained": peer_steps,
            "tau_t0": None, "tau_t1": None, "sim_tau": sim_peer["eval_accept_len"],
            "sim_eval_loss": sim_peer["eval_loss"], "steps_per_s": peer_rate, "train_seconds": peer_train_s,
            "draft": str(exports / "peer"),
            "recipe": {
                "draft_config": json.loads(peer.config_path.read_text()), "attention_backend": attn,
                "param_dtype": "bfloat16 (fp32 AdamW masters: BF16Optimizer)", "optimizer": {
                    **peer.optimizer_settings, "betas": [0.9, 0.999], "weight_decay": 0.0, "eps": 1e-8,
                    "schedule": "CosineAnnealingWarmupLR: linear warmup over int(ratio*N) steps, cosine to 0"},
                "loss": {"loss_type": "dflash", "num_anchors": int(cfg.loss.num_anchors),
                         "loss_decay_gamma": cfg.loss.gamma, "objective_chunk_blocks": 128,
                         "anchors": "uniform among positions t with loss_mask[t] and loss_mask[t+1] (global RNG)"},
                "micro_batch": peer.micro_batch, "accumulation_steps": peer.core.accumulation_steps,
            },
            "substitutions": SUBSTITUTIONS,
            "conversion": conversion,
        },
        "ours": {
            "name": "nemo_dflash", "version": _git_commit(REPO, dirty_mark=True), "steps": common_step, "steps_trained": ours_steps,
            "tau_t0": None, "tau_t1": None, "sim_tau": sim_ours["eval_accept_len"],
            "sim_eval_loss": sim_ours["eval_loss"], "steps_per_s": ours_rate, "train_seconds": ours_train_s,
            "draft": str(exports / "ours"), "command": " ".join(shlex.quote(c) for c in cmd),
            "recipe": {"optimizer": {"lr": float(cfg.optim.lr), "betas": list(cfg.optim.betas), "eps": float(cfg.optim.eps),
                                     "weight_decay": float(cfg.optim.weight_decay), "grad_clip": float(cfg.optim.grad_clip),
                                     "warmup_ratio": float(cfg.optim.warmup_ratio), "schedule": cfg.optim.scheduler},
                       "precision": cfg.train.precision,
                       "params": "fp32" + (" (bf16 autocast)" if cfg.train.precision == "bf16" else ""),
                       "compile": bool(cfg.train.compile), "compile_target": bool(cfg.train.compile_target)},
        },
        "device": args.device_label or _device_label(ev.device),
        "protocol": {
            "recipe": args.recipe, "overrides": common[3:], "steps": n_steps, "minutes_cap": args.minutes,
            "global_batch_rows": peer.global_rows, "max_length": int(cfg.data.max_length),
            "num_anchors": int(cfg.loss.num_anchors), "gamma": cfg.loss.gamma, "lr": float(cfg.optim.lr),
            "warmup_ratio": float(cfg.optim.warmup_ratio), "grad_clip": float(cfg.optim.grad_clip),
            "draft": {"layers": int(ev.draft.config.num_hidden_layers), "block_size": int(ev.draft.config.block_size),
                      "target_layer_ids": list(ev.draft.config.target_layer_ids),
                      "mask_token_id": int(ev.draft.config.mask_token_id)},
            "data": os.path.abspath(args.data), "target": args.target,
            "sim_tau": {"function": "nemo_dflash.train.trainer.Trainer.evaluate (eval_accept_len)",
                        "eval_batches": int(cfg.train.eval_batches), "holdout_fraction": float(cfg.data.holdout_fraction),
                        "eval_every": every},
            "steps_per_s": f"median of {args.log_every}-step windows after the first (the peer's step includes the "
                           "target forward through our hook wrapper, as ours does)",
            "software": {"torch": torch.__version__, "transformers": transformers.__version__,
                         "python": platform.python_version()},
        },
        "curves": curve,
        "checks": checks,
    }


def eval_stage(args, out: Path, result: dict[str, Any]) -> None:
    """Our evaluate on both exports with the same flags; tau per temperature into the JSON."""
    evals, cmds = {}, {}
    for name in ("ours", "peer"):
        if args.which not in ("both", name):
            evals[name] = tau_from_results(out / "eval" / name / "results.json")
            continue
        draft = result[name].get("draft") or str(out / "export" / name)
        ecmd = [sys.executable, "-m", "nemo_dflash.recipes.evaluate", "--draft", draft, "--target", args.target,
                "--out", str(out / "eval" / name), "--protocol", args.eval_protocol, *shlex.split(args.eval_args)]
        if args.eval_minutes:
            ecmd += ["--max-minutes", f"{args.eval_minutes:g}"]
        cmds[name] = " ".join(shlex.quote(c) for c in ecmd)
        rc, wall = _run(ecmd, out / "logs" / f"eval_{name}.log", append=True)
        evals[name] = tau_from_results(out / "eval" / name / "results.json") if rc == 0 else {"failed": rc}
        evals[name]["wall_s"] = wall
    common = common_answer_taus(out / "eval" / "ours" / "results.json", out / "eval" / "peer" / "results.json")
    for name in ("ours", "peer"):
        e = evals[name]
        result[name]["tau_t0"] = e.get("tau_t0")
        result[name]["tau_t1"] = e.get("tau_t1")
        result[name]["real_tau"] = {k: v for k, v in e.items() if k != "protocol"}
        if common:
            result[name]["tau_common_answers"] = common.get(name)
    result["protocol"]["evaluate"] = {"protocol": args.eval_protocol, "args": args.eval_args,
                                      "max_minutes": args.eval_minutes, "commands": cmds,
                                      "resolved": (evals.get("ours") or {}).get("protocol"),
                                      "tau_tX": "mean over datasets of evaluate's mean_acceptance_length at T=X",
                                      "common_answers": "per-answer tau averaged over the (prompt, turn) pairs both "
                                                        "drafts answered (differs from tau_tX only if a run is partial)"}


SUBSTITUTIONS = [
    "target features: our hook wrapper nemo_dflash.target.HFDFlashTargetModel on the same frozen target "
    "(layer i output == hidden_states[i+1], concatenated in target_layer_ids order), instead of SpecForge's SGLang "
    "capture server / offline capture",
    "target embedding + lm_head: SpecForge's TargetEmbeddingsAndHead(target config), tables copied from the loaded "
    "target (from_pretrained reads safetensors from an HF dir/hub; the target may be a .gguf), bf16, frozen",
    "data: our tokenised batches (same rows, order, loss_mask on assistant tokens, trimmed to the longest row) "
    "instead of SpecForge's template preprocessing and FeatureDataLoader",
    "no FSDP wrap at world size 1 (FSDPTrainingBackend.prepare_model(wrap=False)): parameters are already bf16, so "
    "FSDP1 SHARD_GRAD_OP + bf16 MixedPrecision over one rank is the same computation",
    "draft config: a SpecForge configs/*-dflash.json written with our draft's shape (layers, block, target layers, "
    "mask token, hidden/intermediate/heads/head_dim/rms_eps/rope_theta from the target), initializer_range 0.02 "
    "as in SpecForge's configs, loaded with its load_draft_config_source",
]


def _our_checkpoints(run: Path) -> dict[int, Path]:
    found = {}
    for d in sorted((run / "checkpoints").glob("step_*")):
        tail = d.name.split("_")[-1]
        if tail.isdigit() and (d / "draft" / "config.json").is_file():
            found[int(tail)] = d / "draft"
    return found


def _export_peer(peer: PeerTrainer, state: dict, ev: SharedEvaluator, hf_dir: Path, export_dir: Path, target: str,
                 out: Path) -> dict[str, Any]:
    """SpecForge's writer (save_pretrained of its DFlashDraftModel), then our export command."""
    import torch

    with torch.no_grad():
        for k, p in peer.draft.state_dict().items():
            p.copy_(state[k].to(device=p.device, dtype=p.dtype))
    hf_dir.mkdir(parents=True, exist_ok=True)
    peer.draft.save_pretrained(str(hf_dir))
    info: dict[str, Any] = {"peer_writer": "specforge DFlashDraftModel.save_pretrained (what specforge.export.to_hf "
                                           "writes for a DFlash draft)", "hf_dir": str(hf_dir)}
    rc, _ = _run([sys.executable, "-m", "nemo_dflash.recipes.export", "--checkpoint", str(hf_dir), "--out",
                  str(export_dir), "--overwrite", "--target", target], out / "logs" / "export_peer.log")
    if rc == 0:
        info["method"] = "python -m nemo_dflash.recipes.export --checkpoint <SpecForge save_pretrained dir>"
        return info
    # fallback: our serving config (identical shape, mask, layers) beside SpecForge's weights
    from safetensors.torch import save_file

    from nemo_dflash.serving.export import export_draft, serving_config_dict

    alt = hf_dir.parent / "hf_draft_our_config"
    alt.mkdir(parents=True, exist_ok=True)
    (alt / "config.json").write_text(json.dumps(serving_config_dict(ev.draft.config), indent=2) + "\n")
    save_file({k: v.to(torch.bfloat16).contiguous() for k, v in state.items()}, str(alt / "model.safetensors"))
    export_draft(alt, export_dir, overwrite=True)
    info["method"] = ("fallback: our loader refused SpecForge's config.json (see logs/export_peer.log); our serving "
                      "config.json written beside SpecForge's unprefixed weights, then nemo_dflash.serving.export.export_draft")
    return info


def _data_check(summary: dict, ev: SharedEvaluator) -> dict[str, Any]:
    ours = summary.get("data") or {}
    mine = getattr(ev.trainer, "train_ds", None)
    mine = getattr(mine, "stats", {}) if mine is not None else {}
    keys = ("samples", "train_samples", "holdout_samples", "tokens", "supervised_tokens")
    pairs = {k: [ours.get(k), mine.get(k)] for k in keys}
    return {"same": all(a == b for a, b in pairs.values()), "ours_run_vs_peer_loader": pairs}


def _our_inv_freq(draft) -> Optional[float]:
    import torch

    for name, mod in draft.named_modules():
        f = getattr(mod, "inv_freq", None)
        if isinstance(f, torch.Tensor) and f.numel() > 1:
            return float(f.flatten()[1])
    cfg = draft.config
    rope = dict(getattr(cfg, "rope_parameters", None) or {})
    theta = rope.get("rope_theta", getattr(cfg, "rope_theta", None))
    hd = cfg.head_dim or cfg.hidden_size // cfg.num_attention_heads
    return float(theta ** (-2.0 / hd)) if theta else None


def _device_label(device) -> str:
    import torch

    if device.type == "cuda":
        return f"one {torch.cuda.get_device_name(device)} (torch {torch.__version__})"
    return f"CPU ({platform.processor() or platform.machine()}, torch {torch.__version__}, {torch.get_num_threads()} threads)"


def _plot(curve: list[dict], path: Path) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    fig, ax = plt.subplots(figsize=(6, 4))
    for key, label in (("ours", "nemo_dflash"), ("peer", "SpecForge")):
        pts = [(r["step"], r[key]) for r in curve if r.get(key) is not None]
        if pts:
            ax.plot(*zip(*pts), marker="o", label=label)
    ax.set_xlabel("step")
    ax.set_ylabel("held-out simulated tau")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def _fmt(v, nd=3) -> str:
    return "-" if v is None or (isinstance(v, float) and math.isnan(v)) else f"{v:.{nd}f}"


def print_table(r: dict[str, Any]) -> None:
    print()
    print(f"device: {r['device']}")
    print(f"{'trainer':<12} {'version':<12} {'steps':>6} {'steps/s':>8} {'sim tau':>8} {'tau T=0':>8} {'tau T=1':>8}")
    for k in ("ours", "peer"):
        x = r[k]
        print(f"{k:<12} {str(x['version'])[:10]:<12} {x['steps']:>6} {_fmt(x['steps_per_s'], 2):>8} "
              f"{_fmt(x['sim_tau']):>8} {_fmt(x['tau_t0']):>8} {_fmt(x['tau_t1']):>8}")
    print()
    print(f"{'step':>6} {'ours':>8} {'peer':>8} {'ours (in-trainer)':>18}")
    for row in r["curves"]:
        print(f"{row['step']:>6} {_fmt(row.get('ours'), 4):>8} {_fmt(row.get('peer'), 4):>8} "
              f"{_fmt(row.get('ours_in_trainer'), 4):>18}")
    print()


if __name__ == "__main__":
    result = main()
    raise SystemExit(result if isinstance(result, int) else 0)
