"""The peer's parts that need no model and no network: the session table, the compute runtime, its config."""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import operator
import threading
from pathlib import Path

import pytest

from peer.config import PeerConfig, parse_bytes
from peer.runtime import Runtime
from peer.sessions import SessionTable
from swarm.config import add_options, from_args
from swarm.errors import Busy, ConfigError, OutOfCache, StepTimeout, UnknownSession
from swarm.span import Span
from runtime_gate import Gate, WAIT

pytestmark = pytest.mark.unit

SPAN = Span(0, 2)


# ---- sessions ----

def test_sessions_reserve_and_release_cache():
    table = SessionTable(cache_tokens=1000, max_sessions=8)
    a = table.open(SPAN, 2, 100, "float32", now=0.0)
    b = table.open(SPAN, 1, 300, "float32", now=0.0)
    assert (a.reserved, b.reserved, table.reserved, table.tokens_left) == (200, 128, 328, 672)  # a chunk at open
    table.grow(b, 300, now=0.0)
    assert (b.reserved, table.reserved, table.tokens_left) == (300, 500, 500)
    assert a.id != b.id and table.get(a.id) is a
    table.close(a.id)
    assert (table.reserved, table.tokens_left) == (300, 700)
    assert a.closed and a.cache is None
    table.close(a.id)  # closing twice is harmless
    table.close("never-opened")
    assert table.tokens_left == 700


def test_session_larger_than_the_free_cache_fails_at_once():
    table = SessionTable(cache_tokens=1000, max_sessions=8)
    big = table.open(SPAN, 1, 601, "float32", now=0.0)
    table.grow(big, 601, now=0.0)
    with pytest.raises(OutOfCache, match="batch 1 x length 1001 needs more than this peer's whole cache"):
        table.open(SPAN, 1, 1001, "float32", now=0.0)
    late = table.open(SPAN, 1, 400, "float32", now=0.0)
    with pytest.raises(OutOfCache, match="272 more cache tokens needed, 271 of 1000 are free"):
        table.grow(late, 400, now=0.0)
    assert (len(table.sessions), table.tokens_left, late.reserved) == (2, 271, 128)
    table.close(big.id)
    table.grow(late, 400, now=0.0)
    table.grow(table.open(SPAN, 1, 600, "float32", now=0.0), 600, now=0.0)  # exactly what is free
    assert table.tokens_left == 0


def test_session_limit_is_busy():
    table = SessionTable(cache_tokens=10**6, max_sessions=2)
    first = table.open(SPAN, 1, 10, "float32", now=0.0)
    table.open(SPAN, 1, 10, "float32", now=0.0)
    with pytest.raises(Busy, match="limit is 2"):
        table.open(SPAN, 1, 10, "float32", now=0.0)
    table.close(first.id)
    table.open(SPAN, 1, 10, "float32", now=0.0)
    assert len(table.sessions) == 2


def test_unknown_and_closed_sessions():
    table = SessionTable(cache_tokens=1000, max_sessions=8)
    with pytest.raises(UnknownSession, match="nope"):
        table.get("nope")
    session = table.open(SPAN, 1, 10, "float32", now=0.0)
    table.close(session.id)
    with pytest.raises(UnknownSession, match=session.id):
        table.get(session.id)


# ---- runtime ----

def test_runtime_runs_jobs_on_its_own_thread():
    async def main(rt):
        return await rt.run(threading.current_thread), await rt.run(operator.add, 2, 3)

    with Runtime(name="compute-test") as rt:
        worker, total = asyncio.run(main(rt))
    assert worker is not threading.current_thread() and worker.name == "compute-test"
    assert total == 5 and rt.jobs_done == 2
    assert not worker.is_alive()  # leaving the context stops the worker


def test_runtime_propagates_the_job_exception():
    error = KeyError("missing block")

    def fail():
        raise error

    with Runtime() as rt, pytest.raises(KeyError) as info:
        asyncio.run(rt.run(fail))
    assert info.value is error


