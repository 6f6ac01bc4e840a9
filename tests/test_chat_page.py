"""The chat page on `GET /` (issue 24): served from the package, off with `--no-chat-page`, and used
end to end in a real browser against a real `jaxserve serve` of the default model.

The browser is Debian's Chromium (`.ci/run` installs it) driven by Playwright, which never downloads
one. Screenshots of each state go to build/test-artifacts/chat_page/ (or $JAXSERVE_TEST_ARTIFACTS).
The fast tests need no browser and no model.
"""

from __future__ import annotations

import fnmatch
import json
import os
import re
import subprocess
import time
import tomllib
from html.parser import HTMLParser
from pathlib import Path
from types import SimpleNamespace
from urllib.parse import urlparse

import httpx
import pytest
from fastapi.testclient import TestClient

from server.app import STATIC_DIR, create_app
from server_helpers import REPO_ROOT, metric, metric_samples, run_server

CHROMIUM = "/usr/bin/chromium"
# Headless, for a machine without a display or network: without the background-networking flags
# Chromium keeps dialling out.
CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                 "--disable-background-networking", "--disable-component-update", "--disable-sync"]
# The engine shape of test_server's default-model test, so the executables come from the session's cache.
# The default-model limits the other default-model tests use: their executables are compiled once a session.
SERVER_ARGS = ["--max-model-len", "512", "--max-num-seqs", "8", "--max-num-batched-tokens", "128"]
API_KEY = "chat-page-key"
QUESTION = "What is the capital of France?"
RUNNING = "jaxserve:num_requests_running"
STATS = re.compile(r"^\d+ tokens? · first token \d+\.\d\d s · \d+\.\d tokens/s")


# -------------------------------------------------------------------------------------------------
# without a browser


def _stub_engine_loop():
    """What create_app reads of an engine loop; the page's routes never reach the engine."""
    engine = SimpleNamespace(tokenizer=None, cfg=SimpleNamespace(max_model_len=64, max_num_seqs=1, enable_lora=False),
                             model_cfg=SimpleNamespace(vocab_size=16))
    return SimpleNamespace(engine=engine, is_alive=True)


def _page_client(**kwargs) -> TestClient:
    return TestClient(create_app(_stub_engine_loop(), "tiny", max_request_body_bytes=2**20, **kwargs))


class _Links(HTMLParser):
    def __init__(self):
        super().__init__()
        self.urls = []

    def handle_starttag(self, tag, attrs):
        self.urls += [value for name, value in attrs if name in ("src", "href")]


def test_root_serves_the_chat_page_and_no_chat_page_turns_it_off():
    """`/` is the page (with its files under /static, no API key needed) unless `--no-chat-page`, which
    leaves `/` and /static a 404 like any unknown path."""
    from jaxserve.cli import build_parser

    assert build_parser().parse_args(["serve"]).chat_page is True
    assert build_parser().parse_args(["serve", "--no-chat-page"]).chat_page is False
    with _page_client(api_key="secret") as client:
        page = client.get("/")
        assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
        assert "default-src 'none'" in page.headers["content-security-policy"]
        assert client.get("/static/chat.js").status_code == 200
        assert client.get("/v1/models").status_code == 401  # the page is open, the API is not
    with _page_client(chat_page=False) as client:
        for path in ("/", "/static/chat.js"):
            response = client.get(path)
            assert response.status_code == 404 and response.json()["error"]["code"] == 404


def test_the_page_needs_nothing_from_the_network():
    """Every file the page names is a relative path into the package (it works offline) or a data: URL."""
    links = _Links()
    links.feed((STATIC_DIR / "index.html").read_text())
    assert links.urls
    for url in links.urls:
        assert url == "data:," or (url.startswith("static/") and (STATIC_DIR.parent / url).is_file()), url
    for name in ("chat.js", "chat.css"):
        assert not re.search(r"(https?:)?//[a-z0-9]", (STATIC_DIR / name).read_text()), name


