"""The examples of the README and of the documentation under ``docs/`` run as written.

Each example marked ``<!-- readme-example: NAME -->`` (in ``README.md`` or ``docs/**/*.md``; a
name is used once across them) is run in a fresh interpreter. Only the places it stores to are
changed (the durable URL and the job name), so that test runs do not share storage with each
other or with a user's own runs.

Every ```` ```python ```` block of those files carries one of three markers on the line above
it, so that no example slips in untested: ``readme-example: NAME`` (run by a test here),
``copy-of: NAME`` (word for word the example ``NAME``, which a test here runs) or
``not-run: WHY`` (not complete on its own, and why). The first tests below check that.
"""

from __future__ import annotations

import ast
import contextlib
import os
import re
import shutil
import signal
import subprocess
import sys
import uuid
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"

#: The marker above a ```python block: what it is, and its name or reason.
_MARKER = re.compile(r"^<!-- (readme-example|copy-of|not-run): (.*?) -->$")
_FENCE = re.compile(r"^(`{3,})(\S*)")


def doc_files() -> list[Path]:
    """The files whose examples are tested: the README and every page under ``docs/``."""
    return [README, *sorted((ROOT / "docs").rglob("*.md"))]


def python_blocks(path: Path) -> list[tuple[int, str | None, str, str]]:
    """Every ```python block of ``path``: its line number (1-based, the fence), the marker kind
    on the line right above it (``None`` when there is none), the marker's name or reason, and
    the code. Fences nested in longer fences are skipped, as Markdown does."""
    lines = path.read_text().splitlines()
    out: list[tuple[int, str | None, str, str]] = []
    i = 0
    while i < len(lines):
        m = _FENCE.match(lines[i])
        if m is None:
            i += 1
            continue
        fence, info = m.group(1), m.group(2)
        end = i + 1
        while end < len(lines) and not (
            lines[end].startswith(fence) and lines[end].strip() == lines[end][: len(fence)]
        ):
            end += 1
        if info == "python":
            above = _MARKER.match(lines[i - 1]) if i > 0 else None
            kind, what = (above.group(1), above.group(2)) if above else (None, "")
            out.append((i + 1, kind, what, "\n".join(lines[i + 1 : end])))
        i = end + 1
    return out


def _marked(kind: str) -> dict[str, list[tuple[Path, str]]]:
    """Blocks marked ``kind``, by name: where each is, and its code."""
    found: dict[str, list[tuple[Path, str]]] = {}
    for path in doc_files():
        for _, k, name, code in python_blocks(path):
            if k == kind:
                found.setdefault(name, []).append((path, code))
    return found


def example(name: str) -> str:
    """The code block that follows the marker ``<!-- readme-example: name -->`` in the README
    or a page under ``docs/``; the name must be used exactly once across them."""
    found = []
    for path in doc_files():
        for m in re.finditer(
            rf"<!-- readme-example: {re.escape(name)} -->\n```python\n(.*?)\n```",
            path.read_text(),
            re.DOTALL,
        ):
            found.append((path, m.group(1)))
    where = [str(path.relative_to(ROOT)) for path, _ in found]
    assert found, f"neither the README nor docs/ has the example {name!r}"
    assert len(found) == 1, f"the example {name!r} is marked {len(found)} times: {where}"
    return found[0][1]


def _names_run_here() -> set[str]:
    """The example names this module's tests run: the string given to ``example(...)`` or to
    ``run_alone(...)``, and the second argument of ``_script(...)`` (both call ``example``
    with it)."""
    names = set()
    for node in ast.walk(ast.parse(Path(__file__).read_text())):
        if not isinstance(node, ast.Call) or not isinstance(node.func, ast.Name):
            continue
        position = {"example": 0, "run_alone": 0, "_script": 1}.get(node.func.id)
        if position is None or len(node.args) <= position:
            continue
        arg = node.args[position]
        if isinstance(arg, ast.Constant) and isinstance(arg.value, str):
            names.add(arg.value)
    return names


