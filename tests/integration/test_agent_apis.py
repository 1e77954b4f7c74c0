"""OpenAI's Responses API and Anthropic's Messages API on `draft_token_generator serve`,
through their real clients (the `openai` SDK, the OpenAI Agents SDK, the `anthropic` SDK),
against a real verifier: greedy answers equal the verifier decoding alone, under the same
constraint where one is asked for."""

from __future__ import annotations

import asyncio
import json
import re

import anthropic
import httpx
import openai
import pytest
from pydantic import BaseModel, ConfigDict, Field

from drafter.serve.body_bounds import OTHER_FIELDS_BYTES
from scripts.harness.local import LocalServe
from scripts.harness.metrics import Metrics
from tests.conftest import TEST_N_CTX, TEST_THREADS
from tests.fixtures.agent_requests import captured, with_cch
from tests.integration.test_openai_api import WEATHER

pytestmark = pytest.mark.integration

QUESTION = "What is the capital of France?"
CHAT_PROMPT = f"<|im_start|>user\n{QUESTION}<|im_end|>\n<|im_start|>assistant\n"
WEATHER_PARAMETERS = WEATHER["function"]["parameters"]


class Person(BaseModel):
    model_config = ConfigDict(extra="forbid")  # its schema: no other properties

    name: str = Field(max_length=40)
    age: int = Field(ge=0, le=120)


@pytest.fixture(scope="module")
def local_api(live_verifier):
    api = LocalServe(live_verifier.url, threads=TEST_THREADS)
    yield api
    api.stop()


def openai_client(api) -> openai.OpenAI:
    return openai.OpenAI(base_url=api.url, api_key="unused", max_retries=0, timeout=120)


def anthropic_client(api, key: str = "unused") -> anthropic.Anthropic:
    base = api.url.removesuffix("/v1")
    return anthropic.Anthropic(base_url=base, api_key=key, max_retries=0, timeout=120)


def verifier_text(live_verifier, prompt: str, max_tokens: int, grammar: dict | None = None):
    body = {"prompt": prompt, "max_tokens": max_tokens}
    if grammar is not None:
        body["grammar"] = grammar
    response = httpx.post(f"{live_verifier.url}/generate", json=body, timeout=120)
    return response.json()["text"]


# --- OpenAI's Responses API ---


def test_a_response_equals_the_verifier_alone_whole_and_streamed(local_api, live_verifier):
    client = openai_client(local_api)
    expected = verifier_text(live_verifier, CHAT_PROMPT, 40)
    response = client.responses.create(
        model="any", input=QUESTION, max_output_tokens=40, temperature=0
    )
    assert response.id.startswith("resp_") and response.output[0].id.startswith("msg_")
    assert response.output_text == expected
    assert response.status in ("completed", "incomplete")
    assert response.usage.output_tokens <= 40 and response.usage.input_tokens > 5
    assert response.model_extra["speculative"]["rounds"] >= 1
    events = list(
        client.responses.create(
            model="any", input=QUESTION, max_output_tokens=40, temperature=0, stream=True
        )
    )
    kinds = [e.type for e in events]
    assert kinds[:4] == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
    ]
    assert kinds[-4:-1] == [
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
    ]
    assert kinds[-1] in ("response.completed", "response.incomplete")
    assert set(kinds[4:-4]) == {"response.output_text.delta"}
    assert [e.sequence_number for e in events] == list(range(len(events)))
    deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert deltas == expected == events[-1].response.output_text
    # The same conversation as items, with instructions: the system message.
    items = client.responses.create(
        model="any",
        instructions="Answer in one word.",
        input=[{"role": "user", "content": [{"type": "input_text", "text": QUESTION}]}],
        max_output_tokens=12,
        temperature=0,
    )
    system = "<|im_start|>system\nAnswer in one word.<|im_end|>\n"
    assert items.output_text == verifier_text(live_verifier, system + CHAT_PROMPT, 12)


