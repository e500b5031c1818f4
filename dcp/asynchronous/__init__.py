"""Asynchronous saving: staging on the trainer, persisting in a worker.

:mod:`.async_save` is the entry point, :mod:`.staging` copies tensors into
reused shared host memory, :mod:`.worker` is the persistent background
process that plans, writes and commits.
"""
