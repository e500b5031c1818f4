"""The ``hyperdcp`` command line.

Subcommands:

* ``hyperdcp demo`` — the main job: a real multi-rank training run saved and
  resumed under another parallel layout (see :mod:`dcp.demo`).
* ``hyperdcp inspect URI`` — tensors, shapes, dtypes, chunks and bytes of a
  checkpoint (``--json`` for machine-readable output).

Exit codes: 0 success, 1 a checkpoint error (message on stderr), 2 bad usage.
"""

from __future__ import annotations

import argparse
import json
import sys

from dcp.errors import CheckpointError


def _inspect(args) -> int:
    from dcp.load import read_metadata

    md = read_metadata(args.uri)
    if args.json:
        doc = {
            "version": md.version, "save_id": md.save_id, "world_size": md.world_size,
            "stored_bytes": md.stored_bytes, "unique_bytes": md.unique_bytes,
            "tensors": {fqn: {"shape": list(t.shape), "dtype": t.dtype, "chunks": [
                {"offsets": list(c.offsets), "sizes": list(c.sizes), "file": c.file,
                 "byte_offset": c.byte_offset, "nbytes": c.nbytes, "checksum": c.checksum,
                 "rank": c.rank} for c in t.chunks]} for fqn, t in md.tensors.items()},
            "objects": {fqn: ("<pickled>" if o.pickled else o.value) for fqn, o in md.objects.items()},
        }
        print(json.dumps(doc, indent=1))
        return 0
    print(f"checkpoint {args.uri}: format v{md.version}, saved by {md.world_size} rank(s), "
          f"{len(md.tensors)} tensors, {md.stored_bytes} bytes stored, {len(md.files())} files")
    for fqn, t in md.tensors.items():
        ranks = sorted({c.rank for c in t.chunks})
        print(f"  {fqn}: {t.dtype}{list(t.shape)} {t.nbytes} B, {len(t.chunks)} chunk(s), "
              f"written by rank(s) {ranks}")
    for fqn, o in md.objects.items():
        print(f"  {fqn}: {'<pickled>' if o.pickled else repr(o.value)[:80]}")
    return 0


def _demo(args) -> int:
    from dcp import demo

    return demo.main(args.demo_args)


def main(argv: list[str] | None = None) -> int:
    """Run the command line; returns the exit code."""
    parser = argparse.ArgumentParser(prog="hyperdcp", description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("demo", help="train, checkpoint and resume under another layout",
                       add_help=False)
    p.add_argument("demo_args", nargs=argparse.REMAINDER)
    p.set_defaults(run=_demo)
    p = sub.add_parser("inspect", help="list a checkpoint's tensors and chunks")
    p.add_argument("uri")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.set_defaults(run=_inspect)
    args = parser.parse_args(argv)
    try:
        return args.run(args)
    except CheckpointError as e:
        print(f"hyperdcp: error: {e}", file=sys.stderr)
        return 1
