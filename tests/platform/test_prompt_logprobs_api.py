"""vLLM's prompt_logprobs, echo with logprobs and the -1 ("whole vocabulary") values, through the official
`openai` client against the real app (engine core process included): values equal a float64 transformers
reference, shaped as vLLM shapes them, and what vLLM refuses is a 400 with vLLM's message."""

from __future__ import annotations

import openai
import pytest
import torch
from app_fixtures import make_text_model
from test_inference_completions import run, sse_events
from transformers import AutoModelForCausalLM

PROMPT = [5, 17, 42, 99, 7, 120, 3, 8]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_text_model(tmp_path_factory.mktemp("prompt-logprobs") / "model")


@pytest.fixture(scope="module")
def reference(model_dir):
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float64).eval()

    @torch.inference_mode()
    def logprobs(prompt: list[int]) -> torch.Tensor:
        """[len(prompt) - 1, vocab]: row i is the distribution of prompt token i + 1."""
        return torch.log_softmax(model(input_ids=torch.tensor([prompt])).logits[0, :-1], dim=-1)

    return logprobs


def sdk(client) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(
        base_url="http://testserver/v1", api_key="none", http_client=client, max_retries=0
    )


def check_vllm_shape(body: list, prompt: list[int], expected: torch.Tensor, k: int, tokenizer) -> None:
    """vLLM's prompt_logprobs: None, then per token {id: {logprob, rank, decoded_token}} holding the prompt
    token (its true rank) and the position's top-k (ranks 1..k)."""
    assert body[0] is None and len(body) == len(prompt)
    for i, entry in enumerate(body[1:]):
        row, token = expected[i], prompt[i + 1]
        top = row.topk(k)
        assert set(entry) == {str(token)} | {str(t) for t in top.indices.tolist()}
        mine = entry[str(token)]
        assert mine["logprob"] == pytest.approx(row[token].item(), abs=1e-4)
        assert mine["rank"] == int((row >= row[token]).sum())
        assert mine["decoded_token"] == tokenizer.decode([token])
        for rank, (token_id, value) in enumerate(zip(top.indices.tolist(), top.values.tolist()), start=1):
            assert entry[str(token_id)]["rank"] == rank
            assert entry[str(token_id)]["logprob"] == pytest.approx(value, abs=1e-4)


@pytest.mark.slow
def test_prompt_logprobs_on_completions_and_chat(tmp_path, model_dir, reference):
    async def scenario(client, services):
        api = sdk(client)
        completion = await api.completions.create(
            model="tiny", prompt=PROMPT, max_tokens=3, n=2, extra_body={"prompt_logprobs": 2}
        )
        chat = await api.chat.completions.create(
            model="tiny",
            messages=[{"role": "user", "content": "Hello there"}],
            max_tokens=2,
            extra_body={"prompt_logprobs": 1, "return_token_ids": True},
        )
        zero = await api.completions.create(
            model="tiny", prompt=PROMPT, max_tokens=1, extra_body={"prompt_logprobs": 0}
        )
        plain = await api.completions.create(model="tiny", prompt=PROMPT, max_tokens=1)
        return completion, chat, zero, plain, services.tokenizer

    completion, chat, zero, plain, tokenizer = run(tmp_path, model_dir, scenario)
    expected = reference(PROMPT)
    assert len(completion.choices) == 2
    for choice in completion.choices:  # vLLM: per choice, each choice of a prompt the same
        check_vllm_shape(choice.model_extra["prompt_logprobs"], PROMPT, expected, 2, tokenizer)
    chat_prompt = chat.model_extra["prompt_token_ids"]
    check_vllm_shape(chat.model_extra["prompt_logprobs"], chat_prompt, reference(chat_prompt), 1, tokenizer)
    assert "prompt_logprobs" not in chat.choices[0].model_extra  # vLLM: on the chat response, not a choice
    check_vllm_shape(zero.choices[0].model_extra["prompt_logprobs"], PROMPT, expected, 0, tokenizer)
    assert (
        plain.choices[0].prompt_logprobs is None
    )  # vLLM sends null when not asked for (as vLLM's tests read)


