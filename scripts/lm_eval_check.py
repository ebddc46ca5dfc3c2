#!/usr/bin/env python3
# lm-evaluation-harness against `glm5 serve`: a loglikelihood task and a generate_until task on held-out KJV
# verses (tests/data/glm5-kjv/heldout.txt), through lm-eval's `local-completions` model (token-id prompts,
# echo + logprobs for loglikelihood), and a check that every loglikelihood lm-eval got from the server equals
# the one glm5 computes itself for the same tokens (`glm5 generate --dump-logits`: the prompt logits that
# `glm5 perplexity` scores, log-softmax in float64) within 1e-4, and that is_greedy agrees.
#
#   python3 scripts/lm_eval_check.py --glm5 build/glm5 [--model tests/data/glm5-kjv] [--docs 40]
# Pinned: scripts/requirements-eval.txt (lm-eval 0.4.13 and its API extra). Starts and stops the server itself.
# Exit code 77 (skipped) where lm-eval is not installed.

import argparse
import glob
import json
import os
import socket
import subprocess
import sys
import tempfile
import time

try:
    import lm_eval  # noqa: F401
    import numpy as np
    import safetensors  # noqa: F401
    import transformers  # noqa: F401
except ImportError as e:  # the ctest is skipped where lm-eval is not installed
    print(f"skipped: {e}", file=sys.stderr)
    sys.exit(77)


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def make_tasks(model_dir, tmp, n_docs):
    """Pairs of consecutive held-out verses: context = a verse and a newline, continuation = the next verse."""
    verses = [v for v in open(os.path.join(model_dir, "heldout.txt"), encoding="utf-8").read().split("\n") if v]
    docs = [{"context": verses[i] + "\n", "continuation": verses[i + 1]} for i in range(0, 2 * n_docs, 2)]
    data = os.path.join(tmp, "kjv_pairs.jsonl")
    with open(data, "w") as f:
        for d in docs:
            f.write(json.dumps(d) + "\n")
    common = f"dataset_path: json\ndataset_kwargs:\n  data_files:\n    test: {data}\ntest_split: test\n"
    with open(os.path.join(tmp, "kjv_loglik.yaml"), "w") as f:
        f.write("task: kjv_loglik\n" + common + "output_type: loglikelihood\n"
                "doc_to_text: \"{{context}}\"\ndoc_to_target: \"{{continuation}}\"\n"
                "target_delimiter: \"\"\nmetric_list:\n  - metric: acc\n")
    with open(os.path.join(tmp, "kjv_generate.yaml"), "w") as f:
        f.write("task: kjv_generate\n" + common + "output_type: generate_until\n"
                "doc_to_text: \"{{context}}\"\ndoc_to_target: \"{{continuation}}\"\n"
                "target_delimiter: \"\"\ngeneration_kwargs:\n  until: [\"\\n\"]\n  max_gen_toks: 24\n"
                "  do_sample: false\nmetric_list:\n  - metric: exact_match\n")
    return docs


def start_server(glm5, model_dir, port, log):
    srv = subprocess.Popen([glm5, "serve", "--model", model_dir, "--port", str(port), "--served-model-name", "glm5-kjv"],
                           stdout=log, stderr=subprocess.STDOUT)
    import urllib.request
    for _ in range(300):
        try:
            urllib.request.urlopen(f"http://127.0.0.1:{port}/v1/models", timeout=1)
            return srv
        except Exception:
            if srv.poll() is not None:
                raise SystemExit(f"glm5 serve exited with {srv.returncode}; see {log.name}")
            time.sleep(0.2)
    srv.kill()
    raise SystemExit("glm5 serve did not answer within 60 s")


