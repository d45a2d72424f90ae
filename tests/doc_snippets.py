"""Run every fenced code block of README.md and docs/*.md, as a reader would paste it.

    python tests/doc_snippets.py                      # every page; exit 0 only if every snippet passed
    python tests/doc_snippets.py docs/migration.md    # one page (or several)
    python tests/doc_snippets.py --list               # what would run, and what is marked not runnable
    python tests/run_all.py --docs                    # the same, through the suite's runner

What a block is, by its info string:

``python``
    A program: run as one process, or under ``mpiexec -n N`` (``ranks=N``; the default is 2, as the
    docs describe distributed code), through ``collectives._launcher.job_command`` (MPICH and Open MPI
    alike), in a scratch directory of its own. It passes if every rank exits 0 (``exit=`` otherwise).
``bash``, ``sh``, ``shell``
    Commands: every logical line (``\\`` continues it; ``#`` starts a comment) runs at the repository's
    root; ``python`` is this interpreter, and ``[VAR=value ...] mpiexec -n N ARGS`` goes through
    ``job_command(N, ARGS)``. Each must exit 0 (the last one ``exit=``).
``console``
    ``$ command`` lines, each followed by the output it prints: the command runs as above and the output
    shown must appear in what it prints (see *Output* below).
``text``, or no info string
    Output: the hidden ``snippet-setup`` before it is the (python) program that prints it.

Marking a block, in the Markdown source, in HTML comments right before the fence (hidden in the rendered
page, visible in the source):

``<!-- snippet: skip="the reason" -->``
    Not run; the reason is required and shown by ``--list``.
``<!-- snippet: cheap="mpiexec -n 2 python examples/demo.py" reason="..." -->``
    A block too long to run in CI (it installs, or is the whole test suite), checked in a cheap form: the
    command given, which must be part of what the block runs; ``reason`` says what is left out.
``<!-- snippet: requires=lightning -->``
    Runs where the modules named (comma list) import; elsewhere reported as not runnable, saying why.
``<!-- snippet: ranks=3 exit=nonzero timeout=60 continue save=train.py in=scratch ignore="regex" unordered -->``
    ``ranks``: processes (python blocks; 1 is a plain ``python``). ``exit``: the documented exit status
    (a number, or ``nonzero``). ``timeout``: seconds (default 180). ``continue``: a python block that
    continues the previous python block of the page (its program is that one's followed by this one).
    ``save=NAME``: the program is also saved as NAME in the page's scratch directory, for a later
    ``in=scratch`` shell block (which runs there instead of the repository's root) to run by name.
    ``ignore``: a regex of the parts of the shown output that vary from run to run (timings, paths,
    process ids): they match whatever the same regex matches in the real output. ``unordered``: the
    output's records (a line starting in column 0 and the indented lines under it) may come in any order
    (the lines of several ranks).

``<!-- snippet-setup`` ... ``-->`` (before the fence) and ``<!-- snippet-check`` ... ``-->`` (right after
it): hidden code run before and after the block's own (python for python and output blocks, shell
commands for shell blocks): the glue a snippet needs (a tiny model, data), and asserts on its result.

*Output* is compared as text with the runs of whitespace ignored (so the docs may wrap long lines), the
repository's path shown as ``.``, and ``...`` matching anything (also across lines).

A block that is neither runnable nor marked is a failure, as is a directive that no block follows.
The report names each failing snippet by page and line and shows the tail of its output; the last line is
``N passed, M failed, K not runnable (marked)``.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import importlib.util
import os
import re
import shlex
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))
from collectives._launcher import job_command, job_environment  # noqa: E402  (after the path)

PAGES = ["README.md", *sorted(str(p.relative_to(ROOT)) for p in (ROOT / "docs").glob("*.md"))]
PYTHON = {"python", "py", "python3", "pycon"}
SHELL = {"bash", "sh", "shell"}
OUTPUT = {"", "text", "output"}
FENCE = re.compile(r"^(\s*)(`{3,}|~{3,})\s*([\w+-]*)\s*(.*)$")
DIRECTIVE = re.compile(r"^\s*<!--\s*snippet:(.*?)-->\s*$")
HIDDEN = re.compile(r"^\s*<!--\s*snippet-(setup|check)\s*$")
DEFAULT_TIMEOUT = 180


@dataclass
class Snippet:
    page: str
    line: int  # 1-based line of the opening fence
    lang: str
    code: str
    options: dict = field(default_factory=dict)
    setup: str = ""
    check: str = ""

    @property
    def where(self) -> str:
        return f"{self.page}:{self.line}"


class DocError(Exception):
    pass


def parse_options(text: str, where: str) -> dict:
    opts: dict = {}
    for token in shlex.split(text):
        key, eq, value = token.partition("=")
        if key not in {"skip", "cheap", "reason", "requires", "ranks", "exit", "timeout", "continue", "save", "in", "ignore", "unordered"}:
            raise DocError(f"{where}: unknown snippet option {key!r}")
        opts[key] = value if eq else True
    if "skip" in opts and (opts["skip"] is True or not opts["skip"].strip()):
        raise DocError(f"{where}: skip needs a reason: skip=\"why this block is not run\"")
    return opts


def parse_page(page: str) -> list[Snippet]:
    lines = (ROOT / page).read_text().splitlines()
    snippets: list[Snippet] = []
    pending: dict = {}
    i = 0
    while i < len(lines):
        line = lines[i]
        m = FENCE.match(line)
        if m:
            indent, fence, lang, _rest = m.groups()
            start = i
            body = []
            i += 1
            while i < len(lines) and not (lines[i].strip().startswith(fence) and lines[i].strip().strip(fence[0]) == ""):
                text = lines[i]
                body.append(text[len(indent):] if text.startswith(indent) else text.lstrip())
                i += 1
            i += 1
            snip = Snippet(page, start + 1, lang.lower(), "\n".join(body) + "\n", pending.get("options", {}),
                           pending.get("setup", ""))
            pending = {}
            # a check block right after the fence (blank lines allowed)
            j = i
            while j < len(lines) and not lines[j].strip():
                j += 1
            if j < len(lines) and HIDDEN.match(lines[j]) and HIDDEN.match(lines[j]).group(1) == "check":
                snip.check, i = read_hidden(lines, j, page)
            snippets.append(snip)
            continue
        d = DIRECTIVE.match(line)
        h = HIDDEN.match(line)
        if d:
            pending["options"] = parse_options(d.group(1), f"{page}:{i + 1}")
            i += 1
        elif h:
            if h.group(1) == "check":
                raise DocError(f"{page}:{i + 1}: a snippet-check must follow a code block")
            pending["setup"], i = read_hidden(lines, i, page)
        elif line.strip():
            if pending:
                raise DocError(f"{page}:{i + 1}: a snippet directive or setup must come right before a code block")
            i += 1
        else:
            i += 1
    if pending:
        raise DocError(f"{page}: a snippet directive at the end of the page has no code block")
    return snippets


def read_hidden(lines: list[str], i: int, page: str) -> tuple[str, int]:
    """The body of a ``<!-- snippet-setup``/``snippet-check`` comment starting at line i; the next line."""
    indent = len(lines[i]) - len(lines[i].lstrip())
    body = []
    i += 1
    while i < len(lines) and lines[i].strip() != "-->":
        body.append(lines[i][indent:] if lines[i][:indent].strip() == "" else lines[i])
        i += 1
    if i == len(lines):
        raise DocError(f"{page}: unterminated snippet comment")
    return "\n".join(body) + "\n", i + 1


# -- running --------------------------------------------------------------------------------------------

def environment() -> dict:
    env = job_environment()
    bindir = str(Path(sys.executable).parent)
    env["PATH"] = bindir + os.pathsep + env.get("PATH", "")
    env["DOCS_REPO"] = str(ROOT)  # for hidden setup code that needs the repository (its examples)
    env.setdefault("OMP_NUM_THREADS", "1")
    return env


def run(cmd, *, cwd, env, timeout, shell=False) -> tuple[int, str]:
    proc = subprocess.Popen(cmd, cwd=cwd, env=env, shell=shell, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True,
                            executable="/bin/bash" if shell else None)
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        return 124, (out or "") + f"\nTIMEOUT after {timeout}s: killed the process group\n"
    return proc.returncode, out


def command_line(text: str) -> tuple[list[str] | str, dict, bool]:
    """How to run one pasted command: an argv list (mpiexec through job_command, python as this
    interpreter) or, for anything with shell syntax, the string for bash. Returns (cmd, env, shell)."""
    try:
        tokens = shlex.split(text, comments=True)
    except ValueError:
        return text, {}, True
    if not tokens:
        return [], {}, False
    if any(t in {"&&", "||", "|", ";", ">", "<", ">>", "2>&1"} or t.startswith(("$", "`")) for t in tokens) \
            or any(c in text for c in "|;&><`$("):
        return text, {}, True
    if tokens[0] in {"export", "cd", "source", ".", "set", "unset"}:  # shell builtins
        return text, {}, True
    env = {}
    while tokens and re.fullmatch(r"[A-Za-z_]\w*=.*", tokens[0]):
        k, _, v = tokens.pop(0).partition("=")
        env[k] = v
    if tokens and tokens[0] in {"mpiexec", "mpirun"}:
        if len(tokens) < 3 or tokens[1] not in {"-n", "-np"}:
            raise DocError(f"cannot read the mpiexec command {text!r} (write mpiexec -n N ...)")
        n, rest = int(tokens[2]), tokens[3:]
        rest = [sys.executable if (k == 0 and a in {"python", "python3"}) else a for k, a in enumerate(rest)]
        return job_command(n, rest), env, False
    if tokens and tokens[0] in {"python", "python3"}:
        tokens[0] = sys.executable
    return tokens, env, False


def logical_lines(code: str) -> list[str]:
    out, cur = [], ""
    for line in code.splitlines():
        if line.rstrip().endswith("\\"):
            cur += line.rstrip()[:-1] + " "
            continue
        cur += line
        if cur.strip() and not cur.strip().startswith("#"):
            out.append(cur.strip())
        cur = ""
    return out


def exit_ok(rc: int, expected) -> bool:
    if expected in (None, True):
        return rc == 0
    if expected == "nonzero":
        return rc != 0
    return rc == int(expected)


def output_regex(expected: str, ignore: str | None) -> re.Pattern:
    pieces = []
    pos = 0
    spans = [(m.start(), m.end()) for m in re.finditer(ignore, expected)] if ignore else []
    for a, b in spans:
        pieces.append(literal_regex(expected[pos:a]))
        pieces.append(f"(?:{ignore})")
        pos = b
    pieces.append(literal_regex(expected[pos:]))
    return re.compile("".join(pieces), re.DOTALL)


def literal_regex(text: str) -> str:
    parts = []
    for k, chunk in enumerate(text.split("...")):
        if k:
            parts.append(".*?")
        words = chunk.split()
        lead = r"\s*" if chunk[:1].isspace() else ""
        trail = r"\s*" if chunk[-1:].isspace() else ""
        parts.append(lead + r"\s+".join(re.escape(w) for w in words) + trail)
    return "".join(parts)


def records(expected: str) -> list[str]:
    """The output's records: a line starting in column 0 with the indented lines under it."""
    recs: list[str] = []
    for line in expected.splitlines():
        if not line.strip():
            continue
        if line[:1].isspace() and recs:
            recs[-1] += "\n" + line
        else:
            recs.append(line)
    return recs


