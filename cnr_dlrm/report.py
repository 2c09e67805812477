"""PNG plots of a run's checkpoints: ``python -m cnr_dlrm.report SRC --out DIR``.

``SRC`` is a checkpoint root (a directory or storage URL, summarised as ``cnr inspect --json``
does) or a ``report.json`` written by the training job; a SRC that is a file or ends in
``.json`` is read as a report. Writes ``bytes_per_checkpoint.png``, ``dirty_fraction.png`` and
``stall_ms.png`` into DIR (see :mod:`cnr_dlrm.plots`) and prints their paths.

Exit codes, as the ``cnr`` command's: 0 success; 1 a corrupt checkpoint; 2 the command could
not run (bad arguments, missing root, nothing committed, unreadable or malformed report,
bad ``--storage-option``, no matplotlib). Errors are one line on stderr, without a traceback.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from collections.abc import Sequence

from cnr_torchrec.ckpt.tools.summary import summarize
from cnr_torchrec.ckpt.tools.root import not_found_hint, open_storage, parse_storage_options
from cnr_torchrec.errors import CheckpointNotFoundError, CnrError, CorruptCheckpointError

from cnr_dlrm.plots import load_report, validate_report, write_plots

__all__ = ["EXIT_CORRUPT", "EXIT_ERROR", "EXIT_OK", "build_parser", "main", "report"]

EXIT_OK, EXIT_CORRUPT, EXIT_ERROR = 0, 1, 2
PROG = "cnr_dlrm.report"


def report(src: str, out: str, storage_options: Sequence[str] | None = None) -> list[str]:
    """Writes the three PNGs of ``src`` (a checkpoint root or a report.json) into ``out``; returns their paths.

    Raises:
        CheckpointNotFoundError: a root that does not exist or holds no committed checkpoint.
        ReportError: a report.json that cannot be read or does not follow the ``cnr-report`` schema.
        ConfigError: a bad ``--storage-option``, a storage URL the plugins refuse, or no matplotlib.
    """
    if os.path.isfile(src) or src.endswith(".json"):
        doc = load_report(src)
    else:
        storage = open_storage(src, parse_storage_options(storage_options))
        try:
            doc = summarize(storage)
            if not doc["checkpoints"]:
                raise CheckpointNotFoundError(f"no committed checkpoint under {src}{not_found_hint(storage)}")
        finally:
            storage.close()
        validate_report(doc, src)
    return write_plots(doc, out)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog=f"python -m {PROG}",
        description="Write bytes_per_checkpoint.png, dirty_fraction.png and stall_ms.png from a checkpoint root or "
                    "a report.json written by the training job.",
        epilog="exit codes: 0 ok; 1 corrupt checkpoint; 2 the command could not run",
    )
    p.add_argument("src", metavar="SRC", help="checkpoint root, or a report.json")
    p.add_argument("--out", required=True, metavar="DIR")
    p.add_argument("--storage-option", action="append", metavar="KEY=VALUE",
                   help="passed to the torchsnapshot storage plugin (repeatable; VALUE parsed as JSON if it can be), "
                        "e.g. for s3:// roots")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    """Runs ``python -m cnr_dlrm.report``; returns its exit code (see the module docstring)."""
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    try:
        args = build_parser().parse_args(argv)
    except SystemExit as e:  # argparse has printed usage and the error
        return int(e.code or 0)
    try:
        for path in report(args.src, args.out, args.storage_option):
            print(path)
        return EXIT_OK
    except CorruptCheckpointError as e:
        print(f"{PROG}: corrupt checkpoint: {e}. Run `cnr verify` for every problem; restore or compact an older "
              "checkpoint.", file=sys.stderr)
        return EXIT_CORRUPT
    except CnrError as e:
        print(f"{PROG}: {e}", file=sys.stderr)
        return EXIT_ERROR
    except BrokenPipeError:  # `... | head`: the reader left; say nothing more
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        return EXIT_OK
    except OSError as e:
        where = f" ({e.filename})" if e.filename else ""
        print(f"{PROG}: {e.strerror or e}{where}; check the path and its permissions", file=sys.stderr)
        return EXIT_ERROR
    except KeyboardInterrupt:
        print(f"{PROG}: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
