#!/usr/bin/env python3
"""Builds the wheel of kvcache-client from the hand-written package and the generated stubs.

    build_wheel.py --source clients/python --stubs <build>/python --staging DIR
                   --dist <build>/python/dist --version X.Y.Z

The two halves of the client live apart (kvcache_client/ in the source tree, kvcache/ in
the build tree) and kvcache_client/presets.txt is a link out of its folder, so the
pyproject.toml cannot be built in place: this stages pyproject.toml and both packages, links
resolved, into a fresh folder and runs the PEP 517 backend that pyproject.toml names
(setuptools, from the system: nothing is downloaded) on it. It then checks that the wheel
holds what an installed client imports, and prints the wheel's path.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import io
import os
import re
import shutil
import sys
import zipfile
from pathlib import Path
from typing import List

#: Files the installed client needs; a wheel without one of them is refused.
REQUIRED_FILES = (
    "kvcache_client/__init__.py",
    "kvcache_client/py.typed",
    "kvcache_client/presets.txt",
    "kvcache_client/torch/__init__.py",
    "kvcache/__init__.py",
    "kvcache/v1/__init__.py",
    "kvcache/v1/kvcache_pb2.py",
    "kvcache/v1/kvcache_pb2_grpc.py",
)
_SKIPPED = shutil.ignore_patterns("__pycache__", "*.pyc")


class WheelError(Exception):
    """The wheel cannot be built, or is not what the client needs; the message says why."""


def pyproject_field(pyproject: Path, key: str) -> str:
    """A string field of pyproject.toml's [project] table."""
    text = pyproject.read_text(encoding="utf-8")
    try:
        import tomllib  # Python >= 3.11
    except ImportError:
        project = text.split("[project]", 1)[-1].split("\n[", 1)[0]
        found = re.search(rf'^{key}\s*=\s*"([^"]*)"', project, re.MULTILINE)
        value = found.group(1) if found else None
    else:
        value = tomllib.loads(text).get("project", {}).get(key)
    if not isinstance(value, str) or not value:
        raise WheelError(f"{pyproject}: [project] has no string field {key!r}")
    return value


def stage(source: Path, stubs: Path, staging: Path) -> None:
    """A fresh staging folder: pyproject.toml, kvcache_client/ and kvcache/, links resolved
    (copytree copies what a link points to), without bytecode."""
    if staging.exists():
        shutil.rmtree(staging)
    staging.mkdir(parents=True)
    shutil.copy2(source / "pyproject.toml", staging / "pyproject.toml")
    for folder, package in ((source, "kvcache_client"), (stubs, "kvcache")):
        if not (folder / package / "__init__.py").is_file():
            raise WheelError(f"{folder / package}: no __init__.py (is it built?)")
        shutil.copytree(folder / package, staging / package, ignore=_SKIPPED)


def run_backend(staging: Path, dist: Path) -> Path:
    """Runs build-system.build-backend's build_wheel on the staging folder (the backend
    reads the project from the working directory); returns the wheel."""
    text = (staging / "pyproject.toml").read_text(encoding="utf-8")
    found = re.search(r'^build-backend\s*=\s*"([^"]+)"', text, re.MULTILINE)
    if not found:
        raise WheelError("pyproject.toml: [build-system] names no build-backend")
    try:
        backend = importlib.import_module(found.group(1))
    except ImportError as error:
        raise WheelError(f"build backend {found.group(1)} cannot be imported ({error}); "
                         "Debian: python3-setuptools python3-wheel") from None
    dist.mkdir(parents=True, exist_ok=True)
    for old in dist.glob("kvcache_client-*.whl"):
        old.unlink()
    here, log = os.getcwd(), io.StringIO()
    os.chdir(staging)
    try:  # the backend's chatter is shown only when it fails
        with contextlib.redirect_stdout(log), contextlib.redirect_stderr(log):
            name = backend.build_wheel(str(dist.resolve()))
    except BaseException:
        sys.stderr.write(log.getvalue())
        raise
    finally:
        os.chdir(here)
    return dist / name


def check_wheel(wheel: Path, version: str, presets: Path) -> None:
    """Refuses a wheel that is misnamed or lacks a file the client imports or reads."""
    expected = f"kvcache_client-{version}-py3-none-any.whl"
    if wheel.name != expected:
        raise WheelError(f"the backend made {wheel.name}, expected {expected}")
    with zipfile.ZipFile(wheel) as archive:
        names = set(archive.namelist())
        missing: List[str] = [n for n in REQUIRED_FILES if n not in names]
        if missing:
            raise WheelError(f"{wheel.name} lacks {', '.join(missing)}")
        packed = archive.read("kvcache_client/presets.txt")
    if packed != presets.read_bytes():
        raise WheelError(f"{wheel.name}: kvcache_client/presets.txt differs from {presets}")


def main(argv: List[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--source", type=Path, required=True,
                        help="clients/python (pyproject.toml, kvcache_client/)")
    parser.add_argument("--stubs", type=Path, required=True,
                        help="the folder holding the generated package kvcache/")
    parser.add_argument("--staging", type=Path, required=True, help="scratch folder (emptied)")
    parser.add_argument("--dist", type=Path, required=True, help="where the wheel goes")
    parser.add_argument("--version", required=True, help="the project's version")
    args = parser.parse_args(argv)
    try:
        declared = pyproject_field(args.source / "pyproject.toml", "version")
        if declared != args.version:
            raise WheelError(f"{args.source / 'pyproject.toml'}: version {declared!r} is not "
                             f"the project's {args.version!r} (top CMakeLists.txt)")
        stage(args.source, args.stubs, args.staging)
        wheel = run_backend(args.staging, args.dist)
        check_wheel(wheel, args.version, args.source / "kvcache_client" / "presets.txt")
    except (WheelError, OSError) as error:
        print(f"build_wheel: {error}", file=sys.stderr)
        return 1
    print(wheel)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
