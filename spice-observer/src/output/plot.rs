//! SVG time-series plot of spice-server's in-flight messages per display channel (`observe --plot`).
//!
//! For each channel the picture has two panels sharing one time axis:
//! - top: the in-flight message count split into stages (where each in-flight message currently
//!   is, from spice-server to the client), drawn as stacked areas, with a dashed line at 2W+1
//!   (the most the count can reach) and, when given, the count a relay-side observer would
//!   report as a solid line;
//! - bottom: the server→client link throughput in Mbit/s.
//!
//! Drawn with `plotters`' SVG backend only: text is emitted as SVG `<text>` elements and laid out
//! with plotters' built-in size estimate, so no font library is involved.

use std::path::Path;

use anyhow::{Context, Result, bail};
use plotters::element::DashedPathElement;
use plotters::prelude::*;

/// One display channel's time series, all vectors the same length (one entry per sample).
#[derive(Debug, Clone, PartialEq)]
pub struct ChannelSeries {
    /// Panel title, e.g. `"display 0 — qemu pid 1234, 127.0.0.1:5900->127.0.0.1:40000"`.
    pub title: String,
    /// 2W+1 in messages: the most spice-server can have in flight on this channel (W = ACK
    /// window). Drawn as a dashed horizontal line.
    pub limit: u32,
    /// Sample times in seconds since the observation start; finite and non-decreasing.
    pub t_s: Vec<f64>,
    /// Stage name → message count at each sample, in chain order from spice-server to the client
    /// (e.g. `server_writing`, `server_notsent`, `server_unacked`, `proxy_recv_queue`,
    /// `proxy_inside`, `proxy_notsent`, `client_unacked`, `client_owes_ack`). The first stage is
    /// stacked at the bottom. At least one stage.
    pub stages: Vec<(String, Vec<u32>)>,
    /// Optional: the in-flight count a relay-side observer would report at each sample, in
    /// messages (may be negative if that observer's bookkeeping drifts). Drawn as a solid line.
    pub relay_visible: Option<Vec<i64>>,
    /// Server→client throughput in each sample interval (the interval ending at the sample), in
    /// Mbit/s; finite.
    pub throughput_mbit: Vec<f64>,
}

/// Picture width in pixels.
const WIDTH: u32 = 1100;
/// Picture height per channel in pixels.
const CHANNEL_HEIGHT: u32 = 420;
/// Width in pixels of the legend column right of each panel.
const LEGEND_WIDTH: u32 = 220;
/// Above this many samples, each series is thinned to the min and max of each of
/// `DECIMATE_BUCKETS` equal index buckets (the envelope stays exact; the SVG stays small).
const DECIMATE_ABOVE: usize = 2400;
const DECIMATE_BUCKETS: usize = 1000;

/// Stage fill colours in stacking order: Paul Tol's colour-blind-safe "muted" scheme, arranged
/// so that neighbouring bands contrast. Stages past the ninth reuse it from the start.
const STAGE_COLOURS: [RGBColor; 9] = [
    RGBColor(0x33, 0x22, 0x88), // indigo
    RGBColor(0xDD, 0xCC, 0x77), // sand
    RGBColor(0x44, 0xAA, 0x99), // teal
    RGBColor(0xCC, 0x66, 0x77), // rose
    RGBColor(0x88, 0xCC, 0xEE), // cyan
    RGBColor(0x99, 0x99, 0x33), // olive
    RGBColor(0x88, 0x22, 0x55), // wine
    RGBColor(0x11, 0x77, 0x33), // green
    RGBColor(0xAA, 0x44, 0x99), // purple
];
/// Throughput line colour (Tol "bright" blue).
const THROUGHPUT_COLOUR: RGBColor = RGBColor(0x44, 0x77, 0xAA);