def test_responses_parse_gives_the_pydantic_model_the_verifier_wrote(local_api, live_verifier):
    from openai.lib._pydantic import to_strict_json_schema

    parsed = openai_client(local_api).responses.parse(
        model="any", input=QUESTION, text_format=Person, max_output_tokens=60, temperature=0
    )
    assert isinstance(parsed.output_parsed, Person)
    grammar = {"kind": "json_schema", "source": to_strict_json_schema(Person)}
    assert parsed.output_text == verifier_text(live_verifier, CHAT_PROMPT, 60, grammar)


class OpenPerson(BaseModel):  # extra left as pydantic's default: its schema names no more
    name: str = Field(max_length=40)
    age: int = Field(ge=0, le=120)


def test_a_schema_that_leaves_objects_open_gets_its_keys_and_no_others(local_api, live_verifier):
    # Closed and whitespace-bounded on both sides alike (server/shared/json_schemas.py):
    # the verifier alone, given the schema as it is, writes the same text.
    schema = OpenPerson.model_json_schema()
    response = openai_client(local_api).responses.create(
        model="any", input=QUESTION, max_output_tokens=60, temperature=0,
        text={"format": {"type": "json_schema", "name": "person", "schema": schema}},
    )  # fmt: skip
    assert set(json.loads(response.output_text)) <= {"name", "age"}
    grammar = {"kind": "json_schema", "source": schema}
    assert response.output_text == verifier_text(live_verifier, CHAT_PROMPT, 60, grammar)


def test_a_forced_function_call_validates_streams_and_its_output_goes_back(local_api):
    client = openai_client(local_api)
    tools = [{"type": "function", "name": "get_weather", "parameters": WEATHER_PARAMETERS}]
    question = "What's the weather like in Paris?"
    forced = {"type": "function", "name": "get_weather"}
    response = client.responses.create(
        model="any", input=question, tools=tools, tool_choice=forced, max_output_tokens=60,
        temperature=0,
    )  # fmt: skip
    (call,) = response.output
    assert call.type == "function_call" and call.name == "get_weather"
    arguments = json.loads(call.arguments)
    assert set(arguments) == {"city", "unit"} and arguments["unit"] in ("celsius", "fahrenheit")
    assert call.call_id.startswith("call_") and call.id.startswith("fc_")
    events = list(
        client.responses.create(
            model="any",
            input=question,
            tools=tools,
            tool_choice=forced,
            max_output_tokens=60,
            temperature=0,
            stream=True,
        )
    )
    kinds = [e.type for e in events]
    assert kinds[2:6] == [
        "response.output_item.added",
        "response.function_call_arguments.delta",
        "response.function_call_arguments.done",
        "response.output_item.done",
    ]
    assert events[4].arguments == call.arguments and events[-1].type == "response.completed"
    replayed = [
        {"role": "user", "content": question},
        call.model_dump(exclude_none=True),
        {"type": "function_call_output", "call_id": call.call_id, "output": '{"celsius": 21}'},
    ]
    after = client.responses.create(
        model="any", input=replayed, tools=tools, max_output_tokens=60, temperature=0
    )
    assert after.usage.input_tokens > 40  # the call and its output are in the prompt
    assert after.output_text or after.output[0].type == "function_call"
    assert "<tool_call>" not in after.output_text  # a call's markup is read as a call
    tokens = client.responses.input_tokens.count(model="any", input=replayed, tools=tools)
    assert tokens.input_tokens == after.usage.input_tokens


