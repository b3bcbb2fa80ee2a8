//! The `loss.png` loss curve: plotters' bitmap backend renders into an RGB buffer, the
//! `png` crate encodes it, and the file is replaced atomically.
//!
//! Text uses Noto Sans Regular embedded in the binary (crate `ttf-noto-sans`,
//! Apache-2.0): it is registered with plotters' `ab_glyph` font table (for layout) and
//! drawn by [`CrispText`]; no system fonts or fontconfig are needed at run time.

use std::panic::{catch_unwind, AssertUnwindSafe};
use std::path::Path;
use std::sync::OnceLock;

use anyhow::{anyhow, Context, Result};
use plotters::prelude::*;
use plotters::style::{register_font, FontStyle};

use super::accuracy::{draw_accuracy, TaskSeries};
use super::style::{draw_err, draw_legend, draw_mesh, iter_label, panel, text, BACKGROUND, FONT};
use super::text::CrispText;
use super::Row;

/// Width of `loss.png` in pixels.
pub const PLOT_WIDTH: u32 = 1024;
/// Height of `loss.png` in pixels.
pub const PLOT_HEIGHT: u32 = 640;

/// Per-step training loss, raw (thin, light).
pub(crate) const STEP_RAW: RGBColor = RGBColor(170, 199, 232);
/// Per-step training loss, smoothed.
pub(crate) const STEP_SMOOTH: RGBColor = RGBColor(31, 119, 180);
/// Train loss measured at evaluations.
pub(crate) const EVAL_TRAIN: RGBColor = RGBColor(44, 160, 44);
/// Validation loss.
pub(crate) const EVAL_VAL: RGBColor = RGBColor(214, 39, 40);

/// The embedded font.
const FONT_BYTES: &[u8] = ttf_noto_sans::REGULAR;

/// At most this many buckets along x for the per-step lines (each bucket becomes one or
/// two points): pixel-level detail, and cheap even for a million steps.
pub(super) const MAX_BUCKETS: usize = PLOT_WIDTH as usize;

fn ensure_font() -> Result<()> {
    static REGISTERED: OnceLock<Result<(), String>> = OnceLock::new();
    REGISTERED
        .get_or_init(|| {
            for name in [FONT, "sans-serif"] {
                register_font(name, FontStyle::Normal, FONT_BYTES)
                    .map_err(|_| "embedded Noto Sans font failed to load".to_string())?;
            }
            Ok(())
        })
        .clone()
        .map_err(|e| anyhow!(e))
}

/// Renders the loss curve of `rows` to a `PLOT_WIDTH`x`PLOT_HEIGHT` PNG at `path`,
/// replacing it atomically (a crash never leaves a truncated file).
///
/// Per-step training loss is a thin light line under a smoothed line (centred moving
/// average, so it does not lag); eval train and val losses are lines with markers. The y
/// range ignores the first 5% of the iterations (the initial ~ln(vocab) losses) and rare
/// spikes, so the interesting part fills the plot; lines above it leave through the top.
/// Non-finite losses are skipped. Errors (including any panic inside the plotting
/// library) are returned, never raised.
pub fn plot_loss(rows: &[Row], path: &Path) -> Result<()> {
    ensure_font()?;
    let png = match catch_unwind(AssertUnwindSafe(|| render_png(rows))) {
        Ok(r) => r?,
        Err(panic) => {
            let msg = panic
                .downcast_ref::<&str>()
                .map(|s| s.to_string())
                .or_else(|| panic.downcast_ref::<String>().cloned())
                .unwrap_or_else(|| "unknown panic".into());
            return Err(anyhow!("plotting panicked: {msg}"));
        }
    };
    crate::fsutil::write_bytes_atomic(path, png).context("writing the loss plot")
}

type Points = Vec<(f64, f64)>;

/// The series to draw, prepared from the rows.
#[derive(Debug, Default)]
struct Series {
    step_raw: Points,
    step_smooth: Points,
    eval_train: Points,
    eval_val: Points,
}