/// Writes one SVG picture of `channels` to `path` (created or truncated), about 1100 px wide and
/// 420 px high per channel, channels stacked top to bottom in the given order.
///
/// Each channel gets a title line and two vertically stacked panels over the same time axis
/// (seconds since the observation start): (top) stacked areas of the stage counts in messages,
/// first stage at the bottom, with a dashed line at `limit` (2W+1) and the relay-visible line if
/// present, and a legend naming each stage (top band first) with its peak count; (bottom) the
/// throughput line in Mbit/s with its mean and peak. Series longer than 2400 samples are thinned
/// to about 2000 points: per index bucket, the samples with the min and max of the total count
/// (stage bands), of the relay line, and of the throughput; legend peaks use all samples.
///
/// Errors: `channels` empty; a channel with no samples or no stages; a vector whose length
/// differs from `t_s` (the message names the channel and the vector, e.g. stage
/// `proxy_inside`); a non-finite or decreasing `t_s`, or a non-finite throughput; a drawing
/// error; an I/O error writing `path` (with the path in the message).
pub fn write_svg(path: &Path, channels: &[ChannelSeries]) -> Result<()> {
    let svg = render_svg(channels)?;
    std::fs::write(path, svg).with_context(|| format!("writing plot to {}", path.display()))
}

/// Same picture as [`write_svg`], returned as the SVG document text instead of written to a file.
///
/// Errors: as [`write_svg`], less the I/O error.
pub fn render_svg(channels: &[ChannelSeries]) -> Result<String> {
    if channels.is_empty() {
        bail!("plot: no display channel to draw");
    }
    for (i, ch) in channels.iter().enumerate() {
        validate(ch).with_context(|| format!("plot: channel {i} ({:?})", ch.title))?;
    }
    let height = CHANNEL_HEIGHT
        .checked_mul(u32::try_from(channels.len()).unwrap_or(u32::MAX))
        .context("plot: too many channels for one picture")?;
    let mut svg = String::new();
    {
        let root = SVGBackend::with_string(&mut svg, (WIDTH, height)).into_drawing_area();
        root.fill(&WHITE)?;
        let areas = root.split_evenly((channels.len(), 1));
        for (ch, area) in channels.iter().zip(&areas) {
            draw_channel(area, ch).with_context(|| format!("plot: drawing {:?}", ch.title))?;
        }
        root.present()?;
    }
    Ok(svg)
}

/// Checks the shape and values of one channel's series.
fn validate(ch: &ChannelSeries) -> Result<()> {
    let n = ch.t_s.len();
    if n == 0 {
        bail!("no samples (t_s is empty)");
    }
    if ch.stages.is_empty() {
        bail!("no stages");
    }
    for (name, v) in &ch.stages {
        if v.len() != n {
            bail!("stage {name:?} has {} samples, t_s has {n}", v.len());
        }
    }
    if let Some(r) = &ch.relay_visible
        && r.len() != n
    {
        bail!("relay_visible has {} samples, t_s has {n}", r.len());
    }
    if ch.throughput_mbit.len() != n {
        bail!(
            "throughput_mbit has {} samples, t_s has {n}",
            ch.throughput_mbit.len()
        );
    }
    for (k, t) in ch.t_s.iter().enumerate() {
        if !t.is_finite() {
            bail!("t_s[{k}] is {t}");
        }
        if k > 0 && *t < ch.t_s[k - 1] {
            bail!("t_s decreases at [{k}]: {} then {t}", ch.t_s[k - 1]);
        }
    }
    if let Some((k, v)) = ch
        .throughput_mbit
        .iter()
        .enumerate()
        .find(|(_, v)| !v.is_finite())
    {
        bail!("throughput_mbit[{k}] is {v}");
    }
    Ok(())
}

/// Sample indices to draw for a series of `n` values given by `value`: all of them when `n` is at
/// most [`DECIMATE_ABOVE`], else the first and last sample and, for each of
/// [`DECIMATE_BUCKETS`] index buckets, the samples holding its min and its max, in index order.
fn keep_indices(n: usize, value: impl Fn(usize) -> f64) -> Vec<usize> {
    if n <= DECIMATE_ABOVE {
        return (0..n).collect();
    }
    let mut keep = vec![0];
    let per = n.div_ceil(DECIMATE_BUCKETS);
    for start in (0..n).step_by(per) {
        let end = (start + per).min(n);
        let (mut lo, mut hi) = (start, start);
        for k in start..end {
            if value(k) < value(lo) {
                lo = k;
            }
            if value(k) > value(hi) {
                hi = k;
            }
        }
        keep.extend([lo.min(hi), lo.max(hi)]);
    }
    keep.push(n - 1);
    keep.dedup();
    keep
}

