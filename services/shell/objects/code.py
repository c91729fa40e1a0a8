"""A job's code as it travels from `flightdeck submit` to every node: one gzipped tar of the job's folder, stored
in the object store under its own sha256 (`code/<hex>.tar.gz`), so the same folder is stored once and a node can
check what it fetched. Both ends live here: `pack` (the client) and `unpack` (the node agent).

The archive is deterministic (sorted entries, no times, owners or umask in it): packing an unchanged folder again
gives the same address, so a resubmission uploads nothing. What is left out follows git's rules: the folder's
`.flightdeckignore` if it has one, else its `.gitignore`, always with IGNORED_ALWAYS.
"""

import gzip
import hashlib
import io
import os
import re
import stat
import tarfile
from dataclasses import dataclass
from pathlib import Path

import pathspec

PREFIX = "code"
ADDRESS = re.compile(r"sha256:([0-9a-f]{64})\Z")
IGNORE_FILES = (".flightdeckignore", ".gitignore")  # the first one present rules
# Never the job's code: version control, caches, virtual environments, Flightdeck's own data dirs.
IGNORED_ALWAYS = (".git/", "__pycache__/", "*.pyc", ".venv/", ".mypy_cache/", ".pytest_cache/", ".ruff_cache/",
                  ".flightdeck/", ".flightdeck-*/")
MAX_MB_ENV = "FLIGHTDECK_CODE_MAX_MB"
DEFAULT_MAX_MB = 100  # what a job's folder may hold once the ignored is left out


class CodeError(ValueError):
    """A folder that cannot be shipped, or an archive that must not be unpacked; the message says why."""


@dataclass(frozen=True)
class Packed:
    data: bytes  # the gzipped tar
    address: str  # "sha256:<hex>" of `data`
    files: int
    size: int  # the files' bytes before compression

    @property
    def key(self) -> str:
        return key_of(self.address)


def key_of(address: str) -> str:
    """The object-store key of the archive at `address` ("sha256:<hex>")."""
    m = ADDRESS.match(address)
    if m is None:
        raise CodeError(f"{address!r} is not a code address: 'sha256:' and 64 lowercase hex digits")
    return f"{PREFIX}/{m[1]}.tar.gz"


def max_bytes(env: dict[str, str] | None = None) -> int:
    raw = (os.environ if env is None else env).get(MAX_MB_ENV, "")
    try:
        mb = float(raw) if raw else DEFAULT_MAX_MB
    except ValueError:
        raise CodeError(f"${MAX_MB_ENV} must be a number of megabytes, got {raw!r}") from None
    return int(mb * 1e6)


def ignore_rules(folder: Path) -> pathspec.GitIgnoreSpec:
    lines = list(IGNORED_ALWAYS)
    for name in IGNORE_FILES:
        if (folder / name).is_file():
            lines += (folder / name).read_text(errors="replace").splitlines()
            break
    return pathspec.GitIgnoreSpec.from_lines(lines)


def _members(folder: Path, rules: pathspec.GitIgnoreSpec) -> list[tuple[str, Path]]:
    """(archive name, path) of every entry to ship, sorted; ignored folders are not walked."""
    out: list[tuple[str, Path]] = []
    for top, dirs, files in os.walk(folder, followlinks=False):
        here = Path(top)
        rel = here.relative_to(folder).as_posix()
        prefix = "" if rel == "." else rel + "/"
        kept = []
        for d in sorted(dirs):
            name = prefix + d
            if rules.match_file(name + "/"):
                continue
            if (here / d).is_symlink():  # os.walk lists a link to a folder as a folder: ship it as the link
                out.append((name, here / d))
                continue
            kept.append(d)
            out.append((name, here / d))
        dirs[:] = kept
        out += [(prefix + f, here / f) for f in sorted(files) if not rules.match_file(prefix + f)]
    return sorted(out)


