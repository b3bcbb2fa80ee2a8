//! Every kind of bad input a user can hand the `nanogpt` binary, one test each:
//! the run must fail with a non-zero status and a one-line `error: ...` naming the
//! file or key and the fix, never panic or print a backtrace, and leave every file
//! that existed before it byte for byte as it was. The observed messages are listed
//! in docs/reliability.md ("Bad input").

use std::collections::BTreeMap;
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};
use std::sync::OnceLock;

use nanogpt::checkpoint::{self, CheckpointState};
use nanogpt::model::{ModelConfig, ParamLayout};

mod common;
use common::{
    command, fails, fixture, ok, process_temp_dir, refused, refused_multiline, run, succeeds,
    temp_dir, TINY_BATCH, TINY_MODEL,
};

/// The characters of the test dataset's vocabulary (ids 0..9).
const CHARS: &str = "\nabcdefgh";
const VOCAB: u16 = 9;

/// Two quick iterations on the test dataset; `out_dir` is `run` unless overridden.
const SCHEDULE: [&str; 6] = [
    "dataset=ds",
    "eval_iters=1",
    "eval_interval=2",
    "max_iters=2",
    "warmup_iters=1",
    "out_dir=run",
];

/// `train` with the tiny model and [`SCHEDULE`], then `extra` (later keys win).
fn train_args<'a>(extra: &[&'a str]) -> Vec<&'a str> {
    [&["train"], &TINY_MODEL[..], &TINY_BATCH, &SCHEDULE, extra].concat()
}

/// A scratch directory for one test: `ds/` holds a valid char-level dataset.
struct Scene {
    dir: tempfile::TempDir,
}

impl Scene {
    fn new(tag: &str) -> Scene {
        let scene = Scene {
            dir: temp_dir(&format!("bad-{tag}")),
        };
        scene.write_dataset("ds", 1000, 300, VOCAB);
        scene
    }

    fn path(&self) -> &Path {
        self.dir.path()
    }

    fn file(&self, rel: &str) -> PathBuf {
        self.path().join(rel)
    }

    fn write(&self, rel: &str, bytes: impl AsRef<[u8]>) {
        let path = self.file(rel);
        std::fs::create_dir_all(path.parent().unwrap()).unwrap();
        std::fs::write(path, bytes).unwrap();
    }

    /// `rel/` with `train` and `val` tokens cycling through `0..max_id`, and a
    /// meta.json that matches them when `max_id == VOCAB`.
    fn write_dataset(&self, rel: &str, train: usize, val: usize, max_id: u16) {
        self.write(&format!("{rel}/train.bin"), tokens(train, max_id));
        self.write(&format!("{rel}/val.bin"), tokens(val, max_id));
        self.write(&format!("{rel}/meta.json"), meta_json(train, val));
    }

    /// A finished tiny run (checkpoint, metrics, plot) copied into `rel/`.
    fn add_run(&self, rel: &str) {
        let dest = self.file(rel);
        std::fs::create_dir_all(&dest).unwrap();
        for entry in std::fs::read_dir(trained_run()).unwrap() {
            let entry = entry.unwrap();
            std::fs::copy(entry.path(), dest.join(entry.file_name())).unwrap();
        }
    }

    /// Runs the binary and checks the refusal: non-zero exit, no panic or
    /// backtrace, the last line of stderr is the one `error:` line and holds every
    /// phrase, and no file that existed before changed. Returns the error line.
    fn refused(&self, args: &[&str], phrases: &[&str]) -> String {
        self.refused_with(args, phrases, true)
    }

    /// [`Scene::refused`], the error allowed to continue on further lines (for a
    /// message that carries a command to copy).
    fn refused_with(&self, args: &[&str], phrases: &[&str], one_line: bool) -> String {
        let before = snapshot(self.path());
        // A backtrace must not appear even when one is asked for (command() asks).
        let out = run(command(self.path(), args).env("HF_HUB_OFFLINE", "1"));
        let stderr = match one_line {
            true => refused(&out),
            false => refused_multiline(&out),
        };
        let last = match one_line {
            true => stderr.lines().last().unwrap_or_default(),
            false => &stderr[stderr.find("error: ").unwrap_or(0)..],
        };
        assert!(last.starts_with("error: "), "{stderr}");
        for phrase in phrases {
            assert!(last.contains(phrase), "missing {phrase:?} in:\n{last}");
        }
        let after = snapshot(self.path());
        for (path, bytes) in &before {
            assert!(
                after.get(path) == Some(bytes),
                "{} changed or vanished after a refused run",
                path.display()
            );
        }
        last.to_string()
    }

    /// `nanogpt train` with the tiny settings, then `extra` (later keys win).
    fn train_refused(&self, extra: &[&str], phrases: &[&str]) -> String {
        self.refused(&train_args(extra), phrases)
    }
}

fn tokens(n: usize, max_id: u16) -> Vec<u8> {
    (0..n)
        .flat_map(|i| ((i * 7 % max_id as usize) as u16).to_le_bytes())
        .collect()
}

fn meta_json(train: usize, val: usize) -> String {
    serde_json::json!({
        "tokenizer": "char",
        "vocab_size": VOCAB,
        "train_tokens": train,
        "val_tokens": val,
        "chars": CHARS,
        "source": "bad_input test",
    })
    .to_string()
}

/// Every file under `dir` and its bytes.
fn snapshot(dir: &Path) -> BTreeMap<PathBuf, Vec<u8>> {
    let mut files = BTreeMap::new();
    let mut stack = vec![dir.to_path_buf()];
    while let Some(d) = stack.pop() {
        for entry in std::fs::read_dir(&d).unwrap() {
            let path = entry.unwrap().path();
            if path.is_dir() {
                stack.push(path);
            } else if !path.ends_with(".nanogpt.lock") {
                // (The lock file records the last run that held the folder: a refused
                // run may have been that run.)
                files.insert(path.clone(), std::fs::read(&path).unwrap());
            }
        }
    }
    files
}

