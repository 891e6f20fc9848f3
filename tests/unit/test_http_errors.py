"""http_errors: what a client and the log learn about a request aiohttp cannot parse."""

import logging
import time

import pytest
from aiohttp.http_exceptions import (
    BadHttpMessage, BadHttpMethod, BadStatusLine, InvalidHeader, InvalidURLError, LineTooLong,
    TransferEncodingError)

from jaxserve.entrypoints.http_errors import ParseErrorLog, describe

SECRET = "s3cr3t KEY"


@pytest.mark.parametrize("exc,want", [
    # llhttp's wording, as aiohttp's C parser raises it: the description, not the quoted bytes
    (BadHttpMessage(f"Unexpected whitespace after header value:\n\n  b' {SECRET}'\n    ^"),
     "unexpected whitespace after header value"),
    (InvalidURLError(f"Invalid char in url path:\n\n  b'GET /{SECRET}'\n    ^"),
     "invalid char in url path"),
    # the pure-Python parser's wording quotes the bytes: the kind of error instead
    (BadStatusLine(SECRET), "malformed request line"),
    (BadHttpMethod(SECRET), "bad method in the request line"),
    (BadHttpMethod("\x16\x03\x01"), "HTTPS traffic on an HTTP port"),
    (InvalidHeader(SECRET.encode()), "invalid HTTP header"),
    (LineTooLong(SECRET, 8190), "a request line or header is too long"),
    (TransferEncodingError(f"Not enough data for satisfy transfer length {SECRET}"),
     "malformed chunked body"),
    (BadHttpMessage(SECRET), "malformed request"),
])
def test_describe_names_the_error_without_the_bytes(exc, want):
    assert describe(exc) == want


def test_parse_errors_are_logged_once_per_address_per_interval(caplog):
    log = ParseErrorLog(interval_s=0.2)
    with caplog.at_level(logging.WARNING, "jaxserve.api"):
        for _ in range(5):
            log.record("10.0.0.1", "malformed header")
        log.record("10.0.0.2", "malformed header")
        time.sleep(0.25)
        log.record("10.0.0.1", "malformed header")
    lines = [r.getMessage() for r in caplog.records]
    assert lines == ["malformed HTTP request from 10.0.0.1: malformed header",
                     "malformed HTTP request from 10.0.0.2: malformed header",
                     "malformed HTTP request from 10.0.0.1: malformed header (4 more from this "
                     "address since its last line)"]
