"""The run report in a real browser (headless Chromium, Debian's chromium + chromium-driver):
the key numbers are visible, a failed gate shows as failed, and nothing is fetched from
anywhere (every resource is inline or a local file, and none failed to load).

Screenshots (report_summary.png, report_failed_gate.png) land in this test's tmp dir (printed;
`pytest -s` shows the path), or in $DFLASH_SCREENSHOT_DIR when that is set:
`DFLASH_SCREENSHOT_DIR=benchmarks/results pytest tests/test_report_browser.py` refreshes the ones
recorded in the repository.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import pytest

CHROMIUM = Path("/usr/bin/chromium")
CHROMEDRIVER = Path("/usr/bin/chromedriver")
FLAGS = ("--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
         "--disable-background-networking", "--disable-component-update", "--disable-sync",
         "--disable-dev-shm-usage", "--window-size=1280,1600")


@pytest.fixture(scope="module")
def browser(tmp_path_factory):
    if not (CHROMIUM.exists() and CHROMEDRIVER.exists()):
        why = ("headless Chromium not installed: apt-get install -y chromium chromium-driver "
               "(`make test` does this when run as root)")
        if os.environ.get("DFLASH_ETL_REQUIRE_BROWSER"):  # CI: a missing browser is a failure
            pytest.fail(why)
        pytest.skip(why)
    webdriver = pytest.importorskip("selenium.webdriver")
    from selenium.common.exceptions import SessionNotCreatedException
    from selenium.webdriver.chrome.service import Service

    for attempt in range(3):
        options = webdriver.ChromeOptions()
        options.binary_location = str(CHROMIUM)
        for flag in FLAGS:
            options.add_argument(flag)
        options.add_argument(f"--user-data-dir={tmp_path_factory.mktemp('chromium-profile')}")
        options.set_capability("goog:loggingPrefs", {"browser": "ALL", "performance": "ALL"})
        try:
            driver = webdriver.Chrome(service=Service(str(CHROMEDRIVER)), options=options)
            break
        except SessionNotCreatedException:  # "chrome not reachable": a slow start on a busy machine
            if attempt == 2:
                raise
            time.sleep(10)
    driver.set_page_load_timeout(120)
    yield driver
    driver.quit()


@pytest.fixture(scope="module")
def shots(tmp_path_factory) -> Path:
    return Path(os.environ.get("DFLASH_SCREENSHOT_DIR") or tmp_path_factory.mktemp("screens"))


def _open(driver, path: Path) -> None:
    driver.get_log("performance")  # drop what earlier pages logged
    driver.get_log("browser")
    driver.get(path.resolve().as_uri())


def _network_problems(driver) -> list[str]:
    """Requests to any host (http, ws…), requests of the report's pages to anything but local
    files or inline data, loads of the report that failed, console errors. (Chromium's own
    chrome:// pages, e.g. the first tab, log requests too; those are not the report's.)"""
    problems, ours = [], set()
    for entry in driver.get_log("performance"):
        message = json.loads(entry["message"])["message"]
        params = message.get("params", {})
        if message["method"] == "Network.requestWillBeSent":
            url = params["request"]["url"]
            document = params.get("documentURL", "")
            if url.startswith(("http:", "https:", "ws:", "wss:", "ftp:")):
                problems.append(f"request to {url} (from {document})")
            elif document.startswith("file:"):
                ours.add(params["requestId"])
                if not url.startswith(("file:", "data:", "about:")):
                    problems.append(f"request to {url}")
        elif message["method"] == "Network.loadingFailed" and params["requestId"] in ours:
            problems.append(f"failed to load: {params.get('errorText')} {params}")
    problems += [f"console: {e['message']}" for e in driver.get_log("browser")
                 if e["level"] == "SEVERE"]
    return problems


def _external_references(driver) -> list[str]:
    return driver.execute_script("""
        const out = [];
        for (const el of document.querySelectorAll('[src],[href]')) {
          const url = el.getAttribute('src') || el.getAttribute('href');
          if (/^(https?:)?\\/\\//.test(url)) out.push(el.tagName + ' ' + url);
        }
        for (const el of document.querySelectorAll('img')) {
          if (!el.complete || el.naturalWidth === 0) out.push('broken img ' + el.src);
        }
        return out;""")


def _screenshot(driver, path: Path) -> Path:
    """The whole page when the renderer keeps up, else a smaller window: chromedriver gives the
    renderer 10 s per capture, which a loaded 2-core machine missed for a tall page (seen in CI:
    "Timed out receiving message from renderer: 10.000")."""
    from selenium.common.exceptions import TimeoutException

    height = driver.execute_script("return document.documentElement.scrollHeight")
    sizes = (min(max(height, 800), 3000), 1600, 900)
    try:
        for attempt, size in enumerate(sizes, 1):
            driver.set_window_size(1280, size)
            try:
                driver.save_screenshot(str(path))
                break
            except TimeoutException as exc:
                if attempt == len(sizes):
                    raise
                print(f"screenshot at 1280x{size} timed out ({exc.msg.strip()}); smaller next")
    finally:
        driver.set_window_size(1280, 1600)
    print(f"screenshot: {path}")
    return path


def test_summary_shows_the_key_numbers_and_loads_nothing_remote(browser, default_run_dir,
                                                                shots):
    from selenium.webdriver.common.by import By

    _open(browser, default_run_dir / "docs" / "index.html")
    assert browser.title == f"dflash-etl run {default_run_dir.name}"
    for stage in ("ingest", "regenerate", "tokenize", "extract", "train"):
        total = json.loads((default_run_dir / stage / "stats.json").read_text())["total"]
        for key in ("rows_in", "rows_out"):
            cell = browser.find_element(By.CSS_SELECTOR, f'[data-key="{stage}-{key}"]')
            assert cell.is_displayed() and cell.text == str(total[key]), (stage, key)
    evaluation = json.loads((default_run_dir / "train" / "eval.json").read_text())
    for key in ("tau_untrained", "tau_final"):  # the drafter's acceptance length, shown
        cell = browser.find_element(By.CSS_SELECTOR, f'[data-key="train-{key}"]')
        assert cell.is_displayed() and cell.text == f"{evaluation[key]:.3f}", key
    page = browser.find_element(By.TAG_NAME, "body").text
    assert "ALL GATES PASSED" in page and "FAIL" not in page
    assert "render_diff" in page and "Draft vocabulary" in page  # probe, strategy, coverage
    charts = browser.find_elements(By.CSS_SELECTOR, "svg")
    assert len(charts) >= 5 and all(c.size["height"] > 100 for c in charts)
    assert _network_problems(browser) == []
    assert _external_references(browser) == []
    shot = _screenshot(browser, shots / "report_summary.png")
    assert shot.stat().st_size > 10_000
    _rows_as_the_drafter_sees_them(browser, default_run_dir)

    browser.find_element(By.LINK_TEXT, "tokenize validation").click()
    assert "tokenize validation — passed" in browser.title
    rows = browser.find_elements(By.CSS_SELECTOR, "tbody tr")
    assert len(rows) > 15 and not browser.find_elements(By.CSS_SELECTOR, "tr.failed")
    assert _network_problems(browser) == []


def test_a_failed_gate_shows_as_failed(browser, failed_gate_run, shots):
    from selenium.webdriver.common.by import By

    run, code, _ = failed_gate_run
    assert code == 1
    _open(browser, run / "docs" / "index.html")
    header = browser.find_element(By.CSS_SELECTOR, "section h2").text
    assert "FAILED" in header
    gates = browser.find_element(By.XPATH, "//h3[text()='Gates']/following-sibling::table")
    assert "FAILED" in gates.text and "FAIL" in gates.text
    error = browser.find_element(By.CSS_SELECTOR, "#stage-ingest pre").text
    assert "the conversations suite failed" in error and "quarantine_rate" in error
    assert _network_problems(browser) == [] and _external_references(browser) == []

    browser.find_element(By.LINK_TEXT, "ingest validation").click()
    assert "ingest validation — FAILED" in browser.title
    failed = browser.find_elements(By.CSS_SELECTOR, "tr.failed")
    assert len(failed) == 1
    assert "expect_column_pair_values_a_to_be_greater_than_b" in failed[0].text
    assert "openai_chat" in failed[0].text and failed[0].is_displayed()
    assert _network_problems(browser) == []
    _screenshot(browser, shots / "report_failed_gate.png")



def test_the_checks_catch_a_remote_or_missing_resource(browser, tmp_path):
    """The two checks above can fail: a page with a CDN stylesheet and a missing image."""
    page = tmp_path / "bad.html"
    page.write_text('<!DOCTYPE html><html><head><link rel="stylesheet" '
                    'href="https://cdn.example.invalid/x.css"></head><body>'
                    '<img src="missing.png" alt="x"></body></html>')
    _open(browser, page)
    problems = _network_problems(browser)
    assert any("cdn.example.invalid" in p for p in problems)
    assert any("missing.png" in p for p in problems)
    refs = _external_references(browser)
    assert any("cdn.example.invalid" in r for r in refs) and any("broken img" in r for r in refs)


def _rows_as_the_drafter_sees_them(browser, run: Path) -> None:
    """The tokenize section's sample rows: one span per token, highlighted exactly where the
    row's loss mask is 1 (read back from the dataset), the highlight visible."""
    import datasets

    shown = browser.execute_script("""
        return [...document.querySelectorAll('pre.row')].map(pre => [
          Number(pre.dataset.row), Number(pre.dataset.supervised),
          [...pre.querySelectorAll('span.t')].map(t => t.classList.contains('s') ? 1 : 0),
          [...pre.querySelectorAll('span.t')].map(t => Number(t.title))]);""")
    assert len(shown) >= 5
    rows = datasets.load_from_disk(str(run / "tokenize" / "dataset")).with_format(None)
    for row, supervised, marks, ids in shown:
        assert ids == rows[row]["input_ids"][:len(ids)]
        assert marks == rows[row]["loss_mask"][:len(marks)] and sum(marks) == supervised
    colors = browser.execute_script("""
        const s = document.querySelector('pre.row span.s'),
              t = document.querySelector('pre.row span.t:not(.s)');
        return [getComputedStyle(s).backgroundColor, getComputedStyle(t).backgroundColor];""")
    assert colors[0] != colors[1]

