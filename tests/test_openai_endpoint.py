"""The OpenAI-compatible endpoint over the hf engine: OpenAI request/answer shapes, records equal to what the engine
sampled, log-probs equal to a trainer forward, sessions, stop strings, 4xx/5xx JSON errors, bounded timeouts and
shutdown. Plain urllib/socket clients (no openai package)."""

from __future__ import annotations

import json
import socket
import threading
import urllib.error
import urllib.request

import pytest
import torch

from rlhfkit.engines.protocol import SamplingConfig
from rlhfkit.openai_endpoint import (ChatRecord, OpenAIEndpoint, OpenAIEndpointConfig, records_to_rollouts,
                                     session_to_rollout)
from rlhfkit.types import Rollout

pytest.importorskip("transformers")  # the endpoint's tokenizer, the hf engine


class SpyEngine:
    """The real hf engine, remembering what each generate call was asked and returned."""

    def __init__(self, engine):
        self.engine, self.calls = engine, []

    def generate(self, prompts, sampling):
        rollouts = self.engine.generate(prompts, sampling)
        self.calls.append((prompts, sampling, rollouts))
        return rollouts


@pytest.fixture
def served(hf_engine, tokenizer):
    spy = SpyEngine(hf_engine)
    endpoint = OpenAIEndpoint(spy, tokenizer, OpenAIEndpointConfig(model_name="tiny", max_model_len=256,
                                                                   request_timeout_s=60))
    with endpoint:
        yield endpoint, spy


def post(url, body, headers=None, timeout=60):
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    request = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json", **(headers or {})})
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            return response.status, json.load(response)
    except urllib.error.HTTPError as error:
        return error.code, json.load(error)


def chat(endpoint, **body):
    return post(endpoint.url + "/chat/completions", {"model": "tiny", **body},
                headers={"X-Session-Id": body.pop("session")} if "session" in body else None)


MESSAGES = [{"role": "system", "content": "You add numbers."}, {"role": "user", "content": "What is 2 + 3?"}]


def test_answers_the_openai_request_shape(served, tokenizer):
    endpoint, spy = served
    assert endpoint.url.startswith("http://127.0.0.1:") and endpoint.port > 0
    with urllib.request.urlopen(endpoint.url + "/models", timeout=30) as response:
        models = json.load(response)
    assert models["object"] == "list" and [m["id"] for m in models["data"]] == ["tiny"]
    status, answer = chat(endpoint, messages=MESSAGES, n=3, max_tokens=8, temperature=1.0, top_p=1.0, seed=4,
                          logprobs=True, user="episode-7")
    assert status == 200, answer
    assert answer["object"] == "chat.completion" and answer["id"].startswith("chatcmpl-") and answer["model"] == "tiny"
    assert [c["index"] for c in answer["choices"]] == [0, 1, 2]
    records = endpoint.records("episode-7")   # no header: the `user` field names the session
    prompt = tokenizer.encode(tokenizer.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=False),
                              add_special_tokens=False)
    assert answer["usage"] == {"prompt_tokens": len(prompt),
                               "completion_tokens": sum(r.response_token_ids.numel() for r in records),
                               "total_tokens": len(prompt) + sum(r.response_token_ids.numel() for r in records)}
    for choice, record in zip(answer["choices"], records):
        assert choice["message"]["role"] == "assistant" and choice["finish_reason"] in ("stop", "length")
        assert choice["message"]["content"] == tokenizer.decode(record.response_token_ids, skip_special_tokens=True)
        assert [t["logprob"] for t in choice["logprobs"]["content"]] == pytest.approx(
            record.response_logprobs.tolist())
    assert spy.calls[-1][0] == [prompt]   # the chat template applied here, tokenised once


