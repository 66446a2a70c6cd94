"""Server-side generation without a swarm: held-back text, the sampler, and how tokens become text deltas
(stop strings, end tokens, the length limit) over a real byte-level tokenizer."""

from __future__ import annotations

import random
from types import SimpleNamespace

import pytest
import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from client.generation import Delta, Generation, Sampler, Sampling, held_back, stop_token_ids

pytestmark = pytest.mark.unit


# ---- held_back ----

@pytest.mark.parametrize("text, stops, hold", [
    ("hello E", ("END",), 1),
    ("hello EN", ("END",), 2),
    ("hello", ("END",), 0),
    ("hello N", ("END",), 0),  # "N" ends the text but starts no stop string
    ("EN", ("END",), 2),  # the whole text may be the start of a stop string
    ("E", ("END",), 1),
    ("", ("END",), 0),
    ("hello END", ("END",), 0),  # a whole stop string is cut by the caller, not held
    ("abc", (), 0),
    ("ab\ufffd", (), 1),  # an incomplete character
    ("ab\ufffd", ("END",), 1),
    ("x\n\n", ("\n", "\n\n\n"), 2),  # several stop strings: the longest hold wins
    ("x\n", ("\n\n\n", "x\nY"), 2),
    ("x<|e", ("<|end|>", "e"), 3),
    ("ab", ("b", "xyz"), 0),  # a one-character stop string is never held, it is a match
])
def test_held_back(text, stops, hold):
    assert held_back(text, stops) == hold


def test_held_back_is_never_more_than_the_text():
    for text in ("", "a", "ab"):
        assert held_back(text, ("abcdef",)) <= len(text)


# ---- Sampler ----

def sampler(vocab: int = 50, **kw) -> Sampler:
    return Sampler(Sampling(max_tokens=16, **kw), vocab)


def draws(s: Sampler, logits: torch.Tensor, count: int) -> list[list[int]]:
    return [s(logits) for _ in range(count)]


def test_temperature_zero_is_the_argmax():
    logits = torch.randn(3, 50, generator=torch.Generator().manual_seed(0))
    s = sampler(temperature=0.0, n=3)
    assert s(logits) == logits.argmax(-1).tolist()
    assert s(logits.to(torch.bfloat16)) == logits.to(torch.bfloat16).float().argmax(-1).tolist()


@pytest.mark.parametrize("top_p", [0.0, 1e-6])
def test_tiny_top_p_always_gives_the_most_likely_token(top_p):
    # the best token has well under half the mass: plain sampling would often pick another
    logits = torch.log(torch.tensor([[0.1, 0.3, 0.2, 0.2, 0.2]]))
    s = sampler(vocab=5, temperature=1.0, top_p=top_p, seed=3)
    assert {t for (t,) in draws(s, logits, 200)} == {1}


def test_top_p_never_picks_a_token_outside_the_nucleus():
    # mass 0.5 + 0.3 reaches 0.6 with the two best tokens; the others get probability 0
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.1, 0.06, 0.04]]))
    picked = [t for (t,) in draws(sampler(vocab=5, temperature=1.0, top_p=0.6, seed=11), logits, 400)]
    assert set(picked) == {0, 1}


def test_top_p_one_can_pick_any_token():
    logits = torch.zeros(1, 4)
    picked = {t for (t,) in draws(sampler(vocab=4, temperature=1.0, top_p=1.0, seed=5), logits, 200)}
    assert picked == {0, 1, 2, 3}


def test_the_same_seed_gives_the_same_tokens_and_another_seed_others():
    logits = torch.zeros(2, 50)  # uniform: every draw is up to the generator
    a = draws(sampler(n=2, seed=1234), logits, 40)
    b = draws(sampler(n=2, seed=1234), logits, 40)
    c = draws(sampler(n=2, seed=1235), logits, 40)
    assert a == b
    assert a != c


def test_each_choice_has_its_own_generator_seeded_seed_plus_index():
    logits = torch.zeros(2, 50)
    pairs = draws(sampler(n=2, seed=77), logits, 40)
    first, second = [p[0] for p in pairs], [p[1] for p in pairs]
    assert first != second
    alone = [t for (t,) in draws(sampler(n=1, seed=78), logits[:1], 40)]
    assert second == alone


