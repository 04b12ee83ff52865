"""The docs site (`docs/`, `mkdocs.yml`): it builds, every page is in the nav, and its samples are true.

`mkdocs build --strict` runs into a temporary directory (no broken link or anchor, no
missing reference). Without the docs extra (`pip install -e '.[docs]'`) that test is
skipped, except under CI (env `CI` set), where it fails: CI installs the extra.

Code samples are the fenced blocks of each page, read as a reader would run them:

- a ```python block is a complete program and runs, unless the HTML comment on the line
  before it says `<!-- docs: fragment -->` (then it is only compiled);
- a ```bash block is checked unless that comment says `<!-- docs: run -->` (`<!-- docs: run,
  exits 1 -->` when its last command exits 1): every `python -m kvguard SUBCOMMAND` and its
  `--options` must exist (`python -m kvguard --help`, `... SUBCOMMAND --help`), and every
  `KVGUARD_*` variable on any page must be one kvguard reads;
- the blocks of one page that run, run in order in one temporary directory holding a copy
  of `examples/`, with `python` the interpreter running these tests and no `KVGUARD*`
  variable of the caller's.

The text is checked against the code too: every module of the package is named on the
architecture page, every message quoted on the messages page shares a stretch of text
with a string in the source, and the report file fields the reports page lists are the
fields a report file holds.
"""

from __future__ import annotations

import ast
import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys
import textwrap
from functools import lru_cache
from pathlib import Path
from typing import NamedTuple, Optional

import pytest

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"
PAGES = sorted(p.relative_to(DOCS).as_posix() for p in DOCS.rglob("*.md"))
SOURCES = sorted([*(ROOT / "kvguard").rglob("*.py"), *(ROOT / "integrations").rglob("*.py")])
TIMEOUT = 600  # a hang stops here; a busy box (xdist workers beside other jobs) never does

DOCS_MODULES = ("mkdocs", "material", "mkdocstrings", "mkdocstrings_handlers.python", "pymdownx")
_MARKER = re.compile(r"<!--\s*docs:\s*(?P<how>fragment|check|run)(?:,\s*exits\s+(?P<status>\d+))?\s*-->")
_FENCE = re.compile(r"^(?P<marker>[ ]*<!--[^\n]*-->\n)?(?P<indent>[ ]*)```(?P<lang>[a-z]*)[^\n]*\n(?P<code>.*?)^(?P=indent)```",
                    re.S | re.M)
_VARIABLE = re.compile(r"\bKVGUARD(?:_[A-Z]+)*\b")
# `python -m kvguard ...` anywhere; `kvguard ...` (the console script) where a code span starts with it,
# and in a bash sample where a line does
_COMMAND = re.compile(r"(?:python3? -m kvguard|(?<=`)kvguard(?= ))((?: +[^\s#;&|`]+)*)")
_SCRIPT = re.compile(r"^\s*kvguard((?: +[^\s#;&|`]+)*)", re.M)


class Sample(NamedTuple):
    page: str
    lang: str
    code: str
    how: str  # "run", "check" or "fragment"
    status: int  # the exit status it is expected to end with, when it runs
    line: int

    def __str__(self) -> str:
        return f"docs/{self.page}:{self.line} ({self.lang}, {self.how})"


def samples(page: str) -> list[Sample]:
    text = (DOCS / page).read_text()
    found = []
    for match in _FENCE.finditer(text):
        marker = _MARKER.search(match.group("marker") or "")
        lang = match.group("lang")
        default = "run" if lang == "python" else "check"
        how = marker.group("how") if marker else default
        status = int(marker.group("status")) if marker and marker.group("status") else 0
        code = textwrap.dedent(match.group("code"))
        found.append(Sample(page, lang, code, how, status, text.count("\n", 0, match.start("code"))))
    return found


def _docs_tools_missing() -> Optional[str]:
    missing = [name for name in DOCS_MODULES if _find(name) is None]
    return f"the docs extra is not installed (no {', '.join(missing)}): pip install -e '.[docs]'" if missing else None


