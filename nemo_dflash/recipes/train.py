"""Train a DFlash draft from a YAML recipe.

    torchrun --nproc-per-node 8 -m nemo_dflash.recipes.train --config qwen3_8b.yaml \
        target.path=/models/Qwen3-8B data.sources='[{path: /data/regen.jsonl}]'
    python -m nemo_dflash.recipes.train --config smollm2_135m.yaml train.max_steps=50
"""

from __future__ import annotations

import argparse
import json
import logging
import sys

from nemo_dflash.config import ConfigError, load_recipe
from nemo_dflash.recipes._cli import fail, setup_logging

logger = logging.getLogger("nemo_dflash.train")


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", "-c", required=True, help="recipe YAML (working dir first, then the repo's recipes/)")
    p.add_argument("overrides", nargs="*", help="key=value overrides, e.g. optim.lr=1e-4 train.max_steps=100")
    p.add_argument("--print-config", action="store_true", help="print the resolved config and exit")
    return p.parse_args(argv)


def main(argv=None) -> dict:
    args = parse_args(argv)
    setup_logging()
    try:
        cfg = load_recipe(args.config, args.overrides)
    except (ConfigError, FileNotFoundError) as e:
        fail(str(e))
    if args.print_config:
        from nemo_dflash.config import to_yaml

        sys.stdout.write(to_yaml(cfg))
        return {}
    from nemo_dflash.build import MaskTokenError
    from nemo_dflash.train.trainer import train

    try:
        summary = train(cfg)
    except MaskTokenError as e:
        fail(str(e))
    logger.info("summary: %s", json.dumps(summary))
    return summary


if __name__ == "__main__":
    main()
