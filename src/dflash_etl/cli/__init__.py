"""The command line: one subcommand per stage plus run, check, docs and probe-template."""

from dflash_etl.cli.main import build_parser, main

__all__ = ["build_parser", "main"]