def _find(name: str) -> object:
    try:
        return importlib.util.find_spec(name)
    except ModuleNotFoundError:
        return None


def _clean_env() -> dict[str, str]:
    """This interpreter first on PATH, none of the caller's KVGUARD* settings (the build cache kept)."""
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("KVGUARD", "PYTHON", "VIRTUAL_ENV")) or k == "KVGUARD_CACHE_DIR"}
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
    env["NO_MKDOCS_2_WARNING"] = "1"
    return env


# -- the site builds ---------------------------------------------------------------------------


def test_mkdocs_build_strict(tmp_path: Path) -> None:
    missing = _docs_tools_missing()
    if missing:
        if os.environ.get("CI"):
            pytest.fail(f"CI builds the docs: {missing}")
        pytest.skip(missing)
    result = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(tmp_path / "site")],
                            cwd=ROOT, env=_clean_env(), capture_output=True, text=True, timeout=TIMEOUT)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "WARNING" not in result.stderr, result.stderr
    api = (tmp_path / "site" / "api" / "index.html").read_text()
    for name in _public_names():  # each public name has its generated entry
        assert f'id="kvguard.{name}"' in api, f"kvguard.{name} is not in the API reference"
    getting_started = (tmp_path / "site" / "getting-started" / "index.html").read_text()
    assert "docs: fragment" not in re.sub(r"<!--.*?-->", "", getting_started, flags=re.S)  # markers stay hidden


def _public_names() -> list[str]:
    tree = ast.parse((ROOT / "kvguard" / "__init__.py").read_text())
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == "__all__" for t in node.targets):
            return list(ast.literal_eval(node.value))
    raise AssertionError("kvguard/__init__.py has no __all__")


def _nav_pages() -> list[str]:
    """The pages mkdocs.yml's nav names (read as text: the file uses a python/name tag)."""
    config = (ROOT / "mkdocs.yml").read_text()
    nav = re.search(r"^nav:\n((?:[ -].*\n)+)", config, re.M)
    assert nav, "mkdocs.yml has no nav"
    return re.findall(r"([\w/.-]+\.md)\s*$", nav.group(1), re.M)


def test_every_page_is_in_the_nav_once() -> None:
    nav = _nav_pages()
    assert sorted(nav) == PAGES, f"not in the nav: {sorted(set(PAGES) - set(nav))}; missing files: " \
                                 f"{sorted(set(nav) - set(PAGES))}"
    assert len(nav) == len(set(nav))


def test_changelog_page_is_the_changelog() -> None:
    """The changelog page includes CHANGELOG.md itself (a snippet), so it cannot drift."""
    assert (DOCS / "changelog.md").read_text().strip() == '--8<-- "CHANGELOG.md"'


def test_nothing_outside_the_repository_is_cited() -> None:
    for page in PAGES:
        text = (DOCS / page).read_text()
        assert "shared/notes" not in text and "issue " not in text.lower(), page


# -- the samples -------------------------------------------------------------------------------


@pytest.mark.parametrize("page", [p for p in PAGES if p != "reports.md" and any(s.how == "run" for s in samples(p))])
def test_samples_run(page: str, tmp_path: Path) -> None:
    """(The reports page's run in `test_report_fields_are_the_documented_ones`.)"""
    _run_page(page, tmp_path)


def _run_page(page: str, where: Path) -> None:
    shutil.copytree(ROOT / "examples", where / "examples",
                    ignore=shutil.ignore_patterns("__pycache__", "reports", "r", "r-fixed"))
    for number, sample in enumerate(s for s in samples(page) if s.how == "run"):
        if sample.lang == "python":
            script = where / f"sample_{number}.py"
            script.write_text(sample.code)
            command = [sys.executable, script.name]
        else:
            assert sample.lang == "bash", f"{sample}: only python and bash samples run"
            command = ["bash", "-c", sample.code]  # each block from where the page starts (its `cd` stays in it)
        result = subprocess.run(command, cwd=where, env=_clean_env(), capture_output=True, text=True,
                                timeout=TIMEOUT)
        assert result.returncode == sample.status, (
            f"{sample} exited {result.returncode}, expected {sample.status}\n{result.stdout}\n{result.stderr}")