def test_every_static_file_is_package_data():
    """A non-editable install ships every file of the page (pyproject.toml's package data)."""
    patterns = tomllib.loads((REPO_ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["package-data"]["server"]
    for path in STATIC_DIR.rglob("*"):
        if path.is_file():
            name = path.relative_to(STATIC_DIR.parent).as_posix()
            assert any(fnmatch.fnmatch(name, p) and name.count("/") == p.count("/") for p in patterns), name


def test_a_failing_chromium_install_fails_the_ci_script_at_that_step(tmp_path):
    """The CI script's install lines, run with an apt-get that fails: the script stops there."""
    script = (REPO_ROOT / ".ci" / "run").read_text()
    assert "if [ ! -x /usr/bin/chromium ]; then" in script
    lines = [line for line in script.splitlines() if line.startswith("as_root()") or "as_root apt-get" in line
             or "as_root env" in line]
    assert len(lines) == 3 and "chromium" in lines[-1], lines
    fake = tmp_path / "bin"
    fake.mkdir()
    (fake / "apt-get").write_text("#!/bin/sh\necho \"apt-get $*\"\n[ \"$1\" = update ] || exit 100\n")
    (fake / "sudo").write_text("#!/bin/sh\nexec \"$@\"\n")
    for f in fake.iterdir():
        f.chmod(0o755)
    body = "set -euo pipefail\n" + "\n".join(lines) + "\necho REACHED-THE-NEXT-STEP\n"
    result = subprocess.run(["bash", "-c", body], capture_output=True, text=True,
                            env={**os.environ, "PATH": f"{fake}:{os.environ['PATH']}"})
    assert result.returncode == 100, result
    assert "install -y -qq chromium" in result.stdout and "REACHED-THE-NEXT-STEP" not in result.stdout


# -------------------------------------------------------------------------------------------------
# in a real browser


@pytest.fixture(scope="module")
def artifacts() -> Path:
    directory = Path(os.environ.get("JAXSERVE_TEST_ARTIFACTS", REPO_ROOT / "build" / "test-artifacts")) / "chat_page"
    directory.mkdir(parents=True, exist_ok=True)
    return directory


@pytest.fixture(scope="module")
def browser():
    from playwright.sync_api import sync_playwright

    assert os.path.exists(CHROMIUM), f"{CHROMIUM} is missing: apt-get install chromium (.ci/run does)"
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        yield browser
        browser.close()


@pytest.fixture(scope="module")
def server():
    with run_server(SERVER_ARGS) as srv:
        yield srv


def _running(url: str) -> float:
    return metric(metric_samples(url), RUNNING)


def _wait_for(condition, timeout_s: float, what: str):
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, f"not within {timeout_s} s: {what}"
        time.sleep(0.05)


def _settings(page, screenshot: Path | None = None, **values):
    """Opens the settings panel, types the values (by input id), closes it with Done."""
    page.get_by_role("button", name="Settings").click()
    for input_id, value in values.items():
        page.locator(f"#{input_id}").fill(str(value))
    if screenshot is not None:
        page.screenshot(path=screenshot)
    page.get_by_role("button", name="Done").click()


def _ask(page, text: str):
    box = page.get_by_role("textbox", name="Message")
    box.fill(text)
    box.press("Enter")


def _last_reply(page):
    return page.locator(".message.assistant").last


# A reply as the server streams it, for the page served without a server (`_serve_without_a_server`).
CANNED_REPLY = ('data: {"choices": [{"index": 0, "delta": {"content": "Paris."}, "finish_reason": null}]}\n\n'
                'data: {"choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}], '
                '"usage": {"completion_tokens": 2}}\n\ndata: [DONE]\n\n')
FAKE_ORIGIN = "http://chat.test"
SAMPLING_FIELDS = ("temperature", "top_p", "max_tokens", "seed")


def _serve_without_a_server(page, server_info: dict) -> list[dict]:
    """Answers the page's requests in the browser (Playwright's routing): its files from the package, a
    model list, `server_info`, and a canned reply to each chat request, whose bodies it returns."""
    sent = []

    def answer(route):
        path = urlparse(route.request.url).path
        if path == "/":
            route.fulfill(path=STATIC_DIR / "index.html")
        elif path.startswith("/static/"):
            route.fulfill(path=STATIC_DIR.parent / path.lstrip("/"))
        elif path == "/v1/models":
            route.fulfill(json={"object": "list", "data": [{"id": "tiny", "object": "model"}]})
        elif path == "/server_info":
            route.fulfill(json=server_info)
        elif path == "/v1/chat/completions":
            sent.append(json.loads(route.request.post_data))
            route.fulfill(body=CANNED_REPLY, content_type="text/event-stream")
        else:
            route.fulfill(status=404)

    page.route(FAKE_ORIGIN + "/**", answer)
    return sent


def test_the_page_sends_only_the_settings_the_user_set(browser):
    """Issue 38: the settings start empty, with the server's defaults (/server_info) as placeholders; a
    box left empty (or emptied) is not sent, so the server's defaults, the model's, apply; a value typed
    is. Settings the page saved when it filled in temperature 0.7 and top_p 0.95 itself lose those two."""
    page = browser.new_page()
    sent = _serve_without_a_server(page, {"served_model_name": "tiny",
                                          "default_sampling_params": {"temperature": 0.2, "top_p": 0.9}})
    page.goto(FAKE_ORIGIN + "/")
    page.get_by_text("Ask tiny anything").wait_for()
    page.wait_for_function("document.getElementById('temperature').placeholder === 'default: 0.2'")
    assert [page.locator(f"#{box}").input_value() for box in ("temperature", "top-p", "max-tokens", "seed")] == [""] * 4
    assert page.locator("#top-p").get_attribute("placeholder") == "default: 0.9"
    assert page.locator("#max-tokens").get_attribute("placeholder") == "default: all that fits"

    def ask_and_wait(text: str) -> dict:
        _ask(page, text)
        _last_reply(page).locator(".stats").wait_for()
        return sent[-1]

    assert not set(SAMPLING_FIELDS) & set(ask_and_wait("What is the capital of France?"))
    _settings(page, temperature=0.5)
    body = ask_and_wait("And of Italy?")
    assert body["temperature"] == 0.5 and not {"top_p", "max_tokens", "seed"} & set(body)
    _settings(page, temperature="")
    assert "temperature" not in ask_and_wait("And of Spain?")

    old = {"systemPrompt": "Be brief.", "temperature": "0.7", "topP": "0.95", "maxTokens": "64", "seed": ""}
    page.evaluate("settings => localStorage.setItem('jaxserve-chat-settings', JSON.stringify(settings))", old)
    page.reload()
    page.get_by_text("Ask tiny anything").wait_for()
    assert [page.locator(f"#{box}").input_value() for box in ("system-prompt", "temperature", "top-p", "max-tokens")] \
        == ["Be brief.", "", "", "64"]
    page.close()


@pytest.mark.default_model
def test_chat_in_a_browser(browser, server, artifacts):
    """One page through a conversation: Shift+Enter is a newline; the question streams 'Paris' in (the
    reply's text is seen growing) with its tokens, time to first token and tokens/s; a server error
    shows in the conversation; Stop aborts a long reply and the server's running count returns to 0;
    New chat empties the conversation; a phone-sized window (dark) does not scroll sideways."""
    page = browser.new_page(viewport={"width": 1100, "height": 800})
    page.goto(server.url + "/")
    page.get_by_text("Ask SmolLM2-135M-Instruct anything").wait_for()
    page.screenshot(path=artifacts / "empty.png")

    box = page.get_by_role("textbox", name="Message")
    box.type("one")
    box.press("Shift+Enter")
    box.type("two")
    assert box.input_value() == "one\ntwo" and page.locator(".message").count() == 0

    _settings(page, artifacts / "settings.png", **{"temperature": 0, "max-tokens": 32})
    page.evaluate("""() => {
        window.replyLengths = [];
        new MutationObserver(() => {
            const body = document.querySelector('.message.assistant .body');
            if (body) window.replyLengths.push(body.textContent.length);
        }).observe(document.getElementById('conversation'), {childList: true, subtree: true, characterData: true});
    }""")
    _ask(page, QUESTION)
    reply = _last_reply(page)
    reply.locator(".stats").wait_for(timeout=60_000)
    assert "Paris" in reply.locator(".body").inner_text()
    assert len(set(page.evaluate("window.replyLengths")) - {0}) >= 3, "the reply did not stream in"
    stats = reply.locator(".stats").inner_text()
    assert STATS.match(stats), stats
    assert box.input_value() == "" and box.evaluate("el => el === document.activeElement")
    page.screenshot(path=artifacts / "answer.png")

    _settings(page, **{"max-tokens": 100_000})
    _ask(page, "Hello")
    error = _last_reply(page).locator(".error")
    error.wait_for(timeout=30_000)
    assert "100000" in error.inner_text() and "512" in error.inner_text(), error.inner_text()
    assert box.input_value() == "Hello"  # given back, to send again, and the turn left out of the history
    assert page.locator(".message.user.failed").count() == 1
    page.screenshot(path=artifacts / "error.png")

    _settings(page, **{"max-tokens": 400})
    _ask(page, "Write a long story about a dragon who learns to bake bread.")
    reply = _last_reply(page)
    _wait_for(lambda: len(reply.locator(".body").inner_text()) > 40, 60, "the long reply to start")
    assert _running(server.url) == 1
    page.screenshot(path=artifacts / "streaming.png")
    page.get_by_role("button", name="Stop").click()
    _wait_for(lambda: _running(server.url) == 0, 10, "the running count to return to 0 after Stop")
    reply.locator(".stats").wait_for()
    assert "stopped" in reply.locator(".stats").inner_text()
    assert page.get_by_role("button", name="Send").is_visible()
    page.screenshot(path=artifacts / "stopped.png")

    page.get_by_role("button", name="New chat").click()
    assert page.locator(".message").count() == 0
    page.get_by_text("Ask SmolLM2-135M-Instruct anything").wait_for()

    page.set_viewport_size({"width": 390, "height": 760})
    page.emulate_media(color_scheme="dark")
    _settings(page, **{"max-tokens": 80})
    _ask(page, "Write a Python function that adds two numbers.")
    _last_reply(page).locator(".stats").wait_for(timeout=60_000)
    assert page.evaluate("document.documentElement.scrollWidth <= window.innerWidth")
    page.screenshot(path=artifacts / "phone_dark.png")
    page.close()


@pytest.mark.default_model
def test_markdown_is_rendered_highlighted_and_inert(browser, server):
    """The page's renderer: fenced code is highlighted; raw HTML, javascript: links and images from a
    reply are shown as text or plain links, never run or loaded."""
    page = browser.new_page()
    page.goto(server.url + "/")
    html = page.evaluate("""() => renderMarkdown(
        "**bold** and `code`\\n\\n```python\\ndef f(x):\\n    return 1\\n```\\n\\n" +
        "<img src=x onerror=alert(1)> [a](javascript:alert(1)) ![i](http://example.com/i.png)", true)""")
    assert "<strong>bold</strong>" in html and "<code>code</code>" in html
    assert 'class="hljs-keyword">def</span>' in html
    assert "<img" not in html and "&lt;img" in html and "javascript:" not in html
    page.close()


@pytest.mark.default_model
def test_with_an_api_key_the_page_asks_for_it(browser, artifacts):
    """A server started with --api-key: the page asks for the key, says when one is refused, and chats
    once it has the right one (sent as a Bearer token).

    Its first question goes at the server's defaults (issue 38): the page sends no sampling field, and
    the model's (temperature 0.2, top_p 0.9, its card's) apply; the answer says Paris. At those defaults
    the model starts "L'Étoile, la Marseillaise, ..." for about 3 seeds in 10 (29 of 41 said Paris in float32,
    28 in bfloat16: benchmarks/results/default_model_card_defaults_paris.md), so the server's seed is fixed:
    its first request draws the same seed every run, one that says Paris in both."""
    with run_server([*SERVER_ARGS, "--api-key", API_KEY, "--seed", "0"]) as srv:
        page = browser.new_page(viewport={"width": 1100, "height": 800})
        sent = []
        page.on("request", lambda r: sent.append(json.loads(r.post_data))
                if r.url.endswith("/v1/chat/completions") else None)
        page.goto(srv.url + "/")
        dialog = page.get_by_role("dialog", name="API key")
        dialog.wait_for()
        page.screenshot(path=artifacts / "api_key.png")
        page.get_by_label("Key", exact=True).fill("wrong")
        page.get_by_role("button", name="Use this key").click()
        page.get_by_text("The server refused the key.").wait_for()
        page.get_by_label("Key", exact=True).fill(API_KEY)
        page.get_by_role("button", name="Use this key").click()
        page.get_by_text("Ask SmolLM2-135M-Instruct anything").wait_for()
        assert not dialog.is_visible()
        _ask(page, QUESTION)
        reply = _last_reply(page)
        reply.locator(".stats").wait_for(timeout=60_000)
        assert len(sent) == 1 and not set(SAMPLING_FIELDS) & set(sent[0]), sent
        assert "Paris" in reply.locator(".body").inner_text()
        assert httpx.get(srv.url + "/server_info", headers={"Authorization": f"Bearer {API_KEY}"}
                         ).json()["default_sampling_params"] == {"temperature": 0.2, "top_p": 0.9}
        page.screenshot(path=artifacts / "api_key_answer.png")
        page.close()
