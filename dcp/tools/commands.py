"""What each ``hyperdcp`` subcommand does (:mod:`dcp.tools.cli` parses the
command line and calls :data:`RUN`): formats detected, checkpoints read,
verified, compared, converted, listed and pruned, and what is printed.

Apart from the parser because it imports torch and every layer it uses,
which ``hyperdcp --help`` and ``--version`` do without.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

from tqdm import tqdm

from dcp.coordination.independent import has_metadata, what_is_there
from dcp.core.compression import RAW
from dcp.core.metadata import CHECKSUM, METADATA_FILE, TORCH_METADATA_FILE
from dcp.core.storage import open_storage, scheme_of, storage_errors
from dcp.errors import CheckpointError, CorruptCheckpointError, NotACheckpointError
from dcp.interop import mindspore_ckpt, safetensors_io, torch_dcp_io
from dcp.interop.mindspore_ckpt import MindSporeCkpt, is_mindspore_ckpt
from dcp.interop.safetensors_io import INDEX_FILE, SUFFIX, SafetensorsFolder
from dcp.interop.streaming import split_file
from dcp.manager.policies import LatestN
from dcp.manager.steps import (
    POINTER,
    STEP_PREFIX,
    delete_bad_steps,
    prune_steps,
    read_bad_mark,
    read_pointer,
    step_of,
)
from dcp.orchestration import inventory
from dcp.orchestration.load import read_metadata
from dcp.tools.cli import EXIT_DAMAGED, EXIT_DIFFERENT, EXIT_USAGE, FORMATS, UsageError
from dcp.tools.diff import diff
from dcp.tools.verify import verify

#: ``hyperdcp list``'s state of a step that ``load_latest`` marked bad.
BAD = "bad"


def _options(pairs: list[str]) -> dict[str | None, dict]:
    """``[SCHEME:]KEY=VALUE`` pairs as plugin options, by scheme (``None``:
    for every plugin).  A value is parsed as JSON (``8``, ``false``) when it
    parses, else kept as a string."""
    options: dict[str | None, dict] = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        scheme, _, name = key.rpartition(":")
        if not sep or not name:
            raise UsageError(f"storage option {pair!r} is not [SCHEME:]KEY=VALUE")
        try:
            parsed = json.loads(value)
        except ValueError:
            parsed = value
        options.setdefault(scheme or None, {})[name] = parsed
    return options


def _options_for(uri: str, options: dict[str | None, dict]) -> dict:
    """The options of ``uri``'s plugin: those for every plugin, then those
    for its scheme."""
    return {**options.get(None, {}), **options.get(scheme_of(uri), {})}


def _is_ckpt_file(uri: str, options: dict[str | None, dict]) -> bool:
    """Whether ``uri`` is a plain file that is a MindSpore ``.ckpt``: by its
    suffix, or else by its first bytes (:func:`is_mindspore_ckpt`)."""
    root, name = split_file(uri)
    try:
        storage = open_storage(root, **_options_for(uri, options))
        head = memoryview(bytearray(min(mindspore_ckpt.HEAD_BYTES,
                                        mindspore_ckpt.file_size(storage, name))))
        storage.read_ranges(name, [(0, head)])
    except Exception:  # noqa: BLE001  # no such file, a folder, an unreadable one: not one
        return False
    return name.endswith(mindspore_ckpt.SUFFIX) or is_mindspore_ckpt(bytes(head))


def _detect(uri: str, options: dict[str | None, dict]) -> str:
    """The format of what ``uri`` holds: one of :data:`dcp.tools.cli.FORMATS`.  Checkpoint
    folders are looked for first, so a folder named ``*.ckpt`` (PyTorch
    Lightning names its DCP folders ``epoch=0-step=10.ckpt``) is one."""
    if uri.endswith(SUFFIX):
        return "safetensors"
    storage = open_storage(uri, **_options_for(uri, options))
    with storage_errors(f"reading {uri!r}"):
        if has_metadata(storage):
            return "hyperdcp"
        if storage.exists(TORCH_METADATA_FILE):
            return "torch-dcp"
        if _is_ckpt_file(uri, options):
            return "mindspore"
        if storage.exists(INDEX_FILE) or any(n.endswith(SUFFIX) and "/" not in n
                                             for n in _names(storage)):
            return "safetensors"
    raise NotACheckpointError(
        f"{uri!r} is not a checkpoint (no {METADATA_FILE}, no PyTorch DCP "
        f"{TORCH_METADATA_FILE}, no {SUFFIX} file, not a MindSpore {mindspore_ckpt.SUFFIX} "
        f"file): {what_is_there(storage)}")


def _names(storage) -> list[str]:
    """The files under ``storage``'s root; none where the root is a file."""
    try:
        return storage.list_files()
    except NotADirectoryError:
        return []


