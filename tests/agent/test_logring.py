"""The agent's log ring at its documented bounds (docs/api.md, the `logs` command: "its ring: the
last 500 lines of INFO and up, each cut at 1000 characters"; docs/agent.md, "Logs"): the 500th
line stays and the 501st pushes out the oldest; a line of 1000 characters is kept whole and one
of 1001 loses its last character; DEBUG never enters."""

from __future__ import annotations

import logging

from agent.runtime.logring import LogRing, fitting, install

PREFIX = "phone: "  # the ring's format: "<logger name>: <message>"


def record(message: str, level: int = logging.INFO) -> logging.LogRecord:
    return logging.LogRecord("phone", level, __file__, 1, message, None, None)


def test_the_ring_keeps_the_last_500_lines_in_order() -> None:
    ring = LogRing()
    for i in range(1, 501):
        ring.emit(record(f"line {i}"))
    kept = ring.snapshot()
    assert len(kept) == 500 and kept[0]["message"] == PREFIX + "line 1"
    ring.emit(record("line 501"))
    kept = ring.snapshot()
    assert [line["seq"] for line in kept] == list(range(2, 502))
    assert kept[0]["message"] == PREFIX + "line 2" and kept[-1]["message"] == PREFIX + "line 501"


def test_a_line_is_cut_at_1000_characters() -> None:
    ring = LogRing()
    whole = "x" * (1000 - len(PREFIX))
    ring.emit(record(whole))
    ring.emit(record(whole + "y"))
    ring.emit(record(whole + "y" * 5000))
    first, second, third = (line["message"] for line in ring.snapshot())
    assert first == PREFIX + whole and len(first) == 1000
    assert second == first and third == first


def test_a_line_that_cannot_be_formatted_is_kept_as_its_message_cut_too() -> None:
    ring = LogRing()
    broken = logging.LogRecord("phone", logging.INFO, __file__, 1, "%d of " + "z" * 2000,
                               ("not a number",), None)
    ring.emit(broken)
    [line] = ring.snapshot()
    assert line["message"] == ("%d of " + "z" * 2000)[:1000]
    assert line["level"] == "INFO" and line["seq"] == 1 and line["ts"] == broken.created


def test_info_and_up_enter_the_installed_ring_debug_does_not() -> None:
    logger = logging.getLogger("tests.agent.logring")
    logger.propagate = False
    logger.setLevel(logging.DEBUG)
    ring = install(logger)
    try:
        assert install(logger) is ring and logger.handlers.count(ring) == 1  # idempotent
        before = len(ring.snapshot())
        logger.debug("not kept")
        logger.info("kept")
        logger.warning("kept too")
        got = [line["message"] for line in ring.snapshot()[before:]]
        assert got == ["tests.agent.logring: kept", "tests.agent.logring: kept too"]
    finally:
        logger.removeHandler(ring)


def test_shipped_lines_fit_the_body_limit_dropping_the_oldest() -> None:
    lines = [{"seq": i, "ts": 0.0, "level": "INFO", "message": "m" * 1000} for i in range(500)]
    assert fitting(lines) == lines  # a full ring of full lines is well under 900 kB
    kept = fitting(lines, max_bytes=10_000)
    assert kept == lines[-len(kept):] and 0 < len(kept) < 10
