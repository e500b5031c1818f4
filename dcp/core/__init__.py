"""The framework-agnostic model of a checkpoint and its interfaces.

Metadata and its encoding (:mod:`.metadata`), box arithmetic for resharding
(:mod:`.boxes`), plans and the planner interfaces (:mod:`.planner`), the
storage interface and plugin registry (:mod:`.storage`, :mod:`.retry`),
state-dict flattening (:mod:`.state_dict`), the restricted unpickler
(:mod:`.unpickler`) and the torch adapter (:mod:`.tensors`, the only module
here that imports torch).
"""
