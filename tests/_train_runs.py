"""`python -m nemo_dflash.recipes.train ARGS` once for each argument list of the JSON file argv[1] (a list of
lists), one after the other in this process: under torchrun, several trainings for one start-up of the ranks
(each training makes and ends its own process group, as the pipeline's stages do)."""

from __future__ import annotations

import json
import sys

from nemo_dflash.recipes import train

for argv in json.loads(open(sys.argv[1]).read()):
    train.main(argv)
