"""Remapping at load: fill a target tensor from boxes of several source tensors.

A map is data (JSON-able), not code: ``{target: rule}``, where a rule is

* ``{"concat": dim, "sources": [name, ...]}`` — the sources laid one after
  another along ``dim`` (fused QKV from q/k/v, fused gate/up);
* ``{"stack": dim, "sources": [name, ...]}`` — the sources stacked along a
  new ``dim`` (MoE experts);
* ``{"slice": dim, "source": name, "start": a, "stop": b}`` — a part of
  one source (un-fusing);
* ``{"select": dim, "source": name, "index": i}`` — index ``i`` of one
  source's dimension ``dim``, that dimension dropped
  (``source.select(dim, i)``: one expert out of a stack, the inverse of
  ``stack``);
* ``{"transpose": perm, "source": name}`` — one source with its dimensions
  permuted (``target = source.permute(perm)``: ``[1, 0]`` for a matrix).

``"transpose": perm`` may also be added to a concat, stack, slice or select rule:
the target is then that rule's result permuted (``cat(...).permute(perm)``:
fused QKV into a layout storing ``[in, 3 * out]``, like GPT-2's ``c_attn``).
``perm`` is any permutation of the result's dimensions, of any rank (for 0-d
and 1-D tensors only the identity).

Names may hold placeholders ``{name}`` matching any run of characters
(``{i}`` in a ``stack`` source list given as a single string enumerates
``0, 1, ...``), so one map serves every layer; :data:`MAPS` ships the
common ones.

How it reads only what it needs: a concat, stack, or a slice or select
along the leading dimension of a chunk is a change of coordinates that moves
a source chunk's box into the target without changing the order of its
bytes (offsets shift, gain or lose a dimension; a leading-dimension slice or
select cuts a contiguous byte range).  So :class:`RemappedView` presents the source
checkpoint (ours or a :class:`~dcp.interop.safetensors_io.SafetensorsFolder`)
with remapped metadata — target tensors whose chunks point into the source
files — and the unchanged load planner does the rest: resharding, each rank
reading only the byte runs of its own boxes, coalescing.  A rule that
changes the byte order (a transposition, or a slice or select across a
dimension a chunk's bytes cannot follow) is *staged* instead (:class:`Staged`): for
each box a rank holds of the target, the part of each source landing in it
is read, by the same planner, as a box of that source into a scratch tensor
of the box's size, then copied into the target through a permuted view
(:func:`load_through`).  Every mistake — an unknown source, shape or dtype
mismatch, a source used twice, slices or selects that overlap or leave
gaps, an index out of range, a bad permutation — raises
:class:`~dcp.CheckpointError` naming the target and sources before anything
is read.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field, replace

import torch

from dcp.core import tensors
from dcp.core.metadata import DTYPE_ITEMSIZE, ChunkMeta, Metadata, TensorMeta
from dcp.core.state_dict import flatten
from dcp.core.storage import StoragePlugin
from dcp.errors import CheckpointError
from dcp.interop.parallel import aligned_bytes, read_tensors
from dcp.interop.streaming import check_readable
from dcp.interop.view import ReadOnlyView

#: Maps for the common fused layouts, Hugging Face names on the right.
MAPS: dict[str, dict] = {
    # BERT-style attention (MiniLM): query/key/value -> one fused projection
    "bert_fused_qkv": {
        "{p}.attention.self.qkv.weight": {"concat": 0, "sources": [
            "{p}.attention.self.query.weight", "{p}.attention.self.key.weight",
            "{p}.attention.self.value.weight"]},
        "{p}.attention.self.qkv.bias": {"concat": 0, "sources": [
            "{p}.attention.self.query.bias", "{p}.attention.self.key.bias",
            "{p}.attention.self.value.bias"]},
    },
    # Llama-style attention and MLP
    "llama_fused_qkv": {
        "{p}.self_attn.qkv_proj.weight": {"concat": 0, "sources": [
            "{p}.self_attn.q_proj.weight", "{p}.self_attn.k_proj.weight",
            "{p}.self_attn.v_proj.weight"]},
    },
    "llama_fused_gate_up": {
        "{p}.mlp.gate_up_proj.weight": {"concat": 0, "sources": [
            "{p}.mlp.gate_proj.weight", "{p}.mlp.up_proj.weight"]},
    },
    # Mixtral-style experts -> one stacked tensor per projection
    "mixtral_stacked_experts": {
        f"{{p}}.block_sparse_moe.experts.{w}": {
            "stack": 0, "sources": f"{{p}}.block_sparse_moe.experts.{{i}}.{w}.weight"}
        for w in ("w1", "w2", "w3")
    },
}


def _pattern(template: str) -> re.Pattern:
    parts = re.split(r"(\{\w+\})", template)
    return re.compile("".join(f"(?P<{p[1:-1]}>.+?)" if p.startswith("{") else re.escape(p)
                              for p in parts) + r"\Z")


_KINDS = ("concat", "stack", "slice", "select")


def _kind_of(target: str, rule) -> str:
    """The rule's kind: ``concat``, ``stack``, ``slice``, ``select`` or
    (alone) ``transpose``."""
    kinds = [k for k in _KINDS if isinstance(rule, dict) and k in rule]
    if isinstance(rule, dict) and not kinds and "transpose" in rule:
        return "transpose"
    if len(kinds) != 1:
        raise CheckpointError(f"remap rule for {target!r} must have exactly one of "
                              f"'concat', 'stack', 'slice', 'select' (or 'transpose' alone): "
                              f"{rule!r}")
    return kinds[0]


def expand(mapping: dict, names: list[str]) -> dict[str, tuple[str, int, list[str], dict]]:
    """The concrete rules of ``mapping`` over the source ``names``: target
    -> (kind, dim, sources, rule); ``dim`` is 0 for a ``transpose`` rule.
    A rule whose first source matches no name is unused; a templated target
    takes its placeholders from the first source."""
    out: dict[str, tuple[str, int, list[str], dict]] = {}
    for target, rule in mapping.items():
        kind = _kind_of(target, rule)
        dim = 0 if kind == "transpose" else rule[kind]
        if type(dim) is not int:
            raise CheckpointError(f"remap rule for {target!r}: {kind} takes a dimension, "
                                  f"not {dim!r}")
        sources = rule.get("sources", [rule.get("source")])
        stacked_template = isinstance(sources, str)
        first = sources if stacked_template else sources[0]
        if not isinstance(first, str):
            raise CheckpointError(f"remap rule for {target!r} names no source: {rule!r}")
        probe = _pattern(first.replace("{i}", "0") if stacked_template else first)
        for name in names:
            m = probe.match(name)
            if m is None:
                continue
            values = m.groupdict()
            fill = lambda t, v=values: t.format(**v) if v else t  # noqa: E731
            if stacked_template:
                found, i = [], 0
                while (src := sources.format(**values, i=i)) in names:
                    found.append(src)
                    i += 1
            else:
                found = [fill(s) for s in sources]
            concrete = fill(target)
            if concrete in out:
                raise CheckpointError(f"remap: target {concrete!r} is produced by two rules")
            out[concrete] = (kind, dim, found, rule)
    return out


def _shift(chunk: ChunkMeta, dim: int, by: int) -> ChunkMeta:
    offsets = list(chunk.offsets)
    offsets[dim] += by
    return replace(chunk, offsets=tuple(offsets))


@dataclass
class Piece:
    """Where one source lands in a staged target, in the coordinates of
    the target before its permutation (``U``): the source's part
    ``[offsets, offsets + sizes)`` of ``U``; a point ``u`` of it is the
    source's point ``u - shift`` with dimension ``drop`` removed (a stacked
    source), or with index ``pick[1]`` inserted as dimension ``pick[0]`` (a
    selected source: ``U`` lacks that dimension).  ``name`` is the source's
    entry in the view's metadata (a copy of its :class:`~dcp.TensorMeta`
    under a name of its own)."""

    name: str
    source: str
    meta: TensorMeta
    offsets: tuple[int, ...]
    sizes: tuple[int, ...]
    shift: tuple[int, ...]
    drop: int | None = None
    pick: tuple[int, int] | None = None

    def source_box(self, lo: list[int], hi: list[int]) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """The box of the source holding the part ``[lo, hi)`` of ``U``
        (of size 1 along a selected dimension)."""
        offsets = [a - s for a, s in zip(lo, self.shift, strict=True)]
        sizes = [b - a for a, b in zip(lo, hi, strict=True)]
        if self.drop is not None:
            del offsets[self.drop], sizes[self.drop]
        if self.pick is not None:
            offsets.insert(self.pick[0], self.pick[1])
            sizes.insert(self.pick[0], 1)
        return tuple(offsets), tuple(sizes)


@dataclass
class Staged:
    """A target read through scratch boxes of its sources: ``shape`` and
    ``dtype`` are the target's, ``perm`` maps its dimensions to those of
    ``U`` (target dimension ``i`` is ``U``'s ``perm[i]``), ``pieces`` are
    the sources' parts of ``U``."""

    shape: tuple[int, ...]
    dtype: str
    perm: tuple[int, ...]
    pieces: list[Piece] = field(default_factory=list)

    @property
    def meta(self) -> TensorMeta:
        """The target's :class:`~dcp.TensorMeta`, without chunks."""
        return TensorMeta(self.shape, self.dtype)

    def u_box(self, offsets, sizes) -> tuple[list[int], list[int]]:
        """A box of the target as the box ``[lo, hi)`` of ``U``."""
        lo, hi = [0] * len(self.perm), [0] * len(self.perm)
        for i, p in enumerate(self.perm):
            lo[p], hi[p] = offsets[i], offsets[i] + sizes[i]
        return lo, hi

    def parts(self, offsets, sizes):
        """For the target's box ``offsets``/``sizes``: each ``(piece,
        lo, hi)`` with ``[lo, hi)`` the (non-empty) part of ``U`` the piece
        fills in it."""
        box_lo, box_hi = self.u_box(offsets, sizes)
        for piece in self.pieces:
            lo = [max(a, o) for a, o in zip(box_lo, piece.offsets, strict=True)]
            hi = [min(b, o + s) for b, o, s in zip(box_hi, piece.offsets, piece.sizes,
                                                   strict=True)]
            if all(a < b for a, b in zip(lo, hi, strict=True)):
                yield piece, lo, hi


#: Marks the view's names for the sources of staged targets.
STAGED_MARK = "<staged-source-"


@dataclass
class Remapped:
    """A checkpoint's metadata seen through a map.  ``metadata`` is what
    the load planner reads: targets the map moves by offsets (their chunks
    pointing into the source files), sources no rule uses, and, for each
    staged target, its sources under names of their own (:class:`Piece`).
    ``staged`` lists those targets."""

    metadata: Metadata
    staged: dict[str, Staged]

    def targets(self) -> dict[str, TensorMeta]:
        """Every tensor the map presents, by its name: those of
        ``metadata`` and the staged targets (without chunks)."""
        out = {f: m for f, m in self.metadata.tensors.items() if STAGED_MARK not in f}
        out.update((f, s.meta) for f, s in self.staged.items())
        return out


def _permutation(what: str, rule: dict, ndim: int) -> tuple[int, ...] | None:
    """The rule's ``transpose`` as a tuple, ``None`` if it has none."""
    perm = rule.get("transpose")
    if perm is None:
        return None
    if not (isinstance(perm, (list, tuple)) and all(type(p) is int for p in perm)
            and sorted(perm) == list(range(ndim))):
        raise CheckpointError(f"{what}: transpose {perm!r} is not a permutation of the "
                              f"{ndim} dimensions of {list(range(ndim))}")
    return tuple(perm)


def remap_metadata(md: Metadata, mapping: dict, where: str = "the source") -> Remapped:
    """``md`` with the targets of ``mapping`` in place of their sources
    (sources no rule uses pass through).  Raises :class:`CheckpointError`
    naming the target and sources for any mistake in the map."""
    rules = expand(mapping, list(md.tensors))
    if not rules:
        raise CheckpointError(f"remap: no rule of the map matches a tensor of {where}")
    used: dict[str, str] = {}
    out = Metadata(save_id=md.save_id, world_size=md.world_size)
    out.objects = md.objects
    made: dict[str, TensorMeta] = {}
    staged: dict[str, Staged] = {}
    slices: dict[str, list[tuple[int, int, int, str]]] = {}
    for target, (kind, dim, sources, rule) in rules.items():
        what = f"remap target {target!r} ({kind} of {', '.join(map(repr, sources))})"
        missing = [s for s in sources if s not in md.tensors]
        if missing or not sources:
            raise CheckpointError(f"{what}: source(s) {missing or sources} not in {where}")
        if kind in ("slice", "select", "transpose") and len(sources) != 1:
            raise CheckpointError(f"{what}: a {kind} takes one source")
        for s in sources:
            if kind not in ("slice", "select") and s in used:
                raise CheckpointError(f"{what}: source {s!r} is used by {used[s]!r} too")
            used.setdefault(s, target)
        metas = [md.tensors[s] for s in sources]
        dtypes = {m.dtype for m in metas}
        if len(dtypes) > 1:
            raise CheckpointError(f"{what}: sources differ in dtype ({sorted(dtypes)})")
        dtype = metas[0].dtype
        shapes = [list(m.shape) for m in metas]
        # each source's part of the result U: (offsets, sizes, shift, drop, pick) as in Piece
        parts: list[tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...], int | None,
                          tuple[int, int] | None]] = []
        cut_failed = False
        if kind == "concat":
            if not 0 <= dim < len(shapes[0]):
                raise CheckpointError(f"{what}: dim {dim} out of range for shape {shapes[0]}")
            rest = {tuple(s[:dim] + s[dim + 1:]) for s in shapes}
            if len(rest) > 1 or len({len(s) for s in shapes}) > 1:
                raise CheckpointError(f"{what}: shapes {shapes} differ outside dim {dim}")
            shape = list(shapes[0])
            shape[dim] = sum(s[dim] for s in shapes)
            meta, base = TensorMeta(tuple(shape), dtype), 0
            for m in metas:
                meta.chunks.extend(_shift(c, dim, base) for c in m.chunks)
                offsets = tuple(base if d == dim else 0 for d in range(len(shape)))
                parts.append((offsets, m.shape, offsets, None, None))
                base += m.shape[dim]
        elif kind == "stack":
            if len({tuple(s) for s in shapes}) > 1:
                raise CheckpointError(f"{what}: stacked sources differ in shape: {shapes}")
            if not 0 <= dim <= len(shapes[0]):
                raise CheckpointError(f"{what}: dim {dim} out of range for shape {shapes[0]}")
            shape = shapes[0][:dim] + [len(metas)] + shapes[0][dim:]
            meta = TensorMeta(tuple(shape), dtype)
            for k, m in enumerate(metas):
                meta.chunks.extend(
                    replace(c, offsets=c.offsets[:dim] + (k,) + c.offsets[dim:],
                            sizes=c.sizes[:dim] + (1,) + c.sizes[dim:]) for c in m.chunks)
                offsets = tuple(k if d == dim else 0 for d in range(len(shape)))
                parts.append((offsets, m.shape[:dim] + (1,) + m.shape[dim:], offsets, dim, None))
        elif kind == "slice":
            (src,), (m,) = sources, metas
            start, stop = rule.get("start"), rule.get("stop")
            if not (0 <= dim < len(m.shape) and type(start) is int and type(stop) is int
                    and 0 <= start < stop <= m.shape[dim]):
                raise CheckpointError(f"{what}: slice [{start}:{stop}] of dim {dim} does not fit "
                                      f"shape {list(m.shape)}")
            shape = list(m.shape)
            shape[dim] = stop - start
            meta = TensorMeta(tuple(shape), dtype)
            for c in m.chunks:
                cut = _slice_chunk(c, m, dim, start, stop)
                cut_failed = cut_failed or cut is False
                if isinstance(cut, ChunkMeta):
                    meta.chunks.append(cut)
            parts.append(((0,) * len(shape), tuple(shape),
                          tuple(-start if d == dim else 0 for d in range(len(shape))), None, None))
            slices.setdefault(src, []).append((dim, start, stop, target))
        elif kind == "select":
            (src,), (m,) = sources, metas
            index = rule.get("index")
            if not 0 <= dim < len(m.shape):
                raise CheckpointError(f"{what}: dim {dim} out of range for shape {list(m.shape)}")
            if type(index) is not int or not 0 <= index < m.shape[dim]:
                raise CheckpointError(f"{what}: index {index!r} of dim {dim} does not fit shape "
                                      f"{list(m.shape)}")
            shape = list(m.shape[:dim] + m.shape[dim + 1:])
            meta = TensorMeta(tuple(shape), dtype)
            for c in m.chunks:
                cut = _slice_chunk(c, m, dim, index, index + 1)
                cut_failed = cut_failed or cut is False
                if isinstance(cut, ChunkMeta):  # the slice of size 1 without its dimension
                    meta.chunks.append(replace(
                        cut, offsets=cut.offsets[:dim] + cut.offsets[dim + 1:],
                        sizes=cut.sizes[:dim] + cut.sizes[dim + 1:]))
            parts.append(((0,) * len(shape), tuple(shape), (0,) * len(shape), None, (dim, index)))
            slices.setdefault(src, []).append((dim, index, index + 1, target))
        else:
            (m,) = metas
            shape, meta = list(m.shape), m
            parts.append(((0,) * len(shape), m.shape, (0,) * len(shape), None, None))
        perm = _permutation(what, rule, len(shape))
        if perm is None and not cut_failed and kind != "transpose":
            made[target] = meta
            continue
        perm = perm or tuple(range(len(shape)))
        plan = Staged(tuple(shape[p] for p in perm), dtype, perm)
        for k, ((offsets, sizes, shift, drop, pick), s, m) in enumerate(
                zip(parts, sources, metas, strict=True)):
            name = f"{target}{STAGED_MARK}{k}>"
            plan.pieces.append(Piece(name, s, m, offsets, tuple(sizes), shift, drop, pick))
            made[name] = m
        staged[target] = plan
    for src, cuts in slices.items():
        _check_partition(src, md.tensors[src], cuts)
    for fqn, meta in md.tensors.items():
        if fqn not in used:
            out.tensors[fqn] = meta
    for fqn in [*made, *staged]:
        if fqn in out.tensors:
            raise CheckpointError(f"remap target {fqn!r} is also a tensor of {where} no rule uses")
    out.tensors.update(made)
    return Remapped(out, staged)