def compare(expected: str, actual: str, opts: dict) -> str | None:
    """None if the shown output matches what ran, else a description of the first difference."""
    actual = actual.replace(str(ROOT) + "/", "./").replace(str(ROOT), ".")
    ignore = opts.get("ignore")
    chunks = records(expected) if opts.get("unordered") else [expected]
    for chunk in chunks:
        if not chunk.strip() or chunk.strip() == "...":
            continue
        if not output_regex(chunk, ignore).search(actual):
            # name the first line of the chunk that does not match, for a readable report
            for line in chunk.splitlines():
                if line.strip() and line.strip() != "..." and not output_regex(line, ignore).search(actual):
                    return f"the shown output line {line.strip()!r} is not in what it printed"
            return f"the shown output {chunk.strip()[:200]!r} is not in what it printed (in this order)"
    return None


class Page:
    """The state of one page's run: its scratch directory and the last python program."""

    def __init__(self, page: str, scratch: Path):
        self.page = page
        self.scratch = scratch
        self.last_program = ""


def run_python(snip: Snippet, page: Page, env: dict, program: str | None = None) -> tuple[bool, str]:
    opts = snip.options
    if program is None:
        program = snip.setup + snip.code + snip.check
        if opts.get("continue"):
            if not page.last_program:
                raise DocError(f"{snip.where}: continue, but no python block before it on the page")
            program = page.last_program + program
        page.last_program = program
    path = page.scratch / f"snippet_{snip.line}.py"
    path.write_text(program)
    if opts.get("save"):
        (page.scratch / opts["save"]).write_text(program)
    ranks = int(opts.get("ranks", 2))
    argv = [sys.executable, str(path)]
    cmd = argv if ranks == 1 else job_command(ranks, argv)
    rc, out = run(cmd, cwd=page.scratch, env=env, timeout=int(opts.get("timeout", DEFAULT_TIMEOUT)))
    if not exit_ok(rc, opts.get("exit")):
        return False, f"exit status {rc} (documented: {opts.get('exit', 0)})\n{out}"
    return True, out