def test_the_agents_sdk_runs_a_function_tool_through_its_default_responses_model(local_api):
    import agents

    agents.set_tracing_disabled(True)
    client = openai.AsyncOpenAI(base_url=local_api.url, api_key="unused", max_retries=0)
    asked: list[tuple[str, str]] = []

    @agents.function_tool
    def get_weather(city: str, unit: str) -> str:
        """The weather in a city now.

        Args:
            city: The city.
            unit: celsius or fahrenheit.
        """
        asked.append((city, unit))
        return f"21 degrees {unit} in {city}"

    agent = agents.Agent(
        name="weather",
        instructions="You answer questions about the weather with your tool.",
        tools=[get_weather],
        model=agents.OpenAIResponsesModel(model="any", openai_client=client),
        # One call: the default pair repeats a call where several are allowed.
        model_settings=agents.ModelSettings(
            tool_choice="required", temperature=0.0, parallel_tool_calls=False
        ),
        tool_use_behavior="stop_on_first_tool",
    )
    result = asyncio.run(agents.Runner.run(agent, "What's the weather in Paris?", max_turns=2))
    ((city, unit),) = asked
    assert result.final_output == f"21 degrees {unit} in {city}"
    assert isinstance(agents.OpenAIResponsesModel, type)  # the SDK's Responses model ran


# --- Anthropic's Messages API ---

GREEDY = {"temperature": 0}  # the SDK has no temperature argument; the API has the field


def test_a_message_equals_the_verifier_alone_whole_and_streamed(local_api, live_verifier):
    client = anthropic_client(local_api)
    expected = verifier_text(live_verifier, CHAT_PROMPT, 40)
    messages = [{"role": "user", "content": QUESTION}]
    message = client.messages.create(
        model="any", max_tokens=40, messages=messages, extra_body=GREEDY
    )
    assert message.type == "message" and message.role == "assistant"
    assert message.content[0].type == "text" and message.content[0].text == expected
    assert message.stop_reason in ("end_turn", "max_tokens")
    assert message.usage.output_tokens <= 40
    prompt_tokens = message.usage.input_tokens + message.usage.cache_read_input_tokens
    counted = client.messages.count_tokens(model="any", messages=messages)
    assert counted.input_tokens == prompt_tokens
    with client.messages.stream(
        model="any", max_tokens=40, messages=messages, extra_body=GREEDY
    ) as stream:
        kinds = [event.type for event in stream]
        final = stream.get_final_message()
    assert final.content[0].text == expected and final.stop_reason == message.stop_reason
    assert kinds[:2] == ["message_start", "content_block_start"]
    assert kinds[-3:] == ["content_block_stop", "message_delta", "message_stop"]


def test_structured_output_through_output_config_and_messages_parse(local_api, live_verifier):
    client = anthropic_client(local_api)
    messages = [{"role": "user", "content": QUESTION}]
    schema = Person.model_json_schema()
    message = client.messages.create(
        model="any", max_tokens=60, messages=messages, extra_body=GREEDY,
        output_config={"format": {"type": "json_schema", "schema": schema}},
    )  # fmt: skip
    grammar = {"kind": "json_schema", "source": schema}
    assert message.content[0].text == verifier_text(live_verifier, CHAT_PROMPT, 60, grammar)
    Person.model_validate_json(message.content[0].text)
    parsed = client.messages.parse(
        model="any", max_tokens=60, messages=messages, output_format=Person, extra_body=GREEDY
    )
    assert isinstance(parsed.parsed_output, Person)


def test_a_last_assistant_message_is_continued_as_the_verifier_continues_it(
    local_api, live_verifier
):
    prefill = "The capital of France is"
    message = anthropic_client(local_api).messages.create(
        model="any", max_tokens=12, extra_body=GREEDY,
        messages=[{"role": "user", "content": QUESTION}, {"role": "assistant", "content": prefill}],
    )  # fmt: skip
    assert message.content[0].text == verifier_text(live_verifier, CHAT_PROMPT + prefill, 12)


def test_stop_sequences_end_a_message_and_say_which(local_api, live_verifier):
    full = verifier_text(live_verifier, CHAT_PROMPT, 40)
    stop = full.split()[1]
    message = anthropic_client(local_api).messages.create(
        model="any", max_tokens=40, messages=[{"role": "user", "content": QUESTION}],
        extra_body=GREEDY, stop_sequences=[stop, "never seen"],
    )  # fmt: skip
    assert message.stop_reason == "stop_sequence" and message.stop_sequence == stop
    assert message.content[0].text == full[: full.index(stop)]


