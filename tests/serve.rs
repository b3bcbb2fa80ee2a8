//! `nanogpt serve` over real HTTP on loopback: answers in OpenAI's shapes, greedy text
//! equal to `nanogpt sample`, streams, and more than twenty kinds of bad request
//! answered 400/401/404/405/413 with an OpenAI error body, after which the server
//! still serves.

use serde_json::{json, Value};
use std::io::{BufRead, BufReader, Read, Write};
use std::net::TcpStream;
use std::process::{Child, Stdio};
use std::sync::{Arc, Mutex};
use std::time::Duration;

mod common;
use common::{command, fixture, ok, read_json, temp_dir, TINY_MODEL};

const KEY: &str = "sk-test-key";

/// A server on a free port, its log collected as it is written.
struct Server {
    child: Child,
    port: u16,
    log: Arc<Mutex<Vec<String>>>,
}

impl Server {
    fn start(args: &[&str]) -> Server {
        Server::start_from(&fixture("instruct/model").display().to_string(), args)
    }

    /// A server of the model `--init-from` accepts as `model`.
    fn start_from(model: &str, args: &[&str]) -> Server {
        let dir = temp_dir("serve");
        let mut child = command(dir.path(), ["serve", "--init-from", model, "--port", "0"])
            .args(args)
            .stderr(Stdio::piped())
            .stdout(Stdio::null())
            .spawn()
            .expect("nanogpt serve starts");
        let mut lines = BufReader::new(child.stderr.take().unwrap()).lines();
        let first = lines.next().expect("a first line").unwrap();
        let port = first
            .split("http://127.0.0.1:")
            .nth(1)
            .and_then(|rest| rest.split(' ').next())
            .and_then(|p| p.parse().ok())
            .unwrap_or_else(|| panic!("no port in {first:?}"));
        let log = Arc::new(Mutex::new(vec![first]));
        let sink = Arc::clone(&log);
        std::thread::spawn(move || {
            for line in lines.map_while(Result::ok) {
                sink.lock().unwrap().push(line);
            }
        });
        Server { child, port, log }
    }

    /// Sends raw bytes as one HTTP/1.1 request; returns (status, body).
    fn raw(&self, head: &str, body: &[u8]) -> (u16, Vec<u8>) {
        let mut s = TcpStream::connect(("127.0.0.1", self.port)).unwrap();
        s.set_read_timeout(Some(Duration::from_secs(60))).unwrap();
        let request = format!(
            "{head}\r\nHost: localhost\r\nConnection: close\r\nContent-Length: {}\r\n\r\n",
            body.len()
        );
        s.write_all(request.as_bytes()).unwrap();
        // A server may answer (413) before reading all of a large body.
        let _ = s.write_all(body);
        let mut response = Vec::new();
        let _ = s.read_to_end(&mut response);
        let split = response
            .windows(4)
            .position(|w| w == b"\r\n\r\n")
            .expect("a complete response head");
        let head = String::from_utf8_lossy(&response[..split]).into_owned();
        let status = head[9..12].parse().unwrap();
        let mut body = response[split + 4..].to_vec();
        if head
            .to_ascii_lowercase()
            .contains("transfer-encoding: chunked")
        {
            body = dechunk(&body);
        }
        (status, body)
    }

    fn post(&self, path: &str, body: &[u8], key: Option<&str>) -> (u16, Value) {
        let auth = key.map_or(String::new(), |k| format!("\r\nAuthorization: Bearer {k}"));
        let head = format!("POST {path} HTTP/1.1\r\nContent-Type: application/json{auth}");
        let (status, body) = self.raw(&head, body);
        let text = String::from_utf8_lossy(&body).into_owned();
        let value = serde_json::from_str(&text).unwrap_or(Value::String(text));
        (status, value)
    }

    fn json(&self, path: &str, body: Value) -> (u16, Value) {
        self.post(path, body.to_string().as_bytes(), Some(KEY))
    }

