"""The documentation site: it builds in strict mode, its generated pages match the code, and
a real browser shows it (headless Chromium from Debian's packages; skipped without it).

One strict build per run (about 10 s) is shared by the tests of this module.
"""

from __future__ import annotations

import base64
import contextlib
import functools
import http.server
import importlib.util
import io
import json
import os
import re
import shutil
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType
from unittest import mock
from urllib.parse import quote

import pytest
from _unit_helpers import REPO, run_cli
from docs_blocks import blocks_of, pages

from keras_distrib.launcher.cli import arg_parser


def _load_hook(name: str) -> ModuleType:
    spec = importlib.util.spec_from_file_location(f"keras_distrib_docs_{name}", REPO / "docs" / "hooks" / f"{name}.py")
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


errors = _load_hook("errors")  # docs/hooks/errors.py: the error catalogue

BUILD_TIMEOUT = 300


@pytest.fixture(scope="module")
def site(tmp_path_factory: pytest.TempPathFactory) -> Path:
    pytest.importorskip("mkdocs", reason="the [docs] extra is not installed (make install installs it)")
    pytest.importorskip("material", reason="the [docs] extra is not installed (make install installs it)")
    out = tmp_path_factory.mktemp("site")
    done = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(out)],
        cwd=REPO, capture_output=True, text=True, timeout=BUILD_TIMEOUT,
        env={**os.environ, "NO_MKDOCS_2_WARNING": "1"},
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-5000:]
    assert "WARNING" not in done.stderr, done.stderr[-5000:]
    return out


def html_of(site: Path, page: str) -> str:
    """The built HTML of a docs page (``porting.md`` -> ``porting/index.html``)."""
    stem = page.removesuffix(".md")
    return (site / ("index.html" if stem == "index" else f"{stem}/index.html")).read_text()


def test_every_code_block_is_fenced_and_marked(site: Path) -> None:
    """An indented code block has no marker line: every <pre> on a page must come from a fence."""
    for page in pages():
        rel = page.relative_to(REPO / "docs").as_posix() if page.parent != REPO else None
        if rel in (None, "README.md", "reference/api.md"):  # READMEs are not pages; the API page shows signatures
            continue
        fences = len(blocks_of(page))
        pres = html_of(site, rel).count("<pre")
        assert pres == fences, f"{rel}: {pres} code blocks on the page, {fences} fenced blocks in the source"


def test_reference_lists_every_flag_and_key(site: Path) -> None:
    page = html_of(site, "reference/cli.md")
    for action in [*arg_parser("x")._actions, *arg_parser("x", local=True)._actions]:
        for flag in action.option_strings:
            if flag not in ("-h", "--help"):
                assert flag in page, flag
    from dataclasses import fields

    from keras_distrib.launcher.options import Options

    for f in fields(Options):
        assert f"<code>{f.name.replace('_', '-')}</code>" in page, f.name


def test_schedulers_page_lists_every_parser(site: Path) -> None:
    from cluster_parsers.registry import BUILTIN_PARSERS

    page = html_of(site, "schedulers.md")
    for cls in BUILTIN_PARSERS:
        assert f"<code>{cls.name}</code>" in page and all(v in page for v in cls.detect_vars), cls.name
        assert cls.agent_launch_hint.split(":")[-1].split("...")[0].strip() in page, cls.name


def test_every_variable_the_code_reads_is_documented(site: Path) -> None:
    names = set()
    for package in ("keras_distrib", "cluster_parsers"):
        for path in (REPO / package).rglob("*.py"):
            names |= set(re.findall(r"\bKERAS_DISTRIB_[A-Z_]+\b", path.read_text()))
    text = "".join(p.read_text() for p in site.rglob("*.html"))
    missing = sorted(n for n in names if n not in text)
    assert names and not missing, (f"the code reads {missing} but no page names them: add them to the table "
                                   "of docs/reference/cli.md (or to the page of their feature)")


