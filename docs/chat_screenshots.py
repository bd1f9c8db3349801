"""Takes the README's chat page screenshots (docs/chat.png, docs/chat-phone.png) from a running server.

    .venv/bin/kaiten up &                      # or any gateway with an engine behind it
    .venv/bin/python docs/chat_screenshots.py http://127.0.0.1:8000

Drives Debian's chromium through Playwright (as tests/gateway/test_chat_page.py does): one short chat kept in
the list of past chats, then a question whose answer has markdown and code. Greedy with a seed, so a
run on the same model draws the same answers.
"""
from __future__ import annotations

import sys
from pathlib import Path

from playwright.sync_api import sync_playwright

DOCS = Path(__file__).resolve().parent
CHROMIUM = "/usr/bin/chromium"
QUESTIONS = ["What is the capital of France?",
             "Give me three tips for writing clean Python code, each with a short example."]


def ask(pg, text: str) -> None:
    pg.fill("#prompt", text)
    pg.keyboard.press("Enter")
    pg.wait_for_function("() => { const a = [...document.querySelectorAll('article.msg-assistant')].pop();"
                         " return a && ['done', 'stopped', 'error'].includes(a.dataset.state); }", timeout=120_000)


def main(url: str) -> None:
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=["--headless", "--no-sandbox", "--disable-gpu"])
        pg = browser.new_page(viewport={"width": 1280, "height": 860})
        pg.goto(url)
        pg.wait_for_selector("body[data-conn=open]")
        for field, value in (("#temperature", "0"), ("#top_p", "1"), ("#max_tokens", "320"), ("#seed", "0")):
            pg.fill(field, value)
        ask(pg, QUESTIONS[0])
        pg.click("#new-chat")
        ask(pg, QUESTIONS[1])
        pg.wait_for_timeout(3000)                      # the status line settles back to running 0
        pg.mouse.move(0, 0)
        pg.screenshot(path=str(DOCS / "chat.png"))
        pg.set_viewport_size({"width": 390, "height": 844})
        pg.wait_for_timeout(300)
        pg.screenshot(path=str(DOCS / "chat-phone.png"))
        browser.close()


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "http://127.0.0.1:8000")
