"""A screenshot of a run's page in the gateway's web console, taken by Debian's headless chromium (selenium)."""

from __future__ import annotations

import contextlib
import shutil
from collections.abc import Iterator
from pathlib import Path
from urllib.parse import quote

from selenium import webdriver
from selenium.webdriver.common.by import By
from selenium.webdriver.support.ui import WebDriverWait

WAIT_S = 60  # the most the page is waited for


@contextlib.contextmanager
def chromium(width: int = 1200, height: int = 1000) -> Iterator[webdriver.Chrome]:
    """Debian's chromium, headless, driven by its chromedriver; quit on the way out."""
    options = webdriver.ChromeOptions()
    options.binary_location = shutil.which("chromium") or "/usr/bin/chromium"
    for flag in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", f"--window-size={width},{height}"):
        options.add_argument(flag)
    service = webdriver.ChromeService(executable_path=shutil.which("chromedriver") or "/usr/bin/chromedriver")
    driver = webdriver.Chrome(options=options, service=service)
    try:
        yield driver
    finally:
        driver.quit()


def log_in(driver: webdriver.Chrome, http_url: str, api_key: str) -> None:
    """Log in to the console at ``http_url`` with ``api_key`` through its form; returns on the overview."""
    driver.get(http_url + "/console/login")
    driver.find_element(By.NAME, "api_key").send_keys(api_key)
    driver.find_element(By.CSS_SELECTOR, "button[type=submit]").click()
    WebDriverWait(driver, WAIT_S).until(lambda d: d.title.startswith("Overview"))


def screenshot(http_url: str, api_key: str, model_id: str, out: Path) -> Path:
    """Log in to the console at ``http_url`` with ``api_key``, open run ``model_id``'s page, wait until its curves
    are drawn and save the page as the PNG ``out``."""
    with chromium() as driver:
        log_in(driver, http_url, api_key)
        driver.get(f"{http_url}/console/training_runs/{quote(model_id, safe='')}")
        WebDriverWait(driver, WAIT_S).until(lambda d: d.find_elements(By.CSS_SELECTOR, "svg[data-points]"))
        driver.save_screenshot(str(out))
    return out
