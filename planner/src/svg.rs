//! The plot: goodput against checkpoint interval, warden beside the
//! scheduler-requeue baseline, each with its p5-p95 band and its optimum
//! marked. Hand-written SVG (a few dozen elements): a plotting crate would
//! outweigh the planner.

use std::fmt::Write;

use crate::sweep::{Plan, Series};

const WIDTH: f64 = 760.0;
const HEIGHT: f64 = 460.0;
const LEFT: f64 = 70.0;
const RIGHT: f64 = 180.0;
const TOP: f64 = 40.0;
const BOTTOM: f64 = 60.0;
const COLORS: [&str; 2] = ["#1f77b4", "#d62728"];

/// Escapes text for XML.
fn esc(s: &str) -> String {
    s.replace('&', "&amp;")
        .replace('<', "&lt;")
        .replace('>', "&gt;")
        .replace('"', "&quot;")
}

/// Ticks on a log axis: 1-2-5 steps within [lo, hi].
fn log_ticks(lo: f64, hi: f64) -> Vec<f64> {
    let mut ticks = Vec::new();
    let mut decade = 10f64.powf(lo.log10().floor());
    while decade <= hi {
        for m in [1.0, 2.0, 5.0] {
            let t = decade * m;
            if t >= lo * 0.999 && t <= hi * 1.001 {
                ticks.push(t);
            }
        }
        decade *= 10.0;
    }
    ticks
}

/// Ticks on a linear axis: a round step giving 4 to 10 ticks.
fn linear_ticks(lo: f64, hi: f64) -> Vec<f64> {
    let span = (hi - lo).max(1e-9);
    let raw = span / 6.0;
    let mag = 10f64.powf(raw.log10().floor());
    let step = [1.0, 2.0, 5.0, 10.0]
        .iter()
        .map(|m| m * mag)
        .find(|s| span / s <= 8.0)
        .unwrap_or(10.0 * mag);
    let mut t = (lo / step).ceil() * step;
    let mut ticks = Vec::new();
    while t <= hi + step * 1e-9 {
        ticks.push(t);
        t += step;
    }
    ticks
}

/// A label for an interval in minutes.
fn minutes(m: f64) -> String {
    if m >= 10.0 {
        format!("{m:.0}")
    } else if m >= 1.0 {
        format!("{m:.1}").trim_end_matches(".0").to_owned()
    } else {
        format!("{m:.2}")
    }
}