def _slice_chunk(c: ChunkMeta, m: TensorMeta, dim: int, start: int,
                 stop: int) -> ChunkMeta | None | bool:
    """The part of chunk ``c`` inside ``[start, stop)`` of ``dim``, as a
    chunk of the target; ``None`` if none of it is; ``False`` if its bytes
    are not one contiguous run of ``c``'s (a dimension before ``dim`` of
    size above 1 in the chunk, or a compressed chunk: the slice is then
    staged)."""
    lo, hi = max(start, c.offsets[dim]), min(stop, c.offsets[dim] + c.sizes[dim])
    if lo >= hi:
        return None
    if lo == c.offsets[dim] and hi == c.offsets[dim] + c.sizes[dim]:
        return _shift(c, dim, -start)
    if c.frames is not None or any(s != 1 for s in c.sizes[:dim]):  # compressed: no byte run
        return False
    inner = math.prod(c.sizes[dim + 1:]) * DTYPE_ITEMSIZE[m.dtype]
    sizes, offsets = list(c.sizes), list(c.offsets)
    sizes[dim], offsets[dim] = hi - lo, lo - start
    return ChunkMeta(tuple(offsets), tuple(sizes), c.file,
                     c.byte_offset + (lo - c.offsets[dim]) * inner, (hi - lo) * inner, None, c.rank)


