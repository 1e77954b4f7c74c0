"""`draft_token_generator serve` with the official openai client, against a real verifier."""

from __future__ import annotations

import json
import time

import httpx
import openai
import pytest

from scripts.harness.local import LocalServe, free_port
from tests.conftest import TEST_THREADS, start_verifier

pytestmark = pytest.mark.integration


class LocalAPI(LocalServe):
    def __init__(self, verifier_url: str, *extra: str, env: dict[str, str] | None = None):
        super().__init__(verifier_url, *extra, threads=TEST_THREADS, env=env)

    def client(self) -> openai.OpenAI:
        return openai.OpenAI(base_url=self.url, api_key="unused", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def local_api(live_verifier):
    api = LocalAPI(live_verifier.url)
    yield api
    api.log = api.stop()


def verifier_text(live_verifier, prompt: str, max_tokens: int) -> str:
    return httpx.post(
        f"{live_verifier.url}/generate",
        json={"prompt": prompt, "max_tokens": max_tokens},
        timeout=120,
    ).json()["text"]


CHAT_PROMPT = "<|im_start|>user\nWhat is the capital of France?<|im_end|>\n<|im_start|>assistant\n"


def test_models_lists_the_verifier_model(local_api, live_verifier):
    models = local_api.client().models.list()
    assert len(models.data) == 1


def test_completion_equals_the_verifier_alone(local_api, live_verifier):
    prompt = "The three laws of motion are"
    result = local_api.client().completions.create(
        model="any", prompt=prompt, max_tokens=24, temperature=0
    )
    assert result.choices[0].text == verifier_text(live_verifier, prompt, 24)
    assert result.choices[0].finish_reason == "length"
    assert result.usage.completion_tokens == 24
    assert result.model_extra["speculative"]["rounds"] >= 1
    assert 0 <= result.model_extra["speculative"]["acceptance_rate"] <= 1


def test_streamed_completion_equals_the_verifier_alone(local_api, live_verifier):
    prompt = "def fibonacci(n):\n"
    stream = local_api.client().completions.create(
        model="any", prompt=prompt, max_tokens=30, temperature=0, stream=True
    )
    chunks = list(stream)
    assert len(chunks) > 2
    assert "".join(c.choices[0].text for c in chunks) == verifier_text(live_verifier, prompt, 30)
    assert chunks[-1].choices[0].finish_reason == "length"


def test_chat_completion_uses_the_chat_template(local_api, live_verifier):
    result = local_api.client().chat.completions.create(
        model="any",
        messages=[{"role": "user", "content": "What is the capital of France?"}],
        max_tokens=40,
        temperature=0,
    )
    message = result.choices[0].message
    assert message.role == "assistant"
    assert message.content == verifier_text(live_verifier, CHAT_PROMPT, 40)
    assert result.usage.prompt_tokens > 5


def test_streamed_chat_completion(local_api, live_verifier):
    stream = local_api.client().chat.completions.create(
        model="any",
        messages=[{"role": "user", "content": "What is the capital of France?"}],
        max_tokens=40,
        temperature=0,
        stream=True,
    )
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == verifier_text(live_verifier, CHAT_PROMPT, 40)
    assert chunks[-1].choices[0].finish_reason in ("stop", "length")


def test_stop_sequences_are_honoured(local_api, live_verifier):
    prompt = "Count: one, two, three, four, five, six,"
    full = verifier_text(live_verifier, prompt, 40)
    stop = full.strip().split()[2]
    assert stop in full
    for stream in (False, True):
        result = local_api.client().completions.create(
            model="any", prompt=prompt, max_tokens=40, temperature=0, stop=[stop], stream=stream
        )
        if stream:
            chunks = list(result)
            text = "".join(c.choices[0].text for c in chunks)
            finish = chunks[-1].choices[0].finish_reason
        else:
            text, finish = result.choices[0].text, result.choices[0].finish_reason
        assert text == full[: full.index(stop)]
        assert finish == "stop"


def test_sampling_with_a_seed_is_reproducible(local_api):
    def once():
        return (
            local_api.client()
            .completions.create(
                model="any", prompt="Once upon a time", max_tokens=20, temperature=0.8, seed=5
            )
            .choices[0]
            .text
        )

    assert once() == once()


def test_errors_have_the_openai_shape(local_api):
    client = local_api.client()
    with pytest.raises(openai.BadRequestError) as bad:
        client.completions.create(model="any", prompt="hi", max_tokens=0)
    assert bad.value.body["type"] == "invalid_request_error"
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model="any", prompt="hi", n=17)
    with pytest.raises(openai.BadRequestError) as too_long:  # refused before taking a slot
        client.completions.create(model="any", prompt="word " * 1500, max_tokens=4)
    assert too_long.value.body["code"] == "context_length_exceeded"


