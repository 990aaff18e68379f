"""Dynamic batching in the OpenAI endpoint (issue 22: an agent loop of 128 concurrent conversations made one batch-of-1
engine call per request): concurrent requests share engine calls through the real hf engine and real HTTP, each gets
its own answer (equal to a batch-of-1 call where the engine makes that checkable), sampling parameters are never
mixed in a call, a failing engine fails exactly its batch, a hanging one gives 504s and a bounded close, and sessions
still continue token for token."""

from __future__ import annotations

import itertools
import json
import threading
import time
import urllib.error
import urllib.request

import pytest
import torch

from rlhfkit.engines.protocol import SamplingConfig
from rlhfkit.openai_endpoint import OpenAIEndpoint, OpenAIEndpointConfig, session_to_rollout
from rlhfkit.types import Rollout

pytest.importorskip("transformers")  # the endpoint's tokenizer, the hf engine

from rlhfkit.engines.hf import HFEngine, HFEngineConfig


class CallLog:
    """The real hf engine, remembering each generate call's prompts, sampling and result (or that it raised).
    ``fail_when(prompts)`` returning True makes that call raise instead of generating."""

    def __init__(self, engine, fail_when=None):
        self.engine, self.fail_when, self.calls = engine, fail_when, []

    def generate(self, prompts, sampling):
        prompts = [list(p) for p in prompts]
        if self.fail_when is not None and self.fail_when(prompts):
            self.calls.append((prompts, sampling, None))
            raise RuntimeError("CUDA out of memory (simulated)")
        rollouts = self.engine.generate(prompts, sampling)
        self.calls.append((prompts, sampling, rollouts))
        return rollouts


def post(url, body, headers=None, timeout=60):
    request = urllib.request.Request(url + "/chat/completions", data=json.dumps({"model": "tiny", **body}).encode(),
                                     headers={"Content-Type": "application/json", **(headers or {})})
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            return response.status, json.load(response)
    except urllib.error.HTTPError as error:
        return error.code, json.load(error)


def concurrently(functions, timeout=60):
    """Run the functions in threads released together; their results in order."""
    results, barrier = [None] * len(functions), threading.Barrier(len(functions))

    def run(index):
        barrier.wait(timeout=timeout)
        results[index] = functions[index]()

    threads = [threading.Thread(target=run, args=(i,), daemon=True) for i in range(len(functions))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=timeout)
    assert not any(thread.is_alive() for thread in threads), "a client did not finish"
    return results


def question(index):
    return [{"role": "user", "content": f"What is {index} + {index * 3}?"}]


def endpoint_for(engine, tokenizer, **config):
    return OpenAIEndpoint(engine, tokenizer, OpenAIEndpointConfig(model_name="tiny", **config))


def test_concurrent_requests_share_one_engine_call_and_answer_as_a_batch_of_one(hf_engine, tokenizer):
    """Six concurrent greedy clients: one engine call of six prompts, sent because the batch is full (the window is an
    hour, far past the clients' 60 s guard, so waiting it out would fail the test), and each client's answer is its own
    prompt's, token for token what a batch-of-1 call gives."""
    log = CallLog(hf_engine)
    with endpoint_for(log, tokenizer, batch_window_s=3600.0, max_batch_prompts=6) as endpoint:
        answers = concurrently([lambda i=i: post(endpoint.url, {"messages": question(i), "max_tokens": 6,
                                                                "temperature": 0, "return_token_ids": True,
                                                                "user": f"c{i}"})
                                for i in range(6)])
    assert [status for status, _ in answers] == [200] * 6, answers
    assert len(log.calls) == 1 and len(log.calls[0][0]) == 6
    sampling = SamplingConfig(max_new_tokens=6, temperature=0.0, logprobs=True)
    for index, (_, answer) in enumerate(answers):
        prompt = tokenizer.encode(tokenizer.apply_chat_template(question(index), add_generation_prompt=True,
                                                                tokenize=False), add_special_tokens=False)
        assert answer["prompt_token_ids"] == prompt   # each client got the answer to its own prompt
        alone = hf_engine.generate([prompt], sampling)[0]
        assert answer["choices"][0]["token_ids"] == alone.response_token_ids.tolist()
        record = endpoint.records(f"c{index}")[0]
        torch.testing.assert_close(record.response_logprobs, alone.response_logprobs, atol=1e-5, rtol=0)


