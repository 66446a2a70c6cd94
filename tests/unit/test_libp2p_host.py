"""The light client's host module: the placeholder of a module it never loads names itself when used."""

from __future__ import annotations

import sys
import typing

import pytest

from client.light import host as libp2p_host


def test_a_placeholder_class_is_a_type_to_annotate_with_but_refuses_to_be_made(monkeypatch):
    name = "swarm_test_placeholder.stream"
    monkeypatch.delitem(sys.modules, name, raising=False)
    libp2p_host._placeholder(name, ("QUICStream",))
    try:
        cls = sys.modules[name].QUICStream
        assert isinstance(cls, type) and cls.__module__ == name
        assert typing.get_args(cls | None) == (cls, type(None))  # a type alias, as libp2p.custom_types makes
        with pytest.raises(ImportError, match=r"swarm_test_placeholder\.stream\.QUICStream is not loaded"):
            cls()
    finally:
        sys.modules.pop(name, None)