def test_records_are_what_the_engine_sampled(served, hf_engine, tokenizer):
    endpoint, spy = served
    status, answer = chat(endpoint, messages=MESSAGES, n=2, max_tokens=10, seed=11, session="s",
                          return_token_ids=True)
    assert status == 200, answer
    prompts, _, rollouts = spy.calls[-1]
    records = endpoint.records("s")
    assert [r.choice_index for r in records] == [0, 1] and {r.turn_index for r in records} == {0}
    for record, rollout, choice in zip(records, rollouts, answer["choices"]):
        assert torch.equal(record.prompt_token_ids, rollout.prompt_token_ids)
        assert torch.equal(record.response_token_ids, rollout.response_token_ids)
        assert torch.equal(record.response_logprobs, rollout.response_logprobs)
        assert choice["token_ids"] == rollout.response_token_ids.tolist()
    assert answer["prompt_token_ids"] == prompts[0]
    # the same request straight to the engine, same seed: the same tokens (nothing was re-tokenised on the way)
    again = hf_engine.generate(prompts, SamplingConfig(n=2, max_new_tokens=10, seed=11))
    assert [r.response_token_ids.tolist() for r in again] == [r.response_token_ids.tolist() for r in records]


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_logprobs_match_a_trainer_forward_over_a_multi_turn_session(served, hf_engine, temperature):
    from rlhfkit.losses import model_logprobs
    from rlhfkit.packing import pack_rollouts

    endpoint, _ = served
    messages = list(MESSAGES)
    for turn in range(3):   # an agent loop: each answer goes back into the conversation
        status, answer = chat(endpoint, messages=messages, max_tokens=6, temperature=temperature, seed=turn,
                              session=f"agent-{temperature}")
        assert status == 200, answer
        messages += [{"role": "assistant", "content": answer["choices"][0]["message"]["content"]},
                     {"role": "user", "content": f"and plus {turn}?"}]
    records = endpoint.pop_records(f"agent-{temperature}")
    assert [r.turn_index for r in records] == [0, 1, 2] and all(r.temperature == temperature for r in records)
    assert f"agent-{temperature}" not in endpoint.session_ids()
    rollouts = records_to_rollouts(records, prompt_index=5)
    assert [(r.prompt_index, r.sample_index) for r in rollouts] == [(5, 0), (5, 1), (5, 2)]
    batch = pack_rollouts(rollouts)
    with torch.no_grad():
        trainer = model_logprobs(hf_engine.model, batch, temperature=temperature)
    engine = torch.cat([r.response_logprobs for r in records])
    torch.testing.assert_close(trainer[batch.loss_mask].float(), engine, atol=1e-4, rtol=0)


def test_a_session_is_one_multi_turn_rollout_that_group_estimators_accept(served, hf_engine):
    """Review finding: per-turn rollouts of one session share a prompt_index but not a prompt, so GRPO refused them.
    session_to_rollout makes the conversation one sample: sampled tokens carry the engine's log-probs and loss weight,
    the tokens each next request added carry neither; two sessions then form one GRPO group."""
    import dataclasses

    from rlhfkit.experience import ExperienceConfig, make_experience
    from rlhfkit.losses import model_logprobs

    endpoint, _ = served
    sessions = []
    for name in ("s0", "s1"):
        messages = list(MESSAGES)
        for turn in range(3):
            status, answer = chat(endpoint, messages=messages, max_tokens=5, temperature=1.0, seed=turn, session=name)
            assert status == 200, answer
            messages += [{"role": "assistant", "content": answer["choices"][0]["message"]["content"]},
                         {"role": "user", "content": f"and plus {turn}?"}]
        sessions.append(endpoint.pop_records(name))
    rollouts = [session_to_rollout(records, prompt_index=0, sample_index=index)
                for index, records in enumerate(sessions)]
    first, records = rollouts[0], sessions[0]
    sampled = torch.cat([r.response_logprobs for r in records])
    assert int(first.loss_mask.sum()) == sum(r.response_token_ids.numel() for r in records)
    assert first.response_length > int(first.loss_mask.sum())  # the user turns in between are in, with weight 0
    torch.testing.assert_close(first.response_logprobs[first.loss_mask], sampled)
    assert torch.equal(first.response_token_ids[first.loss_mask], torch.cat([r.response_token_ids for r in records]))
    experience, _ = make_experience(rollouts, torch.tensor([1.0, 0.0]), config=ExperienceConfig(estimator="grpo"),
                                    policy_logprobs_fn=lambda b: model_logprobs(hf_engine.model, b))
    assert experience.num_seqs == 2
    with torch.no_grad():
        trainer = model_logprobs(hf_engine.model, experience.batch)
    torch.testing.assert_close(trainer[experience.batch.loss_mask].float(),
                               torch.cat([r.response_logprobs[r.loss_mask] for r in rollouts]), atol=1e-4, rtol=0)
    edited = list(records)
    edited[2] = dataclasses.replace(records[2], prompt_token_ids=records[2].prompt_token_ids.flip(0))
    with pytest.raises(ValueError, match="turn 2 .* does not continue the conversation token for token"):
        session_to_rollout(edited)