def run_commands(commands: list[tuple[str, str]], snip: Snippet, page: Page, env: dict) -> tuple[bool, str]:
    """commands: (command, expected output). Every command must exit 0, the last one as documented."""
    opts = snip.options
    cwd = page.scratch if opts.get("in") == "scratch" else ROOT
    log = []
    if snip.setup.strip():
        rc, out = run(snip.setup, cwd=cwd, env=env, timeout=120, shell=True)
        if rc:
            return False, f"hidden setup exited {rc}\n{out}"
    for k, (text, expected) in enumerate(commands):
        cmd, extra, shell = command_line(text)
        if not cmd:
            continue
        rc, out = run(cmd, cwd=cwd, env={**env, **extra}, timeout=int(opts.get("timeout", DEFAULT_TIMEOUT)),
                      shell=shell)
        log.append(f"$ {text}\n{out}")
        last = k == len(commands) - 1
        if not exit_ok(rc, opts.get("exit") if last else None):
            want = opts.get("exit", 0) if last else 0
            return False, f"`{text}` exited {rc} (documented: {want})\n{out}"
        if expected.strip():
            diff = compare(expected, out, opts)
            if diff:
                return False, f"`{text}`: {diff}\n--- it printed ---\n{out}"
    if snip.check.strip():
        rc, out = run(snip.check, cwd=cwd, env=env, timeout=120, shell=True)
        if rc:
            return False, f"hidden check exited {rc}\n{out}"
    return True, "\n".join(log)


