"""Prompt reuse through `swarm api` (client.api.reuse): conversations whose prompts begin the same way are
computed once, and give exactly what a gateway without reuse gives.

One swarm of the demo model for the module: peer `front` serves the first half of the blocks with a short
idle timeout (it reclaims a kept session within seconds), `back1` and `back2` the second half (replicas, so
one can be killed and the hop checked). Two gateways side by side: `warm` (reuse on, the default) and
`cold` (`--reuse-tokens 0`): the ground truth for every answer. The peers' token counters
(`swarm_peer_tokens`) show what they computed."""

from __future__ import annotations

import threading
import time
import urllib.request

import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from swarm.local.launch import LocalSwarm
from swarm.weights.models import local_model_id
from swarm_harness import wait_until

pytestmark = [pytest.mark.integration, pytest.mark.slow]

FRONT_IDLE_S = 4  # the front peer reclaims a session silent this long, and drops its stream after twice that
SYSTEM = ("You are a careful assistant for a small public library. Answer in one short sentence, politely, and "
          "never invent opening hours, prices or names. The library opens at nine and closes at six on weekdays, "
          "lends up to five books for three weeks, and has a reading room on the second floor.")
TURNS = ["When does the library open?", "How many books can I borrow?", "Where is the reading room?"]


@pytest.fixture(scope="module")
def net(tmp_path_factory, demo_model_dir):
    swarm = LocalSwarm(tmp_path_factory.mktemp("reuse-swarm"))
    model_id = local_model_id(demo_model_dir)
    common = ("--model-id", model_id, "--threads", "1", "--metrics-port", "0", "--cache-tokens", "4096")
    try:
        swarm.start_bootstrap()
        procs = [swarm.start_peer("front", demo_model_dir, "--blocks", "0:15", "--idle-timeout", str(FRONT_IDLE_S),
                                  *common, wait=False),
                 swarm.start_peer("back1", demo_model_dir, "--blocks", "15:30", *common, wait=False),
                 swarm.start_peer("back2", demo_model_dir, "--blocks", "15:30", *common, wait=False)]
        for proc in procs:
            swarm.wait_serving(proc, timeout=300)
        yield swarm
    finally:
        swarm.stop_all()