def test_a_down_verifier_is_a_clear_error_not_a_hang():
    api = LocalAPI("http://127.0.0.1:9")
    try:
        began = time.monotonic()
        with pytest.raises(openai.APIStatusError) as error:
            api.client().completions.create(model="any", prompt="hi", max_tokens=4)
        assert time.monotonic() - began < 30
        assert error.value.status_code == 503
        assert error.value.body["code"] == "verifier_unavailable"
        assert "cannot reach the verifier" in error.value.body["message"]
    finally:
        api.stop()


def test_a_vocabulary_mismatch_is_a_clear_error(live_verifier, tmp_path):
    from tests.fixtures.tiny_gguf import write_tiny_gguf

    tiny = write_tiny_gguf(tmp_path / "tiny.gguf")
    api = LocalAPI(live_verifier.url, "--model", str(tiny), "--no-translate")
    try:
        with pytest.raises(openai.APIStatusError) as error:
            api.client().chat.completions.create(
                model="any", messages=[{"role": "user", "content": "hi"}], max_tokens=4
            )
        assert error.value.status_code == 502
        assert error.value.body["code"] == "vocabulary_mismatch"
        assert "tiny-test-llama" in error.value.body["message"]
    finally:
        api.stop()


def sse_chunks(url: str, body: dict) -> list[dict]:
    """The stream's events as JSON, read raw (as clients that parse it themselves do)."""
    chunks = []
    with httpx.stream("POST", url, json=body, timeout=120) as response:
        assert response.status_code == 200
        for line in response.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                chunks.append(json.loads(line.removeprefix("data: ")))
    return chunks