def _open(uri: str, options: dict[str | None, dict]):
    """``(format, storage)`` for reading ``uri`` as a checkpoint."""
    fmt = _detect(uri, options)
    if fmt == "torch-dcp":
        raise CheckpointError(
            f"{uri!r} is a PyTorch DCP checkpoint, whose metadata is a pickle; convert it first "
            f"(hyperdcp convert --trust-pickle {uri} DST), if you trust it")
    if fmt == "safetensors":
        return fmt, SafetensorsFolder(uri, **_options_for(uri, options))
    if fmt == "mindspore":
        return fmt, MindSporeCkpt(uri, **_options_for(uri, options))
    return fmt, open_storage(uri, **_options_for(uri, options))


def _progress(args) -> bool:
    return not args.quiet and sys.stderr.isatty()


def _inspect(args) -> int:
    fmt, storage = _open(args.uri, _options(args.option))
    md = read_metadata(args.uri, storage=storage)
    if args.json:
        doc = {
            "format": fmt, "version": md.version, "save_id": md.save_id,
            "world_size": md.world_size, "stored_bytes": md.stored_bytes,
            "file_bytes": sum(t.file_bytes for t in md.tensors.values()),
            "unique_bytes": md.unique_bytes, "files": sorted(md.files()),
            "tensors": {fqn: {"shape": list(t.shape), "dtype": t.dtype, "nbytes": t.nbytes,
                              "file_bytes": t.file_bytes,
                              "ranks": sorted({c.rank for c in t.chunks}), "chunks": [
                {"offsets": list(c.offsets), "sizes": list(c.sizes), "file": c.file,
                 "byte_offset": c.byte_offset, "nbytes": c.nbytes, "checksum": c.checksum,
                 "rank": c.rank, "file_nbytes": c.stored_nbytes,
                 "frames": None if c.frames is None else len(c.frames.stored)}
                for c in t.chunks]} for fqn, t in md.tensors.items()},
            "objects": {fqn: ("<pickled>" if o.pickled else o.value)
                        for fqn, o in md.objects.items()},
        }
        print(json.dumps(doc, indent=1))
        return 0
    what = (f"hyperdcp format v{md.version}, saved by {md.world_size} rank(s)" if fmt == "hyperdcp"
            else f"{fmt} (no checksums)")
    in_files = sum(t.file_bytes for t in md.tensors.values())
    packed = (f", {in_files} in data files ({md.stored_bytes / max(1, in_files):.2f}x "
              f"compressed)" if in_files != md.stored_bytes else "")
    print(f"{args.uri}: {what}, {len(md.tensors)} tensors, {len(md.objects)} values, "
          f"{md.stored_bytes} bytes of chunks ({tqdm.format_sizeof(md.stored_bytes, 'B', 1024)})"
          f"{packed}, {len(md.files())} files")
    for fqn, t in md.tensors.items():
        ranks = sorted({c.rank for c in t.chunks})
        packed = (f" ({t.file_bytes} B in files, {t.stored_bytes / max(1, t.file_bytes):.2f}x "
                  f"zstd)" if t.compressed else "")
        print(f"  {fqn}: {t.dtype}{list(t.shape)} {t.nbytes} B{packed}, {len(t.chunks)} "
              f"chunk(s), written by rank(s) {ranks}")
        if args.chunks:
            for c in t.chunks:
                crc = "no checksum" if c.checksum is None else f"{CHECKSUM} {c.checksum:#010x}"
                frames = "" if c.frames is None else (
                    f", {len(c.frames.stored)} frames ({c.frames.kinds.count(RAW)} stored raw)")
                print(f"    at {list(c.offsets)} size {list(c.sizes)}: {c.file} "
                      f"[{c.byte_offset}, {c.byte_offset + c.stored_nbytes}) {crc}, rank "
                      f"{c.rank}{frames}")
    for fqn, o in md.objects.items():
        print(f"  {fqn}: {'<pickled>' if o.pickled else repr(o.value)[:80]}")
    return 0