impl Series {
    fn from_rows(rows: &[Row]) -> Series {
        let mut steps = Vec::new();
        let mut eval_train = Vec::new();
        let mut eval_val = Vec::new();
        for row in rows {
            match *row {
                Row::Step { iter, loss, .. } if loss.is_finite() => steps.push((iter, loss as f64)),
                Row::Step { .. } | Row::Task { .. } => {}
                Row::Eval {
                    iter,
                    train_loss,
                    val_loss,
                } => {
                    if train_loss.is_finite() {
                        eval_train.push((iter, train_loss as f64));
                    }
                    if val_loss.is_finite() {
                        eval_val.push((iter, val_loss as f64));
                    }
                }
            }
        }
        // Rows are logged in order; sort anyway (stable) so a hand-edited file still plots.
        for s in [&mut steps, &mut eval_train, &mut eval_val] {
            s.sort_by_key(|p| p.0);
        }
        let smooth = smooth(&steps);
        let (step_raw, step_smooth) = if steps.len() <= 2 * MAX_BUCKETS {
            (steps, smooth)
        } else {
            (bucket_min_max(&steps), bucket_last(&smooth))
        };
        let to_f64 = |v: Vec<(u64, f64)>| v.into_iter().map(|(x, y)| (x as f64, y)).collect();
        Series {
            step_raw: to_f64(step_raw),
            step_smooth: to_f64(step_smooth),
            eval_train: to_f64(eval_train),
            eval_val: to_f64(eval_val),
        }
    }

    fn all(&self) -> impl Iterator<Item = &(f64, f64)> {
        self.step_raw
            .iter()
            .chain(&self.eval_train)
            .chain(&self.eval_val)
    }

    /// The iterations of every point.
    fn xs(&self) -> impl Iterator<Item = f64> + '_ {
        self.all().map(|p| p.0)
    }
    /// y range: min over everything; max over the points past the first 5% of the x
    /// range (step losses at their 99.5th percentile, so lone spikes do not flatten the
    /// curve); padded by 5%.
    fn y_range(&self, (x_lo, x_hi): (f64, f64)) -> (f64, f64) {
        let cut = x_lo + (x_hi - x_lo) / 20.0;
        let lo = self.all().map(|p| p.1).fold(f64::INFINITY, f64::min);
        let tail = |s: &[(f64, f64)]| -> Vec<f64> {
            let t: Vec<f64> = s.iter().filter(|p| p.0 >= cut).map(|p| p.1).collect();
            if t.is_empty() {
                s.iter().map(|p| p.1).collect()
            } else {
                t
            }
        };
        let mut steps = tail(&self.step_raw);
        steps.sort_by(f64::total_cmp);
        let step_hi = match steps.len() {
            0 => f64::NEG_INFINITY,
            n => steps[((n - 1) as f64 * 0.995).round() as usize],
        };
        let hi = tail(&self.eval_train)
            .into_iter()
            .chain(tail(&self.eval_val))
            .fold(step_hi, f64::max);
        if !lo.is_finite() || !hi.is_finite() {
            return (0.0, 1.0);
        }
        let span = if hi - lo > 1e-6 {
            hi - lo
        } else {
            (hi.abs() * 0.1).max(0.1)
        };
        let y_lo = lo - 0.05 * span;
        // Losses are non-negative: do not pad below zero.
        let y_lo = if lo >= 0.0 { y_lo.max(0.0) } else { y_lo };
        (y_lo, hi + 0.05 * span)
    }
}

/// The x range of iterations `xs`: at least 10 iterations wide, so ticks stay on
/// whole iterations early on.
fn x_range(xs: impl Iterator<Item = f64>) -> (f64, f64) {
    let (lo, hi) = xs.fold((f64::INFINITY, f64::NEG_INFINITY), |(lo, hi), x| {
        (lo.min(x), hi.max(x))
    });
    if !lo.is_finite() {
        (0.0, 10.0)
    } else {
        (lo, hi.max(lo + 10.0))
    }
}

/// Centred moving average over about 2% of the points (half-width at most 500), so the
/// curve does not lag; at the ends the window is cut off (one-sided), which keeps the
/// latest point, the one people look at, as smooth as the rest.
pub(super) fn smooth(points: &[(u64, f64)]) -> Vec<(u64, f64)> {
    let n = points.len();
    let k = (n / 100).min(500);
    let mut prefix = Vec::with_capacity(n + 1);
    prefix.push(0.0f64);
    for p in points {
        prefix.push(prefix[prefix.len() - 1] + p.1);
    }
    (0..n)
        .map(|i| {
            let (a, b) = (i.saturating_sub(k), (i + k).min(n - 1));
            let mean = (prefix[b + 1] - prefix[a]) / (b + 1 - a) as f64;
            (points[i].0, mean)
        })
        .collect()
}

