"""Every code block of README.md and docs/ runs as its page shows it (the rules are in docs/contributing.md).

- A page's ```python blocks run in order in one namespace, as ``python`` started at the repository root runs them: a
  page is one session, and its first block stands alone (it imports what it uses).
- A ```text block right after a ```python block is that block's output: what it printed (and, for a block that must
  raise, the exception as Python prints its last line), compared after normalising addresses (``0x7f...``) and
  trailing spaces. A line ``...`` stands for any lines, and ``...`` inside a line for any text.
- A block's ``title="..."`` says what it needs and what it does, in clauses separated by ``;``: ``needs 2 GPUs``
  (or ``needs a GPU``) and ``needs <package>`` skip it where that is missing; ``raises <Exception>`` makes raising
  that exception (or a subclass) its expected outcome and not raising it a failure.
- ```bash blocks are not run (they take minutes: builds, installs, the demo), but what they name must exist: make
  targets, files of the repository, ``python -m dpfast`` commands, ``DPFAST_*`` switches; and no command installs
  dpfast from a package index, which does not have it.
"""

from __future__ import annotations

import contextlib
import importlib.util
import io
import os
import pathlib
import re
import shlex
import sys
import traceback
import types
from dataclasses import dataclass, field

import pytest
import torch

from ddp_harness import free_port

ROOT = pathlib.Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"
PAGES = [ROOT / "README.md", *sorted(DOCS.rglob("*.md"))] if DOCS.is_dir() else [ROOT / "README.md"]

FENCE = re.compile(r"^(?P<indent> *)(?P<fence>`{3,}|~{3,})(?P<lang>[\w+-]*)[ \t]*(?P<attrs>.*)$")
TITLE = re.compile(r'title="([^"]*)"')


@dataclass
class Block:
    page: pathlib.Path
    line: int  # 1-based line of the opening fence
    lang: str
    title: str
    code: str
    end: int = 0  # 1-based line of the closing fence
    output: Block | None = None  # the ```text block that follows a python block
    clauses: list[str] = field(default_factory=list)

    def where(self) -> str:
        return f"{self.page.relative_to(ROOT)}:{self.line}"

    def needs(self) -> list[str]:
        return [c[len("needs ") :] for c in self.clauses if c.startswith("needs ")]

    def raises(self) -> str | None:
        found = [c[len("raises ") :] for c in self.clauses if c.startswith("raises ")]
        return found[0] if found else None


def parse_blocks(page: pathlib.Path) -> list[Block]:
    """The fenced code blocks of a Markdown page (also those indented inside list items), in order."""
    lines = page.read_text().splitlines()
    blocks: list[Block] = []
    i = 0
    while i < len(lines):
        m = FENCE.match(lines[i])
        if not m:
            i += 1
            continue
        indent, fence = len(m["indent"]), m["fence"]
        start, body = i, []
        i += 1
        while i < len(lines) and not re.match(
            rf"^ {{0,{indent + 3}}}{re.escape(fence[0])}{{{len(fence)},}}\s*$", lines[i]
        ):
            body.append(lines[i][indent:] if lines[i][:indent].strip() == "" else lines[i])
            i += 1
        title = TITLE.search(m["attrs"])
        block = Block(page, start + 1, m["lang"].lower(), title[1] if title else "", "\n".join(body) + "\n", i + 1)
        block.clauses = [c.strip() for c in block.title.split(";") if c.strip()]
        between = lines[blocks[-1].end : start] if blocks else []
        if block.lang == "text" and blocks and blocks[-1].lang == "python" and not "".join(between).strip():
            blocks[-1].output = block
        blocks.append(block)
        i += 1
    return blocks


# ---- what a block needs ----------------------------------------------------------------------------------------------


def _missing(need: str) -> str | None:
    """Why ``need`` ("2 GPUs", "a GPU", "transformers") is not met here, or None."""
    gpus = re.fullmatch(r"(a|\d+) GPUs?", need)
    if gpus:
        n = 1 if gpus[1] == "a" else int(gpus[1])
        have = torch.cuda.device_count() if torch.cuda.is_available() else 0
        return None if have >= n else f"needs {need}, this machine has {have}"
    if re.fullmatch(r"[\w.-]+", need):
        return None if importlib.util.find_spec(need) is not None else f"needs {need}, which is not installed"
    raise AssertionError(f"unknown need {need!r}: say `needs 2 GPUs`, `needs a GPU` or `needs <package>`")


# ---- comparing output ------------------------------------------------------------------------------------------------


def _normalised(text: str) -> str:
    text = re.sub(r"0x[0-9a-fA-F]+", "0x...", text)
    return "\n".join(line.rstrip() for line in text.strip("\n").splitlines())


def _pattern(expected: str) -> re.Pattern:
    parts = []
    for line in _normalised(expected).splitlines():
        if line.strip() == "...":
            parts.append(r"(?:[^\n]*\n)*?")
        else:
            parts.append(".*?".join(re.escape(p) for p in line.split("...")) + r"\n")
    return re.compile("".join(parts))