/// A tiny run trained once for all tests (its out_dir holds ckpt.safetensors).
fn trained_run() -> &'static Path {
    static RUN: OnceLock<PathBuf> = OnceLock::new();
    RUN.get_or_init(|| {
        let scene = Scene::new("trained");
        succeeds(&mut command(scene.path(), train_args(&[])));
        let keep = process_temp_dir("bad-trained-run");
        for entry in std::fs::read_dir(scene.file("run")).unwrap() {
            let entry = entry.unwrap();
            std::fs::copy(entry.path(), keep.join(entry.file_name())).unwrap();
        }
        keep
    })
}

fn tiny_hf_model() -> PathBuf {
    fixture("hf/tiny_a")
}

// ---- token files -------------------------------------------------------------

#[test]
fn missing_train_bin() {
    let s = Scene::new("missing-bin");
    std::fs::remove_file(s.file("ds/train.bin")).unwrap();
    s.train_refused(&[], &["ds/train.bin", "nanogpt prepare"]);
}

#[test]
fn empty_val_bin() {
    let s = Scene::new("empty-bin");
    s.write("ds/val.bin", b"");
    s.write("ds/meta.json", meta_json(1000, 0));
    s.train_refused(
        &[],
        &["ds/val.bin", "is empty", "prepare the dataset again"],
    );
}

#[test]
fn odd_length_train_bin() {
    let s = Scene::new("odd-bin");
    let mut bytes = tokens(1000, VOCAB);
    bytes.push(0);
    s.write("ds/train.bin", bytes);
    s.train_refused(
        &[],
        &[
            "ds/train.bin",
            "not a whole number of uint16",
            "prepare the dataset again",
        ],
    );
}

#[test]
fn truncated_val_bin() {
    let s = Scene::new("truncated-bin");
    s.write("ds/val.bin", tokens(200, VOCAB));
    s.train_refused(
        &[],
        &[
            "ds/val.bin",
            "200 tokens",
            "says 300",
            "prepare the dataset again",
        ],
    );
}

#[test]
fn token_beyond_the_vocabulary() {
    let s = Scene::new("vocab");
    let mut bytes = tokens(1000, VOCAB);
    bytes[1200..1202].copy_from_slice(&VOCAB.to_le_bytes());
    s.write("ds/train.bin", bytes);
    s.train_refused(
        &[],
        &[
            "ds/train.bin",
            "token id 9 at position 600",
            "vocabulary of 9",
            "prepare the dataset again",
        ],
    );
}

#[test]
fn eval_data_beyond_the_model_vocabulary() {
    let s = Scene::new("eval-vocab");
    s.add_run("run");
    s.write("big.bin", tokens(100, 300));
    s.refused(
        &["eval", "--init-from", "run", "--data", "big.bin"],
        &["big.bin", "outside the vocabulary of 9"],
    );
}

#[test]
fn dataset_shorter_than_a_block() {
    let s = Scene::new("short");
    s.write_dataset("ds", 1000, 16, VOCAB);
    s.train_refused(
        &[],
        &[
            "ds/val.bin",
            "16 tokens",
            "block_size 16",
            "smaller block_size or more data",
        ],
    );
}

// ---- meta.json ---------------------------------------------------------------

#[test]
fn meta_vocab_smaller_than_the_tokens() {
    let s = Scene::new("meta-vocab");
    let meta = serde_json::json!({
        "tokenizer": "char", "vocab_size": 5, "train_tokens": 1000,
        "val_tokens": 300, "chars": "\nabcd",
    });
    s.write("ds/meta.json", meta.to_string());
    s.train_refused(
        &[],
        &["ds/train.bin", "outside the vocabulary of 5", "meta.json"],
    );
}

#[test]
fn meta_with_a_wrong_dtype_field() {
    let s = Scene::new("meta-dtype");
    let mut meta: serde_json::Value = serde_json::from_str(&meta_json(1000, 300)).unwrap();
    meta["dtype"] = "int64".into();
    s.write("ds/meta.json", meta.to_string());
    s.train_refused(&[], &["ds/meta.json", "int64", "uint16", "uint32"]);
    // uint16 files said to be uint32 hold half as many tokens as meta.json says.
    meta["dtype"] = "uint32".into();
    s.write("ds/meta.json", meta.to_string());
    s.train_refused(&[], &["ds/train.bin", "holds 500 tokens", "says 1000"]);
}

#[test]
fn meta_with_an_unknown_tokenizer() {
    let s = Scene::new("meta-tokenizer");
    s.write(
        "ds/meta.json",
        meta_json(1000, 300).replace("\"char\"", "\"chr\""),
    );
    s.train_refused(&[], &["ds/meta.json", "chr", "nanogpt prepare"]);
}

#[test]
fn meta_chars_disagree_with_vocab_size() {
    let s = Scene::new("meta-chars");
    s.write(
        "ds/meta.json",
        meta_json(1000, 300).replace("abcdefgh", "abc"),
    );
    s.train_refused(
        &[],
        &[
            "ds/meta.json",
            "`chars` has 4 characters",
            "vocab_size is 9",
        ],
    );
}

#[test]
fn meta_json_truncated() {
    let s = Scene::new("meta-truncated");
    let meta = meta_json(1000, 300);
    s.write("ds/meta.json", &meta[..meta.len() / 2]);
    s.train_refused(
        &[],
        &["ds/meta.json", "not a valid dataset description", "prepare"],
    );
}

#[test]
fn nanogpt_meta_pkl_is_not_unpickled() {
    let s = Scene::new("meta-pkl");
    std::fs::remove_file(s.file("ds/meta.json")).unwrap();
    s.write("ds/meta.pkl", b"\x80\x04 never parsed");
    s.train_refused(&[], &["meta.pkl", "pickle", "nanogpt prepare"]);
}

// ---- checkpoints and safetensors -----------------------------------------------

fn truncate(s: &Scene, rel: &str) {
    let bytes = std::fs::read(s.file(rel)).unwrap();
    s.write(rel, &bytes[..bytes.len() / 2]);
}

/// Overwrites the JSON header of a safetensors file with bytes that are not JSON.
fn corrupt_header(s: &Scene, rel: &str) {
    let mut bytes = std::fs::read(s.file(rel)).unwrap();
    bytes[8..40].fill(b'#');
    s.write(rel, bytes);
}

