#!/usr/bin/env python3
"""Soak test of a running `glm5 serve`: C clients for M minutes with a mixed load, while the
server's processes are sampled for resident memory and open file descriptors.

The mix, per request: streamed completions (one in four of them dropped by the client after the
first chunks: a disconnect mid-stream), whole completions (some with n = 2 and logprobs), chat
completions, vLLM's /tokenize, /health, /v1/models and /metrics, and bad requests a client can
send (malformed JSON, wrong types, unknown fields, an unknown model, too many choices, an empty
body, a wrong API key). Every answer is checked: good requests complete with the tokens they asked
for, bad ones get a 4xx with an OpenAI error object; any 5xx but a 503 while draining is a failure.

Prints one JSON object (requests by kind, HTTP statuses, failures with the first few messages,
RSS and descriptor samples, their growth after the warm-up) and exits 1 when a request failed, a
5xx came back, RSS grew more than --rss-growth (relative) or descriptors more than --fd-growth
between the end of the warm-up and the end.

  serve_soak.py --base-url http://127.0.0.1:PORT --model NAME --pids PID,PID,... [--minutes 30]
                [--clients 16] [--warmup-s 60] [--api-key KEY]
"""
import argparse
import asyncio
import json
import os
import random
import sys
import time

import httpx2 as httpx  # the HTTP client the pinned openai package uses (tests/serve/requirements.txt)
import openai


def rss_kb(pid):
    with open("/proc/%d/status" % pid) as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    return 0


def sample(pids):
    rss, fds = 0, 0
    for pid in pids:
        try:
            rss += rss_kb(pid)
            fds += len(os.listdir("/proc/%d/fd" % pid))
        except OSError:  # a process that went away counts as a failure elsewhere (it is checked)
            pass
    return {"t": time.time(), "rss_mb": round(rss / 1024.0, 1), "fds": fds}


class Soak:
    def __init__(self, args):
        self.args = args
        self.kinds = {}
        self.statuses = {}
        self.failures = []
        self.rng = random.Random(1)
        headers = {"Authorization": "Bearer %s" % args.api_key} if args.api_key else {}
        self.http = httpx.AsyncClient(base_url=args.base_url, headers=headers, timeout=120)
        self.oa = openai.AsyncOpenAI(base_url=args.base_url + "/v1", api_key=args.api_key or "none",
                                     max_retries=0, timeout=120)

    def fail(self, kind, msg):
        self.failures.append("%s: %s" % (kind, msg))

    def count(self, kind, status):
        self.kinds[kind] = self.kinds.get(kind, 0) + 1
        self.statuses[str(status)] = self.statuses.get(str(status), 0) + 1
        if status >= 500:
            self.fail(kind, "HTTP %d" % status)

    async def streamed(self, i):
        drop = i % 4 == 0
        n = self.rng.randint(4, 24)
        tokens, finish = 0, None
        s = await self.oa.completions.create(model=self.args.model, prompt="soak %d: once upon a time" % i,
                                             max_tokens=n, temperature=0.8, seed=i, stream=True,
                                             extra_body={"ignore_eos": True})
        async for chunk in s:
            for c in chunk.choices:
                tokens += len(getattr(c, "token_ids", None) or [])
                finish = c.finish_reason or finish
            if drop and tokens >= 2:
                await s.response.aclose()  # the client goes away mid-stream
                self.count("stream_dropped", 200)
                return
        if tokens != n or finish != "length":
            self.fail("stream", "%d of %d tokens, finish %r" % (tokens, n, finish))
        self.count("stream", 200)

    async def whole(self, i):
        n = self.rng.randint(1, 16)
        choices = 2 if i % 3 == 0 else 1
        r = await self.oa.completions.create(model=self.args.model, prompt=[1, 2, 3, i % 50 + 4], max_tokens=n,
                                             n=choices, logprobs=2 if i % 2 else None, temperature=0.7, seed=i,
                                             extra_body={"ignore_eos": True})
        if len(r.choices) != choices or r.usage.completion_tokens != n * choices:
            self.fail("whole", "%d choices, %d tokens" % (len(r.choices), r.usage.completion_tokens))
        self.count("whole", 200)

    async def chat(self, i):
        r = await self.oa.chat.completions.create(model=self.args.model, max_tokens=8, temperature=0,
                                                  messages=[{"role": "system", "content": "Be brief."},
                                                            {"role": "user", "content": "Question %d?" % i}])
        if not r.choices or r.choices[0].finish_reason not in ("length", "stop"):
            self.fail("chat", "no complete choice")
        self.count("chat", 200)

    async def light(self, i):
        path, method, body = [("/health", "GET", None), ("/v1/models", "GET", None), ("/metrics", "GET", None),
                              ("/tokenize", "POST", {"prompt": "hello soak %d" % i})][i % 4]
        r = await self.http.request(method, path, json=body)
        self.count("light", r.status_code)
        if r.status_code != 200:
            self.fail("light", "%s %s: HTTP %d" % (method, path, r.status_code))

    BAD = [
        ("/v1/completions", b'{"prompt": "x", "max_tokens": '),  # malformed JSON
        ("/v1/completions", b'{"prompt": 12, "max_tokens": 4}'),  # wrong type
        ("/v1/completions", b'{"prompt": "x", "max_tokens": -3}'),
        ("/v1/completions", b'{"prompt": "x", "frobnicate": true}'),  # unknown field
        ("/v1/completions", b'{"prompt": "x", "model": "no-such-model"}'),  # 404
        ("/v1/completions", b'{"prompt": "x", "n": 100000}'),
        ("/v1/chat/completions", b'{"messages": [{"role": "wizard", "content": "x"}]}'),
        ("/v1/chat/completions", b''),
        ("/v1/completions", b'[' * 100 + b']' * 100),  # nested beyond the depth limit
        ("/v1/completions", b'{"prompt": "\xff\xfe not utf-8"}'),
    ]

    async def bad(self, i):
        path, body = self.BAD[i % len(self.BAD)]
        headers = {"Content-Type": "application/json"}
        if i % 7 == 0 and self.args.api_key:
            headers["Authorization"] = "Bearer wrong"
        r = await self.http.post(path, content=body, headers=headers)
        self.count("bad", r.status_code)
        if not 400 <= r.status_code < 500:
            self.fail("bad", "%s %r: HTTP %d, expected 4xx" % (path, body[:40], r.status_code))
        else:
            try:
                ok = isinstance(r.json().get("error"), dict)
            except ValueError:
                ok = False
            if not ok:
                self.fail("bad", "%s: HTTP %d without an OpenAI error object" % (path, r.status_code))

    async def client(self, c, deadline):
        kinds = [self.streamed] * 4 + [self.whole] * 3 + [self.chat] * 2 + [self.light, self.bad, self.bad]
        i = c
        while time.time() < deadline:
            i += self.args.clients
            f = kinds[self.rng.randrange(len(kinds))]
            try:
                await f(i)
            except openai.APIStatusError as e:
                self.count(f.__name__, e.status_code)  # a 5xx is a failure there
                if e.status_code < 500:
                    self.fail(f.__name__, "HTTP %d: %s" % (e.status_code, str(e)[:200]))
            except Exception as e:  # noqa: BLE001 - every failure is counted and reported
                self.count(f.__name__, 0)
                self.fail(f.__name__, "%s: %s" % (type(e).__name__, str(e)[:200]))


