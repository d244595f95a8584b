"""The one home of tiercheck's default places and node-root layout matches what is written."""

from __future__ import annotations

import contextlib
import io
import json
import os
import socket
import tempfile
from pathlib import Path

import pytest
import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st

from tiercheck import SyncCheckpointer, defaults
from tiercheck.defaults import NodeRoot, default_persistent_url, persistent_job_url
from tiercheck.errors import ConfigError


def test_a_checkpointer_writes_where_the_layout_says(tmp_path: Path) -> None:
    root = tmp_path / "shm" / "job" / "node0"
    durable = (tmp_path / "durable").as_uri() + "/"
    with SyncCheckpointer("job", local_root=root, persistent=durable, persist="all") as ckpt:
        ckpt.save(0, {"w": torch.ones(3)})
        ckpt.wait()
        layout = NodeRoot(ckpt.node_root)
        assert layout.lock(0).is_file()  # held while open
        assert ckpt.persistent_job_url == (tmp_path / "durable" / "job").as_uri()
    assert layout.looks_like_one()
    assert sorted(p.name for p in layout.blobs.rglob("*") if p.is_file()) == ["r00000.full"]
    assert layout.identity.is_file()
    assert NodeRoot.lock_rank(layout.lock(0).name) == 0
    job_folder = Path(ckpt.persistent_job_url.removeprefix("file://"))
    assert (job_folder / "v000000000000" / "r00000.packed").is_file()


def test_the_default_places(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    assert default_persistent_url() == (tmp_path / defaults.DEFAULT_PERSISTENT_DIR).as_uri()
    ckpt = SyncCheckpointer("run-1", node="n0")
    assert ckpt.persistent_job_url == (tmp_path / "tiercheck-checkpoints" / "run-1").as_uri()
    assert ckpt.node_root == defaults.memory_base() / "run-1" / "n0"
    if os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK):
        assert defaults.memory_base() == Path("/dev/shm/tiercheck")
    assert defaults.default_root("j").name == socket.gethostname()
    assert persistent_job_url("s3://b/ckpt/", "j") == "s3://b/ckpt/j"


@pytest.mark.parametrize("bad", ["", "a/b", "..", "x:y"])
def test_a_node_root_needs_folder_names(bad: str) -> None:
    with pytest.raises(ConfigError):
        defaults.default_root(bad, "n")
    with pytest.raises(ConfigError):
        defaults.default_root("j", bad)


def test_replica_keys_name_job_and_rank() -> None:
    assert NodeRoot.parse_replica_key("run-1/r00003/v000000000007/r00003.packed") == (
        "run-1",
        3,
        "v000000000007/r00003.packed",
    )
    assert NodeRoot.parse_replica_key("run-1/v000000000007/r00003.packed") is None
    assert NodeRoot.lock_rank("notes.txt") is None


# --- the job id grammar: one folder name, one URL path segment ------------------------------

# Ids that would name another folder, bucket or protocol, or that a listing would not show:
# fsspec URL chaining, queries, fragments, escapes, separators, parents, whitespace, other
# scripts, nothing, too much.
BAD_IDS = [
    "victim::x",
    "a?b",
    "a#b",
    "a%2Fb",
    "a/b",
    "a\\b",
    "..\\escape",
    "..",
    ".",
    ".hidden",
    "-rf",
    " ",
    "a b",
    "tab\t",
    "line\n",
    "ünï",
    "\u0663",  # an Arabic-Indic digit: a digit to str.isdigit, not to the grammar
    "",
    "x" * (defaults.MAX_NAME_LENGTH + 1),
    "s3://bucket",
    "file:",
]
GOOD_IDS = ["run-1", "_x", "a..b", "A.-_9", "x" * defaults.MAX_NAME_LENGTH]


@pytest.mark.parametrize("bad", [*BAD_IDS, 3, None, b"run-1"], ids=repr)
def test_every_way_in_refuses_an_id_outside_the_grammar(bad: object, tmp_path: Path) -> None:
    """The checkpointer (before anything is opened), the node root, the job's URL, the local
    tier: the same ConfigError, stating the grammar and giving an example."""
    from tiercheck.tiers.local import LocalTier

    url = (tmp_path / "durable").as_uri()
    attempts = [
        lambda: SyncCheckpointer(bad, persistent=url, local_root=tmp_path / "shm"),  # type: ignore[arg-type]
        lambda: SyncCheckpointer(bad, persistent=url),  # type: ignore[arg-type]
        lambda: defaults.default_root(bad, "n"),  # type: ignore[arg-type]
        lambda: persistent_job_url(url, bad),  # type: ignore[arg-type]
        lambda: LocalTier(job_id=bad),  # type: ignore[arg-type]
    ]
    if bad is not None:  # node=None is the default name
        attempts.append(lambda: defaults.default_root("j", bad))  # type: ignore[arg-type]
        attempts.append(lambda: SyncCheckpointer("j", node=bad, persistent=url))  # type: ignore[arg-type]
    for attempt in attempts:
        with pytest.raises(ConfigError) as info:
            attempt()
        assert defaults.NAME_GRAMMAR in str(info.value)
        assert "for example" in str(info.value)
    assert not (tmp_path / "shm").exists()
    assert not (tmp_path / "durable").exists()


@pytest.mark.parametrize("good", GOOD_IDS)
def test_an_id_in_the_grammar_is_one_segment_everywhere(good: str, tmp_path: Path) -> None:
    url = (tmp_path / "durable").as_uri()
    assert defaults.check_job_id(good) == good
    assert persistent_job_url(url + "/", good) == f"{url}/{good}"
    root = defaults.default_root(good, "n0")
    assert (root.parent.name, root.parent.parent) == (good, defaults.memory_base())
    ckpt = SyncCheckpointer(good, persistent=url, node="n0")
    assert ckpt.node_root == root


