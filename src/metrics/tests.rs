use super::plot::{
    bucket_min_max, clip_y, smooth, EVAL_TRAIN, EVAL_VAL, MAX_BUCKETS, STEP_RAW, STEP_SMOOTH,
};
use super::*;

use std::collections::BTreeSet;

fn step(iter: u64, loss: f32) -> Row {
    Row::Step {
        iter,
        loss,
        lr: 6e-4,
        ms: 812.5,
        tokens_per_sec: 20164.0,
        mfu: None,
        grad_norm: None,
    }
}

fn eval(iter: u64, train_loss: f32, val_loss: f32) -> Row {
    Row::Eval {
        iter,
        train_loss,
        val_loss,
    }
}

/// Steps 0..n with evals every `every` iterations (before the step, as the trainer does).
fn run_rows(n: u64, every: u64) -> Vec<Row> {
    let mut rows = Vec::new();
    for i in 0..n {
        if i % every == 0 {
            rows.push(eval(i, i as f32, i as f32 + 0.5));
        }
        rows.push(step(i, i as f32));
    }
    rows
}

fn keys(line: &str) -> BTreeSet<String> {
    let v: serde_json::Value = serde_json::from_str(line).unwrap();
    v.as_object().unwrap().keys().cloned().collect()
}

fn set(keys: &[&str]) -> BTreeSet<String> {
    keys.iter().map(|s| s.to_string()).collect()
}

#[test]
fn lines_have_exact_format_and_keys() {
    let dir = tempfile::tempdir().unwrap();
    let mut log = MetricsLog::open(dir.path(), None).unwrap();
    log.append(step(10, 4.25)).unwrap();
    log.append(Row::Step {
        iter: 11,
        loss: 4.0,
        lr: 0.0006,
        ms: 1.5,
        tokens_per_sec: 1000.0,
        mfu: Some(0.25),
        grad_norm: Some(1.125),
    })
    .unwrap();
    log.append(eval(12, 3.5, 3.75)).unwrap();

    let text = fs::read_to_string(dir.path().join(METRICS_FILE)).unwrap();
    let lines: Vec<&str> = text.lines().collect();
    assert_eq!(
        lines,
        [
            r#"{"iter":10,"loss":4.25,"lr":0.0006,"ms":812.5,"tokens_per_sec":20164.0}"#,
            r#"{"iter":11,"loss":4.0,"lr":0.0006,"ms":1.5,"tokens_per_sec":1000.0,"mfu":0.25,"grad_norm":1.125}"#,
            r#"{"iter":12,"train_loss":3.5,"val_loss":3.75}"#,
        ]
    );
    assert!(text.ends_with('\n'));
    assert_eq!(
        keys(lines[0]),
        set(&["iter", "loss", "lr", "ms", "tokens_per_sec"])
    );
    assert_eq!(
        keys(lines[1]),
        set(&[
            "iter",
            "loss",
            "lr",
            "ms",
            "tokens_per_sec",
            "mfu",
            "grad_norm"
        ])
    );
    assert_eq!(keys(lines[2]), set(&["iter", "train_loss", "val_loss"]));
    let v: serde_json::Value = serde_json::from_str(lines[0]).unwrap();
    assert!(v["iter"].is_u64());
}

#[test]
fn jsonl_round_trip() {
    let dir = tempfile::tempdir().unwrap();
    let rows = vec![
        step(0, 10.987_654),
        Row::Step {
            iter: 1,
            loss: 3.123_456_7,
            lr: 1.234_567e-5,
            ms: 1_234.567_890_123,
            tokens_per_sec: 98_765.432_1,
            mfu: Some(0.123_456_789),
            grad_norm: Some(0.987_654_3),
        },
        eval(2, 2.345_678, 3.456_789),
        step(u64::MAX, f32::MIN_POSITIVE),
    ];
    let mut log = MetricsLog::open(dir.path(), None).unwrap();
    for row in &rows {
        log.append(row.clone()).unwrap();
    }
    assert_eq!(log.rows(), &rows[..]);
    assert_eq!(read_rows(log.path()).unwrap(), rows);
    for row in &rows {
        assert_eq!(Row::from_json_line(&row.to_json_line()).unwrap(), *row);
    }
}

