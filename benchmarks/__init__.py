"""Benchmarks of hyperdcp (``dcp``) against ``torch.distributed.checkpoint``.

Run ``python -m benchmarks --help``. Layout: ``__main__`` (CLI), one module per
scenario family (``sync_save_load``), ``systems`` (the compared checkpoint
systems), ``common`` (process-group launch, /proc/self/io accounting, page-cache
eviction) and ``report`` (summary over repeats, JSON and Markdown output).
"""
