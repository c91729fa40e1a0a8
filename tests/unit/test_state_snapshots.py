"""Snapshots of a service's folded state (services/shell/snapshots.py): over a real recorded drill, every built-in
core restarted from a snapshot taken anywhere ends in the state a fold from the first event gives and decides the
same outputs after it; a torn or corrupt snapshot, or one of other code, is passed over, never half-used."""

import hashlib
import pickle
from typing import Any

import msgspec
import pytest

from flightdeck.events import subjects
from flightdeck.events.store import MemoryStore
from flightdeck.services import registry
from flightdeck.services.core import Service
from flightdeck.services.shell import snapshots
from flightdeck.services.shell.fold import Folder, Output, rebuild, replay
from tests.e2e.test_drill_fixture import loaded

CORES = ("scheduler", "resources", "checkpoints", "health", "resharder", "archiver")


async def fold_all(service: Service[Any], store: MemoryStore) -> tuple[Folder[Any], list[Output]]:
    folder: Folder[Any] = Folder(service)
    outs = [o async for step in replay(service, store, folder=folder) for o in step.outputs]
    return folder, outs


@pytest.mark.parametrize("name", CORES)
async def test_a_core_restarted_from_a_snapshot_anywhere_folds_to_the_refolds_state_and_decisions(name: str) -> None:
    store, _ = await loaded()
    service = registry.build(name, env={})
    whole, outputs = await fold_all(service, store)
    assert whole.control_seq > 0
    positions = sorted({s.seq for s in store.rows(subjects.CONTROL)})
    for cut in positions[:: max(1, len(positions) // 7)]:
        part: Folder[Any] = Folder(service)
        before = [o async for step in replay(service, store, until=cut, folder=part) for o in step.outputs]
        taken = snapshots.take(part, generation=0, now=0.0)
        await snapshots.write(store, taken)
        back = await snapshots.load(store, service)
        assert back is not None and back.head.control_seq == part.control_seq
        assert snapshots.digest(back.folder.state) == snapshots.digest(part.state)
        after = [o async for step in replay(service, store, folder=back.folder) for o in step.outputs]
        assert snapshots.digest(back.folder.state) == snapshots.digest(whole.state), (name, cut)
        assert back.folder.telemetry_seq == whole.telemetry_seq
        assert back.folder.admission.versions == whole.admission.versions
        assert [o.msg_id for o in before + after] == [o.msg_id for o in outputs], (name, cut)


async def test_a_write_torn_before_its_head_leaves_the_previous_snapshot_standing() -> None:
    store, _ = await loaded()
    service = registry.build("scheduler", env={})
    first = await rebuild(service, store, until=40)
    await snapshots.write(store, snapshots.take(first, generation=0, now=0.0))
    later = await rebuild(service, store, until=120)
    torn = snapshots.take(later, generation=1, now=1.0)
    for i, part in enumerate(torn.parts):  # the parts of generation 1, then the process dies: no head
        await store.append_bytes(snapshots.part_subject("scheduler", 1, i), part[: len(part) // 2])
    back = await snapshots.load(store, service)
    assert back is not None and back.head.generation == 0 and back.head.control_seq == first.control_seq
    assert snapshots.digest(back.folder.state) == snapshots.digest(first.state)


async def test_a_corrupt_part_or_a_snapshot_of_other_code_is_passed_over_for_a_refold() -> None:
    store, _ = await loaded()
    service = registry.build("health", env={})
    folder = await rebuild(service, store, until=80)
    taken = snapshots.take(folder, generation=0, now=0.0)
    await snapshots.write(store, taken)
    assert await snapshots.load(store, service) is not None
    await store.append_bytes(snapshots.part_subject("health", 0, 0), b"x" + taken.parts[0][1:])
    assert await snapshots.load(store, service) is None  # its sha256 no longer matches the head

    other = msgspec.structs.replace(taken.head, generation=1, fingerprint="0" * 64)
    blob = pickle.dumps(folder.state)
    await store.append_bytes(snapshots.part_subject("health", 1, 0), blob)
    await store.append_bytes(snapshots.head_subject("health"),
                             msgspec.msgpack.encode(msgspec.structs.replace(
                                 other, parts=[hashlib.sha256(blob).hexdigest()])))
    assert await snapshots.load(store, service) is None  # folded by other code (or another initial state)
    await store.append_bytes(snapshots.head_subject("health"), b"\xc1 not a head")
    assert await snapshots.load(store, service) is None


def test_the_fingerprint_follows_the_initial_state_and_the_digest_is_canonical() -> None:
    a, b = registry.build("resources", env={}), registry.build("resources", env={})
    assert snapshots.fingerprint(a) == snapshots.fingerprint(b)
    other = registry.build("resources", env={"FLIGHTDECK_MASTER_PORT_BASE": "31000"})  # another initial state
    assert snapshots.fingerprint(other) != snapshots.fingerprint(a)
    assert snapshots.fingerprint(registry.build("health", env={})) != snapshots.fingerprint(a)
    assert snapshots.digest({"x": {1, 2}, "y": float("nan")}) == snapshots.digest({"y": float("nan"), "x": {2, 1}})
    assert snapshots.digest([1, 2]) != snapshots.digest([2, 1])