/// Deletes the interval checkpoints of `rel` (the final state of the trained run),
/// so that `ckpt.safetensors` is the only one to resume from.
fn only_the_best_checkpoint(s: &Scene, rel: &str) {
    for entry in std::fs::read_dir(s.file(rel)).unwrap() {
        let path = entry.unwrap().path();
        let name = path.file_name().unwrap().to_string_lossy().into_owned();
        if name.starts_with("ckpt-") {
            std::fs::remove_file(path).unwrap();
        }
    }
}

#[test]
fn resume_from_a_truncated_checkpoint() {
    let s = Scene::new("resume-truncated");
    s.add_run("run");
    only_the_best_checkpoint(&s, "run");
    truncate(&s, "run/ckpt.safetensors");
    s.train_refused(
        &["init_from=resume"],
        &[
            "run/ckpt.safetensors",
            "damaged or truncated",
            "init_from=scratch",
        ],
    );
}

#[test]
fn resume_from_a_corrupt_checkpoint() {
    let s = Scene::new("resume-corrupt");
    s.add_run("run");
    only_the_best_checkpoint(&s, "run");
    corrupt_header(&s, "run/ckpt.safetensors");
    s.train_refused(
        &["init_from=resume"],
        &["run/ckpt.safetensors", "damaged or truncated"],
    );
}

#[test]
fn eval_from_a_truncated_checkpoint() {
    let s = Scene::new("eval-truncated");
    s.add_run("run");
    truncate(&s, "run/ckpt.safetensors");
    s.refused(
        &["eval", "--init-from", "run", "--data", "ds/val.bin"],
        &["run/ckpt.safetensors", "damaged or truncated"],
    );
}

#[test]
fn sample_from_a_corrupt_checkpoint() {
    let s = Scene::new("sample-corrupt");
    s.add_run("run");
    corrupt_header(&s, "run/ckpt.safetensors");
    s.refused(
        &["sample", "--out-dir", "run", "--max-new-tokens", "4"],
        &["run/ckpt.safetensors", "damaged or truncated"],
    );
}

#[test]
fn export_from_a_truncated_checkpoint() {
    let s = Scene::new("export-truncated");
    s.add_run("run");
    s.add_run("hf");
    truncate(&s, "run/ckpt.safetensors");
    s.refused(
        &["export", "--from", "run", "--to", "hf"],
        &["run/ckpt.safetensors", "damaged or truncated"],
    );
}

#[test]
fn init_from_a_truncated_safetensors_file() {
    let s = Scene::new("init-truncated-file");
    let bytes = std::fs::read(tiny_hf_model().join("model.safetensors")).unwrap();
    s.write("w/model.safetensors", &bytes[..bytes.len() - 100]);
    s.train_refused(
        &["init_from=w/model.safetensors"],
        &[
            "w/model.safetensors",
            "not a valid safetensors file",
            "download it again",
        ],
    );
}

#[test]
fn init_from_a_model_directory_with_corrupt_weights() {
    let s = Scene::new("init-corrupt-dir");
    let model = tiny_hf_model();
    s.write(
        "m/config.json",
        std::fs::read(model.join("config.json")).unwrap(),
    );
    s.write(
        "m/model.safetensors",
        std::fs::read(model.join("model.safetensors")).unwrap(),
    );
    corrupt_header(&s, "m/model.safetensors");
    s.train_refused(
        &["init_from=m"],
        &["m/model.safetensors", "not a valid safetensors file"],
    );
}

#[test]
fn eval_from_a_truncated_safetensors_file() {
    let s = Scene::new("eval-truncated-file");
    let bytes = std::fs::read(tiny_hf_model().join("model.safetensors")).unwrap();
    s.write("w.safetensors", &bytes[..bytes.len() / 3]);
    s.refused(
        &[
            "eval",
            "--init-from",
            "w.safetensors",
            "--data",
            "ds/val.bin",
        ],
        &["w.safetensors", "not a valid safetensors file"],
    );
}

/// Writes a checkpoint into `s/rel` whose run state says `claimed` while its
/// tensors are laid out for `actual`.
fn write_mismatched_checkpoint(s: &Scene, rel: &str, claimed: ModelConfig, actual: &ModelConfig) {
    let layout = ParamLayout::new(actual);
    let state = CheckpointState {
        model: claimed,
        train_config: serde_json::json!({}),
        iter_num: 2,
        best_val_loss: 2.0,
        adam_step: 2,
        tokenizer: serde_json::from_str(&meta_json(1000, 300)).unwrap(),
        world_size: 1,
        lora: None,
        dataset: None,
        bf16_kernel: None,
        ab_switches: Vec::new(),
    };
    let dir = s.file(rel);
    std::fs::create_dir_all(&dir).unwrap();
    let params = vec![0.01; layout.len];
    checkpoint::save(&dir, &state, &layout, &params, None).unwrap();
}

fn tiny_model() -> ModelConfig {
    ModelConfig {
        vocab_size: VOCAB as usize,
        block_size: 16,
        n_layer: 2,
        n_head: 2,
        n_embd: 32,
        bias: false,
        dropout: 0.0,
        llama: None,
    }
}

#[test]
fn checkpoint_shapes_disagree_with_its_config() {
    let s = Scene::new("ckpt-shapes");
    // Wider tensors than the state says (narrower ones are caught earlier, as too
    // few bytes for the parameters: checkpoint_claiming_a_huge_model).
    let actual = ModelConfig {
        n_embd: 64,
        ..tiny_model()
    };
    write_mismatched_checkpoint(&s, "run", tiny_model(), &actual);
    s.train_refused(
        &["init_from=resume"],
        &["run/ckpt.safetensors", "shapes disagree"],
    );
    s.refused(
        &["eval", "--init-from", "run", "--data", "ds/val.bin"],
        &["run/ckpt.safetensors", "shapes disagree"],
    );
}

#[test]
fn checkpoint_with_an_impossible_model_config() {
    let s = Scene::new("ckpt-config");
    let claimed = ModelConfig {
        n_head: 3,
        ..tiny_model()
    };
    write_mismatched_checkpoint(&s, "run", claimed, &tiny_model());
    s.refused(
        &["sample", "--out-dir", "run", "--max-new-tokens", "4"],
        &[
            "run/ckpt.safetensors",
            "n_embd (32) must be divisible by n_head (3)",
        ],
    );
}

