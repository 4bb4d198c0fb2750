"""The API schema's UIs render in a real browser with no network: Debian's chromium, headless, driven by
selenium through Debian's chromedriver (`make browser` installs both), every host but loopback
unresolvable. Swagger UI (/schema, /schema/swagger) and ReDoc (/schema/redoc) must list every operation
of the OpenAPI document, and the browser must have asked nothing of any other host.

The app runs under uvicorn with its lifespan off: the schema and its assets need no model.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import threading
import time

import httpx
import pytest
import uvicorn
from loraserve.app import create_app
from loraserve.settings import ServerSettings

RENDER_TIMEOUT_S = 60  # a loaded 2-core CI machine; it takes a second or two on an idle one
CHROMIUM_FLAGS = (
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--disable-dev-shm-usage",
    # Offline, whatever the machine can reach: any host but loopback fails to resolve.
    "--host-resolver-rules=MAP * ~NOTFOUND , EXCLUDE 127.0.0.1",
)


def _browser_paths() -> tuple[str, str]:
    chromium = shutil.which("chromium") or shutil.which("chromium-browser")
    driver = shutil.which("chromedriver")
    if chromium and driver:
        return chromium, driver
    if os.environ.get("CI"):
        pytest.fail("chromium and chromedriver are not installed; CI must install them (make browser)")
    pytest.skip("chromium or chromedriver is not installed (make browser installs Debian's packages)")


@pytest.fixture(scope="module")
def server_url(tmp_path_factory):
    app = create_app(ServerSettings(state_dir=tmp_path_factory.mktemp("state")))
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    server = uvicorn.Server(
        uvicorn.Config(app, host="127.0.0.1", port=port, lifespan="off", log_level="warning")
    )
    thread = threading.Thread(target=server.run, name="schema-server", daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        assert time.monotonic() < deadline and thread.is_alive(), "the server did not start"
        time.sleep(0.05)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(timeout=10)


@pytest.fixture(scope="module")
def browser(tmp_path_factory):
    chromium, driver_path = _browser_paths()
    webdriver = pytest.importorskip("selenium.webdriver", reason="selenium is a dev extra (make install)")
    from selenium.webdriver.chrome.service import Service

    os.environ.setdefault("SE_OFFLINE", "true")  # selenium never looks for a driver or browser to download
    options = webdriver.ChromeOptions()
    options.binary_location = chromium
    for flag in CHROMIUM_FLAGS:
        options.add_argument(flag)
    options.add_argument(f"--user-data-dir={tmp_path_factory.mktemp('chromium-profile')}")
    options.set_capability("goog:loggingPrefs", {"performance": "ALL"})
    driver = webdriver.Chrome(service=Service(executable_path=driver_path), options=options)
    try:
        yield driver
    finally:
        driver.quit()


def _operations(server_url: str) -> list[tuple[str, str, str]]:
    """(METHOD, path, summary) of every operation in the OpenAPI document."""
    document = httpx.get(f"{server_url}/schema/openapi.json", timeout=10).json()
    return [
        (method.upper(), path, operation.get("summary", ""))
        for path, item in document["paths"].items()
        for method, operation in item.items()
    ]


def _requested_urls(driver) -> list[str]:
    """Every network URL the browser asked for since the last call (Chrome's performance log): its own
    pages (chrome://, data:, blob:) left out, and so are requests the page's Content-Security-Policy
    blocked before they were made."""
    urls: dict[str, str] = {}
    blocked: set[str] = set()
    for entry in driver.get_log("performance"):
        message = json.loads(entry["message"])["message"]
        params = message["params"]
        if message["method"] == "Network.requestWillBeSent":
            url = params["request"]["url"]
            if url.startswith(("http:", "https:", "ws:", "wss:")):
                urls[params["requestId"]] = url
        elif message["method"] == "Network.loadingFailed" and params.get("blockedReason") == "csp":
            blocked.add(params["requestId"])
    return [url for request_id, url in urls.items() if request_id not in blocked]


def _wait_for(driver, script: str, what: str):
    deadline = time.monotonic() + RENDER_TIMEOUT_S
    while time.monotonic() < deadline:
        result = driver.execute_script(script)
        if result:
            return result
        time.sleep(0.2)
    raise AssertionError(f"{what} did not render within {RENDER_TIMEOUT_S} s:\n{driver.page_source[:2000]}")


@pytest.mark.slow
@pytest.mark.parametrize("page", ["/schema", "/schema/swagger"])
def test_swagger_ui_lists_every_operation_offline(browser, server_url, page):
    browser.get(server_url + page)
    shown = _wait_for(
        browser,
        "const ops = [...document.querySelectorAll('.opblock')].map(op => "
        "[op.querySelector('.opblock-summary-method').textContent.trim(), "
        "op.querySelector('.opblock-summary-path').getAttribute('data-path')]);"
        "return ops.length ? ops : null;",
        "Swagger UI's operations",
    )
    assert {tuple(op) for op in shown} == {(m, p) for m, p, _ in _operations(server_url)}
    assert browser.execute_script("return !!document.querySelector('.btn.authorize')"), "no Authorize button"
    requested = _requested_urls(browser)
    assert any(url.endswith("/schema/assets/swagger-ui-bundle.js") for url in requested), requested
    assert all(url.startswith(server_url + "/") for url in requested), requested


def test_redoc_lists_every_operation_offline(browser, server_url):
    browser.get(server_url + "/schema/redoc")
    _wait_for(
        browser, "return document.querySelectorAll('[data-section-id^=\"operation/\"]').length", "ReDoc"
    )
    text = browser.execute_script("return document.body.innerText")
    missing = [(m, p) for m, p, _ in _operations(server_url) if p not in text]
    assert missing == [], f"ReDoc shows no section for {missing}"
    sections = browser.execute_script(
        "return document.querySelectorAll('[data-section-id^=\"operation/\"]').length"
    )
    assert sections == len(_operations(server_url))
    requested = _requested_urls(browser)
    assert any(url.endswith("/schema/assets/redoc.standalone.js") for url in requested), requested
    assert all(url.startswith(server_url + "/") for url in requested), requested
