"""A real browser: a page served from another port calls the API cross-origin, as a web chat UI
does, through headless Chromium (Debian's `chromium`, which `make setup` installs)."""

from __future__ import annotations

import functools
import threading
from collections.abc import Iterator
from http.server import SimpleHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest
from playwright.sync_api import Browser

from tests.support.server_process import ServerProcess, hotlora_spec

pytestmark = pytest.mark.e2e

API_KEY = "sk-browser"

# The page calls the API given in its query string, shows what came back, and leaves it in
# `window.outcome` (a promise) for the test to read.
PAGE = """<!doctype html>
<meta charset="utf-8">
<title>chat page</title>
<h1>chat page on <span id="origin"></span></h1>
<pre id="out">calling...</pre>
<script>
const api = new URLSearchParams(location.search).get("api");
document.getElementById("origin").textContent = location.origin;

async function call(path, init) {
  try {
    // A bound on the wait: a hung call fails the test instead of stalling it.
    const response = await fetch(api + path, {...init, signal: AbortSignal.timeout(120000)});
    return {
      status: response.status,
      requestId: response.headers.get("x-request-id"),
      body: await response.json(),
    };
  } catch (error) {
    return {error: String(error)};
  }
}

window.outcome = (async () => {
  const auth = {"Authorization": "Bearer __KEY__"};
  const models = await call("/v1/models", {headers: auth});
  const chat = await call("/v1/chat/completions", {
    method: "POST",
    headers: {...auth, "Content-Type": "application/json", "x-request-id": "browser-chat-1"},
    body: JSON.stringify({
      model: models.body ? models.body.data[0].id : "unknown",
      messages: [{role: "user", content: "What is the capital of France? Answer in one sentence."}],
      max_tokens: 8,
      temperature: 0,
    }),
  });
  const outcome = {origin: location.origin, models, chat};
  document.getElementById("out").textContent = JSON.stringify(outcome, null, 2);
  return outcome;
})();
</script>
""".replace("__KEY__", API_KEY)


class _QuietHandler(SimpleHTTPRequestHandler):
    def log_message(self, format: str, *args: Any) -> None:
        pass


@pytest.fixture(scope="module")
def page_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("chat-page")
    (root / "index.html").write_text(PAGE)
    return root


def _serve_pages(root: Path) -> Iterator[str]:
    """A static file server for `root` on a free loopback port; yields its origin."""
    handler = functools.partial(_QuietHandler, directory=str(root))
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{httpd.server_address[1]}"
    finally:
        httpd.shutdown()
        httpd.server_close()
        thread.join(timeout=10)


@pytest.fixture(scope="module")
def allowed_origin(page_dir: Path) -> Iterator[str]:
    yield from _serve_pages(page_dir)


@pytest.fixture(scope="module")
def foreign_origin(page_dir: Path) -> Iterator[str]:
    yield from _serve_pages(page_dir)


@pytest.fixture(scope="module")
def server(embedded_model_dir: Path, allowed_origin: str) -> Iterator[ServerProcess]:
    spec = hotlora_spec(
        "--model",
        str(embedded_model_dir),
        "--allowed-origins",
        allowed_origin,
        "--api-key",
        API_KEY,
    )
    with ServerProcess(spec) as srv:
        yield srv


def _open(browser: Browser, origin: str, api: str, screenshot: Path) -> dict[str, Any]:
    """Load the page from `origin`, wait for its calls to `api`, screenshot it."""
    page = browser.new_page()
    try:
        page.goto(f"{origin}/index.html?api={api}")
        outcome = page.evaluate("window.outcome")
        page.screenshot(path=str(screenshot), full_page=True)
    finally:
        page.close()
    return outcome


def test_an_allowed_page_calls_the_api(
    browser: Browser, server: ServerProcess, allowed_origin: str, tmp_path: Path
):
    screenshot = tmp_path / "allowed-page.png"
    outcome = _open(browser, allowed_origin, server.url, screenshot)
    assert outcome["origin"] == allowed_origin
    models = outcome["models"]
    assert models["status"] == 200, models
    assert models["body"]["data"][0]["id"] == server.model_id
    chat = outcome["chat"]
    assert chat["status"] == 200, chat
    assert chat["body"]["object"] == "chat.completion"
    assert "Paris" in chat["body"]["choices"][0]["message"]["content"]
    assert 0 < chat["body"]["usage"]["completion_tokens"] <= 8
    # Exposed to the page: the id it sent comes back readable.
    assert chat["requestId"] == "browser-chat-1"
    assert models["requestId"]
    assert screenshot.stat().st_size > 0


def test_a_page_from_another_origin_is_blocked(
    browser: Browser, server: ServerProcess, foreign_origin: str, tmp_path: Path
):
    screenshot = tmp_path / "foreign-page.png"
    outcome = _open(browser, foreign_origin, server.url, screenshot)
    assert outcome["origin"] == foreign_origin
    for call in ("models", "chat"):
        assert outcome[call] == {"error": "TypeError: Failed to fetch"}, call
    assert screenshot.stat().st_size > 0
    # Both calls carry Authorization, so the browser asked first, and the server said no.
    log = server.log(200)
    assert "OPTIONS /v1/models 400" in log
    assert "OPTIONS /v1/chat/completions 400" in log
