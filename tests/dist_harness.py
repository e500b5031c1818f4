"""Multi-process test harness: run many scenarios inside ONE spawned gloo group.

Spawning a rank costs ~2-3 s of torch import, so tests never spawn a group per
assertion.  Instead, scenario functions ``fn(ctx)`` run sequentially in one
group of ``world_size`` ranks; each rank records a start and an end record per
scenario in its own results file, and the pytest process turns those records
into one pass/fail per scenario, with the failing ranks' tracebacks.

Two ways to use it:

* ``run_group(world_size, scenarios, tmp_path)`` -> :class:`GroupResult`;
  ``result.check(fn)`` raises ``AssertionError`` for a failed scenario.
  ``scenarios`` are module-level functions (spawned ranks import them by
  module and name).

* The decorator ``@dist_scenario(world_size=4)`` on a ``def test_x(ctx):``
  turns the scenario into a pytest test of the same name.  All decorated
  scenarios of the same ``(world_size, phase)`` run in one group per pytest
  session (see the ``dist_groups`` fixture in conftest.py); groups run in
  ascending ``phase`` order, so a phase-0 group can write a checkpoint into
  ``ctx.shared`` that a phase-1 group of another world size loads.

Robustness:

* Every collective has a timeout (``pg_timeout``, gloo), so a rank that is
  stuck because a peer raised turns into a failure instead of a hang.  After
  every scenario the ranks meet at a store-based barrier (independent of the
  gloo process group) and, if any rank failed, re-create the default process
  group, so one failed scenario does not desynchronise the ones after it.
* The whole group has a join timeout (``group_timeout``); on expiry every rank
  is killed, and each unfinished scenario reports which scenario each rank was
  in at the time.
* A rank that dies (segfault, ``os._exit``) is reported the same way.
"""

from __future__ import annotations

import collections
import dataclasses
import datetime
import importlib
import json
import os
import shutil
import sys
import time
import traceback
import uuid
from collections.abc import Callable, Iterable
from pathlib import Path

import pytest

DEFAULT_PG_TIMEOUT = 60.0  # seconds per gloo collective


def default_group_timeout(n_scenarios: int) -> float:
    """Seconds for a whole group (spawn + all scenarios): generous, since CI has
    2 cores; a hung collective already fails after ``pg_timeout``."""
    return 120.0 + 30.0 * n_scenarios


# pytest-timeout guard for the generated tests; the first test of a session may
# run several groups (all lower phases first).  The harness's own timeouts fire
# well before this in practice.
SESSION_TEST_TIMEOUT = 1800
DEFAULT_PHASE = 1


# --------------------------------------------------------------------------
# What a scenario sees.
# --------------------------------------------------------------------------
@dataclasses.dataclass
class ScenarioContext:
    rank: int
    world_size: int
    dir: Path  # private to this scenario, the same path on every rank
    shared: Path  # shared by all groups of one run_group/session (cross-group checkpoints)
    name: str

    def barrier(self) -> None:
        import torch.distributed as dist

        dist.barrier()


# --------------------------------------------------------------------------
# Registry for @dist_scenario.
# --------------------------------------------------------------------------
@dataclasses.dataclass
class _Registered:
    key: str  # "module:qualname"
    fn: Callable
    world_size: int
    phase: int
    last: bool
    order: int
    chain: str = "main"


_REGISTRY: dict[str, _Registered] = {}


def _key_of(fn: Callable) -> str:
    return f"{fn.__module__}:{fn.__qualname__}"


def dist_scenario(world_size: int, *, phase: int = DEFAULT_PHASE, last: bool = False,
                  chain: str = "main"):
    """Register ``fn(ctx)`` to run in the shared ``world_size`` group of ``phase``
    and return a pytest test (same name) that reports its outcome.

    ``last=True`` schedules the scenario after the others of its group (use it
    for failure-injection scenarios, which are the likeliest to disturb the
    group if the library misbehaves).  ``chain``: phases order the groups of
    one chain only; groups of different chains share nothing and may run in
    different pytest-xdist workers at once."""

    def deco(fn: Callable):
        key = _key_of(fn)
        _REGISTRY[key] = _Registered(key, fn, world_size, phase, last, len(_REGISTRY), chain)

        def test(dist_groups):
            dist_groups.check(key)

        # No functools.wraps: pytest would follow __wrapped__ and ask for a
        # fixture named ``ctx``.
        test.__name__ = fn.__name__
        test.__qualname__ = fn.__qualname__
        test.__module__ = fn.__module__
        test.__doc__ = fn.__doc__
        return pytest.mark.timeout(SESSION_TEST_TIMEOUT)(test)

    return deco


