#!/usr/bin/env python3
"""`glm5 serve` driven by real clients (the official openai package, raw sockets for the transport
limits). Suites (argv[1]): api (1x1: endpoints, streaming, every error status, limits, timeouts,
disconnects, 503 while draining and over capacity, out of descriptors, greedy answers identical
to `glm5 batch`, prompt logprobs (echo) against `glm5 generate --dump-logits` and `glm5 batch`,
/tokenize and /detokenize), layout2x2 (the same answers under mpirun 2 x 2, a mid-stream disconnect, idle
CPU, SIGTERM to rank 0 or to `glm5 launch --run` drains and ends every rank with 0), load (64 clients x 1,000 requests with 0 errors,
then SIGTERM under load drains), fast (precision fast: server and batch give the same bits). Environment: GLM5_BIN,
GLM5_SRC, GLM5_MPIRUN.
"""
import array
import http.client
import json
import math
import os
import re
import resource
import signal
import socket
import struct
import subprocess
import sys
import tempfile
import threading
import time
import unittest

import openai

BIN = os.environ["GLM5_BIN"]
SRC = os.environ["GLM5_SRC"]
MPIRUN = os.environ.get("GLM5_MPIRUN", "mpirun")
MODEL = os.path.join(SRC, "tests", "data", "tiny-a")
MODEL_NAME = "tiny-a"
CLUSTER22 = os.path.join(SRC, "cluster-configs", "cpu-pp2-ep2.yaml")
SCRATCH = tempfile.mkdtemp(prefix="glm5_serve_")


def cpu_seconds(pid):
    """User + system CPU time of a process so far."""
    with open("/proc/%d/stat" % pid) as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


class Server:
    """glm5 serve on a free port; rank 0's pid and port from its 'listening on' line."""

    def __init__(self, *extra, np=1, cluster=None, launch=None, nofile=0):
        cmd = [BIN, "serve", "--model", MODEL, "--port", "0", *extra]
        env = None
        if launch:  # through `glm5 launch --run --cluster FILE -- serve ...` (mpirun from PATH)
            cmd = [BIN, "launch", "--run", "--cluster", launch, "--"] + cmd[1:]
            env = dict(os.environ)
            if os.path.isabs(MPIRUN):
                env["PATH"] = os.path.dirname(MPIRUN) + os.pathsep + env.get("PATH", "")
        elif cluster:
            cmd += ["--cluster", cluster]
        if np > 1:
            cmd = [MPIRUN, "--allow-run-as-root", "--oversubscribe", "--mca", "btl", "self,vader,tcp",
                   "-x", "OMP_NUM_THREADS=1", "-np", str(np)] + cmd
        self.err_path = os.path.join(SCRATCH, "serve_%d.err" % time.monotonic_ns())
        self.err = open(self.err_path, "w+")
        limit = (lambda: resource.setrlimit(resource.RLIMIT_NOFILE, (nofile, nofile))) if nofile else None
        self.proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=self.err, env=env, preexec_fn=limit)
        deadline = time.time() + 60
        while time.time() < deadline:
            m = re.search(r"listening on http://([0-9.]+):(\d+) .*pid (\d+)", self.stderr())
            if m:
                self.host, self.port, self.pid = m.group(1), int(m.group(2)), int(m.group(3))
                return
            if self.proc.poll() is not None:
                raise RuntimeError("glm5 serve exited: " + self.stderr())
            time.sleep(0.05)
        raise RuntimeError("glm5 serve did not start: " + self.stderr())

    def stderr(self):
        with open(self.err_path) as f:
            return f.read()

    def url(self):
        return "http://%s:%d/v1" % (self.host, self.port)

    def client(self, key="unused"):
        return openai.OpenAI(base_url=self.url(), api_key=key, max_retries=0, timeout=60)

    def request(self, method, path, body=None, headers=None):
        c = http.client.HTTPConnection(self.host, self.port, timeout=30)
        c.request(method, path, body=body, headers=headers or {})
        r = c.getresponse()
        data = r.read()
        c.close()
        return r.status, data

    def metrics(self):
        status, data = self.request("GET", "/metrics")
        assert status == 200
        out = {}
        for line in data.decode().splitlines():
            if line and not line.startswith("#"):
                name, value = line.rsplit(" ", 1)
                out[name] = float(value)
        return out

    def cpu_seconds(self):
        """User + system CPU time of rank 0 so far."""
        return cpu_seconds(self.pid)

    def stop(self, sig=signal.SIGTERM, timeout=60):
        """Signals rank 0 and returns the exit code of the whole job."""
        if self.proc.poll() is None:
            os.kill(self.pid, sig)
        try:
            return self.proc.wait(timeout)
        finally:
            if self.proc.poll() is None:
                self.proc.kill()


