//! `cargo xtask demo --affinity`: Envoy with the filter, from `envoy/envoy.yaml`, in front
//! of 7 simple instances; sends requests of both APIs that share a few long
//! prefixes and prints which instance served each, so prefix affinity is
//! visible at a glance. Everything is torn down at the end.

use std::collections::{BTreeMap, BTreeSet};
use std::time::Duration;

use anyhow::{bail, Context as _};
use prefix_router_tools::envoy::Envoy;
use prefix_router_tools::upstream::UpstreamFleet;

use crate::prereqs;
use crate::run::build_wasm;

const INSTANCES: usize = 7;
const REQUESTS_PER_PREFIX: usize = 4;
const KEY_HEADER: &str = "x-prefix-route-key";

/// A shared prefix: a long system prompt / document several requests start with.
struct SharedPrefix {
    name: &'static str,
    text: String,
}

pub fn run() -> anyhow::Result<()> {
    let found = prereqs::ensure_all()?;
    let built = build_wasm()?;
    // PREFIX_ROUTER_WASM runs the demo with another build of the filter.
    let wasm = match std::env::var_os("PREFIX_ROUTER_WASM").filter(|p| !p.is_empty()) {
        Some(path) => std::path::PathBuf::from(path),
        None => built,
    };

    let fleet = UpstreamFleet::start(INSTANCES)?;
    let envoy = Envoy::builder()
        .envoy_binary(&found.envoy)
        .wasm(&wasm)
        .upstreams(fleet.addrs())
        .start()?;
    println!(
        "Envoy {} with the filter ({}), {INSTANCES} instances on {}",
        envoy.listener_addr(),
        wasm.display(),
        fleet
            .addrs()
            .iter()
            .map(|a| a.port().to_string())
            .collect::<Vec<_>>()
            .join(", ")
    );

    let prefixes = shared_prefixes();
    let mut rows = Vec::new();
    for prefix in &prefixes {
        for api in ["invoke", "chat"] {
            for n in 1..=REQUESTS_PER_PREFIX {
                let question = format!("Question {n}: what does section {} say?", n * 7);
                let (path, body) = match api {
                    "invoke" => ("/invocations", invoke_body(&prefix.text, &question)),
                    _ => ("/v1/chat/completions", chat_body(&prefix.text, &question)),
                };
                let request_id = format!("{}-{api}-{n}", prefix.name);
                let served_by = send(&envoy.base_url(), path, &request_id, &body)
                    .with_context(|| format!("request {request_id}"))?;
                let key = fleet
                    .records_with_header("x-demo-request", &request_id)
                    .first()
                    .and_then(|r| r.header(KEY_HEADER).map(str::to_string))
                    .unwrap_or_else(|| "(none)".to_string());
                rows.push(Row {
                    prefix: prefix.name,
                    api,
                    request: n,
                    served_by,
                    key,
                });
            }
        }
    }
    print_table(&rows);
    print_summary(&rows, &fleet);
    Ok(())
}

struct Row {
    prefix: &'static str,
    api: &'static str,
    request: usize,
    served_by: String,
    key: String,
}

fn shared_prefixes() -> Vec<SharedPrefix> {
    let topics = [
        (
            "contract",
            "This services agreement between the parties sets out",
        ),
        (
            "manual",
            "The operator's manual for the hydraulic press explains",
        ),
        (
            "codebase",
            "The repository contains a Rust workspace whose modules",
        ),
    ];
    topics
        .iter()
        .map(|(name, opening)| {
            let mut text = String::new();
            let mut clause = 1;
            // Longer than the filter's default prefix_length (4096), as real shared prompts are.
            while text.len() < 6000 {
                text.push_str(&format!(
                    "{opening} clause {clause}, which applies to every {name} reader. "
                ));
                clause += 1;
            }
            SharedPrefix { name, text }
        })
        .collect()
}

fn invoke_body(document: &str, question: &str) -> String {
    let inputs = format!("{document}\n\n{question}");
    format!(
        "{{\"inputs\":{},\"parameters\":{{\"max_new_tokens\":64}}}}",
        json_string(&inputs)
    )
}

fn chat_body(document: &str, question: &str) -> String {
    format!(
        "{{\"model\":\"demo-model\",\"messages\":[{{\"role\":\"system\",\"content\":{}}},{{\"role\":\"user\",\"content\":{}}}]}}",
        json_string(document),
        json_string(question)
    )
}

fn json_string(text: &str) -> String {
    let mut out = String::with_capacity(text.len() + 2);
    out.push('"');
    for c in text.chars() {
        match c {
            '"' => out.push_str("\\\""),
            '\\' => out.push_str("\\\\"),
            '\n' => out.push_str("\\n"),
            c if (c as u32) < 0x20 => out.push_str(&format!("\\u{:04x}", c as u32)),
            c => out.push(c),
        }
    }
    out.push('"');
    out
}

fn send(base_url: &str, path: &str, request_id: &str, body: &str) -> anyhow::Result<String> {
    let response = ureq::post(&format!("{base_url}{path}"))
        .timeout(Duration::from_secs(10))
        .set("content-type", "application/json")
        .set("x-demo-request", request_id)
        .send_string(body);
    let response = match response {
        Ok(response) => response,
        Err(ureq::Error::Status(code, response)) => {
            bail!(
                "HTTP {code}: {}",
                response.into_string().unwrap_or_default()
            )
        }
        Err(error) => bail!("{error}"),
    };
    Ok(response
        .header("x-served-by")
        .unwrap_or("(no x-served-by)")
        .to_string())
}

fn print_table(rows: &[Row]) {
    println!();
    println!(
        "| {:<9} | {:<6} | {:>7} | {:<11} | {:<18} |",
        "prefix", "api", "request", "served by", KEY_HEADER
    );
    println!(
        "|{:-<11}|{:-<8}|{:->9}|{:-<13}|{:-<20}|",
        "", "", "", "", ""
    );
    for row in rows {
        println!(
            "| {:<9} | {:<6} | {:>7} | {:<11} | {:<18} |",
            row.prefix, row.api, row.request, row.served_by, row.key
        );
    }
}

fn print_summary(rows: &[Row], fleet: &UpstreamFleet) {
    let mut by_group: BTreeMap<(&str, &str), BTreeSet<&str>> = BTreeMap::new();
    for row in rows {
        by_group
            .entry((row.prefix, row.api))
            .or_default()
            .insert(&row.served_by);
    }
    println!();
    for ((prefix, api), instances) in &by_group {
        let verdict = if instances.len() == 1 {
            "one instance: its KV cache stays warm"
        } else {
            "spread over several instances"
        };
        let list: Vec<&str> = instances.iter().copied().collect();
        println!("{prefix:<9} {api:<6} -> {} ({verdict})", list.join(", "));
    }
    println!();
    println!("requests per instance:");
    for (name, count) in fleet.counts() {
        println!("  {name:<11} {count}");
    }
}
