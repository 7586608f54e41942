"""Text loading: the standard library always, Debian packages through apt, the R
serialization of janeaustenr parsed without R."""

from __future__ import annotations

import struct
import zlib

import pytest

from kvguard.errors import ConfigError
from kvguard.eval import texts


def xdr_strings(lines: list[str | None], version: int = 3) -> bytes:
    """A character vector as R's serialize() writes it (XDR)."""
    out = b"X\n" + struct.pack(">iii", version, 0x040201, 0x030500)
    if version == 3:
        out += struct.pack(">i", 5) + b"UTF-8"
    out += struct.pack(">ii", 16, len(lines))
    for line in lines:
        if line is None:
            out += struct.pack(">ii", 9, -1)
        else:
            raw = line.encode()
            out += struct.pack(">ii", 0x00040009, len(raw)) + raw
    return out


@pytest.mark.parametrize("version", [2, 3])
def test_r_strings_reads_a_character_vector(version):
    lines = ["PRIDE AND PREJUDICE", "", "Chapter 1", None, "It is a truth — universally"]
    got = texts.r_strings(xdr_strings(lines, version))
    assert got == ["PRIDE AND PREJUDICE", "", "Chapter 1", "", "It is a truth — universally"]


def test_r_strings_refuses_other_objects():
    with pytest.raises(ConfigError, match="character vector"):
        texts.r_strings(b"X\n" + struct.pack(">iii", 2, 0, 0) + struct.pack(">ii", 14, 1))
    with pytest.raises(ConfigError, match="XDR"):
        texts.r_strings(b"RDX2\n")


def test_austen_found_among_the_records_of_the_lazy_load_database(tmp_path):
    root = tmp_path / "r-cran-janeaustenr"
    data = root / "usr/lib/R/site-library/janeaustenr/data"
    data.mkdir(parents=True)
    (root / ".complete").touch()
    records = [xdr_strings(["EMMA", "", "Emma Woodhouse, handsome, clever"]),
               xdr_strings(["PRIDE AND PREJUDICE", "", "Chapter 1", "",
                            "It is a truth universally acknowledged, that a single man",
                            "in possession of a good fortune"])]
    blob = b"".join(struct.pack(">I", len(r)) + zlib.compress(r) for r in records)
    (data / "Rdata.rdb").write_bytes(blob)
    text = texts.austen(tmp_path)
    assert text.startswith("It is a truth universally acknowledged")
    assert text.endswith("in possession of a good fortune")


def test_stdlib_code_is_real_python():
    code = texts.stdlib_code()
    assert "def wrap(" in code and "class JSONDecodeError" in code
    assert len(code) > 100_000


def test_without_apt_the_error_says_what_to_do(tmp_path, monkeypatch):
    monkeypatch.setattr(texts.shutil, "which", lambda _name: None)
    with pytest.raises(ConfigError, match=r"needs apt-get and dpkg.*--texts stdlib-code"):
        texts.load_texts(["austen"], cache_dir=tmp_path)


def test_files_and_unknown_names(tmp_path):
    f = tmp_path / "notes.txt"
    f.write_text("some text")
    assert texts.load_texts([], [str(f)]) == {"notes": "some text"}
    with pytest.raises(ConfigError, match="unknown text 'bible'"):
        texts.load_texts(["bible"])
    with pytest.raises(ConfigError, match="cannot read text file"):
        texts.load_texts([], [str(tmp_path / "absent.txt")])


def test_the_held_out_text_is_other_howtos_of_the_docs_package(tmp_path):
    src = tmp_path / "python3.11-doc/usr/share/doc/python3.11/html/_sources"
    for f in (*texts.DOCS_FILES, *texts.HOWTO_FILES):
        (src / f).parent.mkdir(parents=True, exist_ok=True)
        (src / f).write_text(f"text of {f}")
    (tmp_path / "python3.11-doc/.complete").touch()
    got = texts.load_texts(["python-docs", "python-howto"], cache_dir=tmp_path)
    assert got["python-howto"].startswith("text of howto/functional.rst.txt")
    assert not set(texts.HOWTO_FILES) & set(texts.DOCS_FILES)  # held out: none of the calibration chapters
    assert "python-howto" in texts.BUILTIN and set(texts.HELD_OUT) <= set(texts.BUILTIN)