# The requests both `glm5 batch` and the server answer: completions (text, ids, stop string) and
# chat, greedy.
REQUESTS = [
    ("/v1/completions", {"prompt": "Hello", "max_tokens": 12}),
    ("/v1/completions", {"prompt": [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12], "max_tokens": 16, "ignore_eos": True}),
    ("/v1/completions", {"prompt": "The quick brown fox jumps over the lazy dog " * 8, "max_tokens": 10}),
    ("/v1/completions", {"prompt": "Stop here", "max_tokens": 20, "stop": ["e"], "ignore_eos": True}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi there"}], "max_tokens": 10}),
    ("/v1/chat/completions", {"messages": [{"role": "system", "content": "Be brief."},
                                           {"role": "user", "content": "What is 2+2?"}], "max_tokens": 8}),
]


def batch_answers(*extra):
    """The same requests through `glm5 batch` (1 process): [(text, token_ids, finish_reason)]."""
    got = batch_choices([{"custom_id": str(i), "method": "POST", "url": url,
                          "body": dict(body, temperature=0, model=MODEL_NAME)} for i, (url, body) in enumerate(REQUESTS)],
                        *extra)
    out = []
    for i in range(len(REQUESTS)):
        c = got[str(i)][0]
        out.append((c["message"]["content"] if "message" in c else c["text"], c["token_ids"], c["finish_reason"]))
    return out


def server_answers(client, stream):
    """The same requests through the openai client, whole or streamed."""
    out = []
    for url, body in REQUESTS:
        body = dict(body)
        extra = {k: body.pop(k) for k in ("ignore_eos",) if k in body}
        chat = url == "/v1/chat/completions"
        api = client.chat.completions if chat else client.completions
        if not stream:
            r = api.create(model=MODEL_NAME, temperature=0, extra_body=extra, **body)
            c = r.choices[0]
            out.append((c.message.content if chat else c.text, c.token_ids, c.finish_reason))
            continue
        text, ids, finish = "", [], None
        for chunk in api.create(model=MODEL_NAME, temperature=0, stream=True, extra_body=extra, **body):
            for c in chunk.choices:
                text += (c.delta.content or "") if chat else c.text
                ids += c.token_ids
                finish = c.finish_reason or finish
        out.append((text, ids, finish))
    return out


def start_stream(s, max_tokens=4000, events=3):
    """A raw-socket streaming completion, read until `events` SSE events arrived: the socket."""
    c = socket.create_connection((s.host, s.port), timeout=30)
    body = json.dumps({"model": MODEL_NAME, "prompt": "Go on", "max_tokens": max_tokens, "ignore_eos": True,
                       "temperature": 0, "stream": True}).encode()
    c.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
              b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
    read_events(c, events)
    return c


def read_events(c, events):
    """Reads from c until `events` SSE events arrived; fails (not spins) if the server closes first."""
    got = b""
    while got.count(b"data: ") < events:
        more = c.recv(4096)
        if not more:
            raise AssertionError("the server closed the stream after: %r" % got[-300:])
        got += more
    return got


def wait_idle(s, cancelled_at_least, timeout=20):
    """Metrics once the engine has nothing running and cancelled_total reached the given count."""
    deadline = time.time() + timeout
    while True:
        m = s.metrics()
        if (m["glm5_serve_cancelled_total"] >= cancelled_at_least and m["glm5_serve_requests_running"] == 0
                and m["glm5_serve_kv_blocks_in_use"] == 0) or time.time() > deadline:
            return m
        time.sleep(0.05)


def dumped_prefill_rows(prompt):
    """`glm5 generate --dump-logits`' prefill_logits for the prompt: one array of floats per row."""
    out = os.path.join(SCRATCH, "dump_%d.safetensors" % time.monotonic_ns())
    subprocess.run([BIN, "generate", "--model", MODEL, "--prompt-ids", ",".join(map(str, prompt)),
                    "--max-new-tokens", "1", "--temperature", "0", "--dump-logits", out], check=True,
                   stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    with open(out, "rb") as f:
        header = json.loads(f.read(struct.unpack("<Q", f.read(8))[0]))
        data = f.read()
    t = header["prefill_logits"]
    assert t["dtype"] == "F32" and t["shape"][0] == len(prompt), t
    begin, end = t["data_offsets"]
    vals = array.array("f")
    vals.frombytes(data[begin:end])
    assert sys.byteorder == "little"
    cols = t["shape"][1]
    return [vals[r * cols:(r + 1) * cols] for r in range(len(prompt))]


def log_softmax_at(row, token):
    """log_softmax(row)[token] in double precision."""
    mx = max(row)
    return row[token] - mx - math.log(math.fsum(math.exp(v - mx) for v in row))


def batch_choices(lines, *extra):
    """`glm5 batch` (1 process) over plain lines: custom_id -> the record's choices (or its error)."""
    inp = os.path.join(SCRATCH, "echo_in_%d.jsonl" % time.monotonic_ns())
    out = inp.replace("_in_", "_out_")
    with open(inp, "w") as f:
        for line in lines:
            f.write(json.dumps(line) + "\n")
    subprocess.run([BIN, "batch", "--model", MODEL, "--input", inp, "--output", out, *extra], check=True,
                   stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    got = {}
    with open(out) as f:
        for line in f:
            rec = json.loads(line)
            got[rec["custom_id"]] = rec["response"]["body"]["choices"] if rec["response"] else rec["error"]
    return got


# An echo request (prompt logprobs with the top 2, then 2 greedy tokens) that the server and the
# batch job must answer with the same bits.
ECHO_BODY = {"prompt": [(3 * i + 4) % 500 for i in range(50)], "echo": True, "logprobs": 2, "max_tokens": 2,
             "temperature": 0}


def served_echo(test, server):
    """ECHO_BODY through the server: its one choice."""
    status, data = server.request("POST", "/v1/completions", json.dumps(dict(ECHO_BODY, model=MODEL_NAME)))
    test.assertEqual(status, 200, data)
    return json.loads(data)["choices"][0]


# A JSON body nested 200,000 levels deep (400 KB): within the body limit, far past the depth limit.
DEEP = '{"prompt": ' + "[" * 200000 + "]" * 200000 + "}"


class Api(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.batch = batch_answers()
        cls.s = Server()

    @classmethod
    def tearDownClass(cls):
        assert cls.s.stop() == 0, cls.s.stderr()

    def test_greedy_answers_equal_batch(self):
        self.assertEqual(server_answers(self.s.client(), stream=False), self.batch)

    def test_streamed_answers_equal_batch(self):
        self.assertEqual(server_answers(self.s.client(), stream=True), self.batch)

    def test_stream_chunks_and_done(self):
        c = http.client.HTTPConnection(self.s.host, self.s.port, timeout=30)
        body = {"model": MODEL_NAME, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 5,
                "temperature": 0, "stream": True, "ignore_eos": True, "stream_options": {"include_usage": True}}
        c.request("POST", "/v1/chat/completions", json.dumps(body))
        r = c.getresponse()
        self.assertEqual(r.status, 200)
        self.assertEqual(r.getheader("Content-Type"), "text/event-stream")
        events = [e[len("data: "):] for e in r.read().decode(errors="replace").split("\n\n") if e]
        self.assertEqual(events[-1], "[DONE]")
        chunks = [json.loads(e) for e in events[:-1]]
        self.assertEqual(chunks[0]["choices"][0]["delta"]["role"], "assistant")
        self.assertTrue(all(ch["object"] == "chat.completion.chunk" for ch in chunks))
        self.assertEqual(chunks[-2]["choices"][0]["finish_reason"], "length")
        self.assertEqual(chunks[-1]["choices"], [])
        self.assertEqual(chunks[-1]["usage"]["completion_tokens"], 5)
        self.assertEqual(sum(len(ch["choices"][0]["token_ids"]) for ch in chunks[:-1]), 5)

    def test_n_choices(self):
        r = self.s.client().completions.create(model=MODEL_NAME, prompt="Hello", max_tokens=4, n=3, temperature=1,
                                               seed=5)
        self.assertEqual(sorted(c.index for c in r.choices), [0, 1, 2])
        self.assertEqual(r.usage.completion_tokens, sum(len(c.token_ids) for c in r.choices))

    def test_models_and_health(self):
        self.assertEqual([m.id for m in self.s.client().models.list()], [MODEL_NAME])
        self.assertEqual(self.s.request("GET", "/health"), (200, b'{"status":"ok"}'))

    def test_metrics(self):
        self.s.client().completions.create(model=MODEL_NAME, prompt="Hi", max_tokens=3, temperature=0)
        m = self.s.metrics()
        self.assertGreaterEqual(m['glm5_serve_requests_total{endpoint="/v1/completions",code="200"}'], 1)
        self.assertGreaterEqual(m["glm5_serve_generation_tokens_total"], 3)
        self.assertGreaterEqual(m["glm5_serve_time_to_first_token_seconds_count"], 1)
        self.assertGreaterEqual(m["glm5_serve_inter_token_latency_seconds_count"], 2)
        self.assertGreater(m["glm5_serve_kv_blocks"], 0)
        self.assertIn("glm5_serve_queue_depth", m)
        self.assertIn('glm5_compute_seconds_total{rank="0"}', m)  # the engine's counters (moe_monitor)

    def expect_error(self, status, path, body, param=None, code=None, method="POST", headers=None):
        got, data = self.s.request(method, path, body if isinstance(body, (str, bytes)) or body is None
                                   else json.dumps(body), headers)
        self.assertEqual(got, status, data)
        err = json.loads(data)["error"]
        self.assertTrue(err["message"])
        self.assertIn("type", err)
        if param is not None:
            self.assertEqual(err["param"], param)
        if code is not None:
            self.assertEqual(err["code"], code)
        return err

    def test_400_invalid_fields(self):
        with self.assertRaises(openai.BadRequestError) as e:
            self.s.client().completions.create(model=MODEL_NAME, prompt="Hi", top_p=7)
        self.assertIn("top_p", str(e.exception))
        err = self.expect_error(400, "/v1/completions", {"prompt": "Hi", "max_tokens": "many"}, param="max_tokens")
        self.assertIn("expected", err["message"])
        self.assertIn('"many"', err["message"])
        self.expect_error(400, "/v1/completions", "{not json", code="invalid_json")
        self.expect_error(400, "/v1/completions", [1, 2])
        self.expect_error(400, "/v1/completions", {"max_tokens": 3})
        self.expect_error(400, "/v1/chat/completions", {"messages": "hi"}, param="messages")
        self.expect_error(400, "/v1/completions", {"prompt": "Hi", "frobnicate": 1}, param="frobnicate")
        self.expect_error(400, "/v1/completions", {"prompt": "Hi", "stream": "yes"}, param="stream")
        self.expect_error(400, "/v1/completions", {"prompt": "Hi", "max_tokens": 100000},
                          code="context_length_exceeded")
        self.expect_error(400, "/v1/completions", {"prompt": "Hi", "stream": True, "logprobs": 2}, param="logprobs")

    def test_400_deeply_nested_json_and_the_server_goes_on(self):
        err = self.expect_error(400, "/v1/completions", DEEP, code="invalid_json")
        self.assertIn("64", err["message"])
        self.expect_error(400, "/v1/chat/completions",
                          {"messages": [{"role": "user", "content": "hi"}], "stop": [[[["x"] * 3]] * 3]},
                          param="stop")
        # At the limit is fine as JSON (the field is still wrong).
        self.expect_error(400, "/v1/completions", '{"prompt": ' + "[" * 63 + "]" * 63 + "}", param="prompt")
        self.assertEqual(self.s.request("GET", "/health"), (200, b'{"status":"ok"}'))
        r = self.s.client().completions.create(model=MODEL_NAME, prompt="Hi", max_tokens=2, temperature=0)
        self.assertEqual(len(r.choices[0].token_ids), r.usage.completion_tokens)

    def test_400_messages_quote_at_most_a_bounded_value(self):
        err = self.expect_error(400, "/v1/completions", {"prompt": {"text": "x" * 100000}}, param="prompt")
        self.assertLess(len(err["message"]), 400)
        self.assertIn("an object of 1 fields", err["message"])

    def test_400_field_ranges_and_names(self):
        self.expect_error(400, "/v1/completions", {"prompt": "Hi", "logprobs": 4294967298}, param="logprobs")
        self.expect_error(400, "/v1/completions", {"prompt": "Hi", "logprobs": -1}, param="logprobs")
        self.expect_error(400, "/v1/completions", {"prompt": "Hi", "max_tokens": 100000},
                          param="prompt", code="context_length_exceeded")
        self.expect_error(400, "/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}],
                                                        "max_tokens": 100000},
                          param="messages", code="context_length_exceeded")
        self.expect_error(404, "/v1/completions", {"model": "nope", "prompt": "Hi"}, param="model",
                          code="model_not_found")

    def test_default_max_tokens_is_the_rest_of_the_context(self):
        prompt = [(7 * i) % 500 + 1 for i in range(4000)]  # 96 tokens short of tiny-a's 4096
        r = self.s.client().completions.create(model=MODEL_NAME, prompt=prompt, temperature=0,
                                               extra_body={"ignore_eos": True})
        self.assertEqual(r.usage.completion_tokens, 96)
        self.assertEqual(r.choices[0].finish_reason, "length")

    def test_echo_prompt_logprobs_equal_the_dumped_logits(self):
        # A prefix and its greedy continuation: the continuation's tokens are their rows' argmax.
        prefix = [(11 * i + 3) % 500 for i in range(30)]
        g = self.s.client().completions.create(model=MODEL_NAME, prompt=prefix, max_tokens=8, temperature=0,
                                               extra_body={"ignore_eos": True})
        prompt = prefix + g.choices[0].token_ids
        # As lm-eval's local-completions sends it: a list of token-id lists.
        r = self.s.client().completions.create(model=MODEL_NAME, prompt=[prompt], echo=True, logprobs=1, max_tokens=0)
        c = r.choices[0]
        lp = c.logprobs
        self.assertEqual(len(lp.token_logprobs), len(prompt))
        self.assertEqual(len(lp.tokens), len(prompt))
        self.assertIsNone(lp.token_logprobs[0])
        self.assertIsNone(lp.top_logprobs[0])
        self.assertEqual(lp.text_offset[0], 0)
        self.assertEqual(c.prompt_token_ids, prompt)
        self.assertEqual(c.token_ids, [])
        self.assertEqual(c.finish_reason, "length")
        self.assertEqual((r.usage.prompt_tokens, r.usage.completion_tokens), (len(prompt), 0))
        status, data = self.s.request("POST", "/detokenize", json.dumps({"tokens": prompt}))
        self.assertEqual(c.text, json.loads(data)["prompt"])
        rows = dumped_prefill_rows(prompt)
        greedy = 0
        for t in range(1, len(prompt)):
            self.assertLessEqual(lp.token_logprobs[t], 0.0)
            self.assertAlmostEqual(lp.token_logprobs[t], log_softmax_at(rows[t - 1], prompt[t]), delta=1e-5)
            top = lp.top_logprobs[t]
            self.assertEqual(top[lp.tokens[t]], lp.token_logprobs[t])  # the token itself is listed
            self.assertLessEqual(len(top), 2)
            if max(range(len(rows[t - 1])), key=lambda v: rows[t - 1][v]) == prompt[t]:
                greedy += 1
                self.assertEqual(max(top.values()), lp.token_logprobs[t])  # lm-eval's is_greedy test
        self.assertGreaterEqual(greedy, 6)

    def test_echo_with_completions_and_prompt_lists(self):
        p1, p2 = [(5 * i + 1) % 500 for i in range(12)], [(7 * i + 2) % 500 for i in range(70)]
        client = self.s.client()
        # lm-eval's loglikelihood request: prompts as token lists, max_tokens 1, logprobs 1.
        r = client.completions.create(model=MODEL_NAME, prompt=[p1, p2], echo=True, logprobs=1, max_tokens=1,
                                      temperature=0, seed=1234)
        self.assertEqual([c.index for c in r.choices], [0, 1])
        self.assertEqual(r.usage.prompt_tokens, len(p1) + len(p2))
        self.assertEqual(r.usage.completion_tokens, 2)
        for c, p in zip(r.choices, (p1, p2)):
            self.assertEqual(c.prompt_token_ids, p)
            self.assertEqual(len(c.token_ids), 1)
            self.assertEqual(len(c.logprobs.token_logprobs), len(p) + 1)
            self.assertEqual(c.logprobs.text_offset[len(p)], sum(len(t) for t in c.logprobs.tokens[:len(p)]))
        alone = client.completions.create(model=MODEL_NAME, prompt=p2, echo=True, logprobs=1, max_tokens=0)
        self.assertEqual(alone.choices[0].logprobs.token_logprobs, r.choices[1].logprobs.token_logprobs[:-1])
        # Text echo: the prompt's text, then the completion's.
        t = client.completions.create(model=MODEL_NAME, prompt="Hello", echo=True, max_tokens=3, temperature=0)
        plain = client.completions.create(model=MODEL_NAME, prompt="Hello", max_tokens=3, temperature=0)
        self.assertEqual(t.choices[0].text, "Hello" + plain.choices[0].text)
        self.assertIsNone(t.choices[0].logprobs)

    def test_echo_refusals(self):
        self.expect_error(400, "/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}], "echo": True},
                          param="echo")
        with self.assertRaises(openai.BadRequestError) as e:
            self.s.client().chat.completions.create(model=MODEL_NAME, messages=[{"role": "user", "content": "Hi"}],
                                                    extra_body={"echo": True})
        self.assertIn("echo", str(e.exception))
        self.expect_error(400, "/v1/completions", {"prompt": "Hi", "max_tokens": 0}, param="max_tokens")
        self.expect_error(400, "/v1/completions", {"prompt": "Hi", "echo": True, "stream": True}, param="echo")
        self.expect_error(400, "/v1/completions", {"prompt": "Hi", "echo": "yes"}, param="echo")
        self.expect_error(400, "/v1/completions", {"prompt": [[1, 2], []], "echo": True}, param="prompt")

    def test_echo_equals_batch_bitwise(self):
        served = served_echo(self, self.s)
        batch = batch_choices([dict(ECHO_BODY, custom_id="e"), {"custom_id": "c", "echo": True,
                                                          "messages": [{"role": "user", "content": "Hi"}]}])
        self.assertEqual(batch["e"][0]["logprobs"], served["logprobs"])
        self.assertEqual(batch["e"][0]["text"], served["text"])
        self.assertIn("field 'echo'", batch["c"]["message"])

    def test_tokenize_and_detokenize(self):
        def post(path, body):
            status, data = self.s.request("POST", path, json.dumps(body))
            return status, json.loads(data)
        status, t = post("/tokenize", {"model": MODEL_NAME, "prompt": "Hello world", "add_special_tokens": False})
        self.assertEqual(status, 200, t)
        self.assertEqual(t["count"], len(t["tokens"]))
        self.assertEqual(t["max_model_len"], 4096)
        self.assertEqual(post("/detokenize", {"tokens": t["tokens"]}), (200, {"prompt": "Hello world"}))
        # The ids answer as the text does.
        a = self.s.client().completions.create(model=MODEL_NAME, prompt="Hello world", max_tokens=4, temperature=0)
        b = self.s.client().completions.create(model=MODEL_NAME, prompt=t["tokens"], max_tokens=4, temperature=0)
        self.assertEqual(a.choices[0].token_ids, b.choices[0].token_ids)
        # messages: the chat prompt's tokens, as many as a chat completion counts.
        msgs = [{"role": "user", "content": "What is 2+2?"}]
        status, m = post("/tokenize", {"messages": msgs, "add_generation_prompt": True})
        self.assertEqual(status, 200, m)
        chat = self.s.client().chat.completions.create(model=MODEL_NAME, messages=msgs, max_tokens=1)
        self.assertEqual(m["count"], chat.usage.prompt_tokens)
        status, info = self.s.request("GET", "/tokenizer_info")
        self.assertEqual(status, 200)
        self.assertIn("eos_token", json.loads(info))
        # Bad input: 400 naming the field; the wrong model 404; the wrong method 405.
        self.expect_error(400, "/tokenize", {"add_special_tokens": False}, param="prompt")
        self.expect_error(400, "/tokenize", {"prompt": ["a"]}, param="prompt")
        self.expect_error(400, "/tokenize", {"prompt": "a", "add_special_tokens": 1}, param="add_special_tokens")
        self.expect_error(400, "/detokenize", {"tokens": [1, 512]}, param="tokens")
        self.expect_error(400, "/detokenize", {"tokens": "1 2"}, param="tokens")
        self.expect_error(400, "/detokenize", {}, param="tokens")
        self.expect_error(400, "/detokenize", "{nope", code="invalid_json")
        self.expect_error(404, "/tokenize", {"model": "nope", "prompt": "a"}, param="model")
        self.expect_error(405, "/tokenize", None, method="GET")

    def test_400_malformed_http(self):
        with socket.create_connection((self.s.host, self.s.port), timeout=10) as c:
            c.sendall(b"NOT HTTP AT ALL\r\n\r\n")
            self.assertIn(b" 400 ", c.recv(65536).split(b"\r\n")[0] + b" ")

    def test_404_unknown_path_and_model(self):
        self.expect_error(404, "/v1/nothing", None, method="GET")
        with self.assertRaises(openai.NotFoundError):
            self.s.client().completions.create(model="no-such-model", prompt="Hi", max_tokens=2)

    def test_405_wrong_method(self):
        self.expect_error(405, "/v1/completions", None, method="GET", code="method_not_allowed")

    def test_413_body_too_large(self):
        self.expect_error(413, "/v1/completions", json.dumps({"prompt": "x" * (9 << 20)}))

    def test_431_header_too_large(self):
        self.expect_error(431, "/v1/models", None, method="GET", headers={"X-Big": "y" * 20000})

    def test_disconnect_mid_stream_frees_the_sequence(self):
        before = self.s.metrics()
        c = socket.create_connection((self.s.host, self.s.port), timeout=30)
        body = json.dumps({"model": MODEL_NAME, "prompt": "Go on", "max_tokens": 4000, "ignore_eos": True,
                           "temperature": 0, "stream": True}).encode()
        c.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                  b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
        read_events(c, 3)
        c.close()
        m = wait_idle(self.s, before["glm5_serve_cancelled_total"] + 1)
        self.assertEqual(m["glm5_serve_cancelled_total"], before["glm5_serve_cancelled_total"] + 1)
        self.assertEqual(m["glm5_serve_requests_running"], 0)
        self.assertEqual(m["glm5_serve_kv_blocks_in_use"], 0)
        generated = m["glm5_serve_generation_tokens_total"] - before["glm5_serve_generation_tokens_total"]
        self.assertLess(generated, 4000)  # ended early, not run to max_tokens

    def test_expect_100_continue(self):
        with socket.create_connection((self.s.host, self.s.port), timeout=10) as c:
            body = json.dumps({"model": MODEL_NAME, "prompt": "Hi " * 600, "max_tokens": 2}).encode()
            c.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nExpect: 100-continue\r\n"
                      b"Content-Length: %d\r\n\r\n" % len(body))
            self.assertTrue(c.recv(100).startswith(b"HTTP/1.1 100 Continue"))
            c.sendall(body)
            self.assertTrue(c.recv(100).startswith(b"HTTP/1.1 200 OK"))

    def test_idle_and_keepalive(self):
        # Two requests on one keep-alive connection.
        c = http.client.HTTPConnection(self.s.host, self.s.port, timeout=30)
        for _ in range(2):
            c.request("GET", "/v1/models")
            r = c.getresponse()
            self.assertEqual(r.status, 200)
            r.read()
        c.close()


class Limits(unittest.TestCase):
    """Servers started with small limits: auth, read timeout, queue size, drain timeout."""

    def test_401_wrong_or_missing_key(self):
        s = Server("--api-key", "sekrit")
        try:
            self.assertEqual(s.request("GET", "/health")[0], 200)  # no key needed
            self.assertEqual(s.request("GET", "/v1/models")[0], 401)
            self.assertEqual(s.request("GET", "/metrics", headers={"Authorization": "Bearer wrong"})[0], 401)
            with self.assertRaises(openai.AuthenticationError):
                s.client("wrong").completions.create(model=MODEL_NAME, prompt="Hi", max_tokens=2)
            r = s.client("sekrit").completions.create(model=MODEL_NAME, prompt="Hi", max_tokens=2)
            self.assertEqual(len(r.choices[0].token_ids), r.usage.completion_tokens)
        finally:
            self.assertEqual(s.stop(), 0)

    def test_read_timeout_closes_a_slow_client(self):
        s = Server("--read-timeout", "1")
        try:
            c = socket.create_connection((s.host, s.port), timeout=10)
            c.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n")  # and never the rest
            t0 = time.time()
            self.assertEqual(c.recv(100), b"")  # closed by the server
            self.assertLess(time.time() - t0, 5)
            self.assertEqual(s.request("GET", "/health")[0], 200)  # the server goes on
        finally:
            self.assertEqual(s.stop(), 0)

    def test_429_queue_full(self):
        cfg = os.path.join(SCRATCH, "one-seq.yaml")
        with open(cfg, "w") as f:
            f.write("stages: 1\nexpert_parallel: 1\nmax_batch: 1\nbackend: cpu\n")
        s = Server("--max-queue", "1", cluster=cfg)
        try:
            # max_batch 1: the engine holds two requests (one running, one waiting), the queue one more.
            body = json.dumps({"prompt": "Hi", "max_tokens": 4000, "ignore_eos": True, "stream": True}).encode()
            held = []
            for k in range(1, 4):  # one at a time: two at once could find the queue full already
                c = socket.create_connection((s.host, s.port), timeout=30)
                c.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body))
                held.append(c)
                deadline = time.time() + 20
                while time.time() < deadline:
                    m = s.metrics()
                    # The engine has taken the first two (else the next would find the queue full).
                    if (m["glm5_serve_requests_running"], m["glm5_serve_queue_depth"]) == (min(k, 2), max(k - 2, 0)):
                        break
                    time.sleep(0.01)
            self.assertEqual(s.metrics()["glm5_serve_queue_depth"], 1)
            with self.assertRaises(openai.RateLimitError) as e:
                s.client().completions.create(model=MODEL_NAME, prompt="Hi", max_tokens=2)
            self.assertEqual(e.exception.status_code, 429)
            # More choices than the queue holds can never be accepted: 400 naming n, not 429.
            with self.assertRaises(openai.BadRequestError) as e:
                s.client().completions.create(model=MODEL_NAME, prompt="Hi", max_tokens=2, n=2)
            self.assertIn("'n'", str(e.exception))
            before = s.metrics()["glm5_serve_cancelled_total"]
            for c in held:
                c.close()  # cancelled: the queue has room again
            m = wait_idle(s, before + 3)
            self.assertEqual(m["glm5_serve_cancelled_total"], before + 3)
            self.assertEqual(m["glm5_serve_requests_running"], 0)
            self.assertEqual(m["glm5_serve_queue_depth"], 0)
            r = s.client().completions.create(model=MODEL_NAME, prompt="Hi", max_tokens=2)
            self.assertEqual(r.usage.completion_tokens, len(r.choices[0].token_ids))
        finally:
            self.assertEqual(s.stop(), 0)

    def test_503_new_requests_and_health_while_draining(self):
        s = Server("--drain-timeout", "120")  # a loaded machine: the stream may take long
        try:
            c = start_stream(s, max_tokens=4000)  # seconds: still running while we look
            os.kill(s.pid, signal.SIGTERM)
            deadline = time.time() + 10
            while "draining" not in s.stderr() and time.time() < deadline:
                time.sleep(0.02)
            self.assertEqual(s.request("GET", "/health"), (503, b'{"status":"draining"}'))
            status, data = s.request("POST", "/v1/completions", json.dumps({"prompt": "Hi", "max_tokens": 2}))
            self.assertEqual(status, 503, data)
            self.assertEqual(json.loads(data)["error"]["code"], "unavailable")
            rest = b""
            while not rest.endswith(b"0\r\n\r\n"):  # the accepted stream still ends whole
                more = c.recv(65536)
                self.assertTrue(more, rest[-300:])
                rest += more
            self.assertIn(b"data: [DONE]", rest)
            self.assertNotIn(b'"error"', rest)
            c.close()
            self.assertEqual(s.proc.wait(30), 0, s.stderr())
        finally:
            s.stop()

    def test_503_over_capacity_is_read_by_the_client(self):
        s = Server("--max-connections", "1")
        try:
            held = socket.create_connection((s.host, s.port), timeout=10)  # the one connection
            time.sleep(0.3)  # accepted: from now on every new connection is one too many
            for _ in range(20):  # a reset instead of the answer shows as an exception here
                status, data = s.request("POST", "/v1/completions",
                                         json.dumps({"prompt": "Hi " * 2000, "max_tokens": 2}))
                self.assertEqual(status, 503, data)
                self.assertEqual(json.loads(data)["error"]["code"], "unavailable")
            held.close()
            deadline, status = time.time() + 10, 0
            while time.time() < deadline and status != 200:  # the slot is free again
                status = s.request("GET", "/health")[0]
                time.sleep(0.05)  # (the last connection may still be closing)
            self.assertEqual(status, 200)
        finally:
            self.assertEqual(s.stop(), 0)

    def test_out_of_file_descriptors_backs_off_and_recovers(self):
        s = Server("--max-connections", "1000", nofile=64)
        held = []
        try:
            for _ in range(100):  # past the descriptor limit: the rest wait in the listen backlog
                held.append(socket.create_connection((s.host, s.port), timeout=10))
            time.sleep(0.3)
            cpu = s.cpu_seconds()
            time.sleep(1.0)
            self.assertLess(s.cpu_seconds() - cpu, 0.3)  # retried every 50 ms, not in a tight loop
            self.assertEqual(s.stderr().count("accept failed"), 1, s.stderr())
        finally:
            for c in held:
                c.close()
        deadline, status = time.time() + 20, 0
        while time.time() < deadline and status != 200:
            try:
                status = s.request("GET", "/health")[0]
            except OSError:
                time.sleep(0.1)
        self.assertEqual(status, 200)
        self.assertEqual(s.stop(), 0)

    def test_503_drain_timeout_cancels_and_exits_0(self):
        s = Server("--drain-timeout", "0.3")
        body = json.dumps({"model": MODEL_NAME, "prompt": "Go", "max_tokens": 4000, "ignore_eos": True,
                           "temperature": 0, "stream": True})
        c = http.client.HTTPConnection(s.host, s.port, timeout=30)
        c.request("POST", "/v1/completions", body)
        r = c.getresponse()
        self.assertEqual(r.status, 200)
        r.read1(100)  # the stream has started
        os.kill(s.pid, signal.SIGTERM)
        rest = r.read().decode(errors="replace")
        events = [e for e in rest.split("\n\n") if e.startswith("data: {\"error\"")]
        self.assertEqual(len(events), 1, rest[-500:])
        self.assertEqual(json.loads(events[0][6:])["error"]["code"], "unavailable")
        self.assertTrue(rest.rstrip().endswith("data: [DONE]"))
        self.assertEqual(s.proc.wait(30), 0, s.stderr())
        self.assertIn("drain timeout", s.stderr())