#[test]
fn checkpoint_claiming_a_huge_model() {
    let s = Scene::new("ckpt-huge");
    let claimed = ModelConfig {
        n_layer: 1 << 40,
        ..tiny_model()
    };
    write_mismatched_checkpoint(&s, "run", claimed, &tiny_model());
    s.refused(
        &["eval", "--init-from", "run", "--data", "ds/val.bin"],
        &["run/ckpt.safetensors", "n_layer"],
    );
}

#[test]
fn resume_on_a_dataset_with_another_vocabulary() {
    let s = Scene::new("resume-vocab");
    let other = ModelConfig {
        vocab_size: 65,
        ..tiny_model()
    };
    write_mismatched_checkpoint(&s, "run", other.clone(), &other);
    s.train_refused(
        &["init_from=resume"],
        &["cannot resume from run", "65 tokens", "meta.json says 9"],
    );
}

/// `rel/ckpt.safetensors`: the trained run's newest checkpoint, its run state and
/// AdamW second moments edited by `edit` (as a hand edit or a hostile file would).
fn write_edited_checkpoint(
    s: &Scene,
    rel: &str,
    edit: impl FnOnce(&mut CheckpointState, &mut [f32]),
) {
    let ckpt = checkpoint::Checkpoint::open_latest(trained_run())
        .unwrap()
        .checkpoint;
    let layout = ParamLayout::new(&ckpt.state.model);
    let mut params = vec![0.0; layout.len];
    ckpt.load_params(&layout, &mut params).unwrap();
    let (mut m, mut v) = (vec![0.0; layout.len], vec![0.0; layout.len]);
    assert!(ckpt.load_moments(&layout, &mut m, &mut v).unwrap());
    let mut state = ckpt.state.clone();
    edit(&mut state, &mut v);
    let dir = s.file(rel);
    std::fs::create_dir_all(&dir).unwrap();
    checkpoint::save(
        &dir,
        &state,
        &layout,
        &params,
        Some(checkpoint::Moments { m: &m, v: &v }),
    )
    .unwrap();
}

/// A checkpoint whose run state was edited into one no run writes is refused by
/// resume and by sample, at once, naming the file and the field. (An iter_num of
/// 2^64 - 1 used to wrap the counter: the run "resumed" at 0 and overwrote the
/// checkpoint, exit 0.)
#[test]
fn checkpoint_with_an_impossible_run_state() {
    type Edit = fn(&mut CheckpointState, &mut [f32]);
    let cases: [(&str, Edit, &[&str]); 6] = [
        (
            "iter",
            |st, _| st.iter_num = u64::MAX,
            &["iter_num = 18446744073709551615"],
        ),
        (
            "adam",
            |st, _| st.adam_step = st.iter_num + 5,
            &["adam_step = 8 is more than iter_num = 3"],
        ),
        (
            "best",
            |st, _| st.best_val_loss = -1.0,
            &["best_val_loss = -1"],
        ),
        ("world", |st, _| st.world_size = 0, &["world_size = 0"]),
        (
            "tokenizer",
            |st, _| st.tokenizer["chars"] = "abc".into(),
            &["tokenizer: `chars` has 3 characters but vocab_size is 9"],
        ),
        (
            "moments",
            |_, v| v[7] = -1.0,
            &["optimizer.v.", "negative, NaN or infinite values"],
        ),
    ];
    for (tag, edit, phrases) in cases {
        let s = Scene::new(&format!("ckpt-state-{tag}"));
        write_edited_checkpoint(&s, "run", edit);
        let started = std::time::Instant::now();
        let mut phrases = phrases.to_vec();
        phrases.push("run/ckpt.safetensors");
        s.train_refused(&["init_from=resume", "max_iters=100"], &phrases);
        if tag != "moments" {
            // (Sampling reads no AdamW moments.)
            s.refused(
                &["sample", "--out-dir", "run", "--max-new-tokens", "4"],
                &phrases,
            );
        }
        assert!(
            started.elapsed().as_secs() < 20,
            "{tag}: {:?}",
            started.elapsed()
        );
    }
}

/// Resuming a run that already reached `max_iters` says the run is complete and exits
/// 0 without training or writing anything, so that a scheduler's requeue loop
/// (`until nanogpt train init_from=resume ...; do ...; done`) ends (it used to exit 1;
/// before that, it trained one more iteration past the end); `eval_only` still
/// evaluates it.
#[test]
fn resume_of_a_complete_run_exits_0() {
    let s = Scene::new("resume-finished");
    s.add_run("run");
    let before = snapshot(s.path());
    let (stdout, stderr) = succeeds(&mut command(s.path(), train_args(&["init_from=resume"])));
    assert!(
        stdout.contains(
            "run/ckpt-000003.safetensors resumes at iteration 3, past max_iters = 2: the run \
             is complete, nothing to train (raise max_iters to train it further"
        ),
        "{stdout}\n{stderr}"
    );
    assert!(!stdout.contains("step "), "{stdout}");
    assert!(
        snapshot(s.path()) == before,
        "a complete run changed its files"
    );
    succeeds(&mut command(
        s.path(),
        train_args(&["init_from=resume", "eval_only=True"]),
    ));
}

/// Resuming on a char dataset whose vocabulary differs (of the same size) is refused:
/// the ids would mean other characters (it used to train the old weights on the new
/// mapping without a word).
#[test]
fn resume_on_a_dataset_with_another_character_vocabulary() {
    let s = Scene::new("resume-chars");
    s.add_run("run");
    s.write_dataset("ds2", 1000, 300, VOCAB);
    let other = meta_json(1000, 300).replace("fgh", "fgi");
    s.write("ds2/meta.json", other);
    s.train_refused(
        &["dataset=ds2", "init_from=resume", "max_iters=6"],
        &[
            "cannot resume from run/ckpt-000003.safetensors",
            "character vocabularies differ (id 8 is 'h' in the checkpoint, 'i' in dataset ds2)",
            "resume on the data the run was trained on",
        ],
    );
}