def output_matches(expected: str, got: str) -> bool:
    return _pattern(expected).fullmatch(_normalised(got) + "\n") is not None


# ---- running a page --------------------------------------------------------------------------------------------------


def _is_a(exc: BaseException, name: str) -> bool:
    return any(name in (c.__name__, f"{c.__module__}.{c.__qualname__}") for c in type(exc).__mro__)


def run_block(block: Block, namespace: dict) -> None:
    expected_exc = block.raises()
    out = io.StringIO()
    raised: BaseException | None = None
    code = compile(block.code, f"{block.where()} (```python)", "exec")
    with contextlib.redirect_stdout(out):
        try:
            exec(code, namespace)
        except Exception as exc:
            raised = exc
    printed = out.getvalue()
    if raised is not None and (expected_exc is None or not _is_a(raised, expected_exc)):
        detail = "".join(traceback.format_exception(type(raised), raised, raised.__traceback__))
        pytest.fail(f"{block.where()}: the block raised\n{detail}\nprinted:\n{printed}", pytrace=False)
    if expected_exc is not None:
        assert raised is not None, f"{block.where()}: the block says `raises {expected_exc}`, but it raised nothing"
        printed += "".join(traceback.format_exception_only(type(raised), raised))
    if block.output is not None and not output_matches(block.output.code, printed):
        pytest.fail(
            f"{block.where()}: the output differs from the ```text block at line {block.output.line}\n"
            f"--- the page shows:\n{block.output.code}--- the block printed:\n{printed}",
            pytrace=False,
        )


def run_page(page: pathlib.Path) -> list[str]:
    """Runs the page's python blocks in order; returns why blocks were skipped."""
    skipped = []
    name = "dpfast_docs_" + re.sub(r"\W", "_", str(page.relative_to(ROOT)))
    module = types.ModuleType(name)  # a real module, so dataclasses and pickling find the page's classes
    sys.modules[name] = module
    old_cwd, old_env = os.getcwd(), dict(os.environ)
    os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = "127.0.0.1", str(free_port())  # blocks setdefault them
    os.chdir(ROOT)
    sys.path.insert(0, str(ROOT))  # as `python` started in the checkout: `from examples.rrn import RRN` works
    torch.manual_seed(0)
    try:
        for block in parse_blocks(page):
            if block.lang != "python":
                continue
            why = [w for w in map(_missing, block.needs()) if w]
            if why:
                skipped.append(f"{block.where()}: {why[0]}")
                continue
            run_block(block, module.__dict__)
    finally:
        os.chdir(old_cwd)
        sys.path.remove(str(ROOT))
        os.environ.clear()
        os.environ.update(old_env)
        sys.modules.pop(name, None)
        if torch.distributed.is_available() and torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()  # a block that failed before its own cleanup
    return skipped


def _page_id(page: pathlib.Path) -> str:
    return str(page.relative_to(ROOT))


PAGES_WITH_CODE = [p for p in PAGES if any(b.lang == "python" for b in parse_blocks(p))]


@pytest.mark.no_plan_check  # the pages' own blocks are what is checked; they may call DataParallel in any way
@pytest.mark.parametrize("page", PAGES_WITH_CODE, ids=_page_id)
def test_python_blocks_run_as_shown(page):
    skipped = run_page(page)
    if skipped and len(skipped) == sum(b.lang == "python" for b in parse_blocks(page)):
        pytest.skip("; ".join(skipped))


# ---- shell blocks: what they name exists -----------------------------------------------------------------------------


def _make_targets() -> set[str]:
    text = (ROOT / "Makefile").read_text()
    return set(re.findall(r"^([\w.-]+):(?!=)", text, re.M))


def _dpfast_commands() -> set[str]:
    from dpfast.__main__ import build_parser

    parser = build_parser()
    sub = next(a for a in parser._actions if a.__class__.__name__ == "_SubParsersAction")
    return set(sub.choices)


def _switches() -> str:
    sources = [ROOT / "setup.py", ROOT / "Makefile", *sorted((ROOT / "dpfast").rglob("*.py"))]
    sources += sorted((ROOT / "benchmarks").glob("*.sh")) + sorted((ROOT / "tests").glob("*.sh"))
    return "\n".join(p.read_text() for p in sources if p.is_file())


SHELL_BLOCKS = [b for p in PAGES for b in parse_blocks(p) if b.lang in ("bash", "sh", "shell", "console")]