def test_api_reference_shows_the_public_functions(site: Path) -> None:
    from keras_distrib import _LAZY

    page = html_of(site, "reference/api.md")
    for module, attr in _LAZY.values():
        assert f'id="{module}.{attr}"' in page, f"{module}.{attr}"
    for name in ("keras_distrib.trainers.fit", "keras_distrib.strategies.strategy", "keras_distrib.data.FileSource",
                 "cluster_parsers.parse_job", "keras_distrib.jax_distribution.distribution"):
        assert f'id="{name}"' in page, name


# -- the error catalogue (docs/hooks/errors.py) ------------------------------------------


def test_every_error_has_a_cause_and_a_fix() -> None:
    entries, unreadable = errors.scan()
    assert not unreadable, "messages the catalogue cannot read (write them as text): " + "; ".join(
        f"{u.where}: {u.source[:120]}" for u in unreadable)
    missing = errors.missing_fixes(entries)
    assert not missing, ("errors without a HINT: add 'HINT: <the fix>' to the message, or an entry to "
                         "docs/hooks/fixes.yml:\n" + "\n".join(f"{e.key!r}: ...   # {e.where}" for e in missing))
    assert len([e for e in entries if e.kind == "error"]) >= 100


def test_fixes_file_has_no_stale_entries() -> None:
    keys = {e.key for e in errors.scan()[0]}
    stale = sorted(set(errors.load_fixes()) - keys)
    assert not stale, f"docs/hooks/fixes.yml entries for messages that no longer exist: {stale}"


@pytest.fixture(scope="module")
def real_errors(tmp_path_factory: pytest.TempPathFactory) -> list[str]:
    """Error lines the launcher prints for a few user mistakes (no TensorFlow)."""
    tmp_path = tmp_path_factory.mktemp("errors")
    bad = tmp_path / "bad.yaml"
    bad.write_text("layout: 5\n")
    unknown = tmp_path / "unknown.yaml"
    unknown.write_text("layuot: allreduce\n")
    slurm = {"SLURM_JOB_ID": "7", "SLURM_JOB_NODELIST": "n[1-2]", "SLURM_NNODES": "2", "SLURM_NODEID": "0"}
    runs = [
        run_cli({}, "--config", str(bad), "--plan"),
        run_cli({}, "--config", str(unknown), "--plan"),
        run_cli({}, "--checkpoint-every", "often", "--plan", module="keras_distrib.local"),
        run_cli({}, "--plan", module="keras_distrib.slurm"),
        run_cli(slurm, "--plan", "--port-base", "70000", module="keras_distrib.slurm"),
    ]
    lines = [r.stderr.strip().splitlines()[-1] for r in runs]
    assert all(line.startswith("keras_distrib: error:") and "HINT:" in line for line in lines), lines
    return [line.removeprefix("keras_distrib: error: ") for line in lines]


def test_real_error_lines_match_their_catalogue_entry(real_errors: list[str], tmp_path: Path) -> None:
    """The printed lines of the command line's bad-input corpus (tests/unit/test_cli.py) and of
    the cases above each read as one catalogue entry, so searching the page finds them."""
    from test_cli import BAD_INPUT, CONFIG_FILES, UNEQUAL_GPUS

    from keras_distrib.launcher import cli

    (tmp_path / "gpus.yaml").write_text(UNEQUAL_GPUS)
    for name, text in CONFIG_FILES.items():
        (tmp_path / name).write_text(text)
    (tmp_path / "binary.yaml").write_bytes(bytes(range(256)))
    lines = list(real_errors)
    for _, module, env, args, _ in BAD_INPUT:
        fill = {k: v.replace("{tmp}", str(tmp_path)) for k, v in env.items()}
        argv = ["--plan", "--format", "json", *(a.replace("{tmp}", str(tmp_path)) for a in args)]
        entry = module.removeprefix("keras_distrib").lstrip(".")
        err = io.StringIO()
        with mock.patch.dict(os.environ, {"PATH": os.environ.get("PATH", ""), **fill}, clear=True), \
                contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(err):
            code = cli.run(argv, entry if entry not in ("", "local") else None, module, local=entry == "local")
        assert code == 2 and err.getvalue().startswith("keras_distrib: error: "), (module, argv, err.getvalue())
        lines.append(err.getvalue().strip().removeprefix("keras_distrib: error: "))
    entries = errors.scan()[0]
    unmatched = [line for line in lines if not any(e.pattern().fullmatch(line) for e in entries)]
    assert not unmatched, f"no catalogue entry reads as: {unmatched}"
    assert len(lines) >= 30