class Layout2x2(unittest.TestCase):
    def test_sigterm_to_launch_drains_the_job(self):
        # SIGTERM to mpirun itself kills the ranks about 2 s later (Open MPI 4.1); glm5 launch --run
        # turns it into SIGUSR1, which mpirun forwards and serve drains on.
        cfg = os.path.join(SCRATCH, "launch-2x2.yaml")
        with open(cfg, "w") as f:
            f.write("stages: 2\nexpert_parallel: 2\nmicro_batches: 2\nbackend: cpu\ncomm: mpi\n"
                    "mpirun_args: [\"--oversubscribe\", \"--mca\", \"btl\", \"self,vader,tcp\"]\n"
                    "env: {OMP_NUM_THREADS: \"1\"}\n")
        s = Server("--drain-timeout", "120", launch=cfg)
        try:
            c = start_stream(s, max_tokens=3000)  # ~2.5 s unloaded: past mpirun's kill, had it aborted
            t0 = time.time()
            os.kill(s.proc.pid, signal.SIGTERM)
            rest = b""
            while not rest.endswith(b"0\r\n\r\n"):
                more = c.recv(65536)
                self.assertTrue(more, "stream cut %.1f s after SIGTERM: %r" % (time.time() - t0, rest[-300:]))
                rest += more
            self.assertIn(b"data: [DONE]", rest)
            self.assertNotIn(b'"error"', rest)
            c.close()
            self.assertEqual(s.proc.wait(60), 0, s.stderr())
            self.assertIn("signal %d: draining" % signal.SIGUSR1, s.stderr())  # not mpirun's SIGTERM
            self.assertIn("drained", s.stderr())
        finally:
            if s.proc.poll() is None:  # mpirun is in its own process group: end the job via rank 0
                os.kill(s.pid, signal.SIGKILL)
                s.proc.wait(30)

    def test_answers_equal_batch_and_sigterm_exits_0(self):
        expected = batch_answers()
        s = Server(np=4, cluster=CLUSTER22)
        try:
            client = s.client()
            self.assertEqual(server_answers(client, stream=False), expected)
            self.assertEqual(server_answers(client, stream=True), expected)
            # A client gone mid-stream: its sequence ends while pipeline steps are in flight.
            before = s.metrics()
            start_stream(s, events=5).close()
            m = wait_idle(s, before["glm5_serve_cancelled_total"] + 1)
            self.assertEqual(m["glm5_serve_cancelled_total"], before["glm5_serve_cancelled_total"] + 1)
            self.assertEqual(m["glm5_serve_requests_running"], 0)
            self.assertEqual(m["glm5_serve_kv_blocks_in_use"], 0)
            self.assertEqual(server_answers(client, stream=False), expected)
            # Idle, the ranks wait instead of ticking every 2 ms (each tick: collectives on all).
            ranks = [int(p) for p in subprocess.run(["pgrep", "-P", str(s.proc.pid)], capture_output=True,
                                                    text=True).stdout.split()]
            self.assertEqual(len(ranks), 4)
            time.sleep(0.5)  # the back-off reaches its longest wait
            at = {p: cpu_seconds(p) for p in ranks}
            ticks = s.metrics()["glm5_serve_engine_ticks_total"]
            time.sleep(2)
            # About one tick per 50 ms (ticking every 2 ms would be ~1,000), and little CPU: 0.05-0.09 s
            # per rank here for those ticks' collectives, 0.1-0.25 s when it ticked every 2 ms.
            self.assertLess(s.metrics()["glm5_serve_engine_ticks_total"] - ticks, 80, "the idle engine ticks fast")
            for p in ranks:
                self.assertLess(cpu_seconds(p) - at[p], 0.15, "rank pid %d busy while idle" % p)
        finally:
            self.assertEqual(s.stop(), 0, s.stderr())
        self.assertIn("drained", s.stderr())


    def test_speculative_answers_equal_plain_batch(self):
        # MTP speculative decoding (3 drafts per step; the MTP layer on the last stage, its MoE over
        # the stage's exchange) on 2 x 2 ranks: the answers, whole and streamed, are the plain batch
        # job's token for token, and /metrics counts the verify steps.
        expected = batch_answers()
        s = Server("--speculative-tokens", "3", np=4, cluster=CLUSTER22)
        try:
            client = s.client()
            self.assertEqual(server_answers(client, stream=False), expected)
            self.assertEqual(server_answers(client, stream=True), expected)
            deadline = time.time() + 10  # the engine's counters are published every 0.5 s
            while s.metrics()['glm5_spec_verify_steps_total{rank="0"}'] == 0 and time.time() < deadline:
                time.sleep(0.1)
            m = s.metrics()
            self.assertGreater(m['glm5_spec_verify_steps_total{rank="0"}'], 0)
            self.assertGreaterEqual(m['glm5_spec_draft_tokens_total{rank="0"}'],
                                    m['glm5_spec_verify_steps_total{rank="0"}'])
        finally:
            self.assertEqual(s.stop(), 0, s.stderr())


