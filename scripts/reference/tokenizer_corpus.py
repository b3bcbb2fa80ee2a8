"""The texts the tokenizer fixtures are made of (see tokenizer_fixtures.py): every
script and shape of text a tokenizer has a rule for."""

SHAKESPEARE = (
    "First Citizen:\nBefore we proceed any further, hear me speak.\n\nAll:\nSpeak, speak.\n\n"
    "First Citizen:\nYou are all resolved rather to die than to famish?\n"
)

CODE_PY = '''def fib(n: int) -> int:
    """Return the n-th Fibonacci number."""
    a, b = 0, 1
    for _ in range(n):
        a, b = b, a + b  # tuple swap
    return a


if __name__ == "__main__":
\tprint(fib(10), f"{fib(20):>8}")
'''

CODE_RUST = '''fn main() {
    let v: Vec<u32> = (0..10).map(|x| x * x).collect();
    println!("{:?} {}", v, v.iter().sum::<u32>());
}
'''

CODE_JSON = '{"name": "nanogpt", "version": [0, 1, 0], "ok": true, "ratio": 0.25, "none": null}'

HTML = '<div class="x"><p>Hello&nbsp;<b>world</b></p><!-- note --></div>\r\n'

CORPUS = [
    "",
    " ",
    "a",
    "Hello world",
    "Hello world!",
    " Hello  world  ",
    "hello\nworld\n",
    SHAKESPEARE,
    # contractions, case, quotes
    "I'm sure it's fine, isn't it? You'LL see. WE'VE DONE IT'S",
    "She said \u201cit\u2019s done\u201d \u2014 and left\u2026",
    "'s 't 're 've 'm 'll 'd 'S 'T",
    # numbers
    "1 12 123 1234 12345 123456 1234567890",
    "3.14159 -2.5e-10 1,000,000 0x1F 007 1/2 50%",
    "\u0661\u0662\u0663 \u0967\u0968\u0969 \u2460\u2461 \uff11\uff12\uff13 \u00bd \u00b2",
    "version 2.0.1-rc3 on 2024-07-26 at 13:45:00Z",
    # whitespace runs
    "a  b   c    d     e",
    "tabs\tand\t\ttabs\t\t\t!",
    "line\n\nbreak\n\n\n\nmore\r\nwindows\r\n\r\nend",
    "   leading and trailing   ",
    "\n\n\n",
    " " * 40 + "x",
    "x" + " " * 17 + "\n" + " " * 9 + "y",
    "\t\n \t\n  \u00a0\u00a0non-breaking\u3000ideographic\u2003em\u2028line\u2029para",
    "word \n  word\n\t word",
    # Latin scripts, accents, composed and decomposed forms
    "Cr\u00e8me br\u00fbl\u00e9e, na\u00efve caf\u00e9, \u00c5ngstr\u00f6m, \u00df \u1e9e \u0152uvre",
    "Cre\u0300me bru\u0302le\u0301e (decomposed e\u0301 and a\u030a)",
    "Za\u017c\u00f3\u0142\u0107 g\u0119\u015bl\u0105 ja\u017a\u0144 \u2014 \u0159e\u0161it \u00fa\u017eas\u0148\u00fd",
    "T\u00fcrk\u00e7e \u0130stanbul \u0131\u015f\u0131k; Ti\u1ebfng Vi\u1ec7t c\u00f3 d\u1ea5u",
    # other scripts
    "\u0395\u03bb\u03bb\u03b7\u03bd\u03b9\u03ba\u03ac: \u039a\u03b1\u03bb\u03b7\u03bc\u03ad\u03c1\u03b1 \u03ba\u03cc\u03c3\u03bc\u03b5",
    "\u0420\u0443\u0441\u0441\u043a\u0438\u0439 \u0442\u0435\u043a\u0441\u0442: \u041f\u0440\u0438\u0432\u0435\u0442, \u043c\u0438\u0440! \u0401\u0436\u0438\u043a.",
    "\u0627\u0644\u0639\u0631\u0628\u064a\u0629: \u0645\u0631\u062d\u0628\u0627 \u0628\u0627\u0644\u0639\u0627\u0644\u0645 \u0661\u0662",
    "\u05e2\u05d1\u05e8\u05d9\u05ea: \u05e9\u05dc\u05d5\u05dd \u05e2\u05d5\u05dc\u05dd",
    "\u0939\u093f\u0928\u094d\u0926\u0940: \u0928\u092e\u0938\u094d\u0924\u0947 \u0926\u0941\u0928\u093f\u092f\u093e",
    "\u0e20\u0e32\u0e29\u0e32\u0e44\u0e17\u0e22: \u0e2a\u0e27\u0e31\u0e2a\u0e14\u0e35\u0e0a\u0e32\u0e27\u0e42\u0e25\u0e01",
    "\u4e2d\u6587\uff1a\u4f60\u597d\uff0c\u4e16\u754c\uff01\u6211\u4eec\u5728\u8bad\u7ec3\u8bed\u8a00\u6a21\u578b\u3002",
    "\u65e5\u672c\u8a9e\uff1a\u3053\u3093\u306b\u3061\u306f\u3001\u4e16\u754c\u3002\u30ab\u30bf\u30ab\u30ca\u3068\uff8a\uff9d\uff76\uff78",
    "\ud55c\uad6d\uc5b4: \uc548\ub155\ud558\uc138\uc694 \uc138\uacc4",
    "\u10e5\u10d0\u10e0\u10d7\u10e3\u10da\u10d8 \u0540\u0561\u0575\u0565\u0580\u0565\u0576 \u12a0\u121b\u122d\u129b \u1781\u17d2\u1798\u17c2\u179a",
    "\U00020000\U0002a6d6 \U0001d400\U0001d41a \U00010348",
    # emoji
    "\U0001f600\U0001f389\U0001f680 ok",
    "\U0001f468\u200d\U0001f469\u200d\U0001f467\u200d\U0001f466 family, \U0001f44d\U0001f3fd thumbs, \U0001f1eb\U0001f1f7\U0001f1ef\U0001f1f5 flags",
    "\u2764\ufe0f \u263a \u2600\ufe0f\u2601 \U0001f9d1\u200d\U0001f4bb",
    # invisible and control characters
    "zero\u200bwidth\u200cjoin\u200dhere\ufeffbom",
    "ctrl\x00null\x01\x07bell\x1b[0m\x7f",
    "soft\u00adhyphen right\u200fto\u200eleft",
    # special tokens written in text
    "<|endoftext|>",
    "before<|endoftext|>after",
    "<|im_start|>user\nhi<|im_end|>\n",
    "<|begin_of_text|><|start_header_id|>user<|end_header_id|>\n\nhi<|eot_id|>",
    "<|im_start|> half <|im_ and <|end_of_text|",
    "<think>\nreasoning\n</think>\n\nanswer",
    "<s> </s> <unk> [INST] [/INST] <pad>",
    # code and markup
    CODE_PY,
    CODE_RUST,
    CODE_JSON,
    HTML,
    "https://example.com/path?q=1&r=%20x#frag user@example.org",
    "$ cargo run --release -- train max_iters=5 | tee log.txt",
    "a_b-c.d/e\\f|g~h^i`j",
    "!!!???...,,,;;;:::---___===+++***###@@@",
    # repetition
    "a" * 100,
    "ab" * 50,
    "\u00e9" * 30,
    "\u4e00" * 20,
    "\U0001f600" * 8,
    "the the the the the the the the the the",
    "The quick brown fox jumps over the lazy dog. THE QUICK BROWN FOX JUMPS OVER THE LAZY DOG.",
]