def test_128_concurrent_clients_are_all_served_in_few_calls(hf_engine, tokenizer):
    """Issue 22's agent loop (16 prompts x 8 samples at once). Defect: the server's listen backlog was
    socketserver's default of 5, so a burst of connections was reset before any was read."""
    log = CallLog(hf_engine)
    with endpoint_for(log, tokenizer) as endpoint:   # default window and max_batch_prompts
        answers = concurrently([lambda i=i: post(endpoint.url, {"messages": question(i % 16), "max_tokens": 2})
                                for i in range(128)], timeout=120)
    assert [status for status, _ in answers] == [200] * 128
    assert sum(len(prompts) for prompts, _, _ in log.calls) == 128 and len(log.calls) <= 32


def test_different_sampling_parameters_never_share_a_call(hf_engine, tokenizer):
    """Four clients at temperature 0.7 and four at 1.0 at once: every call holds only prompts of requests with its
    own temperature, each record is its call's rollout, and the log-probs a trainer recomputes at the record's
    temperature match (a request sampled at the other temperature would not)."""
    from rlhfkit.losses import model_logprobs
    from rlhfkit.packing import pack_rollouts

    log = CallLog(hf_engine)
    temperatures = [0.7, 1.0] * 4
    with endpoint_for(log, tokenizer, batch_window_s=2.0, max_batch_prompts=4) as endpoint:
        answers = concurrently([lambda i=i: post(endpoint.url, {"messages": question(i), "max_tokens": 6,
                                                                "temperature": temperatures[i],
                                                                "return_token_ids": True, "user": f"t{i}"})
                                for i in range(8)])
        assert [status for status, _ in answers] == [200] * 8, answers
        records = [endpoint.records(f"t{i}")[0] for i in range(8)]
    temperature_of = {tuple(answer["prompt_token_ids"]): temperatures[i] for i, (_, answer) in enumerate(answers)}
    assert len(temperature_of) == 8 and sum(len(prompts) for prompts, _, _ in log.calls) == 8
    assert len(log.calls) < 8
    for prompts, sampling, rollouts in log.calls:
        assert len(prompts) <= 4
        assert {temperature_of[tuple(p)] for p in prompts} == {sampling.temperature}
        for prompt, rollout in zip(prompts, rollouts):
            record = next(r for r in records if r.prompt_token_ids.tolist() == prompt)
            assert record.temperature == sampling.temperature
            assert torch.equal(record.response_token_ids, rollout.response_token_ids)
    for temperature in (0.7, 1.0):
        chosen = [r for r in records if r.temperature == temperature]
        batch = pack_rollouts([r.to_rollout() for r in chosen])
        with torch.no_grad():
            trainer = model_logprobs(hf_engine.model, batch, temperature=temperature)
        torch.testing.assert_close(trainer[batch.loss_mask].float(),
                                   torch.cat([r.response_logprobs for r in chosen]), atol=1e-4, rtol=0)


def test_seeded_requests_are_sent_alone_and_reproduce_a_batch_of_one(hf_engine, tokenizer):
    """The engines seed a prompt's samples from (seed, its position in the call): three concurrent requests with one
    seed sent together would get three different answers. Sent alone, each equals the batch-of-1 call."""
    log = CallLog(hf_engine)
    body = {"messages": question(1), "max_tokens": 8, "n": 2, "seed": 7, "return_token_ids": True}
    with endpoint_for(log, tokenizer, batch_window_s=0.5) as endpoint:
        answers = concurrently([lambda: post(endpoint.url, body)] * 3)
    assert [status for status, _ in answers] == [200] * 3, answers
    assert [len(prompts) for prompts, _, _ in log.calls] == [1, 1, 1]
    alone = hf_engine.generate([answers[0][1]["prompt_token_ids"]], SamplingConfig(n=2, max_new_tokens=8, seed=7))
    expected = [r.response_token_ids.tolist() for r in alone]
    for _, answer in answers:
        assert [c["token_ids"] for c in answer["choices"]] == expected


def test_max_batch_prompts_bounds_each_call(hf_engine, tokenizer):
    log = CallLog(hf_engine)
    with endpoint_for(log, tokenizer, batch_window_s=0.3, max_batch_prompts=2) as endpoint:
        answers = concurrently([lambda i=i: post(endpoint.url, {"messages": question(i), "max_tokens": 3})
                                for i in range(5)])
    assert [status for status, _ in answers] == [200] * 5
    sizes = [len(prompts) for prompts, _, _ in log.calls]
    assert sum(sizes) == 5 and max(sizes) <= 2 and len(sizes) >= 3


