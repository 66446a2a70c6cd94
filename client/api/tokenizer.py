"""The gateway's tokenizer endpoints, in vLLM's shapes, so harnesses can count and split tokens remotely:
`POST /tokenize` (a prompt, or chat messages through the chat template), `POST /detokenize`, and
`GET /tokenizer_info` (special tokens and the chat template). `model` is optional here (harnesses send
none) while the gateway serves one model; the gateway picks the model's tokenizer. Pure request/response
logic over the local tokenizer."""

from __future__ import annotations

from typing import Any

from client.api.requests import checked_text, invalid, parse_messages


def _flag(body: dict, name: str, default: bool) -> bool:
    value = body.get(name, default)
    if not isinstance(value, bool):
        raise invalid(name, f"'{name}' must be a boolean")
    return value


def tokenize_request(body: dict) -> tuple[str, Any, bool, bool]:
    """What to tokenize: ("prompt", text, add_special_tokens, return_token_strs) or ("messages", messages,
    add_generation_prompt, return_token_strs)."""
    strs = _flag(body, "return_token_strs", False)
    if "messages" in body:
        return "messages", parse_messages(body), _flag(body, "add_generation_prompt", True), strs
    prompt = body.get("prompt")
    if not isinstance(prompt, str):
        raise invalid("prompt", "'prompt' must be a string (or send 'messages')")
    return "prompt", checked_text(prompt, "prompt"), _flag(body, "add_special_tokens", True), strs


def tokenize_answer(tokenizer, ids: list[int], context_length: int, strs: bool) -> dict[str, Any]:
    out: dict[str, Any] = {"count": len(ids), "max_model_len": context_length, "tokens": ids}
    if strs:
        out["token_strs"] = tokenizer.convert_ids_to_tokens(ids)
    return out


def detokenize(body: dict, tokenizer, vocab_size: int) -> dict[str, Any]:
    tokens = body.get("tokens")
    if not isinstance(tokens, list) or not all(type(t) is int for t in tokens):
        raise invalid("tokens", "'tokens' must be a list of token ids")
    if not all(0 <= t < vocab_size for t in tokens):
        raise invalid("tokens", f"token ids must lie in [0, {vocab_size})")
    return {"prompt": tokenizer.decode(tokens)}


def tokenizer_info(tokenizer, context_length: int) -> dict[str, Any]:
    special = {name: getattr(tokenizer, name, None) for name in ("bos_token", "eos_token", "pad_token", "unk_token")}
    return {"tokenizer_class": type(tokenizer).__name__, **{k: v if isinstance(v, str) else None
                                                            for k, v in special.items()},
            "chat_template": tokenizer.chat_template if isinstance(tokenizer.chat_template, str) else None,
            "model_max_length": context_length, "vocab_size": len(tokenizer)}