def test_streams_have_the_shape_openai_sends(local_api, live_verifier):
    """A chat stream opens with the role and no text; every chunk before the last says
    `finish_reason: null`; every chunk has the same `system_fingerprint`; usage comes last
    when asked for. Completions likewise, without the role."""
    chat = sse_chunks(
        f"{local_api.url}/chat/completions",
        {
            "model": "any",
            "messages": [{"role": "user", "content": "What is the capital of France?"}],
            "max_tokens": 12,
            "temperature": 0,
            "stream": True,
            "stream_options": {"include_usage": True},
        },
    )
    *with_choices, usage = chat
    first, *texts, last = with_choices
    assert first["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert texts and all(set(c["choices"][0]["delta"]) == {"content"} for c in texts)
    for chunk in [first, *texts]:
        assert chunk["choices"][0]["finish_reason"] is None
        assert chunk["choices"][0]["logprobs"] is None
        assert chunk["object"] == "chat.completion.chunk"
    assert last["choices"][0]["delta"] == {}
    assert last["choices"][0]["finish_reason"] in ("stop", "length")
    assert usage["choices"] == [] and 0 < usage["usage"]["completion_tokens"] <= 12
    fingerprints = {c["system_fingerprint"] for c in chat}
    assert len(fingerprints) == 1 and fingerprints.pop().startswith("fp_")
    text = "".join(c["choices"][0]["delta"]["content"] for c in texts)
    assert text == verifier_text(live_verifier, CHAT_PROMPT, 12)

    completion = sse_chunks(
        f"{local_api.url}/completions",
        {"model": "any", "prompt": "The sky is", "max_tokens": 8, "stream": True},
    )
    assert all(c["choices"][0]["finish_reason"] is None for c in completion[:-1])
    assert completion[-1]["choices"][0]["finish_reason"] == "length"
    assert {c["system_fingerprint"] for c in completion} == {chat[0]["system_fingerprint"]}


def test_whole_responses_carry_the_system_fingerprint(local_api):
    result = local_api.client().chat.completions.create(
        model="any", messages=[{"role": "user", "content": "Hi"}], max_tokens=4, temperature=0
    )
    assert result.system_fingerprint.startswith("fp_")


def test_a_replayed_tool_conversation_is_accepted(local_api):
    """An assistant's tool call (content null) and the tool's result, as agents send the
    conversation back."""
    call = {"id": "call_1", "type": "function"}
    call["function"] = {"name": "get_weather", "arguments": '{"city": "Paris"}'}
    result = local_api.client().chat.completions.create(
        model="any",
        messages=[
            {"role": "user", "content": "What is the weather in Paris?"},
            {"role": "assistant", "content": None, "tool_calls": [call]},
            {"role": "tool", "tool_call_id": "call_1", "content": '{"celsius": 21}'},
        ],
        max_tokens=8,
        temperature=0,
    )
    assert result.choices[0].message.content
    assert result.usage.prompt_tokens > 30  # the call and its result are in the prompt


def test_the_paths_without_v1_answer_like_the_paths_with_it(local_api, live_verifier):
    bare = openai.OpenAI(
        base_url=local_api.url.removesuffix("/v1"), api_key="x", max_retries=0, timeout=120
    )
    prompt = "The three laws of motion are"
    result = bare.completions.create(model="any", prompt=prompt, max_tokens=8, temperature=0)
    assert result.choices[0].text == verifier_text(live_verifier, prompt, 8)
    assert len(bare.models.list().data) == 1


def test_serve_with_a_key_of_its_own_refuses_clients_without_it(live_verifier):
    api = LocalAPI(live_verifier.url, "--serve-api-key", "sk-mine")
    try:
        wrong = openai.OpenAI(base_url=api.url, api_key="sk-other", max_retries=0)
        with pytest.raises(openai.AuthenticationError) as refused:
            wrong.models.list()
        assert refused.value.body["code"] == "invalid_api_key"
        right = openai.OpenAI(base_url=api.url, api_key="sk-mine", max_retries=0, timeout=120)
        result = right.completions.create(model="any", prompt="Hi", max_tokens=4, temperature=0)
        assert result.usage.completion_tokens == 4
    finally:
        api.stop()


def verifier_ids(live_verifier, prompt: str) -> list[int]:
    return httpx.post(
        f"{live_verifier.url}/generate", json={"prompt": prompt, "max_tokens": 1}, timeout=30
    ).json()["prompt_ids"]


def test_every_prompt_form_of_completions_answers_as_the_verifier_alone(local_api, live_verifier):
    """A text, texts, token ids and lists of them: a choice each, in order, each equal to
    the verifier's own greedy text; `echo` puts the prompt before it; usage counts all."""
    first, second = "The capital of France is", "def add(a, b):"
    expected = [verifier_text(live_verifier, p, 8) for p in (first, second)]
    ids = [verifier_ids(live_verifier, p) for p in (first, second)]
    client = local_api.client()
    for prompt in ([first, second], ids, [ids[0], ids[1]]):
        result = client.completions.create(model="any", prompt=prompt, max_tokens=8, temperature=0)
        assert [c.index for c in result.choices] == [0, 1]
        assert [c.text for c in result.choices] == expected
        assert result.usage.completion_tokens == 16
    single = client.completions.create(model="any", prompt=ids[0], max_tokens=8, temperature=0)
    assert single.choices[0].text == expected[0]
    echoed = client.completions.create(
        model="any", prompt=[first, second], max_tokens=8, temperature=0, echo=True
    )
    assert [c.text for c in echoed.choices] == [first + expected[0], second + expected[1]]
    echoed_ids = client.completions.create(
        model="any", prompt=ids[1], max_tokens=8, temperature=0, echo=True
    )
    assert echoed_ids.choices[0].text == second + expected[1]
    streamed = client.completions.create(
        model="any", prompt=[first, second], max_tokens=8, temperature=0, echo=True, stream=True
    )
    texts = ["", ""]
    for chunk in streamed:
        texts[chunk.choices[0].index] += chunk.choices[0].text
    assert texts == [first + expected[0], second + expected[1]]


def test_n_choices_greedy_alike_seeded_reproducible(local_api, live_verifier):
    client = local_api.client()
    prompt = "Once upon a time"
    greedy = client.completions.create(model="any", prompt=prompt, max_tokens=6, n=2, temperature=0)
    assert [c.index for c in greedy.choices] == [0, 1]
    assert (
        greedy.choices[0].text == greedy.choices[1].text == verifier_text(live_verifier, prompt, 6)
    )
    assert greedy.usage.prompt_tokens == single_prompt_tokens(client, prompt)

    def seeded():
        result = client.chat.completions.create(
            model="any",
            messages=[{"role": "user", "content": "Tell me a story."}],
            max_tokens=12,
            n=3,
            temperature=1.0,
            seed=11,
        )
        return [c.message.content for c in result.choices]

    first = seeded()
    assert first == seeded()  # each choice its own seed, the same each time
    assert len(set(first)) > 1


def single_prompt_tokens(client: openai.OpenAI, prompt: str) -> int:
    return client.completions.create(model="any", prompt=prompt, max_tokens=1).usage.prompt_tokens


def test_suffix_and_ids_outside_the_vocabulary_are_400s_saying_why(local_api):
    client = local_api.client()
    with pytest.raises(openai.BadRequestError) as no_fim:
        client.completions.create(model="any", prompt="def f(", suffix="return x", max_tokens=4)
    assert no_fim.value.body["param"] == "suffix"
    assert "fill-in-the-middle" in no_fim.value.body["message"]
    with pytest.raises(openai.BadRequestError) as outside:
        client.completions.create(model="any", prompt=[1, 2, 10**7], max_tokens=4)
    assert outside.value.body["param"] == "prompt"
    assert outside.value.body["code"] == "invalid_token"


def test_penalties_and_a_bias_give_the_verifiers_own_text_under_them(local_api, live_verifier):
    prompt = "List the days of the week: Monday, Tuesday,"
    plain = verifier_ids(live_verifier, prompt)  # the prompt's ids; the bias needs a token
    banned = httpx.post(
        f"{live_verifier.url}/generate", json={"prompt": prompt, "max_tokens": 2}, timeout=60
    ).json()["tokens"][0]
    sampling = {"presence_penalty": 0.8, "frequency_penalty": 0.5, "logit_bias": {banned: -100}}
    alone = httpx.post(
        f"{live_verifier.url}/generate",
        json={"prompt_tokens": plain, "max_tokens": 24, "sampling": sampling},
        timeout=120,
    ).json()
    assert banned not in alone["tokens"]
    result = local_api.client().completions.create(
        model="any",
        prompt=prompt,
        max_tokens=24,
        temperature=0,
        presence_penalty=0.8,
        frequency_penalty=0.5,
        logit_bias={str(banned): -100},
    )
    assert result.choices[0].text == alone["text"]
    assert result.choices[0].text != verifier_text(live_verifier, prompt, 24)


def test_logprobs_are_the_verifiers_for_the_tokens_sent(local_api, live_verifier):
    """Greedy: each token is its row's likeliest, so it leads its own top list; the
    tokens' texts make up the text, whole or streamed; completions' older shape too."""
    client = local_api.client()
    messages = [{"role": "user", "content": "Name three colours."}]
    whole = client.chat.completions.create(
        model="any", messages=messages, max_tokens=16, temperature=0, logprobs=True, top_logprobs=3
    )
    content = whole.choices[0].logprobs.content
    assert "".join(c.token for c in content) == whole.choices[0].message.content
    assert len(content) == whole.usage.completion_tokens
    for c in content:
        assert c.logprob <= 0 and len(c.top_logprobs) == 3
        assert c.top_logprobs[0].token == c.token
        assert c.top_logprobs[0].logprob == pytest.approx(c.logprob)
        assert bytes(c.bytes).decode("utf-8", "replace") == c.token
    streamed = client.chat.completions.create(
        model="any", messages=messages, max_tokens=16, temperature=0, logprobs=True, stream=True
    )
    tokens = [
        c.token
        for chunk in streamed
        if chunk.choices and chunk.choices[0].logprobs
        for c in chunk.choices[0].logprobs.content
    ]
    assert tokens == [c.token for c in content]
    text = client.completions.create(
        model="any", prompt="The sky is", max_tokens=6, temperature=0, logprobs=2
    ).choices[0]
    assert "".join(text.logprobs.tokens) == text.text
    assert all(len(top) == 2 for top in text.logprobs.top_logprobs)
    assert text.logprobs.text_offset[0] == 0 and len(text.logprobs.token_logprobs) == 6


PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 20},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
    },
    "required": ["name", "age"],
    "additionalProperties": False,
}


