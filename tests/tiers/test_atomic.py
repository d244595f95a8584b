"""The atomic-write helpers shared by the filesystem-backed tiers."""

from __future__ import annotations

import os
import shutil
import stat
from pathlib import Path

import pytest

from tiercheck.tiers import atomic


def test_temp_names_are_hidden_unique_and_attributable() -> None:
    """Temporary names start with '.', hold the reserved '#', and name this host and pid."""
    first, second = atomic.temp_name(), atomic.temp_name()
    assert first != second
    assert first.startswith(".")
    assert atomic.is_internal_name(first)
    parsed = atomic.parse_temp_name(first)
    assert parsed is not None
    assert parsed[1] == os.getpid()
    assert not atomic.owned_by_dead_process(first)
    assert atomic.parse_temp_name("blob") is None
    assert atomic.parse_temp_name(".tiercheck#tmp#host#notapid#x") is None
    assert not atomic.owned_by_dead_process("blob")


def test_write_all_continues_short_writes(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Parts are written whole even when the kernel accepts only a few bytes per call."""
    real_write = os.write

    def stingy(fd: int, data: memoryview) -> int:
        return real_write(fd, data[:7])

    monkeypatch.setattr(os, "write", stingy)
    parts = [memoryview(b"0123456789abcdef"), memoryview(b""), memoryview(bytes(range(100)))]
    fd = os.open(tmp_path / "f", os.O_WRONLY | os.O_CREAT, 0o600)
    try:
        assert atomic.write_all(fd, parts) == 116
    finally:
        os.close(fd)
    assert (tmp_path / "f").read_bytes() == b"0123456789abcdef" + bytes(range(100))


def test_write_all_refuses_to_spin(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A write that makes no progress raises OSError instead of looping forever."""
    monkeypatch.setattr(os, "write", lambda fd, data: 0)
    fd = os.open(tmp_path / "f", os.O_WRONLY | os.O_CREAT, 0o600)
    try:
        with pytest.raises(OSError):  # noqa: PT011 -- the type is the contract
            atomic.write_all(fd, [memoryview(b"x")])
    finally:
        os.close(fd)


def test_atomic_write_replaces_and_cleans_up(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """atomic_write replaces the target; when writing fails the target and folder are as before."""
    target = tmp_path / "sub" / "blob"
    assert atomic.atomic_write(str(target), [memoryview(b"one")], file_mode=0o600) == 3
    assert target.read_bytes() == b"one"

    def fail(fd: int, parts: object) -> int:
        raise OSError("disk on fire")

    monkeypatch.setattr(atomic, "write_all", fail)
    with pytest.raises(OSError):  # noqa: PT011 -- the type is the contract
        atomic.atomic_write(str(target), [memoryview(b"two")])
    assert target.read_bytes() == b"one"
    assert os.listdir(target.parent) == ["blob"]


def test_make_dirs_sets_the_mode_of_created_folders_only(tmp_path: Path) -> None:
    """Folders created get exactly the mode asked for; existing ones are left alone."""
    tmp_path.chmod(0o755)
    previous = os.umask(0o777)
    try:
        atomic.make_dirs(str(tmp_path / "a" / "b" / "c"), 0o700)
    finally:
        os.umask(previous)
    assert stat.S_IMODE(tmp_path.stat().st_mode) == 0o755
    for folder in (tmp_path / "a", tmp_path / "a" / "b", tmp_path / "a" / "b" / "c"):
        assert stat.S_IMODE(folder.stat().st_mode) == 0o700
    (tmp_path / "file").write_bytes(b"")
    with pytest.raises(NotADirectoryError):
        atomic.make_dirs(str(tmp_path / "file" / "x"), 0o700)


def test_create_temp_recreates_a_folder_pruned_under_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """If a concurrent prune removes the folder between mkdir and open, the folder comes back."""
    folder = tmp_path / "v1"
    real_make_dirs = atomic.make_dirs
    pruned = []

    def make_then_prune(path: str, mode: int | None = None) -> None:
        real_make_dirs(path, mode)
        if not pruned:
            pruned.append(path)
            shutil.rmtree(path)

    monkeypatch.setattr(atomic, "make_dirs", make_then_prune)
    fd, path = atomic.create_temp(str(folder), file_mode=0o600, dir_mode=0o700)
    os.close(fd)
    assert pruned == [str(folder)]
    assert Path(path).parent == folder
    assert stat.S_IMODE(Path(path).stat().st_mode) == 0o600


def test_prune_stops_at_non_empty_folders_and_the_root(tmp_path: Path) -> None:
    """Pruning removes empty folders upwards, stopping at a non-empty one or at the root."""
    (tmp_path / "a" / "b" / "c").mkdir(parents=True)
    (tmp_path / "a" / "keep").write_bytes(b"")
    atomic.prune_empty_dirs(str(tmp_path / "a" / "b" / "c"), str(tmp_path))
    assert sorted(p.name for p in (tmp_path / "a").iterdir()) == ["keep"]
    (tmp_path / "a" / "keep").unlink()
    atomic.prune_empty_dirs(str(tmp_path / "a"), str(tmp_path))
    assert tmp_path.is_dir()
    assert list(tmp_path.iterdir()) == []
    atomic.prune_empty_dirs(str(tmp_path / "gone" / "already"), str(tmp_path))


def test_as_byte_view_flattens_without_copying() -> None:
    """Multi-byte and multi-dimensional buffers become flat byte views of the same memory."""
    data = bytearray(range(16))
    wide = memoryview(data).cast("I")
    flat = atomic.as_byte_view(wide)
    assert flat.nbytes == 16
    assert flat.format == "B"
    data[0] = 99
    assert flat[0] == 99
    square = memoryview(data).cast("B", (4, 4))
    assert atomic.as_byte_view(square).tobytes() == bytes(data)
    with pytest.raises(TypeError):
        atomic.as_byte_view(memoryview(data)[::2])
    with pytest.raises(TypeError):
        atomic.as_byte_view(3)


def test_temp_names_record_the_writer_its_start_and_a_tag() -> None:
    """A name says who wrote it well enough to survive pid reuse and pid namespaces; names of
    earlier releases (host and pid only) are still read."""
    name = atomic.temp_name("sess-1")
    owner = atomic.parse_temp_owner(name)
    assert owner is not None
    me = atomic.current_owner()
    assert (owner.host, owner.pid, owner.start, owner.kernel, owner.tag) == (
        me.host,
        os.getpid(),
        atomic.process_start(os.getpid()),
        me.kernel,
        "sess-1",
    )
    assert atomic.process_verdict(owner)[0] == "live"
    assert atomic.parse_temp_owner(atomic.temp_name()).tag is None  # type: ignore[union-attr]
    assert atomic.parse_temp_owner(".tiercheck#tmp#h#123#abcdef") == atomic.TempOwner("h", 123)
    for bad in (".tiercheck#tmp#h#1-2-zz#t", ".tiercheck#tmp#h#1#t#bad tag", ".tiercheck#tmp##1#t"):
        assert atomic.parse_temp_owner(bad) is None
    with pytest.raises(ValueError, match="tag"):
        atomic.temp_name("not a tag")


def test_a_reused_pid_does_not_keep_a_dead_writers_file_alive() -> None:
    """Same host and kernel, the pid runs, but it started at another time: another process."""
    me = atomic.current_owner()
    assert me.start
    reused = atomic.TempOwner(me.host, me.pid, me.start + 1, me.kernel)
    assert atomic.process_verdict(reused)[0] == "dead"
    elsewhere = atomic.TempOwner(me.host, me.pid, me.start, "ffffffff")
    assert atomic.process_verdict(elsewhere)[0] == "unknown"  # another pid namespace or boot
    assert atomic.process_verdict(atomic.TempOwner("other-host", me.pid))[0] == "unknown"
    assert not atomic.owned_by_dead_process(atomic.temp_name())


def test_find_temps_lists_temporary_files_at_any_depth(tmp_path: Path) -> None:
    (tmp_path / "v1" / ".tiercheck#spares").mkdir(parents=True)
    names = [
        tmp_path / "v1" / atomic.temp_name(),
        tmp_path / "v1" / ".tiercheck#spares" / atomic.temp_name(),
        tmp_path / atomic.temp_name("t"),
    ]
    for path in names:
        path.write_bytes(b"abc")
    (tmp_path / "v1" / "r00000.full").write_bytes(b"blob")
    found = atomic.find_temps(str(tmp_path))
    assert sorted(t.path for t in found) == sorted(str(p) for p in names)
    assert all(t.size == 3 for t in found)
    assert atomic.find_temps(str(tmp_path / "missing")) == []