/// Resuming on other data with the same tokenizer is allowed (continuing on new data
/// is legitimate) with a warning naming both; a checkpoint of an older version, which
/// records no dataset, resumes with a note.
#[test]
fn resume_on_other_data_with_the_same_tokenizer_warns() {
    let s = Scene::new("resume-other-data");
    s.add_run("run");
    s.write_dataset("ds3", 1200, 300, VOCAB);
    let args = train_args(&["dataset=ds3", "init_from=resume", "max_iters=4"]);
    let (_, stderr) = succeeds(&mut command(s.path(), args));
    assert!(
        stderr.contains(
            "warning: dataset ds3 (1200 + 300 tokens) is not the data \
             run/ckpt-000003.safetensors was trained on (ds, 1000 + 300 tokens)"
        ),
        "{stderr}"
    );
    // The same data: nothing said.
    let s = Scene::new("resume-same-data");
    s.add_run("run");
    let args = train_args(&["init_from=resume", "max_iters=4"]);
    let (_, stderr) = succeeds(&mut command(s.path(), args));
    assert!(
        !stderr.contains("warning") && !stderr.contains("note"),
        "{stderr}"
    );

    let s = Scene::new("resume-no-record");
    write_edited_checkpoint(&s, "run", |st, _| st.dataset = None);
    let args = train_args(&["init_from=resume", "max_iters=4"]);
    let (_, stderr) = succeeds(&mut command(s.path(), args));
    assert!(
        stderr.contains("note: run/ckpt.safetensors records no dataset"),
        "{stderr}"
    );
}

/// A dataset folder with token files but no meta.json is read as GPT-2 tokens, as
/// nanoGPT does, and now says so.
#[test]
fn a_dataset_without_meta_json_is_said_to_be_read_as_gpt2() {
    let s = Scene::new("no-meta");
    std::fs::remove_file(s.file("ds/meta.json")).unwrap();
    let (_, stderr) = succeeds(&mut command(s.path(), train_args(&["max_iters=0"])));
    assert!(
        stderr.contains("note: ds has no meta.json: reading its token files as GPT-2 BPE tokens"),
        "{stderr}"
    );
}

// ---- configuration -------------------------------------------------------------

#[test]
fn config_file_with_an_unknown_key() {
    let s = Scene::new("cfg-unknown");
    s.write("c.toml", "n_layer = 2\nlearning_rat = 1e-3\n");
    s.refused(
        &["train", "c.toml"],
        &[
            "c.toml line 2",
            "learning_rat",
            "did you mean `learning_rate`",
        ],
    );
}

#[test]
fn override_with_an_unknown_key() {
    let s = Scene::new("cfg-unknown-override");
    s.train_refused(&["n_layers=3"], &["n_layers=3", "did you mean `n_layer`"]);
}

#[test]
fn config_file_with_a_wrong_type() {
    let s = Scene::new("cfg-type");
    s.write("c.toml", "batch_size = \"twelve\"\n");
    s.refused(
        &["train", "c.toml"],
        &["c.toml line 1", "batch_size", "non-negative integer"],
    );
}

#[test]
fn config_file_that_is_not_toml() {
    let s = Scene::new("cfg-syntax");
    s.write("c.toml", "n_layer = = 2\n");
    s.refused(&["train", "c.toml"], &["c.toml", "invalid TOML"]);
}

#[test]
fn config_file_that_is_not_utf8() {
    let s = Scene::new("cfg-utf8");
    s.write("c.toml", b"dataset = \"caf\xe9\"\n");
    s.refused(
        &["train", "c.toml"],
        &["c.toml", "not UTF-8", "offset 14", "save it as UTF-8"],
    );
}

#[test]
fn zero_size() {
    let s = Scene::new("cfg-zero");
    s.train_refused(&["n_layer=0"], &["`n_layer` must be at least 1, got 0"]);
}

#[test]
fn negative_size() {
    let s = Scene::new("cfg-negative");
    s.train_refused(
        &["batch_size=-4"],
        &["batch_size=-4", "must be a non-negative integer, got -4"],
    );
}

#[test]
fn absurd_size() {
    let s = Scene::new("cfg-absurd");
    s.train_refused(&["n_embd=4000000000000"], &["n_embd", "too large"]);
}

#[test]
fn thousands_of_threads_are_refused_with_the_number_that_works() {
    let s = Scene::new("cfg-threads");
    let started = std::time::Instant::now();
    let msg = s.train_refused(&["threads=100000"], &["threads = 100000", "threads=0"]);
    assert!(started.elapsed().as_secs() < 10, "refused at once: {msg}");
    s.refused(
        &[
            "eval",
            "--init-from",
            "run",
            "--data",
            "x.bin",
            "--threads",
            "100000",
        ],
        &["threads = 100000", "at most"],
    );
}

#[test]
fn an_eval_batch_beyond_the_file_is_cut_to_its_windows() {
    // 10^11 sequences would need terabytes; the file has 12 windows of 8 tokens.
    let s = Scene::new("eval-huge-batch");
    s.add_run("run");
    s.write("small.bin", tokens(100, 9));
    let eval = |batch: &str| {
        let args = [
            "eval",
            "--init-from",
            "run",
            "--data",
            "small.bin",
            "--block-size",
            "8",
        ];
        let json = ok(
            s.path(),
            &[&args[..], &["--json", "--batch-size", batch]].concat(),
        );
        let v: serde_json::Value = serde_json::from_str(json.trim()).unwrap();
        (v["loss"].as_f64().unwrap(), v["tokens"].as_u64().unwrap())
    };
    assert_eq!(eval("100000000000"), eval("12"));
}

#[test]
fn a_negative_temperature_is_a_value_not_a_flag() {
    let s = Scene::new("sample-temp");
    s.add_run("run");
    s.refused(
        &["sample", "--out-dir", "run", "--temperature", "-1"],
        &["--temperature must be 0 or more", "got -1"],
    );
}

#[test]
fn sample_refuses_two_model_sources() {
    let s = Scene::new("sample-two-sources");
    s.add_run("run");
    let stderr = fails(
        s.path(),
        &["sample", "--out-dir", "run", "--init-from", "run"],
    );
    assert!(
        stderr.contains("--init-from") && stderr.contains("cannot be used with"),
        "{stderr}"
    );
}