def _check_partition(src: str, m: TensorMeta, cuts: list[tuple[int, int, int, str]]) -> None:
    """Slices and selects of one source (a select of index ``i`` as the
    slice ``[i:i + 1]``) must share one dim, not overlap nor leave gaps."""
    dims = {d for d, _, _, _ in cuts}
    if len(dims) > 1:
        raise CheckpointError(f"remap: {src!r} is sliced or selected along several dims by "
                              f"{', '.join(repr(t) for *_, t in cuts)}")
    (dim,) = dims
    pos, last = 0, None
    for _, start, stop, target in sorted(cuts, key=lambda c: c[1]):
        if start < pos:
            raise CheckpointError(f"remap: slices or selects {last!r} and {target!r} of {src!r} "
                                  f"overlap at {start} along dim {dim}")
        if start > pos:
            raise CheckpointError(f"remap: slices or selects of {src!r} leave a gap "
                                  f"[{pos}:{start}] along dim {dim} (next: {target!r})")
        pos, last = stop, target
    if pos != m.shape[dim]:
        raise CheckpointError(f"remap: slices or selects of {src!r} leave a gap "
                              f"[{pos}:{m.shape[dim]}] along dim {dim}")


class RemappedView(ReadOnlyView):
    """A checkpoint (or a safetensors folder's view) presented through a
    map: its metadata remapped by :func:`remap_metadata`, its reads going
    to the same files.  Read-only; load through it with
    :func:`load_through` (``load_remapped``, ``load_safetensors(remap=)``),
    which fills staged targets too; a plain ``dcp.load(storage=view)``
    sees only the targets the map moves by offsets."""

    def __init__(self, inner: StoragePlugin, metadata: Metadata, mapping: dict) -> None:
        super().__init__(inner.checkpoint_id, inner, "remapped view")
        self.remapped = remap_metadata(metadata, mapping, repr(inner.checkpoint_id))

    @property
    def metadata(self) -> Metadata:
        return self.remapped.metadata

    def reads_whole(self, fqn: str) -> bool:
        """Whether ``fqn`` is a staged target (read by :meth:`read_whole`)."""
        return fqn in self.remapped.staged

    def check_readable(self, fqn: str) -> None:
        """Read the last byte of each chunk of each source of the staged
        target ``fqn``: raises :class:`~dcp.CorruptCheckpointError` naming
        the source and file if one is short."""
        for piece in self.remapped.staged[fqn].pieces:
            check_readable(self.inner, piece.source, piece.meta)

    def read_whole(self, fqn: str, out: memoryview) -> None:
        """Read the whole staged target ``fqn`` into ``out`` (its row-major
        bytes): each source is read whole (checksums verified), one at a
        time, and copied in through the permuted view.  Raises
        :class:`~dcp.CorruptCheckpointError` naming the source and file."""
        plan = self.remapped.staged[fqn]
        target = tensors.from_bytes(tensors.bytes_of(out), plan.dtype, plan.shape)
        u = target.permute(_inverse_perm(plan.perm))
        for piece, lo, hi in plan.parts((0,) * len(plan.shape), plan.shape):
            raw = aligned_bytes(piece.meta.nbytes)
            read_tensors(self.inner, [(piece.source, piece.meta, raw)])
            whole = tensors.from_bytes(tensors.bytes_of(raw), piece.meta.dtype, piece.meta.shape)
            _place(u, lo, hi, [0] * len(lo), whole, piece)

    def scratch_bytes(self, fqn: str) -> int:
        """Bytes :meth:`read_whole` holds besides ``out``: its largest
        source."""
        return max((p.meta.nbytes for p in self.remapped.staged[fqn].pieces), default=0)


