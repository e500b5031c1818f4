"""Benchmarks of hyperdcp (``dcp``) against ``torch.distributed.checkpoint``.

Run ``python -m benchmarks --help``. Layout: ``__main__`` (CLI, runs every
family), one module per scenario family (``sync_save_load``,
``small_tensors``, ``s3_load``, ``async_save``, ``storage``, ``convert``,
``scale``, ``coordination``, ``startup``), ``systems`` (the compared checkpoint systems
on files), ``state_dicts`` (the layouts and their element-exact check),
``common`` (the one way to run a worker in a process group, timing,
/proc/self/io accounting, page-cache eviction), ``report`` (summary over
repeats and the one JSON / Markdown table writer) and ``chart`` (the PNG).
"""