async def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--base-url", required=True)
    ap.add_argument("--model", required=True)
    ap.add_argument("--pids", required=True, help="the server's processes (comma-separated)")
    ap.add_argument("--minutes", type=float, default=30)
    ap.add_argument("--clients", type=int, default=16)
    ap.add_argument("--warmup-s", type=float, default=60)
    ap.add_argument("--api-key", default="")
    ap.add_argument("--rss-growth", type=float, default=0.10)
    ap.add_argument("--fd-growth", type=int, default=16)
    args = ap.parse_args()
    pids = [int(p) for p in args.pids.split(",") if p]
    soak = Soak(args)
    start = time.time()
    deadline = start + args.minutes * 60
    samples = [sample(pids)]

    async def sampler():
        while time.time() < deadline:
            await asyncio.sleep(10)
            samples.append(sample(pids))

    await asyncio.gather(sampler(), *[soak.client(c, deadline) for c in range(args.clients)])
    samples.append(sample(pids))
    warm = next((s for s in samples if s["t"] - start >= args.warmup_s), samples[0])
    last = samples[-1]
    mid = min(samples, key=lambda s: abs(s["t"] - (start + deadline) / 2))  # growth that goes on shows here too
    rss_growth = (last["rss_mb"] - warm["rss_mb"]) / max(warm["rss_mb"], 1e-9)
    fd_growth = last["fds"] - warm["fds"]
    alive = all(os.path.exists("/proc/%d" % p) for p in pids)
    out = {
        "minutes": round((time.time() - start) / 60, 2),
        "clients": args.clients,
        "requests": sum(soak.kinds.values()),
        "by_kind": soak.kinds,
        "statuses": soak.statuses,
        "http_5xx": sum(v for k, v in soak.statuses.items() if k.startswith("5")),
        "failures": len(soak.failures),
        "first_failures": soak.failures[:5],
        "rss_mb": {"start": samples[0]["rss_mb"], "after_warmup": warm["rss_mb"], "half_way": mid["rss_mb"], "end": last["rss_mb"],
                   "max": max(s["rss_mb"] for s in samples), "growth_after_warmup": round(rss_growth, 4)},
        "fds": {"start": samples[0]["fds"], "after_warmup": warm["fds"], "half_way": mid["fds"], "end": last["fds"],
                "max": max(s["fds"] for s in samples)},
        "server_alive": alive,
    }
    print(json.dumps(out, indent=1))
    ok = not soak.failures and alive and rss_growth <= args.rss_growth and fd_growth <= args.fd_growth
    await soak.http.aclose()
    await soak.oa.close()
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(asyncio.run(main()))
