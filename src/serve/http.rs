//! The routes, on axum: each request is checked ([`super::api`]), turned into a
//! [`Job`] and queued for the model's thread; its events come back on a channel of
//! its own and are answered as one JSON body or, with `stream: true`, as server-sent
//! events. A request that finds the queue full is answered 503 at once.

use super::api::{self, ApiError, Fields, Prompt};
use super::engine::{Event, Finish, Job, TokenInfo};
use super::request::{chat_request, completion_request, Api, Request};
use super::Shared;
use axum::body::Bytes;
use axum::extract::rejection::BytesRejection;
use axum::extract::State;
use axum::http::{header, HeaderMap, HeaderValue, StatusCode};
use axum::response::sse::{Event as SseEvent, Sse};
use axum::response::{IntoResponse, Response};
use serde_json::{json, Map, Value};
use std::collections::VecDeque;
use std::convert::Infallible;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Instant;
use tokio::sync::mpsc::{self, error::TrySendError, UnboundedReceiver};

type Ctx = State<Arc<Shared>>;
type Body = Result<Bytes, BytesRejection>;

/// The error as a response.
pub fn error_response(e: &ApiError) -> Response {
    let status = StatusCode::from_u16(e.status).unwrap_or(StatusCode::BAD_REQUEST);
    let mut response = (status, json_body(&e.to_json())).into_response();
    if e.status == 503 {
        response
            .headers_mut()
            .insert(header::RETRY_AFTER, HeaderValue::from_static("1"));
    }
    response
}

