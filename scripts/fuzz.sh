#!/usr/bin/env bash
# Runs every fuzz target in fuzz/ for a bounded time, one after the other, and
# prints the executions and findings of each (see docs/reliability.md, "Fuzzing").
#
#   scripts/fuzz.sh [SECONDS_PER_TARGET] [TARGET...]     (default: 60 s, all targets)
#
# Needs cargo-fuzz (`cargo install cargo-fuzz`) and a nightly toolchain for
# AddressSanitizer (`rustup toolchain install nightly`). Without nightly it falls
# back to the stable compiler with RUSTC_BOOTSTRAP=1 (which lets stable accept the
# -Z flags cargo-fuzz passes) and no sanitizer (`-s none`): Rust's own checks
# (bounds, overflow with debug assertions, panics) still catch the bugs that
# matter for safe code, only out-of-bounds accesses inside `unsafe` go unseen.
#
# Seeds come from the repository (fixtures, configs) and a tiny checkpoint made
# with the nanogpt binary; the corpus grows in fuzz/corpus/, crashes land in
# fuzz/artifacts/TARGET/ (both ignored by git). Exit status 1 if anything crashed.
set -euo pipefail

cd "$(dirname "$0")/.."
ROOT=$PWD
SECONDS_PER_TARGET=${1:-60}
shift || true
ALL_TARGETS=(checkpoint safetensors_weights meta_json config_toml hf_config token_file prepare_readers
    adapter_config instruct_jsonl task_file serve_request gguf)
