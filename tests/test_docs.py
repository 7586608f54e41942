"""Every shell and Python block of README.md and docs/ runs as a reader would run it, or says why not.

A fenced block whose info string is sh, bash, shell, console, python or py is a block to run. The line
before it may mark it `<!-- not run: REASON -->` (a GPU, the network, the test command itself, a
fragment that takes its names from the reader); a marked block is not collected.
Python blocks run in a subprocess of this venv's interpreter; shell blocks run with bash (-e, pipefail)
in a temporary working directory whose `.venv/bin` holds `kvguard` and `python` of this venv and is on
PATH. `curl` fails on an HTTP error status there, as a reader who looks at the answer would notice.

Some blocks need what a reader does by hand between lines (SESSIONS): start a service in a second
terminal and wait for it, or copy a printed token into a variable. Blocks that fail today are listed
in EXPECTED_FAILURES with why and what their failure looks like; a listed block that passes fails its
test, so the list is emptied as the fixes land. Fenced blocks without one of those info strings
(diagrams, outputs, formats) and indented blocks are not run.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
LANGS = {"sh": "shell", "bash": "shell", "shell": "shell", "console": "shell",
         "python": "python", "py": "python"}
NOT_RUN = re.compile(r"^\s*<!--\s*not run:\s*(?P<reason>.*?)\s*-->\s*$")
FENCE = re.compile(r"^(?P<indent> {0,3})(?P<fence>`{3,}|~{3,})\s*(?P<info>[^`\s]*)")
HEADING = re.compile(r"^#{1,6}\s+(?P<title>.+?)\s*#*\s*$")


@dataclass(frozen=True)
class Block:
    path: str  # relative to the repository
    line: int  # of the opening fence, from 1
    lang: str  # "shell" or "python"
    section: str  # the heading above it ("" before the first)
    index: int  # its place among the runnable blocks of its section, from 1
    code: str
    not_run: str | None  # the reason, when marked

    @property
    def name(self) -> str:
        return f"{self.path}::{self.section}::{self.index}"


def parse(path: Path, root: Path = ROOT) -> tuple[list[Block], list[str]]:
    """The runnable blocks of one Markdown file, and the problems with its markers (a marker
    without a reason, or one that stands before no runnable block)."""
    rel = path.relative_to(root).as_posix()
    lines = path.read_text(encoding="utf-8").splitlines()
    blocks: list[Block] = []
    problems: list[str] = []
    section, counts = "", {}
    marker: tuple[int, str] | None = None  # (line, reason) of a marker on the line before
    i = 0
    while i < len(lines):
        line = lines[i]
        m = FENCE.match(line)
        if m:
            fence, info, indent = m["fence"], m["info"].lower(), len(m["indent"])
            j = i + 1
            close = re.compile(rf"^ {{0,3}}{re.escape(fence[0])}{{{len(fence)},}}\s*$")
            while j < len(lines) and not close.match(lines[j]):
                j += 1
            body = "\n".join(x[indent:] if x[:indent].strip() == "" else x for x in lines[i + 1 : j]) + "\n"
            lang = LANGS.get(info)
            if lang:
                counts[section] = counts.get(section, 0) + 1
                reason = marker[1] if marker else None
                blocks.append(Block(rel, i + 1, lang, section, counts[section], body, reason))
            elif marker:
                problems.append(f"{rel}:{marker[0]}: a not-run marker before a block that is not run "
                                f"anyway ({info!r})")
            marker = None
            i = j + 1
            continue
        n = NOT_RUN.match(line)
        if n:
            if not n["reason"]:
                problems.append(f"{rel}:{i + 1}: a not-run marker must say why")
            marker = (i + 1, n["reason"])
        elif line.strip():
            if marker:
                problems.append(f"{rel}:{marker[0]}: a not-run marker must stand on the line before a block")
            marker = None
            h = HEADING.match(line)
            if h:
                section = h["title"]
        i += 1
    if marker:
        problems.append(f"{rel}:{marker[0]}: a not-run marker at the end of the file")
    return blocks, problems


BLOCKS = [b for path in DOCS for b in parse(path)[0]]


@dataclass(frozen=True)
class Session:
    """What a reader does by hand around a block's lines: `service` matches the line that starts a
    server they leave running in another terminal (started in the background here and waited for on
    `ready`, a path of the admin API); `capture` names a variable set to the last line a matching
    line printed (a token they copy). The admin API listens on a free port instead of the default
    8470, and the block's 127.0.0.1:8470 is read as that port: other runs of the tests on this
    machine (workers, other checkouts) would collide on the default."""

    service: str
    ready: str = "/healthz"
    capture: tuple[tuple[str, str], ...] = ()


SESSIONS = {
    "docs/sidecar.md::Running it::1": Session(service=r"\bkvguard serve\b",
                                             capture=(("TOKEN", r"token create --scope admin"),)),
}

# Blocks that fail today: their name, why, and a pattern their failure's output matches (a failure of
# another kind is reported as such). A listed block that passes fails: take it off the list.
EXPECTED_FAILURES = {
}

SLOW = {  # blocks that take long enough to run only with the slow tests
}


def _params():
    out = []
    for b in BLOCKS:
        if b.not_run:  # test_markers_and_lists_name_real_blocks checks that it says why
            continue
        marks = [pytest.mark.slow] if b.name in SLOW else []
        out.append(pytest.param(b, id=b.name, marks=marks))
    return out


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _workdir(tmp_path: Path) -> tuple[Path, dict]:
    """A reader's working directory: .venv/bin with this venv's kvguard and python, on PATH."""
    work = tmp_path / "work"
    bin_ = work / ".venv" / "bin"
    bin_.mkdir(parents=True)
    py = sys.executable
    for name, run in (("kvguard", f'exec "{py}" -m kvguard "$@"'), ("python", f'exec "{py}" "$@"'),
                      ("python3", f'exec "{py}" "$@"')):
        (bin_ / name).write_text(f"#!/usr/bin/env bash\n{run}\n")
        (bin_ / name).chmod(0o755)
    curl = shutil.which("curl")
    if curl:
        fail = "--fail-with-body --silent --show-error"
        (bin_ / "curl").write_text(f'#!/usr/bin/env bash\nexec "{curl}" {fail} "$@"\n')
        (bin_ / "curl").chmod(0o755)
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVGUARD_")}
    env["PATH"] = f"{bin_}{os.pathsep}{env.get('PATH', '')}"
    env.pop("TRITON_INTERPRET", None)  # a reader's shell has none; the kvguard CLI sets what it needs
    return work, env


def _commands(code: str) -> list[str]:
    """A shell block's commands, continuation lines joined; comments and blank lines left out."""
    out, cur = [], ""
    for line in code.splitlines():
        if not cur and (not line.strip() or line.lstrip().startswith("#")):
            continue
        cur += line + "\n"
        if not line.rstrip().endswith("\\"):
            out.append(cur)
            cur = ""
    if cur:
        out.append(cur)
    return out