#[test]
fn non_finite_values_are_written_as_null_and_read_as_nan() {
    let row = Row::Step {
        iter: 3,
        loss: f32::NAN,
        lr: 1e-4,
        ms: 1.0,
        tokens_per_sec: f64::INFINITY,
        mfu: None,
        grad_norm: Some(f32::NAN),
    };
    let line = row.to_json_line();
    assert_eq!(
        line,
        r#"{"iter":3,"loss":null,"lr":0.0001,"ms":1.0,"tokens_per_sec":null,"grad_norm":null}"#
    );
    match Row::from_json_line(&line).unwrap() {
        Row::Step {
            loss,
            tokens_per_sec,
            grad_norm,
            mfu,
            ..
        } => {
            assert!(loss.is_nan() && tokens_per_sec.is_nan());
            assert!(grad_norm.unwrap().is_nan());
            assert_eq!(mfu, None);
        }
        other => panic!("{other:?}"),
    }
}

#[test]
fn unknown_keys_are_ignored_and_bad_rows_rejected() {
    let row = Row::from_json_line(r#"{"iter":1,"train_loss":2,"val_loss":3,"extra":"x"}"#).unwrap();
    assert_eq!(row, eval(1, 2.0, 3.0));
    for bad in [
        r#"[1,2]"#,
        r#"{"loss":1,"lr":1,"ms":1,"tokens_per_sec":1}"#,
        r#"{"iter":-1,"train_loss":2,"val_loss":3}"#,
        r#"{"iter":1,"loss":1,"lr":1,"ms":1}"#,
        r#"{"iter":1,"loss":"a","lr":1,"ms":1,"tokens_per_sec":1}"#,
        r#"{"iter":1,"train_loss":2}"#,
        r#"{"iter":1}"#,
    ] {
        assert!(Row::from_json_line(bad).is_err(), "{bad}");
    }
}

#[test]
fn fresh_open_starts_empty_file() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join(METRICS_FILE);
    fs::write(&path, "{\"iter\":1,\"train_loss\":1,\"val_loss\":1}\n").unwrap();
    let mut log = MetricsLog::open(dir.path(), None).unwrap();
    assert!(log.rows().is_empty());
    assert_eq!(fs::read_to_string(&path).unwrap(), "");
    log.append(step(0, 1.0)).unwrap();
    assert_eq!(read_rows(&path).unwrap(), vec![step(0, 1.0)]);
}

#[test]
fn open_creates_missing_out_dir() {
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("a/b");
    let mut log = MetricsLog::open(&out, Some(5)).unwrap();
    log.append(step(5, 1.0)).unwrap();
    assert_eq!(
        read_rows(&out.join(METRICS_FILE)).unwrap(),
        vec![step(5, 1.0)]
    );
}

#[test]
fn resume_drops_rows_at_or_after_checkpoint_iteration() {
    let dir = tempfile::tempdir().unwrap();
    let rows = run_rows(30, 10);
    let mut log = MetricsLog::open(dir.path(), None).unwrap();
    for row in &rows {
        log.append(row.clone()).unwrap();
    }
    drop(log);

    // Checkpoint at iteration 20: the crashed run logged eval 20 and steps 20..29 after it.
    let mut log = MetricsLog::open(dir.path(), Some(20)).unwrap();
    let kept: Vec<Row> = rows.iter().filter(|r| r.iter() < 20).cloned().collect();
    assert_eq!(kept.len(), 22);
    assert_eq!(log.rows(), &kept[..]);
    assert_eq!(read_rows(log.path()).unwrap(), kept);

    // The resumed run re-logs from iteration 20 on, after the kept rows.
    log.append(eval(20, 1.0, 2.0)).unwrap();
    log.append(step(20, 1.5)).unwrap();
    let mut expected = kept.clone();
    expected.extend([eval(20, 1.0, 2.0), step(20, 1.5)]);
    assert_eq!(log.rows(), &expected[..]);
    assert_eq!(read_rows(log.path()).unwrap(), expected);

    // Resuming at 0 keeps nothing; no temp files are left behind.
    let log = MetricsLog::open(dir.path(), Some(0)).unwrap();
    assert!(log.rows().is_empty());
    assert_eq!(fs::read_to_string(log.path()).unwrap(), "");
    let names: Vec<_> = fs::read_dir(dir.path())
        .unwrap()
        .map(|e| e.unwrap().file_name())
        .collect();
    assert_eq!(names, [METRICS_FILE]);
}

#[test]
fn resume_without_metrics_file_starts_empty() {
    let dir = tempfile::tempdir().unwrap();
    let log = MetricsLog::open(dir.path(), Some(100)).unwrap();
    assert!(log.rows().is_empty());
    assert!(log.path().exists());
}