def console_commands(code: str) -> list[tuple[str, str]]:
    cmds: list[tuple[str, str]] = []
    for line in code.splitlines():
        if line.startswith("$ "):
            cmds.append((line[2:], ""))
        elif cmds:
            cmds[-1] = (cmds[-1][0], cmds[-1][1] + line + "\n")
        elif line.strip():
            raise DocError("a console block must start with a `$ command` line")
    # continuation lines of a command
    out = []
    for text, expected in cmds:
        while text.rstrip().endswith("\\") and expected:
            first, _, expected = expected.partition("\n")
            text = text.rstrip()[:-1] + " " + first.strip()
        out.append((text, expected))
    return out


def run_snippet(snip: Snippet, page: Page, env: dict) -> tuple[str, str]:
    """('pass' | 'fail' | 'skip', detail)."""
    opts = snip.options
    if "skip" in opts:
        return "skip", opts["skip"]
    missing = [m for m in str(opts.get("requires", "")).split(",") if m and importlib.util.find_spec(m) is None]
    if missing:
        return "skip", f"needs {', '.join(missing)}, not installed here (it runs where it is)"
    try:
        if "cheap" in opts:  # a command too long for CI, checked by a cheaper one it contains
            if opts["cheap"] not in snip.code or not opts.get("reason"):
                raise DocError(f"{snip.where}: cheap=\"...\" must be a command of the block, with a reason=")
            ok, out = run_commands([(opts["cheap"], "")], snip, page, env)
        elif snip.lang in PYTHON:
            ok, out = run_python(snip, page, env)
        elif snip.lang in SHELL:
            ok, out = run_commands([(c, "") for c in logical_lines(snip.code)], snip, page, env)
        elif snip.lang == "console":
            ok, out = run_commands(console_commands(snip.code), snip, page, env)
        elif snip.lang in OUTPUT:
            if not snip.setup.strip():
                return "fail", (f"an output block ({snip.lang or 'no info string'}) without the program that "
                                "prints it (a snippet-setup before it) and not marked skip=\"reason\"")
            ok, out = run_python(snip, page, env, program=snip.setup + snip.check)
            if ok:
                diff = compare(snip.code, out, opts)
                if diff:
                    ok, out = False, f"{diff}\n--- it printed ---\n{out}"
        else:
            return "fail", f"a {snip.lang!r} block is not runnable: mark it skip=\"reason\""
    except DocError as e:
        return "fail", str(e)
    return ("pass" if ok else "fail"), out