TARGETS=("$@")
[ ${#TARGETS[@]} -eq 0 ] && TARGETS=("${ALL_TARGETS[@]}")

if ! cargo fuzz --version >/dev/null 2>&1; then
    echo "cargo-fuzz is missing: cargo install cargo-fuzz" >&2
    exit 2
fi
if rustup run nightly rustc --version >/dev/null 2>&1; then
    FUZZ=(cargo +nightly fuzz)
    SANITIZER=address
else
    echo "note: no nightly toolchain; using stable with RUSTC_BOOTSTRAP=1 and no sanitizer" >&2
    export RUSTC_BOOTSTRAP=1
    FUZZ=(cargo fuzz)
    SANITIZER=none
fi

seed() { # seed TARGET NAME < bytes
    mkdir -p "fuzz/corpus/$1"
    cat >"fuzz/corpus/$1/$2"
}

make_seeds() {
    local tmp
    tmp=$(mktemp -d)
    trap 'rm -rf "$tmp"' RETURN
    cargo build --quiet --bin nanogpt
    local bin=$ROOT/target/debug/nanogpt
    # A tiny char-level dataset and a checkpoint trained on it for two steps.
    for i in $(seq 300); do
        printf 'To be, or not to be: that is the question %d.\nWhether tis nobler?\n' "$i"
    done >"$tmp/text.txt"
    (cd "$tmp" && "$bin" prepare text.txt --out ds --tokenizer char >/dev/null &&
        "$bin" train dataset=ds n_layer=1 n_head=1 n_embd=8 block_size=8 batch_size=2 \
            max_iters=1 eval_interval=1 eval_iters=1 out_dir=run >/dev/null 2>&1)
    seed checkpoint tiny <"$tmp/run/ckpt.safetensors"
    seed meta_json char <"$tmp/ds/meta.json"
    printf '{"tokenizer":"gpt2","vocab_size":50257,"train_tokens":4,"val_tokens":2,"dtype":"uint16"}' |
        seed meta_json gpt2
    { printf '\x40\x00\x10\x02'; head -c 512 "$tmp/ds/train.bin"; } | seed token_file tiny
    for f in configs/*.toml; do seed config_toml "$(basename "$f")" <"$f"; done
    printf 'n_layer = 2\nout_dir = "x"\n\0batch_size=3\n--init_from=resume\ndropout=0.1\n' |
        seed config_toml overrides
    for f in tests/fixtures/hf/*/config.json; do
        seed hf_config "$(basename "$(dirname "$f")")" <"$f"
    done
    seed safetensors_weights tiny_a <tests/fixtures/hf/tiny_a/model.safetensors
    { printf '\x00'; head -c 2000 "$tmp/text.txt"; } | seed prepare_readers txt
    { printf '\x01'; printf '{"text": "one doc"}\n{"text": "two\\n", "id": 2}\n'; } |
        seed prepare_readers jsonl
    { printf '\x02'; cat tests/fixtures/docs.parquet; } | seed prepare_readers parquet
    seed adapter_config peft <tests/fixtures/lora/adapter/adapter_config.json
    printf '{"peft_type": "LORA", "r": 4, "lora_alpha": 12, "target_modules": ["c_attn"], "layers_to_transform": [1], "layers_pattern": "h"}' |
        seed adapter_config layers
    printf '{"peft_type": "LORA", "r": 4, "target_modules": ".*\\\\.0\\\\.attn\\\\.c_attn", "exclude_modules": ["c_fc"]}' |
        seed adapter_config pattern
    { cat tests/fixtures/lora/adapter/adapter_config.json; printf '\0'; \
        cat tests/fixtures/lora/adapter/adapter_model.safetensors; } | seed adapter_config with_weights
    { printf '\x00'; cat tests/fixtures/instruct/alpaca.jsonl; } | seed instruct_jsonl alpaca
    { printf '\x00'; cat tests/fixtures/instruct/chat.jsonl; } | seed instruct_jsonl chat
    { printf '\x02'; printf '\xef\xbb\xbf{"messages": [{"role": "system", "content": "s"}, {"role": "user", "content": "u"}, {"role": "assistant", "content": "a"}]}\n'; } |
        seed instruct_jsonl bom
    { printf '\x00'; cat tests/fixtures/tasks/hellaswag.jsonl; } | seed task_file hellaswag
    { printf '\x01'; cat tests/fixtures/tasks/choice.jsonl; } | seed task_file choice
    printf '\x00{"prompt": [[464, 3797], "The cat"], "max_tokens": 4, "logprobs": 2, "echo": true, "stop": ["\\n"], "logit_bias": {"11": -100}, "stream": true, "stream_options": {"include_usage": true}}' |
        seed serve_request completions
    printf '\x01{"messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": [{"type": "text", "text": "Hi"}]}], "max_tokens": 8, "logprobs": true, "top_logprobs": 2, "n": 2, "seed": 3}' |
        seed serve_request chat
    for f in tests/fixtures/gguf/*.gguf; do seed gguf "$(basename "$f")" <"$f"; done
}

artifacts() { # crash/timeout/oom inputs saved for TARGET so far
    if [ -d "fuzz/artifacts/$1" ]; then find "fuzz/artifacts/$1" -type f | wc -l; else echo 0; fi
}

echo "seeding fuzz/corpus from the repository..."
make_seeds

declare -A RUNS CRASHES
status=0
for target in "${TARGETS[@]}"; do
    echo "=== $target: ${SECONDS_PER_TARGET}s (sanitizer: $SANITIZER)"
    log=$(mktemp)
    before=$(artifacts "$target")
    set +e
    (cd fuzz && "${FUZZ[@]}" run -s "$SANITIZER" -O "$target" "corpus/$target" -- \
        -max_total_time="$SECONDS_PER_TARGET" -rss_limit_mb=4096 -timeout=20 \
        -print_final_stats=1) >"$log" 2>&1
    rc=$?
    set -e
    RUNS[$target]=$(grep -oE 'stat::number_of_executed_units: *[0-9]+' "$log" | grep -oE '[0-9]+$' || echo "?")
    found=$(($(artifacts "$target") - before))
    CRASHES[$target]=$found
    if [ "$rc" -ne 0 ] || [ "$found" -gt 0 ]; then
        status=1
        grep -E 'ERROR|panicked|SUMMARY|Test unit written' "$log" | head -20 || true
        echo "(full log: $log)"
    else
        rm -f "$log"
    fi
done

printf '\n%-22s %14s %10s\n' target executions findings
for target in "${TARGETS[@]}"; do
    printf '%-22s %14s %10s\n' "$target" "${RUNS[$target]}" "${CRASHES[$target]}"
done
exit $status