def test_unseeded_samplers_differ():
    logits = torch.zeros(1, 50)
    assert draws(sampler(), logits, 40) != draws(sampler(), logits, 40)


def test_presence_penalty_moves_the_pick_after_a_token_was_chosen():
    logits = torch.tensor([[2.0, 1.5, 0.0]])
    s = sampler(vocab=3, temperature=0.0, presence_penalty=1.0)
    # 2.0 - 1 < 1.5; then both were chosen and 1.0 > 0.5: the penalty does not grow with repetitions
    assert [s(logits)[0] for _ in range(4)] == [0, 1, 0, 0]
    plain = sampler(vocab=3, temperature=0.0)
    assert [plain(logits)[0] for _ in range(4)] == [0, 0, 0, 0]


def test_frequency_penalty_grows_with_each_repetition():
    logits = torch.tensor([[2.0, 1.5, 0.0]])
    s = sampler(vocab=3, temperature=0.0, frequency_penalty=0.3)
    # token 0: 2.0, then 1.7, then 1.4 < 1.5
    assert [s(logits)[0] for _ in range(3)] == [0, 0, 1]


def test_negative_presence_penalty_favours_repetition():
    logits = torch.tensor([[1.0, 1.2]])
    s = sampler(vocab=2, temperature=0.0, presence_penalty=-1.0)
    assert s(logits) == [1]
    logits = torch.tensor([[1.5, 1.2]])  # token 0 is now better on its own, but 1.2 + 1 wins
    assert s(logits) == [1]


def test_penalties_count_per_choice():
    logits = torch.tensor([[2.0, 1.5], [1.5, 2.0]])
    s = sampler(vocab=2, n=2, temperature=0.0, presence_penalty=1.0)
    assert s(logits) == [0, 1]
    assert s(logits) == [1, 0]


# ---- Generation._advance over a real tokenizer ----

def byte_tokenizer(specials: tuple[str, ...] = ("<eos>",), **tokens) -> PreTrainedTokenizerFast:
    """One token per byte (byte-level, no merges), so an incomplete UTF-8 character decodes to U+FFFD, then
    the `specials`; `tokens` names them (eos_token=..., unk_token=...)."""
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    vocab = {c: i for i, c in enumerate(alphabet)}
    vocab.update({s: len(vocab) + i for i, s in enumerate(specials)})
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    return PreTrainedTokenizerFast(tokenizer_object=tok, **tokens)


@pytest.fixture(scope="module")
def tokenizer() -> PreTrainedTokenizerFast:
    return byte_tokenizer(eos_token="<eos>")


def ids_of(tokenizer, text: str) -> list[int]:
    ids = tokenizer(text, add_special_tokens=False).input_ids
    assert tokenizer.decode(ids) == text
    return ids


def generation(tokenizer, *, n: int = 1, stop: tuple[str, ...] = (), end_tokens: tuple[int, ...] = (),
               max_tokens: int = 64) -> Generation:
    return Generation(None, None, tokenizer, None, [1, 2, 3], Sampling(max_tokens=max_tokens, n=n, stop=stop),
                      list(end_tokens))


def feed(gen: Generation, streams: list[list[int]]) -> list[list[Delta]]:
    """Advance with one token per choice per step (a choice whose stream ran out repeats its last token, as
    the sampler keeps giving tokens to finished choices); the last step is the length limit."""
    steps = max(len(s) for s in streams)
    out = []
    for step in range(steps):
        tokens = [s[min(step, len(s) - 1)] for s in streams]
        out.append(gen._advance(tokens, last=step == steps - 1))
    return out


def text_of(deltas: list[list[Delta]], index: int = 0) -> str:
    return "".join(d.text for step in deltas for d in step if d.index == index)


def finishes(deltas: list[list[Delta]], index: int = 0) -> list[str]:
    return [d.finish_reason for step in deltas for d in step if d.index == index and d.finish_reason]