@pytest.mark.parametrize("block", SHELL_BLOCKS, ids=lambda b: b.where())
def test_shell_blocks_name_what_exists(block):
    targets, switches = _make_targets(), _switches()
    for raw in block.code.splitlines():
        line = re.sub(r"(^|\s)#.*$", "", raw).strip()
        if not line:
            continue
        words = shlex.split(line)
        if words[0] == "make":
            for w in words[1:]:
                if "=" not in w and not w.startswith("-"):
                    assert w in targets, f"{block.where()}: `{line}`: the Makefile has no target {w!r}"
        for i in range(len(words) - 2):
            if words[i : i + 2] == ["-m", "dpfast"] and not words[i + 2].startswith("-"):
                assert words[i + 2] in _dpfast_commands(), f"{block.where()}: `{line}`: no `-m dpfast {words[i + 2]}`"
        if "pip" in words and "install" in words:
            assert not any(re.fullmatch(r"['\"]?dpfast(\[[\w,]+\])?['\"]?", w) for w in words), (
                f"{block.where()}: `{line}` installs dpfast from a package index, which does not have it"
            )
        for w in words:
            if re.fullmatch(r"[\w./-]+/[\w.-]+\.(py|sh|md|txt|json)", w) and not w.startswith("/"):
                assert (ROOT / w).exists(), f"{block.where()}: `{line}` names {w}, which does not exist"
            for var in re.findall(r"\b(DPFAST_\w+|PYTEST_ARGS|FUZZ_\w+)=", w):
                assert var in switches, f"{block.where()}: `{line}`: nothing reads {var}"


# ---- the harness itself ----------------------------------------------------------------------------------------------


def test_output_comparison_normalises_what_must_vary_and_nothing_else():
    assert output_matches("<object at 0x7f00aa>\nx  \n", "<object at 0x55d1>\nx\n")
    assert output_matches("first\n...\nlast", "first\na\nb\nlast\n")
    assert output_matches("first\n...\nlast", "first\nlast\n")
    assert output_matches("B = ... split", "B = 10 split")
    assert not output_matches("B = 10", "B = 11")
    assert not output_matches("a\nb", "a\n")
    assert not output_matches("a", "a\nb\n")


def test_blocks_are_parsed_with_their_titles_and_outputs(tmp_path):
    page = tmp_path / "p.md"
    page.write_text(
        '# t\n\n```python title="needs 2 GPUs; raises ValueError"\nx = 1\n```\n\n```text\nout\n```\n\n'
        "- item\n\n  ```python\n  y = 2\n  ```\n"
    )
    blocks = parse_blocks(page)
    assert [b.lang for b in blocks] == ["python", "text", "python"]
    assert blocks[0].needs() == ["2 GPUs"] and blocks[0].raises() == "ValueError"
    assert blocks[0].output is blocks[1] and blocks[0].code == "x = 1\n"
    assert blocks[2].code == "y = 2\n" and blocks[2].output is None


def test_the_api_reference_renders_every_public_name():
    """Each public module has its page (``::: dpfast.ops`` renders what its ``__all__`` lists), and every public
    name of ``dpfast`` itself has its own ``::: dpfast.X`` there (or an anchor naming it)."""
    import dpfast

    api = {p.name: p.read_text() for p in (DOCS / "api").glob("*.md")} if DOCS.is_dir() else {}
    if not api:
        pytest.skip("docs/ is not in this tree")
    text = "\n".join(api.values())
    for module in (
        "dpfast.ops",
        "dpfast.reference",
        "dpfast.nn",
        "dpfast.distributed",
        "dpfast.integrations.transformers",
        "dpfast.integrations.lightning",
    ):
        assert re.search(rf"^::: {re.escape(module)}$", text, re.M), f"no API page renders {module}"
    for name in dpfast.__all__:
        if isinstance(getattr(dpfast, name), types.ModuleType):
            continue
        assert (
            re.search(rf"^::: dpfast\.{name}$", api["dpfast.md"], re.M) or f"{{#dpfast.{name}}}" in api["dpfast.md"]
        ), f"docs/api/dpfast.md does not render dpfast.{name}"


def test_class_pages_list_public_bases_only():
    """The API page showed ``Bases: SettingsAttributes, DataParallel``: a private mixin on the public page."""
    griffe = pytest.importorskip("griffe")
    if not (DOCS / "_griffe_roles.py").is_file():
        pytest.skip("docs/ is not in this tree")
    extensions = griffe.load_extensions(f"{DOCS / '_griffe_roles.py'}:PublicBases")
    package = griffe.load("dpfast", search_paths=[str(ROOT)], extensions=extensions)
    bases = {name: [str(b.canonical_path) for b in package[name].bases] for name in ("DataParallel", "ScatterError")}
    assert bases == {"DataParallel": ["torch.nn.DataParallel"], "ScatterError": ["ValueError"]}
    ddp = package["distributed.DistributedDataParallel"]
    assert [str(b.canonical_path) for b in ddp.bases] == ["torch.nn.parallel.DistributedDataParallel"]


def test_the_rebuild_hint_never_installs_dpfast_from_an_index(monkeypatch):
    """What ``import dpfast`` and ``python -m dpfast info`` tell an installed (not checked-out) dpfast to run: there is
    no dpfast on a package index, so ``pip install ... --no-binary dpfast dpfast`` would find nothing."""
    from dpfast.ext import loader

    monkeypatch.setattr(loader, "_IN_CHECKOUT", False)
    hint = loader._rebuild_command()
    words = [w.strip("`'\"()") for w in hint.split()]
    assert "--no-binary" not in words and "dpfast" not in words, hint
    assert "checkout or sdist" in hint
