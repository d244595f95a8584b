"""A third-party tier as users ship one: a package built and ``pip install``ed into an environment
of the test's own, found through its entry points, and durable everywhere because it declares
that it outlives the cluster.

The package (``tiercheck-vault-plugin``) declares two entry points: ``vault``, the folder-backed
durable tier of ``vault_tier.py``, and ``mydict``, the dict tier of ``dict_tier.py`` under
another name than its class's (``"dict"``). A script run in the new environment checks that
``mydict`` is refused when a checkpointer is built, naming the entry point to write instead;
that ``vault`` gets a durable tier's policy, holds ``COMMIT`` records and a job record, keeps
three versions, and restores bit for bit once the node's memory is gone; and that
``tiercheck ls``, ``verify``, ``gc`` and ``export`` read it as durable storage.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import site
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

import tiercheck

HERE = Path(__file__).resolve().parent

PYPROJECT = """\
[build-system]
requires = ["setuptools"]
build-backend = "setuptools.build_meta"

[project]
name = "tiercheck-vault-plugin"
version = "1.0"

[project.entry-points."tiercheck.tiers"]
vault = "tiercheck_vault_plugin:VaultTier"
mydict = "tiercheck_dict_plugin:DictTier"

[tool.setuptools]
py-modules = ["tiercheck_vault_plugin", "tiercheck_dict_plugin"]
"""

# Run in the new environment, with the work folder as its argument.
SCRIPT = textwrap.dedent(
    """
    import importlib.metadata
    import json
    import shutil
    import subprocess
    import sys
    from pathlib import Path

    import torch

    from tiercheck import SyncCheckpointer
    from tiercheck.engine.options import TierPolicy
    from tiercheck.errors import ConfigError
    from tiercheck.tiers import get_tier_class

    work = Path(sys.argv[1])
    vault = work / "vault" / "job"

    # The plugin is the package installed into this environment, found by its entry points.
    files = importlib.metadata.distribution("tiercheck-vault-plugin").files or []
    assert any(f.name == "entry_points.txt" for f in files), files
    module = sys.modules[get_tier_class("vault").__module__]
    assert module.__name__ == "tiercheck_vault_plugin"
    assert Path(module.__file__).resolve().is_relative_to(Path(sys.prefix).resolve())

    options = {
        "local_root": work / "shm",
        "persistent": (work / "durable").as_uri(),
        "rank": 0,
        "world_size": 1,
        "base_every": 2,
    }
    try:
        SyncCheckpointer("job", **options, tiers=["local", "mydict"])
    except ConfigError as exc:
        assert 'dict = "tiercheck_dict_plugin:DictTier"' in str(exc), exc
        assert "name = 'mydict'" in str(exc), exc
    else:
        raise AssertionError("a tier registered under another name than its own was accepted")

    def state(version):
        g = torch.Generator().manual_seed(version)
        return {"w": torch.randn(128, 32, generator=g), "b": torch.randn(32, generator=g)}

    def bits(t):
        return t.contiguous().view(torch.uint8)

    with SyncCheckpointer("job", **options, tiers=["local", "vault"]) as ckpt:
        assert ckpt.policies["vault"] == TierPolicy(keep=3, encoding="packed", versions="base")
        for version in range(10):
            ckpt.save(version, state(version))
        assert ckpt.wait()["vault"] == 8
    # Bases only, each proven by a COMMIT record; the newest three kept; the job record there.
    assert sorted(p.parent.name for p in vault.glob("v*/COMMIT")) == [
        "v000000000004", "v000000000006", "v000000000008"
    ], sorted(vault.rglob("*"))
    assert (vault / "JOB").is_file()

    def cli(*args):
        done = subprocess.run(
            [sys.executable, "-m", "tiercheck", *args, "--json"],
            capture_output=True, text=True, timeout=120,
        )
        assert done.returncode == 0, (args, done.stdout, done.stderr)
        return json.loads(done.stdout)

    (listed,) = cli("ls", str(vault))["locations"]
    assert listed["job_record"]["job_id"] == "job"
    assert [(v["version"], v["kind"], v["committed"]) for v in listed["versions"]] == [
        (4, "base", True), (6, "base", True), (8, "base", True)
    ], listed
    cli("verify", str(vault), "--deep")
    kept = cli("gc", str(vault), "--keep", "3", "--dry-run")
    assert (kept["kept"], kept["removed_versions"]) == ([4, 6, 8], []), kept
    exported = cli("export", str(vault), str(work / "model"), "--format", "pt")
    assert exported["version"] == 8, exported
    model = torch.load(work / "model.pt", weights_only=True)
    assert all(torch.equal(bits(model[k]), bits(v)) for k, v in state(8).items())

    # The cluster is lost (the node's memory with it); the vault restores the newest version.
    shutil.rmtree(work / "shm")
    target = {k: torch.zeros_like(v) for k, v in state(0).items()}
    with SyncCheckpointer("job", **options, tiers=["local", "vault"]) as ckpt:
        restored = ckpt.restore(target)
    assert (restored.version, restored.source_tier) == (8, "vault"), restored
    assert all(torch.equal(bits(target[k]), bits(v)) for k, v in state(8).items())
    print("plugin ok")
    """
)


def _run(
    args: list[str | Path], cwd: Path | None = None, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    done = subprocess.run(
        [str(a) for a in args],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
        cwd=cwd,
        env=env,
    )
    assert done.returncode == 0, f"{args}\n{done.stdout}\n{done.stderr}"
    return done


@pytest.mark.slow
def test_an_installed_durable_plugin_is_durable_everywhere(tmp_path: Path) -> None:
    if importlib.util.find_spec("setuptools") is None or importlib.util.find_spec("pip") is None:
        pytest.skip("building the plugin offline needs pip and setuptools in this environment")
    package = tmp_path / "plugin"
    package.mkdir()
    (package / "pyproject.toml").write_text(PYPROJECT)
    shutil.copy(HERE / "vault_tier.py", package / "tiercheck_vault_plugin.py")
    shutil.copy(HERE / "dict_tier.py", package / "tiercheck_dict_plugin.py")

    env = tmp_path / "env"
    _run([sys.executable, "-m", "venv", "--without-pip", env])
    python = env / "bin" / "python"
    where = "import sysconfig; print(sysconfig.get_paths()['purelib'])"
    purelib = Path(_run([python, "-c", where]).stdout.strip())
    # What this interpreter sees (tiercheck, torch, pip, setuptools) is seen from the new
    # environment after its own packages. A --system-site-packages environment would see the
    # base interpreter's packages, not those of the environment running the tests; addsitedir
    # (not a plain path line) also reads their .pth files: an editable tiercheck is one.
    parents = [*site.getsitepackages(), str(Path(tiercheck.__file__).resolve().parent.parent)]
    (purelib / "zz_tests_parent.pth").write_text(
        "import site; " + "; ".join(f"site.addsitedir({p!r})" for p in parents) + "\n"
    )
    _run(
        [python, "-m", "pip", "install", "--no-deps", "--no-build-isolation", "--no-index",
         "--disable-pip-version-check", "--quiet", package],
        cwd=tmp_path,
    )  # fmt: skip
    # Installed into the new environment only: this one knows nothing of it.
    assert importlib.util.find_spec("tiercheck_vault_plugin") is None
    assert (purelib / "tiercheck_vault_plugin.py").is_file()

    script = tmp_path / "script.py"
    script.write_text(SCRIPT)
    work = tmp_path / "work"
    work.mkdir()
    variables = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    variables["TIERCHECK_TEST_VAULT"] = str(work / "vault")
    done = _run([python, script, work], cwd=tmp_path, env=variables)
    assert "plugin ok" in done.stdout