def test_a_stop_string_across_tokens_cuts_the_text_and_stops(tokenizer):
    gen = generation(tokenizer, stop=("END",))
    deltas = feed(gen, [ids_of(tokenizer, "abcENDxyz")])
    assert gen.choices[0].text == "abc"
    assert gen.choices[0].finish_reason == "stop"
    assert text_of(deltas) == "abc"
    assert finishes(deltas) == ["stop"]
    assert all("E" not in d.text for step in deltas for d in step)  # no part of the stop string either
    assert gen.choices[0].ids == ids_of(tokenizer, "abcEND")  # nothing after the stop was taken


def test_a_two_token_stop_string(tokenizer):
    gen = generation(tokenizer, stop=("\n\n",))
    deltas = feed(gen, [ids_of(tokenizer, "one\ntwo\n\nthree")])
    assert gen.choices[0].text == text_of(deltas) == "one\ntwo"
    assert finishes(deltas) == ["stop"]


def test_the_earliest_of_several_stop_strings_wins(tokenizer):
    gen = generation(tokenizer, stop=("xyz", "yz!"))
    feed(gen, [ids_of(tokenizer, "abxyz!")])
    assert gen.choices[0].text == "ab"


def test_a_stop_prefix_that_diverges_is_released_whole(tokenizer):
    gen = generation(tokenizer, stop=("END",))
    deltas = feed(gen, [ids_of(tokenizer, "abENx")])
    texts = [d.text for step in deltas for d in step]
    assert texts == ["a", "b", "ENx"]  # "E" and "EN" held, then released in one piece
    assert gen.choices[0].text == "abENx"
    assert finishes(deltas) == ["length"]


def test_an_end_token_stops_and_its_text_is_left_out(tokenizer):
    period = ids_of(tokenizer, ".")[0]
    gen = generation(tokenizer, end_tokens=(period, tokenizer.eos_token_id))
    deltas = feed(gen, [ids_of(tokenizer, "hi.there")])
    assert gen.choices[0].text == text_of(deltas) == "hi"
    assert finishes(deltas) == ["stop"]
    assert gen.choices[0].ids == ids_of(tokenizer, "hi.")  # the end token counts as generated

    gen = generation(tokenizer, end_tokens=(tokenizer.eos_token_id,))
    deltas = feed(gen, [ids_of(tokenizer, "ok") + [tokenizer.eos_token_id, ids_of(tokenizer, "z")[0]]])
    assert gen.choices[0].text == text_of(deltas) == "ok"
    assert finishes(deltas) == ["stop"]


def test_an_end_token_releases_held_back_text(tokenizer):
    gen = generation(tokenizer, stop=("END",), end_tokens=(tokenizer.eos_token_id,))
    deltas = feed(gen, [ids_of(tokenizer, "aEN") + [tokenizer.eos_token_id]])
    assert gen.choices[0].text == text_of(deltas) == "aEN"
    assert finishes(deltas) == ["stop"]


def test_the_last_token_finishes_with_length_and_flushes_held_text(tokenizer):
    gen = generation(tokenizer, stop=("END",))
    deltas = feed(gen, [ids_of(tokenizer, "abEN")])
    assert [d.text for step in deltas for d in step] == ["a", "b", "EN"]
    assert deltas[-1] == [Delta(0, "EN", "length")]
    assert gen.choices[0].text == "abEN"


def test_an_incomplete_character_is_held_until_complete(tokenizer):
    gen = generation(tokenizer)
    deltas = feed(gen, [ids_of(tokenizer, "a中😀b")])
    texts = [d.text for step in deltas for d in step]
    assert all("\ufffd" not in t for t in texts)
    assert "".join(texts) == gen.choices[0].text == "a中😀b"


def test_deltas_add_up_to_the_text_cut_at_the_first_stop(tokenizer):
    """Random texts (multi-byte characters included) against random stop strings: the deltas concatenated
    are the final text, which is the decoded text cut at the first stop string, or all of it."""
    rng = random.Random(2024)
    alphabet = ["a", "b", "E", "N", "D", "\n", " ", "é", "中", "😀"]
    for _ in range(150):
        text = "".join(rng.choice(alphabet) for _ in range(rng.randint(1, 20)))
        stops = tuple({"".join(rng.choice(alphabet[:7]) for _ in range(rng.randint(1, 3)))
                       for _ in range(rng.randint(1, 3))})
        gen = generation(tokenizer, stop=stops)
        deltas = feed(gen, [ids_of(tokenizer, text)])
        cuts = [i for i in (text.find(s) for s in stops) if i >= 0]
        expected = text[:min(cuts)] if cuts else text
        choice = gen.choices[0]
        assert text_of(deltas) == choice.text == expected, (text, stops)
        assert finishes(deltas) == ["stop" if cuts else "length"], (text, stops)
        for step in deltas:
            for d in step:
                assert "\ufffd" not in d.text, (text, stops)