def _bash(cmd: str, cwd: Path, env: dict, timeout: int = 300) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", "-e", "-o", "pipefail", "-c", cmd], cwd=cwd, env=env, capture_output=True,
                          text=True, timeout=timeout)


def _wait(url: str, proc: subprocess.Popen, log: Path, timeout: float = 120.0) -> None:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if proc.poll() is not None:
            raise AssertionError(f"the service exited with {proc.returncode}:\n{log.read_text()[-3000:]}")
        try:
            with urllib.request.urlopen(url, timeout=2) as r:
                if r.status == 200:
                    return
        except (urllib.error.URLError, OSError):
            pass
        time.sleep(0.3)
    raise AssertionError(f"the service did not answer {url} within {timeout:.0f} s:\n"
                         f"{log.read_text()[-3000:]}")


def _stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=30)


def run_shell(block: Block, tmp_path: Path) -> tuple[bool, str]:
    """Runs a shell block as a reader would; (passed, what it printed)."""
    work, env = _workdir(tmp_path)
    session = SESSIONS.get(block.name)
    if session is None:
        r = _bash(block.code, work, env)
        return r.returncode == 0, r.stdout + r.stderr
    port = _free_port()
    env["KVGUARD_PORT"] = str(port)
    printed, service = [], None
    try:
        for cmd in _commands(block.code):
            cmd = cmd.replace("127.0.0.1:8470", f"127.0.0.1:{port}")
            if re.search(session.service, cmd):
                log = tmp_path / "service.log"
                with open(log, "w") as out:
                    service = subprocess.Popen(["bash", "-c", f"exec {cmd}"], cwd=work, env=env, stdout=out,
                                               stderr=subprocess.STDOUT, start_new_session=True)
                _wait(f"http://127.0.0.1:{port}{session.ready}", service, log)
                printed.append(f"$ {cmd}(started)\n")
                continue
            r = _bash(cmd, work, env)
            printed.append(f"$ {cmd}{r.stdout}{r.stderr}")
            if r.returncode != 0:
                return False, "".join(printed) + f"(exit status {r.returncode})\n"
            for var, pattern in session.capture:
                if re.search(pattern, cmd):
                    env[var] = r.stdout.strip().splitlines()[-1]
        return True, "".join(printed)
    finally:
        if service is not None:
            _stop(service)


