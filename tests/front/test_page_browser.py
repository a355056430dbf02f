"""The front's page in a real browser: headless Chromium driven by Selenium, against `gb10d front` before two real
`gb10d run` instances over gb10d.sim (alpha on demand and parked, beta failing its start).

What an operator sees: both models' states; a memory bar whose segments add up to MemTotal; a click on Wake that
shows the parked model starting and then serving without a reload; the failed start's cause and fix; no error in the
browser's console; no serious or critical accessibility violation (axe-core); screenshots at a laptop's and a phone's
width under the test's tmp dir.

Needs Debian's chromium and chromium-driver, selenium (the test extra) and axe-core from npm (.ci/run installs all
four: `npm install --prefix tests/browser axe-core`); skipped without them unless GB10D_REQUIRE_BROWSER=1.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from gb10d.daemon.lab import wait_until
from test_front import Deployment

pytestmark = pytest.mark.slow

AXE = Path(__file__).parent.parent / "browser" / "node_modules" / "axe-core" / "axe.min.js"
CHROMIUM = shutil.which("chromium")
DRIVER = shutil.which("chromedriver")


def _missing() -> str:
    try:
        import selenium  # noqa: F401
    except ImportError:
        return "selenium is not installed (pip install -e '.[test]')"
    if CHROMIUM is None or DRIVER is None:
        return "chromium and chromium-driver are not installed (apt-get install chromium chromium-driver)"
    if not AXE.exists():
        return f"axe-core is not installed ({AXE}: npm install --prefix tests/browser axe-core)"
    return ""


@pytest.fixture
def browser(tmp_path: Path) -> Iterator[Any]:
    missing = _missing()
    if missing:
        if os.environ.get("GB10D_REQUIRE_BROWSER") == "1":
            pytest.fail(missing)
        pytest.skip(missing)
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = str(CHROMIUM)
    for flag in (
        "--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking", "--disable-component-update",
        "--disable-sync", "--no-first-run", "--disable-dev-shm-usage", f"--user-data-dir={tmp_path / 'chromium'}",
        "--window-size=1280,800",
    ):
        options.add_argument(flag)
    options.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    driver = webdriver.Chrome(options=options, service=Service(str(DRIVER)))
    driver.set_script_timeout(30)
    try:
        yield driver
    finally:
        driver.quit()


def state_of(driver: Any, instance: str) -> str:
    return str(driver.execute_script(
        "const c = document.querySelector(`article[data-instance='${arguments[0]}']`); return c ? c.dataset.state : '';", instance,
    ))


def shoot(driver: Any, width: int, height: int, path: Path) -> None:
    """A screenshot of the page as a window of width x height CSS pixels shows it."""
    driver.set_window_size(width, height)
    inner = driver.execute_script("return [window.innerWidth, window.innerHeight];")
    driver.set_window_size(2 * width - inner[0], 2 * height - inner[1])
    assert driver.execute_script("return window.innerWidth;") == width
    driver.save_screenshot(str(path))


def test_the_page_shows_both_models_wakes_a_parked_one_live_and_passes_axe(tmp_path: Path, browser: Any) -> None:
    (tmp_path / "deployment").mkdir()
    deployment = Deployment(
        tmp_path / "deployment",
        each={
            "alpha": {"on_demand": {"idle_timeout_s": 600}, "vllm.env.GB10D_SIM_SCENARIO": "slow_shards=60"},
            "beta": {"vllm.env.GB10D_SIM_SCENARIO": "model_not_found", "restart.max_attempts": 1},
        },
    )
    driver = browser
    try:
        deployment.start("alpha", serving=False)
        deployment.start("beta", serving=False)
        deployment.wait_state("alpha", "parked")
        deployment.wait_state("beta", "failed")

        driver.get(deployment.url + "/ui/")
        assert wait_until(lambda: state_of(driver, "alpha") == "parked" and state_of(driver, "beta") == "failed", 20), driver.page_source
        beta = driver.execute_script("return document.querySelector(\"article[data-instance='beta'] .failure\").innerText;")
        assert "Failed:" in beta and "Fix:" in beta, beta

        sizes = driver.execute_script(
            "return [...document.querySelectorAll('#bar .seg')].map((s) => Number(s.dataset.bytes));"
        )
        total = driver.execute_script("return Number(document.getElementById('bar').dataset.total);")
        assert total > 0 and abs(sum(sizes) - total) <= total / 100, (sizes, total)

        shoot(driver, 1280, 800, tmp_path / "page-1280x800.png")

        driver.execute_script("window.notReloaded = true;")
        driver.find_element("id", "wake-alpha").click()
        seen = []

        def serving() -> bool:
            state = state_of(driver, "alpha")
            if not seen or seen[-1] != state:
                seen.append(state)
            return state == "serving"

        assert wait_until(serving, 60), seen
        assert "starting" in seen, seen
        assert driver.execute_script("return window.notReloaded === true;")

        # A control keeps its focus while its card is drawn anew on a change: a keyboard user keeps their place.
        driver.execute_script("document.getElementById('copy-alpha').focus();")
        assert httpx.post(deployment.url + "/ui/actions/alpha/park", headers={"x-gb10d-page": "1"}, timeout=30).status_code == 202
        assert wait_until(lambda: state_of(driver, "alpha") == "parked", 60), driver.page_source
        assert driver.execute_script("return document.activeElement === document.getElementById('copy-alpha');")

        found = driver.execute_async_script(
            AXE.read_text() + "\n;const done = arguments[arguments.length - 1];"
            "axe.run(document, {resultTypes: ['violations']}).then((r) => done(r.violations.map((v) => [v.id, v.impact, v.help])));"
        )
        assert [v for v in found if v[1] in ("serious", "critical")] == [], found

        shoot(driver, 390, 844, tmp_path / "page-390x844.png")
        errors = [entry for entry in driver.get_log("browser") if entry["level"] == "SEVERE"]
        assert errors == [], errors
        assert (tmp_path / "page-1280x800.png").stat().st_size > 0 and (tmp_path / "page-390x844.png").stat().st_size > 0
    finally:
        deployment.close()


def test_with_keys_the_page_asks_for_one_once_per_tab_and_keeps_no_cookie(tmp_path: Path, browser: Any) -> None:
    key = "front-key-for-the-page-test"
    (tmp_path / "deployment").mkdir()
    deployment = Deployment(tmp_path / "deployment", {"api_keys": [key]})
    driver = browser
    try:
        driver.get(deployment.url + "/ui/")
        assert wait_until(lambda: driver.find_element("id", "keyform").is_displayed(), 10), "the page asks for a key"
        driver.find_element("id", "key").send_keys("not-the-key-of-this-front")
        driver.find_element("css selector", "#keyform button").click()
        assert wait_until(lambda: "not accepted" in driver.find_element("id", "keyproblem").text, 10)
        driver.find_element("id", "key").send_keys(key)
        driver.find_element("css selector", "#keyform button").click()
        assert wait_until(lambda: state_of(driver, "alpha") == "not running", 10), driver.page_source
        driver.refresh()
        assert wait_until(lambda: state_of(driver, "beta") == "not running", 10), "the key is kept for the tab"
        assert not driver.find_element("id", "keyform").is_displayed()
        assert driver.get_cookies() == []
        # A wrong key's 401 is the page's answer, not an error of the page.
        errors = [e for e in driver.get_log("browser") if e["level"] == "SEVERE" and "401" not in e["message"]]
        assert errors == [], errors
    finally:
        deployment.close()
