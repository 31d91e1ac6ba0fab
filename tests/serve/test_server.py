"""The server through the official `openai` client: greedy answers equal transformers'
`generate` (alone, many prompts in one request, many requests at once), streams that
concatenate to the whole answer in whole characters, n, stop, logprobs, seeds, chat
with the checkpoint's template, usage, /v1/models and /health."""

from __future__ import annotations

import concurrent.futures

import httpx
import pytest
from serve_fixtures import NAME, WRITES, greedy

PROMPTS = ["hello world", "the quick brown fox", "a", "how are you today? the lazy dog",
           "Hi!", "all that glitters is not gold; a stitch in time"]


def reference(checkpoint, prompt: str, n: int) -> tuple[str, int, str]:
    """(text, tokens, finish reason) of transformers' greedy answer to `prompt`."""
    _, model, tok = checkpoint
    ids = tok(prompt)["input_ids"]
    out = greedy(model, tok, ids, n)
    reason = "stop" if out[-1] == tok.eos_token_id else "length"
    return tok.decode(out, skip_special_tokens=True), len(out), reason


def test_greedy_answers_equal_transformers_generate(server, checkpoint):
    for i, prompt in enumerate(PROMPTS):
        n = 6 + 5 * i
        r = server.client.completions.create(model=NAME, prompt=prompt, max_tokens=n,
                                             temperature=0)
        text, count, reason = reference(checkpoint, prompt, n)
        assert (r.choices[0].text, r.choices[0].finish_reason) == (text, reason), prompt
        assert r.usage.completion_tokens == count
        assert r.usage.prompt_tokens == len(checkpoint[2](prompt)["input_ids"])
        assert r.model == NAME and r.id.startswith("cmpl-") and r.object == "text_completion"
    assert server.engine.pages_in_use() == 0