def test_an_engine_failure_fails_exactly_the_requests_of_its_batch(hf_engine, tokenizer):
    """A call holding the poisoned prompt raises: its requests (and only they) get a 500 naming the failure; the
    other batch is answered and the endpoint keeps serving afterwards."""
    poison = tokenizer.encode(tokenizer.apply_chat_template(question(99), add_generation_prompt=True, tokenize=False),
                              add_special_tokens=False)
    log = CallLog(hf_engine, fail_when=lambda prompts: poison in prompts)
    temperatures = [0.7, 0.7, 0.7, 1.0, 1.0, 1.0]
    indices = [99, 1, 2, 3, 4, 5]
    with endpoint_for(log, tokenizer, batch_window_s=2.0, max_batch_prompts=3) as endpoint:
        answers = concurrently([lambda i=i: post(endpoint.url, {"messages": question(indices[i]), "max_tokens": 4,
                                                                "temperature": temperatures[i],
                                                                "user": f"f{indices[i]}"})
                                for i in range(6)])
        failed_calls = [prompts for prompts, _, rollouts in log.calls if rollouts is None]
        assert len(failed_calls) == 1 and poison in failed_calls[0]
        failed = {tuple(p) for p in failed_calls[0]}
        assert len(failed) > 1   # the poisoned request shared its call with others
        for index, (status, answer) in zip(indices, answers):
            prompt = tokenizer.encode(tokenizer.apply_chat_template(question(index), add_generation_prompt=True,
                                                                    tokenize=False), add_special_tokens=False)
            if tuple(prompt) in failed:
                assert status == 500 and answer["error"]["type"] == "server_error", answer
                assert "CUDA out of memory (simulated)" in answer["error"]["message"]
                assert f"an engine call of {len(failed)} request(s)" in answer["error"]["message"]
                assert f"f{index}" not in endpoint.session_ids()
            else:
                assert status == 200, answer
        assert [status for status, _ in answers].count(200) == 6 - len(failed)
        status, answer = post(endpoint.url, {"messages": question(6), "max_tokens": 3})
        assert status == 200, answer


def test_an_engine_group_of_two_gets_batches_spread_over_its_engines(tiny_llama_path, tokenizer):
    """An EngineGroup given to the endpoint receives whole batches and spreads their prompts over its engines as it
    does for any call: eight concurrent requests reach both engines in fewer calls than requests, each answered."""
    from rlhfkit.engines.router import EngineGroup

    logs = [CallLog(HFEngine(HFEngineConfig(model=str(tiny_llama_path), seed=index))) for index in range(2)]
    with EngineGroup(logs) as group, endpoint_for(group, tokenizer, batch_window_s=2.0, max_batch_prompts=8) as endpoint:
        answers = concurrently([lambda i=i: post(endpoint.url, {"messages": question(i), "max_tokens": 4,
                                                                "return_token_ids": True}) for i in range(8)])
    assert [status for status, _ in answers] == [200] * 8, answers
    sent = [tuple(p) for log in logs for prompts, _, _ in log.calls for p in prompts]
    assert sorted(sent) == sorted(tuple(answer["prompt_token_ids"]) for _, answer in answers)
    assert all(log.calls for log in logs) and sum(len(log.calls) for log in logs) < 8


class HangingEngine:
    """Hangs every call until released (60 s at most, a hang guard); remembers the prompts it was sent, in order.
    ``returned`` is set once a call ended: a reply seen while it is unset did not wait for the engine."""

    def __init__(self):
        self.release, self.returned, self.prompts = threading.Event(), threading.Event(), []

    def generate(self, prompts, sampling):
        self.prompts += [list(p) for p in prompts]
        self.release.wait(60)
        self.returned.set()
        return [Rollout(prompt_token_ids=torch.tensor(p), response_token_ids=torch.tensor([1]),
                        response_logprobs=torch.tensor([-0.5])) for p in prompts for _ in range(sampling.n)]


def wait_until(condition, what, timeout_s=60.0):
    """Poll ``condition`` until it holds; the deadline is a hang guard, not a speed check."""
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, f"gave up after {timeout_s:g} s waiting for {what}"
        time.sleep(0.01)


