"""Tools around checkpoints: the ``hyperdcp`` command line (:mod:`.cli`, the
parser; :mod:`.commands`, the subcommands' work), the demo job, ``verify``
and ``diff``."""