def test_every_python_block_is_run_or_says_why_not() -> None:
    unmarked = [
        f"{path.relative_to(ROOT)}:{line}"
        for path in doc_files()
        for line, kind, _, _ in python_blocks(path)
        if kind is None
    ]
    assert not unmarked, (
        "these ```python blocks have no marker on the line above them: mark a complete example "
        "<!-- readme-example: NAME --> and run it in tests/test_readme.py, or say "
        f"<!-- not-run: why --> (or <!-- copy-of: NAME -->): {unmarked}"
    )
    reasonless = [
        f"{path.relative_to(ROOT)}:{line}"
        for path in doc_files()
        for line, kind, why, _ in python_blocks(path)
        if kind == "not-run" and not why.strip()
    ]
    assert not reasonless, f"a not-run marker says why: {reasonless}"


def test_every_marker_stands_above_a_python_block() -> None:
    dangling = []
    for path in doc_files():
        lines = path.read_text().splitlines()
        for i, line in enumerate(lines):
            if _MARKER.match(line) and not (i + 1 < len(lines) and lines[i + 1] == "```python"):
                dangling.append(f"{path.relative_to(ROOT)}:{i + 1}")
    assert not dangling, f"markers not followed by a ```python block: {dangling}"


def test_each_marked_example_is_run_by_a_test_and_marked_once() -> None:
    marked = _marked("readme-example")
    twice = {
        name: [str(path.relative_to(ROOT)) for path, _ in at]
        for name, at in marked.items()
        if len(at) > 1
    }
    assert not twice, f"example names marked more than once: {twice}"
    run = _names_run_here()
    assert set(marked) == run, (
        f"marked but run by no test: {sorted(set(marked) - run)}; "
        f"run by a test but marked nowhere: {sorted(run - set(marked))}"
    )
    # The README keeps its one complete example (its front door), run like the others.
    assert "<!-- readme-example: use -->" in README.read_text()


def test_every_copy_is_word_for_word_its_example() -> None:
    copies = _marked("copy-of")
    assert copies, "the docs repeat the README's example (getting-started.md)"
    for name, at in copies.items():
        original = example(name)
        for path, code in at:
            assert code == original, f"{path.relative_to(ROOT)}: the copy of {name!r} differs"


@pytest.mark.multiprocess
def test_the_use_example_runs_and_resumes(tmp_path: Path) -> None:
    code = example("use")
    job = f"readme-{uuid.uuid4().hex[:8]}"
    assert '"file:///tmp/tiercheck-ckpt"' in code
    assert '"run-1"' in code
    code = code.replace('"file:///tmp/tiercheck-ckpt"', repr((tmp_path / "ckpt").as_uri()))
    code = code.replace('"run-1"', repr(job))
    script = tmp_path / "train.py"
    script.write_text(code)
    try:
        outputs = []
        for _ in range(2):
            run = subprocess.run(
                [sys.executable, str(script)],
                capture_output=True,
                text=True,
                timeout=300,
                cwd=tmp_path,
                check=False,
            )
            assert run.returncode == 0, run.stderr[-4000:]
            outputs.append(run.stdout)
    finally:
        shutil.rmtree(Path("/dev/shm/tiercheck") / job, ignore_errors=True)
    assert "starting at step 0" in outputs[0]
    assert "starting at step 200" in outputs[1]  # the second run found the first one's work
    for out in outputs:
        assert "newest durable version: 190" in out  # bases every 10 steps are durable


def test_the_dcp_example_loads_what_tiercheck_stored(tmp_path: Path) -> None:
    script, job = _script(tmp_path, "dcp-read", "dcp-demo")
    try:
        out = _run([sys.executable, str(script)], tmp_path)
    finally:
        shutil.rmtree(Path("/dev/shm/tiercheck") / job, ignore_errors=True)
    assert "bit-exact: True" in out


def _script(tmp_path: Path, name: str, job: str) -> tuple[Path, str]:
    """The example ``name`` written to ``tmp_path``, storing under a fresh job name there."""
    code = example(name)
    assert '"file:///tmp/tiercheck-demo"' in code
    assert f'"{job}"' in code
    fresh = f"readme-{uuid.uuid4().hex[:8]}"
    code = code.replace('"file:///tmp/tiercheck-demo"', repr((tmp_path / "ckpt").as_uri()))
    code = code.replace(f'"{job}"', repr(fresh))
    script = tmp_path / "train.py"
    script.write_text(code)
    return script, fresh


