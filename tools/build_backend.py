"""shmproxy's build backend: setuptools' own, after a check that the package list misses nothing.

One import name spans three folders of the repository (proxy/ is ``shmproxy``, shm/ and
transports/ are ``shmproxy.shm`` and ``shmproxy.transports``). setuptools' package discovery names
packages after their folders, so it cannot find ``shmproxy.*`` under proxy/, and pyproject.toml
lists the packages by hand. A hand-written list forgets: 0.2.0's wheel shipped without
``shmproxy.mpi``, and only a build from a clean tree showed it (an editable install and the tests
import from the checkout). So every build hook first walks the three folders and fails, naming
them, when a folder with an ``__init__.py`` is not in the list or a listed package has no folder.

pyproject.toml points here with ``backend-path = ["tools"]``; PEP 517 runs the hooks with the
project's root as working directory.
"""
from __future__ import annotations

import io
import os
import sys
import tarfile
from pathlib import Path
from typing import Any

from setuptools import build_meta as _setuptools
from setuptools.build_meta import get_requires_for_build_editable, get_requires_for_build_sdist  # noqa: F401
from setuptools.build_meta import get_requires_for_build_wheel  # noqa: F401

if sys.version_info >= (3, 11):
    import tomllib
else:  # build-system.requires brings tomli on 3.10
    import tomli as tomllib


class PackageListError(Exception):
    """pyproject.toml's [tool.setuptools] packages and the tree's packages differ."""


def tree_packages(root: Path, package_dir: dict[str, str]) -> set[str]:
    """Every package under the mapped folders: the import name of each folder with an __init__.py."""
    found = set()
    for name, folder in package_dir.items():
        base = root / folder
        for init in base.rglob("__init__.py"):
            rel = init.parent.relative_to(base).parts
            if "__pycache__" not in rel:
                found.add(".".join([name, *rel]))
    return found


def check_package_list(root: Path = Path(".")) -> None:
    """Raise PackageListError naming what the list forgets or lists in vain."""
    with open(root / "pyproject.toml", "rb") as f:
        config = tomllib.load(f)["tool"]["setuptools"]
    listed = set(config["packages"])
    package_dir: dict[str, str] = config["package-dir"]
    in_tree = tree_packages(root, package_dir)
    forgotten, vain = sorted(in_tree - listed), sorted(listed - in_tree)
    if forgotten or vain:
        raise PackageListError(
            "pyproject.toml's [tool.setuptools] packages differs from the tree: "
            + (f"not listed, though their folders hold an __init__.py: {forgotten}; " if forgotten else "")
            + (f"listed, with no such package folder: {vain}" if vain else ""))


def build_wheel(wheel_directory: str, config_settings: dict[str, Any] | None = None,
                metadata_directory: str | None = None) -> str:
    check_package_list()
    return _setuptools.build_wheel(wheel_directory, config_settings, metadata_directory)


def build_sdist(sdist_directory: str, config_settings: dict[str, Any] | None = None) -> str:
    check_package_list()
    name = _setuptools.build_sdist(sdist_directory, config_settings)
    _add_to_sdist(Path(sdist_directory) / name, Path(__file__))
    return name


def _add_to_sdist(sdist: Path, backend: Path) -> None:
    """Put this file into the sdist: a wheel built from the sdist runs it, and setuptools packs only
    package files (a MANIFEST.in would be the usual way, and the repository's top level is fixed)."""
    with tarfile.open(sdist, "r:gz") as tf:
        members = [(m, _read(tf, m)) for m in tf.getmembers()]
    top = members[0][0].name.split("/")[0]
    arcname = f"{top}/tools/{backend.name}"
    if any(m.name == arcname for m, _ in members):
        return
    tmp = sdist.with_suffix(".tmp")
    with tarfile.open(tmp, "w:gz", format=tarfile.PAX_FORMAT) as out:
        for m, data in members:
            out.addfile(m, io.BytesIO(data) if data is not None else None)
        out.add(backend, arcname, filter=_anonymous)
    os.replace(tmp, sdist)


def _read(tf: tarfile.TarFile, member: tarfile.TarInfo) -> bytes | None:
    f = tf.extractfile(member)
    return None if f is None else f.read()


def _anonymous(info: tarfile.TarInfo) -> tarfile.TarInfo:
    info.uid = info.gid = 0
    info.uname = info.gname = ""
    return info


def build_editable(wheel_directory: str, config_settings: dict[str, Any] | None = None,
                   metadata_directory: str | None = None) -> str:
    check_package_list()
    return _setuptools.build_editable(wheel_directory, config_settings, metadata_directory)


def prepare_metadata_for_build_wheel(metadata_directory: str,
                                     config_settings: dict[str, Any] | None = None) -> str:
    check_package_list()
    return _setuptools.prepare_metadata_for_build_wheel(metadata_directory, config_settings)


def prepare_metadata_for_build_editable(metadata_directory: str,
                                        config_settings: dict[str, Any] | None = None) -> str:
    check_package_list()
    return _setuptools.prepare_metadata_for_build_editable(metadata_directory, config_settings)