# -- in a real browser ------------------------------------------------------------------


def chromium_binary() -> str | None:
    """Debian's chromium; its /usr/bin wrapper script closes the DevTools pipe, so the binary itself."""
    for candidate in ("/usr/lib/chromium/chromium", shutil.which("chromium"), shutil.which("chromium-browser")):
        if candidate and os.access(candidate, os.X_OK):
            return candidate
    return None


class Chromium:
    """Headless Chromium driven over the DevTools protocol on a pipe (fds 3 and 4): no extra package."""

    def __init__(self, binary: str, profile: Path) -> None:
        to_browser_r, self._to_browser_w = os.pipe()
        self._from_browser_r, from_browser_w = os.pipe()

        def child_fds() -> None:  # os.pipe's fds are close-on-exec: dup2 onto 3 and 4 clears that
            a, b = os.dup(to_browser_r), os.dup(from_browser_w)
            os.dup2(a, 3)
            os.dup2(b, 4)

        self.proc = subprocess.Popen(
            [binary, "--headless", "--no-sandbox", "--disable-gpu", "--remote-debugging-pipe", "--no-first-run",
             f"--user-data-dir={profile}", "--window-size=1280,1000", "about:blank"],
            preexec_fn=child_fds, close_fds=False, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        )
        os.close(to_browser_r)
        os.close(from_browser_w)
        self._buffer = b""
        self._id = 0

    def call(self, method: str, session: str | None = None, timeout: float = 60, **params: object) -> dict:
        self._id += 1
        message: dict[str, object] = {"id": self._id, "method": method, "params": params}
        if session:
            message["sessionId"] = session
        os.write(self._to_browser_w, json.dumps(message).encode() + b"\0")
        deadline = time.monotonic() + timeout
        while True:
            while b"\0" not in self._buffer:
                if time.monotonic() > deadline:
                    raise TimeoutError(f"chromium did not answer {method} within {timeout} s")
                chunk = os.read(self._from_browser_r, 1 << 16)
                if not chunk:
                    raise RuntimeError("chromium closed the DevTools pipe")
                self._buffer += chunk
            raw, self._buffer = self._buffer.split(b"\0", 1)
            reply = json.loads(raw)
            if reply.get("id") == self._id:
                if "error" in reply:
                    raise RuntimeError(f"{method}: {reply['error']}")
                return reply["result"]

    def open(self, url: str) -> str:
        """A new tab at ``url``, loaded; returns its session."""
        target = self.call("Target.createTarget", url="about:blank")["targetId"]
        session = self.call("Target.attachToTarget", targetId=target, flatten=True)["sessionId"]
        self.call("Page.enable", session)
        self.call("Page.navigate", session, url=url)
        self.wait_for(session, "document.readyState === 'complete'")
        return session

    def evaluate(self, session: str, expression: str) -> object:
        return self.call("Runtime.evaluate", session, expression=expression, returnByValue=True)["result"].get("value")

    def wait_for(self, session: str, expression: str, timeout: float = 90) -> object:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            value = self.evaluate(session, expression)
            if value:
                return value
            time.sleep(0.2)
        raise TimeoutError(f"{expression} stayed false for {timeout} s")

    def screenshot(self, session: str) -> bytes:
        return base64.b64decode(self.call("Page.captureScreenshot", session, format="png")["data"])

    def close(self) -> None:
        try:
            self.call("Browser.close", timeout=10)
        except (RuntimeError, TimeoutError, OSError):
            pass
        try:
            self.proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        os.close(self._to_browser_w)
        os.close(self._from_browser_r)


