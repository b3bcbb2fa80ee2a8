"""A small HellaSwag-format file, for checking `nanogpt eval --task hellaswag` against
lm-evaluation-harness where the real HellaSwag cannot be downloaded.

Writes N questions (default 200) in HellaSwag's own jsonl layout (`ind`,
`activity_label`, `ctx_a`, `ctx_b`, `ctx`, `endings`, `label`, `source_id`, `split`,
`split_type`), with what makes the harness's preprocessing matter: WikiHow markup
(`[header]`, `[title]`, `[step]`, `[substeps]`), ctx_b in mixed case (capitalised by
the harness), doubled spaces, stray brackets, a few non-ASCII words; labels are strings,
as in the Hugging Face copy. Deterministic (seeded), standard library only:

    python3 scripts/eval/make_hellaswag_sample.py --out /tmp/hellaswag_sample.jsonl
"""

import argparse
import json
import random

ACTIVITIES = [
    "Removing ice from car", "Baking cookies", "Playing guitar", "Washing dishes",
    "Painting a fence", "Making a sandwich", "Shoveling snow", "Brushing teeth",
    "Tying shoes", "Home and Garden", "Personal Care and Style", "Food and Entertaining",
    "Sports and Fitness", "Café culture", "Pets and Animals",
]
PEOPLE = ["a man", "a woman", "the girl", "two boys", "an older man", "the chef",
          "a young woman", "the instructor", "a crowd", "the dog"]
VERBS = ["picks up", "puts down", "holds", "shows", "cleans", "throws", "points at",
         "walks toward", "smiles at", "talks about"]
THINGS = ["a brush", "the camera", "a bowl of flour", "the snow", "a guitar",
          "the fence", "a sponge", "the ball", "a knife", "the window", "a crêpe pan"]
AFTER = ["then", "Then", "she", "He", "they", "THE MAN", "the woman", "it", "we see",
         "The camera pans and"]
ENDINGS = [
    "continues {v} {t} while {p} watches.",
    "{v} {t} and leaves the room.",
    "is shown again {v} {t} in slow motion.",
    "falls over and {v} {t}.",
    "[step] Finally, {p} {v} {t}.",
    "{v} {t}  before turning to the crowd.",
    "begins to dance around {t}.",
    "sits down next to {t} and rests.",
]
WIKI_STEPS = [
    "[header] How to {a} [title] Gather your supplies. [step] You will need {t}.",
    "[title] Prepare the area. [step] Make sure {t} is clean before you start.",
    "[header] Using {t} [title] Hold it firmly. [substeps] Keep your hands dry.",
    "Learn the basics [title] Watch {p} carefully.",
]


def ending(rng):
    return rng.choice(ENDINGS).format(v=rng.choice(VERBS), t=rng.choice(THINGS),
                                      p=rng.choice(PEOPLE))


def question(i, rng):
    wiki = rng.random() < 0.4
    activity = rng.choice(ACTIVITIES)
    if wiki:
        ctx_a = rng.choice(WIKI_STEPS).format(a=activity.lower(), t=rng.choice(THINGS),
                                             p=rng.choice(PEOPLE))
        ctx_b = rng.choice(["", "[step] " + rng.choice(AFTER), rng.choice(AFTER)])
    else:
        ctx_a = (f"{rng.choice(PEOPLE).capitalize()} {rng.choice(VERBS)} "
                 f"{rng.choice(THINGS)}.")
        if rng.random() < 0.5:
            ctx_a += f" {rng.choice(PEOPLE).capitalize()} {rng.choice(VERBS)} {rng.choice(THINGS)}."
        ctx_b = rng.choice(AFTER)
    endings = [ending(rng) for _ in range(4)]
    if rng.random() < 0.1:
        endings[rng.randrange(4)] += " [unclosed"
    if rng.random() < 0.2:
        ctx_a = "  " + ctx_a + "  "
    label = rng.randrange(4)
    return {
        "ind": i,
        "activity_label": activity,
        "ctx_a": ctx_a,
        "ctx_b": ctx_b,
        "ctx": f"{ctx_a} {ctx_b}",
        "endings": endings,
        "source_id": f"{'wikihow' if wiki else 'activitynet'}~{i}",
        "split": "val",
        "split_type": "indomain",
        "label": str(label),
    }


def main():
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True)
    ap.add_argument("-n", type=int, default=200)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    rng = random.Random(args.seed)
    with open(args.out, "w", encoding="utf-8") as f:
        for i in range(args.n):
            f.write(json.dumps(question(i, rng), ensure_ascii=False) + "\n")


if __name__ == "__main__":
    main()
