"""`python -m nemo_dflash.recipes.regenerate ARGS` whose rank REGEN_KILL_RANK is SIGKILLed as it is about to
write its REGEN_KILL_AT-th conversation of this run (counted from 0): a rank dying mid-run under torchrun,
for the resume tests. Run it as torchrun's script."""

from __future__ import annotations

import os
import signal
import sys
from typing import Any, Iterator

from nemo_dflash.data import regenerate as regen_mod
from nemo_dflash.recipes import regenerate as cli

real = regen_mod.regenerate_conversations


def killed(*args: Any, **kwargs: Any) -> Iterator[dict[str, Any]]:
    for i, record in enumerate(real(*args, **kwargs)):
        if i == int(os.environ["REGEN_KILL_AT"]) and os.environ["RANK"] == os.environ["REGEN_KILL_RANK"]:
            os.kill(os.getpid(), signal.SIGKILL)
        yield record


regen_mod.regenerate_conversations = killed
cli.main(sys.argv[1:])
