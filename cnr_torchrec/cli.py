"""The ``cnr`` command: inspect, verify, compact, export and import checkpoint roots offline, copy one to other
storage (``cnr copy``), publish a serving snapshot of one (``cnr publish``), and clean the host's memory images
(``cnr clean-images``).

Exit codes: 0 success (``verify``: sound; ``cnr`` alone prints the commands); 1 a checkpoint is
corrupt (``verify`` found problems, or ``compact``/``export``/``import-dcp`` met a corrupt file);
2 the command could not run (bad arguments, missing root, nothing committed, unknown id, bad
``--storage-option``, an existing ``export --out``, a DCP checkpoint of another layout, a ``clean-images
--path`` that is not a directory). Errors
are one line on stderr, the error's class and what to do; ``--debug`` prints the traceback
before it.
"""

from __future__ import annotations

import argparse
import itertools
import json
import logging
import os
import sys
import traceback
from collections.abc import Sequence
from typing import Any

from cnr_torchrec.cli_text import codec_label, dense_optimizer_label, human_bytes, id_ranges, inspect_text
from cnr_torchrec.errors import CnrError, ConfigError, CorruptCheckpointError, one_line

__all__ = ["main", "EXIT_OK", "EXIT_CORRUPT", "EXIT_ERROR"]

EXIT_OK, EXIT_CORRUPT, EXIT_ERROR = 0, 1, 2

_LISTED = 10  # PROBLEM lines per file of a checkpoint: a damaged file would otherwise list every blob


# ---------------------------------------------------------------------- helpers


def _progress(total: int, desc: str):
    """A tqdm bar on stderr (hidden when stderr is not a terminal), and its update function."""
    from tqdm import tqdm

    bar = tqdm(total=total, desc=desc, unit="entry", file=sys.stderr, disable=None, leave=False)
    return bar, bar.update


def _key(args: argparse.Namespace):
    from cnr_torchrec.ckpt.format.bytes.integrity import load_key

    return load_key(args.key_file, None)


def _open(args: argparse.Namespace):
    from cnr_torchrec.ckpt.tools.root import open_storage, parse_storage_options

    return open_storage(args.root, parse_storage_options(args.storage_option), _key(args))


# ---------------------------------------------------------------------- inspect

def _cmd_inspect(args: argparse.Namespace) -> int:
    from cnr_torchrec.ckpt.tools.root import not_found_hint
    from cnr_torchrec.ckpt.tools.summary import summarize
    from cnr_torchrec.errors import CheckpointNotFoundError

    storage = _open(args)
    try:
        summary = summarize(storage)
        if not summary["checkpoints"] and not summary["corrupt"] and not summary["uncommitted"]:
            raise CheckpointNotFoundError(f"no checkpoint under {args.root}{not_found_hint(storage)}")
    finally:
        storage.close()
    if args.json:
        print(json.dumps(summary, indent=1))
    else:
        print(inspect_text(summary, None if args.all else args.last))
    return EXIT_OK


# ---------------------------------------------------------------------- verify


def _cmd_verify(args: argparse.Namespace) -> int:
    from cnr_torchrec.ckpt.tools.root import parse_storage_options
    from cnr_torchrec.ckpt.tools.verify import verify_root

    options = parse_storage_options(args.storage_option)
    dense: dict[int, Any] = {}
    problems = verify_root(args.root, options, None if args.id is None else [args.id], dense_optimizers=dense,
                           key=_key(args))
    if problems:
        # At most _LISTED lines per file of a checkpoint, and one line counting the rest, so that the PROBLEM
        # lines and the "more" lines add up to the count below.
        for (_, path), grouped in itertools.groupby(problems, key=lambda p: (p.ckpt_id, p.path)):
            group = list(grouped)
            for p in group[:_LISTED]:
                print(f"PROBLEM {p}")
            if len(group) > _LISTED:
                print(f"... and {len(group) - _LISTED} more problem(s) in {path}")
        bad = sorted({p.ckpt_id for p in problems if p.ckpt_id is not None})
        print(f"{len(problems)} problem(s)" + (f" in checkpoint(s) {', '.join(map(str, bad))}" if bad else ""))
        return EXIT_CORRUPT
    print("OK: " + (f"checkpoint {args.id} and its chain verify" if args.id is not None
                    else f"every committed checkpoint under {args.root} verifies"))
    by_label: dict[str, list[int]] = {}
    for ckpt_id, info in sorted(dense.items()):
        by_label.setdefault(dense_optimizer_label(info), []).append(ckpt_id)
    for label, ids in by_label.items():
        print(f"dense optimizer state {label}: checkpoint(s) {id_ranges(ids)}")
    return EXIT_OK


