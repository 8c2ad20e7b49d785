//! Line charts for bench reports (TTFT versus request rate, TTFT CDFs, imbalance over steps,
//! simulated cost breakdowns), written as SVG or PNG with `plotters`.
//!
//! The font (DejaVu Sans, `bench/assets/`, Bitstream Vera license) is compiled into the binary so
//! charts render the same on a bare CI machine with no fontconfig: PNG text needs glyphs, and SVG
//! layout needs text metrics.

use std::path::Path;
use std::sync::Once;

use plotters::coord::ranged1d::ValueFormatter;
use plotters::coord::Shift;
use plotters::prelude::*;

/// One named line on a chart.
#[derive(Debug, Clone, PartialEq)]
pub struct Series {
    pub label: String,
    pub points: Vec<(f64, f64)>,
}

/// A line chart: every series drawn with markers over shared axes.
#[derive(Debug, Clone, PartialEq)]
pub struct Chart {
    pub title: String,
    pub x_label: String,
    pub y_label: String,
    pub series: Vec<Series>,
    /// Logarithmic x axis (request-rate sweeps span decades); needs positive x values.
    pub log_x: bool,
}

/// Why a chart could not be written.
#[derive(Debug, thiserror::Error)]
pub enum PlotError {
    #[error("unsupported plot file '{0}': the name must end in .svg or .png")]
    Format(String),
    #[error("nothing to plot in '{0}': every series is empty or non-finite")]
    Empty(String),
    #[error("log x axis needs positive x values, got {0}")]
    NonPositiveLogX(f64),
    #[error("cannot draw '{path}': {message}")]
    Draw { path: String, message: String },
}

const FONT: &[u8] = include_bytes!("../assets/DejaVuSans.ttf");
const WIDTH: u32 = 960;
const HEIGHT: u32 = 600;

/// Writes `chart` to `path`; the extension (`.svg` or `.png`) picks the format.
pub fn write_chart(path: &Path, chart: &Chart) -> Result<(), PlotError> {
    let name = path.display().to_string();
    let extension = path
        .extension()
        .and_then(|e| e.to_str())
        .map(str::to_ascii_lowercase);
    let bounds = data_bounds(chart).ok_or_else(|| PlotError::Empty(name.clone()))?;
    if chart.log_x && bounds.x.0 <= 0.0 {
        return Err(PlotError::NonPositiveLogX(bounds.x.0));
    }
    register_font();
    let drawn = match extension.as_deref() {
        Some("svg") => draw(
            SVGBackend::new(path, (WIDTH, HEIGHT)).into_drawing_area(),
            chart,
            &bounds,
        ),
        Some("png") => draw(
            BitMapBackend::new(path, (WIDTH, HEIGHT)).into_drawing_area(),
            chart,
            &bounds,
        ),
        _ => return Err(PlotError::Format(name)),
    };
    drawn.map_err(|message| PlotError::Draw {
        path: name,
        message,
    })
}

fn register_font() {
    static REGISTER: Once = Once::new();
    REGISTER.call_once(|| {
        // The bytes are a valid TrueType file checked into the repository; a failure here would
        // only mean text is missing, which the draw call then reports as an error.
        let _ = plotters::style::register_font("sans-serif", FontStyle::Normal, FONT);
    });
}

/// Axis ranges covering every finite point, padded so markers do not sit on the frame.
struct Bounds {
    x: (f64, f64),
    y: (f64, f64),
}

fn data_bounds(chart: &Chart) -> Option<Bounds> {
    let mut points = chart
        .series
        .iter()
        .flat_map(|s| s.points.iter())
        .filter(|(x, y)| x.is_finite() && y.is_finite())
        .peekable();
    let (x0, y0) = **points.peek()?;
    let (mut x, mut y) = ((x0, x0), (y0, y0));
    for &(px, py) in points {
        x = (x.0.min(px), x.1.max(px));
        y = (y.0.min(py), y.1.max(py));
    }
    Some(Bounds {
        x: pad(x, false),
        y: pad((y.0.min(0.0), y.1), true),
    })
}

fn pad((lo, hi): (f64, f64), top_only: bool) -> (f64, f64) {
    let span = if hi > lo { hi - lo } else { hi.abs().max(1.0) };
    let margin = span * 0.05;
    if top_only {
        (lo, hi + margin)
    } else if hi > lo {
        (lo, hi)
    } else {
        (lo - margin, hi + margin)
    }
}

fn draw<DB: DrawingBackend>(
    root: DrawingArea<DB, Shift>,
    chart: &Chart,
    bounds: &Bounds,
) -> Result<(), String> {
    let err = |e: &dyn std::fmt::Display| e.to_string();
    root.fill(&WHITE).map_err(|e| err(&e))?;
    let mut builder = ChartBuilder::on(&root);
    builder
        .caption(&chart.title, ("sans-serif", 24))
        .margin(16)
        .x_label_area_size(48)
        .y_label_area_size(72);
    // The two axes are different coordinate types; everything drawn on them is shared.
    if chart.log_x {
        let ctx = builder
            .build_cartesian_2d((bounds.x.0..bounds.x.1).log_scale(), bounds.y.0..bounds.y.1)
            .map_err(|e| err(&e))?;
        draw_chart(ctx, chart).map_err(|e| err(&e))?;
    } else {
        let ctx = builder
            .build_cartesian_2d(bounds.x.0..bounds.x.1, bounds.y.0..bounds.y.1)
            .map_err(|e| err(&e))?;
        draw_chart(ctx, chart).map_err(|e| err(&e))?;
    }
    root.present().map_err(|e| err(&e))
}