def test_full_queue_is_busy_at_once():
    gate, ran = Gate(), []

    async def main(rt):
        running = asyncio.create_task(rt.run(gate))
        await gate.wait_started()  # the worker holds the gate; the queue (size 1) is empty
        queued = asyncio.create_task(rt.run(ran.append, "queued"))
        await asyncio.sleep(0)  # let it enter the queue
        assert rt.queued == 1
        try:
            with pytest.raises(Busy, match="queue is full"):
                await asyncio.wait_for(rt.run(ran.append, "refused"), WAIT)  # no waiting for room
        finally:
            gate.release.set()
        return await running, await queued

    with Runtime(max_queue=1) as rt:
        assert asyncio.run(main(rt)) == ("released", None)
    assert ran == ["queued"]


def test_step_timeout_and_skipped_jobs():
    gate, ran = Gate(), []

    async def main(rt):
        try:
            with pytest.raises(StepTimeout, match="did not finish within"):
                await rt.run(gate, timeout=0.05)  # times out while running
            with pytest.raises(StepTimeout):
                await rt.run(ran.append, "abandoned", timeout=0.05)  # times out while queued behind the gate
        finally:
            gate.release.set()
        return await rt.run(ran.append, "after")  # the runtime still works, in order

    with Runtime() as rt:
        asyncio.run(main(rt))
    assert ran == ["after"]  # the abandoned job never ran
    assert gate.started.is_set()


# ---- config ----

@pytest.mark.parametrize("text,expected", [
    ("800MB", 800 * 10**6), ("2GiB", 2 * 2**30), ("4096", 4096), ("1.5GB", 1_500_000_000), ("300mib", 300 * 2**20),
    (" 64 KiB ", 64 * 2**10), ("7B", 7), ("1TB", 10**12), (".5KB", 500),
])
def test_parse_bytes(text, expected):
    assert parse_bytes(text) == expected


@pytest.mark.parametrize("text", ["", "MB", "abc", "12XB", "-1MB", "1e3", "1.2.3MB", "2 G B", "1,5GB"])
def test_parse_bytes_rejects_malformed(text):
    with pytest.raises(ValueError, match="not a size"):
        parse_bytes(text)


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="swarm peer")
    add_options(p, PeerConfig)
    return p


def test_peer_config_from_the_command_line():
    ns = parser().parse_args(["--model", "m", "--blocks", "0:2", "--initial-peers", "a", "b",
                              "--memory-budget", "1GB", "--max-request-bytes", "64MiB", "--step-timeout", "2.5"])
    cfg = from_args(PeerConfig, ns)
    assert cfg.model == "m"
    assert cfg.blocks == Span(0, 2)
    assert cfg.initial_peers == ("a", "b")
    assert cfg.memory_budget == 10**9
    assert cfg.max_request_bytes == 64 * 2**20 and cfg.step_timeout == 2.5
    assert (cfg.port, cfg.max_sessions, cfg.identity, cfg.num_blocks) == (0, 64, None, None)  # dataclass defaults
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.port = 1


def test_peer_config_defaults_and_overrides():
    cfg = from_args(PeerConfig, parser().parse_args(["--model", "m"]), port=4000)
    assert cfg == PeerConfig(model="m", port=4000)
    assert cfg.initial_peers == () and cfg.blocks is None


def test_model_is_required(capsys):
    with pytest.raises(SystemExit):
        parser().parse_args([])
    assert "--model" in capsys.readouterr().err


def test_help_shows_defaults():
    text = parser().format_help()
    assert "--max-sessions" in text and "(default: 64)" in text and "80% of available memory" in text


@pytest.mark.parametrize("change, flag", [
    ({"cache_tokens": 0}, "--cache-tokens"), ({"max_sessions": -1}, "--max-sessions"),
    ({"num_blocks": 0}, "--num-blocks"), ({"dtype": "float64"}, "--dtype"),
    ({"announce_interval": 60.0, "record_ttl": 30.0}, "--announce-interval"), ({"port": 70000}, "--port"),
    ({"relay_slots": -1}, "--relay-slots"),
])
def test_invalid_peer_config_is_a_config_error_naming_the_option(change, flag):
    with pytest.raises(ConfigError, match=flag):
        PeerConfig(model=Path("m"), **change)