def run_load(s, requests, stop_after=0):
    cmd = [sys.executable, os.path.join(SRC, "scripts", "serve_load.py"), "--base-url", s.url(), "--model",
           MODEL_NAME, "--clients", "64", "--requests", str(requests), "--max-tokens", "8"]
    if stop_after:
        cmd += ["--stop-after", str(stop_after)]
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True)


class Load(unittest.TestCase):
    def test_64_clients_1000_requests_no_error(self):
        s = Server()
        try:
            p = run_load(s, 1000)
            out = json.loads(p.communicate(timeout=300)[0])
            print(json.dumps(out), file=sys.stderr)
            self.assertEqual(out["errors"], 0, out["first_errors"])
            self.assertEqual(out["ok"], 1000)
            m = s.metrics()
            self.assertEqual(m['glm5_serve_requests_total{endpoint="/v1/completions",code="200"}'], 1000)
            self.assertEqual(m["glm5_serve_e2e_request_latency_seconds_count"], 1000)
        finally:
            self.assertEqual(s.stop(), 0)

    def test_sigterm_under_load_drains(self):
        s = Server()
        # Streams that are in flight when the signal comes must still end complete.
        results = []
        started = threading.Semaphore(0)

        def stream_one():
            try:
                n = 0
                for chunk in s.client().completions.create(model=MODEL_NAME, prompt="Long", max_tokens=300,
                                                           temperature=0, stream=True,
                                                           extra_body={"ignore_eos": True}):
                    if n == 0:
                        started.release()  # accepted and running
                    n += len(chunk.choices[0].token_ids) if chunk.choices else 0
                results.append(n)
            except Exception as e:  # noqa: BLE001
                results.append(repr(e))
                started.release()
        p = run_load(s, 100000, stop_after=3)
        time.sleep(1.0)
        streams = [threading.Thread(target=stream_one) for _ in range(8)]
        for t in streams:
            t.start()
        for _ in streams:
            self.assertTrue(started.acquire(timeout=30))
        os.kill(s.pid, signal.SIGTERM)
        for t in streams:
            t.join(60)
        self.assertEqual(s.proc.wait(60), 0, s.stderr())
        self.assertIn("drained", s.stderr())
        p.communicate(timeout=60)
        self.assertEqual(results, [300] * 8)  # accepted before the signal: finished whole