def test_concurrent_sessions_are_recorded_apart(served):
    """Four agents at once on one engine: each session holds its own turns, in its own order, and nothing else."""
    endpoint, _ = served
    failures = []

    def agent(name):
        messages = [{"role": "user", "content": f"I am {name}"}]
        for turn in range(2):
            status, answer = chat(endpoint, messages=messages, max_tokens=4, seed=turn, session=name)
            if status != 200 or answer["rlhfkit"] != {"session_id": name, "turn_index": turn, "weight_version": 0}:
                failures.append((name, status, answer))
                return
            messages += [answer["choices"][0]["message"], {"role": "user", "content": "go on"}]

    threads = [threading.Thread(target=agent, args=(f"agent{i}",)) for i in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=60)
    assert not failures
    for i in range(4):
        records = endpoint.pop_records(f"agent{i}")
        assert [r.turn_index for r in records] == [0, 1]
        assert all(r.messages[0]["content"] == f"I am agent{i}" for r in records)
        # turn 1's prompt holds turn 0's prompt: the same conversation, continued
        first = records[0].prompt_token_ids
        assert torch.equal(records[1].prompt_token_ids[:first.numel()], first)


def test_stop_strings_cut_content_and_records_at_the_sampled_tokens(served, tokenizer):
    endpoint, spy = served
    status, free = chat(endpoint, messages=MESSAGES, max_tokens=16, seed=21, session="free")
    assert status == 200
    full = endpoint.records("free")[0]
    text = free["choices"][0]["message"]["content"]
    assert len(text) >= 6, text
    stop = text[3:5]   # a two-character stop string inside the free answer
    status, cut = chat(endpoint, messages=MESSAGES, max_tokens=16, seed=21, stop=[stop, "never-seen"], session="cut")
    assert status == 200, cut
    record = endpoint.records("cut")[0]
    choice = cut["choices"][0]
    assert choice["finish_reason"] == "stop" and choice["message"]["content"] == text[:text.find(stop)]
    keep = record.response_token_ids.numel()
    assert 1 <= keep <= full.response_token_ids.numel()
    assert torch.equal(record.response_token_ids, full.response_token_ids[:keep])       # a prefix of the sample
    assert torch.equal(record.response_logprobs, full.response_logprobs[:keep])
    assert stop in tokenizer.decode(record.response_token_ids) and stop not in tokenizer.decode(
        record.response_token_ids[:-1])                                                # ends where the stop completed
    # a one-token stop string: the engine itself stops on that token (it becomes a stop_token_id)
    sampled = full.response_token_ids.tolist()
    position = next(i for i, token in enumerate(sampled) if i >= 1
                    and tokenizer.encode(tokenizer.decode([token]), add_special_tokens=False) == [token]
                    and tokenizer.decode([token]) not in tokenizer.decode(sampled[:i]))
    single = tokenizer.decode([sampled[position]])
    status, answer = chat(endpoint, messages=MESSAGES, max_tokens=16, seed=21, stop=single, session="one")
    assert status == 200 and answer["choices"][0]["finish_reason"] == "stop"
    assert spy.calls[-1][1].stop_token_ids == (sampled[position],)
    one = endpoint.records("one")[0]
    assert one.response_token_ids.tolist() == sampled[:position + 1]


