"""The ``hyperdcp`` command line: its parser, exit codes and dispatch.

This module imports only the standard library, :mod:`dcp.errors` and
:mod:`dcp.interop.sizes`, so ``hyperdcp --help`` and ``--version`` answer
without torch; a subcommand's work (:mod:`dcp.tools.commands`) is imported
once it runs.

Subcommands (``hyperdcp SUBCOMMAND --help`` describes each):

* ``hyperdcp demo`` — the main job: a real multi-rank training run through
  ``CheckpointManager``, killed mid-save, resumed under another parallel
  layout, then preempted by SIGTERM (see :mod:`dcp.tools.demo`); ``hyperdcp demo
  --recovery``: a host lost and the job back from host memory (the memory
  tier, :mod:`dcp.tools.recovery_demo`).
* ``hyperdcp inspect URI`` — format and version, writing ranks, and every
  tensor's shape, dtype, bytes, chunks and writers (``--chunks`` lists each
  chunk; ``--json`` for machine-readable output).
* ``hyperdcp verify URI`` — reads every stored byte and checks every
  checksum; lists each damaged chunk or value by fqn and file (a step a
  manager marked bad: its mark).
* ``hyperdcp diff A B`` — which tensors and values differ, and by how much.
* ``hyperdcp convert SRC DST`` — between hyperdcp checkpoints, Hugging Face
  safetensors (single file or sharded folder), PyTorch DCP checkpoints and
  MindSpore ``.ckpt`` files; the source format is detected (a ``.ckpt``
  by its suffix or its first bytes).
* ``hyperdcp list ROOT`` — every checkpoint under a root (or the one it
  is): complete or incomplete, size, age, orphaned files
  (:mod:`dcp.orchestration.inventory`); for a :class:`dcp.CheckpointManager`
  root, its steps in order, those marked bad, and the step its
  ``latest.json`` names.
* ``hyperdcp prune URI`` — deletes the orphaned files under a checkpoint or
  root: what saves killed before their cleanup left; under a manager's
  root also the steps ``load_latest`` marked bad and, with
  ``--keep-latest N``, all but the newest N complete steps.

A URI is a path or any URI a storage plugin serves; ``-o [SCHEME:]KEY=VALUE``
passes options to the plugins (with ``SCHEME:``, only to that scheme's).
``inspect``, ``verify`` and ``diff`` also take a safetensors folder or file
and a MindSpore ``.ckpt``.
Long work shows progress bars on stderr when it is a terminal (``--quiet``
hides them).

Exit codes:

* 0 — success (``verify``: nothing damaged; ``diff``: no difference)
* 1 — error, message on stderr (not a checkpoint, unreadable source, failed
  conversion, ...)
* 2 — bad usage
* 3 — ``verify`` found damage (listed on stdout; a malformed metadata file
  counts as damage)
* 4 — ``diff``: the checkpoints differ (listed on stdout)
* 130 — interrupted
"""

from __future__ import annotations

import argparse
import os
import re
import sys

from dcp.errors import CheckpointError
from dcp.interop.sizes import DEFAULT_MAX_SHARD_SIZE

EXIT_ERROR, EXIT_USAGE, EXIT_DAMAGED, EXIT_DIFFERENT, EXIT_INTERRUPTED = 1, 2, 3, 4, 130

#: The Python API's keyword arguments that messages name, and the options
#: that say the same on the command line: an error reaching the user through
#: ``hyperdcp`` names the option (:func:`_in_cli_terms`).
API_OPTIONS = {"overwrite=True": "--overwrite", "allow_pickle=True": "--allow-pickle",
               "trusted=True": "--trust-pickle"}

DESCRIPTION = ("hyperdcp: distributed checkpoints for PyTorch. Inspect, verify, compare, "
               "convert, list and prune checkpoints, or run the demo.")
#: What ``hyperdcp convert`` reads and writes (``--to``).
FORMATS = ("hyperdcp", "safetensors", "torch-dcp", "mindspore")


class UsageError(CheckpointError):
    """A malformed command line (exit code 2)."""


