#!/usr/bin/env python3
"""Talks to a running rackfill server with the official `openai` Python client.

    python3 scripts/openai_smoke.py --base-url http://127.0.0.1:8000/v1 [--api-key KEY]

Covers what clients rely on: the model list, a completion, a batch completion with echo and
prompt logprobs (the way evaluation harnesses score log-likelihoods), a chat completion, streamed
completion and chat with `stream_options.include_usage`, seeded reproducibility, and errors
surfacing as the client's typed exceptions. Exits non-zero with a one-line reason on the first
failure. CI runs it against `rackfill serve` on the built-in model (`pip install openai`).
"""

import argparse
import sys

import openai


def check(cond, what):
    if not cond:
        print(f"openai smoke: FAILED: {what}", file=sys.stderr)
        sys.exit(1)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--base-url", default="http://127.0.0.1:8000/v1")
    ap.add_argument("--api-key", default="unused")
    args = ap.parse_args()
    client = openai.OpenAI(base_url=args.base_url, api_key=args.api_key, max_retries=0, timeout=120)

    models = client.models.list()
    ids = [m.id for m in models.data]
    check(len(ids) >= 1, f"/v1/models lists a model (got {ids})")
    model = ids[0]

    c = client.completions.create(model=model, prompt="Once upon a time", max_tokens=8, temperature=0)
    check(c.object == "text_completion", "completion object")
    check(len(c.choices) == 1 and c.choices[0].finish_reason in ("stop", "length"), "one choice with a finish reason")
    check(c.usage.prompt_tokens > 0 and c.usage.completion_tokens <= 8, f"usage {c.usage}")

    scored = client.completions.create(
        model=model, prompt=["The cat sat on the mat.", "Hello world"], max_tokens=0, echo=True, logprobs=1
    )
    check(len(scored.choices) == 2, "one choice per prompt")
    for choice in scored.choices:
        lp = choice.logprobs
        check(lp is not None and len(lp.tokens) == len(lp.token_logprobs), "echo returns prompt tokens with logprobs")
        check(lp.token_logprobs[0] is None, "the first prompt token has no logprob")
        check(all(x is not None and x <= 0.0 for x in lp.token_logprobs[1:]), "prompt logprobs are <= 0")
        check("".join(lp.tokens) == choice.text, "echoed tokens spell the echoed text")

    chat = client.chat.completions.create(
        model=model,
        messages=[{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Say hi."}],
        max_tokens=8,
        temperature=0.8,
        seed=42,
    )
    check(chat.object == "chat.completion", "chat object")
    check(chat.choices[0].message.role == "assistant", "assistant message")
    again = client.chat.completions.create(
        model=model,
        messages=[{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Say hi."}],
        max_tokens=8,
        temperature=0.8,
        seed=42,
    )
    check(again.choices[0].message.content == chat.choices[0].message.content, "a seed reproduces the chat")

    text, usage = "", None
    for chunk in client.completions.create(
        model=model, prompt="Once upon a time", max_tokens=8, temperature=0, stream=True,
        stream_options={"include_usage": True},
    ):
        if chunk.choices:
            text += chunk.choices[0].text
        if chunk.usage is not None:
            usage = chunk.usage
    check(text == c.choices[0].text, "streamed greedy text equals the non-streamed one")
    check(usage is not None and usage.completion_tokens == c.usage.completion_tokens, "streamed usage")

    pieces, usage = [], None
    for chunk in client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": "Count: one two"}], max_tokens=6, stream=True,
        stream_options={"include_usage": True},
    ):
        if chunk.choices and chunk.choices[0].delta.content:
            pieces.append(chunk.choices[0].delta.content)
        if chunk.usage is not None:
            usage = chunk.usage
    check(usage is not None and usage.completion_tokens <= 6, "chat stream usage")
    check(len(pieces) <= usage.completion_tokens, "at most one content delta per token")

    try:
        client.completions.create(model=model, prompt="x", max_tokens=4, temperature=5.0)
        check(False, "temperature 5 must be rejected")
    except openai.BadRequestError as err:
        check(err.status_code == 400, "400 for a bad parameter")
    try:
        client.completions.create(model="no-such-model", prompt="x", max_tokens=1)
        check(False, "an unknown model must be rejected")
    except openai.NotFoundError as err:
        check(err.status_code == 404, "404 for an unknown model")

    print(f"openai smoke: ok ({model}, openai {openai.__version__})")


if __name__ == "__main__":
    main()
