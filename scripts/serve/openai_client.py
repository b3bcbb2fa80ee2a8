"""The `openai` Python client against `nanogpt serve`: completions, chat, streaming and
logprobs work, and greedy text is `nanogpt sample --temperature 0`'s.

Starts `nanogpt serve --init-from MODEL` on a free loopback port with an API key, talks
to it with `openai.OpenAI(base_url=...)`, checks each answer, and prints what it did:

    cargo build --release
    /work/venv/bin/pip install openai
    /work/venv/bin/python scripts/serve/openai_client.py --model /tmp/small_hf
"""

import argparse
import os
import re
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True, help="anything `serve --init-from` takes")
    ap.add_argument("--nanogpt", default=os.path.join(ROOT, "target", "release", "nanogpt"))
    ap.add_argument("--prompt", default="ROMEO:\nWhat light through yonder")
    ap.add_argument("--tokens", type=int, default=40)
    args = ap.parse_args()
    import openai

    key = "sk-local-check"
    server = subprocess.Popen([args.nanogpt, "serve", "--init-from", args.model, "--port", "0",
                               "--api-key", key], stderr=subprocess.PIPE, text=True)
    try:
        port = re.search(r"http://127\.0\.0\.1:(\d+)", server.stderr.readline()).group(1)
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key=key)
        name = client.models.list().data[0].id
        print(f"models: {name}")

        # Greedy completion, equal to `sample`.
        done = client.completions.create(model=name, prompt=args.prompt, max_tokens=args.tokens, temperature=0)
        text = done.choices[0].text
        sampled = subprocess.run(
            [args.nanogpt, "sample", "--init-from", args.model, "--start", args.prompt, "--num-samples", "1",
             "--max-new-tokens", str(args.tokens), "--temperature", "0"],
            check=True, capture_output=True, text=True).stdout
        # `sample` prints the prompt, the text and a newline.
        sampled = sampled[len(args.prompt):-1].split("<|endoftext|>")[0]
        assert text == sampled, f"server {text!r}\nsample {sampled!r}"
        print(f"completions: greedy text equal to `sample` ({done.usage.completion_tokens} tokens, "
              f"finish_reason {done.choices[0].finish_reason}): {text[:60]!r}...")

        # Streaming gives the same text.
        pieces = [c.choices[0].text for c in client.completions.create(
            model=name, prompt=args.prompt, max_tokens=args.tokens, temperature=0, stream=True) if c.choices]
        assert "".join(pieces) == text
        print(f"completions, streamed: {len(pieces)} chunks, same text")

        # Logprobs with echo (lm-evaluation-harness's loglikelihood request).
        lp = client.completions.create(model=name, prompt=args.prompt, max_tokens=1, temperature=0,
                                       logprobs=3, echo=True).choices[0].logprobs
        assert lp.token_logprobs[0] is None and all(x < 0 for x in lp.token_logprobs[1:])
        assert all(len(t) == 3 for t in lp.top_logprobs[1:])
        print(f"completions, echo + logprobs: {len(lp.tokens)} tokens, first {lp.tokens[:4]}, "
              f"log-probabilities {[round(x, 3) for x in lp.token_logprobs[1:4]]}")

        # Chat, whole and streamed, with logprobs.
        messages = [{"role": "system", "content": "You are brief."}, {"role": "user", "content": "Who art thou?"}]
        chat = client.chat.completions.create(model=name, messages=messages, max_tokens=args.tokens,
                                              temperature=0, logprobs=True, top_logprobs=2)
        reply = chat.choices[0].message.content
        assert len(chat.choices[0].logprobs.content) == chat.usage.completion_tokens
        streamed = "".join(c.choices[0].delta.content or "" for c in client.chat.completions.create(
            model=name, messages=messages, max_tokens=args.tokens, temperature=0, stream=True) if c.choices)
        assert streamed == reply
        print(f"chat: {chat.usage.prompt_tokens} prompt tokens in the template, reply {reply[:60]!r}..., "
              f"streamed the same, {len(chat.choices[0].logprobs.content)} logprobs")

        # Sampling with a seed repeats; errors come back as openai's exceptions.
        a = client.completions.create(model=name, prompt=args.prompt, max_tokens=20, temperature=0.9, seed=7)
        b = client.completions.create(model=name, prompt=args.prompt, max_tokens=20, temperature=0.9, seed=7)
        assert a.choices[0].text == b.choices[0].text
        try:
            client.completions.create(model=name, prompt=args.prompt, max_tokens=-1)
            raise AssertionError("a negative max_tokens was accepted")
        except openai.BadRequestError as e:
            print(f"errors: {e.status_code} {e.body['message']!r}")
        try:
            openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="wrong").models.list()
            raise AssertionError("a wrong key was accepted")
        except openai.AuthenticationError as e:
            print(f"auth: {e.status_code} with a wrong key")
        print("all checks passed")
    finally:
        server.terminate()
        server.wait()


if __name__ == "__main__":
    sys.exit(main())
