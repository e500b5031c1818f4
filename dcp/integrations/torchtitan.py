"""torchtitan's checkpointer on :class:`dcp.CheckpointManager`.

torchtitan 0.3.0 builds its checkpointer from ``Trainer.Config.checkpoint``,
typed ``BaseCheckpointManager.Config``: ``config.checkpoint.build(
dataloader=, model_parts=, optimizers=, lr_schedulers=, states=,
sd_adapter=, base_folder=)`` constructs the class that declares the config
(``Configurable``), and the trainer calls ``load(step)`` once,
``maybe_wait_for_staging()`` right before each optimizer step,
``save(step, last_step)`` after each step and ``close()`` at the end
(``torchtitan/components/checkpointer/base.py``).  :class:`CheckpointManager`
implements that contract (``_load``, ``_save``, ``_maybe_wait_for_staging``,
``_wait_for_saving``, ``_close``) on hyperdcp's manager, so a config switches
by the class it names::

    from dcp.integrations.torchtitan import CheckpointManager
    # was: from torchtitan.components.checkpoint import CheckpointManager
    checkpoint=CheckpointManager.Config(enable=True, folder="s3://bucket/run", ...)

A step holds what torchtitan's own checkpointer saves, under its keys (the
model's fqns at the top level, ``optimizer``, ``lr_scheduler``,
``dataloader``, ``train_state`` and the trainer's other states), in
``<folder>/step-<N>``, with the manager's ``_manager`` entries (each rank's
RNG states) beside them.  Each field of torchtitan's config keeps its
meaning (the table: docs/integrations.md); ``initial_load_in_hf_quantized``
is refused.  The ``memory_*`` fields give the manager a :class:`dcp.MemoryTier`
(docs/recovery.md): a resume then takes the newest step of either tier,
through :meth:`dcp.CheckpointManager.load_latest`, and a seed checkpoint
(persistent by nature) is refused with it.  Steps torchtitan's own
checkpointer wrote (PyTorch DCP) are converted once (``hyperdcp convert
--trust-pickle``) and loaded as the ``initial_load_path``; a folder that
holds only such steps is refused, so a run never starts afresh beside them
nor has its retention delete them.
"""

from __future__ import annotations

import os
import re
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any, Literal, TypeVar

import torch.distributed as dist
from torchtitan.components.checkpointer import (
    DATALOADER,
    LR_SCHEDULER,
    MODEL,
    OPTIMIZER,
    BaseCheckpointManager,
    ModelWrapper,
)
from torchtitan.config import TORCH_DTYPE_MAP
from torchtitan.tools import filesystem

import dcp
from dcp.interop.safetensors_io import load_safetensors
from dcp.interop.torch_dcp_io import TORCH_METADATA_FILE

ASYNC_MODES = ("disabled", "async", "async_with_pinned_mem")
#: ``rng_on_resize`` -> the manager's rule (``None``: such a resume raises).
RNG_RULES: dict[str, Callable[[], Any] | None] = {
    "derive": dcp.DeriveRNG, "first_rank": dcp.FromFirstRank, "refuse": None}
_STEP = re.compile(r"step-(\d+)")
_T = TypeVar("_T")


def _agreed(decide: Callable[[], _T]) -> _T:
    """``decide()`` on rank 0, its result (or its error) the same on every
    rank, so that no rank goes on to a collective another left."""
    if not (dist.is_available() and dist.is_initialized()):
        return decide()
    box: list[Any] = [None]
    if dist.get_rank() == 0:
        try:
            box[0] = decide()
        except dcp.CheckpointError as e:
            box[0] = e
    dist.broadcast_object_list(box, src=0)
    if isinstance(box[0], dcp.CheckpointError):
        raise box[0]
    return box[0]