@pytest.mark.parametrize("page", PAGES)
def test_python_fragments_compile(page: str) -> None:
    for sample in samples(page):
        if sample.lang == "python":
            compile(sample.code, str(sample), "exec")


def test_every_sample_is_python_bash_or_text() -> None:
    for page in PAGES:
        for sample in samples(page):
            assert sample.lang in ("python", "bash", "text", "mermaid"), f"{sample}: give the fence a language"
            assert sample.how != "run" or sample.lang in ("python", "bash"), str(sample)


@lru_cache(maxsize=None)
def _help(*subcommand: str) -> str:
    result = subprocess.run([sys.executable, "-m", "kvguard", *subcommand, "--help"], cwd=ROOT, env=_clean_env(),
                            capture_output=True, text=True, timeout=TIMEOUT)
    assert result.returncode == 0, result.stderr
    return result.stdout


def _subcommands() -> list[str]:
    match = re.search(r"\{([\w,-]+)\}", _help())
    assert match, _help()
    return match.group(1).split(",")


def _commands(text: str, pattern: re.Pattern[str] = _COMMAND) -> list[tuple[str, list[str]]]:
    """(subcommand, its --options) of each `python -m kvguard ...` in `text`."""
    found = []
    for match in pattern.finditer(text):
        words = match.group(1).split()
        if "--" in words:  # `kvguard run [...] -- CMD`: what follows is the command's own
            words = words[:words.index("--")]
        if not words:
            continue
        subcommand = "" if words[0].startswith("-") else words[0]
        if subcommand and not re.fullmatch(r"[a-z][a-z-]*", subcommand):
            continue  # prose: `kvguard [rank 0/2]: ...`
        options = [re.sub(r"[^\w-].*", "", w.lstrip("[")) for w in words if w.lstrip("[").startswith("--")]
        found.append((subcommand, options))
    return found


def test_kvguard_commands_exist() -> None:
    """Every `python -m kvguard ...` on a page (samples and text) names a real subcommand and options."""
    subcommands = _subcommands()
    seen = set()
    for page in PAGES:
        bash = [s.code for s in samples(page) if s.lang == "bash"]
        for subcommand, options in _commands((DOCS / page).read_text()) + _commands("\n".join(bash), _SCRIPT):
            if subcommand:
                assert subcommand in subcommands, f"docs/{page}: `kvguard {subcommand}` is not a subcommand"
            usage = _help(subcommand) if subcommand else _help()
            for option in options:
                assert re.search(rf"(?<![\w-]){re.escape(option)}\b", usage), \
                    f"docs/{page}: `kvguard {subcommand} {option}` is not an option"
            seen.add(subcommand)
    assert set(subcommands) - seen == set(), f"subcommands no page shows: {sorted(set(subcommands) - seen)}"


def _variables_read() -> set[str]:
    return {name for path in SOURCES for name in _VARIABLE.findall(path.read_text())}


def test_environment_variables_are_real_and_all_documented() -> None:
    read = _variables_read()
    documented: set[str] = set()
    for page in PAGES:
        named = set(_VARIABLE.findall((DOCS / page).read_text()))
        assert named <= read, f"docs/{page} names variables kvguard never reads: {sorted(named - read)}"
        documented |= named
    assert read <= documented, f"variables kvguard reads that no page documents: {sorted(read - documented)}"


# -- the text against the code -----------------------------------------------------------------


def test_architecture_names_every_module() -> None:
    text = (DOCS / "architecture.md").read_text()
    package = [p.relative_to(ROOT).as_posix() for ext in ("*.py", "*.pyi", "*.c", "*.cpp", "*.h")
               for p in (ROOT / "kvguard").rglob(ext)]
    missing = [p for p in package if f"`{p}`" not in text]
    assert not missing, f"modules the architecture page does not name: {missing}"
    named = re.findall(r"`(kvguard/[\w/]+\.(?:py|pyi|c|cpp|h))`", text)
    gone = [p for p in named if not (ROOT / p).exists()]
    assert not gone, f"the architecture page names modules that do not exist: {gone}"


