"""oxccl's PEP 517 build backend: maturin's, run so that it finds its own executable.

maturin's backend runs the command ``maturin`` found on PATH. pip puts the build environment
on PATH only with build isolation; ``/path/venv/bin/pip install --no-build-isolation ./python``
from a shell where that venv is not activated would fail with ``FileNotFoundError:
'maturin'`` although maturin is installed in the venv. This backend puts the directory of the
maturin executable that belongs to the importable ``maturin`` package (the one the build
uses) first on PATH, then hands every hook to maturin.
"""

from __future__ import annotations

import os
import shutil
import sys
import sysconfig
from typing import List, Optional


def _candidates() -> List[str]:
    exe = "maturin.exe" if os.name == "nt" else "maturin"
    dirs = [os.path.dirname(sys.executable)]
    try:
        dirs.append(sysconfig.get_path("scripts"))
    except KeyError:
        pass
    found = [os.path.join(d, exe) for d in dirs]
    try:  # where the installed maturin distribution put its executable
        from importlib.metadata import PackageNotFoundError, distribution

        try:
            dist = distribution("maturin")
        except PackageNotFoundError:
            dist = None
        for f in (dist.files or []) if dist is not None else []:
            if os.path.basename(str(f)) == exe:
                found.append(str(dist.locate_file(f)))
    except Exception:  # noqa: BLE001 - a malformed record only loses this candidate
        pass
    return found


def _maturin_dir() -> Optional[str]:
    for path in _candidates():
        if os.path.isfile(path) and os.access(path, os.X_OK):
            return os.path.dirname(os.path.abspath(path))
    return None


def _ensure_on_path() -> None:
    if shutil.which("maturin") is not None:
        return
    found = _maturin_dir()
    if found is not None:
        os.environ["PATH"] = found + os.pathsep + os.environ.get("PATH", "")


_ensure_on_path()

from maturin import *  # noqa: E402,F401,F403 - the PEP 517 hooks
