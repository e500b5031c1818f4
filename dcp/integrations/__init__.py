"""Trainers that pick hyperdcp from their configuration (docs/integrations.md).

:mod:`dcp.integrations.torchtitan`: a checkpointer for torchtitan 0.3.0's
``Trainer.Config.checkpoint``; :mod:`dcp.integrations.lightning`: strategies
for Lightning 2.6's ``Trainer(strategy=...)``.  Each imports its trainer, so
``import dcp`` and this package import neither; both are built on the public
API (:class:`dcp.CheckpointManager`, :func:`dcp.save`, :func:`dcp.load`).
"""