def run_page(page_name: str, env: dict, listing: bool = False, verbose: bool = False) -> tuple[int, int, int, str]:
    """Run (or, ``listing``, list) every snippet of one page in a scratch directory of its own:
    ``(passed, failed, skipped, report)``, the report's lines in the page's order."""
    lines: list[str] = []
    passed = failed = skipped = 0
    try:
        snippets = parse_page(page_name)
    except DocError as e:
        return 0, 1, 0, f"FAIL {e}\n"
    with tempfile.TemporaryDirectory(prefix="doc-snippets-") as scratch:
        page = Page(page_name, Path(scratch))
        for snip in snippets:
            if listing:
                o = snip.options
                what = (f"skip: {o['skip']}" if "skip" in o else
                        f"cheap form: {o['cheap']} ({o.get('reason', '')})" if "cheap" in o else
                        f"run ({', '.join(f'{k}={v}' for k, v in o.items()) or 'defaults'})")
                lines.append(f"{snip.where:<36} {snip.lang or '-':<8} {what}")
                continue
            t0 = time.monotonic()
            status, detail = run_snippet(snip, page, env)
            dt = time.monotonic() - t0
            if status == "pass":
                passed += 1
                lines.append(f"ok   {snip.where} ({snip.lang}, {dt:.1f} s)")
                if verbose:
                    lines.append(detail)
            elif status == "skip":
                skipped += 1
                lines.append(f"skip {snip.where} ({snip.lang}): {detail}")
            else:
                failed += 1
                tail = detail if len(detail) < 6000 else "...\n" + detail[-6000:]
                lines.append(f"FAIL {snip.where} ({snip.lang or 'no info string'}, {dt:.1f} s): {tail.rstrip()}\n")
    return passed, failed, skipped, "".join(line + "\n" for line in lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("pages", nargs="*", help="pages to run (default: README.md and docs/*.md)")
    ap.add_argument("--list", action="store_true", help="list the snippets and what is done with each")
    ap.add_argument("-v", "--verbose", action="store_true", help="print every snippet's output")
    ap.add_argument("-j", "--jobs", type=int, default=1,
                    help="pages run at once (default 1: most blocks are 2-rank jobs that keep 2 cores busy, so "
                         "on CI's 2 cores two pages at a time took as long, 174 s against 157-190 s); a page's "
                         "own snippets always run one after another, in its order, and its report is printed whole")
    args = ap.parse_args(argv)
    pages = [str(Path(p).resolve().relative_to(ROOT)) if Path(p).exists() else p for p in (args.pages or PAGES)]
    env = environment()
    start = time.monotonic()
    if args.list or args.jobs <= 1:
        results = [run_page(p, env, args.list, args.verbose) for p in pages]
        for *_, report in results:
            print(report, end="", flush=True)
    else:
        # the pages with the most runnable snippets first, so that the long ones do not end the run alone;
        # pages share nothing but the repository (each has its own scratch directory)
        order = sorted(pages, key=lambda p: -sum("skip" not in s.options for s in _parsed(p)))
        with concurrent.futures.ThreadPoolExecutor(args.jobs) as pool:
            futures = [pool.submit(run_page, p, env, False, args.verbose) for p in order]
            results = []
            for future in concurrent.futures.as_completed(futures):
                results.append(future.result())
                print(results[-1][3], end="", flush=True)
    if args.list:
        return 0
    passed, failed, skipped = (sum(r[k] for r in results) for k in range(3))
    print(f"\ndocs snippets: {time.monotonic() - start:.0f} s")
    print(f"{passed} passed, {failed} failed, {skipped} not runnable (marked)")
    return 0 if failed == 0 and passed > 0 else 1


def _parsed(page_name: str) -> list:
    try:
        return parse_page(page_name)
    except DocError:
        return []


if __name__ == "__main__":
    sys.exit(main())
