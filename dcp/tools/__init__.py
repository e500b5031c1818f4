"""Tools around checkpoints: the ``hyperdcp`` command line, the demo job,
``verify`` and ``diff``."""