#[test]
fn the_closing_sample_works_with_a_vocabulary_without_a_newline() {
    let s = Scene::new("no-newline");
    s.write("t.txt", "abcab cab bca ".repeat(200));
    ok(
        s.path(),
        &["prepare", "t.txt", "--out", "nonl", "--tokenizer", "char"],
    );
    let args = [&["train", "dataset=nonl"][..], &TINY_MODEL, &TINY_BATCH];
    let args = [
        &args.concat()[..],
        &["max_iters=2", "eval_interval=2", "eval_iters=1"],
    ];
    let stdout = ok(s.path(), &args.concat());
    assert!(
        stdout.contains("A sample from the trained model"),
        "{stdout}"
    );
}

#[test]
fn a_device_or_a_pipe_is_refused_as_data() {
    let s = Scene::new("not-a-file");
    s.add_run("run");
    let started = std::time::Instant::now();
    s.refused(
        &["eval", "--init-from", "run", "--data", "/dev/zero"],
        &["--data /dev/zero", "not a regular file"],
    );
    // The pipe lives outside the scene: the scene's before/after snapshot reads every
    // file in it, and reading a pipe with no writer would block.
    let pipes = temp_dir("bad-pipe");
    let fifo = pipes.path().join("f.txt");
    let made = std::process::Command::new("mkfifo").arg(&fifo).status();
    assert!(made.unwrap().success());
    let fifo = fifo.to_str().unwrap();
    s.refused(
        &["prepare", fifo, "--out", "p"],
        &[fifo, "not a regular file"],
    );
    assert!(
        started.elapsed().as_secs() < 10,
        "refused at once, without reading"
    );
}

#[test]
fn a_metrics_log_that_links_outside_out_dir_is_not_written_through() {
    let s = Scene::new("metrics-link");
    let outside = temp_dir("bad-outside");
    let target = outside.path().join("elsewhere.jsonl");
    std::fs::write(&target, "precious\n").unwrap();
    std::fs::create_dir_all(s.file("run")).unwrap();
    std::os::unix::fs::symlink(&target, s.file("run/metrics.jsonl")).unwrap();
    s.train_refused(
        &[],
        &["metrics.jsonl is a symbolic link", "remove the link"],
    );
    assert_eq!(std::fs::read_to_string(&target).unwrap(), "precious\n");
}

#[test]
fn n_embd_not_divisible_by_n_head() {
    let s = Scene::new("cfg-heads");
    s.train_refused(
        &["n_embd=30", "n_head=4"],
        &["`n_embd` (30) must be a multiple of `n_head` (4)"],
    );
}

#[test]
fn block_size_beyond_the_pretrained_positions() {
    let s = Scene::new("cfg-positions");
    let model = tiny_hf_model();
    let init = format!("init_from={}", model.display());
    s.train_refused(
        &[&init, "block_size=128"],
        &["block_size 128", "n_positions 64", "at most 64"],
    );
}

#[test]
fn pytorch_pickle_weights_are_never_loaded() {
    let s = Scene::new("pickle");
    s.write(
        "m/config.json",
        std::fs::read(tiny_hf_model().join("config.json")).unwrap(),
    );
    s.write("m/pytorch_model.bin", b"\x80\x02 never parsed");
    s.write("w.pt", b"\x80\x02 never parsed");
    let args = train_args(&["init_from=m"]);
    let convert = "GPT2LMHeadModel.from_pretrained('m').save_pretrained('m-safetensors')";
    s.refused_with(&args, &["m holds PyTorch pickle weights", convert], false);
    s.refused_with(
        &["eval", "--init-from", "w.pt", "--data", "ds/val.bin"],
        &["w.pt", "pickle can run arbitrary code"],
        false,
    );
}

// ---- prepare -------------------------------------------------------------------

/// `prepare` of `source` into `out/`, which already holds a prepared dataset that
/// must survive the failure.
fn prepare_refused(s: &Scene, source: &str, phrases: &[&str]) {
    s.write_dataset("out", 100, 20, VOCAB);
    s.refused(&["prepare", source, "--out", "out"], phrases);
}

#[test]
fn prepare_non_utf8_text_file() {
    let s = Scene::new("prep-txt");
    s.write("latin1.txt", b"plain start, then caf\xe9 au lait\n");
    prepare_refused(&s, "latin1.txt", &["latin1.txt", "byte offset 21", "iconv"]);
}

#[test]
fn prepare_non_utf8_file_in_a_folder() {
    let s = Scene::new("prep-dir");
    s.write("docs/a.txt", "fine text\n");
    s.write("docs/b.txt", b"\xff\xfe UTF-16 or so\n");
    prepare_refused(&s, "docs", &["docs/b.txt", "byte offset 0", "iconv"]);
}

#[test]
fn prepare_non_utf8_jsonl() {
    let s = Scene::new("prep-jsonl");
    s.write("d.jsonl", b"{\"text\": \"ok\"}\n{\"text\": \"caf\xe9\"}\n");
    prepare_refused(&s, "d.jsonl", &["d.jsonl", "not valid UTF-8", "iconv"]);
}

#[test]
fn prepare_jsonl_with_a_non_string_text() {
    let s = Scene::new("prep-jsonl-type");
    s.write("d.jsonl", "{\"text\": \"ok\"}\n{\"text\": 5}\n");
    prepare_refused(&s, "d.jsonl", &["d.jsonl line 2", "`text`", "not a string"]);
}

#[test]
fn prepare_corrupt_parquet() {
    let s = Scene::new("prep-parquet");
    s.write("d.parquet", b"PAR1 this is no parquet PAR1");
    prepare_refused(
        &s,
        "d.parquet",
        &["d.parquet", "not a readable parquet file"],
    );
}

/// Found by fuzzing: this file made the parquet crate panic.
#[test]
fn prepare_parquet_that_panics_the_parquet_reader() {
    let s = Scene::new("prep-parquet-panic");
    let file = fixture("fuzz/parquet_short_dictionary_page.parquet");
    s.write("d.parquet", std::fs::read(file).unwrap());
    prepare_refused(
        &s,
        "d.parquet",
        &[
            "d.parquet is a damaged parquet file",
            "convert the data to .jsonl",
        ],
    );
}