def _inverse_perm(perm) -> tuple[int, ...]:
    inv = [0] * len(perm)
    for i, p in enumerate(perm):
        inv[p] = i
    return tuple(inv)


def _place(u: torch.Tensor, lo, hi, base, data: torch.Tensor, piece: Piece) -> None:
    """Copy the part ``[lo, hi)`` of ``U`` from ``data`` (a box of the
    piece's source starting at ``source_box(lo...)``'s offsets, or the whole
    source) into ``u``, a view of ``U`` whose origin is ``base``."""
    offsets, sizes = piece.source_box(lo, hi)
    if data.shape != sizes:  # the whole source: cut the box out
        data = tensors.region(data, offsets, sizes)
    if piece.drop is not None:
        data = data.unsqueeze(piece.drop)
    if piece.pick is not None:
        data = data.select(piece.pick[0], 0)
    tensors.copy_into(tensors.region(u, [a - b for a, b in zip(lo, base, strict=True)],
                                     [b - a for a, b in zip(lo, hi, strict=True)]), data)


def inverse(mapping: dict, md: Metadata) -> dict:
    """The map that undoes ``mapping`` on a checkpoint ``md`` in the target
    layout, for exporting under the original names: each concatenation
    becomes slices of equal parts (fused QKV, gate/up), each stack one
    select per index of the stacked dimension (experts ``[E, out, in]`` ->
    ``E`` tensors ``[out, in]``, named by the stack's source list or its
    ``{i}`` template), each transposition the inverse permutation (a
    transposed concatenation or stack: slices or selects of the target
    transposed back).  Raises :class:`CheckpointError` for a rule it cannot
    invert (slices, selects, a concatenation of a ``{i}`` template; parts of
    unequal size: write those slices by hand), a target without the rule's
    dimension, or a stack of another length than its source list."""
    out: dict = {}
    for target, rule in mapping.items():
        kind = _kind_of(target, rule)
        if kind in ("slice", "select") or (kind == "concat"
                                           and isinstance(rule.get("sources"), str)):
            raise CheckpointError(f"remap: cannot invert the rule for {target!r} ({rule!r}); "
                                  f"write its slices by hand")
        pattern = _pattern(target)
        for fqn, meta in md.tensors.items():
            m = pattern.match(fqn)
            if m is None:
                continue
            values = m.groupdict()
            perm = _permutation(f"remap target {fqn!r}", rule, len(meta.shape))
            inv = None if perm is None else list(_inverse_perm(perm))
            if kind == "transpose":
                out[rule["source"].format(**values)] = {"transpose": inv, "source": fqn}
                continue
            dim, sources = rule[kind], rule["sources"]
            if not 0 <= dim < len(meta.shape):
                raise CheckpointError(f"remap: {fqn!r} of shape {list(meta.shape)} has no dim "
                                      f"{dim} to undo the {kind} of {target!r} along")
            along = dim if inv is None else inv[dim]  # the target's dim holding the parts
            if kind == "stack":
                out.update(_unstack(fqn, meta, rule, values, dim, along, inv))
                continue
            if meta.shape[along] % len(sources):
                raise CheckpointError(f"remap: {fqn!r} of size {meta.shape[along]} along dim "
                                      f"{along} does not split into {len(sources)} equal parts")
            part = meta.shape[along] // len(sources)
            for k, src in enumerate(sources):
                out[src.format(**values)] = {"slice": along, "source": fqn, "start": k * part,
                                             "stop": (k + 1) * part,
                                             **({} if inv is None else {"transpose": inv})}
    return out