def _run(command: list[str], cwd: Path, **extra_env: str) -> str:
    env = {**os.environ, "OMP_NUM_THREADS": "1", **extra_env}
    # A session of its own, ended whole afterwards: a launcher (Lightning's own, torchrun)
    # whose rank failed must not leave another rank waiting for it after the test.
    proc = subprocess.Popen(
        command,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        cwd=cwd,
        env=env,
        start_new_session=True,
    )
    try:
        stdout, stderr = proc.communicate(timeout=300)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    assert proc.returncode == 0, stderr[-4000:]
    return stdout


TORCHRUN = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2"]


@pytest.mark.slow
@pytest.mark.multiprocess
def test_the_lightning_ddp_example_resumes_under_either_launcher(tmp_path: Path) -> None:
    pytest.importorskip("lightning", reason="the example needs the 'lightning' extra")
    script, job = _script(tmp_path, "lightning-ddp", "lightning-ddp-demo")
    try:
        # Lightning starts the second process itself, then torchrun starts both.
        first = _run([sys.executable, str(script)], tmp_path)
        second = _run([*TORCHRUN, str(script)], tmp_path)
    finally:
        shutil.rmtree(Path("/dev/shm/tiercheck") / job, ignore_errors=True)
    assert "started from scratch" in first
    assert "started from step 200 (local tier)" in second  # the newest version, max_steps
    assert (tmp_path / "final.pt").is_file()


@pytest.mark.slow
@pytest.mark.multiprocess
def test_the_hf_example_resumes_under_torchrun(tmp_path: Path) -> None:
    pytest.importorskip("transformers", reason="the example needs the 'hf' extra")
    pytest.importorskip("accelerate", reason="the example needs the 'hf' extra")
    script, job = _script(tmp_path, "hf", "gpt2-demo")
    try:
        first = _run([*TORCHRUN, str(script)], tmp_path)
        second = _run([*TORCHRUN, str(script)], tmp_path)
    finally:
        shutil.rmtree(Path("/dev/shm/tiercheck") / job, ignore_errors=True)
    assert "started from scratch" in first
    assert "started from step 60 (local tier)" in second
    assert (tmp_path / "out" / "final" / "model.safetensors").is_file()


# Appended to the FSDP2 example by its test: each rank's local shards of the model and the
# optimizer's state, written where the test reads them (the process group is gone by then;
# taking local shards needs none).
_FSDP2_EPILOGUE = """
import os as _os
from torch.distributed.tensor import DTensor as _DTensor


def _local(value):
    return value.to_local().clone() if isinstance(value, _DTensor) else value


torch.save(
    {
        "model": {k: _local(v) for k, v in model.state_dict().items()},
        "optim": {
            i: {k: _local(v) for k, v in s.items()} for i, s in opt.state_dict()["state"].items()
        },
    },
    _os.path.join(OUT, f"rank{_os.environ['RANK']}-run{_os.environ['RUN']}.pt"),
)
"""