/// Bucket index of `x` among `MAX_BUCKETS` equal slices of the sorted points' x range.
fn bucketer(points: &[(u64, f64)]) -> impl Fn(u64) -> usize {
    let lo = points.first().map_or(0, |p| p.0);
    let hi = points.last().map_or(0, |p| p.0);
    let width = (hi - lo) as u128 + 1;
    move |x| ((x - lo) as u128 * MAX_BUCKETS as u128 / width) as usize
}

/// Downsamples sorted points to each bucket's minimum and maximum, in x order, which
/// draws the same noise band as every point would at this resolution.
pub(super) fn bucket_min_max(points: &[(u64, f64)]) -> Vec<(u64, f64)> {
    let bucket = bucketer(points);
    let mut out = Vec::with_capacity(2 * MAX_BUCKETS);
    let mut i = 0;
    while i < points.len() {
        let b = bucket(points[i].0);
        let (mut min, mut max) = (points[i], points[i]);
        let mut j = i + 1;
        while j < points.len() && bucket(points[j].0) == b {
            if points[j].1 < min.1 {
                min = points[j];
            }
            if points[j].1 > max.1 {
                max = points[j];
            }
            j += 1;
        }
        if min.0 <= max.0 {
            out.extend([min, max]);
        } else {
            out.extend([max, min]);
        }
        i = j;
    }
    out.dedup();
    out
}

/// Downsamples sorted (smooth) points to the first and the last point of each bucket.
fn bucket_last(points: &[(u64, f64)]) -> Vec<(u64, f64)> {
    let bucket = bucketer(points);
    let mut out = Vec::with_capacity(MAX_BUCKETS + 1);
    for (i, &p) in points.iter().enumerate() {
        let last_in_bucket = points
            .get(i + 1)
            .is_none_or(|next| bucket(next.0) != bucket(p.0));
        if i == 0 || last_in_bucket {
            out.push(p);
        }
    }
    out
}

/// Splits a polyline into the runs that lie within `lo..=hi` in y, cutting segments
/// where they cross the bounds (plotters would otherwise clamp them onto the edge).
pub(super) fn clip_y(points: &[(f64, f64)], lo: f64, hi: f64) -> Vec<Points> {
    let inside = |p: (f64, f64)| p.1 >= lo && p.1 <= hi;
    let mut runs = Vec::new();
    let mut run: Points = Vec::new();
    if let [p] = points {
        if inside(*p) {
            runs.push(vec![*p]);
        }
        return runs;
    }
    for seg in points.windows(2) {
        let (p, q) = (seg[0], seg[1]);
        // Parameter interval [t0, t1] of the segment inside the band.
        let (t0, t1) = if p.1 == q.1 {
            if inside(p) {
                (0.0, 1.0)
            } else {
                (1.0, 0.0)
            }
        } else {
            let (ta, tb) = ((lo - p.1) / (q.1 - p.1), (hi - p.1) / (q.1 - p.1));
            (ta.min(tb).max(0.0), ta.max(tb).min(1.0))
        };
        if t0 > t1 {
            if !run.is_empty() {
                runs.push(std::mem::take(&mut run));
            }
            continue;
        }
        let at = |t: f64| (p.0 + t * (q.0 - p.0), p.1 + t * (q.1 - p.1));
        if run.is_empty() || t0 > 0.0 {
            if !run.is_empty() {
                runs.push(std::mem::take(&mut run));
            }
            run.push(if t0 == 0.0 { p } else { at(t0) });
        }
        run.push(if t1 == 1.0 { q } else { at(t1) });
        if t1 < 1.0 {
            runs.push(std::mem::take(&mut run));
        }
    }
    if !run.is_empty() {
        runs.push(run);
    }
    runs
}

fn title(rows: &[Row]) -> String {
    let last_iter = rows.iter().map(Row::iter).max();
    let mut evals = rows.iter().filter_map(|r| match *r {
        Row::Eval { iter, val_loss, .. } if val_loss.is_finite() => Some((iter, val_loss)),
        _ => None,
    });
    let best_val = evals.clone().min_by(|a, b| a.1.total_cmp(&b.1));
    let last_val = evals.next_back();
    match (last_iter, last_val, best_val) {
        (None, ..) => "loss: no data yet".to_string(),
        (Some(it), Some((last_it, v)), Some((best_it, best))) if best_it != last_it => {
            format!("iter {it}: val loss {v:.4} (best {best:.4} at iter {best_it})")
        }
        (Some(it), Some((_, v)), _) => format!("iter {it}: val loss {v:.4}"),
        (Some(it), ..) => format!("iter {it}"),
    }
}