@pytest.mark.parametrize("body, status, param, fragment", [
    (b"{not json", 400, None, "not valid JSON"),
    ({"messages": []}, 400, "messages", "non-empty list"),
    ({"messages": [{"role": "wizard", "content": "x"}]}, 400, "messages[0].role", "'wizard' is not one of"),
    ({"messages": [{"role": "user", "content": 3}]}, 400, "messages[0].content", "expected a string"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, 400, "messages[0].content[0]", "text"),
    ({"messages": MESSAGES, "n": 0}, 400, "n", "0 is outside [1, 64]"),
    ({"messages": MESSAGES, "temperature": 5}, 400, "temperature", "5 is outside [0, 2]"),
    ({"messages": MESSAGES, "top_p": 0}, 400, "top_p", "outside (0, 1]"),
    ({"messages": MESSAGES, "max_tokens": "8"}, 400, "max_tokens", "expected an integer"),
    ({"messages": MESSAGES, "stop": ["a", "b", "c", "d", "e"]}, 400, "stop", "at most 4"),
    ({"messages": MESSAGES, "stream": True}, 400, "stream", "non-streaming requests only"),
    ({"messages": MESSAGES, "top_logprobs": 3}, 400, "top_logprobs", "sampled token's log-prob only"),
    ({"messages": MESSAGES, "presence_penalty": 0.5}, 400, "presence_penalty", "not supported"),
    ({"messages": MESSAGES, "max_tokens": 250}, 400, "messages", "exceed max_model_len=256"),
    ({"messages": MESSAGES, "model": "gpt-4o"}, 404, "model", "does not exist; this endpoint serves 'tiny'"),
    ([1, 2], 400, None, "must be a JSON object"),
])
def test_malformed_requests_get_openai_errors(served, body, status, param, fragment):
    endpoint, spy = served
    calls = len(spy.calls)
    code, answer = post(endpoint.url + "/chat/completions", body)
    assert code == status, answer
    error = answer["error"]
    assert fragment in error["message"] and error["param"] == param and error["type"] == "invalid_request_error"
    assert len(spy.calls) == calls   # refused before the engine was called


def test_routes_methods_and_size_limits(hf_engine, tokenizer):
    config = OpenAIEndpointConfig(max_request_bytes=2000, read_timeout_s=0.5)
    with OpenAIEndpoint(hf_engine, tokenizer, config) as endpoint:
        assert post(endpoint.url + "/completions", {"prompt": "x"})[0] == 404
        with pytest.raises(urllib.error.HTTPError) as info:
            urllib.request.urlopen(endpoint.url + "/chat/completions", timeout=30)
        assert info.value.code == 405 and "use POST" in json.load(info.value)["error"]["message"]
        code, answer = post(endpoint.url + "/chat/completions", {"messages": MESSAGES, "pad": "x" * 5000})
        assert code == 413 and "max_request_bytes" in answer["error"]["message"]
        # a body that never comes: the server answers 408 (the socket's 60 s timeout only guards against a hang)
        with socket.create_connection(("127.0.0.1", endpoint.port), timeout=60) as raw:
            raw.sendall(f"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1:{endpoint.port}\r\nContent-Type: "
                        "application/json\r\nContent-Length: 50\r\n\r\n{".encode())
            reply = raw.recv(4096).decode()
            assert reply.startswith("HTTP/1.1 408"), reply


class HangingEngine:
    """Blocks every call until released (60 s at most, a hang guard); ``entered``: a call began, ``returned``: one
    ended. A reply seen while ``returned`` is unset did not wait for the engine."""

    def __init__(self):
        self.release, self.entered, self.returned = threading.Event(), threading.Event(), threading.Event()

    def generate(self, prompts, sampling):
        self.entered.set()
        self.release.wait(60)
        self.returned.set()
        return [Rollout(prompt_token_ids=torch.tensor(prompts[0]), response_token_ids=torch.tensor([1]),
                        response_logprobs=torch.tensor([-0.5]))] * sampling.n


class FailingEngine:
    def generate(self, prompts, sampling):
        raise RuntimeError("CUDA out of memory (simulated)")


def test_engine_timeout_and_failure_are_json_errors(tokenizer):
    hanging = HangingEngine()
    with OpenAIEndpoint(hanging, tokenizer, OpenAIEndpointConfig(request_timeout_s=0.5)) as endpoint:
        code, answer = post(endpoint.url + "/chat/completions", {"messages": MESSAGES})
        assert code == 504 and answer["error"]["type"] == "timeout_error"
        assert "request_timeout_s=0.5" in answer["error"]["message"]
        assert not hanging.returned.is_set()   # answered while the engine call still hung
        hanging.release.set()
    with OpenAIEndpoint(FailingEngine(), tokenizer) as endpoint:
        code, answer = post(endpoint.url + "/chat/completions", {"messages": MESSAGES})
        assert code == 500 and answer["error"]["type"] == "server_error"
        assert "CUDA out of memory (simulated)" in answer["error"]["message"]


