from __future__ import annotations

import pytest

from swarm.errors import BadRequest
from swarm.span import Span, split_evenly

pytestmark = pytest.mark.unit


def test_parse_and_iterate():
    span = Span.parse("3:7")
    assert (span.start, span.end, len(span), list(span)) == (3, 7, 4, [3, 4, 5, 6])
    assert str(span) == "[3:7)"


@pytest.mark.parametrize("text", ["", "3", "3:", "a:b", "5:5", "7:3", "-1:3", "1:2:3"])
def test_parse_rejects_malformed(text):
    with pytest.raises(BadRequest):
        Span.parse(text)


def test_check_within():
    Span(0, 30).check_within(30)
    with pytest.raises(BadRequest, match="outside"):
        Span(20, 31).check_within(30)


@pytest.mark.parametrize("blocks,parts", [(30, 3), (6, 3), (7, 3), (5, 5), (16, 1)])
def test_split_evenly_covers_in_order(blocks, parts):
    spans = split_evenly(blocks, parts)
    assert [b for s in spans for b in s] == list(range(blocks))
    assert max(map(len, spans)) - min(map(len, spans)) <= 1


def test_split_evenly_rejects_impossible():
    with pytest.raises(BadRequest):
        split_evenly(3, 4)