    fn get(&self, path: &str) -> (u16, Value) {
        let head = format!("GET {path} HTTP/1.1\r\nAuthorization: Bearer {KEY}");
        let (status, body) = self.raw(&head, b"");
        (status, serde_json::from_slice(&body).unwrap_or(Value::Null))
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn dechunk(mut body: &[u8]) -> Vec<u8> {
    let mut out = Vec::new();
    loop {
        let Some(end) = body.windows(2).position(|w| w == b"\r\n") else {
            return out;
        };
        let size =
            usize::from_str_radix(std::str::from_utf8(&body[..end]).unwrap().trim(), 16).unwrap();
        if size == 0 {
            return out;
        }
        out.extend_from_slice(&body[end + 2..end + 2 + size]);
        body = &body[end + 4 + size..];
    }
}

/// The `data:` payloads of a server-sent-events body.
fn sse_data(body: &str) -> Vec<String> {
    body.lines()
        .filter_map(|l| l.strip_prefix("data: "))
        .map(String::from)
        .collect()
}

#[test]
fn completions_chat_streams_and_logprobs() {
    let server = Server::start(&["--api-key", KEY]);
    let prompt = "To be, or not to be";
    let (status, v) = server.json(
        "/v1/completions",
        json!({"prompt": prompt, "max_tokens": 12, "temperature": 0, "model": "anything"}),
    );
    assert_eq!(status, 200, "{v}");
    assert_eq!(v["object"], "text_completion");
    let text = v["choices"][0]["text"].as_str().unwrap().to_string();
    let usage = &v["usage"];
    assert_eq!(usage["prompt_tokens"], 7);
    assert_eq!(
        usage["total_tokens"].as_u64(),
        Some(7 + usage["completion_tokens"].as_u64().unwrap())
    );

    // Greedy text is `nanogpt sample`'s (cut where the server stops, at end-of-text).
    let sampled = greedy_sample(prompt, 12, &[]);
    assert_eq!(text, sampled);

    // The stream says the same, chunk by chunk, and ends with usage and [DONE].
    let body = json!({"prompt": prompt, "max_tokens": 12, "temperature": 0, "stream": true,
                      "stream_options": {"include_usage": true}});
    let (status, raw) = server.post("/v1/completions", body.to_string().as_bytes(), Some(KEY));
    assert_eq!(status, 200);
    let events = sse_data(raw.as_str().unwrap());
    assert_eq!(events.last().map(String::as_str), Some("[DONE]"));
    let chunks: Vec<Value> = events[..events.len() - 1]
        .iter()
        .map(|e| serde_json::from_str(e).unwrap())
        .collect();
    let streamed: String = chunks
        .iter()
        .flat_map(|c| c["choices"].as_array().unwrap().iter())
        .map(|c| c["text"].as_str().unwrap())
        .collect();
    assert_eq!(streamed, text);
    assert_eq!(chunks.last().unwrap()["usage"], v["usage"]);

    // Echo with logprobs, as lm-evaluation-harness asks: the prompt's tokens, the first
    // without a log-probability, each with its most likely alternative.
    let (status, v) = server.json(
        "/v1/completions",
        json!({"prompt": [[464, 3797, 3332, 319, 262, 2603]], "max_tokens": 1, "temperature": 0,
               "logprobs": 1, "echo": true, "seed": 1234}),
    );
    assert_eq!(status, 200, "{v}");
    let lp = &v["choices"][0]["logprobs"];
    let token_lps = lp["token_logprobs"].as_array().unwrap();
    assert_eq!(token_lps.len(), 7);
    assert!(token_lps[0].is_null() && lp["top_logprobs"][0].is_null());
    assert_eq!(lp["tokens"][0], "The");
    for (t, top) in token_lps[1..]
        .iter()
        .zip(lp["top_logprobs"].as_array().unwrap()[1..].iter())
    {
        let (t, top) = (t.as_f64().unwrap(), top.as_object().unwrap());
        assert_eq!(top.len(), 1);
        assert!(top.values().next().unwrap().as_f64().unwrap() >= t && t < 0.0);
    }
    // The generated token was the greedy one: its log-probability is its top's, bit for bit.
    let last = token_lps[6].as_f64().unwrap();
    assert_eq!(
        lp["top_logprobs"][6]
            .as_object()
            .unwrap()
            .values()
            .next()
            .unwrap()
            .as_f64(),
        Some(last)
    );
    assert!(v["choices"][0]["text"]
        .as_str()
        .unwrap()
        .starts_with("The cat sat on the mat"));

    // Several prompts and samples; every choice indexed.
    let (status, v) = server.json(
        "/v1/completions",
        json!({"prompt": ["a", "b"], "n": 2, "max_tokens": 3, "seed": 5}),
    );
    assert_eq!(status, 200, "{v}");
    let indices: Vec<u64> = v["choices"]
        .as_array()
        .unwrap()
        .iter()
        .map(|c| c["index"].as_u64().unwrap())
        .collect();
    assert_eq!(indices, [0, 1, 2, 3]);

    // Chat, whole and streamed.
    let messages =
        json!([{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]);
    let (status, v) = server.json(
        "/v1/chat/completions",
        json!({"messages": messages, "max_tokens": 8, "temperature": 0, "logprobs": true, "top_logprobs": 2}),
    );
    assert_eq!(status, 200, "{v}");
    assert_eq!(v["object"], "chat.completion");
    assert_eq!(v["choices"][0]["message"]["role"], "assistant");
    let reply = v["choices"][0]["message"]["content"]
        .as_str()
        .unwrap()
        .to_string();
    let content = v["choices"][0]["logprobs"]["content"].as_array().unwrap();
    assert_eq!(
        content.len() as u64,
        v["usage"]["completion_tokens"].as_u64().unwrap()
    );
    assert_eq!(content[0]["top_logprobs"].as_array().unwrap().len(), 2);
    let body = json!({"messages": messages, "max_tokens": 8, "temperature": 0, "stream": true});
    let (_, raw) = server.post(
        "/v1/chat/completions",
        body.to_string().as_bytes(),
        Some(KEY),
    );
    let events = sse_data(raw.as_str().unwrap());
    let chunks: Vec<Value> = events[..events.len() - 1]
        .iter()
        .map(|e| serde_json::from_str(e).unwrap())
        .collect();
    assert_eq!(chunks[0]["choices"][0]["delta"]["role"], "assistant");
    let streamed: String = chunks
        .iter()
        .filter_map(|c| c["choices"][0]["delta"]["content"].as_str())
        .collect();
    assert_eq!(streamed, reply);
    assert!(chunks.last().unwrap()["choices"][0]["finish_reason"].is_string());

    // Models, health, and vLLM's tokenizer routes (lm-evaluation-harness's remote tokenizer).
    let (status, v) = server.get("/v1/models");
    assert_eq!(
        (status, v["data"][0]["max_model_len"].as_u64()),
        (200, Some(64))
    );
    let (status, v) = server.json(
        "/tokenize",
        json!({"prompt": "<|endoftext|>Hi", "add_special_tokens": false}),
    );
    assert_eq!((status, v["tokens"].clone()), (200, json!([50256, 17250])));
    let (_, v) = server.json("/detokenize", json!({"tokens": [17250]}));
    assert_eq!(v["prompt"], "Hi");
    let (_, v) = server.get("/tokenizer_info");
    assert_eq!(v["eos_token"], "<|endoftext|>");
    let (status, v) = server.get("/health");
    assert_eq!(status, 200);
    assert!(v["completion_tokens"].as_u64().unwrap() > 0, "{v}");
    let log = server.log.lock().unwrap().join("\n");
    assert!(
        log.contains("completions 200: 1 prompt(s) × 1, 7 prompt +"),
        "{log}"
    );
}

/// `nanogpt sample`'s greedy continuation of `prompt` (`max_new` tokens, with `extra`
/// options) by the model the servers run, up to its first end-of-text.
fn greedy_sample(prompt: &str, max_new: usize, extra: &[&str]) -> String {
    let dir = temp_dir("serve-sample");
    let model = fixture("instruct/model").display().to_string();
    let max_new = max_new.to_string();
    let args = [
        "sample",
        "--init-from",
        &model,
        "--start",
        prompt,
        "--num-samples",
        "1",
        "--max-new-tokens",
        &max_new,
        "--temperature",
        "0",
    ];
    let sampled = ok(dir.path(), &[&args[..], extra].concat());
    let sampled = sampled.strip_prefix(prompt).unwrap().trim_end_matches('\n');
    sampled.split("<|endoftext|>").next().unwrap().to_string()
}

/// The echoed prompt's log-probabilities and the greedy text of `server`.
fn echo_and_greedy(server: &Server, prompt: &str) -> (Vec<f64>, String) {
    let body = json!({"prompt": prompt, "max_tokens": 8, "temperature": 0, "logprobs": 1,
                      "echo": true});
    let (status, v) = server.json("/v1/completions", body);
    assert_eq!(status, 200, "{v}");
    let lp = &v["choices"][0]["logprobs"];
    let logprobs = lp["token_logprobs"].as_array().unwrap()[1..]
        .iter()
        .map(|x| x.as_f64().unwrap())
        .collect();
    let text = v["choices"][0]["text"].as_str().unwrap();
    (logprobs, text.strip_prefix(prompt).unwrap().to_string())
}

/// In bf16 the server (whose f32 weight matrices are freed) scores the prompt within
/// bf16's rounding of the f32 server's log-probabilities, and its greedy text is
/// `nanogpt sample --dtype bfloat16`'s.
#[test]
fn a_bf16_server_scores_near_f32_and_answers_as_bf16_sample() {
    let prompt = "To be, or not to be";
    let (f32_lps, _) = echo_and_greedy(&Server::start(&[]), prompt);
    let (bf16_lps, text) = echo_and_greedy(&Server::start(&["--dtype", "bfloat16"]), prompt);
    assert_eq!(bf16_lps.len(), f32_lps.len());
    for (i, (b, f)) in bf16_lps.iter().zip(&f32_lps).enumerate() {
        assert!((b - f).abs() < 0.05, "token {}: bf16 {b}, f32 {f}", i + 1);
    }
    let greedy = greedy_sample(prompt, 8, &["--dtype", "bfloat16"]);
    assert_eq!(text.split("<|endoftext|>").next().unwrap(), greedy);
}

#[test]
fn bad_requests_get_openai_errors_and_the_server_keeps_serving() {
    let server = Server::start(&["--api-key", KEY]);
    let long_prompt: Vec<u32> = vec![11; 65];
    let cases: Vec<(&str, Vec<u8>, u16, &str)> = vec![
        ("/v1/completions", b"{".to_vec(), 400, "not valid JSON"),
        ("/v1/completions", b"[1, 2]".to_vec(), 400, "must be a JSON object"),
        ("/v1/completions", b"".to_vec(), 400, "body is empty"),
        ("/v1/completions", b"{\"prompt\": \"\xff\xfe\"}".to_vec(), 400, "not UTF-8"),
        ("/v1/completions", vec![b' '; 10 << 20], 413, "larger than"),
        ("/v1/completions", json!({"prompt": "x", "max_tokens": -1}).to_string().into(), 400, "'max_tokens' must be between"),
        ("/v1/completions", json!({"prompt": "x", "max_tokens": 1.5}).to_string().into(), 400, "must be an integer"),
        ("/v1/completions", json!({"prompt": "x", "colour": "red"}).to_string().into(), 400, "Unrecognized request argument supplied: colour"),
        ("/v1/completions", json!({"prompt": "x", "temperature": 5}).to_string().into(), 400, "'temperature'"),
        ("/v1/completions", json!({"prompt": "x", "temperature": "hot"}).to_string().into(), 400, "must be a number"),
        ("/v1/completions", json!({"prompt": "x", "top_p": 0}).to_string().into(), 400, "'top_p'"),
        ("/v1/completions", json!({"prompt": "x", "n": 0}).to_string().into(), 400, "'n'"),
        ("/v1/completions", json!({"max_tokens": 3}).to_string().into(), 400, "'prompt' is required"),
        ("/v1/completions", json!({"prompt": 42}).to_string().into(), 400, "'prompt' must be"),
        ("/v1/completions", json!({"prompt": [50257]}).to_string().into(), 400, "not an id of this model's vocabulary"),
        ("/v1/completions", json!({"prompt": long_prompt}).to_string().into(), 400, "maximum context length is 64"),
        ("/v1/completions", json!({"prompt": "x", "max_tokens": 64}).to_string().into(), 400, "maximum context length is 64"),
        ("/v1/completions", json!({"prompt": ""}).to_string().into(), 400, "'prompt' is empty"),
        ("/v1/completions", json!({"prompt": "x", "stop": [""]}).to_string().into(), 400, "empty string"),
        ("/v1/completions", json!({"prompt": "x", "stop": 7}).to_string().into(), 400, "'stop' must be"),
        ("/v1/completions", json!({"prompt": "x", "logprobs": 100}).to_string().into(), 400, "'logprobs'"),
        ("/v1/completions", json!({"prompt": "x", "logit_bias": {"cat": 1}}).to_string().into(), 400, "not a token id"),
        ("/v1/completions", json!({"prompt": "x", "stream_options": {"include_usage": true}}).to_string().into(), 400, "only allowed with 'stream'"),
        ("/v1/completions", json!({"prompt": "x", "echo": "yes"}).to_string().into(), 400, "true or false"),
        ("/v1/completions", json!({"prompt": "x", "seed": "s"}).to_string().into(), 400, "must be an integer"),
        ("/v1/completions", json!({"prompt": "x", "suffix": "y"}).to_string().into(), 400, "'suffix'"),
        ("/v1/chat/completions", json!({"max_tokens": 3}).to_string().into(), 400, "'messages' is required"),
        ("/v1/chat/completions", json!({"messages": []}).to_string().into(), 400, "'messages' is empty"),
        ("/v1/chat/completions", json!({"messages": [{"role": "tool", "content": "x"}]}).to_string().into(), 400, "must be system"),
        ("/v1/chat/completions", json!({"messages": [{"role": "user", "content": "x"}, {"role": "assistant", "content": "y"}]}).to_string().into(), 400, "ending with a user message"),
        ("/v1/chat/completions", json!({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]}).to_string().into(), 400, "text only"),
        ("/v1/chat/completions", json!({"messages": [{"role": "user", "content": "x"}], "tools": []}).to_string().into(), 400, "'tools' is not supported"),
        ("/v1/chat/completions", json!({"messages": [{"role": "user", "content": "x"}], "top_logprobs": 2}).to_string().into(), 400, "needs 'logprobs'"),
        ("/v1/chat/completions", json!({"messages": [{"role": "user", "content": "to be or not ".repeat(20)}]}).to_string().into(), 400, "maximum context length"),
        ("/tokenize", json!({"text": "x"}).to_string().into(), 400, "'prompt' is required"),
    ];
    assert!(cases.len() >= 20);
    for (path, body, status, message) in &cases {
        let (got, v) = server.post(path, body, Some(KEY));
        let shown = String::from_utf8_lossy(&body[..body.len().min(80)]).into_owned();
        assert_eq!(got, *status, "{path} {shown}: {v}");
        let error = &v["error"];
        assert_eq!(error["type"], "invalid_request_error", "{shown}: {v}");
        let text = error["message"].as_str().unwrap_or_default();
        assert!(
            text.contains(message),
            "{shown}: {text:?} lacks {message:?}"
        );
        assert!(
            error.get("param").is_some() && error.get("code").is_some(),
            "{v}"
        );
    }
    // No key, a wrong key; an unknown route; a wrong method.
    let body = json!({"prompt": "x"}).to_string();
    let (status, v) = server.post("/v1/completions", body.as_bytes(), None);
    assert_eq!(
        (status, v["error"]["code"].as_str()),
        (401, Some("invalid_api_key"))
    );
    assert_eq!(
        server
            .post("/v1/completions", body.as_bytes(), Some("sk-wrong"))
            .0,
        401
    );
    assert_eq!(server.get("/v1/engines").0, 404);
    assert_eq!(server.get("/v1/completions").0, 405);
    // /health needs no key; the server still answers a good request.
    let (status, _) = server.raw("GET /health HTTP/1.1", b"");
    assert_eq!(status, 200);
    let (status, v) = server.json("/v1/completions", json!({"prompt": "x", "max_tokens": 2}));
    assert_eq!(status, 200, "{v}");
    let log = server.log.lock().unwrap().join("\n");
    assert!(log.contains("400 request refused (max_tokens)"), "{log}");
}

#[test]
fn a_gguf_file_serves_as_the_folder_it_was_exported_from() {
    let dir = temp_dir("serve-gguf");
    let model = fixture("instruct/model").display().to_string();
    let gguf = dir.path().join("m.gguf").display().to_string();
    let export = [
        "export",
        "--from",
        &model,
        "--to",
        &gguf,
        "--outtype",
        "f32",
    ];
    ok(dir.path(), &export);
    let body = json!({"prompt": "To be, or not to be", "max_tokens": 8, "temperature": 0,
        "echo": true, "logprobs": 1});
    let answers: Vec<Value> = [&model, &gguf]
        .iter()
        .map(|m| {
            let (status, v) = Server::start_from(m, &[]).json("/v1/completions", body.clone());
            assert_eq!(status, 200, "{m}: {v}");
            v
        })
        .collect();
    let choice = |v: &Value| v["choices"][0].clone();
    let (a, b) = (choice(&answers[0]), choice(&answers[1]));
    assert_eq!(a["text"], b["text"]);
    assert_eq!(a["logprobs"]["tokens"], b["logprobs"]["tokens"]);
    let logprobs = |c: &Value| -> Vec<f64> {
        let all = c["logprobs"]["token_logprobs"].as_array().unwrap();
        // The first token has no log-probability (null).
        all[1..].iter().map(|x| x.as_f64().unwrap()).collect()
    };
    let (la, lb) = (logprobs(&a), logprobs(&b));
    assert_eq!(la.len(), lb.len());
    assert!(
        la.len() > 8,
        "the prompt's tokens after the first, and the completion's"
    );
    for (x, y) in la.iter().zip(&lb) {
        assert!((x - y).abs() < 1e-5, "{la:?} vs {lb:?}");
    }
}

#[test]
fn chat_renders_the_models_own_template() {
    let dir = temp_dir("serve-template");
    let d = dir.path();
    // A tiny GPT on SmolLM2's tokenizer, whose files (and chat template) the run keeps.
    let smol = fixture("tokenizers/smollm2").display().to_string();
    let lines: String = (0..200)
        .map(|i| format!("{{\"text\": \"line {i} of the text\"}}\n"))
        .collect();
    std::fs::write(d.join("docs.jsonl"), lines).unwrap();
    ok(
        d,
        &[
            "prepare",
            "docs.jsonl",
            "--out",
            "docs",
            "--tokenizer",
            &smol,
            "--val-fraction",
            "0.1",
        ],
    );
    let train = [
        "train",
        "dataset=docs",
        "out_dir=run",
        "max_iters=1",
        "block_size=64",
        "batch_size=1",
        "eval_interval=1",
        "eval_iters=1",
    ];
    ok(d, &[&train[..], &TINY_MODEL].concat());
    let server = Server::start_from(&d.join("run").display().to_string(), &[]);
    // transformers' apply_chat_template(add_generation_prompt=True) of this message:
    // SmolLM2's template adds its default system message.
    let expected = read_json(&fixture("tokenizers/expected.json"));
    let render = expected["renders"]
        .as_array()
        .unwrap()
        .iter()
        .find(|r| r["tokenizer"] == "smollm2" && r["add_generation_prompt"] == true)
        .unwrap()
        .clone();
    assert!(render["text"]
        .as_str()
        .unwrap()
        .starts_with("<|im_start|>system"));
    let ids = render["ids"].as_array().unwrap().len() as u64;
    let body = json!({"messages": render["messages"], "max_tokens": 2, "temperature": 0});
    let (status, v) = server.json("/v1/chat/completions", body);
    assert_eq!(status, 200, "{v}");
    assert_eq!(v["usage"]["prompt_tokens"].as_u64(), Some(ids), "{v}");
    // The rendered prompt's own tokens, as the server's tokenizer reads the text.
    let (_, t) = server.json(
        "/tokenize",
        json!({"prompt": render["text"], "add_special_tokens": false}),
    );
    assert_eq!(t["tokens"], render["ids"]);
}