def verifier_under(live_verifier, prompt: str, grammar: dict, max_tokens: int) -> str:
    return httpx.post(
        f"{live_verifier.url}/generate",
        json={"prompt": prompt, "max_tokens": max_tokens, "grammar": grammar},
        timeout=120,
    ).json()["text"]


def test_json_outputs_parse_validate_and_equal_the_verifier_alone_under_them(
    local_api, live_verifier
):
    client = local_api.client()
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    as_object = client.chat.completions.create(
        model="any",
        messages=messages,
        max_tokens=40,
        temperature=0,
        response_format={"type": "json_object"},
    ).choices[0]
    if as_object.finish_reason == "stop":
        assert isinstance(json.loads(as_object.message.content), dict)
    else:  # cut at max_tokens: an object begun
        assert as_object.message.content.lstrip().startswith("{")
    object_grammar = {"kind": "json_schema", "source": {"type": "object"}}
    assert as_object.message.content == verifier_under(
        live_verifier, CHAT_PROMPT, object_grammar, 40
    )
    for stream in (False, True):
        result = client.chat.completions.create(
            model="any",
            messages=messages,
            max_tokens=60,
            temperature=0,
            stream=stream,
            response_format={
                "type": "json_schema",
                "json_schema": {"name": "person", "schema": PERSON, "strict": True},
            },
        )
        if stream:
            text = "".join(c.choices[0].delta.content or "" for c in result if c.choices)
        else:
            text = result.choices[0].message.content
        person = json.loads(text)
        assert set(person) == {"name", "age"} and 0 <= person["age"] <= 120
        assert text == verifier_under(
            live_verifier, CHAT_PROMPT, {"kind": "json_schema", "source": PERSON}, 60
        )