def test_finished_choices_get_no_more_deltas(tokenizer):
    eos = tokenizer.eos_token_id
    gen = generation(tokenizer, n=2, stop=("END",), end_tokens=(eos,))
    first = ids_of(tokenizer, "ab") + [eos]  # finishes at step 3
    second = ids_of(tokenizer, "wxEND")  # finishes at step 5 on the stop string
    # each keeps being given tokens after it finished
    streams = [first + ids_of(tokenizer, "zzzz"), second + ids_of(tokenizer, "qq")]
    deltas = feed(gen, streams)
    assert [d.index for d in deltas[3]] == [] and all(not step for step in deltas[5:])
    assert all(d.index == 1 for step in deltas[3:] for d in step)
    assert finishes(deltas, 0) == ["stop"] and finishes(deltas, 1) == ["stop"]
    assert gen.choices[0].text == text_of(deltas, 0) == "ab"
    assert gen.choices[1].text == text_of(deltas, 1) == "wx"
    assert gen.choices[0].ids == first and gen.choices[1].ids == second
    assert gen.completion_tokens == len(first) + len(second)


def test_one_delta_per_choice_per_step_at_most(tokenizer):
    gen = generation(tokenizer, n=2)
    deltas = feed(gen, [ids_of(tokenizer, "abc"), ids_of(tokenizer, "xyz")])
    for step in deltas:
        assert sorted(d.index for d in step) == [0, 1]
    assert deltas[-1] == [Delta(0, "c", "length"), Delta(1, "z", "length")]


# ---- end tokens ----

def test_end_tokens_of_the_tokenizer_the_generation_config_and_chat_markers():
    tok = byte_tokenizer(("<unk>", "</s>", "<|im_end|>", "<|eot_id|>"), unk_token="<unk>", eos_token="</s>")
    unk, eos, im_end, eot = tok.convert_tokens_to_ids(["<unk>", "</s>", "<|im_end|>", "<|eot_id|>"])
    assert stop_token_ids(tok) == sorted([eos, im_end, eot])
    config = SimpleNamespace(eos_token_id=[eos, 5])
    assert stop_token_ids(tok, config) == sorted([5, eos, im_end, eot])
    assert stop_token_ids(tok, SimpleNamespace(eos_token_id=7)) == sorted([7, eos, im_end, eot])
    assert unk not in stop_token_ids(tok)  # missing markers read as the unknown token, which ends nothing


def test_an_end_of_text_that_is_also_the_unknown_token_still_ends():
    """GPT-2 style tokenizers (and base models of that lineage) use one token as end-of-text and unknown."""
    tok = byte_tokenizer(("<|endoftext|>",), unk_token="<|endoftext|>", eos_token="<|endoftext|>")
    end = tok.convert_tokens_to_ids("<|endoftext|>")
    assert tok.unk_token_id == tok.eos_token_id == end
    assert stop_token_ids(tok) == [end]
    assert stop_token_ids(tok, SimpleNamespace(eos_token_id=end)) == [end]


def test_a_tokenizer_without_an_unknown_token():
    tok = byte_tokenizer(("<eos>",), eos_token="<eos>")
    assert tok.unk_token_id is None
    assert stop_token_ids(tok, None) == [tok.eos_token_id]


def sentencepiece_tokenizer() -> PreTrainedTokenizerFast:
    """A Llama-2-style tokenizer: '▁' for spaces, characters it lacks spelled as byte tokens, and a decoder
    that strips the leading space of what it decodes."""
    from tokenizers import normalizers

    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, **{f"<0x{b:02X}>": 3 + b for b in range(256)}}
    for c in "▁abcdefghijklmnopqrstuvwxyzHS?!":
        vocab[c] = len(vocab)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>", byte_fallback=True))
    tok.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
                                     decoders.Strip(" ", 1, 0)])
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>")