fn json_body(v: &Value) -> ([(header::HeaderName, &'static str); 1], String) {
    ([(header::CONTENT_TYPE, "application/json")], v.to_string())
}

fn ok_json(v: &Value) -> Response {
    (StatusCode::OK, json_body(v)).into_response()
}

/// 401 unless the request carries `Authorization: Bearer KEY` (when a key is set).
fn authorize(s: &Shared, headers: &HeaderMap) -> Result<(), ApiError> {
    let Some(key) = &s.api_key else {
        return Ok(());
    };
    let given = headers
        .get(header::AUTHORIZATION)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.strip_prefix("Bearer "))
        .unwrap_or("");
    // The same time whatever the key's first difference.
    let same = given.len() == key.len()
        && given
            .bytes()
            .zip(key.bytes())
            .fold(0u8, |acc, (a, b)| acc | (a ^ b))
            == 0;
    match same {
        true => Ok(()),
        false => Err(ApiError {
            status: 401,
            message: "Incorrect API key provided; send it as `Authorization: Bearer KEY`".into(),
            kind: "invalid_request_error",
            param: None,
            code: Some("invalid_api_key"),
        }),
    }
}

/// The body, or the error for one too large or unreadable (413 past the limit).
fn body_bytes(body: Body) -> Result<Bytes, ApiError> {
    body.map_err(|rejection| {
        let status = rejection.status().as_u16();
        let message = match status {
            413 => format!(
                "the request body is larger than {} MiB",
                super::MAX_BODY_BYTES >> 20
            ),
            _ => format!("cannot read the request body: {}", rejection.body_text()),
        };
        ApiError::bad_request(message).with_status(status, "invalid_request_error")
    })
}

pub async fn health(State(s): Ctx) -> Response {
    let waiting = s.queue_capacity - s.jobs.capacity();
    ok_json(&json!({
        "status": "ok",
        "model": s.model_name,
        "queue": {"waiting": waiting, "capacity": s.queue_capacity},
        "requests": s.counts.requests.load(Ordering::Relaxed),
        "rejected_busy": s.counts.busy.load(Ordering::Relaxed),
        "prompt_tokens": s.counts.prompt_tokens.load(Ordering::Relaxed),
        "completion_tokens": s.counts.completion_tokens.load(Ordering::Relaxed),
    }))
}

pub async fn models(State(s): Ctx, headers: HeaderMap) -> Response {
    if let Err(e) = authorize(&s, &headers) {
        return error_response(&e);
    }
    ok_json(&json!({"object": "list", "data": [{
        "id": s.model_name,
        "object": "model",
        "created": s.created,
        "owned_by": "nanogpt",
        "max_model_len": s.model.block,
    }]}))
}

pub async fn not_found() -> Response {
    let e = ApiError::bad_request("no such route; the API serves /v1/completions, /v1/chat/completions, /v1/models, /health, /tokenize, /detokenize and /tokenizer_info")
        .with_status(404, "invalid_request_error");
    error_response(&e)
}

pub async fn method_not_allowed() -> Response {
    let e = ApiError::bad_request("method not allowed on this route")
        .with_status(405, "invalid_request_error");
    error_response(&e)
}

/// vLLM's `/tokenizer_info`, which lm-evaluation-harness reads to use the server's
/// tokenizer (`tokenizer_backend=remote`, picked by default when it answers).
pub async fn tokenizer_info(State(s): Ctx, headers: HeaderMap) -> Response {
    if let Err(e) = authorize(&s, &headers) {
        return error_response(&e);
    }
    let eot = s
        .model
        .tokenizer
        .eot()
        .map(|id| s.model.tokenizer.decode(&[id]));
    ok_json(&json!({
        "eos_token": eot,
        "bos_token": Value::Null,
        "pad_token": Value::Null,
        "model_max_length": s.model.block,
        "vocab_size": s.model.vocab,
    }))
}

/// vLLM's `/tokenize`: `{"prompt"}` → `{"tokens", "count", "max_model_len"}`.
pub async fn tokenize(State(s): Ctx, headers: HeaderMap, body: Body) -> Response {
    let result = authorize(&s, &headers).and_then(|()| {
        let mut f = Fields::parse(&body_bytes(body)?)?;
        let prompt = f
            .string("prompt")?
            .ok_or_else(|| ApiError::invalid("prompt", "'prompt' is required"))?;
        let _ = f.bool("add_special_tokens")?;
        let _ = f.string("model")?;
        f.finish()?;
        let tokens = s.model.encode(&prompt, "prompt")?;
        Ok(json!({"tokens": tokens, "count": tokens.len(), "max_model_len": s.model.block}))
    });
    respond(result)
}

/// vLLM's `/detokenize`: `{"tokens"}` → `{"prompt"}`.
pub async fn detokenize(State(s): Ctx, headers: HeaderMap, body: Body) -> Response {
    let result = authorize(&s, &headers).and_then(|()| {
        let mut f = Fields::parse(&body_bytes(body)?)?;
        let tokens = f
            .take("tokens")
            .ok_or_else(|| ApiError::invalid("tokens", "'tokens' is required"))?;
        let _ = f.string("model")?;
        f.finish()?;
        let ids = match api::prompts(tokens, s.model.vocab)?.pop() {
            Some(Prompt::Tokens(ids)) => ids,
            _ => {
                return Err(ApiError::invalid(
                    "tokens",
                    "'tokens' must be a list of token ids",
                ))
            }
        };
        Ok(json!({"prompt": s.model.tokenizer.decode(&ids)}))
    });
    respond(result)
}

fn respond(result: Result<Value, ApiError>) -> Response {
    match result {
        Ok(v) => ok_json(&v),
        Err(e) => error_response(&e),
    }
}

pub async fn completions(State(s): Ctx, headers: HeaderMap, body: Body) -> Response {
    let request = authorize(&s, &headers)
        .and_then(|()| body_bytes(body))
        .and_then(|b| completion_request(&s.model, &b));
    answer(s, request).await
}

pub async fn chat_completions(State(s): Ctx, headers: HeaderMap, body: Body) -> Response {
    let request = authorize(&s, &headers)
        .and_then(|()| body_bytes(body))
        .and_then(|b| chat_request(&s.model, &b));
    answer(s, request).await
}

/// Queues the request and answers it (or its error).
async fn answer(s: Arc<Shared>, request: Result<Request, ApiError>) -> Response {
    let started = Instant::now();
    s.counts.requests.fetch_add(1, Ordering::Relaxed);
    let request = match request {
        Ok(r) => r,
        Err(e) => {
            crate::errln!(
                "{} request refused ({}): {}",
                e.status,
                e.param.as_deref().unwrap_or("body"),
                e.message
            );
            return error_response(&e);
        }
    };
    let (tx, rx) = mpsc::unbounded_channel();
    let job = Job {
        generation: request.generation.clone(),
        events: tx,
    };
    if let Err(e) = s.jobs.try_send(job) {
        s.counts.busy.fetch_add(1, Ordering::Relaxed);
        let message = match e {
            TrySendError::Full(_) => format!(
                "the server is busy: {} requests are waiting for the model; retry later",
                s.queue_capacity
            ),
            TrySendError::Closed(_) => "the model has stopped; the server is shutting down".into(),
        };
        crate::errln!("503 {}: {message}", request.api.name());
        let e = ApiError::bad_request(message).with_status(503, "server_error");
        return error_response(&e);
    }
    let reply = Reply::new(&s, request, started);
    match reply.request.stream {
        true => stream(reply, rx),
        false => whole(reply, rx).await,
    }
}

/// What a request has received so far, per choice.
struct Reply {
    shared: Arc<Shared>,
    request: Request,
    id: String,
    created: u64,
    choices: Vec<ChoiceState>,
    started: Instant,
    finished: usize,
}

#[derive(Default)]
struct ChoiceState {
    text: String,
    /// Echoed prompt tokens, then generated ones.
    tokens: Vec<TokenInfo>,
    finish: Option<Finish>,
    completion_tokens: usize,
}

impl Reply {
    fn new(s: &Arc<Shared>, request: Request, started: Instant) -> Reply {
        let count = request.generation.prompts.len() * request.generation.n;
        let prefix = match request.api {
            Api::Completions => "cmpl",
            Api::Chat => "chatcmpl",
        };
        Reply {
            shared: Arc::clone(s),
            id: format!(
                "{prefix}-{:x}{:06x}",
                s.created,
                s.counts.requests.load(Ordering::Relaxed)
            ),
            created: unix_now(),
            choices: (0..count).map(|_| ChoiceState::default()).collect(),
            request,
            started,
            finished: 0,
        }
    }

    fn done(&self) -> bool {
        self.finished == self.choices.len()
    }

    /// Records an event; returns what it adds to the choice's text and the tokens it
    /// reports (for a stream chunk).
    fn record(&mut self, event: Event) -> (usize, String, Vec<TokenInfo>, Option<Finish>) {
        match event {
            Event::Prompt { choice, tokens } => {
                let c = &mut self.choices[choice];
                let text = self
                    .shared
                    .model
                    .tokenizer
                    .decode(&tokens.iter().map(|t| t.id).collect::<Vec<_>>());
                c.text.push_str(&text);
                c.tokens.extend(tokens.iter().cloned());
                let reported = match self.request.generation.logprobs {
                    Some(_) => tokens,
                    None => Vec::new(),
                };
                (choice, text, reported, None)
            }
            Event::Token {
                choice,
                text,
                token,
            } => {
                let c = &mut self.choices[choice];
                c.text.push_str(&text);
                c.completion_tokens += 1;
                let reported = match self.request.generation.logprobs {
                    Some(_) => vec![token.clone()],
                    None => Vec::new(),
                };
                c.tokens.push(token);
                (choice, text, reported, None)
            }
            Event::Done {
                choice,
                text,
                finish,
                completion_tokens,
                ..
            } => {
                let c = &mut self.choices[choice];
                c.text.push_str(&text);
                c.finish = Some(finish);
                c.completion_tokens = completion_tokens;
                self.finished += 1;
                (choice, text, Vec::new(), Some(finish))
            }
        }
    }

    /// Prompt tokens (each prompt once, whatever `n`) and completion tokens so far.
    fn tokens(&self) -> (usize, usize) {
        let prompt = self.request.generation.prompts.iter().map(Vec::len).sum();
        let completion = self.choices.iter().map(|c| c.completion_tokens).sum();
        (prompt, completion)
    }

    fn usage(&self) -> Value {
        let (prompt, completion) = self.tokens();
        json!({"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion})
    }

    /// One line in the server's log, and the totals.
    fn log(&self, how: &str) {
        let n = self.request.generation.n;
        let (prompt, completion) = self.tokens();
        let counts = &self.shared.counts;
        counts
            .prompt_tokens
            .fetch_add(prompt as u64, Ordering::Relaxed);
        counts
            .completion_tokens
            .fetch_add(completion as u64, Ordering::Relaxed);
        crate::errln!(
            "{} {how}: {} prompt(s) × {n}, {prompt} prompt + {completion} completion tokens, {:.2} s",
            self.request.api.name(),
            self.request.generation.prompts.len(),
            self.started.elapsed().as_secs_f64()
        );
    }

    /// The token as OpenAI names it: its text, or `bytes:\xNN...` when its bytes are
    /// not whole UTF-8 characters.
    fn token_name(&self, id: u32) -> String {
        let bytes = self.shared.model.tokenizer.token_bytes(id);
        match String::from_utf8(bytes) {
            Ok(text) => text,
            Err(e) => e
                .into_bytes()
                .iter()
                .fold(String::from("bytes:"), |mut s, b| {
                    s.push_str(&format!("\\x{b:02x}"));
                    s
                }),
        }
    }

    /// Completions' `logprobs` object for `tokens`, whose text starts at `offset`
    /// characters.
    fn completion_logprobs(&self, tokens: &[TokenInfo], mut offset: usize) -> Value {
        let mut names = Vec::new();
        let mut lps = Vec::new();
        let mut tops = Vec::new();
        let mut offsets = Vec::new();
        for t in tokens {
            let name = self.token_name(t.id);
            offsets.push(offset);
            offset += name.chars().count();
            names.push(Value::String(name));
            lps.push(t.logprob.map_or(Value::Null, Value::from));
            tops.push(match t.logprob {
                None => Value::Null,
                Some(_) => {
                    let mut top = Map::new();
                    for &(id, lp) in &t.top {
                        top.entry(self.token_name(id)).or_insert(Value::from(lp));
                    }
                    Value::Object(top)
                }
            });
        }
        json!({"tokens": names, "token_logprobs": lps, "top_logprobs": tops, "text_offset": offsets})
    }

    /// Chat's `logprobs` object for `tokens`.
    fn chat_logprobs(&self, tokens: &[TokenInfo]) -> Value {
        let entry = |id: u32, lp: f64| {
            let bytes = self.shared.model.tokenizer.token_bytes(id);
            json!({"token": self.token_name(id), "logprob": lp, "bytes": bytes})
        };
        let content: Vec<Value> = tokens
            .iter()
            .map(|t| {
                let mut e = entry(t.id, t.logprob.unwrap_or(f64::NAN));
                e["top_logprobs"] = t.top.iter().map(|&(id, lp)| entry(id, lp)).collect();
                e
            })
            .collect();
        json!({"content": content})
    }

    fn whole_body(&self) -> Value {
        let choices: Vec<Value> = self
            .choices
            .iter()
            .enumerate()
            .map(|(i, c)| {
                let finish = c.finish.map(Finish::as_str);
                match self.request.api {
                    Api::Completions => json!({
                        "index": i,
                        "text": c.text,
                        "logprobs": self.request.generation.logprobs.map(|_| self.completion_logprobs(&c.tokens, 0)),
                        "finish_reason": finish,
                    }),
                    Api::Chat => json!({
                        "index": i,
                        "message": {"role": "assistant", "content": c.text},
                        "logprobs": self.request.generation.logprobs.map(|_| self.chat_logprobs(&c.tokens)),
                        "finish_reason": finish,
                    }),
                }
            })
            .collect();
        let object = match self.request.api {
            Api::Completions => "text_completion",
            Api::Chat => "chat.completion",
        };
        json!({
            "id": self.id,
            "object": object,
            "created": self.created,
            "model": self.shared.model_name,
            "choices": choices,
            "usage": self.usage(),
        })
    }

    /// A stream chunk for one event of choice `i`.
    fn chunk(&self, i: usize, text: &str, tokens: &[TokenInfo], finish: Option<Finish>) -> Value {
        let finish = finish.map(Finish::as_str);
        let (object, choice) = match self.request.api {
            Api::Completions => {
                let offset = self.choices[i].text.chars().count() - text.chars().count();
                let logprobs = self
                    .request
                    .generation
                    .logprobs
                    .map(|_| self.completion_logprobs(tokens, offset));
                (
                    "text_completion",
                    json!({"index": i, "text": text, "logprobs": logprobs, "finish_reason": finish}),
                )
            }
            Api::Chat => {
                let delta = match finish {
                    Some(_) if text.is_empty() => json!({}),
                    _ => json!({"content": text}),
                };
                let logprobs = self
                    .request
                    .generation
                    .logprobs
                    .map(|_| self.chat_logprobs(tokens));
                (
                    "chat.completion.chunk",
                    json!({"index": i, "delta": delta, "logprobs": logprobs, "finish_reason": finish}),
                )
            }
        };
        json!({"id": self.id, "object": object, "created": self.created, "model": self.shared.model_name, "choices": [choice]})
    }

    /// Chat streams open each choice with the assistant's role.
    fn role_chunks(&self) -> Vec<Value> {
        match self.request.api {
            Api::Completions => Vec::new(),
            Api::Chat => (0..self.choices.len())
                .map(|i| json!({"id": self.id, "object": "chat.completion.chunk", "created": self.created, "model": self.shared.model_name,
                    "choices": [{"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": null, "finish_reason": null}]}))
                .collect(),
        }
    }

    fn usage_chunk(&self) -> Value {
        let object = match self.request.api {
            Api::Completions => "text_completion",
            Api::Chat => "chat.completion.chunk",
        };
        json!({"id": self.id, "object": object, "created": self.created, "model": self.shared.model_name, "choices": [], "usage": self.usage()})
    }
}

fn unix_now() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs())
}

/// Waits for every choice, then answers with one body. If the client goes, this
/// future is dropped with the receiver, and the model thread stops the job.
async fn whole(mut reply: Reply, mut rx: UnboundedReceiver<Event>) -> Response {
    while !reply.done() {
        let Some(event) = rx.recv().await else {
            let e = ApiError::bad_request("the model thread ended the request")
                .with_status(500, "server_error");
            return error_response(&e);
        };
        reply.record(event);
    }
    reply.log("200");
    ok_json(&reply.whole_body())
}

/// Logs a stream that ends before its last choice (the client went away).
struct StreamGuard(Option<Reply>);

impl Drop for StreamGuard {
    fn drop(&mut self) {
        if let Some(reply) = &self.0 {
            if !reply.done() {
                reply.log("stream closed by the client");
            }
        }
    }
}

/// Answers with server-sent events: a chunk per event that says something, the
/// usage chunk when asked for, then `[DONE]`.
fn stream(reply: Reply, rx: UnboundedReceiver<Event>) -> Response {
    let pending: VecDeque<String> = reply.role_chunks().iter().map(Value::to_string).collect();
    let state = (StreamGuard(Some(reply)), rx, pending);
    let events =
        futures_util::stream::unfold(state, |(mut guard, mut rx, mut pending)| async move {
            loop {
                if let Some(data) = pending.pop_front() {
                    let event = SseEvent::default().data(data);
                    return Some((Ok::<_, Infallible>(event), (guard, rx, pending)));
                }
                let reply = guard.0.as_mut()?;
                if reply.done() {
                    if reply.request.include_usage {
                        pending.push_back(reply.usage_chunk().to_string());
                    }
                    pending.push_back("[DONE]".into());
                    reply.log("200 (streamed)");
                    guard.0 = None;
                    continue;
                }
                let event = rx.recv().await?;
                let (choice, text, tokens, finish) = reply.record(event);
                if !text.is_empty() || !tokens.is_empty() || finish.is_some() {
                    pending.push_back(reply.chunk(choice, &text, &tokens, finish).to_string());
                }
            }
        });
    Sse::new(events).into_response()
}
