"""The phases of a synchronous save and of a load, top to bottom.

:mod:`.save` and :mod:`.load` run the phases; the decisions (which bytes,
which rank, which requests) belong to the planners and storage plugins.
:mod:`.pending` keeps saves in flight from being overtaken; :mod:`.gc_pause`
keeps Python's collector out of the planning bursts.
"""