def _verify(args) -> int:
    try:
        mark = read_bad_mark(open_storage(args.uri, **_options_for(args.uri,
                                                                   _options(args.option))))
    except Exception:  # noqa: BLE001  # the storage cannot say: reading the checkpoint tells why
        mark = None
    if mark is not None:
        kept = (f"its metadata is kept as {mark['metadata']} (rename it to {METADATA_FILE} to "
                f"restore the step)" if mark.get("metadata") else "it had no metadata left")
        print(f"BAD: {args.uri} was marked bad by load_latest: {mark.get('reason', '')}; "
              f"{kept}; hyperdcp prune of its root deletes it")
        return EXIT_DAMAGED
    try:
        fmt, storage = _open(args.uri, _options(args.option))
        if fmt == "hyperdcp":
            entry = inventory.inspect_checkpoint(storage)
            if entry.state == inventory.MEMORY:
                raise CheckpointError(f"{args.uri} is {entry.detail}; verify checks whole "
                                      f"checkpoints (a persistent step)")
        report = verify(args.uri, storage=storage, progress=_progress(args))
    except CorruptCheckpointError as e:
        print(f"DAMAGED: {e}")
        return EXIT_DAMAGED
    for damage in report.damaged:
        print(f"DAMAGED: {damage}")
    hyperdcp = fmt == "hyperdcp"
    orphans = inventory.inspect_checkpoint(storage).orphans if hyperdcp else {}
    for name, (size, _) in orphans.items():
        print(f"ORPHANED: {name} ({_size(size)}): not part of the committed checkpoint (left by "
              f"an interrupted save); hyperdcp prune {args.uri} deletes it")
    note = (f", {report.unchecked} chunk(s) carry no checksum (read in full, not checkable)"
            if report.unchecked else "")
    print(f"{args.uri}: {report.checked} checksum(s) match, {len(report.damaged)} damaged, "
          f"{report.nbytes} bytes read{note}")
    return EXIT_DAMAGED if report.damaged else 0


def _diff(args) -> int:
    options = _options(args.option)
    _, sa = _open(args.a, options)
    _, sb = _open(args.b, options)
    report = diff(args.a, args.b, storage_a=sa, storage_b=sb, progress=_progress(args))
    if args.json:
        print(json.dumps({
            "same": report.same, "identical": report.identical,
            "only_in_a": report.only_in_a, "only_in_b": report.only_in_b,
            "tensors": [{"fqn": d.fqn, "problem": d.problem, "detail": d.detail,
                         "differing": d.differing, "numel": d.numel, "max_abs": d.max_abs}
                        for d in report.tensors],
            "objects": report.objects}, indent=1))
    else:
        for fqn in report.only_in_a:
            print(f"only in A: {fqn}")
        for fqn in report.only_in_b:
            print(f"only in B: {fqn}")
        for d in report.tensors:
            print(f"differs: {d}")
        for fqn in report.objects:
            print(f"differs: {fqn} (value)")
        state = "same" if report.same else "different"
        print(f"{state}: {report.identical} identical, {len(report.tensors) + len(report.objects)} "
              f"differ, {len(report.only_in_a)} only in A, {len(report.only_in_b)} only in B")
    return 0 if report.same else EXIT_DIFFERENT