class CheckpointManager(BaseCheckpointManager):
    """torchtitan's checkpointer contract on :class:`dcp.CheckpointManager`
    (module doc): steps under ``folder`` (any storage URI, S3 included),
    hyperdcp's async saves, retention, RNG states and, with
    ``memory_interval``, the memory tier.  Built by torchtitan's
    trainer from :class:`CheckpointManager.Config`; every rank builds it and
    calls it at the same steps.

    Raises:
        dcp.CheckpointError: a refused field or combination (naming the
            field), a step that is not complete, a ``load_step`` older
            than the newest step of either tier, a folder holding only
            torchtitan's own (PyTorch DCP) steps, and every failure of a
            save or load (on every rank).
    """

    @dataclass(kw_only=True, slots=True)
    class Config(BaseCheckpointManager.Config):
        """torchtitan's checkpoint fields (their meaning unchanged) and
        hyperdcp's."""

        async_mode: Literal["disabled", "async", "async_with_pinned_mem"] = "disabled"
        """``disabled``: each save is synchronous.  ``async``: a save returns
        once every tensor is copied to host memory, and a background process
        per rank writes and commits it (:func:`dcp.async_save`).
        ``async_with_pinned_mem``: it returns before the copy ends, and the
        trainer's ``maybe_wait_for_staging()`` waits for it before the
        optimizer step."""

        storage_options: dict[str, Any] = field(default_factory=dict)
        """Options of the storage plugin ``folder``'s scheme picks (S3's
        ``endpoint_url``, ``key``, ``secret``, ``part_size``, ...: README,
        Storage), also used for ``initial_load_path``; plain JSON values."""

        coordination: Literal["gloo", "file"] = "gloo"
        """How the ranks of an async save agree: over a gloo group, or
        through exchange files in the step folder."""

        keep_every_n_steps: int = 0
        """Also keep every step that is a multiple of this, beyond the
        newest ``keep_latest_k`` (0: none)."""

        save_rng: bool = True
        """Save each rank's RNG states (Python, NumPy, torch, accelerators)
        with each step and restore them on resume."""

        rng_on_resize: Literal["derive", "first_rank", "refuse"] = "derive"
        """The RNG states after a resume with another data-parallel degree:
        ``derive``: fresh streams derived from every saved one
        (:class:`dcp.DeriveRNG`); ``first_rank``: old data-parallel rank 0's
        on every rank (:class:`dcp.FromFirstRank`); ``refuse``: such a
        resume raises."""

        memory_interval: int = 0
        """The memory tier (docs/recovery.md): a memory step in host shared
        memory every this many steps, with copies on other hosts; the steps
        ``interval`` picks are then persisted from host memory, and a resume
        takes the newest step of either tier (0: no memory tier)."""

        memory_replicas: int = 1
        """Copies, on other hosts, of each chunk whose every holder is on
        one host (chunks on two or more hosts cost nothing)."""

        memory_domains: dict[str, str] = field(default_factory=dict)
        """``{host: failure domain}`` (a rack); copies land in other
        domains.  Hosts not named are each their own domain."""

        memory_host: str = ""
        """This rank's host identity ("": the machine's name)."""

        memory_namespace: str = ""
        """The folder in host shared memory holding the memory steps ("":
        ``/dev/shm/hyperdcp-memory``)."""

        memory_host_bytes: int = 0
        """The most bytes (the step being saved included) the memory steps
        of this run may hold on one host (0: no limit); a save over it is
        refused, warned, and training goes on."""

        memory_run_id: str = ""
        """The run's identity under the namespace ("": derived from
        ``folder``)."""

        memory_timeout: float = 60.0
        """Seconds a memory save's or restore's transfers wait for a peer."""

        def __post_init__(self) -> None:
            BaseCheckpointManager.Config.__post_init__(self)
            for name, value, allowed in (("async_mode", self.async_mode, ASYNC_MODES),
                                         ("coordination", self.coordination, ("gloo", "file")),
                                         ("rng_on_resize", self.rng_on_resize, tuple(RNG_RULES))):
                if value not in allowed:
                    raise dcp.CheckpointError(f"checkpoint.{name}={value!r}: one of {allowed}")
            if self.keep_every_n_steps < 0:
                raise dcp.CheckpointError(f"checkpoint.keep_every_n_steps="
                                          f"{self.keep_every_n_steps}: 0 (none) or more")
            for name, low in (("memory_interval", 0), ("memory_replicas", 0),
                              ("memory_host_bytes", 0)):
                if getattr(self, name) < low:
                    raise dcp.CheckpointError(f"checkpoint.{name}={getattr(self, name)}: "
                                              f"{low} or more")
            if self.memory_timeout <= 0:
                raise dcp.CheckpointError(f"checkpoint.memory_timeout={self.memory_timeout}: "
                                          f"seconds, > 0")
            if self.create_seed_checkpoint and self.memory_interval:
                raise dcp.CheckpointError(
                    f"checkpoint.create_seed_checkpoint with checkpoint.memory_interval="
                    f"{self.memory_interval}: a seed checkpoint must be persistent, and the "
                    f"memory tier keeps steps in host memory; create the seed with "
                    f"memory_interval=0, then train with the memory tier")
            if self.initial_load_in_hf_quantized:
                raise dcp.CheckpointError(
                    "checkpoint.initial_load_in_hf_quantized: quantized Hugging Face weights are "
                    "read through the model's own storage reader, which hyperdcp does not run; "
                    "load dequantized safetensors (initial_load_in_hf), or keep torchtitan's "
                    "CheckpointManager for that run")

        def memory_tier(self) -> dcp.MemoryTier | None:
            """The :class:`dcp.MemoryTier` the ``memory_*`` fields give
            (``None`` with ``memory_interval=0``)."""
            if not self.memory_interval:
                return None
            return dcp.MemoryTier(
                interval=self.memory_interval, replicas=self.memory_replicas,
                domains=dict(self.memory_domains) or None, host=self.memory_host or None,
                namespace=self.memory_namespace or None,
                host_bytes=self.memory_host_bytes or None, run_id=self.memory_run_id or None,
                timeout=self.memory_timeout)

    def __init__(self, config: Config, *, dataloader: Any, model_parts: list[Any],
                 optimizers: Any, lr_schedulers: Any, states: dict[str, Any],
                 sd_adapter: Any, base_folder: str = "") -> None:
        self.enable = config.enable
        self.save_future: Future | None = None
        if not self.enable:
            return
        self.config = config
        self.folder = filesystem.join(base_folder, config.folder)
        self.sd_adapter = sd_adapter
        for name in ("initial_load_in_hf", "last_save_in_hf"):
            if getattr(config, name) and sd_adapter is None:
                raise dcp.CheckpointError(f"checkpoint.{name}: the model has no state dict "
                                          f"adapter to map its fqns to Hugging Face names")
        self.states = states
        self.states.update({MODEL: ModelWrapper(model_parts), OPTIMIZER: optimizers,
                            DATALOADER: dataloader, LR_SCHEDULER: lr_schedulers})
        unknown = [k for k in config.exclude_from_loading if k not in self.states]
        if unknown:
            raise dcp.CheckpointError(f"checkpoint.exclude_from_loading: {unknown} are not "
                                      f"among the states {sorted(self.states)}")
        decision: Any = dcp.FixedInterval(config.interval)
        if config.enable_first_step_checkpoint:
            decision = dcp.AnyOf(decision, dcp.SpecificSteps([1]))
        keep: Any = dcp.LatestN(config.keep_latest_k)
        if config.keep_every_n_steps:
            keep = dcp.AnyOf(keep, dcp.EveryNSteps(config.keep_every_n_steps))
        rule = RNG_RULES[config.rng_on_resize]
        # torchtitan's data loaders know their data-parallel rank and degree
        dp = (dataloader.dp_rank, dataloader.dp_world_size) \
            if hasattr(dataloader, "dp_rank") and hasattr(dataloader, "dp_world_size") else None
        self._manager = dcp.CheckpointManager(
            self.folder, async_save=config.async_mode != "disabled",
            storage_options=config.storage_options, coordination=config.coordination,
            save_on_preemption=False, save_policy=decision, preservation=keep,
            save_rng=config.save_rng, rng_on_resize=rule() if rule is not None else None,
            data_parallel=dp, export_dtype=TORCH_DTYPE_MAP[config.export_dtype],
            blocking_staging=config.async_mode != "async_with_pinned_mem",
            memory=config.memory_tier())

    @property
    def manager(self) -> dcp.CheckpointManager:
        """The :class:`dcp.CheckpointManager` underneath (steps, errors)."""
        return self._manager

    def _state(self, model_only: bool, exclude: tuple[str, ...] | list[str] = ()) -> dict:
        """What a step holds, in torchtitan's layout: the model's fqns at the
        top level and the other states under their names."""
        state = {} if model_only else {k: v for k, v in self.states.items()
                                       if k != MODEL and v is not None and k not in exclude}
        state.update(self.states[MODEL].state_dict())
        return state

    # -------------------------------------------------------------- save
    def _save(self, curr_step: int, last_step: bool = False) -> bool:
        config = self.config
        if config.load_only:
            return False
        if curr_step == 0 and config.create_seed_checkpoint:
            # step 0 holds the model as initialized; a resume loads it model-only
            return self._started(self._manager.save(0, self._state(model_only=True), force=True))
        if last_step and config.last_save_model_only:
            model = self.states[MODEL].state_dict()
            if config.last_save_in_hf:
                model = self.sd_adapter.to_hf(model)
            self.maybe_wait_for_saving()
            self._manager.export(curr_step, model, safetensors=config.last_save_in_hf)
            return True
        return self._started(self._manager.save(curr_step, self._state(model_only=False),
                                                force=last_step))

    def _started(self, started: bool) -> bool:
        """After the manager's ``save``: an async save that started waited
        for the one before, whose future is done."""
        if started and self.config.async_mode != "disabled":
            if self.save_future is not None:
                self.save_future.set_result(None)
            self.save_future = Future()
        return started

    def _maybe_wait_for_staging(self) -> None:
        self._manager.wait_for_staging()

    def _wait_for_saving(self) -> None:
        """Wait for the save in flight; a failed one is warned about
        (:class:`dcp.CheckpointWarning`, listed in ``manager.errors``) and
        training goes on from the newest complete step."""
        self._manager.wait()
        assert self.save_future is not None
        self.save_future.set_result(None)
        self.save_future = None

    def _close(self) -> None:
        self._manager.close()
        if self.save_future is not None:
            self.save_future.set_result(None)
            self.save_future = None

    # -------------------------------------------------------------- load
    def _resume_point(self, step: int) -> tuple[int | None, int | None]:
        """``(the step to load, the newest complete step)`` of the persistent
        tier; ``(None, None)`` for an initial load or a fresh start."""
        latest = self._manager.latest_step()
        if step == -1:
            if latest is None:
                old = self._torch_dcp_steps()
                if old:
                    raise dcp.CheckpointError(
                        f"{self.folder!r} holds step(s) {old} saved by torchtitan's own "
                        f"checkpointer (PyTorch DCP) and none of hyperdcp's: convert the newest "
                        f"once (hyperdcp convert {self.folder}/step-{old[-1]} DST --trust-pickle) "
                        f"and resume from it with checkpoint.initial_load_path=DST and "
                        f"checkpoint.initial_load_model_only=False, in another "
                        f"checkpoint.folder")
            return latest, latest
        complete = self._manager.persistent_steps()
        if step not in complete:
            raise dcp.CheckpointError(f"checkpoint.load_step={step}: {self.folder!r} holds no "
                                      f"complete step {step} (complete: {complete})")
        if step != latest and not self.config.load_only:
            raise dcp.CheckpointError(
                f"checkpoint.load_step={step}: step {latest} under {self.folder!r} is newer, and "
                f"saves must be newer than the newest step; to train on from step {step}, set "
                f"checkpoint.initial_load_path={self._manager.step_uri(step)!r} and "
                f"initial_load_model_only=False with another checkpoint.folder (or "
                f"load_only=True to only load it)")
        return step, latest

    def _torch_dcp_steps(self) -> list[int]:
        """The steps torchtitan's own checkpointer would find in a local
        ``folder`` (``step-<N>/.metadata``)."""
        if filesystem.is_remote(self.folder) or not os.path.isdir(self.folder):
            return []
        return sorted(int(m.group(1)) for name in os.listdir(self.folder)
                      if (m := _STEP.fullmatch(name))
                      and os.path.isfile(os.path.join(self.folder, name, TORCH_METADATA_FILE)))

    def _newest_in_memory(self) -> int | None:
        """The newest memory step any host holds (``None``: none, or no
        memory tier); collective with a memory tier.  Some host's copy may
        not make it complete: the manager's restore decides that."""
        if self._manager.memory is None:
            return None
        mine = max(self._manager.memory_steps(), default=None)
        every: list[int | None] = [mine]
        if dist.is_available() and dist.is_initialized():
            every = [None] * dist.get_world_size()
            dist.all_gather_object(every, mine)
        return max((s for s in every if s is not None), default=None)

    def _load(self, step: int = -1) -> bool:
        found, latest = _agreed(lambda: self._resume_point(step))
        in_memory = self._newest_in_memory()
        if step != -1 and in_memory is not None and in_memory > step \
                and not self.config.load_only:
            raise dcp.CheckpointError(
                f"checkpoint.load_step={step}: memory step {in_memory} in host memory "
                f"(checkpoint.memory_*) is newer, and saves must be newer than the newest "
                f"step; leave load_step=-1 to resume from the newest step of either tier, or "
                f"set load_only=True to only load step {step}")
        if step == -1 and in_memory is not None and (found is None or in_memory > found):
            found = in_memory  # the manager's restore takes it, or an older step
        if found is None:
            return self._initial_load()
        # step 0 is a seed checkpoint: the model only, as torchtitan loads it
        state = self._state(model_only=found == 0, exclude=self.config.exclude_from_loading)
        if found != 0 and found == max(latest or 0, in_memory or 0):
            # the manager's resume, from the newest step of either tier: RNG states, and
            # corrupt steps passed over (warned about); train_state holds the step loaded
            if self._manager.load_latest(state) is None:
                return self._initial_load()
        else:
            dcp.load(state, self._manager.step_uri(found),
                     storage_options=self.config.storage_options)
        self.states[MODEL].load_state_dict(state)
        return True

    def _initial_load(self) -> bool:
        """``initial_load_path`` (or, for Hugging Face weights, the model's
        ``hf_assets_path``) when the folder holds no complete step; the
        model only unless ``initial_load_model_only=False``."""
        config = self.config
        if config.initial_load_in_hf:
            path = config.initial_load_path or getattr(self.sd_adapter, "hf_assets_path", None)
            if not path:
                raise dcp.CheckpointError("checkpoint.initial_load_in_hf: no initial_load_path, "
                                          "and the model has no hf_assets_path")
            hf = self.sd_adapter.to_hf(self.states[MODEL].state_dict())
            load_safetensors(hf, path, allow_dtype_cast=True,
                             storage_options=config.storage_options)
            self.states[MODEL].load_state_dict(self.sd_adapter.from_hf(hf))
            return True
        path = config.initial_load_path
        if not path:
            return False
        state = self._state(model_only=config.initial_load_model_only,
                            exclude=config.exclude_from_loading)
        try:
            dcp.load(state, path, allow_dtype_cast=config.initial_load_model_only,
                     storage_options=config.storage_options)
        except dcp.NotACheckpointError:
            if not os.path.isfile(os.path.join(path, TORCH_METADATA_FILE)):
                raise
            raise dcp.CheckpointError(
                f"checkpoint.initial_load_path={path!r} is a PyTorch DCP checkpoint (torchtitan's "
                f"own format), whose metadata is a pickle: convert it once (hyperdcp convert "
                f"{path} DST --trust-pickle) and set initial_load_path=DST") from None
        self.states[MODEL].load_state_dict(state)
        return True
