"""Key validation: no key built from any text escapes its prefix or the local store's root."""

import os
import posixpath
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from flightdeck.services.shell.objects.manifest import manifest_key, prefix, shard_key
from flightdeck.services.shell.objects.store import (
    InvalidKey,
    UnsafeLocalPath,
    key,
    local_path,
    split_relative,
    validate_key,
    validate_prefix,
)

# text biased towards the characters that make paths dangerous
tokens = ["a", "b", ".", "..", "/", "\\", "\x00", "\n", "\x7f", "\u202e", "é", " ", "%2e"]
nasty = st.lists(st.sampled_from(tokens), max_size=8).map("".join) | st.text(max_size=12)


@pytest.mark.parametrize(("bad", "why"), [
    ("..", "'..'"), ("a/../b", "'..'"), (".", "'.'"), ("/etc/passwd", "relative"), ("a\\b", "separators"),
    ("a\x00b", "control"), ("a\nb", "control"), ("a\u202eb", "control"), ("", "empty"), ("a//b", "empty"),
    ("a/", "empty"), ("x" * 256, "longer"),
])
def test_bad_keys_are_refused_with_a_reason(bad: str, why: str) -> None:
    with pytest.raises(InvalidKey, match=why):
        validate_key(bad)


def test_good_keys_pass_unchanged() -> None:
    for good in ("checkpoints/llm-1/step000000100-a0/__0_0.distcp", ".metadata", "a/b c/é", "...", "a..b"):
        assert validate_key(good) == good
    assert key("checkpoints", "j", "s", "rank0/x.bin") == "checkpoints/j/s/rank0/x.bin"
    assert manifest_key("j", "c") == "checkpoints/j/c/MANIFEST.json"
    assert shard_key("j", "c", ".metadata") == "checkpoints/j/c/.metadata" and prefix("j", "c") == "checkpoints/j/c/"


def test_prefixes_end_with_a_slash() -> None:
    assert validate_prefix("") == "" and validate_prefix("a/b/") == "a/b/"
    with pytest.raises(InvalidKey, match="must end with '/'"):
        validate_prefix("a/b")
    with pytest.raises(InvalidKey):
        validate_prefix("../")


def test_layout_parts_cannot_smuggle_separators() -> None:
    with pytest.raises(InvalidKey):
        shard_key("j", "c", "../../other-job/c/MANIFEST.json")
    with pytest.raises(InvalidKey):
        prefix("j/../k", "c")


@settings(max_examples=500, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(parts=st.lists(nasty, min_size=1, max_size=4))
def test_no_generated_key_escapes_the_root(parts: list[str], tmp_path: Path) -> None:
    try:
        k = key(*parts)
    except InvalidKey:
        return
    segments = k.split("/")
    assert not k.startswith("/") and "\\" not in k
    assert all(s not in ("", ".", "..") for s in segments)
    assert posixpath.normpath(k) == k
    assert all(ch.isprintable() or ch == " " for ch in k)
    path = local_path(tmp_path, k)
    assert path.resolve().is_relative_to(tmp_path.resolve())
    assert split_relative(k) == segments


def test_symlinks_out_of_the_root_are_refused(tmp_path: Path) -> None:
    root, outside = tmp_path / "root", tmp_path / "outside"
    root.mkdir()
    outside.mkdir()
    os.symlink(outside, root / "evil")
    os.symlink(outside / "f", root / "leaf")
    with pytest.raises(UnsafeLocalPath, match="outside"):
        local_path(root, "evil/x")
    with pytest.raises(UnsafeLocalPath):
        local_path(root, "leaf")
    os.symlink(root / "inner", root / "fine")  # a symlink that stays inside is allowed
    assert local_path(root, "fine/x") == root / "fine" / "x"
