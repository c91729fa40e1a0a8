"""A job's code on its way to the nodes (services/shell/objects/code.py, services/agent/codecache.py): packed the
same way every time (its address is its content), what git would ignore left out, a cap that names what to leave
out, and on the node: fetched once, checked against its address, unpacked only inside its folder, the least
recently used copies evicted but never one a rank runs in."""

import hashlib
import io
import os
import tarfile
from pathlib import Path

import pytest

from flightdeck.events.spec import EntrypointSpec, InvalidSpec, JobSpec, check
from flightdeck.services.agent.codecache import CodeCache
from flightdeck.services.shell.objects import code
from flightdeck.services.shell.objects.local import LocalStore
from flightdeck.services.shell.objects.open import DATA_DIR_ENV, OBJECTS_ENV
from flightdeck.services.tools.codeship import ship, ships
from flightdeck.services.tools.console import upstate
from flightdeck.services.tools.console.submit import store_url


def project(root: Path) -> Path:
    (root / "lib").mkdir(parents=True)
    (root / "train.py").write_text("import lib.helper\n")
    (root / "lib" / "helper.py").write_text("X = 1\n")
    (root / "run.sh").write_text("#!/bin/sh\n")
    (root / "run.sh").chmod(0o755)
    (root / "__pycache__").mkdir()
    (root / "__pycache__" / "train.cpython-311.pyc").write_bytes(b"\0" * 10)
    (root / ".git").mkdir()
    (root / ".git" / "HEAD").write_text("ref\n")
    (root / "data").mkdir()
    (root / "data" / "big.bin").write_bytes(b"\1" * 5000)
    (root / "out.log").write_text("noise\n")
    (root / ".gitignore").write_text("*.log\n")
    return root


def names(packed: code.Packed) -> list[str]:
    with tarfile.open(fileobj=io.BytesIO(packed.data), mode="r:gz") as tar:
        return tar.getnames()


def test_the_same_folder_packs_to_the_same_address_and_git_s_ignores_are_left_out(tmp_path: Path) -> None:
    root = project(tmp_path / "p")
    first = code.pack(root)
    assert first.address == "sha256:" + hashlib.sha256(first.data).hexdigest()
    assert names(first) == [".gitignore", "data", "data/big.bin", "lib", "lib/helper.py", "run.sh", "train.py"]
    os.utime(root / "train.py", (1, 1))  # times are not content
    assert code.pack(root).address == first.address
    (root / "train.py").write_text("import lib.helper  # changed\n")
    assert code.pack(root).address != first.address
    # .flightdeckignore rules over .gitignore when there is one
    (root / ".flightdeckignore").write_text("data/\n")
    packed = code.pack(root)
    assert "data/big.bin" not in names(packed) and "out.log" in names(packed)
    with tarfile.open(fileobj=io.BytesIO(packed.data), mode="r:gz") as tar:
        modes = {m.name: m.mode for m in tar.getmembers()}
        assert (modes["run.sh"], modes["train.py"]) == (0o755, 0o644)
        assert {m.mtime for m in tar.getmembers()} == {0} and {m.uid for m in tar.getmembers()} == {0}


def test_a_folder_over_the_cap_is_refused_naming_its_largest_files(tmp_path: Path) -> None:
    root = project(tmp_path / "p")
    with pytest.raises(code.CodeError) as err:
        code.pack(root, limit=1000)
    said = str(err.value)
    assert "more than the 0 MB cap ($FLIGHTDECK_CODE_MAX_MB)" in said and "data/big.bin (0.0 MB)" in said
    assert ".flightdeckignore" in said and "an absolute entrypoint.cwd ships nothing" in said


def test_a_link_out_of_the_folder_is_refused(tmp_path: Path) -> None:
    root = project(tmp_path / "p")
    (tmp_path / "secret").write_text("x")
    (root / "inside").symlink_to("train.py")
    assert "inside" in names(code.pack(root))
    (root / "outside").symlink_to(tmp_path / "secret")
    with pytest.raises(code.CodeError, match=r"outside links to .*secret, outside the folder shipped"):
        code.pack(root)


def evil(entries: list[tuple[str, bytes]], link: str = "") -> bytes:
    raw = io.BytesIO()
    with tarfile.open(fileobj=raw, mode="w:gz") as tar:
        for name, data in entries:
            info = tarfile.TarInfo(name)
            info.size = len(data)
            if link:
                info.type, info.linkname = tarfile.SYMTYPE, link
            tar.addfile(info, io.BytesIO(data))
    return raw.getvalue()


def address(data: bytes) -> str:
    return "sha256:" + hashlib.sha256(data).hexdigest()


