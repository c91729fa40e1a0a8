"""`flightdeck completion bash|zsh|tcsh`: a shell completion script for every verb and option, generated from the
command line's own parser by shtab. `eval "$(flightdeck completion bash)"` in ~/.bashrc, or write it to a file
your shell's completion loads (zsh: a `_flightdeck` file on $fpath)."""

import argparse

import shtab

from flightdeck.services.tools.cli import Command


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("shell", choices=["bash", "zsh", "tcsh"], help="the shell to complete in")


def run(args: argparse.Namespace) -> int:
    from flightdeck.services.tools.console.__main__ import parser  # the whole command line, every verb in it

    print(shtab.complete(parser(), shell=args.shell))
    return 0


COMMAND = Command("completion", "print a shell completion script (bash, zsh, tcsh)", add_arguments, run)
