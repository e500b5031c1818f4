"""Benchmarks of hyperdcp (``dcp``) against ``torch.distributed.checkpoint``.

Run ``python -m benchmarks --help``. Layout: ``__main__`` (CLI, runs every
family), one module per scenario family (``sync_save_load``,
``small_tensors``, ``async_save``, ``storage``, ``convert``, ``scale``,
``coordination``), ``systems`` (the compared checkpoint systems), ``common``
(process-group launch, /proc/self/io accounting, page-cache eviction),
``report`` (summary over repeats, JSON and Markdown output) and ``chart``
(the PNG).
"""