# ---------------------------------------------------------------------- compact / export


def _cmd_compact(args: argparse.Namespace) -> int:
    from cnr_torchrec.ckpt.compact.offline import compact
    from cnr_torchrec.ckpt.tools.checked_chain import count_entries, load_chain
    from cnr_torchrec.ckpt.tools.root import resolve_id
    from cnr_torchrec.errors import ConfigError
    from cnr_torchrec.quant import get_codec

    if args.method is not None:
        get_codec(args.method, args.bits)  # a bad codec fails before anything is read
    elif args.bits is not None:
        raise ConfigError("--bits needs --method: a lossless compaction keeps every row's stored bytes")
    storage = _open(args)
    try:
        tip = resolve_id(storage, args.id)
        chain = load_chain(storage, tip, verify=False)
        # Lossless: the tip's layout, entry by entry; re-encoding: decode the chain, then write the tip's layout.
        total = count_entries(chain[-1:]) + (count_entries(chain) if args.method is not None else 0)
        bar, update = _progress(total, "compact")
        try:
            manifest = compact(storage, tip, method=args.method, bits=args.bits, progress=update)
        finally:
            bar.close()
    finally:
        storage.close()
    how = ("lossless: every row as stored" if args.method is None
           else f"re-encoded with {codec_label(args.method, args.bits)}")
    assert manifest.compacted_from is not None  # cnr compact writes a compacted baseline
    first, last = manifest.compacted_from
    print(f"compacted chain {first}..{last} (step {manifest.step}) into baseline {manifest.id}: "
          f"{human_bytes(manifest.nbytes)} in {manifest.world_size} rank file(s), {how}. It restores what "
          f"checkpoint {last} restores")
    return EXIT_OK


def _check_out(out: str, what: str) -> None:
    """ConfigError unless ``out`` is a new path in an existing directory (checked before anything is read)."""
    if os.path.lexists(out):
        raise ConfigError(f"{out} exists; give --out a new {what} (an export never overwrites)")
    parent = os.path.dirname(os.path.abspath(out))
    if not os.path.isdir(parent):
        raise ConfigError(f"the directory of --out {out} ({parent}) does not exist; create it, or give --out a "
                          f"{what} in an existing directory")


def _cmd_export(args: argparse.Namespace) -> int:
    import torch

    from cnr_torchrec.ckpt.tools.checked_chain import count_entries, load_chain
    from cnr_torchrec.ckpt.tools.dcp import export_dcp
    from cnr_torchrec.ckpt.tools.export import export_state_dict
    from cnr_torchrec.ckpt.tools.root import resolve_id

    _check_out(args.out, "directory" if args.format == "dcp" else "file")
    storage = _open(args)
    try:
        cid = resolve_id(storage, args.id)
        chain = load_chain(storage, cid, verify=False)
        bar, update = _progress(count_entries(chain), "export")
        try:
            if args.format == "dcp":
                summary = export_dcp(storage, args.out, cid, progress=update)
            else:
                state = export_state_dict(storage, cid, progress=update)
        finally:
            bar.close()
    finally:
        storage.close()
    if args.format == "dcp":
        print(f"exported checkpoint {cid} (step {summary['step']}) as a DCP checkpoint: {summary['tensors']} tensors, "
              f"{human_bytes(summary['nbytes'])} -> {args.out} (dcp.load it; see docs/dcp.md)")
        return EXIT_OK
    out = os.path.abspath(args.out)
    tmp = f"{out}.tmp-{os.getpid()}"
    try:
        torch.save(state, tmp)
        os.replace(tmp, out)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)
    n = sum(t.numel() * t.element_size() for t in state.values())
    print(f"exported checkpoint {cid}: {len(state)} tensors, {human_bytes(n)} -> {args.out}")
    return EXIT_OK