def test_many_requests_at_once_equal_generate(server, checkpoint):
    def ask(i):
        prompt = PROMPTS[i % len(PROMPTS)] + " x" * (i // len(PROMPTS))
        r = server.client.completions.create(model=NAME, prompt=prompt, max_tokens=4 + 3 * i,
                                             temperature=0)
        return r.choices[0].text, reference(checkpoint, prompt, 4 + 3 * i)[0]

    with concurrent.futures.ThreadPoolExecutor(8) as pool:  # more than max_seqs=4
        for got, want in pool.map(ask, range(12)):
            assert got == want


def test_several_prompts_strings_or_token_ids_in_one_request(server, checkpoint):
    tok = checkpoint[2]
    strings = [PROMPTS[0], PROMPTS[1], PROMPTS[4]]
    for prompts in (strings, [tok(p)["input_ids"] for p in strings]):
        r = server.client.completions.create(model=NAME, prompt=prompts, max_tokens=9, n=2,
                                             temperature=0)
        assert [c.index for c in r.choices] == list(range(6))
        for c in r.choices:  # choice i*n + j: sample j of prompt i
            assert c.text == reference(checkpoint, strings[c.index // 2], 9)[0]
        assert r.usage.prompt_tokens == sum(len(tok(p)["input_ids"]) for p in strings)
    ids = tok(PROMPTS[2])["input_ids"]
    one = server.client.completions.create(model=NAME, prompt=ids, max_tokens=7, temperature=0)
    assert one.choices[0].text == reference(checkpoint, PROMPTS[2], 7)[0]


def _stream(server, **kw):
    chunks, usage, reasons = [], None, {}
    for chunk in server.client.completions.create(model=NAME, stream=True, **kw):
        if chunk.usage is not None:
            usage = chunk.usage
        for c in chunk.choices:
            chunks.append((c.index, c.text))
            if c.finish_reason:
                reasons[c.index] = c.finish_reason
    return chunks, usage, reasons


def test_a_stream_concatenates_to_the_answer_in_whole_characters(server):
    # it writes Zürich→東京!Zürich... (16 tokens a round): 41 tokens end after an "→"
    kw = dict(prompt="Hi!", max_tokens=41, temperature=0)
    whole = server.client.completions.create(model=NAME, **kw)
    text = whole.choices[0].text
    assert text == 2 * WRITES + "Zürich→"
    chunks, usage, reasons = _stream(server, stream_options={"include_usage": True}, **kw)
    pieces = [t for _, t in chunks]
    assert "".join(pieces) == text and reasons == {0: "length"}
    assert all("\ufffd" not in p for p in pieces), pieces  # no character split in two
    assert {"ü", "→", "東", "京"} <= set(pieces)  # each made of 2 or 3 byte tokens
    assert usage.completion_tokens == 41 and usage.prompt_tokens == whole.usage.prompt_tokens
    # with the raw wire: server-sent events ending in [DONE]
    with httpx.stream("POST", f"{server.url}/v1/completions", timeout=60,
                      json=dict(model=NAME, stream=True, **kw)) as r:
        assert r.headers["content-type"].startswith("text/event-stream")
        lines = [line for line in r.iter_lines() if line]
    assert all(line.startswith("data: ") for line in lines) and lines[-1] == "data: [DONE]"


def test_stop_strings_are_cut_and_held_back_in_a_stream(server):
    kw = dict(prompt="Hi!", max_tokens=40, temperature=0, stop=["XYZ", "東京"])
    r = server.client.completions.create(model=NAME, **kw)
    assert (r.choices[0].text, r.choices[0].finish_reason) == ("Zürich→", "stop")
    chunks, _, reasons = _stream(server, **kw)
    assert "".join(t for _, t in chunks) == "Zürich→" and reasons == {0: "stop"}
    assert all("東" not in t for _, t in chunks)
    one = server.client.completions.create(model=NAME, prompt="Hi!", max_tokens=40,
                                           temperature=0, stop="ich")
    assert one.choices[0].text == "Zür"
    # a stop string begun but not finished is sent once it cannot be one
    r = server.client.completions.create(model=NAME, prompt="Hi!", max_tokens=16,
                                         temperature=0, stop=["→X"])
    assert (r.choices[0].text, r.choices[0].finish_reason) == (WRITES, "length")


def test_n_samples_and_seeds(server, checkpoint):
    kw = dict(model=NAME, prompt=PROMPTS[0], max_tokens=12, temperature=1.0)
    a = server.client.completions.create(n=3, seed=7, **kw)
    b = server.client.completions.create(n=3, seed=7, **kw)
    c = server.client.completions.create(n=3, seed=8, **kw)
    texts = [x.text for x in a.choices]
    assert [x.index for x in a.choices] == [0, 1, 2]
    assert texts == [x.text for x in b.choices]  # the same seed: the same answers
    assert len(set(texts)) > 1 and texts != [x.text for x in c.choices]
    lengths = [12 if x.finish_reason == "length" else None for x in a.choices]
    assert a.usage.completion_tokens <= 36 and (None in lengths
                                                 or a.usage.completion_tokens == 36)
    g = server.client.completions.create(model=NAME, prompt=PROMPTS[0], max_tokens=12, n=2,
                                         temperature=0)
    want = reference(checkpoint, PROMPTS[0], 12)[0]
    assert [x.text for x in g.choices] == [want, want]
    chunks, _, reasons = _stream(server, prompt=PROMPTS[0], max_tokens=12, n=3, seed=7,
                                 temperature=1.0)
    assert ["".join(t for i, t in chunks if i == j) for j in range(3)] == texts
    assert set(reasons) == {0, 1, 2}


def test_completion_logprobs(server):
    r = server.client.completions.create(model=NAME, prompt=PROMPTS[1], max_tokens=8,
                                         temperature=0, logprobs=3)
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 8
    for chosen, top in zip(lp.token_logprobs, lp.top_logprobs):
        assert chosen <= 0 and chosen >= max(top.values()) - 1e-5  # greedy: the most likely
        # keyed by text, tokens that decode alike (partial characters: "\ufffd") share one
        assert len(top) < 3 or chosen == pytest.approx(max(top.values()))
    assert lp.text_offset == sorted(lp.text_offset) and lp.text_offset[0] == 0
    plain = server.client.completions.create(model=NAME, prompt=PROMPTS[1], max_tokens=8,
                                             temperature=0)
    assert plain.choices[0].logprobs is None and plain.choices[0].text == r.choices[0].text


def test_chat_renders_the_template_and_equals_generate(server, checkpoint):
    _, model, tok = checkpoint
    messages = [{"role": "system", "content": "be brief"},
                {"role": "user", "content": "how are you today?"}]
    ids = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True,
                                  return_dict=True)["input_ids"]
    want = greedy(model, tok, ids, 10)
    r = server.client.chat.completions.create(model=NAME, messages=messages,
                                              max_completion_tokens=10, temperature=0,
                                              logprobs=True, top_logprobs=2)
    msg = r.choices[0].message
    assert (msg.role, msg.content) == ("assistant", tok.decode(want, skip_special_tokens=True))
    assert r.usage.prompt_tokens == len(ids) and r.usage.completion_tokens == len(want)
    assert r.id.startswith("chatcmpl-") and r.object == "chat.completion"
    content = r.choices[0].logprobs.content
    assert len(content) == len(want) and all(len(c.top_logprobs) == 2 for c in content)
    assert all(c.logprob == pytest.approx(c.top_logprobs[0].logprob) for c in content)
    # streamed: a role first, then content deltas that add up to the answer
    deltas = [(c.delta.role, c.delta.content, c.finish_reason) for chunk in
              server.client.chat.completions.create(model=NAME, messages=messages,
                                                    max_tokens=10, temperature=0, stream=True)
              for c in chunk.choices]
    assert deltas[0][0] == "assistant"
    assert "".join(d[1] or "" for d in deltas) == msg.content
    assert deltas[-1][2] == r.choices[0].finish_reason
    # text parts are joined; an answer stops at the chat's stop string
    parts = [{"role": "user", "content": [{"type": "text", "text": "how are you"},
                                          {"type": "text", "text": "today?"}]}]
    joined = [{"role": "user", "content": "how are you\ntoday?"}]
    a, b = (server.client.chat.completions.create(model=NAME, messages=m, max_tokens=6,
                                                  temperature=0) for m in (parts, joined))
    assert a.choices[0].message.content == b.choices[0].message.content


def test_models_and_health(server):
    (model,) = server.client.models.list().data
    assert model.id == NAME and model.owned_by == "tfjax"
    r = httpx.get(f"{server.url}/health")
    assert r.status_code == 200 and r.json() == {"status": "ok"}