def _size(nbytes: int | None) -> str:
    if nbytes is None:
        return "size unknown"
    return f"{nbytes} B" if nbytes < 1024 else tqdm.format_sizeof(nbytes, "B", 1024)


def _age(seconds: float | None) -> str:
    if seconds is None:
        return "age unknown"
    for unit, span in (("d", 86400), ("h", 3600), ("min", 60)):
        if seconds >= span:
            return f"{seconds / span:.1f} {unit} ago"
    return f"{seconds:.0f} s ago"


def _latest(root: str, options: dict, found: list) -> tuple[int | None, str]:
    """The step ``load_latest`` resumes from by a manager root's
    ``latest.json`` (``None`` if the pointer cannot say), and what the
    pointer says of it."""
    pointer = read_pointer(open_storage(root, **options))
    if pointer is None:
        return None, ""
    complete = {e.name: e.metadata for e in found if e.metadata is not None}
    step, previous = pointer["step"], pointer.get("previous")
    md = complete.get(f"{STEP_PREFIX}{step}")
    if md is not None:
        same = md.save_id == pointer.get("save_id")
        return step, f"step {step} ({'verified' if same else 'complete'})"
    if isinstance(previous, int) and f"{STEP_PREFIX}{previous}" in complete:
        return previous, (f"step {step} (not committed: a save in flight, or one that failed or "
                          f"was marked bad), after step {previous} (complete)")
    return None, f"step {step} (stale: hyperdcp and load_latest fall back to listing)"


def _by_step(entry) -> tuple:
    """Order step folders by their number, others by name."""
    step = step_of(f"{entry.name}/x")
    return (entry.name.rpartition("/")[0], step if step is not None else -1, entry.name)


def _require_location(uri: str, options: dict) -> None:
    """Refuse a root that does not exist (a mistyped path in a script must
    not pass for an empty one)."""
    storage = open_storage(uri, **options)
    with storage_errors(f"reading {uri!r}"):
        exists = storage.location_exists()
    if exists is False:
        raise CheckpointError(f"{uri}: no such directory")


def _list(args) -> int:
    options = _options_for(args.root, _options(args.option))
    _require_location(args.root, options)
    found = sorted(inventory.scan(args.root, options), key=_by_step)
    latest, verdict = _latest(args.root, options, found)
    root = open_storage(args.root, **options)
    bad: dict[str, dict] = {}
    for e in found:  # a marked step holds data files but no metadata: incomplete
        if e.state == inventory.INCOMPLETE and step_of(f"{e.name}/x") is not None:
            mark = read_bad_mark(root, f"{e.name}/")
            if mark is not None:
                bad[e.name] = mark

    def state_of(e) -> str:
        return BAD if e.name in bad else e.state

    def detail_of(e) -> str:
        return str(bad[e.name].get("reason", "")) if e.name in bad else e.detail

    if args.json:
        print(json.dumps([{"name": e.name, "uri": e.uri, "state": state_of(e), "nbytes": e.nbytes,
                           "age_s": e.age_s, "orphans": sorted(e.orphans),
                           "orphan_bytes": e.orphan_bytes, "detail": detail_of(e),
                           **({"latest": True} if latest is not None
                              and e.name == f"{STEP_PREFIX}{latest}" else {})}
                          for e in found], indent=1))
        return 0
    if not found:
        print(f"{args.root}: no checkpoint there")
        return 0
    if verdict:
        print(f"{POINTER}: {verdict}")
    elif root.exists(POINTER):
        print(f"{POINTER}: not a pointer (unreadable, or not {{\"step\": N, \"save_id\": ...}}):"
              f" hyperdcp and load_latest fall back to listing")
    for e in found:
        state = state_of(e)
        if e.name in bad:
            state += (f" (marked by load_latest: {detail_of(e)}): not complete; hyperdcp prune "
                      f"{args.root} deletes it")
        elif e.state == inventory.COMPLETE and e.orphans:
            state += f", {len(e.orphans)} orphaned file(s) ({_size(e.orphan_bytes)})"
        elif e.state == inventory.INCOMPLETE:
            state += (f": no committed metadata, {len(e.orphans)} file(s) of an interrupted "
                      f"save or one in flight")
        elif e.state == inventory.DAMAGED:
            state += f": {e.detail}"
        elif e.state == inventory.MEMORY:
            state += ": one host's part, managed by its CheckpointManager (nothing to prune)"
        print(f"{e.name or '.'}: {state}; {_size(e.nbytes)}, written {_age(e.age_s)}")
    orphaned = sum(len(e.orphans) for e in found if e.name not in bad)
    if orphaned:
        print(f"{orphaned} orphaned file(s): hyperdcp prune {args.root} deletes those older "
              f"than --min-age")
    return 0


