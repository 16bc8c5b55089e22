"""`python -m nemo_dflash.recipes.pipeline ARGS` whose rank PIPELINE_KILL_RANK (or any rank) is SIGKILLed mid-stage: in `train`
right after it saved the checkpoint of step PIPELINE_KILL_STEP, or (PIPELINE_KILL_STEP unset) in `regenerate` as
it is about to write its PIPELINE_KILL_AT-th conversation (counted from 0). A rank of a pipeline dying under
torchrun, for the resume tests. Run it as torchrun's script."""

from __future__ import annotations

import os
import signal
import sys
from typing import Any, Iterator

from nemo_dflash.data import regenerate as regen_mod
from nemo_dflash.recipes import pipeline
from nemo_dflash.train import checkpoint

MINE = os.environ["PIPELINE_KILL_RANK"] in ("any", os.environ["RANK"])  # any: whichever rank gets there first
real_save, real_regen = checkpoint.Checkpointer.save, regen_mod.regenerate_conversations


def save_then_die(self: Any, step: int, tokens_seen: int) -> Any:
    path = real_save(self, step, tokens_seen)
    if MINE and step == int(os.environ["PIPELINE_KILL_STEP"]):
        os.kill(os.getpid(), signal.SIGKILL)
    return path


def regen_then_die(*args: Any, **kwargs: Any) -> Iterator[dict[str, Any]]:
    for i, record in enumerate(real_regen(*args, **kwargs)):
        if MINE and i == int(os.environ["PIPELINE_KILL_AT"]):
            os.kill(os.getpid(), signal.SIGKILL)
        yield record


if "PIPELINE_KILL_STEP" in os.environ:
    checkpoint.Checkpointer.save = save_then_die
else:
    regen_mod.regenerate_conversations = regen_then_die
pipeline.main(sys.argv[1:])
