"""Real text for the fidelity harness, read at run time and never committed.

    stdlib-code   Python's own standard library sources (always available)
    austen        Pride and Prejudice, from Debian's r-cran-janeaustenr
    python-docs   the Python 3.11 tutorial's reStructuredText, from Debian's python3.11-doc
    python-howto  held out: three Python 3.11 HOWTOs (functional programming, sorting, logging)
                  from the same package, no part of the calibration texts above; measuring on it
                  tells whether ranges set on the three hold beyond them

The Debian texts are fetched with `apt-get download` and unpacked with `dpkg -x`
into a cache folder (default ~/.cache/kvguard/texts); nothing is installed.
"""

from __future__ import annotations

import os
import shutil
import struct
import subprocess
import sysconfig
import zlib
from pathlib import Path

from ..errors import ConfigError

DEBIAN = {"austen": "r-cran-janeaustenr", "python-docs": "python3.11-doc"}
STDLIB_FILES = ("textwrap.py", "json/decoder.py", "argparse.py", "inspect.py")
DOCS_FILES = ("tutorial/classes.rst.txt", "tutorial/controlflow.rst.txt", "tutorial/datastructures.rst.txt")
HOWTO_FILES = ("howto/functional.rst.txt", "howto/sorting.rst.txt", "howto/logging.rst.txt")
BUILTIN = ("austen", "python-docs", "stdlib-code", "python-howto")
HELD_OUT = ("python-howto",)  # not among the default texts the documented figures were set on


def default_cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "kvguard" / "texts"


def stdlib_code() -> str:
    root = Path(sysconfig.get_paths()["stdlib"])
    return "\n\n".join((root / f).read_text(encoding="utf-8") for f in STDLIB_FILES)


def debian_package(package: str, cache_dir: Path) -> Path:
    """The unpacked tree of a Debian package, downloaded once into cache_dir."""
    root = cache_dir / package
    if (root / ".complete").exists():
        return root
    if not (shutil.which("apt-get") and shutil.which("dpkg")):
        raise ConfigError(f"the {package} text needs apt-get and dpkg (a Debian or Ubuntu system); "
                          "use --texts stdlib-code or --text-file PATH instead")
    debs = cache_dir / "debs"
    debs.mkdir(parents=True, exist_ok=True)
    got = subprocess.run(["apt-get", "download", package], cwd=debs, capture_output=True, text=True)
    files = sorted(debs.glob(f"{package}_*.deb"))
    if got.returncode != 0 or not files:
        raise ConfigError(f"'apt-get download {package}' failed ({got.stderr.strip()[-300:] or 'no .deb'}); "
                          "run 'apt-get update' first, or use --texts stdlib-code or --text-file PATH")
    subprocess.run(["dpkg", "-x", str(files[-1]), str(root)], check=True)
    (root / ".complete").touch()
    return root


def r_strings(blob: bytes) -> list[str]:
    """The elements of a character vector in R's XDR serialization format (version 2 or 3)."""
    if blob[:2] != b"X\n":
        raise ConfigError("not an R XDR-serialized object")
    pos = 2
    version = struct.unpack(">i", blob[pos:pos + 4])[0]
    pos += 12  # version, writer's R version, minimal R version
    if version == 3:
        n = struct.unpack(">i", blob[pos:pos + 4])[0]
        pos += 4 + n  # native encoding name
    flags, length = struct.unpack(">ii", blob[pos:pos + 8])
    pos += 8
    if flags & 0xFF != 16:  # STRSXP
        raise ConfigError(f"expected a character vector, found R type {flags & 0xFF}")
    out = []
    for _ in range(length):
        _, n = struct.unpack(">ii", blob[pos:pos + 8])  # CHARSXP flags, length (-1 = NA)
        pos += 8
        out.append(blob[pos:pos + max(n, 0)].decode("utf-8", "replace"))
        pos += max(n, 0)
    return out


def austen(cache_dir: Path) -> str:
    """Pride and Prejudice, from the R lazy-load database of janeaustenr (zlib records)."""
    rdb = debian_package(DEBIAN["austen"], cache_dir) / "usr/lib/R/site-library/janeaustenr/data/Rdata.rdb"
    data, pos = rdb.read_bytes(), 0
    while pos < len(data):
        z = zlib.decompressobj()
        lines = r_strings(z.decompress(data[pos + 4:]))
        if lines and lines[0].strip().upper() == "PRIDE AND PREJUDICE":
            text = "\n".join(lines)
            return text[text.find("It is a truth universally acknowledged"):]
        pos = len(data) - len(z.unused_data)
    raise ConfigError(f"Pride and Prejudice not found in {rdb}")


def python_docs(cache_dir: Path, files: tuple[str, ...] = DOCS_FILES) -> str:
    src = debian_package(DEBIAN["python-docs"], cache_dir) / "usr/share/doc/python3.11/html/_sources"
    return "\n\n".join((src / f).read_text(encoding="utf-8") for f in files)


def load_texts(names: list[str], files: list[str] = (), cache_dir: Path | None = None) -> dict[str, str]:
    """Texts by name: built-in ones (BUILTIN) and files (named by their stem)."""
    cache_dir = Path(cache_dir or default_cache_dir())
    loaders = {"austen": lambda: austen(cache_dir), "python-docs": lambda: python_docs(cache_dir),
               "stdlib-code": stdlib_code, "python-howto": lambda: python_docs(cache_dir, HOWTO_FILES)}
    out = {}
    for name in names:
        if name not in loaders:
            raise ConfigError(f"unknown text {name!r}; choose from {list(BUILTIN)} or pass --text-file PATH")
        out[name] = loaders[name]()
    for f in files:
        try:
            out[Path(f).stem] = Path(f).read_text(encoding="utf-8", errors="replace")
        except OSError as e:
            raise ConfigError(f"cannot read text file {f}: {e.strerror}") from None
    return out