/// The plot as an SVG document.
pub fn render(plan: &Plan) -> String {
    let series: [&Series; 2] = [&plan.warden, &plan.baseline];
    let all = || series.iter().flat_map(|s| s.points.iter());
    let x_lo = all().map(|p| p.interval_s).fold(f64::INFINITY, f64::min) / 60.0;
    let x_hi = all().map(|p| p.interval_s).fold(0.0, f64::max) / 60.0;
    let y_min = all().map(|p| p.p5).fold(f64::INFINITY, f64::min) * 100.0;
    let y_max = all().map(|p| p.p95).fold(0.0, f64::max) * 100.0;
    let pad = ((y_max - y_min) * 0.05).max(0.1);
    let (y_lo, y_hi) = ((y_min - pad).max(0.0), (y_max + pad).min(100.0));
    let pw = WIDTH - LEFT - RIGHT;
    let ph = HEIGHT - TOP - BOTTOM;
    let x = |m: f64| LEFT + (m.ln() - x_lo.ln()) / (x_hi.ln() - x_lo.ln()).max(1e-12) * pw;
    let y = |g: f64| TOP + (1.0 - (g - y_lo) / (y_hi - y_lo).max(1e-12)) * ph;

    let mut s = String::new();
    // Writing to a String cannot fail.
    let _ = writeln!(
        s,
        r#"<svg xmlns="http://www.w3.org/2000/svg" width="{WIDTH}" height="{HEIGHT}" viewBox="0 0 {WIDTH} {HEIGHT}" font-family="sans-serif" font-size="12">"#
    );
    let _ = writeln!(
        s,
        r#"<rect x="0" y="0" width="{WIDTH}" height="{HEIGHT}" fill="white"/>"#
    );
    let title = format!(
        "Goodput vs checkpoint interval: {} GPUs, {} days, {} reps",
        plan.scenario.gpus, plan.scenario.days, plan.scenario.sweep.reps
    );
    let _ = writeln!(
        s,
        r#"<text x="{}" y="22" text-anchor="middle" font-size="14">{}</text>"#,
        LEFT + pw / 2.0,
        esc(&title)
    );
    // Axes and grid.
    let _ = writeln!(s, r#"<g class="axes" stroke="black" fill="none">"#);
    let _ = writeln!(
        s,
        r#"<line x1="{LEFT}" y1="{}" x2="{}" y2="{}"/>"#,
        TOP + ph,
        LEFT + pw,
        TOP + ph
    );
    let _ = writeln!(
        s,
        r#"<line x1="{LEFT}" y1="{TOP}" x2="{LEFT}" y2="{}"/>"#,
        TOP + ph
    );
    let _ = writeln!(s, "</g>");
    let _ = writeln!(s, r#"<g class="x-ticks">"#);
    for t in log_ticks(x_lo, x_hi) {
        let px = x(t);
        let _ = writeln!(
            s,
            r##"<line x1="{px:.1}" y1="{TOP}" x2="{px:.1}" y2="{:.1}" stroke="#ddd"/><text x="{px:.1}" y="{:.1}" text-anchor="middle">{}</text>"##,
            TOP + ph + 5.0,
            TOP + ph + 18.0,
            minutes(t)
        );
    }
    let _ = writeln!(s, "</g>");
    let _ = writeln!(s, r#"<g class="y-ticks">"#);
    for t in linear_ticks(y_lo, y_hi) {
        let py = y(t);
        let _ = writeln!(
            s,
            r##"<line x1="{:.1}" y1="{py:.1}" x2="{:.1}" y2="{py:.1}" stroke="#ddd"/><text x="{:.1}" y="{:.1}" text-anchor="end">{}</text>"##,
            LEFT - 5.0,
            LEFT + pw,
            LEFT - 8.0,
            py + 4.0,
            format_args!("{t:.1}")
        );
    }
    let _ = writeln!(s, "</g>");
    let _ = writeln!(
        s,
        r#"<text x="{}" y="{}" text-anchor="middle">checkpoint interval (minutes of training between saves, log scale)</text>"#,
        LEFT + pw / 2.0,
        HEIGHT - 15.0
    );
    let _ = writeln!(
        s,
        r#"<text x="18" y="{}" text-anchor="middle" transform="rotate(-90 18 {})">goodput (%)</text>"#,
        TOP + ph / 2.0,
        TOP + ph / 2.0
    );
    // Series: band, line, optimum.
    for (k, ser) in series.iter().enumerate() {
        let color = COLORS[k];
        let _ = writeln!(s, r#"<g class="series" data-name="{}">"#, esc(&ser.name));
        let upper = ser
            .points
            .iter()
            .map(|p| format!("{:.1},{:.1}", x(p.interval_s / 60.0), y(p.p95 * 100.0)));
        let lower = ser
            .points
            .iter()
            .rev()
            .map(|p| format!("{:.1},{:.1}", x(p.interval_s / 60.0), y(p.p5 * 100.0)));
        let band: Vec<String> = upper.chain(lower).collect();
        let _ = writeln!(
            s,
            r#"<polygon points="{}" fill="{color}" fill-opacity="0.15" stroke="none"/>"#,
            band.join(" ")
        );
        let line: Vec<String> = ser
            .points
            .iter()
            .map(|p| format!("{:.1},{:.1}", x(p.interval_s / 60.0), y(p.mean * 100.0)))
            .collect();
        let _ = writeln!(
            s,
            r#"<polyline points="{}" fill="none" stroke="{color}" stroke-width="2"/>"#,
            line.join(" ")
        );
        let o = &ser.optimum;
        let ox = x(o.grid_interval_s / 60.0);
        let oy = y(o.goodput.mean * 100.0);
        let _ = writeln!(
            s,
            r#"<line x1="{ox:.1}" y1="{oy:.1}" x2="{ox:.1}" y2="{:.1}" stroke="{color}" stroke-dasharray="4 3"/><circle cx="{ox:.1}" cy="{oy:.1}" r="4" fill="{color}"/>"#,
            TOP + ph
        );
        let _ = writeln!(s, "</g>");
    }
    // Legend.
    let lx = LEFT + pw + 15.0;
    let _ = writeln!(s, r#"<g class="legend">"#);
    for (k, ser) in series.iter().enumerate() {
        #[allow(clippy::cast_precision_loss)]
        let ly = TOP + 10.0 + k as f64 * 46.0;
        let _ = writeln!(
            s,
            r#"<line x1="{lx}" y1="{ly}" x2="{}" y2="{ly}" stroke="{}" stroke-width="2"/><text x="{}" y="{}">{}</text><text x="{}" y="{}" font-size="11">best {} min: {:.2}%</text>"#,
            lx + 22.0,
            COLORS[k],
            lx + 28.0,
            ly + 4.0,
            esc(&ser.name),
            lx + 28.0,
            ly + 20.0,
            minutes(ser.optimum.interval_s / 60.0),
            ser.optimum.goodput.mean * 100.0
        );
    }
    let _ = writeln!(
        s,
        r#"<text x="{lx}" y="{}" font-size="11">bands: p5-p95</text>"#,
        TOP + 104.0
    );
    let _ = writeln!(s, "</g>");
    s.push_str("</svg>\n");
    s
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ticks_are_round_and_in_range() {
        assert_eq!(
            log_ticks(0.3, 60.0),
            vec![0.5, 1.0, 2.0, 5.0, 10.0, 20.0, 50.0]
        );
        let t = linear_ticks(71.3, 96.8);
        assert!(t.len() >= 4 && t.len() <= 10, "{t:?}");
        assert!(t.iter().all(|v| (71.3..=96.8).contains(v)));
        assert_eq!(minutes(2.0), "2");
        assert_eq!(esc("a<b&c"), "a&lt;b&amp;c");
    }
}