#[test]
fn truncated_last_line_is_ignored() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join(METRICS_FILE);
    let full = format!(
        "{}\n{}\n",
        step(0, 5.0).to_json_line(),
        eval(0, 5.0, 5.5).to_json_line()
    );
    let partial = &step(1, 4.0).to_json_line()[..20];
    fs::write(&path, format!("{full}{partial}")).unwrap();
    assert_eq!(
        read_rows(&path).unwrap(),
        vec![step(0, 5.0), eval(0, 5.0, 5.5)]
    );

    // A complete last line that only lost its newline still counts.
    fs::write(&path, format!("{full}{}", step(1, 4.0).to_json_line())).unwrap();
    assert_eq!(read_rows(&path).unwrap().len(), 3);

    // Zero bytes left by a crash (no newline) are a truncated line too.
    fs::write(&path, format!("{full}\0\0\0\0")).unwrap();
    assert_eq!(read_rows(&path).unwrap().len(), 2);

    // Resuming drops the partial line and appends on a fresh line.
    fs::write(&path, format!("{full}{partial}")).unwrap();
    let mut log = MetricsLog::open(dir.path(), Some(1)).unwrap();
    log.append(step(1, 4.0)).unwrap();
    assert_eq!(
        read_rows(&path).unwrap(),
        vec![step(0, 5.0), eval(0, 5.0, 5.5), step(1, 4.0)]
    );
}

#[test]
fn garbage_line_error_names_file_and_line() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join(METRICS_FILE);
    let good = step(0, 5.0).to_json_line();
    fs::write(&path, format!("{good}\n\n{{\"iter\":1,oops\n{good}\n")).unwrap();
    let err = format!("{:#}", read_rows(&path).unwrap_err());
    assert!(
        err.contains(&format!("{}:3:", path.display())),
        "error should name file and line 3: {err}"
    );

    // A garbage last line that does end in a newline is not a truncation.
    fs::write(&path, format!("{good}\nnot json\n")).unwrap();
    let err = format!("{:#}", read_rows(&path).unwrap_err());
    assert!(err.contains(":2:"), "{err}");

    // Resuming from a corrupt file fails and leaves it alone.
    let before = fs::read(&path).unwrap();
    assert!(MetricsLog::open(dir.path(), Some(10)).is_err());
    assert_eq!(fs::read(&path).unwrap(), before);

    let err = format!(
        "{:#}",
        read_rows(&dir.path().join("missing.jsonl")).unwrap_err()
    );
    assert!(err.contains("missing.jsonl"), "{err}");
}

/// A plausible training run: loss decaying from ~ln(50257) with noise, evals every 100.
fn synthetic_run(steps: u64, eval_every: u64) -> Vec<Row> {
    let mut rows = Vec::new();
    let mut seed = 0x2545_f491_4f6c_dd1du64;
    let mut noise = move || {
        seed ^= seed << 13;
        seed ^= seed >> 7;
        seed ^= seed << 17;
        (seed >> 11) as f64 / (1u64 << 53) as f64 - 0.5
    };
    let curve = |i: u64| 3.0 + 7.9 * (-(i as f64) / (steps as f64 / 12.0)).exp();
    for i in 0..=steps {
        if i % eval_every == 0 {
            let c = curve(i);
            rows.push(eval(i, c as f32, (c + 0.08) as f32));
        }
        if i < steps {
            rows.push(Row::Step {
                iter: i,
                loss: (curve(i) + 0.35 * noise()) as f32,
                lr: 6e-4,
                ms: 800.0,
                tokens_per_sec: 20000.0,
                mfu: Some(0.3),
                grad_norm: Some(1.0),
            });
        }
    }
    rows
}

fn decode_png(path: &Path) -> (png::OutputInfo, Vec<u8>) {
    let decoder = png::Decoder::new(std::io::BufReader::new(fs::File::open(path).unwrap()));
    let mut reader = decoder.read_info().unwrap();
    let mut buf = vec![0; reader.output_buffer_size().unwrap()];
    let info = reader.next_frame(&mut buf).unwrap();
    buf.truncate(info.buffer_size());
    (info, buf)
}

fn count_colour(rgb: &[u8], c: plotters::style::RGBColor) -> usize {
    rgb.chunks_exact(3)
        .filter(|p| p[0] == c.0 && p[1] == c.1 && p[2] == c.2)
        .count()
}

