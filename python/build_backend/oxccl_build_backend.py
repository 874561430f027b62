"""oxccl's PEP 517 build backend: maturin's, run so that it finds its own executable.

maturin's backend runs the command ``maturin`` found on PATH. pip puts the build environment
on PATH only with build isolation; ``/path/venv/bin/pip install --no-build-isolation ./python``
from a shell where that venv is not activated would fail with ``FileNotFoundError:
'maturin'`` although maturin is installed in the venv. This backend puts the directory of the
maturin executable that belongs to the importable ``maturin`` package (the one the build
uses) first on PATH, then hands every hook to maturin; ``build_wheel`` then adds the prebuilt
C++ torch backend and the ``oxccl`` command to maturin's wheel (see below).
"""

from __future__ import annotations

import os
import shutil
import sys
import sysconfig
from typing import Any, Dict, List, Optional


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


# --- The wheel's prebuilt payload -------------------------------------------------------------
#
# maturin's wheel holds the Rust module and the Python package. ``build_wheel`` adds, by
# rewriting that wheel (its RECORD included):
#
# * the C++ torch backend (``oxccl/_torch_backend*.so``), built with the build environment's
#   torch, and its record ``oxccl/_torch_backend.json`` (the build key: torch, oxccl, Python,
#   C++ sources; the library's size and sha256), as ``python -m oxccl.build_torch_ext`` leaves
#   them: ``import oxccl.torch`` then finds a usable build in the package and builds nothing.
#   A build with the same record in the development tree's package or in the cache that
#   ``import oxccl.torch`` uses (``OXCCL_TORCH_EXT_DIR``) is reused, checked as import does.
#   Added only when torch is importable here: with ``pip wheel --no-build-isolation`` that is
#   the venv's torch; an isolated build has no torch and gives a wheel without it (the first
#   import builds it, as from source).
# * the ``oxccl`` command (crates/oxccl-cli, built with cargo, release profile), as a script of
#   the wheel's data (``<name>.data/scripts/oxccl``): installers put it in the environment's
#   bin directory. Added only when the source tree holds the CLI crate (a source
#   distribution does not).
#
# The platform tag: maturin's manylinux tag for the Rust module, raised to the oldest
# manylinux_2_N whose glibc and libstdc++ symbol versions cover the C++ module and the
# command (``linux`` when that cannot be read); torch's own libraries, which the C++ module
# links, are left out of that judgement as for any torch extension's wheel.
#
# By default either is added when it can be built, and left out with a message when its
# build fails (the package still works: the first import builds the C++ module, or says
# why it cannot). ``OXCCL_WHEEL_TORCH_EXT=0`` and ``OXCCL_WHEEL_CLI=0`` (or the config
# settings ``torch-ext=0`` and ``cli=0``) leave either out; ``=1`` makes its absence an error.

import base64  # noqa: E402
import hashlib  # noqa: E402
import json  # noqa: E402
import re  # noqa: E402
import subprocess  # noqa: E402
import tempfile  # noqa: E402
import zipfile  # noqa: E402

import maturin as _maturin  # noqa: E402

#: python/ in the repository (or the source distribution's python/): this file's parent.
_PY_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_PKG_DIR = os.path.join(_PY_DIR, "oxccl")


def _log(msg: str) -> None:
    print(f"oxccl build backend: {msg}", file=sys.stderr, flush=True)


def _choice(config_settings: Optional[dict], setting: str, env: str) -> Optional[bool]:
    """True (required), False (left out) or None (added when possible)."""
    raw = None
    if config_settings and setting in config_settings:
        raw = config_settings[setting]
    elif os.environ.get(env):
        raw = os.environ[env]
    if raw is None:
        return None
    value = str(raw).strip().lower()
    if value in ("1", "true", "yes", "on"):
        return True
    if value in ("0", "false", "no", "off"):
        return False
    raise ValueError(f"{env} / {setting}={raw!r}: expected 0 or 1")


def _oxccl_version() -> str:
    """The version the Rust module reports (its crate's, python/Cargo.toml)."""
    with open(os.path.join(_PY_DIR, "Cargo.toml"), encoding="utf-8") as f:
        m = re.search(r'^version\s*=\s*"([^"]+)"', f.read(), re.MULTILINE)
    if m is None:
        raise RuntimeError("no version in python/Cargo.toml")
    return m.group(1)