def test_unpack_checks_the_address_and_never_writes_outside_its_folder(tmp_path: Path) -> None:
    good = code.pack(project(tmp_path / "p"))
    with pytest.raises(code.CodeError, match=r"hashes to sha256:.*damaged or replaced"):
        code.unpack(good.data + b"x", good.address, tmp_path / "a", limit=1 << 20)
    assert not (tmp_path / "a").exists()
    for n, data in enumerate([evil([("../escaped.txt", b"x")]), evil([("link", b"")], link="/etc/passwd")]):
        with pytest.raises(code.CodeError,
                           match=r"cannot be unpacked: .*(outside the destination|a link to an absolute path)"):
            code.unpack(data, address(data), tmp_path / f"b{n}", limit=1 << 20)
    assert not (tmp_path / "escaped.txt").exists()
    absolute = evil([("/abs/olute.txt", b"x")])  # its leading '/' is dropped: it lands inside
    code.unpack(absolute, address(absolute), tmp_path / "c0", limit=1 << 20)
    assert (tmp_path / "c0" / "abs" / "olute.txt").read_bytes() == b"x"
    bomb = evil([("a", b"\0" * 5000)])
    with pytest.raises(code.CodeError, match=r"unpacks to 0\.0 MB, more than this node's"):
        code.unpack(bomb, address(bomb), tmp_path / "c", limit=1000)
    code.unpack(good.data, good.address, tmp_path / "d", limit=1 << 20)
    assert (tmp_path / "d" / "lib" / "helper.py").read_text() == "X = 1\n"


def spec(cwd: str = "", shipped: str = "") -> JobSpec:
    return JobSpec(name="j", entrypoint=EntrypointSpec(command=["python", "train.py"], cwd=cwd, code=shipped))


async def test_shipped_once_fetched_once_per_node_and_the_least_recent_copies_evicted(tmp_path: Path) -> None:
    objects = LocalStore(tmp_path / "objects")
    root = project(tmp_path / "p")
    assert ships(spec()) and ships(spec("lib")) and not ships(spec("/srv/code")) and not ships(JobSpec(name="j"))
    shipped = await ship(spec("lib"), root, objects)
    assert shipped.entrypoint is not None and shipped.entrypoint.cwd == "lib"
    assert await objects.list("code/") == [code.key_of(shipped.entrypoint.code)]
    assert await ship(shipped, root, objects) is shipped  # shipped already: nothing again

    cache = CodeCache(root=tmp_path / "node", objects=objects, keep=2)
    where = await cache.folder(shipped)
    digest = shipped.entrypoint.code.removeprefix("sha256:")
    assert where == (tmp_path / "node" / "code" / digest / "lib").resolve() and (where / "helper.py").is_file()
    await objects.delete(code.key_of(shipped.entrypoint.code))
    assert await cache.folder(shipped) == where  # the node's copy: no fetch again
    assert await cache.folder(spec()) is None  # nothing shipped

    missing = "sha256:" + "0" * 64
    with pytest.raises(code.CodeError, match="is not in the object store"):
        await cache.copy(missing)
    # Three more versions with room for two: the oldest goes, unless a rank runs in it.
    versions = []
    for n in range(3):
        (root / "train.py").write_text(f"# version {n}\n")
        versions.append((await ship(spec(), root, objects)).entrypoint)
    assert versions[0] is not None and versions[1] is not None and versions[2] is not None
    await cache.copy(versions[0].code)
    await cache.copy(versions[1].code, in_use={digest})
    await cache.copy(versions[2].code, in_use={digest})
    kept = sorted(p.name for p in (tmp_path / "node" / "code").iterdir())
    assert kept == sorted({digest, versions[1].code[7:], versions[2].code[7:]})


def test_a_shipped_job_s_cwd_stays_inside_its_code() -> None:
    assert check(spec("lib", "sha256:" + "a" * 64)).entrypoint is not None
    for bad in ("/srv", "../up", "lib/../../up"):
        with pytest.raises(InvalidSpec, match="must be a folder inside the shipped code"):
            check(spec(bad, "sha256:" + "a" * 64))


def test_submit_ships_to_the_object_store_of_the_up_serving_its_broker(tmp_path: Path,
                                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """A `submit` run from the user's own folder, not where `flightdeck up` runs: its `.flightdeck/objects` is not
    the platform's, so the store comes from $FLIGHTDECK_OBJECTS, else the up that serves the broker, else an error."""
    monkeypatch.delenv(OBJECTS_ENV, raising=False)
    monkeypatch.delenv(DATA_DIR_ENV, raising=False)
    monkeypatch.setenv(upstate.INDEX_ENV, str(tmp_path / "index"))
    monkeypatch.chdir(tmp_path)
    data = tmp_path / "platform"
    data.mkdir()
    upstate.write_state(data, upstate.UpState(pid=os.getpid(), url="nats://127.0.0.1:4333", data_dir=str(data),
                                              port=4333, broker_pid=None, processes={}, status="ready",
                                              started_at=0.0, objects="s3://bucket/root"))
    assert store_url("nats://localhost:4333") == "s3://bucket/root"
    with pytest.raises(code.CodeError, match=r"where does the platform at nats://elsewhere:4222 keep its objects"):
        store_url("nats://elsewhere:4222")
    monkeypatch.setenv(OBJECTS_ENV, "s3://other")
    assert store_url("nats://localhost:4333") == "s3://other"