def test_llama_cpp_grammar_fields_constrain_completions(local_api):
    client = local_api.client()
    answer = client.completions.create(
        model="any",
        prompt="Is the sky blue? Answer:",
        max_tokens=4,
        temperature=0,
        extra_body={"grammar": 'root ::= " yes" | " no"'},
    )
    assert answer.choices[0].text in (" yes", " no")
    sampled = client.completions.create(
        model="any",
        prompt="A person:",
        max_tokens=60,
        temperature=1.0,
        seed=3,
        extra_body={"json_schema": PERSON},
    )
    assert set(json.loads(sampled.choices[0].text)) == {"name", "age"}


WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city now.",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "maxLength": 30},
                "unit": {"enum": ["celsius", "fahrenheit"]},
            },
            "required": ["city", "unit"],
            "additionalProperties": False,
        },
    },
}
CLOCK = {"type": "function", "function": {"name": "get_time", "description": "The time now."}}


def test_a_forced_tool_call_parses_and_validates_whole_or_streamed(local_api):
    client = local_api.client()
    messages = [{"role": "user", "content": "What's the weather like in Paris?"}]
    for choice in ({"type": "function", "function": {"name": "get_weather"}}, "required"):
        result = client.chat.completions.create(
            model="any",
            messages=messages,
            tools=[CLOCK, WEATHER],
            tool_choice=choice,
            max_tokens=60,
            temperature=0,
        ).choices[0]
        assert result.finish_reason == "tool_calls" and result.message.content is None
        (call,) = result.message.tool_calls
        assert call.id.startswith("call_") and call.type == "function"
        if choice == "required":
            assert call.function.name in ("get_weather", "get_time")
            continue
        assert call.function.name == "get_weather"
        arguments = json.loads(call.function.arguments)
        assert set(arguments) == {"city", "unit"} and arguments["unit"] in ("celsius", "fahrenheit")
        forced = {"type": "function", "function": {"name": "get_weather"}}
        chunks = list(
            client.chat.completions.create(
                model="any",
                messages=messages,
                tools=[CLOCK, WEATHER],
                tool_choice=forced,
                max_tokens=60,
                temperature=0,
                stream=True,
            )
        )
        deltas = [d for c in chunks if c.choices for d in c.choices[0].delta.tool_calls or ()]
        assert [(d.function.name, d.function.arguments) for d in deltas] == [
            (call.function.name, call.function.arguments)
        ]
        assert chunks[-1].choices[0].finish_reason == "tool_calls"
        # The call and its result, sent back: the conversation goes on.
        replayed = [
            *messages,
            {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
            {"role": "tool", "tool_call_id": call.id, "content": '{"celsius": 21}'},
        ]
        after = client.chat.completions.create(
            model="any", messages=replayed, tools=[WEATHER], max_tokens=60, temperature=0
        ).choices[0]
        assert after.message.content or after.message.tool_calls
        assert "<tool_call>" not in (after.message.content or "")  # read as a call


def test_tools_whose_parameters_hold_defs_are_called_as_their_models_say(local_api):
    """Parameters as pydantic writes them for nested models (refs into `$defs`), two
    tools with a `$defs` entry of one name: each forced call, and a call to either,
    validates against its own tool's model."""
    from tests.fixtures.tool_models import FIND_CITY, MODELS, PLAN_TRIP

    client = local_api.client()
    messages = [{"role": "user", "content": "Plan three nights in Rome."}]
    forced = [{"type": "function", "function": {"name": name}} for name in MODELS]
    for choice in (*forced, "required"):
        result = client.chat.completions.create(
            model="any",
            messages=messages,
            tools=[PLAN_TRIP, FIND_CITY],
            tool_choice=choice,
            max_tokens=80,
            temperature=0,
        ).choices[0]
        assert result.finish_reason == "tool_calls", result
        calls = result.message.tool_calls  # one or more: parallel_tool_calls by default
        assert len({call.id for call in calls}) == len(calls) >= 1
        for call in calls:
            if choice != "required":
                assert call.function.name == choice["function"]["name"]
            MODELS[call.function.name].model_validate_json(call.function.arguments)


def test_auto_tool_choice_answers_in_words_or_with_a_valid_call(local_api):
    result = (
        local_api.client()
        .chat.completions.create(
            model="any",
            messages=[{"role": "user", "content": "Say hello."}],
            tools=[WEATHER],
            max_tokens=20,
            temperature=0,
        )
        .choices[0]
    )
    if result.message.tool_calls:
        arguments = json.loads(result.message.tool_calls[0].function.arguments)
        assert set(arguments) == {"city", "unit"}
    else:
        assert result.message.content and not result.message.content.startswith("<")


def test_a_translated_pair_serves_the_verifiers_own_text(live_verifier, gemma, tmp_path):
    """Gemma (another tokenizer) drafting for the verifier through text, as the CLI does:
    the verifier's chat template and tokenizer make the prompt, the verifier's ids the
    text; greedy, its own text token for token; sampling verified by match."""
    api = LocalAPI(
        live_verifier.url, "--model", gemma, "--draft-n", "4", env={"XDG_CACHE_HOME": str(tmp_path)}
    )
    try:
        client = api.client()
        chat = client.chat.completions.create(
            model="any",
            messages=[{"role": "user", "content": "What is the capital of France?"}],
            max_tokens=24,
            temperature=0,
        )
        assert chat.choices[0].message.content == verifier_text(live_verifier, CHAT_PROMPT, 24)
        assert chat.model_extra["speculative"]["vocab"] == "translated"
        assert chat.model_extra["speculative"]["drafted"] > 0
        prompt = "The three laws of motion are"
        text = client.completions.create(model="any", prompt=prompt, max_tokens=16, temperature=0)
        assert text.choices[0].text == verifier_text(live_verifier, prompt, 16)
        sampled = client.completions.create(
            model="any", prompt=prompt, max_tokens=8, temperature=0.8, seed=2
        )
        assert sampled.model_extra["speculative"]["strategy"] == "match"
    finally:
        api.stop()


def test_every_choice_of_a_streamed_tool_call_comes(local_api):
    chunks = list(
        local_api.client().chat.completions.create(
            model="any",
            messages=[{"role": "user", "content": "What's the weather like in Rome?"}],
            tools=[WEATHER],
            tool_choice="required",
            max_tokens=60,
            temperature=0.7,
            seed=1,
            n=2,
            stream=True,
        )
    )
    calls = {
        c.choices[0].index: d.function.name
        for c in chunks
        if c.choices
        for d in c.choices[0].delta.tool_calls or ()
    }
    assert calls == {0: "get_weather", 1: "get_weather"}
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices]
    assert finishes.count("tool_calls") == 2