@pytest.mark.slow
def test_echo_with_logprobs_lists_the_prompt_first(tmp_path, model_dir, reference):
    async def scenario(client, services):
        api = sdk(client)
        echoed = await api.completions.create(
            model="tiny", prompt=PROMPT, max_tokens=3, temperature=0, echo=True, logprobs=1
        )
        plain = await api.completions.create(
            model="tiny", prompt=PROMPT, max_tokens=3, temperature=0, logprobs=1
        )
        streamed = await client.post(
            "/v1/completions",
            json={
                "model": "tiny",
                "prompt": PROMPT,
                "max_tokens": 3,
                "temperature": 0,
                "echo": True,
                "logprobs": 1,
                "stream": True,
            },
        )
        chat = await api.chat.completions.create(
            model="tiny",
            messages=[{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Well"}],
            max_tokens=2,
            logprobs=True,
            extra_body={"echo": True, "continue_final_message": True, "add_generation_prompt": False},
        )
        return echoed, plain, streamed, chat, services.tokenizer

    echoed, plain, streamed, chat, tokenizer = run(tmp_path, model_dir, scenario)
    expected = reference(PROMPT)
    logprobs = echoed.choices[0].logprobs
    prompt_tokens = [tokenizer.decode([t]) for t in PROMPT]
    assert logprobs.tokens[: len(PROMPT)] == prompt_tokens
    assert logprobs.tokens[len(PROMPT) :] == plain.choices[0].logprobs.tokens
    assert logprobs.token_logprobs[0] is None and logprobs.top_logprobs[0] is None
    for i, token in enumerate(PROMPT[1:]):
        assert logprobs.token_logprobs[i + 1] == pytest.approx(expected[i, token].item(), abs=1e-4)
        assert prompt_tokens[i + 1] in logprobs.top_logprobs[i + 1]
    assert logprobs.token_logprobs[len(PROMPT) :] == plain.choices[0].logprobs.token_logprobs
    assert echoed.choices[0].text == tokenizer.decode(PROMPT) + plain.choices[0].text
    assert len(echoed.choices[0].model_extra["prompt_logprobs"]) == len(
        PROMPT
    )  # as vLLM: prompt_logprobs too

    chunks = [e for e in sse_events(streamed.text) if e != "[DONE]"]
    first = chunks[0]["choices"][0]["logprobs"]
    assert first["tokens"][: len(PROMPT)] == prompt_tokens and first["token_logprobs"][0] is None
    streamed_values = [v for c in chunks for v in c["choices"][0]["logprobs"]["token_logprobs"]]
    assert streamed_values[1:] == pytest.approx(logprobs.token_logprobs[1:])

    assert chat.choices[0].message.content.startswith("Well")  # chat echo with logprobs now works
    assert len(chat.choices[0].logprobs.content) == chat.usage.completion_tokens


REFUSED = [
    (
        "completions",
        {"extra_body": {"prompt_logprobs": 1}, "stream": True},
        "not available when `stream=True`",
    ),
    ("chat", {"extra_body": {"prompt_logprobs": -1}, "stream": True}, "not available when `stream=True`"),
    ("completions", {"extra_body": {"prompt_logprobs": -2}}, "must be a positive value or -1"),
    ("completions", {"extra_body": {"prompt_logprobs": -1}}, "greater than max allowed: 20"),
    ("completions", {"extra_body": {"prompt_logprobs": 21}}, "prompt logprobs of 21, which is greater"),
    ("completions", {"logprobs": -1}, "`logprobs` must be a positive value"),
    ("completions", {"logprobs": 21}, "sample logprobs of 21, which is greater than max allowed: 20"),
    (
        "chat",
        {"logprobs": True, "top_logprobs": -1},
        "sample logprobs of 300, which is greater than max allowed: 20",
    ),
    ("chat", {"logprobs": True, "top_logprobs": -2}, "must be a positive value or -1"),
    ("chat", {"top_logprobs": 2}, "`logprobs` must be set to true"),
    ("chat", {"logprobs": True, "top_logprobs": 21}, "greater than max allowed: 20"),
]


@pytest.mark.slow
def test_what_vllm_refuses_is_a_400_and_what_asks_nothing_passes(tmp_path, model_dir):
    """vLLM's rules (its default --max-logprobs 20: -1, the whole vocabulary, is over it); values that ask
    for nothing pass: top_logprobs 0 without logprobs, prompt_logprobs 0 with stream."""

    async def scenario(client, services):
        api = sdk(client)
        messages = [{"role": "user", "content": "x"}]
        errors = []
        for path, fields, _ in REFUSED:
            with pytest.raises(openai.BadRequestError) as error:
                if path == "completions":
                    await api.completions.create(model="tiny", prompt="x", max_tokens=2, **fields)
                else:
                    await api.chat.completions.create(model="tiny", messages=messages, max_tokens=2, **fields)
            errors.append(error.value)
        chat = await api.chat.completions.create(
            model="tiny", messages=messages, max_tokens=2, top_logprobs=0
        )
        stream = await api.completions.create(
            model="tiny", prompt="x", max_tokens=2, stream=True, extra_body={"prompt_logprobs": 0}
        )
        chunks = [chunk async for chunk in stream]
        return errors, chat, chunks

    errors, chat, chunks = run(tmp_path, model_dir, scenario)
    for (path, fields, message), error in zip(REFUSED, errors):
        assert error.status_code == 400 and message in error.message, (path, fields, error.message)
    assert chat.choices[0].logprobs is None
    assert chunks and chunks[-1].choices[0].finish_reason is not None


@pytest.mark.slow
def test_minus_one_is_the_whole_vocabulary_under_max_logprobs_minus_one(tmp_path, model_dir, reference):
    """`--max-logprobs -1` (vLLM's): -1 asks for every token's logprob, in chat's top_logprobs and in
    prompt_logprobs; completions' `logprobs: -1` stays refused, as vLLM refuses it."""

    async def scenario(client, services):
        api = sdk(client)
        chat = await api.chat.completions.create(
            model="tiny",
            messages=[{"role": "user", "content": "Hi"}],
            max_tokens=1,
            logprobs=True,
            top_logprobs=-1,
            extra_body={"prompt_logprobs": -1, "return_token_ids": True},
        )
        with pytest.raises(openai.BadRequestError) as refused:
            await api.completions.create(model="tiny", prompt="x", max_tokens=1, logprobs=-1)
        return chat, refused.value, services.tokenizer

    chat, refused, tokenizer = run(tmp_path, model_dir, scenario, max_logprobs=-1)
    vocab = len(tokenizer)
    assert len(chat.choices[0].logprobs.content[0].top_logprobs) == vocab
    prompt = chat.model_extra["prompt_token_ids"]
    entries = chat.model_extra["prompt_logprobs"]
    assert all(len(entry) == vocab for entry in entries[1:])
    check_vllm_shape(entries, prompt, reference(prompt), vocab, tokenizer)
    assert "`logprobs` must be a positive value" in refused.message