type Area<'a> = DrawingArea<SVGBackend<'a>, plotters::coord::Shift>;

fn draw_channel(area: &Area<'_>, ch: &ChannelSeries) -> Result<()> {
    let n = ch.t_s.len();
    let body = area.titled(&ch.title, ("sans-serif", 20).into_font())?;
    let (_, body_h) = body.dim_in_pixel();
    let (top, bottom) = body.split_vertically(body_h * 62 / 100);
    let (plot_w, _) = top.dim_in_pixel();
    let split_x = plot_w.saturating_sub(LEGEND_WIDTH);
    let (top_chart, top_legend) = top.split_horizontally(split_x);
    let (bottom_chart, bottom_legend) = bottom.split_horizontally(split_x);

    // Cumulative stage counts: cum[s][k] = stages 0..=s at sample k.
    let mut cum: Vec<Vec<u64>> = Vec::with_capacity(ch.stages.len());
    for (s, (_, counts)) in ch.stages.iter().enumerate() {
        let row: Vec<u64> = counts
            .iter()
            .enumerate()
            .map(|(k, &c)| u64::from(c) + if s == 0 { 0 } else { cum[s - 1][k] })
            .collect();
        cum.push(row);
    }
    let total = cum.last().expect("validated: at least one stage");

    let x0 = ch.t_s[0];
    let mut x1 = ch.t_s[n - 1];
    if x1 <= x0 {
        x1 = x0 + 1.0;
    }
    // Message counts are whole numbers: integer y axis (whole-number ticks).
    let peak_total = total
        .iter()
        .copied()
        .max()
        .unwrap_or(0)
        .min(i64::MAX as u64 / 2) as i64;
    let (relay_min, relay_max) = match &ch.relay_visible {
        Some(r) => (
            r.iter().copied().min().unwrap_or(0),
            r.iter().copied().max().unwrap_or(0),
        ),
        None => (0, 0),
    };
    let y_hi = peak_total
        .max(i64::from(ch.limit))
        .max(relay_max)
        .min(i64::MAX / 2);
    let y_top = y_hi + y_hi / 12 + 1;
    let y_bottom = relay_min.clamp(i64::MIN / 2, 0);

    // Top panel: stacked stage areas, 2W+1 line, relay-visible line.
    let mut chart = ChartBuilder::on(&top_chart)
        .margin_top(6)
        .margin_right(10)
        .x_label_area_size(22)
        .y_label_area_size(56)
        .build_cartesian_2d(x0..x1, y_bottom..y_top)?;
    chart
        .configure_mesh()
        .y_desc("messages in flight")
        .light_line_style(WHITE.mix(0.0))
        .label_style(("sans-serif", 14))
        .axis_desc_style(("sans-serif", 15))
        .draw()?;
    let idx = keep_indices(n, |k| total[k] as f64);
    for s in 0..ch.stages.len() {
        let colour = STAGE_COLOURS[s % STAGE_COLOURS.len()];
        let upper = idx.iter().map(|&k| (ch.t_s[k], cum[s][k] as i64));
        let lower = idx
            .iter()
            .rev()
            .map(|&k| (ch.t_s[k], if s == 0 { 0 } else { cum[s - 1][k] as i64 }));
        let band: Vec<(f64, i64)> = upper.chain(lower).collect();
        chart.draw_series(std::iter::once(Polygon::new(band, colour.filled())))?;
    }
    let limit = i64::from(ch.limit);
    chart.draw_series(std::iter::once(DashedPathElement::new(
        vec![(x0, limit), (x1, limit)],
        9,
        5,
        BLACK.stroke_width(2),
    )))?;
    if let Some(r) = &ch.relay_visible {
        let ridx = keep_indices(n, |k| r[k] as f64);
        let line: Vec<(f64, i64)> = ridx.iter().map(|&k| (ch.t_s[k], r[k])).collect();
        // A white halo keeps the line readable over the dark bands.
        chart.draw_series(std::iter::once(PathElement::new(
            line.clone(),
            WHITE.stroke_width(4),
        )))?;
        chart.draw_series(std::iter::once(PathElement::new(
            line,
            BLACK.stroke_width(2),
        )))?;
    }

    // Top legend: limit line, relay line, then stages with the top band first.
    let font = ("sans-serif", 15).into_font();
    let mut y = 10;
    let line_at = |y: i32| vec![(8, y + 7), (30, y + 7)];
    top_legend.draw(&DashedPathElement::new(
        line_at(y),
        6,
        3,
        BLACK.stroke_width(2),
    ))?;
    top_legend.draw(&Text::new(
        format!("2W+1 = {}", ch.limit),
        (38, y),
        font.clone(),
    ))?;
    y += 18;
    if let Some(r) = &ch.relay_visible {
        let peak = r.iter().copied().max().unwrap_or(0);
        top_legend.draw(&PathElement::new(line_at(y), BLACK.stroke_width(2)))?;
        top_legend.draw(&Text::new(
            format!("relay-visible (max {peak})"),
            (38, y),
            font.clone(),
        ))?;
        y += 18;
    }
    y += 4;
    for (s, (name, counts)) in ch.stages.iter().enumerate().rev() {
        let colour = STAGE_COLOURS[s % STAGE_COLOURS.len()];
        let peak = counts.iter().copied().max().unwrap_or(0);
        top_legend.draw(&Rectangle::new([(8, y + 2), (30, y + 13)], colour.filled()))?;
        top_legend.draw(&Text::new(
            format!("{name} (max {peak})"),
            (38, y),
            font.clone(),
        ))?;
        y += 17;
    }

    // Bottom panel: throughput.
    let (t_min, t_max) = ch
        .throughput_mbit
        .iter()
        .fold((0.0f64, 0.0f64), |(lo, hi), &v| (lo.min(v), hi.max(v)));
    let t_top = if t_max > 0.0 { t_max * 1.08 } else { 1.0 };
    let mut chart = ChartBuilder::on(&bottom_chart)
        .margin_top(8)
        .margin_right(10)
        .margin_bottom(4)
        .x_label_area_size(36)
        .y_label_area_size(56)
        .build_cartesian_2d(x0..x1, t_min..t_top)?;
    chart
        .configure_mesh()
        .x_desc("time since start (s)")
        .y_desc("Mbit/s")
        .y_labels(5)
        .light_line_style(WHITE.mix(0.0))
        .label_style(("sans-serif", 14))
        .axis_desc_style(("sans-serif", 15))
        .draw()?;
    let tp = &ch.throughput_mbit;
    let tidx = keep_indices(n, |k| tp[k]);
    chart.draw_series(std::iter::once(PathElement::new(
        tidx.iter().map(|&k| (ch.t_s[k], tp[k])).collect::<Vec<_>>(),
        THROUGHPUT_COLOUR.stroke_width(2),
    )))?;
    let mean = tp.iter().sum::<f64>() / n as f64;
    bottom_legend.draw(&PathElement::new(
        line_at(10),
        THROUGHPUT_COLOUR.stroke_width(2),
    ))?;
    bottom_legend.draw(&Text::new(
        "server→client throughput",
        (38, 10),
        font.clone(),
    ))?;
    bottom_legend.draw(&Text::new(
        format!("mean {mean:.2} Mbit/s"),
        (38, 28),
        font.clone(),
    ))?;
    bottom_legend.draw(&Text::new(
        format!("peak {t_max:.2} Mbit/s"),
        (38, 46),
        font,
    ))?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    const STAGES: [&str; 8] = [
        "server_writing",
        "server_notsent",
        "server_unacked",
        "proxy_recv_queue",
        "proxy_inside",
        "proxy_notsent",
        "client_unacked",
        "client_owes_ack",
    ];

    /// A channel with `n` samples every 0.1 s, 8 stages, limit 21, and a relay line.
    fn synthetic(title: &str, n: usize) -> ChannelSeries {
        let t_s: Vec<f64> = (0..n).map(|k| k as f64 * 0.1).collect();
        let stages = STAGES
            .iter()
            .enumerate()
            .map(|(s, name)| {
                let v = (0..n).map(|k| ((k / 7 + s * 3) % 5) as u32 / 2).collect();
                (name.to_string(), v)
            })
            .collect::<Vec<(String, Vec<u32>)>>();
        let relay = (0..n)
            .map(|k| stages[3..].iter().map(|(_, v)| i64::from(v[k])).sum())
            .collect();
        let throughput = (0..n)
            .map(|k| 40.0 + 30.0 * (k as f64 / 9.0).sin())
            .collect();
        ChannelSeries {
            title: title.to_string(),
            limit: 21,
            t_s,
            stages,
            relay_visible: Some(relay),
            throughput_mbit: throughput,
        }
    }

    fn temp_path(name: &str) -> std::path::PathBuf {
        std::env::temp_dir().join(format!(
            "spice-observer-plot-{}-{name}.svg",
            std::process::id()
        ))
    }

    fn all_text(doc: &roxmltree::Document<'_>) -> Vec<String> {
        doc.descendants()
            .filter(|n| n.has_tag_name("text"))
            .map(|n| {
                let s: String = n
                    .descendants()
                    .filter(|d| d.is_text())
                    .filter_map(|d| d.text())
                    .collect();
                s.trim().to_string()
            })
            .collect()
    }

    #[test]
    fn writes_well_formed_svg_with_stages_title_and_series() {
        let titles = [
            "display 0 — qemu pid 1234, 127.0.0.1:5900->127.0.0.1:40000",
            "display 1 — qemu pid 1234, 127.0.0.1:5900->127.0.0.1:40002 <&>",
        ];
        let channels = [synthetic(titles[0], 200), synthetic(titles[1], 200)];
        let path = temp_path("ok");
        write_svg(&path, &channels).unwrap();
        let text = std::fs::read_to_string(&path).unwrap();
        std::fs::remove_file(&path).unwrap();
        let doc = roxmltree::Document::parse(&text).expect("well-formed XML");
        let svg = doc.root_element();
        assert!(svg.has_tag_name("svg"));
        assert_eq!(svg.attribute("width"), Some("1100"));
        assert_eq!(svg.attribute("height"), Some("840"));

        let texts = all_text(&doc);
        for title in titles {
            assert!(
                texts.iter().any(|t| t == title),
                "title {title:?} missing in {texts:?}"
            );
        }
        for stage in STAGES {
            let hits = texts
                .iter()
                .filter(|t| t.starts_with(&format!("{stage} (")))
                .count();
            assert_eq!(hits, 2, "legend entry for {stage}");
        }
        assert!(texts.iter().any(|t| t == "2W+1 = 21"));
        assert!(texts.iter().any(|t| t.starts_with("relay-visible")));
        assert!(texts.iter().any(|t| t == "Mbit/s"));

        // One filled polygon per stage and channel, in the fixed colour order, each with the
        // upper and lower edge of all 200 samples.
        let polys: Vec<_> = doc
            .descendants()
            .filter(|n| n.has_tag_name("polygon"))
            .collect();
        assert_eq!(polys.len(), 2 * STAGES.len());
        for (i, p) in polys.iter().enumerate() {
            let c = STAGE_COLOURS[i % STAGES.len()];
            let fill = format!("#{:02X}{:02X}{:02X}", c.0, c.1, c.2);
            assert_eq!(p.attribute("fill"), Some(fill.as_str()), "polygon {i}");
            let points = p.attribute("points").unwrap().split_whitespace().count();
            assert_eq!(points, 400, "polygon {i} points");
        }
        // Throughput: a 200-point polyline in its colour, once per channel.
        let throughput: Vec<_> = doc
            .descendants()
            .filter(|n| n.has_tag_name("polyline"))
            .filter(|n| n.attribute("stroke") == Some("#4477AA"))
            .filter(|n| n.attribute("points").unwrap().split_whitespace().count() == 200)
            .collect();
        assert_eq!(throughput.len(), 2);
    }

    #[test]
    fn long_series_are_thinned_to_their_envelope() {
        let mut ch = synthetic("long", 50_000);
        ch.stages[0].1[31_234] = 1000; // one spike must survive thinning
        ch.relay_visible = None;
        let svg = render_svg(&[ch]).unwrap();
        assert!(svg.len() < 1_000_000, "SVG is {} bytes", svg.len());
        let doc = roxmltree::Document::parse(&svg).unwrap();
        let texts = all_text(&doc);
        assert!(texts.iter().any(|t| t == "server_writing (max 1000)"));
        assert!(!texts.iter().any(|t| t.starts_with("relay-visible")));
        let polys = doc
            .descendants()
            .filter(|n| n.has_tag_name("polygon"))
            .count();
        assert_eq!(polys, STAGES.len());
    }

    #[test]
    fn keep_indices_keeps_extremes_in_order() {
        assert_eq!(keep_indices(5, |k| k as f64), vec![0, 1, 2, 3, 4]);
        let n = 10_007;
        let v = |k: usize| {
            if k == 5_555 {
                9.0
            } else if k == 777 {
                -9.0
            } else {
                0.0
            }
        };
        let keep = keep_indices(n, v);
        assert!(keep.windows(2).all(|w| w[0] < w[1]));
        assert!(keep.contains(&5_555) && keep.contains(&777));
        assert_eq!((keep[0], *keep.last().unwrap()), (0, n - 1));
        assert!(keep.len() <= 2 * DECIMATE_BUCKETS + 2);
    }

    #[test]
    fn rejects_empty_input() {
        let err = write_svg(&temp_path("empty"), &[]).unwrap_err();
        assert!(err.to_string().contains("no display channel"), "{err:#}");
        let mut ch = synthetic("no samples", 0);
        ch.stages.truncate(1);
        assert!(format!("{:#}", render_svg(&[ch]).unwrap_err()).contains("no samples"));
        let mut ch = synthetic("no stages", 10);
        ch.stages.clear();
        assert!(format!("{:#}", render_svg(&[ch]).unwrap_err()).contains("no stages"));
    }

    #[test]
    fn rejects_mismatched_lengths_naming_the_vector() {
        let mut ch = synthetic("c", 200);
        ch.stages[4].1.pop();
        let err = format!("{:#}", render_svg(&[synthetic("a", 200), ch]).unwrap_err());
        assert!(
            err.contains("channel 1") && err.contains("\"proxy_inside\" has 199 samples"),
            "{err}"
        );

        let mut ch = synthetic("c", 200);
        ch.throughput_mbit.push(1.0);
        let err = format!("{:#}", render_svg(&[ch]).unwrap_err());
        assert!(
            err.contains("throughput_mbit has 201 samples, t_s has 200"),
            "{err}"
        );

        let mut ch = synthetic("c", 200);
        ch.relay_visible.as_mut().unwrap().clear();
        let err = format!("{:#}", render_svg(&[ch]).unwrap_err());
        assert!(err.contains("relay_visible has 0 samples"), "{err}");

        let mut ch = synthetic("c", 200);
        ch.t_s.push(99.0);
        let err = format!("{:#}", render_svg(&[ch]).unwrap_err());
        assert!(err.contains("has 200 samples, t_s has 201"), "{err}");
    }

    #[test]
    fn rejects_bad_times_and_throughput() {
        let mut ch = synthetic("c", 20);
        ch.t_s[5] = 0.0;
        assert!(format!("{:#}", render_svg(&[ch]).unwrap_err()).contains("t_s decreases at [5]"));
        let mut ch = synthetic("c", 20);
        ch.t_s[3] = f64::NAN;
        assert!(format!("{:#}", render_svg(&[ch]).unwrap_err()).contains("t_s[3] is NaN"));
        let mut ch = synthetic("c", 20);
        ch.throughput_mbit[7] = f64::INFINITY;
        assert!(
            format!("{:#}", render_svg(&[ch]).unwrap_err()).contains("throughput_mbit[7] is inf")
        );
    }

    #[test]
    fn io_error_names_the_path() {
        let path = std::env::temp_dir().join("spice-observer-no-such-dir/x/plot.svg");
        let err = format!("{:#}", write_svg(&path, &[synthetic("c", 10)]).unwrap_err());
        assert!(
            err.contains("spice-observer-no-such-dir/x/plot.svg"),
            "{err}"
        );
    }

    #[test]
    fn single_sample_and_zero_counts_draw() {
        let mut ch = synthetic("one", 1);
        for (_, v) in &mut ch.stages {
            v[0] = 0;
        }
        ch.throughput_mbit[0] = 0.0;
        ch.relay_visible = Some(vec![-2]);
        let svg = render_svg(&[ch]).unwrap();
        roxmltree::Document::parse(&svg).unwrap();
    }
}
