"""Reference scores for `nanogpt eval --task` (tests/tasks.rs), from lm-evaluation-harness.

Scores two small task files with the harness's own code (its `hf` model over
`transformers`, its `hellaswag` preprocessing, its multiple-choice metrics) on the tiny
GPT-2 of tests/fixtures/instruct/model (GPT-2's vocabulary, a context of 64 tokens, so
that some questions take the harness's left-truncated window), and writes what
nanogpt must reproduce:

    tests/fixtures/tasks/hellaswag.jsonl   24 questions (scripts/eval/make_hellaswag_sample.py)
    tests/fixtures/tasks/choice.jsonl      questions of the generic {"context", "choices", "label"} form
    tests/fixtures/tasks/expected.json     per question the log-likelihood of each choice,
                                           and acc / acc_norm / acc_bytes with their stderr

The harness needs the model's tokenizer files, which `nanogpt export` writes:

    cargo build --release
    /work/venv/bin/pip install lm-eval
    /work/venv/bin/python scripts/reference/task_fixtures.py
    cargo test --release --test tasks
"""

import argparse
import json
import os
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
sys.path.insert(0, os.path.join(ROOT, "scripts", "eval"))

CHOICE = [
    {"context": "The capital of France is", "choices": ["Paris.", "a city in Spain.", "blue"], "label": 0},
    {"context": "Question: 2 + 2 = ?\nAnswer: ", "choices": ["4", "22", "five"], "label": 0},
    {"context": "", "choices": ["Hello world.", "<|endoftext|>x", "héllo"], "label": 2},
    {"context": "One, two,", "choices": ["three", "four", "three, four, five, six, seven, eight, nine, ten, eleven, twelve, thirteen, fourteen, fifteen, sixteen, seventeen, eighteen, nineteen, twenty, twenty-one, twenty-two, twenty-three, twenty-four, twenty-five"], "label": 1},
    {"context": "A single choice", "choices": ["only"], "label": 0},
]

TASK_YAML = """task: {name}
dataset_path: json
dataset_kwargs:
  data_files:
    validation: {path}
output_type: multiple_choice
validation_split: validation
{extra}
metric_list:
  - metric: acc
  - metric: acc_norm
  - metric: acc_bytes
"""

HELLASWAG = """process_docs: !function hs_utils.process_docs
doc_to_text: "{{query}}"
doc_to_target: "{{label}}"
doc_to_choice: "choices"
"""

GENERIC = """doc_to_text: "{{context}}"
doc_to_target: "{{label}}"
doc_to_choice: "{{choices}}"
"""


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=os.path.join(ROOT, "tests", "fixtures", "tasks"))
    ap.add_argument("--nanogpt", default=os.path.join(ROOT, "target", "release", "nanogpt"))
    args = ap.parse_args()
    os.environ.update(HF_DATASETS_OFFLINE="1", HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
    import random

    import make_hellaswag_sample as hs
    from lm_eval import simple_evaluate
    from lm_eval.tasks import TaskManager

    os.makedirs(args.out, exist_ok=True)
    rng = random.Random(7)
    hellaswag = os.path.join(args.out, "hellaswag.jsonl")
    with open(hellaswag, "w", encoding="utf-8") as f:
        for i in range(24):
            f.write(json.dumps(hs.question(i, rng), ensure_ascii=False) + "\n")
    choice = os.path.join(args.out, "choice.jsonl")
    with open(choice, "w", encoding="utf-8") as f:
        for q in CHOICE:
            f.write(json.dumps(q, ensure_ascii=False) + "\n")

    expected = {}
    with tempfile.TemporaryDirectory() as tmp:
        model = os.path.join(tmp, "model")
        src = os.path.join(ROOT, "tests", "fixtures", "instruct", "model")
        subprocess.run([args.nanogpt, "export", "--from", src, "--to", model], check=True)
        tasks = os.path.join(tmp, "tasks")
        os.makedirs(tasks)
        with open(os.path.join(tasks, "hs_utils.py"), "w") as f:
            f.write("from lm_eval.tasks.hellaswag.utils import process_docs  # noqa: F401\n")
        for name, path, extra in [("t_hellaswag", hellaswag, HELLASWAG), ("t_choice", choice, GENERIC)]:
            with open(os.path.join(tasks, name + ".yaml"), "w") as f:
                f.write(TASK_YAML.format(name=name, path=path, extra=extra))
        out = simple_evaluate(
            model="hf",
            model_args=f"pretrained={model},dtype=float32",
            tasks=["t_hellaswag", "t_choice"],
            task_manager=TaskManager(include_path=tasks),
            batch_size=1,
            device="cpu",
            log_samples=True,
        )
        for name in ["t_hellaswag", "t_choice"]:
            samples = sorted(out["samples"][name], key=lambda s: s["doc_id"])
            metrics = out["results"][name]
            expected[name[2:]] = {
                "loglikelihoods": [[float(r[0][0]) for r in s["resps"]] for s in samples],
                **{m: metrics[f"{m},none"] for m in ["acc", "acc_norm", "acc_bytes"]},
                **{f"{m}_stderr": metrics[f"{m}_stderr,none"] for m in ["acc", "acc_norm", "acc_bytes"]},
            }
    with open(os.path.join(args.out, "expected.json"), "w") as f:
        json.dump(expected, f, indent=1)
        f.write("\n")
    for name, e in expected.items():
        lls = e["loglikelihoods"]
        gaps = [sorted(x)[-1] - sorted(x)[-2] for x in lls if len(x) > 1]
        print(f"{name}: {len(lls)} questions, acc {e['acc']:.4f}, acc_norm {e['acc_norm']:.4f}, "
              f"smallest gap between the best two sums {min(gaps):.2e}")


if __name__ == "__main__":
    main()
