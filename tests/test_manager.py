"""dcp.CheckpointManager: policies and per-rank rules without processes; on
2 real gloo ranks, each on a path, ``shm://`` and ``s3://`` (moto) inside
one spawned group: a job killed with SIGKILL during an async save (separate
processes: tests/manager_job.py) and resumed, retention, preemption and a
change of the data-parallel degree."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
import uuid
import warnings
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

import dcp
import manager_job
import s3_server
from dcp.core.storage import open_storage
from dcp.manager.policies import StepInfo, to_delete
from dcp.manager.steps import POINTER, NamePointer, complete_steps, newest_step, prune_steps
from dist_harness import dist_scenario

HERE = Path(__file__).resolve().parent


# ----------------------------------------------------------- no processes
def test_policies_compose_any_of():
    steps = [StepInfo(s, {"loss": loss}) for s, loss in
             [(10, 5.0), (20, 1.0), (30, 3.0), (40, 2.0), (50, 4.0)]]
    assert dcp.LatestN(2).keep(steps) == {40, 50}
    assert dcp.LatestN(0).keep(steps) == {10, 20, 30, 40, 50}
    assert dcp.EveryNSteps(20).keep(steps) == {20, 40}
    assert dcp.BestN("loss", 2).keep(steps) == {20, 40}
    assert dcp.BestN("loss", 1, mode="max").keep(steps) == {10}
    policy = dcp.AnyOf(dcp.LatestN(1), dcp.BestN("loss", 1), dcp.EveryNSteps(30))
    assert to_delete(policy, steps) == [10, 40]
    # never the newest, never the one in flight, whatever the policy says
    assert to_delete(dcp.BestN("loss", 1), steps, in_flight=30) == [10, 40]
    decide = dcp.AnyOf(dcp.FixedInterval(5), dcp.SpecificSteps([7]), dcp.Forced())
    from dcp.manager.policies import SaveContext
    assert [s for s in range(1, 12) if decide.should_save(SaveContext(s))] == [5, 7, 10]
    assert decide.should_save(SaveContext(3, forced=True))
    assert dcp.OnPreemption().should_save(SaveContext(3, preempted=True))
    with pytest.raises(dcp.CheckpointError, match="interval"):
        dcp.FixedInterval(0)


def test_resize_rules_and_per_rank_encoding():
    from dcp.manager import per_rank
    states = [{"pos": 7, "epoch": 1}, {"pos": 4, "epoch": 1}, {"pos": 5, "epoch": 1}]
    split = [dcp.SumOf("pos")(states, r, 2) for r in range(2)]
    assert split == [{"pos": 8, "epoch": 1}, {"pos": 8, "epoch": 1}]
    assert sum(s["pos"] for s in [dcp.SumOf("pos")(states, r, 5) for r in range(5)]) == 16
    assert dcp.FromFirstRank()(states, 1, 2) is states[0]
    value = {"t": torch.arange(6, dtype=torch.bfloat16).reshape(2, 3), "e": torch.empty(0, 2),
             "n": [1, "a", None, 2.5]}
    back = per_rank.decode(json.loads(per_rank.to_blob({"v": per_rank.encode(value)}))["v"])
    assert torch.equal(back["t"], value["t"]) and back["t"].dtype == torch.bfloat16
    assert back["e"].shape == (0, 2) and back["n"] == value["n"]
    with pytest.raises(dcp.CheckpointError, match="set"):
        per_rank.encode({1, 2})


def test_derive_rng_gives_every_generator_its_own_deterministic_stream():
    import base64
    import random

    import numpy as np

    from dcp.manager import rng
    saved = [rng.capture(), rng.capture()]
    derived = dcp.DeriveRNG()(saved, 1, 3)
    assert derived == dcp.DeriveRNG()(saved, 1, 3)  # deterministic
    assert derived != dcp.DeriveRNG()(saved, 0, 3)
    python_words = list(derived["python"][1][:624])
    numpy_words = np.frombuffer(base64.b64decode(derived["numpy"][1]), dtype=np.uint32).tolist()
    assert python_words != numpy_words  # they were the same Mersenne Twister state

    def draws() -> tuple[list[int], list[int], list[int]]:
        rng.restore(derived, "test")
        return ([random.getrandbits(32) for _ in range(4)],
                [int(v) for v in np.random.randint(0, 2**31, 4)],
                torch.randint(0, 2**31, (4,)).tolist())

    first = draws()
    assert draws() == first
    py, nump, tor = first
    assert py != nump and py != tor and nump != tor


def test_a_step_not_newer_than_the_newest_complete_one_is_refused(tmp_path):
    """The latest is always the highest complete step: a save of a lower
    step, or of a complete step this manager did not save or load, raises;
    re-saving the step just saved is no save."""
    root = tmp_path / "run"
    state = {"w": torch.arange(3.0)}
    with dcp.CheckpointManager(root, async_save=False, keep_latest=0, save_rng=False) as mgr:
        assert mgr.save(3, state, force=True)
        with pytest.raises(dcp.CheckpointError) as e:
            mgr.save(2, state, force=True)
        assert str(e.value) == (f"{str(root)!r}: cannot save step 2: step 3 is already "
                                f"complete or saved there, and a step must be newer than the "
                                f"newest (resume with load_latest, or save under another root)")
        assert mgr.save(3, state, force=True) is False
        assert mgr.steps() == [3] and mgr.latest_step() == 3
    with dcp.CheckpointManager(root, async_save=False, keep_latest=0, save_rng=False) as mgr:
        with pytest.raises(dcp.CheckpointError, match="cannot save step 2: step 3 "):
            mgr.save(2, state, force=True)  # a new job that did not resume
        with pytest.raises(dcp.CheckpointError) as e:
            mgr.save(3, state, force=True)
        assert str(e.value) == (
            f"{str(root)!r}: cannot save step 3: it is complete there already (saved by an "
            f"earlier job, or by its background save after the trainer died), and a complete "
            f"step is never replaced: resume with load_latest, which returns it, and save the "
            f"steps after it (or save under another root)")
        assert mgr.save(4, state, force=True)
        assert mgr.steps() == [3, 4] and mgr.latest_step() == 4
    assert json.loads((root / POINTER).read_text())["step"] == 4


def test_steps_are_non_negative_integers_and_the_state_a_dict(tmp_path):
    import numpy as np
    root = tmp_path / "run"
    model = torch.nn.Linear(2, 2)
    with dcp.CheckpointManager(root, async_save=False, save_rng=False) as mgr:
        for bad in (-1, 2.0, True, "3", None):
            with pytest.raises(dcp.CheckpointError,
                               match=rf"step must be a non-negative integer, not {bad!r} "):
                mgr.save(bad, {"model": model}, force=True)
        assert mgr.save(np.int64(4), {"model": model}, force=True)
        assert mgr.steps() == [4] and mgr.latest_step() == 4
        assert mgr.export(np.int64(4), model).endswith("/export-4")
        with pytest.raises(dcp.CheckpointError, match="non-negative integer, not -2 "):
            mgr.export(-2, model)
        for call in (lambda: mgr.save(5, model, force=True), lambda: mgr.load_latest(model)):
            with pytest.raises(dcp.CheckpointError) as e:
                call()
            assert str(e.value) == (f"{str(root)!r}: the state must be a dict of values and "
                                    f'Statefuls, e.g. {{"model": model, "optim": optim}}, '
                                    f"not a Linear")
        assert mgr.steps() == [4]
    with dcp.CheckpointManager(root, async_save=False, save_rng=False) as mgr:
        fresh = torch.nn.Linear(2, 2)
        assert mgr.load_latest({"model": fresh}) == 4
        assert torch.equal(fresh.weight, model.weight)


def test_a_root_in_a_missing_bucket_fails_before_training():
    root = "s3://hyperdcp-no-such-bucket/run"
    mgr = dcp.CheckpointManager(root, storage_options=s3_server.options(s3_server.endpoint()))
    for call in (lambda: mgr.load_latest({}), lambda: mgr.save(1, {}, force=True)):
        with pytest.raises(dcp.CheckpointError) as e:
            call()
        assert str(e.value) == (f"{root!r}: listing the root failed: FileNotFoundError: The "
                                f"specified bucket does not exist")
    assert mgr.in_flight is None
    mgr.close()


def test_keep_latest_1_with_async_and_coordination_none_are_refused(tmp_path):
    with pytest.raises(dcp.CheckpointError, match="at least 2"):
        dcp.CheckpointManager(tmp_path, keep_latest=1)
    with pytest.raises(dcp.CheckpointError, match="'none'"):
        dcp.CheckpointManager(tmp_path, coordination="none")
    dcp.CheckpointManager(tmp_path, keep_latest=1, async_save=False).close()
    (tmp_path / "file").write_bytes(b"not a folder")
    with pytest.raises(dcp.CheckpointError) as e:
        dcp.CheckpointManager(tmp_path / "file", async_save=False)
    assert str(e.value) == (f"{str(tmp_path / 'file')!r}: the root is a file, not a folder: no "
                            f"step folder can be saved or found under it")
    with pytest.raises(dcp.CheckpointError, match=r"LatestN\) 1 with async saves"):
        dcp.CheckpointManager(tmp_path, preservation=dcp.LatestN(1))
    with pytest.raises(dcp.CheckpointError, match=r"LatestN\) 1 with async saves"):
        dcp.CheckpointManager(tmp_path, preservation=dcp.AnyOf(dcp.BestN("loss", 2),
                                                               dcp.LatestN(1)))
    dcp.CheckpointManager(tmp_path, preservation=dcp.LatestN(1), async_save=False).close()
    for kwargs, message in [
            ({"keep_latest": -1}, "LatestN (keep_latest): n must be an integer of at least 0, "
                                  "not -1"),
            ({"keep_latest": 2.5}, "LatestN (keep_latest): n must be an integer of at least 0, "
                                   "not 2.5"),
            ({"keep_every": 0}, "EveryNSteps (keep_every): n must be an integer of at least 1, "
                                "not 0"),
            ({"keep_every": -3}, "EveryNSteps (keep_every): n must be an integer of at least 1, "
                                 "not -3"),
            ({"preservation": None, "keep_every": True}, "EveryNSteps (keep_every): n must be an "
                                                         "integer of at least 1, not True")]:
        with pytest.raises(dcp.CheckpointError) as e:
            dcp.CheckpointManager(tmp_path, **kwargs)
        assert str(e.value) == message
    with pytest.raises(dcp.CheckpointError, match="BestN: n must be an integer of at least 1"):
        dcp.BestN("loss", 0)


def _adamw(seed: int) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.ReLU(), torch.nn.Linear(3, 2))
    return model, torch.optim.AdamW(model.parameters(), lr=0.01, weight_decay=0.1)


def _same_optim(a: dict, b: dict) -> None:
    assert a["param_groups"] == b["param_groups"]
    assert sorted(a["state"]) == sorted(b["state"]) == [0, 1, 2, 3]
    for i, entry in a["state"].items():
        assert sorted(entry) == sorted(b["state"][i]) == ["exp_avg", "exp_avg_sq", "step"]
        for name, t in entry.items():
            assert torch.equal(t, b["state"][i][name]) and t.dtype == b["state"][i][name].dtype


def test_a_fresh_optimizer_passed_as_a_stateful_resumes(tmp_path):
    """An optimizer passed straight into the state (the README's manager
    example) resumes in a new process: its empty ``state`` is initialised
    (as PyTorch DCP's get_optimizer_state_dict does) before the load plans
    against it; the parameters are untouched by that initialisation."""
    model, optim = _adamw(0)
    for _ in range(3):
        model(torch.randn(5, 4)).square().sum().backward()
        optim.step()
        optim.zero_grad()
    saved = {"model": {k: v.clone() for k, v in model.state_dict().items()},
             "optim": optim.state_dict()}
    mgr = dcp.CheckpointManager(tmp_path / "run", async_save=False, keep_latest=1)
    assert mgr.save(3, {"model": model, "optim": optim}, force=True)
    mgr.close()
    dcp.save({"model": model, "optim": optim}, str(tmp_path / "plain"))
    for how in ("dcp.load", "load_latest"):
        fresh_model, fresh_optim = _adamw(1)
        state = {"model": fresh_model, "optim": fresh_optim}
        if how == "dcp.load":
            dcp.load(state, str(tmp_path / "plain"))
        else:
            with dcp.CheckpointManager(tmp_path / "run", async_save=False) as m:
                assert m.load_latest(state) == 3
        for k, v in fresh_model.state_dict().items():
            assert torch.equal(v, saved["model"][k]), (how, k)
        _same_optim(fresh_optim.state_dict(), saved["optim"])
        assert all(p.grad is None for p in fresh_model.parameters())


def _steps_on_disk(root: Path) -> list[int]:
    return sorted(int(p.name[5:]) for p in root.glob("step-*"))


def test_pointer_listing_fallback_initial_load_and_export(tmp_path):
    """Synchronous saves in one process: the pointer names the newest step;
    a stale or missing pointer falls back to the listing; an incomplete newer
    step is never the latest; initial_load_path (checkpoint or safetensors
    folder) when nothing is complete; the export is model-only and cast."""
    root = tmp_path / "run"
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 3)
    mgr = dcp.CheckpointManager(root, interval=10, keep_latest=2, async_save=False)
    for step in range(1, 31):
        assert mgr.save(step, {"model": model}) == (step % 10 == 0)
    mgr.wait()  # retention runs in the background
    assert mgr.steps() == [20, 30] and _steps_on_disk(root) == [20, 30]
    assert json.loads((root / POINTER).read_text())["step"] == 30
    (root / "step-40").mkdir()  # a save that never committed
    (root / "step-40" / "r00000-0.x.data").write_bytes(b"partial")
    assert mgr.latest_step() == 30
    (root / POINTER).write_text(json.dumps({"step": 30, "save_id": "stale"}))
    assert mgr.latest_step() == 30  # by listing
    (root / POINTER).unlink()
    assert mgr.latest_step() == 30
    assert mgr.save(30, {"model": model}) is False  # already saved
    with torch.no_grad():
        model.weight.fill_(2.5)
    assert mgr.save(31, {"model": model}, force=True)
    mgr.wait()
    # a newer incomplete step (a killed save's leftovers) is left to the save that redoes it
    assert mgr.steps() == [30, 31] and _steps_on_disk(root) == [30, 31, 40]
    mgr.close()

    # export: model only, cast, as a checkpoint and as safetensors
    mgr = dcp.CheckpointManager(root, async_save=False, export_dtype=torch.bfloat16)
    ckpt = mgr.export(31, model)
    md = dcp.read_metadata(ckpt)
    assert set(md.tensors) == {"weight", "bias"} and md.tensors["weight"].dtype == "bfloat16"
    folder = mgr.export(31, model.state_dict(), safetensors=True, path=str(tmp_path / "hf"),
                        dtype=torch.float16)
    assert (Path(folder) / "model.safetensors").exists() or list(Path(folder).glob("*.safetensors"))
    assert not (Path(folder) / ".dcp").exists()  # the staging checkpoint, gone
    # a run that resumed before its last step exports that step again: replaced
    with torch.no_grad():
        model.weight.fill_(3.5)
    assert mgr.export(31, model) == ckpt
    assert torch.equal(dcp.load_keys(ckpt)["weight"], torch.full((3, 4), 3.5, dtype=torch.bfloat16))
    again = mgr.export(31, model.state_dict(), safetensors=True, path=str(tmp_path / "hf"),
                       dtype=torch.float16)
    from safetensors.torch import load_file
    tensors = {k: v for f in Path(again).glob("*.safetensors") for k, v in load_file(f).items()}
    assert torch.equal(tensors["weight"], torch.full((3, 4), 3.5, dtype=torch.float16))
    mgr.close()

    # initial loads into an empty root
    for source in (ckpt, folder):
        fresh = torch.nn.Linear(4, 3)
        m = dcp.CheckpointManager(tmp_path / f"empty-{Path(source).name}", async_save=False,
                                  initial_load_path=source, save_rng=False)
        assert m.load_latest({"model": fresh}) is None
        assert torch.equal(fresh.weight, torch.full((3, 4), 3.5))
        m.close()


def test_prune_steps_keeps_what_it_must(tmp_path):
    root = tmp_path / "run"
    for step in (1, 2, 3, 4):
        dcp.save({"x": torch.ones(2) * step, "_manager": {"metrics": {"loss": 5 - step}}},
                 str(root / f"step-{step}"))
    (root / "step-5").mkdir()
    (root / "step-5" / "r00000-0.a.data").write_bytes(b"in flight")
    deleted = prune_steps(str(root), dcp.AnyOf(dcp.LatestN(1), dcp.BestN("loss", 1, "max")),
                          in_flight=5)
    assert deleted == [2, 3] and _steps_on_disk(root) == [1, 4, 5]


def test_the_pointer_names_each_step_before_its_commit_and_moves_only_forward(tmp_path):
    """NamePointer, the manager's before_commit action: the pointer names a
    step before its metadata is committed, with the newest complete step
    as its previous (what a reader takes while the step is in flight or
    after its commit never came); a save of a step not newer than the
    newest complete one is refused there and commits nothing; a pointer
    that cannot be written fails the save, nothing committed."""
    root = tmp_path / "run"
    with dcp.CheckpointManager(root, async_save=False, keep_latest=0, save_rng=False) as mgr:
        for step in (4, 6):
            assert mgr.save(step, {"x": torch.full((2,), float(step))}, force=True)
    pointer = json.loads((root / POINTER).read_text())
    assert pointer == {"step": 6, "save_id": dcp.read_metadata(str(root / "step-6")).save_id,
                       "previous": 4}
    storage = open_storage(str(root))
    seen = []  # the pointer, and whether step 8 is committed, right after NamePointer ran

    def name_then_look(md) -> None:
        NamePointer(str(root), 8)(md)
        seen.append((json.loads((root / POINTER).read_text()),
                     (root / "step-8" / "metadata.json").exists()))

    md = dcp.save({"x": torch.ones(2)}, str(root / "step-8"), before_commit=name_then_look)
    assert seen == [({"step": 8, "save_id": md.save_id, "previous": 6}, False)]
    (root / "step-8" / "metadata.json").unlink()  # as if the commit never came
    assert newest_step(storage) == 6 and newest_step(storage, exclude=[6]) == 4
    with pytest.raises(dcp.CheckpointError) as e:
        dcp.save({"x": torch.ones(2)}, str(root / "step-5"),
                 before_commit=NamePointer(str(root), 5))
    assert str(e.value).endswith(
        f"step 5: not committed: step 6 under {str(root)!r} is complete already, and a step "
        f"must be newer than the newest (a background save of an earlier job that outlived "
        f"its trainers, or another job saving under the same root)")
    assert list((root / "step-5").glob("*")) == []
    (root / POINTER).unlink()
    (root / POINTER).mkdir()  # the pointer cannot be written
    with pytest.raises(dcp.CheckpointError, match=r"step 9: not committed: writing .*latest\.json "
                       r"failed .*could be missed by load_latest"):
        dcp.save({"x": torch.ones(2)}, str(root / "step-9"),
                 before_commit=NamePointer(str(root), 9))
    assert not (root / "step-9" / "metadata.json").exists() and newest_step(storage) == 6
    with pytest.raises(dcp.CheckpointError, match="before_commit needs a coordinated save"):
        dcp.async_save({"x": torch.ones(2)}, str(root / "step-10"), coordination="none",
                       before_commit=NamePointer(str(root), 10))


def _flip_byte(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[0] ^= 0x40
    path.write_bytes(bytes(data))


def test_a_corrupt_step_is_marked_bad_listed_verified_and_pruned(tmp_path, capsys):
    """A truncated metadata.json in the newest step: load_latest warns
    naming it, marks it bad and resumes the step before; `hyperdcp list`
    and `verify` show the mark, `prune` deletes the step (and an
    interrupted step's folder, emptied); `verify ROOT` names steps in
    numeric order."""
    from dcp.tools.cli import main
    root = tmp_path / "run"
    with dcp.CheckpointManager(root, async_save=False, keep_latest=0, save_rng=False) as mgr:
        for step in (5, 10):
            assert mgr.save(step, {"x": torch.full((3,), float(step))}, force=True)
    assert main(["verify", str(root)]) == 1
    assert "it is a folder of 2 checkpoint(s) (step-5, step-10)" in capsys.readouterr().err
    metadata = root / "step-10" / "metadata.json"
    saved = metadata.read_bytes()
    metadata.write_bytes(saved[:len(saved) // 2])
    target = {"x": torch.zeros(3)}
    with dcp.CheckpointManager(root, async_save=False, save_rng=False) as mgr:
        with pytest.warns(dcp.CheckpointWarning) as caught:
            assert mgr.load_latest(target) == 5
        assert torch.equal(target["x"], torch.full((3,), 5.0))
        assert mgr.steps() == [5] and mgr.latest_step() == 5
    (message,) = [str(w.message) for w in caught]
    assert message.startswith(f"{str(root)!r}: step 10 is corrupt and is passed over ("
                              f"{str(root / 'step-10' / 'metadata.json')}: invalid metadata")
    assert message.endswith("marked bad (" + str(root / "step-10") + "/bad-step.json, its "
                            "metadata kept as metadata.json.bad): it no longer counts as "
                            "complete; load_latest resumes from the newest step that loads")
    assert (root / "step-10" / "metadata.json.bad").read_bytes() == saved[:len(saved) // 2]
    (root / "step-12").mkdir()  # a killed save's leftovers
    (root / "step-12" / "r00000-0.k.data").write_bytes(b"killed")
    assert main(["list", str(root)]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0] == "latest.json: step 10 (not committed: a save in flight, or one that failed " \
                     "or was marked bad), after step 5 (complete)"
    assert out[2].startswith("step-10: bad (marked by load_latest: " + str(metadata)
                             + ": invalid metadata")
    assert out[2].split("): not complete; ")[1].startswith(f"hyperdcp prune {root} deletes it")
    assert main(["list", str(root), "--json"]) == 0
    listed = {e["name"]: e for e in json.loads(capsys.readouterr().out)}
    assert listed["step-10"]["state"] == "bad" and listed["step-5"]["latest"]
    assert main(["verify", str(root / "step-10")]) == 3
    assert capsys.readouterr().out.startswith(f"BAD: {root / 'step-10'} was marked bad by "
                                              f"load_latest: {metadata}: invalid metadata")
    assert main(["prune", str(root)]) == 0  # its data files are young: a save may be redoing it
    assert f"{root}: kept step(s) 10 (marked bad)" in capsys.readouterr().out
    assert (root / "step-10" / "bad-step.json").exists()
    assert main(["prune", str(root), "--min-age", "0"]) == 0
    assert f"{root}: deleted step(s) 10 (marked bad)" in capsys.readouterr().out
    assert _steps_on_disk(root) == [5]  # step-12 emptied and removed too
    with pytest.raises(SystemExit):
        main(["--help"])
    assert "prune     delete what killed saves left, steps marked bad, and old" in \
        capsys.readouterr().out


def test_transient_read_errors_raise_and_mark_nothing(tmp_path):
    """EIO and a 503 from storage while loading the newest step (here the
    manager's per-rank record, a raw blob) say nothing about the checkpoint:
    load_latest raises, naming the file, and marks nothing."""
    root = f"faulty://{tmp_path / 'run'}"
    with dcp.CheckpointManager(root, async_save=False) as mgr:
        assert mgr.save(1, {"count": dcp.PerRank({"seen": 7})}, force=True)
    for fault in ("EIO", "503"):
        options = {"methods": ["read_ranges"], "rate": 1.0, "faults": [fault]}
        with dcp.CheckpointManager(root, async_save=False, storage_options=options) as mgr:
            with pytest.raises(dcp.CheckpointError, match="r00000-objects") as e:
                mgr.load_latest({"count": dcp.PerRank({})})
            assert not isinstance(e.value, dcp.CorruptCheckpointError), e.value
            assert mgr.steps() == [1] and mgr.latest_step() == 1
    assert not (tmp_path / "run" / "step-1" / "bad-step.json").exists()


# ------------------------------- the job SIGKILLed mid-save (separate processes)
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _start(world: int, root: str, out: Path, steps: int, *extra: str,
           port: int | None = None, stderr: Path | None = None) -> list[subprocess.Popen]:
    """The ranks of a tests/manager_job.py job, in one process group (the
    first rank's); ``port``: of a store the caller serves (``--store``);
    ``stderr``: a file taking every process's standard error."""
    port = port or _free_port()
    env = {**os.environ, "GLOO_SOCKET_IFNAME": os.environ.get("GLOO_SOCKET_IFNAME", "lo")}
    env["PYTHONPATH"] = os.pathsep.join([str(HERE.parent), env.get("PYTHONPATH", "")])
    leader = None
    procs = []
    for rank in range(world):
        procs.append(subprocess.Popen(
            [sys.executable, str(HERE / "manager_job.py"), str(rank), str(world), str(port),
             root, str(out), str(steps), *extra], env=env,
            process_group=0 if leader is None else leader.pid,
            stderr=None if stderr is None else stderr.open("a")))
        leader = leader or procs[0]
    return procs


def _wait_job(procs: list[subprocess.Popen], timeout: float = 240) -> list[int]:
    """The exit codes of a job's ranks; the job killed if it outlives ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    try:
        return [proc.wait(timeout=max(deadline - time.monotonic(), 1)) for proc in procs]
    except subprocess.TimeoutExpired:
        os.killpg(procs[0].pid, signal.SIGKILL)
        raise


def _records(out: Path, rank: int) -> list[dict]:
    return [json.loads(line) for line in Path(f"{out}.{rank}").read_text().splitlines()]


# ------------------------------------------- 2 real ranks: path, shm://, s3://
def _shared(value_on_rank0):
    box = [value_on_rank0() if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def _roots(ctx, label: str) -> list[tuple[str, dict | None]]:
    """The same run root on a path, on shm:// and on S3, known to every rank."""
    endpoint = _shared(s3_server.endpoint)
    tag = _shared(lambda: uuid.uuid4().hex[:8])
    return [(str(ctx.dir / label), None),
            (f"shm://hyperdcp-test-{label}-{tag}", None),
            (f"s3://{s3_server.BUCKET}/{label}-{tag}", s3_server.options(endpoint))]


def _drop_shm(root: str) -> None:
    if root.startswith("shm://") and dist.get_rank() == 0:
        import shutil
        shutil.rmtree(f"/dev/shm/hyperdcp/{root[len('shm://'):]}", ignore_errors=True)


def _wait_for(path: Path, timeout: float = 300.0) -> str:
    """The text of ``path`` once another rank has written it."""
    deadline = time.monotonic() + timeout
    while not path.exists():
        assert time.monotonic() < deadline, f"{path} not written within {timeout} s"
        time.sleep(0.05)
    return path.read_text()


@dist_scenario(world_size=2)
def test_manager_sigkill_during_async_save_then_restart_w2(ctx):
    """On a path and S3: a separate 2-rank job (tests/manager_job.py,
    async saves every 2 steps, keep_latest=2; the jobs run at once) is
    killed with SIGKILL, trainers and background savers, right after step
    6's save started, while it is in flight; this group, new processes,
    resumes it: from step 4, the newest complete step (6 never committed),
    and steps 5 and 6 repeat exactly (losses, every generator's draws, each
    rank's loader position) before training goes on to step 8.  (A path and
    S3; shm:// is a path to the save, and the soak kills jobs over it.)"""
    roots = [r for r in _roots(ctx, "kill") if not r[0].startswith("shm://")]
    labels = [root.split("://")[0] if "://" in root else "posix" for root, _ in roots]
    if ctx.rank == 0:  # the jobs to kill, at once; rank 1 waits without a collective meanwhile
        jobs = [_start(2, root, ctx.dir / f"first-{label}", 8, "--kill-at", "6",
                       *(["--options", json.dumps(options)] if options else []))
                for (root, options), label in zip(roots, labels, strict=True)]
        for procs, label in zip(jobs, labels, strict=True):
            codes: object = "the job timed out and was killed"
            with contextlib.suppress(subprocess.TimeoutExpired):
                codes = _wait_job(procs)
            (ctx.dir / f"{label}.codes").write_text(json.dumps(codes))
    for (root, options), label in zip(roots, labels, strict=True):
        out = ctx.dir / f"first-{label}"
        assert json.loads(_wait_for(ctx.dir / f"{label}.codes")) == [-signal.SIGKILL] * 2, label
        first = _records(out, ctx.rank)
        if ctx.rank == 0:
            assert first[-1] == {"killed": 6, "in_flight": True}, (label, first[-1])
        mgr = dcp.CheckpointManager(root, storage_options=options)
        assert mgr.steps() == [2, 4] and mgr.latest_step() == 4, (label, mgr.steps())
        mgr.close()
        ctx.barrier()
        manager_job.run(ctx.rank, 2, root, str(ctx.dir / f"again-{label}"), 8, options=options)
        again = _records(ctx.dir / f"again-{label}", ctx.rank)
        assert again[0]["resumed"] == 4, (label, again[0])
        before = {rec["step"]: rec for rec in first if "step" in rec}
        after = {rec["step"]: rec for rec in again if "step" in rec}
        assert sorted(after) == [5, 6, 7, 8], label
        for step in (5, 6):
            assert after[step] == before[step], (label, step, after[step], before[step])
        assert after[8]["pos"] == 8 * (ctx.rank + 1)
        ctx.barrier()
        _drop_shm(root)


def _gone(pids: list[int], timeout: float = 120.0) -> None:
    """Wait until none of ``pids`` runs (exited, or a zombie nobody reaps)."""
    deadline = time.monotonic() + timeout
    for pid in pids:
        while True:
            try:
                state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
            except (FileNotFoundError, ProcessLookupError):
                break
            if state == "Z":
                break
            assert time.monotonic() < deadline, f"process {pid} still runs after {timeout} s"
            time.sleep(0.05)


def _trainers_killed_after_save_then_resumed(ctx) -> None:
    """A separate job of the group's size (tests/manager_job.py, async
    saves every 2 steps, keep_latest=2, its store served here as torchrun's
    agent serves it): every trainer is SIGKILLed once save(6) has returned
    and its background process writes, and the background processes live
    on and commit step 6, past the trainers' retention: steps 2, 4 and 6
    are left.  Then step 6 is the latest; a save of it by a manager that did
    not resume is refused at the call on every rank; a new job resumes step
    6 exactly (a digest of every tensor, the loader position and every
    generator), and its next commit brings retention back to 2 steps."""
    root, world = str(ctx.dir / "run"), ctx.world_size
    out = ctx.dir / "first"
    if ctx.rank == 0:
        store = dist.TCPStore("127.0.0.1", 0, world, is_master=True, wait_for_workers=False)
        codes: object = "the job timed out and was killed"
        with contextlib.suppress(subprocess.TimeoutExpired):
            codes = _wait_job(_start(world, root, out, 8, "--kill-trainers-at", "6", "--store",
                                     port=store.port, stderr=ctx.dir / "first.stderr"))
        if codes == [-signal.SIGKILL] * world:  # until the background processes committed
            _wait_for(ctx.dir / "run" / "step-6" / "metadata.json", timeout=120)
        (ctx.dir / "codes").write_text(json.dumps(codes))
    codes = json.loads(_wait_for(ctx.dir / "codes"))
    assert codes == [-signal.SIGKILL] * world, codes
    killed = _records(out, ctx.rank)[-1]
    assert killed["killed"] == 6, killed
    mgr = dcp.CheckpointManager(root, interval=2, async_save=False)
    assert mgr.steps() == [2, 4, 6] and mgr.latest_step() == 6, (mgr.steps(), mgr.latest_step())
    with pytest.raises(dcp.CheckpointError) as e:
        mgr.save(6, {"w": torch.zeros(2)}, force=True)
    assert "cannot save step 6: it is complete there already" in str(e.value)
    assert mgr.in_flight is None and not mgr.errors
    mgr.close()
    ctx.barrier()
    manager_job.run(ctx.rank, world, root, str(ctx.dir / "again"), 8, async_save=False)
    again = _records(ctx.dir / "again", ctx.rank)
    assert again[0] == {"resumed": 6, "digest": killed["digest"]}, (again[0], killed)
    assert [rec["step"] for rec in again[1:]] == [7, 8]
    assert _shared(lambda: complete_steps(open_storage(root).list_files())) == [6, 8]
    _gone([killed["worker"]])  # exited once their save was done, quietly
    ctx.barrier()
    if ctx.rank == 0:
        assert "Traceback" not in (ctx.dir / "first.stderr").read_text(), (
            (ctx.dir / "first.stderr").read_text()[-3000:])


@dist_scenario(world_size=2)
def test_manager_trainers_killed_after_save_their_background_commit_resumes_it_w2(ctx):
    _trainers_killed_after_save_then_resumed(ctx)


@dist_scenario(world_size=4)
def test_manager_trainers_killed_after_save_their_background_commit_resumes_it_w4(ctx):
    _trainers_killed_after_save_then_resumed(ctx)


def _shard(value: float | None, rank: int) -> dcp.TensorShard:
    """Rank ``rank``'s half of an 8-element tensor: ``value + rank``, or zeros."""
    data = torch.zeros(4) if value is None else torch.full((4,), value + rank)
    return dcp.TensorShard(data, (8,), (4 * rank,))


@dist_scenario(world_size=2)
def test_manager_passes_over_corrupt_steps_on_every_rank_and_saves_them_afresh_w2(ctx):
    """Steps 1-3 saved, each rank its own shard; rank 1's chunk of step 3
    gets a flipped byte (found by rank 1's CRC check alone) and step 2 a
    truncated metadata.json (found by rank 0 reading it): load_latest warns
    on both ranks naming each, marks both bad and resumes step 1 on both,
    exactly.  Saves of steps 2 and 3 then write them afresh and the marks go."""
    root = str(ctx.dir / "run")
    with dcp.CheckpointManager(root, interval=1, keep_latest=0, async_save=False) as mgr:
        for step in (1, 2, 3):
            assert mgr.save(step, {"w": _shard(10.0 * step, ctx.rank)})
    if ctx.rank == 0:
        (data,) = (ctx.dir / "run" / "step-3").glob("r00001-0.*.data")
        _flip_byte(data)
        metadata = ctx.dir / "run" / "step-2" / "metadata.json"
        metadata.write_bytes(metadata.read_bytes()[:40])
    ctx.barrier()
    mgr = dcp.CheckpointManager(root, interval=1, keep_latest=0, async_save=False)
    target = {"w": _shard(None, ctx.rank)}
    with pytest.warns(dcp.CheckpointWarning) as caught:
        assert mgr.load_latest(target) == 1
    assert torch.equal(target["w"].data, torch.full((4,), 10.0 + ctx.rank))
    messages = [str(w.message) for w in caught]
    assert len(messages) == 2 and "step 3 is corrupt" in messages[0], messages
    assert "'w': checksum mismatch" in messages[0] and "marked bad" in messages[0]
    assert "step 2 is corrupt" in messages[1] and "invalid metadata" in messages[1], messages
    assert mgr.steps() == [1] and mgr.latest_step() == 1
    for step in (2, 3):
        assert mgr.save(step, {"w": _shard(100.0 * step, ctx.rank)})
    mgr.wait()
    assert _shared(mgr.steps) == [1, 2, 3]
    assert _shared(lambda: sorted(p.name for p in (ctx.dir / "run" / "step-3").iterdir()
                                  if "bad" in p.name)) == []
    target = {"w": _shard(None, ctx.rank)}
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert mgr.load_latest(target) == 3
    assert torch.equal(target["w"].data, torch.full((4,), 300.0 + ctx.rank))
    mgr.close()


@dist_scenario(world_size=2)
def test_manager_retention_under_async_saves_and_a_failed_save_w2(ctx):
    """keep_latest=2, keep_every=8, async saves every 2 steps; step 10's
    replicas diverge, so its save fails in the background: retention never
    deletes the newest complete step nor the step in flight, the failure is
    warned about at the next save, the pointer stays on step 8, and step 12
    then commits and prunes."""
    for root, options in _roots(ctx, "retention"):
        mgr = dcp.CheckpointManager(root, interval=2, keep_latest=2, keep_every=8,
                                    storage_options=options, timeout=30)
        w = torch.zeros(64)
        committed: list[int] = []
        for step in range(1, 13):
            w += 1
            state = {"w": w + (ctx.rank if step == 10 else 0), "step": step}
            assert mgr.save(step, state) == (step % 2 == 0)
            if step % 2 == 0:
                on_disk = mgr.steps()  # while `step` is in flight
                if committed:
                    assert committed[-1] in on_disk, (step, committed, on_disk)
                    assert mgr.latest_step() in (committed[-1], step)
                assert set(on_disk) <= {*committed, step}
                if step == 10:
                    with pytest.warns(dcp.CheckpointWarning, match="step 10.*different values"):
                        mgr.wait()
                else:
                    mgr.wait()
                if step != 10:
                    committed.append(step)
                # rank 0 moves the pointer and prunes: its view once it waited
                assert _shared(mgr.latest_step) == committed[-1]
                expected = sorted({*committed[-2:], *(s for s in committed if s % 8 == 0)})
                assert _shared(mgr.steps) == expected, (step, expected)
        assert mgr.steps() == [8, 12] and any("step 10" in str(e) for e in mgr.errors)
        if ctx.rank == 0:
            storage = dcp.core.storage.open_storage(root, **(options or {}))
            assert json.loads(storage.read_file(POINTER))["step"] == 12
        target = {"w": torch.zeros(64), "step": 0}
        assert mgr.load_latest(target) == 12
        assert torch.equal(target["w"], torch.full((64,), 12.0)) and target["step"] == 12
        mgr.close()
        _drop_shm(root)


@dist_scenario(world_size=2)
def test_manager_sigterm_on_one_rank_makes_every_rank_save_the_same_step_w2(ctx):
    """SIGTERM to rank 1 only, between steps 3 and 4: at step 4 (not an
    interval step) every rank saves step 4 synchronously and `preempted` is
    True on both; the last words load back exactly."""
    for root, options in _roots(ctx, "preempt"):
        mgr = dcp.CheckpointManager(root, interval=3, keep_latest=2, storage_options=options,
                                    timeout=30)
        w = torch.zeros(8)
        saved = []
        for step in range(1, 10):
            w += step
            if step == 4 and ctx.rank == 1:
                os.kill(os.getpid(), signal.SIGTERM)
            if mgr.save(step, {"w": w}):
                saved.append(step)
            if mgr.preempted:
                break
        assert saved == [3, 4] and step == 4
        assert _shared(mgr.steps) == [3, 4]
        mgr.close()
        assert signal.getsignal(signal.SIGTERM) is not mgr._on_sigterm
        again = dcp.CheckpointManager(root, storage_options=options)
        target = {"w": torch.zeros(8)}
        assert again.load_latest(target) == 4 and torch.equal(target["w"], torch.full((8,), 10.0))
        assert not again.preempted
        again.close()
        _drop_shm(root)


class _Loader:
    """A Stateful data loader position."""

    def __init__(self, pos: int = -1) -> None:
        self.pos = pos

    def state_dict(self):
        return {"pos": self.pos, "seen": torch.tensor([self.pos, 2 * self.pos])}

    def load_state_dict(self, sd) -> None:
        self.pos = sd["pos"]
        assert torch.equal(sd["seen"], torch.tensor([self.pos, 2 * self.pos]))


@dist_scenario(world_size=2)
def test_manager_per_rank_state_rng_and_data_parallel_degree_change_w2(ctx):
    """Saved under DP2: the same layout resumes each rank's loader and RNG
    streams exactly; under DP1 x TP2 (data_parallel=(0, 1)) a per-rank value
    without a rule raises on every rank naming the key and both degrees, so
    do RNG states without ``rng_on_resize`` (before anything is loaded), and
    declared rules apply: SumOf and FromFirstRank to per-rank values,
    DeriveRNG (the same fresh streams on both ranks and on every resume) and
    FromFirstRank (old rank 0's streams continued) to the RNG states."""
    import random

    import numpy as np
    for root, options in _roots(ctx, "per-rank"):
        random.seed(ctx.rank)
        np.random.seed(ctx.rank)
        torch.manual_seed(ctx.rank)
        mgr = dcp.CheckpointManager(root, interval=1, storage_options=options, timeout=30)
        state = {"w": torch.ones(4), "loader": dcp.PerRank(_Loader(10 * (ctx.rank + 1))),
                 "count": dcp.PerRank({"samples": 3 + ctx.rank, "epoch": 2})}
        assert mgr.save(1, state)
        mgr.wait()
        draws = (torch.rand(5), random.random(), np.random.rand())
        mgr.close()

        loader, count = _Loader(), {}
        mgr = dcp.CheckpointManager(root, storage_options=options)
        assert mgr.load_latest({"w": torch.zeros(4), "loader": dcp.PerRank(loader),
                                "count": dcp.PerRank(count)}) == 1
        assert loader.pos == 10 * (ctx.rank + 1) and count == {"samples": 3 + ctx.rank,
                                                               "epoch": 2}
        again = (torch.rand(5), random.random(), np.random.rand())
        assert torch.equal(draws[0], again[0]) and draws[1:] == again[1:]
        mgr.close()

        mgr = dcp.CheckpointManager(root, storage_options=options, data_parallel=(0, 1))
        with pytest.raises(dcp.CheckpointError) as info:
            mgr.load_latest({"w": torch.zeros(4), "loader": dcp.PerRank(_Loader())})
        message = str(info.value)
        assert "'loader'" in message and "degree 2" in message and "has 1" in message, message
        def ruled() -> dict:
            return {"w": torch.zeros(4), "loader": dcp.PerRank(_Loader(), dcp.FromFirstRank()),
                    "count": dcp.PerRank({}, dcp.SumOf("samples"))}

        target = ruled()  # the RNG states have no rule: raises before loading anything
        with pytest.raises(dcp.CheckpointError, match="2 ranks with data-parallel degree 2; "
                           "this job has 2 ranks and degree 1.*rng_on_resize"):
            mgr.load_latest(target)
        assert torch.equal(target["w"], torch.zeros(4)) and target["loader"].value.pos == -1
        mgr.close()
        old_rank0 = _shared(lambda d=draws: d)
        derived = []
        for rule in (dcp.manager.DeriveRNG(), dcp.manager.DeriveRNG(), dcp.FromFirstRank()):
            mgr = dcp.CheckpointManager(root, storage_options=options, data_parallel=(0, 1),
                                        rng_on_resize=rule)
            target = ruled()
            with warnings.catch_warnings():
                warnings.simplefilter("error")
                assert mgr.load_latest(target) == 1
            assert target["loader"].value.pos == 10
            assert target["count"].value == {"samples": 7, "epoch": 2}
            assert torch.equal(target["w"], torch.ones(4))
            derived.append((torch.rand(5), random.random(), np.random.rand()))
            mgr.close()
        fresh, again, first = derived
        # derived: the same on both ranks (one data-parallel rank), on every resume, and
        # neither old rank's continued stream; FromFirstRank: old rank 0's continued stream
        rank0_fresh = _shared(lambda f=fresh: f)
        assert torch.equal(rank0_fresh[0], fresh[0]) and rank0_fresh[1:] == fresh[1:]
        assert torch.equal(fresh[0], again[0]) and fresh[1:] == again[1:]
        assert not torch.equal(fresh[0], draws[0]) and fresh[1] != draws[1]
        assert fresh[2] != draws[2] and fresh[1] != old_rank0[1]
        assert not torch.equal(fresh[0], old_rank0[0])
        assert torch.equal(first[0], old_rank0[0]) and first[1:] == old_rank0[1:]
        _drop_shm(root)

    # FSDP2: a fresh model's fresh AdamW (empty state) resumes its DTensor states exactly
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor
    mesh = init_device_mesh("cpu", (2,))

    def sharded(seed: int) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
        torch.manual_seed(seed)
        model = fully_shard(torch.nn.Linear(4, 6), mesh=mesh)
        return model, torch.optim.AdamW(model.parameters(), lr=0.01)

    model, optim = sharded(0)
    model(torch.randn(3, 4)).square().sum().backward()
    optim.step()
    with dcp.CheckpointManager(ctx.dir / "fsdp2", async_save=False, save_rng=False) as mgr:
        assert mgr.save(1, {"model": model, "optim": optim}, force=True)
    fresh_model, fresh_optim = sharded(1)
    with dcp.CheckpointManager(ctx.dir / "fsdp2", async_save=False, save_rng=False) as mgr:
        assert mgr.load_latest({"model": fresh_model, "optim": fresh_optim}) == 1
    saved, loaded = optim.state_dict(), fresh_optim.state_dict()
    assert loaded["param_groups"] == saved["param_groups"] and sorted(loaded["state"]) == [0, 1]
    for i, entry in saved["state"].items():
        assert isinstance(entry["exp_avg"], DTensor)
        for name, t in entry.items():
            got = loaded["state"][i][name]
            assert type(got) is type(t) and got.dtype == t.dtype
            if isinstance(t, DTensor):
                assert got.placements == t.placements and torch.equal(got.to_local(), t.to_local())
            else:
                assert torch.equal(got, t)
    for a, b in zip(fresh_model.parameters(), model.parameters(), strict=True):
        assert torch.equal(a.to_local(), b.to_local())


def test_cli_list_shows_steps_and_pointer_and_prune_keeps_latest(tmp_path, capsys):
    from dcp.tools.cli import main
    root = tmp_path / "run"
    mgr = dcp.CheckpointManager(root, interval=1, keep_latest=0, async_save=False,
                                save_rng=False)
    for step in (2, 9, 10):
        mgr.save(step, {"x": torch.full((3,), float(step))})
    mgr.close()
    (root / "step-11").mkdir()
    (root / "step-11" / "r00000-0.z.data").write_bytes(b"killed")
    assert main(["list", str(root)]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0] == "latest.json: step 10 (verified)"
    assert [line.split(":")[0] for line in out[1:5]] == ["step-2", "step-9", "step-10", "step-11"]
    assert "step-11: incomplete" in out[4] and "complete;" in out[1]
    pointer = (root / POINTER).read_bytes()
    (root / POINTER).write_text("garbage")
    assert main(["list", str(root)]) == 0
    assert capsys.readouterr().out.splitlines()[0] == (
        'latest.json: not a pointer (unreadable, or not {"step": N, "save_id": ...}): hyperdcp '
        'and load_latest fall back to listing')
    (root / POINTER).write_bytes(pointer)
    assert main(["list", str(root), "--json"]) == 0
    listed = json.loads(capsys.readouterr().out)
    assert [e["name"] for e in listed if e.get("latest")] == ["step-10"]
    assert main(["prune", str(root), "--keep-latest", "1"]) == 0
    assert "deleted step(s) 2, 9" in capsys.readouterr().out
    assert _steps_on_disk(root) == [10, 11]  # the newer incomplete one may be a save in flight
    with pytest.raises(SystemExit) as info:
        main(["prune", str(root), "--keep-latest", "0"])
    assert info.value.code == 2