def _resolve(module: str, qualname: str) -> Callable:
    mod = importlib.import_module(module)
    key = f"{module}:{qualname}"
    if key in _REGISTRY:
        return _REGISTRY[key].fn
    obj = mod
    for part in qualname.split("."):
        obj = getattr(obj, part)
    return obj


# --------------------------------------------------------------------------
# Rank side.
# --------------------------------------------------------------------------
def _store_barrier(store, key: str, world_size: int, timeout: float) -> None:
    store.add(key, 1)
    deadline = time.monotonic() + timeout
    while store.add(key, 0) < world_size:
        if time.monotonic() > deadline:
            raise TimeoutError(f"store barrier {key!r} timed out after {timeout:.0f}s")
        time.sleep(0.005)


def _init_pg(store, gen: int, rank: int, world_size: int, pg_timeout: float) -> None:
    import torch.distributed as dist

    dist.init_process_group(
        "gloo",
        store=dist.PrefixStore(f"pg{gen}", store),
        rank=rank,
        world_size=world_size,
        timeout=datetime.timedelta(seconds=pg_timeout),
    )


def _rank_main(rank: int, spec: dict) -> None:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    # the group's shared-memory exchange files in a folder of its own, so a
    # scenario can assert none is left while another pytest-xdist worker's
    # loads make theirs (the files and their fan-out are the real ones)
    from dcp.coordination import host_exchange

    host_exchange.SHM_ROOT = spec["shm_root"]
    world_size = spec["world_size"]
    pg_timeout = spec["pg_timeout"]
    # Ranks wait for each other between scenarios outside gloo; only the group
    # timeout (enforced by the parent) bounds a slow scenario.
    barrier_timeout = spec["group_timeout"]
    results = open(Path(spec["results_dir"]) / f"rank{rank}.jsonl", "a", buffering=1)

    def record(**kw):
        results.write(json.dumps(kw) + "\n")
        results.flush()

    t0 = time.monotonic()
    fns: dict[int, Callable | BaseException] = {}
    for i, (module, qualname, _) in enumerate(spec["scenarios"]):
        try:
            fns[i] = _resolve(module, qualname)
        except BaseException as e:  # noqa: BLE001 - reported as the scenario's failure
            fns[i] = e
    store = dist.FileStore(spec["store_path"], world_size)
    gen = 0
    _init_pg(store, gen, rank, world_size, pg_timeout)
    record(event="ready", secs=round(time.monotonic() - t0, 3))
    for i, (module, qualname, scen_dir) in enumerate(spec["scenarios"]):
        key = f"{module}:{qualname}"
        _store_barrier(store, f"begin{i}", world_size, barrier_timeout)
        record(event="start", key=key)
        t0 = time.monotonic()
        ok, tb = True, ""
        try:
            fn = fns[i]
            if isinstance(fn, BaseException):
                raise fn
            ctx = ScenarioContext(rank, world_size, Path(scen_dir), Path(spec["shared"]), key)
            fn(ctx)
        except BaseException:  # noqa: BLE001 - report everything, incl. KeyboardInterrupt-like
            ok, tb = False, traceback.format_exc()
        record(event="end", key=key, ok=ok, tb=tb, secs=round(time.monotonic() - t0, 3))
        store.set(f"status{i}/{rank}", "ok" if ok else "fail")
        # Wait (outside gloo) until every rank is done with this scenario; a rank
        # blocked in a collective gets out through the gloo timeout.
        _store_barrier(store, f"end{i}", world_size, barrier_timeout)
        statuses = [store.get(f"status{i}/{r}").decode() for r in range(world_size)]
        if "fail" in statuses:
            # Collectives may be out of step: start from a fresh process group.
            try:
                dist.destroy_process_group()
            except Exception:  # noqa: BLE001
                pass
            gen += 1
            _init_pg(store, gen, rank, world_size, pg_timeout)
    _store_barrier(store, "finish", world_size, barrier_timeout)
    dist.destroy_process_group()
    results.close()


