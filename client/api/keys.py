"""Users of the gateway: API keys, as OpenAI clients send them (`Authorization: Bearer KEY`). Sync, small.

Without keys (the default) the gateway has one user, everyone who can reach it, as before. With keys
(`--api-key KEY`, repeated, or `--api-keys FILE`: one key per line, `NAME KEY` or `KEY` alone, `#` comments), a
request without a known key gets 401 (`invalid_api_key`), and each key is a user of its own:
- **Prompt reuse** (`client.api.reuse`) shares sessions within one user only: another user's cached prompt is
  neither used nor detectable (`cached_tokens`, timing), as a per-request `cache_salt` does elsewhere. The
  `user` field of a request is the client's word, not proof: it changes nothing here.
- **Limits**: a user runs at most `--key-generations` generations at once (running or waiting for a slot);
  more get 429 (`rate_limit_exceeded`), so one user cannot take every slot.
- **Metrics**: requests by user name and status (`swarm_api_user_requests_total`).
Keys are compared in constant time; logs and metrics name users, never keys.
"""

from __future__ import annotations

import hashlib
import hmac
from collections import Counter
from pathlib import Path

from client.api.errors import ApiError
from swarm.errors import ConfigError

MAX_KEYS = 10_000


class ApiKeys:
    def __init__(self, keys: dict[str, str], per_user: int):
        """`keys`: key -> user name; `per_user`: generations one user may have at once."""
        self.keys = dict(keys)
        self.per_user = per_user
        self.holding: Counter[str] = Counter()

    @classmethod
    def of(cls, config) -> ApiKeys:
        keys = {key: f"key{i + 1}" for i, key in enumerate(config.api_key)}
        if config.api_keys is not None:
            keys.update(read_keys(Path(config.api_keys)))
        return cls(keys, config.key_generations)

    @property
    def on(self) -> bool:
        return bool(self.keys)

    def user(self, authorization: str | None) -> str:
        """The user an `Authorization` header names ("" when the gateway has no keys); 401 if none does."""
        if not self.keys:
            return ""
        scheme, _, given = (authorization or "").partition(" ")
        if scheme.lower() != "bearer" or not given.strip():
            raise unauthorized("no API key: send it as 'Authorization: Bearer KEY'")
        given = given.strip().encode()
        found = ""
        for key, name in self.keys.items():  # every key compared, in constant time: no timing says which is near
            if hmac.compare_digest(key.encode(), given):
                found = name
        if not found:
            raise unauthorized("the API key is not valid for this server")
        return found

    def admit(self, user: str) -> None:
        """One more generation of `user`; 429 if it has `per_user` already. `release(user)` when it ends."""
        if self.keys and self.holding[user] >= self.per_user:
            raise ApiError(429, f"this API key has {self.holding[user]} generations running or waiting, its limit; "
                           "retry when one ends", type="rate_limit_error", code="rate_limit_exceeded",
                           headers={"Retry-After": "1"})
        self.holding[user] += 1

    def release(self, user: str) -> None:
        self.holding[user] -= 1
        if self.holding[user] <= 0:
            del self.holding[user]


def unauthorized(message: str) -> ApiError:
    return ApiError(401, message, type="invalid_request_error", code="invalid_api_key",
                    headers={"WWW-Authenticate": "Bearer"})


def read_keys(path: Path) -> dict[str, str]:
    """A keys file: key -> user name (a line's name, else one made of the key's hash)."""
    try:
        lines = path.read_text().splitlines()
    except OSError as e:
        raise ConfigError(f"cannot read the API keys file {path}: {e}") from None
    keys: dict[str, str] = {}
    for number, line in enumerate(lines, 1):
        words = line.split("#", 1)[0].split()
        if not words:
            continue
        if len(words) > 2 or len(keys) >= MAX_KEYS:
            raise ConfigError(f"{path}:{number}: a line is 'NAME KEY' or 'KEY' (at most {MAX_KEYS} keys)")
        key = words[-1]
        name = words[0] if len(words) == 2 else "key-" + hashlib.sha256(key.encode()).hexdigest()[:8]
        if len(key) < 8:
            raise ConfigError(f"{path}:{number}: an API key has at least 8 characters")
        keys[key] = name
    if not keys:
        raise ConfigError(f"the API keys file {path} holds no key")
    return keys
