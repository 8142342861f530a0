//! SVG plots of the bench report (plotters' SVG backend).
//!
//! Text is laid out with the Ubuntu Light face embedded in the binary
//! (`epaint_default_fonts`), registered with plotters' `ab_glyph` font
//! backend, so no system font library is needed to draw a plot; the SVG
//! names the family `sans-serif` and viewers draw it with their own font.

use std::path::Path;
use std::sync::Once;

use anyhow::{Result, anyhow};
use plotters::coord::Shift;
use plotters::coord::ranged1d::ValueFormatter;
use plotters::coord::types::RangedCoordf64;
use plotters::prelude::*;
use plotters::style::text_anchor::{HPos, Pos, VPos};

const FONT: &str = "sans-serif";

fn register_font() -> Result<()> {
    static ONCE: Once = Once::new();
    let mut result = Ok(());
    ONCE.call_once(|| {
        result = plotters::style::register_font(
            FONT,
            FontStyle::Normal,
            epaint_default_fonts::UBUNTU_LIGHT,
        )
        .map_err(|_| anyhow!("the embedded font could not be read"));
    });
    result
}

/// Distinct colours for up to 8 series (then they repeat).
const COLORS: [RGBColor; 8] = [
    RGBColor(0x1f, 0x77, 0xb4),
    RGBColor(0xff, 0x7f, 0x0e),
    RGBColor(0x2c, 0xa0, 0x2c),
    RGBColor(0xd6, 0x27, 0x28),
    RGBColor(0x94, 0x67, 0xbd),
    RGBColor(0x8c, 0x56, 0x4b),
    RGBColor(0xe3, 0x77, 0xc2),
    RGBColor(0x7f, 0x7f, 0x7f),
];

/// A grouped bar chart: one group per x label, one bar per series.
#[derive(Clone)]
pub struct Bars {
    pub title: String,
    pub y_label: String,
    pub groups: Vec<String>,
    /// Name and one value per group (None: no bar).
    pub series: Vec<(String, Vec<Option<f64>>)>,
    pub log_y: bool,
    /// A dashed reference line (e.g. 1 for speedups).
    pub reference: Option<f64>,
}

/// A line chart of (x, y) points per series.
pub struct Lines {
    pub title: String,
    pub x_label: String,
    pub y_label: String,
    pub series: Vec<(String, Vec<(f64, f64)>)>,
    /// Draw y = x dashed (ideal scaling).
    pub diagonal: bool,
}

fn err<E: std::fmt::Debug>(e: E) -> anyhow::Error {
    anyhow!("drawing a plot: {e:?}")
}

/// Writes `b` as an SVG at `path`.
pub fn bars(path: &Path, b: &Bars) -> Result<()> {
    register_font()?;
    let values: Vec<f64> = b
        .series
        .iter()
        .flat_map(|(_, v)| v.iter().flatten().copied())
        .filter(|v| v.is_finite() && (!b.log_y || *v > 0.0))
        .chain(b.reference)
        .collect();
    if values.is_empty() {
        return Err(anyhow!("plot '{}' has no values", b.title));
    }
    let max = values.iter().copied().fold(f64::MIN, f64::max);
    let min = values.iter().copied().fold(f64::MAX, f64::min);
    let width = (160 + 90 * b.groups.len() as u32).clamp(640, 1400);
    let root = SVGBackend::new(path, (width, 480)).into_drawing_area();
    root.fill(&WHITE).map_err(err)?;
    let n = b.groups.len() as f64;
    if b.log_y {
        // Room above the tallest bar for the legend.
        let lo = 10f64.powf((min * 0.8).log10().floor());
        let hi = max * (max / lo).powf(0.4).max(2.0);
        let mut chart = chart_builder(&root, &b.title)
            .build_cartesian_2d(0.0..n, (lo..hi).log_scale())
            .map_err(err)?;
        draw_bars(&root, &mut chart, b, lo)
    } else {
        let hi = max * 1.45;
        let mut chart = chart_builder(&root, &b.title)
            .build_cartesian_2d(0.0..n, 0.0..hi)
            .map_err(err)?;
        draw_bars(&root, &mut chart, b, 0.0)
    }?;
    root.present().map_err(err)
}

