//! A small hand-written SVG chart of the routing benchmark: per workload, the
//! KV-cache hit rate and TTFT p50 of each strategy as horizontal bars (TTFT
//! scaled to the workload's slowest strategy, labelled in ms).

use std::fmt::Write as _;

use super::fleet::Strategy;
use super::peers::Peer;
use super::routing::RoutingReport;

const WIDTH: f64 = 860.0;
const ROW_HEIGHT: f64 = 16.0;
const LABEL_WIDTH: f64 = 230.0;
const PANEL_WIDTH: f64 = 270.0;
const GAP: f64 = 40.0;

fn colour(peer: Peer) -> &'static str {
    match peer {
        Peer::Filter(Strategy::Random) => "#9e9e9e",
        Peer::Filter(Strategy::LeastOutstandingRequests) => "#f2a541",
        Peer::Filter(Strategy::PrefixAware) => "#2a7ab9",
        Peer::LongestPrefix(_) | Peer::LoadMargin(_) => "#4292c6",
        Peer::Balanced => "#08519c",
        Peer::Adapters => "#e7298a",
        Peer::AdaptersEngine => "#ce1256",
        Peer::PrefixAwareEngine => "#7570b3",
        Peer::Replicated { arm, envoys: 2 } => match arm {
            Peer::Balanced => "#66c2a5",
            _ => "#1b9e77",
        },
        Peer::Replicated { arm, .. } => match arm {
            Peer::Balanced => "#a6d854",
            Peer::PrefixAwareEngine => "#a6761d",
            _ => "#e6ab02",
        },
        Peer::FixedPrefix(_) => "#6baed6",
        Peer::SglangCacheAware => "#d95f02",
        Peer::Oracle => "#333333",
        Peer::Baseline(peer) => colour(*peer),
    }
}

fn escape(text: &str) -> String {
    text.replace('&', "&amp;")
        .replace('<', "&lt;")
        .replace('>', "&gt;")
}

/// The chart as an SVG document.
pub fn routing_svg(report: &RoutingReport) -> String {
    let rows: usize = report
        .workloads
        .iter()
        .map(|w| w.strategies.len() + 1)
        .sum();
    let height = 70.0 + rows as f64 * ROW_HEIGHT + 40.0;
    let hit_x = LABEL_WIDTH;
    let ttft_x = LABEL_WIDTH + PANEL_WIDTH + GAP;
    let mut svg = String::new();
    let _ = writeln!(
        svg,
        r#"<svg xmlns="http://www.w3.org/2000/svg" width="{WIDTH}" height="{height}" viewBox="0 0 {WIDTH} {height}" font-family="sans-serif" font-size="11">"#
    );
    let _ = writeln!(svg, r#"<rect width="100%" height="100%" fill="white"/>"#);
    let _ = writeln!(
        svg,
        r#"<text x="10" y="20" font-size="14" font-weight="bold">prefix-router: {} vllm-sim instances through Envoy{}</text>"#,
        report.instances,
        if report.quick { " (--quick)" } else { "" }
    );
    let _ = writeln!(
        svg,
        r#"<text x="{hit_x}" y="45" font-weight="bold">KV-cache hit rate (token-weighted)</text><text x="{ttft_x}" y="45" font-weight="bold">TTFT p50 (simulated ms)</text>"#
    );
    let mut y = 60.0;
    for workload in &report.workloads {
        let _ = writeln!(
            svg,
            r#"<text x="10" y="{}" font-weight="bold">{} ({})</text>"#,
            y + 11.0,
            escape(&workload.workload),
            escape(&workload.api)
        );
        y += ROW_HEIGHT;
        let slowest = workload
            .strategies
            .iter()
            .map(|s| s.ttft_p50_ms)
            .fold(0.0, f64::max)
            .max(1e-9);
        for s in &workload.strategies {
            let fill = colour(s.strategy);
            let hit_w = (s.hit_rate.clamp(0.0, 1.0) * PANEL_WIDTH).max(0.5);
            let ttft_w = (s.ttft_p50_ms / slowest * PANEL_WIDTH).max(0.5);
            let _ = writeln!(
                svg,
                r#"<text x="20" y="{ty}">{name}</text><rect x="{hit_x}" y="{y}" width="{hit_w:.1}" height="{h}" fill="{fill}"/><text x="{hl:.1}" y="{ty}">{hit:.1}%</text><rect x="{ttft_x}" y="{y}" width="{ttft_w:.1}" height="{h}" fill="{fill}"/><text x="{tl:.1}" y="{ty}">{ttft:.0}</text>"#,
                ty = y + 11.0,
                name = escape(&s.strategy.name()),
                h = ROW_HEIGHT - 3.0,
                hl = hit_x + hit_w + 4.0,
                hit = s.hit_rate * 100.0,
                tl = ttft_x + ttft_w + 4.0,
                ttft = s.ttft_p50_ms,
            );
            y += ROW_HEIGHT;
        }
    }
    let _ = writeln!(
        svg,
        r##"<text x="10" y="{}" fill="#555">LEAST_OUTSTANDING_REQUESTS: the filter's least_request (FULL_SCAN) cluster. Data: target/bench/routing.json</text>"##,
        y + 20.0
    );
    svg.push_str("</svg>\n");
    svg
}
