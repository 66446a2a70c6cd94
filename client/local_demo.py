"""The offline demo: the demo model split into spans, chained in one process, streaming its answer.

Until peers run as separate processes, this is the main job of the quick start: it shows the same
path a swarm route takes (head -> spans -> head) and measures it.
"""

from __future__ import annotations

import argparse
import sys
import time

import torch

from client.local_chain import LocalChain


def run_demo(args: argparse.Namespace) -> int:
    from transformers import AutoTokenizer

    from swarm.demo_model import default_demo_dir, prepare_demo_model

    path = args.model or prepare_demo_model(default_demo_dir(args.cache_home))
    started = time.monotonic()
    tokenizer = AutoTokenizer.from_pretrained(path)
    chain = LocalChain.from_path(path, args.spans, dtype=args.dtype)
    route = " -> ".join(["head", *(str(b.span) for b in chain.blocks), "head"])
    print(f"[demo] {chain.checkpoint.model_type} with {chain.checkpoint.num_blocks} blocks, route: {route} "
          f"(loaded in {time.monotonic() - started:.1f} s)", file=sys.stderr)

    if args.raw or not tokenizer.chat_template:
        text = args.prompt
    else:
        text = tokenizer.apply_chat_template([{"role": "user", "content": args.prompt}], tokenize=False,
                                             add_generation_prompt=True)
    input_ids = tokenizer(text, return_tensors="pt").input_ids
    print(f"> {args.prompt}", flush=True)
    stats = stream_generate(chain, tokenizer, input_ids, args.max_new_tokens, args.temperature)
    print(f"\n[demo] {stats['tokens']} tokens; first token after {stats['ttft_s'] * 1000:.0f} ms; "
          f"decode {stats['tokens_per_s']:.1f} tokens/s", file=sys.stderr)
    return 0


def stream_generate(chain: LocalChain, tokenizer, input_ids: torch.Tensor, max_new_tokens: int,
                    temperature: float = 0.0, seed: int = 0, out=sys.stdout) -> dict:
    """Generate for one sequence, writing text to `out` as it is produced; returns timing figures."""
    stop_ids = {i for i in (tokenizer.eos_token_id, tokenizer.convert_tokens_to_ids("<|im_end|>")) if isinstance(i, int)}
    generator = torch.Generator().manual_seed(seed)
    session = chain.session(batch_size=1, max_length=input_ids.shape[1] + max_new_tokens)
    started = time.monotonic()
    logits = session.prefill(input_ids)[:, -1]
    first_token_at = time.monotonic()
    generated: list[int] = []
    shown = ""
    for _ in range(max_new_tokens):
        if temperature > 0:
            probs = torch.softmax(logits.float() / temperature, dim=-1)
            token = int(torch.multinomial(probs, 1, generator=generator))
        else:
            token = int(logits.argmax(-1))
        if token in stop_ids:
            break
        generated.append(token)
        text = tokenizer.decode(generated, skip_special_tokens=True)
        if not text.endswith("\ufffd"):  # wait for the rest of a multi-byte character
            out.write(text[len(shown):])
            out.flush()
            shown = text
        if len(generated) < max_new_tokens:
            logits = session.step(torch.tensor([[token]]))[:, -1]
    decode_s = time.monotonic() - first_token_at
    return {
        "tokens": len(generated),
        "text": shown,
        "ttft_s": first_token_at - started,
        "tokens_per_s": (len(generated) - 1) / decode_s if len(generated) > 1 and decode_s > 0 else 0.0,
    }
