"""Remapping at load: fill a target tensor from boxes of several source tensors.

A map is data (JSON-able), not code: ``{target: rule}``, where a rule is

* ``{"concat": dim, "sources": [name, ...]}`` — the sources laid one after
  another along ``dim`` (fused QKV from q/k/v, fused gate/up);
* ``{"stack": dim, "sources": [name, ...]}`` — the sources stacked along a
  new ``dim`` (MoE experts);
* ``{"slice": dim, "source": name, "start": a, "stop": b}`` — a part of
  one source (un-fusing).

Names may hold placeholders ``{name}`` matching any run of characters
(``{i}`` in a ``stack`` source list given as a single string enumerates
``0, 1, ...``), so one map serves every layer; :data:`MAPS` ships the
common ones.

How it reads only what it needs: every rule is a change of coordinates
that moves a source chunk's box into the target without changing the
order of its bytes (concat and stack shift or extend its offsets; a slice
along the leading dimension of a chunk cuts a contiguous byte range).  So
:class:`RemappedView` presents the source checkpoint (ours or a
:class:`~dcp.interop.safetensors_io.SafetensorsFolder`) with remapped
metadata — target tensors whose chunks point into the source files — and
the unchanged load planner does the rest: resharding, each rank reading
only the byte runs of its own boxes, coalescing.  Transposition changes
the byte order and is not expressible this way; it is refused, as is a
slice a chunk's bytes cannot follow.  Every mistake — an unknown source,
shape or dtype mismatch, a source used twice, slices that overlap or leave
gaps — raises :class:`~dcp.CheckpointError` naming the target and sources
before anything is read.
"""

from __future__ import annotations

import math
import re
from dataclasses import replace

from dcp.core.metadata import DTYPE_ITEMSIZE, ChunkMeta, Metadata, TensorMeta
from dcp.core.storage import StoragePlugin
from dcp.errors import CheckpointError
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


def expand(mapping: dict, names: list[str]) -> dict[str, tuple[str, int, list[str], dict]]:
    """The concrete rules of ``mapping`` over the source ``names``: target
    -> (kind, dim, sources, rule).  A rule whose first source matches no
    name is unused; a templated target takes its placeholders from the
    first source."""
    out: dict[str, tuple[str, int, list[str], dict]] = {}
    for target, rule in mapping.items():
        if not isinstance(rule, dict) or len({"concat", "stack", "slice"} & set(rule)) != 1:
            raise CheckpointError(f"remap rule for {target!r} must have exactly one of "
                                  f"'concat', 'stack', 'slice': {rule!r}")
        kind = next(k for k in ("concat", "stack", "slice") if k in rule)
        dim = rule[kind]
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


def remap_metadata(md: Metadata, mapping: dict, where: str = "the source") -> Metadata:
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
    slices: dict[str, list[tuple[int, int, int, str]]] = {}
    for target, (kind, dim, sources, rule) in rules.items():
        what = f"remap target {target!r} ({kind} of {', '.join(map(repr, sources))})"
        missing = [s for s in sources if s not in md.tensors]
        if missing or not sources:
            raise CheckpointError(f"{what}: source(s) {missing or sources} not in {where}")
        for s in sources:
            if kind != "slice" and s in used:
                raise CheckpointError(f"{what}: source {s!r} is used by {used[s]!r} too")
            used.setdefault(s, target)
        metas = [md.tensors[s] for s in sources]
        dtypes = {m.dtype for m in metas}
        if len(dtypes) > 1:
            raise CheckpointError(f"{what}: sources differ in dtype ({sorted(dtypes)})")
        dtype = metas[0].dtype
        shapes = [list(m.shape) for m in metas]
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
        else:
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
                cut = _slice_chunk(c, m, dim, start, stop, what)
                if cut is not None:
                    meta.chunks.append(cut)
            slices.setdefault(src, []).append((dim, start, stop, target))
        made[target] = meta
    for src, cuts in slices.items():
        _check_partition(src, md.tensors[src], cuts)
    for fqn, meta in md.tensors.items():
        if fqn not in used:
            out.tensors[fqn] = meta
    for fqn, meta in made.items():
        if fqn in out.tensors:
            raise CheckpointError(f"remap target {fqn!r} is also a tensor of {where} no rule uses")
        out.tensors[fqn] = meta
    return out