def _folder(url: str) -> tuple[type, str]:
    import fsspec

    fs, path = fsspec.core.url_to_fs(url)
    return type(fs), path


@given(
    job_id=st.one_of(
        st.text(max_size=140),
        st.sampled_from(BAD_IDS),
        st.from_regex(r"[A-Za-z0-9_][A-Za-z0-9._-]{0,127}", fullmatch=True),
    ),
    root=st.sampled_from(["file:///tmp/tiercheck-grammar/root", "memory://tiercheck/root/"]),
)
def test_any_text_is_refused_or_exactly_one_path_segment_of_the_url(job_id: str, root: str) -> None:
    """Whatever the text: a ConfigError, or the job's folder is ``<url>/<id>`` -- the same
    filesystem, one segment below the root, named exactly ``id``."""
    try:
        url = persistent_job_url(root, job_id)
    except ConfigError:
        return
    assert url == root.rstrip("/") + "/" + job_id
    fs_type, path = _folder(url)
    root_type, root_path = _folder(root)
    assert fs_type is root_type
    assert path == root_path.rstrip("/") + "/" + job_id
    assert Path(path).name == job_id
    assert Path(path).parent == Path(root_path)


@settings(max_examples=6)
@given(job_id=st.from_regex(r"[A-Za-z0-9_][A-Za-z0-9._-]{0,127}", fullmatch=True))
@example(job_id="x" * defaults.MAX_NAME_LENGTH)
@example(job_id="_.-")
def test_an_accepted_id_saves_restores_and_is_listed(job_id: str) -> None:
    """A real save under any accepted id; ``tiercheck ls`` lists exactly that job."""
    from tiercheck.cli import main

    with tempfile.TemporaryDirectory() as tmp:
        durable = (Path(tmp) / "durable").as_uri()
        state = {"w": torch.arange(6.0)}
        with SyncCheckpointer(
            job_id, persistent=durable, local_root=Path(tmp) / "shm", base_every=1
        ) as ckpt:
            ckpt.save(0, state)
            assert ckpt.wait()["persistent"] == 0
            assert Path(ckpt.persistent_job_url.removeprefix("file://")).parent == Path(
                tmp, "durable"
            )
        out = io.StringIO()
        with contextlib.redirect_stdout(out):
            assert main(["ls", durable, "--json"]) == 0
        listed = json.loads(out.getvalue())["locations"]
        assert [(loc["tier"], loc["job"]) for loc in listed] == [("persistent", job_id)]
        with SyncCheckpointer(job_id, persistent=durable, local_root=Path(tmp) / "other") as again:
            restored = again.restore()
        assert restored is not None
        assert torch.equal(restored.state["w"], state["w"])


# --- the encodings -------------------------------------------------------------------------


def test_every_encoding_has_its_encoder_header_byte_and_read_order() -> None:
    from tiercheck.codec.encode.encoder import ENCODERS
    from tiercheck.codec.format.blobformat import KINDS

    kinds = defaults.ENCODING_KINDS
    assert tuple(kinds) == defaults.ENCODINGS
    assert len(kinds) >= 2
    assert all(kinds[name].name == name for name in kinds)
    assert set(ENCODERS) == set(kinds)
    assert {k.header_byte: k.name for k in kinds.values()} == KINDS
    assert len(KINDS) == len(kinds)  # one byte each
    assert len({k.read_order for k in kinds.values()}) == len(kinds)  # a restore never ties


@pytest.mark.parametrize("name", defaults.ENCODINGS)
def test_each_encoding_round_trips_through_its_encoder_key_and_header(name: str) -> None:
    from tiercheck.codec import encode, read_meta, snapshot
    from tiercheck.codec.decode.decoder import decode
    from tiercheck.consistency.keys import blob_key, parse_blob_key

    state = {"w": torch.arange(1000, dtype=torch.float32), "step": 3}
    raw = snapshot(state, version=7)
    parts, meta = encode(raw, name, rank=2)
    blob = b"".join(memoryview(p).cast("B").tobytes() for p in parts)
    assert meta.kind == name
    assert read_meta(blob).kind == name
    assert meta.encoding is defaults.encoding_kind(name)
    assert decode(blob).raw_digest == raw.raw_digest
    parsed = parse_blob_key(blob_key(7, 2, meta.kind))
    assert parsed is not None
    assert parsed.kind == name


def test_a_name_that_is_no_encoding_is_refused_with_the_choices() -> None:
    with pytest.raises(ValueError, match=r"'zip' is not an encoding: expected one of full, packed"):
        defaults.encoding_kind("zip")


def test_no_module_branches_on_an_encoding_name() -> None:
    """What differs between encodings is asked of :class:`~tiercheck.defaults.EncodingKind`,
    never decided by comparing a name: a new encoding is then one entry, its encoder and its
    decoder, not a hunt through every module that once wrote ``== "full"``."""
    import ast

    root = Path(defaults.__file__).parent
    names = set(defaults.ENCODINGS)
    found = []
    for path in sorted(root.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if not isinstance(node, ast.Compare):
                continue
            for side in (node.left, *node.comparators):
                elements = side.elts if isinstance(side, (ast.Tuple, ast.List, ast.Set)) else [side]
                if any(isinstance(e, ast.Constant) and e.value in names for e in elements):
                    found.append(f"{path.relative_to(root)}:{node.lineno}: {ast.unparse(node)}")
    assert found == []