#[test]
fn prepare_empty_text() {
    let s = Scene::new("prep-empty");
    s.write("empty.txt", b"");
    prepare_refused(&s, "empty.txt", &["empty.txt", "contains no text"]);
}

#[test]
fn prepare_into_a_file() {
    let s = Scene::new("prep-out-file");
    s.write("t.txt", "some text to prepare\n".repeat(20));
    s.write("taken", b"a file, not a folder");
    s.refused(
        &["prepare", "t.txt", "--out", "taken"],
        &["--out taken is a file", "choose another --out"],
    );
}

// ---- out_dir -------------------------------------------------------------------

#[test]
fn out_dir_is_a_file() {
    let s = Scene::new("out-file");
    s.write("run", b"precious");
    s.train_refused(
        &[],
        &[
            "out_dir run is a file, not a directory",
            "choose another out_dir",
        ],
    );
}

/// A directory this process cannot create files in: a read-only directory for
/// an ordinary user; for root (which ignores permission bits) a directory of
/// procfs, where nobody can create files.
fn read_only_dir(s: &Scene) -> String {
    // procfs gives /proc/self the effective uid of the process reading it.
    let root = std::fs::metadata("/proc/self").is_ok_and(|m| m.uid() == 0);
    if root {
        return "/proc/self".to_string();
    }
    let dir = s.file("ro");
    std::fs::create_dir(&dir).unwrap();
    let mut perms = std::fs::metadata(&dir).unwrap().permissions();
    perms.set_readonly(true);
    std::fs::set_permissions(&dir, perms).unwrap();
    "ro".to_string()
}

#[test]
fn out_dir_is_read_only() {
    let s = Scene::new("out-readonly");
    let dir = read_only_dir(&s);
    let out = format!("out_dir={dir}");
    s.train_refused(&[&out], &[&dir, "out_dir", "choose another out_dir"]);
}

#[test]
fn prepare_into_a_read_only_folder() {
    let s = Scene::new("prep-readonly");
    s.write("t.txt", "some text to prepare\n".repeat(20));
    let dir = read_only_dir(&s);
    s.refused(&["prepare", "t.txt", "--out", &dir], &[&dir, "writable"]);
}

// ---- where files are written -----------------------------------------------------

/// Output file names are fixed; the only user path is out_dir itself. A
/// checkpoint's recorded config (here claiming another out_dir) never redirects
/// where a resumed run writes.
#[test]
fn a_checkpoint_cannot_redirect_where_a_run_writes() {
    let s = Scene::new("ckpt-paths");
    s.add_run("run");
    let ckpt = nanogpt::checkpoint::Checkpoint::open(&s.file("run")).unwrap();
    let mut state = ckpt.state.clone();
    let layout = ParamLayout::new(&state.model);
    let mut params = vec![0.0; layout.len];
    ckpt.load_params(&layout, &mut params).unwrap();
    let (mut m, mut v) = (vec![0.0; layout.len], vec![0.0; layout.len]);
    assert!(ckpt.load_moments(&layout, &mut m, &mut v).unwrap());
    drop(ckpt);
    state.train_config["out_dir"] = "../escaped".into();
    state.train_config["dataset"] = "../escaped-data".into();
    checkpoint::save(
        &s.file("run"),
        &state,
        &layout,
        &params,
        Some(checkpoint::Moments { m: &m, v: &v }),
    )
    .unwrap();

    let args = train_args(&["init_from=resume", "max_iters=4"]);
    succeeds(&mut command(s.path(), args));
    let parent = s.path().parent().unwrap();
    assert!(!parent.join("escaped").exists() && !parent.join("escaped-data").exists());
    let state = nanogpt::checkpoint::Checkpoint::open(&s.file("run"))
        .unwrap()
        .state;
    assert_eq!(
        state.iter_num, 4,
        "the resumed run wrote its checkpoint in run/"
    );
    assert_eq!(state.train_config["out_dir"], "run");
}

/// A sharded model's index names its shard files: a name that is a path
/// (`../x.safetensors`) is refused, never opened.
#[test]
fn a_shard_index_cannot_reach_outside_the_model_folder() {
    let s = Scene::new("shard-paths");
    let model = tiny_hf_model();
    let weights = std::fs::read(model.join("model.safetensors")).unwrap();
    s.write("outside.safetensors", &weights);
    s.write(
        "m/config.json",
        std::fs::read(model.join("config.json")).unwrap(),
    );
    let index = serde_json::json!({
        "metadata": {},
        "weight_map": {"transformer.wte.weight": "../outside.safetensors"},
    });
    s.write("m/model.safetensors.index.json", index.to_string());
    s.refused(
        &["eval", "--init-from", "m", "--data", "ds/val.bin"],
        &[
            "model.safetensors.index.json",
            "\"../outside.safetensors\"",
            "not a plain file name",
        ],
    );
}

// ---- files that are not files, or too large (issue 38) ---------------------------

/// Makes a named pipe at `path`: opened for reading, it blocks until a writer comes.
fn mkfifo(path: &Path) {
    std::fs::create_dir_all(path.parent().unwrap()).unwrap();
    let status = std::process::Command::new("mkfifo")
        .arg(path)
        .status()
        .unwrap();
    assert!(status.success());
}

/// [`Scene::refused`] of a command that must end within 20 s (a pipe opened for
/// reading used to block it forever; `/dev/zero` read until memory ran out).
fn refused_at_once(s: &Scene, args: &[&str], phrases: &[&str]) {
    let mut child = command(s.path(), args)
        .env("HF_HUB_OFFLINE", "1")
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let started = std::time::Instant::now();
    while child.try_wait().unwrap().is_none() {
        if started.elapsed() > std::time::Duration::from_secs(20) {
            child.kill().unwrap();
            child.wait().unwrap();
            panic!("{args:?} still runs after 20 s (blocked on a pipe or reading forever)");
        }
        std::thread::sleep(std::time::Duration::from_millis(50));
    }
    let out = child.wait_with_output().unwrap();
    let stderr = refused(&out);
    for phrase in phrases {
        assert!(stderr.contains(phrase), "missing {phrase:?} in:\n{stderr}");
    }
}

