"""The recovery tier: memory steps in host shared memory, copies on other
hosts, restore from the cheapest complete source, silent-data-corruption
checks (docs/recovery.md).

Modules, one concept each: ``tier.py`` (the :class:`MemoryTier` policy),
``placement.py`` (which rank writes each chunk, where copies go, where a
restore takes each chunk: pure, numpy), ``host_store.py`` (one host's
memory steps in shared memory), ``hosts.py`` (the tier's gloo group and the
host of each rank), ``replicate.py`` (batched transfers between ranks),
``snapshot.py`` (the phases of a memory save), ``sdc.py`` (replica
checksums compared), ``restore.py`` (agreement and reading).
"""

from dcp.recovery.restore import RestoreReport
from dcp.recovery.tier import MemoryTier

__all__ = ["MemoryTier", "RestoreReport"]