def _at_least_one(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, not {value}")
    return value


class _Version(argparse.Action):
    """``--version``: the installed hyperdcp's version, looked up only when
    asked (``importlib.metadata`` costs as much as the rest of the parser)."""

    def __init__(self, option_strings: list[str], dest: str, **kwargs) -> None:
        super().__init__(option_strings, dest, nargs=0, default=argparse.SUPPRESS, **kwargs)

    def __call__(self, parser, namespace, values, option_string=None) -> None:
        import importlib.metadata

        print(f"hyperdcp {importlib.metadata.version('hyperdcp')}")
        parser.exit()


def _in_cli_terms(message: str) -> str:
    """``message`` with the API's keyword arguments replaced by the options
    of the command line (:data:`API_OPTIONS`)."""
    return re.sub("|".join(map(re.escape, API_OPTIONS)),
                  lambda m: API_OPTIONS[m.group(0)], message)


def _demo(argv: list[str]) -> int:
    if "--recovery" in argv:
        from dcp.tools import recovery_demo

        return recovery_demo.main(argv)
    from dcp.tools import demo

    return demo.main(argv)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="hyperdcp", description=DESCRIPTION,
        epilog="exit codes: 0 ok, 1 error, 2 bad usage, 3 verify found damage, "
               "4 diff found differences, 130 interrupted",
        formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--version", action=_Version, help="show the version and exit")
    sub = parser.add_subparsers(dest="command", required=True, metavar="SUBCOMMAND")
    # listed for --help only: main() hands "demo ..." to the demo's own parser
    sub.add_parser("demo", help="train, SIGKILL mid-save, resume under another layout, last "
                                "words on SIGTERM; --recovery: a host lost, resumed from host "
                                "memory (hyperdcp demo [--recovery] --help for options)",
                   add_help=False)

    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("-o", "--storage-option", dest="option", action="append", default=[],
                        metavar="[SCHEME:]KEY=VALUE",
                        help="option for the storage plugins, or with SCHEME: for that scheme's "
                             "only (repeatable; VALUE parsed as JSON when it parses), e.g. "
                             "-o thread_count=8 -o s3:endpoint_url=http://127.0.0.1:9000")
    common.add_argument("-q", "--quiet", action="store_true",
                        help="no progress bars (they show only when stderr is a terminal)")

    p = sub.add_parser("inspect", parents=[common], help="list a checkpoint's tensors and chunks",
                       description="Print a checkpoint's format version, writing ranks, and "
                                   "every tensor's shape, dtype, bytes, chunks and writers. "
                                   "URI may also be a safetensors folder or file. Exit 0, or 1 "
                                   "on error.")
    p.add_argument("uri", metavar="URI")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.add_argument("-c", "--chunks", action="store_true",
                   help="list every chunk: box, file, byte range, checksum, rank")

    p = sub.add_parser("verify", parents=[common], help="check every checksum of a checkpoint",
                       description="Read every stored byte and check every checksum; list each "
                                   "damaged chunk or value (fqn, file, problem); a step "
                                   "CheckpointManager.load_latest marked bad is reported as "
                                   "such. Exit 0 if nothing is damaged, 3 if something is (or "
                                   "the step is marked bad), 1 on error.")
    p.add_argument("uri", metavar="URI")

    p = sub.add_parser("diff", parents=[common], help="compare two checkpoints",
                       description="List fqns present on one side only and tensors or values "
                                   "that differ (bitwise), with how many elements differ and "
                                   "the largest absolute difference. Exit 0 if the same, 4 if "
                                   "different, 1 on error.")
    p.add_argument("a", metavar="A")
    p.add_argument("b", metavar="B")
    p.add_argument("--json", action="store_true", help="machine-readable output")

    p = sub.add_parser("convert", parents=[common],
                       help="convert between hyperdcp, safetensors, PyTorch DCP and "
                            "MindSpore .ckpt",
                       description="Convert SRC (format detected: hyperdcp checkpoint, "
                                   "safetensors folder or file, PyTorch DCP checkpoint, "
                                   "MindSpore .ckpt file, by its suffix or first bytes) into "
                                   "DST, streaming, several files at once within --buffer-bytes; "
                                   "under torchrun every conversion is shared over "
                                   "the ranks. A MindSpore .ckpt is read and written without "
                                   "MindSpore (DST ending in .ckpt: --to mindspore by default); "
                                   "MindSpore's safetensors files are safetensors. Exit 0, or 1 "
                                   "on error, 2 on bad usage.")
    p.add_argument("src", metavar="SRC")
    p.add_argument("dst", metavar="DST")
    p.add_argument("--to", choices=FORMATS,
                   help="format to write (default: hyperdcp; when SRC is hyperdcp, required "
                        "unless DST ends in .ckpt: mindspore)")
    p.add_argument("--max-shard-size", default=DEFAULT_MAX_SHARD_SIZE,
                   metavar="SIZE",
                   help="safetensors export: bytes of tensors per file, e.g. 5GB or 500MiB "
                        "(default %(default)s)")
    p.add_argument("--rename-map", metavar="FILE",
                   help="JSON file mapping source names to destination names")
    p.add_argument("--buffer-bytes", default="512MiB", metavar="SIZE",
                   help="memory budget of a conversion per process, e.g. 2GiB "
                        "(default %(default)s; at least the largest tensor is let through)")
    p.add_argument("--dtype", default=None, metavar="DTYPE",
                   help="safetensors and mindspore export: cast floating-point tensors, e.g. "
                        "bfloat16")
    p.add_argument("--model-only", action="store_true",
                   help="safetensors and mindspore export: only the tensors under 'model.', "
                        "named without it")
    p.add_argument("--prefix", default=None,
                   help="safetensors and mindspore export: only the tensors under this "
                        "prefix, named without it")
    p.add_argument("--crc-check", action="store_true",
                   help="mindspore export: end the .ckpt with MindSpore's crc_num trailer "
                        "(checked by load_checkpoint(..., crc_check=True); a trailer in a "
                        "source is always checked)")
    p.add_argument("--overwrite", action="store_true", help="replace what DST holds")
    p.add_argument("--trust-pickle", action="store_true",
                   help="PyTorch DCP source: allow reading its pickled metadata and values, "
                        "which can run code (only for checkpoints you trust)")
    p.add_argument("--allow-pickle", action="store_true",
                   help="store non-JSON values pickled (import), or unpickle stored ones to "
                        "hand to torch (export to torch-dcp)")

    p = sub.add_parser("list", parents=[common],
                       help="list the checkpoints under a root, complete or not",
                       description="List every checkpoint folder under ROOT (ROOT itself "
                                   "included): complete, incomplete (no committed metadata: a "
                                   "save interrupted or in flight) or damaged, its size, age "
                                   "and orphaned files. Exit 0, or 1 on error.")
    p.add_argument("root", metavar="ROOT")
    p.add_argument("--json", action="store_true", help="machine-readable output")

    p = sub.add_parser("prune", parents=[common],
                       help="delete what killed saves left, steps marked bad, and old steps "
                            "(--keep-latest)",
                       description="Delete the orphaned files of every checkpoint folder under "
                                   "URI: data, exchange and commit files no committed metadata "
                                   "uses, left by saves killed before they could clean up, and "
                                   "their emptied folders. Under a CheckpointManager root, also "
                                   "the steps load_latest marked bad (corrupt; their files as "
                                   "orphans, by --min-age) and, with --keep-latest, old complete "
                                   "steps. Files hyperdcp does not name are never touched. Exit "
                                   "0, or 1 on error.")
    p.add_argument("uri", metavar="URI")
    p.add_argument("--min-age", type=float, default=60.0, metavar="MINUTES",
                   help="delete only files written at least this long ago, so that a save "
                        "still in flight keeps its files (default %(default)g; 0: all)")
    p.add_argument("--keep-latest", type=_at_least_one, metavar="N",
                   help="under a CheckpointManager root: also delete every complete step "
                        "but the newest N, and the files of incomplete steps older than the "
                        "newest complete one (a step in flight is newer: kept)")
    return parser


def main(argv: list[str] | None = None) -> int:
    """Run the command line; returns the exit code (see the module doc)."""
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["demo"]:
        return _demo(argv[1:])
    args = _parser().parse_args(argv)
    try:
        from dcp.tools import commands  # torch and the layers: only once a subcommand runs

        return commands.RUN[args.command](args)
    except CheckpointError as e:
        print(f"hyperdcp: error: {_in_cli_terms(str(e))}", file=sys.stderr)
        return EXIT_USAGE if isinstance(e, UsageError) else EXIT_ERROR
    except KeyboardInterrupt:
        print("hyperdcp: interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED
    except BrokenPipeError:  # stdout piped into a command that stopped reading (| head)
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # no error at exit
        return EXIT_ERROR