class NotingTokenizer:
    """The real tokenizer; ``encoded`` is set once a text holding ``marker`` was encoded: that request is then past
    the endpoint's closing check and in flight."""

    def __init__(self, tokenizer, marker):
        self._tokenizer, self.marker, self.encoded = tokenizer, marker, threading.Event()

    def __getattr__(self, name):
        return getattr(self._tokenizer, name)

    def encode(self, text, **kwargs):
        ids = self._tokenizer.encode(text, **kwargs)
        if self.marker in text:
            self.encoded.set()
        return ids


def test_a_hanging_engine_gives_every_waiting_request_a_504(tokenizer):
    """The engine hangs. Request 1's call hangs in the engine; requests 2 and 3 (other temperatures, so calls of their
    own) arrive while it does and queue, one call running at a time. When 1's call times out the older of 2 and 3 is
    sent and hangs too; the other expires while still queued. All three get a 504 naming request_timeout_s, and the
    one dropped from the queue never reaches the engine."""
    hanging = HangingEngine()
    results = {}

    def client(index, temperature):
        results[index] = post(endpoint.url, {"messages": question(index), "temperature": temperature})

    # request_timeout_s must fire (the engine hangs); 2 and 3 have that long to be queued behind request 1
    with endpoint_for(hanging, tokenizer, request_timeout_s=3.0, batch_window_s=0) as endpoint:
        threads = [threading.Thread(target=client, args=(1, 1.0), daemon=True)]
        threads[0].start()
        wait_until(lambda: len(hanging.prompts) == 1, "request 1 to reach the engine")
        threads += [threading.Thread(target=client, args=args, daemon=True) for args in ((2, 0.5), (3, 0.3))]
        for thread in threads[1:]:
            thread.start()
        for thread in threads:
            thread.join(timeout=60)
        assert sorted(results) == [1, 2, 3], results
        for index in (1, 2, 3):
            status, answer = results[index]
            assert status == 504 and answer["error"]["type"] == "timeout_error", answer
            assert "request_timeout_s=3" in answer["error"]["message"]
        assert not hanging.returned.is_set()   # every 504 came while the engine still hung
        hanging.release.set()
        # the engine runs calls in order, so a call of the dropped request would come before this one's
        status, answer = post(endpoint.url, {"messages": question(4), "temperature": 0.9})
        assert status == 200, answer
        sent = [tokenizer.decode(prompt) for prompt in hanging.prompts]
        assert len(sent) == 3 and "What is 1 + 3?" in sent[0] and "What is 4 + 12?" in sent[2], sent
        assert ("What is 2 + 6?" in sent[1]) != ("What is 3 + 9?" in sent[1]), sent


def test_close_is_bounded_and_answers_queued_requests_503(tokenizer):
    hanging = HangingEngine()
    noting = NotingTokenizer(tokenizer, "What is 2 + 6?")
    endpoint = endpoint_for(hanging, noting, request_timeout_s=60, shutdown_timeout_s=0.5, batch_window_s=0)
    endpoint.start()
    results = {}

    def client(name, index, temperature):
        results[name] = post(endpoint.url, {"messages": question(index), "temperature": temperature}, timeout=90)

    threads = [threading.Thread(target=client, args=("running", 1, 1.0), daemon=True)]
    threads[0].start()
    wait_until(lambda: len(hanging.prompts) == 1, "the first request to reach the engine")
    threads.append(threading.Thread(target=client, args=("queued", 2, 0.5), daemon=True))
    threads[1].start()
    assert noting.encoded.wait(60), "the second request never reached the endpoint"
    endpoint.close()
    assert not hanging.returned.is_set()   # close() did not wait for the engine call in flight
    threads[1].join(timeout=60)
    assert results["queued"][0] == 503 and "shutting down" in results["queued"][1]["error"]["message"]
    assert len(hanging.prompts) == 1   # the waiting request never reached the engine
    hanging.release.set()
    threads[0].join(timeout=60)