def _unstack(fqn: str, meta: TensorMeta, rule: dict, values: dict, dim: int, along: int,
             inv: list[int] | None) -> dict:
    """The selects undoing the stack ``rule`` for its target ``fqn``
    (placeholders ``values``), stacked along ``along`` (``U``'s ``dim``;
    ``inv``: the inverse of the rule's permutation, if any)."""
    sources, count = rule["sources"], meta.shape[along]
    names = ([sources.format(**values, i=k) for k in range(count)] if isinstance(sources, str)
             else [s.format(**values) for s in sources])
    if len(names) != count:
        raise CheckpointError(f"remap: {fqn!r} stacks {count} along dim {along}, its rule "
                              f"names {len(names)} sources")
    # a source is U.select(dim, k): T.select(along, k) with T's other dims in U's order
    rest = [] if inv is None else [p - (p > along) for j, p in enumerate(inv) if j != dim]
    extra = {} if rest == sorted(rest) else {"transpose": rest}
    return {src: {"select": along, "source": fqn, "index": k, **extra}
            for k, src in enumerate(names)}


def load_through(view: RemappedView, state_dict: dict, checkpoint_id: str, **load_options):
    """:func:`dcp.load` of ``state_dict`` through ``view`` (collective as it
    is), staged targets included: for each box this rank holds of one, the
    box of each source landing in it is read into a scratch tensor (under
    the source's staged name, by the same load, so the planner reshards and
    coalesces it with the rest), then copied into the target through a
    permuted view.  Staged targets must be tensors held in dicts of the
    state dict (not inside a Stateful or a list).  Returns the
    :class:`dcp.LoadReport`, in the target's names.

    Raises:
        CheckpointError: as :func:`dcp.load`; a staged target of another
            shape than the map gives, on the meta device, or inside a list.
    """
    from dcp.orchestration.load import load

    staged = view.remapped.staged
    leaves = flatten(state_dict, tensors.is_tensor) if staged else {}
    held = {f: leaf for f, leaf in leaves.items() if f in staged}
    scratch: dict[str, tensors.TensorShard] = {}
    copies = []
    for fqn, leaf in held.items():
        plan = staged[fqn]
        if not isinstance(leaf.container, dict):
            raise CheckpointError(f"{fqn!r}: a staged remap target must sit in a dict of the "
                                  f"state dict, not a {type(leaf.container).__name__}")
        if tensors.is_meta(leaf.value):
            raise CheckpointError(f"{fqn!r}: a staged remap target cannot be on the meta device")
        local = tensors.describe(fqn, leaf.value)
        if local.global_shape != plan.shape:
            raise CheckpointError(f"{fqn!r}: the target has shape {list(local.global_shape)}, "
                                  f"the remap gives {list(plan.shape)}")
        if 0 in local.sizes:
            continue
        base, _ = plan.u_box(local.offsets, local.sizes)
        u = local.data.permute(_inverse_perm(plan.perm))
        for piece, lo, hi in plan.parts(local.offsets, local.sizes):
            offsets, sizes = piece.source_box(lo, hi)
            box = torch.empty(sizes, dtype=local.data.dtype)
            scratch[piece.name] = tensors.TensorShard(box, piece.meta.shape, offsets)
            copies.append((u, lo, hi, base, box, piece))
    # the load sees the state dict without the staged targets, with their sources' boxes
    copies_of: dict[int, tuple[dict, dict]] = {}
    pruned = _without(state_dict, {id(leaf.value) for leaf in held.values()}, copies_of)
    combined = {**pruned, **scratch}
    copies_of[id(combined)] = (state_dict, combined)
    try:
        report = load(combined, checkpoint_id, storage=view, **load_options)
    finally:  # plain values the load replaced in the copies go back to the caller's dicts
        _write_back(state_dict, combined, copies_of)
    for args in copies:
        _place(*args)
    report.unexpected_keys = [f for f in report.unexpected_keys if STAGED_MARK not in f] + [
        f for f in staged if f not in held]
    return report