def _cmd_import_dcp(args: argparse.Namespace) -> int:
    from cnr_torchrec.ckpt.tools.dcp import import_dcp

    local = args.root.removeprefix("fs://") if "://" not in args.root or args.root.startswith("fs://") else None
    created = local is not None and not os.path.exists(local)
    if local is not None and created:
        os.makedirs(local)  # a new root; removed again if the import fails
    try:
        storage = _open(args)
        try:
            manifest = import_dcp(args.src, storage, append=args.append, step=args.step)
        finally:
            storage.close()
    except BaseException:
        if local is not None and created and not os.listdir(local):
            os.rmdir(local)
        raise
    print(f"imported {args.src} as baseline {manifest.id} (step {manifest.step}) of {args.root}: "
          f"{len(manifest.tables)} tables, {human_bytes(manifest.nbytes)}. Checkpointer.restore() restores it")
    return EXIT_OK


# ---------------------------------------------------------------------- clean-images


def _cmd_clean_images(args: argparse.Namespace) -> int:
    from cnr_torchrec.ckpt.memory import directory

    if not args.max_age_s > 0:
        raise ConfigError(f"--max-age-s {args.max_age_s:g}: give a positive number of seconds")
    entries = directory.scan(args.path)
    picked = directory.select(entries, root=args.root, everything=args.all, max_age_s=args.max_age_s)
    verb = "would remove" if args.dry_run else "removed"
    for entry, why in picked:
        if not args.dry_run:
            directory.remove(entry)
        what = "old-layout files" if entry.legacy else f"root {entry.root or '(unnamed)'}"
        print(f"{verb} {entry.path} ({what}, {len(entry.files)} file(s), {human_bytes(entry.nbytes)}): {why}")
    kept = len(entries) - len(picked)
    gone = f"the images of {len(picked)} root(s), {human_bytes(sum(e.nbytes for e, _ in picked))}" if picked \
        else "nothing"
    print(f"{verb} {gone} under {args.path}; kept the images of {kept} root(s)")
    return EXIT_OK


# ---------------------------------------------------------------------- copy


def _cmd_copy(args: argparse.Namespace) -> int:
    from cnr_torchrec.ckpt.compact.copy import copy_compacted
    from cnr_torchrec.ckpt.tools.copy import copy_checkpoints
    from cnr_torchrec.ckpt.tools.root import open_storage, parse_storage_options

    if args.compact and args.all:
        raise ConfigError("--compact copies one chain as one baseline; give it without --all (or --id N for N's "
                          "chain)")
    local = args.dst.removeprefix("fs://") if "://" not in args.dst or args.dst.startswith("fs://") else None
    if local is not None:
        os.makedirs(local, exist_ok=True)
    key = _key(args)
    src = open_storage(args.root, parse_storage_options(args.storage_option), key)
    try:
        dst = open_storage(args.dst, parse_storage_options(args.dst_storage_option), key)
        try:
            report = (copy_compacted(src, dst, ckpt=args.id) if args.compact
                      else copy_checkpoints(src, dst, everything=args.all, ckpt=args.id))
        finally:
            dst.close()
    finally:
        src.close()
    copied = id_ranges(report.copied) if report.copied else "none"
    if args.compact:
        copied += " as one baseline"
    skipped = f"; already there: {id_ranges(report.skipped)}" if report.skipped else ""
    print(f"copied checkpoints {copied} of {args.root} to {args.dst}{skipped}: {report.files} files, "
          f"{human_bytes(report.nbytes)} written, {report.files_present} files found whole already")
    return EXIT_OK


# ---------------------------------------------------------------------- publish


def _cmd_publish(args: argparse.Namespace) -> int:
    import time

    from cnr_torchrec.ckpt.tools.root import parse_storage_options
    from cnr_torchrec.errors import CheckpointError, CheckpointNotFoundError
    from cnr_torchrec.publish.snapshot import Publisher

    if not args.poll_s > 0:
        raise ConfigError(f"--poll-s {args.poll_s:g}: give a positive number of seconds")
    with Publisher(args.root, args.out, args.dtype, args.tables, key=_key(args), lease=args.lease,
                   storage_options=parse_storage_options(args.storage_option)) as publisher:
        while True:
            try:
                updates = publisher.step()
            except CheckpointNotFoundError:
                if not args.follow:
                    raise
                updates = []  # nothing committed yet
            except CheckpointError as e:
                if not args.follow:
                    raise
                print(f"cnr publish: {one_line(e)}; still serving what {args.out}/current holds", file=sys.stderr)
                updates = []
            for u in updates:
                print(f"published checkpoint {u.ckpt} (step {u.step}) to {args.out}/current: {u.how} {u.why}, "
                      f"{u.rows} rows in {u.apply_ms:.0f} ms, {u.lag_s:.2f} s after its commit", flush=True)
            if not args.follow:
                if not updates:
                    print(f"{args.out}/current already serves the newest committed checkpoint")
                return EXIT_OK
            time.sleep(args.poll_s)