def run_python(block: Block, tmp_path: Path) -> tuple[bool, str]:
    work = tmp_path / "work"
    work.mkdir()
    script = tmp_path / "block.py"
    script.write_text(block.code)
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVGUARD_")}
    r = subprocess.run([sys.executable, str(script)], cwd=work, env=env, capture_output=True, text=True,
                       timeout=600)
    return r.returncode == 0, r.stdout + r.stderr


def test_parse_finds_blocks_sections_and_markers(tmp_path):
    md = tmp_path / "x.md"
    md.write_text("# T\n\n```sh\necho a\n```\n\n## Run it\n\n<!-- not run: needs a GPU -->\n\n"
                  "```python\nprint(1)\n```\n\n```text\n```sh inside text\n```\n\n  ```bash\n  cd x\n  ```\n"
                  "<!-- not run:  -->\n```py\npass\n```\n<!-- not run: why -->\n```json\n{}\n```\n"
                  "<!-- not run: why -->\nprose\n```sh\ntrue\n```\n")
    blocks, problems = parse(md, tmp_path)
    assert [(b.name, b.lang, b.not_run) for b in blocks] == [
        ("x.md::T::1", "shell", None), ("x.md::Run it::1", "python", "needs a GPU"),
        ("x.md::Run it::2", "shell", None), ("x.md::Run it::3", "python", ""),
        ("x.md::Run it::4", "shell", None)]
    assert blocks[2].code == "cd x\n"  # the fence's indent taken off
    assert problems == ["x.md:22: a not-run marker must say why",
                        "x.md:26: a not-run marker before a block that is not run anyway ('json')",
                        "x.md:30: a not-run marker must stand on the line before a block"]


def test_markers_and_lists_name_real_blocks():
    problems = [p for path in DOCS for p in parse(path)[1]]
    names = {b.name: b for b in BLOCKS}
    for listed in (*SESSIONS, *EXPECTED_FAILURES, *SLOW):
        if listed not in names:
            problems.append(f"{listed}: listed in tests/test_docs.py, but no such block")
        elif names[listed].not_run:
            problems.append(f"{listed}: listed in tests/test_docs.py, but marked not run")
    assert not problems, "\n".join(problems)


@pytest.mark.parametrize("block", _params())
def test_block(block: Block):
    run = run_shell if block.lang == "shell" else run_python
    # a short path of its own: the sidecar's Unix socket lies under it, and such a path has at most 107 bytes
    with tempfile.TemporaryDirectory(prefix="kvgdoc-") as tmp:
        passed, printed = run(block, Path(tmp))
    where = f"{block.path}:{block.line} ({block.name})"
    if block.name in EXPECTED_FAILURES:
        why, pattern = EXPECTED_FAILURES[block.name]
        assert not passed, (f"{where} passes now: take it off EXPECTED_FAILURES in tests/test_docs.py "
                            f"(listed because {why})")
        assert re.search(pattern, printed), (f"{where} fails, but not as listed ({why}; expected to match "
                                             f"{pattern!r}):\n{printed[-4000:]}")
        return
    assert passed, f"{where} failed:\n{printed[-4000:]}"


def _anchors(path: Path) -> set[str]:
    """The anchors a renderer gives the headings of a markdown file (lower case, punctuation
    dropped, spaces as hyphens)."""
    heads = re.findall(r"^#{1,6} (.*)$", path.read_text(encoding="utf-8"), re.M)
    return {re.sub(r"[^\w\- ]", "", h.strip().lower()).replace(" ", "-") for h in heads}


def test_links_between_the_docs_reach_a_file_and_a_heading():
    """A relative link names a file that exists and, after #, a heading it has: sections move."""
    broken = []
    for doc in DOCS:
        for target, anchor in re.findall(r"\]\(([\w./-]*?)(?:#([^)\s]+))?\)", doc.read_text(encoding="utf-8")):
            if target.startswith(("http", "mailto")) or not (target or anchor):
                continue
            path = (doc.parent / target) if target else doc
            if not path.exists():
                broken.append(f"{doc.relative_to(ROOT)}: {target} does not exist")
            elif anchor and path.suffix == ".md" and anchor not in _anchors(path):
                broken.append(f"{doc.relative_to(ROOT)}: {target or doc.name} has no heading #{anchor}")
    assert not broken, "\n".join(broken)
