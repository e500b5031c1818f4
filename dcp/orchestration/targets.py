"""A load's targets, prepared at the API's edge and finished after the reads.

:func:`dcp.load` hands the load the caller's state dict through
:class:`Targets`:

* before anything is read, Stateful values are resolved to what their
  ``state_dict()`` returns (:mod:`dcp.core.stateful`), a fresh optimizer's
  state initialised first (:func:`dcp.core.tensors.init_optimizer_state`:
  its empty ``state`` would give the load no targets), and MindSpore
  targets are replaced by torch host tensors
  (:class:`dcp.core.mindspore_tensors.LoadTargets`); a failure there is
  kept and raised inside the planning step, so every rank fails together;
* once the metadata is known, inside the planning step, every target on the
  meta device is replaced by a real tensor of its layout and the saved
  dtype, on the load's ``device`` (by default the current accelerator:
  :func:`dcp.core.tensors.materialize`), or the load raises naming it when
  the checkpoint lacks it.  PyTorch DCP materializes them too, on its
  group's device; what it must never be is a meta target left in place by
  a load that succeeds;
* after every read, the loaded values are written into the MindSpore
  targets, the Statefuls' ``load_state_dict()`` are called and the
  replaced fqns reported (:attr:`dcp.LoadReport.materialized`).
"""

from __future__ import annotations

from typing import Any

from dcp.core import mindspore_tensors, stateful, tensors
from dcp.core.metadata import Metadata
from dcp.core.state_dict import flatten
from dcp.errors import CheckpointError


class Targets:
    """The state dict one load fills: ``state_dict`` is what the load
    plans against; meta-device targets are materialized on ``device``
    (``None``: :func:`dcp.core.tensors.materialize`'s default)."""

    def __init__(self, state_dict: Any, device: Any = None) -> None:
        self.device = device
        self.error: CheckpointError | None = None
        self.mindspore = mindspore_tensors.LoadTargets()
        try:
            self.resolved = stateful.resolve(state_dict, tensors.is_tensor,
                                             prepare=tensors.init_optimizer_state,
                                             substitute=self.mindspore.substitute
                                             if mindspore_tensors.imported() else None)
        except CheckpointError as e:  # raised in the planning step, on every rank
            self.error = e
            self.resolved = stateful.Resolved(state_dict)
        self.materialized: list[str] = []

    @property
    def state_dict(self) -> Any:
        return self.resolved.state_dict

    def before_planning(self, metadata: Metadata | None) -> None:
        """Raise a failure of the Stateful resolution; replace meta-device
        targets by real tensors of the saved dtype."""
        if self.error is not None:
            raise self.error
        if metadata is None or not isinstance(self.state_dict, dict):
            return
        for fqn, leaf in flatten(self.state_dict, tensors.is_tensor).items():
            if not (tensors.is_tensor(leaf.value) and tensors.is_meta(leaf.value)):
                continue
            saved = metadata.tensors.get(fqn)
            if saved is None:
                raise CheckpointError(
                    f"{fqn!r} is on the meta device and the checkpoint does not hold it: "
                    f"nothing would give it values (materialize it, or leave it out)")
            leaf.replace(fqn, tensors.materialize(leaf.value, saved.dtype, self.device))
            self.materialized.append(fqn)

    def finish(self, report: Any) -> None:
        """After every read: fill the MindSpore targets (those the load
        found), call the Statefuls' ``load_state_dict()`` and report the
        materialized fqns."""
        self.mindspore.write_back(report.missing_keys)
        self.resolved.finish()
        report.materialized = list(self.materialized)