def gateway(net, name: str, *extra: str) -> openai.OpenAI:
    proc = net.start_api(name, net.model_dir, "--max-tokens", "24", *extra)
    return openai.OpenAI(base_url=proc.extra["url"], api_key="unused", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def apis(net, demo_model_dir):
    net.model_dir = demo_model_dir
    # checks off on both: the back hop's replicas would check each other, and each check costs them tokens too
    return {"warm": gateway(net, "warm", "--verify-fraction", "0"),
            "cold": gateway(net, "cold", "--verify-fraction", "0", "--reuse-tokens", "0")}


def metric(url: str, name: str, labels: dict | None = None) -> float:
    text = urllib.request.urlopen(url, timeout=10).read().decode()
    total = 0.0
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == name and all(sample.labels.get(k) == v for k, v in (labels or {}).items()):
                total += sample.value
    return total


def peer_tokens(net) -> float:
    """Tokens every live peer has run through its blocks so far."""
    return sum(metric(net.metrics_url(p), "swarm_peer_tokens_total") for p in net.procs.values()
               if p.name in ("front", "back1", "back2") and p.alive())


def api_metric(client: openai.OpenAI, name: str, labels: dict | None = None) -> float:
    return metric(str(client.base_url).removesuffix("/v1/") + "/metrics", name, labels)


def chat(client: openai.OpenAI, model: str, messages: list[dict]) -> tuple[str, int]:
    """The greedy answer and its cached prompt tokens."""
    out = client.chat.completions.create(model=model, messages=messages, max_tokens=24, temperature=0)
    return out.choices[0].message.content, out.usage.prompt_tokens_details.cached_tokens


def conversation(client, model, system: str, turns: list[str], pause: float = 0.0) -> list[tuple[str, int]]:
    messages, answers = [{"role": "system", "content": system}], []
    for turn in turns:
        messages.append({"role": "user", "content": turn})
        answers.append(chat(client, model, messages))
        messages.append({"role": "assistant", "content": answers[-1][0]})
        time.sleep(pause)
    return answers


def test_a_multi_turn_chat_sends_each_turn_once_and_answers_as_a_cold_gateway(net, apis):
    model = apis["warm"].models.list().data[0].id
    before = peer_tokens(net)
    cold = conversation(apis["cold"], model, SYSTEM, TURNS)
    cold_tokens = peer_tokens(net) - before
    before = peer_tokens(net)
    warm = conversation(apis["warm"], model, SYSTEM, TURNS)
    warm_tokens = peer_tokens(net) - before
    assert [text for text, _ in warm] == [text for text, _ in cold]
    assert all(cached == 0 for _, cached in cold)
    assert warm[0][1] == 0 and all(cached > 40 for _, cached in warm[1:])  # the earlier turns were not sent again
    saved = sum(cached for _, cached in warm) * 2  # each prompt token goes through both hops
    assert warm_tokens == pytest.approx(cold_tokens - saved, abs=4)
    assert api_metric(apis["warm"], "swarm_api_prefix_hits_total", {"kind": "kept"}) >= 2


def test_checks_are_forked_with_the_session(net, apis):
    """With checks on, the back hop's replicas check each other: the next turn forks the hop's session at
    one and its checker's at the other, and nothing is found wrong."""
    model = apis["warm"].models.list().data[0].id
    checked = gateway(net, "checked")  # checks on, as by default
    try:
        turns = ["What floor is the reading room on?", "And how many books can I borrow?"]
        cold = conversation(apis["cold"], model, "Be brief. " + SYSTEM, turns)
        backs = [net.metrics_url(net.procs[name]) for name in ("back1", "back2")]
        first = conversation(checked, model, "Be brief. " + SYSTEM, turns[:1])
        before = [metric(url, "swarm_peer_sessions_forked_total") for url in backs]
        both = conversation(checked, model, "Be brief. " + SYSTEM, turns)
        forked = [metric(url, "swarm_peer_sessions_forked_total") - b for url, b in zip(backs, before)]
        assert [text for text, _ in both] == [text for text, _ in cold] and first[0][0] == cold[0][0]
        assert both[0][1] > 0 and both[1][1] > 0
        assert all(n >= 1 for n in forked), forked  # the hop's session at one replica, its checker's at the other
        assert api_metric(checked, "swarm_api_failovers_total") == 0
    finally:
        net.stop("checked")


def test_a_kept_session_the_peer_reclaimed_gives_the_same_text(net, apis):
    model = apis["warm"].models.list().data[0].id
    front = net.metrics_url(net.procs["front"])
    turns = ["Can I renew a book?", "Is the reading room quiet?"]
    cold = conversation(apis["cold"], model, SYSTEM + " Renewals are free.", turns)
    messages = [{"role": "system", "content": SYSTEM + " Renewals are free."}, {"role": "user", "content": turns[0]}]
    first = chat(apis["warm"], model, messages)
    wait_until(lambda: metric(front, "swarm_peer_sessions_open") == 0, 30, "the front peer to reclaim the session")
    messages += [{"role": "assistant", "content": first[0]}, {"role": "user", "content": turns[1]}]
    second = chat(apis["warm"], model, messages)
    assert [first[0], second[0]] == [text for text, _ in cold]
    assert second[1] > 0  # the kept session was used: its reclaimed part replayed on the peer


def test_the_budget_closes_the_least_recently_used_session(net, apis, tmp_path):
    model = apis["warm"].models.list().data[0].id
    small = gateway(net, "small", "--verify-fraction", "0", "--reuse-tokens", "150")
    french, german = "You answer in French. " + SYSTEM, "You answer in German. " + SYSTEM  # ~100 tokens kept each
    try:
        a = conversation(small, model, french, ["Say hello."])
        b = conversation(small, model, german, ["Say hello."])
        assert api_metric(small, "swarm_api_kept_sessions") == 1
        assert api_metric(small, "swarm_api_kept_sessions_closed_total", {"reason": "budget"}) >= 1
        # the second conversation's session is kept: asked again, its prompt is not sent again
        b2 = conversation(small, model, german, ["Say hello."])
        # the first one's went: asked again, it is computed afresh, to the same answer
        a2 = conversation(small, model, french, ["Say hello."])
        assert (a2[0][0], b2[0][0]) == (a[0][0], b[0][0])
        assert b2[0][1] > 0 and a2[0][1] == 0
    finally:
        net.stop("small")


def together(calls) -> list:
    """Run the calls at once, each in a thread; their results in order."""
    results, errors = [None] * len(calls), []

    def run(i, call):
        try:
            results[i] = call()
        except Exception as e:  # raised below, in the test's thread
            errors.append(e)

    threads = [threading.Thread(target=run, args=(i, c)) for i, c in enumerate(calls)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(300)
    if errors:
        raise errors[0]
    return results


def test_concurrent_conversations_with_one_system_prompt_compute_it_once(net, apis, demo_model_dir):
    """Two requests sharing a system prompt at once, through each gateway: the warm one computes the prompt once
    (one request forks the other's session), so the peers run 2 x shared tokens less (once on each hop). The
    peers' counters also count whatever else they run meanwhile (a step resent to a busy machine's peer), so a
    window that does not add up is measured once more, with a prompt of its own."""
    from transformers import AutoTokenizer

    model = apis["warm"].models.list().data[0].id
    tokenizer = AutoTokenizer.from_pretrained(demo_model_dir)
    for attempt in range(2):
        # unlike the kept sessions' system prompt from its first word: nothing kept shares its start
        system = f"Members may also book meeting room {attempt + 1} for up to two hours a day. " + SYSTEM
        questions = ["Can I book the meeting room?", "How long can I keep a book?"]
        asks = [[{"role": "system", "content": system}, {"role": "user", "content": q}] for q in questions]
        prompts = [tokenizer.apply_chat_template(m, add_generation_prompt=True, return_dict=True)["input_ids"]
                   for m in asks]
        shared = next(i for i, (a, b) in enumerate(zip(*prompts)) if a != b)
        runs = {}
        for name in ("cold", "warm"):
            before = peer_tokens(net)
            answers = together([lambda m=m: chat(apis[name], model, m) for m in asks])
            runs[name] = answers, peer_tokens(net) - before
        (cold, cold_tokens), (warm, warm_tokens) = runs["cold"], runs["warm"]
        assert [text for text, _ in warm] == [text for text, _ in cold]
        assert sorted(cached for _, cached in warm) == [0, shared]  # one computed it, the other forked it
        if warm_tokens == pytest.approx(cold_tokens - 2 * shared, abs=4) or attempt == 1:
            break
    logs = {name: net.procs[name].text()[-1500:] for name in ("warm", "cold")}
    assert warm_tokens == pytest.approx(cold_tokens - 2 * shared, abs=4), logs  # once on each of the two hops
    assert api_metric(apis["warm"], "swarm_api_prefix_hits_total", {"kind": "fork"}) >= 1


def test_a_kept_session_whose_peer_died_gives_the_same_text(net, apis):
    """Last in the module: it kills a peer. A gateway of its own, the other one stopped (its kept sessions
    closed), so that the one back peer holding a session holds this conversation's."""
    model = apis["warm"].models.list().data[0].id
    net.stop("warm")
    solo = gateway(net, "solo", "--verify-fraction", "0")
    turns = ["Do you have a reading room?", "Which floor is it on?"]
    cold = conversation(apis["cold"], model, SYSTEM, turns)
    backs = [net.procs["back1"], net.procs["back2"]]
    wait_until(lambda: sum(metric(net.metrics_url(p), "swarm_peer_sessions_open") for p in backs) == 0, 30,
               "the other gateways' sessions to close")
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": turns[0]}]
    first = chat(solo, model, messages)
    (holder,) = [p for p in backs if metric(net.metrics_url(p), "swarm_peer_sessions_open") > 0]
    net.stop(holder.name, sig=9)
    messages += [{"role": "assistant", "content": first[0]}, {"role": "user", "content": turns[1]}]
    second = chat(solo, model, messages)
    assert [first[0], second[0]] == [text for text, _ in cold]
    assert second[1] > 0
    assert api_metric(solo, "swarm_api_failovers_total") >= 1


def test_with_api_keys_each_user_reuses_only_its_own_sessions_and_has_its_own_limit(net, apis):
    """A gateway with two keys: a request without one is refused (401); a prompt one user ran is not reused for
    the other (its `cached_tokens` says nothing of the first user's), only for the same user; a user with a
    generation running gets 429 for another (`--key-generations 1`)."""
    alice_key, bob_key = "alice-key-0123456789", "bob-key-0123456789"
    proc = net.start_api("keyed", net.model_dir, "--max-tokens", "24", "--verify-fraction", "0", "--api-key",
                         alice_key, bob_key, "--key-generations", "1")
    url = proc.extra["url"]
    alice, bob, nobody = (openai.OpenAI(base_url=url, api_key=key, max_retries=0, timeout=120)
                          for key in (alice_key, bob_key, "wrong-key-0123456789"))
    with pytest.raises(openai.AuthenticationError):
        nobody.models.list()
    model = alice.models.list().data[0].id
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": TURNS[0]}]
    first, cached = chat(alice, model, messages)
    assert cached == 0
    other, cached_for_bob = chat(bob, model, messages)
    again, cached_for_alice = chat(alice, model, messages)
    assert other == first == again and cached_for_bob == 0 and cached_for_alice > 40
    stream = alice.chat.completions.create(model=model, messages=messages, max_tokens=24, temperature=0, stream=True)
    try:
        next(iter(stream))  # alice's generation is running
        with pytest.raises(openai.RateLimitError):
            chat(alice, model, messages)
        assert chat(bob, model, messages)[0] == first  # bob is not held back by alice
    finally:
        stream.close()
    assert api_metric(alice, "swarm_api_user_requests_total", {"user": "key1", "status": "429"}) == 1
    net.stop("keyed")