@pytest.fixture(scope="module")
def served(site: Path) -> Iterator[str]:
    handler = functools.partial(http.server.SimpleHTTPRequestHandler, directory=str(site))
    handler.log_message = lambda *a, **k: None  # type: ignore[method-assign]
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()


@pytest.fixture(scope="module")
def browser(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Chromium]:
    binary = chromium_binary()
    if binary is None:
        pytest.skip("no chromium: install Debian's package (apt-get install chromium) to look at the site in a browser")
    chromium = Chromium(binary, tmp_path_factory.mktemp("chromium-profile"))
    yield chromium
    chromium.close()


def assert_rendered(png: bytes, name: str, out_dir: Path) -> None:
    """A real page: mostly background, but many colours (text, code, the header), not a blank frame."""
    from PIL import Image  # pillow: a dependency of matplotlib, in the [test] extra

    (out_dir / f"{name}.png").write_bytes(png)
    image = Image.open(io.BytesIO(png)).convert("RGB")
    width, height = image.size
    counts = image.getcolors(maxcolors=width * height)
    background = max(counts)[0]
    inked = 1 - background / (width * height)
    assert width >= 800 and height >= 600, (width, height)
    assert len(counts) > 50 and 0.03 < inked < 0.9, (name, len(counts), inked)


@pytest.mark.parametrize(("path", "title"), [("/", "keras-distrib"), ("/troubleshooting/", "Troubleshooting")])
def test_page_renders_in_a_browser(browser: Chromium, served: str, tmp_path: Path, path: str, title: str) -> None:
    session = browser.open(served + path)
    assert browser.evaluate(session, "document.querySelector('article h1').textContent.trim()").startswith(title)
    browser.wait_for(session, "document.fonts.status === 'loaded'")
    assert_rendered(browser.screenshot(session), title, tmp_path)


def test_search_finds_a_real_error_message(browser: Chromium, served: str, tmp_path: Path, real_errors: list[str]) -> None:
    """What a user does: paste a few words of the error they got into the site's search."""
    line = next(line for line in real_errors if "unknown key" in line)
    message = re.sub(r"'[^']*'", " ", line.split(" HINT:")[0])  # without the values the user typed
    query = " ".join(re.sub(r"[^\w ]", " ", message).split())  # "config has unknown key"
    session = browser.open(f"{served}/?q={quote(query)}")
    browser.wait_for(session, "document.querySelectorAll('.md-search-result__item').length > 0")
    hits = browser.evaluate(session, "Array.from(document.querySelectorAll('.md-search-result__item a'))"
                                     ".map(a => [a.href, a.textContent])")
    # The hit is the error's own section on the troubleshooting page, titled by the message.
    assert any("/troubleshooting/" in href and "has unknown key {key}" in text for href, text in hits), (query, hits)
    assert_rendered(browser.screenshot(session), "search", tmp_path)


def test_every_variable_the_code_reads_is_documented() -> None:
    """Each KERAS_DISTRIB_* name in the code is in the environment contract (what the agent
    sets) or in the reference's table of variables a user sets."""
    import re

    from keras_distrib import contract

    named = set()
    for path in [*(REPO / "keras_distrib").rglob("*.py"), *(REPO / "cluster_parsers").rglob("*.py")]:
        named |= set(re.findall(r"[\"'](KERAS_DISTRIB_[A-Z_]+)[\"']", path.read_text()))
    table = (REPO / "docs" / "reference" / "cli.md").read_text().split("## Environment variables you can set", 1)[1]
    user_set = set(re.findall(r"^\| `(KERAS_DISTRIB_[A-Z_]+)` \|", table, re.MULTILINE))
    assert named - set(contract.VARIABLES) - user_set == set()
    assert user_set <= named  # no row for a variable nothing reads