# ---------------------------------------------------------------------- parser


def build_parser() -> argparse.ArgumentParser:
    from cnr_torchrec.quant import METHODS

    parser = argparse.ArgumentParser(
        prog="cnr",
        description="Inspect, verify, compact, export and import cnr_torchrec checkpoint roots (offline: no "
                    "model, no process group), publish a serving snapshot of one, and clean this host's memory "
                    "images. Do not run compact or import-dcp "
                    "while a training job writes to the same root.",
        epilog="exit codes: 0 ok; 1 corrupt checkpoint (verify found problems); 2 the command could not run",
    )
    debug_help = "on an error, print its traceback before the one-line message"
    parser.add_argument("--debug", action="store_true", help=debug_help)
    common = argparse.ArgumentParser(add_help=False)
    # SUPPRESS: `cnr --debug inspect` must not be undone by the subcommand's own default.
    common.add_argument("--debug", action="store_true", default=argparse.SUPPRESS, help=debug_help)
    common.add_argument("--storage-option", action="append", metavar="KEY=VALUE",
                        help="passed to the torchsnapshot storage plugin (repeatable; VALUE parsed as JSON if it can "
                             "be), e.g. for s3:// roots")
    common.add_argument("--key-file", metavar="FILE",
                        help="the root's key (integrity.key_file in the job's config): manifests and chunks are "
                             "checked against it, and what the command writes is sealed with it (docs/checkpoints.md)")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")

    p = sub.add_parser("inspect", parents=[common], help="list checkpoints, chains, sizes, dirty fractions",
                       description="List the committed checkpoints (chain, step, kind, codec, bytes, rows, dirty "
                                   "fraction, stall and write ms), the total against a full fp32 snapshot, and "
                                   "uncommitted (torn) directories.")
    p.add_argument("root", metavar="DIR", help="checkpoint root (directory or storage URL)")
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")
    p.add_argument("--last", type=int, default=40, metavar="N",
                   help="list the newest N checkpoints (default 40); the chains are summarised whatever their number")
    p.add_argument("--all", action="store_true", help="list every checkpoint")
    p.set_defaults(func=_cmd_inspect)

    p = sub.add_parser("verify", parents=[common], help="check manifests, files, checksums and chains",
                       description="Check every committed checkpoint (or one and its chain): manifest seal, rank "
                                   "file sizes and xxh3, every blob's bounds and xxh3, references, chains, "
                                   "index.json; with --key-file, each manifest's HMAC-SHA256 and each chunk's keyed "
                                   "BLAKE2b. Exit 0 when sound, 1 with one line per problem otherwise.")
    p.add_argument("root", metavar="DIR")
    p.add_argument("--id", type=int, help="verify only this checkpoint (and its chain)")
    p.set_defaults(func=_cmd_verify)

    p = sub.add_parser("compact", parents=[common], help="merge a chain into a new baseline",
                       description="Merge a chain (default: the newest committed checkpoint's) into a new baseline "
                                   "with the next free id, the same step and world size. By default every row keeps "
                                   "the bytes the newest checkpoint of the chain stored for it, so restoring the new "
                                   "baseline equals restoring the chain, bit for bit; --method re-encodes instead. "
                                   "Must not run while a job writes to the root (a job with compaction: in its "
                                   "config compacts in the background itself).")
    p.add_argument("root", metavar="DIR")
    p.add_argument("--id", type=int, help="the chain's tip (default: the newest committed checkpoint)")
    p.add_argument("--method", default=None, choices=METHODS,
                   help="re-encode the rows with this codec (default: keep every row's stored bytes, lossless)")
    p.add_argument("--bits", type=int, help="bits for a quantizing --method (2, 3, 4 or 8)")
    p.set_defaults(func=_cmd_compact)

    p = sub.add_parser("export", parents=[common], help="write a full-precision state_dict (torch.save or DCP)",
                       description="--format torch (default): a plain, unsharded state_dict in one file: each table "
                                   "under its unsharded name, the dense parameters, and row optimizer state under "
                                   "'<weight>.optimizer_state.<i>'; torch.load(FILE, weights_only=True) reads it. "
                                   "--format dcp: a torch.distributed.checkpoint directory laid out as torchtitan "
                                   "lays one out: the model's state_dict keys at the top level, with 'optim', "
                                   "'dense_optim' and 'train_state' beside them; dcp.load(model.state_dict(), ...) "
                                   "restores the model into a DMP of any plan and world size (docs/dcp.md).")
    p.add_argument("root", metavar="DIR")
    p.add_argument("--out", required=True, metavar="OUT", help="the file (torch), or a new directory (dcp)")
    p.add_argument("--id", type=int, help="checkpoint to export (default: the newest committed)")
    p.add_argument("--format", choices=("torch", "dcp"), default="torch", help="torch.save file (default) or DCP")
    p.set_defaults(func=_cmd_export)

    p = sub.add_parser("import-dcp", parents=[common], help="turn a DCP checkpoint of a DMP into a baseline",
                       description="Write a DCP checkpoint of a DistributedModelParallel (dcp.save of "
                                   "{**dmp.state_dict(), 'optim': dmp.fused_optimizer.state_dict()}, optionally "
                                   "'dense_optim' and 'train_state'; the older layout nested under 'model' is read "
                                   "too) as a full-precision baseline of DIR, which Checkpointer.restore() restores "
                                   "onto any plan (docs/dcp.md). DIR must hold no checkpoint unless --append.")
    p.add_argument("src", metavar="DCP_DIR", help="the directory dcp.save wrote")
    p.add_argument("root", metavar="DIR", help="checkpoint root (created if missing)")
    p.add_argument("--append", action="store_true",
                   help="add the import to a root that holds checkpoints, as a new baseline (same tables)")
    p.add_argument("--step", type=int, default=None,
                   help="the training step the baseline records (default: the step DCP_DIR records, else 0)")
    p.set_defaults(func=_cmd_import_dcp)

    _add_copy_parser(sub, common)
    _add_publish_parser(sub, common)
    _add_clean_images_parser(sub)
    return parser