@pytest.mark.parametrize("answer", ["Hi 中 ok 😀 bad", " leading space", "é!", "😀😀"])
def test_byte_fallback_and_stripping_decoders_give_the_text_of_decoding_everything(answer):
    tok = sentencepiece_tokenizer()
    prompt = tok("Say", add_special_tokens=False).input_ids
    whole = tok(f"Say {answer}", add_special_tokens=False).input_ids
    assert whole[:len(prompt)] == prompt
    generated = whole[len(prompt):]
    expected = tok.decode(whole)[len(tok.decode(prompt)):]
    gen = Generation(None, None, tok, None, prompt, Sampling(max_tokens=len(generated) + 1), [2])
    deltas = feed(gen, [generated + [2]])
    assert text_of(deltas) == expected == gen.choices[0].text
    assert "\ufffd" not in text_of(deltas)  # incomplete characters waited for their last byte
    assert finishes(deltas) == ["stop"]


def test_non_finite_logits_are_an_error_of_the_swarm_not_a_crash():
    from swarm.errors import SwarmError

    s = sampler(temperature=0.7)
    logits = torch.zeros(1, 50)
    logits[0, 3] = float("nan")
    with pytest.raises(SwarmError, match="non-finite"):
        s(logits)


@pytest.mark.parametrize("temperature", [1e-300, 1e-45, 1e-6])
def test_a_vanishing_temperature_is_greedy(temperature):
    logits = torch.randn(1, 50, generator=torch.Generator().manual_seed(3))
    assert sampler(temperature=temperature)(logits) == [int(logits.argmax())]


# ---- the sampler's transformers processors ----

def test_top_k_keeps_only_the_k_most_likely():
    logits = torch.log(torch.tensor([[0.4, 0.3, 0.2, 0.1]]))
    picked = {t for (t,) in draws(sampler(vocab=4, top_k=2, seed=1), logits, 300)}
    assert picked == {0, 1}


def test_min_p_drops_tokens_below_a_fraction_of_the_best():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))  # min_p 0.2: keep p >= 0.1
    picked = {t for (t,) in draws(sampler(vocab=4, min_p=0.2, seed=2), logits, 400)}
    assert picked == {0, 1, 2}


def test_repetition_penalty_counts_the_prompt_and_the_generated_tokens():
    logits = torch.tensor([[2.0, 1.9, 1.0]])
    s = Sampler(Sampling(max_tokens=4, temperature=0.0, repetition_penalty=1.5), 3, prompt=[0])
    # token 0 is in the prompt: 2.0 / 1.5 < 1.9; then token 1 is penalized too: 1.9 / 1.5 < 2.0 / 1.5
    assert [s(logits)[0] for _ in range(3)] == [1, 0, 0]


def test_a_rewound_sampler_draws_the_same_tokens_again():
    logits = torch.zeros(2, 50)
    s = sampler(n=2, seed=9, presence_penalty=0.5, repetition_penalty=1.1)
    state = s.state()
    first = draws(s, logits, 10)
    s.restore(state)
    assert draws(s, logits, 10) == first


def test_logprobs_are_the_log_softmax_of_the_raw_logits():
    from client.sampling import logprobs_of, score

    logits = torch.randn(2, 30, generator=torch.Generator().manual_seed(4))
    want = torch.log_softmax(logits, -1)
    got = logprobs_of(logits, torch.tensor([3, 7]), k=2)
    assert [g.token for g in got] == [3, 7]
    assert [g.logprob for g in got] == pytest.approx([want[0, 3].item(), want[1, 7].item()])
    assert [t for t, _ in got[1].top] == want[1].topk(2).indices.tolist()
    hidden = torch.randn(600, 30)  # more positions than one chunk; the "logits" are the hidden states themselves
    targets = [i % 30 for i in range(600)]
    scored = score(lambda h: h, hidden, targets, k=0)
    assert [x.logprob for x in scored] == pytest.approx(
        torch.log_softmax(hidden, -1)[torch.arange(600), torch.tensor(targets)].tolist(), abs=1e-5)