def _slice_chunk(c: ChunkMeta, m: TensorMeta, dim: int, start: int, stop: int,
                 what: str) -> ChunkMeta | None:
    """The part of chunk ``c`` inside ``[start, stop)`` of ``dim``, as a
    chunk of the target; ``None`` if none of it is.  Its bytes must be one
    contiguous run of ``c``'s: every dimension before ``dim`` of size 1 in
    the chunk."""
    lo, hi = max(start, c.offsets[dim]), min(stop, c.offsets[dim] + c.sizes[dim])
    if lo >= hi:
        return None
    if lo == c.offsets[dim] and hi == c.offsets[dim] + c.sizes[dim]:
        return _shift(c, dim, -start)
    if any(s != 1 for s in c.sizes[:dim]):
        raise CheckpointError(f"{what}: a chunk at offsets {list(c.offsets)} of sizes "
                              f"{list(c.sizes)} cannot be cut along dim {dim} without a copy")
    inner = math.prod(c.sizes[dim + 1:]) * DTYPE_ITEMSIZE[m.dtype]
    sizes, offsets = list(c.sizes), list(c.offsets)
    sizes[dim], offsets[dim] = hi - lo, lo - start
    return ChunkMeta(tuple(offsets), tuple(sizes), c.file,
                     c.byte_offset + (lo - c.offsets[dim]) * inner, (hi - lo) * inner, None, c.rank)


def _check_partition(src: str, m: TensorMeta, cuts: list[tuple[int, int, int, str]]) -> None:
    """Slices of one source must not overlap nor leave gaps."""
    dims = {d for d, _, _, _ in cuts}
    if len(dims) > 1:
        raise CheckpointError(f"remap: {src!r} is sliced along several dims by "
                              f"{', '.join(repr(t) for *_, t in cuts)}")
    (dim,) = dims
    pos, last = 0, None
    for _, start, stop, target in sorted(cuts, key=lambda c: c[1]):
        if start < pos:
            raise CheckpointError(f"remap: slices {last!r} and {target!r} of {src!r} overlap "
                                  f"at {start} along dim {dim}")
        if start > pos:
            raise CheckpointError(f"remap: slices of {src!r} leave a gap [{pos}:{start}] along "
                                  f"dim {dim} (next: {target!r})")
        pos, last = stop, target
    if pos != m.shape[dim]:
        raise CheckpointError(f"remap: slices of {src!r} leave a gap [{pos}:{m.shape[dim]}] "
                              f"along dim {dim}")


class RemappedView(ReadOnlyView):
    """A checkpoint (or a safetensors folder's view) presented through a
    map: its metadata remapped by :func:`remap_metadata`, its reads going
    to the same files.  Read-only; pass it as ``storage=`` to
    :func:`dcp.load`."""

    def __init__(self, inner: StoragePlugin, metadata: Metadata, mapping: dict) -> None:
        super().__init__(inner.checkpoint_id, inner, "remapped view")
        self._metadata = remap_metadata(metadata, mapping, repr(inner.checkpoint_id))

    @property
    def metadata(self) -> Metadata:
        return self._metadata


def inverse(mapping: dict, md: Metadata) -> dict:
    """The map that undoes ``mapping`` on a checkpoint ``md`` in the target
    layout: each concatenation becomes slices of equal parts (fused QKV,
    gate/up), for exporting under the original names.  Raises
    :class:`CheckpointError` for a rule it cannot invert (stacks; parts of
    unequal size: write those slices by hand)."""
    out: dict = {}
    for target, rule in mapping.items():
        if "concat" not in rule or isinstance(rule.get("sources"), str):
            raise CheckpointError(f"remap: cannot invert the rule for {target!r} ({rule!r}); "
                                  f"write its slices by hand")
        dim, sources = rule["concat"], rule["sources"]
        pattern = _pattern(target)
        for fqn, meta in md.tensors.items():
            m = pattern.match(fqn)
            if m is None:
                continue
            values = m.groupdict()
            if meta.shape[dim] % len(sources):
                raise CheckpointError(f"remap: {fqn!r} of size {meta.shape[dim]} along dim {dim} "
                                      f"does not split into {len(sources)} equal parts")
            part = meta.shape[dim] // len(sources)
            for k, src in enumerate(sources):
                out[src.format(**values)] = {"slice": dim, "source": fqn, "start": k * part,
                                             "stop": (k + 1) * part}
    return out


def load_remapped(state_dict: dict, checkpoint_id: str, mapping: dict, *,
                  storage_options: dict | None = None, **load_options):
    """:func:`dcp.load` of ``checkpoint_id`` through ``mapping`` (collective
    as it is); ``load_options`` as for :func:`dcp.load`.  For a Hugging
    Face folder use ``load_safetensors(..., remap=mapping)``."""
    from dcp.core.storage import open_storage
    from dcp.orchestration.load import load, read_metadata

    inner = open_storage(str(checkpoint_id), **(storage_options or {}))
    view = RemappedView(inner, read_metadata(str(checkpoint_id), storage=inner), mapping)
    return load(state_dict, str(checkpoint_id), storage=view, **load_options)
