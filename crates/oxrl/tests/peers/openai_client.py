"""The official `openai` client against `oxrl serve`: chat, completion, streaming, n > 1,
log-probs, an image prompt, and bad requests answered 4xx while the server keeps serving.

Usage: openai_client.py TEXT_URL TEXT_MODEL VL_URL IMAGE_PNG
"""

import base64
import sys

import httpx
import openai

text_url, text_model, vl_url, image_png = sys.argv[1:5]
client = openai.OpenAI(base_url=f"{text_url}/v1", api_key="unused", max_retries=0)

# The model list names the served model.
assert [m.id for m in client.models.list().data] == [text_model]

messages = [{"role": "user", "content": "7+5"}]

# Chat, n > 1, log-probs, usage.
chat = client.chat.completions.create(
    model=text_model, messages=messages, max_tokens=8, n=2, seed=3, logprobs=True
)
assert len(chat.choices) == 2, chat
for choice in chat.choices:
    assert choice.message.role == "assistant"
    assert isinstance(choice.message.content, str)
    assert choice.finish_reason in ("stop", "length")
    assert choice.logprobs.content, choice
    assert all(t.logprob <= 0.0 for t in choice.logprobs.content)
completion_tokens = sum(len(c.logprobs.content) for c in chat.choices)
assert chat.usage.completion_tokens == completion_tokens, chat.usage
assert chat.usage.total_tokens == chat.usage.prompt_tokens + completion_tokens

# Streaming adds up to the same answer for the same seed.
pieces = {}
finish = {}
for chunk in client.chat.completions.create(
    model=text_model, messages=messages, max_tokens=8, n=2, seed=3, stream=True
):
    for c in chunk.choices:
        pieces[c.index] = pieces.get(c.index, "") + (c.delta.content or "")
        if c.finish_reason:
            finish[c.index] = c.finish_reason
for choice in chat.choices:
    assert pieces[choice.index] == choice.message.content, (pieces, chat)
    assert finish[choice.index] == choice.finish_reason

# Completions: text and token-id prompts, log-probs of the sampled tokens.
done = client.completions.create(
    model=text_model, prompt="3+4=", max_tokens=4, n=3, seed=1, logprobs=0
)
assert len(done.choices) == 3
for c in done.choices:
    assert len(c.logprobs.token_logprobs) == len(c.logprobs.tokens)
    assert "".join(c.logprobs.tokens).startswith(c.text) or c.finish_reason == "stop"
ids = client.completions.create(model=text_model, prompt=[257, 52, 43, 53, 61], max_tokens=3)
assert ids.usage.prompt_tokens == 5

# Streamed completion with a stop string: the text never holds it.
text = ""
for chunk in client.completions.create(
    model=text_model, prompt="1+1=", max_tokens=12, seed=5, stream=True, stop=["\n"]
):
    text += chunk.choices[0].text
assert "\n" not in text

# An image prompt (Qwen3-VL) as a data URL.
vl = openai.OpenAI(base_url=f"{vl_url}/v1", api_key="unused", max_retries=0)
with open(image_png, "rb") as f:
    data_url = "data:image/png;base64," + base64.b64encode(f.read()).decode()
seen = vl.chat.completions.create(
    model=vl.models.list().data[0].id,
    messages=[
        {
            "role": "user",
            "content": [
                {"type": "image_url", "image_url": {"url": data_url}},
                {"type": "text", "text": "What colour is the shape?"},
            ],
        }
    ],
    max_tokens=4,
    temperature=0,
)
assert seen.choices[0].message.content is not None
assert seen.usage.prompt_tokens > 20, seen.usage

# Bad requests: 4xx with a message, as the client's own exception types.
def expect(error, call, says):
    try:
        call()
    except error as e:
        assert says in str(e), (says, str(e))
        return
    raise AssertionError(f"expected {error.__name__}")


expect(
    openai.NotFoundError,
    lambda: client.completions.create(model="nope", prompt="1", max_tokens=2),
    "nope",
)
expect(
    openai.BadRequestError,
    lambda: client.completions.create(model=text_model, prompt=[50] * 300, max_tokens=2),
    "maximum context length",
)
expect(
    openai.BadRequestError,
    lambda: client.chat.completions.create(model=text_model, messages=messages, max_tokens=-1),
    "max_tokens",
)
raw = httpx.post(
    f"{text_url}/v1/chat/completions",
    content=b'{"messages": [',
    headers={"Content-Type": "application/json"},
)
assert raw.status_code == 400 and "not valid JSON" in raw.json()["error"]["message"], raw.text

# ... and the server keeps serving.
again = client.chat.completions.create(model=text_model, messages=messages, max_tokens=4)
assert again.choices[0].message.content is not None
print("openai client: every check passed")