def _add_copy_parser(sub: Any, common: argparse.ArgumentParser) -> None:
    p = sub.add_parser("copy", parents=[common], help="copy committed checkpoints to another root, never torn",
                       description="Copy the newest committed chain of ROOT (--all: every committed checkpoint; "
                                   "--id N: N's chain) to DST, any storage to any (a directory, s3://...). Every "
                                   "file is checked as it is read (manifest seals, part and chunk digests, the key on "
                                   "a keyed root), and each checkpoint's manifest, its commit, is written last: a "
                                   "copy stopped anywhere leaves DST restorable at what it committed, and a copy run "
                                   "again skips what is there already (docs/cli.md).")
    p.add_argument("root", metavar="ROOT", help="the root to copy from")
    p.add_argument("dst", metavar="DST", help="the root to copy to (a directory is created if missing)")
    which = p.add_mutually_exclusive_group()
    which.add_argument("--all", action="store_true", help="every committed checkpoint, not only the newest chain")
    which.add_argument("--id", type=int, help="copy this checkpoint's chain")
    p.add_argument("--compact", action="store_true",
                   help="write the chain into DST as one baseline (cnr compact's, lossless), not its members")
    p.add_argument("--dst-storage-option", action="append", metavar="KEY=VALUE",
                   help="passed to DST's storage plugin (repeatable), as --storage-option is to ROOT's")
    p.set_defaults(func=_cmd_copy)