# --------------------------------------------------------------------------
# Pytest side.
# --------------------------------------------------------------------------
@dataclasses.dataclass
class _Outcome:
    ok: bool | None  # None: never finished
    tb: str = ""
    secs: float = 0.0


class GroupResult:
    def __init__(self, world_size: int, keys: list[str], outcomes: dict, group_error: str,
                 secs: float):
        self.world_size = world_size
        self.keys = keys
        self.outcomes: dict[str, dict[int, _Outcome]] = outcomes
        self.group_error = group_error  # crash / timeout description, "" if none
        self.secs = secs

    def check(self, scenario: Callable | str) -> None:
        key = scenario if isinstance(scenario, str) else _key_of(scenario)
        if key not in self.outcomes:
            raise KeyError(f"{key} was not part of this group")
        per_rank = self.outcomes[key]
        lines: list[str] = []
        seen: dict[str, int] = {}
        for rank in range(self.world_size):
            out = per_rank.get(rank)
            if out is None or out.ok is None:
                state = "started but never finished" if out is not None else "never started"
                lines.append(f"---- rank {rank}: {state} ----")
            elif not out.ok:
                if out.tb in seen:
                    lines.append(f"---- rank {rank}: failed with the same traceback as "
                                 f"rank {seen[out.tb]} ----")
                else:
                    seen[out.tb] = rank
                    lines.append(f"---- rank {rank} traceback ----\n{out.tb}")
        if lines:
            head = f"scenario {key} failed in a world_size={self.world_size} group"
            unfinished = any(o is None or o.ok is None
                             for o in (per_rank.get(r) for r in range(self.world_size)))
            if self.group_error and unfinished:
                head += f"\ngroup error: {self.group_error}"
            raise AssertionError(head + "\n" + "\n".join(lines))

    def summary(self) -> str:
        rows = []
        for key in self.keys:
            outs = self.outcomes[key]
            secs = max((o.secs for o in outs.values()), default=0.0)
            oks = {o.ok for o in outs.values()}
            state = "ok" if oks == {True} and len(outs) == self.world_size else "FAIL"
            rows.append(f"{state:4} {secs:7.2f}s {key}")
        return "\n".join(rows)


def _collect(results_dir: Path, world_size: int, keys: list[str]):
    outcomes = {k: {} for k in keys}
    current: dict[int, str] = {}
    ready: dict[int, float] = {}
    for rank in range(world_size):
        path = results_dir / f"rank{rank}.jsonl"
        if not path.exists():
            continue
        for line in path.read_text().splitlines():
            try:
                rec = json.loads(line)
            except ValueError:
                continue
            if rec["event"] == "ready":
                ready[rank] = rec["secs"]
                continue
            if rec["event"] == "start":
                outcomes[rec["key"]][rank] = _Outcome(None)
                current[rank] = rec["key"]
            else:
                outcomes[rec["key"]][rank] = _Outcome(rec["ok"], rec["tb"], rec["secs"])
                current.pop(rank, None)
    return outcomes, current, ready


