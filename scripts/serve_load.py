#!/usr/bin/env python3
"""Load generator for `glm5 serve` with the official OpenAI client: C concurrent clients send N
completion requests in all (half streamed, half whole), each checked for a complete answer.
Prints one JSON object: requests, errors (with the first few messages), throughput and latency
percentiles (time to first token of the streamed ones, end to end of all).

  serve_load.py --base-url http://127.0.0.1:PORT/v1 --model NAME [--clients 64] [--requests 1000]
                [--max-tokens 8] [--stop-after S]   (S: stop sending after S seconds, for drain tests)
"""
import argparse
import asyncio
import json
import statistics
import sys
import time

import openai


def percentile(xs, p):
    if not xs:
        return None
    xs = sorted(xs)
    k = min(len(xs) - 1, max(0, int(round(p / 100.0 * (len(xs) - 1)))))
    return xs[k]


async def one(client, args, i, stats):
    prompt = "Request %d: the quick brown fox" % i
    stream = i % 2 == 0
    t0 = time.perf_counter()
    ttft = None
    tokens = 0
    finish = None
    try:
        if stream:
            s = await client.completions.create(model=args.model, prompt=prompt, max_tokens=args.max_tokens,
                                                temperature=0, stream=True, extra_body={"ignore_eos": True})
            async for chunk in s:
                for c in chunk.choices:
                    ids = getattr(c, "token_ids", None) or []
                    if ids and ttft is None:
                        ttft = time.perf_counter() - t0
                    tokens += len(ids)
                    if c.finish_reason:
                        finish = c.finish_reason
        else:
            r = await client.completions.create(model=args.model, prompt=prompt, max_tokens=args.max_tokens,
                                                temperature=0, extra_body={"ignore_eos": True})
            tokens = r.usage.completion_tokens
            finish = r.choices[0].finish_reason
        if tokens != args.max_tokens or finish != "length":
            raise RuntimeError("incomplete answer: %d tokens, finish_reason %r" % (tokens, finish))
    except Exception as e:  # noqa: BLE001 - every failure is counted and reported
        stats["errors"].append("%s: %s" % (type(e).__name__, e))
        return
    stats["e2e"].append(time.perf_counter() - t0)
    if ttft is not None:
        stats["ttft"].append(ttft)
    stats["tokens"] += tokens
    stats["ok"] += 1


async def main_async(args):
    client = openai.AsyncOpenAI(base_url=args.base_url, api_key=args.api_key, max_retries=0, timeout=args.timeout)
    stats = {"ok": 0, "errors": [], "e2e": [], "ttft": [], "tokens": 0}
    next_i = 0
    t0 = time.perf_counter()

    async def worker():
        nonlocal next_i
        while next_i < args.requests:
            if args.stop_after and time.perf_counter() - t0 > args.stop_after:
                return
            i = next_i
            next_i += 1
            await one(client, args, i, stats)

    await asyncio.gather(*[worker() for _ in range(args.clients)])
    wall = time.perf_counter() - t0
    await client.close()
    ms = lambda x: None if x is None else round(1000 * x, 2)  # noqa: E731
    return {
        "clients": args.clients, "requests": stats["ok"] + len(stats["errors"]), "ok": stats["ok"],
        "errors": len(stats["errors"]), "first_errors": stats["errors"][:5], "wall_s": round(wall, 3),
        "requests_per_s": round(stats["ok"] / wall, 2), "tokens_per_s": round(stats["tokens"] / wall, 1),
        "ttft_ms": {p: ms(percentile(stats["ttft"], p)) for p in (50, 90, 99)},
        "e2e_ms": {p: ms(percentile(stats["e2e"], p)) for p in (50, 90, 99)},
        "e2e_mean_ms": ms(statistics.mean(stats["e2e"])) if stats["e2e"] else None,
    }


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--base-url", required=True)
    ap.add_argument("--model", required=True)
    ap.add_argument("--api-key", default="unused")
    ap.add_argument("--clients", type=int, default=64)
    ap.add_argument("--requests", type=int, default=1000)
    ap.add_argument("--max-tokens", type=int, default=8)
    ap.add_argument("--timeout", type=float, default=120)
    ap.add_argument("--stop-after", type=float, default=0)
    args = ap.parse_args()
    out = asyncio.run(main_async(args))
    print(json.dumps(out))
    return 0 if out["errors"] == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
