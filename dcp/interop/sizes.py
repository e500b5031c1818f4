"""Byte sizes as conversions take them: ``5GB`` (10^9), ``500MiB`` (2^20),
``1048576``; and the default shard size of a safetensors export.

Apart from :mod:`.safetensors_io` so that the ``hyperdcp`` parser can
name the default without importing torch."""

from __future__ import annotations

import re

from dcp.errors import CheckpointError

#: Default shard size of an export: the Hugging Face Hub's customary 5 GB.
DEFAULT_MAX_SHARD_SIZE = "5GB"

_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
          "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40}


def parse_size(size: int | str) -> int:
    """Bytes in ``size``: an int, or a string like ``"5GB"`` (10^9),
    ``"500MiB"`` (2^20) or ``"1048576"``.  Raises :class:`CheckpointError`
    for anything else or a size below 1."""
    if isinstance(size, int):
        value = size
    else:
        match = re.fullmatch(r"\s*(\d+)\s*([A-Za-z]*)\s*", str(size))
        if not match or match.group(2).upper() not in _UNITS:
            raise CheckpointError(f"size {size!r} is not a number with a unit like 5GB or 500MiB")
        value = int(match.group(1)) * _UNITS[match.group(2).upper()]
    if value < 1:
        raise CheckpointError(f"size {size!r} must be at least 1 byte")
    return value