def _torch_ext_files(tmp: str) -> Optional[Dict[str, str]]:
    """Builds the C++ torch backend into `tmp` in a child process (with this Python, so with
    the build environment's torch); returns ``{path in the wheel: file}``, or None when torch
    is not importable here."""
    probe = subprocess.run(
        [sys.executable, "-c", "import torch, setuptools; print(torch.__version__)"],
        capture_output=True, text=True,
    )
    if probe.returncode != 0:
        _log("torch (or setuptools) is not importable in the build environment: the wheel has no "
             "prebuilt C++ torch backend (build with `pip wheel --no-build-isolation` in a venv "
             "with torch to add it)")
        return None
    script = os.path.join(_PKG_DIR, "build_torch_ext.py")
    # The module is loaded from its file: importing the package ``oxccl`` needs the Rust
    # module, which is not built in the source tree.
    code = (
        "import importlib.util, json, sys\n"
        "spec = importlib.util.spec_from_file_location('oxccl_build_torch_ext', sys.argv[1])\n"
        "m = importlib.util.module_from_spec(spec); spec.loader.exec_module(m)\n"
        "import torch, sysconfig\n"
        "k = {'torch': str(torch.__version__), 'oxccl': sys.argv[3],\n"
        "     'python': sys.implementation.cache_tag + sysconfig.get_config_var('EXT_SUFFIX'),\n"
        "     'sources': m._sources_hash()}\n"
        "into = sys.argv[2]\n"
        "import os, shutil\n"
        "os.makedirs(into, exist_ok=True)\n"
        "for d in (m.HERE, m.cache_dir(k)):\n"
        "    found = m.usable(d, k)\n"
        "    if found:\n"
        "        shutil.copyfile(found, m.target(into))\n"
        "        shutil.copyfile(os.path.join(d, m.STAMP), os.path.join(into, m.STAMP))\n"
        "        if m.usable(into, k):\n"
        "            print('reusing ' + found, file=sys.stderr)\n"
        "            break\n"
        "else:\n"
        "    m.build(into=into, k=k)\n"
        "assert m.usable(into, k), 'the build is not usable'\n"
        "print(json.dumps({'module': m.target(into), 'stamp': m.STAMP}))\n"
    )
    into = os.path.join(tmp, "torch-ext")
    _log(f"the C++ torch backend for torch {probe.stdout.strip()}: reused, else built (~1-3 min)")
    r = subprocess.run(
        [sys.executable, "-c", code, script, into, _oxccl_version()],
        stdout=subprocess.PIPE, text=True,
    )
    if r.returncode != 0:
        raise RuntimeError(f"the build of the C++ torch backend failed (exit status {r.returncode})")
    out = json.loads(r.stdout.strip().splitlines()[-1])
    module = out["module"]
    return {
        "oxccl/" + os.path.basename(module): module,
        "oxccl/" + out["stamp"]: os.path.join(into, out["stamp"]),
    }


def _cli_file() -> Optional[str]:
    """Builds the ``oxccl`` command (crates/oxccl-cli, release) with cargo; its path, or None
    when this tree has no CLI crate."""
    root = os.path.dirname(_PY_DIR)
    if not os.path.isfile(os.path.join(root, "crates", "oxccl-cli", "Cargo.toml")):
        _log("no crates/oxccl-cli here (a source distribution): the wheel has no `oxccl` command")
        return None
    cmd = ["cargo", "build", "--release", "--locked", "-p", "oxccl-cli", "--message-format=json-render-diagnostics"]
    _log("building the oxccl command: " + " ".join(cmd[:6]))
    r = subprocess.run(cmd, cwd=root, stdout=subprocess.PIPE, text=True)
    if r.returncode != 0:
        raise RuntimeError(f"cargo build of the oxccl command failed (exit status {r.returncode})")
    exe = None
    for line in r.stdout.splitlines():
        try:
            msg = json.loads(line)
        except ValueError:
            continue
        if msg.get("reason") == "compiler-artifact" and msg.get("executable") and msg["target"]["name"] == "oxccl":
            exe = msg["executable"]
    if exe is None or not os.path.isfile(exe):
        raise RuntimeError("cargo built no `oxccl` executable")
    return exe


def _record_hash(data: bytes) -> str:
    digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
    return f"sha256={digest}"


