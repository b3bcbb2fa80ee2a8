"""lm-evaluation-harness on `nanogpt serve` against the harness on the same weights in
`transformers`: the same numbers are expected (issue 37's ±1e-4).

Runs, offline, three small tasks written here (in a temporary folder):

    hellaswag_sample   multiple_choice  HellaSwag-format questions (make_hellaswag_sample.py)
    shakespeare_last   loglikelihood    a line of the bundled Shakespeare less its last word,
                                        the word to score (perplexity, acc = greedy)
    shakespeare_next   generate_until   the first words of a line; greedy until a newline
                                        (exact_match against the rest of the line)

first with `lm_eval --model hf` on MODEL (a Hugging Face GPT-2 folder, e.g. from
`nanogpt export`), then with `lm_eval --model local-completions` against `nanogpt serve
--init-from MODEL` on a free loopback port (the harness reads the server's tokenizer
through /tokenizer_info, /tokenize and /detokenize), and compares every metric and every
sample's answer:

    cargo build --release
    /work/venv/bin/pip install "lm-eval[api]"   # the api extra: local-completions
    /work/venv/bin/python scripts/eval/lm_eval_vs_serve.py --model /tmp/m124_hf
"""

import argparse
import glob
import json
import os
import random
import re
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
sys.path.insert(0, HERE)

MC_YAML = """task: hellaswag_sample
dataset_path: json
dataset_kwargs: {{data_files: {{validation: {path}}}}}
output_type: multiple_choice
validation_split: validation
process_docs: !function hs_utils.process_docs
doc_to_text: "{{{{query}}}}"
doc_to_target: "{{{{label}}}}"
doc_to_choice: "choices"
metric_list: [{{metric: acc}}, {{metric: acc_norm}}, {{metric: acc_bytes}}]
"""
LL_YAML = """task: shakespeare_last
dataset_path: json
dataset_kwargs: {{data_files: {{validation: {path}}}}}
output_type: loglikelihood
validation_split: validation
doc_to_text: "{{{{context}}}}"
doc_to_target: "{{{{target}}}}"
target_delimiter: ""
metric_list: [{{metric: perplexity}}, {{metric: acc}}]
"""
GEN_YAML = """task: shakespeare_next
dataset_path: json
dataset_kwargs: {{data_files: {{validation: {path}}}}}
output_type: generate_until
validation_split: validation
doc_to_text: "{{{{context}}}}"
doc_to_target: "{{{{target}}}}"
target_delimiter: ""
generation_kwargs: {{until: ["\\n"], do_sample: false, max_gen_toks: 24}}
metric_list: [{{metric: exact_match}}]
"""


def write_tasks(tmp, n):
    import make_hellaswag_sample as hs

    rng = random.Random(1)
    with open(os.path.join(tmp, "mc.jsonl"), "w") as f:
        for i in range(n):
            f.write(json.dumps(hs.question(i, rng), ensure_ascii=False) + "\n")
    text = open(os.path.join(ROOT, "data", "shakespeare", "input.txt"), encoding="utf-8").read()
    lines = [l for l in text.split("\n") if len(l.split()) >= 6]
    lines = random.Random(2).sample(lines, n)
    with open(os.path.join(tmp, "ll.jsonl"), "w") as f:
        for l in lines:
            head, last = l.rsplit(" ", 1)
            f.write(json.dumps({"context": head, "target": " " + last}) + "\n")
    with open(os.path.join(tmp, "gen.jsonl"), "w") as f:
        for l in lines:
            words = l.split(" ")
            f.write(json.dumps({"context": " ".join(words[:3]), "target": " " + " ".join(words[3:])}) + "\n")
    with open(os.path.join(tmp, "hs_utils.py"), "w") as f:
        f.write("from lm_eval.tasks.hellaswag.utils import process_docs  # noqa: F401\n")
    for name, yaml, data in [("mc", MC_YAML, "mc.jsonl"), ("ll", LL_YAML, "ll.jsonl"), ("gen", GEN_YAML, "gen.jsonl")]:
        with open(os.path.join(tmp, name + ".yaml"), "w") as f:
            f.write(yaml.format(path=os.path.join(tmp, data)))