def test_close_is_bounded_with_a_request_in_flight(tokenizer):
    hanging = HangingEngine()
    endpoint = OpenAIEndpoint(hanging, tokenizer, OpenAIEndpointConfig(request_timeout_s=60, shutdown_timeout_s=0.5))
    endpoint.start()
    url, port = endpoint.url, endpoint.port
    results = []
    client = threading.Thread(target=lambda: results.append(post(url + "/chat/completions", {"messages": MESSAGES},
                                                                 timeout=90)), daemon=True)
    client.start()
    assert hanging.entered.wait(60), "the request never reached the engine"
    endpoint.close()
    assert not hanging.returned.is_set()   # close() did not wait for the engine call in flight
    with pytest.raises(OSError):
        socket.create_connection(("127.0.0.1", port), timeout=2).close()
    endpoint.close()   # idempotent
    with pytest.raises(RuntimeError, match=r"start\(\) called on an endpoint that is closed"):
        endpoint.start()
    hanging.release.set()
    client.join(timeout=60)


def test_config_and_argument_errors(hf_engine, tokenizer):
    with pytest.raises(ValueError, match=r"OpenAIEndpointConfig.port=70000"):
        OpenAIEndpointConfig(port=70000)
    with pytest.raises(ValueError, match=r"default_max_tokens=512 exceeds max_tokens_limit=256"):
        OpenAIEndpointConfig(default_max_tokens=512, max_tokens_limit=256)
    with pytest.raises(ValueError, match=r"request_timeout_s=0"):
        OpenAIEndpointConfig(request_timeout_s=0)
    with pytest.raises(TypeError, match=r"has no generate"):
        OpenAIEndpoint(object(), tokenizer)
    with pytest.raises(TypeError, match=r"has no apply_chat_template"):
        OpenAIEndpoint(hf_engine, object())
    endpoint = OpenAIEndpoint(hf_engine, tokenizer)
    with pytest.raises(RuntimeError, match=r"port read before start"):
        _ = endpoint.port
    with pytest.raises(KeyError, match=r"no records for session 'x'"):
        endpoint.records("x")
    endpoint.close()
    with pytest.raises(TypeError, match=r"records\[0\] is str"):
        records_to_rollouts(["x"])
    assert ChatRecord.__dataclass_params__.frozen


class BrokenTokenizer:
    chat_template = "x"

    def apply_chat_template(self, messages, **kwargs):
        return "text"

    def encode(self, text, **kwargs):
        raise RuntimeError("tokenizer defect (simulated)")

    def decode(self, ids, **kwargs):
        return ""


def test_an_unexpected_error_is_a_json_500_not_a_dropped_connection(hf_engine):
    with OpenAIEndpoint(hf_engine, BrokenTokenizer()) as endpoint:
        code, answer = post(endpoint.url + "/chat/completions", {"messages": MESSAGES})
        assert code == 500 and answer["error"]["type"] == "server_error"
        assert "RuntimeError: tokenizer defect (simulated)" in answer["error"]["message"]
        code, _ = post(endpoint.url + "/chat/completions", {"messages": MESSAGES})   # still serving
        assert code == 500


def test_only_json_posts_addressed_to_this_server_reach_the_engine(served):
    """Issue 50: a text/plain POST (what a web page may send cross-origin without a CORS preflight), a foreign Host
    (DNS rebinding) or a foreign Origin reached the engine and wrote into a training session."""
    endpoint, spy = served
    url, port = endpoint.url + "/chat/completions", endpoint.port
    body = {"model": "tiny", "messages": MESSAGES, "max_tokens": 2, "user": "web-page"}
    for headers, status, fragment in [
        ({"Content-Type": "text/plain"}, 415, "'Content-Type: application/json'"),
        ({"Content-Type": "application/x-www-form-urlencoded"}, 415, "'Content-Type: application/json'"),
        ({"Content-Type": "application/json; charset=latin-1"}, 415, "'Content-Type: application/json'"),
        ({"Host": f"rebound.example:{port}"}, 421, "does not name this server"),
        ({"Host": "127.0.0.1:1"}, 421, "does not name this server"),
        ({"Origin": "http://evil.example"}, 403, "cross-origin requests (from a web page) are refused"),
        ({"Origin": f"http://rebound.example:{port}"}, 403, "cross-origin"),
        ({"Origin": "null"}, 403, "cross-origin"),
    ]:
        code, answer = post(url, body, headers)
        assert code == status and fragment in answer["error"]["message"], (headers, code, answer)
    assert not spy.calls and "web-page" not in endpoint.session_ids()
    # this server's own names and a same-origin Origin are served
    for headers in ({"Host": f"localhost:{port}"}, {"Origin": f"http://127.0.0.1:{port}"},
                    {"Content-Type": "application/json; charset=utf-8"}):
        code, answer = post(url, body, headers)
        assert code == 200, (headers, answer)
    assert len(endpoint.records("web-page")) == 3