def run_group(
    world_size: int,
    scenarios: Iterable[Callable | str],
    tmp_path: Path,
    *,
    shared: Path | None = None,
    pg_timeout: float = DEFAULT_PG_TIMEOUT,
    group_timeout: float | None = None,
) -> GroupResult:
    """Spawn ``world_size`` gloo ranks that run ``scenarios`` in order.

    Each scenario gets ``ctx.dir = tmp_path / <scenario name>`` (created here)
    and ``ctx.shared = shared or tmp_path / "shared"``.  Never raises for a
    failing scenario; call ``check`` on the result."""
    import torch.multiprocessing as tmp_mp

    keys = [s if isinstance(s, str) else _key_of(s) for s in scenarios]
    if group_timeout is None:
        group_timeout = default_group_timeout(len(keys))
    tmp_path = Path(tmp_path)
    shared = Path(shared) if shared is not None else tmp_path / "shared"
    shared.mkdir(parents=True, exist_ok=True)
    results_dir = tmp_path / "_results"
    results_dir.mkdir(parents=True, exist_ok=True)
    specs = []
    for key in keys:
        module, qualname = key.split(":")
        scen_dir = tmp_path / qualname.replace(".", "_")
        scen_dir.mkdir(parents=True, exist_ok=True)
        specs.append((module, qualname, str(scen_dir)))
    spec = dict(
        world_size=world_size,
        scenarios=specs,
        results_dir=str(results_dir),
        store_path=str(tmp_path / "_filestore"),
        shared=str(shared),
        pg_timeout=pg_timeout,
        group_timeout=group_timeout,
        shm_root=f"/dev/shm/hyperdcp-test-{os.getpid()}-{uuid.uuid4().hex[:8]}",
    )
    os.makedirs(spec["shm_root"], exist_ok=True)

    env_overrides = {"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
    if sys.platform.startswith("linux"):
        env_overrides.setdefault("GLOO_SOCKET_IFNAME", os.environ.get("GLOO_SOCKET_IFNAME", "lo"))
    saved_env = {k: os.environ.get(k) for k in env_overrides}
    os.environ.update(env_overrides)
    t0 = time.monotonic()
    group_error = ""
    ctx = None
    try:
        ctx = tmp_mp.start_processes(
            _rank_main, args=(spec,), nprocs=world_size, join=False, start_method="spawn"
        )
        deadline = t0 + group_timeout
        while True:
            try:
                if ctx.join(timeout=1.0):
                    break
            except Exception as e:  # a rank exited abnormally (harness failure / crash)
                group_error = f"{type(e).__name__}: {e}"
                break
            if time.monotonic() > deadline:
                group_error = f"group timed out after {group_timeout:.0f}s; all ranks killed"
                break
    finally:
        if ctx is not None:
            for p in ctx.processes:
                if p.is_alive():
                    p.kill()
            for p in ctx.processes:
                p.join(timeout=10)
        for k, v in saved_env.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        shutil.rmtree(spec["shm_root"], ignore_errors=True)

    outcomes, current, ready = _collect(results_dir, world_size, keys)
    if group_error and current:
        where = ", ".join(f"rank {r} in {k}" for r, k in sorted(current.items()))
        group_error += f" (at that moment: {where})"
    res = GroupResult(world_size, keys, outcomes, group_error, time.monotonic() - t0)
    res.ready_secs = max(ready.values(), default=0.0)
    return res


class SessionGroups:
    """Lazily runs every registered ``(chain, world_size, phase)`` group once per
    session, in ascending phase order within its chain (all groups of a lower
    phase of a chain run before any group of a higher one)."""

    instances: list[SessionGroups] = []  # this session's, for the durations summary

    def __init__(self, base: Path):
        SessionGroups.instances.append(self)
        self.base = Path(base)
        self.shared = self.base / "shared"
        self.results: dict[tuple[str, int, int], GroupResult] = {}

    def _groups(self) -> dict[tuple[str, int, int], list[_Registered]]:
        groups: dict[tuple[str, int, int], list[_Registered]] = collections.defaultdict(list)
        for reg in _REGISTRY.values():
            groups[(reg.chain, reg.world_size, reg.phase)].append(reg)
        for regs in groups.values():
            regs.sort(key=lambda r: (r.last, r.order))
        return groups

    def _run(self, gid: tuple[str, int, int], regs: list[_Registered]) -> None:
        if gid in self.results:
            return
        chain, ws, phase = gid
        res = run_group(
            ws,
            [r.key for r in regs],
            self.base / f"{chain}_w{ws}_phase{phase}",
            shared=self.shared,
        )
        self.results[gid] = res
        sys.stderr.write(
            f"\n[dist_harness] {chain} world_size={ws} phase={phase}: {res.secs:.1f}s "
            f"(imports + init {res.ready_secs:.1f}s)\n{res.summary()}\n"
        )

    def check(self, key: str) -> None:
        reg = _REGISTRY[key]
        groups = self._groups()
        for gid in sorted(groups, key=lambda g: (g[2], g[1])):
            if gid[0] == reg.chain and gid[2] < reg.phase:
                self._run(gid, groups[gid])
        gid = (reg.chain, reg.world_size, reg.phase)
        self._run(gid, groups[gid])
        self.results[gid].check(key)