#[test]
fn plot_renders_png_with_series_colours() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join(LOSS_PLOT_FILE);
    let rows = synthetic_run(2000, 100);
    plot_loss(&rows, &path).unwrap();
    // Rendering again replaces the file in place.
    plot_loss(&rows, &path).unwrap();

    let (info, rgb) = decode_png(&path);
    assert_eq!((info.width, info.height), (PLOT_WIDTH, PLOT_HEIGHT));
    assert_eq!(info.color_type, png::ColorType::Rgb);
    assert_eq!(info.bit_depth, png::BitDepth::Eight);
    for (name, colour, min) in [
        ("step raw", STEP_RAW, 500),
        ("step smoothed", STEP_SMOOTH, 500),
        ("eval train", EVAL_TRAIN, 300),
        ("val", EVAL_VAL, 300),
    ] {
        let n = count_colour(&rgb, colour);
        assert!(n >= min, "{name}: only {n} pixels of {colour:?}");
    }
    // Text was rendered: dark pixels (no series colour is dark in all channels) from
    // the title, tick labels, axis descriptions and legend.
    let is_dark = |p: &[u8]| p.iter().all(|&v| v < 90);
    let dark = rgb.chunks_exact(3).filter(|p| is_dark(p)).count();
    assert!(dark > 400, "only {dark} dark pixels: no text?");
    let title_band = 40 * PLOT_WIDTH as usize * 3;
    let title = rgb[..title_band]
        .chunks_exact(3)
        .filter(|p| is_dark(p))
        .count();
    assert!(title > 50, "only {title} dark pixels in the title band");

    let names: Vec<_> = fs::read_dir(dir.path())
        .unwrap()
        .map(|e| e.unwrap().file_name())
        .collect();
    assert_eq!(names, [LOSS_PLOT_FILE], "temp file left behind");
}

#[test]
fn plot_handles_empty_partial_and_non_finite_rows() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join(LOSS_PLOT_FILE);
    let cases: Vec<Vec<Row>> = vec![
        vec![],
        vec![step(0, 10.9)],
        vec![eval(0, 10.9, 10.95)],
        vec![step(5, 3.0), step(6, 3.0), step(7, 3.0)],
        vec![step(0, f32::NAN), eval(0, f32::INFINITY, f32::NAN)],
        vec![step(0, f32::NAN), step(1, 2.0), eval(1, f32::NAN, 2.5)],
        vec![step(u64::MAX - 1, 1.0), step(u64::MAX, 2.0)],
    ];
    for rows in cases {
        plot_loss(&rows, &path).unwrap_or_else(|e| panic!("{rows:?}: {e:#}"));
        let (info, _) = decode_png(&path);
        assert_eq!((info.width, info.height), (PLOT_WIDTH, PLOT_HEIGHT));
    }
}

#[test]
fn plot_failure_is_an_error() {
    let dir = tempfile::tempdir().unwrap();
    let err = plot_loss(
        &synthetic_run(10, 5),
        &dir.path().join("no/such/dir/loss.png"),
    )
    .unwrap_err();
    assert!(format!("{err:#}").contains("loss.png"), "{err:#}");
}

#[test]
fn long_runs_are_downsampled_for_plotting() {
    let points: Vec<(u64, f64)> = (0..300_000u64)
        .map(|i| (i, if i == 123_457 { 50.0 } else { (i % 7) as f64 }))
        .collect();
    let down = bucket_min_max(&points);
    assert!(down.len() <= 2 * MAX_BUCKETS, "{}", down.len());
    assert!(down.windows(2).all(|w| w[0].0 <= w[1].0));
    assert!(down.contains(&(123_457, 50.0)), "spike kept");
    assert_eq!(down.iter().map(|p| p.1).fold(f64::INFINITY, f64::min), 0.0);
    assert_eq!(down.first().unwrap().0, 0);

    // Away from the ends, the smoothed curve of a ramp is the ramp (centred: no lag).
    let ramp: Vec<(u64, f64)> = (0..1000u64).map(|i| (i, i as f64)).collect();
    assert_eq!(smooth(&ramp)[10..990], ramp[10..990]);
    let flat = vec![(0, 4.0), (1, 4.0), (2, 4.0)];
    assert_eq!(smooth(&flat), flat);

    let dir = tempfile::tempdir().unwrap();
    let rows = synthetic_run(200_000, 10_000);
    let t = std::time::Instant::now();
    plot_loss(&rows, &dir.path().join(LOSS_PLOT_FILE)).unwrap();
    assert!(t.elapsed().as_secs_f64() < 5.0, "{:?}", t.elapsed());
}