def test_a_bearer_key_is_asked_when_configured_and_always_beyond_loopback(hf_engine, tokenizer, caplog):
    """Issue 50: the endpoint had no authentication. A configured key is required on loopback too; bound beyond
    loopback without one, the endpoint makes a key, exposes it as ``api_key`` and never logs it."""
    spy = SpyEngine(hf_engine)
    body = {"model": "tiny", "messages": MESSAGES, "max_tokens": 2}
    key = "test-key-0123456789"
    config = OpenAIEndpointConfig(model_name="tiny", api_key=key)
    assert key not in repr(config)
    with OpenAIEndpoint(spy, tokenizer, config) as endpoint:
        assert endpoint.api_key == key
        for headers in ({}, {"Authorization": "Bearer wrong-key"}, {"Authorization": key},
                        {"Authorization": f"Basic {key}"}):
            code, answer = post(endpoint.url + "/chat/completions", body, headers)
            assert code == 401 and answer["error"]["type"] == "authentication_error", (headers, answer)
        with pytest.raises(urllib.error.HTTPError) as info:
            urllib.request.urlopen(endpoint.url + "/models", timeout=30)
        assert info.value.code == 401 and info.value.headers["WWW-Authenticate"].startswith("Bearer")
        assert not spy.calls
        assert post(endpoint.url + "/chat/completions", body, {"Authorization": f"Bearer {key}"})[0] == 200
    with caplog.at_level("DEBUG", logger="rlhfkit.openai_endpoint"):
        with OpenAIEndpoint(hf_engine, tokenizer, OpenAIEndpointConfig(model_name="tiny", host="0.0.0.0")) as wide:
            made = wide.api_key
            assert isinstance(made, str) and len(made) >= 32
            url = f"http://127.0.0.1:{wide.port}/v1/chat/completions"   # a wildcard bind takes any address of ours
            assert post(url, body)[0] == 401
            assert post(url, body, {"Authorization": f"Bearer {made}"})[0] == 200
    assert made not in caplog.text and "bearer key required" in caplog.text
    loopback = OpenAIEndpoint(hf_engine, tokenizer)
    assert loopback.api_key is None   # on loopback without a configured key, none is asked
    loopback.close()
    with pytest.raises(ValueError, match=r"OpenAIEndpointConfig.host='localhost'; must be an IP address literal"):
        OpenAIEndpointConfig(host="localhost")
    with pytest.raises(ValueError, match=r"api_key \(a str of length 7, not shown\)") as info:
        OpenAIEndpointConfig(api_key="has spc")
    assert "has spc" not in str(info.value)


def _body(messages: str = json.dumps(MESSAGES), **fields: str) -> bytes:
    """A request body, its fields given as JSON text; valid but for what a test puts in."""
    fields = {"messages": messages, "max_tokens": "2", **fields}
    return ("{" + ", ".join(f'"{name}": {value}' for name, value in fields.items()) + "}").encode()


def _tools(default: str) -> str:
    return f'[{{"type": "function", "function": {{"name": "f", "parameters": {{"default": {default}}}}}}}]'


