"""Flattening nested state dicts into fqns, and writing leaves back.

A state dict is a tree of dicts, lists and tuples.  Its leaves are tensors
(anything :func:`dcp.core.tensors.is_tensor_like` accepts) and plain values.  The
fqn of a leaf is the dotted path of keys and list indices leading to it:
``{"model": {"layers": [{"w": t}]}}`` gives ``model.layers.0.w``.  Its
path is the same keys as a tuple, dict keys as strings and list indices as
ints (``("model", "layers", 0, "w")``), as PyTorch DCP's flattening records
them: the fqn alone cannot say which dots were a key's own
(``{"model": {"layers.0.w": t}}`` has the same fqn).

Lists and tuples are descended into only when they contain a tensor
somewhere; a list of plain values (an optimizer's ``params`` list, say) is a
single leaf, as in PyTorch DCP.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

from dcp.errors import CheckpointError


@dataclass
class Leaf:
    """One leaf: its value, how to replace it in its container, and its path
    (dict keys as ``str``, list and tuple indices as ``int``)."""

    value: Any
    container: Any
    key: Any
    path: tuple[str | int, ...] = ()

    def replace(self, fqn: str, value: Any) -> None:
        """Set a new value in place of this leaf (tensors are filled in place
        instead; this is for plain values)."""
        if isinstance(self.container, tuple):
            raise CheckpointError(f"cannot set {fqn!r}: it sits inside a tuple; use a list")
        self.container[self.key] = value
        self.value = value


def flatten(state_dict: dict, is_tensor: Callable[[Any], bool]) -> dict[str, Leaf]:
    """Map every leaf's fqn to its :class:`Leaf`.

    Raises :class:`CheckpointError` if ``state_dict`` is not a dict, a key is
    neither ``str`` nor ``int``, or two paths give the same fqn.
    """
    if not isinstance(state_dict, dict):
        raise CheckpointError(f"a state dict must be a dict, got {type(state_dict).__name__}")
    out: dict[str, Leaf] = {}

    def holds_tensor(value) -> bool:
        if is_tensor(value):
            return True
        if isinstance(value, dict):
            return any(holds_tensor(v) for v in value.values())
        if isinstance(value, (list, tuple)):
            return any(holds_tensor(v) for v in value)
        return False

    def visit(value, container, key, fqn: str, path: tuple[str | int, ...]):
        items: Iterable[tuple[Any, Any]]
        if isinstance(value, dict) and (value or container is None):
            items = value.items()
        elif isinstance(value, (list, tuple)) and holds_tensor(value):
            items = enumerate(value)
        else:
            if fqn in out:
                raise CheckpointError(f"two entries of the state dict share the fqn {fqn!r}")
            out[fqn] = Leaf(value, container, key, path)
            return
        in_dict = isinstance(value, dict)
        for k, v in items:
            if not isinstance(k, (str, int)) or isinstance(k, bool):
                raise CheckpointError(
                    f"state dict key {k!r} under {fqn or '<root>'!r} must be str or int")
            visit(v, value, k, f"{fqn}.{k}" if fqn else str(k),
                  (*path, str(k) if in_dict else k))

    visit(state_dict, None, None, "", ())
    return out


def shaped_like(target: Any, value: Any) -> Any:
    """``value`` (a plain value as JSON gives it back: lists, dicts) with the
    container types of ``target`` where their shapes agree: tuples, named
    tuples and tuple subclasses such as ``torch.Size``, nested in lists and
    dicts.  JSON has no tuple, so a saved tuple loads as a list unless the
    target says what it was."""
    if isinstance(target, tuple) and isinstance(value, list) and len(target) == len(value):
        items = [shaped_like(t, v) for t, v in zip(target, value, strict=True)]
        if hasattr(target, "_fields"):  # a named tuple
            return type(target)(*items)
        try:
            return type(target)(items)
        except TypeError:
            return tuple(items)
    if isinstance(target, list) and isinstance(value, list) and len(target) == len(value):
        return [shaped_like(t, v) for t, v in zip(target, value, strict=True)]
    if isinstance(target, dict) and isinstance(value, dict):
        return {k: shaped_like(target.get(k), v) for k, v in value.items()}
    return value


def selecting_keys(fqn: str, path: tuple[str | int, ...] | None) -> list[str]:
    """The keys that select ``fqn`` as a whole-component prefix: the dotted
    joins of its path's leading parts, the fqn last (``("model", "a", 0)``:
    ``model``, ``model.a``, ``model.a.0``; never ``model.a.`` or ``mod``).
    Where the path is unknown (``None``) the fqn's dotted parts stand in
    for it."""
    parts = fqn.split(".") if path is None else [str(p) for p in path]
    return [".".join(parts[:n]) for n in range(1, len(parts) + 1)]


def nest(root: dict, path: tuple[str | int, ...], value: Any, fqn: str) -> None:
    """Set ``value`` in ``root`` at ``path``, making the dicts (below a
    ``str`` part) and lists (below an ``int`` part, grown with ``None``)
    on the way; :func:`flatten`'s inverse, leaf by leaf.  Raises
    :class:`CheckpointError` naming ``fqn`` where the path runs through a
    value that is not such a container (paths of one checkpoint that
    disagree)."""
    node: Any = root
    for at, (part, below) in enumerate(zip(path, (*path[1:], None), strict=True)):
        if isinstance(node, list) and type(part) is int:
            node.extend([None] * (part + 1 - len(node)))
        elif not (isinstance(node, dict) and isinstance(part, str)):
            raise CheckpointError(
                f"{fqn!r}: its path {list(path)} runs through "
                f"{'<root>' if not at else repr('.'.join(map(str, path[:at])))}, "
                f"a {type(node).__name__} that cannot hold key {part!r}")
        if below is None:
            node[part] = value
            return
        child = node.get(part) if isinstance(node, dict) else node[part]
        if child is None:
            child = node[part] = {} if isinstance(below, str) else []
        node = child
