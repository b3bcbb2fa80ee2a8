//! Text rendering for the loss plot.
//!
//! plotters' `ab_glyph` text drawing snaps every glyph to a whole pixel and drops each
//! glyph's left side bearing, which gives visibly uneven letter spacing ("at i ter").
//! [`CrispText`] wraps a backend and re-implements only `draw_text`, placing glyphs at
//! sub-pixel positions with their bearings and kerning. Everything else (and plotters'
//! text size estimates, which this rendering matches) goes to the wrapped backend.

use ab_glyph::{point, Font, FontRef, PxScale, ScaleFont};
use plotters_backend::text_anchor::{HPos, VPos};
use plotters_backend::{
    BackendColor, BackendCoord, BackendStyle, BackendTextStyle, DrawingBackend, DrawingErrorKind,
};

/// Error for a font that failed to parse (the embedded one never does).
#[derive(Debug)]
pub(super) struct BadFont;

impl std::fmt::Display for BadFont {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("embedded font failed to load")
    }
}

impl std::error::Error for BadFont {}

/// A backend whose text is drawn with `font` (whatever family a style asks for).
pub(super) struct CrispText<B> {
    inner: B,
    font: FontRef<'static>,
}

impl<B> CrispText<B> {
    pub(super) fn new(inner: B, font_bytes: &'static [u8]) -> Result<Self, BadFont> {
        let font = FontRef::try_from_slice(font_bytes).map_err(|_| BadFont)?;
        Ok(CrispText { inner, font })
    }
}

impl<B: DrawingBackend> DrawingBackend for CrispText<B> {
    type ErrorType = B::ErrorType;

    fn get_size(&self) -> (u32, u32) {
        self.inner.get_size()
    }

    fn ensure_prepared(&mut self) -> Result<(), DrawingErrorKind<Self::ErrorType>> {
        self.inner.ensure_prepared()
    }

    fn present(&mut self) -> Result<(), DrawingErrorKind<Self::ErrorType>> {
        self.inner.present()
    }

    fn draw_pixel(
        &mut self,
        point: BackendCoord,
        color: BackendColor,
    ) -> Result<(), DrawingErrorKind<Self::ErrorType>> {
        self.inner.draw_pixel(point, color)
    }

    fn draw_line<S: BackendStyle>(
        &mut self,
        from: BackendCoord,
        to: BackendCoord,
        style: &S,
    ) -> Result<(), DrawingErrorKind<Self::ErrorType>> {
        self.inner.draw_line(from, to, style)
    }

    fn draw_rect<S: BackendStyle>(
        &mut self,
        upper_left: BackendCoord,
        bottom_right: BackendCoord,
        style: &S,
        fill: bool,
    ) -> Result<(), DrawingErrorKind<Self::ErrorType>> {
        self.inner.draw_rect(upper_left, bottom_right, style, fill)
    }

    fn draw_path<S: BackendStyle, I: IntoIterator<Item = BackendCoord>>(
        &mut self,
        path: I,
        style: &S,
    ) -> Result<(), DrawingErrorKind<Self::ErrorType>> {
        self.inner.draw_path(path, style)
    }

    fn draw_circle<S: BackendStyle>(
        &mut self,
        center: BackendCoord,
        radius: u32,
        style: &S,
        fill: bool,
    ) -> Result<(), DrawingErrorKind<Self::ErrorType>> {
        self.inner.draw_circle(center, radius, style, fill)
    }

    fn fill_polygon<S: BackendStyle, I: IntoIterator<Item = BackendCoord>>(
        &mut self,
        vert: I,
        style: &S,
    ) -> Result<(), DrawingErrorKind<Self::ErrorType>> {
        self.inner.fill_polygon(vert, style)
    }

    fn blit_bitmap(
        &mut self,
        pos: BackendCoord,
        size: (u32, u32),
        src: &[u8],
    ) -> Result<(), DrawingErrorKind<Self::ErrorType>> {
        self.inner.blit_bitmap(pos, size, src)
    }

    /// Same box and anchor conventions as plotters' ab_glyph text (pixel scale = style
    /// size, box height = size / 1.24, baseline at size / 2 below the box top, width =
    /// advances + kerning), so plotters' layout estimates hold.
    fn draw_text<S: BackendTextStyle>(
        &mut self,
        text: &str,
        style: &S,
        pos: BackendCoord,
    ) -> Result<(), DrawingErrorKind<Self::ErrorType>> {
        let color = style.color();
        if color.alpha == 0.0 || text.is_empty() {
            return Ok(());
        }
        let size = style.size() as f32;
        let font = self.font.as_scaled(PxScale::from(size));

        let mut glyphs = Vec::with_capacity(text.len());
        let mut caret = 0.0f32;
        let mut prev = None;
        for c in text.chars() {
            let id = font.glyph_id(c);
            if let Some(p) = prev {
                caret += font.kern(p, id);
            }
            glyphs.push(id.with_scale_and_position(size, point(caret, size / 2.0)));
            caret += font.h_advance(id);
            prev = Some(id);
        }
        let width = caret as i32;
        let height = (size / 1.24) as i32;
        let dx = match style.anchor().h_pos {
            HPos::Left => 0,
            HPos::Right => -width,
            HPos::Center => -width / 2,
        };
        let dy = match style.anchor().v_pos {
            VPos::Top => 0,
            VPos::Center => -height / 2,
            VPos::Bottom => -height,
        };
        let transform = style.transform();
        let (w, h) = self.inner.get_size();
        let mut result = Ok(());
        for glyph in glyphs {
            let Some(outline) = self.font.outline_glyph(glyph) else {
                continue; // e.g. a space
            };
            let bounds = outline.px_bounds();
            let (ox, oy) = (bounds.min.x as i32, bounds.min.y as i32);
            outline.draw(|gx, gy, coverage| {
                if result.is_err() || coverage <= 0.0 {
                    return;
                }
                let (x, y) = transform.transform(ox + gx as i32 + dx, oy + gy as i32 + dy);
                let (x, y) = (pos.0 + x, pos.1 + y);
                if x >= 0 && y >= 0 && (x as u32) < w && (y as u32) < h {
                    let pixel = BackendColor {
                        alpha: color.alpha * coverage.min(1.0) as f64,
                        rgb: color.rgb,
                    };
                    result = self.inner.draw_pixel((x, y), pixel);
                }
            });
            if result.is_err() {
                break;
            }
        }
        result
    }
}