#[test]
fn lines_are_clipped_not_clamped_to_the_y_range() {
    // Starts above the range, dips in, leaves through the top, comes back.
    let pts = [
        (0.0, 10.0),
        (1.0, 2.0),
        (2.0, 3.0),
        (3.0, 12.0),
        (4.0, 12.0),
        (5.0, 4.0),
    ];
    let runs = clip_y(&pts, 0.0, 6.0);
    assert_eq!(runs.len(), 2, "{runs:?}");
    assert_eq!(runs[0][0], (0.5, 6.0));
    assert_eq!(&runs[0][1..3], &[(1.0, 2.0), (2.0, 3.0)]);
    assert_eq!(runs[0][3], (2.0 + 1.0 / 3.0, 6.0));
    assert_eq!(runs[1], [(4.75, 6.0), (5.0, 4.0)]);
    assert!(clip_y(&[(0.0, 9.0), (1.0, 9.0)], 0.0, 6.0).is_empty());
    assert_eq!(clip_y(&[(0.0, 1.0)], 0.0, 6.0), [vec![(0.0, 1.0)]]);
}

fn task(iter: u64, name: &str, acc_norm: f64) -> Row {
    Row::Task {
        iter,
        task: name.into(),
        examples: 40,
        acc: 0.25,
        acc_norm,
        acc_bytes: 0.5,
        acc_token: 0.125,
    }
}

#[test]
fn task_rows_have_their_format_and_read_back() {
    let row = task(250, "hellaswag", 0.375);
    let line = row.to_json_line();
    assert_eq!(
        line,
        r#"{"iter":250,"task":"hellaswag","examples":40,"acc":0.25,"acc_norm":0.375,"acc_bytes":0.5,"acc_token":0.125}"#
    );
    assert_eq!(Row::from_json_line(&line).unwrap(), row);
    assert_eq!(row.iter(), 250);
    for bad in [
        r#"{"iter":1,"task":3,"examples":1,"acc":0,"acc_norm":0,"acc_bytes":0,"acc_token":0}"#,
        r#"{"iter":1,"task":"h","acc":0,"acc_norm":0,"acc_bytes":0,"acc_token":0}"#,
        r#"{"iter":1,"task":"h","examples":1,"acc":0,"acc_norm":0,"acc_bytes":0}"#,
    ] {
        assert!(Row::from_json_line(bad).is_err(), "{bad}");
    }
    // Resuming drops task rows past the checkpoint, as it drops the others.
    let dir = tempfile::tempdir().unwrap();
    let mut log = MetricsLog::open(dir.path(), None).unwrap();
    for r in [task(0, "h", 0.25), eval(0, 2.0, 2.5), task(10, "h", 0.5)] {
        log.append(r).unwrap();
    }
    let log = MetricsLog::open(dir.path(), Some(10)).unwrap();
    assert_eq!(log.rows(), [task(0, "h", 0.25), eval(0, 2.0, 2.5)]);
}

#[test]
fn task_rows_get_a_panel_of_their_own() {
    use super::accuracy::TASK_COLOURS;
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join(LOSS_PLOT_FILE);
    let mut rows = synthetic_run(2000, 100);
    plot_loss(&rows, &path).unwrap();
    let (_, plain) = decode_png(&path);
    assert_eq!(count_colour(&plain, TASK_COLOURS[0]), 0);
    for k in 0..=20 {
        rows.push(task(k * 100, "hellaswag", 0.25 + 0.005 * k as f64));
        rows.push(task(k * 100, "choice/arc", 0.4 + 0.002 * k as f64));
    }
    plot_loss(&rows, &path).unwrap();
    let (info, rgb) = decode_png(&path);
    assert_eq!((info.width, info.height), (PLOT_WIDTH, PLOT_HEIGHT));
    let row_bytes = PLOT_WIDTH as usize * 3;
    let split = (PLOT_HEIGHT * 3 / 5) as usize * row_bytes;
    let (top, bottom) = rgb.split_at(split);
    // Each task's line and markers in the lower panel only; the losses above it.
    for colour in &TASK_COLOURS[..2] {
        assert_eq!(count_colour(top, *colour), 0, "{colour:?} above");
        let n = count_colour(bottom, *colour);
        assert!(n >= 300, "{colour:?}: only {n} pixels below");
    }
    for colour in [STEP_SMOOTH, EVAL_VAL] {
        assert!(count_colour(top, colour) >= 300, "{colour:?}");
        assert_eq!(count_colour(bottom, colour), 0, "{colour:?} below");
    }
    // Task rows alone plot too.
    plot_loss(&rows[rows.len() - 2..], &path).unwrap();
}
