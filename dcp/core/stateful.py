"""Stateful objects: values that save as their ``state_dict()`` and load
through their ``load_state_dict()``.

PyTorch DCP's ``Stateful`` protocol (``torch.distributed.checkpoint.stateful``)
is what torchtitan's ``ModelWrapper`` and ``OptimizersContainer``, the DCP
tutorial's ``AppState``, modules, optimizers, LR schedulers and stateful data
loaders implement.  It is resolved here, at the API's edge, before any
planning, so the planners and the metadata only ever see plain state dicts:

* :func:`resolve` walks the state dict (dicts, lists and tuples, the top
  level and any depth below) and returns a copy in which every Stateful is
  replaced by what its ``state_dict()`` returns at that moment.  Only the
  containers on the way to a Stateful are copied; everything else, tensors
  included, is shared with the caller's state dict.  :func:`dcp.save` and
  :func:`dcp.async_save` call it before describing the state (so before
  staging, for an async save).
* On load, those ``state_dict()`` results are the targets, filled in place
  (their tensors) or replaced (their plain values); once every read has
  finished, :meth:`Resolved.finish` writes the replaced plain values back
  into the caller's containers, sets every top-level value that is not a
  Stateful through the caller's own ``__setitem__`` (as torch DCP does: a
  ``dict`` subclass sees the load), and calls each Stateful's
  ``load_state_dict()`` with its loaded values, innermost first and
  otherwise in the order of their fqns, which every rank shares: a
  ``load_state_dict()`` that runs collectives (an all-gather, an
  all-reduce) meets the same one on every rank, whatever order each rank's
  dict holds its keys in (torch DCP sorts the top-level keys).

A value is Stateful when it has callable ``state_dict`` and
``load_state_dict`` attributes and is not a tensor leaf — the same test as
torch's ``runtime_checkable`` protocol.

The same walk substitutes leaves of other frameworks (``substitute``:
MindSpore tensors by torch tensors, :mod:`dcp.core.mindspore_tensors`), in
the same copies of the containers on the way to them.  After a load,
:meth:`Resolved.finish` puts the original leaves back into those copies
before any ``load_state_dict()`` sees them (a copied tuple keeps the
substitutes: it cannot be changed).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from dcp.errors import CheckpointError


def is_stateful(value: Any, is_tensor: Callable[[Any], bool]) -> bool:
    """Whether ``value`` follows the Stateful protocol (and is no tensor)."""
    return (callable(getattr(value, "state_dict", None))
            and callable(getattr(value, "load_state_dict", None))
            and not isinstance(value, (dict, list, tuple)) and not is_tensor(value))


@dataclass
class _Found:
    """One Stateful: its fqn, the object, and where its resolved state dict
    sits in the resolved tree (``container[key]``)."""

    fqn: str
    obj: Any
    container: Any
    key: Any
    depth: int = 0


@dataclass
class Resolved:
    """A state dict with its Stateful values resolved.

    ``state_dict``: the resolved tree (the caller's own dict when it holds no
    Stateful and no substituted leaf).  ``statefuls``: the Stateful objects
    found, innermost first.  ``substituted``: the leaves replaced by
    ``substitute`` (``obj`` the original).  ``copies``: ``(original, copy)``
    for every container copied on the way to either.
    """

    state_dict: dict
    root: Any = None
    statefuls: list[_Found] = field(default_factory=list)
    substituted: list[_Found] = field(default_factory=list)
    copies: list[tuple[Any, Any]] = field(default_factory=list)

    def finish(self) -> None:
        """After a load: write the plain values a load replaced in copied
        containers back into the caller's, set the caller's top-level
        values that are not Statefuls through its ``__setitem__``, then
        call every Stateful's ``load_state_dict()`` with its loaded state
        dict, innermost first, then by fqn (the same order on every rank).

        Raises :class:`CheckpointError` naming the fqn if a
        ``load_state_dict()`` raises.
        """
        copied = {id(copy) for _, copy in self.copies}
        resolved = {(id(f.container), _hashable(f.key))
                    for f in (*self.statefuls, *self.substituted)}
        for original, copy in self.copies:
            if isinstance(original, tuple):
                continue  # immutable: its Statefuls are loaded below, its plain values cannot be
            keys = copy.keys() if isinstance(copy, dict) else range(len(copy))
            for key in keys:
                value = copy[key]
                if id(value) in copied or (id(copy), _hashable(key)) in resolved:
                    continue
                original[key] = value
        for found in self.substituted:
            if not isinstance(found.container, tuple):
                found.container[found.key] = found.obj
        if isinstance(self.state_dict, dict) and (
                self.root is None or self.root is self.state_dict):
            # the caller's dict was not copied (copied ones were set above)
            for key in list(self.state_dict):
                self.state_dict[key] = self.state_dict[key]
        for found in sorted(self.statefuls, key=lambda f: (-f.depth, f.fqn)):
            try:
                found.obj.load_state_dict(found.container[found.key])
            except CheckpointError:
                raise
            except Exception as e:
                raise CheckpointError(
                    f"{found.fqn or '<root>'!r}: {type(found.obj).__name__}.load_state_dict "
                    f"raised {type(e).__name__}: {e}") from e


def _hashable(key: Any) -> Any:
    return key if isinstance(key, (str, int)) else repr(key)


#: ``substitute(fqn, value)``: what to plan with in place of a leaf (the
#: value itself: no change).
Substitute = Callable[[str, Any], Any]


def resolve(state_dict: Any, is_tensor: Callable[[Any], bool],
            prepare: Callable[[Any], None] | None = None,
            substitute: Substitute | None = None) -> Resolved:
    """Replace every Stateful in ``state_dict`` by its ``state_dict()`` (see
    the module doc).  A Stateful's state dict may itself hold Statefuls; they
    are resolved too.  ``prepare`` (a load's) is called with each Stateful
    before its ``state_dict()``; ``substitute`` with every other leaf, at
    any depth.

    Raises :class:`CheckpointError` naming the fqn if a ``state_dict()``
    raises or returns something other than a dict; what ``substitute``
    raises.
    """
    out = Resolved(state_dict, root=state_dict)
    out.state_dict = _walk(state_dict, "", out, is_tensor, prepare, substitute, 1)
    return out


def _walk(value: Any, fqn: str, out: Resolved, is_tensor,
          prepare: Callable[[Any], None] | None, substitute: Substitute | None,
          depth: int) -> Any:
    """``value`` (``depth`` containers below the root, which is 1) with its
    Statefuls resolved and its leaves substituted: ``value`` itself if none
    changed, else a copy of it."""
    if isinstance(value, dict):
        items = list(value.items())
    elif isinstance(value, (list, tuple)):
        items = list(enumerate(value))
    else:
        return value
    new: dict[Any, Any] = {}
    found: list[Any] = []
    swapped: list[Any] = []
    for key, child in items:
        path = f"{fqn}.{key}" if fqn else str(key)
        if substitute is not None and not isinstance(child, (dict, list, tuple)):
            replacement = substitute(path, child)
            if replacement is not child:
                new[key] = replacement
                swapped.append((key, child, path))
                continue
        if is_stateful(child, is_tensor):
            try:
                if prepare is not None:
                    prepare(child)
                sd = child.state_dict()
            except CheckpointError:
                raise
            except Exception as e:
                raise CheckpointError(
                    f"{path!r}: {type(child).__name__}.state_dict raised "
                    f"{type(e).__name__}: {e}") from e
            if not isinstance(sd, dict):
                raise CheckpointError(
                    f"{path!r}: {type(child).__name__}.state_dict() returned a "
                    f"{type(sd).__name__}, not a dict")
            new[key] = _walk(sd, path, out, is_tensor, prepare, substitute, depth + 1)
            found.append((key, child, path))
        else:
            resolved = _walk(child, path, out, is_tensor, prepare, substitute, depth + 1)
            if resolved is not child:
                new[key] = resolved
    if not new:
        return value
    if isinstance(value, dict):
        copy: Any = dict(value)
        copy.update(new)
    else:
        copy = [new.get(k, v) for k, v in items]
        if isinstance(value, tuple):
            copy = type(value)(copy) if type(value) is tuple else tuple(copy)
    out.copies.append((value, copy))
    for key, child, path in found:
        out.statefuls.append(_Found(path, child, copy, key, depth))
    for key, child, path in swapped:
        out.substituted.append(_Found(path, child, copy, key))
    return copy