def test_a_tool_use_then_its_result_go_on_whole_and_streamed(local_api):
    client = anthropic_client(local_api)
    tools = [
        {
            "name": "get_weather",
            "description": "The weather in a city now.",
            "input_schema": WEATHER_PARAMETERS,
        }
    ]
    question = [{"role": "user", "content": "What's the weather like in Paris?"}]
    forced = {"type": "tool", "name": "get_weather"}
    message = client.messages.create(
        model="any", max_tokens=60, messages=question, tools=tools, tool_choice=forced,
        extra_body=GREEDY,
    )  # fmt: skip
    assert message.stop_reason == "tool_use"
    (use,) = message.content
    assert use.type == "tool_use" and use.name == "get_weather" and use.id.startswith("toolu_")
    assert set(use.input) == {"city", "unit"} and use.input["unit"] in ("celsius", "fahrenheit")
    with client.messages.stream(
        model="any", max_tokens=60, messages=question, tools=tools, tool_choice=forced,
        extra_body=GREEDY,
    ) as stream:  # fmt: skip
        streamed = stream.get_final_message()
    assert streamed.content[0].input == use.input and streamed.stop_reason == "tool_use"
    result = {"type": "tool_result", "tool_use_id": use.id, "content": '{"celsius": 21}'}
    after = client.messages.create(
        model="any",
        max_tokens=20,
        messages=[
            *question,
            {"role": "assistant", "content": [use.model_dump()]},
            {"role": "user", "content": [result]},
        ],
        tools=tools,
        extra_body=GREEDY,
    )
    assert after.stop_reason in ("end_turn", "max_tokens", "tool_use")
    assert after.usage.input_tokens + after.usage.cache_read_input_tokens > 40


def test_the_anthropic_client_is_served_with_serves_own_key_as_x_api_key(live_verifier):
    api = LocalServe(live_verifier.url, "--serve-api-key", "sk-mine", threads=TEST_THREADS)
    try:
        with pytest.raises(anthropic.AuthenticationError) as refused:
            anthropic_client(api, "sk-other").messages.create(
                model="any", max_tokens=4, messages=[{"role": "user", "content": "Hi"}]
            )
        assert refused.value.body["type"] == "error"
        assert refused.value.body["error"]["type"] == "authentication_error"
        message = anthropic_client(api, "sk-mine").messages.create(
            model="any",
            max_tokens=4,
            messages=[{"role": "user", "content": "Hi"}],
            extra_body=GREEDY,
        )
        assert message.usage.output_tokens == 4
    finally:
        api.stop()


# --- Bad input through each API: a 400 in its own shape, nothing left on the verifier ---

HUGE_SCHEMA = {"type": "object", "properties": {f"p{i}": {"type": "string"} for i in range(40000)}}