fn chart_builder<'a, 'b>(
    root: &'a DrawingArea<SVGBackend<'b>, Shift>,
    title: &str,
) -> ChartBuilder<'a, 'b, SVGBackend<'b>> {
    let mut c = ChartBuilder::on(root);
    c.caption(title, (FONT, 20))
        .margin(12)
        .x_label_area_size(36)
        .y_label_area_size(64);
    c
}

fn draw_bars<'a, 'b: 'a, Y>(
    root: &DrawingArea<SVGBackend<'b>, Shift>,
    chart: &mut ChartContext<'a, SVGBackend<'b>, Cartesian2d<RangedCoordf64, Y>>,
    b: &Bars,
    floor: f64,
) -> Result<()>
where
    Y: Ranged<ValueType = f64> + ValueFormatter<f64>,
{
    chart
        .configure_mesh()
        .disable_x_mesh()
        .light_line_style(TRANSPARENT)
        .y_labels(8)
        .x_labels(0)
        .y_desc(b.y_label.as_str())
        .label_style((FONT, 13))
        .axis_desc_style((FONT, 14))
        .draw()
        .map_err(err)?;
    let k = b.series.len().max(1) as f64;
    let slot = 0.8 / k;
    for (s, (name, values)) in b.series.iter().enumerate() {
        let color = COLORS[s % COLORS.len()];
        let rects = values.iter().enumerate().filter_map(|(g, v)| {
            let v = (*v)?;
            (v.is_finite() && v > floor).then(|| {
                let x0 = g as f64 + 0.1 + slot * s as f64;
                Rectangle::new([(x0, floor), (x0 + slot * 0.92, v)], color.filled())
            })
        });
        chart
            .draw_series(rects)
            .map_err(err)?
            .label(name.as_str())
            .legend(move |(x, y)| Rectangle::new([(x, y - 5), (x + 12, y + 5)], color.filled()));
    }
    if let Some(r) = b.reference {
        let n = b.groups.len() as f64;
        chart
            .draw_series(DashedLineSeries::new(
                [(0.0, r), (n, r)],
                6,
                4,
                BLACK.stroke_width(1),
            ))
            .map_err(err)?;
    }
    // Group names under the axis, centred on their groups.
    for (g, name) in b.groups.iter().enumerate() {
        let (px, py) = chart.backend_coord(&(g as f64 + 0.5, floor));
        let style = TextStyle::from((FONT, 13).into_font()).pos(Pos::new(HPos::Center, VPos::Top));
        root.draw(&Text::new(name.clone(), (px, py + 6), style))
            .map_err(err)?;
    }
    chart
        .configure_series_labels()
        .position(SeriesLabelPosition::UpperRight)
        .label_font((FONT, 13))
        .background_style(WHITE.mix(0.85))
        .border_style(BLACK.mix(0.3))
        .draw()
        .map_err(err)
}

