//! nanogpt: train and fine-tune GPT-2 and Llama-family language models on CPUs.
//!
//! The numerical core is llm.c-style: hand-written forward/backward kernels
//! ([`kernels`]) over flat parameter, gradient and activation buffers ([`model`]),
//! an AdamW optimizer over the same buffers ([`optim`]).

pub mod bench;
pub mod chat;
pub mod checkpoint;
pub mod cli;
pub mod config;
pub mod console;
pub mod data;
pub mod dist;
pub mod doctor;
pub mod eval;
pub mod fault;
pub mod fsutil;
pub mod gguf;
pub mod hf;
pub mod hub;
pub mod kernels;
pub mod launch;
pub mod metrics;
pub mod model;
pub mod model_source;
pub mod optim;
pub mod plan;
pub mod profile;
pub mod progress;
pub mod resident;
pub mod sample;
pub mod serve;
pub mod shutdown;
pub mod tasks;
pub mod tensor_file;
pub mod threads;
pub mod train;
pub mod tuning;