#: manylinux policies (auditwheel's, for x86_64): the newest symbol
#: version of glibc, libstdc++ (GLIBCXX, CXXABI) and libgcc_s (GCC) each allows.
_MANYLINUX = [
    (17, {"GLIBC": "2.17", "GLIBCXX": "3.4.19", "CXXABI": "1.3.7", "GCC": "4.8.0"}),
    (24, {"GLIBC": "2.24", "GLIBCXX": "3.4.22", "CXXABI": "1.3.10", "GCC": "4.8.0"}),
    (28, {"GLIBC": "2.28", "GLIBCXX": "3.4.24", "CXXABI": "1.3.11", "GCC": "7.0.0"}),
    (31, {"GLIBC": "2.31", "GLIBCXX": "3.4.28", "CXXABI": "1.3.12", "GCC": "7.0.0"}),
    (34, {"GLIBC": "2.34", "GLIBCXX": "3.4.29", "CXXABI": "1.3.13", "GCC": "7.0.0"}),
    (35, {"GLIBC": "2.35", "GLIBCXX": "3.4.30", "CXXABI": "1.3.13", "GCC": "12.0.0"}),
    (36, {"GLIBC": "2.36", "GLIBCXX": "3.4.30", "CXXABI": "1.3.13", "GCC": "12.0.0"}),
    (38, {"GLIBC": "2.38", "GLIBCXX": "3.4.30", "CXXABI": "1.3.13", "GCC": "12.0.0"}),
    (39, {"GLIBC": "2.39", "GLIBCXX": "3.4.33", "CXXABI": "1.3.15", "GCC": "14.0.0"}),
]


def _version(v: str) -> List[int]:
    return [int(x) for x in v.split(".")]


