"""How ranks agree: collectives, file flags, or nothing at all.

:mod:`.collectives` (steps over a gloo process group, with failure
propagation), :mod:`.file_flag` (the same steps over the checkpoint's own
storage), :mod:`.independent` (no cross-rank traffic), :mod:`.wire` (the
non-executable payload encoding), :mod:`.plan_cache` (skipping the planning
exchange), :mod:`.dtensor_offsets` (where DTensor shards the placements do
not place start), and the load side's pass-on of regions read once:
:mod:`.broadcast` (across hosts) and :mod:`.host_exchange` (shared memory
within a host).
"""
