//! What the panels of `loss.png` share: the text style, tick labels, errors.

use anyhow::anyhow;
use plotters::chart::MeshStyle;
use plotters::coord::cartesian::Cartesian2d;
use plotters::coord::ranged1d::ValueFormatter;
use plotters::coord::types::RangedCoordf64;
use plotters::coord::CoordTranslate;
use plotters::prelude::*;
use plotters::style::FontStyle;
use std::ops::Range;

/// Background.
pub(crate) const BACKGROUND: RGBColor = RGBColor(255, 255, 255);
/// Text colour.
const TEXT: RGBColor = RGBColor(30, 30, 30);
/// Family name the embedded font is registered under ("sans-serif" too, for any
/// plotters default text style).
pub(super) const FONT: &str = "nanogpt-sans";

/// A text style of the embedded font.
pub(super) fn text(size: f64) -> TextStyle<'static> {
    FontDesc::new(FontFamily::Name(FONT), size, FontStyle::Normal).color(&TEXT)
}

/// Tick label for an iteration: an integer, with decimals only on a sub-unit axis.
pub(super) fn iter_label(x: &f64) -> String {
    if (x - x.round()).abs() < 1e-6 {
        format!("{x:.0}")
    } else {
        format!("{x:.1}")
    }
}

/// A panel's chart over `x` × `y`, with the margins and the y label area every
/// panel has; `x_labels`: the height of the area under the x axis.
pub(super) fn panel<'a, DB: DrawingBackend>(
    builder: &mut ChartBuilder<'a, '_, DB>,
    x_labels: u32,
    (x, y): (Range<f64>, Range<f64>),
) -> anyhow::Result<ChartContext<'a, DB, Cartesian2d<RangedCoordf64, RangedCoordf64>>> {
    builder
        .margin(16)
        .margin_right(36)
        .x_label_area_size(x_labels)
        .y_label_area_size(64)
        .build_cartesian_2d(x, y)
        .map_err(draw_err)
}

/// Draws `mesh`, its labels set, in the text and grid lines every panel has.
pub(super) fn draw_mesh<X, Y, DB>(mesh: &mut MeshStyle<'_, '_, X, Y, DB>) -> anyhow::Result<()>
where
    X: Ranged + ValueFormatter<X::ValueType>,
    Y: Ranged + ValueFormatter<Y::ValueType>,
    DB: DrawingBackend,
{
    mesh.label_style(text(15.0))
        .axis_desc_style(text(17.0))
        .bold_line_style(RGBColor(222, 222, 222))
        .light_line_style(RGBColor(244, 244, 244))
        .axis_style(RGBColor(120, 120, 120))
        .draw()
        .map_err(draw_err)
}

/// Draws the legend of the series drawn on `chart`, boxed as every panel boxes it.
pub(super) fn draw_legend<'a, DB: DrawingBackend + 'a, CT: CoordTranslate>(
    chart: &mut ChartContext<'a, DB, CT>,
    position: SeriesLabelPosition,
) -> anyhow::Result<()> {
    chart
        .configure_series_labels()
        .position(position)
        .margin(12)
        .label_font(text(16.0))
        .background_style(BACKGROUND.mix(0.9))
        .border_style(RGBColor(190, 190, 190))
        .draw()
        .map_err(draw_err)?;
    Ok(())
}

pub(super) fn draw_err<E: std::fmt::Display>(e: E) -> anyhow::Error {
    anyhow!("drawing the loss plot: {e}")
}