_STRETCH = 20  # characters a quoted message must share, in one piece, with a string in the source


@lru_cache(maxsize=None)
def _source_templates() -> tuple[re.Pattern[str], ...]:
    """kvguard's f-strings with at least 15 literal characters, as patterns (each field: any text)."""
    templates = []
    for path in SOURCES:
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.JoinedStr):
                literal = [v.value if isinstance(v, ast.Constant) and isinstance(v.value, str) else None
                           for v in node.values]
                if sum(len(part) for part in literal if part) >= 15:
                    templates.append(re.compile("".join(re.escape(part) if part is not None else ".+?"
                                                        for part in literal)))
    return tuple(templates)


@lru_cache(maxsize=None)
def _source_stretches() -> frozenset[str]:
    """Every `_STRETCH`-character stretch of the literal text of kvguard's strings (f-string pieces apart)."""
    pieces: list[str] = []
    for path in SOURCES:
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Constant) and isinstance(node.value, str):
                pieces.append(node.value)
            elif isinstance(node, ast.JoinedStr):
                pieces += [v.value for v in node.values if isinstance(v, ast.Constant) and isinstance(v.value, str)]
    return frozenset(p[i:i + _STRETCH] for p in pieces for i in range(len(p) - _STRETCH + 1))


def _quoted_messages(text: str) -> list[str]:
    """The first cell of each table row, when it is one code span: the messages of the messages page."""
    return [m.group(1) for m in re.finditer(r"^\| `([^`]+)` \|", text, re.M)]


def test_quoted_messages_are_kvguard_messages() -> None:
    """Each message shares 20 characters in one piece with a string of the source, or holds
    the whole of one of its f-strings (with any values, `…` included)."""
    text = (DOCS / "messages.md").read_text()
    messages = _quoted_messages(text)
    assert len(messages) >= 30, "the messages page lists its messages as table rows starting with a code span"
    stretches = _source_stretches()
    invented = []
    for message in messages:
        parts = [p.strip() for p in re.split(r"…|\.\.\.", message)]
        longest = max(parts, key=len)
        need = min(_STRETCH, len(longest))
        if need < _STRETCH:
            continue  # too short to tell (`kvguard: …`)
        if any(longest[i:i + _STRETCH] in stretches for i in range(len(longest) - _STRETCH + 1)):
            continue
        if not any(template.search(message) for template in _source_templates()):
            invented.append(message)
    assert not invented, f"messages quoted on docs/messages.md that kvguard's source does not hold: {invented}"


def test_report_fields_are_the_documented_ones(tmp_path: Path) -> None:
    """The reports page's samples write a report file; each of its fields is on the page, and back."""
    _run_page("reports.md", tmp_path)
    records = [json.loads(line) for line in (tmp_path / "reports" / "kvguard-rank0.jsonl").read_text().splitlines()]
    assert [r["record"] for r in records] == ["header", "event", "summary"]
    summary = records[-1]
    fields = set().union(*records, *summary["sites"], summary["sites"][0]["first"], *summary["targets"].values())
    text = (DOCS / "reports.md").read_text()
    undocumented = sorted(f for f in fields if f"`{f}`" not in text)
    assert not undocumented, f"report fields the reports page does not name: {undocumented}"


def test_event_kinds_are_the_documented_ones() -> None:
    """Every kind an event can have (`EventKind`) is in `MutationEvent`'s docstring and in
    docs/reports.md's list, and nothing else is: the three had drifted apart (six, five, four)."""
    from kvguard._report.events import EVENT_KINDS, MutationEvent

    text = (ROOT / "docs" / "reports.md").read_text()
    listed = text[text.index("`kind` (") : text.index("`blocked`,")]
    assert set(re.findall(r'`"(\w+)"`', listed)) == set(EVENT_KINDS)
    docstring = MutationEvent.__doc__ or ""
    said = docstring[docstring.index("ev.kind") : docstring.index("ev.filename")]
    assert set(re.findall(r'"(\w+)"', said.split("(")[0])) == set(EVENT_KINDS)