def test_bad_input_is_a_400_in_each_apis_shape_and_leaves_nothing_behind(local_api, live_verifier):
    def prefills() -> float:
        return Metrics.scrape(live_verifier.url).value(
            "verifier_requests_total", endpoint="/prefill"
        )

    before = prefills()
    responses = openai_client(local_api)
    for bad in (
        {"input": 42},
        {"input": QUESTION, "max_output_token": 8},
        {"input": QUESTION, "previous_response_id": "resp_1"},
        {"input": [{"type": "function_call_output", "call_id": "call_9", "output": "x"}]},
        {"input": QUESTION, "text": {"format": {"type": "json_schema", "name": "x",
                                                "schema": HUGE_SCHEMA}}},
    ):  # fmt: skip
        with pytest.raises(openai.BadRequestError) as refused:
            responses.post("/responses", body={"model": "any", **bad}, cast_to=httpx.Response)
        assert refused.value.status_code == 400 and refused.value.body["message"]
    messages = anthropic_client(local_api)
    question = [{"role": "user", "content": QUESTION}]
    for bad in (
        {"messages": question},  # no max_tokens
        {"max_tokens": 8, "messages": "hi"},
        {"max_tokens": 8, "messages": question, "stop_sequence": ["x"]},
        {"max_tokens": 8, "messages": [{"role": "user", "content": [
            {"type": "tool_result", "tool_use_id": "toolu_9", "content": "x"}]}]},
        {"max_tokens": 8, "messages": question, "tools": [
            {"name": "big", "input_schema": HUGE_SCHEMA}]},
    ):  # fmt: skip
        with pytest.raises(anthropic.BadRequestError) as refused:
            messages.post("/v1/messages", body={"model": "any", **bad}, cast_to=httpx.Response)
        assert refused.value.body["type"] == "error"
        assert refused.value.body["error"]["type"] == "invalid_request_error"
    assert Metrics.scrape(live_verifier.url).value("verifier_active_sessions") == 0
    assert prefills() == before


# --- The coding agents' requests, as captured (tests/fixtures/agent_requests/) ---


def sse_data(response: httpx.Response) -> list[dict]:
    assert response.status_code == 200, response.text
    lines = response.text.splitlines()
    return [json.loads(line[6:]) for line in lines if line.startswith("data: {")]


def test_claude_codes_second_turn_reuses_its_prompt_though_its_billing_line_changed(
    local_api, live_verifier
):
    from drafter.serve.messages_api import MessagesRequest
    from drafter.serve.tools import request_grammar, tools_message

    agent = captured("claude_code")
    url = local_api.url.removesuffix("/v1") + agent["path"]  # ?beta=true
    headers = {**agent["headers"], "x-api-key": "unused"}
    greedy = {"max_tokens": 12, "temperature": 0}  # Claude Code sends neither
    # The first turn as Claude Code sends it, streamed.
    first = {**with_cch(agent["first"], "1a2b3"), **greedy}
    events = sse_data(httpx.post(url, json=first, headers=headers, timeout=120))
    assert events[0]["type"] == "message_start" and events[-1]["type"] == "message_stop"
    usage = events[-2]["usage"]  # message_delta's: the whole usage
    first_prompt = usage["input_tokens"] + usage["cache_read_input_tokens"]
    # The same conversation a turn on, its billing line's `cch=` changed: the verifier
    # keeps the first turn's prompt, all but a tile at worst (docs/numerics.md).
    second = {**with_cch(agent["second"], "9f8e7"), **greedy, "stream": False}
    response = httpx.post(url, json=second, headers=headers, timeout=120)
    assert response.status_code == 200, response.text
    message = response.json()
    tile = httpx.get(f"{live_verifier.url}/info").json()["prompt_tile_rows"]
    assert message["usage"]["cache_read_input_tokens"] >= max(1, first_prompt - 2 * tile)
    # The verifier alone, on the prompt the conversation means (no billing line; the
    # tools described in the system message) and under the same grammar.
    chat = MessagesRequest.model_validate(second).to_chat()
    turns = [[m.role, m.text] for m in chat.messages]
    assert "x-anthropic-billing-header" not in turns[0][1]
    turns[0][1] += "\n\n" + tools_message(chat.tools or [])
    prompt = "".join(f"<|im_start|>{role}\n{text}<|im_end|>\n" for role, text in turns)
    grammar = request_grammar(chat)
    expected = verifier_text(
        live_verifier,
        prompt + "<|im_start|>assistant\n",
        12,
        grammar.model_dump(exclude_none=True) if grammar else None,
    )
    (block,) = message["content"]
    if block["type"] == "text":
        assert block["text"] == expected
    else:  # a call (the tools' markup, the verifier's text) came back as its block
        assert block["type"] == "tool_use" and block["name"] in expected