/// The LoRA fixture's base, and a copy of its adapter in `s/ad` with `broken`
/// replaced by a named pipe.
fn adapter_with_a_pipe(s: &Scene, broken: &str) -> (PathBuf, PathBuf) {
    for f in ["adapter_config.json", "adapter_model.safetensors"] {
        s.write(
            &format!("ad/{f}"),
            std::fs::read(fixture("lora/adapter").join(f)).unwrap(),
        );
    }
    std::fs::remove_file(s.file("ad").join(broken)).unwrap();
    mkfifo(&s.file("ad").join(broken));
    (fixture("lora/base"), fixture("lora/tokens.bin"))
}

#[test]
fn an_adapter_config_that_is_a_pipe() {
    let s = Scene::new("fifo-adapter-config");
    let (base, tokens) = adapter_with_a_pipe(&s, "adapter_config.json");
    let args = [
        "eval",
        "--init-from",
        base.to_str().unwrap(),
        "--adapter",
        "ad",
        "--data",
        tokens.to_str().unwrap(),
    ];
    refused_at_once(&s, &args, &["ad/adapter_config.json is not a regular file"]);
}

#[test]
fn adapter_weights_that_are_a_pipe() {
    let s = Scene::new("fifo-adapter-weights");
    let (base, tokens) = adapter_with_a_pipe(&s, "adapter_model.safetensors");
    let args = [
        "eval",
        "--init-from",
        base.to_str().unwrap(),
        "--adapter",
        "ad",
        "--data",
        tokens.to_str().unwrap(),
    ];
    refused_at_once(
        &s,
        &args,
        &["ad/adapter_model.safetensors is not a regular file"],
    );
}

#[test]
fn a_meta_json_that_is_a_pipe() {
    let s = Scene::new("fifo-meta");
    std::fs::remove_file(s.file("ds/meta.json")).unwrap();
    mkfifo(&s.file("ds/meta.json"));
    refused_at_once(
        &s,
        &train_args(&[]),
        &["ds/meta.json is not a regular file"],
    );
}

#[test]
fn a_model_config_json_that_is_a_pipe_or_dev_zero() {
    let s = Scene::new("fifo-hf-config");
    let weights = std::fs::read(tiny_hf_model().join("model.safetensors")).unwrap();
    s.write("m/model.safetensors", &weights);
    mkfifo(&s.file("m/config.json"));
    let args = ["eval", "--init-from", "m", "--data", "ds/val.bin"];
    refused_at_once(&s, &args, &["m/config.json is not a regular file"]);
    s.write("z/model.safetensors", &weights);
    std::os::unix::fs::symlink("/dev/zero", s.file("z/config.json")).unwrap();
    let args = ["eval", "--init-from", "z", "--data", "ds/val.bin"];
    refused_at_once(&s, &args, &["z/config.json is not a regular file"]);
}

/// A JSON file larger than any real one (a sparse file of 65 MiB here) is refused
/// before it is read.
#[test]
fn a_json_file_beyond_the_size_limit() {
    let s = Scene::new("json-size");
    let file = std::fs::OpenOptions::new()
        .write(true)
        .open(s.file("ds/meta.json"))
        .unwrap();
    file.set_len(65 << 20).unwrap();
    refused_at_once(
        &s,
        &train_args(&[]),
        &["ds/meta.json holds 68157440 bytes, more than the 67108864"],
    );
}

// ---- settings that are ignored or wrong, and links (issue 38) --------------------

/// `out_dir` (or `prepare --out`) that is a symbolic link to nothing is named as such
/// (it used to fail with a bare "File exists (os error 17)").
#[test]
fn out_dir_is_a_dangling_symbolic_link() {
    let s = Scene::new("out-dangling");
    std::os::unix::fs::symlink(s.file("gone"), s.file("run")).unwrap();
    let phrases = [
        "out_dir run is a symbolic link to",
        "gone, which does not exist",
        "remove the link",
    ];
    refused_at_once(&s, &train_args(&[]), &phrases);
    s.write("t.txt", "some text to prepare\n".repeat(20));
    std::os::unix::fs::symlink(s.file("gone"), s.file("out")).unwrap();
    refused_at_once(
        &s,
        &["prepare", "t.txt", "--out", "out"],
        &[
            "--out out is a symbolic link to nothing",
            "choose another --out",
        ],
    );
    assert!(
        !s.file("gone").exists(),
        "nothing made where the links point"
    );
}

/// `sample --num-samples 0`, and negative `--top-p` / `--repetition-penalty` (read as
/// unknown flags before), name the flag and the range.
#[test]
fn sample_flags_out_of_range() {
    let s = Scene::new("sample-flags");
    s.add_run("run");
    let base = ["sample", "--out-dir", "run", "--max-new-tokens", "2"];
    s.refused(
        &[&base[..], &["--num-samples", "0"]].concat(),
        &["--num-samples must be at least 1"],
    );
    s.refused(
        &[&base[..], &["--top-p", "-1"]].concat(),
        &["--top-p must be above 0 and at most 1", "got -1"],
    );
    s.refused(
        &[&base[..], &["--repetition-penalty", "-1"]].concat(),
        &["--repetition-penalty must be above 0", "got -1"],
    );
}

/// `plan` refuses what it used to plan silently otherwise: more ranks per host than
/// ranks, and an `adapter` it cannot read (planned as a full fine-tune).
#[test]
fn plan_refuses_impossible_placements_and_missing_adapters() {
    let s = Scene::new("plan-args");
    s.refused(
        &["plan", "--world-size", "2", "--ranks-per-host", "8"],
        &["--ranks-per-host 8 is more than the 2 ranks of the job"],
    );
    let init = format!("init_from={}", fixture("lora/base").display());
    s.refused(
        &["plan", &init, "adapter=missing", "block_size=16"],
        &[
            "adapter=missing: cannot load the LoRA adapter",
            "missing/adapter_config.json",
        ],
    );
}