def _prune(args) -> int:
    options = _options(args.option)
    options = _options_for(args.uri, options)
    _require_location(args.uri, options)
    result = inventory.prune(args.uri, args.min_age * 60, options)
    bad, left = delete_bad_steps(args.uri, options)  # their data files went as orphans
    if bad:
        print(f"{args.uri}: deleted step(s) {', '.join(map(str, bad))} (marked bad)")
    if left:
        print(f"{args.uri}: kept step(s) {', '.join(map(str, left))} (marked bad): they hold "
              f"files written less than {args.min_age:g} min ago, maybe a save of that step "
              f"in flight")
    if args.keep_latest is not None:
        steps = prune_steps(args.uri, LatestN(args.keep_latest), options)
        print(f"{args.uri}: deleted step(s) {', '.join(map(str, steps)) or 'none'} "
              f"(kept the newest {args.keep_latest} complete)")
    for uri, size in result.removed.items():
        print(f"removed {uri} ({_size(size)})")
    total = sum(s or 0 for s in result.removed.values())
    print(f"{args.uri}: removed {len(result.removed)} orphaned file(s) ({_size(total)})")
    if result.kept:
        print(f"kept {len(result.kept)} orphaned file(s) written less than {args.min_age:g} "
              f"min ago (or of unknown age): a save may still be writing them; --min-age 0 "
              f"deletes them too")
    return 0


def _rename_map(path: str | None) -> dict[str, str] | None:
    if path is None:
        return None
    try:
        rename = json.loads(Path(path).read_text())
    except (OSError, ValueError) as e:
        raise CheckpointError(f"--rename-map {path!r}: cannot read a JSON object ({e})") from None
    if not isinstance(rename, dict) or not all(isinstance(v, str) for v in rename.values()):
        raise CheckpointError(
            f"--rename-map {path!r}: must be a JSON object of old name -> new name")
    return rename


def _job_group():
    """The whole job's process group when run under ``torchrun`` with more
    than one rank (its ``WORLD_SIZE`` and rendezvous variables; gloo), else
    ``None``: a conversion then runs in this process alone."""
    if int(os.environ.get("WORLD_SIZE", "1")) <= 1:
        return None
    import torch.distributed as dist

    if not dist.is_initialized():
        dist.init_process_group("gloo")
    return dist.group.WORLD


