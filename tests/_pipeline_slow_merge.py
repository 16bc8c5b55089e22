"""`python -m nemo_dflash.recipes.pipeline ARGS` whose rank 0 waits PIPELINE_MERGE_DELAY seconds before it merges the
ranks' regenerate shards, so the other ranks finish the stage well before its file exists: the next stage must still
find it (every rank waits for rank 0 at the end of a stage). Run it as torchrun's script."""

from __future__ import annotations

import os
import sys
import time
from typing import Any

from nemo_dflash.recipes import pipeline
from nemo_dflash.data import regen_run as regen_recipe

real_merge = regen_recipe.merge_ranks


def slow_merge(*args: Any, **kwargs: Any) -> Any:
    time.sleep(float(os.environ.get("PIPELINE_MERGE_DELAY", "3")))
    return real_merge(*args, **kwargs)


regen_recipe.merge_ranks = slow_merge
pipeline.main(sys.argv[1:])