def test_logprobs_under_a_grammar_list_only_the_tokens_it_allows(local_api):
    """At the end of a JSON answer the grammar allows the end alone: the top list has
    what it allows, every logprob finite."""
    result = (
        local_api.client()
        .chat.completions.create(
            model="any",
            messages=[{"role": "user", "content": "A person, as JSON."}],
            max_tokens=60,
            temperature=0,
            logprobs=True,
            top_logprobs=5,
            response_format={
                "type": "json_schema",
                "json_schema": {"name": "person", "schema": PERSON},
            },
        )
        .choices[0]
    )
    content = result.logprobs.content
    assert content and all(c.top_logprobs for c in content)
    assert all(t.logprob > float("-inf") for c in content for t in c.top_logprobs)
    if result.finish_reason == "stop":
        assert len(content[-1].top_logprobs) < 5  # the end: only the end-of-turn tokens


@pytest.mark.parametrize("drafter", ["suffix", "model+suffix", "model+history"])
def test_serve_drafts_a_repeated_request_from_its_own_history(unsized_verifier, drafter):
    """`--drafter suffix`: a request's text joins serve's history when it ends, so the
    same question again is drafted from the first answer; both are the verifier's own.
    With the model behind the lookup (`model+suffix`), the lookup's drafts go first;
    `model+history` drafts from the history alone,
    on a match as long as the verifier's copies wait for (the prompt holds one). A stop
    sequence (never met) paces the chunks as a watched generation's. A fixed draft
    length, and lookups verified whole: what `auto` and a verifier that sizes lookups
    choose follows measured times, which a loaded machine moves."""
    prompt = "List the eight planets of the solar system in order from the Sun, one per line:\n"
    api = LocalAPI(unsized_verifier.url, "--drafter", drafter, "--draft-n", "8")
    try:
        client = api.client()
        answers = [
            client.completions.create(
                model="any", prompt=prompt, max_tokens=32, temperature=0, stop=["<never>"]
            )
            for _ in range(2)
        ]
    finally:
        api.stop()
    alone = verifier_text(unsized_verifier, prompt, 32)
    assert [a.choices[0].text for a in answers] == [alone, alone]
    first, second = (a.model_extra["speculative"] for a in answers)
    assert second["accepted"] > first["accepted"]
    assert second["accepted"] >= answers[1].usage.completion_tokens // 2  # most of it drafted


