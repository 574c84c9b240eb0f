"""dflash_etl: validation-first ETL for speculative-decoding drafter training data.

The command line is `dflash-etl` or `python -m dflash_etl` (cli/main.py). Before that one entry,
each stage module, evaluate, lineage and the export ran as `python -m dflash_etl.<module>`:
such a command would now import its module and end with exit 0 having done nothing, so it is
refused here, naming the command that replaced it.
"""

import sys

__version__ = "0.1.0"

_MOVED = {**{f"dflash_etl.stages.{s}": s
             for s in ("ingest", "regenerate", "tokenize", "extract", "train")},
          "dflash_etl.evaluate": "eval", "dflash_etl.lineage": "show",
          "dflash_etl.handoff.export": "export"}


def _refuse_moved_entry(argv: list[str]) -> None:
    if "-m" in argv[:-1] and (module := argv[argv.index("-m") + 1]) in _MOVED:
        raise SystemExit(f"error: `python -m {module}` is gone: run `python -m dflash_etl "
                         f"{_MOVED[module]} ...` (or `dflash-etl {_MOVED[module]} ...`)")


_refuse_moved_entry(list(getattr(sys, "orig_argv", ())))
