//! The HTML report: one self-contained file (inline CSS, inline SVG charts, no scripts, no
//! network fetches), for people. Cells that hold the run's key numbers carry ids, so a
//! headless browser's DOM dump can be checked against the JSON report
//! (scripts/check-report.sh).

use std::fmt::Write as _;

use crate::report::{Kind, Report, Severity, Verdict};

fn esc(s: &str) -> String {
    let mut out = String::with_capacity(s.len());
    for c in s.chars() {
        match c {
            '&' => out.push_str("&amp;"),
            '<' => out.push_str("&lt;"),
            '>' => out.push_str("&gt;"),
            '"' => out.push_str("&quot;"),
            '\'' => out.push_str("&#39;"),
            c => out.push(c),
        }
    }
    out
}

fn verdict_class(v: Verdict) -> &'static str {
    match v {
        Verdict::Pass => "pass",
        Verdict::Warn => "warn",
        Verdict::Fail => "fail",
        Verdict::Skipped => "skip",
    }
}

const CSS: &str = "
body{font:14px/1.45 system-ui,-apple-system,'Segoe UI',sans-serif;margin:2em auto;max-width:1100px;color:#1d232b;padding:0 1em}
h1{font-size:1.6em;margin:0 0 .2em}h2{font-size:1.2em;margin:1.6em 0 .5em;border-bottom:1px solid #dde3ea;padding-bottom:.2em}
.meta{color:#556}.banner{padding:.8em 1em;border-radius:6px;font-weight:600;font-size:1.1em;margin:1em 0}
.banner.pass{background:#e3f6e8;color:#12612b}.banner.fail{background:#fde8e8;color:#9b1c1c}
.fault{background:#fff3cd;color:#7a5300;padding:.5em 1em;border-radius:6px}
table{border-collapse:collapse;width:100%;margin:.4em 0;font-size:13px}
th,td{border:1px solid #dde3ea;padding:4px 8px;text-align:left;vertical-align:top}
th{background:#f3f6f9}td.num{text-align:right;font-variant-numeric:tabular-nums}
.v{font-weight:700;border-radius:4px;padding:1px 6px}.v.pass{background:#e3f6e8;color:#12612b}
.v.fail{background:#fde8e8;color:#9b1c1c}.v.warn{background:#fff3cd;color:#7a5300}.v.skip{background:#eef;color:#446}
.mono{font-family:ui-monospace,Menlo,Consolas,monospace;font-size:12px;word-break:break-all}
.cards{display:flex;gap:1em;flex-wrap:wrap}.card{border:1px solid #dde3ea;border-radius:6px;padding:.5em 1em;min-width:9em}
.card b{display:block;font-size:1.5em}svg{background:#fbfcfd;border:1px solid #dde3ea;border-radius:6px}
.legend span{display:inline-block;margin-right:1.2em}.legend i{display:inline-block;width:10px;height:10px;border-radius:50%;margin-right:4px}
";

/// Colour of a request's dot in the latency chart.
fn dot_color(kind: Kind, status: Option<u16>, leaked: bool) -> &'static str {
    if leaked {
        "#d62728"
    } else if kind.over_length() && status.is_some_and(|s| (200..300).contains(&s)) {
        "#ff7f0e"
    } else if status.is_some_and(|s| (200..300).contains(&s)) {
        "#2b7bb9"
    } else {
        "#999999"
    }
}

/// Latency of every request against its id (request order), on a square-root scale so
/// both fast rejections and long prefills stay readable.
fn latency_chart(r: &Report) -> String {
    let (w, h, left, bottom, top, right) = (1000.0, 300.0, 60.0, 40.0, 15.0, 15.0);
    let max_ms = r
        .requests
        .iter()
        .map(|q| q.total_ms)
        .fold(1.0_f64, f64::max);
    let n = r.requests.iter().map(|q| q.id).max().unwrap_or(1).max(1) as f64;
    let x = |id: f64| left + (w - left - right) * (id / n);
    let y = |ms: f64| top + (h - top - bottom) * (1.0 - (ms / max_ms).sqrt());
    let mut s = String::new();
    let _ = write!(
        s,
        r#"<svg id="latency-chart" role="img" aria-label="latency of every request" width="{w}" height="{h}" viewBox="0 0 {w} {h}" xmlns="http://www.w3.org/2000/svg">"#
    );
    for frac in [0.0, 0.1, 0.25, 0.5, 1.0] {
        let ms = max_ms * frac;
        let yy = y(ms);
        let _ = write!(
            s,
            r##"<line x1="{left}" x2="{}" y1="{yy:.1}" y2="{yy:.1}" stroke="#e3e8ee"/><text x="{}" y="{:.1}" font-size="11" text-anchor="end" fill="#556">{}</text>"##,
            w - right,
            left - 6.0,
            yy + 4.0,
            if ms >= 1000.0 {
                format!("{:.1} s", ms / 1000.0)
            } else {
                format!("{ms:.0} ms")
            }
        );
    }
    let _ = write!(
        s,
        r##"<line x1="{left}" x2="{left}" y1="{top}" y2="{}" stroke="#889"/><line x1="{left}" x2="{}" y1="{}" y2="{}" stroke="#889"/><text x="{}" y="{}" font-size="12" text-anchor="middle" fill="#334">request (in order sent)</text>"##,
        h - bottom,
        w - right,
        h - bottom,
        h - bottom,
        (w + left) / 2.0,
        h - 8.0
    );
    let leaked: std::collections::HashSet<usize> = r.leaks.iter().map(|l| l.found_in).collect();
    for q in &r.requests {
        let _ = write!(
            s,
            r#"<circle cx="{:.1}" cy="{:.1}" r="4" fill="{}" fill-opacity="0.85"><title>#{} {} {}: {} in {:.0} ms</title></circle>"#,
            x(q.id as f64),
            y(q.total_ms),
            dot_color(q.kind, q.status, leaked.contains(&q.id)),
            q.id,
            esc(&q.tenant),
            q.kind.label(),
            q.status
                .map_or("no answer".to_owned(), |s| format!("HTTP {s}")),
            q.total_ms
        );
    }
    s.push_str("</svg>");
    s.push_str(r##"<div class="legend"><span><i style="background:#2b7bb9"></i>2xx</span><span><i style="background:#999999"></i>refused / error</span><span><i style="background:#ff7f0e"></i>2xx for an over-length prompt</span><span><i style="background:#d62728"></i>received another request's canary</span></div>"##);
    s
}

/// Bars of the side channel's four time-to-first-token medians.
fn side_channel_chart(r: &Report) -> String {
    let Some(sc) = &r.side_channel else {
        return String::new();
    };
    if sc.trials.is_empty() {
        return String::new();
    }
    let med = |f: &dyn Fn(&crate::report::SideChannelTrial) -> f64| {
        let mut v: Vec<f64> = sc.trials.iter().map(f).collect();
        v.sort_by(f64::total_cmp);
        v[v.len() / 2]
    };
    let bars = [
        ("A, cold", med(&|t| t.a_cold_ms)),
        ("A, again", med(&|t| t.a_repeat_ms)),
        ("B, A's prefix", med(&|t| t.b_same_prefix_ms)),
        ("B, fresh prefix", med(&|t| t.b_fresh_ms)),
    ];
    let max = bars.iter().map(|b| b.1).fold(1.0_f64, f64::max);
    let mut s = String::from(
        r#"<svg id="side-channel-chart" role="img" aria-label="time to first token" width="620" height="170" viewBox="0 0 620 170" xmlns="http://www.w3.org/2000/svg">"#,
    );
    for (i, (label, ms)) in bars.iter().enumerate() {
        let yy = 15.0 + i as f64 * 38.0;
        let len = 380.0 * ms / max;
        let _ = write!(
            s,
            r##"<text x="130" y="{:.0}" font-size="12" text-anchor="end" fill="#334">{label}</text><rect x="140" y="{yy:.0}" width="{len:.1}" height="24" fill="{}"/><text x="{:.1}" y="{:.0}" font-size="12" fill="#334">{ms:.0} ms</text>"##,
            yy + 16.0,
            if i == 2 { "#9467bd" } else { "#2b7bb9" },
            146.0 + len,
            yy + 16.0
        );
    }
    s.push_str("</svg>");
    s
}

pub fn render(r: &Report) -> String {
    let mut h = String::new();
    let _ = write!(
        h,
        "<!DOCTYPE html><html lang=\"en\"><head><meta charset=\"utf-8\"><title>kvwarden audit: {}</title><style>{CSS}</style></head><body>",
        esc(&r.endpoint)
    );
    let _ = write!(
        h,
        "<h1>kvwarden audit</h1><div class=\"meta\">endpoint <span class=\"mono\" id=\"endpoint\">{}</span> · model <b id=\"model\">{}</b> · context <b id=\"max-context\">{}</b> tokens ({}) · {} tenants ({}) · seed {} · {:.1} s</div>",
        esc(&r.endpoint),
        esc(&r.model),
        r.max_context,
        esc(&r.context_source),
        r.tenants.len(),
        if r.real_tenants { "one per API key" } else { "synthetic identities" },
        r.seed,
        r.duration_s
    );
    if r.health.get("fault_injection").and_then(|v| v.as_bool()) == Some(true) {
        let _ = write!(
            h,
            "<p class=\"fault\" id=\"fault-injection\">The server reports a fault-injection build: <span class=\"mono\">{}</span></p>",
            esc(&r.health.to_string())
        );
    }
    let _ = write!(
        h,
        "<div class=\"banner {}\" id=\"verdict\">{}</div>",
        if r.passed { "pass" } else { "fail" },
        if r.passed {
            "PASS: no check failed"
        } else {
            "FAIL: see the findings below"
        }
    );
    let _ = write!(
        h,
        "<div class=\"cards\"><div class=\"card\">requests<b id=\"requests-count\">{}</b></div><div class=\"card\">leaks<b id=\"leaks-count\">{}</b></div><div class=\"card\">failures<b id=\"failures-count\">{}</b></div><div class=\"card\">warnings<b id=\"warnings-count\">{}</b></div></div>",
        r.requests.len(),
        r.leaks.len(),
        r.failures(),
        r.findings.len() - r.failures()
    );

    h.push_str("<h2>Checks</h2><table id=\"checks\"><tr><th>check</th><th>result</th><th>details</th></tr>");
    for c in &r.checks {
        let _ = write!(
            h,
            "<tr><td>{}</td><td><span class=\"v {}\">{}</span></td><td>{}</td></tr>",
            c.title,
            verdict_class(c.verdict),
            c.verdict.label(),
            esc(&c.summary)
        );
    }
    h.push_str("</table>");

    if !r.leaks.is_empty() {
        h.push_str("<h2>Leaks</h2><table id=\"leaks\"><tr><th>received by</th><th>canary of</th><th>canary</th><th>where</th><th>bytes</th></tr>");
        for l in &r.leaks {
            let _ = write!(
                h,
                "<tr><td>#{} ({}), HTTP {}</td><td>#{} ({}){}</td><td class=\"mono\">{}</td><td>{}</td><td class=\"mono\">{}</td></tr>",
                l.found_in,
                esc(&l.found_tenant),
                l.status.map_or("-".to_owned(), |s| s.to_string()),
                l.canary_of,
                esc(&l.canary_tenant),
                if l.cross_tenant { ", another tenant" } else { "" },
                esc(&l.canary),
                l.location,
                esc(&l.excerpt)
            );
        }
        h.push_str("</table>");
    }

    if !r.findings.is_empty() {
        h.push_str("<h2>Findings</h2><table id=\"findings\"><tr><th>severity</th><th>check</th><th>request</th><th>finding</th></tr>");
        for f in &r.findings {
            let (cls, label) = match f.severity {
                Severity::Failure => ("fail", "FAIL"),
                Severity::Warning => ("warn", "WARN"),
            };
            let _ = write!(
                h,
                "<tr><td><span class=\"v {cls}\">{label}</span></td><td>{}</td><td>{}</td><td>{}</td></tr>",
                f.check.title(),
                f.request.map_or(String::new(), |q| format!("#{q}")),
                esc(&f.message)
            );
        }
        h.push_str("</table>");
    }

    if !r.capacity.is_empty() {
        h.push_str("<h2>Capacity honesty</h2><table id=\"capacity\"><tr><th>case</th><th>request</th><th>prompt tokens</th><th>max_tokens</th><th>expected</th><th>status</th><th>result</th><th>detail</th></tr>");
        for (i, c) in r.capacity.iter().enumerate() {
            let _ = write!(
                h,
                "<tr><td>{}</td><td>#{}</td><td class=\"num\">{}</td><td class=\"num\">{}</td><td>{}</td><td class=\"num\" id=\"capacity-status-{i}\">{}</td><td><span class=\"v {}\">{}</span></td><td>{}</td></tr>",
                esc(&c.case),
                c.request,
                c.prompt_tokens,
                c.max_tokens,
                c.expected,
                c.status.map_or("-".to_owned(), |s| s.to_string()),
                verdict_class(c.verdict),
                c.verdict.label(),
                esc(&c.detail)
            );
        }
        h.push_str("</table>");
    }

    let d = &r.differential;
    let _ = write!(
        h,
        "<h2>Differential content</h2><p>Greedy answers identical alone and batched: <b id=\"differential-identical\">{}</b> of <b id=\"differential-compared\">{}</b>{}.</p>",
        d.identical,
        d.compared,
        if d.batch_invariance_claimed { " (the server claims batch invariance: any difference fails)" } else { " (reported as a rate)" }
    );

    if let Some(sc) = &r.side_channel {
        let _ = write!(
            h,
            "<h2>Prefix-cache side channel</h2><p>Tenant A = {}, tenant B = {} ({}). Time to first token of a long prefix: A cold, A again, B on A's prefix, B on a fresh prefix of the same length.</p>",
            esc(&sc.tenants.0),
            esc(&sc.tenants.1),
            if sc.real_tenants { "distinct API keys" } else { "synthetic identities" }
        );
        h.push_str(&side_channel_chart(r));
        h.push_str("<table id=\"side-channel\"><tr><th>prefix tokens</th><th>A cold (ms)</th><th>A again (ms)</th><th>B, A's prefix (ms)</th><th>B, fresh (ms)</th><th>cached tokens A again / B A's prefix / B fresh</th></tr>");
        let opt = |v: Option<u64>| v.map_or("-".to_owned(), |v| v.to_string());
        for t in &sc.trials {
            let _ = write!(
                h,
                "<tr><td class=\"num\">{}</td><td class=\"num\">{:.0}</td><td class=\"num\">{:.0}</td><td class=\"num\">{:.0}</td><td class=\"num\">{:.0}</td><td>{} / {} / {}</td></tr>",
                t.prefix_tokens,
                t.a_cold_ms,
                t.a_repeat_ms,
                t.b_same_prefix_ms,
                t.b_fresh_ms,
                opt(t.a_repeat_cached),
                opt(t.b_same_prefix_cached),
                opt(t.b_fresh_cached)
            );
        }
        h.push_str("</table>");
    }

    h.push_str("<h2>Latency of every request</h2>");
    h.push_str(&latency_chart(r));

    h.push_str("<h2>Requests</h2><table id=\"requests\"><tr><th>#</th><th>tenant</th><th>kind</th><th>api</th><th>prompt</th><th>status</th><th>finish</th><th>tokens out</th><th>TTFT (ms)</th><th>total (ms)</th><th>bytes</th><th>error</th></tr>");
    for q in &r.requests {
        let _ = write!(
            h,
            "<tr><td class=\"num\">{}</td><td>{}</td><td>{}{}</td><td>{}{}</td><td>{}</td><td class=\"num\">{}</td><td>{}</td><td class=\"num\">{}</td><td class=\"num\">{}</td><td class=\"num\">{:.0}</td><td class=\"num\">{}</td><td class=\"mono\">{}</td></tr>",
            q.id,
            esc(&q.tenant),
            q.kind.label(),
            q.replay_of.map_or(String::new(), |o| format!(" of #{o}")),
            match q.api {
                oai_client::Api::Chat => "chat",
                oai_client::Api::Completions => "completions",
            },
            if q.stream { ", stream" } else { "" },
            esc(&q.prompt),
            q.status.map_or("-".to_owned(), |s| s.to_string()),
            esc(q.finish_reason.as_deref().unwrap_or("")),
            q.usage.and_then(|u| u.completion_tokens).map_or("-".to_owned(), |n| n.to_string()),
            q.ttft_ms.map_or("-".to_owned(), |t| format!("{t:.0}")),
            q.total_ms,
            q.bytes,
            esc(q.error.as_deref().unwrap_or(""))
        );
    }
    h.push_str("</table><p class=\"meta\">Generated by <code>kvwarden audit</code>. This page is self-contained: no scripts, no network requests.</p></body></html>\n");
    h
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn escaping_closes_every_door() {
        assert_eq!(
            esc("<a href=\"x\">'&'</a>"),
            "&lt;a href=&quot;x&quot;&gt;&#39;&amp;&#39;&lt;/a&gt;"
        );
    }
}
