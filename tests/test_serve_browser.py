"""The page of ``flowers serve`` in a real headless chromium: pick a photo, see the top classes."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from tests.helpers.serving import TOP_K, httpx, photo_files

webdriver = pytest.importorskip("selenium.webdriver", reason="the page test drives chromium with Selenium ('.[dev]')")
from selenium.common.exceptions import WebDriverException  # noqa: E402
from selenium.webdriver.common.by import By  # noqa: E402
from selenium.webdriver.support.ui import WebDriverWait  # noqa: E402


@pytest.fixture(scope="module")
def browser():
    chromium = next(filter(None, map(shutil.which, ("chromium", "chromium-browser", "google-chrome"))), None)
    driver = shutil.which("chromedriver")
    if not chromium or not driver:
        pytest.skip("chromium or chromedriver is not installed (`make browser` installs Debian's with apt)")
    options = webdriver.ChromeOptions()
    options.binary_location = chromium
    for flag in ("--headless", "--no-sandbox", "--disable-dev-shm-usage", "--disable-gpu", "--window-size=1000,900"):
        options.add_argument(flag)
    try:
        # Both paths given: Selenium starts them as they are and downloads nothing.
        session = webdriver.Chrome(service=webdriver.ChromeService(executable_path=driver), options=options)
    except WebDriverException as failure:
        pytest.skip(f"chromium could not start: {' '.join(str(failure.msg).split())[:300]}")
    yield session
    session.quit()


def test_a_photo_picked_on_the_page_shows_the_servers_top_classes(browser, served, tmp_path):
    photo = list(photo_files(tmp_path))[-1]  # a drawn rose
    expected = httpx.post(f"{served.url}/predict", content=photo.read_bytes(),
                          headers={"Content-Type": "image/jpeg"}, timeout=60).json()
    browser.get(f"{served.url}/")
    wait = WebDriverWait(browser, 60)
    wait.until(lambda b: "daisy, dandelion, rose, sunflower, tulip" in b.find_element(By.ID, "model").text)
    browser.find_element(By.ID, "file").send_keys(str(photo))
    wait.until(lambda b: b.find_element(By.ID, "prediction").text or b.find_element(By.ID, "error").text)
    assert browser.find_element(By.ID, "error").text == ""
    assert browser.find_element(By.ID, "prediction").text == expected["prediction"]
    rows = browser.find_elements(By.CSS_SELECTOR, "#top li")
    assert len(rows) == TOP_K
    for row, top in zip(rows, expected["top"], strict=True):
        assert row.find_element(By.CLASS_NAME, "class").text == top["class"]
        assert row.find_element(By.CLASS_NAME, "probability").text == f"{100 * top['probability']:.1f} %"
        width = row.find_element(By.CSS_SELECTOR, ".bar span").get_attribute("style")
        assert f"width: {100 * top['probability']:.1f}%" in width
    assert browser.find_element(By.ID, "preview").get_attribute("hidden") is None


def test_a_file_that_is_no_image_shows_the_servers_error_on_the_page(browser, served, tmp_path):
    notes = Path(tmp_path / "notes.txt")
    notes.write_text("not a photo")
    browser.get(f"{served.url}/")
    browser.find_element(By.ID, "file").send_keys(str(notes))
    wait = WebDriverWait(browser, 60)
    wait.until(lambda b: b.find_element(By.ID, "error").text)
    assert "not an image" in browser.find_element(By.ID, "error").text
    assert browser.find_element(By.ID, "prediction").text == ""