def test_the_draft_model_is_loaded_at_start_before_any_request(live_verifier):
    # `loaded=True` waits until /health says the draft model is loaded, with no request sent.
    api = LocalServe(live_verifier.url, threads=TEST_THREADS, loaded=True, timeout=180)
    try:
        health = httpx.get(f"{api.url.removesuffix('/v1')}/health", timeout=30).json()
        assert health["draft_model_loaded"] is True
        assert health["running"] == 0
        prompt = "The three laws of motion are"
        result = openai.OpenAI(base_url=api.url, api_key="unused", max_retries=0).completions
        text = result.create(model="any", prompt=prompt, max_tokens=16, temperature=0)
        assert text.choices[0].text == verifier_text(live_verifier, prompt, 16)
    finally:
        api.stop()


def test_started_before_its_verifier_the_first_request_loads_the_draft_model(verifier_model):
    port = free_port()
    api = LocalServe(f"http://127.0.0.1:{port}", threads=TEST_THREADS, timeout=180)
    try:
        health = httpx.get(f"{api.url.removesuffix('/v1')}/health", timeout=30)
        assert health.status_code == 503 and health.json()["draft_model_loaded"] is False
        verifier = start_verifier(verifier_model, port=port)
        try:
            prompt = "The three laws of motion are"
            client = openai.OpenAI(base_url=api.url, api_key="unused", max_retries=0)
            text = client.completions.create(
                model="any", prompt=prompt, max_tokens=8, temperature=0
            )
            assert text.choices[0].text == verifier_text(verifier, prompt, 8)
            health = httpx.get(f"{api.url.removesuffix('/v1')}/health", timeout=30).json()
            assert health["draft_model_loaded"] is True
        finally:
            verifier.stop()
    finally:
        api.stop()
