"""transformers' `generate()` with checked outputs (`client.inference.verify`): what a streamer sees is verified output
only, and a lie found during or after the generation makes it go on from the last right position.

`HeldStreamer` wraps the caller's streamer: transformers puts the prompt, then each step's new tokens; the
wrapper passes a step's tokens on once the outputs they were made from are verified (`InferenceSession.
verified_length`), and the end once everything is. `checked_generate` runs transformers' generate in the
active session; when the session rewinds (`Rewound`: a hop was found lying and replaced), it runs generate
again from the tokens still right, with the same arguments less the tokens already made, at most
`MAX_REWINDS` times. Greedy output is therefore the honest model's; sampling draws anew after the rewind.

Blocks that no other peer could check (a sole server) count as verified; a generation through them says so:
an `UncheckedOutputWarning` (once per generation) and the output's `unchecked_blocks` attribute (the API's
`X-Swarm-Unchecked-Blocks` header and usage field carry the same text). `--require-checked` refuses them.
"""

from __future__ import annotations

import copy
import warnings

import torch

from swarm.errors import Rewound, SwarmError

MAX_REWINDS = 8


class UncheckedOutputWarning(UserWarning):
    """Some blocks of a generation's route were computed by a peer no other peer could check."""


# every generation through unchecked blocks says so, not only the first one at a given line (a caller's own
# filters come first and still win)
warnings.filterwarnings("always", category=UncheckedOutputWarning, append=True)


def unchecked_message(blocks: list[str]) -> str:
    """What users are told of hops no other peer could check, each as `str(hop)`: '[15:30) at XXXXXXXX' (the
    peer's id's last 8 characters; ASCII, as HTTP headers need)."""
    return (f"blocks {', '.join(blocks)} were computed by a peer that no other peer could check: their outputs are "
            "unchecked (--require-checked refuses them)")


class HeldStreamer:
    def __init__(self, streamer, session, prompt_length: int):
        self.streamer, self.session, self.prompt_length = streamer, session, prompt_length
        self.prompt_seen = False
        self.restarted = False  # a restarted generate puts its prefix again: not new tokens
        self.held: list[torch.Tensor] = []  # steps' tokens not passed on yet
        self.passed = 0  # steps' tokens passed on

    def put(self, value: torch.Tensor) -> None:
        if not self.prompt_seen:
            self.prompt_seen = True
            if self.streamer is not None and not self.restarted:
                self.streamer.put(value)
            return
        self.held.append(value)
        self.release(self.session.verified_length - self.prompt_length + 1)

    def end(self) -> None:
        """transformers' end of a generate: nothing here (the checked generate ends the caller's streamer)."""

    def release(self, upto: int) -> None:
        while self.held and self.passed < upto:
            value = self.held.pop(0)
            self.passed += 1
            if self.streamer is not None:
                self.streamer.put(value)

    def rewind(self, steps: int) -> None:
        """Only the first `steps` steps' tokens are right; the generate restarts after them."""
        self.held = self.held[:max(0, steps - self.passed)]
        self.prompt_seen, self.restarted = False, True

    def finish(self) -> None:
        self.release(self.passed + len(self.held))
        if self.streamer is not None:
            self.streamer.end()


def checked_generate(generate, remote, inputs: torch.Tensor, kwargs: dict):
    """`generate(inputs, **kwargs)` (transformers') in `remote` (a `TokenSession`), verified."""
    prompt_length = inputs.shape[1]
    held = HeldStreamer(kwargs.pop("streamer", None), remote.session, prompt_length)
    ids, base = inputs, kwargs
    for _ in range(MAX_REWINDS + 1):
        try:
            out = generate(ids, streamer=held if held.streamer is not None else None, **kwargs)
            remote.model.connection.run(remote.session.verify())
            held.finish()
            return _said(out, [str(hop) for hop in remote.session.unchecked])
        except Rewound as e:
            if held.streamer is not None and max(0, e.position + 1 - prompt_length) < held.passed:  # shown unchecked
                raise SwarmError(f"{e}; tokens already streamed were made from it (their blocks had no other "
                                 "peer to check them then)") from None
            right = remote.last_ids[:, :e.position + 1]
            if right.shape[1] < prompt_length:
                right = inputs
            held.rewind(right.shape[1] - prompt_length)
            kwargs = _less(base, right.shape[1] - prompt_length, right.shape[1])
            ids = right
    raise SwarmError(f"outputs were found wrong {MAX_REWINDS} times in one generation")


def _said(out, blocks: list[str]):
    """`out` with `unchecked_blocks` set, after warning once if there are any."""
    if blocks:
        warnings.warn(unchecked_message(blocks), UncheckedOutputWarning, stacklevel=4)
    try:
        out.unchecked_blocks = blocks
    except AttributeError:
        pass  # an output type that takes no attributes: the warning said it
    return out


def _less(kwargs: dict, made: int, length: int) -> dict:
    """The arguments of a generate that goes on from `length` tokens, `made` of them already generated."""
    kwargs = dict(kwargs)
    if kwargs.get("max_new_tokens") is not None:
        kwargs["max_new_tokens"] = max(1, kwargs["max_new_tokens"] - made)
    elif kwargs.get("generation_config") is not None and kwargs["generation_config"].max_new_tokens is not None:
        config = kwargs["generation_config"] = copy.deepcopy(kwargs["generation_config"])
        config.max_new_tokens = max(1, config.max_new_tokens - made)
    mask = kwargs.get("attention_mask")
    if mask is not None and mask.shape[1] < length:
        kwargs["attention_mask"] = torch.cat([mask, mask.new_ones(mask.shape[0], length - mask.shape[1])], 1)
    elif mask is not None:
        kwargs["attention_mask"] = mask[:, :length]
    return kwargs