def _manylinux_minor(module: str) -> Optional[int]:
    """The oldest manylinux_2_N whose glibc, libstdc++ and libgcc_s symbol versions cover what
    `module` needs (read with ``readelf -V``), or None when that cannot be told. Libraries
    outside those (torch's libc10, libtorch*) are not judged: they come with the torch the
    wheel is for, as for any torch extension's wheel."""
    try:
        out = subprocess.run(["readelf", "-V", "--wide", module], capture_output=True, text=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        return None
    needs: Dict[str, str] = {}
    for name, ver in re.findall(r"Name: (GLIBC|GLIBCXX|CXXABI|GCC)_([0-9.]+)\b", out):
        if name not in needs or _version(ver) > _version(needs[name]):
            needs[name] = ver
    for minor, allows in _MANYLINUX:
        if all(_version(v) <= _version(allows[n]) for n, v in needs.items()):
            return minor
    return None


def _retag(name: str, wheel_file: bytes, minor: Optional[int]) -> Any:
    """The wheel's name and WHEEL file with each manylinux platform tag raised to
    ``manylinux_2_<minor>`` at least (``linux`` when `minor` is None)."""

    def fix(plat: str) -> str:
        m = re.fullmatch(r"(?:manylinux_2_(\d+)|manylinux2014)_(\w+)", plat)
        if m is None:
            return plat
        have = int(m.group(1) or 17)
        if minor is None:
            return f"linux_{m.group(2)}"
        return f"manylinux_2_{max(have, minor)}_{m.group(2)}"

    def fix_all(plats: str) -> str:
        out: List[str] = []
        for p in plats.split("."):
            p = fix(p)
            if p not in out:
                out.append(p)
        return ".".join(out)

    stem, plats = name[: -len(".whl")].rsplit("-", 1)
    new_name = f"{stem}-{fix_all(plats)}.whl"
    lines = []
    for line in wheel_file.decode().splitlines():
        if line.startswith("Tag: "):
            tag, plat = line[len("Tag: "):].rsplit("-", 1)
            fixed = [f"Tag: {tag}-{p}" for p in fix_all(plat).split(".")]
            lines.extend(f for f in fixed if f not in lines)
        else:
            lines.append(line)
    return new_name, ("\n".join(lines) + "\n").encode()


def _add_to_wheel(
    wheel: str, files: Dict[str, str], scripts: Dict[str, str], manylinux: Optional[int], retag: bool
) -> str:
    """Rewrites `wheel` with `files` (``{path in the wheel: file}``) and `scripts` (``{name:
    file}``, under ``<dist-info name>.data/scripts/``, executable), and a RECORD that lists
    them; with `retag`, its platform tag raised to what `manylinux` (see :func:`_retag`)
    says. Returns the new wheel's file name (in the same directory)."""
    new_name = os.path.basename(wheel)
    with zipfile.ZipFile(wheel) as src:
        infos = src.infolist()
        record_name = next(i.filename for i in infos if i.filename.endswith(".dist-info/RECORD"))
        data_dir = record_name.split("/")[0][: -len(".dist-info")] + ".data"
        added: List[Any] = []
        for arc, path in sorted(files.items()):
            added.append((arc, path, 0o644))
        for name, path in sorted(scripts.items()):
            added.append((f"{data_dir}/scripts/{name}", path, 0o755))
        names = {a[0] for a in added}
        tmp = wheel + ".tmp"
        records = []
        with zipfile.ZipFile(tmp, "w", compression=zipfile.ZIP_DEFLATED) as dst:
            # The package's files, the added ones, then the metadata (last, as the wheel format
            # recommends).
            dist_info = record_name.split("/")[0] + "/"
            ordered = [i for i in infos if not i.filename.startswith(dist_info)] + [None]
            ordered += [i for i in infos if i.filename.startswith(dist_info)]
            for info in ordered:
                if info is None:
                    for arc, path, mode in added:
                        with open(path, "rb") as f:
                            data = f.read()
                        entry = zipfile.ZipInfo(arc, date_time=(2020, 1, 1, 0, 0, 0))
                        entry.external_attr = (0o100000 | mode) << 16
                        entry.compress_type = zipfile.ZIP_DEFLATED
                        dst.writestr(entry, data)
                        records.append(f"{arc},{_record_hash(data)},{len(data)}")
                    continue
                if info.filename == record_name or info.filename in names:
                    continue
                data = src.read(info)
                if retag and info.filename.endswith(".dist-info/WHEEL"):
                    new_name, data = _retag(os.path.basename(wheel), data, manylinux)
                dst.writestr(info, data)
                records.append(f"{info.filename},{_record_hash(data)},{len(data)}")
            records.append(f"{record_name},,")
            dst.writestr(record_name, "\n".join(records) + "\n")
    os.replace(tmp, os.path.join(os.path.dirname(wheel), new_name))
    if new_name != os.path.basename(wheel):
        os.unlink(wheel)
    return new_name


def build_wheel(wheel_directory: str, config_settings: Optional[dict] = None, metadata_directory: Optional[str] = None) -> str:
    """maturin's wheel, with the prebuilt C++ torch backend and the ``oxccl`` command added
    (see above)."""
    want_ext = _choice(config_settings, "torch-ext", "OXCCL_WHEEL_TORCH_EXT")
    want_cli = _choice(config_settings, "cli", "OXCCL_WHEEL_CLI")
    maturin_settings = {k: v for k, v in (config_settings or {}).items() if k not in ("torch-ext", "cli")}
    # maturin's PEP 517 build tags the wheel `linux` unless told a compatibility; `pypi` has it
    # check the Rust module and give the oldest manylinux tag it meets. A compatibility given
    # by the caller (MATURIN_PEP517_ARGS, the config setting build-args) is kept, and so is its
    # tag.
    args = " ".join(_maturin.get_maturin_pep517_args(maturin_settings))
    retag = "--compatibility" not in args and "--manylinux" not in args
    if retag and sys.platform.startswith("linux"):
        key = "maturin.build-args" if "maturin.build-args" in maturin_settings else "build-args"
        maturin_settings[key] = (args + " --compatibility pypi").strip()
    name = _maturin.build_wheel(wheel_directory, maturin_settings or None, metadata_directory)
    wheel = os.path.join(wheel_directory, name)
    with tempfile.TemporaryDirectory(prefix="oxccl-wheel-") as tmp:
        files: Dict[str, str] = {}
        scripts: Dict[str, str] = {}
        if want_ext is not False:
            try:
                ext = _torch_ext_files(tmp)
            except RuntimeError as e:
                if want_ext:
                    raise
                # Asked for by default only: the package still installs, and the first import
                # builds the module, as from source.
                _log(f"{e}: the wheel has no prebuilt C++ torch backend")
                ext = None
            if ext is None and want_ext:
                raise RuntimeError("OXCCL_WHEEL_TORCH_EXT=1, but torch is not importable in the build environment")
            files.update(ext or {})
        if want_cli is not False:
            try:
                exe = _cli_file()
            except (OSError, RuntimeError) as e:  # OSError: no cargo
                if want_cli:
                    raise
                _log(f"{e}: the wheel has no `oxccl` command")
                exe = None
            if exe is None and want_cli:
                raise RuntimeError("OXCCL_WHEEL_CLI=1, but this source tree has no crates/oxccl-cli")
            if exe is not None:
                scripts["oxccl"] = exe
        if files or scripts:
            modules = [p for a, p in files.items() if a.endswith(".so")] + list(scripts.values())
            manylinux = max((_manylinux_minor(m) or 10**6 for m in modules), default=17)
            name = _add_to_wheel(wheel, files, scripts, None if manylinux == 10**6 else manylinux, retag)
            _log(f"added to {name}: {', '.join(sorted(files) + ['scripts/' + s for s in scripts])}")
    return name
