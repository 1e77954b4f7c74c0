"""A request's prompts, made ready: what the verifier is sent (a text or token ids) and
its ids of it (for checking the length, and choosing a slot). Made with the vocabulary
the verifier's ids are in (`TextSide`): the draft model's own, or, for a pair with
another tokenizer (translated), the verifier's. Blocking (tokenizing a long prompt takes
a while): called off the event loop.

Completions take every form OpenAI's do: a text, texts, token ids (the verifier's
vocabulary), or lists of them; `suffix` becomes a fill-in-the-middle prompt where the
model has the tokens for one.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from drafter.serve.chat_api import ChatCompletionRequest, CompletionRequest
from drafter.serve.errors import PromptTooLong, invalid_request
from drafter.serve.tools import tools_message
from server.shared.protocol import PromptInput
from server.shared.runtime import LlamaVocab


@dataclass(frozen=True)
class TextSide:
    """The vocabulary the verifier's ids are in: its chat template, tokenizer and
    fill-in-the-middle tokens, and the bytes of an id (`token_bytes`: safe for any id the
    verifier may send)."""

    vocab: LlamaVocab
    token_bytes: Callable[[int], bytes]
    name: str
    # The most text the verifier's context can hold (0: no bound): a longer prompt is
    # refused before it is tokenized, which is where a huge one would cost.
    max_chars: int = 0

    def check_length(self, chars: int) -> None:
        if self.max_chars and chars > self.max_chars:
            raise PromptTooLong(
                f"the prompt is {chars} characters, more than the verifier's context can "
                f"hold ({self.max_chars} characters at most: no token is longer than "
                "its vocabulary's longest piece)"
            )


@dataclass(frozen=True)
class Prompted:
    """One prompt, ready to generate from."""

    verifier_input: PromptInput  # what /prefill gets: the text, or the ids
    prompt_ids: list[int]  # in the verifier's vocabulary
    echo: str = ""  # text the choice begins with (`echo`)


def chat_prompts(
    side: TextSide, request: ChatCompletionRequest, prefill: str = ""
) -> list[Prompted]:
    """The conversation through the model's chat template; tools the answer may call are
    described in the system message (drafter/serve/tools.py). A `prefill` is the answer's
    beginning, written after the template's opening of the assistant's turn."""
    messages = [("system" if m.role == "developer" else m.role, m.text) for m in request.messages]
    if request.calls_tools and request.tools:
        described = tools_message(request.tools)
        if messages[0][0] == "system":
            messages[0] = ("system", f"{messages[0][1]}\n\n{described}")
        else:
            messages.insert(0, ("system", described))
    prompt = side.vocab.apply_chat_template(messages) + prefill
    return [_text(side, prompt, add_bos=not side.vocab.starts_with_bos(prompt))]


def completion_prompts(side: TextSide, request: CompletionRequest, n_vocab: int) -> list[Prompted]:
    """One per prompt given; token ids are checked against the verifier's `n_vocab`."""
    out = []
    for prompt in request.prompts():
        if not isinstance(prompt, str):
            _check_ids(prompt, n_vocab)
        if request.suffix is not None:
            ready = _fill_in_the_middle(side, prompt, request.suffix)
        elif isinstance(prompt, str):
            ready = _text(side, prompt, add_bos=True)
        else:
            ready = Prompted(PromptInput(prompt_tokens=prompt), list(prompt))
        if request.echo:
            shown = prompt if isinstance(prompt, str) else _text_of(side, prompt)
            ready = Prompted(ready.verifier_input, ready.prompt_ids, echo=shown)
        out.append(ready)
    return out


def _text(side: TextSide, text: str, add_bos: bool) -> Prompted:
    side.check_length(len(text))
    ids = side.vocab.tokenize(text, add_special=add_bos)
    return Prompted(PromptInput(prompt=text, add_bos=add_bos), ids)


def _check_ids(ids: list[int], n_vocab: int) -> None:
    for token in ids:
        if token >= n_vocab:
            raise invalid_request(
                f"prompt: token id {token} is outside the model's vocabulary of {n_vocab}",
                param="prompt",
                code="invalid_token",
            )


def _fill_in_the_middle(side: TextSide, prefix: str | list[int], suffix: str) -> Prompted:
    """prefix, suffix, then the model writes the middle, as llama.cpp's server frames it:
    [BOS] FIM_PRE prefix FIM_SUF suffix FIM_MID."""
    fim = side.vocab.fim_ids
    if fim is None:
        raise invalid_request(
            f"suffix needs a model with fill-in-the-middle tokens; {side.name} has none",
            param="suffix",
            code="unsupported_parameter",
        )
    pre, suf, mid = fim
    side.check_length((len(prefix) if isinstance(prefix, str) else 0) + len(suffix))
    runtime = side.vocab
    before = prefix if isinstance(prefix, list) else runtime.tokenize(prefix, add_special=False)
    after = runtime.tokenize(suffix, add_special=False)
    bos = [runtime.bos_id] if runtime.add_bos else []
    ids = [*bos, pre, *before, suf, *after, mid]
    return Prompted(PromptInput(prompt_tokens=ids), ids)


def _text_of(side: TextSide, ids: list[int]) -> str:
    return b"".join(side.token_bytes(t) for t in ids).decode("utf-8", "replace")