def _without(d: dict, drop: set[int], copies_of: dict[int, tuple[dict, dict]]) -> dict:
    """``d`` without the tensors whose ``id`` is in ``drop``: dicts holding
    one are copied (recorded in ``copies_of``: id of copy -> (original,
    copy)) and left out where nothing else remains; the others are
    shared."""
    out: dict = {}
    changed = False
    for key, value in d.items():
        if id(value) in drop and tensors.is_tensor(value):
            changed = True
            continue
        if isinstance(value, dict) and value:
            sub = _without(value, drop, copies_of)
            if sub is not value:
                changed = True
                if sub:
                    out[key] = sub
                continue
        out[key] = value
    if not changed:
        return d
    copies_of[id(out)] = (d, out)
    return out


def _write_back(original: dict, copy: dict, copies_of: dict[int, tuple[dict, dict]]) -> None:
    """Put the values of ``copy`` (a copy :func:`_without` made) into
    ``original``, descending into the copies it made."""
    for key, value in copy.items():
        if id(value) in copies_of and copies_of[id(value)][1] is value:
            _write_back(copies_of[id(value)][0], value, copies_of)
        elif STAGED_MARK not in str(key):
            original[key] = value


def load_remapped(state_dict: dict, checkpoint_id: str, mapping: dict, *,
                  storage_options: dict | None = None, **load_options):
    """:func:`dcp.load` of ``checkpoint_id`` through ``mapping`` (collective
    as it is; :func:`load_through`); ``load_options`` as for
    :func:`dcp.load`.  For a Hugging Face folder use
    ``load_safetensors(..., remap=mapping)``."""
    from dcp.core.storage import open_storage
    from dcp.orchestration.load import read_metadata

    inner = open_storage(str(checkpoint_id), **(storage_options or {}))
    view = RemappedView(inner, read_metadata(str(checkpoint_id), storage=inner), mapping)
    return load_through(view, state_dict, str(checkpoint_id), **load_options)