def _add_publish_parser(sub: Any, common: argparse.ArgumentParser) -> None:
    p = sub.add_parser("publish", parents=[common], help="keep a serving snapshot in a directory current",
                       description="Write the newest committed checkpoint's tables to OUT/current/model.pt (a "
                                   "state_dict by the training model's names, in --dtype; int8/int4 as FBGEMM's "
                                   "fused row-wise rows), then, with --follow, each checkpoint committed after it, "
                                   "reading only the rows that changed. OUT/current is a link replaced in one "
                                   "rename, so a server never reads a torn snapshot; a restart resumes from it "
                                   "(docs/publish.md).")
    p.add_argument("root", metavar="ROOT", help="the checkpoint root a training job writes")
    p.add_argument("--out", required=True, metavar="DIR", help="the snapshot's directory (created if missing)")
    p.add_argument("--follow", action="store_true", help="keep polling the root and publish each new commit")
    p.add_argument("--poll-s", type=float, default=5.0, metavar="S", help="seconds between polls (default 5)")
    p.add_argument("--tables", nargs="+", metavar="TABLE", help="publish only these tables (default: all)")
    p.add_argument("--dtype", choices=("int8", "int4", "fp16", "fp32"), default="fp32",
                   help="the served rows' type (default fp32)")
    p.add_argument("--lease", metavar="NAME",
                   help="write a lease under ROOT/followers/NAME.json after each update: a job whose keep.followers "
                        "names NAME keeps what this publisher has not read yet")
    p.set_defaults(func=_cmd_publish)


def _add_clean_images_parser(sub: Any) -> None:
    from cnr_torchrec.ckpt.config import DEFAULT_IMAGE_MAX_AGE_S, MemoryTierConfig

    debug = argparse.ArgumentParser(add_help=False)
    debug.add_argument("--debug", action="store_true", default=argparse.SUPPRESS,
                       help="on an error, print its traceback before the one-line message")
    default = MemoryTierConfig().path
    p = sub.add_parser("clean-images", parents=[debug], help="remove this host's memory images (memory_tier)",
                       description="Remove this user's memory images (memory_tier) under memory_tier.path, one "
                                   "directory per root: by default those whose local root is gone or that are "
                                   "older than --max-age-s (what a job that opens a root removes); --root R: R's; "
                                   "--all: every one. Another user's files are never touched. A job that restarts "
                                   "after its images were removed reads storage.")
    p.add_argument("--path", default=default, help=f"the jobs' memory_tier.path (default {default})")
    which = p.add_mutually_exclusive_group()
    which.add_argument("--root", metavar="ROOT", help="remove the images of this checkpoint root")
    which.add_argument("--all", action="store_true", help="remove every memory image of this user under --path")
    p.add_argument("--max-age-s", type=float, default=DEFAULT_IMAGE_MAX_AGE_S, metavar="S",
                   help=f"by default, remove images unchanged for longer than S seconds (default "
                        f"{DEFAULT_IMAGE_MAX_AGE_S:g}, memory_tier.max_age_s's default)")
    p.add_argument("--dry-run", action="store_true", help="list what would be removed, and remove nothing")
    p.set_defaults(func=_cmd_clean_images)


def _error(args: argparse.Namespace, e: CnrError, advice: str = "") -> None:
    """Prints ``e`` as one line on stderr (after its traceback, with --debug)."""
    if args.debug:
        traceback.print_exc()
    line = one_line(e)
    print(f"cnr {args.command}: {line}{'' if line.endswith('.') or not advice else '.'}{advice}", file=sys.stderr)


def main(argv: Sequence[str] | None = None) -> int:
    """Runs the ``cnr`` command; returns its exit code (see the module docstring)."""
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as e:  # argparse has printed usage and the error
        return int(e.code or 0)
    if args.command is None:  # `cnr` alone: what it can do, as `cnr --help` shows it
        parser.print_help()
        return EXIT_OK
    try:
        return args.func(args)
    except CorruptCheckpointError as e:
        _error(args, e, " Run `cnr verify` for every problem; restore or compact an older checkpoint.")
        return EXIT_CORRUPT
    except CnrError as e:
        _error(args, e)
        return EXIT_ERROR
    except BrokenPipeError:  # `cnr inspect ROOT | head`: the reader left; say nothing more
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        return EXIT_OK
    except OSError as e:
        where = f" ({e.filename})" if e.filename else ""
        if args.debug:
            traceback.print_exc()
        print(f"cnr {args.command}: {e.strerror or e}{where}; check the path and its permissions", file=sys.stderr)
        return EXIT_ERROR
    except KeyboardInterrupt:
        print(f"cnr {args.command}: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
