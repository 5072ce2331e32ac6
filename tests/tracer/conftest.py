"""Fixtures of the tracer tests: canned Anthropic and Responses upstreams (tests/canned_apis.py)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.canned_apis import CannedAnthropic, CannedResponses


@pytest.fixture
def anthropic_upstream() -> Iterator[CannedAnthropic]:
    """An Anthropic-style server on a free loopback port."""
    server = CannedAnthropic().start()
    yield server
    server.stop()


@pytest.fixture
def responses_upstream() -> Iterator[CannedResponses]:
    """A Responses-style server on a free loopback port."""
    server = CannedResponses().start()
    yield server
    server.stop()
