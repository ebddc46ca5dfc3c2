#!/usr/bin/env python3
"""Write the mixed batch-request file used by tests/launcher/batch/test_batch.cpp.

200 lines for tests/data/tiny-a (vocab 512, context 4096): OpenAI Batch /v1/completions with text
prompts and with token-id lists, /v1/chat/completions with messages, plain {"custom_id",
"prompt_ids"} lines; greedy and seeded sampling, logprobs and stop strings on some; prompts of 1 to
~150 tokens and max_tokens 1..12. Also a blank line, malformed lines (not JSON, no prompt,
temperature -1, top_p 2, a token id outside the vocab, a wrong url), three prompts that do not
fit the context and one repeated custom_id. Standard library only; the output is deterministic.

  python3 scripts/make_batch_requests.py --out tests/data/batch/requests-200.jsonl
"""

import argparse
import json
import random

VOCAB = 512           # tiny-a vocab_size
TEXT_IDS = 503        # ids below the tokenizer's special tokens
CONTEXT = 4096        # tiny-a max_position_embeddings
LINES = 200

WORDS = ("the model reads a long prompt and writes tokens one by one while experts route each "
         "token to four of sixteen small networks pipeline stages pass hidden states down the "
         "column indexer picks sixteen keys cache grows with every step hello world capital of "
         "France is Paris once upon a time there was a tiny random checkpoint").split()


def text_prompt(rng, max_words):
    n = rng.randint(1, max_words)
    s = " ".join(rng.choice(WORDS) for _ in range(n))
    return s[0].upper() + s[1:] if rng.random() < 0.5 else s


def ids(rng, n):
    return [rng.randrange(TEXT_IDS) for _ in range(n)]


def length(rng, i, longest):
    """Mostly short prompts (the CPU test stays fast), every 13th line a long one."""
    return rng.randint(longest * 2 // 3, longest) if i % 13 == 5 else rng.randint(1, 24)


def sampling(rng, body, allow_stop):
    body["max_tokens"] = rng.randint(1, 12)
    mode = rng.random()
    if mode < 0.4:
        body["temperature"] = 0
    else:
        body["temperature"] = round(rng.uniform(0.5, 1.2), 2)
        if mode < 0.9:  # most sampled requests carry a seed; the rest use the per-line default
            body["seed"] = rng.randrange(1 << 31)
        if rng.random() < 0.4:
            body["top_p"] = round(rng.uniform(0.5, 0.99), 2)
        if rng.random() < 0.3:
            body["top_k"] = rng.randint(1, 50)
    if allow_stop and rng.random() < 0.2:
        body["stop"] = rng.choice(["e", " ", ["a", "o"], "\n", ["the", "s"]])


def valid_line(rng, i):
    cid = f"req-{i:03d}"
    kind = i % 4
    if kind == 0:  # OpenAI Batch completions, text prompt
        body = {"model": "tiny-a", "prompt": text_prompt(rng, length(rng, i, 60) // 2 + 1)}
        sampling(rng, body, True)
        if rng.random() < 0.3:
            body["logprobs"] = rng.randint(0, 3)
        return {"custom_id": cid, "method": "POST", "url": "/v1/completions", "body": body}
    if kind == 1:  # OpenAI Batch chat completions
        msgs = []
        if rng.random() < 0.3:
            msgs.append({"role": "system", "content": text_prompt(rng, 8)})
        msgs.append({"role": "user", "content": text_prompt(rng, length(rng, i, 50) // 2 + 1)})
        if rng.random() < 0.2:
            msgs += [{"role": "assistant", "content": text_prompt(rng, 6)},
                     {"role": "user", "content": text_prompt(rng, 6)}]
        body = {"model": "tiny-a", "messages": msgs}
        sampling(rng, body, True)
        if rng.random() < 0.3:
            body["logprobs"] = True
            body["top_logprobs"] = 2
        if rng.random() < 0.3:
            body["chat_template_kwargs"] = {"enable_thinking": rng.random() < 0.5}
        return {"custom_id": cid, "method": "POST", "url": "/v1/chat/completions", "body": body}
    if kind == 2:  # plain form with prompt_ids
        line = {"custom_id": cid, "prompt_ids": ids(rng, length(rng, i, 150))}
        sampling(rng, line, False)
        if rng.random() < 0.3:
            line["logprobs"] = rng.randint(0, 2)
        return line
    # OpenAI Batch completions with the prompt as a list of ids
    body = {"prompt": ids(rng, length(rng, i, 150))}
    sampling(rng, body, False)
    return {"custom_id": cid, "method": "POST", "url": "/v1/completions", "body": body}


def special_lines(rng):
    """Malformed, over-long and duplicate lines, keyed by the line index they go to."""
    return {
        7: "{not json at all",
        23: json.dumps({"custom_id": "bad-no-prompt", "method": "POST", "url": "/v1/completions",
                        "body": {"max_tokens": 3}}),
        41: json.dumps({"custom_id": "bad-temperature", "prompt_ids": [1, 2, 3], "temperature": -1}),
        58: json.dumps({"custom_id": "bad-top-p", "method": "POST", "url": "/v1/completions",
                        "body": {"prompt": "hello", "top_p": 2}}),
        77: json.dumps({"custom_id": "bad-token-id", "prompt_ids": [5, 6, VOCAB + 3], "max_tokens": 2}),
        96: json.dumps({"custom_id": "bad-url", "method": "POST", "url": "/v1/embeddings",
                        "body": {"input": "hello"}}),
        # Over-long: 4100 ids alone exceed the context; 4090 ids fit but not with max_tokens 10.
        110: json.dumps({"custom_id": "long-ids", "prompt_ids": ids(rng, CONTEXT + 4), "max_tokens": 2}),
        131: json.dumps({"custom_id": "long-prompt-list", "method": "POST", "url": "/v1/completions",
                         "body": {"prompt": ids(rng, CONTEXT + 4), "max_tokens": 1, "temperature": 0}}),
        150: json.dumps({"custom_id": "long-with-max-tokens", "prompt_ids": ids(rng, CONTEXT - 6),
                         "max_tokens": 10}),
        # The same custom_id as an earlier valid line: the later line gets an error record.
        170: json.dumps({"custom_id": "req-012", "prompt_ids": [9, 8, 7], "max_tokens": 2,
                         "temperature": 0}),
        185: "   ",  # blank: no record
    }


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--seed", type=int, default=20240517)
    args = ap.parse_args()
    rng = random.Random(args.seed)
    special = special_lines(rng)
    with open(args.out, "w", encoding="utf-8") as f:
        for i in range(LINES):
            text = special[i] if i in special else json.dumps(valid_line(rng, i))
            f.write(text + "\n")


if __name__ == "__main__":
    main()