def lm_eval(tmp, out, model, model_args, extra=()):
    cmd = [os.path.join(os.path.dirname(sys.executable), "lm_eval"), "--model", model,
           "--model_args", model_args, "--tasks", "hellaswag_sample,shakespeare_last,shakespeare_next",
           "--include_path", tmp, "--log_samples", "--output_path", out, *extra]
    start = time.time()
    run = subprocess.run(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    if run.returncode != 0:
        sys.exit(f"lm_eval --model {model} failed ({run.returncode}):\n" + run.stderr[-3000:])
    results = json.load(open(glob.glob(os.path.join(out, "*", "results_*.json"))[0]))["results"]
    samples = {}
    for path in glob.glob(os.path.join(out, "*", "samples_*.jsonl")):
        task = re.match(r"samples_(.*)_\d{4}-", os.path.basename(path)).group(1)
        samples[task] = sorted((json.loads(l) for l in open(path)), key=lambda s: s["doc_id"])
    return results, samples, time.time() - start


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True, help="a Hugging Face GPT-2 folder")
    ap.add_argument("--nanogpt", default=os.path.join(ROOT, "target", "release", "nanogpt"))
    ap.add_argument("-n", type=int, default=100, help="examples per task")
    args = ap.parse_args()
    os.environ.update(HF_DATASETS_OFFLINE="1", HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
    block = json.load(open(os.path.join(args.model, "config.json")))["n_positions"]
    with tempfile.TemporaryDirectory() as tmp:
        write_tasks(tmp, args.n)
        hf = lm_eval(tmp, os.path.join(tmp, "out_hf"), "hf",
                     f"pretrained={args.model},dtype=float32,max_length={block}", ["--batch_size", "1", "--device", "cpu"])
        server = subprocess.Popen([args.nanogpt, "serve", "--init-from", args.model, "--port", "0"],
                                  stderr=subprocess.PIPE, text=True)
        try:
            line = server.stderr.readline()
            port = re.search(r"http://127\.0\.0\.1:(\d+)", line).group(1)
            srv = lm_eval(tmp, os.path.join(tmp, "out_srv"), "local-completions",
                          f"model=m,base_url=http://127.0.0.1:{port}/v1/completions,max_length={block}")
        finally:
            server.terminate()
            server.wait()
    worst, failed = 0.0, False
    # Differences relative to the value where it is above 1 (perplexity).
    print(f"{'task':<18} {'metric':<12} {'hf':>14} {'serve':>14} {'diff':>9}")
    for task in sorted(hf[0]):
        for key, value in sorted(hf[0][task].items()):
            if not isinstance(value, float) or "stderr" in key:
                continue
            other = srv[0][task][key]
            diff = abs(value - other) / max(1.0, abs(value))
            worst = max(worst, diff)
            failed |= diff > 1e-4
            print(f"{task:<18} {key.split(',')[0]:<12} {value:14.6f} {other:14.6f} {diff:9.2e}")
    for task, samples in hf[1].items():
        for a, b in zip(samples, srv[1][task]):
            ra, rb = a["filtered_resps"], b["filtered_resps"]
            if task == "shakespeare_next":
                failed |= ra != rb
                if ra != rb:
                    print(f"{task} doc {a['doc_id']}: hf {ra!r}, serve {rb!r}")
            else:
                for x, y in zip(ra, rb):
                    if abs(float(x[0]) - float(y[0])) > 1e-3 or x[1] != y[1]:
                        print(f"{task} doc {a['doc_id']}: hf {x}, serve {y}")
    print(f"largest metric difference {worst:.2e}; lm_eval took {hf[2]:.0f} s on hf, {srv[2]:.0f} s on serve")
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