class FastPrecision(unittest.TestCase):
    """Precision fast: the server and the batch job are the same entry point to the same bits (greedy answers,
    streamed or not, and echoed prompt logprobs), as in exact."""

    @classmethod
    def setUpClass(cls):
        cls.batch = batch_answers("--precision", "fast")
        cls.s = Server("--precision", "fast")

    @classmethod
    def tearDownClass(cls):
        assert cls.s.stop() == 0, cls.s.stderr()

    def test_answers_equal_batch(self):
        self.assertEqual(server_answers(self.s.client(), stream=False), self.batch)
        self.assertEqual(server_answers(self.s.client(), stream=True), self.batch)

    def test_echo_equals_batch_bitwise_and_differs_from_exact(self):
        served = served_echo(self, self.s)
        fast = batch_choices([dict(ECHO_BODY, custom_id="e")], "--precision", "fast")
        exact = batch_choices([dict(ECHO_BODY, custom_id="e")])
        self.assertEqual(fast["e"][0]["logprobs"], served["logprobs"])
        self.assertNotEqual(exact["e"][0]["logprobs"]["token_logprobs"], served["logprobs"]["token_logprobs"])


if __name__ == "__main__":
    suites = {"api": [Api, Limits], "layout2x2": [Layout2x2], "load": [Load], "fast": [FastPrecision]}
    which = sys.argv.pop(1) if len(sys.argv) > 1 and sys.argv[1] in suites else "api"
    loader = unittest.TestLoader()
    suite = unittest.TestSuite(loader.loadTestsFromTestCase(c) for c in suites[which])
    res = unittest.TextTestRunner(verbosity=2).run(suite)
    sys.exit(0 if res.wasSuccessful() else 1)