/// Writes `l` as an SVG at `path`.
pub fn lines(path: &Path, l: &Lines) -> Result<()> {
    register_font()?;
    let points: Vec<(f64, f64)> = l.series.iter().flat_map(|(_, p)| p.clone()).collect();
    if points.is_empty() {
        return Err(anyhow!("plot '{}' has no values", l.title));
    }
    let x_max = points.iter().map(|p| p.0).fold(1.0, f64::max);
    let y_max = points.iter().map(|p| p.1).fold(x_max, f64::max) * 1.1;
    let root = SVGBackend::new(path, (720, 480)).into_drawing_area();
    root.fill(&WHITE).map_err(err)?;
    let mut chart = chart_builder(&root, &l.title)
        .build_cartesian_2d(0.8..x_max + 0.2, 0.0..y_max)
        .map_err(err)?;
    chart
        .configure_mesh()
        .x_desc(l.x_label.as_str())
        .y_desc(l.y_label.as_str())
        .x_labels(x_max as usize + 1)
        .x_label_formatter(&|x| {
            if (x - x.round()).abs() < 1e-9 {
                format!("{x:.0}")
            } else {
                String::new()
            }
        })
        .label_style((FONT, 13))
        .axis_desc_style((FONT, 14))
        .draw()
        .map_err(err)?;
    if l.diagonal {
        chart
            .draw_series(DashedLineSeries::new(
                [(1.0, 1.0), (x_max, x_max)],
                6,
                4,
                BLACK.stroke_width(1),
            ))
            .map_err(err)?
            .label("ideal")
            .legend(|(x, y)| PathElement::new([(x, y), (x + 14, y)], BLACK));
    }
    for (s, (name, pts)) in l.series.iter().enumerate() {
        let color = COLORS[s % COLORS.len()];
        chart
            .draw_series(LineSeries::new(pts.iter().copied(), color.stroke_width(2)))
            .map_err(err)?
            .label(name.as_str())
            .legend(move |(x, y)| PathElement::new([(x, y), (x + 14, y)], color.stroke_width(2)));
        chart
            .draw_series(pts.iter().map(|&p| Circle::new(p, 4, color.filled())))
            .map_err(err)?;
    }
    chart
        .configure_series_labels()
        .position(SeriesLabelPosition::UpperLeft)
        .label_font((FONT, 13))
        .background_style(WHITE.mix(0.85))
        .border_style(BLACK.mix(0.3))
        .draw()
        .map_err(err)?;
    root.present().map_err(err)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A `<text>` element whose content is exactly `text`.
    fn has_text(svg: &str, text: &str) -> bool {
        svg.split("<text")
            .skip(1)
            .filter_map(|t| Some(t.split_once('>')?.1.split_once("</text>")?.0.trim()))
            .any(|t| t == text)
    }

    #[test]
    fn bar_and_line_plots_are_svg_with_their_labels() {
        let dir = tempfile::tempdir().unwrap();
        let b = Bars {
            title: "time per mode".into(),
            y_label: "ms".into(),
            groups: vec!["mode 1".into(), "mode 2".into()],
            series: vec![
                ("fcoo".into(), vec![Some(1.5), Some(2.0)]),
                ("coo".into(), vec![Some(40.0), None]),
            ],
            log_y: true,
            reference: Some(1.0),
        };
        for log_y in [true, false] {
            let p = dir.path().join(format!("b{log_y}.svg"));
            bars(&p, &Bars { log_y, ..b.clone() }).unwrap();
            let svg = std::fs::read_to_string(&p).unwrap();
            assert!(svg.starts_with("<svg"), "{}", &svg[..40.min(svg.len())]);
            for text in ["time per mode", "mode 1", "mode 2", "fcoo", "coo", "ms"] {
                assert!(has_text(&svg, text), "{text} missing");
            }
            // Three bars: two of fcoo, one of coo (None draws nothing).
            let fcoo = svg.matches("fill=\"#1F77B4\"").count();
            let coo = svg.matches("fill=\"#FF7F0E\"").count();
            assert_eq!((fcoo, coo), (3, 2), "bars plus one legend box each");
        }
        let p = dir.path().join("l.svg");
        lines(
            &p,
            &Lines {
                title: "scaling".into(),
                x_label: "GPUs".into(),
                y_label: "speedup".into(),
                series: vec![("amazon nccl".into(), vec![(1.0, 1.0), (2.0, 1.9)])],
                diagonal: true,
            },
        )
        .unwrap();
        let svg = std::fs::read_to_string(&p).unwrap();
        for text in ["scaling", "GPUs", "amazon nccl", "ideal"] {
            assert!(has_text(&svg, text), "{text} missing");
        }
        let empty = Bars {
            series: vec![("x".into(), vec![None, None])],
            reference: None,
            ..b.clone()
        };
        assert!(bars(&dir.path().join("e.svg"), &empty).is_err());
    }
}
