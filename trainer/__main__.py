"""`python -m flightdeck.trainer`: run one rank of the built-in trainer (a user of the trainer API, trainer/loop.py).

Exit 0: all steps done, stopped on command, or preempted by SIGTERM after saving a checkpoint.
Any other code: the rank failed (an exception is reported as RankFault first, by the API's exit hook).
"""

import os
import sys

import flightdeck
from flightdeck.trainer import config
from flightdeck.trainer.loop import train


def main(argv: list[str] | None = None) -> int:
    config.flags_to_env(argv, os.environ)
    return train(flightdeck.init())


if __name__ == "__main__":
    sys.exit(main())