@pytest.mark.parametrize("body, fragment, param", [
    (_body(messages="[" * 100_000 + "]" * 100_000), "nested too deeply", None),
    (_body(messages="[" * 70 + "]" * 70), "nested more than 64 levels deep", None),
    (_body(seed="1" * 5000), "an integer of 5000 digits", None),
    (_body(temperature="9" * 400), "an integer of 400 digits", None),
    (_body(messages='[{"role": "user", "content": "\\ud800"}]'), "lone surrogate (U+D800)", "messages[0].content"),
    (_body(tools=_tools("NaN")), "holds NaN, which is not valid JSON", None),
    (_body(tools=_tools("-Infinity")), "holds -Infinity", None),
    (_body(tools=_tools("1e999")), "'1e999', which is not a finite float", None),
    (_body().replace(b"2 + 3", "2 \u2795 3".encode("utf-8")).decode().encode("utf-16"), "not UTF-8", None),
    (_body().replace(b"2 + 3", "caf\xe9".encode("latin-1")), "not UTF-8", None),
    (_body().replace(b"2 + 3", b"\xed\xa0\x80"), "not UTF-8", None),   # a surrogate encoded as if it were UTF-8
], ids=["100000-deep", "70-deep", "5000-digits", "400-digit-temperature", "lone-surrogate", "nan", "infinity", "1e999",
        "utf-16", "latin-1", "encoded-surrogate"])
def test_malformed_bodies_are_400s_naming_the_problem(served, body, fragment, param):
    """Issue 50: deep nesting, huge integers and lone surrogates were 500s (a RecursionError, int() refusing 4300+
    digits, the tokenizer refusing a surrogate), NaN and non-UTF-8 bodies were accepted."""
    endpoint, spy = served
    code, answer = post(endpoint.url + "/chat/completions", body)
    assert code == 400 and answer["error"]["type"] == "invalid_request_error", answer
    assert fragment in answer["error"]["message"] and answer["error"]["param"] == param, answer
    assert not spy.calls
    with urllib.request.urlopen(endpoint.url + "/models", timeout=30) as response:   # still serving
        assert response.status == 200


TOOLS_TEMPLATE = ("{% if tools %}<|system|>tools:{% for tool in tools %} {{ tool['function']['name'] }}{% endfor %}"
                  "<|end|>{% endif %}{% for message in messages %}<|{{ message['role'] }}|>{{ message['content'] }}"
                  "<|end|>{% endfor %}{% if add_generation_prompt %}<|assistant|>{% endif %}")


def _tool(name: str) -> dict:
    return {"type": "function", "function": {"name": name, "parameters": {"type": "object", "properties": {}}}}


def test_a_change_of_tools_between_turns_re_renders_the_prompt(hf_engine, tiny_llama_path):
    """Issue 50: token-in/token-out continuation reused the previous turn's prompt ids although the request's tools
    (rendered before the messages) had changed: the engine and the record got the old tool list."""
    transformers = pytest.importorskip("transformers")
    tokenizer = transformers.AutoTokenizer.from_pretrained(tiny_llama_path)
    tokenizer.chat_template = TOOLS_TEMPLATE
    spy = SpyEngine(hf_engine)
    tool_lists = [[_tool("get_weather")], [_tool("get_time")], [_tool("get_time")]]
    messages = [{"role": "user", "content": "What time is it?"}]
    with OpenAIEndpoint(spy, tokenizer, OpenAIEndpointConfig(model_name="tiny")) as endpoint:
        for turn, tools in enumerate(tool_lists):
            status, answer = chat(endpoint, messages=messages, tools=tools, max_tokens=4, seed=turn, session="agent")
            assert status == 200, answer
            messages += [answer["choices"][0]["message"], {"role": "user", "content": "go on"}]
        records = endpoint.pop_records("agent")
    engine_prompts = [prompts[0] for prompts, _, _ in spy.calls]
    assert "get_weather" in tokenizer.decode(engine_prompts[0])
    changed = tokenizer.decode(engine_prompts[1])
    assert "get_time" in changed and "get_weather" not in changed
    # the changed turn is the whole conversation rendered with the new tools, tokenised once
    rendered = tokenizer.apply_chat_template(records[1].messages, tools=tool_lists[1], add_generation_prompt=True,
                                             tokenize=False)
    assert engine_prompts[1] == tokenizer.encode(rendered, add_special_tokens=False)
    for record, prompt, tools in zip(records, engine_prompts, tool_lists):
        assert record.prompt_token_ids.tolist() == prompt and record.tools == tools
    # the next turn kept the tools: it continues the previous prompt and the sampled answer token for token
    previous = records[1].prompt_token_ids.tolist() + records[1].response_token_ids.tolist()
    assert engine_prompts[2][:len(previous)] == previous
