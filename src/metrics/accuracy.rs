//! The second panel of `loss.png`: the accuracy (`acc_norm`, lm-evaluation-harness's
//! headline metric for HellaSwag) of each multiple-choice task scored during training,
//! one line with markers per task, over the same iterations as the loss chart.

use plotters::coord::Shift;
use plotters::prelude::*;

use super::style::{draw_err, draw_legend, draw_mesh, iter_label, panel};
use super::Row;
use anyhow::Result;

/// The tasks' colours, in the order the tasks first appear (then again).
pub(crate) const TASK_COLOURS: [RGBColor; 5] = [
    RGBColor(148, 103, 189),
    RGBColor(255, 127, 14),
    RGBColor(23, 190, 207),
    RGBColor(140, 86, 75),
    RGBColor(227, 119, 194),
];

/// Each task's `(iteration, acc_norm)` points, tasks in the order they first appear.
#[derive(Debug, Default)]
pub(super) struct TaskSeries {
    tasks: Vec<(String, Vec<(f64, f64)>)>,
}

impl TaskSeries {
    pub(super) fn from_rows(rows: &[Row]) -> TaskSeries {
        let mut series = TaskSeries::default();
        for row in rows {
            let Row::Task {
                iter,
                task,
                acc_norm,
                ..
            } = row
            else {
                continue;
            };
            if !acc_norm.is_finite() {
                continue;
            }
            let at = match series.tasks.iter().position(|(name, _)| name == task) {
                Some(i) => i,
                None => {
                    series.tasks.push((task.clone(), Vec::new()));
                    series.tasks.len() - 1
                }
            };
            series.tasks[at].1.push((*iter as f64, *acc_norm));
        }
        for (_, points) in &mut series.tasks {
            points.sort_by(|a, b| a.0.total_cmp(&b.0));
        }
        series
    }

    pub(super) fn is_empty(&self) -> bool {
        self.tasks.is_empty()
    }

    /// The iterations of every point.
    pub(super) fn xs(&self) -> impl Iterator<Item = f64> + '_ {
        self.tasks.iter().flat_map(|(_, p)| p.iter().map(|q| q.0))
    }

    /// The accuracies' range, padded, within [0, 1] (at least 0.05 tall).
    fn y_range(&self) -> (f64, f64) {
        let ys = self.tasks.iter().flat_map(|(_, p)| p.iter().map(|q| q.1));
        let (lo, hi) = ys.fold((1.0f64, 0.0f64), |(lo, hi), y| (lo.min(y), hi.max(y)));
        let pad = ((hi - lo) * 0.1).max(0.025);
        ((lo - pad).max(0.0), (hi + pad).min(1.0))
    }
}

/// Draws the accuracy panel over iterations `x_lo..x_hi`.
pub(super) fn draw_accuracy<DB: DrawingBackend>(
    area: &DrawingArea<DB, Shift>,
    tasks: &TaskSeries,
    (x_lo, x_hi): (f64, f64),
) -> Result<()> {
    let (y_lo, y_hi) = tasks.y_range();
    let mut chart = panel(&mut ChartBuilder::on(area), 44, (x_lo..x_hi, y_lo..y_hi))?;
    draw_mesh(
        chart
            .configure_mesh()
            .y_desc("acc_norm")
            .x_labels(10)
            .y_labels(6)
            .x_label_formatter(&iter_label)
            .y_label_formatter(&|y| format!("{y:.2}")),
    )?;
    for (k, (name, points)) in tasks.tasks.iter().enumerate() {
        let colour = TASK_COLOURS[k % TASK_COLOURS.len()];
        let last = points.last().map_or(f64::NAN, |p| p.1);
        chart
            .draw_series(LineSeries::new(points.clone(), colour.stroke_width(2)))
            .map_err(draw_err)?
            .label(format!("{name} {last:.4}"))
            .legend(move |(x, y)| {
                EmptyElement::at((x, y))
                    + PathElement::new([(0, 0), (24, 0)], colour.stroke_width(2))
                    + Circle::new((12, 0), 4, colour.filled())
            });
        let markers = points.iter().map(|&p| Circle::new(p, 4, colour.filled()));
        chart.draw_series(markers).map_err(draw_err)?;
    }
    draw_legend(&mut chart, SeriesLabelPosition::LowerRight)?;
    Ok(())
}