def own_loglikelihood(glm5, model_dir, ctx_ids, cont_ids, tmp):
    """Sum of log-softmax(prompt logits of row p-1)[token p] over the continuation, and whether each is the argmax."""
    ids = ctx_ids + cont_ids
    dump = os.path.join(tmp, "dump.safetensors")
    subprocess.run([glm5, "generate", "--model", model_dir, "--prompt-ids", ",".join(map(str, ids)),
                    "--max-new-tokens", "1", "--temperature", "0", "--dump-logits", dump],
                   check=True, capture_output=True)
    from safetensors.numpy import load_file
    logits = load_file(dump)["prefill_logits"].astype(np.float64)
    total, greedy = 0.0, True
    for p in range(len(ctx_ids), len(ids)):
        row = logits[p - 1]
        m = row.max()
        total += row[ids[p]] - m - np.log(np.exp(row - m).sum())
        greedy = greedy and int(np.argmax(row)) == ids[p]
    return total, greedy


def main():
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--glm5", required=True)
    ap.add_argument("--model", default="tests/data/glm5-kjv")
    ap.add_argument("--docs", type=int, default=40)
    args = ap.parse_args()
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(args.model)
    port = free_port()
    with tempfile.TemporaryDirectory() as tmp:
        docs = make_tasks(args.model, tmp, args.docs)
        log = open(os.path.join(tmp, "serve.log"), "w")
        srv = start_server(args.glm5, args.model, port, log)
        try:
            out = os.path.join(tmp, "out")
            cmd = [sys.executable, "-m", "lm_eval", "--model", "local-completions", "--model_args",
                   f"base_url=http://127.0.0.1:{port}/v1/completions,model=glm5-kjv,tokenizer_backend=huggingface,"
                   f"tokenizer={args.model},tokenized_requests=True,max_length=1024,num_concurrent=4",
                   "--tasks", "kjv_loglik,kjv_generate", "--include_path", tmp, "--log_samples", "--output_path", out]
            r = subprocess.run(cmd, capture_output=True, text=True)
            print(r.stdout[-3000:])
            if r.returncode:
                print(r.stderr[-4000:], file=sys.stderr)
                raise SystemExit(f"lm_eval failed with exit code {r.returncode}")
        finally:
            srv.terminate()
            srv.wait(timeout=60)
        samples = {}
        for path in glob.glob(os.path.join(out, "**", "samples_*.jsonl"), recursive=True):
            task = "kjv_loglik" if "kjv_loglik" in path else "kjv_generate"
            samples[task] = [json.loads(line) for line in open(path)]
        loglik = samples.get("kjv_loglik", [])
        gen = samples.get("kjv_generate", [])
        if len(loglik) != len(docs) or len(gen) != len(docs):
            raise SystemExit(f"lm_eval logged {len(loglik)} loglikelihood and {len(gen)} generation samples, "
                             f"expected {len(docs)} each")
        worst, greedy_mismatch = 0.0, 0
        for s in loglik:
            context, cont = s["arguments"]["gen_args_0"]["arg_0"], s["arguments"]["gen_args_0"]["arg_1"]
            # lm-eval's own split (TemplateLM._encode_pair): trailing spaces of the context move to the continuation
            n_spaces = len(context) - len(context.rstrip())
            if n_spaces:
                cont, context = context[-n_spaces:] + cont, context[:-n_spaces]
            whole = tok(context + cont, add_special_tokens=False).input_ids
            ctx_ids = tok(context, add_special_tokens=False).input_ids
            ll, greedy = own_loglikelihood(args.glm5, args.model, ctx_ids, whole[len(ctx_ids):], tmp)
            theirs, their_greedy = s["resps"][0][0]  # logged as strings: ["-197.63...", "False"]
            their_greedy = their_greedy in (True, "True")
            worst = max(worst, abs(float(theirs) - ll))
            greedy_mismatch += their_greedy != greedy
        ok = worst < 1e-4 and greedy_mismatch == 0
        print(f"{len(loglik)} loglikelihoods from lm-eval through glm5 serve against glm5's own: max |difference| "
              f"{worst:.3g} (limit 1e-4), is_greedy disagreements {greedy_mismatch}; "
              f"{len(gen)} generate_until samples without error: {'ok' if ok else 'FAIL'}")
        sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