/// Renders the plot and returns the encoded PNG.
fn render_png(rows: &[Row]) -> Result<Vec<u8>> {
    let (w, h) = (PLOT_WIDTH, PLOT_HEIGHT);
    let mut rgb = vec![0u8; w as usize * h as usize * 3];
    render_rgb(rows, &mut rgb)?;

    let mut png = Vec::with_capacity(64 * 1024);
    let mut encoder = png::Encoder::new(&mut png, w, h);
    encoder.set_color(png::ColorType::Rgb);
    encoder.set_depth(png::BitDepth::Eight);
    let mut writer = encoder.write_header().context("encoding PNG")?;
    writer.write_image_data(&rgb).context("encoding PNG")?;
    writer.finish().context("encoding PNG")?;
    Ok(png)
}

/// The loss chart; with task rows, above a panel of their accuracies (the same
/// iterations along x).
fn render_rgb(rows: &[Row], rgb: &mut [u8]) -> Result<()> {
    let series = Series::from_rows(rows);
    let tasks = TaskSeries::from_rows(rows);
    let x = x_range(series.xs().chain(tasks.xs()));
    let backend = BitMapBackend::with_buffer(rgb, (PLOT_WIDTH, PLOT_HEIGHT));
    let root = CrispText::new(backend, FONT_BYTES)
        .map_err(draw_err)?
        .into_drawing_area();
    root.fill(&BACKGROUND).map_err(draw_err)?;
    match tasks.is_empty() {
        true => draw_losses(&root, rows, &series, x)?,
        false => {
            let (top, bottom) = root.split_vertically(PLOT_HEIGHT * 3 / 5);
            draw_losses(&top, rows, &series, x)?;
            draw_accuracy(&bottom, &tasks, x)?;
        }
    }
    root.present().map_err(draw_err)?;
    Ok(())
}

/// The loss chart of `rows` over iterations `x_lo..x_hi`.
fn draw_losses<DB: DrawingBackend>(
    area: &DrawingArea<DB, plotters::coord::Shift>,
    rows: &[Row],
    series: &Series,
    (x_lo, x_hi): (f64, f64),
) -> Result<()> {
    let (y_lo, y_hi) = series.y_range((x_lo, x_hi));
    let mut builder = ChartBuilder::on(area);
    builder.caption(title(rows), text(21.0));
    let mut chart = panel(&mut builder, 52, (x_lo..x_hi, y_lo..y_hi))?;
    draw_mesh(
        chart
            .configure_mesh()
            .x_desc("iteration")
            .y_desc("loss")
            .x_labels(10)
            .y_labels(10)
            .x_label_formatter(&iter_label),
    )?;

    let legend_line = |color: RGBColor| {
        move |(x, y): (i32, i32)| PathElement::new([(x, y), (x + 24, y)], color.stroke_width(3))
    };
    let legend_marker = |color: RGBColor| {
        move |(x, y): (i32, i32)| {
            EmptyElement::at((x, y))
                + PathElement::new([(0, 0), (24, 0)], color.stroke_width(2))
                + Circle::new((12, 0), 4, color.filled())
        }
    };
    let lines = |points: &[(f64, f64)], style: ShapeStyle| {
        clip_y(points, y_lo, y_hi)
            .into_iter()
            .map(move |run| PathElement::new(run, style))
    };

    if !series.step_raw.is_empty() {
        chart
            .draw_series(lines(&series.step_raw, STEP_RAW.stroke_width(1)))
            .map_err(draw_err)?;
        chart
            .draw_series(lines(&series.step_smooth, STEP_SMOOTH.stroke_width(2)))
            .map_err(draw_err)?
            .label("train (step)")
            .legend(legend_line(STEP_SMOOTH));
    }
    for (points, color, label) in [
        (&series.eval_train, EVAL_TRAIN, "train (eval)"),
        (&series.eval_val, EVAL_VAL, "val"),
    ] {
        if points.is_empty() {
            continue;
        }
        chart
            .draw_series(lines(points, color.stroke_width(2)))
            .map_err(draw_err)?
            .label(label)
            .legend(legend_marker(color));
        let markers = points
            .iter()
            .filter(|p| p.1 >= y_lo && p.1 <= y_hi)
            .map(|&p| Circle::new(p, 4, color.filled()));
        chart.draw_series(markers).map_err(draw_err)?;
    }
    if series.all().next().is_some() {
        draw_legend(&mut chart, SeriesLabelPosition::UpperRight)?;
    }
    Ok(())
}