@pytest.mark.slow
@pytest.mark.multiprocess
def test_the_fsdp2_example_resumes_every_shard_under_torchrun(tmp_path: Path) -> None:
    code = example("fsdp2")
    job = f"readme-{uuid.uuid4().hex[:8]}"
    assert '"file:///tmp/tiercheck-ckpt"' in code
    assert '"fsdp2-run"' in code
    code = code.replace('"file:///tmp/tiercheck-ckpt"', repr((tmp_path / "ckpt").as_uri()))
    code = code.replace('"fsdp2-run"', repr(job))
    script = tmp_path / "train.py"
    script.write_text(code + f"\nOUT = {str(tmp_path)!r}\n" + _FSDP2_EPILOGUE)
    outputs = []
    try:
        for run in range(2):
            outputs.append(_run([*TORCHRUN, str(script)], tmp_path, RUN=str(run)))
        # Once more on one rank: the example opens with elastic=True, so the 2-rank version
        # comes back resharded onto it.
        one_rank = [*TORCHRUN[:-1], "--nproc-per-node=1"]
        outputs.append(_run([*one_rank, str(script)], tmp_path, RUN="2"))
    finally:
        shutil.rmtree(Path("/dev/shm/tiercheck") / job, ignore_errors=True)
    # Searched, not split into lines: two ranks' prints may interleave in the shared pipe.
    starts = [sorted(re.findall(r"rank (\d) starting at step (\d+)", out)) for out in outputs]
    assert starts[0] == [("0", "0"), ("1", "0")]
    # The second run found the first one's newest version on both ranks: nothing left to train.
    assert starts[1] == [("0", "20"), ("1", "20")]
    assert starts[2] == [("0", "20")]
    for rank in (0, 1):
        saved = torch.load(tmp_path / f"rank{rank}-run0.pt", weights_only=True)
        restored = torch.load(tmp_path / f"rank{rank}-run1.pt", weights_only=True)
        assert saved["model"]["0.weight"].shape == (32, 64)  # half the rows: a shard
        assert sorted(restored["model"]) == sorted(saved["model"])
        for key, value in saved["model"].items():
            assert torch.equal(restored["model"][key], value), (rank, key)
        # The second run's optimizer was fresh (no state) until restore filled it.
        assert sorted(restored["optim"]) == sorted(saved["optim"]) == [0, 1, 2, 3]
        for index, entry in saved["optim"].items():
            assert sorted(restored["optim"][index]) == ["exp_avg", "exp_avg_sq", "step"]
            for key, value in entry.items():
                assert torch.equal(restored["optim"][index][key], value), (rank, index, key)
    # The one rank holds both ranks' shards put together, optimizer state included.
    shards = [torch.load(tmp_path / f"rank{r}-run0.pt", weights_only=True) for r in (0, 1)]
    whole = torch.load(tmp_path / "rank0-run2.pt", weights_only=True)
    for key in shards[0]["model"]:
        joined = torch.cat([shards[0]["model"][key], shards[1]["model"][key]])
        assert torch.equal(whole["model"][key], joined), key
    for index, entry in shards[0]["optim"].items():
        for key, value in entry.items():
            joined = value if key == "step" else torch.cat([value, shards[1]["optim"][index][key]])
            assert torch.equal(whole["optim"][index][key], joined), (index, key)


def run_alone(name: str, job_id: str, tmp_path: Path) -> subprocess.CompletedProcess[str]:
    """Run example ``name`` in a fresh interpreter, storing under ``tmp_path`` and as a job of
    its own instead of its ``job_id`` and ``file:///tmp/tiercheck-ckpt``."""
    code = example(name)
    job = f"readme-{uuid.uuid4().hex[:8]}"
    assert '"file:///tmp/tiercheck-ckpt"' in code
    assert f'"{job_id}"' in code
    code = code.replace('"file:///tmp/tiercheck-ckpt"', repr((tmp_path / "ckpt").as_uri()))
    code = code.replace(f'"{job_id}"', repr(job))
    script = tmp_path / "train.py"
    script.write_text(code)
    try:
        run = subprocess.run(
            [sys.executable, str(script)],
            capture_output=True,
            text=True,
            timeout=300,
            cwd=tmp_path,
            check=False,
        )
    finally:
        shutil.rmtree(Path("/dev/shm/tiercheck") / job, ignore_errors=True)
    assert run.returncode == 0, run.stderr[-4000:]
    return run


@pytest.mark.multiprocess
def test_the_overlap_example_runs(tmp_path: Path) -> None:
    run = run_alone("overlap", "run-2", tmp_path)
    assert "newest durable version: 90" in run.stdout
    assert "StateChanged" not in run.stderr  # the fence kept every snapshot whole


def test_the_first_save_example_readies_memory_and_saves(tmp_path: Path) -> None:
    run = run_alone("first-save", "run-3", tmp_path)
    readied = re.search(r"readied (\d+) bytes", run.stdout)
    assert readied is not None, run.stdout
    assert int(readied.group(1)) > 4 * 256 * 256 * 3  # the weights and both moments
    # Only bases go to the persistent tier by default: the first save was one.
    assert "newest: {'local': 200, 'persistent': 100}" in run.stdout


def test_the_health_example_says_the_tier_keeps_committing(tmp_path: Path) -> None:
    code = example("health")
    job = f"readme-{uuid.uuid4().hex[:8]}"
    assert '"pause-demo"' in code
    assert '"/tmp/tc-pause-demo"' in code
    code = code.replace('"pause-demo"', repr(job))
    code = code.replace('"/tmp/tc-pause-demo"', repr(str(tmp_path / "shm")))
    run = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=tmp_path,
        check=False,
    )
    assert run.returncode == 0, run.stderr[-4000:]
    assert run.stdout.splitlines() == ["local 0 0 False"]