def pack(folder: Path, *, limit: int | None = None) -> Packed:
    """The folder as a deterministic archive; CodeError if it holds more than `limit` bytes to ship (naming the
    largest files), or a link that leads out of it."""
    folder = folder.resolve()
    if not folder.is_dir():
        raise CodeError(f"{folder} is not a folder: ship the folder that holds the job's code")
    limit = max_bytes() if limit is None else limit
    members = _members(folder, ignore_rules(folder))
    sizes = [(p.lstat().st_size, name) for name, p in members if stat.S_ISREG(p.lstat().st_mode)]
    total = sum(s for s, _ in sizes)
    if total > limit:
        largest = ", ".join(f"{name} ({s / 1e6:,.1f} MB)" for s, name in sorted(sizes, reverse=True)[:5])
        raise CodeError(
            f"{folder} holds {total / 1e6:,.1f} MB to ship, more than the {limit / 1e6:,.0f} MB cap (${MAX_MB_ENV}). "
            f"The largest: {largest}. Leave data and outputs out in {IGNORE_FILES[0]} (git's pattern rules), or run "
            "code that is already on the nodes: an absolute entrypoint.cwd ships nothing")
    raw = io.BytesIO()
    with tarfile.open(fileobj=raw, mode="w", format=tarfile.PAX_FORMAT) as tar:
        for name, path in members:
            info = _entry(folder, name, path)
            if info.isreg():
                with path.open("rb") as f:
                    tar.addfile(info, f)
            else:
                tar.addfile(info)
    out = io.BytesIO()
    with gzip.GzipFile(fileobj=out, mode="wb", mtime=0, compresslevel=6) as gz:
        gz.write(raw.getvalue())
    data = out.getvalue()
    return Packed(data=data, address="sha256:" + hashlib.sha256(data).hexdigest(), files=len(sizes), size=total)


def _entry(folder: Path, name: str, path: Path) -> tarfile.TarInfo:
    st = path.lstat()
    info = tarfile.TarInfo(name)
    info.mtime, info.uid, info.gid, info.uname, info.gname = 0, 0, 0, "", ""
    if stat.S_ISLNK(st.st_mode):
        target = os.readlink(path)
        if not (path.parent / target).resolve().is_relative_to(folder):
            raise CodeError(f"{name} links to {target}, outside the folder shipped ({folder}): copy what it points "
                            f"at into the folder, or leave the link out in {IGNORE_FILES[0]}")
        info.type, info.linkname, info.mode = tarfile.SYMTYPE, target, 0o777
        return info
    if stat.S_ISDIR(st.st_mode):
        info.type, info.mode = tarfile.DIRTYPE, 0o755
        return info
    if not stat.S_ISREG(st.st_mode):
        raise CodeError(f"{name} is neither a file, a folder nor a link (a socket, a device, a pipe?): leave it out in "
                        f"{IGNORE_FILES[0]}")
    info.size, info.mode = st.st_size, 0o755 if st.st_mode & stat.S_IXUSR else 0o644
    return info


def unpack(data: bytes, address: str, dest: Path, *, limit: int) -> None:
    """Check `data` is the archive at `address` and unpack it into `dest` (which must not exist yet): no entry
    may leave `dest` (tarfile's "data" filter: no absolute paths, '..', links out, devices), nor may the files
    hold more than `limit` bytes in all."""
    m = ADDRESS.match(address)
    if m is None:
        raise CodeError(f"{address!r} is not a code address")
    got = hashlib.sha256(data).hexdigest()
    if got != m[1]:
        raise CodeError(f"the archive fetched for {address} hashes to sha256:{got}: it was damaged or replaced in "
                        "the object store")
    try:
        with tarfile.open(fileobj=io.BytesIO(data), mode="r:gz") as tar:
            members = tar.getmembers()
            total = sum(x.size for x in members if x.isfile())
            if total > limit:
                raise CodeError(f"{address} unpacks to {total / 1e6:,.1f} MB, more than this node's "
                                f"{limit / 1e6:,.0f} MB (${MAX_MB_ENV})")
            dest.mkdir(parents=True)
            tar.extractall(dest, members=members, filter="data")
    except (tarfile.TarError, EOFError, OSError, gzip.BadGzipFile) as exc:
        raise CodeError(f"{address} cannot be unpacked: {exc}") from exc