def _convert(args) -> int:
    options = _options(args.option)
    source = _detect(args.src, options)
    target = args.to or ("hyperdcp" if source != "hyperdcp" else
                         "mindspore" if args.dst.endswith(mindspore_ckpt.SUFFIX) else None)
    if target is None:
        print("hyperdcp convert: error: SRC is a hyperdcp checkpoint: say which format to write "
              f"with --to ({', '.join(FORMATS[1:])})", file=sys.stderr)
        return EXIT_USAGE
    if args.to is None and source != "hyperdcp" and args.dst.endswith(mindspore_ckpt.SUFFIX):
        print(f"hyperdcp convert: error: SRC is {source}, and a {mindspore_ckpt.SUFFIX} DST would "
              f"be written as a hyperdcp folder; convert to hyperdcp first, then that to "
              f"MindSpore with --to mindspore (or name the hyperdcp folder with --to hyperdcp)",
              file=sys.stderr)
        return EXIT_USAGE
    common = {"rename": _rename_map(args.rename_map), "overwrite": args.overwrite,
              "progress": _progress(args)}
    budget = safetensors_io.parse_size(args.buffer_bytes)
    group = _job_group()
    started = time.perf_counter()
    src_options, dst_options = _options_for(args.src, options), _options_for(args.dst, options)
    skipped: list[str]  # the values the target format cannot hold
    if (source, target) == ("safetensors", "hyperdcp"):
        md = safetensors_io.safetensors_to_checkpoint(
            args.src, args.dst, source_options=src_options, storage_options=dst_options,
            buffer_bytes=budget, process_group=group, **common)
        count, nbytes, skipped = len(md.tensors), md.stored_bytes, []
    elif (source, target) == ("hyperdcp", "safetensors"):
        result = safetensors_io.checkpoint_to_safetensors(
            args.src, args.dst, max_shard_size=args.max_shard_size, storage_options=src_options,
            dest_options=dst_options, dtype=args.dtype, model_only=args.model_only,
            prefix=args.prefix, buffer_bytes=budget, process_group=group, **common)
        count, nbytes, skipped = result.tensors, result.nbytes, result.skipped
    elif (source, target) == ("mindspore", "hyperdcp"):
        md = mindspore_ckpt.mindspore_ckpt_to_checkpoint(
            args.src, args.dst, source_options=src_options, storage_options=dst_options,
            buffer_bytes=budget, process_group=group, **common)
        count, nbytes, skipped = len(md.tensors), md.stored_bytes, []
    elif (source, target) == ("hyperdcp", "mindspore"):
        result = mindspore_ckpt.checkpoint_to_mindspore_ckpt(
            args.src, args.dst, storage_options=src_options, dest_options=dst_options,
            dtype=args.dtype, model_only=args.model_only, prefix=args.prefix,
            crc_check=args.crc_check, buffer_bytes=budget, process_group=group, **common)
        count, nbytes, skipped = result.tensors, result.nbytes, result.skipped
    elif (source, target) == ("torch-dcp", "hyperdcp"):
        md = torch_dcp_io.torch_dcp_to_checkpoint(
            args.src, args.dst, trusted=args.trust_pickle, allow_pickle=args.allow_pickle,
            storage_options=dst_options, buffer_bytes=budget, process_group=group, **common)
        count, nbytes, skipped = len(md.tensors), md.stored_bytes, []
    elif (source, target) == ("hyperdcp", "torch-dcp"):
        result = torch_dcp_io.checkpoint_to_torch_dcp(
            args.src, args.dst, allow_pickle=args.allow_pickle, storage_options=src_options,
            buffer_bytes=budget, process_group=group, **common)
        count, nbytes, skipped = result.tensors, result.nbytes, result.skipped
    else:
        print(f"hyperdcp convert: error: cannot convert {source} to {target}; convert to hyperdcp "
              f"first", file=sys.stderr)
        return EXIT_USAGE
    seconds = time.perf_counter() - started
    if group is not None and __import__("torch.distributed").distributed.get_rank() != 0:
        return 0
    print(f"converted {count} tensors ({nbytes} bytes) from {source} {args.src} to {target} "
          f"{args.dst} in {seconds:.2f} s ({_size(round(nbytes / max(seconds, 1e-9)))}/s)")
    if skipped:
        print(f"note: {target} holds tensors only; skipped {len(skipped)} value(s): "
              f"{', '.join(skipped)}")
    return 0


#: Each subcommand's work, by name: it takes the parsed arguments and
#: returns the exit code.
RUN = {"inspect": _inspect, "verify": _verify, "diff": _diff, "convert": _convert,
       "list": _list, "prune": _prune}
