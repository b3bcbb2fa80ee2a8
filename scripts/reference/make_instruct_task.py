"""A toy instruction task for docs/finetune.md: "does this word contain an a?"

Writes chat-form JSON Lines (standard library only, deterministic):

    DIR/train.jsonl   examples to fine-tune on (default 2000)
    DIR/eval.jsonl    held-out examples for `nanogpt eval --data` (default 200)

Each line: {"messages": [{"role": "user", "content": "bcad"},
                         {"role": "assistant", "content": "yes"}]}
Words are 3 to 5 letters from a-h; about 4 in 10 contain an `a`.
"""

import argparse
import json
import os
import random


def examples(n, rng):
    for _ in range(n):
        word = "".join(rng.choice("abcdefgh") for _ in range(rng.randint(3, 5)))
        answer = "yes" if "a" in word else "no"
        yield {"messages": [{"role": "user", "content": word},
                            {"role": "assistant", "content": answer}]}


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="task")
    ap.add_argument("--train", type=int, default=2000)
    ap.add_argument("--eval", type=int, default=200)
    ap.add_argument("--seed", type=int, default=1)
    args = ap.parse_args()
    rng = random.Random(args.seed)
    os.makedirs(args.out, exist_ok=True)
    for name, n in (("train.jsonl", args.train), ("eval.jsonl", args.eval)):
        with open(os.path.join(args.out, name), "w", encoding="utf-8") as f:
            for ex in examples(n, rng):
                f.write(json.dumps(ex) + "\n")
    print(f"wrote {args.train} + {args.eval} examples to {args.out}/")


if __name__ == "__main__":
    main()