def test_codexs_request_with_a_hosted_tool_beside_a_function_is_answered(local_api):
    agent = captured("codex")
    url = local_api.url + agent["path"].removeprefix("/v1")
    headers = {**agent["headers"], "authorization": "Bearer unused"}
    body = {**agent["first"], "max_output_tokens": 8}  # as sent: streamed, sampled
    events = sse_data(httpx.post(url, json=body, headers=headers, timeout=120))
    assert events[0]["type"] == "response.created"
    done = events[-1]
    assert done["type"] in ("response.completed", "response.incomplete"), done
    # web_search and the namespace are left out; the function is offered.
    assert [t["name"] for t in done["response"]["tools"]] == ["exec_command"]
    assert 1 <= done["response"]["usage"]["output_tokens"] <= 8
    # A probe of one token, as clients send to check a provider answers.
    probe = {**agent["second"], "stream": False, "max_output_tokens": 1}
    response = httpx.post(url, json=probe, headers=headers, timeout=120)
    assert response.status_code == 200, response.text
    assert response.json()["usage"]["output_tokens"] == 1


def test_work_is_bounded_before_it_is_done(local_api):
    """A body larger than a request could use with the verifier's context is refused
    before it is read (413); a prompt longer than the context can hold, in a body within
    that, is refused before it is tokenized, through the count endpoints too; tools whose
    schemas no grammar of calls holds are refused before the grammar is written. Each in
    its API's shape."""
    base = local_api.url.removesuffix("/v1")
    question = [{"role": "user", "content": "hi"}]
    loaded = httpx.post(  # the draft model loaded: the verifier's context known
        f"{base}/v1/messages/count_tokens", json={"model": "any", "messages": question}, timeout=120
    )
    assert loaded.status_code == 200, loaded.text
    part = "word " * 200_000  # 4 messages of 1 MB, each as long as a message may be
    turns = [{"role": role, "content": part} for role in ("user", "assistant") * 2]
    counted = httpx.post(
        f"{base}/v1/messages/count_tokens", json={"model": "any", "messages": turns}, timeout=60
    )
    assert counted.status_code == 413, counted.text
    assert counted.json()["error"]["type"] == "request_too_large"
    message = counted.json()["error"]["message"]
    assert f"the verifier's context of {TEST_N_CTX} tokens" in message
    cap = int(re.search(r"over (\d+) bytes", message).group(1))  # type: ignore[union-attr]
    counted = httpx.post(
        f"{local_api.url}/responses/input_tokens", json={"model": "any", "input": turns}, timeout=60
    )
    assert counted.status_code == 413 and counted.json()["error"]["code"] == "payload_too_large"
    # Half of what the cap leaves for text: more than the context holds (a third of it).
    turns = [{"role": "user", "content": "word " * ((cap - OTHER_FIELDS_BYTES) // 10)}]
    counted = httpx.post(
        f"{base}/v1/messages/count_tokens", json={"model": "any", "messages": turns}, timeout=60
    )
    assert counted.status_code == 400
    assert counted.json()["error"]["type"] == "invalid_request_error"
    assert "more than the verifier's context can hold" in counted.json()["error"]["message"]
    counted = httpx.post(
        f"{local_api.url}/responses/input_tokens",
        json={"model": "any", "input": turns},
        timeout=60,
    )
    assert (
        counted.status_code == 400 and counted.json()["error"]["code"] == "context_length_exceeded"
    )
    wide = {"type": "object", "properties": {f"p{i}": {"type": "string"} for i in range(4000)}}
    tools = [{"type": "function", "name": "wide", "parameters": wide}]
    refused = httpx.post(
        f"{local_api.url}/responses",
        json={"model": "any", "input": "hi", "tools": tools, "tool_choice": "required"},
        timeout=60,
    )
    assert refused.status_code == 400
    assert refused.json()["error"]["param"] == "tools"
    assert "a grammar of calls holds at most" in refused.json()["error"]["message"]
