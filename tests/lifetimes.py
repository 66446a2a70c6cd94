"""Session fixtures that own processes (a swarm's peers) are released as soon as the last collected test that
uses them is done, not at the end of the session: idle peers would otherwise share the CPU with every later
test. Released means stopped; the fixture's own teardown still runs at the end, so stopping must be idempotent.

`tests/conftest.py` feeds this module from two hooks: the collected tests in run order, and each test's end.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

_last_user: dict[str, str] = {}  # fixture name -> node id of the last collected test that uses it
_releases: dict[str, Callable[[], None]] = {}  # fixture name -> how to stop what it owns


def release_after_last_use(fixture: str, stop: Callable[[], None]) -> None:
    """Call `stop` once the last collected test that uses `fixture` (directly or through other fixtures) and
    its teardown are done."""
    _releases[fixture] = stop


def collected(items: Iterable) -> None:
    """The tests that will run, in order (after every selection and reordering)."""
    _last_user.clear()
    for item in items:
        for name in getattr(item, "fixturenames", ()):  # the closure: fixtures used through fixtures too
            _last_user[name] = item.nodeid


def finished(nodeid: str) -> None:
    """Test `nodeid` and its teardown are done: release what no later test uses."""
    for fixture in [f for f in _releases if _last_user.get(f) == nodeid]:
        _releases.pop(fixture)()