type Ctx<'a, DB, X> = ChartContext<'a, DB, Cartesian2d<X, plotters::coord::types::RangedCoordf64>>;

/// Mesh, series and legend on a built chart.
fn draw_chart<'a, DB, X>(
    mut ctx: Ctx<'a, DB, X>,
    chart: &Chart,
) -> Result<(), DrawingAreaErrorKind<DB::ErrorType>>
where
    DB: DrawingBackend + 'a,
    X: Ranged<ValueType = f64> + ValueFormatter<f64>,
{
    configure_mesh(&mut ctx, chart)?;
    draw_series(&mut ctx, chart)?;
    finish_legend(&mut ctx, chart)
}

fn configure_mesh<'a, DB, X>(
    ctx: &mut Ctx<'a, DB, X>,
    chart: &Chart,
) -> Result<(), DrawingAreaErrorKind<DB::ErrorType>>
where
    DB: DrawingBackend + 'a,
    X: Ranged<ValueType = f64> + ValueFormatter<f64>,
{
    ctx.configure_mesh()
        .x_desc(&chart.x_label)
        .y_desc(&chart.y_label)
        .label_style(("sans-serif", 14))
        .draw()
}

fn draw_series<'a, DB, X>(
    ctx: &mut Ctx<'a, DB, X>,
    chart: &Chart,
) -> Result<(), DrawingAreaErrorKind<DB::ErrorType>>
where
    DB: DrawingBackend + 'a,
    X: Ranged<ValueType = f64> + ValueFormatter<f64>,
{
    for (i, series) in chart.series.iter().enumerate() {
        let color = Palette99::pick(i).to_rgba();
        let points: Vec<(f64, f64)> = series
            .points
            .iter()
            .copied()
            .filter(|(x, y)| x.is_finite() && y.is_finite() && (!chart.log_x || *x > 0.0))
            .collect();
        ctx.draw_series(LineSeries::new(
            points.iter().copied(),
            color.stroke_width(2),
        ))?
        .label(series.label.as_str())
        .legend(move |(x, y)| PathElement::new([(x, y), (x + 20, y)], color.stroke_width(2)));
        // Markers only where they stay readable (CDFs and per-step series have many points).
        if points.len() <= 64 {
            ctx.draw_series(points.iter().map(|&p| Circle::new(p, 3, color.filled())))?;
        }
    }
    Ok(())
}

fn finish_legend<'a, DB, X>(
    ctx: &mut Ctx<'a, DB, X>,
    chart: &Chart,
) -> Result<(), DrawingAreaErrorKind<DB::ErrorType>>
where
    DB: DrawingBackend + 'a,
    X: Ranged<ValueType = f64> + ValueFormatter<f64>,
{
    if chart.series.len() > 1 || chart.series.iter().any(|s| !s.label.is_empty()) {
        ctx.configure_series_labels()
            .background_style(WHITE.mix(0.85))
            .border_style(BLACK)
            .label_font(("sans-serif", 14))
            .draw()?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn chart(log_x: bool) -> Chart {
        Chart {
            title: "TTFT versus request rate".into(),
            x_label: "requests/s".into(),
            y_label: "mean TTFT (ms)".into(),
            series: vec![
                Series {
                    label: "quota".into(),
                    points: vec![(1.0, 10.0), (2.0, 12.0), (4.0, 30.0)],
                },
                Series {
                    label: "none".into(),
                    points: vec![(1.0, 11.0), (2.0, f64::NAN), (4.0, 60.0)],
                },
            ],
            log_x,
        }
    }

    #[test]
    fn writes_svg_and_png() {
        let dir = tempfile::tempdir().unwrap();
        let svg = dir.path().join("c.svg");
        write_chart(&svg, &chart(true)).unwrap();
        let text = std::fs::read_to_string(&svg).unwrap();
        assert!(text.starts_with("<svg"), "{}", &text[..40.min(text.len())]);
        assert!(text.contains("TTFT versus request rate") && text.contains("quota"));
        let png = dir.path().join("c.PNG");
        write_chart(&png, &chart(false)).unwrap();
        let bytes = std::fs::read(&png).unwrap();
        assert_eq!(&bytes[1..4], b"PNG");
    }

    #[test]
    fn refuses_bad_requests() {
        let dir = tempfile::tempdir().unwrap();
        let bad_ext = write_chart(&dir.path().join("c.jpg"), &chart(false)).unwrap_err();
        assert!(matches!(bad_ext, PlotError::Format(_)), "{bad_ext}");
        let mut empty = chart(false);
        empty.series.iter_mut().for_each(|s| s.points.clear());
        let err = write_chart(&dir.path().join("e.svg"), &empty).unwrap_err();
        assert!(matches!(err, PlotError::Empty(_)), "{err}");
        let mut zero = chart(true);
        zero.series[0].points.push((0.0, 1.0));
        let err = write_chart(&dir.path().join("z.svg"), &zero).unwrap_err();
        assert!(matches!(err, PlotError::NonPositiveLogX(_)), "{err}");
        let missing_dir = dir.path().join("no/such/dir/c.png");
        assert!(write_chart(&missing_dir, &chart(false)).is_err());
    }
}