def test_concurrent_sessions_continue_token_for_token_in_shared_calls(hf_engine, tokenizer):
    """Four agents, three turns each, at once: turns share engine calls, and every turn's prompt is still the
    previous prompt + the sampled answer's ids (nothing re-tokenised), so each session is one multi-turn rollout
    whose log-probs a trainer reproduces."""
    from rlhfkit.losses import model_logprobs
    from rlhfkit.packing import pack_rollouts

    log = CallLog(hf_engine)

    def agent(name):
        messages = [{"role": "user", "content": f"I am {name}, count with me."}]
        for turn in range(3):
            status, answer = post(endpoint.url, {"messages": messages, "max_tokens": 5}, {"X-Session-Id": name})
            if status != 200 or answer["rlhfkit"]["turn_index"] != turn:
                return status, answer
            messages = messages + [answer["choices"][0]["message"], {"role": "user", "content": f"then {turn}"}]
        return 200, None

    names = [f"agent{i}" for i in range(4)]
    with endpoint_for(log, tokenizer, batch_window_s=1.0, max_batch_prompts=4) as endpoint:
        outcomes = concurrently([lambda name=name: agent(name) for name in names])
        assert outcomes == [(200, None)] * 4
        sessions = [endpoint.pop_records(name) for name in names]
    assert sum(len(prompts) for prompts, _, _ in log.calls) == 12 and len(log.calls) < 12
    rollouts = []
    for records in sessions:
        assert [r.turn_index for r in records] == [0, 1, 2]
        for before, after in itertools.pairwise(records):
            sent = torch.cat([before.prompt_token_ids, before.response_token_ids])
            assert torch.equal(after.prompt_token_ids[:sent.numel()], sent)
        rollouts.append(session_to_rollout(records))
    batch = pack_rollouts(rollouts)
    with torch.no_grad():
        trainer = model_logprobs(hf_engine.model, batch)
    torch.testing.assert_close(trainer[batch.loss_mask].float(),
                               torch.cat([r.response_logprobs[r.loss_mask] for r in rollouts]), atol=1e-4, rtol=0)


@pytest.mark.parametrize("field, value", [("batch_window_s", -0.1), ("batch_window_s", float("inf")),
                                          ("batch_window_s", True), ("batch_window_s", "0.01"),
                                          ("max_batch_prompts", 0), ("max_batch_prompts", 2.5),
                                          ("max_batch_wait_s", -1.0), ("max_batch_wait_s", float("inf"))])
def test_batching_config_errors_name_field_and_value(field, value):
    with pytest.raises(ValueError, match=rf"OpenAIEndpointConfig\.{field}={value!r}"):
        OpenAIEndpointConfig(**{field: value})
    assert OpenAIEndpointConfig(batch_window_s=0).batch_window_s == 0


def _trickle(batcher, count: int, gap_s: float) -> list[threading.Thread]:
    """``count`` requests of equal sampling, one every ``gap_s`` seconds, each on its own thread."""
    sampling = SamplingConfig(n=1, max_new_tokens=2)
    threads = [threading.Thread(target=batcher.generate, args=([i + 1], sampling), kwargs={"timeout_s": 60.0})
               for i in range(count)]
    for thread in threads:
        thread.start()
        time.sleep(gap_s)
    return threads


def _counting_generate(calls: list[int]):
    def generate(prompts, sampling):
        calls.append(len(prompts))
        return [Rollout(prompt_token_ids=torch.tensor(p), response_token_ids=torch.tensor([7])) for p in prompts]
    return generate


def test_a_trickle_of_requests_joins_one_call_while_the_gaps_stay_below_the_window():
    """Agents connect over a few hundred milliseconds (thread starts, HTTP): a fixed window from the oldest request
    split them into a call per window; the quiet-gap rule sends one call once nobody arrived for batch_window_s."""
    from rlhfkit.openai_endpoint._batching import RequestBatcher

    calls: list[int] = []
    batcher = RequestBatcher(_counting_generate(calls), window_s=0.5, max_wait_s=60.0, max_batch_prompts=64,
                             max_in_flight=1)
    try:
        for thread in _trickle(batcher, 12, gap_s=0.05):  # spans >= 0.55 s > window_s; gaps a tenth of window_s
            thread.join(timeout=60)
    finally:
        batcher.close()
    assert calls == [12]


def test_max_batch_wait_bounds_how_long_a_request_waits_for_others():
    from rlhfkit.openai_endpoint._batching import RequestBatcher

    calls: list[int] = []
    batcher = RequestBatcher(_counting_generate(calls), window_s=0.05, max_wait_s=0.1, max_batch_prompts=64,
                             max_in_flight=1)
    try:
        for thread in _trickle(batcher, 15, gap_s=0.02):  # spans >= 0.28 s, well past max_wait_s
            thread.join(timeout=60)
    finally:
        batcher.close()
    assert sum(calls) == 15 and len(calls) >= 2, calls  # the first call left at max_wait_s, not at the end
